"""V4 full-sequence logits against transformers' DeepseekV4ForCausalLM (same weights, fp32), which
rounds nothing: ours with ``numerics="float"``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from deepinfer.engine.checkpoint.transformers_names import from_transformers  # noqa: E402
from deepinfer.engine.model.config_parsing import load_config  # noqa: E402
from deepinfer.engine.model.model import build_model  # noqa: E402
from deepinfer.engine.testing.simple_runner import SimpleRunner  # noqa: E402

BASE = dict(
    vocab_size=97,
    hidden_size=32,
    moe_intermediate_size=16,
    num_attention_heads=4,
    head_dim=32,
    qk_rope_head_dim=8,
    q_lora_rank=16,
    n_routed_experts=6,
    num_experts_per_tok=2,
    o_groups=2,
    o_lora_rank=8,
    # Enough indexer heads that no two entries tie at score 0 (ReLU): with ties, which entry
    # top-k keeps is unspecified, in transformers as here.
    index_n_heads=16,
    index_head_dim=16,
    sliding_window=16,
    hc_sinkhorn_iters=5,
    rope_scaling=dict(
        type="yarn", factor=4, original_max_position_embeddings=64, beta_fast=32, beta_slow=1
    ),
)
CONFIGS = {
    # SWA, CSA with index_topk (3) < compressed entries, HCA, hash then score routing, hc 4
    "swa-csa_topk_small-hca-hash-hc4": dict(
        num_hidden_layers=4,
        compress_ratios=[0, 4, 128, 4],
        num_hash_layers=2,
        index_topk=3,
        hc_mult=4,
    ),
    # CSA with index_topk larger than the entries, HCA, score routing only, hc 2
    "csa_topk_large-hca-score-hc2": dict(
        num_hidden_layers=3,
        compress_ratios=[4, 128, 0],
        num_hash_layers=0,
        index_topk=512,
        hc_mult=2,
    ),
    # transformers' own form with a general HCA rate: 8 (37 entries over 300 tokens)
    "swa-hca8-csa-hca8-rates": dict(
        num_hidden_layers=4,
        layer_types=[
            "sliding_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        num_hash_layers=1,
        index_topk=5,
        hc_mult=2,
    ),
}


def _randomise(model: torch.nn.Module, gen: torch.Generator, n_experts: int) -> None:
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                rows = [
                    torch.randperm(n_experts, generator=gen)[: t.shape[1]]
                    for _ in range(t.shape[0])
                ]
                t.copy_(torch.stack(rows))
            elif "norm" in name:
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            elif t.is_floating_point():
                t.copy_(0.3 * torch.randn(t.shape, generator=gen))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    gen = torch.Generator().manual_seed(1234)
    cfg = transformers.DeepseekV4Config(**BASE, **CONFIGS[request.param])
    hf = transformers.DeepseekV4ForCausalLM(cfg).float().eval()
    _randomise(hf, gen, cfg.n_routed_experts)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path


def _ours(path):
    # transformers' V4 port rounds nothing (no FP8 / FP4 cache formats): compare the float path
    config = load_config(path, numerics="float")
    model = build_model(config, device="cpu", dtype=torch.float32)
    model.load_state_dict(from_transformers(load_file(path / "model.safetensors")), strict=True)
    return model.eval()


def test_full_sequence_logits_match_transformers(checkpoint):
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ours = _ours(checkpoint)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, hf.config.vocab_size, (300,), generator=gen)
    with torch.no_grad():
        want = hf(input_ids=ids[None], use_cache=False).logits[0].float()
    got = SimpleRunner(ours, max_seqs=1, max_len=300).step({0: ids.tolist()})[0]
    delta = (got.log_softmax(-1) - want.log_softmax(-1)).abs().max().item()
    assert delta < 1e-4, f"max |delta log-softmax| = {delta}"


def test_module_names_and_saved_names_convert_alike(checkpoint):
    """transformers' in-memory module names (fused experts) and the names its save_pretrained
    writes map to the same official tensors."""
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    from_modules = from_transformers(hf.state_dict())
    from_saved = from_transformers(load_file(checkpoint / "model.safetensors"))
    assert sorted(from_modules) == sorted(from_saved)
    for name, tensor in from_saved.items():
        assert torch.equal(from_modules[name], tensor), name
