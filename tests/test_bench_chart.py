"""The benchmark's chart (bench/chart.py): a valid SVG from a tiny record and from a recorded
report, and the README's chart is the one its recorded report draws."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from bench import chart

REPO = Path(__file__).resolve().parent.parent
SVG = "{http://www.w3.org/2000/svg}"
RECORDED = REPO / "bench/results/2026-12-04-cpu-make-bench-disk-86e93cd.txt"


def _row(op: str, key: str, label: str, gbps: tuple[float, float, float],
         drive: bool = False) -> dict[str, object]:
    low, median, high = gbps
    return {"op": op, "key": key, "label": label, "drive": drive, "tool": "fio io_uring (x)",
            "gbps": {"median": median, "min": low, "max": high}}


def test_a_tiny_record_gives_a_valid_svg_with_one_bar_per_row(tmp_path: Path) -> None:
    record = {"rows": [_row("save", "drive", "", (1.0, 2.0, 3.0), drive=True),
                       _row("save", "gds-auto", "gds_persist auto", (1.5, 1.8, 2.0)),
                       _row("save", "torch", "torch.save & co <x>", (0.5, 0.6, 0.7)),
                       _row("load", "torch", "torch.load", (0.9, 1.0, 1.1)),
                       _row("load", "dcp", "DCP", (None, None, None))],  # type: ignore[arg-type]
              "state": {"payload_bytes": 2**20}, "config": {"runs": 2},
              "machine": {"filesystem": {"fstype": "ext4"}, "block_device": {"name": "vda"}}}
    out = tmp_path / "c.svg"
    assert chart.write_svg(record, str(out), "a subtitle") == f"SVG chart written to {out}"
    root = ET.parse(out).getroot()  # well-formed XML, labels escaped
    assert root.tag == f"{SVG}svg"
    bars = [r for r in root.iter(f"{SVG}rect") if r.get("fill") != "white"]
    assert [b.get("fill") for b in bars] == [chart.COLOURS[k]
                                             for k in ("drive", "gds", "other", "other")]
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "torch.save & co <x>" in texts and "drive limit: fio io_uring" in texts
    assert "1.0 MiB state dict, ext4 on vda, 2 runs" in texts and "a subtitle" in texts
    widths = [float(b.get("width", 0)) for b in bars]
    assert widths[0] / widths[1] == pytest.approx(2.0 / 1.8, rel=1e-2)  # one scale per panel


def test_a_report_without_a_table_is_refused() -> None:
    with pytest.raises(ValueError, match="no bench_io.py table rows found"):
        chart.bars_from_report("elapsed 3.0s\n")


def test_the_readme_chart_is_drawn_from_its_recorded_report(tmp_path: Path) -> None:
    bars = chart.bars_from_report(RECORDED.read_text())
    assert len(bars) == 20  # bench_io's table only, not bench_restore's lines after it
    auto = next(b for b in bars if b.op == "save" and b.label == "gds_persist auto")
    assert (auto.median, auto.low, auto.high, auto.kind) == (3.15, 3.01, 3.28, "gds")
    out = tmp_path / "c.svg"
    committed = RECORDED.with_suffix(".svg")
    root = ET.parse(committed).getroot()
    title, subtitle = [t.text or "" for t in root.iter(f"{SVG}text")][:2]
    assert chart.main([str(RECORDED), str(out), "--title", title, "--subtitle", subtitle]) == 0
    assert out.read_text() == committed.read_text(), "redraw it with bench/chart.py"
    assert committed.name in (REPO / "README.md").read_text()
