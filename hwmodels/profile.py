"""A GPU hardware profile: datasheet peaks plus measured efficiency tables, with provenance.

Bundled profiles (hwmodels/profiles/<name>.yaml) hold datasheet figures and published
measurements, every number traceable to public sources and its source
URL; `paraplan calibrate` writes measured ones through `write_profile` in the same format.
Internal units are SI (FLOP/s, bytes, bytes/s, seconds); the YAML keys carry their unit.

dtype conventions (`GpuProfile.peak` / `gemm_curve`):
- fp32 training runs its GEMMs on TF32 tensor cores (PyTorch `allow_tf32`, NVIDIA's containers
  enable it), so `peak("fp32")` is the TF32 peak; the CUDA-core fp32 figure stays in `peak_flops`.
- fp8 exists only on Hopper and newer; asking an Ampere profile for it is a ConfigError under
  `training.precision`.
"""
from __future__ import annotations

import difflib
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hwmodels.curves import Curve, to_unit
from paraplan.errors import ConfigError
from paraplan.fileio import parse_yaml, read_text, write_atomic, yaml_problem
from paraplan.specs import (
    BANDWIDTH_RANGE, BUSBW_RANGE, CAPACITY_RANGE, EFFICIENCY_FLOOR, FLOPS_RANGE, LATENCY_RANGE,
    OVERSUBSCRIPTION_RANGE, TOPOLOGIES,
    InterNodeSpec, LinkSpec,
)

__all__ = ["ARCHS", "BUNDLED", "Curve", "DTYPES", "HEAD_DIM_FIELDS", "GpuProfile", "load_profile", "write_profile"]

DTYPES = ("fp32", "tf32", "fp16", "bf16", "fp8")
ARCHS = ("ampere", "hopper", "blackwell")
BUNDLED = ("a100-sxm-40gb", "a100-sxm-80gb", "h100-sxm-80gb", "h100-sxm-80gb-calibrated", "h200-sxm-141gb",
           "h200-sxm-141gb-calibrated", "b200-sxm-180gb")
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"

HeadDimCurves = tuple[tuple[int, Curve, Curve], ...]
"""((head_dim, forward curve, backward curve), ...), head dims ascending."""
HEAD_DIM_FIELDS = ("attention_head_dims", "attention_flash3_head_dims")
"""GpuProfile's per-head-dim curves, of the flash and flash3 kernels."""

# Unit of each YAML key -> SI.
TFLOPS, GBPS, GBITPS, GIB, GB, MB, GFLOP, US = 1e12, 1e9, 1e9 / 8, 2**30, 1e9, 1e6, 1e9, 1e-6


