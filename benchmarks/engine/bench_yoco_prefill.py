"""Prefill throughput with YoCo prefill truncation ``off`` and ``compact`` on a dummy-weight
V4.1-Flash-shaped model (one GPU).

The model keeps V4.1-Flash's shapes and its two halves, cut to ``--layers``: two sliding-window
layers, ratio-2 producers (kv sources every 6 layers from 2), then ``--consumers`` ratio-1
consumer layers (the first one the kv, index and candidate source, index sources every 4
after it); no Engram, no DSpark stages. Each row prefills ``--prompts`` prompts of
``--prompt-len`` tokens (``max_tokens=1``, whole prompts in one step) and reports prefill
tokens per second, the second of two identical runs (Triton compilations are not timed). Both
modes run on the same engine: the setting is the model's ``truncation`` (``compact`` with
``keep_tokens`` 0 = the least allowed, window + drafts = 128).

    python -m benchmarks.engine.bench_yoco_prefill --layers 16 --prompt-lens 8192,32768 \
        --out bench-out/yoco_prefill.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import environment, print_table, write_json
from benchmarks.sweep.models import V41_FLASH_TEXT, _v41_flash_config

FULL_LAYERS = 40


def v41_yoco_config(layers: int, consumers: int) -> dict:
    """V4.1-Flash shapes with ``layers - consumers`` leading layers and ``consumers`` ratio-1
    consumer layers (the real model: 40 = 20 + 20)."""
    producers = layers - consumers
    if producers < 3 or consumers < 1:
        raise ValueError(f"--layers {layers} / --consumers {consumers}: expected >= 3 / >= 1")
    config = _v41_flash_config(FULL_LAYERS)
    text = config["text_config"]
    text["num_hidden_layers"] = layers
    text["compress_ratios"] = [0, 0] + [2] * (producers - 2) + [1] * consumers
    text["kv_source_layer_ids"] = list(range(2, producers, 6)) + [producers]
    text["index_source_layer_ids"] = list(range(2, producers, 6)) + list(
        range(producers, layers, 4)
    )
    text["candidate_source_layer_id"] = producers
    assert V41_FLASH_TEXT["sliding_window"] == 128
    return config


def _prefill_seconds(llm, prompts: list[list[int]]) -> float:
    from deepinfer.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--consumers", type=int, help="consumer layers (default: half)")
    parser.add_argument("--prompt-lens", default="8192,32768")
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--modes", default="off,compact")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from deepinfer.engine import LLM

    lengths = [int(n) for n in args.prompt_lens.split(",")]
    consumers = args.consumers or args.layers // 2
    config = v41_yoco_config(args.layers, consumers)
    directory = Path(tempfile.mkdtemp(prefix="deepinfer-yoco-"))
    (directory / "config.json").write_text(json.dumps(config))
    longest = max(lengths) * args.prompts
    llm = LLM(
        str(directory),
        load_format="dummy",
        speculative_tokens=0,
        max_num_seqs=max(args.prompts, 1),
        max_model_len=max(lengths) + 16,
        max_num_batched_tokens=longest,
        gpu_memory_utilization=args.gpu_memory_utilization,
        yoco_prefill_truncation_mode="compact",
    )
    model = llm._core.executor.model
    compact = model.truncation
    gen = torch.Generator().manual_seed(0)
    vocab = config["text_config"]["vocab_size"]
    rows = []
    for length in lengths:
        prompts = torch.randint(3, vocab, (args.prompts, length), generator=gen).tolist()
        for mode in args.modes.split(","):
            model.truncation = compact if mode == "compact" else None
            seconds = _prefill_seconds(llm, prompts)
            tokens = args.prompts * length
            rows.append({"mode": mode, "prompt_len": length, "prompts": args.prompts,
                         "seconds": seconds, "tok/s": tokens / seconds})  # fmt: skip
    model.truncation = compact
    label = (
        f"V4.1-Flash shape, dummy weights, {args.layers} layers ({args.layers - consumers} + "
        f"{consumers} consumers), no Engram / DSpark; compact keeps {compact.keep_tokens} rows"
    )
    print(label)
    print_table(rows, ["mode", "prompt_len", "prompts", "seconds", "tok/s"])
    write_json(args.out, {"environment": environment(), "model": label, "rows": rows,
                          "settings": {k: str(v) for k, v in vars(args).items()}})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
