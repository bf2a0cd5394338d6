"""Op boundaries on the device timeline, for kernels the profiler cannot tie to a launch.

``torch.profiler`` links a kernel to the host event that launched it through the CUDA runtime's
launch calls; Triton launches through the driver's ``cuLaunchKernelEx``, which the profiler does
not record, so a Triton kernel appears on the device timeline with no owner. While recording,
every outermost op call launches a one-thread marker kernel before and after its work
(:func:`device_marker`); kernels of one stream run in launch order, so the kernels between an op
call's two markers are exactly the ones it launched, whichever API launched them. The recorder
keeps the calls' names in launch order and :func:`marker_groups` pairs them with the markers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

BEGIN = "deepinfer_op_begin"
END = "deepinfer_op_end"
UNOWNED = "kernels without a launch record"

try:
    import triton
    import triton.language as tl

    @triton.jit
    def deepinfer_op_begin(flag):
        tl.store(flag, 1)

    @triton.jit
    def deepinfer_op_end(flag):
        tl.store(flag, 2)

except ImportError:  # no Triton: no CUDA kernels to mark either
    triton = None


def device_marker(device: torch.device | str) -> Callable[[bool], None]:
    """``mark(end)``: queue the begin (``end=False``) or end marker kernel on the current
    stream of ``device``."""
    if triton is None:
        raise RuntimeError("op markers need Triton (they mark CUDA kernels' op boundaries)")
    flag = torch.zeros(1, dtype=torch.int32, device=device)

    def mark(end: bool) -> None:
        (deepinfer_op_end if end else deepinfer_op_begin)[(1,)](flag)

    mark(False)  # compile both now, not inside the profiled step
    mark(True)
    torch.cuda.synchronize(device)
    return mark


def is_marker(name: str) -> bool:
    return BEGIN in name or END in name


def marker_groups(
    kernels: Sequence, calls: Sequence[str]
) -> tuple[dict[str, tuple[float, int]], dict[str, dict[str, float]], float]:
    """Device kernels (events with ``name``, ``time_range.start``/``.end`` in µs, in any order;
    one stream) and the recorded op calls in launch order -> (seconds and kernel count per op,
    kernel milliseconds by name per op, seconds of the kernels outside every marker pair: the
    caller attributes those by their launch records). Raises if the markers and the calls
    disagree, which would make every owner wrong."""
    groups: dict[str, tuple[float, int]] = {}
    by_name: dict[str, dict[str, float]] = {}
    open_op, seen, outside = None, 0, 0.0
    for k in sorted(kernels, key=lambda k: k.time_range.start):
        if BEGIN in k.name:
            if open_op is not None or seen >= len(calls):
                raise ValueError(f"op markers out of step with the {len(calls)} recorded calls")
            open_op, seen = calls[seen], seen + 1
        elif END in k.name:
            if open_op is None:
                raise ValueError("an op's end marker without its begin marker")
            open_op = None
        elif open_op is None:
            outside += (k.time_range.end - k.time_range.start) * 1e-6
        else:
            us = k.time_range.end - k.time_range.start
            seconds, n = groups.get(open_op, (0.0, 0))
            groups[open_op] = (seconds + us * 1e-6, n + 1)
            names = by_name.setdefault(open_op, {})
            names[k.name] = names.get(k.name, 0.0) + us * 1e-3
    if seen != len(calls):
        raise ValueError(f"{seen} op markers on the device for {len(calls)} recorded calls")
    return groups, by_name, outside
