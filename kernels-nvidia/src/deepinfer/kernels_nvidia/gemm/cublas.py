"""FP8 block-scaled GEMM through cuBLAS's blockwise-scaled product, for prefill-sized M on Hopper.

For V4's recipe (activations in 1 x 128 groups, weights in 128 x 128 blocks, power-of-two
scales) torch exposes cuBLAS's blockwise FP8 GEMM as ``torch.nn.functional.scaled_mm`` with
``ScalingType.BlockWise1x128`` x ``ScalingType.BlockWise128x128``. It is the same math as
``fp8_gemm_nt`` (each 128-deep FP8 product promoted into fp32 with its two scales) and on the
H200 it ran well above our Triton tiles at prefill M on the V4 shapes (``benchmarks/RESULTS.md``,
FP8 block GEMM). There is no cuBLAS recipe for V4.1's 32-column
blocks on SM90, and batch-invariant mode keeps the Triton tiles (cuBLAS picks its algorithm per
shape).

cuBLAS takes the activation scales M-major (``[M, K/128]`` with unit stride along M) and the
weight scales as fp32 ``[K/128, N/128]`` with unit stride along K. ``linear`` has the
quantisation kernel write the activation scales M-major (other callers' row-major scales are
copied), and each weight's fp32 scales are converted once and kept while the weight's ue8m0
scale tensor lives and is unchanged (:func:`weight_scales`). A shape cuBLAS refuses (an M
alignment, an older library) is remembered and falls back to the Triton tiles: the call never
fails because of this route.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

logger = logging.getLogger(__name__)

MIN_M = 1024  # below this the Triton tiles' launch is as fast (measured at M = 4096 only)
# The narrowest weight measured: with the scales converted once per weight (not per call) this
# route beats the Triton tiles there too.
MIN_N = 512
_REFUSED: set[tuple[int, int, int, int]] = set()
_WEIGHT_SCALES: dict[tuple, tuple] = {}  # (device, data_ptr, shape, stride) -> (ref, version, fp32)
_MAX_WEIGHT_SCALES = 4096  # a bound: entries also go when their tensors die


def weight_scales(b_scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 ``[N/128, K/128]`` (``float8_e8m0fnu`` or its uint8 bits) -> fp32 ``[K/128, N/128]``
    with unit stride along K, converted once per scale tensor object: kept while that object
    lives and its version counter (in-place writes) is unchanged, dropped when it dies. Pass the
    weight's own scale tensor (a new view per call would be converted every call). So a
    weight's scales cost nothing after its first product. Inference tensors keep no version
    counter: an in-place write to one under ``torch.inference_mode`` is not seen (the engine
    loads its scales outside that mode)."""
    key = (b_scale.device, b_scale.data_ptr(), tuple(b_scale.shape), b_scale.stride())
    version = _version(b_scale)
    hit = _WEIGHT_SCALES.get(key)
    if hit is not None and hit[0]() is b_scale and hit[1] == version:
        return hit[2]
    converted = torch.exp2(b_scale.view(torch.uint8).float() - 127.0).t()
    if len(_WEIGHT_SCALES) >= _MAX_WEIGHT_SCALES:
        _WEIGHT_SCALES.clear()
    ref = weakref.ref(b_scale, lambda _, key=key: _WEIGHT_SCALES.pop(key, None))
    _WEIGHT_SCALES[key] = (ref, version, converted)
    return converted


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor
        return None


@functools.cache
def available(device_index: int) -> bool:
    """Whether torch exposes cuBLAS's blockwise FP8 recipe and the device is a Hopper GPU (the
    only one it was measured and tested on)."""
    try:
        from torch.nn.functional import ScalingType, scaled_mm  # noqa: F401
    except ImportError:
        return False
    if not hasattr(ScalingType, "BlockWise1x128"):
        return False
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def recipe_fits(n: int, k: int, a_group: int, block_size: tuple[int, int]) -> bool:
    """Whether a product has V4's scale recipe, whole 128-blocks and at least ``MIN_N`` outputs
    (M and the device apart)."""
    return (
        a_group == 128
        and tuple(block_size) == (128, 128)
        and n % 128 == 0
        and k % 128 == 0
        and n >= MIN_N
    )


def fp8_gemm_cublas(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor | None:
    """``a [M, K]`` e4m3 (fp32 scales ``[M, K/128]``) times ``b [N, K]`` e4m3 (ue8m0 scales
    ``[N/128, K/128]``, the weight's own tensor: :func:`weight_scales`) -> bf16 ``[M, N]``;
    ``None`` where cuBLAS refused this shape."""
    from torch.nn.functional import ScalingType, scaled_mm

    m, k = a.shape
    n = b.shape[0]
    key = (a.device.index or 0, n, k, m % 16)
    if key in _REFUSED:
        return None
    if a_scale.stride() == (1, m):
        sa = a_scale
    else:
        sa = torch.empty_strided(a_scale.shape, (1, m), dtype=torch.float32, device=a.device)
        sa.copy_(a_scale)
    sb = weight_scales(b_scale)
    try:
        return scaled_mm(
            a, b.t(), sa, ScalingType.BlockWise1x128, sb, ScalingType.BlockWise128x128,
            output_dtype=torch.bfloat16,
        )  # fmt: skip
    except (RuntimeError, ValueError, NotImplementedError) as e:
        _REFUSED.add(key)
        logger.info(
            "cuBLAS blockwise FP8 GEMM refused M=%d N=%d K=%d (%s); Triton tiles", m, n, k, e
        )
        return None
