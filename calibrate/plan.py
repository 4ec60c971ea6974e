"""What a calibration runs: GEMM shapes, copy sizes, attention and elementwise configurations and
collective message sizes, scaled to the device's measured speed so that one sweep definition
fits an H100 and a laptop CPU alike. Pure Python (no torch): the plan is built from `Rates`
(a short probe on the device, or a profile's own predictions) and can be costed before it runs.

GEMM shapes are the ones training issues: for every bundled model preset
(paraplan/presets/models.yaml) at tensor-parallel degrees 1-8 and micro-batch x sequence of 2k-8k
tokens, the per-layer linear layers as the simulator costs them (simulator/workload.py: QKV and
MLP-up column-parallel, attention projection and MLP-down row-parallel, the vocabulary-parallel LM
head, MoE experts at their routed token counts), each forward (tokens x k @ k x n), backward-data
(tokens x n @ n x k) and backward-weight (k x tokens @ tokens x n). A shape too slow for the
device's time budget is halved along its largest dimension until it fits (recorded as
`scale 1/2^j`), which keeps its aspect ratio; a spread of them over the device's FLOP range is
chosen, plus a regular grid of squares.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import numpy as np
import yaml

from hwmodels.compute import ATTENTION_HIDDEN, ATTENTION_TOKENS

__all__ = ["AttentionConfig", "GemmShape", "Plan", "Rates", "Timing", "build_plan", "collective_sizes",
           "estimate_seconds", "gemm_pool", "rates_from_profile", "select_gemm_shapes"]

TOKENS = (2048, 4096, 8192)
"""micro_batch_size x seq_length of the training shapes (mbs 1-2 at 2k-4k, the common plans)."""
TP_DEGREES = (1, 2, 4, 8)
EP_DEGREES = (1, 8)
GRID_EXPONENTS = tuple(range(7, 16))
"""Square grid 128^3 .. 32768^3 (as far as the time budget allows)."""
MIN_DIM = 16
"""Halving stops here (tensor-core tiles want multiples of 16)."""


@dataclass(frozen=True, kw_only=True)
class Timing:
    warmup: int
    """calls before timing (cuBLAS heuristics, allocator, caches)."""
    repeats: int
    """timed blocks; the measurement is their median."""
    min_block_s: float
    """a block repeats the call back to back until it lasts this long (timer resolution, launch overhead)."""
    max_kernel_s: float
    """the budget of one call: bigger shapes are scaled down."""


TIMINGS = {
    # (device, quick) -> Timing. CUDA events resolve ~0.5 us, so short blocks suffice on a GPU;
    # on a CPU perf_counter and a shared machine want longer ones.
    ("cuda", True): Timing(warmup=2, repeats=5, min_block_s=2e-4, max_kernel_s=0.02),
    ("cuda", False): Timing(warmup=5, repeats=15, min_block_s=1e-3, max_kernel_s=0.1),
    ("cpu", True): Timing(warmup=1, repeats=5, min_block_s=1e-3, max_kernel_s=0.004),
    ("cpu", False): Timing(warmup=3, repeats=11, min_block_s=5e-3, max_kernel_s=0.05),
}

COUNTS = {
    # quick -> preset GEMM shapes and grid squares per dtype, attention sequence lengths per head
    # dim, head dims, HBM buffer size step (a power-of-two exponent), elementwise sizes, optimizer
    # sizes, collective message size step (exponent)
    True: dict(gemm=24, grid=6, seqs=4, head_dims=(64, 128), hbm_step=2, elementwise=3, optimizer=2, coll_step=2),
    False: dict(gemm=96, grid=16, seqs=8, head_dims=(64, 128, 256), hbm_step=1, elementwise=6, optimizer=4,
                coll_step=1),
}

SEQ_LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Attention sequence lengths; a plan takes `seqs` of those the device runs within its budget,
evenly spread and the longest included."""
# the attention sweep runs the FlashAttention-2/3 benchmark grid (hwmodels.compute.ATTENTION_TOKENS /
# ATTENTION_HIDDEN), causal, as the simulator's calls are (the bundled FlashAttention-2 knots are
# non-causal figures, which causal calls of twice their sequence read: attention_curve_flops)

