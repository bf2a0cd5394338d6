"""The multi-process (gloo) tests of ``engine/distributed`` and ``engine/parallel`` form one
xdist work unit: they run one at a time on one worker (each spawns two to four ranks) while the
other worker runs the single-process tests."""

from __future__ import annotations

from pathlib import Path

import pytest

SPAWNING = [Path(__file__).parent / "engine" / name for name in ("distributed", "parallel")]


@pytest.hookimpl(tryfirst=True)  # before xdist names the tests' groups
def pytest_collection_modifyitems(items):
    for item in items:
        if any(item.path.is_relative_to(d) for d in SPAWNING):
            item.add_marker(pytest.mark.xdist_group("engine-gloo"))
