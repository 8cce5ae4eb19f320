"""Hidden set-up and checks for the Python blocks of README.md and docs/*.md, run by
tests/test_docs_examples.py (CONTRIBUTING.md, "Examples in the docs").

Each block runs as written, in a fresh interpreter (``python -W error``) whose working directory
is an empty temporary one: ``setup`` first (imports, a tiny model and optimizer, the files the
block reads), then the block, then ``check`` (asserts what the block did). A block is found by
its file and one line of it (stripped) that no other block of that file has: edit that line and
the key must follow, add a block and it needs an entry here (even an empty ``Prelude()``), or its
test fails saying so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prelude:
    setup: str = ""  # runs before the block
    check: str = ""  # runs after it


TINY_TRAINER = """
import os
import torch
import gds_persist
try:
    from tests.helpers import prefer_installed_kernels  # the checkout's kernels/ shadows it
    prefer_installed_kernels()
except ImportError:
    pass
import transformers

transformers.set_seed(0)
model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
    n_embd=16, n_layer=1, n_head=2, vocab_size=61, n_positions=8, bos_token_id=0,
    eos_token_id=0))
ids = torch.randint(0, 61, (16, 8))
data = [{"input_ids": i, "labels": i} for i in ids]
args = transformers.TrainingArguments(output_dir="out", max_steps=4, save_steps=2,
                                      per_device_train_batch_size=4, report_to=[], use_cpu=True,
                                      logging_strategy="no", disable_tqdm=True)
"""

TINY_TRAINING = """
import torch
import gds_persist

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
loss_fn = lambda out: out.pow(2).mean()
batch = lambda: torch.randn(4, 8)
batches = iter(batch, None)
"""


def trained_last(step: int) -> str:
    """Checks that ``state`` is the last step's, holding the model's final weights."""
    return (f'assert state["step"] == {step}, state["step"]\n'
            'assert all(torch.equal(state["model"][k], v)\n'
            '           for k, v in model.state_dict().items())\n')


SMALL_STATE = """
import torch
import gds_persist

state = {"w": torch.randn(1000, 33), "b": torch.arange(7), "step": 1}
"""
# a local S3-compatible server (bench/s3_server.py) with the bucket the text names, and the AWS
# variables pointing at it; stopped when the block's process exits
LOCAL_S3 = """
import atexit
import os
from bench.s3_server import S3Server

_s3 = S3Server("my-bucket").start()
atexit.register(_s3.stop)
os.environ.update(_s3.env)
"""
GLOO_WORLD_OF_ONE = """
import os
import torch
import torch.distributed as dist
import gds_persist
from tests.dcp_workers import free_port

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                  WORLD_SIZE="1", LOCAL_RANK="0")
"""
LIGHTNING_MODEL = """
import warnings
warnings.filterwarnings("ignore", module=r"lightning\\.")  # its advice on workers and loggers
warnings.filterwarnings("ignore", message=r".*(num_workers|LeafSpec|max_epochs)")
import torch
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import gds_persist


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def _loss(self, batch):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def training_step(self, batch, index):
        return self._loss(batch)

    def validation_step(self, batch, index):
        self.log("val_loss", self._loss(batch))

    def on_train_epoch_end(self):
        self.trainer.should_stop = True  # one epoch per fit: the block sets no max_epochs

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def _data(self):
        data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
        return torch.utils.data.DataLoader(data, batch_size=8)

    train_dataloader = val_dataloader = _data


from gds_persist.integrations.lightning import GdsPersistCheckpointIO

torch.manual_seed(0)
model = Tiny()
first = L.Trainer(plugins=[GdsPersistCheckpointIO()], logger=False, enable_progress_bar=False,
                  callbacks=[ModelCheckpoint(dirpath="checkpoints", save_last=True)])
first.fit(model)  # the checkpoint the block resumes from
"""

TWO_NODES = """
import os
import shutil
import subprocess
import sys
import torch
import torch.distributed as dist
import gds_persist
from tests.dcp_workers import free_port

if "DOC_PEER" not in os.environ:  # rank 0 starts rank 1 on "another node": this same script
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                      LOCAL_RANK="0", GDS_PERSIST_JOB=f"doc-block-{os.getpid()}")
    peer = subprocess.Popen([sys.executable, "-W", "error", __file__],
                            env={**os.environ, "DOC_PEER": "1", "RANK": "1",
                                 "GDS_PERSIST_NODE": "doc-node-b"})
    os.environ.update(RANK="0", GDS_PERSIST_NODE="doc-node-a")
dist.init_process_group("gloo")
MEMORY_TIER = dict(memory=gds_persist.MemoryTier("/dev/shm/ckpt", every=1, replicas=1),
                   drive_every=100)
