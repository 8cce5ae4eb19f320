"""Statistics, the printed header and table, the JSON record and the optional PNG chart."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

GB = 1e9


@dataclass
class Series:
    """The timed runs of one row (one method, one operation), in repetition order."""

    key: str
    label: str
    op: str  # "save" or "load"
    nbytes: int  # bytes the GB/s figure is computed from (the state dict's payload)
    seconds: list[float] = field(default_factory=list)
    tool: str = ""  # for the drive rows: what measured them
    drive: bool = False
    baseline: bool = False
    limit: bool = False  # the aligned-writer limit (bench/bench_limit.py): the "x limit" column

    @property
    def gbps(self) -> list[float]:
        return [self.nbytes / s / GB if s > 0 else float("inf") for s in self.seconds]


def summary(values: list[float]) -> dict[str, float | None]:
    """Median, min, max and quartiles (the quartiles equal the median for one value)."""
    if not values:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None}
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    else:
        q1 = q3 = values[0]
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "q1": q1, "q3": q3}


def paired_ratio(num: list[float], den: list[float]) -> float | None:
    """Median over repetitions of num[r] / den[r]: both measured side by side in repetition r."""
    ratios = [a / b for a, b in zip(num, den, strict=True) if b and a == a and b == b]
    return statistics.median(ratios) if ratios else None


def rows(series: list[Series]) -> list[dict[str, Any]]:
    """One dict per table row: statistics of GB/s and the paired ratios."""
    out = []
    for op in ("save", "load"):
        group = [s for s in series if s.op == op]
        drive = next((s for s in group if s.drive), None)
        base = next((s for s in group if s.baseline), None)
        limit = next((s for s in group if s.limit), None)
        for s in group:
            stats = summary(s.gbps)
            out.append({
                "op": op, "key": s.key, "label": s.label, "drive": s.drive, "tool": s.tool,
                "runs": len(s.seconds), "nbytes": s.nbytes,
                "gbps": stats, "seconds": summary(s.seconds),
                "x_drive": paired_ratio(s.gbps, drive.gbps) if drive else None,
                "x_baseline": paired_ratio(s.gbps, base.gbps) if base else None,
                "x_limit": paired_ratio(s.gbps, limit.gbps) if limit else None,
                "baseline": base.label if base else None,
            })
    return out


def _bytes(n: float | None) -> str:
    if n is None:
        return "?"
    if n == 0:
        return "0 B"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


RUNS_NOTE = ("interleaved (round-robin, order rotated every repetition); every save includes "
             "fsync")


def header_lines(record: dict[str, Any], title: str = "gds_persist I/O benchmark",
                 runs_note: str = RUNS_NOTE) -> list[str]:
    m = record["machine"]
    fs, bd, st = m["filesystem"], m["block_device"], record["state"]
    v = m["versions"]
    gpu = record["gpu_line"]
    blocks = (f"logical {bd.get('logical_block_size', '?')} B / physical "
              f"{bd.get('physical_block_size', '?')} B" if "logical_block_size" in bd
              else bd.get("note", "block size unknown"))
    cache = record["cache"]
    resident = cache.get("resident_before_load") or {}
    worst = max(resident.values(), default=None)
    cached = ("" if worst is None else
              f"; checkpoint bytes cached before a load: at most {_bytes(worst)}")
    lines = [
        title,
        f"  CPU        {m['cpu']}; {m['cores']['usable']} usable of {m['cores']['logical']} "
        f"logical cores; memory {_bytes(m['memory_bytes'])}",
        f"  directory  {m['directory']} on {fs['fstype']} ({fs['source']}, mounted at "
        f"{fs['mount_point']}); device {bd.get('name', bd['dev'])}: {blocks}; "
        f"O_DIRECT {'yes' if m['o_direct']['supported'] else 'no'}",
        f"  GPU        {gpu}",
        f"  versions   torch {v.get('torch')}, gds_persist {v.get('gds_persist')}"
        + (f" (git {v['gds_persist_git']})" if v.get("gds_persist_git") else "") + ", "
        f"safetensors {v.get('safetensors')}, python {v.get('python')}, "
        f"kernel {v.get('kernel')}, host CRC32C {v.get('host_crc32c')}",
        f"  state      {_bytes(st['payload_bytes'])} ({st['payload_bytes']} bytes) on "
        f"{record['config']['device']}: {st['description']}",
        f"  runs       {record['config']['runs']} per method, {runs_note}",
        f"  cold load  {cache['detail']}{cached}",
        f"  drive      {record['drive']['tool']}"
        + (f", {record['drive']['fio']}" if record["drive"]["tool"].startswith("fio") else "")
        + (f" ({'; '.join(record['drive']['notes'])})" if record["drive"]["notes"] else ""),
    ]
    if cache["how"] == "none" or (worst or 0) > 0.01 * record["state"]["payload_bytes"]:
        lines.append("  NOTE       the page cache could not be emptied before loads: cold-load "
                     "figures may be optimistic")
    if not record["drive"]["tool"].startswith("fio"):
        lines.append("  NOTE       drive limit from a plain Python stream, not fio "
                     "(install fio for the reference figure)")
    return lines


COLUMNS = (("op", 4, "<"), ("method", 30, "<"), ("GB/s", 7, ">"), ("min-max", 13, ">"),
           ("IQR", 13, ">"), ("x limit", 7, ">"), ("x drive", 7, ">"), ("x torch", 7, ">"),
           ("on disk", 10, ">"))


def fixed_width(values: tuple[str, ...], columns: tuple[tuple[str, int, str], ...]) -> str:
    """One table line: each value padded to its column's (name, width, alignment)."""
    cells = zip(values, columns, strict=True)
    return "  ".join(f"{v:{a}{w}}" for v, (_, w, a) in cells).rstrip()


