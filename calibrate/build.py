"""Measurements -> a GpuProfile: the fits (calibrate.fit), the peaks, the fields kept from a base
profile, and a provenance entry for every field saying where its value came from.

On a GPU the peaks are the datasheet's, from the bundled profile of the same GPU (or --base): a
calibration measures efficiencies against them, so MFU stays comparable with published figures.
On a CPU there is no datasheet in reach, so the peaks are measured: the best GEMM throughput of
each dtype over CPU_HEADROOM (and the RAM bandwidth the best copy over it), so the best measured
shape sits at efficiency 0.9 rather than at the 1.0 bound of the profile format, leaving the fit
room on both sides. A CPU profile's arch is "ampere": of the three the loader knows, the one
without NVLink SHARP (NVLS, which hwmodels.network applies to hopper and blackwell all-reduces)
and without fp8 tensor cores, both of which a CPU lacks.

A CPU run with --base keeps the base's fields it did not measure. When the base describes another
device (a GPU's bundled profile), the result is a hybrid, and it says so: it is named
cpu-<model>-with-<base> (never the base's own name, nor BASE-calibrated, which would claim a
calibrated GPU), the measured memory is the machine's (capacity with bandwidth and curve), the
base's fp8 peak goes when the GEMMs are the CPU's (a CPU has no fp8 GEMM to set beside them), and
every provenance entry kept from the base is marked as inherited.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import math
import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from calibrate import fit as F
from calibrate.device import CAPACITY_TOLERANCE, DeviceInfo, slug
from calibrate.errors import CalibrationError
from hwmodels.compute import BACKWARD_OVER_FORWARD, KERNEL_OVERHEAD, memory_bound_time
from hwmodels.curves import Curve
from hwmodels.network import busbw_factor
from hwmodels.profile import HEAD_DIM_FIELDS, GpuProfile
from paraplan.specs import InterNodeSpec

__all__ = ["CPU_ARCH", "CPU_HEADROOM", "Built", "build_profile"]

CPU_HEADROOM = 0.9
CPU_ARCH = "ampere"
GEMM_DTYPES = ("tf32", "fp16", "bf16", "fp8")

# Placeholders of a CPU profile for what a single-process calibration cannot measure; each one is
# marked "assumed" in the provenance and replaced by measurements under --collectives.
CPU_COLLECTIVE_LATENCY = 20 * 1e-6
"""seconds: a shared-memory (gloo) collective's startup, assumed (gloo over loopback measures 10-50 us)."""
CPU_NIC = (1, 10e9 / 8)
"""(NICs per node, bytes/s each): one 10 GbE port, assumed where /sys/class/net reports no speed."""
CPU_NIC_EFFICIENCY = 0.9
CPU_NET_LATENCY = 10 * 1e-6
CURVE_SIZES = tuple(2**e for e in range(10, 31, 2))


@dataclass
class Built:
    profile: GpuProfile
    fits: dict = field(default_factory=dict)
    """name -> a JSON-able summary of each fit (for the report and the printed table)."""
    notes: list[str] = field(default_factory=list)


def _pct(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}%"


def _clamped(curve: Curve, y_scale: float) -> Curve:
    """`curve` with its values times y_scale, capped at 1 (a base curve re-expressed against a new peak)."""
    return Curve(curve.xs, tuple(min(1.0, y * y_scale) for y in curve.ys))


def host_nics() -> tuple[int, float] | None:
    """(count, bytes/s) of the physical NICs /sys/class/net reports a speed for, the fastest's speed."""
    try:
        names = os.listdir("/sys/class/net")
    except OSError:
        return None
    speeds = []
    for name in names:
        if name == "lo" or name.startswith(("veth", "docker", "br-", "virbr", "ifb", "tun", "tap")):
            continue
        try:
            mbps = int(open(f"/sys/class/net/{name}/speed").read().strip())
        except (OSError, ValueError):
            continue
        if mbps > 0:
            speeds.append(mbps)
    return (len(speeds), max(speeds) * 1e6 / 8) if speeds else None


def _cpu_template(info: DeviceInfo) -> GpuProfile:
    """A CPU profile's skeleton: every field present, the measured ones replaced afterwards."""
    flat = Curve((1.0,), (0.5,))
    nics = host_nics() or CPU_NIC
    return GpuProfile(
        name=f"cpu-{slug(info.name)}", arch=CPU_ARCH,
        peak_flops=(("fp32", 1e9), ("tf32", 1e9), ("fp16", 1e9), ("bf16", 1e9)),
        hbm_capacity=float(info.memory_bytes), hbm_bandwidth=1e9, hbm_efficiency=flat,
        gemm_efficiency=(("tf32", flat), ("fp16", flat), ("bf16", flat)),
        attention_fwd_efficiency=flat, attention_bwd_efficiency=flat,
        nvlink_bandwidth=1e9, nvlink_ring_busbw=1e9, nvlink_busbw=flat, nvlink_latency=CPU_COLLECTIVE_LATENCY,
        node_network=InterNodeSpec(nics_per_node=int(nics[0]), nic_bandwidth=float(nics[1]), topology="fat-tree",
                                   oversubscription=1.0, latency=CPU_NET_LATENCY, nodes_per_leaf=32),
        nic_efficiency=CPU_NIC_EFFICIENCY,
    )


