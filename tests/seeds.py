"""A pytest plugin: every test's randomness comes from one printed seed, and can be replayed.

The session seed is ``GDS_PERSIST_TEST_SEED`` where set, else drawn at random; the header
prints it. Each test seeds Python's ``random``, NumPy's global generator and torch's from its
own seed (derived from the session seed and its node id, so one test replayed alone gets the
seed it had in the full run), and gets it as the ``test_seed`` fixture for generators of its
own. A failing test's report names its seed and the command that replays it; Hypothesis tests
draw from the session seed too (unless ``--hypothesis-seed`` is given). ``tests/conftest.py``
loads it. How a flaky test is handled: CONTRIBUTING.md, "Flaky tests".
"""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Iterator
from typing import Any

import pytest

ENV = "GDS_PERSIST_TEST_SEED"
_session: int | None = None


def session_seed() -> int:
    """``GDS_PERSIST_TEST_SEED`` (an integer) where set, else one drawn for this session."""
    global _session
    if _session is None:
        raw = os.environ.get(ENV, "").strip()
        try:
            _session = int(raw) if raw else random.SystemRandom().randrange(1 << 32)
        except ValueError:
            raise pytest.UsageError(f"{ENV}={raw!r}: give an integer (the seed a failing "
                                    "run printed)") from None
    return _session


def seed_for(nodeid: str) -> int:
    """The seed of one test: the session seed mixed with its node id (order-independent)."""
    return zlib.crc32(nodeid.encode(), session_seed()) & 0xFFFFFFFF


def replay(nodeid: str) -> str:
    return f"{ENV}={session_seed()} pytest '{nodeid}'"


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("hypothesis_seed", None) is None:
        try:
            from hypothesis import core
        except ImportError:
            return
        core.global_force_seed = session_seed()  # type: ignore[assignment]


def pytest_report_header(config: pytest.Config) -> str:
    return f"test seed: {session_seed()} (replay a run with {ENV}={session_seed()})"


@pytest.fixture(autouse=True)
def test_seed(request: pytest.FixtureRequest) -> Iterator[int]:
    """This test's seed; Python's, NumPy's and torch's global generators start from it."""
    seed = seed_for(request.node.nodeid)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    import torch

    torch.manual_seed(seed)
    print(f"test seed {seed} (replay: {replay(request.node.nodeid)})")
    yield seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    outcome: Any = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("test seed", f"seed {seed_for(item.nodeid)}; replay: "
                                             f"{replay(item.nodeid)}"))
