"""What YoCo prefill truncation costs in quality, on the embedded tiny model (CPU is enough).

Held-in evaluation windows: window ``i`` is ``tokens[i * stride : i * stride + P + C]`` of
``--tokens`` (``data/validation.bin`` of ``examples/tiny_model``, the split its evaluation
scores), a prompt of ``P`` (``--prompt-len``) tokens and its true continuation of ``C``.

- NLL: the mean negative log-likelihood of the ``C`` continuation tokens, teacher forced: the
  prompt is one prefill (truncated in ``compact``), the continuation one more chunk that is not
  truncated (its rows see full windows, as decode steps after that prefill would);
- greedy agreement: ``LLM.generate`` greedy, ``--greedy-tokens`` new tokens per prompt, against
  ``off``: the share of positions with the same token, the mean length of the common prefix,
  and the share of prompts whose continuation is identical.

    python -m benchmarks.engine.yoco_quality --tokens examples/tiny_model/data/validation.bin \
        --out bench-out/yoco_quality.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import environment, print_table, write_json

CHECKPOINT = Path(__file__).resolve().parents[2] / "examples" / "tiny_model" / "checkpoint"


def windows(path: Path, count: int, length: int, stride: int) -> list[list[int]]:
    tokens = np.fromfile(path, dtype="<u2")
    if count * stride + length > len(tokens):
        raise ValueError(f"{path}: {len(tokens)} tokens, fewer than {count} windows need")
    return [
        tokens[i * stride : i * stride + length].astype(np.int64).tolist() for i in range(count)
    ]


@torch.no_grad()
def continuation_nll(model, data: list[list[int]], prompt_len: int, group: int) -> float:
    """Mean NLL of every window's tokens after ``prompt_len`` under ``model.truncation``."""
    from deepinfer.engine.testing.simple_runner import SimpleRunner

    total, count = 0.0, 0
    for first in range(0, len(data), group):
        part = data[first : first + group]
        runner = SimpleRunner(model, max_seqs=len(part), max_len=len(part[0]), block_size=128)
        prompt_lens = torch.full((len(part),), prompt_len)
        batch = runner.batch({s: w[:prompt_len] for s, w in enumerate(part)})
        last = torch.arange(1, len(part) + 1) * prompt_len - 1
        batch = dataclasses.replace(batch, logits_indices=last, prompt_lens=prompt_lens)
        first_logits = model(batch, runner.cache)
        for s in range(len(part)):
            runner.lengths[s] = prompt_len
        batch = runner.batch({s: w[prompt_len:-1] for s, w in enumerate(part)})
        rest = model(dataclasses.replace(batch, prompt_lens=prompt_lens), runner.cache)
        rest = rest.view(len(part), -1, rest.shape[-1])
        logits = torch.cat([first_logits[:, None], rest], dim=1)
        targets = torch.tensor([w[prompt_len:] for w in part])
        nll = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"
        )
        total, count = total + float(nll), count + targets.numel()
    return total / count


def greedy(checkpoint: str, prompts, mode: str, keep: int, new_tokens: int) -> list[list[int]]:
    from deepinfer.engine import LLM, SamplingParams

    llm = LLM(
        checkpoint,
        accelerator="cpu",
        dtype="float32",
        speculative_tokens=0,
        max_num_seqs=8,
        yoco_prefill_truncation_mode=mode,
        yoco_prefill_keep_tokens=keep,
    )
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def agreement(base: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    same = [sum(a == b for a, b in zip(x, y)) / len(x) for x, y in zip(base, other)]
    prefix = []
    for x, y in zip(base, other):
        n = next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
        prefix.append(n)
    return {
        "token_agreement": sum(same) / len(same),
        "mean_common_prefix": sum(prefix) / len(prefix),
        "identical_share": sum(x == y for x, y in zip(base, other)) / len(base),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=str(CHECKPOINT))
    parser.add_argument("--tokens", type=Path, required=True, help="validation.bin (uint16)")
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--stride", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=448)
    parser.add_argument("--continuation", type=int, default=64)
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--keeps", default="128,256", help="keep_tokens values to measure")
    parser.add_argument("--group", type=int, default=4, help="windows per NLL forward")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from deepinfer.engine.checkpoint import load_model

    torch.manual_seed(0)
    data = windows(args.tokens, args.windows, args.prompt_len + args.continuation, args.stride)
    prompts = [w[: args.prompt_len] for w in data]
    model = load_model(args.checkpoint, device="cpu", dtype=torch.float32, progress=False)
    started = time.perf_counter()
    base_nll = continuation_nll(model, data, args.prompt_len, args.group)
    base_tokens = greedy(args.checkpoint, prompts, "off", 0, args.greedy_tokens)
    rows = [{"mode": "off", "keep": "-", "nll": base_nll, "ppl": math.exp(base_nll)}]
    rows[0].update(agreement(base_tokens, base_tokens))
    for keep in (int(k) for k in args.keeps.split(",")):
        model.set_prefill_truncation("compact", keep)
        nll = continuation_nll(model, data, args.prompt_len, args.group)
        model.truncation = None
        row = {"mode": "compact", "keep": keep, "nll": nll, "ppl": math.exp(nll)}
        row.update(agreement(base_tokens, greedy(args.checkpoint, prompts, "compact", keep,
                                                 args.greedy_tokens)))  # fmt: skip
        rows.append(row)
    print_table(rows, ["mode", "keep", "nll", "ppl", "token_agreement", "mean_common_prefix",
                       "identical_share"])  # fmt: skip
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    write_json(
        args.out,
        {
            "environment": environment(),
            "settings": settings,
            "seconds": time.perf_counter() - started,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