def build_profile(*, info: DeviceInfo, base: GpuProfile | None, base_label: str, measurements, collectives,
                  name: str | None, mode: str, timing, notes: list[str], wall_s: float,
                  when: str | None = None) -> Built:
    """The calibrated profile. `measurements` are bench.Measurement, `collectives`
    collectives.CollectiveSample; what was not measured comes from `base` (required for it)."""
    cpu = info.kind == "cpu"
    foreign_base = cpu and base is not None and not _describes_this_cpu(base, info)
    by_kind: dict[str, list] = {}
    unusable = []  # a timer that read 0 (or a NaN) for one item: fit the rest, say which were left out
    for m in measurements:
        if math.isfinite(m.seconds) and m.seconds > 0:
            by_kind.setdefault(m.kind, []).append(m)
        else:
            unusable.append(m)
    if unusable:
        notes.append(f"{len(unusable)} measurement(s) with a time that is not a positive number were left out of the "
                     f"fits: " + ", ".join(f"{m.kind} {m.params}" for m in unusable[:3]) + (", ..." if len(unusable) > 3 else ""))
    start = base if base is not None else _cpu_template(info)
    if not cpu and base is not None and abs(info.memory_bytes - base.hbm_capacity) > CAPACITY_TOLERANCE * base.hbm_capacity:
        notes.append(f"the base profile {base.name} describes a {base.hbm_capacity / 2**30:.0f} GiB GPU and this "
                     f"{info.name} has {info.memory_bytes / 2**30:.0f} GiB: the datasheet peaks, HBM bandwidth and "
                     "links this profile keeps from the base may not be this GPU's (check --base)")
    built = Built(profile=start, notes=notes)
    prov = dict(start.provenance) if base is not None else {}
    when = when or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    prov["calibration"] = (f"measured by paraplan calibrate ({mode}) on {info.describe()}, {when}; "
                           f"{len(measurements)} kernel and {len(collectives)} collective measurements, "
                           f"each the median of {timing.repeats} timed blocks after {timing.warmup} warm-up calls")
    if base is not None:
        prov["base"] = f"{base_label}: fields not measured here keep its values and sources"

    if base is None:  # a CPU profile's template values must all be replaced by measurements
        lacking = [what for what, kinds in (("HBM copies", ("copy",)), ("attention", ("attention_fwd", "attention_bwd")))
                   if not all(by_kind.get(k) for k in kinds)]
        if lacking:
            raise CalibrationError(f"no {' or '.join(lacking)} measurements completed (all skipped or out of memory); "
                                   "a CPU profile needs them, or --base to take them from")

    # ---- peaks
    peaks = dict(start.peak_flops)
    gemm_by_dtype: dict[str, list] = {}
    for m in by_kind.get("gemm", []):
        gemm_by_dtype.setdefault(m.dtype, []).append(m)
    old_peaks = dict(peaks)
    if cpu and base is None:
        missing = [d for d in ("tf32", "fp16", "bf16") if d not in gemm_by_dtype]
        if missing:
            raise CalibrationError(f"a CPU profile needs GEMM curves for tf32, fp16 and bf16; {', '.join(missing)} "
                                   "not measured (and no --base to take them from)")
    raised = []
    if cpu and gemm_by_dtype:
        for d, ms in gemm_by_dtype.items():
            peaks[d] = max(m.work / m.seconds for m in ms) / CPU_HEADROOM
        if "tf32" in gemm_by_dtype:
            peaks["fp32"] = peaks["tf32"]
            # A CPU without bf16/fp16 arithmetic (AVX512_BF16, AMX, AVX512_FP16) computes 16-bit data
            # in its fp32 units after conversion, as torch's flash CPU attention does (about 15x faster
            # than torch's bf16 matmul on the machine this was written on): its 16-bit peak is at least its
            # fp32 one, so no 16-bit kernel counts as faster than peak and MFU stays below 1
            raised = [d for d in ("fp16", "bf16") if d in gemm_by_dtype and peaks[d] < peaks["tf32"]]
            for d in raised:
                peaks[d] = peaks["tf32"]
        dropped = [d for d in ("fp8",) if d in peaks and d not in gemm_by_dtype]
        for d in dropped:  # the base's fp8 beside this CPU's 16-bit peaks: a CPU has no fp8 GEMM
            del peaks[d]
        kept = [d for d in ("tf32", "fp16", "bf16") if d in peaks and d not in gemm_by_dtype]
        prov["peak_tflops"] = (f"derived: the best measured GEMM throughput of {', '.join(sorted(gemm_by_dtype))} / "
                               f"{CPU_HEADROOM} (a CPU has no datasheet peak here; its best shape then sits at "
                               "efficiency 0.9)"
                               + ("; tf32 and fp32 are the CPU's fp32 GEMM (no TF32 on a CPU)"
                                  if "tf32" in gemm_by_dtype else "")
                               + (f"; {' and '.join(raised)} raised to the fp32 peak: this CPU's 16-bit GEMMs run "
                                  "slower than its fp32 ones, so it has no faster 16-bit arithmetic and computes "
                                  "16-bit data in its fp32 units (torch's flash CPU attention does)" if raised else "")
                               + (f"; {', '.join(kept)} kept from the base {base_label} (not measured)" if kept else "")
                               + ("; no fp8 (a CPU has no fp8 GEMM; the base's fp8 peak dropped)" if dropped else ""))
    for d in GEMM_DTYPES:
        if d in gemm_by_dtype and d not in peaks:
            raise CalibrationError(f"measured {d} GEMMs but the base profile {base_label} has no {d} peak")

    # ---- HBM
    capacity = start.hbm_capacity
    if not cpu:
        # what the device lets the allocator address (torch.cuda.get_device_properties
        # total_memory), below the datasheet figure: an H100 80GB exposes 79.18 GiB
        capacity = float(info.memory_bytes)
        prov["hbm.capacity"] = (f"measured: the device's memory as torch reports it (total_memory), "
                                f"{capacity / 2**30:.2f} GiB")
    bandwidth = start.hbm_bandwidth
    hbm_curve = start.hbm_efficiency
    copies = sorted(by_kind.get("copy", []), key=lambda m: m.work)
    if copies:
        if cpu:
            # Small copies run from the CPU's caches, faster than RAM; the bandwidth is set from the
            # best copy so that the efficiency curve (at most 1) can hold both regimes and
            # memory_bound_time matches either; the RAM figure is the largest copy's.
            bandwidth = max(m.work / m.seconds for m in copies) / CPU_HEADROOM
            prov["hbm.bandwidth"] = (f"derived: the best measured copy bandwidth / {CPU_HEADROOM} "
                                     f"({max(m.work / m.seconds for m in copies) / 1e9:.2f} GB/s; small copies run "
                                     f"from cache, the largest ({_mb(copies[-1].work)}) at "
                                     f"{copies[-1].work / copies[-1].seconds / 1e9:.2f} GB/s from RAM)")
            capacity = float(info.memory_bytes)  # the memory whose copies were measured
            prov["hbm.capacity"] = f"measured: the machine's RAM (sysconf), {capacity / 2**30:.1f} GiB"
        fit = F.fit_hbm([m.work for m in copies], [m.seconds for m in copies], bandwidth=bandwidth)
        hbm_curve = fit.curve
        built.fits["hbm.copy"] = _fit_json(fit)
        triad = by_kind.get("triad", [])
        prov["hbm.efficiency"] = (
            f"measured: {len(copies)} copies {_mb(copies[0].work)}-{_mb(copies[-1].work)} moved (STREAM copy, buffers "
            f"rotated past the last-level cache); fitted with the copies' own per-kernel overhead, "
            f"{fit.overhead * 1e6:.2f} us (memory_bound_time charges a training kernel's "
            f"{KERNEL_OVERHEAD * 1e6:.0f} us instead), on all {fit.n_train} "
            f"(MAPE {_pct(fit.train_mape)}; {_held_out(fit)}); best copy "
            f"{max(m.work / m.seconds for m in copies) / 1e9:.1f} GB/s"
            + (f", best triad {max(m.work / m.seconds for m in triad) / 1e9:.1f} GB/s" if triad else ""))
    elif base is not None and bandwidth != start.hbm_bandwidth:
        hbm_curve = _clamped(hbm_curve, start.hbm_bandwidth / bandwidth)

    profile = dataclasses.replace(start, peak_flops=tuple((d, peaks[d]) for d in ("fp32",) + GEMM_DTYPES if d in peaks),
                                  hbm_capacity=capacity, hbm_bandwidth=bandwidth, hbm_efficiency=hbm_curve,
                                  calibrated=True)

    # ---- GEMM
    curves = {d: c for d, c in start.gemm_efficiency if d in peaks}  # a dropped peak takes its curve along
    for d in list(curves):  # kept curves re-expressed against the new peaks (same times)
        if d not in gemm_by_dtype and d in old_peaks and old_peaks[d] != peaks[d]:
            curves[d] = _clamped(curves[d], old_peaks[d] / peaks[d])
    for d, ms in gemm_by_dtype.items():
        curves.setdefault(d, Curve((1.0,), (0.5,)))
    profile = dataclasses.replace(profile, gemm_efficiency=tuple((d, curves[d]) for d in GEMM_DTYPES if d in curves))
    for d in GEMM_DTYPES:
        ms = gemm_by_dtype.get(d)
        if not ms:
            continue
        ms = sorted(ms, key=lambda m: m.work)
        shapes = [(m.params["m"], m.params["n"], m.params["k"]) for m in ms]
        fit = F.fit_gemm(shapes, [m.seconds for m in ms], dtype=d, profile=profile)
        curves[d] = fit.curve
        profile = dataclasses.replace(profile, gemm_efficiency=tuple((x, curves[x]) for x in GEMM_DTYPES if x in curves))
        presets = sum(1 for m in ms if m.origin != "grid")
        best = max(ms, key=lambda m: m.work / m.seconds)
        built.fits[f"gemm.{d}"] = _fit_json(fit) | {
            "shapes": len(ms), "best_tflops": best.work / best.seconds / 1e12,
            "best_efficiency": best.work / best.seconds / profile.peak(d),
            "median_efficiency": float(np.median([m.work / m.seconds / profile.peak(d) for m in ms]))}
        if d == "fp8":
            what = "torch._scaled_mm (e4m3 in, bf16 out)"
        elif d == "tf32":
            what = "torch.matmul in fp32" + (" (a CPU has no TF32)" if cpu else " with TF32 enabled")
        else:
            what = f"torch.matmul in {d}"
        grid = len(ms) - presets
        prov[f"gemm_efficiency.{d}"] = (
            f"measured: {len(ms)} GEMMs, {presets} training shapes of the bundled model presets (TP 1-8, 2k-8k tokens, "
            f"fwd/dgrad/wgrad; halved to the device's time budget where marked in the report) and {grid} grid "
            f"square{'' if grid == 1 else 's'}, {what}; fitted to hwmodels.compute.gemm_time on all {fit.n_train} "
            f"shapes (MAPE {_pct(fit.train_mape)}; {_held_out(fit)}); best {best.work / best.seconds / 1e12:.3g} TFLOP/s at "
            f"{best.params['m']}x{best.params['n']}x{best.params['k']}")

    # ---- attention
    # torch's SDPA runs cuDNN's fused attention where it can (an H100 with torch 2.11: every call).
    # On Hopper that is the FlashAttention-3 class of kernel (FA3 reaches ~0.62 of peak forward, FA2
    # ~0.35; the calls measured on an H100 reached 0.61), the kernel Transformer Engine prefers there
    # and what `training.attention: flash3` prices. So a profile that has a flash3 curve takes the
    # measured one there and keeps its FlashAttention-2 curve (`flash`), which nothing here measured.
    attn = by_kind.get("attention_fwd", []) + by_kind.get("attention_bwd", [])
    as_flash3 = (bool(attn) and {m.origin for m in attn} == {"CUDNN_ATTENTION"}
                 and profile.attention_flash3_efficiency is not None)
    flash3 = list(profile.attention_flash3_efficiency or ())
    kernels = sorted({m.origin or "unreported" for m in attn})
    if len(kernels) > 1:
        built.notes.append(f"attention: torch ran several kernels across the configurations ({', '.join(kernels)}); "
                           "their fit is written to the FlashAttention-2 curve (training.attention: flash)")
    head_dim_field = "attention_flash3_head_dims" if as_flash3 else "attention_head_dims"
    head_dim_key = ("attention_efficiency_flash3" if as_flash3 else "attention_efficiency") + ".by_head_dim"
    if attn:  # a base profile's per-head-dim curves describe the kernel measured anew: they go
        profile = dataclasses.replace(profile, **{head_dim_field: ()})
        prov.pop(head_dim_key, None)
    elif base is not None and old_peaks.get("bf16") != peaks.get("bf16"):
        scale = old_peaks["bf16"] / peaks["bf16"]
        profile = dataclasses.replace(profile, **{f: tuple((d, _clamped(fw, scale), _clamped(bw, scale))
                                                           for d, fw, bw in getattr(profile, f))
                                                  for f in HEAD_DIM_FIELDS})
    head_dims = _fitted_head_dims(by_kind)
    head_dim_fits: dict[str, dict[int, Curve]] = {}
    for direction in ("fwd", "bwd"):
        ms = sorted(by_kind.get(f"attention_{direction}", []), key=lambda m: m.work)
        field_name = f"attention_{direction}_efficiency"
        if not ms:
            if base is not None and old_peaks.get("bf16") != peaks.get("bf16"):
                profile = dataclasses.replace(profile, **{field_name: _clamped(getattr(profile, field_name),
                                                                              old_peaks["bf16"] / peaks["bf16"])})
            continue
        head_dim_fits[direction] = _head_dim_fits(ms, head_dims, direction, profile, built)
        if len(ms) < 2:
            built.notes.append(f"attention {direction}: one configuration ran; the curve is a single value")
        configs = [dict(m.params) for m in ms]
        fit = F.fit_attention(configs, [m.seconds for m in ms], backward=direction == "bwd", dtype="bf16",
                              profile=profile)
        key = f"attention_efficiency_flash3.{direction}" if as_flash3 else f"attention_efficiency.{direction}"
        if as_flash3:
            flash3[0 if direction == "fwd" else 1] = fit.curve
            profile = dataclasses.replace(profile, attention_flash3_efficiency=tuple(flash3))
            prov[f"attention_efficiency.{direction}"] = (
                f"{prov.get(f'attention_efficiency.{direction}', 'from the base profile')} (kept: torch ran cuDNN's "
                f"fused attention, a FlashAttention-3-class kernel, measured into attention_efficiency_flash3)")
        else:
            profile = dataclasses.replace(profile, **{field_name: fit.curve})
        backends = sorted({m.origin for m in ms if m.origin})
        built.fits[f"attention.{direction}"] = _fit_json(fit) | {
            "configs": len(ms), "best_tflops": max(m.work / m.seconds for m in ms) / 1e12,
            "backend": backends, "field": key.split(".")[0]}
        prov[key] = (
            f"measured: {len(ms)} torch scaled_dot_product_attention {direction} calls "
            f"({', '.join(backends) or 'not reported by this torch'}), causal bf16, head dims "
            f"{sorted({c['head_dim'] for c in configs})}, seq {min(c['q_len'] for c in configs)}-"
            f"{max(c['q_len'] for c in configs)} (the FlashAttention benchmark grid, scaled to the device); fitted to "
            f"hwmodels.compute.attention_time on all {fit.n_train} (MAPE {_pct(fit.train_mape)}; {_held_out(fit)})"
            + ("; the simulator reads the per-head-dim curves below instead, so these errors are those of one "
               "curve for every head dim, not of what it prices" if head_dims else ""))

    if head_dims:
        profile = dataclasses.replace(profile, **{head_dim_field: tuple(
            (d, head_dim_fits["fwd"][d], head_dim_fits["bwd"][d]) for d in head_dims)})
        prov[head_dim_key] = (
            f"measured: the calls above fitted per head dim ({', '.join(map(str, head_dims))}), each to "
            f"hwmodels.compute.attention_time on its own calls (MAPE fwd/bwd; fitted without some, on those): "
            + "; ".join(f"{d}: " + ", ".join(
                f"{_pct(built.fits[f'attention.{w}.d{d}']['train_mape'])} ({_pct(built.fits[f'attention.{w}.d{d}']['test_mape'])})"
                for w in ("fwd", "bwd")) for d in head_dims)
            + "; a call reads the curves of its own head dim, interpolated between two measured ones")

    # ---- memory-bound kernels vs the model (a check of the HBM curve on other kernels)
    checks = []
    for kind in ("elementwise", "optimizer"):
        ops: dict[str, list] = {}
        for m in by_kind.get(kind, []):
            ops.setdefault(m.op, []).append(m)
        for op, ms in ops.items():
            pred = [sum(memory_bound_time(profile, b) for b in m.params["kernels"]) for m in ms]
            err = F.mape(pred, [m.seconds for m in ms])
            ratio = float(np.median([p / m.seconds for p, m in zip(pred, ms)]))
            built.fits[f"memory_bound.{op}"] = {"n_test": len(ms), "test_mape": err, "model_over_measured": ratio}
            checks.append(f"{op} {_pct(err)}")
    if checks:
        prov["hbm.efficiency.check"] = ("memory_bound_time with this profile vs measured torch kernels (short ones as "
                                        "CUDA graph replays on a GPU; MAPE, none of them fitted): " + ", ".join(checks))
    ratios = _backward_ratios(by_kind.get("elementwise", []), by_kind.get("elementwise_bwd", []))
    for op, ratio in ratios.items():
        built.fits[f"memory_bound_backward.{op}"] = {"measured_over_forward": ratio,
                                                    "model_over_forward": BACKWARD_OVER_FORWARD[op]}
    if ratios:
        prov["memory_bound.backward.check"] = (
            "measured: a kernel's backward time over its forward's, torch's kernels timed both ways at the "
            f"{BACKWARD_SIZES} largest sizes (median), against the factor the simulator prices the fused "
            "kernels with (hwmodels.compute.BACKWARD_OVER_FORWARD; torch's SwiGLU is an unfused silu and "
            "product, whose backward moves 9/5 of its forward's bytes): "
            + ", ".join(f"{op} {r:.2f} (model {BACKWARD_OVER_FORWARD[op]:.2f})" for op, r in ratios.items()))

    # ---- collectives: a CPU profile's links start as flagged placeholders; measurements replace them
    if cpu and base is None:
        profile = _cpu_links_assumed(profile, prov)
    if collectives:
        profile = _collectives(profile, collectives, built, prov, info=info)

    if foreign_base:
        _mark_inherited(prov, base, base_label)
    final_name = name or _default_name(info, base)
    prov["calibration"] += f"; wall time {wall_s:.1f} s"
    built.profile = _rounded(dataclasses.replace(profile, name=final_name, provenance=tuple(prov.items()),
                                                 calibrated=True), base)
    return built


