"""Fit measured times to the hardware models' parameters (numpy + scipy; no torch here).

Each fit works on the quantity the simulator predicts, not on a derived one: the GEMM curve is
fitted so that `hwmodels.compute.gemm_time` (roofline of compute and HBM time, efficiency read
from the curve) reproduces the measured GEMM times; the HBM curve, with the copies' own per-kernel
overhead, so that `memory_bound_time`'s streaming term reproduces the copy times (fit_hbm); the
attention curves so that `attention_time` does. The loss is the
log of predicted / measured time (a relative error, so a 10 us GEMM counts as much as a 10 ms
one) under scipy's robust soft-L1 loss (a few noisy samples on a busy machine do not drag the
curve), with the knot values bounded to (0, 1] as the profile format requires.

Held-out error: about 20% of the sizes are left out of a first fit (`holdout_split`; every point
of a size goes together, so no twin of a held-out point is fitted), and that fit is called through
the real hwmodels function on them; `FitResult.test_mape` is that mean absolute percentage error,
the number a user should expect on shapes the calibration never ran. The curve written to the
profile is then fitted again on every point: the check costs no measurement.

Collectives are fitted to the alpha-beta (Hockney) model, t = alpha + f x S / B, with f the
nccl-tests busbw factor of the op (hwmodels.network.busbw_factor): alpha is the latency, B the
asymptotic bus bandwidth, and busbw(S) / B the efficiency at size S (Thakur, Rabenseifner and
Gropp 2005, "Optimization of Collective Communication Operations in MPICH", Sec. 2).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from hwmodels.compute import KERNEL_OVERHEAD, attention_time, gemm_bytes, gemm_time
from hwmodels.curves import Curve
from hwmodels.profile import GpuProfile

__all__ = ["AlphaBeta", "FitResult", "choose_knots", "fit_alpha_beta", "fit_attention", "fit_gemm", "fit_hbm",
           "holdout_split", "mape"]

HOLDOUT_FRACTION = 0.2
EFF_MIN, EFF_MAX = 1e-4, 1.0
"""Bounds of a fitted efficiency: the profile loader accepts (0, 1]."""
SMOOTHNESS = 0.02
"""Weight of the second-difference penalty on knot values (relative to their mean): keeps a curve
with few points per knot from zig-zagging, too weak to move a real knee by more than a percent
(tests/test_calibrate_fit.py recovers the bundled H100 curve with it on)."""
ROBUST_SCALE = 0.05
"""soft-L1 scale: residuals (log time ratios) beyond ~5% count linearly, not quadratically."""


@dataclass(frozen=True, kw_only=True)
class FitResult:
    curve: Curve
    """fitted to every point."""
    n_train: int
    """points the curve is fitted to: all of them."""
    n_test: int
    """points a first fit left out to measure the error on unseen sizes."""
    train_mape: float
    """percent, the curve through hwmodels on every point."""
    test_mape: float
    """percent, the first fit (without them) on the held-out points (nan when there were too few
    points to hold any out)."""
    test_max_ape: float
    """percent, the worst held-out point."""
    overhead: float | None = None
    """seconds each measured call cost beyond the curve's work, fitted with it (fit_hbm); None where
    the fit charges hwmodels' KERNEL_OVERHEAD."""


@dataclass(frozen=True, kw_only=True)
class AlphaBeta:
    alpha: float
    """seconds: the latency term."""
    busbw: float
    """bytes/s: the asymptotic bus bandwidth (nccl-tests convention)."""
    factor: float
    """the op's busbw factor: t = alpha + factor x nbytes / busbw."""
    n_train: int
    n_test: int
    train_mape: float
    test_mape: float

    def time(self, nbytes: float) -> float:
        return self.alpha + self.factor * nbytes / self.busbw

    def efficiency(self, nbytes: float) -> float:
        """Achieved busbw at `nbytes` over the asymptotic busbw."""
        return self.factor * nbytes / self.time(nbytes) / self.busbw


def mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Mean absolute percentage error, in percent; nan for no points."""
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    if p.size == 0:
        return math.nan
    return float(np.mean(np.abs(p - m) / m) * 100.0)


def _max_ape(predicted, measured) -> float:
    p, m = np.asarray(predicted, float), np.asarray(measured, float)
    return float(np.max(np.abs(p - m) / m) * 100.0) if p.size else math.nan


def holdout_split(xs: Sequence[float], *, fraction: float = HOLDOUT_FRACTION, seed: int = 0,
                  keys: Sequence | None = None) -> tuple[list[int], list[int]]:
    """(train, test) indices: round(fraction x units) units held out, a unit being every point of
    one key (default: of one x). Points of one key get the same prediction from the model (a
    repeated GEMM shape; attention configurations of equal FLOPs, which is all attention_time
    reads), so a fitted twin would turn the held-out error into a training error. The units are
    sorted by size and cut into as many equal strata as units to hold out, one drawn from each by a
    seeded RNG (stratified sampling): the held-out points spread over the whole range, so their
    error is the curve's everywhere, not where a lucky draw fell. The units holding the smallest and
    largest x are never held out (a curve is clamped outside its knots, so holding out an end would
    test an extrapolation the model never makes), and at least two units are left to fit."""
    x = np.asarray(xs, float)
    keys = [float(v) for v in x] if keys is None else list(keys)
    units: dict = {}
    for i, key in enumerate(keys):
        units.setdefault(key, []).append(i)
    lo, hi = (float(x.min()), float(x.max())) if len(x) else (0.0, 0.0)
    inner = [key for key, idx in units.items() if not {float(x[i]) for i in idx} & {lo, hi}]
    inner.sort(key=lambda key: (min(float(x[i]) for i in units[key]), units[key][0]))
    k = min(int(round(fraction * len(units))), len(inner), max(0, len(units) - 2))
    rng = np.random.default_rng(seed)
    bounds = [len(inner) * j // k for j in range(k + 1)] if k > 0 else []
    picked = [int(rng.integers(a, b)) for a, b in zip(bounds, bounds[1:])]
    test = sorted(i for j in picked for i in units[inner[j]])
    held = set(test)
    return [i for i in range(len(x)) if i not in held], test


def choose_knots(xs: Sequence[float], *, per_knot: int = 3, max_knots: int = 16, min_gap: float = 0.1) -> np.ndarray:
    """Knot sizes at quantiles of log10(x), so every segment holds data: about one knot per
    `per_knot` points, between 2 and `max_knots`, the ends at the smallest and largest x, no two
    closer than `min_gap` decades (one knot when every x is the same). Three points per knot was
    the best trade on synthetic sweeps (tests/test_calibrate_fit.py's setting: 30 shapes with 2-8%
    noise, fresh-shape error 2.3-4.7% against 3.2-4.7% at four and 2.6-5.4% at two)."""
    lx = np.sort(np.log10(np.asarray(xs, float)))
    if lx[-1] - lx[0] < min_gap:
        return np.array([10 ** lx[0]]) if lx[-1] == lx[0] else 10 ** np.array([lx[0], lx[-1]])
    n = int(np.clip(len(lx) // per_knot, 2, max_knots))
    knots = [lx[0]]
    for q in np.quantile(lx, np.linspace(0, 1, n))[1:]:
        if q - knots[-1] >= min_gap:
            knots.append(float(q))
    if knots[-1] != lx[-1]:
        if lx[-1] - knots[-1] < min_gap and len(knots) > 1:
            knots[-1] = float(lx[-1])
        else:
            knots.append(float(lx[-1]))
    return 10 ** np.array(knots)


# ----------------------------------------------------------------------------- the generic fit


def _interp(x: np.ndarray, knots: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """hwmodels.curves.Curve, vectorised: linear in log10(x) between knots, clamped outside."""
    return np.interp(np.log10(x), np.log10(knots), ys)


def _compute_times(flops: np.ndarray, peak: float, knots: np.ndarray, ys: np.ndarray,
                   at: np.ndarray | None = None) -> np.ndarray:
    """hwmodels.compute._compute_time, vectorised: flops / (peak x eff(at)), `at` the curve's sizes
    (default the FLOPs), floored at the time of the slowest knot at or below `at`, scaled by
    flops / at."""
    x = flops if at is None else at
    t = flops / (peak * _interp(x, knots, ys))
    i = np.searchsorted(knots, x, side="right") - 1
    j = np.maximum(i, 0)
    floor = np.where(i >= 0, np.maximum.accumulate(knots / ys)[j] / peak * (flops / x), 0.0)
    return np.maximum(t, floor)


def _initial(x: np.ndarray, eff: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Start values: at each knot the median raw efficiency of the points nearest it in log x."""
    lx, lk = np.log10(x), np.log10(knots)
    k = max(1, min(len(x), int(math.ceil(len(x) / len(knots)))))
    out = [float(np.median(eff[np.argsort(np.abs(lx - c))[:k]])) for c in lk]
    return np.clip(out, EFF_MIN * 1.01, EFF_MAX * 0.999)