"""
TWO_NODES_DONE = """
if "DOC_PEER" not in os.environ:
    assert peer.wait(timeout=240) == 0, "the peer rank failed"
    shutil.rmtree(f"/dev/shm/ckpt/{os.environ['GDS_PERSIST_JOB']}", ignore_errors=True)
    shutil.rmtree(f"/mnt/nvme/ckpt/{os.environ['GDS_PERSIST_JOB']}", ignore_errors=True)
dist.destroy_process_group()
"""
MEMORY_STEP_ONE = """
with gds_persist.Checkpointer("ckpt", process_group=dist.group.WORLD, **MEMORY_TIER) as first:
    first.save(1, {"w": torch.ones(4), "step": 1})
pg = dist.group.WORLD
"""

DEEPSPEED_ENGINE = GLOO_WORLD_OF_ONE + """
import deepspeed
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # no C++ build: gloo is enough
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9}
batch = lambda: torch.randn(4, 8)
"""

PRELUDES: dict[tuple[str, str], Prelude] = {
    # README.md
    ("README.md", 'state = gds_persist.load("checkpoints/step-1", map_location=device)   '
                  "# every byte verified"): Prelude(
        check='assert state["step"] == 1 and state["model"]["0.weight"].device.type == device\n'
              'assert info.backend in ("kvikio", "direct", "buffered"), info.backend\n'
              'assert torch.equal(model.state_dict()["2.bias"], state["model"]["2.bias"])\n'),
    ("docs/USAGE.md", "opt.load_state_dict(state[\"optim\"])      # hyperparameters; its tensors "
                  "are already in place"): Prelude(
        setup=TINY_TRAINING + """
opt = optimizer
loss_fn(model(batch())).backward()
opt.step()
saved = {k: v.clone() for k, v in model.state_dict().items()}
gds_persist.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1000},
                 "checkpoints/step-1000")
torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
""",
        check="""
assert step == 1000
assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
assert state["model"]["0.weight"] is live["model"]["0.weight"]  # filled in place
"""),
    ("docs/USAGE.md", 'gds_persist.load("from_elsewhere.pt", into=live)          # any torch.save '
                  'file, in place'): Prelude(
        setup=SMALL_STATE + 'torch.save({"w": torch.ones(1000, 33)}, "from_elsewhere.pt")\n'
              'live = {"w": torch.zeros(1000, 33)}\nsaved = state\n',
        check='assert torch.equal(state["w"], saved["w"]) and state["step"] == 1\n'
              'assert bool((live["w"] == 1).all())  # filled in place from the stock file\n'
              'assert gds_persist.verify("model.pt").checksum == "crc32c"\n'),
    ("README.md", "state = ckpt.load()             # latest committed step; verified"): Prelude(
        setup=TINY_TRAINING + "start, total = 0, 3\n",
        check=trained_last(2) + "assert ckpt.steps() == [0, 1, 2]\n"),
    ("docs/USAGE.md", 'gds_persist.save(state, "ckpt/step-2", base="ckpt/step-1",'): Prelude(
        setup=SMALL_STATE,
        check="""
back = gds_persist.load("ckpt/step-2")
assert torch.equal(back["w"], state["w"]) and back["step"] == 1
assert gds_persist.read_manifest("ckpt/step-2").bases, "step-2 refers to nothing in step-1"
ckpt.close()
assert ckpt.incremental and ckpt.warmup_report is not None  # the default warm-up ran
"""),
    ("docs/USAGE.md", 'gds_persist.settings.set(block_bytes="32MiB")    # from now on, for the '
                      'whole process'): Prelude(
        setup=SMALL_STATE,
        check='assert torch.equal(gds_persist.load("ckpt/step-1")["w"], state["w"])\n'
              "cfg = gds_persist.settings.current()\n"
              "assert (cfg.block_bytes, cfg.io_threads) == (32 << 20, 4)\n"),
    ("docs/USAGE.md", 'print(ckpt.restored_from)       # "memory", "replica" or "drive"'): Prelude(
        setup=TWO_NODES + MEMORY_STEP_ONE,
        check='assert ckpt.restored_from == "memory" and state["step"] == 1\n'
              "ckpt.close()\n" + TWO_NODES_DONE),
    # docs/BENCHMARK.md
    ("docs/BENCHMARK.md", 'key="gds-direct-64MiB")'): Prelude(
        setup="from bench.methods import REGISTRY, GdsPersist, register\n",
        check='method = REGISTRY["gds-direct-64MiB"]()\n'
              'assert method.key == "gds-direct-64MiB", method.key\n'),
    # docs/DISTRIBUTED.md
    ("docs/DISTRIBUTED.md", 'torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))'): Prelude(
        setup=GLOO_WORLD_OF_ONE + "net = torch.nn.Linear(8, 4)\nstep = 1\n",
        check='assert torch.equal(state["model"]["weight"], ddp.module.weight.detach())\n'
              'assert state["step"] == 1 and info.world_size == 1\n'
              "dist.destroy_process_group()\n"),
    ("docs/DISTRIBUTED.md", 'opt.optim.load_state_dict(state["optimizer"])'): Prelude(
        setup=GLOO_WORLD_OF_ONE + 'dist.init_process_group("gloo")\nimport warnings\n'
              "warnings.filterwarnings(  # torch.distributed.optim's own, at its import\n"
              '    "ignore", r"`torch\\.jit\\.\\w+` is deprecated", DeprecationWarning)\n'
              'net = torch.nn.Linear(8, 4)\nstep, path = 1, "ckpt/step-1"\n',
        check='assert gds_persist.verify(path).ok\nassert state["step"] == 1\n'
              "dist.destroy_process_group()\n"),
    # docs/FORMAT.md
    ("docs/FORMAT.md", 'json.dumps(body, sort_keys=True, separators=(",", ":"), '
                       "allow_nan=False).encode()"): Prelude(
        setup=SMALL_STATE + 'gds_persist.save(state, "ck")\nimport json\n'
              'doc = json.loads(open("ck/manifest.json", "rb").read())\nbody = doc["body"]\n'),
    ("docs/FORMAT.md", "def read_checkpoint(path):"): Prelude(
        check=SMALL_STATE + """