BACKWARD_SIZES = 2
"""An elementwise op's backward-over-forward ratio is the median over its largest sizes measured
both ways: the longest kernels, least their launch's."""


def _backward_ratios(forward: list, backward: list) -> dict[str, float]:
    """Per op timed both ways, the median of backward / forward seconds over its BACKWARD_SIZES
    largest sizes (ops the model has a factor for)."""
    fwd = {(m.op, m.params.get("elements")): m.seconds for m in forward}
    pairs: dict[str, list[tuple[float, float]]] = {}
    for m in backward:
        key = (m.op, m.params.get("elements"))
        if key in fwd and m.op in BACKWARD_OVER_FORWARD:
            pairs.setdefault(m.op, []).append((float(key[1]), m.seconds / fwd[key]))
    return {op: float(np.median([r for _, r in sorted(rs)[-BACKWARD_SIZES:]])) for op, rs in pairs.items()}


def _default_name(info: DeviceInfo, base: GpuProfile | None) -> str:
    """A GPU: BASE-calibrated (the base is that GPU's datasheet profile). A CPU: cpu-<model>, or
    the base's name where the base is a profile of this CPU already (it may say what it mixes),
    or cpu-<model>-with-BASE where the fields not measured are another device's. Never the base's
    name or BASE-calibrated for a CPU: a profile measured on a CPU is no calibrated GPU."""
    if info.kind != "cpu" and base is not None:
        return f"{base.name}-calibrated"
    own = _cpu_name(info)
    if base is None:
        return own
    return base.name if _describes_this_cpu(base, info) else f"{own}-with-{base.name}"


