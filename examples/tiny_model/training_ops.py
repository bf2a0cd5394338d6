"""Training twins of reference ops (and of the MoE loop) whose GPU cost is pathological.

- ``sparse_mqa_sink`` (gather twin, here): the reference gathers ``kv[indices]`` by advanced
  indexing, whose backward is an ``index_put_`` with accumulation that CUDA runs as a sort and
  a serial walk over each run of duplicate indices (every key row is listed by up to
  ``window + index_topk`` ~ 640 queries). This twin computes the same forward values in the
  same order of operations but gathers with ``index_select``, whose backward is an
  ``index_add_`` (atomic adds on CUDA).
- ``sparse_mqa_sink`` (dense twin, :mod:`dense_attention`): given the training batch's
  :class:`~dense_attention.SequenceBlocks`, per-sequence dense matmuls with a log-count mask
  (no gather, no scatter in the backward); calls whose shapes are not that layout use the
  gather twin.
- ``MoE.forward`` (:func:`grouped_moe_forward`): the reference loops over the experts present
  with one ``nonzero`` (a host sync) each; the twin sorts the (token, slot) pairs by expert
  once, reads the per-expert counts with one sync, and runs each expert on its contiguous
  slice. Same math: each expert sees the same rows, each token's routed outputs are summed
  in fp32 into a zero row (two terms: the order cannot change the sum).

``with training_ops(blocks, model=model) as dense: ...`` swaps the twins into the op registry's
reference slot and onto the model's MoE modules for the duration (the model code is unchanged
and still calls ``deepinfer.kernels.sparse_mqa_sink``); training runs on the reference backend
(``deepinfer.kernels.set_accelerator("cpu")``). ``dense`` is the
:class:`~dense_attention.DenseAttention` in use (None without ``blocks``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator

import torch

from deepinfer.kernels import registry

from .dense_attention import DenseAttention, SequenceBlocks


def sparse_mqa_sink(q: torch.Tensor, kv, indices: torch.Tensor, sink: torch.Tensor, scale: float):
    """The reference contract (q ``[T, H, D]``, kv ``[M, D]`` or a sequence of sources,
    indices ``[T, K]`` with -1 holes, sink ``[H]``) -> ``[T, H, D]``; only the gather
    differs (a differentiable ``index_select`` over the sources joined)."""
    kv = joined(kv)
    valid = indices >= 0
    rows = indices.clamp(min=0).reshape(-1).long()
    gathered = kv.index_select(0, rows).view(*indices.shape, kv.shape[-1]).float()
    logits = torch.einsum("thd,tkd->thk", q.float(), gathered) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink_logit = sink.float()[None, :, None].expand(q.shape[0], -1, 1)
    peak = torch.maximum(logits.amax(-1, keepdim=True), sink_logit)
    probs = torch.exp(logits - peak)
    denom = probs.sum(-1, keepdim=True) + torch.exp(sink_logit - peak)
    out = torch.einsum("thk,tkd->thd", probs / denom, gathered)
    return out.to(q.dtype)


def joined(kv) -> torch.Tensor:
    """``kv`` as one tensor: the op's KV sources concatenated (training keeps their grads)."""
    return kv if isinstance(kv, torch.Tensor) else torch.cat(tuple(kv))


TWINS = {"sparse_mqa_sink": sparse_mqa_sink}


def grouped_moe_forward(
    moe, x: torch.Tensor, input_ids: torch.Tensor, positions=None, image_mask=None
) -> torch.Tensor:
    """``MoE.forward`` with one host sync: x ``[T, D]`` -> ``[T, D]`` (routed experts summed
    in fp32, plus the shared expert), the reference's values. ``positions`` only matter under
    expert parallelism, which training does not use."""
    weights, ids = moe.gate(x, input_ids, image_mask)  # [T, k] fp32, [T, k] int64
    num_experts = len(moe.experts)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # the one sync
    token_of_pair = order.div(ids.shape[1], rounding_mode="floor")
    rows = x.index_select(0, token_of_pair)
    route = weights.reshape(-1).index_select(0, order)
    outputs = []
    for expert, part, part_route, count in zip(
        moe.experts, rows.split(counts), route.split(counts), counts
    ):
        if count:
            outputs.append(expert(part, part_route).float())
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if outputs:
        out = out.index_add(0, token_of_pair, torch.cat(outputs))
    return (out + moe.shared_experts(x).float()).to(x.dtype)


@contextlib.contextmanager
def moe_twins(model: torch.nn.Module) -> Iterator[int]:
    """Run every ``MoE`` module of ``model`` with :func:`grouped_moe_forward` inside the block
    (an instance attribute shadows the class's ``forward``); yields how many were swapped."""
    from deepinfer.engine.model.moe import MoE

    swapped = [m for m in model.modules() if isinstance(m, MoE)]
    try:
        for m in swapped:
            m.forward = functools.partial(grouped_moe_forward, m)
        yield len(swapped)
    finally:
        for m in swapped:
            m.__dict__.pop("forward", None)


@contextlib.contextmanager
def training_ops(
    blocks: SequenceBlocks | None = None,
    *,
    model: torch.nn.Module | None = None,
    verify: bool = False,
) -> Iterator[DenseAttention | None]:
    """Use the training twins inside the ``with`` block: the gather twin of
    ``sparse_mqa_sink``, or with ``blocks`` the dense twin (gather for other shapes;
    ``verify``: see :class:`~dense_attention.DenseAttention`); with ``model`` its MoE twin."""
    twins: dict = dict(TWINS)
    dense = None
    if blocks is not None:
        dense = DenseAttention(blocks, sparse_mqa_sink, verify=verify)
        twins["sparse_mqa_sink"] = dense
    saved = {name: registry.OPS[name] for name in twins}
    with contextlib.ExitStack() as stack:
        if model is not None:
            stack.enter_context(moe_twins(model))
        try:
            for name, twin in twins.items():
                registry.OPS[name] = dataclasses.replace(saved[name], reference=twin)
            yield dense
        finally:
            registry.OPS.update(saved)
