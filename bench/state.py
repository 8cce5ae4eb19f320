"""A deterministic synthetic GPT-style training checkpoint of a chosen size.

The state dict looks like what a trainer saves: ``{"model": model.state_dict(),
"optimizer": adam.state_dict(), "step": int, ...}``, with

* a large token embedding tied to the LM head (two keys, one storage, as in GPT-2),
* a position embedding and per-layer attention / MLP weight matrices (the large tensors),
* per-layer LayerNorm weights and biases and linear biases (many small tensors),
* Adam state per parameter: a 0-dim ``step`` tensor, ``exp_avg`` and ``exp_avg_sq`` in fp32,
  plus, for ``dtype="mixed"``, an fp32 master copy of each bf16 parameter (Megatron-style
  mixed precision: 2 + 4 + 4 + 4 = 14 bytes per parameter).

Values are uniform random from a seeded generator (the bytes are incompressible and the same
on every run and machine); they are not meant to be a trained model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 50304  # GPT-2's vocabulary padded to a multiple of 64
CONTEXT = 1024
MAX_LAYERS = 96
DTYPES = ("mixed", "fp32")
BYTES_PER_PARAM = {"mixed": 14, "fp32": 12}


@dataclass(frozen=True)
class GPTShape:
    """The model shape chosen to reach a target checkpoint size."""

    layers: int
    hidden: int
    vocab: int
    context: int

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        h = self.hidden
        shapes: dict[str, tuple[int, ...]] = {
            "wte.weight": (self.vocab, h),
            "wpe.weight": (self.context, h),
        }
        for i in range(self.layers):
            p = f"h.{i}."
            shapes.update({
                p + "ln_1.weight": (h,), p + "ln_1.bias": (h,),
                p + "attn.c_attn.weight": (3 * h, h), p + "attn.c_attn.bias": (3 * h,),
                p + "attn.c_proj.weight": (h, h), p + "attn.c_proj.bias": (h,),
                p + "ln_2.weight": (h,), p + "ln_2.bias": (h,),
                p + "mlp.c_fc.weight": (4 * h, h), p + "mlp.c_fc.bias": (4 * h,),
                p + "mlp.c_proj.weight": (h, 4 * h), p + "mlp.c_proj.bias": (h,),
            })
        shapes.update({"ln_f.weight": (h,), "ln_f.bias": (h,)})
        return shapes

    def params(self) -> int:
        n = 0
        for shape in self.param_shapes().values():
            k = 1
            for d in shape:
                k *= d
            n += k
        return n


def choose_shape(target_bytes: int, dtype: str = "mixed") -> GPTShape:
    """A GPT shape whose checkpoint is about ``target_bytes`` (within 2% where possible).

    Depth and width grow together as in the GPT family (hidden about 64 x layers, a multiple of
    64) and the vocabulary (a multiple of 64, at most GPT-2's padded 50304) stays as close to
    GPT-2's as the size allows while absorbing the remainder.
    Tiny targets get a small vocabulary and context, but every kind of tensor is still there.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    target = max(1, target_bytes // BYTES_PER_PARAM[dtype])
    best: tuple[tuple[float, ...], GPTShape] | None = None
    for layers in range(1, MAX_LAYERS + 1):
        for hidden in range(64, 32768 + 1, 64):
            per_layer = 12 * hidden * hidden + 13 * hidden
            context = min(CONTEXT, max(64, target // 16 // hidden // 64 * 64))
            rest = target - context * hidden - 2 * hidden - layers * per_layer
            vocab = max(64, min(VOCAB, rest // hidden // 64 * 64))
            params = (vocab + context + 2) * hidden + layers * per_layer
            error = abs(params - target) / target
            shape_penalty = abs(math.log(hidden / (64 * layers))) + abs(math.log(vocab / VOCAB))
            score = (error > 0.02, shape_penalty, error)
            if best is None or score < best[0]:
                best = (score, GPTShape(layers, hidden, vocab, context))
            if rest < 0:
                break
    assert best is not None
    return best[1]


def make_state_dict(target_bytes: int, *, dtype: str = "mixed", seed: int = 0,
                    device: str | torch.device = "cpu") -> dict[str, Any]:
    """A GPT-style model + Adam checkpoint of about ``target_bytes`` bytes (deterministic)."""
    shape = choose_shape(target_bytes, dtype)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    model_dtype = torch.bfloat16 if dtype == "mixed" else torch.float32

    def uniform(shape_: tuple[int, ...], low: float, high: float) -> torch.Tensor:
        t = torch.empty(shape_, dtype=torch.float32).uniform_(low, high, generator=gen)
        return t.to(device)

    model: dict[str, torch.Tensor] = {}
    state: dict[int, dict[str, Any]] = {}
    names = list(shape.param_shapes().items())
    for index, (name, pshape) in enumerate(names):
        master = uniform(pshape, -0.05, 0.05)
        model[name] = master.to(model_dtype) if dtype == "mixed" else master
        entry: dict[str, Any] = {"step": torch.tensor(1000.0, device=device)}
        entry["exp_avg"] = uniform(pshape, -1e-3, 1e-3)
        entry["exp_avg_sq"] = uniform(pshape, 0.0, 1e-6)
        if dtype == "mixed":
            entry["master_param"] = master
        state[index] = entry
    model["lm_head.weight"] = model["wte.weight"]  # tied: one storage, two keys
    optimizer = {
        "state": state,
        "param_groups": [{
            "lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
            "differentiable": False, "fused": None, "params": list(range(len(names))),
        }],
    }
    return {
        "model": model,
        "optimizer": optimizer,
        "step": 1000,
        "config": {"layers": shape.layers, "hidden": shape.hidden, "vocab": shape.vocab,
                   "context": shape.context, "dtype": dtype, "seed": seed},
    }


def iter_tensors(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """All tensors of a nested state dict as (dotted key, tensor), in a stable order."""
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, torch.Tensor):
        out.append((prefix, obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out += iter_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out += iter_tensors(v, f"{prefix}.{i}" if prefix else str(i))
    return out


@dataclass(frozen=True)
class StateSummary:
    """What the benchmark reports about the state dict it wrote."""

    payload_bytes: int  # bytes of distinct storages: what any correct writer must persist
    tensors: int
    storages: int
    small_tensors: int  # tensors under 64 KiB (norm weights, biases, step counters)
    largest_bytes: int
    shared_tensors: int  # tensors whose storage another key also uses (tied weights)


def summarize(sd: Any) -> StateSummary:
    tensors = [t for _, t in iter_tensors(sd)]
    seen: dict[tuple[str, int], int] = {}
    counts: dict[tuple[str, int], int] = {}
    for t in tensors:
        s = t.untyped_storage()
        key = (str(t.device), s.data_ptr())
        seen[key] = s.nbytes()
        counts[key] = counts.get(key, 0) + 1
    shared = sum(c for c in counts.values() if c > 1)
    sizes = [t.numel() * t.element_size() for t in tensors]
    return StateSummary(
        payload_bytes=sum(seen.values()),
        tensors=len(tensors),
        storages=len(seen),
        small_tensors=sum(1 for s in sizes if s < 64 << 10),
        largest_bytes=max(sizes, default=0),
        shared_tensors=shared,
    )
