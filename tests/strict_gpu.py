"""A pytest plugin: on a machine with a CUDA device, a ``gpu``-marked test that skips FAILS.

A GPU test that skips on a GPU machine hides a broken GPU path (the first H200 run: a cupy
DeprecationWarning switched the CRC kernel off and its 3 tests skipped, unnoticed). So where
``torch.cuda.is_available()`` (``--strict-gpu=auto``, the default) or with ``--strict-gpu=on``,
every skip of a ``gpu``-marked test (``pytest.skip`` in the test or a fixture, a ``skipif``
mark, ``importorskip``) is reported as a failure carrying the skip's reason. CPU machines keep
skipping with the reason. ``tests/conftest.py`` loads it; ``-p tests.strict_gpu`` loads it alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

MODES = ("auto", "on", "off")
_cuda: bool | None = None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--strict-gpu", choices=MODES, default="auto",
        help="fail (not skip) gpu-marked tests that skip: auto (default) where "
             "torch.cuda.is_available(), on, off",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (see tests/strict_gpu.py)")


def strict(config: pytest.Config) -> bool:
    mode = config.getoption("--strict-gpu")
    if mode != "auto":
        return bool(mode == "on")
    global _cuda
    if _cuda is None:
        import torch

        _cuda = torch.cuda.is_available()
    return _cuda


def skip_reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    outcome: Any = yield
    report = outcome.get_result()
    if (report.skipped and not hasattr(report, "wasxfail")
            and item.get_closest_marker("gpu") is not None and strict(item.config)):
        report.outcome = "failed"
        report.longrepr = (
            f"GPU test skipped on a machine with a CUDA device: {skip_reason(report.longrepr)}"
            "\n(tests/strict_gpu.py: on a GPU machine an unusable GPU path - kernel, kvikio, "
            "cupy - is a failure, not a skip; --strict-gpu=off to allow skips)"
        )
