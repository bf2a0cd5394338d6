"""``build_model``: the stack of a config's architecture; ``expected_tensors``: what its
checkpoint must hold."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.engine.model.config import ModelConfig
from deepinfer.engine.model.model_v4 import DeepseekV4Model
from deepinfer.engine.model.model_v41 import DeepseekV41Model
from deepinfer.engine.model.stack import StepOutput
from deepinfer.parallel import ExpertParallelContext

__all__ = ["DeepseekV4Model", "DeepseekV41Model", "StepOutput", "build_model", "expected_tensors"]


def build_model(
    config: ModelConfig,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.bfloat16,
    *,
    include_mtp: bool = False,
    expert_parallel: ExpertParallelContext | None = None,
) -> nn.Module:
    """The model of ``config.architecture`` with uninitialised weights on ``device``.

    ``dtype`` is the dtype of the tensors the checkpoint stores as bf16 (use fp32 for tight
    tests); fp32 tensors, FP8 / FP4 weights and their scales keep their stored dtypes.
    ``include_mtp`` also builds the draft stages ``mtp.*`` (speculative decoding).
    ``expert_parallel``: this rank's EP group; its MoE layers then hold only this rank's
    expert slots (None: every expert, one process).
    """
    stack = DeepseekV41Model if config.is_v41 else DeepseekV4Model
    return stack(
        config,
        dtype=dtype,
        device=device,
        include_mtp=include_mtp,
        expert_parallel=expert_parallel,
    )


def expected_tensors(
    config: ModelConfig, dtype: torch.dtype = torch.bfloat16, *, include_mtp: bool = True
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every checkpoint tensor the model needs: ``name -> (shape, dtype)`` (vision excluded)."""
    model = build_model(config, device="meta", dtype=dtype, include_mtp=include_mtp)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
