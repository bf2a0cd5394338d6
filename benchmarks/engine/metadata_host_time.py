"""Host time of one step's index lists (``build_metadata``) on the CPU, per step shape.

Thread CPU time of ``build_metadata`` with one torch thread (V4-Flash config: window 128,
ratios 4 overlapped and 128; 64 state slots, blocks of 128 rows), the median of ``--reps``
runs after one warm-up, per step:

- ``1x1024``: one fresh 1,024-token prompt; ``8x1024``: eight of them;
- ``1x8192@8k``: an 8,192-row chunk at positions 8,192-16,383 of one prompt;
- ``1x8192@120k``: an 8,192-row chunk at positions 122,880-131,071.

``--device`` picks where the metadata's tensors go: ``meta`` stands in for an accelerator
(whatever the lists' device-side ops cost, none of it is host work; the host-to-device copy
is not counted either), ``cpu`` runs those ops on the host too (the CPU backend's own cost).
``--trees A B ...`` measures other checkouts of this repository (each one's package sources
imported in a child process), alternating them per run, for an A/B on one loaded machine.

    python -m benchmarks.engine.metadata_host_time --reps 5 --out bench-out/metadata_host_time.json
    python -m benchmarks.engine.metadata_host_time --trees ../before . --device meta
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("deepinfer-kernels", "deepinfer-parallel", "deepinfer-sampling", "deepinfer-spec",
            "deepinfer-engine")  # fmt: skip
CASES = {  # name -> (sequences, rows each, first position)
    "1x1024": (1, 1024, 0),
    "8x1024": (8, 1024, 0),
    "1x8192@8k": (1, 8192, 8192),
    "1x8192@120k": (1, 8192, 122880),
}
RATIOS = [0, 0] + [4, 128] * 20 + [4]  # V4-Flash's 43 layers


def step(sequences: int, rows: int, first: int, device: str):
    """(batch, config, layout, ring size) of one step: ``sequences`` runs of ``rows`` tokens
    at positions ``first .. first + rows - 1``, each in its own blocks and state slot."""
    import torch

    from benchmarks.model.dummy_forward import v4_flash_config
    from deepinfer.engine.model.cache import CacheLayout
    from deepinfer.engine.model.config_parsing import parse_config
    from deepinfer.engine.model.metadata import ForwardBatch

    config = parse_config(v4_flash_config(RATIOS))
    end = first + rows
    blocks = -(-end // 128)
    layout = CacheLayout(num_blocks=sequences * blocks + 1, num_slots=64, block_size=128)
    positions = torch.arange(first, end).repeat(sequences)
    tables = 1 + torch.arange(sequences * blocks).reshape(sequences, blocks)
    batch = ForwardBatch(
        # the device the lists go to is the input ids' (the other fields are read on the host)
        input_ids=torch.zeros(sequences * rows, dtype=torch.long, device=device),
        positions=positions,
        cu_seqlens_q=torch.arange(sequences + 1) * rows,
        seq_lens=torch.full((sequences,), end),
        block_tables=tables.int(),
        state_slots=torch.arange(sequences) + 1,
    )
    return batch, config, layout, config.sliding_window


def measure(case: str, device: str, copy_reads: bool, reps: int) -> list[float]:
    """Thread CPU milliseconds of ``reps`` calls of ``build_metadata`` (after one warm-up)."""
    import torch

    from deepinfer.engine.model.metadata import build_metadata

    torch.set_num_threads(1)
    batch, config, layout, ring = step(*CASES[case], device)
    times = []
    for i in range(reps + 1):
        start = time.thread_time()
        md = build_metadata(batch, config, layout, ring, copy_reads=copy_reads)
        elapsed = time.thread_time() - start
        del md
        if i:
            times.append(elapsed * 1e3)
    return times


def _child(tree: str, case: str, device: str, copy_reads: bool, reps: int) -> list[float]:
    """:func:`measure` in a child process importing ``tree``'s package sources."""
    root = Path(tree).resolve()
    here = Path(__file__).resolve().parents[2]  # this script's checkout, for benchmarks.*
    paths = [str(root / "packages" / p / "src") for p in PACKAGES] + [str(here)]
    code = (
        f"import sys; sys.path[:0] = {paths!r}; import json; "
        "from benchmarks.engine.metadata_host_time import measure; "
        f"print(json.dumps(measure({case!r}, {device!r}, {copy_reads!r}, {reps})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated step names")
    parser.add_argument("--device", choices=("meta", "cpu"), default="meta")
    parser.add_argument("--copy-reads", action="store_true", help="also the float-copy lists")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per step (and tree)")
    parser.add_argument("--trees", nargs="*", default=None, help="checkouts to alternate")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    trees = args.trees or [None]
    rows = []
    for case in args.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"--cases: {case!r} is not one of {', '.join(CASES)}")
        runs: dict = {t: [] for t in trees}
        for _ in range(args.reps):  # alternate the trees run by run
            for t in trees:
                if t is None:
                    runs[t] += measure(case, args.device, args.copy_reads, 1)
                else:
                    runs[t] += _child(t, case, args.device, args.copy_reads, 1)
        for t in trees:
            ms = runs[t]
            rows.append({"step": case, "tree": t or "(this)", "median_ms": statistics.median(ms),
                         "runs_ms": ", ".join(f"{m:.1f}" for m in ms)})  # fmt: skip
    columns = ["step", "tree", "median_ms", "runs_ms"]
    print(f"device={args.device} copy_reads={args.copy_reads} (thread CPU ms, one torch thread)")
    widths = [max(len(c), *(len(f"{r[c]:.1f}" if c == "median_ms" else str(r[c])) for r in rows))
              for c in columns]  # fmt: skip
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        cells = [f"{r[c]:.1f}" if c == "median_ms" else str(r[c]) for c in columns]
        print("  ".join(v.rjust(w) for v, w in zip(cells, widths)))
    if args.out:
        payload = {"device": args.device, "copy_reads": args.copy_reads, "rows": rows}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
