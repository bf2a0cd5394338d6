"""The V4 one-pass mHC pre (see :mod:`.hc_pre`) as a persistent, software-pipelined grid.

Every program owns one column chunk (``pid % num_chunks``) and walks the token tiles
``pid // num_chunks``, ``+ tiles_per_round``, ... In each step it issues the loads of its next
tile, THEN waits for and collapses the tile it holds (whose partners have had a whole step to
arrive), then projects and publishes the new tile. So the wait for a tile's other chunks hides
behind the next tile's loads instead of stalling the multiprocessor.

Progress: the grid is at most the number of programs that fit on the device at once (from the
compiled kernel's registers and shared memory), so every program runs; a program publishes
tile ``r + 1`` before it waits on tile ``r``, so by induction every wait ends. The last program
to arrive at a tile finishes it (``pre`` published with a second counter bump, then ``post``
and ``comb``), as in :mod:`.hc_pre`. Under the Triton interpreter a tile is one chunk (``DC``
covers ``D``): every program is its tiles' last arriver and nothing waits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer.kernels_nvidia.hc_pre import (
    NPAD,
    HcPreTiles,
    _collapse,
    _finish_mix,
    _finish_pre,
    _partial_projection,
    _post_comb,
    _wait_until,
)


@triton.jit
def _load_tile(x_ptr, tile, t_loc, cols, cmask, num_tokens, dim, stride_xt, BT: tl.constexpr):
    tokens = tile * BT + t_loc
    m2 = (tokens < num_tokens)[:, None] & cmask[None, :]
    xp = x_ptr + tokens.to(tl.int64)[:, None] * stride_xt + cols[None, :]
    x0 = tl.load(xp, mask=m2, other=0.0)
    x1 = tl.load(xp + dim, mask=m2, other=0.0)
    x2 = tl.load(xp + 2 * dim, mask=m2, other=0.0)
    x3 = tl.load(xp + 3 * dim, mask=m2, other=0.0)
    return x0, x1, x2, x3


@triton.jit
def _publish(
    x0, x1, x2, x3, tile, chunk, t_loc, cols, cmask, fn_ptr, base_ptr, scale_ptr, pre_ptr,
    post_ptr, comb_ptr, part_ptr, mix_ptr, count_ptr, num_tokens, dim, num_chunks, norm_eps,
    hc_eps, sinkhorn_iters, BT: tl.constexpr, CG: tl.constexpr, CSTRIDE: tl.constexpr,
    X_BF16: tl.constexpr,
):  # fmt: skip
    """Store this chunk's partial mixes, arrive; the last arriver finishes the tile."""
    tokens = tile * BT + t_loc
    tmask = tokens < num_tokens
    part = _partial_projection(x0, x1, x2, x3, fn_ptr, cols, cmask, dim, 4 * dim, X_BF16)
    slot0 = tile * num_chunks
    outs = tl.arange(0, NPAD)
    tl.store(part_ptr + ((slot0 + chunk) * BT + t_loc)[:, None] * NPAD + outs[None, :], part)
    counter = count_ptr + tile * CSTRIDE
    tl.debug_barrier()  # every thread's partial stores precede the release
    old = tl.atomic_add(counter, 1, sem="acq_rel")
    if old == num_chunks - 1:
        g0, rms = _finish_pre(part_ptr, slot0, num_chunks, t_loc, tokens, tmask, base_ptr,
                              scale_ptr, pre_ptr, dim, norm_eps, hc_eps, BT, CG)  # fmt: skip
        tl.debug_barrier()
        tl.atomic_add(counter, 1, sem="release")  # pre is published
        _finish_mix(part_ptr, mix_ptr, slot0, num_chunks, t_loc, tokens, tmask, g0, rms, BT, CG)
        _post_comb(mix_ptr, tokens, tmask, base_ptr, scale_ptr, post_ptr, comb_ptr, hc_eps,
                   sinkhorn_iters)  # fmt: skip


@triton.jit
def _collapse_tile(
    x0, x1, x2, x3, tile, t_loc, cols, cmask, pre_ptr, y_ptr, count_ptr, num_tokens, dim,
    num_chunks, BT: tl.constexpr, CSTRIDE: tl.constexpr, SLEEP_NS: tl.constexpr,
):  # fmt: skip
    """Wait until the tile's ``pre`` is published, then collapse the held columns."""
    counter = count_ptr + tile * CSTRIDE
    _wait_until(counter, num_chunks + 1, tl.load(counter, volatile=True), 1, SLEEP_NS)
    tokens = tile * BT + t_loc
    tmask = tokens < num_tokens
    m2 = tmask[:, None] & cmask[None, :]
    _collapse(x0, x1, x2, x3, pre_ptr, tokens, tmask, y_ptr, dim, cols, m2)


