"""SamplingParams / StructuredOutputs validation and seed resolution."""

import json

import pytest

from deepinfer.sampling import SamplingParams, StructuredOutputs, resolve_seeds


@pytest.mark.parametrize(
    ("kwargs", "field", "expected"),
    [
        ({"temperature": -0.5}, "temperature", "[0.0"),
        ({"top_p": 0.0}, "top_p", "(0.0, 1.0]"),
        ({"top_p": 1.5}, "top_p", "(0.0, 1.0]"),
        ({"top_k": -3}, "top_k", "integer >= 1"),
        ({"min_p": 2.0}, "min_p", "[0.0, 1.0]"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens", "<= max_tokens"),
        ({"stop": ["ok", ""]}, "stop", "non-empty strings"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids", "non-negative"),
        ({"n": 0}, "n", ">= 1"),
        ({"presence_penalty": 3.0}, "presence_penalty", "[-2.0, 2.0]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "(0.0"),
        ({"logit_bias": {5: 200.0}}, "logit_bias[5]", "[-100.0, 100.0]"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias", "int keys"),
        ({"logprobs": 1001}, "logprobs", "[0, 1000]"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", "[0, 1000]"),
        ({"first_n_token_no_eos": -1}, "first_n_token_no_eos", ">= 0"),
        ({"seed": 1, "seq_seed": 2}, "seed", "same value as seq_seed"),
        ({"so_args": {"schema_type": "yaml", "schema": "x"}}, "so_args.schema_type", "json"),
        ({"so_args": {"schema_type": "regex", "schema": ""}}, "so_args.schema", "non-empty"),
        (
            {"so_args": {"schema_type": "regex", "schema": "a+", "bound_token_id": 3}},
            "so_args.bound_token_id",
            "trigger_token_ids",
        ),
        ({"so_args": {"schema_type": "regex", "schema": "a", "x": 1}}, "so_args", "unknown"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field, expected):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert f"SamplingParams.{field}=" in message
    assert expected in message


def test_valid_params_are_frozen_and_normalised():
    p = SamplingParams(stop="END", stop_token_ids=[3, 4], logit_bias={7: -1.5}, seed=5)
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4)
    assert p.seq_seed == 5 and p.seed == 5
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(seq_seed=-1).seq_seed == (1 << 63) - 1  # masked like a uint64


def test_seed_resolution_keeps_given_seeds_and_draws_distinct_random_ones():
    given = SamplingParams(seq_seed=42)
    assert given.with_resolved_seed() is given
    resolved = resolve_seeds([SamplingParams(), given, SamplingParams()])
    seeds = [p.seq_seed for p in resolved]
    assert seeds[1] == 42 and None not in seeds and seeds[0] != seeds[2]
    assert SamplingParams().with_resolved_seed(7).seq_seed == 7


def test_structured_outputs_forms_resolve_to_one_spec():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    by_so_args = SamplingParams(
        so_args={
            "schema_type": "json",
            "schema": json.dumps(schema),
            "trigger_token_ids": [5, 6],
            "bound_token_id": 5,
        }
    ).grammar_spec
    assert by_so_args.kind == "json" and json.loads(by_so_args.source) == schema
    assert by_so_args.trigger_token_ids == (5, 6) and by_so_args.bound_token_id == 5
    by_dataclass = SamplingParams(structured_outputs=StructuredOutputs(json=schema)).grammar_spec
    assert by_dataclass.kind == "json" and json.loads(by_dataclass.source) == schema
    choice = StructuredOutputs(choice=["yes", "no.", "a|b"]).to_spec()
    assert choice.kind == "regex"
    import re

    assert all(re.fullmatch(choice.source, c) for c in ["yes", "no.", "a|b"])
    assert not re.fullmatch(choice.source, "a")
    assert SamplingParams().grammar_spec is None


def test_structured_outputs_needs_exactly_one_form():
    with pytest.raises(ValueError, match="exactly one of json, regex, grammar, choice"):
        StructuredOutputs(json={}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="StructuredOutputs.choice"):
        StructuredOutputs(choice=[])
    with pytest.raises(ValueError, match="SamplingParams.so_args"):
        SamplingParams(
            so_args={"schema_type": "regex", "schema": "a"},
            structured_outputs=StructuredOutputs(regex="a"),
        )
