"""The sampling pipeline: ``sample(logits, params, positions)``.

Steps, in order, each a pure batched step on the logits' device (host preparation first):

1. **penalties** - repetition, frequency, presence over ``output_token_ids``; then token bans
   (EOS before ``min_tokens`` / ``first_n_token_no_eos``, stop tokens before ``min_tokens``).
2. **logit bias** - ``SamplingParams.logit_bias`` added.
3. **grammar mask** - ``bitmask`` (xgrammar layout) applied: disallowed tokens get ``-inf``.
4. **temperature** - ``s = logits * (1 / T)``; rows with ``T = 0`` are greedy.
5. **top-k / top-p / min-p** - one cutoff per row (``top_k_top_p_min_p_cutoff``): kept
   tokens are ``s >= cutoff`` (ties at the cut are kept).
6. **draw** - Gumbel-max (``gumbel_sample``): ``argmax(s + g)`` over kept tokens with
   ``g = -log(-log(u))`` and ``u`` the counter hash of (seed, absolute position, stream,
   token id). Greedy rows take ``argmax`` of the step-3 logits. Steps 5 and 6 run as the one
   op ``top_k_top_p_min_p_sample`` (a backend may draw from the cutoff's candidates).
7. **logprobs** - see :class:`SampleResult`.

Determinism and tie-breaking: every random number is a pure function of (request seed,
absolute position, stream, token id), so a row draws the same token whatever the batch size,
its index in the batch, or the device, given the same processed logits. Argmax ties (greedy
and Gumbel) go to the lowest token id. The hash bits are device independent; the float32
``log`` in the noise may differ by an ulp across devices, which can flip a draw only when the
two best perturbed scores are within an ulp (about one draw in 10^6-10^7). Top-p masses are
exact integer sums (see the op's contract), so the cutoff is the same on CPU and GPU, at the
top-p boundary too. Rows whose ``seq_seed`` is unset get a fresh random seed per call: resolve seeds at
admission (``resolve_seeds``) for reproducible streams.

A greedy fast path (every row greedy, no processing, no logprobs) is one ``argmax``.

Host cost: the rows' parameters are packed into one buffer and copied once (``rows``); on CUDA,
steps 4-6 of a call without processing or logprobs run as a captured CUDA graph once the same
logits address and batch shape come back (``graphs``; bit-identical to the eager launches;
``DEEPINFER_ENFORCE_EAGER=1`` turns it off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer import kernels
from deepinfer.sampling import graphs, rng
from deepinfer.sampling.params import (
    ROW_GREEDY,
    ROW_LOGPROBS,
    ROW_PLAIN_GREEDY,
    ROW_PROCESSED,
    ROW_UNSEEDED,
    SamplingParams,
)
from deepinfer.sampling.processors import (
    apply_bans_and_bias,
    apply_penalties,
    needs_processing,
    prepare_processors,
)
from deepinfer.sampling.rows import RowTensors, batch_flags, pack_rows, row_records


@dataclass(frozen=True)
class SampleResult:
    """What :func:`sample` returns for a batch of ``B`` rows.

    token_ids: ``[B]`` int64 sampled tokens.
    The logprob fields are ``None`` unless some row's ``logprobs`` is set. Then, with
    ``K = max(logprobs)`` over the rows:
    logprobs / top_logprobs / top_token_ids (``[B]``, ``[B, K]``, ``[B, K]``): the
      **processed** distribution the token was drawn from: log-softmax of the logits after
      penalties, bias, grammar mask, temperature and top-k/top-p/min-p (removed tokens are
      ``-inf``). For greedy rows: after penalties, bias and mask, at temperature 1, untruncated.
    raw_logprobs / raw_top_logprobs / raw_top_token_ids: the **raw** distribution, log-softmax
      of the ``logits`` exactly as passed to :func:`sample`.
    Top-k alternatives are sorted by descending logprob (ties: lowest token id first is not
    guaranteed; they are torch.topk's order).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    raw_logprobs: torch.Tensor | None = None
    raw_top_logprobs: torch.Tensor | None = None
    raw_top_token_ids: torch.Tensor | None = None


def _validate(logits, params, positions, output_token_ids, bitmask) -> None:
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be [B, V], got shape {tuple(logits.shape)}")
    rows = logits.shape[0]
    if len(params) != rows:
        raise ValueError(f"sample: {len(params)} SamplingParams for {rows} logits rows")
    if len(positions) != rows:
        raise ValueError(f"sample: {len(positions)} positions for {rows} logits rows")
    if output_token_ids is not None and len(output_token_ids) != rows:
        raise ValueError(f"sample: {len(output_token_ids)} output_token_ids for {rows} rows")
    if bitmask is not None:
        words = (logits.shape[1] + 31) // 32
        if bitmask.dim() != 2 or bitmask.shape[0] != rows or bitmask.shape[1] < words:
            raise ValueError(
                f"sample: bitmask must be int32 [{rows}, >= {words}], got "
                f"{bitmask.dtype} {tuple(bitmask.shape)}"
            )


def _process(logits, params, output_token_ids, bitmask) -> torch.Tensor:
    """Steps 1-3 on a float32 copy (the caller's logits are never modified)."""
    inputs = prepare_processors(params, output_token_ids, logits.shape[1], logits.device)
    if not needs_processing(inputs) and bitmask is None:
        return logits.float()
    work = logits.to(torch.float32, copy=True)
    apply_penalties(work, inputs)
    apply_bans_and_bias(work, inputs)
    if bitmask is not None:
        kernels.apply_token_bitmask(work, bitmask.to(work.device, non_blocking=True), out=work)
    return work


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int] | torch.Tensor,
    *,
    output_token_ids: Sequence[Sequence[int]] | None = None,
    bitmask: torch.Tensor | None = None,
    stream: int = rng.STREAM_SAMPLE,
) -> SampleResult:
    """Sample one token per row through the pipeline in this module's docstring.

    logits: ``[B, V]`` float32/bf16/fp16 on any device (not modified).
    params: ``B`` :class:`SamplingParams`. positions: ``[B]`` absolute position each row's new
    token will take (the RNG counter). output_token_ids: per row, the tokens the penalties and
    ``min_tokens`` count (normally the generated tokens). bitmask: ``[B, ceil(V/32)]`` int32
    grammar mask (all ones = unconstrained row), host or device. stream: the RNG stream id
    (``rng.STREAM_SAMPLE``; drafting passes ``rng.STREAM_DRAFT``).
    """
    _validate(logits, params, positions, output_token_ids, bitmask)
    records = row_records(params)
    any_flags, all_flags = batch_flags(params, records)
    if bitmask is None and all_flags & ROW_PLAIN_GREEDY:
        return SampleResult(token_ids=torch.argmax(logits, dim=-1))  # greedy fast path
    want_logprobs = bool(any_flags & ROW_LOGPROBS)
    if any_flags & ROW_PROCESSED or bitmask is not None:
        processed = _process(logits, params, output_token_ids, bitmask)
    else:  # the ops read bf16/fp16 as float32 themselves: no copy
        processed = logits.float() if want_logprobs else logits
    if all_flags & ROW_GREEDY and not want_logprobs:
        return SampleResult(token_ids=torch.argmax(processed, dim=-1))
    some_greedy = bool(any_flags & ROW_GREEDY)
    unseeded = bool(any_flags & ROW_UNSEEDED)
    if not want_logprobs and processed is logits and graphs.graphs_enabled(logits):
        rows = pack_rows(
            params, positions, logits.device, unseeded, static_positions=True, records=records
        )
        key = graphs.graph_key(logits, rows.buffer, stream, some_greedy)
        token_ids = graphs.run_graphed(
            key, lambda: _draw(logits, rows, stream, some_greedy)[0], logits.device, (rows,)
        )
        return SampleResult(token_ids=token_ids)
    rows = pack_rows(params, positions, logits.device, unseeded, records=records)
    drawn, cutoff = _draw(processed, rows, stream, some_greedy)
    if not want_logprobs:
        return SampleResult(token_ids=drawn)
    num_top = max(p.logprobs or 0 for p in params)
    greedy = rows.greedy_flags.bool()
    return _with_logprobs(logits, processed, rows.temperature, greedy, cutoff, drawn, num_top)


