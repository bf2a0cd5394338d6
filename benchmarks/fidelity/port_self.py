"""The port against itself: the rounding sites of one port run, the metrics that compare two
runs, and the runs that change nothing but the last bit of an fp32 value.

``port_perturbed`` (and ``_attn``) is the ceiling for any implementation that is not bit-identical to the port:
the port's own logits after one fp32 ulp of difference in its first hidden states (the
embedding output), the size of difference a reordered sum leaves. Two sizes:

- ``everywhere``: every element moved by one ulp, up or down at random (seeded). A reordered
  reduction leaves last-bit differences of either sign across its output; a uniform nudge of
  one sign would be mostly undone by the RMS norms that follow.
- ``attn``: every element of layer 0's attention output moved the same way: the first value
  where our model and the port differ (their attention sums in another order); here the
  port's own rounding sites of layer 0 see no difference, as with ours.
- ``one``: one element (the first token's first channel) moved one ulp up: the smallest change
  an fp32 forward can have.

``port_threads1`` runs the port on one CPU thread against the default count, to show whether
the thread count alone moves anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

SITES = ("kv", "index_k", "index_q", "entries")
PERTURBED = ("port_perturbed", "port_perturbed_attn", "port_perturbed_one", "port_threads1")


class PortSites:
    """Records (and names) every call of the port's two rounding functions while installed."""

    def __init__(self, modeling) -> None:
        self.modeling, self.layer, self.calls = modeling, -1, {}
        self.fp8, self.fp4 = modeling._fake_quant_fp8_block, modeling._fake_quant_fp4_block

    def __enter__(self) -> PortSites:
        self.modeling._fake_quant_fp8_block = self._kv
        self.modeling._fake_quant_fp4_block = self._fp4
        return self

    def __exit__(self, *exc) -> None:
        self.modeling._fake_quant_fp8_block = self.fp8
        self.modeling._fake_quant_fp4_block = self.fp4

    def _record(self, site: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        self.calls[(self.layer, site)] = (x.reshape(-1, d).clone(), y.reshape(-1, d).clone())
        return y

    def _kv(self, x, block_size=32):
        return self._record("kv", x, self.fp8(x, block_size))

    def _fp4(self, x, block_size, e4m3_scales=False):
        site = "entries" if e4m3_scales else ("index_k" if x.dim() == 3 else "index_q")
        return self._record(site, x, self.fp4(x, block_size, e4m3_scales))

    def hook(self, model) -> list:
        return [
            layer.register_forward_pre_hook(lambda _m, _a, i=i: setattr(self, "layer", i))
            for i, layer in enumerate(model.model.layers)
        ]


def one_ulp_everywhere(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Every element one ulp up or down, the direction drawn per element."""
    gen = torch.Generator().manual_seed(seed)
    up = torch.randint(0, 2, x.shape, generator=gen).bool()
    toward = torch.where(up, float("inf"), float("-inf")).to(x.dtype)
    return torch.nextafter(x, toward)


def one_ulp_once(x: torch.Tensor) -> torch.Tensor:
    """The first element of the first token one ulp up; every other element unchanged."""
    y = x.clone()
    first = y[..., 0, 0]
    y[..., 0, 0] = torch.nextafter(first, torch.full_like(first, float("inf")))
    return y


def run_port(port, modeling, ids: torch.Tensor, perturb: Callable | None = None, at: str = "embed"):
    """One one-shot prefill of the port with its cache; ``perturb`` rewrites the output of the
    embedding (``at="embed"``) or of layer 0's attention (``at="attn0"``). Returns the logits
    and the rounding sites' (input, output) per (layer, site)."""
    handles = []
    if perturb is not None and at == "embed":
        handles.append(port.model.embed.register_forward_hook(lambda _m, _a, out: perturb(out)))
    elif perturb is not None:  # the attention returns (output, weights)
        attn = port.model.layers[0].attn
        hook = attn.register_forward_hook(lambda _m, _a, out: (perturb(out[0]), *out[1:]))
        handles.append(hook)
    sites = PortSites(modeling)
    handles += sites.hook(port)
    try:
        with sites, torch.no_grad():
            logits = port(input_ids=ids[None], use_cache=True).logits[0]
    finally:
        for h in handles:
            h.remove()
    return logits, sites.calls


def flips(want_calls: dict, got_calls: dict) -> list[dict[str, Any]]:
    """Per site in forward order: elements rounded differently and the input gap behind them."""
    rows = []
    for key in sorted(want_calls, key=lambda k: (k[0], SITES.index(k[1]))):
        if key not in got_calls:
            rows.append({"layer": key[0], "site": key[1], "missing_in_ours": True})
            continue
        (xp, yp), (xo, yo) = want_calls[key], got_calls[key]
        rounds = bool((yp != xp).any())  # an unrounded site passes its input's gap through
        differ = (yp != yo) if rounds else torch.zeros_like(yp, dtype=torch.bool)
        row = {"layer": key[0], "site": key[1], "elements": yp.numel(), "rounds": rounds,
               "flips": int(differ.sum()), "max_in_gap": float((xp - xo).abs().max())}  # fmt: skip
        if differ.any():
            r, c = (int(v) for v in differ.nonzero()[0])
            row["first"] = {"row": r, "col": c, "in_port": float(xp[r, c]),
                            "in_ours": float(xo[r, c]), "out_port": float(yp[r, c]),
                            "out_ours": float(yo[r, c])}  # fmt: skip
        rows.append(row)
    return rows


def compare(want: torch.Tensor, got: torch.Tensor) -> dict[str, Any]:
    delta = (got.log_softmax(-1) - want.log_softmax(-1)).abs()
    per_pos = delta.amax(-1)
    worst = int(per_pos.argmax())
    return {
        "argmax_agree": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
        "mean_abs_dlogp": float(delta.mean()),
        "max_abs_dlogp": float(delta.max()),
        "worst_position": worst,
        "positions_over_1e-3": int((per_pos > 1e-3).sum()),
        "bitwise_equal": bool(torch.equal(got, want)),
    }


def _against(want, want_calls, got, got_calls) -> dict[str, Any]:
    flipped = [s for s in flips(want_calls, got_calls) if s.get("flips")]
    return {
        **compare(want, got),
        "sites_flipping": len(flipped),
        "flips": sum(s["flips"] for s in flipped),
        "first_flip": flipped[0] if flipped else None,
    }


def self_rows(
    port, modeling, ids, want, want_calls, seed: int, rebind, draws: int = 1
) -> dict[str, Any]:
    """The port against its own one-shot prefill (``want``, ``want_calls``) under each one-ulp
    perturbation and on one thread. ``rebind`` gives the port a fresh n-gram history. With
    ``draws`` > 1, ``<row>_draws`` also holds the metrics of that many sign draws of each
    every-element row (draw k seeded ``seed + 1000 k``; draw 0 is the row itself): which draws
    flip where is chance, so one draw per model is a noisy ceiling."""
    rows: dict[str, Any] = {}

    def run(perturb=None, at="embed") -> dict[str, Any]:
        rebind()
        got, calls = run_port(port, modeling, ids, perturb, at)
        return _against(want, want_calls, got, calls)

    for name, at in (("port_perturbed", "embed"), ("port_perturbed_attn", "attn0")):
        runs = [run(lambda out, k=k: one_ulp_everywhere(out, seed + 1000 * k), at)
                for k in range(draws)]  # fmt: skip
        rows[name] = runs[0]
        if draws > 1:
            rows[f"{name}_draws"] = [_summary(r) for r in runs]
    rows["port_perturbed_one"] = run(one_ulp_once)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows["port_threads1"] = {**run(), "default_threads": threads}
    finally:
        torch.set_num_threads(threads)
    return rows


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    keep = ("argmax_agree", "mean_abs_dlogp", "max_abs_dlogp", "bitwise_equal", "flips")
    return {k: row[k] for k in keep}
