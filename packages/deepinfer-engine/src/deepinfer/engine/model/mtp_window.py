"""Index lists of the DSpark draft stages: the window over main positions plus the draft block.

Each draft stage owns a sliding-window ring in the state slots (``"{layer}.window"``, row of
position ``p`` = ``slot * R + p % R``), like any SWA layer. Two things write it:

- *seeding*: for every position the target processed, the stage's window K=V computed from the
  target's tap hidden states (``main_x``), at that main position;
- *drafting*: the block's own K=V at positions ``p+1 .. p+K`` (``p`` = the last position the
  target processed; slot 0 of the block is the anchor token the target produced after it),
  overwritten by seeding once those positions are verified.

A draft query at ``p+1+i`` attends to the ring rows of main positions ``p-W+1 .. p`` (-1 before
the start) and to *all* ``K`` block rows (bidirectional within the block). With
``R >= W + K`` the block writes never clobber the window the block reads.
"""

from __future__ import annotations

import torch

from deepinfer.engine.model.engram_history import last_writers
from deepinfer.engine.model.metadata import AttentionMetadata


def check_ring(ring_size: int, window: int, block_size: int) -> None:
    if ring_size < window + block_size:
        raise ValueError(
            f"ring_size = {ring_size}: the draft block of {block_size} needs a window ring of "
            f">= sliding_window + block = {window + block_size} rows (CacheLayout.max_draft)"
        )


def draft_metadata(
    last_positions: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    window: int,
    ring_size: int,
    num_slots: int,
    write_slots: torch.Tensor | None = None,
) -> AttentionMetadata:
    """Metadata of a draft step over ``B`` requests, ``B * K`` tokens (request-major).

    last_positions, slots: ``[B]`` int64. ``window_indices [B*K, W + K]`` index rows of
    ``[ring rows of all slots | the step's B*K tokens]``; the block's K=V rows are written to
    the ring at positions ``p+1 .. p+K`` of ``write_slots`` (default ``slots``: a padded
    block's padding requests read a real slot and write the scratch slot).
    """
    check_ring(ring_size, window, block_size)
    device = last_positions.device
    num_requests = last_positions.shape[0]
    base = num_slots * ring_size
    back = torch.arange(window - 1, -1, -1, device=device)
    main_pos = last_positions[:, None] - back[None, :]  # [B, W]
    main_rows = slots[:, None] * ring_size + main_pos.remainder(ring_size)
    main_rows = torch.where(main_pos >= 0, main_rows, torch.full_like(main_rows, -1))
    offsets = torch.arange(block_size, device=device)
    block_rows = base + torch.arange(num_requests, device=device)[:, None] * block_size + offsets
    rows = torch.cat([main_rows, block_rows], dim=1)  # [B, W + K]
    window_indices = rows.repeat_interleave(block_size, dim=0)
    draft_pos = last_positions[:, None] + 1 + offsets  # [B, K]
    writes = slots if write_slots is None else write_slots
    write_dst = writes[:, None] * ring_size + draft_pos.remainder(ring_size)
    return AttentionMetadata(
        num_tokens=num_requests * block_size,
        window_base=base,
        window_indices=window_indices,
        window_write_src=torch.arange(num_requests * block_size, device=device),
        window_write_dst=write_dst.reshape(-1),
    )


def draft_block(
    anchors: torch.Tensor,
    last_positions: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    noise_token_id: int,
    window: int,
    ring_size: int,
    num_slots: int,
    write_slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(token ids ``[B*K]``, positions ``[B*K]``, :func:`draft_metadata`) of a draft block, on
    the inputs' device: block token ``i`` of a request is at ``p + 1 + i``, the anchor first,
    then the noise token."""
    device = anchors.device
    ids = torch.full((anchors.shape[0], block_size), noise_token_id, dtype=torch.long,
                     device=device)  # fmt: skip
    ids[:, 0] = anchors
    positions = last_positions[:, None] + 1 + torch.arange(block_size, device=device)
    md = draft_metadata(last_positions, slots, block_size, window, ring_size, num_slots,
                        write_slots)  # fmt: skip
    return ids.reshape(-1), positions.reshape(-1), md


def seed_rows(
    positions: torch.Tensor, token_slots: torch.Tensor, ring_size: int, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(source token rows, ring rows) of the seeding writes, one pair per token.

    positions, token_slots ``[T]`` int64. Tokens that share a ring row (a chunk longer than the
    ring) all copy the latest position's row, so the write is deterministic and sync-free.
    """
    dst = token_slots * ring_size + positions.remainder(ring_size)
    return last_writers(dst, num_slots * ring_size), dst
