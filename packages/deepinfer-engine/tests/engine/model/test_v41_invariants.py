"""Cache invariants of the V4.1 stack (CSA2 shared KV, index sources, candidate pre-filter,
deferred mHC pre-mix, Engram): incremental decode, chunked prefill and batching all give the
logits of one whole-sequence prefill (fp32, |delta| < 1e-5)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing.simple_runner import SimpleRunner

VOCAB = 53
TEXT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 16,
    "o_groups": 2,
    "o_lora_rank": 8,
    "sliding_window": 8,
    # SWA, Engram at 1; ratio-2 group {1, 2}; ratio-1 group {3..6} with index sources 3 and 5
    "compress_ratios": [0, 2, 2, 1, 1, 1, 1, 0],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 5],
    "candidate_source_layer_id": 3,
    "candidate_topk_blocks": 2,
    "candidate_block_size": 4,
    "n_routed_experts": 5,
    "num_experts_per_tok": 2,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 3,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 4,
    "rms_norm_eps": 1e-20,
    "engram_layer_ids": [1],
    "engram_num_embeddings": [184],
    "engram_max_ngram_size": 3,
    "engram_vocab_size": 40,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 30,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}
RAW = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "text_config": TEXT,
}
SEQ_LEN = 60


def random_v41_model(raw=RAW, seed=0, numerics="model"):
    config = parse_config(raw, numerics=numerics)
    model = build_model(config, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            else:
                std = 0.05 if name == "head.weight" else 0.3
                t.copy_(std * torch.randn(t.shape, generator=gen))
    token_map = torch.randint(0, TEXT["engram_compressed_vocab_size"], (VOCAB,), generator=gen)
    model.bind_engram(token_map)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    # Invariants of the cache bookkeeping, on the float path: the reference ops are not batch
    # invariant, so under the model's rounding a one-ulp difference between chunk shapes can
    # flip an FP8 / FP4 rounding (test_quantised_numerics and the spec transcription cover it)
    return random_v41_model(numerics="float")


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def whole(model, tokens):
    return SimpleRunner(model, max_seqs=1, max_len=SEQ_LEN, block_size=16).step(
        {0: tokens.tolist()}
    )[0]


def _runner(model, max_seqs=1):
    return SimpleRunner(model, max_seqs=max_seqs, max_len=SEQ_LEN, block_size=16)


def test_incremental_decode_equals_prefill(model, tokens, whole):
    runner = _runner(model)
    out = [runner.step({0: tokens[:20].tolist()})[0]]
    out += [runner.step({0: [t]})[0] for t in tokens[20:].tolist()]
    torch.testing.assert_close(torch.cat(out), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", [1, 3, 17])
def test_chunked_prefill_equals_whole(model, tokens, whole, size):
    runner, out = _runner(model), []
    for i in range(0, SEQ_LEN, size):
        out.append(runner.step({0: tokens[i : i + size].tolist()})[0])
    torch.testing.assert_close(torch.cat(out), whole, atol=1e-5, rtol=0)


def test_batched_with_others_equals_alone(model, tokens, whole):
    gen = torch.Generator().manual_seed(13)
    other = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    runner, got = _runner(model, max_seqs=3), []
    runner.step({2: other[:25]})
    for i, (start, n) in enumerate([(0, 23), (23, 1), (24, 36)]):
        chunks = {
            1: other[i * 4 : i * 4 + 4],
            0: tokens[start : start + n].tolist(),
            2: [other[25 + i]],
        }
        got.append(runner.step(chunks)[0])
    torch.testing.assert_close(torch.cat(got), whole, atol=1e-5, rtol=0)


def test_candidate_filter_and_topk_change_the_result(tokens, whole):
    """The schedule is live: a wider index top-k changes the logits (the test would be blind
    if every compressed entry were always selected)."""
    wide = random_v41_model({**RAW, "text_config": {**TEXT, "index_topk": 64}})
    got = SimpleRunner(wide, max_seqs=1, max_len=SEQ_LEN, block_size=16).step({0: tokens.tolist()})[
        0
    ]
    assert (got - whole).abs().max() > 1e-3
