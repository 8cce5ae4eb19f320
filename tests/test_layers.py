"""The package's layers (CONTRIBUTING.md, "Layout"; docs/ARCHITECTURE.md): each folder of the
package is one layer, a folder imports only folders of lower layers (and the vocabulary at the
root), no two folders import each other (nor any longer circle of folders), no two modules form
an import circle (function-level imports included), and no module grows past ``MAX_LINES``.

Every module of gds_persist is parsed with ``ast`` (nothing is imported). Each ``import`` and
``from ... import`` anywhere in a module (module level, inside functions, under ``if
TYPE_CHECKING``) is an edge: ``import a.b.c`` is an edge to ``a.b.c`` and to its parent packages
``a.b`` and ``a`` (except the root ``gds_persist``, whose ``__init__`` re-exports everything, and
except the importer's own enclosing packages, which are being imported already when the importer
runs); ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``.
"""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

ROOT = "gds_persist"
PACKAGE = Path(__file__).resolve().parent.parent / ROOT
MAX_LINES = 600

# The root holds only the vocabulary every layer speaks; each of these modules is the unit
# "vocabulary" (layer 0). A new root module is refused: give it a folder.
VOCABULARY = ("_version", "_lazy", "errors", "settings", "progress", "results", "stages",
              "keywords")

# The one table: folder (unit) -> layer, bottom up. Folders of one layer may not import each
# other at all (the folder graph must stay acyclic either way).
LAYERS: dict[str, int] = {
    "vocabulary": 0,    # the root modules above
    "format": 1,        # the only code that knows what is on disk
    "backends": 2,      # the only code that touches data files' descriptors
    "transfer": 3,      # moving, checksumming and committing bytes; warm-up
    "state": 4,         # the one walker of live state dicts
    "stores": 4,        # where checkpoints live, by URL scheme (s3://): commit, I/O, opening
    "parallel": 5,      # process-group glue, schedules, exchange, shared reads
    "saving": 6,        # one save orchestrator: plain, units, data-parallel
    "loading": 6,       # one load orchestrator, verify, where the bytes land
    "advice": 6,        # intervals, levels, wear, the scale model (pure arithmetic)
    "training": 7,      # Checkpointer, snapshots, the helper process, the memory tier
    "dcp": 8,           # the PyTorch DCP storage writer and reader
    "convert": 9,       # torch.save / safetensors / DCP import and export, materialize
    "integrations": 10,  # Lightning, Accelerate
    "cli": 11,          # the gds-persist command
    "__main__": 12,     # python -m gds_persist
    "package": 12,      # gds_persist/__init__.py: re-exports the public API
}


def _module_files() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _module_files()


def _is_package(name: str) -> bool:
    path = MODULES.get(name)
    return path is not None and path.name == "__init__.py"


def _resolve(importer: str, level: int, module: str | None) -> str:
    """The absolute name of a (possibly relative) ``from`` import's module."""
    if level == 0:
        return module or ""
    base = importer.split(".")
    if not _is_package(importer):
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _with_parents(target: str, importer: str) -> list[str]:
    parts = target.split(".")
    enclosing = {".".join(importer.split(".")[:k]) for k in range(1, importer.count(".") + 2)}
    out = [target]
    for k in range(len(parts) - 1, 1, -1):  # parents, never the root package itself
        parent = ".".join(parts[:k])
        if parent not in enclosing:
            out.append(parent)
    return out


