"""Quantities on the command line and in reports: durations and byte sizes."""

from __future__ import annotations

import math
import re

_DURATIONS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_SIZES = {"": 1.0, "b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "pb": 1e15,
          "kib": 2.0**10, "mib": 2.0**20, "gib": 2.0**30, "tib": 2.0**40, "pib": 2.0**50}


def parse_quantity(text: str | float, units: dict[str, float], what: str, examples: str,
                   fold_case: bool = False) -> float:
    """A finite, non-negative number with an optional unit from ``units`` (name -> factor)."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
        unit = None if m is None else m.group(2).lower() if fold_case else m.group(2)
        if m is None or unit not in units:
            raise ValueError(f"bad {what} {text!r}: use {examples}")
        value = float(m.group(1)) * units[unit]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"bad {what} {text!r}: must be finite and >= 0")
    return value


def parse_duration(text: str | float) -> float:
    """Seconds from ``90``, ``90s``, ``2.5m``, ``24h``, ``7d``."""
    return parse_quantity(text, _DURATIONS, "duration",
                          "a number of seconds or e.g. 90s, 5m, 24h, 7d")


def parse_size(text: str | float) -> float:
    """Bytes from ``182e9``, ``182GB``, ``3.84 TB``, ``1.5TiB`` (kB-PB decimal, KiB-PiB binary)."""
    return parse_quantity(text, _SIZES, "size",
                          "a number of bytes or e.g. 182GB, 3.84TB, 1.5TiB", fold_case=True)


def format_bytes(n: float) -> str:
    """Decimal units, as drives are rated."""
    for unit, size in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def format_duration(s: float) -> str:
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if s >= size:
            return f"{s / size:.3g} {unit} ({s:.0f} s)"
    return f"{s:.3g} s"
