"""YoCo prefill truncation on the small random V4.1 model (window 8, consumer layers 5-7, DSpark
taps 5-7): ``compact`` equals ``mask`` bit for bit through a chunked prefill next to a whole
one, a verify step and its rollback, and never reads a window row it skipped; a keep of the
whole prompt equals ``off``; the consumer layers compute only the kept rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.engine.checkpoint.dummy import fill_dummy
from deepinfer.engine.model.config_parsing import parse_config
from deepinfer.engine.model.metadata import ForwardBatch
from deepinfer.engine.model.model import build_model
from deepinfer.engine.model.yoco import consumer_rows, kept_rows, prefill_truncation
from deepinfer.engine.testing.configs import tiny_v4_config, tiny_v41_config
from deepinfer.engine.testing.simple_runner import SimpleRunner

MAX_DRAFT = 3
KEEP = 12  # >= window 8 + MAX_DRAFT
PROMPTS = {0: 26, 1: 6}


@pytest.fixture(scope="module")
def model():
    raw = tiny_v41_config(vision=False)
    m = build_model(parse_config(raw), device="cpu", dtype=torch.float32)
    fill_dummy(m, seed=0)
    gen = torch.Generator().manual_seed(1)
    vocab = raw["text_config"]["engram_compressed_vocab_size"]
    m.bind_engram(torch.randint(0, vocab, (m.config.vocab_size,), generator=gen))
    return m.eval()


@pytest.fixture(scope="module")
def runs(model):
    """``(mode, keep, chunked, poisoned) -> steps``, each run once. Batch invariant: compact
    runs the consumer layers on fewer rows than mask, so they agree only row for row."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    done = {}

    def get(mode, keep, poison=False):
        key = (mode, keep, poison)
        if key not in done:
            done[key] = _run(model, mode, keep, poison=poison)
        return done[key]

    yield get
    mp.undo()


def _tokens(seed: int) -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return {s: torch.randint(3, 500, (n + 8,), generator=gen).tolist() for s, n in PROMPTS.items()}


def _steps(tokens: dict[int, list[int]]) -> list[tuple[dict, str | None]]:
    """(chunks, then) per step: prefill (sequence 0 in two chunks, sequence 1 whole), a
    verify-shaped step of 1 + MAX_DRAFT rows rolled back, then one decode row each."""
    p0, p1 = PROMPTS[0], PROMPTS[1]
    prefill = [{0: tokens[0][:12], 1: tokens[1][:p1]}, {0: tokens[0][12:p0]}]
    verify = {s: tokens[s][n : n + 1 + MAX_DRAFT] for s, n in PROMPTS.items()}
    decode = {s: tokens[s][n : n + 1] for s, n in PROMPTS.items()}
    return [(c, None) for c in prefill] + [(verify, "rollback"), (decode, None)]


@torch.no_grad()
def _run(model, mode: str, keep: int, *, poison: bool = False):
    """Each step's (StepOutput, batch). The steps after the prefill run with truncation off,
    as the decode graphs run them: every query reads its whole window, whatever was kept."""
    model.truncation = None
    if mode != "off":
        model.set_prefill_truncation(mode, keep, MAX_DRAFT)
    runner = SimpleRunner(model, max_seqs=2, max_len=64, block_size=16, max_draft=MAX_DRAFT)
    if poison:  # every consumer window row truncation may skip
        for layer in range(model.truncation.boundary, model.config.num_layers):
            _poison(runner.cache[f"{layer}.window"])
    tokens, outs = _tokens(0), []
    for chunks, then in _steps(tokens):
        batch = runner.batch(chunks)
        if all(runner.lengths.get(s, 0) >= PROMPTS[s] for s in chunks):
            model.truncation = None
        batch = dataclasses.replace(batch, prompt_lens=torch.tensor([PROMPTS[s] for s in chunks]))
        outs.append((model.forward_step(batch, runner.cache), batch))
        for s, ids in chunks.items():
            runner.lengths[s] = runner.lengths.get(s, 0) + len(ids)
        if then == "rollback":
            for s in chunks:
                runner.rollback(s, MAX_DRAFT)
    model.truncation = None
    return outs


def _poison(rows: torch.Tensor) -> None:
    """NaN in every row: NaN itself, or in a packed cache all bytes 0xFF (NaN as an FP8 e4m3
    code and as a UE8M0 scale)."""
    rows.fill_(float("nan") if rows.is_floating_point() else 0xFF)


def _rows(out, batch) -> torch.Tensor:
    return out.rows if out.rows is not None else torch.arange(batch.input_ids.shape[0])


