"""Speculative decoding settings of the runner, resolved once at load, and the per-request rule
for how drafts are verified.

Resolution (:func:`resolve_spec_config`): speculation runs when the checkpoint has DSpark draft
stages and ``K`` > 0, where ``K`` is ``EngineConfig.speculative_tokens`` (the argument, else
``DEEPINFER_USE_NEXTN_DECODE``, default 5, settled when the config was built). ``K`` above the
checkpoint's ``dspark_block_size`` (the block the drafter was trained on): an explicit
``speculative_tokens`` is an error, the environment value is capped at the block size with a
warning (so the default 5 works on a checkpoint trained with 3). Asking explicitly for ``K`` > 0 on a checkpoint without DSpark
stages is an error too.

Verification modes per request (:func:`verify_mode`):

- ``greedy`` (temperature 0): drafts accepted while they equal the target's argmax
  (``accept_greedy``); outputs are those of non-speculative greedy decoding.
- ``seed_exact``: a draft is accepted iff it equals the token the target's own sampler draws at
  that position with the request's seed (``accept_seed_exact``); outputs are identical with and
  without speculation. Drafts are drawn with the target's RNG key, which couples the two draws.
- ``rejection``: chain rejection sampling (``accept_rejection``) against the processed draft
  distribution kept at proposal time; the output distribution is the target's, but tokens
  differ from a non-speculative run. Drafts use their own RNG stream (``STREAM_DRAFT``).

``spec_acceptance="auto"`` (default) uses ``seed_exact`` for requests whose seed the user gave
and ``rejection`` for requests whose seed the engine drew; ``"seed_exact"`` / ``"rejection"``
force one mode for every sampled request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.model.config import ModelConfig

logger = logging.getLogger("deepinfer.engine")

GREEDY, SEED_EXACT, REJECTION = "greedy", "seed_exact", "rejection"


@dataclass(frozen=True)
class SpecConfig:
    """num_draft_tokens: ``K`` drafts proposed per request per step; acceptance: ``"auto" |
    "seed_exact" | "rejection"``; varlen: confidence-scheduled verification; cost_curve: its
    ``StepCostCurve`` (None until measured); return_confidences: report draft confidences."""

    num_draft_tokens: int
    acceptance: str = "auto"
    varlen: bool = False
    cost_curve: Any = None
    return_confidences: bool = False


def requested_draft_tokens(config: EngineConfig, block_size: int) -> int:
    """``K`` from the config, checked against the drafter's block: a count the user asked for
    must fit it, one from the environment is capped at it."""
    k = config.speculative_tokens
    if k <= block_size:
        return k
    if not config.cap_speculative_tokens:
        raise ValueError(
            f"speculative_tokens={k}: expected 0..{block_size} (the checkpoint's dspark_block_size)"
        )
    logger.warning(
        "DEEPINFER_USE_NEXTN_DECODE=%d is above the checkpoint's dspark_block_size=%d: "
        "proposing %d drafts per step",
        k,
        block_size,
        block_size,
    )
    return block_size


def resolve_spec_config(
    config: EngineConfig, model_config: ModelConfig, *, has_draft_weights: bool
) -> SpecConfig | None:
    """The runner's speculation settings, or None when it does not speculate."""
    from deepinfer.engine.model.mtp import is_dspark

    usable = is_dspark(model_config) and has_draft_weights
    if not usable:
        if config.speculative_tokens and not config.cap_speculative_tokens:
            raise ValueError(
                f"speculative_tokens={config.speculative_tokens}: the checkpoint has no DSpark "
                "draft stages (mtp.* with dspark_block_size > 0); expected 0 or None"
            )
        return None
    k = requested_draft_tokens(config, model_config.dspark_block_size)
    if k == 0:
        return None
    return SpecConfig(
        num_draft_tokens=k,
        acceptance=config.spec_acceptance,
        varlen=config.spec_varlen,
        cost_curve=config.spec_cost_curve,
        return_confidences=config.return_draft_confidences,
    )


def verify_mode(params: Any, has_user_seed: bool, acceptance: str) -> str:
    """How a request's drafts are drawn and verified (see the module docstring)."""
    if params.is_greedy:
        return GREEDY
    if acceptance == "auto":
        return SEED_EXACT if has_user_seed else REJECTION
    return acceptance
