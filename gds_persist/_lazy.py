"""Submodules that resolve as attributes of their package on first use (PEP 562 module
``__getattr__``): ``import gds_persist`` then ``gds_persist.dcp.GdsPersistWriter(path)`` works,
and torch.distributed.checkpoint, Lightning, Accelerate and the GPU stack are imported only then.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_submodules(package: str, namespace: dict[str, Any], names: tuple[str, ...]
                    ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for the package ``package`` (its globals ``namespace``):
    each of ``names`` is imported as ``package.name`` when first looked up."""

    def __getattr__(name: str) -> Any:
        if name in names:  # the import binds it in namespace: later look-ups never come here
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
