"""Sampling kernels against their references: the conformance kit under TRITON_INTERPRET=1 at
small shapes on CPU, and at real shapes on the GPU (with a speed print against torch)."""

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():  # CPU: the Triton interpreter (set before kernels are imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deepinfer.kernels.testing import cases_for, check_case, patch_triton_interpreter  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
if INTERPRETED:
    patch_triton_interpreter()

from deepinfer.kernels_nvidia import sampling, sampling_cutoff, sampling_draw  # noqa: E402
from deepinfer.kernels_nvidia.registry import IMPLEMENTATIONS  # noqa: E402

CUTOFF = "top_k_top_p_min_p_cutoff"
OPS = ("apply_token_bitmask", CUTOFF, "gumbel_sample")
needs_gpu = pytest.mark.skipif(
    INTERPRETED or not torch.cuda.is_available(), reason="needs an NVIDIA GPU (and no interpreter)"
)


def test_every_sampling_op_has_a_kernel():
    assert sampling.gumbel_sample is IMPLEMENTATIONS["gumbel_sample"]
    assert sampling_cutoff.top_k_top_p_min_p_cutoff is IMPLEMENTATIONS["top_k_top_p_min_p_cutoff"]
    assert sampling_draw.top_k_top_p_min_p_sample is IMPLEMENTATIONS["top_k_top_p_min_p_sample"]
    assert set(OPS) <= set(IMPLEMENTATIONS)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter run")
@pytest.mark.parametrize(
    "case", [c for c in cases_for(OPS, "small") if c.op != CUTOFF], ids=str
)  # the cutoff's own file runs it with small buffers (its default sorts 1024 values per row)
def test_conformance_small_interpreted(case):
    for seed in range(2):
        check_case(IMPLEMENTATIONS[case.op], case, device="cpu", seed=seed)


@pytest.mark.skipif(not INTERPRETED, reason="interpreter run")
@pytest.mark.parametrize("case", cases_for(["gumbel_sample"], "small"), ids=str)
def test_gumbel_with_fused_pick_small_interpreted(case):
    impl = functools.partial(sampling.gumbel, fused_pick=True)
    for seed in range(2):
        check_case(impl, case, device="cpu", seed=seed)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", cases_for(["gumbel_sample"], "real"), ids=str)
def test_gumbel_with_fused_pick_real_gpu(case):
    check_case(functools.partial(sampling.gumbel, fused_pick=True), case, device="cuda", seed=5)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("case", cases_for(OPS, "real"), ids=str)
def test_conformance_real_gpu(case):
    for seed in range(3):
        check_case(IMPLEMENTATIONS[case.op], case, device="cuda", seed=seed)


@pytest.mark.gpu
@needs_gpu
def test_speed_against_torch_sort_and_multinomial():
    rows, vocab = 256, 129280
    logits = torch.randn(rows, vocab, device="cuda") * 3
    temperature = torch.full((rows,), 0.8, device="cuda")
    top_k = torch.full((rows,), 50, dtype=torch.int32, device="cuda")
    top_p = torch.full((rows,), 0.9, device="cuda")
    min_p = torch.zeros(rows, device="cuda")
    seeds = torch.arange(rows, device="cuda")

    def ours():
        cut = sampling_cutoff.top_k_top_p_min_p_cutoff(logits, temperature, top_k, top_p, min_p)
        return sampling.gumbel_sample(logits, temperature, cut, seeds, seeds, 0)

    def baseline():
        probs, idx = torch.sort(torch.softmax(logits / 0.8, -1), descending=True)
        probs = probs.masked_fill(probs.cumsum(-1) - probs > 0.9, 0)
        return idx.gather(1, torch.multinomial(probs, 1)).squeeze(1)

    def time_ms(fn):
        for _ in range(3):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20

    ours_ms, base_ms = time_ms(ours), time_ms(baseline)
    print(f"\n256x129280 top-k/top-p sample: ours {ours_ms:.3f} ms, "
          f"torch sort+multinomial {base_ms:.3f} ms")  # fmt: skip
    tokens = ours()
    scaled = logits / 0.8
    top50 = scaled.topk(50, dim=-1).indices
    assert (top50 == tokens[:, None]).any(-1).all(), "a token outside the top-k was drawn"


_COMPILE_SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer.kernels_nvidia import sampling as k
from deepinfer.kernels_nvidia import sampling_cutoff as c
from deepinfer.kernels_nvidia import sampling_draw as d

