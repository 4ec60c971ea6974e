"""GPU profiles: the Curve, the bundled datasheet profiles, load/write round trip and errors."""
from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import pytest
import yaml

from hwmodels.curves import Curve, to_unit
from hwmodels.profile import BUNDLED, PROFILE_DIR, GpuProfile, load_profile, write_profile
from paraplan.errors import ConfigError, ParaplanError
from paraplan.specs import InterNodeSpec, LinkSpec

GiB = 2**30
# Memory of the Hopper profiles: what torch reports on the device (total_memory, in the measured
# reports under benchmarks/data/gpu), below the datasheet's 80 and 141 GB
H100_MEMORY_GIB, H200_MEMORY_GIB = 85017493504 / GiB, 150109880320 / GiB

# ----------------------------------------------------------------------------------------- Curve


def test_curve_interpolates_linearly_in_log10_of_x():
    c = Curve((10.0, 1000.0), (0.2, 0.6))
    assert c(100.0) == pytest.approx(0.4)          # log10 midpoint
    assert c(10**1.5) == pytest.approx(0.3)        # a quarter of the way in log10
    assert c(10**2.5) == pytest.approx(0.5)


def test_curve_three_knots_picks_the_right_segment():
    c = Curve((1.0, 10.0, 100.0), (0.0, 1.0, 0.5))
    assert c(10**0.5) == pytest.approx(0.5)
    assert c(10**1.5) == pytest.approx(0.75)
    assert c(10.0) == pytest.approx(1.0)


def test_curve_is_clamped_outside_its_knots():
    c = Curve((10.0, 1000.0), (0.2, 0.6))
    assert c(1.0) == 0.2 and c(0.0) == 0.2 and c(-5.0) == 0.2
    assert c(1e9) == 0.6


@pytest.mark.parametrize("xs, ys", [
    ((10.0, 1.0), (0.1, 0.2)),        # decreasing
    ((1.0, 1.0), (0.1, 0.2)),         # not strictly increasing
    ((1.0, 2.0), (0.1,)),             # lengths differ
    ((), ()),                         # empty
    ((0.0, 1.0), (0.1, 0.2)),         # log10(0)
    ((1.0, 2.0), (0.1, float("nan"))),
])
def test_curve_rejects_malformed_knots(xs, ys):
    with pytest.raises(ValueError):
        Curve(xs, ys)


def test_curve_is_hashable_and_compares_by_knots():
    a, b = Curve((1, 2), (3, 4)), Curve((1.0, 2.0), (3.0, 4.0))
    assert a == b and hash(a) == hash(b)
    assert a != Curve((1, 2), (3, 5))


def test_to_unit_round_trips_exactly():
    for v, scale in [(0.6e-6, 1e-6), (2.7e-6, 1e-6), (2039e9, 1e9), (989.4e12, 1e12), (1.2345678901e12, 1e9),
                     (141 * GiB, GiB), (25e9, 1e9 / 8)]:
        assert to_unit(v, scale) * scale == v
    assert to_unit(312e12, 1e12) == 312 and isinstance(to_unit(312e12, 1e12), int)


# ---------------------------------------------------------------------------- bundled profiles

# Datasheet figures, copied from public sources (gpus.*).
DATASHEET = {
    #                 bf16 TFLOP/s, fp8,   tf32,  HBM GiB, HBM GB/s, NVLink GB/s, NIC Gb/s
    "a100-sxm-40gb": (312, None, 156, 39.59, 1555, 300, 200),
    "a100-sxm-80gb": (312, None, 156, 79.25, 2039, 300, 200),
    "h100-sxm-80gb": (989.4, 1978.9, 494.7, H100_MEMORY_GIB, 3350, 450, 400),
    "h100-sxm-80gb-calibrated": (989.4, 1978.9, 494.7, H100_MEMORY_GIB, 3350, 450, 400),
    "h200-sxm-141gb": (989.4, 1978.9, 494.7, H200_MEMORY_GIB, 4800, 450, 400),
    "h200-sxm-141gb-calibrated": (989.4, 1978.9, 494.7, H200_MEMORY_GIB, 4800, 450, 400),
    "b200-sxm-180gb": (2250, 4500, 1100, 178.35, 7700, 900, 400),
}


