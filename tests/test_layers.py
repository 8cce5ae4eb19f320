"""The package's layers (CONTRIBUTING.md, "Layout"): a module imports only its own layer or lower
ones, and no import circle exists, function-level imports included.

Every module of gds_persist is parsed with ``ast`` (nothing is imported). Each ``import`` and
``from ... import`` anywhere in a module (module level, inside functions, under ``if
TYPE_CHECKING``) is an edge: ``import a.b.c`` is an edge to ``a.b.c`` and to its parent packages
``a.b`` and ``a`` (except the root ``gds_persist``, whose ``__init__`` re-exports everything, and
except the importer's own enclosing packages, which are being imported already when the importer
runs); ``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = "gds_persist"
PACKAGE = Path(__file__).resolve().parent.parent / ROOT

# The one table: module (or package, covering everything below it) -> layer, bottom up.
LAYERS: dict[str, int] = {
    # 0 base: no gds_persist imports beyond this layer
    "gds_persist._version": 0,
    "gds_persist._lazy": 0,
    "gds_persist.errors": 0,
    "gds_persist.settings": 0,
    "gds_persist.progress": 0,
    "gds_persist.results": 0,
    "gds_persist.stages": 0,
    # 1 format: the only code that knows what is on disk
    "gds_persist.format": 1,
    # 2 transfer: moving and checksumming bytes, committing; backends beside it
    "gds_persist.transfer": 2,
    "gds_persist.transfer.locks": 2,
    "gds_persist.transfer.opened": 2,
    "gds_persist.backends": 2,
    # 3 orchestration: state, parallel, one save and one load orchestrator
    "gds_persist.state": 3,
    "gds_persist.parallel": 3,
    "gds_persist.saving": 3,
    "gds_persist.loading": 3,
    # 4 training: Checkpointer, snapshots, the helper process; advice
    "gds_persist.training": 4,
    "gds_persist.advice": 4,
    # 5 integrations: DCP, conversions, the CLI, the trainer plugins
    "gds_persist.dcp": 5,
    "gds_persist.convert": 5,
    "gds_persist.cli": 5,
    "gds_persist.__main__": 5,
    "gds_persist.integrations": 5,
    # the package itself only re-exports the public API
    "gds_persist": 6,
}
LAYER_NAMES = ["base", "format", "transfer", "orchestration", "training", "integrations",
               "package"]


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


def layer_of(name: str) -> int | None:
    """The layer of ``name``'s longest entry in LAYERS; the root entry covers only itself."""
    if name == ROOT:
        return LAYERS[ROOT]
    parts = name.split(".")
    for k in range(len(parts), 1, -1):
        layer = LAYERS.get(".".join(parts[:k]))
        if layer is not None:
            return layer
    return None


GRAPH = {name: imports_of(name) for name in MODULES}


def _describe(layer: int | None) -> str:
    return "unmapped" if layer is None else f"layer {layer} ({LAYER_NAMES[layer]})"


def test_every_module_has_a_layer() -> None:
    unmapped = [name for name in MODULES if layer_of(name) is None]
    assert not unmapped, f"add these modules to LAYERS (and CONTRIBUTING.md): {unmapped}"
    stale = [name for name in LAYERS if name not in MODULES]
    assert not stale, f"LAYERS names modules that do not exist: {stale}"


def test_no_lower_layer_imports_a_higher_one() -> None:
    bad = []
    for name, targets in sorted(GRAPH.items()):
        mine = layer_of(name)
        for target, line in sorted(targets.items()):
            theirs = layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:  # unmapped: above
                bad.append(f"{MODULES[name].relative_to(PACKAGE.parent)}:{line}: {name} "
                           f"[{_describe(mine)}] imports {target} [{_describe(theirs)}]")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def _cycles() -> list[tuple[list[str], list[str]]]:
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
        for w in sorted(GRAPH[v]):
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

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return [(_one_cycle(c), c) for c in components]


def _one_cycle(component: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(GRAPH[v]):
                if w == start:
                    return paths[v] + [start]
                if w in members and w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return component  # pragma: no cover - a component always has a cycle


def test_no_import_cycles() -> None:
    cycles = _cycles()
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
    graph["gds_persist.errors"]["gds_persist.loading.load"] = 1  # base importing orchestration
    monkeypatch.setitem(globals(), "GRAPH", graph)
    with pytest.raises(AssertionError, match=r"gds_persist\.errors \[layer 0 \(base\)\] imports "
                                             r"gds_persist\.loading\.load \[layer 3"):
        test_no_lower_layer_imports_a_higher_one()
    with pytest.raises(AssertionError, match=r"(?s)import cycles:\n.*gds_persist\.errors \(line"):
        test_no_import_cycles()