state["t"] = state["w"][1:, ::3]  # a view: shape, stride and offset of a shared storage
gds_persist.save(state, "ck")
got = read_checkpoint("ck")
assert got["step"] == 1
for key in ("w", "b", "t"):
    assert (as_numpy(got[key]) == state[key].numpy()).all(), key
"""),
    # docs/INTEGRATIONS.md
    ("docs/INTEGRATIONS.md", 'fut = dcp.async_save(state_dict, '
                             'storage_writer=GdsPersistWriter("ckpt/step-200"))'): Prelude(
        setup="import warnings\n"
              'warnings.filterwarnings("ignore", "torch.distributed is disabled")  # no_dist\n'
              "import torch\nimport gds_persist\n"
              'state_dict = {"w": torch.randn(64, 8), "step": torch.tensor(3)}\n'
              "want = {k: v.clone() for k, v in state_dict.items()}\n"
              'state_dict["w"].zero_()  # saved as zeros at step-100 and step-200\n',
        check='assert gds_persist.verify("ckpt/step-100").ok\n'
              'assert torch.equal(state_dict["w"], torch.zeros(64, 8))\n'),
    ("docs/INTEGRATIONS.md", 'gds_persist.export_checkpoint("ckpt/step-100", "model.pt")'
                             "                  # torch.save file"): Prelude(
        setup=SMALL_STATE + 'gds_persist.save(state, "ckpt/step-100")\n'
              'path, out, seen = "ckpt/step-100", "model-st.safetensors", []\n'
              "cb = lambda done, total: seen.append((done, total))\n"
              'torch.save({"w": state["w"]}, "pytorch_model.bin")\n',
        check='assert torch.equal(gds_persist.load("ckpt/imported")["w"], state["w"])\n'
              'assert torch.equal(torch.load("model.pt")["w"], state["w"])\n'
              "assert seen and seen[-1][0] == seen[-1][1]\n"),
    ("docs/INTEGRATIONS.md", "def log_progress(done, total):"): Prelude(
        setup=SMALL_STATE + "import logging\nlogging.basicConfig(level=logging.INFO)\n"
              'logger = logging.getLogger("train")\npath = "ck"\n',
        check="assert gds_persist.verify(path).ok\n"),
    ("docs/INTEGRATIONS.md", 'trainer.fit(model, ckpt_path="checkpoints/last.ckpt")'
                             "      # resume"): Prelude(
        setup=LIGHTNING_MODEL,
        check='assert trainer.current_epoch == 2, trainer.current_epoch  # resumed after epoch 1\n'
              'assert gds_persist.verify("checkpoints/last.ckpt").ok\n'),
    ("docs/INTEGRATIONS.md", 'save_state(accelerator, "ckpt/step-100")'
                             '      # instead of accelerator.save_state("ckpt/step-100")'): Prelude(
        setup="import torch\nfrom accelerate import Accelerator\nimport gds_persist\n"
              "accelerator = Accelerator()\nmodel = torch.nn.Linear(4, 2)\n"
              "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)\n",
        check='assert gds_persist.verify("ckpt/step-100").ok\n'),
    ("docs/INTEGRATIONS.md", 'dcp_to_torch_save("ckpt/dcp", "model-full.pt")'
                             "     # consolidated, written atomically, CRC32C checked"): Prelude(
        setup="import torch\n"
              'want = {"w": torch.randn(16, 4), "b": torch.arange(3)}\n'
              'torch.save(want, "model.pt")\n',
        check='got = torch.load("model-full.pt")\n'
              "assert all(torch.equal(got[k], v) for k, v in want.items()), got\n"),
    ("docs/INTEGRATIONS.md", "gds_deepspeed.attach(engine)        # on every rank, right after "
                             "deepspeed.initialize"): Prelude(
        setup=DEEPSPEED_ENGINE,
        check="""
