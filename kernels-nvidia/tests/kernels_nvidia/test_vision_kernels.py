"""The vision tower's attention on NVIDIA GPUs: the reference's result, through a fused SDPA
kernel (a shape the fused kernels refuse would fall back to the N x N math path)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.reference.vision import vision_attention as reference
from deepinfer.kernels_nvidia.vision import vision_attention

HAS_CUDA = torch.cuda.is_available()


def test_matches_the_reference_on_random_patches():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(203, 4, 64, generator=gen) for _ in range(3))
    torch.testing.assert_close(vision_attention(q, k, v), reference(q, k, v), atol=2e-6, rtol=0)


def test_rejects_mismatched_shapes():
    q = torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match=r"q, k, v must be \[N, H, d\]"):
        vision_attention(q, q, q[:4])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU")
def test_runs_a_fused_kernel_at_the_released_shape():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2025, 16, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))  # fmt: skip
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        got = vision_attention(q, k, v)  # raises if no fused kernel takes these inputs
    torch.testing.assert_close(got.float(), reference(q, k, v).float(), atol=2e-2, rtol=2e-2)