def _cpu_name(info: DeviceInfo) -> str:
    return f"cpu-{slug(info.name)}"


def _describes_this_cpu(base: GpuProfile, info: DeviceInfo) -> bool:
    """Whether `base` is a calibration of this CPU (named as _default_name names one)."""
    own = _cpu_name(info)
    return base.name == own or base.name.startswith(f"{own}-with-")


INHERITED = "inherited from the base"


def _mark_inherited(prov: dict, base: GpuProfile, base_label: str) -> None:
    """A CPU run on another device's profile: every provenance entry still the base's says it is
    the base's device's, not this machine's, and the base entry lists what this run measured."""
    theirs = dict(base.provenance)
    measured = [k for k, v in prov.items() if k not in ("calibration", "base") and theirs.get(k) != v]
    for key, text in theirs.items():
        if key not in ("calibration", "base") and prov.get(key) == text:
            prov[key] = f"{INHERITED} {base_label}, not measured on this CPU: {text}"
    prov["base"] = (f"{base_label}, a profile of another device: this CPU measured {', '.join(measured) or 'nothing'}; "
                    f"every other field (arch {base.arch} included) keeps the base's value, marked '{INHERITED}' "
                    "where the base gives a source")


SIGNIFICANT = 5
"""Digits kept of every measured number: far finer than run-to-run noise, and a readable file."""


