"""`paraplan calibrate` as a user runs it: on the CPU (--device cpu --quick), with collectives on
two gloo ranks under torchrun, every bad input, an interrupt and a failure mid-way. GPU runs are
marked `gpu` and skip where there is no CUDA device."""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from calibrate.fit import holdout_split, mape
from hwmodels.compute import gemm_time
from hwmodels.network import busbw_factor
from hwmodels.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]
QUICK_CPU = ("--device", "cpu", "--quick", "--threads", "1")


def paraplan(*args, env=None, timeout=120):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "paraplan", "calibrate", *args], capture_output=True, text=True,
                          cwd=ROOT, env=full_env, timeout=timeout)


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _tiny_scenario(profile_path: str) -> dict:
    return {
        "model": {"name": "tiny", "num_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "vocab_size": 1024,
                  "activation": "swiglu"},
        "cluster": {"gpu": profile_path, "num_nodes": 1, "gpus_per_node": 2},
        "training": {"seq_length": 256, "global_batch_size": 4, "precision": "bf16"},
        "plan": {"tp": 2, "pp": 1, "micro_batch_size": 1},
    }


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal")
    out, report = d / "cpu.yaml", d / "cpu.json"
    r = paraplan(*QUICK_CPU, "--out", str(out), "--report", str(report))
    assert r.returncode == 0, r.stderr
    return r, out, report


def test_cpu_quick_writes_a_profile_the_loader_accepts(cpu_run):
    r, out, _ = cpu_run
    p = load_profile(str(out))
    assert p.calibrated and p.name.startswith("cpu-") and p.arch == "ampere"
    assert {d for d, _ in p.peak_flops} == {"fp32", "tf32", "fp16", "bf16"}
    assert 0 < p.hbm_efficiency.max <= 1 and p.hbm_capacity > 2**30
    prov = dict(p.provenance)
    for key in ("calibration", "peak_tflops", "hbm.efficiency", "gemm_efficiency.bf16", "attention_efficiency.fwd",
                "nvlink", "network"):
        assert key in prov, key
    assert "torch" in prov["calibration"] and "wall time" in prov["calibration"]
    assert [f.name for f in out.parent.iterdir() if f.name.startswith(".")] == []  # no temp files left
    assert out.stat().st_mode & 0o044  # readable by others, as open() would make it (umask permitting)
    for word in ("wrote", "GEMM", "held-out MAPE", "HBM copy", "attention"):
        assert word in r.stdout
    assert "calibrate: gemm bf16" in r.stderr  # progress, one line per phase off a terminal


def test_report_holds_the_held_out_error_of_the_written_profile(cpu_run):
    """The reported held-out MAPE is gemm_time's error on shapes a fit never saw (the same fit,
    redone here from the report, gives it again); the written curve is the one fitted to every
    shape (the refit's curve, through gemm_time, has the written profile's error on every shape)."""
    from calibrate.fit import fit_gemm

    _, out, report = cpu_run
    rep = json.loads(report.read_text())
    p = load_profile(str(out))
    for dtype in ("tf32", "fp16", "bf16"):
        fit = rep["fits"][f"gemm.{dtype}"]
        ms = sorted((m for m in rep["measurements"] if m["kind"] == "gemm" and m["dtype"] == dtype),
                    key=lambda m: m["work"])
        assert len(ms) >= 15 and fit["n_test"] >= 3 and fit["n_train"] == len(ms)
        shapes = [(m["params"]["m"], m["params"]["n"], m["params"]["k"]) for m in ms]
        train, test = holdout_split([m["work"] for m in ms], keys=shapes)  # as fit_gemm splits
        seconds = [m["seconds"] for m in ms]
        again = fit_gemm(shapes, seconds, dtype=dtype, profile=p, train=train, test=test)
        assert again.test_mape == pytest.approx(fit["test_mape"], rel=0.02, abs=0.05)
        # Deterministic given the report: comparing the written curve's error on the held-out shapes
        # with the held-out fit's, as this test once did, depends on the timing noise (a loaded
        # machine measured one shape at 1.5 and 6.1 ms, and the all-shape fit then read 52.9%
        # against a held-out 24.3%). A wrong or stale curve written to the profile misses this.
        written = mape([gemm_time(p, *sh, dtype) for sh in shapes], seconds)
        assert written == pytest.approx(again.train_mape, rel=0.02, abs=0.05)
        assert written == pytest.approx(fit["train_mape"], rel=0.02, abs=0.05)
        assert f"predicted those with MAPE {fit['test_mape']:.1f}%" in dict(p.provenance)[f"gemm_efficiency.{dtype}"]
    assert rep["fits"]["hbm.copy"]["n_test"] >= 1 and rep["device"]["kind"] == "cpu"
    assert {m["kind"] for m in rep["measurements"]} == {"gemm", "copy", "triad", "attention_fwd", "attention_bwd",
                                                        "elementwise", "elementwise_bwd", "optimizer"}
    # every elementwise op timed backward too, at each size, and its ratio to the forward reported
    timed = lambda kind: sorted((m["op"], m["params"]["elements"]) for m in rep["measurements"] if m["kind"] == kind)  # noqa: E731
    assert timed("elementwise_bwd") == timed("elementwise")
    ratios = {k.split(".", 1)[1]: v for k, v in rep["fits"].items() if k.startswith("memory_bound_backward.")}
    assert set(ratios) == {"layernorm", "rmsnorm", "softmax", "gelu", "swiglu"}
    assert all(v["measured_over_forward"] > 0 for v in ratios.values())


