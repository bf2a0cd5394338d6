"""The V4.1 vision tower and aligner against a transcription of the ``deepseek_v41`` ports'
vision math written here in plain torch (explicit loops where the port uses a library call:
the 2D RoPE table, the ``F.unfold`` feature order), random weights, several image grids."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.engine.model.vision import Aligner, VisionTower, image_span
from deepinfer.engine.model.vision_config import VisionConfig

CONFIG = VisionConfig(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=2)


def _random_(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "norm.weight")):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 16
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))


# --------------------------------------------------------------------- the transcription
def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))


def _rope_table(n_h, n_w, head_dim, theta):
    """cos/sin [N, head_dim/2]: per patch (row, col) the row angles then the column angles."""
    dim = head_dim // 2
    inv_freq = [1.0 / theta ** (j / dim) for j in range(0, dim, 2)]
    table = torch.empty(n_h * n_w, dim, dtype=torch.float64)
    for r in range(n_h):
        for c in range(n_w):
            table[r * n_w + c] = torch.tensor([r * f for f in inv_freq] + [c * f for f in inv_freq])
    return table.cos().float(), table.sin().float()


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _tower(sd, patches, n_h, n_w, c: VisionConfig):
    n, heads, hd = n_h * n_w, c.num_heads, c.head_dim
    x = patches @ sd["patch_embed.proj.weight"].T + sd["patch_embed.proj.bias"]
    cos, sin = _rope_table(n_h, n_w, hd, c.rope_theta)
    for b in range(c.num_layers):
        p = f"blocks.{b}."
        y = _rms(x, sd[p + "norm1.weight"])
        qkv = y @ sd[p + "attn.wqkv.weight"].T + sd[p + "attn.wqkv.bias"]
        q, k, v = (t.reshape(n, heads, hd) for t in qkv.chunk(3, dim=-1))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        scores = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(hd)
        o = torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v).reshape(n, -1)
        x = x + o @ sd[p + "attn.wo.weight"].T + sd[p + "attn.wo.bias"]
        y = _rms(x, sd[p + "norm2.weight"])
        gate, up = (y @ sd[p + "mlp.w1.weight"].T).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.w2.weight"].T
    return _rms(x, sd["norm.weight"])


def _aligner(sd, x, n_h, n_w, r):
    """Zero-padded r x r blocks, each row channel-major then block row then block column."""
    dim = x.shape[-1]
    grid = x.reshape(n_h, n_w, dim)
    gh, gw = -(-n_h // r), -(-n_w // r)
    rows = torch.zeros(gh * gw, dim * r * r)
    for bi in range(gh):
        for bj in range(gw):
            for i in range(r):
                for j in range(r):
                    if bi * r + i < n_h and bj * r + j < n_w:
                        rows[bi * gw + bj, i * r + j :: r * r] = grid[bi * r + i, bj * r + j]
    hidden = torch.nn.functional.gelu(rows @ sd["w1.weight"].T + sd["w1.bias"])
    return hidden @ sd["w2.weight"].T + sd["w2.bias"]


# --------------------------------------------------------------------- tests
@pytest.mark.parametrize("n_h,n_w", [(3, 3), (4, 7), (7, 2), (1, 5), (6, 6)])
def test_tower_and_aligner_match_the_transcription(n_h, n_w):
    tower = VisionTower(CONFIG, torch.float32)
    aligner = Aligner(CONFIG, 24, torch.float32)
    _random_(tower, seed=n_h * 10 + n_w)
    _random_(aligner, seed=n_h * 10 + n_w + 1)
    gen = torch.Generator().manual_seed(n_h + 100 * n_w)
    patches = torch.randn(n_h * n_w, CONFIG.patch_dim, generator=gen)
    features = tower(patches, n_h, n_w)
    want = _tower(dict(tower.state_dict()), patches, n_h, n_w, CONFIG)
    torch.testing.assert_close(features, want, atol=2e-5, rtol=2e-5)
    rows = aligner(features, n_h, n_w)
    want_rows = _aligner(dict(aligner.state_dict()), want, n_h, n_w, 3)
    assert rows.shape == (-(-n_h // 3) * -(-n_w // 3), 24)
    torch.testing.assert_close(rows, want_rows, atol=2e-5, rtol=2e-5)


def test_the_rope_depends_on_the_patch_position():
    """Swapping two patches changes more than their own rows' order (2D RoPE, not a bag)."""
    tower = VisionTower(CONFIG, torch.float32)
    _random_(tower, seed=3)
    patches = torch.randn(12, CONFIG.patch_dim, generator=torch.Generator().manual_seed(4))
    a = tower(patches, 3, 4)
    swapped = patches.clone()
    swapped[[0, 11]] = patches[[11, 0]]
    b = tower(swapped, 3, 4)
    assert not torch.allclose(a[[11, 0]], b[[0, 11]], atol=1e-4)
    assert not torch.allclose(tower(patches, 4, 3), a, atol=1e-4)  # the grid shape matters too


def test_image_span_layout():
    rows = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    start, newline, end = torch.full((4,), -1.0), torch.full((4,), -2.0), torch.full((4,), -3.0)
    span = image_span(rows, 2, 3, start, newline, end)
    assert span.shape == (2 * 4 + 2, 4)
    torch.testing.assert_close(span[0], start)
    torch.testing.assert_close(span[1:4], rows[0:3])
    torch.testing.assert_close(span[4], newline)
    torch.testing.assert_close(span[5:8], rows[3:6])
    torch.testing.assert_close(span[8], newline)
    torch.testing.assert_close(span[9], end)


def test_wrong_patch_count_is_named():
    tower = VisionTower(CONFIG, torch.float32)
    with pytest.raises(ValueError, match=r"expected \(12, 12\) for a 3x4 grid"):
        tower(torch.zeros(11, 12), 3, 4)
