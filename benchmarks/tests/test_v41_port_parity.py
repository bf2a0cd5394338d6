"""The port parity benchmark's ``port_layout`` row changes only where attention sums: our model
with its attention reductions taken over the port's key axis gives our model's logits to fp32
accuracy (the port itself is not needed for this); the ``port_perturbed`` rows move each
perturbed element by exactly one fp32 ulp."""

from __future__ import annotations

import torch

from benchmarks.fidelity import port_self
from benchmarks.fidelity import v41_port_parity as parity
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.engram_hashing import compressed_token_map
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing import random_checkpoint
from deepinfer.engine.testing.simple_runner import SimpleRunner
from deepinfer.kernels import registry


def test_port_layout_is_our_attention_summed_in_another_order() -> None:
    # the head sizes that do not round: a reordered sum cannot move a rounding boundary here
    raw = parity._config("inactive")
    model = build_model(parse_config(raw), device="cpu", dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    parity._randomise(model, gen)
    vocab = raw["text_config"]["vocab_size"]
    model.bind_engram(compressed_token_map(random_checkpoint.testing_tokenizer_for(vocab).backend))
    ids = torch.randint(0, vocab, (256,), generator=gen).tolist()
    with torch.no_grad():
        want = SimpleRunner(model, max_seqs=1, max_len=256).step({0: ids})[0]
    op = registry.OPS["sparse_mqa_sink"]
    layout = parity._PortLayout(model)
    registry.OPS[op.name] = registry.OpDef(op.name, op.contract, layout)
    try:
        with torch.no_grad():
            got = SimpleRunner(model, max_seqs=1, max_len=256).step({0: ids})[0]
    finally:
        registry.OPS[op.name] = op
    assert set(layout.emitted) == {1, 4}  # both kv sources mapped their entries
    # Same products, other summation order: fp32 rounding differences through six layers
    # (measured 1.0e-5). 256 tokens: the arenas hold their entries out of emission order, so
    # a column mapping that skipped the entry order moves whole rows (checked: it fails).
    torch.testing.assert_close(got.log_softmax(-1), want.log_softmax(-1), atol=1e-4, rtol=0)


def test_port_perturbations_move_one_ulp() -> None:
    x = torch.randn(1, 256, 128, generator=torch.Generator().manual_seed(0)) / 128**0.5
    y = port_self.one_ulp_everywhere(x, seed=3)
    assert bool((y != x).all())
    assert torch.equal(torch.nextafter(y, x), x)  # one representable step from each element
    up = (y > x).float().mean()
    assert 0.45 < float(up) < 0.55  # both directions, drawn per element
    assert torch.equal(port_self.one_ulp_everywhere(x, seed=3), y)
    one = port_self.one_ulp_once(x)
    assert int((one != x).sum()) == 1 and bool(one[0, 0, 0] > x[0, 0, 0])
    assert torch.equal(torch.nextafter(one, x), x)
