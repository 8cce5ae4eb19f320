"""Progress reporting: a callback protocol for the Python API and a terminal bar for the CLI.

Every long operation (``save``, ``load``, ``verify``, ``export_checkpoint``,
``import_checkpoint``, the DCP writer/reader) accepts ``progress=``, a callable::

    def progress(done_bytes: int, total_bytes: int) -> None: ...

It is called from the thread doing the I/O (possibly an I/O pool thread, never two at once)
after each block, with ``done_bytes`` non-decreasing and never above ``total_bytes``; the last
call of a successful operation has ``done_bytes == total_bytes``. Keep it cheap: it runs on the
I/O path. An exception raised by the callback aborts the operation (like any other error).

The CLI uses :class:`ProgressBar`, shown only when stderr is a terminal
(:func:`cli_progress` returns ``None`` otherwise, so pipes and CI logs stay clean).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

ProgressCallback = Callable[[int, int], None]


class ByteCounter:
    """Turns per-block byte counts (``add(n)``, from any thread) into ``progress(done, total)``
    calls that respect the protocol above."""

    def __init__(self, callback: ProgressCallback | None, total: int):
        self.callback = callback
        self.total = max(0, int(total))
        self.done = 0
        self._lock = threading.Lock()

    def add(self, nbytes: int) -> None:
        if self.callback is None:
            return
        with self._lock:
            self.done = min(self.total, self.done + int(nbytes))
            self.callback(self.done, self.total)

    def finish(self) -> None:
        """The operation succeeded: report ``total`` (once more if already there)."""
        if self.callback is None:
            return
        with self._lock:
            self.done = self.total
            self.callback(self.total, self.total)

    @property
    def hook(self) -> Callable[[int], None] | None:
        """What the core write/read loops take: ``None`` when nobody listens (zero cost)."""
        return self.add if self.callback is not None else None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


class ProgressBar:
    """A one-line bar with bytes, rate and ETA, redrawn at most every ``min_interval`` s.

    Usable directly as a progress callback; ``close()`` ends the line. ``stream`` defaults to
    stderr. Thread-safe.
    """

    def __init__(
        self, label: str, stream: TextIO | None = None, width: int = 24, min_interval: float = 0.1
    ):
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.min_interval = min_interval
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self._drawn = False
        self._lock = threading.Lock()
        self._last = (0, 0)
        self._shown = (-1, -1)

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            self._last = (done, total)
            now = time.perf_counter()
            if (done, total) == self._shown or (
                done < total and now - self._last_draw < self.min_interval
            ):
                return
            self._last_draw = now
            self._draw(done, total, now)

    def _draw(self, done: int, total: int, now: float) -> None:
        elapsed = max(now - self._t0, 1e-9)
        rate = done / elapsed
        frac = done / total if total else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        eta = (total - done) / rate if rate > 0 and done < total else 0.0
        line = (
            f"\r{self.label} [{bar}] {frac * 100:5.1f}% {human_bytes(done)}/"
            f"{human_bytes(total)} {rate / 1e9:.2f} GB/s ETA {eta:4.0f} s"
        )
        self.stream.write(line)
        self.stream.flush()
        self._drawn = True
        self._shown = (done, total)

    def close(self) -> None:
        with self._lock:
            if self._drawn:
                if self._shown != self._last:
                    self._draw(*self._last, time.perf_counter())
                self.stream.write("\n")
                self.stream.flush()
                self._drawn = False

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cli_progress(label: str, stream: TextIO | None = None) -> ProgressBar | None:
    """A :class:`ProgressBar` when ``stream`` (default stderr) is a terminal, else ``None``."""
    stream = stream if stream is not None else sys.stderr
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return ProgressBar(label, stream) if tty else None
