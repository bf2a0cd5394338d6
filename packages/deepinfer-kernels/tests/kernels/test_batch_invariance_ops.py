"""Every op of ``deepinfer.kernels`` under ``DEEPINFER_BATCH_INVARIANT=1``: one row alone is
bitwise the same row inside batches of 1, 7, 64 and 1,000 rows with random neighbours (and
wider ``-1`` padding of index lists), for each small conformance case of the op. On the CPU
reference backend here; the same checks run the NVIDIA kernels with the ``gpu`` marker."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from deepinfer import kernels as K
from deepinfer.kernels.invariant import ROW_WISE
from deepinfer.kernels.testing import CASES
from deepinfer.kernels.testing.cases.indexer import per_row
from deepinfer.kernels.testing.invariance import RowArgs, case_rows, check_rows

# Per op: the arguments that are per token (dim 0). Ops missing here and from NOT_PER_TOKEN
# fail test_every_op_is_checked, so a new op must say how its rows are checked.
ROW_ARGS: dict[str, RowArgs] = {
    "apply_rope": RowArgs(("x", "cos", "sin")),
    "apply_token_bitmask": RowArgs(("logits", "bitmask")),
    "candidate_block_mask": RowArgs(("scores", "visible_count")),
    "compress_gather_pool": RowArgs(("rows",)),
    "compress_pool": RowArgs(("kv", "score")),
    "engram_embedding_lookup": RowArgs(("row_ids",)),
    "engram_gate": RowArgs(("hidden", "key", "value", "mask")),
    "engram_hash": RowArgs(("ngram_ids",)),
    "fp4_moe_experts": RowArgs(("x", "topk_weights", "topk_ids")),
    "fp4_sim": RowArgs(("x",)),
    "fp8_act_quant": RowArgs(("x",)),
    "fp8_gemm_nt": RowArgs(("a", "a_scale")),
    "fp8_sim": RowArgs(("x",)),
    "fused_add_rms_norm": RowArgs(("x", "residual")),
    "gelu": RowArgs(("x",)),
    "grouped_linear": RowArgs(("x",)),
    "gumbel_sample": RowArgs(("logits", "temperature", "cutoff", "seeds", "positions")),
    "hadamard_rotate": RowArgs(("x",)),
    "join_index_lists": RowArgs(("first", "second")),
    "hc_collapse": RowArgs(("h", "pre")),
    "hc_expand": RowArgs(("f", "h", "post", "comb")),
    "hc_head_coefficients": RowArgs(("x",)),
    "hc_mix_coefficients": RowArgs(("x",)),
    "hc_pre": RowArgs(("x", "collapse_pre")),
    "indexer_scores": RowArgs(("q", "weights", "candidates"), "candidates", column_output=True),
    "linear": RowArgs(("x",)),
    "linears": RowArgs(("x",)),
    "pack_rows": RowArgs(("x",)),
    "rms_norm": RowArgs(("x",)),
    "rope_rotate_half": RowArgs(("x", "cos", "sin")),
    "route_hash": RowArgs(("logits", "ids")),
    "route_topk": RowArgs(("logits",)),
    "select_topk": RowArgs(("scores", "candidates")),
    "silu_mul": RowArgs(("gate", "up")),
    "sparse_mqa_sink": RowArgs(("q", "indices"), "indices"),
    "swiglu_clamped": RowArgs(("gate", "up")),
    "top_k_top_p_min_p_cutoff": RowArgs(("logits", "temperature", "top_k", "top_p", "min_p")),
    "top_k_top_p_min_p_sample": RowArgs(
        ("logits", "temperature", "top_k", "top_p", "min_p", "seeds", "positions")
    ),
    "unpack_rows": RowArgs(("rows",)),
}


def _scores_of_rows(q, weights, keys, candidates):
    return K.indexer_scores(q, weights, keys, *per_row(candidates))


def _topk_of_rows(scores, candidates, k):
    return K.select_topk(scores, *per_row(candidates)[:2], k)


def _each_query_its_list(args):
    """An indexer op's per-sequence lists as each query's own ``[T, C]`` list (its rows)."""
    *head, seq_rows, q_seq, counts = args
    cols = torch.arange(seq_rows.shape[1], device=seq_rows.device)
    return (*head, seq_rows[q_seq].masked_fill(cols >= counts[:, None], -1))


def _list_of_topk(args):
    scores, seq_rows, q_seq, k = args
    return scores, seq_rows[q_seq], k


# Ops taking each sequence's list once, checked as the op over each query's own list (every
# row its own sequence): (that call, the case's inputs in its form).
PER_ROW_FORM = {
    "indexer_scores": (_scores_of_rows, _each_query_its_list),
    "select_topk": (_topk_of_rows, _list_of_topk),
}

# Ops whose rows are not tokens of a batch, and why.
NOT_PER_TOKEN = {
    "fp4_dequant": "weights, at load time",
    "fp4_quant": "weights, at load time",
    "fp8_block_dequant": "weights, at load time",
    "fp8_block_quant": "weights, at load time (a scale spans 128 rows by the format)",
    "patch_unfold": "one image's patches (rows are pixels of that image)",
    "vision_attention": "attention among one image's patches",
    "write_rows": "stores pack_rows's bytes (checked per row above) at given rows of a cache",
    "write_state_rows": "copies rows, no arithmetic",
}

# On the CPU, ops the flag runs row by row (ROW_WISE) stop at 64 rows: each row is its own
# call there, so 1,000 would only repeat it slowly; the MoE reference stops at 7 (it
# dequantises every expert for each row).
COSTLY = {"fp4_moe_experts"}

SIZES = (1, 7, 64, 1000)
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


@pytest.fixture(scope="module", autouse=True)
def _threads():
    """Several threads even on a small machine: torch splits a reduction across threads once
    a tensor is big enough, which is one way a row's result comes to depend on the batch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(threads)


