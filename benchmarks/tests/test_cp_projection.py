"""The one-GPU CP projection never rots: its ``--tiny`` CPU mode runs each case in a child
process and writes every rank's peak, and its loopback plays one rank of a mirrored group."""

from __future__ import annotations

import json

import torch

from benchmarks.parallel.cp_projection import RankLoopback, main


def test_loopback_gathers_this_ranks_block_into_every_place() -> None:
    comm = RankLoopback(2, 3)
    x = torch.randn(5, 4)
    out = torch.full((15, 4), float("nan"))
    comm.all_gather_into_tensor(out, x)
    assert torch.equal(out, x.repeat(3, 1))


def test_tiny_projection_measures_every_rank(tmp_path) -> None:
    out = tmp_path / "cp.json"
    main(["--tiny", "--lengths", "768", "--cp", "2", "--layers", "3", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    assert [r["rank"] for r in row["cp2"]["ranks"]] == [0, 1]
    assert sum(r["rows"] for r in row["cp2"]["ranks"]) == 768 == row["cp1"]["ranks"][0]["rows"]
    assert all(r["peak_bytes"] > 0 for r in row["cp1"]["ranks"] + row["cp2"]["ranks"])
    # each rank holds about half the rows' activations (well under CP = 1's peak)
    assert row["ratio"] < 0.75
