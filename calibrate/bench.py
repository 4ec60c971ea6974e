"""Single-device microbenchmarks with torch: GEMM, HBM copy/triad, flash attention, elementwise
kernels and the AdamW step.

Timing (`Clock`): warm-up calls first (cuBLAS heuristics, the caching allocator, caches), then
`repeats` blocks of back-to-back calls, each block long enough for the timer (CUDA events on a
GPU, recorded around the block on the stream; time.perf_counter on a CPU, where every torch op is
synchronous); the per-call time of each block, and the median over blocks is the measurement.
Median rather than mean or min: robust to a preempted block on a shared machine, and not the
lucky best case the simulator would then promise.

Kernels shorter than the host's cost to launch one (a few microseconds of Python and dispatch;
about 18 us for an eager torch.matmul on the H100 measured) would leave the GPU idle between calls,
and the events would time the host. So on a GPU a call shorter than HOST_BOUND_S is captured into
a CUDA graph where the benchmark allows it (GEMMs, attention forwards, copies, elementwise kernels)
and timed as replays queued back to back. Otherwise each block is queued behind a
`torch.cuda._sleep` that lasts longer than the host takes to queue the block, checked block by block
(the trick of Triton's and nvbench's timers for short kernels): the GPU then runs its calls back to
back, as a training step's stream of kernels runs.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from calibrate.plan import ADAMW_BYTES_PER_PARAM, ELEMENTWISE_WIDTH, AttentionConfig, GemmShape, Rates, Timing
from calibrate.results import Measurement

__all__ = ["Clock", "Measurement", "fp8_supported", "memory_budget", "probe_rates", "run_attention",
           "run_elementwise", "run_gemm", "run_hbm", "run_optimizer", "torch_dtype"]

MAX_INNER = 10_000
HOST_PROBE_CALLS = 8
"""calls timed on the host, unsynchronised, to measure what one costs to queue."""
MAX_QUEUED_CALLS = 256
"""a GPU block's calls, kept well inside CUDA's launch queue (about 1,000 pending kernels) so the
host never waits for a free slot while the sleep runs."""
SLEEP_MARGIN = 1.5
"""the sleep lasts this many times the host's measured queueing time of the block."""
MAX_SLEEP_CYCLES = 2**31 - 1
"""torch.cuda._sleep takes an int64 count; ~1 s at a 2 GHz clock is far beyond any block's queueing."""
MAX_LEAD_SCALE = 8.0
"""the most a late block lengthens every later lead: about an idle-to-boost clock ratio (345 to 1980
MHz on an H100); a block still late beyond it retries on its own, up to MAX_SLEEP_CYCLES."""
ONCE_SAMPLES = 3
MAX_GRAPH_CALLS = 1024
"""calls one graph may capture (a rotation of up to calibrate.bench.MAX_SETS buffer sets fits)."""
GRAPH_WARM_S = 0.02
"""seconds of graph replays before a graph-timed measurement, so it starts on a busy GPU (an H100
read 345 MHz idle and 1980 MHz under load)."""
HOST_BOUND_S = 1e-4
"""calls shorter than this are captured into a CUDA graph where the benchmark allows it: a host
queues a kernel in a few to tens of microseconds."""
_TORCH = {"tf32": torch.float32, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def torch_dtype(dtype: str) -> torch.dtype:
    return _TORCH[dtype]


@dataclass(frozen=True)
class Timed:
    seconds: float
    spread: float
    inner: int
    samples: tuple[float, ...] = field(repr=False)
    graph: bool = False
    """timed as CUDA graph replays (Clock._time_graph)."""


class Clock:
    """Times callables on one device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._cycles_per_s: float | None = None
        self._lead_scale = 1.0
        """grows (x2, up to MAX_LEAD_SCALE) whenever a block's sleep ended before the host had queued it."""
        self.capture_failures = 0
        """calls that asked for a CUDA graph and could not be captured (timed eagerly instead)."""

    def sleep_cycles_per_s(self) -> float:
        """Clock cycles per second of torch.cuda._sleep on this GPU, measured once (~10 ms)."""
        if self._cycles_per_s is None:
            cycles = 10_000_000
            self.sync()
            self._cycles_per_s = cycles / max(self.once(lambda: torch.cuda._sleep(cycles)), 1e-6)
        return self._cycles_per_s

    def host_seconds(self, fn: Callable[[], object]) -> float:
        """What one call costs the host to queue (unsynchronised), per call."""
        self.sync()
        t0 = time.perf_counter()
        for _ in range(HOST_PROBE_CALLS):
            fn()
        host = (time.perf_counter() - t0) / HOST_PROBE_CALLS
        self.sync()
        return host

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def once(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def time(self, fn: Callable[[], object], timing: Timing, *, inner: int | None = None,
             graph: bool = False, cycle: int = 1) -> Timed:
        """The median per-call time of `fn`. `graph`: on a GPU, a call shorter than HOST_BOUND_S is
        captured into a CUDA graph and timed by replaying it (no host in the way), when it can be
        captured. A graph freezes the calls it captured: `fn` that rotates over `cycle` buffer sets
        is captured a multiple of `cycle` times, so every replay visits each set in turn."""
        for _ in range(timing.warmup):
            fn()
        self.sync()
        # the fastest of a few single calls: one sample can be a host stall (an H100 read 111-250 us
        # for a ~3 us GEMM), which would send a short call down the path for long ones
        one = min(self.once(fn) for _ in range(ONCE_SAMPLES)) if inner is None or self.cuda else 0.0
        if self.cuda and graph and one < HOST_BOUND_S:
            timed = self._time_graph(fn, timing, one, cycle)
            if timed is not None:
                return timed
        if inner is None:
            inner = int(min(MAX_INNER, max(1, math.ceil(timing.min_block_s / max(one, 1e-7)))))
        samples = []
        if self.cuda:
            inner = min(inner, MAX_QUEUED_CALLS)
            # a lead for every block: `one` holds the host's launch latency too, so comparing it with
            # the host's queueing time cannot tell which side is slower (an H100's 3.7 us matmul read
            # 18 us, its queueing time, when a lead was skipped on that comparison), and a call that
            # is long on the host as well (an AdamW step: ~90 us of Python however few its
            # parameters) is host-bound at any length; for a long kernel the lead is short anyway
            host = self.host_seconds(fn)
            base_lead = SLEEP_MARGIN * inner * host * self.sleep_cycles_per_s()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(timing.repeats)]
            for start, end in events:
                lead = min(int(base_lead * self._lead_scale), MAX_SLEEP_CYCLES)  # per block: a retry's
                while True:                                                       # doubling stays its own
                    self.sync()
                    if lead:
                        torch.cuda._sleep(lead)
                    start.record()
                    for _ in range(inner):
                        fn()
                    # Self-check, independent of the clock-rate estimate: the block ran back to back
                    # only if the GPU had not yet reached it when the host finished queueing it (a
                    # sleep measured at a low clock, or a host slower than it measured, fails it);
                    # then sleep longer, for this block and, up to a bound, for later ones.
                    late = bool(lead) and start.query()
                    end.record()
                    if not late or lead >= MAX_SLEEP_CYCLES:
                        break
                    lead = min(2 * lead, MAX_SLEEP_CYCLES)
                    self._lead_scale = min(2 * self._lead_scale, MAX_LEAD_SCALE)
            self.sync()
            samples = [start.elapsed_time(end) / 1e3 / inner for start, end in events]
        else:
            for _ in range(timing.repeats):
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                samples.append((time.perf_counter() - t0) / inner)
        return _timed(samples, inner)

    def _time_graph(self, fn: Callable[[], object], timing: Timing, one: float, cycle: int = 1) -> Timed | None:
        """fn captured `inner` times into a CUDA graph; each timed block replays the graph back to back
        (queued, not synchronised) until it lasts timing.min_block_s, after GRAPH_WARM_S of replays
        that keep the GPU busy, so it is timed at the clock of a busy GPU (an H100 idles at 345 MHz
        and boosts to 1980). None when fn cannot be captured (it is then timed eagerly)."""
        inner = int(min(MAX_QUEUED_CALLS, max(16, math.ceil(timing.min_block_s / max(one, 1e-7)))))
        inner = cycle * math.ceil(inner / cycle)
        if inner > MAX_GRAPH_CALLS or self.capture_failures:
            return None  # after one failed capture, no more: the eager timer measures the rest
        g = torch.cuda.CUDAGraph()
        home = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(home)
        pool = torch.cuda.graph_pool_handle()
        try:
            with torch.cuda.stream(side):  # warm-up on the stream that captures, as torch.cuda.graphs asks
                fn()
            with torch.cuda.graph(g, pool=pool, stream=side):
                for _ in range(inner):
                    fn()
        except Exception:  # noqa: BLE001 - not capturable: the eager timer measures it
            torch.cuda.set_stream(home)  # a capture that raised inside can leave its stream current
            try:  # and, in torch 2.11, the allocator still routing to the graph's pool (pytorch#180395)
                torch._C._cuda_endAllocateToPool(self.device.index, pool)
            except Exception:  # noqa: BLE001 - already ended (later torch), or no such function
                pass
            self.sync()
            self.capture_failures += 1
            return None
        home.wait_stream(side)
        self.sync()
        g.replay()  # the first replay uploads the graph
        self.sync()
        per_replay = self.once(g.replay)
        reps = max(1, math.ceil(timing.min_block_s / max(per_replay, 1e-7)))
        for _ in range(max(1, math.ceil(GRAPH_WARM_S / max(per_replay, 1e-7)))):
            g.replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(timing.repeats)]
        for start, end in events:
            start.record()
            for _ in range(reps):
                g.replay()
            end.record()
        self.sync()
        samples = [start.elapsed_time(end) / 1e3 / (reps * inner) for start, end in events]
        del g
        return _timed(samples, reps * inner, graph=True)


