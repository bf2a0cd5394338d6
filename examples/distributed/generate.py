"""Data-parallel generation: one script, started by ``LLM`` itself or by ``torchrun``.

    python -m examples.distributed.generate --data-parallel-size 2      # LLM starts 2 workers
    torchrun --standalone --nproc-per-node 2 -m examples.distributed.generate
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m examples.distributed.generate --model DIR_OR_HUB_ID          # on each of 2 nodes

Under ``torchrun`` every process runs this script: the data-parallel size is the world size,
each rank loads its model and cache, rank 0 spreads the requests over the ranks and gets the
outputs (``generate`` returns ``[]`` on the others), so only rank 0 prints and writes ``--out``.
Each prompt samples with its own seed (``--seed`` + its index), so the outputs do not depend on
how the requests are spread; with ``DEEPINFER_BATCH_INVARIANT=1`` they equal a one-process run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from deepinfer.engine import LLM, SamplingParams

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "tiny_model" / "checkpoint"
PROMPTS = [
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(directory):",
    "class Stack:\n    def __init__(self):",
    "The capital of France is",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=str(DEFAULT_MODEL), help="checkpoint directory or hub id"
    )
    parser.add_argument(
        "--accelerator", default="auto", choices=["auto", "nvidia", "ascend", "cpu"]
    )
    parser.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=None,
        help="ranks (default: torchrun's WORLD_SIZE, else 2)",
    )
    parser.add_argument(
        "--expert-parallel-size",
        "-ep",
        type=int,
        default=None,
        help="1 or the data-parallel size (the default)",
    )
    parser.add_argument(
        "--prompt-token-ids",
        default=None,
        help="JSON file with a list of prompts as token-id lists",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0, help="the first prompt's sampling seed")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--out", default=None, help="write the outputs here as JSON (rank 0)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict]:
    """Generate for every prompt; the outputs as plain dicts (``[]`` on torchrun ranks > 0)."""
    dp = args.data_parallel_size or int(os.environ.get("WORLD_SIZE", 2))
    dtype = "float32" if args.accelerator == "cpu" else "bfloat16"
    llm = LLM(
        args.model,
        accelerator=args.accelerator,
        dtype=dtype,
        block_size=args.block_size,
        max_model_len=1024,
        data_parallel_size=dp,
        expert_parallel_size=args.expert_parallel_size or dp,
    )
    if args.prompt_token_ids:
        token_ids = json.loads(Path(args.prompt_token_ids).read_text())
        prompts = {"prompt_token_ids": token_ids}
    else:
        token_ids = PROMPTS
        prompts = {"prompts": PROMPTS}
    params = [
        SamplingParams(
            temperature=args.temperature,
            max_tokens=args.max_tokens,
            seed=args.seed + i,
            ignore_eos=True,
        )
        for i in range(len(token_ids))
    ]
    try:
        outputs = llm.generate(**prompts, sampling_params=params, use_tqdm=False)
    finally:
        llm.close()
    return [
        {"prompt": o.prompt, "token_ids": o.outputs[0].token_ids, "text": o.outputs[0].text}
        for o in outputs
    ]


def main() -> None:
    args = parse_args()
    results = run(args)
    if results:  # rank 0, or the process that started the workers
        for result in results:
            print(f"{result['prompt']!r} -> {result['text']!r}")
        if args.out:
            Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
