"""Under ``DEEPINFER_BATCH_INVARIANT=1``, the model-level pieces around the kernels' ops:

- the LM head (final collapse, norm, head matmul): a row's fp32 logits alone equal its row in
  batches of 1, 7, 64 and 1,000 random rows;
- chunk borders: a sequence's logits are bitwise the same whether its prompt runs in one step
  or split at any border (the compressors' partial windows, the Engram n-gram history and the
  sliding window carried across in the cache's state), with a random neighbour sequence in the
  second step; for tiny V4 (overlapping ratio 4, ratio 8) and V4.1 (ratios 1 and 2, Engram).
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.checkpoint.dummy import fill_dummy
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing import tiny_v4_config, tiny_v41_config
from deepinfer.engine.testing.simple_runner import SimpleRunner
from deepinfer.kernels.testing.invariance import check_rows

BLOCK_SIZE = 16
LENGTH = 21  # past two windows of every compression ratio and the sliding window (8)


@pytest.fixture(autouse=True)
def _invariant(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")


def _model(arch: str):
    if arch == "v41":
        raw = tiny_v41_config(vision=False)
    else:
        raw = tiny_v4_config(hca_ratio=8)
    model = build_model(parse_config(raw), device="cpu", dtype=torch.float32)
    fill_dummy(model, seed=0)
    if arch == "v41":
        vocab = raw["text_config"]["engram_compressed_vocab_size"]
        gen = torch.Generator().manual_seed(1)
        model.bind_engram(torch.randint(0, vocab, (model.config.vocab_size,), generator=gen))
    return model.eval()


@pytest.fixture(scope="module", params=["v4", "v41"])
def model(request):
    return _model(request.param)


@torch.no_grad()
def test_lm_head_row_alone_equals_row_in_batch(model):
    cfg = model.config
    gen = torch.Generator().manual_seed(5)
    rows = []
    for _ in range(1000):
        row = {"streams": torch.randn(1, cfg.hc_mult, cfg.hidden_size, generator=gen)}
        if model.mix.__class__.__name__ == "DeferredMix":  # V4.1 collapses with its own pre
            row["pre"] = torch.rand(1, cfg.hc_mult, generator=gen)
        rows.append(row)

    def head(streams, pre=None):
        return model.logits(streams, pre, None)

    check_rows(head, {}, rows, (1, 7, 64, 1000), "LM head")


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=gen).tolist()


@torch.no_grad()
def test_logits_do_not_depend_on_where_the_prompt_is_split(model):
    vocab = model.config.vocab_size
    prompt, neighbour = _prompt(0, LENGTH, vocab), _prompt(1, 13, vocab)
    whole = SimpleRunner(model, max_seqs=2, max_len=64, block_size=BLOCK_SIZE).step({0: prompt})[0]
    for border in (3, 9, 17):  # mid-window of ratios 2, 4, 8; past the window (8), a block (16)
        runner = SimpleRunner(model, max_seqs=2, max_len=64, block_size=BLOCK_SIZE)
        first = runner.step({0: prompt[:border]})[0]
        second = runner.step({1: neighbour, 0: prompt[border:]})[0]
        split = torch.cat([first, second])
        for t in range(LENGTH):
            assert torch.equal(split[t], whole[t]), f"split at {border}: position {t} differs"
