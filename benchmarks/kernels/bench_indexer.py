"""Lightning indexer on the GPU: scoring + top-k (512) for one CSA layer, 64 query rows, over
all visible compressed entries (64k context / ratio 4 = 16384 entries; V4.1: 32 heads).
Triton scoring alone, Triton top-k alone (radix select, winners ordered in-kernel) next to
``torch.topk`` on the same scores, and scoring + top-k (the criterion) against the reference
(gather + einsum + stable sort); the scoring launch shape is swept and the best sum reported.

Bytes counted: the index keys each row reads, rows x entries x 128 x bytes per element (the
keys are shared between rows, so much of it comes from L2; the issue's target counts it this
way); "unique" is the key arena read once. The "private keys" case gives every row its own
16,384 keys (64 decoding sequences at 64k context): there every counted byte comes from HBM.
Ceiling: the copy rate measured in the same run.

    python -m benchmarks.kernels.bench_indexer --out bench-out/indexer.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.common import copy_bandwidth_tbs, environment, print_table, time_cuda, write_json
from deepinfer import kernels
from deepinfer.kernels_nvidia import backend

DIM, TOPK = 128, 512
# (block_c, blocks per program, warps, stages, keys as the product's M side)
SCORE_SWEEP = [(128, 8, 8, 3, True), (64, 8, 4, 3, True), (64, 32, 4, 3, True)]


def warm_up(seconds: float = 1.0) -> None:
    """Keep the GPU busy for a while first, so that its clocks have left the idle state."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return


def bench(
    rows: int,
    heads: int,
    entries: int,
    key_dtype: torch.dtype,
    ceiling: float,
    sweep=(),
    *,
    private_keys: bool = False,
) -> dict:
    """``private_keys``: every row reads its own ``entries`` keys (64 decoding sequences, each
    at 64k context), so all counted bytes come from HBM; otherwise the rows share one arena."""
    q = torch.randn(rows, heads, DIM, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(rows, heads, device="cuda") * (DIM * heads) ** -0.5
    arena = rows * entries if private_keys else entries
    keys = torch.randn(arena, DIM, device="cuda").to(key_dtype)
    # one list per sequence: every row the one sequence's, or (private) each row its own
    seqs = rows if private_keys else 1
    seq_rows = torch.arange(seqs * entries, device="cuda", dtype=torch.int32).view(seqs, entries)
    q_seq = torch.arange(rows, device="cuda") * int(private_keys)  # private: row t, list t
    counts = torch.full((rows,), entries, device="cuda")
    lists = (seq_rows, q_seq, counts)

    def run(impl, **kw):
        return lambda: impl["select_topk"](
            impl["indexer_scores"](q, w, keys, *lists, **kw), seq_rows, q_seq, TOPK
        )

    ref = {n: kernels.OPS[n].reference for n in ("indexer_scores", "select_topk")}
    scores = backend.ops["indexer_scores"](q, w, keys, *lists)
    if not torch.equal(backend.ops["select_topk"](scores, seq_rows, q_seq, TOPK),
                       ref["select_topk"](scores, seq_rows, q_seq, TOPK)):  # fmt: skip
        raise AssertionError("select_topk differs from the reference")
    ms = default_ms = time_cuda(run(backend.ops), iters=100)
    best = "default"
    for bc, nb, nw, ns, keys_m in sweep:
        kw = {"block_c": bc, "blocks_per_program": nb, "num_warps": nw, "num_stages": ns,
              "keys_as_m": keys_m}  # fmt: skip
        name = f"bc{bc}/nb{nb}/w{nw}/s{ns}" + ("/keys-as-M" if keys_m else "")
        try:
            alt = time_cuda(run(backend.ops, **kw), iters=50)
        except Exception as e:  # a launch shape that does not compile is skipped
            print(f"  scores {name} failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        print(f"  {rows}x{entries} Hi={heads} scores {name} + top-k: {alt * 1e3:.1f} us")
        if alt < ms:
            ms, best = alt, name
    score_ms = time_cuda(lambda: backend.ops["indexer_scores"](q, w, keys, *lists), iters=100)
    topk_ms = time_cuda(
        lambda: backend.ops["select_topk"](scores, seq_rows, q_seq, TOPK), iters=100
    )
    torch_topk_ms = time_cuda(lambda: scores.topk(TOPK, dim=-1), iters=100)
    ref_ms = time_cuda(run(ref), iters=10)
    read = rows * entries * DIM * keys.element_size()
    sharing = "private keys" if private_keys else "shared keys"
    return {"case": f"T={rows} Hi={heads} entries={entries} keys={str(key_dtype)[6:]} {sharing}",
            "scores_us": score_ms * 1e3, "scores_TB/s": read / score_ms / 1e9,
            "topk_us": topk_ms * 1e3, "torch_topk_us": torch_topk_ms * 1e3,
            "total_us": ms * 1e3, "total_TB/s": read / ms / 1e9,
            "default_total_us": default_ms * 1e3,
            "%ceiling": 100 * read / ms / 1e9 / ceiling,
            "unique_TB/s": arena * DIM * keys.element_size() / ms / 1e9,
            "reference_us": ref_ms * 1e3, "score_launch": best}  # fmt: skip


def bench_candidate_mask(rows: int, entries: int, blocks: int, block_size: int) -> dict:
    """V4.1 candidate pre-filter at 64k context (ratio 1): keep 2048 of the 8-entry blocks."""
    scores = torch.randn(rows, entries, device="cuda")
    counts = torch.full((rows,), entries, device="cuda", dtype=torch.int64)
    args = (scores, counts, blocks, block_size)
    ms = time_cuda(lambda: backend.ops["candidate_block_mask"](*args), iters=50)
    ref_ms = time_cuda(lambda: kernels.OPS["candidate_block_mask"].reference(*args), iters=10)
    return {"case": f"candidate_block_mask T={rows} C={entries} keep {blocks}x{block_size}",
            "total_us": ms * 1e3, "reference_us": ref_ms * 1e3}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_indexer.py needs an NVIDIA GPU")
    warm_up()
    ceiling = copy_bandwidth_tbs()
    print(f"measured copy bandwidth: {ceiling:.2f} TB/s")
    rows = [
        bench(64, 64, 16384, torch.bfloat16, ceiling, SCORE_SWEEP),
        bench(64, 64, 16384, torch.bfloat16, ceiling, private_keys=True),
        bench(64, 64, 16384, torch.float8_e4m3fn, ceiling),
        bench(64, 32, 16384, torch.bfloat16, ceiling),
        bench(64, 64, 32768, torch.bfloat16, ceiling),
        bench_candidate_mask(64, 65536, 2048, 8),
    ]
    cols = ["case", "scores_us", "scores_TB/s", "topk_us", "torch_topk_us", "total_us",
            "total_TB/s", "%ceiling", "unique_TB/s", "reference_us", "score_launch"]  # fmt: skip
    print(
        f"copy ceiling {ceiling:.2f} TB/s; total = scoring + top-k (the issue's criterion: "
        f">= 2.5 TB/s over the keys each row reads)"
    )
    print_table(rows, cols)
    write_json(args.out, {"env": environment(), "copy_TB/s": ceiling, "rows": rows})


if __name__ == "__main__":
    main()
