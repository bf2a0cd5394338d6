"""Context-parallel prefill over gloo: the prompt's logprobs with CP = 2 and 4 equal one
process's plain forward (within 1e-5 in fp32, bitwise with batch-invariant kernels), and every
rank, decoding greedily from the cache its prefill left, continues exactly as one process does;
also when the prompt is prefilled in two chunks (chunked prefill), each split over the ranks,
and when the CP ranks are also the model's expert-parallel ranks.

The prompts are a few hundred tokens (CI time); ``DEEPINFER_CP_TOKENS=4000`` runs the
acceptance's 4,000-token prompt through the same tests."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from deepinfer import kernels
from deepinfer.engine.checkpoint.loader import load_into
from deepinfer.engine.checkpoint.model_loader import bind_engram_from_tokenizer, load_model
from deepinfer.engine.model.cache import CacheLayout
from deepinfer.engine.model.config_parsing import load_config, parse_config
from deepinfer.engine.model.context_prefill import (
    RowGather,
    RowSplit,
    context_parallel_prefill,
    prompt_logprobs,
)
from deepinfer.engine.model.metadata import ForwardBatch, build_metadata
from deepinfer.engine.model.model import build_model
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config, tiny_v41_config
from deepinfer.engine.testing.simple_runner import SimpleRunner
from deepinfer.parallel import (
    ExpertParallelContext,
    SingleProcessComm,
    TorchDistributedComm,
    spawn,
)

PROMPT_TOKENS = int(os.environ.get("DEEPINFER_CP_TOKENS", "300"))
# the batch-invariant reference runs row by row: a shorter prompt (still several HCA entries)
INVARIANT_TOKENS = int(os.environ.get("DEEPINFER_CP_TOKENS", "96"))
NEW_TOKENS = 4
TIMEOUT_S = 120 if PROMPT_TOKENS <= 1000 else 2400


def _prompt(n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _greedy(runner: SimpleRunner, last: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and their logprob rows, starting from the prompt's last logits."""
    tokens, rows = [], []
    row = torch.log_softmax(last.float(), dim=-1)
    for i in range(n):
        tokens.append(int(row.argmax()))
        rows.append(row)
        if i + 1 < n:
            row = torch.log_softmax(runner.step({0: [tokens[-1]]})[0][-1].float(), dim=-1)
    return tokens, torch.stack(rows)