row = {"logits_ptr": "*fp32", "stride": "i32", "temp_ptr": "*fp32"}
params = {"top_k_ptr": "*i64", "top_p_ptr": "*fp32", "min_p_ptr": "*fp32"}
tail = {"NCP": 32, "CAP": 8192, "SORT_CAP": 256, "BLOCK": 1024, "CBLOCK": 256, "NBLK": 128}
constexpr = lambda names: {n: "constexpr" for n in names}  # noqa: E731
jobs = [
    (k._bitmask_kernel, {"logits_ptr": "*bf16", "bitmask_ptr": "*i32", "out_ptr": "*bf16",
     "vocab": "i32", "stride_l": "i32", "stride_b": "i32", "stride_o": "i32",
     "BLOCK": "constexpr"}, {"BLOCK": 1024}),
    (c._extremes_kernel, {**row, "maxima_ptr": "*fp32", "minima_ptr": "*fp32",
     "hist_ptr": "*i32", "z_ptr": "*i64", "t_mp_ptr": "*fp32", "count_ptr": "*i32",
     "vocab": "i32", "num_chunks": "i32", **constexpr(["CHUNK", "NB"])},
     {"CHUNK": 4096, "NB": 64}),
    (c._histogram_kernel, {**row, **params, "maxima_ptr": "*fp32", "hist_ptr": "*i32",
     "z_ptr": "*i64", "t_mp_ptr": "*fp32", "vocab": "i32", "num_chunks": "i32",
     **constexpr(["CHUNK", "NB", "NCP"])}, {"CHUNK": 4096, "NB": 64, "NCP": 32}),
]
buffers = {"maxima_ptr": "*fp32", "minima_ptr": "*fp32", "hist_ptr": "*i32", "z_ptr": "*i64",
           "t_mp_ptr": "*fp32"}
for fused in (False, True):
    jobs.append((c._gather_kernel, {**row, **params, **buffers, "count_ptr": "*i32",
                 "cand_ptr": "*fp32", "idx_ptr": "*i32", "out_ptr": "*fp32", "vocab": "i32",
                 "num_chunks": "i32", "sort_limit": "i32", **constexpr(["CHUNK", "GATHER_BLOCK",
                 "NB", *tail, "FUSED", "STORE_IDX"])}, {"CHUNK": 4096, "GATHER_BLOCK": 1024,
                 "NB": 64, **tail, "FUSED": fused, "STORE_IDX": not fused}))
    jobs.append((k._gumbel_kernel, {**row, "cutoff_ptr": "*fp32", "seeds_ptr": "*i64",
                 "positions_ptr": "*i64", "stream_term": "i64", "best_ptr": "*fp32",
                 "best_idx_ptr": "*i32", "done_ptr": "*i32", "out_ptr": "*i64",
                 "flags_ptr": "*i32", "vocab": "i32", "num_chunks": "i32",
                 **constexpr(["CHUNK", "NCP", "FUSED", "ONLY_FLAGGED"])},
                 {"CHUNK": 4096, "NCP": 32, "FUSED": fused, "ONLY_FLAGGED": not fused}))
    jobs.append((k._pick_chunk_kernel, {"best_ptr": "*fp32", "best_idx_ptr": "*i32",
                 "out_ptr": "*i64", "flags_ptr": "*i32", "num_chunks": "i32",
                 "NCP": "constexpr", "ONLY_FLAGGED": "constexpr"},
                 {"NCP": 32, "ONLY_FLAGGED": fused}))
finish = {**row, **params, **buffers, "cand_ptr": "*fp32"}
jobs += [
    (c._finish_kernel, {**finish, "out_ptr": "*fp32", "vocab": "i32", "num_chunks": "i32",
     "sort_limit": "i32", **constexpr(["NB", *tail])}, {"NB": 64, **tail}),
    (d._finish_draw_kernel, {**finish, "idx_ptr": "*i32", "out_ptr": "*fp32",
     "seeds_ptr": "*i64", "positions_ptr": "*i64", "stream_term": "i64", "tokens_ptr": "*i64",
     "flags_ptr": "*i32", "vocab": "i32", "num_chunks": "i32", "sort_limit": "i32",
     **constexpr(["NB", *tail])}, {"NB": 64, **tail}),
]
for fn, signature, constexprs in jobs:
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "enable_fp_fusion": False})
    assert "cubin" in compiled.asm, fn
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_a_gpu():
    """The interpreter does not type-check like the compiler: compile each kernel for sm_90
    ahead of time (ptxas ships with triton), in a process without TRITON_INTERPRET."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