def test_every_bundled_profile_is_listed_and_loads():
    assert set(BUNDLED) == set(DATASHEET) == {p.stem for p in PROFILE_DIR.glob("*.yaml")}
    for name in BUNDLED:
        p = load_profile(name)
        assert isinstance(p, GpuProfile) and p.name == name and p.calibrated is name.endswith("-calibrated")


def test_the_calibrated_h100_is_measured_where_it_says_and_the_datasheet_profile_elsewhere():
    """paraplan calibrate on an H100 (benchmarks/data/gpu/h100-calibration-report.json): GEMMs, HBM and
    cuDNN attention (-> the flash3 curve) measured; FlashAttention-2 and the links kept from the base."""
    cal, base = load_profile("h100-sxm-80gb-calibrated"), load_profile("h100-sxm-80gb")
    prov = dict(cal.provenance)
    for key in ("gemm_efficiency.bf16", "hbm.efficiency", "attention_efficiency_flash3.fwd",
                "attention_efficiency_flash3.bwd"):
        assert prov[key].startswith("measured:"), key
    assert "CUDNN_ATTENTION" in prov["attention_efficiency_flash3.fwd"]
    assert cal.attention_fwd_efficiency == base.attention_fwd_efficiency  # FA2: not what torch ran
    assert cal.attention_flash3_efficiency != base.attention_flash3_efficiency
    assert cal.nvlink_busbw == base.nvlink_busbw and cal.peak_flops == base.peak_flops
    # sustained at the 700 W limit the big bf16 GEMMs ran at a median 0.68 of peak, below the datasheet-derived 0.80
    assert 0.6 < cal.gemm_curve("bf16")(2.0 * 8192**3) < base.gemm_curve("bf16")(2.0 * 8192**3)


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_peaks_equal_the_datasheet(name):
    bf16, fp8, tf32, hbm_gib, hbm_gbps, nvlink, nic_gbit = DATASHEET[name]
    p = load_profile(name)
    assert p.peak("bf16") == pytest.approx(bf16 * 1e12, rel=1e-12)
    assert p.peak("fp16") == p.peak("bf16")
    assert p.peak("tf32") == pytest.approx(tf32 * 1e12, rel=1e-12)
    assert p.peak("fp32") == p.peak("tf32")  # fp32 GEMMs run on TF32 tensor cores
    assert p.hbm_capacity == pytest.approx(hbm_gib * GiB, rel=1e-12)
    assert p.hbm_bandwidth == pytest.approx(hbm_gbps * 1e9, rel=1e-12)
    assert p.nvlink_bandwidth == pytest.approx(nvlink * 1e9, rel=1e-12)
    assert p.default_inter_node().nic_bandwidth == pytest.approx(nic_gbit * 1e9 / 8, rel=1e-12)
    if fp8 is None:
        with pytest.raises(ConfigError) as err:
            p.peak("fp8")
        assert err.value.path == "training.precision"
        with pytest.raises(ConfigError):
            p.gemm_curve("fp8")
    else:
        assert p.peak("fp8") == pytest.approx(fp8 * 1e12, rel=1e-12)


def test_fp32_keeps_its_cuda_core_figure_in_peak_flops():
    assert dict(load_profile("a100-sxm-80gb").peak_flops)["fp32"] == pytest.approx(19.5e12)


def test_unknown_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match="int4"):
        load_profile("h100-sxm-80gb").peak("int4")


