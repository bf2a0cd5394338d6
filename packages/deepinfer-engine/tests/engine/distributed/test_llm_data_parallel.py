"""LLM(data_parallel_size=N) on CPU processes over gloo, on tiny real checkpoints.

With ``DEEPINFER_BATCH_INVARIANT=1`` greedy and seeded outputs of mixed prompts equal the
single-process run token for token and logprob for logprob (50 short prompts, both
checkpoints at 2 and 4 ranks); without it, the tokens of 50 prompts are the same and their logprobs
agree within 1e-4, two of them with an image (V4.1's tower) run on different ranks. Asynchronous
scheduling (the default) sends the ranks their next step before collecting the last one; off,
they step synchronously: the same tokens. A bad request fails alone, a killed or stopped worker
fails the call naming its rank within the step timeout, and no worker outlives the engine.
The V4.1 ranks map one copy of the Engram tables in node shared memory.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time

import numpy as np
import pytest
from PIL import Image

from deepinfer.engine.distributed.shared_tables import shared_table_mappings
from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.model.config_parsing import load_config
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config, tiny_v41_config
from deepinfer.parallel import WorkerError
from deepinfer.sampling import SamplingParams, StructuredOutputs

MAX_TOKENS = 3
NUM_INVARIANT_PROMPTS = 50
IMAGE_ID = 15  # tiny_v41_config's image_token_id
IMAGE_PROMPTS = {3: (20, 12), 4: (10, 24)}  # prompt index: (width, height) of its image
PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(directory, block size) of a float V4.1 (with a vision tower) and a float V4 checkpoint."""
    v41 = tmp_path_factory.mktemp("v41")
    make_random_checkpoint(v41, tiny_v41_config(vision=True), quantized=False, seed=0)
    v4 = tmp_path_factory.mktemp("v4")
    make_random_checkpoint(v4, tiny_v4_config(), quantized=False, seed=0)
    return {"v41": (v41, 16), "v4": (v4, 128)}


def _prompts(num: int = 50, longest: int = 24) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(20, 250) for _ in range(rng.randrange(2, longest))] for _ in range(num)]


def _params(num: int = 50) -> list[SamplingParams]:
    """Greedy and seeded sampling, alternating, with the top-2 logprobs of each token."""
    return [
        SamplingParams(
            temperature=0.0 if i % 2 == 0 else 0.9,
            seq_seed=1000 + i,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            logprobs=2,
        )
        for i in range(num)
    ]


def _engine(checkpoint, **kwargs) -> LLM:
    directory, block_size = checkpoint
    return LLM(
        str(directory),
        accelerator="cpu",  # gloo ranks on any machine
        dtype="float32",
        block_size=block_size,
        max_model_len=128,
        speculative_tokens=0,
        **kwargs,
    )


