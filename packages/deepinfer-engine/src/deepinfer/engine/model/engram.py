"""Engram: V4.1 conditional memory, gated into the hyper-connection streams (spec 7.3).

Checkpoint tensors of an Engram layer ``i`` (``layers.{i}.engram.``):

================  =================  ==========================================
name              dtype              shape
================  =================  ==========================================
embed.weight      F8_E4M3            ``[engram_num_embeddings[k], head_dim]``
embed.scale       F8_E8M0            ``[engram_num_embeddings[k], head_dim/32]``
wkv.weight        F8_E4M3            ``[(hc_mult+1)*D, (N-1)*n_heads*head_dim]``
wkv.scale         F8_E8M0            weight blocks of the checkpoint (32x32 in V4.1)
q_weight          BF16               ``[hc_mult, D]``
k_weight          BF16               ``[hc_mult, D]``
================  =================  ==========================================

How the stack calls it (once per forward, flat batch of ``T`` tokens):

1. before the first layer: ``row_ids = hasher.row_ids(input_ids, positions, token_slots,
   cache.extra["engram_history"], is_image)`` (:class:`EngramHasher`) -> ``[T, L, C]`` for all
   Engram layers at once (reads the n-gram windows, then writes the history ring);
2. at layer ``engram_layer_ids[k]``, on the residual streams *before* the block:
   ``h = layers[i].engram(h, row_ids[:, k], token_mask)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deepinfer import kernels
from deepinfer.engine.model.engram_hashing import EngramHashLayout
from deepinfer.engine.model.engram_history import ngram_token_ids, update_history
from deepinfer.engine.model.layers import LinearFactory
from deepinfer.kernels import envs

ENGRAM_SCALE_BLOCK = 32


@dataclass(frozen=True)
class EngramConfig:
    """What one Engram layer needs from the model config."""

    layer_id: int
    num_embeddings: int
    max_ngram_size: int
    num_heads: int
    head_dim: int
    hidden_size: int
    hc_mult: int
    eps: float
    weight_block: tuple[int, int] | None  # None: unquantised checkpoint

    @property
    def num_columns(self) -> int:
        """Table rows read per token: one per (n-gram order, head)."""
        return (self.max_ngram_size - 1) * self.num_heads

    @classmethod
    def from_model_config(cls, cfg: Any, layer_id: int) -> EngramConfig:
        if layer_id not in cfg.engram_layer_ids:
            raise ValueError(
                f"layer_id = {layer_id}: not an Engram layer (engram_layer_ids = "
                f"{tuple(cfg.engram_layer_ids)})"
            )
        index = tuple(cfg.engram_layer_ids).index(layer_id)
        if cfg.engram_head_dim % ENGRAM_SCALE_BLOCK:
            raise ValueError(
                f"engram_head_dim = {cfg.engram_head_dim}: expected a multiple of "
                f"{ENGRAM_SCALE_BLOCK} (one table scale per {ENGRAM_SCALE_BLOCK} columns)"
            )
        return cls(
            layer_id=layer_id,
            num_embeddings=cfg.engram_num_embeddings[index],
            max_ngram_size=cfg.engram_max_ngram_size,
            num_heads=cfg.engram_n_heads,
            head_dim=cfg.engram_head_dim,
            hidden_size=cfg.hidden_size,
            hc_mult=cfg.hc_mult,
            eps=cfg.rms_norm_eps,
            weight_block=cfg.weight_block,
        )


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


_HOST_TABLES_DEFERRED: ContextVar[bool] = ContextVar("engram_host_tables_deferred", default=False)


@contextmanager
def host_tables_deferred() -> Iterator[None]:
    """Build the tables that would live in host memory on the meta device: the loader then
    places them (in memory the node's ranks share) instead of each rank allocating its own."""
    token = _HOST_TABLES_DEFERRED.set(True)
    try:
        yield
    finally:
        _HOST_TABLES_DEFERRED.reset(token)


class EngramTable(nn.Module):
    """``embed``: the hashed n-gram table, FP8 rows with one ue8m0 scale per 32 columns.

    A table on the host (``host=True``: pinned memory when CUDA is available) serves a step by
    gathering only the rows the step reads, on a worker thread that starts as soon as the row
    ids exist (:meth:`prefetch`) and copies them to the device on a side stream while the layers
    before this one run; the lookup then reads that compact table. Dequantisation is per row,
    so the result is bitwise the device table's. Built under :func:`host_tables_deferred`, a
    table in host memory starts on the meta device and its loader gives it storage."""

    def __init__(
        self,
        num_rows: int,
        width: int,
        quantized: bool,
        dtype: torch.dtype,
        device=None,
        host: bool = False,
    ) -> None:
        super().__init__()
        fp8, e8m0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
        self.host = host
        pin = host and torch.cuda.is_available()
        place = {"device": "cpu", "pin_memory": pin} if host else {"device": device}
        in_host_memory = host or torch.device(device or "cpu").type == "cpu"
        if in_host_memory and _HOST_TABLES_DEFERRED.get():
            place = {"device": "meta"}
        weight_dtype = fp8 if quantized else dtype
        self.weight = _frozen(torch.empty(num_rows, width, dtype=weight_dtype, **place))
        self.scale = None
        if quantized:
            scale_shape = (num_rows, width // ENGRAM_SCALE_BLOCK)
            self.scale = _frozen(torch.empty(scale_shape, dtype=e8m0, **place))
        self._pending: tuple[torch.Tensor, Future] | None = None

    def prefetch(self, row_ids: torch.Tensor) -> None:
        """Start gathering the rows ``row_ids`` will read (host tables on a CUDA step only)."""
        if self.host and row_ids.is_cuda:
            stream = torch.cuda.current_stream(row_ids.device)
            produced = stream.record_event()
            job = _gather_pool().submit(self._gather_async, row_ids, produced, stream)
            self._pending = (_key(row_ids), job)

    def forward(self, row_ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """row_ids ``[...]`` int64 -> dequantised rows ``[..., width]`` of ``out_dtype``."""
        if not self.host or not row_ids.is_cuda:
            return kernels.engram_embedding_lookup(
                self.weight, self.scale, row_ids, out_dtype=out_dtype
            )
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == _key(row_ids):
            weight, scale, local, ready = pending[1].result()
        else:
            stream = torch.cuda.current_stream(row_ids.device)
            weight, scale, local, ready = self._gather_async(row_ids, stream.record_event(), stream)
        torch.cuda.current_stream(row_ids.device).wait_event(ready)
        return kernels.engram_embedding_lookup(weight, scale, local, out_dtype=out_dtype)

    def gather(
        self, row_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(the distinct rows ``row_ids`` reads, their scales, ``row_ids`` renumbered into them),
        on the host."""
        distinct, local = torch.unique(row_ids.cpu(), return_inverse=True)
        scale = None if self.scale is None else self.scale.index_select(0, distinct)
        return self.weight.index_select(0, distinct), scale, local

    def _gather_async(self, row_ids: torch.Tensor, produced, consumer):
        """On a worker thread: wait for the row ids (``produced``, recorded on the ``consumer``
        stream that computes and later reads them), gather on the host, copy to the device on a
        side stream; returns the device tensors and the event that marks them ready."""
        device = row_ids.device
        side = _side_stream(device)
        with torch.cuda.stream(side):
            side.wait_event(produced)
            row_ids.record_stream(side)
            weight, scale, local = self.gather(row_ids)
            moved = [
                None if t is None else t.pin_memory().to(device, non_blocking=True)
                for t in (weight, scale, local)
            ]
            ready = torch.cuda.Event()
            ready.record(side)
        for t in moved:
            if t is not None:
                t.record_stream(consumer)
        return (*moved, ready)


_POOL: ThreadPoolExecutor | None = None
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _gather_pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engram-gather")
    return _POOL


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _key(row_ids: torch.Tensor) -> tuple:
    return row_ids.data_ptr(), tuple(row_ids.shape), row_ids.stride()


# A table larger than this share of the device's memory lives on the host.
HOST_TABLE_SHARE = 0.05


def engram_on_host(device, table_bytes: int) -> bool:
    """Where a V4.1 model on ``device`` keeps an Engram table of ``table_bytes``: in host memory
    on a CUDA device when the table is large next to the device (the released tables are ~98 GB
    each, and a step reads a few thousand rows of them), unless
    ``DEEPINFER_ENGRAM_FORCE_GPU_STORAGE=1``; on the device everywhere else."""
    if device is None or torch.device(device).type != "cuda":
        return False
    if envs.get("DEEPINFER_ENGRAM_FORCE_GPU_STORAGE"):
        return False
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    return table_bytes > HOST_TABLE_SHARE * total


class Engram(nn.Module):
    """One Engram layer: table lookup, ``wkv`` projection, per-stream gate into the streams."""

    def __init__(self, cfg: EngramConfig, factory: LinearFactory) -> None:
        super().__init__()
        self.cfg = cfg
        dtype, device = factory.dtype, factory.device
        quantized = cfg.weight_block is not None
        row_bytes = cfg.head_dim * (1 if quantized else dtype.itemsize)
        host = engram_on_host(device, cfg.num_embeddings * row_bytes)
        self.embed = EngramTable(cfg.num_embeddings, cfg.head_dim, quantized, dtype, device, host)
        self.wkv = factory.quantised(
            cfg.num_columns * cfg.head_dim, (cfg.hc_mult + 1) * cfg.hidden_size
        )
        shape = (cfg.hc_mult, cfg.hidden_size)
        self.q_weight = _frozen(torch.empty(shape, dtype=dtype, device=device))
        self.k_weight = _frozen(torch.empty(shape, dtype=dtype, device=device))

    def forward(
        self, hidden: torch.Tensor, row_ids: torch.Tensor, token_mask: torch.Tensor
    ) -> torch.Tensor:
        """Mix the looked-up n-gram memory into the streams.

        hidden:     ``[T, hc_mult, D]`` residual streams entering the layer (bf16 or fp32).
        row_ids:    ``[T, (N-1)*n_heads]`` int64 rows of this layer (``engram_hash`` output).
        token_mask: ``[T]`` bool, False for image tokens (their streams pass through unchanged).
        Returns ``[T, hc_mult, D]`` of ``hidden.dtype``.
        """
        num_tokens, streams, dim = hidden.shape
        rows = self.embed(row_ids, hidden.dtype)  # [T, C, head_dim]
        kv = self.wkv(rows.reshape(num_tokens, -1))  # [T, (nc+1)*D]
        key = kv[:, : streams * dim].reshape(num_tokens, streams, dim)
        value = kv[:, streams * dim :]
        return kernels.engram_gate(
            hidden, key, value, self.q_weight, self.k_weight, token_mask, self.cfg.eps
        )


class EngramHasher:
    """Per-forward hashing for all Engram layers: n-gram windows, history update, row ids.

    token_map ``[vocab]`` int64 (:func:`engram_hashing.compressed_token_map`) and the layout's
    tensors are moved to ``device`` once. The history ring lives in the cache's state slots
    (``ModelCache.extra["engram_history"]``, from :func:`engram_history.new_history`).
    """

    def __init__(
        self,
        layout: EngramHashLayout,
        token_map: torch.Tensor,
        pad_token_id: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layout = layout
        self.pad_token_id = pad_token_id
        self.token_map = token_map.to(device)
        self.multipliers = layout.multipliers.to(device)
        self.primes = layout.primes.to(device)
        self.offsets = layout.offsets.to(device)

    def row_ids(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_slots: torch.Tensor,
        history: torch.Tensor,
        is_barrier: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[T, L, C]`` int64 table rows of every token for every Engram layer.

        input_ids, positions, token_slots ``[T]`` int64 (a sequence's tokens contiguous, at
        consecutive positions); history ``[num_slots, R]`` is read, then updated in place.
        """
        cmap, n = self.token_map, self.layout.max_ngram_size
        ngrams = ngram_token_ids(
            input_ids, positions, token_slots, cmap, history, self.pad_token_id, n, is_barrier
        )
        update_history(history, input_ids, positions, token_slots, cmap, is_barrier)
        return kernels.engram_hash(ngrams, self.multipliers, self.primes, self.offsets)
