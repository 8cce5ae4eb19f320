"""Every ```python block of README.md and docs/*.md runs as written (issue 19).

Each block runs in a process of its own with warnings as errors (forked from a server that has
imported torch and gds_persist with warnings as errors too, tests/forkserver.py: a fresh
interpreter would spend 4 s of CPU a block on that import), in an empty temporary working
directory, between the hidden set-up and checks that ``tests/doc_preludes.py`` keeps for it
(keyed by file and one line of the block). A block without an entry there fails, saying so. An
HTML comment on the line before a block marks it (CONTRIBUTING.md, "Examples in the docs"):

* ``<!-- doc-test: gpu -->``: needs a CUDA device; runs in ``pytest -m gpu`` (bench/gpu_check.sh)
  and skips with the reason elsewhere;
* ``<!-- doc-test: skip (why) -->``: a fragment that cannot run (a bare signature); the reason is
  required.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.doc_preludes import PRELUDES, Prelude
from tests.forkserver import ForkServer

REPO = Path(__file__).resolve().parent.parent
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*doc-test:\s*(?P<kind>\S+?)\s*(?:\((?P<why>.*)\))?\s*-->")
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    file: str
    line: int  # of the opening fence, 1-based
    code: str
    marker: str  # "", "gpu" or "skip"
    reason: str

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def _marker(lines: list[str], fence: int, file: str) -> tuple[str, str]:
    before = [ln for ln in lines[:fence] if ln.strip()][-1:]
    m = MARKER.fullmatch(before[0].strip()) if before else None
    if m is None:
        return "", ""
    kind, why = m.group("kind"), (m.group("why") or "").strip()
    if kind not in ("gpu", "skip") or (kind == "skip" and not why):
        raise ValueError(f"{file}:{fence}: unknown doc-test marker {before[0].strip()!r}: use "
                         "<!-- doc-test: gpu --> or <!-- doc-test: skip (the reason) -->")
    return kind, why


def read_blocks(file: str) -> list[Block]:
    lines = (REPO / file).read_text().splitlines()
    blocks, start = [], None
    for i, line in enumerate(lines):
        if start is None and re.fullmatch(r"```python\s*", line):
            start = i
        elif start is not None and re.fullmatch(r"```\s*", line):
            kind, why = _marker(lines, start, file)
            blocks.append(Block(file, start + 1, "\n".join(lines[start + 1:i]) + "\n", kind, why))
            start = None
    assert start is None, f"{file}:{start + 1}: a ```python block is never closed"
    return blocks


BLOCKS = [b for f in DOCS for b in read_blocks(f)]


def prelude_for(block: Block) -> Prelude:
    lines = {ln.strip() for ln in block.code.splitlines()}
    found = [key for key in PRELUDES if key[0] == block.file and key[1] in lines]
    first = block.code.strip().splitlines()[0]
    if not found:
        pytest.fail(f"add a prelude for block {block.where} ({first!r}) in file {block.file}: "
                    "an entry (file, one of its lines) in tests/doc_preludes.py, even an empty "
                    "Prelude(); or mark it <!-- doc-test: gpu --> / <!-- doc-test: skip (why) -->")
    assert len(found) == 1, f"{block.where}: several preludes match: {found}"
    return PRELUDES[found[0]]


def _param(block: Block) -> object:
    marks = []
    if block.marker == "gpu":
        marks.append(pytest.mark.gpu)
    elif block.marker == "skip":
        marks.append(pytest.mark.skip(reason=f"{block.where} is marked skip: {block.reason}"))
    return pytest.param(block, marks=marks, id=block.where)


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    with ForkServer(warnings_error=True) as server:  # its workers too: `python -W error`
        yield server


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_doc_block_runs_as_written(block: Block, tmp_path: Path, forks: ForkServer) -> None:
    if block.marker == "gpu" and not torch.cuda.is_available():
        pytest.skip(f"{block.where} is marked gpu and there is no CUDA device")
    prelude = prelude_for(block)
    script = "\n".join(["# --- hidden set-up", prelude.setup, f"# --- {block.where}", block.code,
                        "# --- hidden checks", prelude.check])
    cwd, stderr = tmp_path / "cwd", tmp_path / "stderr"  # the block sees an empty directory
    cwd.mkdir()
    (cwd / "doc_block.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = forks.spawn(str(cwd / "doc_block.py"), [], env=env, cwd=str(cwd),
                       stdout=str(tmp_path / "stdout"), stderr=str(stderr)).wait(TIMEOUT_S)
    numbered = "\n".join(f"{i:4} {ln}" for i, ln in enumerate(script.splitlines(), 1))
    assert code == 0, (f"{block.where} failed (exit {code}):\n{stderr.read_text()[-4000:]}"
                       f"\n--- the script run (doc_block.py):\n{numbered}")


def test_every_prelude_belongs_to_one_block() -> None:
    for file, line in PRELUDES:
        assert file in DOCS, f"tests/doc_preludes.py names {file}, which is not a doc file"
        owners = [b.where for b in BLOCKS if b.file == file
                  and line in {ln.strip() for ln in b.code.splitlines()}]
        assert len(owners) == 1, (f"the prelude keyed {line!r} matches {owners or 'no block'} in "
                                  f"{file}: the block changed? key it by a line it still has")


def test_markers_precede_python_blocks() -> None:
    for file in DOCS:
        lines = (REPO / file).read_text().splitlines()
        for i, line in enumerate(lines):
            if "doc-test:" in line:
                after = next((ln for ln in lines[i + 1:] if ln.strip()), "")
                assert MARKER.fullmatch(line.strip()) and after.strip() == "```python", (
                    f"{file}:{i + 1}: a doc-test marker must be the line before a ```python "
                    f"block: {line.strip()!r}")
    assert {b.marker for b in BLOCKS} <= {"", "gpu", "skip"}
    assert len(BLOCKS) >= 10, [b.where for b in BLOCKS]  # the parser still finds them


def _expand(path: str) -> list[str]:
    """``a-{x,y}.txt`` -> ``a-x.txt``, ``a-y.txt`` (nested and repeated braces too)."""
    m = re.search(r"\{([^{}]*)\}", path)
    if m is None:
        return [path]
    return [p for alt in m.group(1).split(",")
            for p in _expand(path[:m.start()] + alt + path[m.end():])]


def test_results_the_docs_cite_exist() -> None:
    cited = set()
    for file in [*DOCS, "CONTRIBUTING.md"]:
        for ref in re.findall(r"bench/results/[\w./{},*-]*", (REPO / file).read_text()):
            cited |= {(file, p) for p in _expand(ref.rstrip(".,"))}
    missing = [f"{file}: {p}" for file, p in sorted(cited) if not glob.glob(str(REPO / p))]
    assert not missing, f"cited results that do not exist: {missing}"
    assert len(cited) > 10, cited  # the pattern still finds them


def test_the_results_index_names_every_file_kept() -> None:
    """bench/results/README.md lists every file there and nothing that is not."""
    results = REPO / "bench/results"
    named = {p.rstrip("/") for cell in re.findall(r"`(20[^`]*)`",
                                                  (results / "README.md").read_text())
             for p in _expand(cell)}
    kept = {p.name for p in results.iterdir()} - {"README.md"}
    assert kept - named == set(), "add these to bench/results/README.md, or git rm them"
    assert named - kept == set(), "bench/results/README.md names files that are not there"