def _run(model, prompt, comm=None, chunks=1, device="cpu", exchange="borders", rounds=8):
    """One process's plain prefill (``comm`` None), or CP prefills of ``chunks`` consecutive
    chunks of the prompt (chunked prefill), then greedy decoding from this rank's cache."""
    max_len = len(prompt) + NEW_TOKENS
    runner = SimpleRunner(model, max_seqs=1, max_len=max_len, block_size=128, device=device)
    if comm is None:
        logits = runner.step({0: prompt})[0]
    else:
        bounds = [len(prompt) * i // chunks for i in range(chunks + 1)]
        parts = []
        for a, b in zip(bounds, bounds[1:]):
            split = RowSplit.balanced(b - a, comm.world_size, model.config, rounds)
            batch = runner.batch({0: prompt[a:b]})
            own = context_parallel_prefill(model, runner.cache, batch, split, comm, exchange)
            parts.append(RowGather(comm, split, device)(own))
            runner.lengths[0] = b
        logits = torch.cat(parts)
    tokens, rows = _greedy(runner, logits[-1], NEW_TOKENS)
    return {"logprobs": prompt_logprobs(logits, prompt).cpu(), "tokens": tokens, "rows": rows.cpu()}


def _load(directory, numerics, device, dtype, expert_parallel=None):
    config = load_config(directory, numerics=numerics)
    model = build_model(config, device=device, dtype=dtype, expert_parallel=expert_parallel)
    load_into(model, directory, config=config, progress=False)
    bind_engram_from_tokenizer(model, directory)
    return model.eval()


def _worker(rank, world_size, directory, opts):
    """opts: numerics, batch_invariant, tokens, chunks; gpu (one GPU per rank, NCCL, bf16,
    the NVIDIA kernels); ep (the CP ranks are also the model's expert-parallel ranks);
    exchange and rounds (pieces per rank / 2) of the CP prefill."""
    os.environ["DEEPINFER_BATCH_INVARIANT"] = "1" if opts["batch_invariant"] else "0"
    torch.set_num_threads(1)
    device, dtype = "cpu", torch.float32
    if opts.get("gpu"):
        kernels.set_accelerator("nvidia")
        device, dtype = f"cuda:{rank}", torch.bfloat16
        torch.cuda.set_device(device)
    comm = TorchDistributedComm()
    ep = ExpertParallelContext(comm) if opts.get("ep") else None
    model = _load(directory, opts["numerics"], device, dtype, ep)
    prompt = _prompt(opts["tokens"])
    exchange, rounds = opts.get("exchange", "borders"), opts.get("rounds", 8)
    result = {"cp": _run(model, prompt, comm, opts["chunks"], device, exchange, rounds)}
    if rank == 0:
        single = _load(directory, opts["numerics"], device, dtype) if ep else model
        result["single"] = _run(single, prompt, device=device)
    return result


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    v4 = tiny_v4_config(hca_ratio=16)
    v41 = tiny_v41_config(vision=False)
    return {
        # fp32 weights: a wrong reduction order or a wrong key row shows in the logprobs
        "v4": make_random_checkpoint(
            root / "v4", v4, quantized=False, seed=1, float_dtype=torch.float32
        ),
        "v41": make_random_checkpoint(
            root / "v41", v41, quantized=False, seed=2, float_dtype=torch.float32
        ),
        "v41-fp8": make_random_checkpoint(root / "v41q", v41, quantized=True, seed=3),
    }


def _check(results, exact: bool) -> None:
    single = results[0]["single"]
    for rank, got in enumerate(results):
        cp = got["cp"]
        assert cp["tokens"] == single["tokens"], rank
        for key in ("logprobs", "rows"):
            if exact:
                assert torch.equal(cp[key], single[key]), (rank, key)
            else:
                diff = (cp[key] - single[key]).abs().max().item()
                assert diff <= 1e-5, (rank, key, diff)


@pytest.mark.parametrize(
    ("arch", "world_size", "chunks", "exchange", "rounds"),
    # rounds=1: pieces of 75 rows, far longer than the border (15), so each rank computes
    # keys for only part of the prompt and receives the other ranks' entries
    [("v4", 2, 1, "borders", 1), ("v41", 4, 2, "hidden", 8)],
)
def test_cp_prefill_matches_one_process_within_1e5(
    checkpoints, arch, world_size, chunks, exchange, rounds
):
    opts = dict(numerics="float", batch_invariant=False, tokens=PROMPT_TOKENS, chunks=chunks)
    opts.update(exchange=exchange, rounds=rounds)
    results = spawn(_worker, world_size, str(checkpoints[arch]), opts, timeout_s=TIMEOUT_S)
    _check(results, exact=False)


@pytest.mark.parametrize(
    ("arch", "world_size", "chunks", "ep"), [("v4", 4, 1, True), ("v41-fp8", 2, 2, False)]
)
def test_cp_prefill_is_bitwise_one_process_when_batch_invariant(
    checkpoints, arch, world_size, chunks, ep
):
    """The V4 case also shards the experts over the CP ranks (expert parallelism)."""
    opts = dict(numerics="model", batch_invariant=True, tokens=INVARIANT_TOKENS, chunks=chunks)
    opts["ep"] = ep
    results = spawn(_worker, world_size, str(checkpoints[arch]), opts, timeout_s=TIMEOUT_S)
    _check(results, exact=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize(("arch", "chunks"), [("v4", 1), ("v41-fp8", 2)])
def test_cp_prefill_over_nccl_is_bitwise_one_gpu_when_batch_invariant(checkpoints, arch, chunks):
    opts = dict(numerics="model", batch_invariant=True, tokens=PROMPT_TOKENS, chunks=chunks)
    opts["gpu"] = True
    results = spawn(
        _worker,
        2,
        str(checkpoints[arch]),
        opts,
        backend="nccl",
        start_method="spawn",
        timeout_s=TIMEOUT_S,
    )
    _check(results, exact=True)


@pytest.mark.parametrize("raw", [tiny_v4_config(hca_ratio=16), tiny_v41_config(vision=False)])
def test_query_rows_metadata_is_the_whole_steps_lists_at_those_rows(raw):
    config = parse_config(raw)
    layout = CacheLayout(num_blocks=8, num_slots=3, block_size=64)
    # two sequences: one continuing after 70 cached tokens, one starting
    runs, slots = [(70, 90), (0, 130)], [2, 0]
    positions = torch.cat([torch.arange(s, s + n) for s, n in runs])
    cu = torch.tensor([0] + [n for _, n in runs]).cumsum(0)
    tables = torch.tensor([[7, 5, 3, -1], [0, 1, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([s + n for s, n in runs])
    batch = ForwardBatch(positions.clone(), positions, cu, lens, tables, torch.tensor(slots))
    ring = config.sliding_window
    whole = build_metadata(batch, config, layout, ring)
    rows = torch.randperm(len(positions), generator=torch.Generator().manual_seed(0))[:77]
    rows = rows.sort().values
    part = build_metadata(batch, config, layout, ring, query_rows=rows)
    assert part.num_tokens == len(rows)
    assert torch.equal(part.window_indices, whole.window_indices[rows])
    for name in ("window_write_src", "window_write_dst"):
        assert torch.equal(getattr(part, name), getattr(whole, name))
    assert part.plans.keys() == whole.plans.keys()
    for kind, plan in whole.plans.items():
        got = part.plans[kind]
        width = got.all_visible().shape[1]
        assert torch.equal(got.all_visible(), plan.all_visible()[rows, :width])
        assert (plan.all_visible()[rows, width:] == -1).all()
        assert torch.equal(got.visible_count, plan.visible_count[rows])
        for name in (
            "emit_src",
            "emit_positions",
            "emit_rows",
            "state_write_src",
            "state_write_dst",
        ):
            assert torch.equal(getattr(got, name), getattr(plan, name)), (kind, name)


def test_one_rank_is_the_plain_forward_and_honours_logits_indices(checkpoints):
    """CP = 1 runs the plain forward's arithmetic (bitwise, the same cache), and only the rows
    ``logits_indices`` names get logits (a prompt without prompt logprobs needs its last)."""
    model = load_model(checkpoints["v41"], dtype=torch.float32, progress=False).eval()
    prompt = _prompt(70)
    plain = SimpleRunner(model, max_seqs=1, max_len=80, block_size=64)
    want = plain.step({0: prompt})[0]
    runner = SimpleRunner(model, max_seqs=1, max_len=80, block_size=64)
    batch = runner.batch({0: prompt})
    split = RowSplit.balanced(len(prompt), 1, model.config)
    got = context_parallel_prefill(model, runner.cache, batch, split, SingleProcessComm())
    assert torch.equal(got, want)
    for key, tensor in plain.cache.tensors.items():
        assert torch.equal(runner.cache.tensors[key], tensor), key
    runner = SimpleRunner(model, max_seqs=1, max_len=80, block_size=64)
    batch = dataclasses.replace(runner.batch({0: prompt}), logits_indices=torch.tensor([3, 69]))
    got = context_parallel_prefill(model, runner.cache, batch, split, SingleProcessComm())
    # the head's product over 2 rows instead of 70 may round its last bit differently
    torch.testing.assert_close(got, want[[3, 69]], rtol=0, atol=1e-5)


def test_a_split_leaving_a_rank_without_rows_is_refused(checkpoints):
    model = load_model(checkpoints["v4"], dtype=torch.float32, progress=False).eval()
    runner = SimpleRunner(model, max_seqs=1, max_len=8)
    split = RowSplit.balanced(3, 4, model.config)  # 3 rows over 4 ranks
    with pytest.raises(ValueError, match="RowSplit: rank 3 has no rows of the 3-row step"):
        context_parallel_prefill(
            model, runner.cache, runner.batch({0: [5, 6, 7]}), split, SingleProcessComm()
        )
