"""How the nox sessions spread tests over their two pytest workers (``-n 2 --dist loadgroup``).

A work unit is a test file (its module fixtures, such as a built model, stay on one worker),
unless its tests carry ``xdist_group`` marks: then each group is a unit, so a file whose
parametrized fixture builds several costly cases can spread them over both workers. Named
groups and units holding a ``slow`` test are handed out first, so the longest ones do not start
last and leave one worker idle at the end.

On the GPU (``tools/gpu_check.sh`` runs the engine's tests over a few workers) a worker gives its
cached device memory back after each GPU test: the engine sizes its KV cache from the device's
free memory, which the blocks another worker's allocator keeps would take.
"""

from __future__ import annotations

import gc
import sys

import pytest


@pytest.fixture(autouse=True)
def _give_back_cached_device_memory(request):
    yield
    torch = sys.modules.get("torch")
    if (
        torch is None
        or not hasattr(request.config, "workerinput")
        or request.node.get_closest_marker("gpu") is None
        or not torch.cuda.is_initialized()
    ):
        return
    gc.collect()
    torch.cuda.empty_cache()


def _group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return mark.args[0] if mark.args else mark.kwargs.get("name", "default")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileOrGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            # xdist appends "@<group>" to the node ids of marked tests under loadgroup
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return nodeid.rsplit("@", 1)[-1]
            return nodeid.split("::", 1)[0]

    # hand units out in collection order, which pytest_collection_modifyitems sets below
    config.option.loadscopereorder = False
    return FileOrGroupScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    # on a worker, xdist sets the option loadgroup for --dist loadgroup (and dist to "no")
    if not hasattr(config, "workerinput") or not getattr(config.option, "loadgroup", False):
        return  # plain pytest keeps its own order
    units = [_group(item) or item.nodeid.split("::", 1)[0] for item in items]
    # a named group is split out of its file for its cost: it goes first too
    first = {u for u, item in zip(units, items) if item.get_closest_marker("slow") or _group(item)}
    order = sorted(range(len(items)), key=lambda i: units[i] not in first)  # stable
    items[:] = [items[i] for i in order]