ELEMENTWISE = ("layernorm", "rmsnorm", "softmax", "gelu", "swiglu")
ELEMENTWISE_WIDTH = 4096
MAX_ELEMENTWISE = 2**28
"""elements: 512 MiB of bf16 activations, above any one layer's on a GPU."""
MAX_PARAMS = 2**28
"""parameters in one AdamW step: a 4.3B-parameter model's shard on 16 ranks."""
ADAMW_BYTES_PER_PARAM = 28
"""fp32 AdamW: reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq (7 x 4 bytes)."""


@dataclass(frozen=True, kw_only=True)
class Rates:
    """How fast the device is, to size the sweep: from a probe (bench.probe_rates) or a profile."""

    gemm: dict[str, float]
    """dtype -> FLOP/s of a medium square GEMM."""
    memory: float
    """bytes/s of a large copy."""
    attention: float
    """FLOP/s of a medium flash-attention forward."""
    memory_budget: float = 4 * 2**30
    """bytes the operands of one benchmark may take."""


@dataclass(frozen=True, kw_only=True)
class GemmShape:
    m: int
    n: int
    k: int
    origin: str
    """e.g. 'llama3-8b tp2 t4096 qkv fwd', the same with ' scale 1/8' when halved, 'grid'."""
    kind: str = "grid"
    """the layer and pass, e.g. 'qkv fwd' (selection spreads over kinds)."""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    batch: int
    heads: int
    seq: int
    head_dim: int

    def kwargs(self) -> dict:
        """hwmodels.compute.attention_time's shape arguments."""
        return dict(batch=self.batch, heads=self.heads, q_len=self.seq, kv_len=self.seq, head_dim=self.head_dim,
                    causal=True)


@dataclass(frozen=True, kw_only=True)
class Plan:
    device: str
    quick: bool
    timing: Timing
    gemm: dict[str, tuple[GemmShape, ...]]
    hbm_sizes: tuple[int, ...]
    """bytes of one buffer; a copy moves 2x, a triad 3x."""
    attention: tuple[AttentionConfig, ...]
    elementwise: tuple[tuple[str, int], ...]
    """(op, elements of its input)."""
    optimizer: tuple[int, ...]
    """parameter counts of the AdamW step."""
    collective_sizes: tuple[int, ...] = ()
    """bytes (nccl-tests convention) per collective."""


# ----------------------------------------------------------------------------- GEMM shapes


