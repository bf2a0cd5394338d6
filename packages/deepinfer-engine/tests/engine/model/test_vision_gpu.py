"""The vision tower and aligner on the GPU (bf16, the selected backend's ops: fused attention
on NVIDIA) match the CPU reference in fp32 at the released widths.

Run on a GPU machine: ``python -m pytest
packages/deepinfer-engine/tests/engine/model/test_vision_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.model.vision import Aligner, VisionTower
from deepinfer.engine.model.vision_config import VisionConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

RELEASED = VisionConfig(
    num_layers=2, hidden_size=1024, num_heads=16, intermediate_size=2816, patch_size=14
)


@pytest.mark.parametrize("n_h,n_w", [(39, 39), (24, 60), (93, 93)])
def test_tower_on_the_gpu_matches_the_cpu(n_h, n_w):
    gen = torch.Generator().manual_seed(n_h * n_w)
    cpu_tower, cpu_aligner = (
        VisionTower(RELEASED, torch.float32),
        Aligner(RELEASED, 5120, torch.float32),
    )
    with torch.no_grad():
        for name, p in [*cpu_tower.named_parameters(), *cpu_aligner.named_parameters()]:
            if name.endswith("norm.weight") or name.endswith(("norm1.weight", "norm2.weight")):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 100
                p.copy_(torch.randn(p.shape, generator=gen) / fan_in**0.5)
            p.copy_(p.to(torch.bfloat16).float())  # the values bf16 can hold, on both sides
    gpu_tower = VisionTower(RELEASED, torch.bfloat16, "cuda")
    gpu_aligner = Aligner(RELEASED, 5120, torch.bfloat16, "cuda")
    gpu_tower.load_state_dict(cpu_tower.state_dict())
    gpu_aligner.load_state_dict(cpu_aligner.state_dict())
    patches = torch.randn(n_h * n_w, RELEASED.patch_dim, generator=gen)
    with torch.no_grad():
        want = cpu_aligner(cpu_tower(patches, n_h, n_w), n_h, n_w)
        got = gpu_aligner(gpu_tower(patches.cuda(), n_h, n_w), n_h, n_w).float().cpu()
    error = (got - want).norm() / want.norm()
    assert error < 2e-2, f"relative error {error:.3g}"
