"""Kernel times on one GPU (seconds): GEMMs, attention, memory-bound kernels. Pure functions of a
GpuProfile and the kernel's shape; no state.

Each compute kernel's time is FLOPs / (peak x efficiency(FLOPs)), the efficiency read from the
profile's measured tables (the Calculon approach: roofline x efficiency tables, Isaev et al.,
SC'23, https://github.com/calculon-ai/calculon).
"""
from __future__ import annotations

import bisect
import math

from hwmodels.curves import Curve
from hwmodels.profile import GpuProfile
from paraplan.errors import ConfigError

__all__ = ["ATTENTION_HIDDEN", "ATTENTION_TOKENS", "BACKWARD_OVER_FORWARD", "GELU_BACKWARD", "KERNEL_OVERHEAD",
           "NORM_BACKWARD", "ROTARY_BACKWARD", "SOFTMAX_BACKWARD", "SWIGLU_BACKWARD", "attention_curve_flops",
           "attention_flops", "attention_time", "dtype_bytes", "gemm_time", "memory_bound_time",
           "unfused_attention_time"]

KERNEL_OVERHEAD = 3e-6
"""Seconds a memory-bound kernel costs beyond its bytes: the ~1 us gap between back-to-back
launches (NVIDIA, "Getting Started with CUDA Graphs": a 2.9 us kernel repeats every 3.8 us) plus
~2 us for the first wave to ramp up and the last to drain. Small elementwise kernels take 3-5 us
in PyTorch profiles for this reason. GEMM and attention curves are measured end-to-end and
already include it; it floors them below their smallest measured size, where a curve clamped at its
first knot would let a tiny GEMM (an MoE router's, a toy model's) finish in a fraction of a
microsecond. No GEMM in OpenXLA's H100 table runs in under 5.2 us (256^3;
benchmarks/data/openxla_sm90_matmul.csv)."""

# A memory-bound kernel's backward time over its forward's. From the bytes each moves: GELU reads x
# and writes y, its backward reads x and dy and writes dx (3 passes for 2); SwiGLU reads gate and up
# and writes f, its backward reads gate, up and df and writes both gradients (5 for 3); a rotation's
# backward rotates the gradient (read dy, write dx: 1 for 1); softmax reads the scores and writes the
# probabilities, its backward reads the probabilities and their gradient and writes the scores'
# (3 for 2). Liger-Kernel's published fused-kernel timings (linkedin/Liger-Kernel
# benchmark/data/*_all_benchmark_data*.csv, backward timed alone) agree: SwiGLU 1.59-1.63, ReLU^2
# 1.45, RoPE 1.00. A norm's backward would be 1.5 by bytes (read x and dy, write dx), but it reduces
# the weight gradient over the tokens as well, and measures 1.6-2.2: Liger RMSNorm 1.74 (H100) and
# 1.99 (A100), fused add+RMSNorm 1.63, GroupNorm 1.94, torch LayerNorm 1.92-2.22. `paraplan
# calibrate` times torch's kernels both ways and prints the ratios beside these.
NORM_BACKWARD = 2.0
GELU_BACKWARD = 1.5
SWIGLU_BACKWARD = 5 / 3
ROTARY_BACKWARD = 1.0
SOFTMAX_BACKWARD = 1.5
BACKWARD_OVER_FORWARD = {"layernorm": NORM_BACKWARD, "rmsnorm": NORM_BACKWARD, "softmax": SOFTMAX_BACKWARD,
                         "gelu": GELU_BACKWARD, "swiglu": SWIGLU_BACKWARD}
"""The factors by the kernel names `paraplan calibrate` times."""

