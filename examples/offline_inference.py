"""Offline batch generation with DeepInfer.

    uv run examples/offline_inference.py                       # the embedded default model, on CPU
    uv run examples/offline_inference.py --model DIR_OR_HUB_ID --max-tokens 64

Without ``--model`` it loads ``examples/tiny_model/checkpoint``: a small model of the
DeepSeek-V4.1-Flash architecture that we trained on the Python standard library, with its three
DSpark draft stages, in the official FP8/FP4 format (``examples/tiny_model/README.md``), so it
runs on a fresh machine with no GPU and no network.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.engine import LLM, SamplingParams

DEFAULT_MODEL = Path(__file__).resolve().parent / "tiny_model" / "checkpoint"
PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(directory):",
    "class Stack:\n    def __init__(self):",
    "The capital of France is",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=str(DEFAULT_MODEL), help="checkpoint directory or hub id"
    )
    parser.add_argument(
        "--accelerator", default="auto", choices=["auto", "nvidia", "ascend", "cpu"]
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=0, help="per-request sampling seed")
    args = parser.parse_args()

    dtype = "float32" if args.accelerator == "cpu" else "bfloat16"
    llm = LLM(args.model, accelerator=args.accelerator, dtype=dtype, max_num_seqs=16)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
    )
    for output in llm.generate(PROMPTS, params):
        completion = output.outputs[0]
        print("-" * 72)
        print(f"prompt:     {output.prompt!r}")
        print(f"completion: {completion.text!r}")
        print(f"tokens: {len(completion.token_ids)}, finish: {completion.finish_reason}")


if __name__ == "__main__":
    main()