def _sig(x: float, unit: float = 1.0) -> float:
    """x rounded to SIGNIFICANT digits in the YAML unit `unit` (so the file shows 12.345, not
    12.344999999999999: the value is that decimal times the unit, as the loader computes it)."""
    if not x:
        return x
    w = float(f"{x / unit:.{SIGNIFICANT}g}")
    return w * unit if unit != 1.0 else w


def _rounded(p: GpuProfile, base: GpuProfile | None) -> GpuProfile:
    """`p` with its measured numbers rounded to SIGNIFICANT digits in their YAML units
    (hwmodels.profile's TFLOPS, GBPS, GFLOP, MB, US); what it kept from `base` stays as the base
    has it. Knots stay strictly increasing (at least 0.1 decade apart, or distinct byte counts)."""
    from hwmodels.profile import GBPS, GFLOP, MB, TFLOPS, US

    def kept(name: str, value) -> bool:
        return base is not None and getattr(base, name) == value

    def num(name: str, unit: float = 1.0):
        v = getattr(p, name)
        return v if kept(name, v) else _sig(v, unit)

    def curve(c: Curve, old: Curve | None, xu: float | None, yu: float = 1.0) -> Curve:
        """xu None: sizes kept as they are (message sizes in bytes are exact)."""
        if c == old:
            return c
        xs = c.xs if xu is None else tuple(_sig(x, xu) for x in c.xs)
        return Curve(xs, tuple(_sig(y, yu) for y in c.ys))

    def field_curve(name: str, xu: float | None, yu: float = 1.0) -> Curve:
        return curve(getattr(p, name), getattr(base, name) if base is not None else None, xu, yu)

    def head_dims(name: str):
        olds = {d: (fw, bw) for d, fw, bw in getattr(base, name)} if base is not None else {}
        return tuple((d, *(curve(c, old, GFLOP) for c, old in zip((fw, bw), olds.get(d, (None, None)))))
                     for d, fw, bw in getattr(p, name))

    base_peaks = dict(base.peak_flops) if base is not None else {}
    base_gemm = dict(base.gemm_efficiency) if base is not None else {}
    base_flash3 = (base.attention_flash3_efficiency if base is not None else None) or (None, None)
    return dataclasses.replace(
        p, peak_flops=tuple((d, v if base_peaks.get(d) == v else _sig(v, TFLOPS)) for d, v in p.peak_flops),
        hbm_bandwidth=num("hbm_bandwidth", GBPS), hbm_efficiency=field_curve("hbm_efficiency", MB),
        gemm_efficiency=tuple((d, curve(c, base_gemm.get(d), GFLOP)) for d, c in p.gemm_efficiency),
        attention_fwd_efficiency=field_curve("attention_fwd_efficiency", GFLOP),
        attention_bwd_efficiency=field_curve("attention_bwd_efficiency", GFLOP),
        attention_flash3_efficiency=(None if p.attention_flash3_efficiency is None else tuple(
            curve(c, old, GFLOP) for c, old in zip(p.attention_flash3_efficiency, base_flash3))),
        **{f: head_dims(f) for f in HEAD_DIM_FIELDS},
        nvlink_bandwidth=num("nvlink_bandwidth", GBPS), nvlink_ring_busbw=num("nvlink_ring_busbw", GBPS),
        nvlink_busbw=field_curve("nvlink_busbw", None, GBPS), nvlink_latency=num("nvlink_latency", US),
        nic_efficiency=num("nic_efficiency"))


