"""Penalties, token bans, logit bias, grammar bitmask and logprobs, checked row by row."""

import math

import torch

from deepinfer.sampling import SamplingParams, allocate_token_bitmask, prompt_logprobs, sample

VOCAB = 64


def _greedy_logprob_row(logits, params, outputs=None, bitmask=None):
    return sample(logits, params, list(range(len(params))), output_token_ids=outputs,
                  bitmask=bitmask)  # fmt: skip


def test_penalties_follow_their_formulas():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, VOCAB, generator=gen) * 3
    history = [[3, 3, 9], [5]]
    params = [
        SamplingParams(temperature=0, logprobs=0, repetition_penalty=2.0,
                       frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(temperature=0, logprobs=0),
    ]  # fmt: skip
    result = _greedy_logprob_row(logits, params, history)
    want = logits[0].clone()
    for token, count in ((3, 2), (9, 1)):
        v = want[token]
        want[token] = (v / 2.0 if v > 0 else v * 2.0) - 0.5 * count - 0.25
    want_lp = torch.log_softmax(want, 0)
    assert torch.allclose(result.top_logprobs[0], want_lp.max(0, keepdim=True).values, atol=1e-5)
    token = result.token_ids[0].item()
    assert token == torch.argmax(want).item()
    assert math.isclose(result.logprobs[0].item(), want_lp[token].item(), abs_tol=1e-5)
    # row 1 asked for no penalty: processed == raw
    assert math.isclose(result.logprobs[1].item(), result.raw_logprobs[1].item(), abs_tol=1e-6)


def test_min_tokens_and_first_n_token_no_eos_ban_eos_and_stop_tokens():
    logits = torch.zeros(4, VOCAB)
    logits[:, 7] = 100.0  # EOS would win
    logits[:, 8] = 90.0  # then the stop token
    base = {"temperature": 0, "eos_token_id": 7, "stop_token_ids": [8]}
    params = [
        SamplingParams(min_tokens=3, **base),
        SamplingParams(first_n_token_no_eos=1, **base),
        SamplingParams(min_tokens=3, ignore_eos=True, **base),
        SamplingParams(min_tokens=2, **base),
    ]
    outputs = [[1, 2], [], [1], [1, 2]]
    tokens = sample(logits, params, [0] * 4, output_token_ids=outputs).token_ids.tolist()
    assert tokens[0] not in (7, 8)  # 2 < min_tokens: EOS and stop banned
    assert tokens[1] == 8  # EOS banned for the first token only
    assert tokens[2] == 7  # ignore_eos: EOS is not banned, the stop token is
    assert tokens[3] == 7  # min_tokens reached


def test_logit_bias_adds_to_the_logits():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(1, VOCAB, generator=gen)
    params = [SamplingParams(temperature=0, logprobs=3, logit_bias={11: 30.0, 12: -5.0})]
    result = sample(logits, params, [0])
    want = logits[0].clone()
    want[11] += 30.0
    want[12] -= 5.0
    assert result.token_ids.item() == 11
    assert torch.allclose(
        result.top_logprobs[0], torch.log_softmax(want, 0).topk(3).values, atol=1e-5
    )


def test_bitmask_restricts_the_draw_and_logprobs():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, VOCAB, generator=gen)
    bitmask = allocate_token_bitmask(3, VOCAB)
    allowed = [4, 33, 63]
    bitmask[0].zero_()
    for t in allowed:
        bitmask[0, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    params = [SamplingParams(seq_seed=i, logprobs=2) for i in range(3)]
    for position in range(20):
        result = sample(logits, params, [position] * 3, bitmask=bitmask)
        assert result.token_ids[0].item() in allowed
        finite = torch.isfinite(torch.log_softmax(logits[0], 0))
        assert finite.all()
    want = torch.log_softmax(logits[0, allowed], 0)
    assert torch.allclose(result.top_logprobs[0], want.topk(2).values, atol=1e-5)


def test_processed_logprobs_are_the_truncated_tempered_distribution():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, VOCAB, generator=gen) * 2
    params = [SamplingParams(temperature=0.5, top_k=4, seq_seed=9, logprobs=6)]
    result = sample(logits, params, [5])
    scaled = logits[0] * (1.0 / torch.tensor(0.5))
    top4 = scaled.topk(4)
    want = torch.log_softmax(top4.values, 0)
    assert torch.allclose(result.top_logprobs[0, :4], want, atol=1e-5)
    assert torch.equal(result.top_token_ids[0, :4], top4.indices)
    assert torch.isinf(result.top_logprobs[0, 4:]).all()
    raw = torch.log_softmax(logits[0], 0)
    assert torch.allclose(result.raw_top_logprobs[0], raw.topk(6).values, atol=1e-6)
    token = result.token_ids.item()
    assert token in top4.indices.tolist()
    assert math.isclose(result.raw_logprobs.item(), raw[token].item(), abs_tol=1e-6)


def test_prompt_logprobs_are_raw_log_softmax_values():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, VOCAB, generator=gen) * 2
    targets = torch.randint(0, VOCAB, (5,), generator=gen)
    chosen, top, top_ids = prompt_logprobs(logits, targets, 3)
    want = torch.log_softmax(logits, -1)
    assert torch.allclose(chosen, want[torch.arange(5), targets], atol=1e-6)
    assert torch.allclose(top, want.topk(3).values, atol=1e-6)
    assert torch.equal(top_ids, want.topk(3).indices)
