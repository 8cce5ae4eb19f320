"""The command line the example trainers share: where checkpoints go, how long to train, how
wide the model is, and a step to stop at as if interrupted (a rerun resumes)."""

from __future__ import annotations

import argparse


def example_parser(doc: str, *, steps: int, width: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--ckpt-dir", required=True)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--width", type=int, default=width)
    ap.add_argument("--stop-after", type=int, default=None,
                    help="exit after this step (as if interrupted; rerun to resume)")
    return ap
