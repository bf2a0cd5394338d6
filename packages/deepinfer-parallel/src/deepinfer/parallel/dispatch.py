"""MoE token movement for expert parallelism: dispatch rows to expert ranks, combine them back.

Physical expert slots are numbered globally; rank ``r`` holds slots
``[r * slots_per_rank, (r + 1) * slots_per_rank)``. :func:`dispatch` sends each (token, k) pair
to the rank holding its slot; :func:`combine` brings the expert outputs home and sums each
token's ``K`` contributions in a fixed order (k = 0..K-1, fp32), so a token's output never
depends on which other tokens or ranks share the step (batch invariant).

The row counts are exchanged first with one small all-to-all and read on the host: the
variable-split all-to-all needs its sizes there. That read is the one host sync of a dispatch;
:func:`combine` reuses the counts and does not sync. Every rank calls both in the same order,
a rank with no tokens too (``T = 0``, empty tensors), so the collectives always match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.parallel.comm import Communicator


@dataclass(frozen=True)
class DispatchHandle:
    """What :func:`combine` needs to undo a :func:`dispatch`.

    ``send_splits[j]``: rows this rank sent to rank ``j``; ``recv_splits[j]``: rows it received
    from rank ``j``. ``order`` [sum(send_splits)] int64: the flat (token * K + k) index of each
    sent row, in send order (stably sorted by destination rank, so by token then k within a
    rank); padding pairs (slot -1) are left out.
    """

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    order: torch.Tensor
    num_tokens: int
    top_k: int


def _check_dispatch(hidden: torch.Tensor, global_slot: torch.Tensor, slots_per_rank: int) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected [T, D], got shape {tuple(hidden.shape)}")
    if global_slot.dim() != 2 or global_slot.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"global_slot: expected [T={hidden.shape[0]}, K], got shape {tuple(global_slot.shape)}"
        )
    if global_slot.dtype != torch.int64:
        raise ValueError(f"global_slot: expected dtype int64, got {global_slot.dtype}")
    if global_slot.shape[1] < 1:
        raise ValueError("global_slot: expected K >= 1 slots per token, got 0")
    if slots_per_rank < 1:
        raise ValueError(f"slots_per_rank: expected >= 1, got {slots_per_rank}")


def _exchange_counts(send_counts: torch.Tensor, comm: Communicator) -> tuple[list[int], list[int]]:
    """Row counts per destination [W + 1] (last: padding) -> (send, recv splits) on the host."""
    world_size = comm.world_size
    recv_counts = torch.empty_like(send_counts[:world_size])
    comm.all_to_all_single(recv_counts, send_counts[:world_size])
    both = torch.cat([send_counts[:world_size], recv_counts]).tolist()  # the one host sync
    return both[:world_size], both[world_size:]


def dispatch(
    hidden: torch.Tensor, global_slot: torch.Tensor, slots_per_rank: int, comm: Communicator
) -> tuple[torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send each token's hidden row to the ranks of its ``K`` expert slots.

    Args:
        hidden: [T, D], any dtype; ``T`` may be 0.
        global_slot: [T, K] int64, physical slots in ``[0, slots_per_rank * world_size)``;
            repeats are allowed (each (token, k) pair travels on its own); -1 marks a padding
            pair, which is not sent and adds nothing in :func:`combine`.
        slots_per_rank: physical expert slots each rank holds.
    Returns:
        received: [R, D] ``hidden.dtype``, the rows sent here, grouped by source rank, then by
            source token, then k.
        received_local_slot: [R] int64, each row's slot on this rank (``global % slots_per_rank``).
        handle: for :func:`combine`.
    """
    _check_dispatch(hidden, global_slot, slots_per_rank)
    num_tokens, top_k = global_slot.shape
    flat_slot = global_slot.reshape(-1)
    # padding pairs (slot -1) go to a virtual rank W, sorted last and never sent
    dest = torch.div(flat_slot, slots_per_rank, rounding_mode="floor")
    dest = torch.where(flat_slot >= 0, dest, comm.world_size)
    send_counts = torch.zeros(comm.world_size + 1, dtype=torch.int64, device=hidden.device)
    send_counts.scatter_add_(0, dest, torch.ones_like(dest))
    send_splits, recv_splits = _exchange_counts(send_counts, comm)
    order = torch.sort(dest, stable=True).indices[: sum(send_splits)]

    num_received = sum(recv_splits)
    received = hidden.new_empty((num_received, hidden.shape[1]))
    comm.all_to_all_single(
        received, hidden.index_select(0, order // top_k), recv_splits, send_splits
    )
    received_local_slot = flat_slot.new_empty(num_received)
    comm.all_to_all_single(
        received_local_slot, (flat_slot % slots_per_rank)[order], recv_splits, send_splits
    )
    handle = DispatchHandle(tuple(send_splits), tuple(recv_splits), order, num_tokens, top_k)
    return received, received_local_slot, handle


def dispatch_pairs(
    values: torch.Tensor, handle: DispatchHandle, comm: Communicator
) -> torch.Tensor:
    """Send a per-(token, k) value along the routes of ``handle`` (e.g. each pair's router
    weight, for experts that apply it before their down projection).

    Args:
        values: [T, K, ...] any dtype, the value of each (token, k) pair.
    Returns:
        [R, ...], row ``i`` the value of the pair whose hidden row is ``received[i]``.
    """
    num_tokens, top_k = handle.num_tokens, handle.top_k
    if tuple(values.shape[:2]) != (num_tokens, top_k):
        raise ValueError(
            f"values: expected [{num_tokens}, {top_k}, ...], got {tuple(values.shape)}"
        )
    flat = values.reshape(num_tokens * top_k, *values.shape[2:])
    received = flat.new_empty((sum(handle.recv_splits), *values.shape[2:]))
    comm.all_to_all_single(received, flat[handle.order], handle.recv_splits, handle.send_splits)
    return received


def combine(
    expert_out: torch.Tensor,
    topk_weights: torch.Tensor,
    handle: DispatchHandle,
    comm: Communicator,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Return expert outputs to their tokens and sum them, weighted, in a fixed order.

    Args:
        expert_out: [R, D], row ``i`` the expert output for ``received[i]`` of the dispatch.
        topk_weights: [T, K], any float dtype, the router weight of each (token, k) pair.
        handle: from the matching :func:`dispatch`.
        out_dtype: the result's dtype (None: ``expert_out.dtype``); the rows travel in
            ``expert_out.dtype`` either way, so bf16 outputs summed into fp32 move half the bytes.
    Returns:
        [T, D] ``out_dtype``: ``sum_k topk_weights[t, k] * out[t, k]``, accumulated in fp32 over
        k = 0..K-1, one multiply and one add per step (no fused multiply-add, whose rounding
        could differ between vectorised and scalar paths), then cast.
    """
    num_tokens, top_k = handle.num_tokens, handle.top_k
    if expert_out.dim() != 2 or expert_out.shape[0] != sum(handle.recv_splits):
        raise ValueError(
            f"expert_out: expected [R={sum(handle.recv_splits)}, D], got {tuple(expert_out.shape)}"
        )
    if tuple(topk_weights.shape) != (num_tokens, top_k):
        raise ValueError(
            f"topk_weights: expected [{num_tokens}, {top_k}], got {tuple(topk_weights.shape)}"
        )
    returned = expert_out.new_empty((sum(handle.send_splits), expert_out.shape[1]))
    comm.all_to_all_single(returned, expert_out, handle.send_splits, handle.recv_splits)
    per_pair = returned.new_zeros((num_tokens * top_k, expert_out.shape[1]))
    per_pair[handle.order] = returned
    per_pair = per_pair.view(num_tokens, top_k, expert_out.shape[1])
    weights = topk_weights.float()
    acc = torch.zeros(
        (num_tokens, expert_out.shape[1]), dtype=torch.float32, device=returned.device
    )
    for k in range(top_k):
        acc += per_pair[:, k].float() * weights[:, k, None]
    return acc.to(out_dtype or expert_out.dtype)


def group_by_slot(
    received_local_slot: torch.Tensor, slots_per_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The order that groups received rows by local slot, and the rows per slot; no host sync.

    Args:
        received_local_slot: [R] int64 from :func:`dispatch`, values in ``[0, slots_per_rank)``.
    Returns:
        order: [R] int64, ``received[order]`` has slot 0's rows first, then slot 1's, ...;
            stable, so within a slot rows keep their arrival order (source rank, token, k).
        counts: [slots_per_rank] int64, rows per local slot: a grouped GEMM's group sizes and
            this step's per-expert load for EPLB.
    """
    if received_local_slot.dim() != 1 or received_local_slot.dtype != torch.int64:
        raise ValueError(
            f"received_local_slot: expected [R] int64, got {tuple(received_local_slot.shape)} "
            f"{received_local_slot.dtype}"
        )
    order = torch.sort(received_local_slot, stable=True).indices
    counts = torch.zeros(slots_per_rank, dtype=torch.int64, device=received_local_slot.device)
    counts.scatter_add_(0, received_local_slot, torch.ones_like(received_local_slot))
    return order, counts