assert open("checkpoints/latest").read() == "step-4"
assert resumed.global_steps == 4, resumed.global_steps
for tag in ("step-2", "step-4"):
    path = f"checkpoints/{tag}/mp_rank_00_model_states.pt"
    assert gds_persist.verify(path).ok and gds_persist.verify(path).checksum == "crc32c"
    assert torch.load(path, weights_only=True)["global_steps"] == int(tag[-1])
"""),
    ("docs/INTEGRATIONS.md", "gds_deepspeed.flush(engine)     # on every rank: step-6 durable "
                             "and `latest` naming it"): Prelude(
        setup=DEEPSPEED_ENGINE + """
from gds_persist.integrations import deepspeed as gds_deepspeed
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
""",
        check="""
assert open("checkpoints/latest").read() == "step-6"
assert engine.checkpoint_engine.decoupled
assert gds_persist.verify("checkpoints/step-6/mp_rank_00_model_states.pt").ok
"""),
    ("docs/INTEGRATIONS.md", "trainer.train()                                      # "
                             "checkpoints written in the background"): Prelude(
        setup=TINY_TRAINER,
        check="""
assert sorted(os.listdir("out")) == ["checkpoint-2", "checkpoint-4"]
assert gds_persist.verify("out/checkpoint-4").ok
"""),
    ("docs/USAGE.md", 'gds_persist.save(model.state_dict(), "hf-model", format="safetensors")'
                      "  # model.safetensors"): Prelude(
        setup="import torch\nimport gds_persist\nmodel = torch.nn.Linear(4, 3)\n",
        check="from safetensors.torch import load_file\n"
              "assert torch.equal(load_file('hf-model/model.safetensors')['weight'], "
              "model.weight)\n"),
    # docs/TRAINING.md
    ("docs/TRAINING.md", "for step in range(start + 1, total_steps + 1):"): Prelude(
        setup=TINY_TRAINING + "total_steps = 3\n",
        check="state = gds_persist.load(f\"ckpt/step-{3:08d}\")\n" + trained_last(3)),
    ("docs/TRAINING.md", 'ckpt = gds_persist.Checkpointer("ckpt", keep_last=3, incremental=True, '
                         'compression="auto")'): Prelude(
        setup="import gds_persist\n",
        check="import torch\nfor step in (1, 2):\n"
              '    ckpt.save(step, {"frozen": torch.ones(1000), "step": step}).wait()\n'
              "assert ckpt.stats.bytes_referenced == 4000, ckpt.stats\nckpt.close()\n"),
    ("docs/TRAINING.md", "advice = advise_multilevel(1.0, levels, LevelFailures("
                         "process_mtbf_s=6 * 3600,"): Prelude(
        check="tmpfs, durable = advice.levels\n"
              "assert durable.interval_s >= 1800 and durable.limited_by == 'flush', durable\n"
              "assert durable.every % tmpfs.every == 0 and tmpfs.limited_by == 'failures'\n"
              "assert advice.recovered_from == {'process': 'tmpfs', 'replica_loss': 'durable'}\n"),
    # docs/OBJECT_STORE.md
    ("docs/OBJECT_STORE.md", 'gds_persist.save(state, "s3://my-bucket/run-7/step-100")'): Prelude(
        setup=LOCAL_S3,
        check='assert gds_persist.read_manifest("s3://my-bucket/run-7/step-100").writer['
              '"backend"] == "s3"\nassert not os.path.exists("s3:")\n'),
    ("docs/OBJECT_STORE.md", "state = ckpt.load()                 # latest committed step; "
                             "verified"): Prelude(
        setup=LOCAL_S3,
        check='assert gds_persist.Checkpointer("s3://my-bucket/run-8").steps() == [2, 3]\n'
              'assert not os.path.exists("s3:")\n'),
    # docs/RECOVERY.md
    ("docs/RECOVERY.md", "pg = torch.distributed.new_group()                 # the Checkpointer's "
                         "own group"): Prelude(
        setup=TWO_NODES + TINY_TRAINING + "total = 3\n",
        check="""
ckpt.close()
again = gds_persist.Checkpointer("ckpt", process_group=pg, **MEMORY_TIER)
assert again.load()["step"] == 3 and again.restored_from == "memory", again.restored_from
again.close()
""" + TWO_NODES_DONE),
}
