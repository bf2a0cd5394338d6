"""Loading tokenizer.json + tokenizer_config.json, special-token ids, encode/decode."""

from __future__ import annotations

import json
import random

import pytest

from deepinfer.engine.tokenizer import (
    V4_SPECIAL_TOKENS,
    load_tokenizer,
    testing_tokenizer,
    train_byte_level_bpe,
)


def random_unicode_text(rng: random.Random) -> str:
    ranges = [(0x20, 0x7E), (0xA0, 0x17F), (0x4E00, 0x4FFF), (0x1F300, 0x1F5FF)]
    chars = []
    for _ in range(rng.randint(1, 60)):
        low, high = rng.choice(ranges)
        chars.append(chr(rng.randint(low, high)) if rng.random() < 0.9 else rng.choice("\n\t  "))
    return "".join(chars)


def test_testing_tokenizer_places_the_special_tokens_first():
    tokenizer = testing_tokenizer()
    for expected_id, token in enumerate(V4_SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == expected_id
    special = tokenizer.special
    assert (special.bos, special.eos, special.pad) == (0, 1, 2)
    assert special.has_chat_tokens
    assert special.image is not None and special.draft_noise is not None
    assert dict(special.tasks).keys() == {
        "action",
        "query",
        "authority",
        "domain",
        "title",
        "read_url",
    }


def test_special_tokens_in_text_become_single_ids():
    tokenizer = testing_tokenizer()
    for token_id, token in enumerate(V4_SPECIAL_TOKENS):
        ids = tokenizer.encode(f"a{token}b", add_bos=False)
        assert ids.count(token_id) == 1
        assert tokenizer.decode(ids) == f"a{token}b"


@pytest.mark.parametrize("seed", range(10))
def test_any_text_round_trips(seed):
    tokenizer = testing_tokenizer()
    text = random_unicode_text(random.Random(seed))
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.bos_token_id
    assert max(ids) < tokenizer.vocab_size
    assert tokenizer.decode(ids[1:]) == text
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert "".join(tokenizer.decode_stream(iter(ids[1:]))) == text


def test_save_and_load_gives_the_same_tokenizer(tmp_path):
    original = testing_tokenizer()
    original.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.vocab_size == original.vocab_size
    assert loaded.special == original.special
    text = random_unicode_text(random.Random(7)) + "<｜User｜>hi<｜Assistant｜><think>"
    assert loaded.encode(text) == original.encode(text)
    assert loaded.encode_batch([text, "x"]) == [original.encode(text), original.encode("x")]


def write_config(directory, **fields):
    (directory / "tokenizer_config.json").write_text(json.dumps(fields), encoding="utf-8")


def test_tokenizer_config_fields(tmp_path):
    testing_tokenizer().save(tmp_path)
    added_token = {"__type": "AddedToken", "content": "<｜end▁of▁sentence｜>", "special": True}
    write_config(
        tmp_path, add_bos_token=False, eos_token=added_token, pad_token=None, model_max_length=4096
    )
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.encode("hi")[0] != tokenizer.bos_token_id
    assert tokenizer.eos_token_id == 1
    assert tokenizer.config.model_max_length == 4096
    # No pad_token in the config (as in V4): the V4 pad spelling is still looked up.
    assert tokenizer.pad_token_id == 2


def test_tokenizer_config_naming_tokens_outside_the_vocabulary(tmp_path):
    testing_tokenizer().save(tmp_path)
    write_config(tmp_path, eos_token="<|endoftext|>")
    with pytest.raises(ValueError, match=r"eos_token '<\|endoftext\|>'"):
        load_tokenizer(tmp_path)
    write_config(tmp_path, pad_token="<pad>")
    with pytest.raises(ValueError, match="pad_token '<pad>'"):
        load_tokenizer(tmp_path)
    write_config(tmp_path, add_bos_token="yes")
    with pytest.raises(ValueError, match="add_bos_token"):
        load_tokenizer(tmp_path)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_without_tokenizer_config_the_v4_defaults_apply(tmp_path):
    testing_tokenizer().save(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.encode("x")[0] == 0 and tokenizer.eos_token_id == 1


def test_train_byte_level_bpe_rejects_a_too_small_vocabulary():
    with pytest.raises(ValueError, match="vocab_size is 100"):
        train_byte_level_bpe(["abc"], vocab_size=100)


def test_transformers_reads_the_saved_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizer = testing_tokenizer()
    tokenizer.save(tmp_path)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    text = "def f(x):\n    return x  # ok <｜User｜>"
    assert hf.encode(text) == tokenizer.encode(text)  # BOS added by the post-processor
    assert hf.eos_token_id == tokenizer.eos_token_id and hf.pad_token_id == tokenizer.pad_token_id


def test_deepseek_style_tokenizer_config(tmp_path):
    # The shape of DeepSeek's released tokenizer_config.json: AddedToken dicts, pad = EOS,
    # a SentencePiece-family class name and a Jinja chat template (both ignored here).
    testing_tokenizer().save(tmp_path)

    def added(content):
        return {"__type": "AddedToken", "content": content, "lstrip": False, "normalized": True}

    write_config(
        tmp_path,
        add_bos_token=True,
        add_eos_token=False,
        bos_token=added("<｜begin▁of▁sentence｜>"),
        eos_token=added("<｜end▁of▁sentence｜>"),
        pad_token=added("<｜end▁of▁sentence｜>"),
        legacy=True,
        model_max_length=1.0e30,
        sp_model_kwargs={},
        unk_token=None,
        tokenizer_class="LlamaTokenizerFast",
        chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    tokenizer = load_tokenizer(tmp_path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 1)
    text = "x = [1, 2]  # a comment"
    assert tokenizer.decode(tokenizer.encode(text)[1:]) == text  # byte-level, spaces kept
