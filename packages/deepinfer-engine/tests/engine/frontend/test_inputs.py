import numpy as np
import pytest

from deepinfer.engine.frontend.inputs import normalize_params, normalize_prompts
from deepinfer.engine.frontend.validation import InvalidRequestError
from deepinfer.engine.testing.fake_executor import ByteTokenizer
from deepinfer.sampling import SamplingParams


def test_prompt_forms():
    tok = ByteTokenizer()
    assert normalize_prompts("ab", None, tok) == (["ab"], [tok.encode("ab")])
    assert normalize_prompts(None, [3, 4], tok) == ([None], [[3, 4]])
    assert normalize_prompts(None, [[3], [4, 5]], tok) == ([None, None], [[3], [4, 5]])
    ids = np.array([7, 8], dtype=np.int64)
    texts, lists = normalize_prompts(["x"], [ids], tok)
    assert texts == ["x"] and lists == [[7, 8]] and type(lists[0][0]) is int


@pytest.mark.parametrize(
    ("prompts", "ids", "message"),
    [
        (None, None, "give prompts or prompt_token_ids"),
        (["a", 5], None, "request 1: the prompt is 5, expected a string"),
        (["a", ""], None, "request 1: the prompt is empty"),
        (None, [[1], ["x"]], r"request 1: prompt_token_ids is \['x'\]"),
        (["a"], [[1], [2]], "1 prompts but 2 prompt_token_ids lists"),
        (None, "abc", "expected a list of integers or a list of them"),
    ],
)
def test_bad_prompt_forms_name_the_request(prompts, ids, message):
    with pytest.raises(InvalidRequestError, match=message):
        normalize_prompts(prompts, ids, ByteTokenizer())


def test_params_forms():
    p = SamplingParams(max_tokens=3)
    assert normalize_params(p, 2) == [p, p]
    assert normalize_params(None, 1)[0].max_tokens == SamplingParams().max_tokens
    with pytest.raises(InvalidRequestError, match="3 prompts but 2 sampling parameters"):
        normalize_params([p, p], 3)
    with pytest.raises(InvalidRequestError, match="request 1: sampling_params is"):
        normalize_params([p, {"max_tokens": 3}], 2)


def test_token_lists_are_copies_and_the_checks_keep_their_messages():
    """Plain lists of ints take the fast path (a copy, not the caller's list); a bool, a float
    or an id out of range still fails with the request and token named."""
    from deepinfer.engine.frontend.validation import validate_prompt_token_ids

    prompt = [5, 6, 7]
    _, (ids,) = normalize_prompts(None, [prompt], ByteTokenizer())
    assert ids == prompt and ids is not prompt
    with pytest.raises(InvalidRequestError, match=r"request 0: prompt_token_ids is \[1, True\]"):
        normalize_prompts(None, [[1, True]], ByteTokenizer())
    for bad, position in (([1, -2, 3], 1), ([1, 2, 1000], 2), ([0, 2.0], 1)):
        with pytest.raises(InvalidRequestError, match=f"request 4: prompt token {position} is"):
            validate_prompt_token_ids(4, bad, vocab_size=1000, max_model_len=10)
    validate_prompt_token_ids(4, [0, 999], vocab_size=1000, max_model_len=10)