def test_simulate_runs_on_the_calibrated_profile(cpu_run):
    from paraplan.loader import load_scenario
    from simulator.simulate import simulate

    result = simulate(load_scenario(_tiny_scenario(str(cpu_run[1]))))
    assert result.step_time_s > 0 and result.fits and 0 < result.mfu < 1


def test_collectives_on_two_gloo_ranks(cpu_run, tmp_path):
    """torchrun, 2 CPU ranks, gloo: every op gloo supports swept (the rest skipped, said so); the
    single-device fields taken from --base; the all_reduce curve is the measurement."""
    base = str(cpu_run[1])
    out, report = tmp_path / "node.yaml", tmp_path / "node.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "paraplan", "calibrate", *QUICK_CPU[:3], "--collectives", "--skip",
                        "gemm,hbm,attention,elementwise", "--base", base, "--out", str(out), "--report", str(report)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(report.read_text())
    samples = rep["collectives"]
    ops = {s["op"] for s in samples}
    skipped = [n for n in rep["notes"] if "not supported" in n]
    assert "all_reduce" in ops and len(ops) + len(skipped) == 5
    for s in samples:
        assert s["ranks"] == 2 and s["backend"] == "gloo" and s["tier"] == "intra"
        assert s["busbw"] == pytest.approx(s["algbw"] * busbw_factor(s["op"], 2))
        assert s["algbw"] == pytest.approx(s["nbytes"] / s["seconds"])
    p, b = load_profile(str(out)), load_profile(base)
    ar = sorted((s for s in samples if s["op"] == "all_reduce"), key=lambda s: s["nbytes"])
    assert p.nvlink_busbw.xs == tuple(float(s["nbytes"]) for s in ar)
    assert p.gemm_efficiency == b.gemm_efficiency and p.peak_flops == b.peak_flops  # --skip gemm: the base's
    prov = dict(p.provenance)
    assert "gloo, 2 ranks" in prov["collectives.intra"] and "alpha-beta" in prov["collectives.intra"]
    assert "collective.intra.all_reduce" in rep["fits"] and "alpha (us)" in r.stdout

    from paraplan.loader import load_scenario
    from simulator.simulate import simulate

    assert simulate(load_scenario(_tiny_scenario(str(out)))).breakdown["tp_comm"] > 0