def _timed(samples: list[float], inner: int, *, graph: bool = False) -> Timed:
    """The median of the per-call samples, and their interquartile spread relative to it."""
    med = statistics.median(samples)
    q = statistics.quantiles(samples, n=4) if len(samples) >= 2 else [med, med, med]
    return Timed(seconds=med, spread=(q[2] - q[0]) / med if med > 0 else 0.0, inner=inner, samples=tuple(samples),
                 graph=graph)


def _skippable(exc: BaseException) -> bool:
    """Out of memory for one shape: skip it and go on (anything else aborts the calibration)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc))


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- capabilities


def fp8_supported(device: torch.device) -> tuple[bool, str]:
    """(ok, why not): fp8 GEMMs run through torch._scaled_mm on compute capability 8.9+."""
    if device.type != "cuda":
        return False, "fp8 GEMMs need a GPU (torch._scaled_mm on compute capability 8.9+)"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return False, f"fp8 GEMMs need compute capability 8.9+ (this GPU is {cap[0]}.{cap[1]})"
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return False, f"this torch ({torch.__version__}) has no torch._scaled_mm"
    return True, ""


def memory_budget(device: torch.device) -> float:
    """Bytes one benchmark's operands may take: half the free GPU memory; on a CPU a quarter of
    the available RAM, at most 4 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return 0.5 * free
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = 8 * 2**30
    return float(min(0.25 * avail, 4 * 2**30))


