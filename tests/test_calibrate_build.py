"""calibrate.build without a device: synthetic measurements made with the bundled H100 profile's
own models go in, and the profile that comes out must describe the same GPU, carry provenance,
and load back through hwmodels.profile exactly as a scenario would load it."""
import dataclasses

import numpy as np
import pytest

from calibrate.build import CPU_ARCH, CPU_HEADROOM, build_profile
from calibrate.device import DeviceInfo
from calibrate.plan import TIMINGS, Rates, build_plan, rates_from_profile
from calibrate.results import CollectiveSample, Measurement
from hwmodels.compute import attention_flops, attention_time, gemm_time, memory_bound_time
from hwmodels.network import busbw_factor
from hwmodels.profile import load_profile, write_profile

H100 = load_profile("h100-sxm-80gb")
GPU = DeviceInfo(kind="cuda", index=0, name="NVIDIA H100 80GB HBM3", memory_bytes=int(79.1 * 2**30), capability="9.0",
                 driver="550.54.15", cuda="12.4", torch="2.13.0")
CPU = DeviceInfo(kind="cpu", index=0, name="Some CPU 8-Core", memory_bytes=64 * 2**30, torch="2.13.0", threads=8)


def _measure(profile, plan, dtypes, seed=0):
    """What bench would have measured on a device that behaves exactly like `profile` (+1% noise)."""
    rng = np.random.default_rng(seed)
    noisy = lambda t: t * rng.lognormal(0, 0.01)  # noqa: E731
    out = []
    for d in dtypes:
        for s in plan.gemm[d]:
            out.append(Measurement(kind="gemm", op="matmul", dtype=d, params=dict(m=s.m, n=s.n, k=s.k), work=s.flops,
                                   seconds=noisy(gemm_time(profile, s.m, s.n, s.k, d)), origin=s.origin))
    for size in plan.hbm_sizes:
        for kind, passes in (("copy", 2), ("triad", 3)):
            out.append(Measurement(kind=kind, op=kind, dtype="fp32", params=dict(bytes=size), work=passes * size,
                                   seconds=noisy(memory_bound_time(profile, passes * size))))
    for a in plan.attention:
        for bwd in (False, True):
            out.append(Measurement(kind="attention_bwd" if bwd else "attention_fwd", op="sdpa", dtype="bf16",
                                   params=a.kwargs(), work=attention_flops(**a.kwargs(), backward=bwd),
                                   seconds=noisy(attention_time(profile, **a.kwargs(), dtype="bf16", backward=bwd))))
    for op, n in plan.elementwise:
        kernels = [4.0 * n]
        out.append(Measurement(kind="elementwise", op=op, dtype="bf16", params=dict(elements=n, kernels=kernels),
                               work=sum(kernels), seconds=noisy(memory_bound_time(profile, kernels[0]))))
    return out


def _collectives(ranks=8, tier="intra", busbw=400e9, alpha=15e-6):
    out = []
    for op in ("all_reduce", "all_gather", "reduce_scatter", "send_recv"):
        f = busbw_factor(op, ranks)
        bw = busbw * (0.8 if op in ("all_gather", "reduce_scatter") else 1.0)
        for e in range(10, 31, 2):
            t = alpha + f * 2**e / bw
            out.append(CollectiveSample(op=op, tier=tier, ranks=ranks, nodes=1 if tier == "intra" else 2,
                                        backend="nccl", nbytes=2**e, seconds=t, algbw=2**e / t, busbw=f * 2**e / t))
    return out


def _build(info, base, measurements, collectives=(), **kw):
    return build_profile(info=info, base=base, base_label="h100-sxm-80gb (bundled)" if base else "",
                         measurements=measurements, collectives=list(collectives), name=kw.get("name"), mode="quick",
                         timing=TIMINGS[(info.kind, True)], notes=[], wall_s=12.0)