@dataclass(frozen=True, kw_only=True)
class GpuProfile:
    name: str
    arch: str
    """ampere | hopper | blackwell: selects NCCL's per-architecture constants and NVLS."""
    peak_flops: tuple[tuple[str, float], ...]
    """(dtype, dense FLOP/s) datasheet peaks, no 2:4 sparsity; fp8 absent where unsupported."""
    hbm_capacity: float
    """bytes."""
    hbm_bandwidth: float
    """bytes/s, datasheet."""
    hbm_efficiency: Curve
    """bytes moved by one kernel -> fraction of hbm_bandwidth achieved."""
    gemm_efficiency: tuple[tuple[str, Curve], ...]
    """(dtype, curve): FLOPs of one GEMM -> fraction of peak(dtype) achieved."""
    attention_fwd_efficiency: Curve
    """FLOPs of one flash-attention forward call on the FlashAttention benchmark grid (16k tokens,
    2048 wide) -> fraction of the 16-bit peak; a call is read at the grid's FLOPs for its sequence
    length (hwmodels.compute.attention_curve_flops)."""
    attention_bwd_efficiency: Curve
    """The same for the backward call."""
    attention_flash3_efficiency: tuple[Curve, Curve] | None = None
    """(forward, backward) curves of Hopper's FlashAttention-3-class kernels (training.attention
    flash3), like the two above; None where the GPU has none."""
    attention_head_dims: HeadDimCurves = ()
    """Where calibration measured several head dims: per head dim, ascending, its own (forward,
    backward) curves of the `flash` kernel. A call reads those of the head dims around its own
    (hwmodels.compute.attention_time) instead of attention_fwd/bwd_efficiency, which one fit over all
    head dims makes an average of kernels whose speeds differ (on the H100 measured here, from 2k tokens
    up, head dim 128's backward ran 1.2-1.3x faster than that average and head dim 64's forward 1.25x
    slower)."""
    attention_flash3_head_dims: HeadDimCurves = ()
    """The same for attention_flash3_efficiency (where the H100 profile's measured curves are).
    With a single head dim, every call reads that one's curves."""

    def __post_init__(self) -> None:
        for name in HEAD_DIM_FIELDS:
            dims = [entry[0] for entry in getattr(self, name)]
            if dims != sorted(set(dims)):
                raise ValueError(f"{name}: head dims must be distinct and ascending, got {dims}")
    nvlink_bandwidth: float
    """bytes/s per GPU per direction, datasheet."""
    nvlink_ring_busbw: float
    """bytes/s: the ring-algorithm busbw ceiling inside one node (all_gather, reduce_scatter,
    ring all_reduce); below the all-reduce curve's peak where NVLS (NVLink SHARP) lifts it."""
    nvlink_busbw: Curve
    """8-GPU all-reduce message bytes -> measured nccl-tests busbw (bytes/s) within one node."""
    nvlink_latency: float
    """seconds: NCCL's NVLink hop latency (tuning.cc hwLat, ring LL)."""
    node_network: InterNodeSpec
    """The typical node's scale-out network, used where a scenario gives no inter_node."""
    nic_efficiency: float
    """Fraction of NIC line rate NCCL achieves (HDR 24/25, NDR 47/50)."""
    provenance: tuple[tuple[str, str], ...] = ()
    """(field, source URL or 'derived: how') pairs."""
    calibrated: bool = False
    """True when written by `paraplan calibrate` from measurements on this machine."""

    def peak(self, dtype: str) -> float:
        """Tensor-core peak FLOP/s for GEMMs in `dtype` (fp32 -> TF32, see module docstring)."""
        return dict(self.peak_flops)[self._tensor_dtype(dtype)]

    def gemm_curve(self, dtype: str) -> Curve:
        return dict(self.gemm_efficiency)[self._tensor_dtype(dtype)]

    def default_intra_node(self) -> LinkSpec:
        return LinkSpec(bandwidth=self.nvlink_bandwidth, latency=self.nvlink_latency)

    def default_inter_node(self) -> InterNodeSpec:
        return self.node_network

    def _tensor_dtype(self, dtype: str) -> str:
        if dtype not in DTYPES:
            raise ConfigError("training.precision", f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
        if dtype == "fp32":
            dtype = "tf32"
        if dtype not in dict(self.peak_flops):
            raise ConfigError(
                "training.precision",
                f"{self.name} ({self.arch}) has no {dtype} tensor cores; use "
                + ", ".join(d for d, _ in self.peak_flops if d != "fp32"),
            )
        return dtype


# ------------------------------------------------------------------------------------ loading


def load_profile(name_or_path: str) -> GpuProfile:
    """A bundled profile by name, or a profile YAML file by path."""
    if name_or_path in BUNDLED:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    else:
        path = Path(name_or_path).expanduser()
        if path.exists() and not path.is_file():
            raise ConfigError("cluster.gpu", f"{name_or_path}: a directory or device, not a GPU profile file")
        if not path.is_file():
            raise ConfigError("cluster.gpu", f"unknown GPU profile {name_or_path!r}: neither a bundled name "
                                             f"({', '.join(BUNDLED)}) nor an existing profile file")
    path = path.resolve()
    st = path.stat()
    return _load_cached(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=64)
def _load_cached(path: str, _mtime_ns: int, _size: int) -> GpuProfile:
    """Parsed once per file version (mtime and size in the key: a re-calibrated file is re-read)."""
    try:
        raw = parse_yaml(read_text(path, "cluster.gpu"))
    except yaml.YAMLError as exc:
        raise ConfigError("cluster.gpu", f"{path}: invalid YAML: {yaml_problem(exc)}") from None
    try:
        return _from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(exc.path, f"in GPU profile {path}: {exc.message}") from None


def _keys(raw: Any, path: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict:
    """A mapping with exactly the allowed keys; unknown ones rejected with a 'did you mean'."""
    if not isinstance(raw, dict):
        got = "nothing" if raw is None else type(raw).__name__
        raise ConfigError(path, f"expected a mapping, got {got}")
    allowed = required + optional
    for key in raw:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; allowed: {', '.join(allowed)}"
            raise ConfigError(f"{path}.{key}" if path else str(key), f"unknown key{hint}")
    for key in required:
        if key not in raw:
            raise ConfigError(f"{path}.{key}" if path else key, "missing")
    return raw


def _num(raw: Any, path: str, scale: float = 1.0, *, fraction: bool = False, integer: bool = False,
         within: tuple[float, float] | None = None) -> float:
    """A positive finite number times `scale`; a fraction in [EFFICIENCY_FLOOR, 1]; with `within`,
    its SI value (raw x scale) in that range (paraplan.specs), the bounds named in the file's unit."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not raw > 0 or raw == float("inf"):
        raise ConfigError(path, f"expected a positive finite number, got {raw!r}")
    if integer and not isinstance(raw, int):
        raise ConfigError(path, f"expected a whole number, got {raw!r}")
    if fraction and not EFFICIENCY_FLOOR <= raw <= 1:
        raise ConfigError(path, f"expected a fraction in [{EFFICIENCY_FLOOR:g}, 1], got {raw!r}")
    if within is not None and not within[0] <= raw * scale <= within[1]:
        raise ConfigError(path, f"expected a number from {within[0] / scale:g} to {within[1] / scale:g}, got {raw!r}")
    return raw * scale if scale != 1.0 else raw


def _curve(raw: Any, path: str, xkey: str, xscale: float, ykey: str, yscale: float = 1.0, *, fraction=True,
           within: tuple[float, float] | None = None) -> Curve:
    raw = _keys(raw, path, (xkey, ykey))
    xs, ys = raw[xkey], raw[ykey]
    for key, vals in ((xkey, xs), (ykey, ys)):
        if not isinstance(vals, list) or not vals:
            raise ConfigError(f"{path}.{key}", "expected a non-empty list of numbers")
    xs = [_num(v, f"{path}.{xkey}", xscale) for v in xs]
    ys = [_num(v, f"{path}.{ykey}", yscale, fraction=fraction, within=within) for v in ys]
    try:
        return Curve(tuple(xs), tuple(ys))
    except ValueError as exc:
        raise ConfigError(path, str(exc)) from None


def _head_dim_curves(raw: Any, path: str) -> HeadDimCurves:
    """`by_head_dim: {64: {fwd: CURVE, bwd: CURVE}, ...}` (absent or empty: none)."""
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a mapping of head dim -> {{fwd, bwd}}, got {type(raw).__name__}")
    out = []
    for d, pair in raw.items():
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
            raise ConfigError(f"{path}.{d}", "expected a positive whole head dim as the key")
        pair = _keys(pair, f"{path}.{d}", ("fwd", "bwd"))
        out.append((d, *(_curve(pair[k], f"{path}.{d}.{k}", "gflops", GFLOP, "efficiency") for k in ("fwd", "bwd"))))
    return tuple(sorted(out, key=lambda e: e[0]))


def _head_dim_dict(curves: HeadDimCurves) -> dict:
    return {"by_head_dim": {d: {"fwd": _curve_dict(f, "gflops", GFLOP, "efficiency"),
                                "bwd": _curve_dict(b, "gflops", GFLOP, "efficiency")} for d, f, b in curves}
            } if curves else {}


def _from_dict(raw: Any) -> GpuProfile:
    top = _keys(raw, "", ("name", "arch", "peak_tflops", "hbm", "gemm_efficiency", "attention_efficiency",
                          "nvlink", "network"), ("calibrated", "provenance", "attention_efficiency_flash3"))
    if not isinstance(top["name"], str) or not top["name"]:
        raise ConfigError("name", "expected a non-empty string")
    if top["arch"] not in ARCHS:
        raise ConfigError("arch", f"expected one of {', '.join(ARCHS)}, got {top['arch']!r}")
    calibrated = top.get("calibrated", False)
    if not isinstance(calibrated, bool):
        raise ConfigError("calibrated", f"expected true or false, got {calibrated!r}")

    peaks_raw = _keys(top["peak_tflops"], "peak_tflops", ("tf32", "fp16", "bf16"), ("fp32", "fp8"))
    peaks = tuple((d, _num(peaks_raw[d], f"peak_tflops.{d}", TFLOPS, within=FLOPS_RANGE)) for d in DTYPES if peaks_raw.get(d) is not None)
    if top["arch"] == "ampere" and "fp8" in dict(peaks):
        raise ConfigError("peak_tflops.fp8", "Ampere has no fp8 tensor cores")

    tensor = tuple(d for d, _ in peaks if d != "fp32")
    gemm_raw = _keys(top["gemm_efficiency"], "gemm_efficiency", tensor)
    gemm = tuple((d, _curve(gemm_raw[d], f"gemm_efficiency.{d}", "gflops", GFLOP, "efficiency")) for d in tensor)

    hbm = _keys(top["hbm"], "hbm", ("bandwidth_GBps", "efficiency"), ("capacity_GiB", "capacity_GB"))
    if ("capacity_GiB" in hbm) == ("capacity_GB" in hbm):
        raise ConfigError("hbm", "give exactly one of capacity_GiB, capacity_GB")
    capacity = (_num(hbm["capacity_GiB"], "hbm.capacity_GiB", GIB, within=CAPACITY_RANGE) if "capacity_GiB" in hbm
                else _num(hbm["capacity_GB"], "hbm.capacity_GB", GB, within=CAPACITY_RANGE))

    attn = _keys(top["attention_efficiency"], "attention_efficiency", ("fwd", "bwd"), ("by_head_dim",))
    flash3, flash3_head_dims = None, ()
    if top.get("attention_efficiency_flash3") is not None:
        f3 = _keys(top["attention_efficiency_flash3"], "attention_efficiency_flash3", ("fwd", "bwd"), ("by_head_dim",))
        flash3 = tuple(_curve(f3[k], f"attention_efficiency_flash3.{k}", "gflops", GFLOP, "efficiency")
                       for k in ("fwd", "bwd"))
        flash3_head_dims = _head_dim_curves(f3.get("by_head_dim"), "attention_efficiency_flash3.by_head_dim")
    nvl = _keys(top["nvlink"], "nvlink", ("bandwidth_GBps", "latency_us", "ring_busbw_GBps", "allreduce_busbw"))
    net = _keys(top["network"], "network", ("nics_per_node", "nic_bandwidth_Gbps", "nic_efficiency", "topology",
                                            "oversubscription", "latency_us", "nodes_per_leaf"))
    if net["topology"] not in TOPOLOGIES:
        raise ConfigError("network.topology", f"expected one of {', '.join(TOPOLOGIES)}, got {net['topology']!r}")
    oversub = _num(net["oversubscription"], "network.oversubscription", within=OVERSUBSCRIPTION_RANGE)

    prov = top.get("provenance") or {}
    if not isinstance(prov, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prov.items()):
        raise ConfigError("provenance", "expected a mapping of field -> source text")

    return GpuProfile(
        name=top["name"],
        arch=top["arch"],
        peak_flops=peaks,
        hbm_capacity=capacity,
        hbm_bandwidth=_num(hbm["bandwidth_GBps"], "hbm.bandwidth_GBps", GBPS, within=BANDWIDTH_RANGE),
        hbm_efficiency=_curve(hbm["efficiency"], "hbm.efficiency", "MB", MB, "efficiency"),
        gemm_efficiency=gemm,
        attention_fwd_efficiency=_curve(attn["fwd"], "attention_efficiency.fwd", "gflops", GFLOP, "efficiency"),
        attention_bwd_efficiency=_curve(attn["bwd"], "attention_efficiency.bwd", "gflops", GFLOP, "efficiency"),
        attention_flash3_efficiency=flash3,
        attention_head_dims=_head_dim_curves(attn.get("by_head_dim"), "attention_efficiency.by_head_dim"),
        attention_flash3_head_dims=flash3_head_dims,
        nvlink_bandwidth=_num(nvl["bandwidth_GBps"], "nvlink.bandwidth_GBps", GBPS, within=BANDWIDTH_RANGE),
        nvlink_ring_busbw=_num(nvl["ring_busbw_GBps"], "nvlink.ring_busbw_GBps", GBPS, within=BANDWIDTH_RANGE),
        nvlink_busbw=_curve(nvl["allreduce_busbw"], "nvlink.allreduce_busbw", "bytes", 1.0, "busbw_GBps", GBPS,
                            fraction=False, within=BUSBW_RANGE),
        nvlink_latency=_num(nvl["latency_us"], "nvlink.latency_us", US, within=LATENCY_RANGE),
        node_network=InterNodeSpec(
            nics_per_node=_num(net["nics_per_node"], "network.nics_per_node", integer=True),
            nic_bandwidth=_num(net["nic_bandwidth_Gbps"], "network.nic_bandwidth_Gbps", GBITPS, within=BANDWIDTH_RANGE),
            topology=net["topology"],
            oversubscription=oversub,
            latency=_num(net["latency_us"], "network.latency_us", US, within=LATENCY_RANGE),
            nodes_per_leaf=_num(net["nodes_per_leaf"], "network.nodes_per_leaf", integer=True),
        ),
        nic_efficiency=_num(net["nic_efficiency"], "network.nic_efficiency", fraction=True),
        provenance=tuple(prov.items()),
        calibrated=calibrated,
    )


# ------------------------------------------------------------------------------------ writing


def _curve_dict(c: Curve, xkey: str, xscale: float, ykey: str, yscale: float = 1.0) -> dict:
    return {xkey: [to_unit(x, xscale) for x in c.xs], ykey: [to_unit(y, yscale) for y in c.ys]}


def _to_dict(p: GpuProfile) -> dict:
    net = p.node_network
    out = {
        "name": p.name,
        "arch": p.arch,
        "calibrated": p.calibrated,
        "peak_tflops": {d: to_unit(v, TFLOPS) for d, v in p.peak_flops},
        "hbm": {
            "capacity_GiB": to_unit(p.hbm_capacity, GIB),
            "bandwidth_GBps": to_unit(p.hbm_bandwidth, GBPS),
            "efficiency": _curve_dict(p.hbm_efficiency, "MB", MB, "efficiency"),
        },
        "gemm_efficiency": {d: _curve_dict(c, "gflops", GFLOP, "efficiency") for d, c in p.gemm_efficiency},
        "attention_efficiency": {
            "fwd": _curve_dict(p.attention_fwd_efficiency, "gflops", GFLOP, "efficiency"),
            "bwd": _curve_dict(p.attention_bwd_efficiency, "gflops", GFLOP, "efficiency"),
            **_head_dim_dict(p.attention_head_dims),
        },
        **({"attention_efficiency_flash3": {
            **{k: _curve_dict(c, "gflops", GFLOP, "efficiency") for k, c in zip(("fwd", "bwd"), p.attention_flash3_efficiency)},
            **_head_dim_dict(p.attention_flash3_head_dims),
        }} if p.attention_flash3_efficiency else {}),
        "nvlink": {
            "bandwidth_GBps": to_unit(p.nvlink_bandwidth, GBPS),
            "latency_us": to_unit(p.nvlink_latency, US),
            "ring_busbw_GBps": to_unit(p.nvlink_ring_busbw, GBPS),
            "allreduce_busbw": _curve_dict(p.nvlink_busbw, "bytes", 1.0, "busbw_GBps", GBPS),
        },
        "network": {
            "nics_per_node": net.nics_per_node,
            "nic_bandwidth_Gbps": to_unit(net.nic_bandwidth, GBITPS),
            "nic_efficiency": p.nic_efficiency,
            "topology": net.topology,
            "oversubscription": net.oversubscription,
            "latency_us": to_unit(net.latency, US),
            "nodes_per_leaf": net.nodes_per_leaf,
        },
    }
    if p.provenance:
        out["provenance"] = dict(p.provenance)
    return out


def write_profile(profile: GpuProfile, path: str | os.PathLike) -> Path:
    """Write `profile` as YAML atomically: a temporary file in the same folder, then os.replace,
    so a reader never sees half a profile. `load_profile(path) == profile` afterwards."""
    path = Path(path)
    text = "# GPU profile written by paraplan (hwmodels.profile.write_profile)\n" + yaml.safe_dump(
        _to_dict(profile), sort_keys=False, default_flow_style=None, width=100)
    write_atomic(path, text)
    return path
