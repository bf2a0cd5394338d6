"""Batch-invariant execution of the reference backend (``DEEPINFER_BATCH_INVARIANT=1``).

The reference ops are plain torch: a matmul over ``M`` rows may pick its blocking (and so its
summation order) from ``M``, a reduction over a padded index list depends on the padded width
(the longest list in the batch), and torch's CPU reductions over a short inner dimension may
be vectorised across rows. In batch-invariant mode the ops listed here run one
row at a time, each row with only its own valid indices, so a row's result is a function of
that row's inputs alone: bitwise identical whatever else is in the batch. Slow, and exact.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class RowSplit:
    """rows: the arguments indexed by token along dim 0; index: the ``[T, C]`` index-list
    argument (or the ``[1, C]`` list ``row_of`` gives a row) whose ``-1`` padding is dropped
    per row, together with the same columns of the ``columns`` arguments; pad_output: for a
    ``[T, C]`` output, the value the dropped columns get back (None: not per column)."""

    rows: tuple[str, ...]
    index: str | None = None
    columns: tuple[str, ...] = ()
    pad_output: float | None = None
    prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # once, before the rows
    # row t's other arguments from the whole call's (after the ``rows`` are sliced), before
    # its index padding is dropped
    row_of: Callable[[dict[str, Any], int], dict[str, Any]] | None = None


def _dequantised_weight(arguments: dict[str, Any]) -> dict[str, Any]:
    """Dequantise a quantised weight once for all rows (the same fp32 values every row would
    compute), instead of once per row."""
    from deepinfer.kernels.reference.linear import dequant_weight

    if arguments.get("scale") is None:
        return arguments
    weight = dequant_weight(arguments["weight"], arguments["scale"], arguments.get("block_size"))
    return {**arguments, "weight": weight.float(), "scale": None, "block_size": None}


def _indexer_row(arguments: dict[str, Any], t: int) -> dict[str, Any]:
    """Query ``t`` of ``indexer_scores`` as a call of its own candidate list: one sequence
    ``[1, C]``, its columns past the count ``-1`` (dropped as padding)."""
    seq_rows, counts = arguments["seq_rows"], arguments["counts"]
    cols = torch.arange(seq_rows.shape[1], device=seq_rows.device)
    row = seq_rows[arguments["q_seq"][t]].masked_fill(cols >= counts[t], -1)[None]
    every = torch.full((1,), row.shape[1], dtype=counts.dtype, device=counts.device)
    return {**arguments, "seq_rows": row, "q_seq": torch.zeros_like(every), "counts": every}


ROW_WISE: dict[str, RowSplit] = {
    "rms_norm": RowSplit(("x",)),
    "fused_add_rms_norm": RowSplit(("x", "residual")),
    "grouped_linear": RowSplit(("x",), prepare=_dequantised_weight),
    "fp8_gemm_nt": RowSplit(("a", "a_scale")),
    "fp4_moe_experts": RowSplit(("x", "topk_weights", "topk_ids", "shared")),
    "hc_mix_coefficients": RowSplit(("x",)),
    "hc_head_coefficients": RowSplit(("x",)),
    "hc_pre": RowSplit(("x", "collapse_pre")),
    "hadamard_rotate": RowSplit(("x",)),
    "compress_pool": RowSplit(("kv", "score")),
    "compress_gather_pool": RowSplit(("rows",)),
    # Small inner reductions (top-k weights, stream sums, per-block amax) may be vectorised
    # across rows by torch's CPU kernels, so even these go row by row.
    "route_topk": RowSplit(("logits",)),
    "route_hash": RowSplit(("logits", "ids")),
    "hc_collapse": RowSplit(("h", "pre")),
    "hc_expand": RowSplit(("f", "h", "post", "comb")),
    # The gate's RMS and dot reduce a short inner dimension, which torch's CPU kernels may
    # vectorise across rows: row by row too.
    "engram_gate": RowSplit(("hidden", "key", "value", "mask")),
    # Not listed: ops whose only reductions are max / sort (the FP8 / FP4 scale of a block,
    # top-k with stable ties, the candidate pre-filter): exact in any order.
    "sparse_mqa_sink": RowSplit(("q", "indices"), index="indices"),
    "indexer_scores": RowSplit(
        ("q", "weights"), index="seq_rows", pad_output=float("-inf"), row_of=_indexer_row
    ),
}


def linear_rowwise(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    block_size: tuple[int, int] | None = None,
    act_quant_group: int | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The reference ``linear`` as one batched matmul of ``T`` independent ``1 x K`` products
    (``bmm`` over a stride-0 weight): every row runs the same-shaped product whatever ``T``."""
    from deepinfer.kernels.reference.linear import linear_operands

    xc, wc = linear_operands(x, weight, scale, block_size, act_quant_group)
    rows = xc.reshape(-1, 1, xc.shape[-1])
    y = torch.bmm(rows, wc.t().expand(rows.shape[0], *wc.t().shape))
    return y.reshape(*x.shape[:-1], wc.shape[0]).to(out_dtype or x.dtype)


def linears_rowwise(x, weights, scales, *, block_size=None, act_quant_group=None,
                    out_dtype=None):  # fmt: skip
    """The reference ``linears``: :func:`linear_rowwise` for each weight."""
    kw = {"block_size": block_size, "act_quant_group": act_quant_group, "out_dtype": out_dtype}
    return tuple(linear_rowwise(x, w, s, **kw) for w, s in zip(weights, scales, strict=True))


def _concat(outputs: list[Any]) -> Any:
    if isinstance(outputs[0], tuple):
        return tuple(_concat(list(parts)) for parts in zip(*outputs))
    return torch.cat(outputs, dim=0)


def _restore_columns(out: torch.Tensor, valid: torch.Tensor, pad: float) -> torch.Tensor:
    full = torch.full((1, valid.shape[0], *out.shape[2:]), pad, dtype=out.dtype, device=out.device)
    full[:, valid] = out
    return full


def call_rowwise(name: str, contract: Callable, impl: Callable, *args: Any, **kwargs: Any) -> Any:
    split = ROW_WISE[name]
    bound = inspect.signature(contract).bind(*args, **kwargs)
    arguments = dict(bound.arguments)
    outs = {k: arguments.pop(k) for k in ("out", "residual_out") if arguments.get(k) is not None}
    num_rows = arguments[split.rows[0]].shape[0]
    if num_rows <= 1 and not split.index:
        return impl(*args, **kwargs)
    if split.prepare is not None:
        arguments = split.prepare(arguments)
    results = []
    for t in range(num_rows):
        row = dict(arguments)
        for key in split.rows:
            if arguments.get(key) is not None:  # optional per-row arguments may be absent
                row[key] = arguments[key][t : t + 1]
        if split.row_of is not None:
            row = split.row_of(row, t)
        valid = None
        if split.index is not None and row[split.index].shape[1] > 0:
            valid = row[split.index][0] >= 0
            if not bool(valid.any()):
                valid = torch.zeros_like(valid)
                valid[0] = True  # keep one (padding) column so shapes stay valid
            for key in (split.index, *split.columns):
                row[key] = row[key][:, valid]
        out = impl(**row)
        if split.pad_output is not None and valid is not None:
            out = _restore_columns(out, valid, split.pad_output)
        results.append(out)
    result = _concat(results)
    for (key, dest), value in zip(outs.items(), result if isinstance(result, tuple) else (result,)):
        dest.copy_(value)
        del key
    return result
