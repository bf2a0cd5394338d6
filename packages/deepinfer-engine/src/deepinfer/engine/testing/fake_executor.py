"""Test doubles for the engine core: a deterministic fake model executor and a byte tokenizer.

``HashModelExecutor`` honours the executor protocol exactly as a real runner must: it keeps
its own copy of each sequence from the ``SchedulerOutput`` diffs, writes every computed
position's token into a simulated paged arena through the block table and into a simulated
sliding-window ring in the sequence's state slot (``window + num_draft_tokens`` entries, like
the model's SWA rings), performs block and state copies before the "forward", and derives each
next token from what it reads back: the whole context from the arena and the last ``window``
tokens from the ring. A wrong block table, a missed copy, a wrong computed count or a ring
entry overwritten too early changes the output, which :func:`reference_next_token` (computed
from the plain token list) would not.

With ``num_draft_tokens > 0`` it also proposes drafts (the true continuation, with some tokens
deliberately wrong) and verifies scheduled drafts seed-exactly: a draft is accepted iff it is
the token the model itself would produce there, so outputs equal those without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from deepinfer.engine.runner.batch_plan import (
    RunnerSequence,
    RunnerState,
    StepPlan,
    build_step_plan,
)

_M64 = (1 << 64) - 1
EMPTY = -1
POISON = -2  # what a stale ring entry reads as


def _mix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def content_hash(token_ids: list[int]) -> int:
    """Order-sensitive hash of a token list."""
    h = 0x1234
    for position, token_id in enumerate(token_ids):
        h = _mix(h + (token_id + 3) * (position + 7))
    return h


def is_greedy(params: Any) -> bool:
    return float(getattr(params, "temperature", 1.0) or 0.0) == 0.0


def next_token(
    context: list[int], recent: list[int], seed: int, greedy: bool, vocab_size: int
) -> int:
    """The fake model: a hash of the context and of its last tokens (the "window"); when
    sampling, also of the seed and the position."""
    h = _mix(content_hash(context) ^ (content_hash(recent) * 3 & _M64))
    if not greedy:
        h = _mix(h ^ _mix(seed) ^ (len(context) * 0x9E37))
    return h % vocab_size


def reference_next_token(
    context: list[int], seed: int, greedy: bool, vocab_size: int, window: int = 4
) -> int:
    """:func:`next_token` computed from the plain token list."""
    return next_token(context, context[-window:], seed, greedy, vocab_size)


def token_logprob(token_id: int, position: int) -> float:
    """A deterministic fake logprob (negative, varies with token and position)."""
    return -((token_id * 31 + position * 17) % 997) / 100.0 - 0.01


def reference_generate(
    prompt: list[int],
    params: Any,
    seed: int,
    vocab_size: int,
    num_tokens: int,
    window: int = 4,
) -> list[int]:
    """``num_tokens`` tokens of the fake model by a plain loop over the full context."""
    tokens = list(prompt)
    for _ in range(num_tokens):
        tokens.append(reference_next_token(tokens, seed, is_greedy(params), vocab_size, window))
    return tokens[len(prompt) :]


def _is_wrong_draft(seed: int, position: int) -> bool:
    return _mix(seed ^ (position * 0xA0761D64)) % 3 == 0


@dataclass
class HashModelExecutor:
    """A fake executor over a simulated KV arena and state slots (see the module docstring).

    It mirrors sequences with :class:`RunnerState` and lays steps out with
    :func:`build_step_plan`, as a device runner would, so the tests cover those too.
    fail_request_ids: requests for which every step reports an error.
    window: tokens the "sliding window" covers; num_draft_tokens: drafts proposed per step.
    """

    num_blocks: int
    block_size: int
    num_state_slots: int
    vocab_size: int = 256
    fail_request_ids: set[str] = field(default_factory=set)
    window: int = 4
    num_draft_tokens: int = 0

    def __post_init__(self) -> None:
        self.ring_size = self.window + self.num_draft_tokens
        self.arena = [[EMPTY] * self.block_size for _ in range(self.num_blocks)]
        self.states = [self._empty_ring() for _ in range(self.num_state_slots)]
        self.runner_state = RunnerState()
        self.num_steps = 0
        self.num_accepted_drafts = 0
        self.num_rejected_drafts = 0

    def _empty_ring(self) -> list[tuple[int, int]]:
        return [(EMPTY, EMPTY)] * self.ring_size

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.num_steps += 1
        self.runner_state.apply(scheduler_output)
        for src, dst in scheduler_output.block_copies:
            self.arena[dst] = list(self.arena[src])
        for src, dst in scheduler_output.state_copies:
            self.states[dst] = list(self.states[src])
        plan = build_step_plan(self.runner_state, scheduler_output)
        self._forward(plan)
        out = ModelRunnerOutput()
        self._prompt_logprobs(plan, out)
        for b, request_id in enumerate(plan.request_ids):
            if request_id in self.fail_request_ids:
                out.errors[request_id] = f"simulated failure of {request_id}"
                continue
            rows = [s for s, r in enumerate(plan.sample_requests) if r == b]
            if rows:
                is_fork = request_id in scheduler_output.fork_seeds
                self._sample(plan, b, rows, is_fork, out)
        return out

    def _forward(self, plan: StepPlan) -> None:
        """Write every token of the step into the arena (block table) and ring (state slot)."""
        for b in range(len(plan.request_ids)):
            slot = plan.state_slots[b]
            if plan.is_fresh[b]:
                self.states[slot] = self._empty_ring()
            for t in range(plan.cu_seqlens_q[b], plan.cu_seqlens_q[b + 1]):
                position = plan.positions[t]
                block_id = plan.block_tables[b][position // self.block_size]
                assert block_id != 0, "wrote into the reserved null block"
                self.arena[block_id][position % self.block_size] = plan.input_ids[t]
                self.states[slot][position % self.ring_size] = (position, plan.input_ids[t])

    def _sample(self, plan: StepPlan, b: int, rows: list[int], is_fork: bool, out) -> None:
        request_id = plan.request_ids[b]
        seq = self.runner_state.sequences[request_id]
        targets = [
            self._sample_token(seq, plan, b, plan.sample_positions[s], plan.sample_seeds[s])
            for s in rows
        ]
        if is_fork:
            sampled = targets
        else:
            drafts = plan.input_ids[plan.cu_seqlens_q[b + 1] - plan.num_drafts[b] :][
                : plan.num_drafts[b]
            ]
            sampled = self._verify(targets, drafts)
        out.sampled_token_ids[request_id] = sampled
        self.runner_state.last_sampled[request_id] = sampled[0 if is_fork else -1]
        first_position = plan.sample_positions[rows[0]]
        if getattr(seq.sampling_params, "logprobs", None) is not None:
            out.logprobs[request_id] = [
                {t: token_logprob(t, first_position + (0 if is_fork else i))}
                for i, t in enumerate(sampled)
            ]
        if self.num_draft_tokens and not is_fork:
            known = seq.token_ids[:first_position] + sampled
            out.draft_token_ids[request_id] = self._propose(seq, known)

    def _verify(self, targets: list[int], drafts: list[int]) -> list[int]:
        """Accept drafts while each equals the model's own token; end with the model's token."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        self.num_accepted_drafts += accepted
        self.num_rejected_drafts += len(drafts) - accepted
        return targets[: accepted + 1]

    def _propose(self, seq: RunnerSequence, context: list[int]) -> list[int]:
        greedy = is_greedy(seq.sampling_params)
        context = list(context)
        drafts = []
        for _ in range(self.num_draft_tokens):
            token = reference_next_token(context, seq.seed, greedy, self.vocab_size, self.window)
            if _is_wrong_draft(seq.seed, len(context)):
                token = (token + 1) % self.vocab_size
            drafts.append(token)
            context.append(token)
        return drafts

    def _sample_token(self, seq: RunnerSequence, plan, b: int, length: int, seed: int) -> int:
        """The token at position ``length`` from the context read back from arena and ring."""
        table = plan.block_tables[b]
        bs = self.block_size
        context = [self.arena[table[p // bs]][p % bs] for p in range(length)]
        ring = self.states[plan.state_slots[b]]
        recent = []
        for p in range(max(0, length - self.window), length):
            stored_position, token_id = ring[p % self.ring_size]
            recent.append(token_id if stored_position == p else POISON)
        return next_token(context, recent, seed, is_greedy(seq.sampling_params), self.vocab_size)

    def _prompt_logprobs(self, plan: StepPlan, out: ModelRunnerOutput) -> None:
        for s, row in enumerate(plan.prompt_logprob_rows):
            request_id = plan.request_ids[plan.prompt_logprob_requests[s]]
            target = plan.prompt_logprob_targets[s]
            position = plan.positions[row] + 1
            out.prompt_logprobs.setdefault(request_id, []).append(
                {target: token_logprob(target, position)}
            )


@dataclass
class ScriptedExecutor(HashModelExecutor):
    """Every request generates ``script`` (output position ``i`` gives ``script[i]``), then
    ``eos_token_id`` forever; the cache is still simulated and checked."""

    script: list[int] = field(default_factory=list)
    eos_token_id: int = 1

    def _sample_token(self, seq: RunnerSequence, plan, b: int, length: int, seed: int) -> int:
        table = plan.block_tables[b]
        bs = self.block_size
        context = [self.arena[table[p // bs]][p % bs] for p in range(length)]
        assert context == seq.token_ids[:length], "the arena lost tokens"
        k = length - seq.num_prompt_tokens
        return self.script[k] if k < len(self.script) else self.eos_token_id


class ByteTokenizer:
    """Byte-level tokenizer: ids 0-2 are special (BOS, EOS, PAD), id ``3 + b`` is byte ``b``.

    Decoding invalid UTF-8 gives U+FFFD, as byte-level BPE decoders do, so tokens that split
    a character exercise the incremental detokeniser.
    """

    bos_token_id = 0
    eos_token_id = 1
    pad_token_id = 2
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [3 + b for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        parts: list[bytes] = []
        for token_id in ids:
            if token_id < 3:
                if not skip_special_tokens:
                    parts.append(["<bos>", "<eos>", "<pad>"][token_id].encode())
                continue
            parts.append(bytes([token_id - 3]))
        return b"".join(parts).decode("utf-8", errors="replace")


def build_engine_core(
    config: Any,
    *,
    tokenizer: Any = None,
    vocab_size: int = 256,
    fail_request_ids=(),
    num_draft_tokens: int = 0,
    async_scheduling: bool = False,
) -> Any:
    """An ``EngineCore`` over a :class:`HashModelExecutor` sized from ``config``."""
    from deepinfer.engine.core.engine_core import EngineCore
    from deepinfer.engine.core.scheduler import Scheduler

    executor = HashModelExecutor(
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        num_state_slots=config.num_state_slots,
        vocab_size=vocab_size,
        fail_request_ids=set(fail_request_ids),
        num_draft_tokens=num_draft_tokens,
    )
    scheduler = Scheduler(config, tokenizer=tokenizer)
    return EngineCore(scheduler, executor, async_scheduling=async_scheduling)


class LocalRanks:
    """A RankGroup of in-process executors (one per rank) that records which ranks each step
    reached: the data-parallel core's tests run it without processes."""

    def __init__(self, executors: list[Any]) -> None:
        self.executors = executors
        self.world_size = len(executors)
        self.steps: list[list[int]] = []

    def execute(self, outputs: dict[int, Any]) -> dict[int, Any]:
        self.steps.append(sorted(outputs))
        return {rank: self.executors[rank].execute(so) for rank, so in outputs.items()}

    def end_call(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_until_done(core: Any, max_steps: int = 100_000) -> list[Any]:
    """Step ``core`` until no request is unfinished; return every ``SequenceUpdate``."""
    updates = []
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return updates
        updates.extend(core.step())
    raise RuntimeError(f"requests still unfinished after {max_steps} steps")


def fake_loaded_model(
    config: Any,
    tokenizer: Any,
    *,
    num_blocks: int = 256,
    executor: HashModelExecutor | None = None,
    max_position_embeddings: int = 4096,
) -> Any:
    """A ``LoadedModel`` for ``LLM`` tests: a fake executor sized like the engine's cache."""
    from deepinfer.engine.config import LoadedModel

    num_state_slots = config.max_num_seqs + 1
    if executor is None:
        executor = HashModelExecutor(
            num_blocks, config.block_size, num_state_slots, vocab_size=tokenizer.vocab_size
        )
    return LoadedModel(
        executor=executor,
        tokenizer=tokenizer,
        vocab_size=tokenizer.vocab_size,
        eos_token_ids=frozenset({tokenizer.eos_token_id}),
        max_position_embeddings=max_position_embeddings,
        num_blocks=num_blocks,
        num_state_slots=num_state_slots,
    )
