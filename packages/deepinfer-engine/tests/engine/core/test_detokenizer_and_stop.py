import random
from pathlib import Path

import pytest

from deepinfer.engine.core.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, TokenBytes
from deepinfer.engine.core.request import Request
from deepinfer.engine.core.stop import check_new_token
from deepinfer.engine.testing.fake_executor import ByteTokenizer
from deepinfer.sampling import SamplingParams

TEXTS = ["héllo wörld", "日本語のテキスト", "emoji 😀🎉 mixed ascii", "ÅΩ≈ç√∫ end"]


def _bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 5 + ["plain words and more words"] * 5, trainer)
    return tok


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_streamed_deltas_join_to_the_full_text_without_garbage(kind):
    tok = ByteTokenizer() if kind == "bytes" else _bpe_tokenizer()
    encode = tok.encode if kind == "bytes" else (lambda s: tok.encode(s).ids)
    rng = random.Random(1)
    for _ in range(20):
        prompt_text = rng.choice(TEXTS)
        out_text = "".join(rng.sample(TEXTS, 2))
        prompt, out = encode(prompt_text), encode(out_text)
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = [detok.append(t) for t in out]
        assert all(REPLACEMENT_CHAR not in d for d in deltas)
        assert "".join(deltas) == tok.decode(out)
        assert "".join(deltas) == out_text


EMBEDDED = Path(__file__).resolve().parents[5] / "examples" / "tiny_model" / "checkpoint"


def _two_decode_deltas(tokenizer, prompt, tokens, skip):
    """The deltas of the plain prefix / read offsets method: two decodes per token (the window
    restarts at the read offset after every emit), the reference for the one-decode window."""
    ids, deltas = list(prompt), []
    read = len(ids)
    start = max(read - 5, 0)
    for token in tokens:
        ids.append(token)
        prefix = tokenizer.decode(ids[start:read], skip_special_tokens=skip)
        full = tokenizer.decode(ids[start:], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            deltas.append("")
            continue
        deltas.append(full[len(prefix) :])
        start, read = read, len(ids)
    return deltas


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_of_random_ids_match_two_decodes_and_the_full_decode(skip):
    """Random ids of the embedded tokenizer (specials, split UTF-8 bytes and all): the deltas
    equal the two-decode method's; after a text prompt they join to the full decode of the
    ids, less a trailing character still incomplete (held back)."""
    from deepinfer.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(EMBEDDED)
    rng = random.Random(7)
    text_prompt = tok.encode("A prompt, then random ids:")
    for trial in range(300):
        random_prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(12))]
        prompt = text_prompt if trial % 2 else random_prompt
        out = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas = [detok.append(t) for t in out]
        assert deltas == _two_decode_deltas(tok, prompt, out, skip)
        if prompt is text_prompt:
            full, joined = tok.decode(out, skip_special_tokens=skip), "".join(deltas)
            held_back = full[len(joined) :]
            assert full.startswith(joined)
            assert not held_back or held_back.endswith(REPLACEMENT_CHAR)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("kind", ["embedded", "bpe"])
def test_byte_path_deltas_equal_the_window_decodes(kind, skip):
    """With a TokenBytes table (byte-level tokenizers) the deltas are the window decodes',
    for random ids mixing whole words, split UTF-8 bytes, bad bytes and added tokens."""
    from deepinfer.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(EMBEDDED) if kind == "embedded" else _bpe_tokenizer()
    backend = getattr(tok, "backend", tok)
    token_bytes = TokenBytes.of(tok)
    assert token_bytes is not None
    vocab = backend.get_vocab_size()
    added = sorted(backend.get_added_tokens_decoder())
    words = [i for i in range(vocab) if i not in added]
    rng = random.Random(11)
    num_byte_path = 0
    for trial in range(400):
        pool = words if trial % 3 else words + added * 20  # a third with many added tokens
        prompt = [rng.choice(pool) for _ in range(rng.randrange(8))]
        out = [rng.choice(pool) for _ in range(rng.randrange(1, 60))]
        window = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        fast = IncrementalDetokenizer(
            tok, prompt, skip_special_tokens=skip, token_bytes=token_bytes
        )
        for t in out:
            num_byte_path += fast.pending is not None
            assert fast.append(t) == window.append(t)
            assert (fast.window, fast.read_offset) == (window.window, window.read_offset)
            assert fast.prefix_text == window.prefix_text
    assert num_byte_path > 1000  # the byte path did run


