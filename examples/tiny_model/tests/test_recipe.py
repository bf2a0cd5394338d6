"""The tiny model's backbone recipe on CPU at micro scale (examples/tiny_model).

The real tiny V4.1 config (vocab 8192, 8 layers, 16 experts) on a few hundred tokens written
here: every trainable parameter gets a gradient; a few steps on one batch lower its loss;
``train.py`` -> ``export.py`` writes the official format (FP8 32x32 / FP4 / FP8 Engram, <= 15 MB
shards, an index, configs, tokenizer) within 36 MB; the engine's loader reads it back and
scores exactly what the fake-quantised training model scores; the batched fake quantisation
is bit-identical to the kernels' quantisers; the bigram baseline matches a dense count.
``train`` and ``export`` run as programs (``python -m examples.tiny_model.train``), the way a
user runs them; the training code's parts come from the ``examples.tiny_model`` package.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from deepinfer.engine.checkpoint import load_model
from deepinfer.engine.model.config_parsing import parse_config
from examples.tiny_model import evaluate as ev
from examples.tiny_model import tiny_common as tc
from examples.tiny_model.quantise import quant_groups, swap_in_quantised

REPO = Path(__file__).resolve().parents[3]
SEQ_LEN, BATCH = 32, 2
slow = pytest.mark.slow  # the recipe tests: a 33M-parameter model trained, exported, loaded


def run_example(script: str, *argv: str) -> None:
    """``python -m examples.tiny_model.<script> ARGV`` from the repository root, as a user runs it."""
    module = f"examples.tiny_model.{script}"
    subprocess.run([sys.executable, "-m", module, *argv], check=True, cwd=REPO, timeout=600)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """train.bin / validation.bin of random text-token ids (uint16), a few hundred each."""
    path = tmp_path_factory.mktemp("tiny_data")
    rng = np.random.default_rng(0)
    for split, n in (("train", 600), ("validation", 200)):
        rng.integers(17, 8192, size=n).astype(np.uint16).tofile(path / f"{split}.bin")
    return path


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny_run")
    argv = ["--steps", "3", "--batch", str(BATCH), "--seq-len", str(SEQ_LEN), "--warmup", "1"]
    argv += ["--device", "cpu", "--out", str(out), "--data-dir", str(data_dir)]
    argv += ["--log-every", "1", "--eval-tokens", "64", "--qat-fraction", "0.34", "--repeat-batch"]
    run_example("train", *argv)
    return out


@pytest.fixture(scope="module")
def exported(trained) -> Path:
    out = trained / "checkpoint"
    run_example("export", "--backbone", str(trained / "backbone.pt"), "--out", str(out))
    return out


@slow
def test_every_trainable_parameter_gets_a_gradient(data_dir):
    model = tc.build_model("cpu", seed=3)
    tb = tc.training_batch(model.config, BATCH, 2 * SEQ_LEN, "cpu")
    tokens = tc.load_tokens("train", data_dir)
    windows = torch.from_numpy(tc.batches(tokens, BATCH, 2 * SEQ_LEN, seed=0, step=0))
    tc.token_nll(model, tb, windows).backward()
    silent = [n for n, p in tc.trainable_parameters(model) if p.grad is None or not p.grad.any()]
    assert silent == []
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(tc.NON_DIFFERENTIABLE.search(n) for n in frozen)
    assert any(".indexer." in n for n in frozen) and any(n.endswith("gate.bias") for n in frozen)


@slow
def test_train_script_writes_backbone_and_facts(trained):
    facts = json.loads((trained / "train.json").read_text())
    assert facts["steps_done"] == 3 and facts["qat_from_step"] == 2
    assert [e["step"] for e in facts["log"]] == [1, 2, 3]
    losses = [e["loss"] for e in facts["log"]]  # one batch, repeated: it is being memorised
    assert losses[2] < losses[1] < losses[0]
    assert np.isfinite(facts["val_nll"]) and facts["val_tokens"] == 64
    saved = torch.load(trained / "backbone.pt", weights_only=True)
    assert not any(k.startswith("mtp.") for k in saved["state_dict"])
    assert saved["config"]["quantization_config"]["weight_block_size"] == [32, 32]


@slow
def test_export_is_the_official_format(exported):
    files = sorted(p.name for p in exported.iterdir())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", f) for f in shards)
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert name in files
    assert all((exported / s).stat().st_size <= 15_000_000 for s in shards)
    assert sum((exported / f).stat().st_size for f in files) <= 36_000_000
    index = json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(shards)
    dtypes = {}
    for shard in shards:
        with safe_open(exported / shard, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                dtypes[key] = f.get_slice(key).get_dtype()
    assert set(dtypes) == set(index)
    assert dtypes["layers.0.attn.wq_a.weight"] == "F8_E4M3"
    assert dtypes["layers.0.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.3.ffn.experts.5.w2.weight"] == "I8"
    assert dtypes["layers.1.engram.embed.weight"] == "F8_E4M3"
    assert dtypes["embed.weight"] == "BF16" and dtypes["layers.2.hc_attn_fn"] == "F32"
    assert any(k.startswith("mtp.2.") for k in dtypes)


@slow
def test_exported_checkpoint_scores_like_the_fake_quantised_model(trained, exported, data_dir):
    windows = tc.eval_windows(tc.load_tokens("validation", data_dir), SEQ_LEN, 64)
    # float numerics on both sides: the FP8 / FP4 weights dequantise exactly
    loaded = load_model(exported, dtype=torch.float32, numerics="float", progress=False)
    reference = tc.load_backbone(trained / "backbone.pt")
    tc.fake_quantise_(reference)
    nll_loaded = tc.mean_nll(loaded, windows, BATCH, "cpu")
    nll_reference = tc.mean_nll(reference, windows, BATCH, "cpu")
    assert nll_loaded == pytest.approx(nll_reference, rel=1e-5)
    shipped = load_model(exported, dtype=torch.float32, progress=False)
    assert shipped.config.numerics == "model"
    nll_shipped = tc.mean_nll(shipped, windows, BATCH, "cpu")
    plain = tc.mean_nll(tc.load_backbone(trained / "backbone.pt"), windows, BATCH, "cpu")
    assert plain != nll_shipped  # quantisation changes the numbers, a little
    assert abs(plain - nll_shipped) / plain < 0.05


@slow
def test_batched_fake_quantisation_equals_the_kernels_quantisers():
    model = tc.build_model("cpu", include_mtp=True, seed=2)
    raw = tc.hf_config(quantized=True)
    parsed = parse_config(raw)
    groups = quant_groups(model, raw)
    assert {g.kind for g in groups} == {"fp8", "fp4", "bf16"}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    swap_in_quantised(groups)
    from deepinfer.engine.checkpoint.inventory import official_inventory

    inventory = official_inventory(parsed, include_mtp=True, include_vision=False)
    for g in groups:
        for name in g.names[:2]:
            want = tc.stored_value(name, before[name], inventory[name].dtype, parsed)
            got = dict(model.named_parameters())[name].detach()
            assert torch.equal(got, want), name
            if g.kind != "bf16":  # ones (norms) are exact in bf16
                assert not torch.equal(got, before[name]), name


def test_bigram_matches_dense_counts():
    rng = np.random.default_rng(0)
    vocab, train = 7, rng.integers(0, 7, size=500)
    prev, nxt = rng.integers(0, 7, size=50), rng.integers(0, 7, size=50)
    counts = np.zeros((vocab, vocab))
    np.add.at(counts, (train[:-1], train[1:]), 1)
    unigram = (np.bincount(train, minlength=vocab) + 1) / (len(train) + vocab)
    lam = 0.8
    p = lam * counts[prev, nxt] / counts.sum(1)[prev] + (1 - lam) * unigram[nxt]
    assert ev.Bigram(train, vocab).nll(prev, nxt, lam) == pytest.approx(-np.log(p).mean())


def test_training_twin_of_sparse_attention_matches_the_reference():
    import deepinfer.kernels as K
    from deepinfer.kernels.reference.attention import sparse_mqa_sink as reference
    from examples.tiny_model.training_ops import sparse_mqa_sink as twin
    from examples.tiny_model.training_ops import training_ops

    g = torch.Generator().manual_seed(5)
    q = torch.randn(40, 4, 64, generator=g)
    kv = torch.randn(70, 64, generator=g, requires_grad=True)
    indices = torch.randint(-1, 70, (40, 25), generator=g)  # holes and many duplicates
    sink = torch.randn(4, generator=g)
    want = reference(q, kv, indices, sink, 0.125)
    got = twin(q, kv, indices, sink, 0.125)
    assert torch.equal(got, want)
    (grad_want,) = torch.autograd.grad(want.square().sum(), kv)
    (grad_got,) = torch.autograd.grad(got.square().sum(), kv)
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-5, atol=1e-5)
    with training_ops():
        assert K.registry.OPS["sparse_mqa_sink"].reference is twin
    assert K.registry.OPS["sparse_mqa_sink"].reference is reference


# -- the dense-masked attention twin and the MoE twin ----------------------------------------


def training_layout_call(num_seqs, seq_len, ring, arena, width, g, outside=False, device="cpu"):
    """Random ``sparse_mqa_sink`` inputs laid out as a training batch's: kv = [ring rows |
    step tokens | arena], each query listing rows of its own sequence only: a window part
    (step tokens, unsorted, duplicated, with holes) and a compressed part (arena rows, idem;
    every third query sees only its window). ``outside``: one index into another sequence."""
    heads, dim = 4, 16
    num_tokens = num_seqs * seq_len
    base = num_seqs * ring
    rows = base + num_tokens + num_seqs * arena
    q = torch.randn(num_tokens, heads, dim, generator=g, requires_grad=True)
    kv = torch.randn(rows, dim, generator=g, requires_grad=True)
    sink = torch.randn(heads, generator=g, requires_grad=True)
    t = torch.arange(num_tokens)
    seq = t // seq_len
    window = (
        base + seq[:, None] * seq_len + torch.randint(0, seq_len, (num_tokens, width), generator=g)
    )
    window[torch.rand(num_tokens, width, generator=g) < 0.2] = -1
    window[:, :2] = window[:, 2:3]  # duplicates for sure (or holes)
    parts = [window]
    if arena:
        entries = torch.randint(0, arena, (num_tokens, width), generator=g)
        compressed = base + num_tokens + seq[:, None] * arena + entries
        compressed[torch.rand(num_tokens, width, generator=g) < 0.3] = -1
        compressed[t % 3 == 0] = -1  # rows that see only their window
        parts.append(compressed)
    indices = torch.cat(parts, dim=1)
    if outside:
        indices[1, 0] = base + ((1 // seq_len + 1) % num_seqs) * seq_len
    moved = (t.detach().to(device).requires_grad_(t.requires_grad) for t in (q, kv, sink))
    q, kv, sink = moved
    return q, kv, indices.to(device), sink


def twin_values_and_grads(fn, q, kv, indices, sink):
    out = fn(q, kv, indices, sink, 0.25)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.device)
    grads = torch.autograd.grad((out * weight).sum(), (q, kv, sink))
    return out, grads


@pytest.mark.parametrize("arena", [0, 6], ids=["window-only", "window+compressed"])
def test_dense_attention_twin_equals_the_gather_twin(arena):
    import deepinfer.kernels as K
    from examples.tiny_model.dense_attention import SequenceBlocks
    from examples.tiny_model.training_ops import sparse_mqa_sink as gather
    from examples.tiny_model.training_ops import training_ops

    g = torch.Generator().manual_seed(11 + arena)
    num_seqs, seq_len, ring = 3, 8, 5
    q, kv, indices, sink = training_layout_call(num_seqs, seq_len, ring, arena, 7, g)
    want, want_grads = twin_values_and_grads(gather, q, kv, indices, sink)
    with training_ops(SequenceBlocks(seq_len, ring)) as dense:
        got, got_grads = twin_values_and_grads(K.sparse_mqa_sink, q, kv, indices, sink)
    assert dense.num_dense == 1 and dense.num_fallback == 0
    dense.raise_on_violations()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, a, b in zip(("q", "kv", "sink"), got_grads, want_grads):
        assert b.abs().sum() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert kv.grad is None and not got_grads[1][: num_seqs * ring].any()  # ring rows unread


def test_dense_attention_twin_falls_back_or_raises_off_its_layout():
    from examples.tiny_model.dense_attention import DenseAttention, SequenceBlocks
    from examples.tiny_model.training_ops import sparse_mqa_sink as gather

    g = torch.Generator().manual_seed(3)
    q, kv, indices, sink = training_layout_call(2, 8, 5, 4, 6, g, outside=True)
    want = gather(q, kv, indices, sink, 0.25)
    checked = DenseAttention(SequenceBlocks(8, 5), gather, verify=True)
    torch.testing.assert_close(checked(q, kv, indices, sink, 0.25), want)
    assert (checked.num_dense, checked.num_fallback) == (0, 1)
    unchecked = DenseAttention(SequenceBlocks(8, 5), gather)
    unchecked(q, kv, indices, sink, 0.25)
    with pytest.raises(RuntimeError, match="1 indices outside"):
        unchecked.raise_on_violations()
    other_length = DenseAttention(SequenceBlocks(6, 5), gather)  # 16 tokens: not 6 per seq
    torch.testing.assert_close(other_length(q, kv, indices, sink, 0.25), want)
    assert other_length.num_fallback == 1


def test_grouped_moe_twin_equals_the_reference_loop():
    from examples.tiny_model.training_ops import grouped_moe_forward, moe_twins

    model = tc.build_model("cpu", seed=4)
    moe = model.layers[3].ffn
    g = torch.Generator().manual_seed(6)
    x = torch.randn(96, model.config.hidden_size, generator=g, requires_grad=True)
    ids = torch.randint(17, 8192, (96,), generator=g)
    with torch.no_grad():
        moe.gate.bias.copy_(torch.randn(moe.gate.bias.shape, generator=g))  # uneven loads
    params = [x, moe.gate.weight, moe.experts[0].w1.weight, moe.shared_experts.w2.weight]
    want = moe(x, ids)
    want_grads = torch.autograd.grad(want.square().sum(), params)
    got = grouped_moe_forward(moe, x, ids)
    got_grads = torch.autograd.grad(got.square().sum(), params)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        assert b.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    with moe_twins(model) as count:
        assert count == model.config.num_layers and "forward" in moe.__dict__
    assert "forward" not in moe.__dict__


@slow
def test_one_training_step_is_the_same_with_the_dense_and_moe_twins():
    from examples.tiny_model.dense_attention import SequenceBlocks
    from examples.tiny_model.training_ops import training_ops

    model = tc.build_model("cpu", seed=1)
    seq_len = 160  # > window (128): rows see the window and compressed entries beyond it
    tb = tc.training_batch(model.config, 2, seq_len, "cpu")
    windows = torch.randint(17, 8192, (2, seq_len + 1), generator=torch.Generator().manual_seed(0))
    params = [p for _, p in tc.trainable_parameters(model)]

    def step(**twins):
        with training_ops(**twins) as dense:
            loss = tc.token_nll(model, tb, windows)
            grads = torch.autograd.grad(loss, params)
        return loss, torch.stack([gr.norm() for gr in grads]), dense

    loss, norms, _ = step()
    loss_twin, norms_twin, dense = step(
        blocks=SequenceBlocks(seq_len, tb.cache.ring_size), model=model
    )
    assert dense.num_dense == model.config.num_layers and dense.num_fallback == 0
    dense.raise_on_violations()
    torch.testing.assert_close(loss_twin, loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norms_twin, norms, rtol=1e-3, atol=1e-7)
    assert torch.linalg.vector_norm(norms_twin) == pytest.approx(
        float(torch.linalg.vector_norm(norms)), rel=1e-5
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_dense_attention_twin_on_cuda_at_the_training_shapes(monkeypatch):
    """The twin's CUDA path at the real layout (512 tokens, ring 128, a ratio-2 arena of 256
    per sequence), fp32 without TF32, against the gather twin. Training runs the reference
    slot (the twins), never a backend's kernel (no backward): on CUDA that takes
    ``DEEPINFER_REFERENCE_OPS=1`` (train.py selects the CPU backend instead)."""
    monkeypatch.setenv("DEEPINFER_REFERENCE_OPS", "1")
    import deepinfer.kernels as K
    from examples.tiny_model.dense_attention import SequenceBlocks
    from examples.tiny_model.training_ops import sparse_mqa_sink as gather
    from examples.tiny_model.training_ops import training_ops

    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        g = torch.Generator().manual_seed(21)
        args = training_layout_call(4, 512, 128, 256, 128, g, device="cuda")
        want, want_grads = twin_values_and_grads(gather, *args)
        with training_ops(SequenceBlocks(512, 128)) as dense:
            got, got_grads = twin_values_and_grads(K.sparse_mqa_sink, *args)
        assert (dense.num_dense, dense.num_fallback) == (1, 0)
        dense.raise_on_violations()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
