"""What one forward step hands down to every module: metadata, cache, RoPE angles."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.engine.model.cache import ModelCache
from deepinfer.engine.model.metadata import (
    AttentionMetadata,
    CacheReads,
    CompressionPlan,
    read_index,
)
from deepinfer.engine.model.rope import RopeTables


@dataclass
class StepContext:
    """Per-step state passed explicitly through the stack (never a global).

    angles: ``{compressed_table: (cos, sin)}`` ``[T, rd/2]`` at the token positions.
    selected: V4.1 top-k arena rows of the latest index-source layer, per compression ratio
    (``ratio -> [T, k]``); candidate_mask the candidate source's pre-filter ``[T, C]`` bool;
    both filled as layers run. engram_rows: V4.1 Engram table rows ``[T, L, C]`` (None without
    Engram layers); token_mask ``[T]`` bool, False for image tokens. entries_written: this
    step's compressed entries are already stored (YoCo compact rows: the boundary layer wrote
    them from every row of the step), so kv sources only read them.
    """

    metadata: AttentionMetadata
    cache: ModelCache
    input_ids: torch.Tensor
    positions: torch.Tensor
    rope: RopeTables
    angles: dict[bool, tuple[torch.Tensor, torch.Tensor]]
    selected: dict[int, torch.Tensor] = field(default_factory=dict)
    candidate_mask: torch.Tensor | None = None
    engram_rows: torch.Tensor | None = None
    token_mask: torch.Tensor | None = None
    image_mask: torch.Tensor | None = None  # [T] bool, True on image-span rows; None: no image
    taps: dict[int, torch.Tensor] = field(default_factory=dict)
    tap_layers: tuple[int, ...] = ()
    entries_written: bool = False
    # context parallelism (:mod:`.context_prefill`): this rank's rows are some of the step's;
    # gather_keys maps their attention inputs to the whole step's, in step order, and
    # key_positions / key_angles are the whole step's (None: the rows are the whole step)
    gather_keys: Callable[[torch.Tensor], torch.Tensor] | None = None
    key_positions: torch.Tensor | None = None
    key_angles: dict[bool, tuple[torch.Tensor, torch.Tensor]] | None = None
    _gathered: tuple[torch.Tensor, torch.Tensor] | None = None
    _shared: dict[tuple, tuple[object, Any]] = field(default_factory=dict, repr=False)

    def shared(self, name: str, of: object, make: Callable[[], Any], *key: Hashable) -> Any:
        """``make()`` once a step for every layer asking for ``name`` of the step tensor ``of``
        (or tuple of them) and ``key``: index lists and angles derived from the metadata, which
        layers of one kind share, cost one set of small ops a step instead of one a layer.
        ``of`` is kept with the value, so the ``id`` of each names it for the whole step; the
        context lives for one step (a graph replay reruns what the capture computed)."""
        anchors = of if isinstance(of, tuple) else (of,)
        full_key = (name, *map(id, anchors), *key)
        entry = self._shared.get(full_key)
        if entry is None:
            entry = self._shared[full_key] = (anchors, make())
        return entry[1]

    def cache_reads(self) -> CacheReads | None:
        """The metadata's lists for reading float copies of the step's cache rows, where the
        cache stores packed rows (a float cache is one format already) and they still apply."""
        return self.metadata.cache_reads() if self.cache.formats else None

    def arena_rows(self, key: str, plan: CompressionPlan, rows: torch.Tensor):
        """(arena tensor ``key`` as the step's readers take it, ``rows`` (arena rows, ``-1`` =
        none) as indices into it): float copies of the rows the step reads where
        :meth:`cache_reads` has them, else the arena in place."""
        if plan.read_rows is not None and self.cache_reads() is not None:
            if rows is plan.seq_rows or rows is plan.visible:  # the plan's own: once a step
                index = self.shared("read_index", rows, lambda: read_index(plan.read_rows, rows))
            else:
                index = read_index(plan.read_rows, rows)
            return self.cache.gather(key, plan.read_rows), index
        return self.cache.rows(key), rows

    def arena_reads(self, key: str, plan: CompressionPlan):
        """The index readers' arguments: :meth:`arena_rows` of ``plan.seq_rows``, then
        ``plan.q_seq`` and ``plan.visible_count``."""
        return *self.arena_rows(key, plan, plan.seq_rows), plan.q_seq, plan.visible_count

    def record_tap(self, layer_id: int, streams: torch.Tensor) -> None:
        """Keep the DSpark tap of ``layer_id``: the mean over the streams, fp32 ``[T, D]``."""
        if layer_id in self.tap_layers:
            self.taps[layer_id] = streams.float().mean(1)

    def keys_of(self, x: torch.Tensor) -> torch.Tensor:
        """The rows a layer's KV, compressed entries and compressor state come from: ``x``, or
        under context parallelism the whole step's rows (gathered once per attention input)."""
        if self.gather_keys is None:
            return x
        if self._gathered is None or self._gathered[0] is not x:
            self._gathered = (x, self.gather_keys(x))
        return self._gathered[1]

    def release_keys(self) -> None:
        """Drop the gathered rows of the last attention input (their layer is done)."""
        self._gathered = None

    def positions_of_keys(self) -> torch.Tensor:
        return self.positions if self.key_positions is None else self.key_positions

    def angles_of_keys(self, compressed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.angles if self.key_angles is None else self.key_angles)[compressed]

    def entry_angles(self, plan: CompressionPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the compressed table at ``plan``'s entry positions (once a step)."""
        positions = plan.emit_positions
        return self.shared(
            "entry_angles", positions, lambda: RopeTables.angles(self.rope.compress, positions)
        )