# ----------------------------------------------------------------------------- operands


def _gemm_fn(a: torch.Tensor, b: torch.Tensor, dtype: str, out: torch.Tensor | None) -> Callable[[], object]:
    if dtype == "fp8":
        one = torch.ones((), device=a.device, dtype=torch.float32)
        return lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    return lambda: torch.matmul(a, b, out=out)


def _random(numel: int, dtype: str, device: torch.device) -> torch.Tensor:
    """A flat random buffer to slice operands from (fp8: e4m3, the forward-pass format)."""
    if dtype == "fp8":
        return torch.randn(numel, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    return torch.randn(numel, device=device, dtype=torch_dtype(dtype))


def flush_bytes(device: torch.device) -> int:
    """Bytes a rotation of buffers should span so repeated calls do not hit the last-level cache:
    twice the GPU's L2, or twice the CPU's L3 (sysfs), 64 MiB where unknown."""
    if device.type == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 * 2**20
        return 2 * int(l2)
    try:
        text = open("/sys/devices/system/cpu/cpu0/cache/index3/size").read().strip()
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        l3 = int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)
        return max(2 * l3, 64 * 2**20)
    except (OSError, ValueError, IndexError):
        return 64 * 2**20


MAX_SETS = 1024
"""Buffer sets a call rotates over, at most: 1,024 x 96 KiB (the smallest GEMM's, 128^3 in bf16: A, B
and C) = 96 MiB, past an H100's 50 MB L2; 1,024 x 3 x 64 KiB for the smallest copy."""


