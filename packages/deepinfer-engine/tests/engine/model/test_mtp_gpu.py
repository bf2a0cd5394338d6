"""The DSpark drafter on the GPU drafts what it drafts on the CPU.

Run on a GPU machine: ``.venv/bin/python -m pytest
packages/deepinfer-engine/tests/engine/model/test_mtp_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.layers import Embedding, LinearFactory
from deepinfer.engine.model.mtp import DSparkDraft
from deepinfer.engine.model.rope import RopeTables

from .test_mtp import BLOCK, DIM, VOCAB, randomise, tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _draft_on(device, v41):
    cfg = tiny_config(v41)
    draft = DSparkDraft(cfg, LinearFactory(cfg, torch.float32))
    randomise(draft)
    embed = Embedding(VOCAB, DIM, dtype=torch.float32)
    randomise(embed, 1)
    layout = CacheLayout(num_blocks=1, num_slots=2, max_draft=BLOCK)
    cache = ModelCache(cfg, layout, dtype=torch.float32, device=device)
    draft, embed = draft.to(device), embed.to(device)
    draft.allocate(cache)
    return draft, embed, cache, RopeTables(cfg, device)


@pytest.mark.parametrize("v41", [False, True])
def test_propose_on_cuda_matches_cpu(v41):
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(11, 2 * DIM, generator=g)
    head = torch.randn(VOCAB, DIM, generator=g)
    slots = torch.tensor([0] * 5 + [1] * 6)
    positions = torch.cat([torch.arange(5), torch.arange(6)])
    out = {}
    for device in ("cpu", "cuda"):
        draft, embed, cache, rope = _draft_on(device, v41)
        draft.seed(taps.to(device), positions.to(device), slots.to(device), cache, rope)
        out[device] = draft.propose(
            torch.tensor([3, 9], device=device),
            torch.tensor([4, 5], device=device),
            torch.tensor([0, 1], device=device),
            cache,
            embed,
            head.to(device),
            rope,
        )
    torch.testing.assert_close(out["cuda"].logits.cpu(), out["cpu"].logits, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(
        out["cuda"].confidence_logits.cpu(), out["cpu"].confidence_logits, atol=1e-3, rtol=1e-3
    )
