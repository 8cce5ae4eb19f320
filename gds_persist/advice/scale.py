"""A scale model of checkpoint writing under data parallelism (``gds-persist plan``).

FastPersist's argument: with data parallelism at a fixed global batch, each iteration gets shorter
as GPUs are added, while a checkpoint written by one rank takes as long as ever, so checkpointing
grows to dominate; if every data-parallel rank writes 1/N of it to its node's drives, checkpoint
time shrinks with N as well. This module predicts both, using the real scheduler
(:func:`gds_persist.parallel.schedule.plan_save`) on the storage sizes of a GPT-like state
dict, so the predicted balance is the one a real save would get. Pure arithmetic: no I/O, no
processes.

Model (stated so it can be argued with): each drive writes at ``drive_gbps`` on its own; a node
writes at most ``node_gbps`` (unset: no cap); a node's ``j``-th writer writes to drive
``j % drives_per_node``; the single-writer baseline is one rank writing the whole checkpoint to
one drive. Checkpoint time = the slowest drive (or node) to finish its bytes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from ..parallel.schedule import RankInfo, plan_save

# (parameters, layers, hidden) of the GPT-3 family (Brown et al. 2020, table 2.1)
GPT_FAMILY = [(125e6, 12, 768), (350e6, 24, 1024), (760e6, 24, 1536), (1.3e9, 24, 2048),
              (2.7e9, 32, 2560), (6.7e9, 32, 4096), (13e9, 40, 5140), (30e9, 48, 7168),
              (70e9, 80, 8192), (175e9, 96, 12288)]


def gpt_shape(params: float, vocab: int = 50304, seq: int = 2048) -> tuple[int, int]:
    """``(layers, hidden)`` of a GPT with about ``params`` parameters: the GPT-3 family's depth
    for that size, and the width that makes the count match."""
    if params < 1e5:
        raise ValueError(f"params={params:g} is too small for a GPT-like model")
    layers = min(GPT_FAMILY, key=lambda c: abs(math.log(c[0] / params)))[1]
    a, b = 12 * layers, 13 * layers + vocab + seq  # params ~ 12 L h^2 + (13 L + V + S) h
    hidden = (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
    return layers, max(8, int(round(hidden / 8)) * 8)


def gpt_param_numels(layers: int, hidden: int, vocab: int = 50304,
                     seq: int = 2048) -> list[tuple[str, int]]:
    """``(name, numel)`` of every parameter tensor, in ``state_dict`` order."""
    h = hidden
    out = [("wte.weight", vocab * h), ("wpe.weight", seq * h)]
    for i in range(layers):
        p = f"h.{i}."
        out += [(p + "ln_1.weight", h), (p + "ln_1.bias", h),
                (p + "attn.c_attn.weight", 3 * h * h), (p + "attn.c_attn.bias", 3 * h),
                (p + "attn.c_proj.weight", h * h), (p + "attn.c_proj.bias", h),
                (p + "ln_2.weight", h), (p + "ln_2.bias", h),
                (p + "mlp.c_fc.weight", 4 * h * h), (p + "mlp.c_fc.bias", 4 * h),
                (p + "mlp.c_proj.weight", 4 * h * h), (p + "mlp.c_proj.bias", h)]
    return out + [("ln_f.weight", h), ("ln_f.bias", h)]


def bytes_split(bytes_per_param: int) -> tuple[int, list[int]]:
    """``(model weight bytes, [optimizer state bytes, ...])`` per parameter. 14 (the default) is
    mixed-precision Adam: a 2-byte weight, then fp32 master weight, exp_avg and exp_avg_sq."""
    if bytes_per_param < 1:
        raise ValueError(f"bytes_per_param={bytes_per_param} must be at least 1")
    weight = 2 if bytes_per_param % 4 == 2 else min(4, bytes_per_param)
    rest = bytes_per_param - weight
    return weight, [4] * (rest // 4) + ([rest % 4] if rest % 4 else [])


def gpt_storage_sizes(params: float, bytes_per_param: int = 14, vocab: int = 50304,
                      seq: int = 2048) -> list[int]:
    """Storage sizes of ``{"model": ..., "optimizer": ...}`` for a GPT-like model, as flatten
    orders them: every weight, then per parameter its optimizer states and a 4-byte ``step``
    (thousands of tiny tensors, as torch.optim.Adam keeps them)."""
    layers, hidden = gpt_shape(params, vocab, seq)
    numels = [n for _, n in gpt_param_numels(layers, hidden, vocab, seq)]
    weight, states = bytes_split(bytes_per_param)
    sizes = [n * weight for n in numels]
    for n in numels:
        if states:
            sizes += [n * s for s in states] + [4]
    return sizes


@dataclass(frozen=True)
class Scenario:
    params: float
    dp: int
    bytes_per_param: int = 14
    gpus_per_node: int = 8
    drives_per_node: int = 8
    drive_gbps: float = 3.0
    node_gbps: float | None = None
    writers_per_node: int | None = None
    iteration_s: float = 1.0


@dataclass(frozen=True)
class Prediction:
    scenario: Scenario
    nodes: int
    writers: int
    checkpoint_bytes: int
    writer_balance: float
    node_balance: float
    single_s: float
    partitioned_s: float

    @property
    def speedup(self) -> float:
        return self.single_s / self.partitioned_s if self.partitioned_s else float("inf")

    @property
    def single_fraction(self) -> float:
        return self.single_s / self.scenario.iteration_s

    @property
    def partitioned_fraction(self) -> float:
        return self.partitioned_s / self.scenario.iteration_s


def predict(s: Scenario, sizes: list[int] | None = None) -> Prediction:
    if s.dp < 1 or s.gpus_per_node < 1 or s.drives_per_node < 1 or s.drive_gbps <= 0:
        raise ValueError(f"dp, gpus_per_node, drives_per_node and drive_gbps must be positive: {s}")
    sizes = sizes if sizes is not None else gpt_storage_sizes(s.params, s.bytes_per_param)
    ranks = [RankInfo(r, f"node{r // s.gpus_per_node:05d}") for r in range(s.dp)]
    plan = plan_save(sizes, ranks, writers_per_node=s.writers_per_node, data_dirs=s.drives_per_node)
    node_of = {r: k for k, members in enumerate(plan.nodes) for r in members}
    drive_bytes: dict[tuple[int, int], int] = defaultdict(int)
    node_bytes: dict[int, int] = defaultdict(int)
    for f in plan.files:
        drive_bytes[(node_of[f.rank], f.dir)] += f.plan.size
        node_bytes[node_of[f.rank]] += f.plan.size
    rate = s.drive_gbps * 1e9
    partitioned = max(n / rate for n in drive_bytes.values())
    single = plan.total_bytes / rate
    if s.node_gbps:
        partitioned = max(partitioned, max(node_bytes.values()) / (s.node_gbps * 1e9))
        single = max(single, plan.total_bytes / (s.node_gbps * 1e9))
    return Prediction(s, len(plan.nodes), len(plan.writers), plan.total_bytes,
                      plan.writer_balance, plan.node_balance, single, partitioned)
