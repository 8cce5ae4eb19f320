"""The benchmark's chart: bench_io.py's table as an SVG bar chart, in plain Python (no plotting
library).

    python bench/chart.py RESULT OUT.svg [--title TEXT]

RESULT is what ``bench/bench_io.py`` wrote: its ``--json`` record, or its printed report (a
``.txt`` in bench/results/, the table parsed back). ``make bench`` writes
``bench/out/bench_io.svg`` from the run it makes (``bench_io.py --svg``). One panel per operation
(durable save, cold load), one bar per row: the median GB/s, a whisker from the lowest to the
highest run; gds_persist rows orange, the drive's own limit grey, the others blue.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from html import escape
from typing import Any

OPS = (("save", "save (durable: fsync included)"), ("load", "load (cold: page cache dropped)"))
COLOURS = {"gds": "#d9730d", "drive": "#9a9a9a", "other": "#3b75af"}


@dataclass(frozen=True)
class Bar:
    op: str  # "save" or "load"
    label: str
    median: float  # GB/s
    low: float
    high: float
    kind: str  # "gds", "drive" or "other"


def _kind(label: str, key: str = "") -> str:
    if label.startswith("drive limit"):
        return "drive"
    return "gds" if key.startswith("gds-") or "gds_persist" in label.lower() or \
        "GdsPersist" in label else "other"


def bars_from_record(record: dict[str, Any]) -> list[Bar]:
    """The bars of a bench_io.py record (its ``rows``; rows without a median are left out)."""
    out = []
    for r in record["rows"]:
        g = r["gbps"]
        if g["median"] is None:
            continue
        label = ("drive limit: " + r["tool"].split(" (")[0]) if r["drive"] else r["label"]
        out.append(Bar(r["op"], label, g["median"], g["min"], g["max"],
                       "drive" if r["drive"] else _kind(label, r["key"])))
    return out


_ROW = re.compile(r"^(save|load)  (.{30})\s+([\d.]+)\s+([\d.]+)-([\d.]+)\s")


def bars_from_report(text: str) -> list[Bar]:
    """The bars of bench_io.py's printed table (the first table in ``text``: a ``make bench``
    log holds bench_restore.py's output after it)."""
    out: list[Bar] = []
    for line in text.splitlines():
        m = _ROW.match(line)
        if m is None:
            if out and not line.strip():
                break  # the end of the table
            continue
        op, label, median, low, high = m.groups()
        label = label.strip()
        out.append(Bar(op, label, float(median), float(low), float(high), _kind(label)))
    if not out:
        raise ValueError("no bench_io.py table rows found (lines like 'save  gds_persist auto "
                         "  0.68  0.60-0.77 ...'): give bench_io.py's report or its --json")
    return out


def svg(bars: list[Bar], title: str, subtitle: str = "") -> str:
    """The chart as an SVG document."""
    if not bars:
        raise ValueError("nothing to draw: no rows with a measured median")
    label_w, plot_w, row_h, gap = 230, 300, 20, 40
    panel_w = label_w + plot_w + 60
    top = 58 if subtitle else 40
    groups = [(op, name, [b for b in bars if b.op == op]) for op, name in OPS]
    groups = [g for g in groups if g[2]]
    rows = max(len(g[2]) for g in groups)
    height = top + 24 + rows * row_h + 40
    width = panel_w * len(groups) + gap
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(title)}</text>']
    if subtitle:
        parts.append(f'<text x="10" y="42" fill="#444">{escape(subtitle)}</text>')
    for i, (_, name, group) in enumerate(groups):
        x0 = 10 + i * (panel_w + gap // 2)
        scale = plot_w / max(b.high for b in group)
        parts.append(f'<text x="{x0}" y="{top + 12}" font-weight="bold">{escape(name)}</text>')
        for j, b in enumerate(group):
            y = top + 24 + j * row_h
            x = x0 + label_w
            parts.append(f'<text x="{x - 6}" y="{y + 13}" text-anchor="end">'
                         f'{escape(b.label)}</text>')
            parts.append(f'<rect x="{x}" y="{y + 3}" width="{b.median * scale:.1f}" '
                         f'height="{row_h - 6}" fill="{COLOURS[b.kind]}"/>')
            lo, hi, mid = x + b.low * scale, x + b.high * scale, y + row_h / 2
            parts.append(f'<path d="M{lo:.1f} {mid:.1f}H{hi:.1f}M{lo:.1f} {mid - 4:.1f}'
                         f'V{mid + 4:.1f}M{hi:.1f} {mid - 4:.1f}V{mid + 4:.1f}" '
                         'stroke="black" fill="none"/>')
            parts.append(f'<text x="{hi + 5:.1f}" y="{y + 13}">{b.median:.2f}</text>')
        axis_y = top + 24 + len(group) * row_h + 4
        parts.append(f'<text x="{x0 + label_w}" y="{axis_y + 14}" fill="#444">GB/s (median; '
                     'whisker: lowest to highest run)</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def title_of(record: dict[str, Any]) -> str:
    m, size = record["machine"], record["state"]["payload_bytes"]
    size_text = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    return (f"{size_text} state dict, "
            f"{m['filesystem']['fstype']} on {m['block_device'].get('name', '?')}, "
            f"{record['config']['runs']} runs")


def write_svg(record: dict[str, Any], path: str, subtitle: str = "") -> str:
    """bench_io.py's ``--svg``: the chart of ``record`` at ``path``; returns what it did."""
    with open(path, "w") as f:
        f.write(svg(bars_from_record(record), title_of(record), subtitle))
    return f"SVG chart written to {path}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="chart.py", description=__doc__.split("\n\n")[0])
    p.add_argument("result", help="bench_io.py's --json record or its printed report (.txt)")
    p.add_argument("out", help="the SVG to write")
    p.add_argument("--title", default=None, help="the chart's title (default: from the record; "
                   "required for a .txt report)")
    p.add_argument("--subtitle", default="", help="a second line, e.g. the machine and date")
    args = p.parse_args(argv)
    with open(args.result) as f:
        text = f.read()
    if args.result.endswith(".json"):
        record = json.loads(text)
        bars, title = bars_from_record(record), args.title or title_of(record)
    else:
        if args.title is None:
            p.error("give --title for a .txt report (it is read back from the table only)")
        bars, title = bars_from_report(text), args.title
    with open(args.out, "w") as f:
        f.write(svg(bars, title, args.subtitle))
    print(f"SVG chart of {len(bars)} rows written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
