"""Prefill and decode sweeps through ``LLM.generate`` (our engine) or a transformers model's own
``generate`` loop (the baseline), timed the same way: wall clock around the whole call with a
device synchronisation on each side, after a warm-up, median of ``repeats`` runs.

Decode steps are isolated by difference: the same batch with ``max_tokens=K`` minus
``max_tokens=1`` covers exactly K-1 decode steps (the prefill and the first token cancel).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# generate(prompts [B][L] token ids, max_tokens) -> None
Generate = Callable[[list[list[int]], int], None]


@dataclass(frozen=True)
class SweepSettings:
    prefill_tokens: tuple[int, ...]  # tokens per prefill batch
    prompt_len: int  # prompt length within a prefill batch
    concurrency: tuple[int, ...]  # decode batch sizes
    context_len: int  # prompt length of each decoding sequence
    decode_tokens: int  # K: tokens generated in the long decode run
    repeats: int
    vocab_size: int
    seed: int = 0


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _seconds(generate: Generate, prompts: list[list[int]], max_tokens: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        generate(prompts, max_tokens)
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _prompts(settings: SweepSettings, num: int, length: int, gen: torch.Generator) -> list[list]:
    """Random token ids in [3, vocab): clear of the bos/eos/pad ids."""
    return torch.randint(3, settings.vocab_size, (num, length), generator=gen).tolist()


def prefill_sweep(generate: Generate, settings: SweepSettings) -> list[dict]:
    """One point per batch size in tokens: ``tokens // prompt_len`` prompts, ``max_tokens=1``."""
    gen = torch.Generator().manual_seed(settings.seed)
    generate(_prompts(settings, 1, settings.prompt_len, gen), 2)  # warm-up (JIT, allocator)
    points = []
    for tokens in settings.prefill_tokens:
        num_prompts = max(1, tokens // settings.prompt_len)
        prompts = _prompts(settings, num_prompts, settings.prompt_len, gen)
        seconds = _seconds(generate, prompts, 1, settings.repeats)
        batch_tokens = num_prompts * settings.prompt_len
        points.append({"tokens": batch_tokens, "prompts": num_prompts, "step_ms": seconds * 1e3,
                       "tok/s/gpu": batch_tokens / seconds})  # fmt: skip
    return points


def decode_sweep(generate: Generate, settings: SweepSettings) -> list[dict]:
    """One point per concurrency: output tokens/s/GPU, tokens/s/user and the decode step time."""
    gen = torch.Generator().manual_seed(settings.seed + 1)
    steps = settings.decode_tokens - 1
    points = []
    for batch in settings.concurrency:
        prompts = _prompts(settings, batch, settings.context_len, gen)
        generate(prompts, 2)  # warm-up at this batch size
        base = _seconds(generate, prompts, 1, settings.repeats)
        full = _seconds(generate, prompts, settings.decode_tokens, settings.repeats)
        # Guard against timer noise on tiny models making the difference non-positive.
        step_s = max(full - base, 1e-9) / steps
        points.append({"batch": batch, "context": settings.context_len, "step_ms": step_s * 1e3,
                       "tok/s/user": 1 / step_s, "tok/s/gpu": batch / step_s})  # fmt: skip
    return points


def engine_generate(llm) -> Generate:
    """Our engine: greedy, ``ignore_eos`` so every request runs exactly ``max_tokens``."""
    from deepinfer.sampling import SamplingParams

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        produced = {len(o.outputs[0].token_ids) for o in outputs}
        if produced != {max_tokens}:
            raise RuntimeError(f"engine produced {produced} tokens, expected {max_tokens}")

    return generate
