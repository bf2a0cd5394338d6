"""The transformers example: a random tiny Llama under a JSON schema yields valid, seeded JSON."""

import importlib.util
import json
from pathlib import Path

import pytest

from deepinfer.sampling import SamplingParams, StructuredOutputs
from deepinfer.sampling.testing import byte_level_tokenizer, check_json_schema

EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "sampler_with_transformers.py"


@pytest.mark.slow
@pytest.mark.skipif(not EXAMPLE.exists(), reason="examples/ not in this checkout")
def test_example_generates_schema_valid_json_reproducibly():
    spec = importlib.util.spec_from_file_location("sampler_with_transformers", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    tokenizer = byte_level_tokenizer()
    model = example.tiny_model(len(tokenizer))
    texts = []
    for seed in (5, 5, 6):
        params = SamplingParams(
            temperature=1.0, max_tokens=200, seq_seed=seed,
            structured_outputs=StructuredOutputs(json=example.SCHEMA),
        )  # fmt: skip
        texts.append(example.generate_json(model, tokenizer, "User: ", params))
    for text in texts:
        assert check_json_schema(json.loads(text), example.SCHEMA) == [], text
    assert texts[0] == texts[1]  # same seed, same text