def _roughness(ys: np.ndarray) -> np.ndarray:
    """The smoothness penalty's residuals: the knot values' second differences relative to their
    mean, weighted by SMOOTHNESS (none for two knots or fewer)."""
    if len(ys) <= 2 or SMOOTHNESS <= 0:
        return np.zeros(0)
    return SMOOTHNESS * np.diff(ys, 2) / max(float(np.mean(ys)), EFF_MIN)


def _fit_knot_values(predict: Callable[[np.ndarray], np.ndarray], measured: np.ndarray, x0: np.ndarray) -> np.ndarray:
    """Knot efficiencies minimising the robust log error of predict(ys) against measured."""
    logm = np.log(measured)

    def residuals(ys):
        return np.concatenate([np.log(predict(ys)) - logm, _roughness(ys)])

    sol = least_squares(residuals, x0, bounds=(EFF_MIN, EFF_MAX), loss="soft_l1", f_scale=ROBUST_SCALE,
                        x_scale="jac", max_nfev=2000)
    return np.clip(sol.x, EFF_MIN, EFF_MAX)


def _validated(fit_on: Callable[[list[int]], object], model: Callable[[object, int], float], seconds: Sequence[float],
               train, test, parts: Callable[[object], tuple[Curve, float | None]] = lambda c: (c, None)) -> FitResult:
    """Fit on `train`, measure that fit through the real hwmodels function `model(fitted, i)` on
    `test`, then fit again on every point for the curve to keep (its error over all of them is
    `train_mape`). `parts`: a fit's (curve, overhead) (FitResult.overhead), for fits that are more
    than a curve."""
    held = fit_on(train)
    pred_test = [model(held, i) for i in test]
    everything = sorted(train + test)
    fitted = fit_on(everything) if test else held
    curve, overhead = parts(fitted)
    return FitResult(
        curve=curve, n_train=len(everything), n_test=len(test),
        train_mape=mape([model(fitted, i) for i in everything], [seconds[i] for i in everything]),
        test_mape=mape(pred_test, [seconds[i] for i in test]),
        test_max_ape=_max_ape(pred_test, [seconds[i] for i in test]),
        overhead=overhead,
    )


def _above_floor(x: np.ndarray, t: np.ndarray, floor: float = 1.05 * KERNEL_OVERHEAD) -> np.ndarray:
    """The sizes to place knots at: those whose time is above `floor`, by default one kernel's
    overhead (5% margin). A kernel timed at the floor says only that it is fast; a knot there could
    take any value (even efficiency 1 at a few MFLOP), and the curve is clamped below its first knot
    anyway."""
    keep = x[t > floor]
    return keep if keep.size else x


def _split(n: int, xs, train, test):
    if train is None:
        train, test = holdout_split(xs)
    if len(train) < 1:
        raise ValueError("nothing to fit: no training points")
    return list(train), list(test or [])


# ----------------------------------------------------------------------------- HBM


