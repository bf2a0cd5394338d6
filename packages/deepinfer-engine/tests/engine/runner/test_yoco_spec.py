"""YoCo prefill truncation with speculative decoding after an unchunked prefill, on the small
random V4.1 checkpoint (window 8, consumer layers 5-7, three DSpark stages tapping them), batch
invariant, a prompt longer than the keep: greedy tokens and their logprobs with drafts equal
those without bit for bit, whether the DSpark stages draft (seeded from the kept rows) or an
oracle drafts tokens of which some are accepted and some rejected (the chunked case with
drafts: ``test_yoco_engine.py``)."""

from __future__ import annotations

import random

import pytest

from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.testing.oracle_drafts import OracleDraftSource
from deepinfer.sampling import SamplingParams

K = 3  # the checkpoint's dspark_block_size
KEEP = 8 + K  # the least keep with K drafts (window 8); the runs without drafts use it too
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)


@pytest.fixture(autouse=True)
def _batch_invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(20, 250) for _ in range(n)] for n in (KEEP + 6,)]


def _engine(checkpoint, mode: str, drafts: int) -> LLM:
    llm = LLM(
        str(checkpoint),
        dtype="float32",
        block_size=16,
        max_model_len=64,
        max_num_seqs=4,
        speculative_tokens=drafts,
        return_draft_confidences=drafts > 0,
        yoco_prefill_truncation_mode=mode,
        yoco_prefill_keep_tokens=KEEP,
    )
    assert llm.scheduler_config.max_num_batched_tokens >= 64 * 2  # every prompt whole
    return llm


def _run(llm: LLM):
    return llm.generate(prompt_token_ids=_prompts(), sampling_params=GREEDY, use_tqdm=False)


def _outputs(outs) -> list:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_unchunked_prefill_with_speculation_equals_without(dspark_checkpoint):
    plain = _run(_engine(dspark_checkpoint, "compact", 0))
    dspark = _run(_engine(dspark_checkpoint, "compact", K))
    assert _outputs(dspark) == _outputs(plain)
    assert all(o.metrics.num_draft_tokens > 0 for o in dspark), "nothing was verified"

    outputs = [o.outputs[0].token_ids for o in plain]
    reference = {str(i): p + out for i, (p, out) in enumerate(zip(_prompts(), outputs))}
    llm = _engine(dspark_checkpoint, "compact", K)
    llm._core.executor.drafter = OracleDraftSource(
        reference, K, 512, lambda request, position: position % 3 == 0
    )
    oracle = _run(llm)
    assert _outputs(oracle) == _outputs(plain)
    accepted = [o.metrics.num_accepted_tokens for o in oracle]
    rejected = [o.metrics.num_draft_tokens - a for o, a in zip(oracle, accepted)]
    assert min(accepted) > 0 and min(rejected) > 0, (accepted, rejected)
