"""A minimal driver for the model outside the engine: fixed block tables and one state slot
per sequence. For tests, examples and smoke runs; the engine's block manager replaces it."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from deepinfer.engine.model.cache import CacheLayout, ModelCache
from deepinfer.engine.model.metadata import ForwardBatch


class SimpleRunner:
    """Runs steps of ``{sequence id: new token ids}`` against one :class:`ModelCache`.

    Sequence ``s`` owns state slot ``s`` and the arena blocks ``s * per_seq .. + per_seq``.
    Block ids are handed out in reverse so that arena addressing through the tables matters.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_seqs: int,
        max_len: int,
        block_size: int = 128,
        max_draft: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.model, self.device = model, torch.device(device)
        self.blocks_per_seq = math.ceil(max_len / block_size)
        layout = CacheLayout(
            num_blocks=max_seqs * self.blocks_per_seq,
            num_slots=max_seqs,
            block_size=block_size,
            max_draft=max_draft,
        )
        dtype = dtype or next(model.parameters()).dtype
        self.cache = ModelCache(model.config, layout, dtype=dtype, device=device)
        self.lengths: dict[int, int] = {}
        self.max_seqs = max_seqs

    def block_table(self, seq: int) -> list[int]:
        total = self.cache.layout.num_blocks
        return [total - 1 - (seq * self.blocks_per_seq + j) for j in range(self.blocks_per_seq)]

    def batch(self, chunks: Mapping[int, Sequence[int]]) -> ForwardBatch:
        ids, positions, cu, seq_lens, tables, slots = [], [], [0], [], [], []
        for seq, tokens in chunks.items():
            if not 0 <= seq < self.max_seqs:
                raise ValueError(f"sequence id {seq}: expected 0 <= id < {self.max_seqs}")
            start = self.lengths.get(seq, 0)
            ids += list(tokens)
            positions += range(start, start + len(tokens))
            cu.append(len(ids))
            seq_lens.append(start + len(tokens))
            tables.append(self.block_table(seq))
            slots.append(seq)
        as_long = dict(dtype=torch.long, device=self.device)
        return ForwardBatch(
            input_ids=torch.tensor(ids, **as_long),
            positions=torch.tensor(positions, **as_long),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, **as_long),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=self.device),
            state_slots=torch.tensor(slots, **as_long),
        )

    @torch.no_grad()
    def step(self, chunks: Mapping[int, Sequence[int]]) -> dict[int, torch.Tensor]:
        """Feed each sequence its next tokens; returns ``{seq: logits [n, vocab] fp32}``."""
        batch = self.batch(chunks)
        logits = self.model(batch, self.cache)
        out, row = {}, 0
        for seq, tokens in chunks.items():
            out[seq] = logits[row : row + len(tokens)]
            row += len(tokens)
            self.lengths[seq] = self.lengths.get(seq, 0) + len(tokens)
        return out

    def rollback(self, seq: int, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` of ``seq`` (rejected drafts, at most ``max_draft``):
        their cache rows are simply overwritten by the next step."""
        if not 0 <= num_tokens <= self.cache.layout.max_draft:
            raise ValueError(
                f"rollback of {num_tokens} tokens: expected 0..{self.cache.layout.max_draft}"
            )
        self.lengths[seq] -= num_tokens
