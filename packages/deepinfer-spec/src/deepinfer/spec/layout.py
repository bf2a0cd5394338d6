"""Draft layouts: padded ``[B, K]`` batches and flat varlen rows with ``cu_*`` offsets.

The acceptance functions work on padded batches: request ``b`` has ``num_draft_tokens[b] <= K``
drafts in ``draft_tokens[b, :num_draft_tokens[b]]``; entries past that count are ignored (by
convention filled with :data:`PAD_TOKEN_ID`). The target verifies ``num_draft_tokens[b] + 1``
rows per request: row ``j`` is the target's prediction for the position of draft ``j`` (row 0 is
computed from the last committed token), and row ``num_draft_tokens[b]`` gives the bonus token.

The engine's verify batch is flat ("one row per query token", no padding): requests are
concatenated and ``cu_num_draft_tokens[B + 1]`` (int64, ``cu[0] = 0``) marks where each request's
drafts start. The verify rows of request ``b`` are then
``cu_num_verify_tokens[b] : cu_num_verify_tokens[b + 1]`` with
``cu_num_verify_tokens = cu_num_draft_tokens + arange(B + 1)``. The helpers here move values
between the two layouts with gathers only (no host synchronisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD_TOKEN_ID = -1
"""Token id marking an unused draft slot or output slot; never accepted."""


def cu_from_counts(counts: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sums ``[B + 1]`` int64 (``out[0] = 0``) of per-request counts ``[B]``."""
    zero = torch.zeros(1, dtype=torch.int64, device=counts.device)
    return torch.cat([zero, torch.cumsum(counts.to(torch.int64), dim=0)])


def counts_from_cu(cu: torch.Tensor) -> torch.Tensor:
    """Per-request counts ``[B]`` int64 from offsets ``[B + 1]``."""
    return (cu[1:] - cu[:-1]).to(torch.int64)


def cu_num_verify_tokens(cu_num_draft_tokens: torch.Tensor) -> torch.Tensor:
    """Offsets ``[B + 1]`` int64 of the verify rows: each request verifies its drafts plus one."""
    steps = torch.arange(cu_num_draft_tokens.numel(), device=cu_num_draft_tokens.device)
    return cu_num_draft_tokens.to(torch.int64) + steps


def varlen_to_padded(
    flat: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int, fill: float | int
) -> torch.Tensor:
    """Scatter flat rows into a padded batch.

    flat: ``[T, *rest]`` rows of all requests, concatenated; cu_seqlens: ``[B + 1]`` int64
    offsets into ``flat``; max_len: ``K``, at least the longest request (checked only when the
    offsets are on the CPU, to avoid a device sync). Returns ``[B, K, *rest]`` of ``flat``'s
    dtype, with ``fill`` past each request's length.
    """
    if max_len < 0:
        raise ValueError(f"max_len={max_len}: expected a non-negative int")
    lengths = counts_from_cu(cu_seqlens)
    if lengths.device.type == "cpu" and lengths.numel() and int(lengths.max()) > max_len:
        raise ValueError(
            f"max_len={max_len}: expected at least the longest request ({int(lengths.max())})"
        )
    shape = (lengths.numel(), max_len, *flat.shape[1:])
    if flat.shape[0] == 0:
        return torch.full(shape, fill, dtype=flat.dtype, device=flat.device)
    slots = torch.arange(max_len, device=flat.device)
    is_valid = slots[None, :] < lengths[:, None]
    index = (cu_seqlens[:-1, None] + slots[None, :]).clamp(max=flat.shape[0] - 1)
    gathered = flat[index]
    mask = is_valid.reshape(*is_valid.shape, *([1] * (flat.dim() - 1)))
    return torch.where(mask, gathered, torch.full_like(gathered, fill))