@triton.jit
def _hc_pre_pipelined_kernel(
    x_ptr, fn_ptr, base_ptr, scale_ptr, y_ptr, pre_ptr, post_ptr, comb_ptr,
    part_ptr, mix_ptr, count_ptr,
    num_tokens, num_tiles, dim, num_chunks, stride_xt, norm_eps, hc_eps, sinkhorn_iters,
    BT: tl.constexpr, DC: tl.constexpr, CG: tl.constexpr, X_BF16: tl.constexpr,
    SLEEP_NS: tl.constexpr, CSTRIDE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    chunk = pid % num_chunks
    tiles_per_round = tl.num_programs(0) // num_chunks
    tile = pid // num_chunks
    t_loc = tl.arange(0, BT)
    cols = chunk * DC + tl.arange(0, DC)
    cmask = cols < dim
    x0, x1, x2, x3 = _load_tile(x_ptr, tile, t_loc, cols, cmask, num_tokens, dim, stride_xt, BT)
    _publish(x0, x1, x2, x3, tile, chunk, t_loc, cols, cmask, fn_ptr, base_ptr, scale_ptr,
             pre_ptr, post_ptr, comb_ptr, part_ptr, mix_ptr, count_ptr, num_tokens, dim,
             num_chunks, norm_eps, hc_eps, sinkhorn_iters, BT, CG, CSTRIDE, X_BF16)  # fmt: skip
    for nxt in range(tile + tiles_per_round, num_tiles, tiles_per_round):
        n0, n1, n2, n3 = _load_tile(x_ptr, nxt, t_loc, cols, cmask, num_tokens, dim, stride_xt,
                                    BT)  # fmt: skip
        _collapse_tile(x0, x1, x2, x3, tile, t_loc, cols, cmask, pre_ptr, y_ptr, count_ptr,
                       num_tokens, dim, num_chunks, BT, CSTRIDE, SLEEP_NS)  # fmt: skip
        _publish(n0, n1, n2, n3, nxt, chunk, t_loc, cols, cmask, fn_ptr, base_ptr, scale_ptr,
                 pre_ptr, post_ptr, comb_ptr, part_ptr, mix_ptr, count_ptr, num_tokens, dim,
                 num_chunks, norm_eps, hc_eps, sinkhorn_iters, BT, CG, CSTRIDE,
                 X_BF16)  # fmt: skip
        x0, x1, x2, x3 = n0, n1, n2, n3
        tile = nxt
    _collapse_tile(x0, x1, x2, x3, tile, t_loc, cols, cmask, pre_ptr, y_ptr, count_ptr,
                   num_tokens, dim, num_chunks, BT, CSTRIDE, SLEEP_NS)  # fmt: skip


@functools.cache
def _device_slots(device_index: int) -> tuple[int, int, int]:
    """(multiprocessors, registers, shared memory bytes) per multiprocessor."""
    props = torch.cuda.get_device_properties(device_index)
    smem = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    return props.multi_processor_count, regs, smem


def _resident_programs(kernel, num_warps: int, device: torch.device) -> int:
    """Programs of ``kernel`` that fit on the device at once (registers, shared memory, warps)."""
    sms, regs, smem = _device_slots(device.index or 0)
    per_warp = -(-kernel.n_regs * 32 // 256) * 256
    by_regs = (regs // max(per_warp, 1)) // num_warps
    shared = kernel.metadata.shared
    by_smem = smem // (shared + 1024) if shared else 32
    return sms * max(1, min(by_regs, by_smem, 64 // num_warps, 32))


def launch_pipelined(x, fn, base, scale, kw, tiles: HcPreTiles, sleep_ns=64, max_programs=None):
    """Allocate and launch the pipelined V4 pre; returns ``(y, pre, post, comb, kernel)``."""
    t, nc, d = x.shape
    dev = x.device
    y = torch.empty(t, d, dtype=x.dtype, device=dev)
    pre = torch.empty(t, nc, dtype=torch.float32, device=dev)
    post = torch.empty_like(pre)
    comb = torch.empty(t, nc, nc, dtype=torch.float32, device=dev)
    if t == 0:
        return y, pre, post, comb, None
    bt = tiles.block_tokens
    dc = triton.next_power_of_2(d) if dev.type == "cpu" else tiles.block_cols
    num_chunks = triton.cdiv(d, dc)
    num_tiles = triton.cdiv(t, bt)
    part = torch.empty(num_tiles * num_chunks * bt, NPAD.value, dtype=torch.float32, device=dev)
    mix = torch.empty(num_tiles * bt, NPAD.value, dtype=torch.float32, device=dev)
    cstride = 32
    count = torch.zeros(num_tiles * cstride, dtype=torch.int32, device=dev)
    args = (
        x, fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous(),
        y, pre, post, comb, part, mix, count,
        t, num_tiles, d, num_chunks, x.stride(0), kw["norm_eps"], kw["hc_eps"],
        kw["sinkhorn_iters"],
    )  # fmt: skip
    meta = dict(
        BT=bt, DC=dc, CG=min(8, max(2, triton.next_power_of_2(num_chunks))),
        X_BF16=x.dtype == torch.bfloat16, SLEEP_NS=sleep_ns, CSTRIDE=cstride,
        num_warps=tiles.num_warps,
    )  # fmt: skip
    if dev.type == "cpu":
        slots = 4
    else:
        compiled = _hc_pre_pipelined_kernel.warmup(*args, grid=(1,), **meta)
        compiled._init_handles()
        slots = _resident_programs(compiled, tiles.num_warps, dev)
    if max_programs:
        slots = min(slots, max_programs)
    rounds_width = max(1, min(num_tiles, slots // num_chunks))
    if rounds_width * num_chunks > slots and dev.type != "cpu":
        raise ValueError(f"tiles: {num_chunks} chunks per tile do not fit {slots} programs")
    kernel = _hc_pre_pipelined_kernel[(rounds_width * num_chunks,)](*args, **meta)
    return y, pre, post, comb, kernel