def test_gpu_profile_recovers_the_base_it_was_measured_on(tmp_path):
    rates = rates_from_profile(H100, ("bf16", "fp8"), memory_budget=40 * 2**30)
    plan = build_plan(device="cuda", quick=True, dtypes=("bf16", "fp8"), rates=rates)
    built = _build(GPU, H100, _measure(H100, plan, ("bf16", "fp8")), _collectives())
    p = built.profile
    assert p.name == "h100-sxm-80gb-calibrated" and p.calibrated and p.arch == "hopper"
    assert p.peak_flops == H100.peak_flops  # datasheet peaks kept on a GPU
    assert p.gemm_curve("tf32") == H100.gemm_curve("tf32")  # not measured: the base's
    for d in ("bf16", "fp8"):
        assert built.fits[f"gemm.{d}"]["test_mape"] < 8.0  # 23 shapes; fp8's knee (0.14 -> 0.51 in a decade) costs most
        assert p.gemm_curve(d)(1.1e12) == pytest.approx(H100.gemm_curve(d)(1.1e12), rel=0.05)
    assert p.hbm_efficiency(5e8) == pytest.approx(H100.hbm_efficiency(5e8), rel=0.03)  # the plateau
    assert built.fits["hbm.copy"]["test_mape"] < 6.0
    assert p.attention_fwd_efficiency(5e11) == pytest.approx(H100.attention_fwd_efficiency(5e11), rel=0.06)
    # collectives: the all_reduce curve is the measurement; the ring ceiling the lower of AG / RS
    f = busbw_factor("all_reduce", 8)
    assert p.nvlink_busbw(2**30) == pytest.approx(f * 2**30 / (15e-6 + f * 2**30 / 400e9), rel=1e-4)
    assert p.nvlink_ring_busbw == pytest.approx(320e9, rel=0.01)
    assert p.nvlink_bandwidth == H100.nvlink_bandwidth  # datasheet link rate kept on a GPU
    assert built.fits["collective.intra.all_reduce"]["alpha_us"] == pytest.approx(15.0, rel=0.02)
    prov = dict(p.provenance)
    assert "NVIDIA H100 80GB HBM3" in prov["calibration"] and "driver 550.54.15" in prov["calibration"]
    assert "it predicted those with MAPE" in prov["gemm_efficiency.bf16"] and prov["gemm_efficiency.tf32"] == dict(H100.provenance)[
        "gemm_efficiency.tf32"]
    assert "nccl" in prov["collectives.intra"] and "measured" in prov["nvlink.allreduce_busbw"]
    # the file round trip a scenario depends on
    write_profile(p, tmp_path / "p.yaml")
    q = load_profile(str(tmp_path / "p.yaml"))
    assert q.gemm_curve("bf16").xs == pytest.approx(p.gemm_curve("bf16").xs, rel=1e-12)
    assert q.calibrated and q.name == p.name


def test_cpu_profile_takes_its_peaks_from_the_measurements():
    """A CPU has no datasheet: peaks are the best measured rates / 0.9; the template fills the rest."""
    slow = dataclasses.replace(H100, peak_flops=tuple((d, v / 5000) for d, v in H100.peak_flops),
                               hbm_bandwidth=H100.hbm_bandwidth / 100)
    rates = Rates(gemm={d: slow.peak(d) * 0.7 for d in ("tf32", "fp16", "bf16")}, memory=slow.hbm_bandwidth * 0.8,
                  attention=slow.peak("bf16") * 0.3, memory_budget=2**30)
    plan = build_plan(device="cpu", quick=True, dtypes=("tf32", "fp16", "bf16"), rates=rates)
    ms = _measure(slow, plan, ("tf32", "fp16", "bf16"))
    p = _build(CPU, None, ms).profile
    assert p.name == "cpu-some-cpu-8-core" and p.arch == CPU_ARCH and p.hbm_capacity == 64 * 2**30
    best = max(m.work / m.seconds for m in ms if m.kind == "gemm" and m.dtype == "bf16")
    assert p.peak("bf16") == pytest.approx(best / CPU_HEADROOM, rel=1e-4)
    assert p.peak("fp32") == p.peak("tf32")
    assert "raised to the fp32 peak" not in dict(p.provenance)["peak_tflops"]  # its bf16 GEMMs outrun fp32
    assert max(p.gemm_curve("bf16").ys) <= 1.0
    prov = dict(p.provenance)
    assert prov["peak_tflops"].startswith("derived") and prov["nvlink"].startswith("assumed")
    with pytest.raises(Exception, match="fp8"):
        p.peak("fp8")  # an ampere-arch profile has no fp8, as a CPU has none


