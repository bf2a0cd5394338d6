"""RoPE frequency tables: plain (ratio-0 layers) and YaRN (layers with compression)."""

from __future__ import annotations

import math

import torch

from deepinfer.engine.model.config import ModelConfig, RopeScaling


def plain_inv_freq(rope_dim: int, theta: float) -> torch.Tensor:
    """``f_i = theta^(-2i / rope_dim)``, ``i < rope_dim / 2``; ``[rope_dim / 2]`` fp32."""
    return 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def yarn_inv_freq(rope_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN frequencies without attention scaling (the V4 family uses no mscale)."""

    def correction_dim(num_rotations: float) -> float:
        orig = scaling.original_max_position_embeddings
        return rope_dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    freq = plain_inv_freq(rope_dim, theta)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return freq / scaling.factor * ramp + freq * (1 - ramp)


class RopeTables:
    """The two frequency tables of a model; ``angles`` turns positions into cos / sin."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        rd = config.rope_head_dim
        self.main = plain_inv_freq(rd, config.rope_theta).to(device)
        if config.rope_scaling is None:
            compress = plain_inv_freq(rd, config.compress_rope_theta)
        else:
            compress = yarn_inv_freq(rd, config.compress_rope_theta, config.rope_scaling)
        self.compress = compress.to(device)

    def table(self, compressed: bool) -> torch.Tensor:
        return self.compress if compressed else self.main

    @staticmethod
    def angles(
        inv_freq: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions ``[N]`` int -> (cos, sin) ``[N, rd / 2]`` fp32."""
        freqs = positions.to(inv_freq.device).float()[:, None] * inv_freq[None, :]
        return freqs.cos(), freqs.sin()
