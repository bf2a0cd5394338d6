"""Host preparation of the per-row parameters: one packed host buffer, one copy to the device.

The buffer is ``[4, B]`` float32 (temperature, top_p, min_p, pad) then ``[4, B]`` int64
(top_k, seed, greedy flag, position), filled with numpy from the bytes each
:class:`SamplingParams` caches at construction. On CUDA the host side is pinned (torch's caching
host allocator keeps each block until its copy has run, so the copy never waits behind queued
work) and the device side is a buffer kept per (rows, device, stream) with its field views made
once: a call costs one numpy fill and one ``copy_``. Reusing the device buffer is safe because
every use of it is ordered on that one stream. The fixed addresses are also what a captured
CUDA graph reads (``deepinfer.sampling.graphs``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.sampling import rng
from deepinfer.sampling.params import SamplingParams

_MAX_DEVICE_BUFFERS = 16  # distinct (rows, device, stream) kept; past it the cache restarts


@dataclass(frozen=True)
class RowTensors:
    """Per-row parameters on the device: views of one buffer filled by one transfer."""

    temperature: torch.Tensor  # [B] float32, greedy rows as 1.0
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64
    seeds: torch.Tensor  # [B] int64
    greedy_flags: torch.Tensor  # [B] int64, 1 for greedy rows
    positions: torch.Tensor  # [B] int64
    buffer: torch.Tensor  # [6 B] int64: the storage every field views


def _views(buffer: torch.Tensor, num: int) -> RowTensors:
    temperature, top_p, min_p, _ = buffer[: 2 * num].view(torch.float32).view(4, num).unbind(0)
    top_k, seeds, greedy_flags, positions = buffer[2 * num :].view(4, num).unbind(0)
    return RowTensors(temperature, top_p, min_p, top_k, seeds, greedy_flags, positions, buffer)


_device_buffers: dict[tuple, RowTensors] = {}


def device_rows(num: int, device: torch.device) -> RowTensors:
    """The reused device buffer (and its views) for ``num`` rows on ``device``'s current
    stream; allocated on first use."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (num, device, stream)
    rows = _device_buffers.get(key)
    if rows is None:
        if len(_device_buffers) >= _MAX_DEVICE_BUFFERS:
            _device_buffers.clear()  # a graph that captured an evicted buffer keeps it alive
        rows = _views(torch.empty(6 * num, dtype=torch.int64, device=device), num)
        _device_buffers[key] = rows
    return rows


def _fill_host(params, positions, unseeded: bool, pinned: bool) -> torch.Tensor:
    num = len(params)
    floats = np.frombuffer(b"".join([p.row_float_bytes for p in params]), np.float32)
    ints = np.frombuffer(b"".join([p.row_int_bytes for p in params]), np.int64)
    host_tensor = torch.empty(6 * num, dtype=torch.int64, pin_memory=pinned)
    host = host_tensor.numpy()
    host[: 2 * num].view(np.float32).reshape(4, num)[:] = floats.reshape(num, 4).T
    host_ints = host[2 * num :].reshape(4, num)
    host_ints[:3] = ints.reshape(num, 3).T
    if unseeded:  # rows without a seed get a fresh one per call
        missing = [i for i, p in enumerate(params) if p.seq_seed is None]
        host_ints[1, missing] = rng.random_seeds(len(missing))
    if not isinstance(positions, torch.Tensor):
        host_ints[3] = positions
    return host_tensor


def pack_rows(
    params: Sequence[SamplingParams],
    positions: Sequence[int] | torch.Tensor,
    device: torch.device,
    unseeded: bool,
    *,
    static_positions: bool = False,
) -> RowTensors:
    """The rows' parameters on ``device`` (host fill, then one non-blocking copy).

    positions: a host sequence (packed with the rest) or a ``[B]`` integer tensor on any
    device: used as is, or with ``static_positions`` copied into the buffer's positions field
    (so a captured graph finds it there).
    """
    host = _fill_host(params, positions, unseeded, pinned=device.type == "cuda")
    if device.type != "cuda":  # synchronous consumers: a fresh buffer per call is free
        rows = _views(host.to(device), len(params))
    else:
        rows = device_rows(len(params), device)
        rows.buffer.copy_(host, non_blocking=True)
    if isinstance(positions, torch.Tensor):
        if static_positions:
            rows.positions.copy_(positions, non_blocking=True)
        else:
            pos = positions.to(device=device, dtype=torch.int64)
            rows = RowTensors(*[getattr(rows, f) for f in _FIELDS[:6]], pos, rows.buffer)
    return rows


_FIELDS = ("temperature", "top_p", "min_p", "top_k", "seeds", "greedy_flags", "positions")


def batch_flags(params: Sequence[SamplingParams]) -> tuple[int, int]:
    """(OR, AND) of the rows' ``row_flags``, over the few distinct values."""
    distinct = {p.row_flags for p in params}
    return functools.reduce(operator.or_, distinct, 0), functools.reduce(
        operator.and_, distinct, ~0
    )


__all__ = ["RowTensors", "batch_flags", "device_rows", "pack_rows"]
