"""A module holding exactly a given set of tensors, for loader tests without the model."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def module_with_tensors(
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]], device: str = "cpu"
) -> nn.Module:
    """An ``nn.Module`` whose ``state_dict`` has one frozen parameter per dotted name in
    ``specs`` (``{name: (shape, dtype)}``), allocated uninitialised on ``device``."""
    root = nn.Module()
    for name, (shape, dtype) in specs.items():
        *path, leaf = name.split(".")
        owner = root
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        tensor = torch.empty(shape, dtype=dtype, device=device)
        owner.register_parameter(leaf, nn.Parameter(tensor, requires_grad=False))
    return root