def padded_to_varlen(padded: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenate the first ``lengths[b]`` rows of each request: ``[B, K, *rest]`` -> ``[T, *rest]``.

    ``T = lengths.sum()``, so this one synchronises when ``lengths`` lives on a device.
    """
    slots = torch.arange(padded.shape[1], device=padded.device)
    is_valid = slots[None, :] < lengths.to(padded.device)[:, None]
    return padded[is_valid]


def pad_drafts(
    flat_draft_tokens: torch.Tensor, cu_num_draft_tokens: torch.Tensor, max_drafts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat drafts ``[T]`` int -> padded ``draft_tokens`` ``[B, K]`` int64 (``PAD_TOKEN_ID``
    past each count) and ``num_draft_tokens`` ``[B]`` int64, ``K = max_drafts``."""
    padded = varlen_to_padded(
        flat_draft_tokens.to(torch.int64), cu_num_draft_tokens, max_drafts, PAD_TOKEN_ID
    )
    return padded, counts_from_cu(cu_num_draft_tokens)


def pad_verify_rows(
    flat_rows: torch.Tensor, cu_num_draft_tokens: torch.Tensor, max_drafts: int, fill: float | int
) -> torch.Tensor:
    """Flat verify rows ``[T + B, *rest]`` (request ``b`` owns ``num_draft_tokens[b] + 1``
    consecutive rows) -> padded ``[B, K + 1, *rest]`` with ``fill`` past each request's rows."""
    cu_rows = cu_num_verify_tokens(cu_num_draft_tokens)
    return varlen_to_padded(flat_rows, cu_rows, max_drafts + 1, fill)


@dataclass(frozen=True)
class VerifyRows:
    """The flat target input of one verify step: per request ``[anchor, drafts[:n_b]]``.

    input_ids: ``[T]`` int64 tokens, ``T = B + sum(n_b)``.
    positions: ``[T]`` int64 absolute positions (the anchor's, then one more per draft).
    request_index: ``[T]`` int64, the request each row belongs to.
    cu_num_verify_tokens: ``[B + 1]`` int64 row offsets per request.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    request_index: torch.Tensor
    cu_num_verify_tokens: torch.Tensor


def build_verify_rows(
    anchor_tokens: torch.Tensor,
    anchor_positions: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_verify_drafts: torch.Tensor,
    num_rows: int | None = None,
) -> VerifyRows:
    """Lay out ``[anchor, draft_0 .. draft_{n_b - 1}]`` per request as flat rows.

    anchor_tokens, anchor_positions: ``[B]`` int — each request's last committed token and its
    absolute position (so draft ``j`` sits at ``anchor_positions + 1 + j``, the ``positions``
    the acceptance functions take). draft_tokens: ``[B, K]`` int; num_verify_drafts: ``[B]``
    int, ``<= K``. num_rows: the exact total ``B + sum(num_verify_drafts)`` when the caller
    knows it (the planner does), which keeps this free of host synchronisation; computed
    otherwise. Padding rows for a captured graph are the caller's to append.
    """
    device = draft_tokens.device
    cu_rows = cu_num_verify_tokens(cu_from_counts(num_verify_drafts.to(device)))
    if num_rows is None:
        num_rows = int(cu_rows[-1])
    rows = torch.arange(num_rows, device=device)
    request_index = torch.searchsorted(cu_rows[1:], rows, right=True)
    offset = rows - cu_rows[request_index]
    draft_slot = (offset - 1).clamp(min=0, max=max(draft_tokens.shape[1] - 1, 0))
    if draft_tokens.shape[1] == 0:
        from_drafts = anchor_tokens.to(torch.int64)[request_index]
    else:
        from_drafts = draft_tokens.to(torch.int64)[request_index, draft_slot]
    input_ids = torch.where(offset == 0, anchor_tokens.to(torch.int64)[request_index], from_drafts)
    positions = anchor_positions.to(torch.int64)[request_index] + offset
    return VerifyRows(input_ids, positions, request_index, cu_rows)


__all__ = [
    "PAD_TOKEN_ID",
    "VerifyRows",
    "build_verify_rows",
    "counts_from_cu",
    "cu_from_counts",
    "cu_num_verify_tokens",
    "pad_drafts",
    "pad_verify_rows",
    "padded_to_varlen",
    "varlen_to_padded",
]
