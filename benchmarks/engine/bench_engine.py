"""End-to-end engine throughput through ``LLM.generate`` on a dummy-weight V4-Flash-shaped model.

The model is the published V4-Flash shape (hidden 4096, 64 heads of 512, 256 FP4 experts top-6,
FP8 128x128 blocks) with ``--layers`` backbone layers (the real model has 43 and does not fit one
H200 with its 160 GB of weights); results are labelled with the layer count. Weights are random
(``load_format="dummy"``). Prefill: ``--prefill-prompts`` prompts of ``--prompt-len`` tokens with
``max_tokens=1``. Decode: batches of prompts of 128 tokens generating ``--decode-tokens`` tokens;
decode throughput = batch x (decode tokens - 1) / (time - time of the same batch with
``max_tokens=1``).

    python benchmarks/engine/bench_engine.py --out bench-out/engine.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "model"))
from common import environment, print_table, write_json  # noqa: E402
from dummy_forward import v4_flash_config  # noqa: E402

from deepinfer.engine.llm import LLM  # noqa: E402
from deepinfer.sampling import SamplingParams  # noqa: E402

RATIOS = [0, 0, 4, 128, 4, 128, 4, 128]


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--prefill-prompts", default="1,4,8")
    parser.add_argument("--decode-batches", default="1,8,32")
    parser.add_argument("--decode-tokens", type=int, default=17)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp())
    config = v4_flash_config(RATIOS[: args.layers])
    (directory / "config.json").write_text(json.dumps(config))
    start = time.perf_counter()
    llm = LLM(
        str(directory), load_format="dummy", max_num_seqs=64, max_model_len=4096,
        max_num_batched_tokens=8192, gpu_memory_utilization=0.85,
    )  # fmt: skip
    load_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    vocab = config["vocab_size"]
    rows = []
    _run(llm, [[1] * 64], 2)  # warm-up (Triton compiles)
    for n in map(int, args.prefill_prompts.split(",")):
        prompts = torch.randint(3, vocab, (n, args.prompt_len), generator=gen).tolist()
        seconds = _run(llm, prompts, 1)
        rows.append({"phase": "prefill", "batch": n, "tokens": n * args.prompt_len,
                     "seconds": seconds, "tok/s": n * args.prompt_len / seconds})  # fmt: skip
    for b in map(int, args.decode_batches.split(",")):
        prompts = torch.randint(3, vocab, (b, 128), generator=gen).tolist()
        base = _run(llm, prompts, 1)
        full = _run(llm, prompts, args.decode_tokens)
        steps = args.decode_tokens - 1
        step_s = (full - base) / steps
        rows.append({"phase": "decode", "batch": b, "tokens": b * steps, "seconds": full - base,
                     "tok/s": b / step_s, "tok/s/user": 1 / step_s, "step_ms": step_s * 1e3})  # fmt: skip
    print(f"V4-Flash-shaped dummy model, {args.layers} of 43 layers, load {load_s:.1f} s, "
          f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")  # fmt: skip
    print_table(rows, ["phase", "batch", "tokens", "seconds", "tok/s", "tok/s/user", "step_ms"])
    write_json(
        args.out, {"env": environment(), "layers": args.layers, "load_s": load_s, "rows": rows}
    )


if __name__ == "__main__":
    main()