def test_default_node_network():
    a100, h100 = load_profile("a100-sxm-80gb"), load_profile("h100-sxm-80gb")
    assert a100.default_intra_node() == LinkSpec(bandwidth=300e9, latency=a100.nvlink_latency)
    assert a100.nvlink_latency == pytest.approx(0.6e-6)
    assert a100.default_inter_node() == InterNodeSpec(nics_per_node=8, nic_bandwidth=25e9, topology="rail-optimized",
                                                      oversubscription=1, latency=a100.default_inter_node().latency,
                                                      nodes_per_leaf=20)
    assert a100.default_inter_node().latency == pytest.approx(2.7e-6)
    assert a100.nic_efficiency == pytest.approx(24 / 25) and h100.nic_efficiency == pytest.approx(47 / 50)
    assert h100.default_inter_node().nics_per_node == 8 and h100.default_inter_node().nodes_per_leaf == 32


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_provenance_covers_every_field_with_a_source(name):
    p = load_profile(name)
    prov = dict(p.provenance)
    needed = {"peak_tflops", "hbm.capacity", "hbm.bandwidth", "hbm.efficiency", "attention_efficiency.fwd",
              "attention_efficiency.bwd", "nvlink.bandwidth", "nvlink.latency", "nvlink.ring_busbw",
              "nvlink.allreduce_busbw", "network", "network.nic_efficiency", "network.latency"}
    needed |= {f"gemm_efficiency.{d}" for d, _ in p.gemm_efficiency}
    assert needed <= set(prov), needed - set(prov)
    for field, text in prov.items():
        # a calibrated profile's measured fields cite the report in benchmarks/data/gpu/ instead
        measured = p.calibrated and (text.startswith("measured") or field in ("calibration", "base", "hbm.efficiency.check"))
        assert "https://" in text or text.startswith("derived:") or measured, field


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_curves_are_sane(name):
    p = load_profile(name)
    for _, c in p.gemm_efficiency:
        assert 0 < min(c.ys) and max(c.ys) < 0.9
    if p.calibrated:  # copies measured below the 3 us kernel overhead leave the small-size knots at 1
        assert 0.75 <= p.hbm_efficiency(2**30) <= 0.9 and p.hbm_efficiency.max <= 1.0
    else:
        assert 0.75 <= p.hbm_efficiency.max <= 0.9  # STREAM copy fractions 0.79 .. 0.87
    assert p.nvlink_ring_busbw <= p.nvlink_busbw.max <= p.nvlink_bandwidth * 1.1
    assert 0.7 < p.nvlink_ring_busbw / p.nvlink_bandwidth < 0.85  # rules_of_thumb 0.77-0.82


# ---------------------------------------------------------------------------- load / write


@pytest.mark.parametrize("name", BUNDLED)
def test_write_then_load_round_trips_every_bundled_profile(tmp_path, name):
    p = load_profile(name)
    path = write_profile(p, tmp_path / f"{name}.yaml")
    assert load_profile(str(path)) == p


def test_round_trip_of_a_calibrated_profile_with_awkward_numbers(tmp_path):
    p = load_profile("h100-sxm-80gb")
    q = dataclasses.replace(
        p, name="my-h100", calibrated=True, hbm_bandwidth=3.0123456789e12, nvlink_latency=0.7311e-6,
        hbm_capacity=79.6 * GiB, gemm_efficiency=(("tf32", Curve((1.1e9, 3.3e11), (0.31, 0.77))),) + p.gemm_efficiency[1:],
        node_network=dataclasses.replace(p.node_network, latency=3.14159e-6, oversubscription=2.5),
        provenance=(("gemm_efficiency.bf16", "measured: paraplan calibrate, fit MAPE 2.1%"),))
    assert load_profile(str(write_profile(q, tmp_path / "mine.yaml"))) == q


def test_written_profile_is_human_readable_with_units_in_keys(tmp_path):
    text = write_profile(load_profile("a100-sxm-80gb"), tmp_path / "a.yaml").read_text()
    raw = yaml.safe_load(text)
    assert raw["peak_tflops"]["bf16"] == 312
    assert raw["hbm"]["capacity_GiB"] == 79.25 and raw["hbm"]["bandwidth_GBps"] == 2039
    assert raw["network"]["nic_bandwidth_Gbps"] == 200
    assert set(raw["gemm_efficiency"]["bf16"]) == {"gflops", "efficiency"}


def test_atomic_write_leaves_no_temporary_file(tmp_path):
    write_profile(load_profile("a100-sxm-80gb"), tmp_path / "a.yaml")
    assert os.listdir(tmp_path) == ["a.yaml"]


