"""`paraplan validate`: the closed loop (calibrate -> simulate -> launch -> compare -> refit) on CPUs.

What is asserted, and what is not. A 2-process gloo run of a 2-layer, hidden-128 model on a
shared 2-core CI machine takes tens of milliseconds per step, and its step time moves by 10-30 %
between steps and between runs (other jobs on the host, torchrun's own threads, gloo's polling,
allocator warm-up), while the quick CPU calibration measures single GEMMs on one thread in a
quiet process. Measured on a 2-core shared host: dp -72 to -80 %, pp -72 to -74 %, tp -94 to -96 %
over several runs (the simulator predicts 9-12 ms, the runs take about 40-48 ms for dp/pp and
180-230 ms for tp, whose DTensor and gloo per-op overhead it does not model; the README gives the
latest figures). So on such a host the only tolerance we consider meaningful
is a *factor* of a few for dp/pp (|error| up to ~80 %), and none for tp: the simulator's model of
a GPU (kernels back to back, no Python or framework overhead, communication on its own links)
does not describe a CPU where the framework overhead per op is of the order of the op itself and
the two ranks share the cores they compute with. A tight bound (say 15 %, the GPU target and the
CLI's default --tolerance) would make this test flaky or force a fudge. So the test asserts only
what is robust:

- the command runs and its JSON has the fields, mutually consistent
  (error_pct == 100 * (predicted - measured) / measured, measured == the median of the steps);
- refitting the profile to a run and re-simulating that same run gives a smaller error
  (deterministic: the same measurement is reused, no second launch is compared);
- bad input is one line, exit 2, and nothing is written.

The errors measured are printed (pytest -s) so they can be reported honestly. Three torchrun
launches at most: the dp, tp and pp plans share one job (one start-up), the CLI runs one more.
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from calibrate.validate import compare, measure, prepare, refit, resolve_profile
from hwmodels.profile import load_profile, write_profile
from paraplan.cli.main import main
from simulator.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "model": {"name": "tiny", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_kv_heads": 4,
              "ffn_hidden_size": 512, "vocab_size": 512, "activation": "swiglu"},
    "cluster": {"gpu": "h100-sxm-80gb", "num_nodes": 1, "gpus_per_node": 2},
    "training": {"seq_length": 128, "global_batch_size": 8, "precision": "bf16"},
    "run": {"steps": 4, "warmup_steps": 1, "seed": 0, "backend": "gloo", "timeout_s": 60,
            "num_layers": 2, "hidden_size": 128},  # scaled down: 2 layers, hidden 128 (4 heads, 2 kv heads)
}
PLANS = {
    "dp": {"tp": 1, "pp": 1, "dp": 2, "micro_batch_size": 2},
    "tp": {"tp": 2, "pp": 1, "dp": 1, "micro_batch_size": 2},
    "pp": {"tp": 1, "pp": 2, "dp": 1, "micro_batch_size": 2, "schedule": "1f1b"},
}
CPU_TOLERANCE_PCT = 80.0  # reported, not asserted: see the module docstring


def _config(d: Path, name: str) -> Path:
    path = d / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": f"tiny-{name}", **BASE, "plan": PLANS[name]}, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    """A quick CPU calibration (the calibrate tests' settings), in a subprocess so its thread
    setting does not leak into this one."""
    out = tmp_path_factory.mktemp("cal") / "cpu.yaml"
    r = subprocess.run([sys.executable, "-m", "paraplan", "calibrate", "--device", "cpu", "--quick", "--threads", "1",
                        "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    return str(out)


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("cfg")
    return {name: _config(d, name) for name in PLANS}


@pytest.fixture(scope="module")
def runs(profile, configs):
    """dp, tp and pp on 2 gloo ranks, measured in one torchrun job; name -> (scenario, sim, report)."""
    prepared = {name: prepare(str(path), profile=profile) for name, path in configs.items()}
    scs = [sc for sc, _ in prepared.values()]
    sims = [simulate(sc) for sc in scs]
    ms = measure(scs, nproc=2, backend="gloo", timeout_s=60)
    out = {}
    for (name, path), sc, sim, m in zip(configs.items(), scs, sims, ms):
        out[name] = (sc, sim, compare(sc, sim, m, config=str(path), tolerance_pct=CPU_TOLERANCE_PCT))
    print("\nCPU closed loop (2 gloo ranks, 2 layers, hidden 128, seq 128, bf16):")
    for name, (_, _, r) in out.items():
        print(f"  {name}: predicted {r['predicted_step_time_s'] * 1e3:7.2f} ms  measured {r['measured_step_time_s'] * 1e3:7.2f} ms"
              f"  error {r['error_pct']:+6.1f} %  (steps spread {r['measured_spread_pct']:.0f} %)")
    return out


def test_one_job_validates_dp_tp_pp(runs):
    for name, (sc, sim, r) in runs.items():
        assert r["plan"]["tp"] == PLANS[name]["tp"] and r["plan"]["pp"] == PLANS[name]["pp"]
        # the scaled model is what was simulated and what ran
        assert r["model"]["num_layers"] == 2 and r["model"]["hidden_size"] == 128
        assert sc.model.num_layers == 2 and sc.model.hidden_size == 128
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["steps"] == 4 and r["warmup_steps"] == 1
        assert r["compute_dtype_measured"] == "bf16" == r["precision_simulated"]  # the same job, bf16 on both sides
        assert r["profile"].startswith("cpu-") and r["profile_calibrated"]
        assert r["predicted_step_time_s"] == sim.step_time_s > 0 and r["measured_step_time_s"] > 0
        assert r["measured_step_time_s"] == pytest.approx(statistics.median(r["measured_step_times_s"]))
        assert r["error_pct"] == pytest.approx(
            100 * (r["predicted_step_time_s"] - r["measured_step_time_s"]) / r["measured_step_time_s"])
        assert r["within_tolerance"] == (abs(r["error_pct"]) <= CPU_TOLERANCE_PCT)
        assert r["components"]["compared"] == ["step"] and "whole-step" in r["components"]["why"]
        assert set(r["components"]["predicted_breakdown_s"]) >= {"compute", "pp_bubble", "dp_comm", "tp_comm"}
    assert runs["pp"][2]["components"]["predicted_breakdown_s"]["pp_bubble"] > 0
    assert runs["tp"][2]["components"]["predicted_breakdown_s"]["tp_comm"] > 0


@pytest.mark.parametrize("name", list(PLANS))
def test_refit_reduces_the_error_of_the_same_run(runs, name, tmp_path):
    sc, _, r = runs[name]
    fit = refit(sc, r["measured_step_time_s"], config=r["config"])
    out = write_profile(fit.profile, tmp_path / "refit.yaml")
    again = simulate(dataclasses.replace(sc, cluster=dataclasses.replace(sc.cluster, gpu=str(out))))
    before = abs(r["error_pct"])
    after = abs(100 * (again.step_time_s - r["measured_step_time_s"]) / r["measured_step_time_s"])
    print(f"  {name}: refit x{fit.factor:.3g}: error {r['error_pct']:+.1f} % -> {fit.error_after_pct:+.1f} %")
    assert again.step_time_s == pytest.approx(fit.predicted_after_s)
    assert after < before or after < 1.0
    p = load_profile(str(out))
    assert p.calibrated and p.name.endswith("-refit")
    assert all(0 < y <= 1 for _, c in p.gemm_efficiency for y in c.ys)
    assert all(0 < y <= 1 for y in p.attention_fwd_efficiency.ys + p.attention_bwd_efficiency.ys)
    prov = dict(p.provenance)
    assert "refit by paraplan validate" in prov["refit"] and r["config"] in prov["refit"] and "measured" in prov["refit"]


def test_cli_json_and_refit(profile, configs, tmp_path):
    out = tmp_path / "refit.yaml"
    r = subprocess.run([sys.executable, "-m", "paraplan", "validate", str(configs["dp"]), "--profile", profile,
                        "--steps", "3", "--layers", "2", "--hidden", "128", "--json", "--refit", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    rep = json.loads(r.stdout)
    assert r.returncode == (0 if rep["within_tolerance"] else 1), r.stderr  # 1: outside the tolerance
    for key in ("predicted_step_time_s", "measured_step_time_s", "error_pct", "plan", "profile", "steps",
                "tolerance_pct", "refit"):
        assert key in rep
    assert rep["steps"] == 3 and rep["tolerance_pct"] == 15.0 and rep["profile"] == load_profile(profile).name
    assert rep["error_pct"] == pytest.approx(
        100 * (rep["predicted_step_time_s"] - rep["measured_step_time_s"]) / rep["measured_step_time_s"])
    assert abs(rep["refit"]["error_pct"]) < abs(rep["error_pct"]) or abs(rep["refit"]["error_pct"]) < 1.0
    # re-simulating the same job with the written profile gives the refit's prediction
    sc, _ = prepare(str(configs["dp"]), profile=str(out), steps=3, layers=2, hidden=128)
    assert simulate(sc).step_time_s == pytest.approx(rep["refit"]["predicted_step_time_s"])
    assert load_profile(str(out)).calibrated


@pytest.mark.parametrize("case", ["missing config", "unknown profile", "refit under a file", "refit is a folder",
                                  "refit not yaml", "refit is the config"])
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, configs, tmp_path, capsys):
    cfg, prof, refit_out = str(configs["dp"]), "h100-sxm-80gb", str(tmp_path / "out.yaml")
    if case == "missing config":
        cfg, message = str(tmp_path / "nope.yaml"), "config file not found"
    elif case == "unknown profile":
        prof, message = str(tmp_path / "nope-profile.yaml"), "--profile"
    elif case == "refit under a file":
        (tmp_path / "f").write_text("")
        refit_out, message = str(tmp_path / "f" / "out.yaml"), "is a file, so nothing can be written under it"
    elif case == "refit is a folder":
        (tmp_path / "dir.yaml").mkdir()
        refit_out, message = str(tmp_path / "dir.yaml"), "is a directory"
    elif case == "refit is the config":
        refit_out, message = cfg, "--refit: " + cfg + " is the same file as config"
    else:
        refit_out, message = str(tmp_path / "out.txt"), "must end in .yaml"
    before = sorted(os.listdir(tmp_path))
    assert main(["validate", cfg, "--profile", prof, "--refit", refit_out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == before


def test_resolve_profile_keeps_bundled_names_and_makes_paths_absolute(profile, monkeypatch):
    assert resolve_profile("h100-sxm-80gb") == "h100-sxm-80gb"
    monkeypatch.chdir(Path(profile).parent)
    assert resolve_profile(Path(profile).name) == str(Path(profile).resolve())


def _hopper_tiny():
    from paraplan.loader import load_scenario

    return load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml",
                         ["cluster.gpu=h100-sxm-80gb", "training.attention=flash3"])


def test_refit_scales_the_attention_kernel_the_plan_runs():
    """A plan on the Hopper attention kernel (flash3) is refit through that kernel's curves too,
    and every curve's provenance says it was scaled (no stale held-out figures)."""
    sc = _hopper_tiny()
    before = simulate(sc).step_time_s
    fit = refit(sc, 1.5 * before, config="tiny")
    assert fit.note == "" and abs(fit.error_after_pct) < 1.0
    base = load_profile("h100-sxm-80gb")
    for old, new in zip(base.attention_flash3_efficiency, fit.profile.attention_flash3_efficiency):
        assert new.ys == pytest.approx([y * fit.factor for y in old.ys])
    prov = dict(fit.profile.provenance)
    assert prov["gemm_efficiency.bf16"].endswith(f"[then scaled x{fit.factor:.4g} by a refit, see 'refit']")


def test_refit_says_when_no_efficiency_reaches_the_measurement():
    """Five times faster than predicted: every efficiency capped at 1 cannot get there; the refit
    says so and reports the smallest factor that gets as close, not an arbitrary 1e4."""
    sc = _hopper_tiny()
    before = simulate(sc).step_time_s
    fit = refit(sc, 0.2 * before, config="tiny")
    assert "is faster than any compute efficiency reaches" in fit.note and "at 1 (peak)" in fit.note
    assert fit.factor < 1e3 and fit.error_after_pct > 10
    assert all(y == 1.0 for _, c in fit.profile.gemm_efficiency for y in c.ys)
    assert fit.note in dict(fit.profile.provenance)["refit"]


def test_a_gpu_profile_predicting_a_cpu_run_is_said():
    from types import SimpleNamespace

    from calibrate.validate import _profile_notes
    from hwmodels.profile import load_profile

    gpu = load_profile("a100-sxm-80gb")
    said = _profile_notes(gpu, {"device": "cpu"})
    assert len(said) == 1 and said[0].startswith("predicted with a100-sxm-80gb, a GPU's profile, for a run on CPUs")
    assert _profile_notes(gpu, {"device": "NVIDIA A100-SXM4-80GB"}) == []
    assert _profile_notes(SimpleNamespace(name="cpu-amd-epyc"), {"device": "cpu"}) == []