def test_a_cpu_without_fast_16_bit_arithmetic_gets_the_fp32_peak_for_16_bit(tmp_path):
    """A CPU whose bf16 GEMMs run 30x slower than its fp32 ones (no AVX512_BF16/AMX; torch's bf16
    matmul on this 2-core machine) computes 16-bit data in its fp32 units, as torch's flash CPU
    attention does: the 16-bit peaks are the fp32 one, so attention that outruns the bf16 GEMMs still
    fits below efficiency 1 and the profile prices the measured calls as measured."""
    peaks = {"fp32": 2e12, "tf32": 2e12, "fp16": 2e12 / 30, "bf16": 2e12 / 30}
    cpu_like = dataclasses.replace(H100, peak_flops=tuple(peaks.items()), hbm_bandwidth=H100.hbm_bandwidth / 100)
    rates = Rates(gemm={d: cpu_like.peak(d) * 0.7 for d in ("tf32", "fp16", "bf16")},
                  memory=cpu_like.hbm_bandwidth * 0.8, attention=peaks["bf16"] * 0.3, memory_budget=2**30)
    plan = build_plan(device="cpu", quick=True, dtypes=("tf32", "fp16", "bf16"), rates=rates)
    # attention 10x faster than the bf16 GEMMs: what torch's CPU kernel, computing in fp32, does
    fast_attention = [dataclasses.replace(m, seconds=m.seconds / 10) if m.kind.startswith("attention") else m
                      for m in _measure(cpu_like, plan, ("tf32", "fp16", "bf16"))]
    built = _build(CPU, None, fast_attention)
    p = built.profile
    assert p.peak("bf16") == p.peak("fp16") == p.peak("tf32")
    assert "raised to the fp32 peak" in dict(p.provenance)["peak_tflops"]
    assert max(p.attention_fwd_efficiency.ys) < 1.0 and built.fits["attention.fwd"]["train_mape"] < 10.0
    for m in (m for m in fast_attention if m.kind == "attention_fwd"):
        assert attention_time(p, **m.params, dtype="bf16", backward=False) == pytest.approx(m.seconds, rel=0.1)
    for s in plan.gemm["bf16"][:3]:  # the bf16 GEMMs keep their (slow) measured times
        assert gemm_time(p, s.m, s.n, s.k, "bf16") == pytest.approx(gemm_time(cpu_like, s.m, s.n, s.k, "bf16"), rel=0.15)


def test_cpu_profile_must_have_every_16_bit_gemm():
    rates = Rates(gemm={"bf16": 1e11}, memory=1e10, attention=1e10, memory_budget=2**30)
    plan = build_plan(device="cpu", quick=True, dtypes=("bf16",), rates=rates)
    with pytest.raises(Exception, match="tf32, fp16"):
        _build(CPU, None, _measure(H100, plan, ("bf16",)))


def _cpu_rates(slow):
    return Rates(gemm={d: slow.peak(d) * 0.7 for d in ("tf32", "fp16", "bf16")}, memory=slow.hbm_bandwidth * 0.8,
                 attention=slow.peak("bf16") * 0.3, memory_budget=2**30)


def test_cpu_profile_on_a_gpu_base_says_what_it_measured_and_what_it_inherited(tmp_path):
    """`--device cpu --base h100-sxm-80gb --skip gemm,attention,elementwise`: the memory is this
    machine's (RAM capacity with the measured bandwidth), everything else the H100's, and the
    profile says so: not named like the GPU, its kept provenance marked as inherited."""
    slow = dataclasses.replace(H100, hbm_bandwidth=H100.hbm_bandwidth / 100)
    plan = build_plan(device="cpu", quick=True, dtypes=("tf32", "fp16", "bf16"), rates=_cpu_rates(slow))
    copies = [m for m in _measure(slow, plan, ()) if m.kind in ("copy", "triad")]
    p = _build(CPU, H100, copies).profile
    assert p.name == "cpu-some-cpu-8-core-with-h100-sxm-80gb"
    assert p.hbm_capacity == 64 * 2**30 and p.hbm_bandwidth < H100.hbm_bandwidth / 50
    assert p.peak_flops == H100.peak_flops and p.gemm_efficiency == H100.gemm_efficiency  # not measured: kept
    prov, theirs = dict(p.provenance), dict(H100.provenance)
    assert prov["hbm.capacity"].startswith("measured: the machine's RAM")
    assert prov["peak_tflops"] == f"inherited from the base h100-sxm-80gb (bundled), not measured on this CPU: " \
                                  f"{theirs['peak_tflops']}"
    assert all(prov[k].startswith("inherited from the base") for k in theirs if not k.startswith("hbm"))
    assert "this CPU measured hbm.capacity, hbm.bandwidth, hbm.efficiency" in prov["base"]
    write_profile(p, tmp_path / "p.yaml")
    q = load_profile(str(tmp_path / "p.yaml"))
    assert (q.name, q.hbm_capacity) == (p.name, p.hbm_capacity)