def _fitted_head_dims(by_kind: dict) -> list[int]:
    """The head dims that get curves of their own: those with at least two calls measured in each
    direction, when forward and backward have the same ones and there are several (else none)."""
    def dims(direction: str) -> list[int]:
        counts = Counter(int(m.params["head_dim"]) for m in by_kind.get(f"attention_{direction}", []))
        return sorted(d for d, n in counts.items() if n >= 2)

    fwd = dims("fwd")
    return fwd if len(fwd) > 1 and fwd == dims("bwd") else []


def _head_dim_fits(ms: list, head_dims: list[int], direction: str, profile: GpuProfile, built: Built) -> dict[int, Curve]:
    """Per head dim of `head_dims`, the attention curve fitted to its calls among `ms` alone
    (recorded in built.fits as attention.<direction>.d<head dim>)."""
    by_dim: dict[int, list] = {d: [] for d in head_dims}
    for m in ms:
        if int(m.params["head_dim"]) in by_dim:
            by_dim[int(m.params["head_dim"])].append(m)
    out = {}
    for d, calls in by_dim.items():
        fit = F.fit_attention([dict(m.params) for m in calls], [m.seconds for m in calls],
                              backward=direction == "bwd", dtype="bf16", profile=profile)
        out[d] = fit.curve
        built.fits[f"attention.{direction}.d{d}"] = _fit_json(fit) | {"configs": len(calls)}
    return out


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3g} MB"