def test_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    target = tmp_path / "a.yaml"
    target.write_text("old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(ParaplanError, match=r"cannot write .*a\.yaml: disk full$"):  # the target, not the temporary
        write_profile(load_profile("a100-sxm-80gb"), target)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["a.yaml"]


def test_rewritten_file_is_reloaded_not_served_from_cache(tmp_path):
    p = load_profile("a100-sxm-80gb")
    path = write_profile(p, tmp_path / "x.yaml")
    assert load_profile(str(path)) is load_profile(str(path))  # cached
    q = dataclasses.replace(p, hbm_bandwidth=1.9e12, calibrated=True)
    write_profile(q, path)
    assert load_profile(str(path)) == q


def test_unknown_profile_name_lists_the_bundled_names():
    with pytest.raises(ConfigError) as err:
        load_profile("a100-sxm-90gb")
    assert err.value.path == "cluster.gpu"
    for name in BUNDLED:
        assert name in str(err.value)


def test_missing_profile_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_profile(str(tmp_path / "nope.yaml"))
    assert err.value.path == "cluster.gpu" and "h100-sxm-80gb" in str(err.value)


def _bundled_raw(name="a100-sxm-80gb") -> dict:
    return yaml.safe_load((PROFILE_DIR / f"{name}.yaml").read_text())


def _load_raw(tmp_path: Path, raw: dict):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    return load_profile(str(path))


def test_misspelt_key_names_its_path_and_suggests(tmp_path):
    raw = _bundled_raw()
    raw["hbm"]["bandwith_GBps"] = raw["hbm"].pop("bandwidth_GBps")
    with pytest.raises(ConfigError) as err:
        _load_raw(tmp_path, raw)
    assert err.value.path == "hbm.bandwith_GBps" and "bandwidth_GBps" in str(err.value)


@pytest.mark.parametrize("mutate, path", [
    (lambda r: r["gemm_efficiency"]["bf16"].update(gflops=[10, 5, 20, 30, 40, 50]), "gemm_efficiency.bf16"),
    (lambda r: r["gemm_efficiency"]["bf16"]["efficiency"].__setitem__(0, 1.3), "gemm_efficiency.bf16.efficiency"),
    (lambda r: r["gemm_efficiency"].pop("tf32"), "gemm_efficiency.tf32"),
    (lambda r: r.update(arch="volta"), "arch"),
    (lambda r: r["peak_tflops"].update(fp8=624), "peak_tflops.fp8"),
    (lambda r: r["network"].update(topology="torus"), "network.topology"),
    (lambda r: r["network"].update(nics_per_node=7.5), "network.nics_per_node"),
    (lambda r: r["nvlink"].update(latency_us=-1), "nvlink.latency_us"),
    # past any hardware: had given an infinite step time, a traceback, or room for any plan
    (lambda r: r["nvlink"].update(latency_us=float("inf")), "nvlink.latency_us"),
    (lambda r: r["nvlink"].update(bandwidth_GBps=1e300), "nvlink.bandwidth_GBps"),
    (lambda r: r["hbm"].update(capacity_GiB=1e308), "hbm.capacity_GiB"),
    (lambda r: r["peak_tflops"].update(bf16=float("inf")), "peak_tflops.bf16"),
    (lambda r: r["network"].update(nic_bandwidth_Gbps=1e-300), "network.nic_bandwidth_Gbps"),
    (lambda r: r["gemm_efficiency"]["bf16"]["efficiency"].__setitem__(0, 1e-300), "gemm_efficiency.bf16.efficiency"),
    (lambda r: r["nvlink"]["allreduce_busbw"]["busbw_GBps"].__setitem__(0, 1e300), "nvlink.allreduce_busbw.busbw_GBps"),
    (lambda r: r["hbm"].update(capacity_GB=80), "hbm"),
    (lambda r: r.pop("network"), "network"),
    (lambda r: r["attention_efficiency"].update(by_head_dim={"d128": dict(r["attention_efficiency"])}),
     "attention_efficiency.by_head_dim.d128"),
    (lambda r: r["attention_efficiency"].update(by_head_dim={128: {"fwd": r["attention_efficiency"]["fwd"]}}),
     "attention_efficiency.by_head_dim.128.bwd"),
])
def test_malformed_profile_is_a_config_error_at_its_key(tmp_path, mutate, path):
    raw = _bundled_raw()
    mutate(raw)
    with pytest.raises(ConfigError) as err:
        _load_raw(tmp_path, raw)
    assert err.value.path == path
    assert "bad.yaml" in str(err.value)


def test_capacity_may_be_given_in_decimal_gigabytes(tmp_path):
    raw = _bundled_raw("h200-sxm-141gb")
    del raw["hbm"]["capacity_GiB"]
    raw["hbm"]["capacity_GB"] = 141
    assert _load_raw(tmp_path, raw).hbm_capacity == pytest.approx(141e9)


def test_not_yaml_is_a_config_error(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("name: [unclosed")
    with pytest.raises(ConfigError) as err:
        load_profile(str(path))
    assert err.value.path == "cluster.gpu"


def test_hbm_efficiency_plateau_is_the_stream_fraction():
    # STREAM copy TB/s / peak, Azure AI-benchmarking-guide ND A100 v4, ND H100 v5 and ND H200 v5 results:
    # https://github.com/Azure/AI-benchmarking-guide/blob/3bb66cacc25632d8ece36bc1d5128c5ea886a60b/Azure_Results/ND_A100_v4_results.md
    # https://github.com/Azure/AI-benchmarking-guide/blob/f350e7e65b82cfcb9220b32b582bc34342d9c1a6/Azure%20Results/ND_H100_v5_results.md
    # https://github.com/Azure/AI-benchmarking-guide/blob/7f20e5fa3b2f9a46d8404af1f6fb14b049d6d5cc/Azure_Results/ND_H200_v5_results.md
    for name, copy_tbps in [("a100-sxm-80gb", 1.61), ("h100-sxm-80gb", 2.9), ("h200-sxm-141gb", 4.01)]:
        p = load_profile(name)
        assert p.hbm_efficiency(1e10) * p.hbm_bandwidth == pytest.approx(copy_tbps * 1e12, rel=0.02)
        assert math.isclose(p.hbm_efficiency(1e8), p.hbm_efficiency.max)


def test_invalid_profile_yaml_is_one_line_with_its_position(tmp_path):
    """The same 'invalid YAML: line L, column C: problem' as a scenario's or a records file's."""
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\npeak_tflops: {bf16: 1\n")
    with pytest.raises(ConfigError) as exc:
        load_profile(str(path))
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith(f"cluster.gpu: {path}: invalid YAML: line 3, column 1: ")


def test_per_head_dim_attention_curves_round_trip_in_head_dim_order(tmp_path):
    p = load_profile("h100-sxm-80gb")
    fwd, bwd = p.attention_fwd_efficiency, p.attention_bwd_efficiency
    slow = Curve(fwd.xs, tuple(y / 2 for y in fwd.ys))
    mine = dataclasses.replace(p, attention_head_dims=((64, slow, bwd), (256, fwd, bwd)),
                               attention_flash3_head_dims=((128, slow, slow),))
    again = load_profile(str(write_profile(mine, tmp_path / "p.yaml")))
    assert again == mine
    raw = yaml.safe_load((tmp_path / "p.yaml").read_text())
    raw["attention_efficiency"]["by_head_dim"] = dict(reversed(list(raw["attention_efficiency"]["by_head_dim"].items())))
    assert list(raw["attention_efficiency"]["by_head_dim"]) == [256, 64]
    assert _load_raw(tmp_path, raw).attention_head_dims == ((64, slow, bwd), (256, fwd, bwd))  # read in order


def test_per_head_dim_curves_must_be_distinct_and_ascending():
    p = load_profile("h100-sxm-80gb")
    fwd, bwd = p.attention_fwd_efficiency, p.attention_bwd_efficiency
    for dims in ((256, 64), (128, 128)):
        with pytest.raises(ValueError, match="head dims must be distinct and ascending"):
            dataclasses.replace(p, attention_head_dims=tuple((d, fwd, bwd) for d in dims))
