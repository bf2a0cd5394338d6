"""Prefill and decode sweeps through our engine or a transformers model's own ``generate`` loop
(the baseline), measured the same way for both.

- Prefill: a ``max_tokens=1`` call timed by :func:`benchmarks.timing.time_call`, as
  ``bench_engine`` times its rows: one untimed call with the same prompts first (so no point
  pays for compiling kernels for its shape), then the median of ``repeats`` calls.
- Decode: the time between consecutive tokens of one sequence, counted only over the steps in
  which every sequence of the batch was decoding (after the last prompt's first token, up to the
  first sequence's last token), median over those steps and the repeats. So neither prefill nor
  a ragged tail pollutes the step time, whatever the engine's prefill chunking.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.timing import time_call

# generate(prompts [B][L] token ids, max_tokens) -> per sequence, the perf_counter time at
# which each of its generated tokens arrived (max_tokens times each).
Generate = Callable[[list[list[int]], int], list[list[float]]]


def full_batch_step_seconds(token_times: list[list[float]]) -> list[float]:
    """Intervals between the tokens of the last-started sequence during which every sequence of
    the batch was still decoding; empty if there was no such step."""
    last_start = max(times[0] for times in token_times)
    first_end = min(times[-1] for times in token_times)
    latest = max(token_times, key=lambda times: times[0])
    return [b - a for a, b in zip(latest, latest[1:]) if a >= last_start and b <= first_end]


@dataclass(frozen=True)
class SweepSettings:
    prefill_tokens: tuple[int, ...]  # tokens per prefill batch
    prompt_len: int  # prompt length within a prefill batch
    concurrency: tuple[int, ...]  # decode batch sizes
    context_len: int  # prompt length of each decoding sequence
    decode_tokens: int  # K: tokens generated in the long decode run
    repeats: int
    vocab_size: int
    max_point_s: float = float("inf")  # stop a sweep after a point that took longer than this
    seed: int = 0


def _prompts(settings: SweepSettings, num: int, length: int, gen: torch.Generator) -> list[list]:
    """Random token ids in [3, vocab): clear of the bos/eos/pad ids."""
    return torch.randint(3, settings.vocab_size, (num, length), generator=gen).tolist()


def _over_budget(points: list[dict], settings: SweepSettings, phase: str) -> bool:
    """True (and says so) once the previous point took longer than ``max_point_s``: larger
    points would take longer still, so the sweep stops there and its JSON shows where."""
    if points and points[-1]["point_s"] > settings.max_point_s:
        print(f"{phase} sweep stopped: the last point took {points[-1]['point_s']:.0f} s "
              f"(--max-point-s {settings.max_point_s:.0f})")  # fmt: skip
        return True
    return False


def prefill_sweep(generate: Generate, settings: SweepSettings) -> list[dict]:
    """One point per batch size in tokens: ``tokens // prompt_len`` prompts, ``max_tokens=1``."""
    gen = torch.Generator().manual_seed(settings.seed)
    points = []
    for tokens in settings.prefill_tokens:
        if _over_budget(points, settings, "prefill"):
            break
        started = time.perf_counter()
        num_prompts = max(1, tokens // settings.prompt_len)
        prompts = _prompts(settings, num_prompts, settings.prompt_len, gen)
        timing = time_call(lambda p=prompts: generate(p, 1), warmup=1, repeats=settings.repeats)
        seconds, device = timing.median_s, timing.record()["device_s"]
        batch_tokens = num_prompts * settings.prompt_len
        points.append({"tokens": batch_tokens, "prompts": num_prompts, "step_ms": seconds * 1e3,
                       "tok/s/gpu": batch_tokens / seconds,
                       "samples_ms": [s * 1e3 for s in timing.samples_s],
                       "device_ms": None if device is None else device * 1e3,
                       "point_s": time.perf_counter() - started})  # fmt: skip
    return points


def decode_sweep(generate: Generate, settings: SweepSettings) -> list[dict]:
    """One point per concurrency: output tokens/s/GPU, tokens/s/user and the decode step time."""
    gen = torch.Generator().manual_seed(settings.seed + 1)
    points = []
    for batch in settings.concurrency:
        if _over_budget(points, settings, "decode"):
            break
        started = time.perf_counter()
        generate(_prompts(settings, batch, 16, gen), 3)  # warm-up at this batch size, cheap
        prompts = _prompts(settings, batch, settings.context_len, gen)
        steps: list[float] = []
        for _ in range(settings.repeats):
            steps += full_batch_step_seconds(generate(prompts, settings.decode_tokens))
        if not steps:
            raise RuntimeError(
                f"decode sweep at batch {batch}: no step ran the whole batch; raise "
                f"--decode-tokens (got {settings.decode_tokens}) or the prefill token budget"
            )
        step_s = statistics.median(steps)
        points.append({"batch": batch, "context": settings.context_len, "step_ms": step_s * 1e3,
                       "tok/s/user": 1 / step_s, "tok/s/gpu": batch / step_s,
                       "point_s": time.perf_counter() - started})  # fmt: skip
    return points


def engine_generate(llm) -> Generate:
    """Our engine through ``LLM.stream``: greedy, ``ignore_eos`` so every request runs exactly
    ``max_tokens``; a token's time is when its step's output reached the host."""
    from deepinfer.sampling import SamplingParams

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        token_times: dict[str, list[float]] = {}
        for delta in llm.stream(prompt_token_ids=prompts, sampling_params=params):
            now = time.perf_counter()
            new_tokens = sum(len(sample.token_ids) for sample in delta.outputs)
            token_times.setdefault(delta.request_id, []).extend([now] * new_tokens)
        produced = {len(times) for times in token_times.values()}
        if len(token_times) != len(prompts) or produced != {max_tokens}:
            raise RuntimeError(f"engine produced {produced} tokens, expected {max_tokens}")
        return list(token_times.values())

    return generate