def _generate(llm: LLM, num: int = 50, longest: int = 24, images: bool = False):
    prompts, params = _prompts(num, longest), _params(num)
    if not images:
        return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    items: list[dict] = [{"prompt_token_ids": p} for p in prompts]
    for index, (width, height) in IMAGE_PROMPTS.items():
        pixels = np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
        items[index] = {
            "prompt_token_ids": [IMAGE_ID, *prompts[index]],
            "multi_modal_data": {"image": Image.fromarray(pixels)},
        }
    return llm.generate(items, params, use_tqdm=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _assert_one_engram_copy(llm: LLM, directory) -> None:
    """Every rank maps the same shared files of the Engram tables (float32 here), read-only:
    the node holds their bytes once."""
    config = load_config(directory)
    tables = {
        f"layers.{layer}.engram.embed.weight": -(-rows * config.engram_head_dim * 4 // PAGE) * PAGE
        for layer, rows in zip(config.engram_layer_ids, config.engram_num_embeddings, strict=True)
    }
    files = [
        {(m.name, m.inode, m.num_bytes, m.perms) for m in shared_table_mappings(pid)}
        for pid in llm._core.ranks.pids
    ]
    assert files[0] == files[1]
    assert {name: size for name, _, size, _ in files[0]} == tables
    assert len({inode for _, inode, _, _ in files[0]}) == len(tables)
    assert {perms for *_, perms in files[0]} == {"r--s"}


@pytest.mark.parametrize("kind,ranks", [("v41", 2), ("v41", 4), ("v4", 2), ("v4", 4)])
def test_batch_invariant_outputs_equal_the_single_process(checkpoints, monkeypatch, kind, ranks):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    ahead = kind == "v41"  # asynchronous ranks against a synchronous process, and the reverse
    one = _engine(checkpoints[kind], async_scheduling=not ahead)
    expected = _generate(one, NUM_INVARIANT_PROMPTS, longest=10)
    llm = _engine(
        checkpoints[kind], data_parallel_size=ranks, expert_parallel_size=ranks,
        async_scheduling=ahead,
    )  # fmt: skip
    assert llm._core.async_scheduling == ahead
    try:
        if kind == "v41":
            _assert_one_engram_copy(llm, checkpoints[kind][0])
        outputs = _generate(llm, NUM_INVARIANT_PROMPTS, longest=10)
    finally:
        llm.close()
    assert [o.request_id for o in outputs] == [o.request_id for o in expected]
    for got, want in zip(outputs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs


def test_logprobs_agree_images_included_and_a_bad_request_fails_alone(
    checkpoints, monkeypatch, caplog
):
    # float numerics: with the model's roundings a last-bit difference in reduction order can
    # flip a rounding and move a logprob past 1e-4; the batch-invariant tests cover them bitwise
    expected = _generate(_engine(checkpoints["v41"], numerics="float"), images=True)
    with caplog.at_level(logging.INFO, logger="deepinfer.engine"):
        llm = _engine(
            checkpoints["v41"], data_parallel_size=2, expert_parallel_size=2, numerics="float",
            async_scheduling=True,
        )  # fmt: skip
    assert "over gloo, asynchronous scheduling on" in caplog.text
    assert llm._core.async_scheduling
    ranks: list[int] = []
    add = llm._core.add_request
    monkeypatch.setattr(llm._core, "add_request", lambda request: ranks.append(add(request)))
    try:
        outputs = _generate(llm, images=True)
        bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="(unclosed"))
        good = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        mixed = llm.generate(["a", "b", "c", "d"], [good, bad, good, good], use_tqdm=False)
    finally:
        llm.close()
    _assert_logprobs_agree(outputs, expected)
    assert {ranks[index] for index in IMAGE_PROMPTS} == {0, 1}
    for index in IMAGE_PROMPTS:  # the placeholder became the image's span
        assert len(outputs[index].prompt_token_ids) > len(_prompts()[index]) + 1
    assert mixed[1].outputs[0].finish_reason == "error" and mixed[1].outputs[0].error
    assert [mixed[i].outputs[0].finish_reason for i in (0, 2, 3)] == ["length"] * 3


def _assert_logprobs_agree(outputs, expected) -> None:
    """The same tokens, and each token's top logprobs within 1e-4."""
    for got, want in zip(outputs, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for got_lp, want_lp in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert got_lp.keys() == want_lp.keys()
            assert all(abs(got_lp[t] - want_lp[t]) <= 1e-4 for t in got_lp)


@pytest.mark.parametrize("kind,ranks", [("v41", 4), ("v4", 2), ("v4", 4)])
def test_logprobs_agree_without_the_flag(checkpoints, kind, ranks):
    """The rest of the matrix beside the V4.1 2-rank case above: 50 prompts, float numerics."""
    expected = _generate(_engine(checkpoints[kind], numerics="float"))
    llm = _engine(
        checkpoints[kind], data_parallel_size=ranks, expert_parallel_size=ranks,
        numerics="float",
    )  # fmt: skip
    try:
        outputs = _generate(llm)
    finally:
        llm.close()
    assert [o.request_id for o in outputs] == [o.request_id for o in expected]
    _assert_logprobs_agree(outputs, expected)


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_dead_or_hung_worker_fails_the_call_naming_its_rank(checkpoints, fault):
    llm = _engine(checkpoints["v41"], data_parallel_size=2, distributed_timeout_s=10)
    pids = llm._core.ranks.pids
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    stream = llm.stream(prompt_token_ids=_prompts()[:8], sampling_params=params)
    next(stream)  # generation is under way
    os.kill(pids[1], signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1") as failure:
        for _ in stream:
            pass
    assert failure.value.rank == 1
    assert time.monotonic() - start < 30
    assert ("SIGKILL" if fault == "killed" else "did not answer within 10 s") in str(failure.value)
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(WorkerError, match="workers stopped"):
        llm.generate(prompt_token_ids=[[5, 6, 7]], use_tqdm=False)
