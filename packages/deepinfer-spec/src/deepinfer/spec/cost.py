"""Measured step-cost curve: time of one target step as a function of the tokens in it."""

from __future__ import annotations

import math
import statistics
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepCostCurve:
    """Measured points ``(num_tokens[i], cost[i])`` of one forward step's cost.

    num_tokens: strictly increasing positive token counts (e.g. the captured graph sizes).
    cost: the measured cost at each (any positive unit, e.g. milliseconds).
    staircase: ``False`` interpolates linearly between points; ``True`` charges the cost of the
        smallest measured size at or above the count (padding to a captured graph is real work).

    Below the first point the cost is ``cost[0]``. Above the last point it extends the last
    segment's slope (never decreasing; a single point extends flat).
    """

    num_tokens: tuple[int, ...]
    cost: tuple[float, ...]
    staircase: bool = False

    def __post_init__(self) -> None:
        if len(self.num_tokens) == 0 or len(self.num_tokens) != len(self.cost):
            raise ValueError(
                f"num_tokens has {len(self.num_tokens)} points and cost {len(self.cost)}: "
                "expected the same positive number of points"
            )
        if any(not isinstance(n, int) or n <= 0 for n in self.num_tokens):
            raise ValueError(f"num_tokens={self.num_tokens}: expected positive ints")
        if any(b <= a for a, b in zip(self.num_tokens, self.num_tokens[1:])):
            raise ValueError(f"num_tokens={self.num_tokens}: expected strictly increasing")
        if any(not math.isfinite(c) or c <= 0 for c in self.cost):
            raise ValueError(f"cost={self.cost}: expected finite positive values")

    @classmethod
    def from_points(
        cls, points: Iterable[tuple[int, float]], staircase: bool = False
    ) -> StepCostCurve:
        """Build from ``(num_tokens, cost)`` pairs in any order."""
        ordered = sorted((int(n), float(c)) for n, c in points)
        return cls(tuple(n for n, _ in ordered), tuple(c for _, c in ordered), staircase)

    @classmethod
    def from_samples(
        cls, samples: Mapping[int, Sequence[float]], *, staircase: bool = False
    ) -> StepCostCurve:
        """Build from raw timings per size: the median of each size's samples, then made
        non-decreasing (a running maximum), since a step never gets cheaper with more tokens and
        a dip in noisy timings would lure the planner into an unstable choice."""
        if any(len(times) == 0 for times in samples.values()):
            empty = sorted(n for n, times in samples.items() if len(times) == 0)
            raise ValueError(f"samples for num_tokens={empty}: expected at least one timing")
        medians = sorted((int(n), statistics.median(times)) for n, times in samples.items())
        running, points = 0.0, []
        for num_tokens, median in medians:
            running = max(running, float(median))
            points.append((num_tokens, running))
        return cls.from_points(points, staircase=staircase)

    def __call__(self, num_tokens: int) -> float:
        """Cost of a step with ``num_tokens`` tokens."""
        return self.cost_range(num_tokens, 1)[0]

    def cost_range(self, first: int, count: int) -> list[float]:
        """Costs of steps of ``first, first + 1, ..., first + count - 1`` tokens, in plain float
        arithmetic (a host planner asks for every candidate size of every step): per segment
        ``cost[i-1] + (n - num_tokens[i-1]) / span * (cost[i] - cost[i-1])`` for ``n`` in
        ``(num_tokens[i-1], num_tokens[i]]``."""
        xs, ys = self.num_tokens, self.cost
        out: list[float] = []
        n, end = first, first + count
        while n < end and n <= xs[-1]:
            upper = bisect_left(xs, n)
            stop = min(end, xs[upper] + 1)  # the sizes this segment prices
            if self.staircase or upper == 0:  # (below the first point: its cost)
                out += [float(ys[upper])] * (stop - n)
            else:
                x0, y0, dy = xs[upper - 1], ys[upper - 1], ys[upper] - ys[upper - 1]
                span = xs[upper] - x0
                out += [y0 + (k - x0) / span * dy for k in range(n, stop)]
            n = stop
        if n < end:  # past the last point: the last segment's slope, never decreasing
            if len(xs) == 1:
                return out + [float(ys[-1])] * (end - n)
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            out += [ys[-1] + slope * (k - xs[-1]) for k in range(n, end)]
        return out

    def costs(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """Vectorised cost, float64 tensor of ``num_tokens``' shape (a CPU integer tensor)."""
        values = [self(n) for n in num_tokens.reshape(-1).tolist()]  # (sizes in any order)
        return torch.tensor(values, dtype=torch.float64).reshape(num_tokens.shape)


__all__ = ["StepCostCurve"]
