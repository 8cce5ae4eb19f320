"""One rank of tests/test_transformers_trainer.py's DDP case (2 gloo ranks, the env:// rendezvous
Trainer expects): Trainer's own saving, attached, and attached resumed from the attached run's
first checkpoint; the SHA-256 of the final weights of each, as JSON in ``argv[2]``."""

from __future__ import annotations

import hashlib
import json
import os
import sys

from tests.helpers import prefer_installed_kernels

prefer_installed_kernels()

import torch  # noqa: E402
import transformers  # noqa: E402

from gds_persist.integrations.transformers import attach  # noqa: E402


def run(out: str, attached: bool, resume: str | None = None) -> str:
    transformers.set_seed(0)
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=61,
                                     n_positions=8, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": i, "labels": i} for i in torch.randint(0, 61, (32, 8), generator=g)]
    args = transformers.TrainingArguments(
        output_dir=out, max_steps=4, save_steps=2, per_device_train_batch_size=2,
        learning_rate=1e-2, report_to=[], use_cpu=True, logging_strategy="no",
        disable_tqdm=True, seed=0, ddp_backend="gloo")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    if attached:
        attach(trainer)
    trainer.train(resume_from_checkpoint=resume)
    digest = hashlib.sha256()
    for v in trainer.model.state_dict().values():
        digest.update(v.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


if __name__ == "__main__":
    root, result = sys.argv[1], sys.argv[2]
    hashes = {"own": run(f"{root}/own", False), "attached": run(f"{root}/attached", True)}
    hashes["resumed"] = run(f"{root}/resumed", True, f"{root}/attached/checkpoint-2")
    with open(result, "w") as f:
        json.dump({"rank": int(os.environ["RANK"]), **hashes}, f)