def _held_out(fit: F.FitResult) -> str:
    """How the fitting did on points it had not seen: a fit without n_test of them, on those."""
    if not fit.n_test:
        return "too few points to hold any out"
    return (f"fitted without {fit.n_test} of them, it predicted those with MAPE {_pct(fit.test_mape)}, "
            f"worst {_pct(fit.test_max_ape)}")


def _fit_json(fit: F.FitResult) -> dict:
    return {"n_train": fit.n_train, "n_test": fit.n_test, "train_mape": fit.train_mape, "test_mape": fit.test_mape,
            "test_max_ape": fit.test_max_ape, "knots": list(fit.curve.xs), "values": list(fit.curve.ys),
            **({} if fit.overhead is None else {"overhead_s": fit.overhead})}


def _cpu_links_assumed(profile: GpuProfile, prov: dict) -> GpuProfile:
    """A CPU profile without --collectives: the intra-node tier as shared memory at half the copy
    bandwidth with an assumed startup latency (alpha-beta), flagged as assumed."""
    bw = profile.hbm_bandwidth * profile.hbm_efficiency.max / 2
    f8 = busbw_factor("all_reduce", 8)
    busbw = tuple(f8 * s / (CPU_COLLECTIVE_LATENCY + f8 * s / bw) for s in CURVE_SIZES)
    prov["nvlink"] = (f"assumed (not measured; run under torchrun with --collectives to measure): shared memory at half "
                      f"the copy bandwidth ({bw / 1e9:.2f} GB/s), {CPU_COLLECTIVE_LATENCY * 1e6:.0f} us per collective")
    nics = host_nics()
    prov["network"] = ("assumed (a single-node calibration measures no network): "
                       + (f"{nics[0]} NIC(s) at {nics[1] * 8 / 1e9:.0f} Gb/s from /sys/class/net" if nics
                          else "one 10 GbE NIC (/sys/class/net reports no speed)")
                       + f", efficiency {CPU_NIC_EFFICIENCY}, latency {CPU_NET_LATENCY * 1e6:.0f} us, fat-tree")
    return dataclasses.replace(profile, nvlink_bandwidth=bw, nvlink_ring_busbw=bw, nvlink_busbw=Curve(CURVE_SIZES, busbw),
                               nvlink_latency=CPU_COLLECTIVE_LATENCY)


