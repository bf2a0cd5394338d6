"""Where a warm eager prefill step of the V4-Flash-shaped dummy spends its host time (CUDA).

Per ``--shapes`` entry (PROMPTSxTOKENS, ``max_tokens=1``): three untimed ``generate`` calls,
then five timed ones (ms until ``generate`` returns / until the device is idle after it), the
caching allocator's counters over those five (device mallocs and frees, retries: a
``cudaFree`` waits for the device and is not reported by ``torch.cuda.set_sync_debug_mode``),
then cProfile of one more call, its top functions by own and by cumulative time.

    python -m benchmarks.engine.prefill_host_probe --layers 4 --shapes 1x1024,8x1024
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine.prefill_breakdown import parse_shapes
from benchmarks.model.dummy_forward import v4_flash_config
from deepinfer.engine.frontend.llm import LLM
from deepinfer.sampling import SamplingParams

ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
RATIOS = (0, 0, 4, 128)  # the V4-Flash layer pattern's start, repeated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shapes", default="1x1024,8x1024")
    parser.add_argument("--top", type=int, default=30, help="functions printed per sort")
    args = parser.parse_args()
    shapes = parse_shapes(args.shapes, "--shapes")
    config = v4_flash_config([RATIOS[i % len(RATIOS)] for i in range(args.layers)])
    path = Path(tempfile.mkdtemp())
    (path / "config.json").write_text(json.dumps(config))
    longest = max(length for _, length in shapes)
    llm = LLM(str(path), load_format="dummy", max_model_len=max(4096, longest + 1),
              max_num_batched_tokens=max(8192, *(n * t for n, t in shapes)),
              gpu_memory_utilization=0.85, speculative_tokens=0)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def step(n: int, length: int) -> tuple[float, float]:
        prompts = torch.randint(3, 1000, (n, length)).tolist()
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        returned = time.perf_counter()
        torch.cuda.synchronize()
        return (returned - start) * 1e3, (time.perf_counter() - start) * 1e3

    for n, length in shapes:
        for _ in range(3):
            step(n, length)
        before = {k: torch.cuda.memory_stats().get(k, 0) for k in ALLOCATOR}
        walls = [step(n, length) for _ in range(5)]
        after = {k: torch.cuda.memory_stats().get(k, 0) for k in ALLOCATOR}
        print(f"PROBE {n}x{length} returned/idle ms:", [f"{a:.1f}/{b:.1f}" for a, b in walls])
        print(f"PROBE {n}x{length} allocator over 5 calls:",
              {k: after[k] - before[k] for k in ALLOCATOR})  # fmt: skip
        profile = cProfile.Profile()
        profile.enable()
        step(n, length)
        profile.disable()
        for key in ("tottime", "cumtime"):
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.top)
            print(f"PROBE {n}x{length} cProfile by {key}\n{out.getvalue()}")


if __name__ == "__main__":
    main()
