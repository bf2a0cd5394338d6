"""Drive a ``transformers`` model's generation loop with DeepInfer's sampler and a JSON schema.

Shows that ``deepinfer.sampling`` is usable outside the engine: a tiny randomly initialised
Llama (built in memory, nothing downloaded) and a small byte-level BPE tokenizer trained in
memory produce JSON that always parses and matches the schema, because every step's logits go
through the grammar mask and our seeded sampler. The same seed gives the same text.

    python examples/sampler_with_transformers.py
"""

from __future__ import annotations

import json

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deepinfer.sampling import (
    SamplingParams,
    StructuredOutputs,
    StructuredOutputState,
    allocate_token_bitmask,
    compiler_for_tokenizer,
    resolve_seeds,
    sample,
)
from deepinfer.sampling.testing import byte_level_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def tiny_model(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


@torch.no_grad()
def generate_json(model, tokenizer, prompt: str, params: SamplingParams) -> str:
    vocab_size = model.config.vocab_size
    compiler = compiler_for_tokenizer(tokenizer, vocab_size=vocab_size, json_any_whitespace=False)
    state = StructuredOutputState(compiler.compile(params.grammar_spec))
    bitmask = allocate_token_bitmask(1, vocab_size)
    prompt_ids = tokenizer.encode(prompt)
    generated: list[int] = []
    for _ in range(params.max_tokens):
        # The whole sequence each step (no KV cache): simplest with any transformers version.
        input_ids = torch.tensor([prompt_ids + generated])
        logits = model(input_ids=input_ids).logits[:, -1, :]
        state.fill_bitmask(bitmask, 0)
        position = len(prompt_ids) + len(generated)
        result = sample(logits, [params], [position], output_token_ids=[generated], bitmask=bitmask)
        token = result.token_ids.item()
        if not state.accept_token(token):
            raise RuntimeError(f"the grammar rejected token {token}")
        if state.is_terminated() or token == tokenizer.eos_token_id:
            break
        generated.append(token)
    return tokenizer.decode(generated)


def main() -> None:
    tokenizer = byte_level_tokenizer()
    model = tiny_model(len(tokenizer))
    (params,) = resolve_seeds(
        [
            SamplingParams(
                temperature=0.9,
                top_p=0.95,
                max_tokens=200,
                seq_seed=1234,
                structured_outputs=StructuredOutputs(json=SCHEMA),
            )
        ]
    )
    text = generate_json(model, tokenizer, "Describe a user as JSON: ", params)
    value = json.loads(text)
    print("generated:", text)
    print("parsed:   ", value)
    again = generate_json(model, tokenizer, "Describe a user as JSON: ", params)
    print("same seed, same text:", again == text)


if __name__ == "__main__":
    main()
