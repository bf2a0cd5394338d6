"""The whole engine (scheduler + model runner + real tiny checkpoints) is exact.

With ``DEEPINFER_BATCH_INVARIANT=1`` greedy outputs of 50 prompts of mixed lengths are
bitwise identical, every token and every returned logprob (sampled, top-k alternatives,
prompt): alone, all together, chunked, under preemption, with speculation (checkpoints with
DSpark stages), and equal to the argmax of the model's plain full forward along each
sequence; for tiny V4 and V4.1 checkpoints, FP8 and float, and the embedded model. Without the
flag, the tiny checkpoints' logprobs agree within 1e-4.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from deepinfer.engine.checkpoint.model_loader import load_model
from deepinfer.engine.frontend.llm import LLM
from deepinfer.engine.testing import make_random_checkpoint, tiny_v4_config, tiny_v41_config
from deepinfer.engine.testing.simple_runner import SimpleRunner
from deepinfer.sampling import SamplingParams

MAX_TOKENS = 3
# (architecture, quantised, block size): V4's ratio-128 layers need 128-token blocks.
CHECKPOINTS = [("v4", False, 128), ("v4", True, 128), ("v41", False, 16), ("v41", True, 16)]
EMBEDDED = Path(__file__).parents[5] / "examples" / "tiny_model" / "checkpoint"
ALONE = 6  # prompts also run alone (each its own generate call)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _case(kind: str, quantized: bool, block_size: int):
    """A checkpoint parameter, its own xdist work unit (each costs minutes on the CPU)."""
    name = kind if kind == "embedded" else f"{kind}-{'fp8' if quantized else 'float'}"
    marks = [pytest.mark.slow, pytest.mark.xdist_group(f"llm_exactness-{name}")]
    return pytest.param((kind, quantized, block_size), marks=marks, id=name)


@pytest.fixture(scope="module", params=[_case(*c) for c in [*CHECKPOINTS, ("embedded", True, 16)]])
def checkpoint(request, tmp_path_factory):
    kind, quantized, block_size = request.param
    if kind == "embedded":
        return EMBEDDED, block_size
    directory = tmp_path_factory.mktemp(f"{kind}-{quantized}")
    config = tiny_v41_config(vision=False) if kind == "v41" else tiny_v4_config()
    make_random_checkpoint(directory, config, quantized=quantized, seed=0)
    return directory, block_size


def _prompts(block_size: int) -> list[list[int]]:
    """44 short prompts and 6 that end just before a block boundary (they grow into a new
    block while decoding, which is what forces preemption when blocks are scarce)."""
    rng = random.Random(0)
    lengths = [rng.randrange(3, 25) for _ in range(44)]
    lengths += [block_size - rng.randrange(1, 3) for _ in range(6)]
    rng.shuffle(lengths)
    return [[rng.randrange(20, 250) for _ in range(n)] for n in lengths]


def _engine(directory, block_size: int, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 320)
    kwargs.setdefault("speculative_tokens", 0)
    return LLM(str(directory), dtype="float32", block_size=block_size, **kwargs)


def _greedy(llm: LLM, prompts, **params):
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    return llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)


def _records(outputs) -> list[tuple]:
    """Everything a request returns that the mode promises bitwise: tokens, per-token
    ``{token: logprob}`` (sampled and top-2), per-prompt-token ``{token: logprob}`` (and top-1)."""
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]


def _run(llm: LLM, prompts) -> list[tuple]:
    return _records(_greedy(llm, prompts, logprobs=2, prompt_logprobs=1))


def _first_difference(got: list[tuple], want: list[tuple]) -> str:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for name, a, b in zip(("tokens", "logprobs", "prompt logprobs"), g, w, strict=True):
            if a != b:
                return f"prompt {i}: {name} differ: {a} != {b}"
    return "no difference"


def _assert_same(got: list[tuple], want: list[tuple], how: str) -> None:
    assert got == want, f"{how}: {_first_difference(got, want)}"


def _plain_forward_argmax(directory, prompts, outputs) -> list[list[int]]:
    """The model's own greedy choices along each finished sequence: one full forward over
    prompt + output (causal, batch-invariant ops), the argmax at each generating position.
    Equal to ``outputs`` exactly when re-running the forward token by token would be."""
    model = load_model(directory, device="cpu", dtype=torch.float32, progress=False)
    choices = []
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = list(prompt) + list(output)
        runner = SimpleRunner(model, max_seqs=1, max_len=len(tokens))
        logits = runner.step({0: tokens})[0]
        choices.append(logits[len(prompt) - 1 : len(tokens) - 1].argmax(-1).tolist())
    return choices


def _matrix(directory, block_size: int, **device) -> list[list[int]]:
    """The mode's promise for 50 prompts: alone (the first few) / all together / chunked /
    preempted / with speculation, every record bitwise equal. Returns the tokens."""
    prompts = _prompts(block_size)
    llm = _engine(directory, block_size, max_num_seqs=64, **device)
    together = _run(llm, prompts)
    assert all(lp is not None and len(lp) == MAX_TOKENS for _, lp, _ in together)
    alone = [_run(llm, [p])[0] for p in prompts[:ALONE]]
    _assert_same(alone, together[:ALONE], "alone vs a batch of 50")

    chunked = _engine(directory, block_size, max_num_seqs=64, max_num_batched_tokens=24, **device)
    _assert_same(_run(chunked, prompts), together, "chunked (24-token budget)")

    scarce = _engine(directory, block_size, max_num_seqs=64, num_cache_blocks=12,
                     max_model_len=12 * block_size, **device)  # fmt: skip
    outputs = _greedy(scarce, prompts, logprobs=2, prompt_logprobs=1)
    _assert_same(_records(outputs), together, "under preemption")
    assert sum(o.metrics.num_preemptions for o in outputs) > 0, "no preemption was forced"

    if block_size == 16:  # V4.1 checkpoints have DSpark stages
        spec = _engine(directory, block_size, max_num_seqs=64, speculative_tokens=2, **device)
        outputs = _greedy(spec, prompts, logprobs=2, prompt_logprobs=1)
        _assert_same(_records(outputs), together, "with speculation")
        assert sum(o.metrics.num_draft_tokens for o in outputs) > 0, "nothing was drafted"
    return [t for t, _, _ in together]


def test_outputs_are_bitwise_identical_however_they_are_batched(checkpoint, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    directory, block_size = checkpoint
    tokens = _matrix(directory, block_size, accelerator="cpu")
    # the plain forward on the prompts also run alone and the six that cross a block boundary
    prompts = _prompts(block_size)
    some = [i for i, p in enumerate(prompts) if i < ALONE or len(p) >= block_size - 2]
    want = [tokens[i] for i in some]
    assert _plain_forward_argmax(directory, [prompts[i] for i in some], want) == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_outputs_are_bitwise_identical_however_they_are_batched_on_the_gpu(checkpoint, monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    directory, block_size = checkpoint
    # four engines stay alive through the matrix: a tenth of the GPU each
    _matrix(directory, block_size, accelerator="nvidia", gpu_memory_utilization=0.1)


def test_logprobs_agree_without_the_batch_invariant_flag(checkpoint, monkeypatch, request):
    if "embedded" in request.node.name:
        # FP8 weights and the model's cache rounding: without the flag a last-bit difference
        # between batch shapes can flip a rounding and move a logprob far past 1e-4 (issue 30
        # measured 1.1e-2); only the flag's bitwise mode promises equality for this model
        pytest.skip("the embedded model is compared bitwise under the flag only")
    monkeypatch.delenv("DEEPINFER_BATCH_INVARIANT", raising=False)
    directory, block_size = checkpoint
    prompts = _prompts(block_size)[:20]
    llm = _engine(directory, block_size, max_num_seqs=64)
    chunked = _engine(directory, block_size, max_num_seqs=64, max_num_batched_tokens=24)
    runs = [
        _greedy(llm, prompts, logprobs=0),
        [_greedy(llm, [p], logprobs=0)[0] for p in prompts],
        _greedy(chunked, prompts, logprobs=0),
    ]
    reference = runs[0]
    for run in runs[1:]:
        for got, want in zip(run, reference):
            got, want = got.outputs[0], want.outputs[0]
            assert got.token_ids == want.token_ids
            for g, w, token in zip(got.logprobs, want.logprobs, want.token_ids):
                assert abs(g[token] - w[token]) < 1e-4
