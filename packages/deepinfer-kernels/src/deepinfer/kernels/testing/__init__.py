"""The conformance kit: checks any backend's op implementations against the reference.

A :class:`Case` makes fresh random inputs for one op (never zeros), names the outputs that can be
passed as ``out=`` buffers and the tolerance its dtype allows. :func:`check_case` runs an
implementation three ways — allocating its own outputs, writing into NaN-poisoned buffers, and on
non-contiguous views of the inputs where the case has them — and compares each result with the
reference twin run on the same inputs; for an op with an in-place form (``out=x``) it also
checks that form bitwise against the allocating call, on contiguous and non-contiguous inputs. Cases live in ``deepinfer.kernels.testing.cases``, one
module per op family, at two scales: ``small`` (CPU, Triton interpreter) and ``real`` (model
sizes, on the device).

Use from a backend's tests::

    from deepinfer.kernels.testing import cases_for, check_case

    @pytest.mark.parametrize("case", cases_for(backend.ops, "small"), ids=str)
    def test_conformance(case):
        check_case(backend.ops[case.op], case, device="cpu")
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.kernels.registry import OPS

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
Comparison = Callable[[Any, Any, tuple[Any, ...], dict[str, Any], "Case", str], None]


@dataclass(frozen=True)
class Case:
    """One conformance case.

    make_inputs(generator, device) -> (args, kwargs): fresh random inputs.
    out_names: keyword outputs the op accepts (``out``, ``residual_out``); the kit poisons them.
    make_strided(args) -> args: the same values as non-contiguous views, or None.
    compare(got, want, args, kwargs, case, how): replaces the elementwise comparison for ops
    that select (``deepinfer.kernels.testing.selection``), where near-tied choices may differ.
    writes: positions of the arguments the op writes into (a cache); the reference runs on
    copies of them, so what is compared is what the implementation wrote.
    in_place: position of the argument ``out=`` may be (the op's in-place form), or None.
    """

    op: str
    name: str
    scale: str
    make_inputs: Callable[[torch.Generator, torch.device], Inputs]
    out_names: tuple[str, ...] = ()
    make_strided: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None = None
    atol: float = 1e-5
    rtol: float = 1e-5
    tags: frozenset[str] = field(default_factory=frozenset)
    compare: Comparison | None = None
    writes: tuple[int, ...] = ()
    in_place: int | None = None

    def __str__(self) -> str:
        return f"{self.op}-{self.name}"


CASES: list[Case] = []


def register(*cases: Case) -> None:
    for case in cases:
        if case.op not in OPS:
            raise KeyError(f"conformance case for unknown op {case.op!r}")
        CASES.append(case)


def with_kwargs(make: Callable, **extra: Any) -> Callable:
    """A case's ``make(gen, device) -> (args, kwargs)`` with ``extra`` added to its kwargs
    (the same inputs, another form of the call: ``out_dtype=torch.bfloat16``, say)."""

    def made(gen, device):
        args, kwargs = make(gen, device)
        return args, {**kwargs, **extra}

    return made


def _load_cases() -> None:
    from deepinfer.kernels.testing import cases

    for info in sorted(pkgutil.iter_modules(cases.__path__), key=lambda m: m.name):
        importlib.import_module(f"{cases.__name__}.{info.name}")


def cases_for(ops: Iterable[str], scale: str) -> list[Case]:
    """The registered cases of scale ``small`` or ``real`` for the ops named."""
    wanted = set(ops)
    return [c for c in CASES if c.op in wanted and c.scale == scale]


def tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) one rounding of ``dtype`` explains for values of magnitude ~1."""
    return {
        torch.float32: (1e-5, 1e-5),
        torch.float16: (2e-3, 2e-3),
        torch.bfloat16: (1.6e-2, 1.6e-2),
    }[dtype]


def _as_tuple(result: Any) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def _poisoned_like(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, -12345)


def _compare(got: Any, want: Any, case: Case, how: str, inputs: Inputs) -> None:
    if case.compare is not None:
        case.compare(got, want, *inputs, case, how)
        return
    got_t, want_t = _as_tuple(got), _as_tuple(want)
    assert len(got_t) == len(want_t), f"{case} ({how}): {len(got_t)} outputs, want {len(want_t)}"
    for i, (g, w) in enumerate(zip(got_t, want_t)):
        assert g.shape == w.shape, (
            f"{case} ({how}) output {i}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        )
        assert g.dtype == w.dtype, f"{case} ({how}) output {i}: dtype {g.dtype} != {w.dtype}"
        torch.testing.assert_close(
            g.cpu(),
            w.cpu(),
            atol=case.atol,
            rtol=case.rtol,
            equal_nan=False,
            msg=lambda m, i=i: f"{case} ({how}) output {i}: {m}",
        )


def check_case(
    impl: Callable[..., Any], case: Case, device: str | torch.device, seed: int | None = None
) -> None:
    """Run ``impl`` on ``case`` three ways and compare each with the reference twin."""
    device = torch.device(device)
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed if seed is not None else torch.seed() % (2**63))
    args, kwargs = case.make_inputs(gen, device)
    reference = OPS[case.op].reference
    ref_args = tuple(a.clone() if i in case.writes else a for i, a in enumerate(args))
    want = reference(*ref_args, **kwargs)
    want_t = _as_tuple(want)

    inputs = (args, kwargs)
    allocated = impl(*args, **kwargs)
    _compare(allocated, want, case, "allocating", inputs)
    if case.in_place is not None:
        _check_in_place(impl, case, args, kwargs, allocated, "")

    if case.out_names:
        outs = {n: _poisoned_like(w) for n, w in zip(case.out_names, want_t)}
        got = impl(*args, **kwargs, **outs)
        for n, w in zip(case.out_names, want_t):
            _compare(outs[n], w, case, f"into poisoned {n}=", inputs)
        _compare(got, want, case, "returned with out=", inputs)

    if case.make_strided is not None:
        strided = case.make_strided(args)
        assert any(isinstance(a, torch.Tensor) and not a.is_contiguous() for a in strided), (
            f"{case}: make_strided produced no non-contiguous input"
        )
        _compare(impl(*strided, **kwargs), want, case, "non-contiguous inputs", inputs)
        if case.in_place is not None:
            _check_in_place(impl, case, strided, kwargs, allocated, " on non-contiguous inputs")


def _check_in_place(impl, case: Case, args, kwargs, allocated: torch.Tensor, how: str) -> None:
    """``impl(..., x, ..., out=x)`` on a copy of ``x`` (kept in its layout) returns that copy,
    holding bitwise the allocating call's result."""
    i = case.in_place
    target = torch.empty_strided(
        args[i].shape, args[i].stride(), dtype=args[i].dtype, device=args[i].device
    )
    target.copy_(args[i])
    got = impl(*args[:i], target, *args[i + 1 :], **kwargs, out=target)
    assert got is target, f"{case} (in place{how}): did not return out"
    assert torch.equal(target, allocated), f"{case} (in place{how}): differs from allocating"


def patch_triton_interpreter() -> None:
    """Make ``TRITON_INTERPRET=1`` compute bf16 and fp32 ``tl.dot`` as a GPU does.

    The interpreter multiplies bf16 bit patterns as integers (triton#11584): bf16 operands are
    upcast to fp32 first. A bf16 or fp32 tile product is then summed in float64 and rounded
    once: numpy's BLAS picks its micro-kernel, and with it the summation order, by a row's
    place in the tile, so a row's result would depend on which rows share its tile (a GPU's
    tile order does not). Call before kernel modules are imported.
    """
    import numpy as np
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    if getattr(builder, "_deepinfer_bf16_dot", False):
        return
    original = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        import triton.language as tl

        wide = (tl.bfloat16, tl.float32)
        if a.dtype.scalar in wide and b.dtype.scalar in wide:

            def up(h):
                if h.dtype.scalar != tl.bfloat16:
                    return h.data.astype(np.float64)
                bits = h.data.view(np.uint16).astype(np.uint32) << 16
                return bits.view(np.float32).astype(np.float64)

            res = np.matmul(up(a), up(b)).astype(d.data.dtype) + d.data
            return interp.TensorHandle(res, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot
    builder._deepinfer_bf16_dot = True


_load_cases()

__all__ = [
    "CASES",
    "Case",
    "cases_for",
    "check_case",
    "patch_triton_interpreter",
    "register",
    "tolerance",
]