def _as_rows(case):
    """(the case in the form its rows are checked in, the call that takes that form)."""
    if case.op not in PER_ROW_FORM:
        return case, getattr(K, case.op)
    call, convert = PER_ROW_FORM[case.op]

    def make(gen, device):
        args, kwargs = case.make_inputs(gen, device)
        return convert(args), kwargs

    return dataclasses.replace(case, make_inputs=make), call


def _rows_per_call(case) -> int:
    case, call = _as_rows(case)
    args, kwargs = case.make_inputs(torch.Generator().manual_seed(0), torch.device("cpu"))
    bound = inspect.signature(call).bind(*args, **kwargs).arguments
    return bound[ROW_ARGS[case.op].rows[0]].shape[0]


def _small_cases():
    """Per op in ROW_ARGS, the small conformance case with the most rows per call (its other
    cases vary shapes and dtypes the row-by-row split does not depend on)."""
    best = {}
    for c in CASES:
        if c.scale == "small" and c.op in ROW_ARGS:
            rows = _rows_per_call(c)
            if c.op not in best or rows > best[c.op][0]:
                best[c.op] = (rows, c)
    return [c for _, c in best.values()]


def test_every_op_is_checked():
    missing = sorted(set(K.OPS) - set(ROW_ARGS) - set(NOT_PER_TOKEN))
    assert not missing, f"ops with no batch-invariance check: {missing} (add them to ROW_ARGS)"
    assert {c.op for c in _small_cases()} == set(ROW_ARGS) & set(K.OPS)


def _check(case, device, sizes):
    spec = ROW_ARGS[case.op]
    case, op = _as_rows(case)
    shared, rows = case_rows(case, spec, op, max(sizes), device)
    check_rows(
        op, shared, rows, sizes, str(case), index=spec.index, column_output=spec.column_output
    )


@pytest.mark.parametrize("case", _small_cases(), ids=str)
def test_row_alone_equals_row_in_batch_cpu(case):
    sizes = SIZES[:2] if case.op in COSTLY else SIZES[:3] if case.op in ROW_WISE else SIZES
    _check(case, torch.device("cpu"), sizes)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", _small_cases(), ids=str)
def test_row_alone_equals_row_in_batch_cuda(case):
    _check(case, torch.device("cuda"), SIZES)