def _models() -> dict[str, dict]:
    """The bundled model presets with the loader's derived defaults filled in (models.yaml header)."""
    raw = yaml.safe_load(resources.files("paraplan.presets").joinpath("models.yaml").read_text(encoding="utf-8"))
    out = {}
    for name, m in raw.items():
        m = dict(m)
        m.setdefault("num_kv_heads", m["num_attention_heads"])
        m.setdefault("head_dim", m["hidden_size"] // m["num_attention_heads"])
        m.setdefault("ffn_hidden_size", 4 * m["hidden_size"])
        out[name] = m
    return out


def _linears(m: dict, tp: int, tokens: int) -> list[tuple[str, int, int, int]]:
    """(label, tokens, k, n) of one rank's linear layers, as simulator/workload.py shapes them."""
    h, heads, kv, d = m["hidden_size"], m["num_attention_heads"], m["num_kv_heads"], m["head_dim"]
    if heads % tp or (kv % tp and kv >= tp):
        return []
    mats = 3 if m.get("activation") == "swiglu" else 2
    out = [("qkv", tokens, h, (heads + 2 * kv) * d // tp), ("proj", tokens, heads * d // tp, h)]
    moe = m.get("moe")
    if moe is None or moe.get("first_dense_layers", 0) > 0:
        f = m["ffn_hidden_size"] // tp
        out += [("mlp-up", tokens, h, (mats - 1) * f), ("mlp-down", tokens, f, h)]
    if moe is not None:
        f = moe["expert_ffn_hidden_size"]
        for ep in EP_DEGREES:
            routed = tokens * moe["top_k"] * ep // moe["num_experts"]
            if routed >= MIN_DIM:
                out += [(f"expert-up ep{ep}", routed, h, (mats - 1) * f), (f"expert-down ep{ep}", routed, f, h)]
    if m["vocab_size"] % tp == 0:
        out.append(("lm-head", tokens, h, m["vocab_size"] // tp))
    return out


def gemm_pool() -> list[GemmShape]:
    """Every training GEMM of the bundled presets (deduplicated by shape), forward and backward."""
    seen: dict[tuple[int, int, int], GemmShape] = {}
    for name, model in _models().items():
        for tp in TP_DEGREES:
            for tokens in TOKENS:
                for label, t, k, n in _linears(model, tp, tokens):
                    base = f"{name} tp{tp} t{tokens} {label}"
                    for (mm, nn, kk), pas in (((t, n, k), "fwd"), ((t, k, n), "dgrad"), ((k, n, t), "wgrad")):
                        seen.setdefault((mm, nn, kk), GemmShape(m=mm, n=nn, k=kk, origin=f"{base} {pas}",
                                                                kind=f"{label.split()[0]} {pas}"))
    return list(seen.values())


def _halved(s: GemmShape) -> GemmShape | None:
    """`s` with its largest dimension halved, rounded down to a multiple of 16 (tensor-core tiles,
    and torch._scaled_mm's rule for fp8); None below MIN_DIM."""
    dims = [s.m, s.n, s.k]
    i = int(np.argmax(dims))
    half = dims[i] // 2 // 16 * 16
    if half < MIN_DIM:
        return None
    dims[i] = half
    return GemmShape(m=dims[0], n=dims[1], k=dims[2], origin=s.origin, kind=s.kind)


def _gemm_bytes(s: GemmShape, elem: int) -> int:
    return (s.m * s.k + s.k * s.n + s.m * s.n) * elem


def _candidates(pool: list[GemmShape], lo: float, hi: float, max_bytes: float, elem: int) -> list[tuple[GemmShape, int]]:
    """(shape, halvings) for every pool shape and its halvings with lo <= FLOPs <= hi."""
    out, seen = [], set()
    for s in pool:
        j, cur = 0, s
        while cur is not None and cur.flops >= lo:
            key = (cur.m, cur.n, cur.k)
            fp8_ok = elem != 1 or (cur.n % 16 == 0 and cur.k % 16 == 0)
            if cur.flops <= hi and _gemm_bytes(cur, elem) <= max_bytes and key not in seen and fp8_ok:
                seen.add(key)
                origin = s.origin if j == 0 else f"{s.origin} scale 1/{2**j}"
                out.append((GemmShape(m=cur.m, n=cur.n, k=cur.k, origin=origin, kind=s.kind), j))
            cur, j = _halved(cur), j + 1
    return out


def select_gemm_shapes(pool: list[GemmShape], count: int, *, lo: float, hi: float, max_bytes: float,
                       elem: int) -> list[GemmShape]:
    """`count` shapes spread evenly over log FLOPs in [lo, hi] (deterministic): for each target,
    among the candidates within half a bin of it, the least used layer kind (qkv fwd, lm-head
    wgrad, ...), then the fewest halvings, then the nearest; the nearest overall if none is that near."""
    cands = _candidates(pool, lo, hi, max_bytes, elem)
    if not cands or count <= 0:
        return []
    logf = np.array([math.log10(s.flops) for s, _ in cands])
    halvings = np.array([j for _, j in cands], float)
    names = sorted({s.kind for s, _ in cands})
    kind = np.array([names.index(s.kind) for s, _ in cands])
    used = np.zeros(len(names))
    taken = np.zeros(len(cands), bool)
    targets = np.linspace(logf.min(), logf.max(), count)
    half_bin = (targets[1] - targets[0]) / 2 if count > 1 else np.inf
    chosen = []
    for target in targets:
        dist = np.where(taken, np.inf, np.abs(logf - target))
        if not np.isfinite(dist.min()):
            break
        near = dist <= max(half_bin, dist.min())
        key = np.where(near, used[kind] * 1e6 + halvings * 1e3 + dist, np.inf)
        i = int(np.argmin(key))
        taken[i] = True
        used[kind[i]] += 1
        chosen.append(cands[i][0])
    return sorted(chosen, key=lambda s: s.flops)


def grid_shapes(count: int, *, lo: float, hi: float, max_bytes: float, elem: int) -> list[GemmShape]:
    """Up to `count` squares 2^i cubed inside the budget, evenly spread over those that fit."""
    fits = [GemmShape(m=2**e, n=2**e, k=2**e, origin="grid") for e in GRID_EXPONENTS]
    fits = [s for s in fits if lo <= s.flops <= hi and _gemm_bytes(s, elem) <= max_bytes]
    if len(fits) <= count:
        return fits
    idx = np.unique(np.round(np.linspace(0, len(fits) - 1, count)).astype(int))
    return [fits[i] for i in idx]


# ----------------------------------------------------------------------------- the plan

ELEM_BYTES = {"tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def build_plan(*, device: str, quick: bool, dtypes: tuple[str, ...], rates: Rates,
               collective_max_bytes: int = 0) -> Plan:
    """The sweep for a device whose speed `rates` describes; every call's predicted time within
    the mode's max_kernel_s, every benchmark's operands within rates.memory_budget."""
    timing = TIMINGS[(device, quick)]
    c = COUNTS[quick]
    budget = timing.max_kernel_s
    pool = gemm_pool()
    gemm = {}
    for dt in dtypes:
        rate = rates.gemm[dt]
        hi = rate * budget
        lo = min(2.0 * 128**3, hi / 8)
        shapes = select_gemm_shapes(pool, c["gemm"], lo=lo, hi=hi, max_bytes=rates.memory_budget / 2,
                                    elem=ELEM_BYTES[dt])
        seen = {(s.m, s.n, s.k) for s in shapes}
        grid = [g for g in grid_shapes(c["grid"], lo=lo, hi=hi, max_bytes=rates.memory_budget / 2, elem=ELEM_BYTES[dt])
                if (g.m, g.n, g.k) not in seen]
        gemm[dt] = tuple(sorted(shapes + grid, key=lambda s: s.flops))

    # HBM: buffers of 64 KiB up to what one call may move in the budget (a copy moves 2x its buffer).
    top = min(rates.memory * budget / 2, rates.memory_budget / 8)
    hbm = tuple(2**e for e in range(16, 32, c["hbm_step"]) if 2**e <= top) or (2**16,)

    attention = []
    for d in c["head_dims"]:
        attention += _attention_configs(d, c["seqs"], rates, budget)

    # Elementwise: activations of tokens x 4096 (bf16), the sizes spread up to the budget.
    el_top = max(2**12, int(min(rates.memory * budget / 10, rates.memory_budget / 12, MAX_ELEMENTWISE)))
    el_sizes = _geometric(2**16, el_top, c["elementwise"])
    elementwise = tuple((op, n) for op in ELEMENTWISE for n in el_sizes)
    opt_top = max(2**12, int(min(rates.memory * budget / ADAMW_BYTES_PER_PARAM, rates.memory_budget / 32, MAX_PARAMS)))
    optimizer = tuple(_geometric(2**14, opt_top, c["optimizer"]))

    coll = collective_sizes(quick, collective_max_bytes) if collective_max_bytes else ()
    return Plan(device=device, quick=quick, timing=timing, gemm=gemm, hbm_sizes=hbm, attention=tuple(attention),
                elementwise=elementwise, optimizer=optimizer, collective_sizes=coll)


def collective_sizes(quick: bool, max_bytes: int) -> tuple[int, ...]:
    """Message sizes from 1 KiB up to max_bytes, x4 apart (--quick) or x2 (nccl-tests' -f 2)."""
    return tuple(2**e for e in range(10, 40, COUNTS[quick]["coll_step"]) if 2**e <= max_bytes)


def _geometric(lo: int, hi: int, count: int) -> list[int]:
    """`count` powers of two from lo up to the largest one <= hi (fewer where the range is short)."""
    top = max(int(math.floor(math.log2(hi))), 0)
    bottom = min(int(math.ceil(math.log2(lo))), top)
    return [int(2**e) for e in np.unique(np.round(np.linspace(bottom, top, count)).astype(int))]


def _attention_configs(head_dim: int, count: int, rates: Rates, budget: float) -> list[AttentionConfig]:
    """Up to `count` sequence lengths of the FlashAttention benchmark grid at `head_dim`, scaled
    to the device: the longest sequence whose single-head backward (2.5x the forward's FLOPs) fits
    the budget (the shortest, with one head, however slow the device), then the grid's tokens
    (batch x seq) and hidden size (heads x head_dim) halved for every sequence alike until that
    longest one fits, so FLOPs still grow with the sequence length as on the full grid (forward
    FLOPs = 2 x tokens x hidden x seq, causal)."""
    limit = rates.attention * budget / 2.5

    def fits(tokens: int, hidden: int, seq: int) -> bool:
        return 2.0 * tokens * hidden * seq <= limit and 3 * 2 * tokens * hidden <= rates.memory_budget

    seqs = [s for s in SEQ_LENGTHS if fits(s, head_dim, s)] or [SEQ_LENGTHS[0]]  # one head of the shortest at least
    longest = seqs[-1]
    tokens, hidden = ATTENTION_TOKENS, ATTENTION_HIDDEN
    while not fits(tokens, hidden, longest):
        if tokens > longest:
            tokens //= 2
        elif hidden > head_dim:
            hidden //= 2
        else:
            break
    seqs = [s for s in seqs if s <= tokens]
    pick = sorted({int(i) for i in np.round(np.linspace(len(seqs) - 1, 0, count))})
    return [AttentionConfig(batch=tokens // seqs[i], heads=max(1, hidden // head_dim), seq=seqs[i], head_dim=head_dim)
            for i in pick]


# ----------------------------------------------------------------------------- costing a plan


def rates_from_profile(profile, dtypes: tuple[str, ...], *, memory_budget: float) -> Rates:
    """The rates a probe would measure on the profile's GPU (medium shapes: 4096^3 GEMM, 256 MiB
    copy, seq 4096 attention), from its own efficiency curves."""
    from hwmodels.compute import attention_flops

    flops = 2.0 * 4096**3
    attn = attention_flops(batch=4, heads=16, q_len=4096, kv_len=4096, head_dim=128, causal=True, backward=False)
    return Rates(
        gemm={d: profile.peak(d) * profile.gemm_curve(d)(flops) for d in dtypes},
        memory=profile.hbm_bandwidth * profile.hbm_efficiency(2 * 2**28),
        attention=profile.peak("bf16") * profile.attention_fwd_efficiency(attn),
        memory_budget=memory_budget,
    )


PER_ITEM_OVERHEAD = {"cuda": 5e-3, "cpu": 1e-3}
"""seconds of Python, allocation and synchronisation around each benchmark item (an estimate)."""
STARTUP = {"cuda": 20.0, "cpu": 5.0}
"""seconds before the first benchmark: importing torch, creating the CUDA context and the cuBLAS
and cuDNN handles, the speed probe, and the fits after the last one (an estimate)."""


def estimate_seconds(plan: Plan, profile, *, ranks: int = 1) -> float:
    """Predicted wall time of `plan` on the GPU `profile` describes (the hwmodels kernel times of
    every call, warm-up, sizing and repeats included, plus a per-item overhead); what
    `--quick` promises ("under 2 minutes on an H100") is checked against this."""
    from hwmodels.compute import attention_time, gemm_time, memory_bound_time

    t = plan.timing
    over = PER_ITEM_OVERHEAD[plan.device]

    def item(kernel: float) -> float:
        inner = max(1, math.ceil(t.min_block_s / max(kernel, 1e-9)))
        return (t.warmup + 1 + t.repeats * inner) * kernel + over

    total = STARTUP[plan.device]
    for dt, shapes in plan.gemm.items():
        total += sum(item(gemm_time(profile, s.m, s.n, s.k, dt)) for s in shapes)
    for n in plan.hbm_sizes:
        total += item(memory_bound_time(profile, 2 * n)) + item(memory_bound_time(profile, 3 * n))
    for a in plan.attention:
        for bwd in (False, True):
            total += item(attention_time(profile, **a.kwargs(), dtype="bf16", backward=bwd))
    for _, n in plan.elementwise:  # forward, then the backward alone (about twice the bytes)
        total += item(memory_bound_time(profile, 5 * n * 2)) + item(memory_bound_time(profile, 10 * n * 2))
    for n in plan.optimizer:
        total += item(memory_bound_time(profile, ADAMW_BYTES_PER_PARAM * n))
    if ranks > 1 and plan.collective_sizes:
        bus = profile.nvlink_busbw
        for size in plan.collective_sizes:
            total += 5 * item(2.0 * size / bus(size))  # five ops, all_reduce's factor as the upper bound
    return total
