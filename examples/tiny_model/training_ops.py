"""Training twins of reference ops whose backward is pathologically slow on a GPU.

``sparse_mqa_sink``'s reference gathers ``kv[indices]`` by advanced indexing. Its backward is
an ``index_put_`` with accumulation, which CUDA runs as a sort followed by a serial walk over
each run of duplicate indices. In a training batch every key row is listed by up to
``window + index_topk`` queries (about 640 here), so that backward dominates the step. The twin
here computes the same forward values in the same order of operations, but gathers with
``index_select``, whose backward is an ``index_add_`` (atomic adds on CUDA).

``with training_ops(): ...`` swaps the twins into the op registry's reference slot for the
duration (the model code is unchanged and still calls ``deepinfer.kernels.sparse_mqa_sink``);
training runs on the reference backend (``deepinfer.kernels.set_accelerator("cpu")``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch

from deepinfer.kernels import registry


def sparse_mqa_sink(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """The reference contract (q ``[T, H, D]``, kv ``[M, D]``, indices ``[T, K]`` with -1
    holes, sink ``[H]``) -> ``[T, H, D]``; only the gather differs."""
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


TWINS = {"sparse_mqa_sink": sparse_mqa_sink}


@contextlib.contextmanager
def training_ops() -> Iterator[None]:
    """Use the training twins as the ops' references inside the ``with`` block."""
    saved = {name: registry.OPS[name] for name in TWINS}
    try:
        for name, twin in TWINS.items():
            registry.OPS[name] = dataclasses.replace(saved[name], reference=twin)
        yield
    finally:
        registry.OPS.update(saved)
