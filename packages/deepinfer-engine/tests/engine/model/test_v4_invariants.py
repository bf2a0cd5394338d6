"""Cache invariants of the V4 stack: incremental decode, chunked prefill and batching all give
the logits of one whole-sequence prefill."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing.simple_runner import SimpleRunner

RAW = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "vocab_size": 61,
    "hidden_size": 32,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 16,
    "o_groups": 2,
    "o_lora_rank": 8,
    "sliding_window": 8,
    "compress_ratios": [0, 4, 128, 4, 0],
    "num_hash_layers": 1,
    "n_routed_experts": 5,
    "num_experts_per_tok": 2,
    "index_n_heads": 16,
    "index_head_dim": 16,
    "index_topk": 3,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 4,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}
SEQ_LEN = 140  # > 128: one HCA entry, many CSA entries, the window wraps


def random_model(raw=RAW, seed=0):
    config = parse_config(raw)
    model = build_model(config, device="cpu", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                n = config.n_routed_experts
                t.copy_(torch.stack([torch.randperm(n, generator=gen)[: t.shape[1]] for _ in t]))
            elif name.endswith("norm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            else:
                # a small head keeps logits O(1), so 1e-5 measures fp32 noise, not magnitude
                std = 0.05 if name == "head.weight" else 0.3
                t.copy_(std * torch.randn(t.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return random_model()


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(
        0, RAW["vocab_size"], (SEQ_LEN,), generator=torch.Generator().manual_seed(3)
    )


@pytest.fixture(scope="module")
def whole(model, tokens):
    return SimpleRunner(model, max_seqs=1, max_len=SEQ_LEN).step({0: tokens.tolist()})[0]


def _chunked(model, tokens, sizes, seq=0, max_seqs=1):
    runner = SimpleRunner(model, max_seqs=max_seqs, max_len=SEQ_LEN)
    out, i, k = [], 0, 0
    while i < len(tokens):
        n = sizes[k % len(sizes)]
        out.append(runner.step({seq: tokens[i : i + n].tolist()})[seq])
        i, k = i + n, k + 1
    return torch.cat(out)


def test_incremental_decode_equals_prefill(model, tokens, whole):
    prefix = 100
    runner = SimpleRunner(model, max_seqs=1, max_len=SEQ_LEN)
    out = [runner.step({0: tokens[:prefix].tolist()})[0]]
    out += [runner.step({0: [t]})[0] for t in tokens[prefix:].tolist()]
    torch.testing.assert_close(torch.cat(out), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("size", [1, 3, 17])
def test_chunked_prefill_equals_whole(model, tokens, whole, size):
    torch.testing.assert_close(_chunked(model, tokens, [size]), whole, atol=1e-5, rtol=0)


def test_batched_with_others_equals_alone(model, tokens, whole):
    gen = torch.Generator().manual_seed(11)
    others = [torch.randint(0, RAW["vocab_size"], (n,), generator=gen).tolist() for n in (70, 9)]
    runner = SimpleRunner(model, max_seqs=3, max_len=SEQ_LEN)
    runner.step({1: others[0][:50]})  # another sequence already mid-way
    got = []
    for i, n in enumerate((60, 5, 75)):  # prefill chunks mixed with others' decode / prefill
        start = sum((60, 5, 75)[:i])
        chunks = {
            2: others[1][i : i + 3],
            0: tokens[start : start + n].tolist(),
            1: [others[0][50 + i]],
        }
        got.append(runner.step(chunks)[0])
    torch.testing.assert_close(torch.cat(got), whole, atol=1e-5, rtol=0)