def _collectives(profile: GpuProfile, samples, built: Built, prov: dict, *, info: DeviceInfo) -> GpuProfile:
    """Alpha-beta fits per tier and op; the intra-node tier's all_reduce busbw curve, ring busbw
    and (CPU) link rate and latency; the NIC efficiency from the inter-node tier."""
    by: dict[tuple[str, str], list] = {}
    for s in samples:
        by.setdefault((s.tier, s.op), []).append(s)
    lines: dict[str, list[str]] = {}
    fits: dict[tuple[str, str], F.AlphaBeta] = {}
    for (tier, op), ss in sorted(by.items()):
        ss = sorted(ss, key=lambda s: s.nbytes)
        factor = busbw_factor(op, ss[0].ranks)
        ab = F.fit_alpha_beta([s.nbytes for s in ss], [s.seconds for s in ss], factor=factor)
        fits[(tier, op)] = ab
        built.fits[f"collective.{tier}.{op}"] = {
            "ranks": ss[0].ranks, "nodes": ss[0].nodes, "backend": ss[0].backend, "alpha_us": ab.alpha * 1e6,
            "busbw_GBps": ab.busbw / 1e9, "max_measured_busbw_GBps": max(s.busbw for s in ss) / 1e9,
            "n_train": ab.n_train, "n_test": ab.n_test, "train_mape": ab.train_mape, "test_mape": ab.test_mape,
            "efficiency": {str(s.nbytes): ab.efficiency(s.nbytes) for s in ss}}
        lines.setdefault(tier, []).append(
            f"{op} {ab.alpha * 1e6:.1f} us + S/{ab.busbw / 1e9:.3g} GB/s busbw (held-out MAPE {_pct(ab.test_mape)})")
    for tier, ls in lines.items():
        first = next(s for s in samples if s.tier == tier)
        prov[f"collectives.{tier}"] = (f"measured ({first.backend}, {first.ranks} ranks on {first.nodes} node(s), "
                                       f"nccl-tests conventions), alpha-beta per op: " + "; ".join(ls))

    intra = {op: sorted(ss, key=lambda s: s.nbytes) for (t, op), ss in by.items() if t == "intra"}
    if "all_reduce" in intra:
        ar = intra["all_reduce"]
        n = ar[0].ranks
        profile = dataclasses.replace(profile, nvlink_busbw=Curve(tuple(float(s.nbytes) for s in ar),
                                                                  tuple(s.busbw for s in ar)))
        prov["nvlink.allreduce_busbw"] = (f"measured: all_reduce busbw over {n} ranks ({ar[0].backend}), "
                                          f"{len(ar)} sizes {ar[0].nbytes}-{ar[-1].nbytes} bytes"
                                          + ("" if n == 8 else f" (hwmodels.network reads this curve as 8 ranks'; "
                                                               f"measured with {n})"))
        ring_ops = [op for op in ("all_gather", "reduce_scatter") if op in intra]
        ring = (min(max(s.busbw for s in intra[op]) for op in ring_ops) if ring_ops
                else max(s.busbw for s in ar))
        profile = dataclasses.replace(profile, nvlink_ring_busbw=ring)
        prov["nvlink.ring_busbw"] = (f"measured: the lower of the peak busbw of {' and '.join(ring_ops)}" if ring_ops
                                     else "measured: the peak all_reduce busbw (no all_gather/reduce_scatter ran)") \
            + f" over {n} ranks, {ring / 1e9:.3g} GB/s"
        if info.kind == "cpu":
            link = max(s.busbw for s in intra["send_recv"]) if "send_recv" in intra else ring
            by_p2p = ("intra", "send_recv") in fits
            lat = max(fits[("intra", "send_recv" if by_p2p else "all_reduce")].alpha, 1e-7)
            profile = dataclasses.replace(profile, nvlink_bandwidth=link, nvlink_latency=lat)
            prov["nvlink.bandwidth"] = "measured: " + ("the peak send/recv busbw" if "send_recv" in intra
                                                       else "the ring busbw (send/recv did not run)")
            prov["nvlink.latency"] = f"measured: the alpha of the {'send/recv' if by_p2p else 'all_reduce'} alpha-beta fit"
            prov.pop("nvlink", None)
    inter = [s for s in samples if s.tier == "inter" and s.op == "all_reduce"]
    if inter:
        net = profile.node_network
        best = max(s.busbw for s in inter)
        # hwmodels.network: a hierarchical ring's busbw is ppn x the per-GPU share of the node's NICs
        # (nics x rate x efficiency / GPUs per node): ranks on fewer GPUs than the node has reach
        # only their share of its NICs
        ppn = max(1, inter[0].ranks // max(1, inter[0].nodes))
        gpus = info.count if info.kind == "cuda" and info.count >= ppn else ppn
        line = net.nics_per_node * net.nic_bandwidth * ppn / gpus
        if best < 0.95 * profile.nvlink_ring_busbw and best <= line:
            eff = best / line
            profile = dataclasses.replace(profile, nic_efficiency=eff)
            share = "" if ppn == gpus else f" ({ppn} of the node's {gpus} GPUs ran ranks: their {ppn}/{gpus} share)"
            prov["network.nic_efficiency"] = (f"measured: peak inter-node all_reduce busbw {best / 1e9:.3g} GB/s over "
                                              f"{net.nics_per_node} x {net.nic_bandwidth * 8 / 1e9:.0f} Gb/s NICs{share} "
                                              "(hwmodels.network: hierarchical ring busbw = NIC line rate x efficiency)")
        else:
            built.notes.append("inter-node all_reduce was not NIC-bound (at or above the intra-node ring busbw, or "
                               "above the NICs' line rate): network.nic_efficiency kept from the base profile")
    return profile
