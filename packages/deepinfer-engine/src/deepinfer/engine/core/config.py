"""Frozen configuration of the scheduler (resolved before construction)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("deepinfer.engine")

DEFAULT_COMPRESSION_RATIOS = (1, 2, 4, 128)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits the scheduler enforces each step.

    max_num_seqs: most sequences running at once (n > 1 children count one each).
    max_num_batched_tokens: token budget of one step (prefill chunks + decodes + drafts).
    max_model_len: most tokens (prompt + output) a sequence may reach.
    num_blocks: blocks in the paged arena, block 0 included (reserved).
    block_size: sequence tokens per block; a multiple of every compression ratio (1, 2, 4, 128).
    num_state_slots: state slots, slot 0 included (reserved).
    enable_chunked_prefill: split prompts across steps to fill the token budget.
    num_lookahead_tokens: extra positions reserved per running sequence for draft tokens.
    compression_ratios: the model's KV compression ratios; ``block_size`` must be a multiple
        of each so every block holds whole compressed entries.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    num_blocks: int = 1024
    block_size: int = 128
    num_state_slots: int = 257
    enable_chunked_prefill: bool = True
    num_lookahead_tokens: int = 0
    compression_ratios: tuple[int, ...] = DEFAULT_COMPRESSION_RATIOS

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected a positive integer")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks={self.num_blocks}: expected >= 2 (block 0 is reserved)")
        if self.num_state_slots < 2:
            raise ValueError(
                f"num_state_slots={self.num_state_slots}: expected >= 2 (slot 0 is reserved)"
            )
        if any(self.block_size % r for r in self.compression_ratios):
            raise ValueError(
                f"block_size={self.block_size}: expected a multiple of every compression "
                f"ratio {self.compression_ratios}"
            )
        if self.num_lookahead_tokens < 0:
            raise ValueError(f"num_lookahead_tokens={self.num_lookahead_tokens}: expected >= 0")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_model_len="
                f"{self.max_model_len}: without chunked prefill a whole prompt must fit one step"
            )


def log_capacity(config: SchedulerConfig) -> None:
    """The start-up line: cache capacity in tokens and sequences."""
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens; %d state slots (max %d sequences); "
        "max_model_len %d, %d batched tokens per step",
        config.num_blocks - 1,
        config.block_size,
        (config.num_blocks - 1) * config.block_size,
        config.num_state_slots - 1,
        config.max_num_seqs,
        config.max_model_len,
        config.max_num_batched_tokens,
    )