def test_compact_equals_mask_bit_for_bit_and_never_reads_a_skipped_row(runs):
    # compact starts with NaN consumer rings: a query reading a row it skipped would turn NaN
    mask, compact = runs("mask", KEEP), runs("compact", KEEP, poison=True)
    dropped = 0
    for (m, batch), (c, _) in zip(mask, compact, strict=True):
        rows = _rows(c, batch)
        dropped += batch.input_ids.shape[0] - len(rows)
        assert torch.isfinite(c.logits).all()
        assert torch.equal(c.logits, m.logits[rows])
        assert torch.equal(c.taps, m.taps[rows])  # DSpark taps are consumer layers here
    assert dropped > 0  # truncation really skipped rows
    assert compact[-1][0].rows is None  # decode and verify rows are never dropped
    # an approximation: the narrowed windows change the prompt's last rows
    assert not torch.equal(runs("off", KEEP)[-1][0].logits, mask[-1][0].logits)


def test_keep_of_the_whole_prompt_equals_off(runs):
    off, compact = runs("off", KEEP), runs("compact", max(PROMPTS.values()))
    for (o, _), (c, _) in zip(off, compact, strict=True):
        assert c.rows is None
        assert torch.equal(c.logits, o.logits)


def test_consumer_layers_compute_only_the_kept_rows(model, monkeypatch):
    seen: dict[int, int] = {}
    for block in model.layers:
        original = block.attn.forward

        def counting(x, ctx, _id=block.layer_id, _f=original):
            seen[_id] = x.shape[0]
            return _f(x, ctx)

        monkeypatch.setattr(block.attn, "forward", counting)
    model.set_prefill_truncation("compact", KEEP, MAX_DRAFT)
    runner = SimpleRunner(model, max_seqs=2, max_len=64, block_size=16, max_draft=MAX_DRAFT)
    batch = runner.batch({s: _tokens(0)[s][:n] for s, n in PROMPTS.items()})
    with torch.no_grad():
        model.forward_step(batch, runner.cache)
    boundary = model.truncation.boundary
    # sequence 0 keeps its last KEEP rows, sequence 1 (shorter than KEEP) all of them
    assert consumer_rows(batch, model.truncation) == KEEP + PROMPTS[1]
    assert all(seen[i] == sum(PROMPTS.values()) for i in range(boundary))
    assert all(seen[i] == KEEP + PROMPTS[1] for i in range(boundary, model.config.num_layers))
    model.truncation = None


@pytest.mark.parametrize("chunk", [8192, 2048], ids=["unchunked", "chunks of 2048"])
def test_consumer_flops_of_an_8k_prompt_drop_by_90_percent(model, chunk):
    """Rows counted by the function the forward uses; a consumer row costs the same FLOPs in
    every mode (projections, MoE and attention over window + top-k), so FLOPs scale with rows."""
    prompt, keep = 8192, 140
    truncation = prefill_truncation(model.config, "compact", keep, 5)
    rows = 0
    runner = SimpleRunner(model, max_seqs=1, max_len=prompt, block_size=128)
    for start in range(0, prompt, chunk):
        batch = runner.batch({0: [0] * chunk})
        batch = dataclasses.replace(batch, prompt_lens=torch.tensor([prompt]))
        rows += consumer_rows(batch, truncation)
        runner.lengths[0] = start + chunk
    assert rows == keep + prompt // chunk - 1  # one placeholder row per earlier chunk
    assert 1 - rows / prompt >= 0.9


def test_bad_settings_are_refused_in_one_line(model):
    v4 = parse_config(tiny_v4_config())
    with pytest.raises(ValueError, match="no YoCo consumer layers"):
        prefill_truncation(v4, "compact", 140, 0)
    with pytest.raises(ValueError, match=r"keep_tokens=10: expected >= sliding_window .* 8 \+ 3"):
        prefill_truncation(model.config, "mask", 10, 3)
    with pytest.raises(ValueError, match="expected one of off, mask, compact"):
        prefill_truncation(model.config, "on", 140, 0)
    assert prefill_truncation(model.config, "off", 0, 0) is None
    assert prefill_truncation(model.config, "compact", 0, 3).keep_tokens == 11


def test_kept_rows_read_the_host_copies_only():
    """An eager step's cut comes from the batch's host copies (``step_batch`` keeps the prompt
    lengths there): the device fields, here on the meta device, are never read back."""
    host = {"cu_seqlens_q": torch.tensor([0, 5, 8]), "seq_lens": torch.tensor([5, 12]),
            "prompt_lens": torch.tensor([5, 20])}  # fmt: skip
    meta = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in host.items()}
    batch = ForwardBatch(input_ids=torch.empty(8, dtype=torch.long, device="meta"),
                         positions=torch.empty(8, dtype=torch.long, device="meta"),
                         block_tables=torch.empty(2, 1, dtype=torch.int32, device="meta"),
                         state_slots=torch.empty(2, dtype=torch.long, device="meta"),
                         **meta, host=host)  # fmt: skip
    kept = kept_rows(batch, keep_tokens=2)
    # sequence 0: prompt 5, cut 3 -> rows 3, 4; sequence 1: prompt 20 past its step -> last row
    assert kept.rows.tolist() == [3, 4, 7] and kept.counts.tolist() == [2, 1]
