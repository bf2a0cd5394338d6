"""One-GPU projection of context-parallel prefill: the peak activation memory of each rank of
CP = ``--cp`` prefilling one long prompt, against one device prefilling it whole (CP = 1), at
the published V4-Flash shapes (``--layers`` first layers, dummy weights).

Each rank of the CP group is run alone, in turn, on the one device: ``context_parallel_prefill``
with a loopback communicator that plays rank ``r`` of ``--cp`` ranks whose peers mirror it (an
all-gather writes this rank's block into every rank's place of the output, with no extra
buffer). Every shape a rank sees (its rows, the border rows it receives, the entries gathered
from all ranks) is the real deployment's; only the values received are this rank's own. The
peak is ``torch.cuda.max_memory_allocated`` above the allocation just before the prefill (the
weights and the preallocated cache excluded), on the second of two identical prefills (the
first compiles the kernels). Every (length, CP) case runs in its own process, so a case that
fails (out of memory, a kernel limit) leaves the others' numbers.

    python -m benchmarks.parallel.cp_projection --lengths 32768,65536,131072 --cp 4 \\
        --out bench-out/cp_projection.json

``--tiny`` runs the tiny V4 test config on the CPU (peak resident memory instead; smoke test).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.common import environment, write_json
from benchmarks.parallel.bench_context import _memory_kb

REPO = Path(__file__).resolve().parents[2]
CASE = "CASE "  # prefix of a child's result line


class RankLoopback:
    """Rank ``rank`` of ``world_size`` ranks whose peers mirror it: an all-gather fills every
    rank's block of the output with this rank's input (the real shapes, no extra buffer)."""

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank}: expected 0 <= rank < world_size {world_size}")
        self.rank, self.world_size = rank, world_size

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> None:
        blocks = output.view(self.world_size, *input.shape)
        blocks.copy_(input.unsqueeze(0).expand_as(blocks))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        pass

    def barrier(self) -> None:
        pass


def model_config(tiny: bool, layers: int):
    from benchmarks.model.dummy_forward import v4_flash_config
    from benchmarks.parallel.ep_projection import V4_RATIOS
    from deepinfer.engine.model.config_parsing import parse_config
    from deepinfer.engine.testing import tiny_v4_config

    if tiny:
        ratios = ([0, 4, 128] * layers)[:layers]
        return parse_config(
            tiny_v4_config(sliding_window=128, index_topk=512, compress_ratios=ratios,
                           num_hidden_layers=layers)
        )  # fmt: skip
    if not 1 <= layers <= len(V4_RATIOS):
        raise ValueError(f"--layers {layers}: expected 1..{len(V4_RATIOS)}")
    return parse_config(v4_flash_config(V4_RATIOS[:layers]))


class _Peak:
    """Peak memory above the current allocation: device bytes on CUDA, resident bytes on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cpu":
            libc = ctypes.CDLL("libc.so.6")
            libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: big blocks mmapped, freed ones unmapped
            libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD

    def __enter__(self) -> _Peak:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM
            self.base = _memory_kb("VmRSS") * 1024
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.base
        else:
            self.bytes = _memory_kb("VmHWM") * 1024 - self.base
        self.seconds = time.perf_counter() - self.start


@torch.inference_mode()
def run_case(tokens: int, cp: int, layers: int, tiny: bool, exchange: str) -> dict:
    """Peak bytes and seconds of each rank's prefill of one ``tokens``-token prompt."""
    from deepinfer.engine.checkpoint.dummy import fill_dummy
    from deepinfer.engine.model.context_prefill import RowSplit, context_parallel_prefill
    from deepinfer.engine.model.model import build_model
    from deepinfer.engine.testing.simple_runner import SimpleRunner

    device = torch.device("cuda" if torch.cuda.is_available() and not tiny else "cpu")
    if tiny:
        torch.set_num_threads(1)
    dtype = torch.float32 if tiny else torch.bfloat16
    config = model_config(tiny, layers)
    model = build_model(config, device=device, dtype=dtype).eval()
    fill_dummy(model, seed=0)
    runner = SimpleRunner(model, max_seqs=1, max_len=tokens, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, config.vocab_size, (tokens,), generator=gen).tolist()
    batch = runner.batch({0: prompt})  # the cache rows are rewritten by every prefill
    batch = replace(batch, logits_indices=torch.tensor([tokens - 1], device=device))
    split = RowSplit.balanced(tokens, cp, config) if cp > 1 else None
    ranks = []
    for rank in range(cp):
        peak = _Peak(device)
        for _ in range(2):  # the second is measured: the first compiles and warms up
            with peak:
                if split is None:
                    out = model(batch, runner.cache)
                else:
                    comm = RankLoopback(rank, cp)
                    out = context_parallel_prefill(model, runner.cache, batch, split, comm,
                                                   exchange)  # fmt: skip
                del out
        rows = tokens if split is None else len(split.rows[rank])
        ranks.append({"rank": rank, "rows": rows, "peak_bytes": peak.bytes,
                      "seconds": peak.seconds})  # fmt: skip
    return {"tokens": tokens, "cp": cp, "ranks": ranks,
            "peak_bytes_max": max(r["peak_bytes"] for r in ranks)}  # fmt: skip


def _child(tokens: int, cp: int, args) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.parallel.cp_projection", "--case", f"{tokens},{cp}",
           "--layers", str(args.layers), "--exchange", args.exchange] + (["--tiny"] * args.tiny)  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(CASE)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"tokens": tokens, "cp": cp, "error": f"exit {proc.returncode}: " + " | ".join(tail)}
    result = json.loads(lines[-1][len(CASE) :])
    print(f"case {tokens} tokens CP={cp}: peak {result['peak_bytes_max'] / 2**30:.2f} GiB",
          flush=True)  # fmt: skip
    return result


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="32768,65536,131072")
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--layers", type=int, default=4, help="V4-Flash's first N layers")
    p.add_argument("--exchange", default="borders", choices=("borders", "hidden"))
    p.add_argument("--tiny", action="store_true", help="tiny V4 config on the CPU (smoke test)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.cp < 2:
        p.error(f"--cp {args.cp}: expected >= 2 (CP = 1 is always run as the baseline)")
    if args.case is not None:  # a child: one (length, CP) case, one result line
        tokens, cp = (int(x) for x in args.case.split(","))
        result = run_case(tokens, cp, args.layers, args.tiny, args.exchange)
        print(CASE + json.dumps(result), flush=True)
        return result
    lengths = [int(x) for x in args.lengths.split(",") if x]
    rows = []
    for tokens in lengths:
        base = _child(tokens, 1, args)
        split = _child(tokens, args.cp, args)
        row = {"tokens": tokens, "cp1": base, f"cp{args.cp}": split}
        if "error" not in base and "error" not in split:
            row["ratio"] = split["peak_bytes_max"] / base["peak_bytes_max"]
        rows.append(row)
        gib = 2**30
        line = f"{tokens:>7} tokens: "
        for name, case in (("CP=1", base), (f"CP={args.cp}", split)):
            if "error" in case:
                line += f"{name} failed ({case['error'][:160]}); "
            else:
                secs = max(r["seconds"] for r in case["ranks"])
                line += f"{name} peak {case['peak_bytes_max'] / gib:.2f} GiB, {secs:.3f} s; "
        if "ratio" in row:
            line += f"ratio {row['ratio']:.3f}"
        print(line, flush=True)
    result = {
        "env": environment() if torch.cuda.is_available() and not args.tiny else None,
        "layers": args.layers, "cp": args.cp, "exchange": args.exchange, "tiny": args.tiny,
        "rows": rows,
    }  # fmt: skip
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