def test_cpu_gemms_on_a_gpu_base_drop_its_fp8():
    """The CPU's measured 16-bit peaks do not sit beside the GPU's fp8 peak (a CPU has no fp8)."""
    slow = dataclasses.replace(H100, peak_flops=tuple((d, v / 5000) for d, v in H100.peak_flops),
                               hbm_bandwidth=H100.hbm_bandwidth / 100)
    plan = build_plan(device="cpu", quick=True, dtypes=("tf32", "fp16", "bf16"), rates=_cpu_rates(slow))
    p = _build(CPU, H100, _measure(slow, plan, ("tf32", "fp16", "bf16"))).profile
    assert "fp8" not in dict(p.peak_flops) and "fp8" not in dict(p.gemm_efficiency)
    assert p.peak("bf16") < H100.peak("bf16") / 1000
    assert "fp8 peak dropped" in dict(p.provenance)["peak_tflops"]


def test_cpu_profile_names_say_whose_fields_they_hold():
    """cpu-<model> for this CPU alone, also when the base is a profile of this CPU already (a later
    --collectives run on it); cpu-<model>-with-BASE where the unmeasured fields are another
    device's, and that stays the name of runs on the hybrid. Never the GPU's name or
    BASE-calibrated: nothing of the GPU was measured."""
    slow = dataclasses.replace(H100, peak_flops=tuple((d, v / 5000) for d, v in H100.peak_flops),
                               hbm_bandwidth=H100.hbm_bandwidth / 100)
    plan = build_plan(device="cpu", quick=True, dtypes=("tf32", "fp16", "bf16"), rates=_cpu_rates(slow))
    copies = [m for m in _measure(slow, plan, ()) if m.kind == "copy"]
    alone = _build(CPU, None, _measure(slow, plan, ("tf32", "fp16", "bf16"))).profile
    again = _build(CPU, alone, copies).profile
    hybrid = _build(CPU, H100, copies).profile
    on_hybrid = _build(CPU, hybrid, copies).profile
    assert (alone.name, again.name) == ("cpu-some-cpu-8-core", "cpu-some-cpu-8-core")
    assert hybrid.name == on_hybrid.name == "cpu-some-cpu-8-core-with-h100-sxm-80gb"
    assert not any(v.startswith("inherited") for v in dict(again.provenance).values())


def test_a_measurement_that_is_not_a_positive_time_is_left_out_with_a_note():
    """One timer reading of 0 or NaN used to abort the whole fit (and lose every measurement)."""
    rates = rates_from_profile(H100, ("bf16",), memory_budget=40 * 2**30)
    plan = build_plan(device="cuda", quick=True, dtypes=("bf16",), rates=rates)
    ms = _measure(H100, plan, ("bf16",))
    gemms = [i for i, m in enumerate(ms) if m.kind == "gemm"]
    ms[gemms[3]] = dataclasses.replace(ms[gemms[3]], seconds=0.0)
    ms[gemms[5]] = dataclasses.replace(ms[gemms[5]], seconds=float("nan"))
    built = _build(GPU, H100, ms)
    assert any(n.startswith("2 measurement(s) with a time that is not a positive number were left out") for n in built.notes)
    assert built.fits["gemm.bf16"]["n_train"] == len(gemms) - 2


def _scaled(curve, k):
    from hwmodels.curves import Curve
    return Curve(curve.xs, tuple(y * k for y in curve.ys))


