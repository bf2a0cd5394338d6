"""Images through ``LLM`` on the tiny random V4.1 checkpoint with a one-block vision tower.

Greedy tokens of an image request are the same alone, in a batch of mixed text and image
requests and under chunked prefill with a small budget (batch-invariant mode), and equal the
argmax of one plain forward with the tower's span put in by hand; different images change the
logits; image rows route with ``bias_vl``; each bad image input fails its request alone."""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from deepinfer.engine.checkpoint.model_loader import load_model
from deepinfer.engine.frontend.images import decode_image, preprocess
from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.model.vision_config import plan_image
from deepinfer.engine.testing import make_random_checkpoint, tiny_v41_config
from deepinfer.engine.testing.simple_runner import SimpleRunner
from deepinfer.engine.tokenizer.special_tokens import IMAGE_TOKEN
from deepinfer.sampling import SamplingParams

IMAGE_ID = 15  # tiny_v41_config's image_token_id (the test tokenizer's IMAGE_TOKEN)
MAX_TOKENS = 3


def _image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("v41-vision")
    make_random_checkpoint(directory, tiny_v41_config(), quantized=False, seed=1)
    return directory


@pytest.fixture(scope="module")
def llm(vision_checkpoint):
    return LLM(str(vision_checkpoint), dtype="float32", block_size=16, max_model_len=160)


def _greedy(llm, prompts, **kw):
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    return llm.generate(prompts, sp, use_tqdm=False, **kw)


def _ask(text_before: str, image, text_after: str = " what is it?") -> dict:
    return {"prompt": text_before + IMAGE_TOKEN + text_after, "multi_modal_data": {"image": image}}


