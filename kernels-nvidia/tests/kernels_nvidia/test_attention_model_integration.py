"""The engine's tiny V4 and V4.1 models run with this backend's attention-stack kernels (sparse attention,
mHC, indexer, compressor pooling, RoPE) in place of the reference and gives the same logits:
checks the shapes, dtypes and layouts the model really passes. CPU: the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import registry
from deepinfer.kernels_nvidia import backend

engine_config = pytest.importorskip("deepinfer.engine.model.config_parsing")
from deepinfer.engine.model.model import build_model  # noqa: E402
from deepinfer.engine.testing.simple_runner import SimpleRunner  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
OURS = {
    "sparse_mqa_sink", "hc_mix_coefficients", "hc_head_coefficients", "hc_collapse",
    "hc_expand", "indexer_scores", "select_topk", "compress_pool", "apply_rope",
    "candidate_block_mask", "hadamard_rotate",
}  # fmt: skip
OPTIONAL = {"hc_head_coefficients", "candidate_block_mask", "hadamard_rotate"}  # not every model
RAW = {
    "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 61, "hidden_size": 32,
    "moe_intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4,
    "head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_groups": 2, "o_lora_rank": 8,
    "sliding_window": 8, "compress_ratios": [0, 4, 128, 4, 0], "num_hash_layers": 1,
    "n_routed_experts": 5, "num_experts_per_tok": 2, "index_n_heads": 16, "index_head_dim": 16,
    "index_topk": 3, "hc_mult": 2, "hc_sinkhorn_iters": 4,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32,
                     "beta_fast": 32, "beta_slow": 1},
}  # fmt: skip
SEQ_LEN = 44  # the window wraps, 11 CSA entries (top-3 chosen), the HCA layer sees none yet
# V4.1: ratio-2 and ratio-1 groups with shared KV, index sources and the candidate pre-filter
V41_TEXT = {
    **{k: RAW[k] for k in ("vocab_size", "hidden_size", "moe_intermediate_size",
                           "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank",
                           "o_groups", "o_lora_rank", "sliding_window", "n_routed_experts",
                           "num_experts_per_tok", "index_n_heads", "index_head_dim", "index_topk",
                           "hc_mult", "hc_sinkhorn_iters", "rope_scaling")},
    "num_hidden_layers": 5, "compress_ratios": [0, 2, 2, 1, 1, 0],
    "kv_source_layer_ids": [1, 3], "index_source_layer_ids": [1, 3],
    "candidate_source_layer_id": 3, "candidate_topk_blocks": 2, "candidate_block_size": 4,
    "rms_norm_eps": 1e-20,
}  # fmt: skip
V41_RAW = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "text_config": V41_TEXT,
}


def _random_model(raw):
    config = engine_config.parse_config(raw)
    model = build_model(config, device=DEVICE, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                n = config.n_routed_experts
                rows = [torch.randperm(n, generator=gen)[: t.shape[1]] for _ in t]
                t.copy_(torch.stack(rows))
            elif name.endswith("norm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            else:
                std = 0.05 if name == "head.weight" else 0.3
                t.copy_(std * torch.randn(t.shape, generator=gen))
    return model.eval()


def _logits(model, tokens):
    runner = SimpleRunner(model, max_seqs=1, max_len=len(tokens), device=DEVICE)
    prefill = runner.step({0: tokens[:-4]})[0]
    decode = [runner.step({0: [t]})[0] for t in tokens[-4:]]
    return torch.cat([prefill, *decode])


@pytest.mark.slow
@pytest.mark.parametrize("raw,seq_len", [(RAW, SEQ_LEN), (V41_RAW, 20)], ids=["v4", "v4.1"])
def test_tiny_model_matches_the_reference_backend(monkeypatch, raw, seq_len):
    model = _random_model(raw)
    tokens = torch.randint(0, 61, (seq_len,), generator=torch.Generator().manual_seed(3))
    tokens = tokens.tolist()
    with torch.no_grad():
        want = _logits(model, tokens)
        used = set()
        reference_resolve = registry.resolve

        def ours(name, args=()):
            if name in OURS:
                used.add(name)
                return backend.ops[name]
            return reference_resolve(name, args)

        monkeypatch.setattr(registry, "resolve", ours)
        got = _logits(model, tokens)
    assert used >= OURS - OPTIONAL
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
def test_attention_stack_kernels_never_sync_with_the_host():
    """Each op only enqueues work (no .item()/.tolist()/nonzero on device tensors): safe inside
    a CUDA graph and under asynchronous scheduling."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    ops = backend.ops
    q, kv = randn(8, 64, 512), randn(4096, 512)
    idx = torch.randint(-1, 4096, (8, 640), device="cuda", generator=g)
    h, f = randn(8, 4, 4096), randn(8, 4096)
    fn, base, scale = randn(24, 16384, dtype=torch.float32) * 0.01, randn(24), randn(3)
    scores = randn(8, 2048, dtype=torch.float32)
    seq_rows = torch.arange(2048, device="cuda").expand(2, -1).contiguous()  # two sequences
    q_seq = torch.tensor([0] * 4 + [1] * 4, device="cuda")
    counts = torch.full((8,), 1500, device="cuda")
    ang = randn(8, 32, dtype=torch.float32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops["sparse_mqa_sink"](q, kv, idx, randn(64, dtype=torch.float32), 0.05)
        sources = (kv[:1000].to(torch.float8_e4m3fn), kv[1000:1008], kv[1008:])
        ops["sparse_mqa_sink"](q, sources, idx, randn(64, dtype=torch.float32), 0.05)
        pre, post, comb = ops["hc_mix_coefficients"](
            h, fn, base, scale, norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20
        )
        ops["hc_collapse"](h, pre)
        ops["hc_expand"](f, h, post, comb)
        ops["indexer_scores"](
            randn(8, 64, 128), randn(8, 64), randn(2048, 128), seq_rows, q_seq, counts
        )
        ops["select_topk"](scores, seq_rows, q_seq, 512)
        ops["candidate_block_mask"](scores, torch.full((8,), 2000, device="cuda"), 64, 8)
        ops["hadamard_rotate"](randn(8, 128))
        ops["compress_pool"](randn(256, 8, 512), randn(256, 8, 512, dtype=torch.float32))
        ops["apply_rope"](q, ang.cos(), ang.sin(), inverse=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