def test_attention_measured_at_several_head_dims_gets_a_curve_per_head_dim(tmp_path):
    """A device whose head dim 64 runs attention at 0.8x the speed of its head dim 128: one fit over
    both would price each at the average; the profile keeps a curve for each."""
    rates = rates_from_profile(H100, ("bf16",), memory_budget=40 * 2**30)
    plan = build_plan(device="cuda", quick=True, dtypes=("bf16",), rates=rates)
    assert sorted({a.head_dim for a in plan.attention}) == [64, 128]
    fwd, bwd = H100.attention_fwd_efficiency, H100.attention_bwd_efficiency
    device = dataclasses.replace(H100, attention_head_dims=((64, _scaled(fwd, 0.8), _scaled(bwd, 0.8)), (128, fwd, bwd)))
    built = _build(GPU, H100, _measure(device, plan, ("bf16",)))
    p = load_profile(str(write_profile(built.profile, tmp_path / "p.yaml")))
    assert [d for d, *_ in p.attention_head_dims] == [64, 128] and not p.attention_flash3_head_dims
    for d, k in ((64, 0.8), (128, 1.0)):
        shape = dict(batch=4, heads=2048 // d, q_len=4096, kv_len=4096, head_dim=d, causal=True, dtype="bf16")
        for backward in (False, True):
            truth = attention_time(device, **shape, backward=backward)
            assert attention_time(p, **shape, backward=backward) == pytest.approx(truth, rel=0.05)
    assert "64, 128" in dict(p.provenance)["attention_efficiency.by_head_dim"]
    assert {f"attention.{w}.d{d}" for w in ("fwd", "bwd") for d in (64, 128)} <= built.fits.keys()
    # measured anew at one head dim, a base profile's per-head-dim curves are dropped, not kept
    one = [m for m in _measure(device, plan, ("bf16",)) if m.params.get("head_dim", 128) == 128]
    again = _build(GPU, p, one)
    assert again.profile.attention_head_dims == ()
    assert "attention_efficiency.by_head_dim" not in dict(again.profile.provenance)
    assert not [k for k in again.fits if k.startswith("attention.fwd.d")]  # nothing kept, nothing reported


def test_nic_efficiency_counts_only_the_nics_the_ranks_reach():
    """2 nodes x 4 ranks on 8-GPU nodes reach half of each node's NICs (hwmodels.network: ppn x the
    per-GPU share); a busbw of 180 GB/s over 8 x 400 Gb/s is then 0.9 of that half, not 0.45."""
    rates = rates_from_profile(H100, ("bf16",), memory_budget=40 * 2**30)
    plan = build_plan(device="cuda", quick=True, dtypes=("bf16",), rates=rates)
    samples = _collectives() + _collectives(ranks=8, tier="inter", busbw=180e9)
    built = _build(dataclasses.replace(GPU, count=8), H100, _measure(H100, plan, ("bf16",)), samples)
    assert built.profile.nic_efficiency == pytest.approx(0.9, rel=0.01)
    assert "4 of the node's 8 GPUs ran ranks" in dict(built.profile.provenance)["network.nic_efficiency"]
    # every GPU of the node ran a rank: the whole line rate
    full = _collectives() + _collectives(ranks=16, tier="inter", busbw=180e9)
    assert _build(dataclasses.replace(GPU, count=8), H100, _measure(H100, plan, ("bf16",)), full).profile.nic_efficiency \
        == pytest.approx(0.45, rel=0.01)


def test_a_base_of_another_gpu_size_is_called_out():
    rates = rates_from_profile(H100, ("bf16",), memory_budget=40 * 2**30)
    plan = build_plan(device="cuda", quick=True, dtypes=("bf16",), rates=rates)
    h200 = load_profile("h200-sxm-141gb")
    built = _build(GPU, h200, _measure(H100, plan, ("bf16",)))
    assert any("the base profile h200-sxm-141gb describes a 140 GiB GPU" in n for n in built.notes)
    assert not any("describes a" in n for n in _build(GPU, H100, _measure(H100, plan, ("bf16",))).notes)


def test_elementwise_backwards_are_reported_as_their_ratio_to_the_forward():
    """Timed both ways, each op's backward over forward (median of its two largest sizes) is
    reported beside the factor the simulator prices the fused kernel with; a small size's ratio,
    mostly launch, does not count."""
    from hwmodels.compute import BACKWARD_OVER_FORWARD

    rates = rates_from_profile(H100, ("bf16",), memory_budget=40 * 2**30)
    plan = build_plan(device="cuda", quick=True, dtypes=("bf16",), rates=rates)
    forward = _measure(H100, plan, ("bf16",))
    sizes = sorted({n for _, n in plan.elementwise})
    assert len(sizes) >= 3
    ratio = {"layernorm": 2.2, "rmsnorm": 1.8, "softmax": 1.5, "gelu": 1.5, "swiglu": 1.9}
    backward = [dataclasses.replace(m, kind="elementwise_bwd",
                                    seconds=m.seconds * (10.0 if m.params["elements"] == sizes[0] else ratio[m.op]))
                for m in forward if m.kind == "elementwise"]
    built = _build(GPU, H100, forward + backward)
    for op, r in ratio.items():
        assert built.fits[f"memory_bound_backward.{op}"] == {"measured_over_forward": pytest.approx(r),
                                                             "model_over_forward": BACKWARD_OVER_FORWARD[op]}
    text = dict(built.profile.provenance)["memory_bound.backward.check"]
    assert text.startswith("measured:") and "layernorm 2.20 (model 2.00)" in text and "gelu 1.50 (model 1.50)" in text
    # measured forward only (an older report): no check
    assert not any(k.startswith("memory_bound_backward.") for k in _build(GPU, H100, forward).fits)