def test_same_tokens_alone_in_a_mixed_batch_and_chunked(vision_checkpoint, llm, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    wide, tall = _image(0, 90, 40), _image(1, 30, 80)
    prompts = [
        _ask("look: ", wide),
        "a text prompt in between",
        {"prompt": "two " + IMAGE_TOKEN + IMAGE_TOKEN, "multi_modal_data": {"image": [tall, wide]}},
    ]
    together = [o.outputs[0].token_ids for o in _greedy(llm, prompts)]
    assert all(len(t) == MAX_TOKENS for t in together)
    for index in (0, 2):  # the image requests alone
        assert _greedy(llm, [prompts[index]])[0].outputs[0].token_ids == together[index]
    chunked = LLM(
        str(vision_checkpoint), dtype="float32", block_size=16, max_model_len=160,
        max_num_batched_tokens=16,
    )  # fmt: skip
    assert [o.outputs[0].token_ids for o in _greedy(chunked, prompts)] == together


def test_the_engine_equals_a_plain_forward_with_the_span(vision_checkpoint, llm, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    image = _image(2, 50, 70)
    out = _greedy(llm, [_ask("see ", image)])[0]
    prompt, generated = list(out.prompt_token_ids), out.outputs[0].token_ids
    model = load_model(vision_checkpoint, dtype=torch.float32, progress=False)
    config = model.vision_config
    rgb = decode_image(image)
    plan = plan_image(*rgb.size, config)
    span = model.encode_image(
        torch.from_numpy(preprocess(rgb, plan, config)), plan.vit_h, plan.vit_w
    )
    start = prompt.index(IMAGE_ID)
    assert prompt[start : start + plan.num_tokens] == [IMAGE_ID] * plan.num_tokens
    tokens = prompt + generated
    runner = SimpleRunner(model, max_seqs=1, max_len=len(tokens), block_size=16)
    batch = dataclasses.replace(
        runner.batch({0: tokens}),
        image_rows=torch.arange(start, start + plan.num_tokens),
        image_embeds=span,
    )
    with torch.no_grad():
        logits = model(batch, runner.cache)
    assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == generated


def test_different_images_give_different_logits(llm):
    a, b = _image(3, 60, 60), _image(4, 60, 60)
    outs = _greedy(llm, [_ask("x ", a), _ask("x ", b), _ask("x ", a)])
    ((token, logprob_a),) = outs[0].outputs[0].logprobs[0].items()
    assert outs[2].outputs[0].logprobs[0][token] == pytest.approx(logprob_a, abs=1e-5)
    logprob_b = outs[1].outputs[0].logprobs[0].get(token)  # None: b chose another token
    assert logprob_b is None or abs(logprob_b - logprob_a) > 1e-3


def test_image_rows_route_with_bias_vl(vision_checkpoint):
    """Swapping ``bias_vl`` for ``bias`` changes an image request's logits, not a text one's."""
    model = load_model(vision_checkpoint, dtype=torch.float32, progress=False)
    runner = SimpleRunner(model, max_seqs=2, max_len=32, block_size=16)
    tokens = [20, 21, IMAGE_ID, IMAGE_ID, IMAGE_ID, IMAGE_ID, IMAGE_ID, 22]
    gen = torch.Generator().manual_seed(0)
    embeds = torch.randn(5, model.config.hidden_size, generator=gen)

    def logits(seq):
        batch = runner.batch({seq: tokens})
        batch = dataclasses.replace(batch, image_rows=torch.arange(2, 7), image_embeds=embeds)
        with torch.no_grad():
            return model(batch, runner.cache)

    before = logits(0)
    with torch.no_grad():
        for layer in model.layers:
            layer.ffn.gate.bias_vl.copy_(layer.ffn.gate.bias)
    assert not torch.allclose(before[-1], logits(1)[-1], atol=1e-4)


def test_bad_image_inputs_fail_alone(llm, dspark_checkpoint, tmp_path):
    good = _image(5, 40, 40)
    good.save(tmp_path / "good.png")
    prompts = [
        _ask("ok ", str(tmp_path / "good.png")),
        {"prompt": "no placeholder", "multi_modal_data": {"image": good}},
        {"prompt": "two " + IMAGE_TOKEN + IMAGE_TOKEN, "multi_modal_data": {"image": good}},
        {"prompt": "a placeholder but no image " + IMAGE_TOKEN},
        _ask("junk ", b"\x89PNG not really"),
        _ask("empty ", Image.new("RGB", (0, 7))),
        _ask("missing ", "file:///no/such/image.png"),
        _ask("ok ", f"file://{tmp_path / 'good.png'}"),
    ]
    outs = _greedy(llm, prompts)
    errors = [o.outputs[0].error for o in outs]
    assert [o.outputs[0].finish_reason for o in outs] == [
        "length", "error", "error", "error", "error", "error", "error", "length"
    ]  # fmt: skip
    assert outs[0].outputs[0].token_ids == outs[7].outputs[0].token_ids
    assert "request 1: the prompt has 0 image placeholder(s)" in errors[1]
    assert "request 2: the prompt has 2 image placeholder(s)" in errors[2]
    assert "but 1 image(s) were given" in errors[2]
    assert "request 3: the prompt has 1 image placeholder(s)" in errors[3]
    assert "request 4: image 0: cannot decode" in errors[4]
    assert "request 5: image 0: the image is 0x7 pixels" in errors[5]
    assert "request 6: image 0:" in errors[6] and "no such image file" in errors[6]

    text_only = LLM(str(dspark_checkpoint), dtype="float32", block_size=16, max_model_len=64)
    outs = _greedy(text_only, ["plain", _ask("look ", good), "plain too"])
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert (
        "request 1: it has 1 image(s) but the model has no vision tower" in outs[1].outputs[0].error
    )


def test_an_image_too_large_for_the_limits_fails_alone(vision_checkpoint):
    small = LLM(
        str(vision_checkpoint), dtype="float32", block_size=16, max_model_len=32,
        max_num_batched_tokens=12,
    )  # fmt: skip
    big, tiny = _image(6, 200, 200), _image(7, 20, 20)  # spans of 14 and 5 positions
    outs = _greedy(small, [_ask("a ", tiny), _ask("b " * 20, big), _ask("c ", big), "d"])
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "error", "length"]
    assert "expected fewer than max_model_len=32" in outs[1].outputs[0].error
    assert "request 2: an image span of 14 tokens" in outs[2].outputs[0].error
    assert "max_num_batched_tokens=12" in outs[2].outputs[0].error


def test_chat_image_parts_equal_generate_with_the_placeholder(llm, tmp_path):
    image = _image(8, 70, 30)
    image.save(tmp_path / "a.png")
    encoded = base64.b64encode((tmp_path / "a.png").read_bytes()).decode()
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    conversations = [
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}]}],
        [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{encoded}"}},
            {"type": "text", "text": "hi"},
        ]}],
        [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": f"file://{tmp_path / 'a.png'}"}},
            {"type": "text", "text": "hi"},
        ]}],
    ]  # fmt: skip
    chats = llm.chat(conversations, sp, use_tqdm=False)
    ids = llm.get_tokenizer().encode_chat([{"role": "user", "content": IMAGE_TOKEN + "hi"}])
    direct = llm.generate(
        {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, sp, use_tqdm=False
    )[0]
    assert IMAGE_ID in direct.prompt_token_ids
    for out in chats:
        assert out.prompt_token_ids == direct.prompt_token_ids
        assert out.outputs[0].token_ids == direct.outputs[0].token_ids


def _type_lines(monkeypatch, *lines: str) -> None:
    """``input()`` returns ``lines``, then raises EOFError (Ctrl-D)."""
    pending = iter(lines)

    def fake_input(prompt: str = "") -> str:
        try:
            return next(pending)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", fake_input)


def test_cli_chat_takes_images(vision_checkpoint, tmp_path, monkeypatch, capsys):
    from deepinfer.engine.cli import main

    _image(9, 40, 50).save(tmp_path / "b.png")
    args = ["chat", "--model", str(vision_checkpoint), "--accelerator", "cpu", "--max-tokens", "2"]
    args += ["--max-model-len", "128"]
    _type_lines(monkeypatch, "describe it", "and now?")
    assert main([*args, "--image", str(tmp_path / "b.png"), "--image", "none.png"]) == 0
    err = capsys.readouterr().err
    # the first turn holds both images and fails; it is dropped, so the second one runs
    assert "request 0: image 1:" in err and "no such image file" in err
    assert err.count("deepinfer: error") == 1


def test_image_rows_are_engram_barriers(vision_checkpoint):
    """A text token right after an image span hashes its n-grams as the first token of a
    sequence does (no look-back into or across the span)."""
    model = load_model(vision_checkpoint, dtype=torch.float32, progress=False)
    runner = SimpleRunner(model, max_seqs=2, max_len=32, block_size=16)
    after = [20, 21, IMAGE_ID, IMAGE_ID, IMAGE_ID, IMAGE_ID, IMAGE_ID, 22, 23]
    batch = runner.batch({0: after, 1: [22, 23]})
    image_mask = torch.zeros(len(after) + 2, dtype=torch.bool)
    image_mask[2:7] = True
    rows = model.engram_rows(batch, runner.cache, image_mask)
    torch.testing.assert_close(rows[7:9], rows[9:11], rtol=0, atol=0)
    plain = SimpleRunner(model, max_seqs=1, max_len=32, block_size=16)
    text_rows = model.engram_rows(plain.batch({0: after}), plain.cache)
    assert not torch.equal(text_rows[7], rows[7])  # without the barrier it looks back


def test_stream_takes_images(llm):
    image = _image(10, 45, 45)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    done = llm.generate(["t", "u"], sp, use_tqdm=False, multi_modal_data=[None, None])
    assert [len(o.outputs[0].token_ids) for o in done] == [MAX_TOKENS] * 2
    streamed = [
        t
        for d in llm.stream(["a " + IMAGE_TOKEN], sp, multi_modal_data={"image": image})
        for t in d.outputs[0].token_ids
    ]
    direct = llm.generate([_ask("a ", image, "")], sp, use_tqdm=False)[0]
    assert streamed == direct.outputs[0].token_ids
