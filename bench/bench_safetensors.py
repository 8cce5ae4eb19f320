"""Safetensors and Transformers' Trainer: gds_persist beside the Hugging Face tools, in one run.

Save (every figure includes fsync of the files and the directory):
``gds_persist.save(format="safetensors")``, ``safetensors.torch.save_file`` + fsync,
``save_pretrained`` + fsync, and gds_persist's directory format. Load: ``gds_persist.load``,
``gds_persist.load(into=model.state_dict())`` and ``load_file`` + ``load_state_dict``. The
methods run interleaved (A B C D, A B C D, ...: other processes share the CPUs) and the medians
are reported. The files are read back from the page cache on every side (no cache drop here).

Trainer: a tiny GPT-2 trained with ``save_steps=1``: how long training stops per checkpoint
(``_save_checkpoint``'s time) with Trainer's own saving and with ``attach``, and the whole run.

    python bench/bench_safetensors.py --dirs bench/out /dev/shm/bench42 --runs 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

import gds_persist  # noqa: E402
from gds_persist.transfer.commit import fsync_path  # noqa: E402

# then off the path: the checkout's top-level kernels/ (CUDA sources) would shadow the `kernels`
# package Transformers imports
sys.path.remove(REPO)


def _fsync_tree(path: str) -> None:
    for name in os.listdir(path):
        fsync_path(os.path.join(path, name))
    fsync_path(path)


def _model(n_embd: int, n_layer: int, vocab: int) -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=n_embd, n_layer=n_layer, n_head=8, vocab_size=vocab,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def save_methods(model: Any, sd: dict[str, torch.Tensor], base: str
                 ) -> dict[str, Callable[[], Any]]:
    from safetensors.torch import save_file

    untied = {k: v for k, v in sd.items() if k != "lm_head.weight"}  # save_file refuses ties

    def save_file_fsync() -> None:
        os.makedirs(f"{base}/st", exist_ok=True)
        save_file(untied, f"{base}/st/model.safetensors", metadata={"format": "pt"})
        _fsync_tree(f"{base}/st")

    def save_pretrained_fsync() -> None:
        model.save_pretrained(f"{base}/hf")
        _fsync_tree(f"{base}/hf")

    return {"gds safetensors": lambda: gds_persist.save(sd, f"{base}/gds", format="safetensors"),
            "save_file+fsync": save_file_fsync, "save_pretrained+fsync": save_pretrained_fsync,
            "gds directory": lambda: gds_persist.save(sd, f"{base}/dir")}


def load_methods(model: Any, base: str) -> dict[str, Callable[[], Any]]:
    from safetensors.torch import load_file

    target = model.state_dict()
    return {"gds load": lambda: gds_persist.load(f"{base}/gds"),
            "gds load(into=)": lambda: gds_persist.load(f"{base}/gds", into=target),
            "load_file+load_state_dict": lambda: model.load_state_dict(
                load_file(f"{base}/st/model.safetensors"), strict=False)}


def interleaved(methods: dict[str, Callable[[], Any]], runs: int,
                before: Callable[[str], None] | None = None) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(runs):
        for name, fn in methods.items():
            if before:
                before(name)
            times[name].append(_timed(fn))
    return times


def trainer_figure(base: str, attached: bool, steps: int) -> dict[str, Any]:
    import transformers

    from gds_persist.integrations.transformers import attach

    out = f"{base}/trainer-{'attached' if attached else 'own'}"
    shutil.rmtree(out, ignore_errors=True)
    model = _model(512, 4, 8192)
    ids = torch.randint(0, 8192, (64, 16))
    data = [{"input_ids": i, "labels": i} for i in ids]
    args = transformers.TrainingArguments(output_dir=out, max_steps=steps, save_steps=1,
                                          per_device_train_batch_size=2, report_to=[],
                                          use_cpu=True, logging_strategy="no", disable_tqdm=True,
                                          save_total_limit=2)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    stops: list[float] = []
    if attached:
        attach(trainer)
    else:
        own = trainer._save_checkpoint

        def timed(*a: Any) -> None:
            stops.append(_timed(lambda: own(*a)))

        trainer._save_checkpoint = timed
    wall = _timed(trainer.train)
    if attached:
        stops = trainer.gds_persist.stops
    shutil.rmtree(out, ignore_errors=True)
    return {"stops_s": stops, "median_stop_s": statistics.median(stops), "train_s": wall}


def run_in(base: str, runs: int, n_embd: int, n_layer: int, vocab: int,
           trainer_steps: int) -> dict[str, Any]:
    os.makedirs(base, exist_ok=True)
    model = _model(n_embd, n_layer, vocab)
    sd = model.state_dict()
    nbytes = sum(v.numel() * v.element_size() for k, v in sd.items() if k != "lm_head.weight")

    def clear(name: str) -> None:
        for sub in ("gds", "st", "hf", "dir"):
            if name.startswith({"gds": "gds s", "st": "save_file", "hf": "save_pre",
                                "dir": "gds d"}[sub]):
                shutil.rmtree(f"{base}/{sub}", ignore_errors=True)

    saves = interleaved(save_methods(model, sd, base), runs, clear)
    loads = interleaved(load_methods(model, base), runs)
    assert all(torch.equal(v, sd[k]) for k, v in gds_persist.load(f"{base}/gds").items())
    figures: dict[str, Any] = {"bytes": nbytes, "save_s": saves, "load_s": loads}
    med = {k: statistics.median(v) for k, v in {**saves, **loads}.items()}
    figures["median_s"] = med
    figures["ratios"] = {
        "safetensors save vs save_file+fsync": med["save_file+fsync"] / med["gds safetensors"],
        "safetensors save vs save_pretrained+fsync":
            med["save_pretrained+fsync"] / med["gds safetensors"],
        "safetensors save vs gds directory": med["gds directory"] / med["gds safetensors"],
        "load(into=) vs load_file+load_state_dict":
            med["load_file+load_state_dict"] / med["gds load(into=)"],
    }
    trainer = [(trainer_figure(base, a, trainer_steps), a) for a in (False, True, False, True)]
    own = [f for f, a in trainer if not a]
    ours = [f for f, a in trainer if a]
    figures["trainer"] = {"own": own, "attached": ours}
    figures["ratios"]["trainer stop per checkpoint, own vs attached"] = (
        statistics.median(s for f in own for s in f["stops_s"])
        / statistics.median(s for f in ours for s in f["stops_s"]))
    for sub in ("gds", "st", "hf", "dir"):
        shutil.rmtree(f"{base}/{sub}", ignore_errors=True)
    return figures


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dirs", nargs="+", default=["bench/out/safetensors", "/dev/shm/bench42"])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--trainer-steps", type=int, default=4)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    record = {d: run_in(d, args.runs, args.n_embd, args.n_layer, args.vocab,
                        args.trainer_steps) for d in args.dirs}
    for d, fig in record.items():
        print(f"== {d}: {fig['bytes'] / 2**20:.0f} MiB of weights, medians of {args.runs}")
        for k, v in fig["median_s"].items():
            print(f"  {k:28s} {v:8.3f} s  {fig['bytes'] / v / 1e9:6.2f} GB/s")
        for k, v in fig["ratios"].items():
            print(f"  {k}: {v:.2f}x")
        for side in ("own", "attached"):
            stops = [s for f in fig["trainer"][side] for s in f["stops_s"]]
            print(f"  trainer {side}: stop per checkpoint median {statistics.median(stops):.3f} s,"
                  f" train() {[round(f['train_s'], 2) for f in fig['trainer'][side]]} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
