"""``forward_step`` hands the draft stages what they read: DSpark taps (V4.1: the streams
entering the tap layers; V4-0731: the layers' outputs; mean over streams, fp32) and the final
streams."""

from __future__ import annotations

import dataclasses

import torch

from deepinfer.engine.model.block import Block
from deepinfer.engine.testing.simple_runner import SimpleRunner

from .test_v4_invariants import RAW as V4_RAW  # noqa: TID252
from .test_v4_invariants import random_model  # noqa: TID252
from .test_v41_invariants import RAW, TEXT, random_v41_model  # noqa: TID252


def _recording(monkeypatch, method):
    seen = {}
    original = getattr(Block, method)

    def wrapped(self, h, *args):
        out = original(self, h, *args)
        seen[self.layer_id] = (h, out[0] if isinstance(out, tuple) else out)
        return out

    monkeypatch.setattr(Block, method, wrapped)
    return seen


def test_v41_taps_are_the_streams_entering_the_tap_layers(monkeypatch):
    taps = [2, 4, 5]
    model = random_v41_model({**RAW, "text_config": {**TEXT, "dspark_target_layer_ids": taps}})
    seen = _recording(monkeypatch, "forward_v41")
    runner = SimpleRunner(model, max_seqs=1, max_len=20, block_size=16)
    out = model.forward_step(runner.batch({0: list(range(3, 23))}), runner.cache)
    want = torch.cat([seen[i][0].float().mean(1) for i in taps], dim=-1)
    torch.testing.assert_close(out.taps, want, atol=0, rtol=0)
    assert out.streams.shape == (20, TEXT["hc_mult"], TEXT["hidden_size"])


def test_v4_taps_are_the_tap_layers_outputs(monkeypatch):
    taps = [1, 3]
    model = random_model({**V4_RAW, "dspark_target_layer_ids": taps})
    seen = _recording(monkeypatch, "forward")
    runner = SimpleRunner(model, max_seqs=1, max_len=20)
    out = model.forward_step(runner.batch({0: list(range(3, 23))}), runner.cache)
    want = torch.cat([seen[i][1].float().mean(1) for i in taps], dim=-1)
    torch.testing.assert_close(out.taps, want, atol=0, rtol=0)


def test_logits_indices_select_rows(monkeypatch):
    # the head then runs over 2 rows instead of 17: bitwise equal only in batch-invariant mode,
    # since torch's CPU matmul may pick its summation order from the row count
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    model = random_v41_model()
    runner = SimpleRunner(model, max_seqs=2, max_len=20, block_size=16)
    batch = runner.batch({0: list(range(3, 13)), 1: list(range(5, 12))})
    full = model(batch, runner.cache)
    runner = SimpleRunner(model, max_seqs=2, max_len=20, block_size=16)
    rows = torch.tensor([9, 16])  # the last token of each sequence
    picked = model(dataclasses.replace(batch, logits_indices=rows), runner.cache)
    torch.testing.assert_close(picked, full[rows], atol=0, rtol=0)