def fit_hbm(nbytes: Sequence[float], seconds: Sequence[float], *, bandwidth: float,
            train: Sequence[int] | None = None, test: Sequence[int] | None = None) -> FitResult:
    """The HBM efficiency curve (bytes moved by one kernel -> fraction of `bandwidth`) and the
    measured copies' own per-kernel overhead, fitted together: t = overhead + bytes / (bandwidth x
    eff(bytes)). The curve is then the streaming rate alone, as its readers take it:
    memory_bound_time adds an eager training kernel's KERNEL_OVERHEAD to it, gemm_time reads it for
    a GEMM's operand traffic with no overhead at all. Fitted under KERNEL_OVERHEAD instead, copies
    that cost less per kernel than that (graph-replayed ones on an H100: about 1.9 us) pin the
    curve's small sizes at the bound of 1, above any rate measured. Knots sit only where the
    streaming term is at least the overhead (below, the times say little about the rate: on an
    H100, copies of 0.1-2 MB all took 1.9-2.5 us); the curve holds its first knot's value there."""
    b, t = np.asarray(nbytes, float), np.asarray(seconds, float)
    train, test = _split(len(b), b, train, test)

    def fit_on(idx: list[int]) -> tuple[Curve, float]:
        bt, tt = b[idx], t[idx]
        # start: the three smallest copies' median time less their bytes at the best rate measured
        best = float(np.max(bt / tt))
        small = np.argsort(bt)[:3]
        a0 = float(np.clip(np.median(tt[small] - bt[small] / best), 0.0, 0.9 * np.min(tt)))
        knots = choose_knots(_above_floor(bt, tt, 2.0 * a0), per_knot=1)
        raw = bt / (bandwidth * np.maximum(tt - a0, 0.1 * tt))
        x0 = np.concatenate([[a0 * 1e6], _initial(bt, raw, knots)])
        logm = np.log(tt)

        def residuals(p):
            pred = p[0] * 1e-6 + bt / (bandwidth * _interp(bt, knots, p[1:]))
            return np.concatenate([np.log(pred) - logm, _roughness(p[1:])])

        lower = np.concatenate([[0.0], np.full(len(knots), EFF_MIN)])
        upper = np.concatenate([[float(np.min(tt)) * 1e6], np.full(len(knots), EFF_MAX)])
        sol = least_squares(residuals, np.clip(x0, lower, upper * 0.999), bounds=(lower, upper), loss="soft_l1",
                            f_scale=ROBUST_SCALE, x_scale="jac", max_nfev=2000)
        ys = np.clip(sol.x[1:], EFF_MIN, EFF_MAX)
        return Curve(tuple(knots), tuple(ys)), float(sol.x[0]) * 1e-6

    def model(fitted: tuple[Curve, float], i: int) -> float:
        curve, overhead = fitted
        return overhead + b[i] / (bandwidth * curve(b[i]))

    return _validated(fit_on, model, t, train, test, parts=lambda fitted: fitted)


# ----------------------------------------------------------------------------- GEMM


def fit_gemm(shapes: Sequence[tuple[int, int, int]], seconds: Sequence[float], *, dtype: str, profile: GpuProfile,
             train: Sequence[int] | None = None, test: Sequence[int] | None = None) -> FitResult:
    """The GEMM efficiency curve of `dtype` (FLOPs of one GEMM -> fraction of profile.peak(dtype))
    that makes hwmodels.compute.gemm_time(profile, m, n, k, dtype) match the measured (m, n, k)
    times, with `profile`'s HBM curve (fit it first) for the memory term of the roofline."""
    m, n, k = (np.asarray([s[i] for s in shapes], float) for i in range(3))
    t = np.asarray(seconds, float)
    flops = 2.0 * m * n * k
    peak = profile.peak(dtype)
    nbytes = gemm_bytes(m, n, k, dtype)
    t_mem = nbytes / (profile.hbm_bandwidth * np.array([profile.hbm_efficiency(x) for x in nbytes]))
    if train is None:  # a repeated shape is one unit of the hold-out
        train, test = holdout_split(flops, keys=[tuple(sh) for sh in shapes])
    train, test = _split(len(t), flops, train, test)

    def fit_on(idx: list[int]) -> Curve:
        ft, tt, mt = flops[idx], t[idx], t_mem[idx]
        knots = choose_knots(_above_floor(ft, tt))
        raw = ft / (peak * np.sqrt(np.maximum(tt**2 - mt**2, (0.1 * tt) ** 2)))
        # gemm_time's own form: the roofline of compute and HBM time, floored at one kernel's overhead
        ys = _fit_knot_values(lambda ys: np.maximum(np.hypot(_compute_times(ft, peak, knots, ys), mt), KERNEL_OVERHEAD),
                              tt, _initial(ft, raw, knots))
        return Curve(tuple(knots), tuple(ys))

    key = "tf32" if dtype == "fp32" else dtype  # fp32 GEMMs run on the TF32 curve (hwmodels.profile)

    def model(c: Curve, i: int) -> float:
        curves = tuple((d, c if d == key else cv) for d, cv in profile.gemm_efficiency)
        return gemm_time(dataclasses.replace(profile, gemm_efficiency=curves), int(m[i]), int(n[i]), int(k[i]), dtype)

    return _validated(fit_on, model, t, train, test)


