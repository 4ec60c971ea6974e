"""calibrate.fit: the fits recover known curves from synthetic measurements made with the
simulator's own kernel models (so a fit that drifted from hwmodels would fail here)."""
import dataclasses
import math

import numpy as np
import pytest

from calibrate.fit import (choose_knots, fit_alpha_beta, fit_attention, fit_gemm, fit_hbm, holdout_split, mape)
from hwmodels.compute import KERNEL_OVERHEAD, attention_time, gemm_time, memory_bound_time
from hwmodels.profile import load_profile

H100 = load_profile("h100-sxm-80gb")
NOISE = 0.02  # 2% lognormal timing noise


def _noisy(values, seed=1):
    rng = np.random.default_rng(seed)
    return [v * rng.lognormal(0.0, NOISE) for v in values]


def _shapes(n, seed=0, lo=8, hi=14.5):
    rng = np.random.default_rng(seed)
    return [tuple(int(2 ** rng.uniform(lo, hi)) // 16 * 16 for _ in range(3)) for _ in range(n)]


def test_mape():
    assert mape([110, 90], [100, 100]) == pytest.approx(10.0)
    assert math.isnan(mape([], []))


def test_holdout_split_keeps_the_ends_and_is_deterministic():
    xs = [float(2**i) for i in range(20)]
    train, test = holdout_split(xs)
    assert len(test) == 4 and sorted(train + test) == list(range(20))
    assert 0 in train and 19 in train  # a clamped curve is never asked to extrapolate
    assert holdout_split(xs) == (train, test)
    assert holdout_split([1.0, 2.0]) == ([0, 1], [])  # too few to hold any out


def test_holdout_split_spreads_the_held_out_sizes_over_the_range():
    """One held-out size per stratum of the sorted sizes, whatever the seed: never a cluster where
    the curve happens to fit well."""
    xs = [float(2**i) for i in range(20)]
    for seed in range(20):
        _, test = holdout_split(xs, seed=seed)
        bounds = [18 * j // 4 for j in range(5)]  # the 18 inner sizes (1-18) in 4 strata
        assert len(test) == 4
        assert all(bounds[j] <= i - 1 < bounds[j + 1] for j, i in enumerate(test))


def test_holdout_split_holds_out_every_point_of_a_size_together():
    """Equal x (attention configurations of equal FLOPs, a repeated shape): the curve cannot tell
    them apart, so a fitted twin would turn the held-out error into a training error."""
    xs = [float(2**i) for i in range(10) for _ in range(3)]  # each size three times
    train, test = holdout_split(xs)
    held = {xs[i] for i in test}
    assert test and not held & {xs[i] for i in train}
    assert len(test) == 3 * len(held) == 6


def test_the_written_curve_is_fitted_to_every_point():
    """The hold-out only measures the procedure; the profile's curve uses all the measurements."""
    shapes = _shapes(60, seed=5)
    times = _noisy([gemm_time(H100, m, n, k, "bf16") for m, n, k in shapes])
    checked = fit_gemm(shapes, times, dtype="bf16", profile=H100)
    everything = fit_gemm(shapes, times, dtype="bf16", profile=H100, train=list(range(60)), test=[])
    assert checked.n_test == 12 and checked.curve == everything.curve


def test_knots_start_above_the_launch_floor():
    """GEMMs timed at the 3 us floor say only that they are fast: no knot there (a quick plan's
    fp8 curve had put efficiency 1.0 at 4 MFLOP), the curve clamps below its first knot."""
    shapes = [(s, s, s) for s in (64, 96, 128, 160, 192, 256)] + _shapes(40, seed=2, lo=9, hi=14)
    times = [gemm_time(H100, m, n, k, "fp8") for m, n, k in shapes]
    fit = fit_gemm(shapes, times, dtype="fp8", profile=H100)
    timed = [2.0 * m * n * k for (m, n, k), t in zip(shapes, times) if t > 1.05 * 3e-6]
    assert fit.curve.xs[0] == pytest.approx(min(timed), rel=1e-6)
    assert max(fit.curve.ys) < 0.75  # H100 fp8 GEMMs peak near 0.70 of the datasheet


def test_choose_knots_span_the_data_and_stay_apart():
    xs = np.geomspace(1e6, 1e13, 40)
    k = choose_knots(xs)
    assert k[0] == pytest.approx(1e6) and k[-1] == pytest.approx(1e13)
    assert len(k) == 13 and np.all(np.diff(np.log10(k)) >= 0.1 - 1e-12)
    assert len(choose_knots([5e9] * 6)) == 1


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_fit_gemm_recovers_the_bundled_h100_curve(dtype):
    shapes = _shapes(120)
    truth = [gemm_time(H100, m, n, k, dtype) for m, n, k in shapes]
    fit = fit_gemm(shapes, _noisy(truth), dtype=dtype, profile=H100)
    assert fit.n_test == 24 and fit.n_train == 120  # the written curve is fitted to every point
    # the held-out error is the 2% noise plus the knot mismatch at the true curve's corners, no more
    assert fit.test_mape < 3.0, fit
    # the recovered profile predicts 200 fresh shapes, noise-free, within 2.5% on average
    fitted = dataclasses.replace(H100, gemm_efficiency=tuple(
        (d, fit.curve if d == dtype else c) for d, c in H100.gemm_efficiency))
    fresh = _shapes(200, seed=7)
    assert mape([gemm_time(fitted, *s, dtype) for s in fresh], [gemm_time(H100, *s, dtype) for s in fresh]) < 1.5
    # and where GEMMs are compute-bound (below, the HBM term hides the curve) the curve itself
    assert fit.curve(1.1e12) == pytest.approx(H100.gemm_curve(dtype)(1.1e12), rel=0.05)


def test_fit_gemm_sees_a_different_curve():
    """Measurements from the A100 curve must not fit back to the H100 one (the fit is not a no-op)."""
    a100 = load_profile("a100-sxm-80gb")
    shapes = _shapes(60, seed=3, lo=7, hi=12)
    truth = [gemm_time(a100, m, n, k, "bf16") * H100.peak("bf16") / a100.peak("bf16") for m, n, k in shapes]
    fit = fit_gemm(shapes, truth, dtype="bf16", profile=H100)
    assert fit.test_mape < 5.0
    assert abs(fit.curve(2.0 * 1024**3) - H100.gemm_curve("bf16")(2.0 * 1024**3)) > 0.02


def test_fit_hbm_recovers_the_bundled_curve_and_its_overhead():
    sizes = [2**e for e in range(14, 32)]
    fit = fit_hbm(sizes, _noisy([memory_bound_time(H100, b) for b in sizes]), bandwidth=H100.hbm_bandwidth)
    assert fit.n_test == 4 and fit.test_mape < 5.0
    assert fit.overhead == pytest.approx(KERNEL_OVERHEAD, rel=0.05)
    for x, y in zip(H100.hbm_efficiency.xs, H100.hbm_efficiency.ys):
        if x >= 1e7:  # below, the 3 us overhead outweighs the streaming and hides the efficiency
            assert fit.curve(x) == pytest.approx(y, rel=0.08)


def test_fit_hbm_does_not_pin_small_copies_at_full_bandwidth():
    """Copies that cost less per kernel than KERNEL_OVERHEAD (graph replays on an H100: ~1.9 us)
    fit their own overhead: the curve holds the streaming rate measured, never 1."""
    sizes = [2**e for e in range(17, 33)]
    rate = 0.87
    fit = fit_hbm(sizes, _noisy([1.9e-6 + b / (H100.hbm_bandwidth * rate) for b in sizes]),
                  bandwidth=H100.hbm_bandwidth)
    assert fit.overhead == pytest.approx(1.9e-6, rel=0.1)
    assert max(fit.curve.ys) < 0.92 and min(fit.curve.ys) > 0.82
    assert fit.train_mape < 3.0


@pytest.mark.parametrize("backward", [False, True])
def test_fit_attention_recovers_the_bundled_curve(backward):
    configs = [dict(batch=max(1, 16384 // s), heads=2048 // d, q_len=s, kv_len=s, head_dim=d, causal=True)
               for s in (256, 512, 1024, 2048, 4096, 8192, 16384) for d in (64, 128)]
    truth = [attention_time(H100, **c, dtype="bf16", backward=backward) for c in configs]
    fit = fit_attention(configs, _noisy(truth), backward=backward, dtype="bf16", profile=H100)
    assert fit.n_test >= 2 and fit.test_mape < 4.0
    curve = H100.attention_bwd_efficiency if backward else H100.attention_fwd_efficiency
    mid = math.sqrt(curve.xs[0] * curve.xs[-1])
    assert fit.curve(mid) == pytest.approx(curve(mid), rel=0.06)


def test_fit_alpha_beta_recovers_latency_and_bandwidth():
    sizes = [2**e for e in range(10, 31)]
    alpha, busbw, factor = 25e-6, 180e9, 2 * 7 / 8
    ab = fit_alpha_beta(sizes, _noisy([alpha + factor * s / busbw for s in sizes]), factor=factor)
    assert ab.alpha == pytest.approx(alpha, rel=0.05)
    assert ab.busbw == pytest.approx(busbw, rel=0.03)
    assert ab.test_mape < 4.0 and ab.n_test == 4
    assert ab.efficiency(2**30) == pytest.approx(1.0, abs=0.01) and ab.efficiency(2**10) < 0.01


class _FakeGpu:
    """A stream on a virtual clock: the host queues work (each call costs it `host_s`), the GPU
    runs it in order once queued and idles when the queue is empty; events stamp when the stream
    reaches them. Enough to tell a timer that measures the GPU from one that measures the host."""

    def __init__(self, kernel_s: float, host_s: float, cycles_per_s: float = 1.8e9, idle_cycles_per_s: float | None = None):
        self.kernel_s, self.host_s, self.rate = kernel_s, host_s, cycles_per_s
        self.idle_rate = idle_cycles_per_s  # the first sleep's clock (a GPU not yet boosted), if other
        self.host, self.gpu = 0.0, 0.0

    def sleep(self, cycles: int) -> None:
        rate, self.idle_rate = (self.idle_rate or self.rate), None
        self.launch(cycles / rate)

    def launch(self, seconds: float) -> None:
        if getattr(self, "capturing", None) is not None:  # recorded into a graph, not run
            if self.capture_raises:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.capturing.kernels.append(seconds)
            return
        self.host += self.host_s
        self.gpu = max(self.gpu, self.host) + seconds

    def install_graphs(self, monkeypatch, *, raises: bool = False):
        """CUDA graphs on the same clock: a replay costs the host one launch (5 us) and runs every
        captured kernel back to back; streams are stand-ins."""
        import contextlib
        import types

        import calibrate.bench as bench

        fake, self.capturing, self.capture_raises = self, None, raises

        class Graph:
            def __init__(self):
                self.kernels = []

            def replay(self):
                fake.host += 5e-6
                fake.gpu = max(fake.gpu, fake.host) + sum(self.kernels)

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None):
            fake.capturing = g
            try:
                yield
            finally:
                fake.capturing = None

        stream = types.SimpleNamespace(wait_stream=lambda other: None)
        monkeypatch.setattr(bench.torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(bench.torch.cuda, "graph", graph)
        monkeypatch.setattr(bench.torch.cuda, "Stream", lambda device=None: stream)
        monkeypatch.setattr(bench.torch.cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(bench.torch.cuda, "current_stream", lambda device=None: stream)
        monkeypatch.setattr(bench.torch.cuda, "set_stream", lambda s: None)
        monkeypatch.setattr(bench.torch.cuda, "graph_pool_handle", lambda: None)

    def install(self, monkeypatch):
        import types

        import calibrate.bench as bench

        fake = self

        class Event:
            def __init__(self, enable_timing=True):
                self.t = None

            def record(self):
                self.t = max(fake.gpu, fake.host)
                fake.gpu = self.t

            def synchronize(self):
                fake.host = max(fake.host, self.t)

            def query(self):
                return self.t <= fake.host

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3

        monkeypatch.setattr(bench.torch.cuda, "Event", Event)
        monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda device=None: setattr(fake, "host", max(fake.host, fake.gpu)))
        monkeypatch.setattr(bench.torch.cuda, "_sleep", fake.sleep)
        monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: fake.host))
        return lambda: fake.launch(fake.kernel_s)


@pytest.mark.parametrize("kernel_s,host_s", [(2e-6, 10e-6), (5e-6, 6e-6), (50e-6, 10e-6), (2e-3, 10e-6)])
def test_gpu_clock_times_the_kernel_not_the_host_that_queues_it(monkeypatch, kernel_s, host_s):
    """A 2 us kernel that takes the host 10 us to queue would read as 10 us without a queued lead
    (the GPU idles between calls); each block is queued behind a sleep, so the GPU time is read."""
    import torch

    from calibrate.bench import Clock
    from calibrate.plan import TIMINGS

    fn = _FakeGpu(kernel_s, host_s).install(monkeypatch)
    t = Clock(torch.device("cuda")).time(fn, TIMINGS["cuda", False])
    assert t.seconds == pytest.approx(kernel_s, rel=0.02), (t.seconds, kernel_s)


def test_gpu_clock_lengthens_a_sleep_measured_at_an_idle_clock(monkeypatch):
    """A sleep rate measured at an idle clock (an H100 idles at 345 MHz, boosts to 1980) makes every
    lead 5.7x too short, and a 2 us kernel would read 18 us, the host's queueing time. The timer
    sees that the GPU reached a block before the host had queued it and sleeps longer."""
    import torch

    from calibrate.bench import Clock
    from calibrate.plan import TIMINGS

    fn = _FakeGpu(2e-6, 18e-6, cycles_per_s=1.98e9, idle_cycles_per_s=0.345e9).install(monkeypatch)
    clock = Clock(torch.device("cuda"))
    for _ in range(2):  # the second call starts from the lengthened lead
        t = clock.time(fn, TIMINGS["cuda", False])
        assert t.seconds == pytest.approx(2e-6, rel=0.02), t.seconds


@pytest.mark.parametrize("raises", [False, True])
def test_gpu_clock_times_short_calls_as_graph_replays(monkeypatch, raises):
    """A 2 us kernel the host takes 18 us to queue: captured into a graph and replayed, it reads 2 us;
    a call that cannot be captured falls back to the eager timer (and is counted), which reads 2 us too."""
    import torch

    from calibrate.bench import Clock
    from calibrate.plan import TIMINGS

    fake = _FakeGpu(2e-6, 18e-6)
    fn = fake.install(monkeypatch)
    fake.install_graphs(monkeypatch, raises=raises)
    clock = Clock(torch.device("cuda"))
    t = clock.time(fn, TIMINGS["cuda", False], graph=True)
    assert t.seconds == pytest.approx(2e-6, rel=0.05), t.seconds
    assert t.graph is not raises and clock.capture_failures == int(raises)
    rotating = clock.time(fn, TIMINGS["cuda", False], graph=True, cycle=96)  # a rotation of 96 buffer sets
    assert rotating.seconds == pytest.approx(2e-6, rel=0.05) and (raises or rotating.inner % 96 == 0)