def imports_of(name: str) -> dict[str, int]:
    """Every gds_persist module ``name`` imports -> the line of the first such import."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found: dict[str, int] = {}
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, node.level, node.module)
            for a in node.names:
                sub = f"{base}.{a.name}"
                targets.append(sub if sub in MODULES else base)
        for target in targets:
            if target != ROOT and not target.startswith(ROOT + "."):
                continue
            for t in _with_parents(target, name):
                if t in MODULES and t != name:
                    found.setdefault(t, node.lineno)
    return found


def unit_of(name: str) -> str:
    """The folder (unit) a module belongs to: its first component below the root; a root
    module is ``vocabulary`` (or itself: ``__main__``), the root package is ``package``."""
    if name == ROOT:
        return "package"
    first = name.split(".")[1]
    if f"{ROOT}.{first}" in MODULES and not _is_package(f"{ROOT}.{first}"):
        return "vocabulary" if first in VOCABULARY else first
    return first


def layer_of(name: str) -> int | None:
    return LAYERS.get(unit_of(name))


GRAPH = {name: imports_of(name) for name in MODULES}


def folder_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """unit -> unit it imports -> one import that makes the edge (``module:line``)."""
    out: dict[str, dict[str, str]] = {unit_of(n): {} for n in graph}
    for name, targets in graph.items():
        for target, line in sorted(targets.items()):
            a, b = unit_of(name), unit_of(target)
            if a != b:
                out[a].setdefault(b, f"{name} (line {line}) imports {target}")
    return out


def _describe(unit: str) -> str:
    return f"{unit} [layer {LAYERS.get(unit, '?')}]"


def test_every_module_has_a_folder_with_a_layer() -> None:
    unmapped = sorted({unit_of(n) for n in MODULES} - set(LAYERS))
    assert not unmapped, f"add these folders to LAYERS (and CONTRIBUTING.md): {unmapped}"
    stale = sorted(set(LAYERS) - {unit_of(n) for n in MODULES})
    assert not stale, f"LAYERS names folders that do not exist: {stale}"


def test_the_root_holds_only_the_vocabulary() -> None:
    extra = sorted(p.stem for p in PACKAGE.glob("*.py")
                   if p.stem not in (*VOCABULARY, "__init__", "__main__"))
    assert not extra, (f"modules at the package root beyond the vocabulary: {extra}; "
                       "move each into the folder of its stage")


def test_no_folder_imports_a_higher_or_equal_layer() -> None:
    bad = []
    for unit, targets in sorted(folder_graph(GRAPH).items()):
        for target, why in sorted(targets.items()):
            mine, theirs = LAYERS.get(unit), LAYERS.get(target)
            if mine is not None and theirs is not None and theirs >= mine:
                bad.append(f"{_describe(unit)} imports {_describe(target)}: {why}")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_two_folders_import_each_other() -> None:
    folders = folder_graph(GRAPH)
    cycles = _cycles({u: dict.fromkeys(t, 0) for u, t in folders.items()})
    text = [" -> ".join(f"{a} ({folders[a][b]})" for a, b in zip(c, c[1:], strict=False))
            for c, _ in cycles]
    assert not cycles, "folders in an import circle:\n" + "\n".join(text)


def test_no_module_over_the_line_limit() -> None:
    long = {str(p.relative_to(PACKAGE.parent)): n for p in MODULES.values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def _cycles(graph: dict[str, dict[str, int]]) -> list[tuple[list[str], list[str]]]:
    """Every strongly connected component with more than one module (Tarjan): one concrete
    cycle through it, and all its members."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [(_one_cycle(graph, c), c) for c in components]


def _one_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    return paths[v] + [start]
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return component  # pragma: no cover - a component always has a cycle


def test_no_import_cycles() -> None:
    cycles = _cycles(GRAPH)
    text = [" -> ".join(f"{m} (line {GRAPH[m][n]})" if n else m
                        for m, n in zip(c, c[1:] + [""], strict=True))
            + (f"  [one of the circles among {', '.join(members)}]" if len(members) > 2 else "")
            for c, members in cycles]
    assert not cycles, "import cycles:\n" + "\n".join(text)


# --- the checker itself must be able to fail ----------------------------------------------------

@pytest.mark.parametrize(
    ("importer", "level", "module", "expected"),
    [
        ("gds_persist.loading.load", 1, "format", "gds_persist.loading.format"),
        ("gds_persist.format.tree", 1, "records", "gds_persist.format.records"),
        ("gds_persist.format.tree", 2, "errors", "gds_persist.errors"),
        ("gds_persist.format", 1, "tree", "gds_persist.format.tree"),
        ("gds_persist.dcp.writer", 1, None, "gds_persist.dcp"),
    ],
)
def test_relative_imports_resolve(importer: str, level: int, module: str | None,
                                  expected: str) -> None:
    assert _resolve(importer, level, module) == expected


def test_parent_packages_count_but_not_the_root_or_enclosing_ones() -> None:
    assert _with_parents("gds_persist.transfer.writer", "gds_persist.loading.load") == [
        "gds_persist.transfer.writer", "gds_persist.transfer"]
    assert _with_parents("gds_persist.transfer.pipeline", "gds_persist.transfer.writer") == [
        "gds_persist.transfer.pipeline"]
    assert _with_parents("gds_persist.errors", "gds_persist.loading.load") == ["gds_persist.errors"]


