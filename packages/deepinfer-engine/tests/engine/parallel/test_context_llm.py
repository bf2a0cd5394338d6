"""Context parallelism through ``LLM``: with batch-invariant kernels, two DP ranks that prefill
long prompts as one CP group give the single-process outputs bit for bit: greedy and sampled
tokens (``n = 2`` forking after a CP prefill too), their logprobs and the prompt logprobs; a
short prompt in the same call runs on its rank as before. On V4.1 the engine speculates, and
the drafts (their confidences) equal one process's too: the owner computes the prompt rows of
the draft stages' window itself, seeding their rings. CP chunks are of up to 64 rows
(``max_num_batched_tokens`` 32), so the 100-token prompt takes two; tiny V4 and V4.1.

``DEEPINFER_CP_LLM_WIDE=1`` also runs four ranks: one CP group of 4, two groups of 2 (their
own process groups), and two groups of 2 whose ranks are also the four expert-parallel ranks
(a rank whose group has no chunk takes part in the MoE exchanges of the chunk's step).
``DEEPINFER_CP_TOKENS=4000`` makes the first prompt 4,000 tokens long."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config, tiny_v41_config
from deepinfer.sampling import SamplingParams

WIDE = os.environ.get("DEEPINFER_CP_LLM_WIDE") == "1"
LAYOUTS = [dict(data_parallel_size=2, context_parallel_size=2)]
if WIDE:
    LAYOUTS += [
        dict(data_parallel_size=4, context_parallel_size=4),
        dict(data_parallel_size=4, context_parallel_size=2),
        dict(data_parallel_size=4, context_parallel_size=2, expert_parallel_size=4),
    ]


LONG = int(os.environ.get("DEEPINFER_CP_TOKENS", "100"))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (LONG, 12, 70)]


def _params() -> list[SamplingParams]:
    common = dict(max_tokens=4, ignore_eos=True, logprobs=2)
    return [
        SamplingParams(temperature=0.0, prompt_logprobs=2, **common),
        SamplingParams(temperature=0.8, seq_seed=1, prompt_logprobs=0, **common),
        SamplingParams(temperature=0.8, seq_seed=2, n=2, **common),
    ]


def _outputs(checkpoint, **parallel) -> list:
    options = dict(dtype="float32", max_model_len=LONG + 32, max_num_batched_tokens=32)
    options.update(speculative_tokens=0, cp_min_tokens=64)
    llm = LLM(str(checkpoint), **{**options, **parallel})
    try:
        outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=_params(), use_tqdm=False)
        # the long prompts' rows in chunks of up to C * max_num_batched_tokens
        cp, tail = (
            parallel.get("context_parallel_size", 1),
            getattr(llm._core, "num_tail_tokens", 1),
        )
        rows = [len(p) - tail for p in _prompts() if len(p) >= 64]
        chunks = sum(-(-n // (cp * 32)) for n in rows if n >= 16 * cp)  # 16 rows a rank
        assert getattr(llm._core, "num_context_chunks", chunks) == chunks
    finally:
        llm.close()
    return [
        (o.prompt_logprobs, [(c.token_ids, c.logprobs) for c in o.outputs], _drafting(o.metrics))
        for o in outs
    ]


def _drafting(metrics) -> tuple:
    """What speculation did: the drafts verified and accepted, and each draft's confidence
    (which the draft stages' windows decide, so the CP path must seed them as one process
    does)."""
    if metrics is None:
        return ()
    return (
        metrics.num_verify_steps,
        metrics.num_draft_tokens,
        metrics.num_accepted_tokens,
        metrics.draft_confidences,
    )


def _checkpoint(arch: str, directory):
    config = tiny_v4_config(hca_ratio=16) if arch == "v4" else tiny_v41_config(vision=False)
    return make_random_checkpoint(
        directory, config, quantized=False, seed=6, float_dtype=torch.float32
    )


# V4.1 speculates (DSpark, 2 drafts): the owner computes the draft window's prompt rows itself
SPECULATION = dict(speculative_tokens=2, spec_varlen=False, return_draft_confidences=True)


@pytest.fixture(scope="module", params=["v4", "v41-dspark"])
def case(request, tmp_path_factory):
    """(checkpoint, options, the single-process outputs with batch-invariant kernels)."""
    arch = request.param.split("-")[0]
    checkpoint = _checkpoint(arch, tmp_path_factory.mktemp(f"cp-llm-{arch}"))
    options = SPECULATION if arch == "v41" else {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
        return checkpoint, options, _outputs(checkpoint, **options)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(map(str, d.values())))
def test_cp_prefill_through_llm_is_bitwise_one_process(case, layout, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    checkpoint, options, single = case
    got = _outputs(checkpoint, **options, **layout)
    assert [len(p or []) for p, _, _ in got] == [LONG, 12, 0]
    for index, (want, have) in enumerate(zip(single, got)):
        assert have == want, index


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_cp_prefill_through_llm_over_nccl_is_bitwise_one_gpu(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    checkpoint = _checkpoint(arch, tmp_path)
    gpu = dict(accelerator="nvidia", dtype="bfloat16", gpu_memory_utilization=0.3)
    # the CP ranks first: their processes give their GPUs back when closed
    got = _outputs(checkpoint, data_parallel_size=2, context_parallel_size=2, **gpu)
    assert got == _outputs(checkpoint, **gpu)