# ----------------------------------------------------------------------------- attention


def fit_attention(configs: Sequence[dict], seconds: Sequence[float], *, backward: bool, dtype: str, profile: GpuProfile,
                  train: Sequence[int] | None = None, test: Sequence[int] | None = None) -> FitResult:
    """The flash-attention curve (the benchmark grid's FLOPs at a call's sequence lengths,
    hwmodels.compute.attention_curve_flops -> fraction of the 16-bit peak) that makes
    hwmodels.compute.attention_time match the measured calls; `configs` hold attention_time's
    keyword arguments (batch, heads, q_len, kv_len, head_dim, causal)."""
    # the simulator's own rule for which peak attention runs at (fp8 training keeps it in bf16)
    from hwmodels.compute import _attention_dtype, attention_curve_flops, attention_flops

    t = np.asarray(seconds, float)
    flops = np.array([attention_flops(**c, backward=backward) for c in configs])
    at = np.array([attention_curve_flops(q_len=c["q_len"], kv_len=c["kv_len"], causal=c["causal"], backward=backward)
                   for c in configs])
    peak = profile.peak(_attention_dtype(dtype))
    train, test = _split(len(t), at, train, test)

    def fit_on(idx: list[int]) -> Curve:
        ft, xt, tt = flops[idx], at[idx], t[idx]
        knots = choose_knots(_above_floor(xt, tt), per_knot=2)  # few configurations, each a smooth average over many tiles
        ys = _fit_knot_values(lambda ys: np.maximum(_compute_times(ft, peak, knots, ys, xt), KERNEL_OVERHEAD), tt,
                              _initial(xt, ft / (peak * tt), knots))
        return Curve(tuple(knots), tuple(ys))

    field = "attention_bwd_efficiency" if backward else "attention_fwd_efficiency"

    def model(c: Curve, i: int) -> float:
        # the `flash` curves alone: per-head-dim ones (a base profile's) would be read in their place
        return attention_time(dataclasses.replace(profile, **{field: c}, attention_head_dims=()), **configs[i],
                              dtype=dtype, backward=backward)

    return _validated(fit_on, model, t, train, test)


# ----------------------------------------------------------------------------- collectives


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float], *, factor: float,
                   train: Sequence[int] | None = None, test: Sequence[int] | None = None) -> AlphaBeta:
    """alpha (s) and busbw (bytes/s) of t = alpha + factor x nbytes / busbw, fitted on the log
    time ratio (so small, latency-bound messages weigh as much as large ones)."""
    b, t = np.asarray(nbytes, float), np.asarray(seconds, float)
    train, test = _split(len(b), b, train, test)

    def fit_on(idx: list[int]) -> tuple[float, float]:
        bt, tt = b[idx], t[idx]
        logm = np.log(tt)
        bw0 = float(np.max(factor * bt / tt))
        a0 = max(float(np.min(tt)) * 0.5, 1e-9)

        def residuals(p):
            alpha, logbw = p[0] * 1e-6, p[1]
            return np.log(alpha + factor * bt / np.exp(logbw)) - logm

        sol = least_squares(residuals, [a0 * 1e6, math.log(bw0)], bounds=([0.0, -np.inf], [np.inf, np.inf]),
                            loss="soft_l1", f_scale=ROBUST_SCALE, x_scale="jac", max_nfev=2000)
        return float(sol.x[0]) * 1e-6, float(math.exp(sol.x[1]))

    # as the curves: the held-out error of a fit without the test sizes, then the fit of all points
    everything = sorted(train + test)
    alpha, busbw = fit_on(train)
    held = AlphaBeta(alpha=alpha, busbw=busbw, factor=factor, n_train=len(everything), n_test=len(test),
                     train_mape=math.nan, test_mape=math.nan)
    ab = dataclasses.replace(held, **dict(zip(("alpha", "busbw"), fit_on(everything)))) if test else held
    return dataclasses.replace(
        ab,
        train_mape=mape([ab.time(b[i]) for i in everything], [t[i] for i in everything]),
        test_mape=mape([held.time(b[i]) for i in test], [t[i] for i in test]),
    )