_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element; tf32 tensors are stored as fp32."""
    return _BYTES[dtype]


def _compute_time(flops: float, peak: float, curve: Curve, at: float | None = None) -> float:
    """flops / (peak x curve(at)), `at` the curve's size for the kernel (default its FLOPs), floored
    at the time of the slowest measured knot at or below `at`, scaled by flops / at: the curve
    interpolates efficiency linearly in log(size), which where it climbs steeply (launch-bound
    GEMMs) would let a bigger kernel finish sooner than a smaller one, and a fitted curve's knots
    themselves can dip by a fraction of a percent where they are launch-bound."""
    x = flops if at is None else at
    t = flops / (peak * curve(x))
    i = bisect.bisect_right(curve.xs, x) - 1
    if i >= 0:
        t = max(t, curve.ratio_max(i) / peak * (flops / x))
    return t


def memory_bound_time(gpu: GpuProfile, nbytes: float) -> float:
    """A kernel that streams `nbytes` through HBM (reads + writes), e.g. an elementwise op, a
    LayerNorm or an optimizer step: nbytes / (bandwidth x efficiency(nbytes)) + KERNEL_OVERHEAD.
    The efficiency plateau is the STREAM copy fraction (STREAM copy TB/s / peak in the Azure AI-benchmarking-guide
    results, e.g. ND A100 v4:
    https://github.com/Azure/AI-benchmarking-guide/blob/3bb66cacc25632d8ece36bc1d5128c5ea886a60b/Azure_Results/ND_A100_v4_results.md)."""
    if nbytes <= 0:
        return 0.0
    return KERNEL_OVERHEAD + nbytes / (gpu.hbm_bandwidth * gpu.hbm_efficiency(nbytes))


def gemm_bytes(m, n, k, dtype: str, batch=1, out_bytes: float | None = None):
    """HBM bytes of C[m,n] = A[m,k] @ B[k,n] (gemm_time; scalars or numpy arrays): A and B read
    in `dtype`, C written at `out_bytes` per element, by default 16-bit under fp8 (Transformer
    Engine's fp8 GEMMs return the activation dtype; the calibration's torch._scaled_mm runs with
    out_dtype=bfloat16) and `dtype` otherwise."""
    c_bytes = max(dtype_bytes(dtype), 2) if out_bytes is None else out_bytes
    return batch * ((m * k + k * n) * dtype_bytes(dtype) + m * n * c_bytes)


def gemm_time(gpu: GpuProfile, m: int, n: int, k: int, dtype: str, batch: int = 1,
              out_bytes: float | None = None) -> float:
    """C[m,n] = A[m,k] @ B[k,n], `batch` times in one (batched) kernel.

    Compute: 2mnk x batch FLOPs at peak(dtype) x gemm_curve(dtype)(FLOPs); the curve is measured
    on whole GEMMs, so it already holds launch and wave-quantisation losses.
    Memory: A, B and C each cross HBM once, batch x (mk + kn + mn) x dtype bytes (C at 2 under
    fp8; gemm_bytes), at hbm_bandwidth x hbm_efficiency(bytes). `out_bytes` replaces C's bytes per element where C is
    not simply written in `dtype`: a GEMM that accumulates into an existing fp32 C (cuBLAS
    beta = 1, as Megatron's fused weight-gradient GEMM does) reads and writes it, 4 + 4 bytes.

    Combined as sqrt(t_compute^2 + t_memory^2): a smooth roofline between perfect overlap,
    max(t_c, t_m) (Williams, Waterman, Patterson, CACM 2009), and none, t_c + t_m (Calculon's
    `no_overlap` processing mode). Where one term dominates it is within 3% of the max, so the
    square shapes the curves are measured on are unchanged; at the ridge point it is sqrt(2) x the
    max. Check (tests/test_hwmodels_compute.py): the Azure A100 cuBLASLt shape [802816,192,768]
    sits on the ridge (153 FLOP/byte) and ran at 157.8 TFLOP/s; max predicts 235 (+49%), the sum
    121 (-23%), this 171 (+8.5%). Floored at KERNEL_OVERHEAD, one kernel's launch and ramp.
    """
    if min(m, n, k, batch) <= 0:
        return 0.0
    flops = 2.0 * m * n * k * batch
    t_compute = _compute_time(flops, gpu.peak(dtype), gpu.gemm_curve(dtype))
    nbytes = gemm_bytes(m, n, k, dtype, batch, out_bytes)
    t_memory = nbytes / (gpu.hbm_bandwidth * gpu.hbm_efficiency(nbytes))
    return max(math.hypot(t_compute, t_memory), KERNEL_OVERHEAD)


def _attention_dtype(dtype: str) -> str:
    """Attention runs in 16-bit under fp8 training (Transformer Engine keeps dot-product attention
    in bf16 by default); fp32 training prices it at the TF32 rate."""
    return "bf16" if dtype == "fp8" else dtype


def attention_flops(*, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, causal: bool,
                    backward: bool) -> float:
    """FLOPs of one flash-attention call, the FlashAttention-2/3 papers' convention
    (arXiv 2307.08691 Sec. 4.1, arXiv 2407.08608 Sec. 4.1): forward 4 x b x h x q x kv x d (two
    matmuls, QK^T and PV); causal keeps the computed fraction of the mask, 1/2 when q == kv
    (bottom-right aligned in general: 1 - q/(2 kv) for q <= kv); backward 2.5 x forward (five
    matmuls instead of two, the forward's QK^T recomputed)."""
    f = 4.0 * batch * heads * q_len * kv_len * head_dim
    if causal:
        f *= 1.0 - q_len / (2.0 * kv_len) if q_len <= kv_len else kv_len / (2.0 * q_len)
    return 2.5 * f if backward else f


ATTENTION_TOKENS, ATTENTION_HIDDEN = 16384, 2048
"""The FlashAttention-2/3 benchmark grid (arXiv 2307.08691 Sec. 4.1, arXiv 2407.08608 Sec. 4.1):
batch = 16k tokens / seqlen, heads = 2048 / head_dim, on which the profiles' attention curves are
measured (the bundled ones from those papers' figures, `paraplan calibrate` on the same grid)."""


def attention_curve_flops(*, q_len: int, kv_len: int, causal: bool, backward: bool) -> float:
    """Where a call reads the attention curves: the FLOPs the benchmark grid runs at this call's
    sequence lengths. The curves give efficiency against the sequence, which sets how full a
    kernel's tiles are and how long its inner loop runs; read at the call's own FLOPs, a call with
    fewer heads or a smaller batch than the grid's would be priced at a shorter sequence's
    efficiency (Qwen3's 16 heads per TP rank at 4k tokens and micro-batch 1: 1.4x the forward and
    1.9x the backward the calibration measured for that kernel at 4k, scaled to its heads).
    The simulator's calls are causal, and a knot sits at the FLOPs of its own measurement: a causal
    one (calibration, which runs causal; FlashAttention-3's forward figure) is read by a causal call
    of its sequence; a non-causal one (the FlashAttention-2 paper's figures in the bundled profiles)
    by a causal call of twice its sequence, the same tokens with the same mean key/value length per
    query, which sets the kernel's inner loop (causal s, mean s/2; non-causal s/2, s/2)."""
    return attention_flops(batch=ATTENTION_TOKENS / q_len, heads=ATTENTION_HIDDEN, q_len=q_len, kv_len=kv_len,
                           head_dim=1, causal=causal, backward=backward)


def attention_time(gpu: GpuProfile, *, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                   dtype: str, causal: bool, backward: bool, kernel: str = "flash") -> float:
    """One fused flash-attention call (forward, or backward). Efficiency from the profile's
    attention curves (read at attention_curve_flops, the benchmark grid's FLOPs at the call's
    sequence lengths -> fraction of the 16-bit peak): `kernel` flash reads
    attention_efficiency, FlashAttention-2-era figures in the bundled profiles (A100 0.50-0.73 at 512
    to 16k tokens without the causal mask, read by causal calls of 1k to 32k; H100 ~0.23-0.33); flash3 reads attention_efficiency_flash3, Hopper's FlashAttention-3-class
    kernels (H100 up to ~0.62 forward), see the profiles' provenance. Where calibration measured
    several head dims (GpuProfile.attention_head_dims, attention_flash3_head_dims), the curves of the
    call's head dim are read instead (_head_dim_time). Floored at one kernel's overhead."""
    flops = attention_flops(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim,
                            causal=causal, backward=backward)
    if flops <= 0:
        return 0.0
    if kernel == "flash3":
        if gpu.attention_flash3_efficiency is None:
            raise ConfigError("training.attention", f"flash3 needs a GPU profile with attention_efficiency_flash3 "
                                                    f"(FlashAttention-3-class kernels run on Hopper); {gpu.name} has none")
        curve, by_head_dim = gpu.attention_flash3_efficiency[1 if backward else 0], gpu.attention_flash3_head_dims
    else:
        curve = gpu.attention_bwd_efficiency if backward else gpu.attention_fwd_efficiency
        by_head_dim = gpu.attention_head_dims
    at = attention_curve_flops(q_len=q_len, kv_len=kv_len, causal=causal, backward=backward)
    peak = gpu.peak(_attention_dtype(dtype))
    if not by_head_dim:
        return max(_compute_time(flops, peak, curve, at), KERNEL_OVERHEAD)
    return max(_head_dim_time(flops, peak, by_head_dim, head_dim, backward, at), KERNEL_OVERHEAD)


def _head_dim_time(flops: float, peak: float, by_head_dim, head_dim: float, backward: bool, at: float) -> float:
    """The time at `head_dim` from the per-head-dim curves (GpuProfile.attention_head_dims): a
    measured head dim's own curve; between two, their efficiencies (flops / time) interpolated
    linearly in log(head dim), as the curves interpolate in log(size) (an MLA call, whose query-key
    and value head dims differ, sits at their mean); beyond the measured ones, the nearest."""
    k = 2 if backward else 1  # (head_dim, forward curve, backward curve)
    dims = [entry[0] for entry in by_head_dim]
    i = bisect.bisect_left(dims, head_dim)
    if i == len(dims) or dims[i] == head_dim or i == 0:
        return _compute_time(flops, peak, by_head_dim[min(i, len(dims) - 1)][k], at)
    lo, hi = by_head_dim[i - 1], by_head_dim[i]
    w = math.log(head_dim / lo[0]) / math.log(hi[0] / lo[0])
    return 1.0 / ((1.0 - w) / _compute_time(flops, peak, lo[k], at) + w / _compute_time(flops, peak, hi[k], at))


def unfused_attention_time(gpu: GpuProfile, *, batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
                           dtype: str, causal: bool, backward: bool, dropout: bool = True) -> float:
    """Attention as Megatron-LM ran it before FlashAttention: batched GEMMs around a materialised
    b x a x q x kv score tensor and memory-bound kernels over it. The causal mask is applied to the
    full score tensor (FusedScaleMaskSoftmax), so nothing is halved.

    Forward: QK^T (q x d @ d x kv) and AV (q x kv @ kv x d), batch b x a each; the fused
    scale+mask+softmax kernel reads the scores and writes the probabilities (2 passes of e bytes per
    element); dropout reads them and writes the dropped copy plus a 1-byte mask (2 passes + mask).
    What the backward keeps is Korthikanti et al. 2022 Sec. 4.1: softmax output 2as^2b, dropout
    mask as^2b, dropout output 2as^2b bytes.
    Backward: four GEMMs (dQ = dS K, dK = dS^T Q, dP = dO V^T, dV = P^T dO); dropout backward reads
    the gradient and the mask and writes a gradient (2 passes + mask); softmax backward reads the
    gradient and the softmax output and writes the score gradient (3 passes).
    `dropout=False` drops the dropout kernels (attention dropout 0, as in most models after 2022).
    """
    dt = _attention_dtype(dtype)
    bh = batch * heads
    if min(bh, q_len, kv_len, head_dim) <= 0:
        return 0.0
    e = dtype_bytes(dt)
    scores = float(bh) * q_len * kv_len
    if not backward:
        gemms = gemm_time(gpu, q_len, kv_len, head_dim, dt, batch=bh) + gemm_time(gpu, q_len, head_dim, kv_len, dt, batch=bh)
        memory = memory_bound_time(gpu, 2 * e * scores)
        if dropout:
            memory += memory_bound_time(gpu, (2 * e + 1) * scores)
        return gemms + memory
    gemms = (gemm_time(gpu, q_len, head_dim, kv_len, dt, batch=bh)      # dQ = dS @ K
             + gemm_time(gpu, kv_len, head_dim, q_len, dt, batch=bh)    # dK = dS^T @ Q
             + gemm_time(gpu, q_len, kv_len, head_dim, dt, batch=bh)    # dP = dO @ V^T
             + gemm_time(gpu, kv_len, head_dim, q_len, dt, batch=bh))   # dV = P^T @ dO
    memory = memory_bound_time(gpu, SOFTMAX_BACKWARD * 2 * e * scores)
    if dropout:
        memory += memory_bound_time(gpu, (2 * e + 1) * scores)
    return gemms + memory
