"""A V4-Flash-sized model of 2 layers (CSA + HCA, real widths, FP8 / FP4 weights) built with
``load_format="dummy"`` on the GPU runs a prefill and decode steps through the reference ops.

Run on the GPU machine with ``-s`` to see memory and time:
    python -m pytest packages/deepinfer-engine/tests/engine/model/test_v4_flash_dummy_gpu.py -q -s
"""

from __future__ import annotations

import time

import pytest
import torch

from deepinfer.engine.checkpoint import load_into
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing.simple_runner import SimpleRunner

from .test_config import V4_FLASH, V41, V41_TEXT  # noqa: TID252

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


V4_TWO_LAYERS = {
    **V4_FLASH,
    "num_hidden_layers": 2,
    "compress_ratios": [4, 128],
    "num_hash_layers": 1,
}
# V4.1 widths, a ratio-2 source then a ratio-1 source (the candidate source); no Engram (its
# real tables are ~98 GB each) and no draft stages.
V41_TWO_LAYERS = {
    **V41,
    "text_config": {
        **V41_TEXT,
        "num_hidden_layers": 2,
        "compress_ratios": [2, 1],
        "kv_source_layer_ids": [0, 1],
        "index_source_layer_ids": [0, 1],
        "candidate_source_layer_id": 1,
        "engram_layer_ids": [],
        "engram_num_embeddings": [],
        "dspark_target_layer_ids": [],
    },
}


@pytest.mark.parametrize("raw", [V4_TWO_LAYERS, V41_TWO_LAYERS], ids=["v4-flash", "v4.1-flash"])
def test_flash_sized_two_layer_dummy_forward(raw):
    config = parse_config(raw)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = build_model(config, device="cuda", dtype=torch.bfloat16)
    load_into(model, load_format="dummy")
    torch.cuda.synchronize()
    built = time.perf_counter() - start
    weights_gib = torch.cuda.memory_allocated() / 2**30
    prompt = 1024
    runner = SimpleRunner(model, max_seqs=2, max_len=prompt + 8, device="cuda")
    ids = torch.randint(0, config.vocab_size, (prompt + 4,)).tolist()
    start = time.perf_counter()
    logits = runner.step({0: ids[:prompt], 1: ids[: prompt // 2]})
    torch.cuda.synchronize()
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    for t in ids[prompt : prompt + 4]:
        step = runner.step({0: [t], 1: [t]})
    torch.cuda.synchronize()
    decode = (time.perf_counter() - start) / 4
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    print(
        f"\n{config.architecture} 2-layer dummy: build+fill {built:.1f} s, weights {weights_gib:.2f} GiB, "
        f"prefill {prompt}+{prompt // 2} tok {prefill:.2f} s, decode step (2 seq) "
        f"{decode * 1e3:.0f} ms, peak {peak_gib:.2f} GiB"
    )
    assert logits[0].shape == (prompt, config.vocab_size)
    assert torch.isfinite(logits[0]).all() and torch.isfinite(step[0]).all()
    assert weights_gib > 5  # real widths: 2 x 256 / 384 FP4 experts + embed + head
