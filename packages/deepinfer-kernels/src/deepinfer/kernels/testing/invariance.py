"""Batch-invariance check of one op: a row's result alone vs inside batches of random rows.

Used by every package whose code runs per token under ``DEEPINFER_BATCH_INVARIANT=1`` (the
kernels' ops, the sampler, the engine's LM head): ``check_rows`` runs batches of random rows and
asserts that several rows of each (first, last, spread between) are ``torch.equal`` to the
same rows run alone. Index-list arguments are padded with ``-1`` to
a wider batch than the row needs, as a real batch pads to its longest list.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepinfer.kernels.testing import Case

Row = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RowArgs:
    """rows: the arguments indexed by token along dim 0. index: a ``[T, C]`` ``-1``-padded
    index-list argument (the batch pads it wider). column_output: the output is ``[T, C]``
    per index column (compared on the row's own columns)."""

    rows: tuple[str, ...]
    index: str | None = None
    column_output: bool = False


def _as_tuple(result: Any) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def assert_rows_equal(alone: Any, batched: Any, at: int, what: str, columns: int | None = None):
    """Every output of ``alone`` (one row) is bitwise row ``at`` of ``batched``."""
    for i, (a, b) in enumerate(zip(_as_tuple(alone), _as_tuple(batched), strict=True)):
        b = b[at : at + 1]
        if columns is not None:
            b = b[:, :columns]
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().nan_to_num(0.0).max().item()
            raise AssertionError(f"{what}: output {i} differs from the row alone (max {diff:.3g})")


def positions_in_batch(n: int, count: int = 8) -> list[int]:
    """Which rows of a batch of ``n`` are checked: the first, the last and ``count - 2`` spread
    between (a row's luck with vector lanes or thread chunks varies with where it sits)."""
    if n <= count:
        return list(range(n))
    return sorted({0, n - 1, *((n * (2 * j + 1)) // (2 * count) for j in range(count - 2))})


def check_rows(
    fn: Callable[..., Any],
    shared: dict[str, Any],
    rows: Sequence[Row],
    sizes: Sequence[int],
    what: str,
    *,
    index: str | None = None,
    column_output: bool = False,
    extra_padding: int = 5,
) -> None:
    """For each size ``n`` in ``sizes``, ``fn(**shared, **batch)`` over ``rows[:n]`` gives, at
    each row of :func:`positions_in_batch`, exactly ``fn(**shared, **row)`` of that row alone
    (needs ``len(rows) >= max(sizes)``). Index lists are padded ``extra_padding`` wider than
    the batch's longest, as a bigger batch pads them."""
    alone: dict[int, Any] = {}
    for n in sizes:
        if len(rows) < n:
            raise ValueError(f"check_rows: {n} rows wanted, {len(rows)} made")
        members = rows[:n]
        batch = {}
        for key in members[0]:
            parts = [m[key] for m in members]
            if key == index:
                wide = max(p.shape[1] for p in parts) + extra_padding
                parts = [
                    torch.nn.functional.pad(p, (0, wide - p.shape[1]), value=-1) for p in parts
                ]
            batch[key] = torch.cat(parts, dim=0)
        batched = fn(**shared, **batch)
        for at in positions_in_batch(n):
            if at not in alone:
                alone[at] = fn(**shared, **rows[at])
            columns = rows[at][index].shape[1] if column_output else None
            assert_rows_equal(alone[at], batched, at, f"{what}: row {at} of {n}", columns)


def case_rows(
    case: Case, spec: RowArgs, fn_signature: Callable, count: int, device: torch.device
) -> tuple[dict[str, Any], list[Row]]:
    """``count`` single rows of ``case`` (fresh inputs per seed, split along dim 0) and the
    shared arguments of its first seed, as keywords of ``fn_signature``."""
    signature = inspect.signature(fn_signature)
    shared: dict[str, Any] | None = None
    rows: list[Row] = []
    seed = 0
    while len(rows) < count:
        gen = torch.Generator().manual_seed(1000 + seed)
        args, kwargs = case.make_inputs(gen, device)
        bound = dict(signature.bind(*args, **kwargs).arguments)
        present = [k for k in spec.rows if bound.get(k) is not None]
        if shared is None:
            shared = {k: v for k, v in bound.items() if k not in spec.rows}
        num = bound[spec.rows[0]].shape[0]
        for k in present:
            if bound[k].shape[0] != num:
                raise ValueError(
                    f"{case}: row argument {k} has {bound[k].shape[0]} rows, not {num}"
                )
        for t in range(num):
            rows.append({k: bound[k][t : t + 1] for k in present})
        seed += 1
    return shared, rows[:count]


__all__ = ["RowArgs", "assert_rows_equal", "case_rows", "check_rows", "positions_in_batch"]