def _draw(processed, rows: RowTensors, stream: int, some_greedy: bool):
    """Steps 4-6 on the device: (token ids ``[B]`` int64, cutoffs ``[B]`` float32)."""
    drawn, cutoff = kernels.top_k_top_p_min_p_sample(
        processed, rows.temperature, rows.top_k, rows.top_p, rows.min_p, rows.seeds,
        rows.positions, stream,
    )  # fmt: skip
    if some_greedy:
        drawn = torch.where(rows.greedy_flags.bool(), torch.argmax(processed, dim=-1), drawn)
    return drawn, cutoff


def _logprob_fields(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int):
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    top_values, top_ids = torch.topk(logprobs, num_top, dim=-1)
    return chosen, top_values, top_ids


def _with_logprobs(
    logits, processed, temperature, greedy, cutoff, token_ids, num_top
) -> SampleResult:
    scaled = processed * (1.0 / temperature)[:, None]
    truncated = scaled.masked_fill(scaled < cutoff[:, None], float("-inf"))
    final = torch.where(greedy[:, None], processed, truncated)
    processed_lp = torch.log_softmax(final, dim=-1)
    raw_lp = torch.log_softmax(logits.float(), dim=-1)
    lp, top_lp, top_ids = _logprob_fields(processed_lp, token_ids, num_top)
    raw, raw_top_lp, raw_top_ids = _logprob_fields(raw_lp, token_ids, num_top)
    return SampleResult(
        token_ids=token_ids,
        logprobs=lp,
        top_logprobs=top_lp,
        top_token_ids=top_ids,
        raw_logprobs=raw,
        raw_top_logprobs=raw_top_lp,
        raw_top_token_ids=raw_top_ids,
    )


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw logprobs of prompt tokens: for row ``i`` of ``logits`` ``[N, V]`` (the logits at
    prompt position ``i``), the log-softmax value of ``next_token_ids[i]`` (``[N]`` int64) and
    the ``num_top`` best alternatives. Returns ``([N], [N, num_top], [N, num_top])``; compute it
    in chunks of rows for long prompts."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return _logprob_fields(logprobs, next_token_ids.to(logits.device), num_top)


__all__ = ["SampleResult", "prompt_logprobs", "sample"]