def _operands(pool: torch.Tensor, s: GemmShape, dtype: str, *, pool_b: torch.Tensor | None = None,
              index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A (m x k) and B (k x n) of `s`, the `index`-th set of each: A from `pool`, B from `pool_b`
    (default the same pool, as the probes take them)."""
    mk, kn = s.m * s.k, s.k * s.n
    a = pool[index * mk: (index + 1) * mk].view(s.m, s.k)
    pool_b = pool if pool_b is None else pool_b
    b = pool_b[index * kn: (index + 1) * kn]
    if dtype == "fp8":  # torch._scaled_mm wants the second operand column-major
        return a, b.view(s.n, s.k).t()
    return a, b.view(s.k, s.n)


def _sets(set_bytes: float, span: int, budget: float) -> int:
    """How many copies of a call's operands (`set_bytes` each) the call rotates over, so that every
    call reads its operands from memory rather than from the last-level cache: enough to span `span`
    bytes (flush_bytes), at most MAX_SETS and what `budget` holds, at least one."""
    return int(max(1, min(MAX_SETS, math.ceil(span / set_bytes), budget // set_bytes)))


def _rotating(fns: list[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs the next of `fns` at each call (a buffer rotation; Clock.time's
    `cycle` is len(fns))."""
    if len(fns) == 1:
        return fns[0]
    state = {"i": 0}

    def call():
        i = state["i"] = (state["i"] + 1) % len(fns)
        return fns[i]()

    return call


class _tf32:
    """TF32 tensor cores for fp32 matmuls on a GPU while inside (what fp32 training enables)."""

    def __init__(self, device: torch.device, on: bool) -> None:
        self.active = on and device.type == "cuda"

    def __enter__(self):
        if self.active:
            self.saved = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        if self.active:
            torch.backends.cuda.matmul.allow_tf32 = self.saved


# ----------------------------------------------------------------------------- probes


def _probe(clock: Clock, make: Callable[[int], tuple[Callable[[], object], float]], sizes, target_s: float) -> float:
    """work / time of the first size in `sizes` whose call lasts target_s (or of the last)."""
    probe = Timing(warmup=1, repeats=3, min_block_s=0.0, max_kernel_s=target_s)
    rate = 0.0
    for size in sizes:
        fn, work = make(size)
        t = clock.time(fn, probe, inner=1).seconds
        rate = work / max(t, 1e-9)
        del fn
        if t >= target_s:
            break
    return rate


def probe_rates(device: torch.device, dtypes: tuple[str, ...], clock: Clock, *, budget_s: float) -> Rates:
    """A few calls per kind, growing until a call lasts budget_s / 4: the device's speed, to size
    the sweep (plan.build_plan)."""
    target = budget_s / 4
    gemm = {}
    for dt in dtypes:
        def make(n, dt=dt):
            pool = _random(n * n, dt, device)
            a, b = _operands(pool, GemmShape(m=n, n=n, k=n, origin="probe"), dt)
            out = None if dt == "fp8" else torch.empty(n, n, device=device, dtype=torch_dtype(dt))
            return _gemm_fn(a, b, dt, out), 2.0 * n**3

        with _tf32(device, dt == "tf32"):
            gemm[dt] = _probe(clock, make, [2**e for e in range(7, 15)], target)

    def copy(nbytes):
        src = torch.empty(nbytes // 4, device=device).fill_(1.0)
        dst = torch.empty_like(src)
        return (lambda: dst.copy_(src)), 2.0 * nbytes

    memory = _probe(clock, copy, [2**e for e in range(20, 31)], target)

    def attention(seq):
        q = torch.randn(1, 8, seq, 64, device=device, dtype=torch.bfloat16)
        return (lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)), 2.0 * 8 * seq * seq * 64

    with torch.no_grad():
        attn = _probe(clock, attention, [2**e for e in range(7, 15)], target)
    _free(device)
    return Rates(gemm=gemm, memory=memory, attention=attn, memory_budget=memory_budget(device))


# ----------------------------------------------------------------------------- GEMM


def run_gemm(shapes, dtype: str, *, device: torch.device, clock: Clock, timing: Timing, progress,
             notes: list[str], budget: float | None = None) -> list[Measurement]:
    """torch.matmul (torch._scaled_mm for fp8) on each shape. A and B come from separate buffers and
    rotate over as many sets as span flush_bytes (_sets), each with its own output: a training step
    reads a layer's weights long after it last touched them, so a benchmark whose operands sat in
    the L2 between calls (an H100's holds 50 MB) would time them faster than any step runs them."""
    if not shapes:
        return []
    span = flush_bytes(device)
    budget = memory_budget(device) if budget is None else budget
    elem = 1 if dtype == "fp8" else torch_dtype(dtype).itemsize
    # every shape's rotation fits: its sets span at most span + one set of each operand
    pool_a = _random(max(s.m * s.k for s in shapes) + span // elem, dtype, device)
    pool_b = _random(max(s.k * s.n for s in shapes) + span // elem, dtype, device)
    out_dtype = torch.bfloat16 if dtype == "fp8" else torch_dtype(dtype)
    out_elem = torch.tensor([], dtype=out_dtype).element_size()
    results = []
    with _tf32(device, dtype == "tf32"):
        for s in shapes:
            progress.step(f"gemm {dtype} {s.m}x{s.n}x{s.k} ({s.origin})")
            sets = min(_sets((s.m * s.k + s.k * s.n) * elem + s.m * s.n * out_elem, span, budget),
                       pool_a.numel() // (s.m * s.k), pool_b.numel() // (s.k * s.n))
            fns = outs = None
            try:
                outs = None if dtype == "fp8" else torch.empty(sets, s.m, s.n, device=device, dtype=out_dtype)
                fns = [_gemm_fn(*_operands(pool_a, s, dtype, pool_b=pool_b, index=i), dtype,
                                None if outs is None else outs[i]) for i in range(sets)]
                t = clock.time(_rotating(fns), timing, graph=True, cycle=sets)
            except Exception as exc:
                if not _skippable(exc):
                    raise
                fns = outs = None  # the closures hold the outputs and operand views: let them go
                _free(device)
                notes.append(f"gemm {dtype} {s.m}x{s.n}x{s.k}: out of memory, skipped")
                continue
            fns = outs = None
            results.append(Measurement(kind="gemm", op="matmul" if dtype != "fp8" else "_scaled_mm", dtype=dtype,
                                       params=dict(m=s.m, n=s.n, k=s.k, buffers=sets), work=s.flops, seconds=t.seconds,
                                       spread=t.spread, repeats=timing.repeats, inner=t.inner, origin=s.origin,
                                       graph=t.graph))
    del pool_a, pool_b
    _free(device)
    return results


# ----------------------------------------------------------------------------- HBM


def run_hbm(sizes, *, device: torch.device, clock: Clock, timing: Timing, progress, budget: float) -> list[Measurement]:
    """Copy (b = a: 2 x size bytes moved) and triad (a = b + 2c: 3 x size), STREAM's kernels
    (McCalpin 1995), each over a rotation of buffers spanning flush_bytes so the data comes from
    memory, not the cache."""
    results = []
    span = flush_bytes(device)
    for size in sizes:
        n = max(1, size // 4)
        sets = _sets(3 * size, span, budget)
        bufs = torch.empty(sets, 3, n, device=device).fill_(1.0)
        copy = _rotating([lambda a=a, b=b: b.copy_(a) for a, b, _ in bufs])
        triad = _rotating([lambda a=a, b=b, c=c: torch.add(b, c, alpha=2.0, out=a) for a, b, c in bufs])
        for kind, fn, passes in (("copy", copy, 2), ("triad", triad, 3)):
            progress.step(f"hbm {kind} {size / 2**20:.2f} MiB")
            t = clock.time(fn, timing, graph=True, cycle=sets)
            results.append(Measurement(kind=kind, op=kind, dtype="fp32", params=dict(bytes=4 * n, buffers=sets),
                                       work=float(passes * 4 * n), seconds=t.seconds, spread=t.spread,
                                       repeats=timing.repeats, inner=t.inner, graph=t.graph))
        del bufs, copy, triad
    _free(device)
    return results


# ----------------------------------------------------------------------------- attention


def sdpa_backend(q, k, v) -> str:
    """The kernel torch's scaled_dot_product_attention picks for these inputs (causal), as
    torch.nn.attention.SDPBackend names it (CUDNN_ATTENTION, FLASH_ATTENTION, ...); '' where
    this torch cannot say. torch._fused_sdp_choice is the dispatcher's own choice function."""
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(int(torch._fused_sdp_choice(q, k, v, is_causal=True))).name
    except Exception:  # noqa: BLE001 - a private function: absent or changed in some torch
        return ""


def run_attention(configs: tuple[AttentionConfig, ...], *, device: torch.device, clock: Clock, timing: Timing,
                  progress, notes: list[str]) -> list[Measurement]:
    """torch.nn.functional.scaled_dot_product_attention, causal, bf16, forward and backward
    (torch picks its fused kernel: FlashAttention-2 or cuDNN on a GPU, its flash CPU kernel on a
    CPU). FLOPs by hwmodels.compute.attention_flops (the FlashAttention papers' convention)."""
    from hwmodels.compute import attention_flops

    results = []
    for c in configs:
        shape = (c.batch, c.heads, c.seq, c.head_dim)
        try:
            q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            backend = sdpa_backend(q, k, v)
            for backward in (False, True):
                progress.step(f"attention {'bwd' if backward else 'fwd'} b{c.batch} h{c.heads} s{c.seq} d{c.head_dim}")
                if backward:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    grad = torch.randn_like(out)

                    def fn(out=out, grad=grad, inputs=(q, k, v)):
                        return torch.autograd.grad(out, inputs, grad, retain_graph=True)

                    t = clock.time(fn, timing)
                    del out, grad
                else:
                    with torch.no_grad():
                        t = clock.time(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True), timing,
                                       graph=True)
                flops = attention_flops(**c.kwargs(), backward=backward)
                results.append(Measurement(kind="attention_bwd" if backward else "attention_fwd", op="sdpa",
                                           dtype="bf16", params=c.kwargs(), work=flops, seconds=t.seconds,
                                           spread=t.spread, repeats=timing.repeats, inner=t.inner, graph=t.graph,
                                           origin=backend))
            del q, k, v
        except Exception as exc:
            if not _skippable(exc):
                raise
            notes.append(f"attention s{c.seq} d{c.head_dim}: out of memory, skipped")
        _free(device)
    return results


# ----------------------------------------------------------------------------- elementwise


def _elementwise_params(op: str, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The op's inputs besides x: a norm's weight (and LayerNorm's bias), SwiGLU's up half."""
    width = x.shape[-1]
    if op == "layernorm":
        return torch.ones(width, device=x.device, dtype=x.dtype), torch.zeros(width, device=x.device, dtype=x.dtype)
    if op == "rmsnorm":
        return (torch.ones(width, device=x.device, dtype=x.dtype),)
    if op in ("softmax", "gelu"):
        return ()
    if op == "swiglu":
        return (torch.randn_like(x),)
    raise ValueError(f"unknown elementwise op {op!r}")


def _elementwise_apply(op: str, x: torch.Tensor, params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The op on x (and its _elementwise_params), as torch eager runs it."""
    if op == "layernorm":
        return F.layer_norm(x, (x.shape[-1],), *params)
    if op == "rmsnorm":
        return F.rms_norm(x, (x.shape[-1],), *params)
    if op == "softmax":
        return torch.softmax(x, dim=-1)
    if op == "gelu":
        return F.gelu(x, approximate="tanh")
    return F.silu(x) * params[0]  # swiglu: silu(gate) * up


def _elementwise(op: str, n: int, device: torch.device, sets: int = 1) -> tuple[Callable[[], object], list[float]]:
    """The op on n bf16 elements as (rows, 4096), rotating over `sets` inputs (_sets), and the bytes
    each kernel torch eager launches for it moves (what hwmodels.compute.memory_bound_time is
    checked against)."""
    width = min(ELEMENTWISE_WIDTH, n)
    rows = max(1, n // width)
    e = 2  # bf16
    xs = torch.randn(sets, rows, width, device=device, dtype=torch.bfloat16)
    nbytes = float(rows * width * e)
    fns = [lambda x=x, params=_elementwise_params(op, x): _elementwise_apply(op, x, params) for x in xs]
    # swiglu unfused: silu reads and writes f, the product reads 2f, writes f; the rest read and write once
    return _rotating(fns), ([2 * nbytes, 3 * nbytes] if op == "swiglu" else [2 * nbytes])


def _elementwise_backward(op: str, n: int, device: torch.device, sets: int = 1) -> Callable[[], object]:
    """The backward alone of the op on n bf16 elements, as _elementwise shapes them: the forward run
    once per set with its graph kept, each call the gradients of the inputs (and of a norm's weight
    and bias) for a fixed output gradient, as Liger-Kernel's benchmarks time a backward
    (y.backward(dy, retain_graph=True))."""
    width = min(ELEMENTWISE_WIDTH, n)
    rows = max(1, n // width)
    calls = []
    for _ in range(sets):
        x = torch.randn(rows, width, device=device, dtype=torch.bfloat16).requires_grad_()
        params = tuple(t.requires_grad_() for t in _elementwise_params(op, x.detach()))
        y = _elementwise_apply(op, x, params)
        dy = torch.randn_like(y)
        calls.append(lambda y=y, inputs=(x, *params), dy=dy: torch.autograd.grad(y, inputs, dy, retain_graph=True))
    return _rotating(calls)


def run_elementwise(items, *, device: torch.device, clock: Clock, timing: Timing, progress,
                    budget: float | None = None) -> list[Measurement]:
    """Norms, softmax and activations, forward and then backward alone (kind elementwise_bwd, its
    work the forward's bytes: the check is the ratio of the two times), each over inputs rotated
    past the last-level cache (_sets:
    a kernel's input in a training step is the previous kernel's output, but one of a size worth
    timing, an activation of thousands of tokens, is long out of the L2 by the time its backward
    reads it)."""
    span = flush_bytes(device)
    budget = memory_budget(device) if budget is None else budget
    results = []
    with torch.no_grad():
        for op, n in items:
            progress.step(f"elementwise {op} {n} elements")
            inputs = 2 if op == "swiglu" else 1
            sets = _sets(inputs * 2 * n, span, budget)
            fn, kernels = _elementwise(op, n, device, sets)
            t = clock.time(fn, timing, graph=True, cycle=sets)
            results.append(Measurement(kind="elementwise", op=op, dtype="bf16",
                                       params=dict(elements=n, kernels=kernels, buffers=sets),
                                       work=float(sum(kernels)), seconds=t.seconds, spread=t.spread,
                                       repeats=timing.repeats, inner=t.inner, graph=t.graph))
            del fn
            # the backward, timed eagerly behind the sleep lead (autograd is not captured); each set
            # keeps its forward's saved tensors, output and output gradient besides the inputs
            progress.step(f"elementwise {op} backward {n} elements")
            sets = _sets(inputs * 4 * 2 * n, span, budget)
            with torch.enable_grad():
                fn = _elementwise_backward(op, n, device, sets)
                t = clock.time(fn, timing, cycle=sets)
            results.append(Measurement(kind="elementwise_bwd", op=op, dtype="bf16",
                                       params=dict(elements=n, kernels=kernels, buffers=sets),
                                       work=float(sum(kernels)), seconds=t.seconds, spread=t.spread,
                                       repeats=timing.repeats, inner=t.inner, graph=t.graph))
            del fn
    _free(device)
    return results


def run_optimizer(sizes, *, device: torch.device, clock: Clock, timing: Timing, progress,
                  notes: list[str]) -> list[Measurement]:
    """torch.optim.AdamW.step on one fp32 parameter of n elements, fused where torch has it for the
    device (foreach otherwise, said in the notes)."""
    results = []
    for n in sizes:
        progress.step(f"adamw step {n} parameters")
        p = torch.nn.Parameter(torch.randn(n, device=device))
        p.grad = torch.randn_like(p)
        try:
            opt, impl = torch.optim.AdamW([p], lr=1e-4, fused=True), "fused"
            opt.step()
        except (RuntimeError, TypeError, ValueError) as exc:
            opt, impl = torch.optim.AdamW([p], lr=1e-4, foreach=True), "foreach"
            note = f"AdamW fused is unavailable on {device.type} ({str(exc).splitlines()[0]}); timed foreach"
            if note not in notes:
                notes.append(note)
        t = clock.time(opt.step, timing)
        results.append(Measurement(kind="optimizer", op=f"adamw-{impl}", dtype="fp32",
                                   params=dict(parameters=n, kernels=[float(ADAMW_BYTES_PER_PARAM * n)]),
                                   work=float(ADAMW_BYTES_PER_PARAM * n), seconds=t.seconds, spread=t.spread,
                                   repeats=timing.repeats, inner=t.inner))
        del opt, p
    _free(device)
    return results
