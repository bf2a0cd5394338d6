"""Host Engram tables in node shared memory: what the node holds and what placing them costs.

``--ranks`` processes (one node, gloo) place ``--tables`` FP8 tables of ``--gib`` GiB each (plus
their ue8m0 scales) as the engine does with several ranks
(:class:`deepinfer.engine.distributed.shared_tables.NodeTableShare`): the first rank fills them
(a constant byte, so the time is the mechanism's, not a random generator's), every rank maps
them read-only and, with ``--cuda``, registers its mapping as pinned memory. Each rank then
reads every page. Printed per rank: the placing time, the registration time, whether the table
is pinned, its anonymous resident memory growth (a private copy would show here) and its shared
resident memory; and for the node, the growth of ``Shmem`` in ``/proc/meminfo`` (one copy:
the tables' bytes, whatever the number of ranks). With ``--cuda`` each rank also times a step's
gather (``--rows`` rows of each table to the device, median of 20).

    python -m benchmarks.parallel.engram_shared_tables --ranks 2 --gib 1 --out bench-out/engram_shm.json
    python -m benchmarks.parallel.engram_shared_tables --ranks 8 --gib 8 --cuda --out bench-out/engram_shm_gpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.multiprocessing as mp
from torch import nn

from benchmarks.common import environment, print_table, write_json
from deepinfer.engine.distributed.shared_tables import NodeTableShare
from deepinfer.engine.model.engram import EngramTable, host_tables_deferred
from deepinfer.parallel import find_free_port

WIDTH = 256  # bytes per FP8 row (released V4.1 tables: head_dim 256)
TIMEOUT_S = 600


def _meminfo(key: str, path: str = "/proc/meminfo") -> int:
    """A ``/proc`` memory field in bytes (kB in the file)."""
    with open(path) as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _fill(tables: dict[str, torch.Tensor]) -> None:
    for t in tables.values():
        t.view(torch.uint8).fill_(0x38)  # FP8 1.0 and a valid ue8m0 scale: every page written


def _rank(rank: int, args, init_method: str, results) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=args.ranks
    )
    rows = args.gib * 2**30 // WIDTH
    device = "cuda" if args.cuda else "cpu"
    with host_tables_deferred():
        model = nn.ModuleList(
            EngramTable(rows, WIDTH, True, torch.bfloat16, device=device, host=args.cuda)
            for _ in range(args.tables)
        )
    anon = _meminfo("RssAnon", "/proc/self/status")
    start = time.perf_counter()
    share = NodeTableShare.join(TIMEOUT_S)
    share.place(model, _fill)
    placed_s = time.perf_counter() - start
    for table in model:
        table.weight.view(torch.uint8).max()
        table.scale.view(torch.uint8).max()
    row = {
        "rank": rank,
        "leader": share.is_leader,
        "place_s": placed_s,
        "pinned": bool(args.cuda and model[0].weight.is_pinned()),
        "anon_growth_mib": (_meminfo("RssAnon", "/proc/self/status") - anon) / 2**20,
        "shmem_rss_gib": _meminfo("RssShmem", "/proc/self/status") / 2**30,
    }
    if args.cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        row_ids = torch.randint(0, rows, (args.rows,), device="cuda")
        times = []
        for _ in range(23):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for table in model:
                table(row_ids, torch.bfloat16)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        row["gather_ms"] = statistics.median(times[3:])
    results.put(row)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tables", type=int, default=2)
    parser.add_argument("--gib", type=int, default=1, help="GiB of FP8 rows per table")
    parser.add_argument("--cuda", action="store_true", help="pin the mappings, time gathers")
    parser.add_argument("--rows", type=int, default=4096, help="rows a timed gather reads")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    shmem = _meminfo("Shmem")
    init_method = f"tcp://127.0.0.1:{find_free_port()}"
    procs = [
        ctx.Process(target=_rank, args=(r, args, init_method, results)) for r in range(args.ranks)
    ]
    for proc in procs:
        proc.start()
    rows = sorted((results.get(timeout=TIMEOUT_S) for _ in procs), key=lambda r: r["rank"])
    node_growth = _meminfo("Shmem") - shmem  # read while the ranks still map the tables
    for proc in procs:
        proc.join(TIMEOUT_S)
    table_bytes = args.tables * (args.gib * 2**30 + args.gib * 2**30 // 32)
    columns = ["rank", "leader", "place_s", "pinned", "anon_growth_mib", "shmem_rss_gib"]
    print_table(rows, columns + (["gather_ms"] if args.cuda else []))
    print(
        f"node Shmem growth {node_growth / 2**30:.3f} GiB for {args.ranks} ranks; "
        f"the tables hold {table_bytes / 2**30:.3f} GiB"
    )
    write_json(
        args.out,
        {"env": environment(), "args": vars(args), "ranks": rows,
         "node_shmem_growth_bytes": node_growth, "table_bytes": table_bytes},
    )  # fmt: skip


if __name__ == "__main__":
    main()
