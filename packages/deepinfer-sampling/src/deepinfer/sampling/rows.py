"""Host preparation of the per-row parameters: one packed host buffer, one copy to the device.

The buffer is ``[4, B]`` float32 (temperature, top_p, min_p, pad) then ``[4, B]`` int64
(top_k, seed, greedy flag, position), filled with numpy from the record each
:class:`SamplingParams` caches at construction (one join per step, shared with the batch
flags). On CUDA the host side is pinned (torch's caching
host allocator keeps each block until its copy has run, so the copy never waits behind queued
work) and the device side is a buffer kept per (rows, device, stream) with its field views made
once: a call costs one numpy fill and one ``copy_``. Reusing the device buffer is safe because
every use of it is ordered on that one stream. The fixed addresses are also what a captured
CUDA graph reads (``deepinfer.sampling.graphs``).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.sampling import rng
from deepinfer.sampling.params import ROW_UNSEEDED, SamplingParams

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


_ROW_BYTES = operator.attrgetter("row_bytes")


def row_records(params: Sequence[SamplingParams]) -> np.ndarray:
    """``[B, 6]`` int64: each row's cached record (``SamplingParams.row_bytes``): float32
    temperature, top_p, min_p, pad in the first two columns, then top_k, seed, greedy flag and
    ``row_flags``. One join of cached bytes: the only per-row Python work of a step."""
    return np.frombuffer(b"".join(map(_ROW_BYTES, params)), np.int64).reshape(len(params), 6)


def batch_flags(params: Sequence[SamplingParams], records: np.ndarray | None = None):
    """(OR, AND) of the rows' ``row_flags``."""
    flags = (row_records(params) if records is None else records)[:, 5]
    return int(np.bitwise_or.reduce(flags)), int(np.bitwise_and.reduce(flags))


def _fill_host(records: np.ndarray, positions, unseeded: bool, pinned: bool) -> torch.Tensor:
    num = records.shape[0]
    host_tensor = torch.empty(6 * num, dtype=torch.int64, pin_memory=pinned)
    host = host_tensor.numpy()
    host[: 2 * num].view(np.float32).reshape(4, num)[:] = records[:, :2].view(np.float32).T
    host_ints = host[2 * num :].reshape(4, num)
    host_ints[:3] = records[:, 2:5].T
    if unseeded:  # rows without a seed get a fresh one per call
        missing = np.flatnonzero(records[:, 5] & ROW_UNSEEDED)
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
    records: np.ndarray | None = None,
) -> RowTensors:
    """The rows' parameters on ``device`` (host fill, then one non-blocking copy).

    positions: a host sequence (packed with the rest) or a ``[B]`` integer tensor on any
    device: used as is, or with ``static_positions`` copied into the buffer's positions field
    (so a captured graph finds it there). records: :func:`row_records` of ``params`` if the
    caller has them.
    """
    records = row_records(params) if records is None else records
    host = _fill_host(records, positions, unseeded, pinned=device.type == "cuda")
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


__all__ = ["RowTensors", "batch_flags", "device_rows", "pack_rows", "row_records"]