def table_lines(table: list[dict[str, Any]], disk: dict[str, int]) -> list[str]:
    def fmt(values: tuple[str, ...]) -> str:
        return fixed_width(values, COLUMNS)

    lines = [fmt(tuple(c[0] for c in COLUMNS)), fmt(tuple("-" * c[1] for c in COLUMNS))]
    for r in table:
        g = r["gbps"]
        label = ("drive limit: " + r["tool"].split(" (")[0]) if r["drive"] else r["label"]
        lines.append(fmt((
            r["op"], label[:30], _num(g["median"]),
            f"{_num(g['min'])}-{_num(g['max'])}", f"{_num(g['q1'])}-{_num(g['q3'])}",
            _num(r.get("x_limit")), _num(r["x_drive"]), _num(r["x_baseline"]),
            _bytes(disk.get(r["key"])) if not r["drive"] else _bytes(r["nbytes"]),
        )))
    return lines


LEGEND = (
    "GB/s = state-dict payload bytes (distinct storages, 1 GB = 1e9 B) / seconds, median of "
    "the runs; min-max and IQR over the runs.",
    "x limit / x drive / x torch = median over repetitions of the ratio to the aligned-writer "
    "limit row / the drive-limit row / the torch.save (save) or torch.load (load) row measured "
    "in the same repetition.",
    "aligned-writer limit = the state's distinct bytes from page-aligned memory, O_DIRECT "
    "16 MiB requests, one file per I/O thread, fsynced, no checksum or copy: what a save can "
    "reach (bench/bench_limit.py); fio rewrites one cache-hot buffer (docs/BENCHMARK.md).",
)


def save_json(record: dict[str, Any], path: str | None) -> dict[str, Any]:
    """``--json PATH``: ``record`` written there if a path is given; returns ``record``."""
    if path:
        to_json(record, path)
    return record


def to_json(record: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=_default)
        f.write("\n")


def _default(o: Any) -> Any:
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return str(o)


def to_png(record: dict[str, Any], path: str) -> str:
    """Bar chart of median GB/s with min-max whiskers; returns what it did.

    matplotlib is optional (not a dependency): without it the chart is skipped with a message.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - matplotlib is optional
        return f"PNG skipped: matplotlib not importable ({type(e).__name__}); pip install it"
    table = record["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.5 * len(table) / 2 + 2), squeeze=False)
    for ax, op in zip(axes[0], ("save", "load"), strict=True):
        group = [r for r in table if r["op"] == op and r["gbps"]["median"] is not None]
        labels = [("drive limit" if r["drive"] else r["label"]) for r in group]
        med = [r["gbps"]["median"] for r in group]
        err = [[m - r["gbps"]["min"] for m, r in zip(med, group, strict=True)],
               [r["gbps"]["max"] - m for m, r in zip(med, group, strict=True)]]
        colors = ["0.6" if r["drive"] else ("tab:orange" if r["key"].startswith("gds-")
                                            else "tab:blue") for r in group]
        ax.barh(labels, med, xerr=err, color=colors, capsize=3)
        ax.invert_yaxis()
        ax.set_xlabel("GB/s (median, min-max)")
        ax.set_title(f"{op} ({'durable, fsync' if op == 'save' else 'cold'})")
    fig.suptitle(f"{_bytes(record['state']['payload_bytes'])} state dict, "
                 f"{record['machine']['filesystem']['fstype']} on "
                 f"{record['machine']['block_device'].get('name', '?')}, "
                 f"{record['config']['runs']} runs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"PNG written to {path}"
