"""DSpark heads of the last draft stage: the low-rank Markov head and the confidence head.

Checkpoint names (``mtp.{last}.``; spec 2.10 for V4-Flash-0731, 7.5 for V4.1):

======================================  ===============================  =================
V4-Flash-0731                           V4.1                             shape
======================================  ===============================  =================
markov_head.markov_w1.weight            markov_head.embed.weight         ``[vocab, rank]``
markov_head.markov_w2.weight            markov_head.head.weight          ``[vocab, rank]``
confidence_head.proj.weight             confidence_head.proj.weight      ``[1, D + rank]``
======================================  ===============================  =================

Draft position ``i`` of a block (``prev_i`` = the token before it: the seed token for ``i = 0``,
else draft ``i - 1``): ``logits_i = base_logits_i + W2 @ W1[prev_i]`` and
``confidence_logit_i = proj . [hidden_i ; W1[prev_i]]`` where ``hidden_i`` is the last stage's
collapsed stream *before* the final norm. ``sigmoid(confidence_logit / T)`` estimates the
probability that draft ``i`` is accepted given drafts ``< i`` were (T = 1 unless calibrated).
"""

from __future__ import annotations

import torch
from torch import nn

import deepinfer.kernels as K

# (embedding name, projection name) per checkpoint family
MARKOV_NAMES = {"v4": ("markov_w1", "markov_w2"), "v41": ("embed", "head")}


def _weight(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class _Weight(nn.Module):
    def __init__(self, shape, dtype, device) -> None:
        super().__init__()
        self.weight = _weight(shape, dtype, device)


class MarkovHead(nn.Module):
    """First-order low-rank correction of the draft logits by the previous token."""

    def __init__(
        self, vocab_size: int, rank: int, family: str, dtype=torch.bfloat16, device=None
    ) -> None:
        super().__init__()
        if family not in MARKOV_NAMES:
            raise ValueError(
                f"MarkovHead family {family!r}: expected one of {sorted(MARKOV_NAMES)}"
            )
        self.embed_name, self.head_name = MARKOV_NAMES[family]
        self.add_module(self.embed_name, _Weight((vocab_size, rank), dtype, device))
        self.add_module(self.head_name, _Weight((vocab_size, rank), dtype, device))

    @property
    def embedding_table(self) -> torch.Tensor:
        return getattr(self, self.embed_name).weight

    @property
    def projection(self) -> torch.Tensor:
        return getattr(self, self.head_name).weight

    def embedding(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """prev_tokens ``[N]`` int64 -> ``[N, rank]`` (stored dtype)."""
        return self.embedding_table[prev_tokens]

    def bias(self, embedding: torch.Tensor) -> torch.Tensor:
        """``[N, rank]`` -> the logit correction ``[N, vocab]`` fp32."""
        return K.linear(embedding, self.projection, out_dtype=torch.float32)

    def forward(self, base_logits: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        """base_logits ``[N, vocab]`` fp32 + correction of ``prev_tokens`` ``[N]``."""
        return base_logits.float() + self.bias(self.embedding(prev_tokens))


class ConfidenceHead(nn.Module):
    """``proj [1, D + rank]``: a scalar acceptance logit per draft position."""

    def __init__(self, hidden_size: int, rank: int, dtype=torch.bfloat16, device=None) -> None:
        super().__init__()
        self.proj = _Weight((1, hidden_size + rank), dtype, device)

    def forward(self, hidden: torch.Tensor, markov_embedding: torch.Tensor) -> torch.Tensor:
        """hidden ``[N, D]`` (pre-norm), markov_embedding ``[N, rank]`` -> logits ``[N]`` fp32."""
        features = torch.cat([hidden.float(), markov_embedding.float()], dim=-1)
        return K.linear(features, self.proj.weight, out_dtype=torch.float32).squeeze(-1)


def confidence_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Acceptance probability ``sigmoid(logit / temperature)`` (fp32)."""
    if temperature <= 0:
        raise ValueError(f"confidence temperature = {temperature}: expected > 0")
    return torch.sigmoid(logits.float() / temperature)
