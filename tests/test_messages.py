"""What users read points at the docs, never at files of the repository the wheel does not ship
(CONTRIBUTING.md, "Rules of the house"): every string of the package that reaches a user -
exception texts, warnings, ``SaveInfo.reason``, what goes into a manifest's writer record, CLI
help - names a doc and its section (``docs/TRAINING.md, "Benchmark"``), not ``training/mode.py``
or ``bench/results/...``. Docstrings and comments may cite code; they are not scanned.

Every module is parsed with ``ast``: each string literal (f-strings too, with their formatted
parts as ``{}``) that is not a docstring nor a bare string statement is checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "gds_persist"

# a Python file, or a path into a folder of the repository that the wheel does not ship
REPO_PATH = re.compile(r"[\w/.{}-]*\w\.py\b|(?<![\w/.])(?:bench|tests|examples|\.ci|"
                       r"gds_persist|kernels)/[\w/.*{}-]*")
ALLOWED = {
    # the CUDA sources are package data: the wheel ships kernels/*.cu as gds_persist.kernels
    "gds_persist/kernels", "kernels/*.cu", "kernels/{}",
}
# messages that still cite repository files, in modules being rewritten on other branches of
DOC_REF = re.compile(r"(docs/[\w.-]+\.md)(?:,? (?:\"([^\"]+)\"|'([^']+)'))?")


def _unread_strings(tree: ast.AST) -> set[int]:
    """Docstrings and bare string statements: never shown at run time."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant | ast.JoinedStr)}


def messages(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string a user may read: literals and f-strings (``{}`` for each
    formatted part), implicitly joined pieces as one."""
    tree = ast.parse(source)
    skip = _unread_strings(tree)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
            out.append((node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}"
                                             for v in node.values)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))
    return out


def repo_paths(source: str) -> list[tuple[int, str]]:
    return [(line, m) for line, text in messages(source) for m in REPO_PATH.findall(text)
            if m not in ALLOWED]


def _modules() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_messages_cite_docs_not_repository_files() -> None:
    found = {(path, line, ref) for path, text in _modules().items()
             for line, ref in repo_paths(text)}
    assert not found, ("messages citing files the wheel does not ship (name the doc and its "
                       "section instead, as docs/TRAINING.md, \"Benchmark\"):\n" + "\n".join(
                           f"{p}:{line}: {ref}" for p, line, ref in sorted(found)))



def _headings(doc: str) -> set[str]:
    return {line.lstrip("#").strip().replace("`", "")
            for line in (REPO / doc).read_text().splitlines() if line.startswith("#")}


def test_doc_sections_cited_by_messages_exist() -> None:
    bad = []
    for path, source in _modules().items():
        for line, text in messages(source):
            for doc, *section in DOC_REF.findall(text):
                name = "".join(section)
                if not (REPO / doc).is_file():
                    bad.append(f"{path}:{line}: {doc} does not exist")
                elif name and name.replace("`", "") not in _headings(doc):
                    bad.append(f"{path}:{line}: {doc} has no section {name!r}")
    assert not bad, "messages citing docs that are not there:\n" + "\n".join(bad)


def test_the_scanner_finds_paths_in_messages_only() -> None:
    source = '''"""Docstring: training/mode.py may be cited here."""
# and in comments: bench/bench_train.py
X = "see backends/auto.py"
def f(name):
    """tests/test_x.py here too"""
    "a bare string statement: bench/x.py"
    raise ValueError(f"run bench/{name}"
                     f"_train.py or read {name}: bench/results/"
                     "x.txt, or docs/TRAINING.md")
Y = ".gds_persist/checksums.json and kernels/*.cu"
'''
    assert repo_paths(source) == [(3, "backends/auto.py"), (7, "bench/{}_train.py"),
                                  (7, "bench/results/x.txt")]
    assert DOC_REF.findall('docs/GPU.md, "The GPU path" or docs/FORMAT.md') == [
        ("docs/GPU.md", "The GPU path", ""), ("docs/FORMAT.md", "", "")]
