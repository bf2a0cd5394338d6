"""Lazy package exports: a package's public names import their modules on first use, so that
importing a torch-free part of the engine (the scheduler, the fakes) does not import torch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], eager: Iterable[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name of ``exports`` ({name: module})
    is looked up in its module when first asked for; ``eager`` names the package defines
    itself and lists too."""
    names = sorted([*exports, *eager])

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(module), name)

    def __dir__() -> list[str]:
        return names

    return __getattr__, __dir__
