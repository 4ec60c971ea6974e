"""Efficiency tables: a measured quantity as a function of a size, interpolated in log10(size).

Hardware efficiency rises with kernel or message size over decades (a 1 MiB all-reduce and an
8 GiB one differ by 10^4), so the tables are sampled at powers of two and interpolated linearly in
log10(x), as Calculon interpolates its efficiency tables and as nccl-tests curves are plotted.
Outside the sampled range the curve is clamped to its end values: no extrapolation beyond what
was measured.
"""
from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Curve:
    """y(x), piecewise linear in log10(x) between the knots, clamped outside them."""

    xs: tuple[float, ...]
    """Sizes (FLOPs, bytes), strictly increasing and > 0."""
    ys: tuple[float, ...]
    """The value at each size (a fraction of a peak, or bytes/s)."""
    _logs: tuple[float, ...] = field(init=False, repr=False, compare=False, default=())
    _ratio_max: tuple[float, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        xs = tuple(float(x) for x in self.xs)
        ys = tuple(float(y) for y in self.ys)
        if not xs or len(xs) != len(ys):
            raise ValueError(f"a curve needs as many ys as xs and at least one point (got {len(xs)} xs, {len(ys)} ys)")
        if not all(math.isfinite(v) for v in xs + ys):
            raise ValueError("curve values must be finite numbers")
        if xs[0] <= 0 or any(b <= a for a, b in zip(xs, xs[1:])):
            raise ValueError(f"curve xs must be positive and strictly increasing, got {list(xs)}")
        object.__setattr__(self, "xs", xs)
        object.__setattr__(self, "ys", ys)
        object.__setattr__(self, "_logs", tuple(math.log10(x) for x in xs))
        object.__setattr__(self, "_ratio_max", tuple(itertools.accumulate(
            (x / y if y > 0 else math.inf for x, y in zip(xs, ys)), max)))

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, x)  # xs[i-1] <= x < xs[i]
        lo, hi = self._logs[i - 1], self._logs[i]
        t = (math.log10(x) - lo) / (hi - lo)
        return ys[i - 1] + t * (ys[i] - ys[i - 1])

    def ratio_max(self, i: int) -> float:
        """The largest x / y of knots 0..i: for an efficiency curve over work, the time x peak of the
        slowest of those knots."""
        return self._ratio_max[i]

    @property
    def max(self) -> float:
        return max(self.ys)

    def scaled(self, *, x: float = 1.0, y: float = 1.0) -> "Curve":
        """The same curve with sizes times `x` and values times `y` (derived profiles)."""
        return Curve(tuple(v * x for v in self.xs), tuple(v * y for v in self.ys))


def to_unit(value: float, scale: float) -> float | int:
    """`value` (SI) expressed in a unit of `scale` SI units, chosen so that `w * scale == value`
    exactly where a float allows it: profiles written by `write_profile` load back bit-identical.
    Whole numbers come back as int for a readable file (312 rather than 312.0)."""
    w = value / scale
    if w * scale != value:
        for direction in (math.inf, -math.inf):
            cand = w
            for _ in range(4):
                cand = math.nextafter(cand, direction)
                if cand * scale == value:
                    w = cand
                    break
            if w * scale == value:
                break
    if w == int(w) and abs(w) < 2**53 and float(int(w)) * scale == value:
        return int(w)
    return w