def test_a_planted_upward_import_and_circle_are_found(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = {name: dict(targets) for name, targets in GRAPH.items()}
    graph["gds_persist.errors"]["gds_persist.loading.load"] = 1  # vocabulary importing a verb
    monkeypatch.setitem(globals(), "GRAPH", graph)
    with pytest.raises(AssertionError, match=r"vocabulary \[layer 0\] imports loading \[layer 6\]: "
                                             r"gds_persist\.errors \(line 1\)"):
        test_no_folder_imports_a_higher_or_equal_layer()
    with pytest.raises(AssertionError, match=r"(?s)folders in an import circle:\n.*loading"):
        test_no_two_folders_import_each_other()
    with pytest.raises(AssertionError, match=r"(?s)import cycles:\n.*gds_persist\.errors \(line"):
        test_no_import_cycles()


def test_folders_of_one_layer_may_not_import_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    graph = {name: dict(targets) for name, targets in GRAPH.items()}
    graph["gds_persist.saving.save"]["gds_persist.loading.load"] = 7
    monkeypatch.setitem(globals(), "GRAPH", graph)
    with pytest.raises(AssertionError, match=r"saving \[layer 6\] imports loading \[layer 6\]"):
        test_no_folder_imports_a_higher_or_equal_layer()


def test_a_long_module_and_a_new_root_module_are_found(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(globals(), "MAX_LINES", 5)
    with pytest.raises(AssertionError, match=r"modules over 5 lines .*gds_persist/"):
        test_no_module_over_the_line_limit()
    monkeypatch.setitem(globals(), "VOCABULARY", ("errors",))
    with pytest.raises(AssertionError, match=r"beyond the vocabulary: \[.*'settings'"):
        test_the_root_holds_only_the_vocabulary()


# --- CONTRIBUTING.md's module table is the tree ------------------------------------------------

CONTRIBUTING = PACKAGE.parent / "CONTRIBUTING.md"
ROOT_ROW = "root (vocabulary)"
# in a row's last cell, a lower-case word in backticks is a module of that folder (``name`` or
# ``name.py``), a word with a trailing slash a subfolder (``tier/``); other code is written so
# it does not look like one (``"direct"``, ``save()``, ``SaveRequest``)
_MODULE_TOKEN = re.compile(r"`([a-z_][a-z0-9_]*)(?:\.py)?`")
_FOLDER_TOKEN = re.compile(r"`([a-z_][a-z0-9_/]*)/`")


def table_rows(text: str) -> dict[str, str]:
    """Folder (``root (vocabulary)`` or ``format``) -> the last cell of its row of the table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            folder = cells[1] if cells[1] == ROOT_ROW else cells[1].strip("`").rstrip("/")
            rows[folder] = cells[2]
    return rows


def table_errors(rows: dict[str, str], modules: dict[str, Path]) -> list[str]:
    """What the table and the tree disagree on, each as the edit that fixes it."""
    tree: dict[str, dict[str, str]] = {}  # row -> module stem or subfolder (``tier/``) -> path
    for path in modules.values():
        rel = path.relative_to(PACKAGE)
        row = ROOT_ROW if len(rel.parts) == 1 else rel.parts[0]
        names = tree.setdefault(row, {})
        for k in range(2, len(rel.parts)):
            names.setdefault("/".join(rel.parts[1:k]) + "/", "/".join(rel.parts[:k]) + "/")
        if rel.stem != "__init__" or row == ROOT_ROW:
            names[rel.stem] = str(rel)
    errors = []
    for row, names in sorted(tree.items()):
        if row not in rows:
            errors.append(f"CONTRIBUTING.md's table has no row for {row}/: add one")
            continue
        prefix = "" if row == ROOT_ROW else row + "/"
        named = set(_MODULE_TOKEN.findall(rows[row])) | {
            f.removeprefix(prefix) + "/" for f in _FOLDER_TOKEN.findall(rows[row])}
        where = "the root row" if row == ROOT_ROW else f"the row of `{row}/`"
        errors += [f"{ROOT}/{names[n]} is not in CONTRIBUTING.md's table: add `{n}` to {where}"
                   for n in sorted(set(names) - named)]
        errors += [f"CONTRIBUTING.md's table names `{n}` in {where}, but {ROOT}/{prefix} has "
                   "no such module or folder: remove it (or, if it is not meant as a module, "
                   "write it so it does not look like one: `save()`, `\"direct\"`)"
                   for n in sorted(named - set(names))]
    errors += [f"CONTRIBUTING.md's table has a row for {row}/, which is not a folder of {ROOT}"
               for row in sorted(set(rows) - set(tree))]
    return errors


def test_contributing_table_names_every_module() -> None:
    errors = table_errors(table_rows(CONTRIBUTING.read_text()), MODULES)
    assert not errors, "\n".join(errors)


def test_a_module_missing_from_the_table_and_a_stale_name_are_found() -> None:
    rows = table_rows(CONTRIBUTING.read_text())
    modules = dict(MODULES, **{f"{ROOT}.format.brand_new": PACKAGE / "format" / "brand_new.py"})
    del modules[f"{ROOT}.format.tree"]
    errors = "\n".join(table_errors(rows, modules))
    assert ("gds_persist/format/brand_new.py is not in CONTRIBUTING.md's table: add `brand_new` "
            "to the row of `format/`") in errors
    assert "names `tree` in the row of `format/`, but gds_persist/format/ has no such" in errors


# --- every exception and warning class lives in errors.py ----------------------------------------

_BUILTIN_EXCEPTIONS = {n for n in dir(builtins)
                       if isinstance(getattr(builtins, n), type)
                       and issubclass(getattr(builtins, n), BaseException)}


def exception_classes(sources: dict[str, str]) -> list[str]:
    """``module:line class`` for every class (in modules other than ``errors``) whose bases are
    exceptions or warnings: builtin ones, a package class that is one, or any base named
    ``...Error`` / ``...Exception`` / ``...Warning`` (``pickle.UnpicklingError``)."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    classes = {(name, node.name): node for name, tree in trees.items()
               for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    known = set(_BUILTIN_EXCEPTIONS) | {c for (m, c) in classes if m.endswith(".errors")}
    grew = True
    while grew:  # a class deriving from a package exception class is one too
        grew = False
        for (_, cls), node in classes.items():
            bases = {b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")
                     for b in node.bases}
            if cls not in known and any(b in known or b.endswith(("Error", "Exception", "Warning"))
                                        for b in bases):
                known.add(cls)
                grew = True
    return sorted(f"{m}:{node.lineno} {c}" for (m, c), node in classes.items()
                  if c in known and not m.endswith(".errors"))


def test_every_exception_class_lives_in_errors() -> None:
    found = exception_classes({n: p.read_text() for n, p in MODULES.items()})
    assert not found, (f"exception or warning classes outside {ROOT}/errors.py: {found}; move "
                       "each to errors.py (deriving from CheckpointError) and export it from "
                       f"{ROOT}/__init__.py")


def test_an_exception_class_outside_errors_is_found() -> None:
    found = exception_classes({
        f"{ROOT}.errors": "class CheckpointError(Exception): pass",
        f"{ROOT}.format.x": "class Plain:\n    pass\nclass BadInput(ValueError):\n    pass",
        f"{ROOT}.format.y": "from .. import errors\nclass Worse(errors.CheckpointError): pass\n"
                            "class Worst(Worse): pass\nclass Odd(pickle.UnpicklingError): pass\n"
                            "class Noisy(UserWarning): pass",
    })
    assert found == [f"{ROOT}.format.x:3 BadInput", f"{ROOT}.format.y:2 Worse",
                     f"{ROOT}.format.y:3 Worst", f"{ROOT}.format.y:4 Odd",
                     f"{ROOT}.format.y:5 Noisy"]


def test_the_architecture_map_names_every_folder_at_its_layer() -> None:
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    drawn = {m[2]: int(m[1]) for m in re.finditer(r"^ {1,2}(\d+) {2}(\w+)/ ", text, re.M)}
    folders = {u: n for u, n in LAYERS.items() if u not in ("vocabulary", "package", "__main__")}
    assert drawn == folders, ("docs/ARCHITECTURE.md's map and LAYERS differ: drawn "
                              f"{sorted(drawn.items() - folders.items())}, in the tree "
                              f"{sorted(folders.items() - drawn.items())}")