def test_token_bytes_only_for_byte_level_decoders():
    assert TokenBytes.of(ByteTokenizer()) is None
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.BPE())
    tok.decoder = decoders.Metaspace()
    assert TokenBytes.of(tok) is None


def _request(params, *, prompt=(10, 11), eos=1, tokenizer=None):
    req = Request("r", list(prompt), params, seed=0, eos_token_ids=frozenset({eos}))
    if tokenizer is not None:
        req.detokenizer = IncrementalDetokenizer(tokenizer, list(prompt))
    return req


def _feed(req, tokens, max_model_len=1000):
    for t in tokens:
        req.all_token_ids.append(t)
        decision = check_new_token(req, t, max_model_len)
        if decision is not None:
            return decision
    return None


def test_stop_string_spanning_tokens_is_cut_from_the_text():
    tok = ByteTokenizer()
    req = _request(SamplingParams(stop=["STOP", "never"], max_tokens=100), tokenizer=tok)
    decision = _feed(req, tok.encode("abc ST") + tok.encode("OP and more"))
    assert decision.finish_reason == "stop" and decision.stop_reason == "STOP"
    assert req.output_text == "abc "
    assert req.output_token_ids == tok.encode("abc STOP")  # tokens up to the completing one


def test_stop_string_split_inside_a_multibyte_character_is_found():
    tok = ByteTokenizer()
    req = _request(SamplingParams(stop=["é!"], max_tokens=100), tokenizer=tok)
    decision = _feed(req, tok.encode("caf") + tok.encode("é!") + tok.encode("x"))
    assert decision.stop_reason == "é!" and req.output_text == "caf"


def test_include_stop_str_and_earliest_match_wins():
    tok = ByteTokenizer()

    class Params:
        stop = ("bc", "abcd")
        include_stop_str_in_output = True
        max_tokens = 50

    req = _request(Params(), tokenizer=tok)
    decision = _feed(req, tok.encode("xabcd"))
    assert decision.stop_reason == "bc" and req.output_text == "xabc"


def test_eos_stop_token_ids_and_min_tokens():
    tok = ByteTokenizer()
    eos = tok.eos_token_id
    req = _request(SamplingParams(min_tokens=2, max_tokens=10), tokenizer=tok)
    assert _feed(req, [eos, 50]) is None  # within min_tokens EOS does not stop
    decision = _feed(req, [eos])
    assert decision.finish_reason == "stop" and decision.stop_reason is None
    req = _request(SamplingParams(stop_token_ids=[60], max_tokens=10), tokenizer=tok)
    decision = _feed(req, [50, 60, 70])
    assert decision.stop_reason == 60 and req.output_token_ids == [50, 60]
    assert req.output_text == tok.decode([50])  # the stop token's text is not added


def test_ignore_eos_first_n_no_eos_and_length_limits():
    req = _request(SamplingParams(ignore_eos=True, max_tokens=3))
    decision = _feed(req, [1, 1, 1, 1])
    assert decision.finish_reason == "length" and req.num_output_tokens == 3
    req = _request(SamplingParams(first_n_token_no_eos=1, max_tokens=5))
    decision = _feed(req, [1, 1])
    assert decision.finish_reason == "stop" and req.num_output_tokens == 2
    req = _request(SamplingParams(max_tokens=50), prompt=[5] * 8)
    decision = _feed(req, [7] * 10, max_model_len=10)
    assert decision.finish_reason == "length" and req.num_tokens == 10
