"""calibrate.plan and calibrate.device's pure parts: which shapes a calibration runs, how long
it takes on a GPU the bundled profiles describe, and which bundled profile a GPU name gets."""
import math

import pytest

from calibrate.device import bundled_match, slug
from calibrate.plan import (TIMINGS, Rates, build_plan, collective_sizes, estimate_seconds, gemm_pool,
                            rates_from_profile)
from hwmodels.compute import attention_flops
from hwmodels.profile import load_profile

GiB = 2**30
H100 = load_profile("h100-sxm-80gb")
ALL = ("tf32", "fp16", "bf16", "fp8")


def _h100_plan(quick):
    rates = rates_from_profile(H100, ALL, memory_budget=40 * GiB)
    return build_plan(device="cuda", quick=quick, dtypes=ALL, rates=rates,
                      collective_max_bytes=2**28 if quick else 2**32)


def test_pool_holds_the_training_gemms_of_the_presets():
    shapes = {(s.m, s.n, s.k): s for s in gemm_pool()}
    # llama3-70b at TP 8, 4096 tokens: QKV (8192 -> (64 + 2 x 8) x 128 / 8 = 1280), fwd / dgrad / wgrad
    assert {(4096, 1280, 8192), (4096, 8192, 1280), (8192, 1280, 4096)} <= set(shapes)
    # llama3-8b LM head at TP 8 (128256 / 8 = 16032), SwiGLU MLP-up (2 x 14336 / 2)
    assert (4096, 16032, 4096) in shapes and (4096, 14336, 4096) in shapes
    # a deepseek-v3 routed expert: 4096 tokens x top-8 x EP 8 / 256 experts = 1024 tokens
    assert shapes[(1024, 4096, 7168)].kind == "expert-up fwd"


def test_h100_quick_calibration_fits_in_two_minutes():
    """The --quick promise, costed with the H100 profile's own kernel models (startup included),
    with the 8-GPU collective sweep; the full sweep is bigger."""
    quick, full = _h100_plan(True), _h100_plan(False)
    t_quick = estimate_seconds(quick, H100, ranks=8)
    assert t_quick < 120, t_quick
    assert estimate_seconds(full, H100, ranks=8) > t_quick
    assert {d: len(s) >= 25 for d, s in quick.gemm.items()} == dict.fromkeys(ALL, True)
    assert len(full.gemm["bf16"]) >= 3 * len(quick.gemm["bf16"])


def test_gpu_plan_spans_the_training_range():
    plan = _h100_plan(True)
    flops = [s.flops for s in plan.gemm["bf16"]]
    assert min(flops) <= 2 * 256**3 and max(flops) >= 1e13  # launch-bound to LM-head sized
    unscaled = [s for s in plan.gemm["bf16"] if "scale" not in s.origin and s.origin != "grid"]
    assert len(unscaled) >= 10 and len({s.kind for s in unscaled}) >= 6
    assert all(s.n % 16 == 0 and s.k % 16 == 0 for s in plan.gemm["fp8"])  # torch._scaled_mm's rule
    assert [a.seq for a in plan.attention if a.head_dim == 128] == [128, 512, 4096, 16384]


def test_cpu_plan_stays_inside_the_time_budget():
    """A slow device gets the same kinds of shapes, halved until each call fits its budget."""
    rates = Rates(gemm={"tf32": 50e9, "fp16": 1.5e9, "bf16": 200e9}, memory=10e9, attention=20e9,
                  memory_budget=GiB)
    plan = build_plan(device="cpu", quick=True, dtypes=("tf32", "fp16", "bf16"), rates=rates)
    budget = TIMINGS[("cpu", True)].max_kernel_s
    for dt, shapes in plan.gemm.items():
        assert len(shapes) >= 20, dt
        assert all(s.flops / rates.gemm[dt] <= budget for s in shapes), dt
        assert len({round(math.log10(s.flops), 1) for s in shapes}) >= 5, dt  # spread, not piled at the cap
    assert any("scale 1/" in s.origin for s in plan.gemm["bf16"])
    fwd = [attention_flops(**a.kwargs(), backward=False) for a in plan.attention if a.head_dim == 64]
    assert len(fwd) >= 2 and fwd == sorted(fwd) and fwd[-1] >= 2 * fwd[0]  # FLOPs grow with seq
    assert all(2.5 * f / rates.attention <= budget for f in fwd)
    assert max(plan.hbm_sizes) * 2 / rates.memory <= budget and len(plan.hbm_sizes) >= 4


def test_collective_sizes():
    assert collective_sizes(True, 2**22) == (2**10, 2**12, 2**14, 2**16, 2**18, 2**20, 2**22)
    assert len(collective_sizes(False, 2**32)) == 23


@pytest.mark.parametrize("name, memory_gib, expected", [
    ("NVIDIA H100 80GB HBM3", 79.1, "h100-sxm-80gb"),
    ("NVIDIA H100 PCIe", 79.6, None),  # other clocks and power than the SXM part
    ("NVIDIA H100 NVL", 93.1, None),
    ("NVIDIA H200", 139.8, "h200-sxm-141gb"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "a100-sxm-80gb"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100-sxm-40gb"),
    ("NVIDIA A100 80GB PCIe", 79.2, None),
    ("NVIDIA B200", 178.4, "b200-sxm-180gb"),
    ("NVIDIA H100 80GB HBM3", 40.0, None),  # a MIG slice or a cut-down part: not the bundled one
    ("NVIDIA GeForce RTX 4090", 23.6, None),
])
def test_bundled_match(name, memory_gib, expected):
    assert bundled_match(name, int(memory_gib * GiB)) == expected


class _Stream:
    def __init__(self, tty):
        self.text, self.tty = "", tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return self.tty


def test_progress_line():
    from calibrate.progress import Progress

    clock = iter(range(100)).__next__
    term = _Stream(tty=True)
    p = Progress(4, stream=term, clock=clock)
    p.phase("gemm bf16", 4)
    p.step("gemm bf16 4096x4096x4096")
    p.step("gemm bf16 8192x8192x8192")
    p.clear()
    assert "\r[   0/4   0%" in term.text and "\r[   1/4  25%" in term.text and "8192x8192x8192" in term.text
    assert "\n" not in term.text and term.text.endswith("\r")  # rewritten in place, then wiped
    log = _Stream(tty=False)
    p = Progress(4, stream=log, clock=clock)
    p.phase("gemm bf16", 4)
    p.step("gemm bf16 4096x4096x4096")
    p.note("fp8 skipped")
    assert log.text.splitlines()[0].startswith("calibrate: gemm bf16 (4 items") and "\r" not in log.text
    assert log.text.splitlines()[1] == "calibrate: fp8 skipped"


def test_slug():
    assert slug("AMD EPYC 9654 96-Core Processor") == "amd-epyc-9654-96-core-processor"