def test_collectives_across_two_nodes(cpu_run, tmp_path):
    """Two one-rank "nodes": two processes with the environment torchrun gives each node's worker
    (LOCAL_WORLD_SIZE 1, WORLD_SIZE 2; launched directly, as SLURM-style launchers do, which spares
    the torchrun agents' multi-node exit barrier). The inter-node tier is swept over the world."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, report = tmp_path / "two.yaml", tmp_path / "two.json"
    args = [sys.executable, "-m", "paraplan", "calibrate", *QUICK_CPU[:3], "--collectives", "--skip",
            "gemm,hbm,attention,elementwise", "--base", str(cpu_run[1]), "--out", str(out), "--report", str(report)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(i), "LOCAL_RANK": "0",
                                   "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(i)})
             for i in range(2)]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], [r[1][-2000:] for r in results]
    assert results[1][0] == ""  # only rank 0 reports (and writes)
    rep = json.loads(report.read_text())
    assert {(s["tier"], s["nodes"], s["ranks"]) for s in rep["collectives"]} == {("inter", 2, 2)}
    p = load_profile(str(out))
    prov = dict(p.provenance)
    assert "2 ranks on 2 node(s)" in prov["collectives.inter"]
    assert "network.nic_efficiency" in prov or any("nic_efficiency kept" in n for n in rep["notes"])


BAD_INPUT = [
    (["--device", "cpu", "--out", "{d}/p.txt"], {}, "must end in .yaml or .yml"),
    (["--device", "cpu", "--collectives", "--out", "{d}/p.yaml"], {}, "--collectives needs several ranks"),
    (["--device", "cpu", "--out", "{d}/p.yaml"], {"WORLD_SIZE": "2", "RANK": "0"}, "without --collectives"),
    (["--device", "cpu", "--dtypes", "fp8", "--out", "{d}/p.yaml"], {}, "fp8 GEMMs need a GPU"),
    (["--device", "cpu", "--skip", "gemm", "--out", "{d}/p.yaml"], {}, "needs --base"),
    (["--device", "cpu", "--skip", "gemm,hbm,attention,elementwise", "--base", "h100-sxm-80gb", "--out", "{d}/p.yaml"],
     {}, "nothing to measure"),
    (["--device", "cpu", "--base", "nope", "--out", "{d}/p.yaml"], {}, "--base nope: unknown GPU profile"),
    (["--device", "cpu", "--threads", "0", "--out", "{d}/p.yaml"], {}, "--threads 0"),
    (["--device", "cpu", "--out", "{d}/p.yaml", "--dtypes", "int4"], {}, "--dtypes int4"),
    (["--device", "cpu", "--out", "{d}/p.yaml", "--report", "{d}"], {}, "--report: "),
    (["--device", "cpu", "--out", str(ROOT / "README.md" / "p.yaml")], {}, "--out: "),
    (["--from-report", "{d}/missing.json", "--out", "{d}/p.yaml"], {}, "--from-report {d}/missing.json: not found"),
    (["--from-report", str(ROOT / "README.md"), "--out", "{d}/p.yaml"], {}, "not a report written by"),
    (["--from-report", str(ROOT / "benchmarks/data/gpu/h100-calibration-report.json"), "--quick", "--out",
      "{d}/p.yaml"], {}, "--quick choose what to measure"),
    (["--from-report", "{d}/../empty-report.json", "--out", "{d}/p.yaml"], {}, "holds no measurements to fit"),
    (["--from-report", "{d}/../nulls-report.json", "--out", "{d}/p.yaml"], {}, "expected an object with 'device'"),
    (["--from-report", "{d}/../notes-report.json", "--out", "{d}/p.yaml"], {}, "notes must be a list of strings"),
    (["--from-report", "{d}/../tpu-report.json", "--out", "{d}/p.yaml"], {}, "device.kind must be cuda or cpu, got 'tpu'"),
    # each had been read loosely: a string as true, a negative wall time, a mapping as no measurements
    (["--from-report", "{d}/../quick-report.json", "--out", "{d}/p.yaml"], {}, "options.quick must be true or false, got 'no'"),
    (["--from-report", "{d}/../wall-report.json", "--out", "{d}/p.yaml"], {}, "wall_s must be a finite number of seconds >= 0"),
    (["--from-report", "{d}/../dict-report.json", "--out", "{d}/p.yaml"], {}, "measurements must be a list, got dict"),
    (["--from-report", "{d}/../name-report.json", "--out", "{d}/p.yaml"], {}, "device.name must be a string, got 5"),
    (["--from-report", str(ROOT / "benchmarks/data/gpu/h100-calibration-report.json"), "--name", "a\nb", "--out",
      "{d}/p.yaml"], {}, "--name 'a\\nb': expected printable text on one line"),
    (["--from-report", "{d}/../nan-report.json", "--out", "{d}/p.yaml"], {}, "seconds is nan; expected a positive"),
    (["--from-report", "{d}/../kind-report.json", "--out", "{d}/p.yaml"], {}, "measurement kind 'matmul'; known:"),
    (["--from-report", "{d}/../fast-report.json", "--out", "{d}/p.yaml"], {}, "above the 1e+18 no device reaches"),
    (["--from-report", "{d}/../skip-report.json", "--out", "{d}/p.yaml"], {}, "options.skip names gpu; known:"),
    (["--from-report", "{d}/../work-report.json", "--out", "{d}/p.yaml"], {}, "work is 4.1943e+07, but its params do 4.1943e+06"),
    (["--from-report", "{d}/../fp32-report.json", "--out", "{d}/p.yaml"], {}, "gemm measurement in 'fp32'; calibrate"),
    (["--from-report", "{d}/../memory-report.json", "--out", "{d}/p.yaml"], {}, "device.memory_bytes is 0; expected"),
    (["--from-report", "{d}/../count-report.json", "--out", "{d}/p.yaml"], {}, "device.count must be a whole number"),
    (["--from-report", "{d}/../op-report.json", "--out", "{d}/p.yaml"], {}, "collective op 'bogus'; known:"),
    (["--from-report", "{d}/../tier-report.json", "--out", "{d}/p.yaml"], {}, "collective tier 'weird'; expected"),
    (["--from-report", "{d}/../ranks-report.json", "--out", "{d}/p.yaml"], {}, "collective's ranks is 1; expected"),
    (["--from-report", str(ROOT / "benchmarks/data/gpu/h100-calibration-report.json"), "--name", " ", "--out",
      "{d}/p.yaml"], {}, "--name: expected a non-empty name"),
    (["--device", "cpu", "--threads", "1000000", "--out", "{d}/p.yaml"], {}, "--threads 1000000: expected 1 to"),
    pytest.param(["--device", "cuda", "--out", "{d}/p.yaml"], {}, "--device cuda: no GPU",
                 marks=pytest.mark.skipif(_cuda(), reason="a GPU is present")),
]


@pytest.mark.parametrize("args, env, message", BAD_INPUT)
def test_bad_input_is_one_line_exit_2_and_no_file(tmp_path, args, env, message):
    good = json.loads((ROOT / "benchmarks/data/gpu/h100-calibration-report.json").read_text())
    (tmp_path.parent / "empty-report.json").write_text(json.dumps({**good, "measurements": []}))
    (tmp_path.parent / "nulls-report.json").write_text(json.dumps({**good, "options": None}))
    (tmp_path.parent / "notes-report.json").write_text(json.dumps({**good, "notes": 5}))
    (tmp_path.parent / "tpu-report.json").write_text(json.dumps({**good, "device": {**good["device"], "kind": "tpu"}}))
    (tmp_path.parent / "quick-report.json").write_text(json.dumps({**good, "options": {**good["options"], "quick": "no"}}))
    (tmp_path.parent / "wall-report.json").write_text(json.dumps({**good, "wall_s": -5}))
    (tmp_path.parent / "dict-report.json").write_text(json.dumps({**good, "measurements": {}}))
    (tmp_path.parent / "name-report.json").write_text(json.dumps({**good, "device": {**good["device"], "name": 5}}))
    first, rest = good["measurements"][0], good["measurements"][1:]
    for name, change in (("nan", {"seconds": float("nan")}), ("kind", {"kind": "matmul"}), ("fast", {"work": 1e300})):
        (tmp_path.parent / f"{name}-report.json").write_text(json.dumps({**good, "measurements": [{**first, **change}, *rest]}))
    (tmp_path.parent / "skip-report.json").write_text(json.dumps({**good, "options": {**good["options"], "skip": ["gpu"]}}))
    for name, change in (("work", {"work": 10 * first["work"]}), ("fp32", {"dtype": "fp32"})):
        (tmp_path.parent / f"{name}-report.json").write_text(json.dumps({**good, "measurements": [{**first, **change}, *rest]}))
    (tmp_path.parent / "memory-report.json").write_text(json.dumps({**good, "device": {**good["device"], "memory_bytes": 0}}))
    (tmp_path.parent / "count-report.json").write_text(json.dumps({**good, "device": {**good["device"], "count": "8"}}))
    sample = dict(op="all_reduce", tier="intra", ranks=8, nodes=1, backend="nccl", nbytes=2**20, seconds=1e-4,
                  algbw=1e10, busbw=1.75e10)
    for name, change in (("op", {"op": "bogus"}), ("tier", {"tier": "weird"}), ("ranks", {"ranks": 1})):
        (tmp_path.parent / f"{name}-report.json").write_text(json.dumps({**good, "collectives": [{**sample, **change}]}))
    r = paraplan(*[a.format(d=tmp_path) for a in args], env=env)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message.format(d=tmp_path) in lines[0], r.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_calibration_writes_nothing(tmp_path):
    """Ctrl-C in the middle of the GEMM sweep: exit 130, one clear line, no profile, no temp file."""
    out = tmp_path / "p.yaml"
    # Ctrl-C's default action in the child, whatever this process inherited: a shell starts a
    # background job with SIGINT ignored, and Python then keeps it ignored (no KeyboardInterrupt)
    proc = subprocess.Popen([sys.executable, "-m", "paraplan", "calibrate", "--device", "cpu", "--threads", "1",
                             "--out", str(out), "--report", str(tmp_path / "r.json")],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True).start()
    seen = []
    try:
        while not any("calibrate: gemm" in line for line in seen):
            seen.append(lines.get(timeout=90))
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass  # reported below, with what it printed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.1)  # the reader thread's last lines
    while not lines.empty():
        seen.append(lines.get())
    assert proc.returncode == 130, seen
    assert seen[-1].strip() == f"error: calibration interrupted; nothing written to {out}"
    assert list(tmp_path.iterdir()) == []


def test_a_failure_midway_writes_nothing(tmp_path, monkeypatch, capsys):
    """A benchmark that fails (a CUDA error, say) ends the run with one line naming it, exit 2, no files."""
    import calibrate.bench
    from paraplan.cli.main import main

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)\nmore detail")

    monkeypatch.setattr(calibrate.bench, "run_attention", broken)
    out = tmp_path / "p.yaml"
    rc = main(["calibrate", *QUICK_CPU, "--skip", "elementwise", "--no-progress", "--out", str(out),
               "--report", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [f"error: attention fwd/bwd benchmark failed: CUDA error: an illegal memory access was encountered "
                   f"(simulated); nothing written to {out}"]
    assert list(tmp_path.iterdir()) == []


def test_a_fit_that_fails_keeps_the_measurements_in_the_report(tmp_path, monkeypatch, capsys):
    """Fitting runs after every measurement: if it fails (a bug), the run's --report still holds
    them, so `--from-report` can refit once the fit is fixed; no profile is written."""
    import calibrate.build
    from paraplan.cli.main import main

    def broken(**kwargs):
        raise ValueError("a fit that fails (simulated)")

    monkeypatch.setattr(calibrate.build, "build_profile", broken)
    out, report = tmp_path / "p.yaml", tmp_path / "r.json"
    rc = main(["calibrate", *QUICK_CPU, "--skip", "attention,elementwise", "--base", "h100-sxm-80gb", "--no-progress",
               "--out", str(out), "--report", str(report)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err == [f"error: fitting failed: a fit that fails (simulated); nothing written to {out}; the measurements "
                   f"are in {report}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    kept = json.loads(report.read_text())
    assert kept["measurements"] and kept["fits"] == {}


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs a CUDA GPU")
def test_gpu_quick_calibration(tmp_path):
    import torch

    out, report = tmp_path / "gpu.yaml", tmp_path / "gpu.json"
    name = torch.cuda.get_device_name(0)
    from calibrate.device import bundled_match

    base = bundled_match(name, torch.cuda.get_device_properties(0).total_memory)
    r = paraplan("--quick", "--out", str(out), "--report", str(report), *(() if base else ("--base", "h100-sxm-80gb")),
                 timeout=600)
    assert r.returncode == 0, r.stderr
    p, rep = load_profile(str(out)), json.loads(report.read_text())
    assert p.calibrated and rep["device"]["kind"] == "cuda" and rep["wall_s"] < 300
    assert rep["fits"]["gemm.bf16"]["test_mape"] < 15.0
    assert 0.3 < rep["fits"]["gemm.bf16"]["best_efficiency"] <= 1.2
    if torch.cuda.get_device_capability(0) >= (8, 9) and "fp8" in dict(p.peak_flops):
        assert "gemm.fp8" in rep["fits"]
    from paraplan.loader import load_scenario
    from simulator.simulate import simulate

    assert simulate(load_scenario(_tiny_scenario(str(out)))).step_time_s > 0


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda() or __import__("torch").cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_gpu_collectives_with_nccl(tmp_path):
    import torch

    n = torch.cuda.device_count()
    out, report = tmp_path / "node.yaml", tmp_path / "node.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                        "-m", "paraplan", "calibrate", "--quick", "--collectives", "--skip",
                        "gemm,hbm,attention,elementwise", "--out", str(out), "--report", str(report)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(report.read_text())
    assert {s["op"] for s in rep["collectives"]} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                                     "send_recv"}
    assert all(s["backend"] == "nccl" for s in rep["collectives"])


def test_summary_calls_out_a_poor_fit():
    from types import SimpleNamespace

    from paraplan.cli.calibrate import format_summary

    def outcome(err, check_err=80.0):
        return SimpleNamespace(profile=SimpleNamespace(name="p"), path="p.yaml", wall_s=1.0, measurements=[], notes=[],
                               info=SimpleNamespace(describe=lambda: "cpu"),
                               fits={"collective.inter.all_reduce": {"test_mape": err, "backend": "gloo", "ranks": 4,
                                                                     "alpha_us": 1.0, "busbw_GBps": 1.0,
                                                                     "max_measured_busbw_GBps": 1.0},
                                     "memory_bound.rmsnorm": {"test_mape": check_err, "model_over_measured": 0.5}})
    text = format_summary(outcome(80.0))
    assert "warning: the collective.inter.all_reduce fit misses its held-out measurements by 80.0%" in text
    # the memory-bound kernels are a check of the model, not a fit: their line says how far off they are
    assert "memory_bound.rmsnorm fit" not in text and "rmsnorm 80.0% x0.50" in text
    assert "warning" not in format_summary(outcome(5.0))


def test_from_report_refits_the_bundled_h100_profile_exactly(tmp_path):
    """The bundled h100-sxm-80gb-calibrated is what `--from-report` makes of the H100 run's report
    (no GPU, no torch needed): the measured profile can be rebuilt and checked by anyone."""
    from calibrate.run import _same

    report = ROOT / "benchmarks/data/gpu/h100-calibration-report.json"
    r = paraplan("--from-report", str(report), "--out", str(tmp_path / "h100.yaml"), "--report", str(tmp_path / "r.json"))
    assert r.returncode == 0, r.stderr
    assert "CUDNN_ATTENTION -> attention_efficiency_flash3" in r.stdout and "refitted from" in r.stdout
    mine, bundled = load_profile(str(tmp_path / "h100.yaml")), load_profile("h100-sxm-80gb-calibrated")
    strip = lambda p: p.__class__(**{**p.__dict__, "provenance": ()})  # noqa: E731 - the refit's date differs
    assert _same(strip(mine), strip(bundled))
    prov = dict(mine.provenance)
    assert "2026-11-27T03:30:00+00:00" in prov["calibration"] and "refitted from the report" in prov["calibration"]
    again = json.loads((tmp_path / "r.json").read_text())
    original = json.loads(report.read_text())
    assert again["measured_at"] == original["measured_at"] and again["wall_s"] == original["wall_s"]
    assert {k: v for k, v in again["options"].items() if k not in ("out", "report")} == \
        {k: v for k, v in original["options"].items() if k not in ("out", "report")}


def test_from_report_refits_the_bundled_h200_profile_exactly(tmp_path):
    """h200-sxm-141gb-calibrated, likewise, is `--from-report` of the H200 run's report."""
    from calibrate.run import _same

    report = ROOT / "benchmarks/data/gpu/h200-calibration-report.json"
    r = paraplan("--from-report", str(report), "--out", str(tmp_path / "h200.yaml"),
                 "--name", "h200-sxm-141gb-calibrated")
    assert r.returncode == 0, r.stderr
    mine, bundled = load_profile(str(tmp_path / "h200.yaml")), load_profile("h200-sxm-141gb-calibrated")
    strip = lambda p: p.__class__(**{**p.__dict__, "provenance": ()})  # noqa: E731 - the refit's date differs
    assert _same(strip(mine), strip(bundled))
    assert bundled.calibrated and bundled.arch == "hopper" and "NVIDIA H200" in dict(bundled.provenance)["calibration"]


def test_from_report_writes_through_a_symlink_at_out(tmp_path):
    real, link = tmp_path / "real.yaml", tmp_path / "link.yaml"
    real.write_text("")
    link.symlink_to(real.name)
    r = paraplan("--from-report", str(ROOT / "benchmarks/data/gpu/h100-calibration-report.json"),
                 "--out", str(link))
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and real.read_text().startswith("# GPU profile written by paraplan")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.yaml", "real.yaml"]
