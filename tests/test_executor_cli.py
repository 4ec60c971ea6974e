"""`paraplan launch` as a user runs it: `python -m paraplan launch ...` in a subprocess.

Bad input is one `error:` line and exit 2, before any process starts; a plan that runs prints the
summary and writes the measurement; a rank that dies ends the job with that rank named and exit 1
within the process-group timeout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """\
# an executor config: a scenario plus the run section
name: tiny-launch
model: {name: tiny, num_layers: 4, hidden_size: 64, num_attention_heads: 4, num_kv_heads: 2,
        ffn_hidden_size: 128, vocab_size: 256, activation: swiglu}
cluster: {gpu: h100-sxm-80gb, num_nodes: 1, gpus_per_node: 2}
training: {seq_length: 32, global_batch_size: 8, precision: bf16}
plan: {tp: 1, pp: 2, micro_batch_size: 2, schedule: 1f1b}
run: {steps: 2, warmup_steps: 1, seed: 0, backend: gloo, timeout_s: 60}
"""


@pytest.fixture()
def config(tmp_path):
    path = tmp_path / "best_plan.yaml"
    path.write_text(CONFIG)
    return str(path)


def paraplan(*args, env=None, timeout=300, cwd=ROOT):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "paraplan", "launch", *args], capture_output=True, text=True,
                          cwd=cwd, env=full_env, timeout=timeout)


BAD_INPUT = [
    (["missing.yaml"], "scenario file not found"),
    (["CONFIG", "--nproc", "3"], "the plan needs tp*pp*cp*dp = 1*2*1*1 = 2 processes, but --nproc 3 x --nnodes 1 = 3\n"),
    (["CONFIG", "--set", "plan.dp=2"], "plan: tp*pp*cp*dp = 1*2*1*2 = 4 but the cluster has 2 GPUs"),
    (["CONFIG", "--set", "plan.pp=1", "--set", "plan.dp=2", "--nproc", "1"],
     "for fewer processes shrink the plan to 1: --set cluster.num_nodes=1 --set cluster.gpus_per_node=1"),
    (["CONFIG", "--set", "plan.tp=2", "--set", "plan.pp=1", "--set", "model.num_kv_heads=1"],
     "plan.tp: 2 does not divide model.num_kv_heads (1)"),
    (["CONFIG", "--set", "training.global_batch_size=2"], "plan.schedule: 1f1b needs at least 2 microbatches per pipeline, got 1"),
    (["CONFIG", "--set", "plan.pp=1", "--set", "plan.dp=2", "--set", "plan.ep=2"], "plan.ep: expert parallelism needs an MoE model"),
    (["CONFIG", "--set", "training.precision=fp8"], "training.precision: the executor trains in fp32 or bf16, not fp8"),
    (["CONFIG", "--hidden", "100"], "--hidden (run.hidden_size): 100 gives 6.25 attention heads"),
    (["CONFIG", "--layers", "3"], "plan.pp: model.num_layers (3) is not divisible by pp"),
    (["CONFIG", "--steps", "0"], "--steps (run.steps): expected a positive integer, got 0"),
    (["CONFIG", "--set", "run.steps=0"], "error: run.steps: expected a positive integer, got 0"),
    (["CONFIG", "--backend", "nccl"], "nccl needs CUDA GPUs"),
    (["CONFIG", "--nnodes", "2", "--nproc", "1"], "--nnodes > 1 needs --rdzv-endpoint"),
    (["CONFIG", "--set", "run.backend=mpi"], "run.backend: 'mpi' is not one of nccl, gloo"),
    (["CONFIG", "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", "host:99999"], "--rdzv-endpoint: expected HOST[:PORT]"),
    (["CONFIG", "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", "a b:1"], "--rdzv-endpoint: expected HOST[:PORT]"),
    (["CONFIG", "--out", "/"], "--out: / is a directory"),
    (["CONFIG", "--out", "CONFIG"], "is the same file as config"),
    (["CONFIG", "--seed", "4294967296"], "--seed (run.seed): expected an integer from 0 to 2**32 - 1"),
    (["CONFIG", "--hidden", "131072", "--set", "run.num_layers=64"], "run.backend gloo: the 2 CPU process(es) need at least"),
    (["CONFIG", "--run-dir", "CONFIG/x"], "is a file, so nothing can be written under it"),
    # a folder that holds files of its own: a run would replace out/ and overwrite job.json
    (["CONFIG", "--run-dir", "CONFIGDIR"], "holds best_plan.yaml, not an earlier run's files only"),
    (["CONFIG", "--set", "cluster.gpus_per_node=3", "--set", "plan.pp=3", "--set", "plan.first_stage_layers=2",
      "--set", "plan.last_stage_layers=2", "--set", "training.global_batch_size=6"],
     "pipeline rank 1 would hold no layer, embedding or head"),
    # a planner-written layout (the embedding and the loss alone on their stages) scaled by --layers
    (["CONFIG", "--set", "plan.schedule=interleaved-1f1b", "--set", "plan.virtual_pipeline_stages=3",
      "--set", "plan.first_stage_layers=0", "--set", "plan.last_stage_layers=0", "--set", "training.global_batch_size=16",
      "--layers", "6"],
     "do not split evenly over the other 4 (virtual) stages (--layers 6 sets model.num_layers; this layout splits 4 or 8)"),
]


@pytest.mark.parametrize("args, message", BAD_INPUT, ids=[m.split(":")[0][:40] for _, m in BAD_INPUT])
def test_bad_input_is_one_line_before_launch(config, args, message):
    if "nccl" in message:
        torch = pytest.importorskip("torch")
        if torch.cuda.is_available():
            pytest.skip("this host has CUDA")
    start = time.perf_counter()
    r = paraplan(*[a.replace("CONFIGDIR", str(Path(config).parent)).replace("CONFIG", str(config)) for a in args])
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert message in r.stderr
    assert r.stdout == ""  # nothing started: no progress line, no summary
    assert time.perf_counter() - start < 60  # generous: a loaded CI machine


def test_launch_prints_the_summary_and_writes_the_measurement(config, tmp_path):
    out = tmp_path / "measured.json"
    r = paraplan(config, "--steps", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    for word in ("step time (median)", "tokens/s", "TFLOP/s per rank", "peak memory per rank", "FLOPs:",
                 "bf16 runs in fp32 on CPU"):
        assert word in r.stdout
    m = json.loads(out.read_text())
    assert m["world_size"] == 2 and m["backend"] == "gloo" and len(m["steps"]) == 3
    assert m["steps"][0]["warmup"] and not m["steps"][1]["warmup"]
    assert m["model_flops_per_step"] > 0 and "mfu" not in m  # MFU only on GPUs
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # written atomically


def test_scale_down_flags(config):
    r = paraplan(config, "--layers", "2", "--hidden", "32", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "2 layers, hidden 32" in r.stdout


def test_dry_run_json_is_json(config):
    r = paraplan(config, "--layers", "2", "--hidden", "32", "--dry-run", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["plan_ok"], out["processes_per_node"], out["num_layers"], out["hidden_size"]) == (True, 2, 2, 32)


def _processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains `text` (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")
def test_sigterm_stops_the_job_and_its_workers(config, tmp_path):
    """`timeout`, a scheduler or CI stop paraplan with SIGTERM: the job (its own session) goes too."""
    import signal

    run = tmp_path / "run"
    env = dict(os.environ, PARAPLAN_EXECUTOR_FAULT="1:1:hang")
    proc = subprocess.Popen([sys.executable, "-m", "paraplan", "launch", config, "--timeout", "300",
                             "--run-dir", str(run)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.perf_counter() + 120
    while len(_processes_mentioning(str(run / "job.json"))) < 3 and time.perf_counter() < deadline:
        time.sleep(0.5)  # torchrun and its two workers
    assert len(_processes_mentioning(str(run / "job.json"))) >= 3, "the job did not start"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.strip().splitlines() == ["error: terminated"], err
    deadline = time.perf_counter() + 30
    while _processes_mentioning(str(run / "job.json")) and time.perf_counter() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(run / "job.json")) == []


def test_dead_rank_is_named(config, tmp_path):
    """(Run from another directory with a relative --run-dir, which the workers, started from the
    package root, must still find.)"""
    start = time.perf_counter()
    r = paraplan(config, "--timeout", "20", "--run-dir", "run", env={"PARAPLAN_EXECUTOR_FAULT": "1:1:raise"},
                 cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr.startswith("error: rank 1 failed: RuntimeError: injected fault at step 1")
    assert r.stderr.count("\n") == 1
    assert (tmp_path / "run" / "torchrun.log").exists()
    assert time.perf_counter() - start < 120  # far from the 30-minute default timeout


@pytest.mark.slow
def test_killed_and_hung_ranks_end_within_the_timeout(config, tmp_path):
    r = paraplan(config, "--timeout", "5", env={"PARAPLAN_EXECUTOR_FAULT": "0:1:exit"})
    assert r.returncode == 1 and "rank 0 exited with code 3 without reporting an error" in r.stderr
    start = time.perf_counter()
    r = paraplan(config, "--timeout", "5", env={"PARAPLAN_EXECUTOR_FAULT": "1:1:hang"})
    assert r.returncode == 1
    assert "rank 0 failed" in r.stderr and "no error from rank 1 (hung?)" in r.stderr
    assert time.perf_counter() - start < 120  # far from the 30-minute default timeout


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_devices() < 1, reason="needs a CUDA GPU")
def test_nccl_on_one_gpu_reports_mfu(config, tmp_path):
    out = tmp_path / "measured.json"
    r = paraplan(config, "--backend", "nccl", "--set", "cluster.gpus_per_node=1", "--set", "plan.pp=1",
                 "--steps", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    m = json.loads(out.read_text())
    assert m["compute_dtype"] == "bf16" and m["ranks"][0]["memory"]["source"] == "cuda-allocator"
    assert 0 < m["mfu"] < 1 and "MFU" in r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_devices() < 2, reason="needs 2 CUDA GPUs")
def test_nccl_pipeline_on_two_gpus(config):
    r = paraplan(config, "--backend", "nccl", "--steps", "2")
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("device,memory,profile,noted", [
    ("NVIDIA H100 80GB HBM3", 85_520_809_984, "h100-sxm-80gb", False),
    ("NVIDIA H200", 150_754_820_096, "h200-sxm-141gb", False),
    # a PCIe H100 peaks at 756 dense bf16 TFLOP/s, not the SXM's 989: no bundled profile matches it
    ("NVIDIA H100 PCIe", 85_520_809_984, "a100-sxm-80gb", True),
])
def test_mfu_peak_is_the_device_that_ran(config, device, memory, profile, noted):
    from paraplan.cli.launch import add_flops
    from paraplan.loader import load_scenario
    from hwmodels.profile import load_profile

    sc = load_scenario(config, ["cluster.gpu=a100-sxm-80gb"])
    m = {"tokens_per_step": 256, "step_time_s": 0.5, "world_size": 2, "backend": "nccl", "device": device,
         "device_memory_bytes": memory, "compute_dtype": "bf16", "notes": []}
    add_flops(sc, m)
    assert m["peak_profile"] == profile
    assert m["peak_flops_per_rank"] == load_profile(profile).peak("bf16")
    assert m["mfu"] == pytest.approx(m["model_flops_per_step"] / 0.5 / 2 / m["peak_flops_per_rank"])
    assert any("matches no bundled GPU profile" in n for n in m["notes"]) == noted


def test_dry_run_checks_a_gpu_plan_on_a_host_without_gpus_and_prints_the_command(config, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    r = paraplan(config, "--backend", "nccl", "--dry-run", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    assert "note: not on this host: run.backend nccl needs CUDA GPUs" in r.stdout
    assert (f"-m torch.distributed.run --nproc-per-node 2 --monitor-interval 0.5 --standalone -m executor.worker "
            f"{tmp_path / 'run'}/job.json --out-dir {tmp_path / 'run'}/out") in r.stdout
    assert not (tmp_path / "run").exists()  # nothing written, nothing started
    out = json.loads(paraplan(config, "--backend", "nccl", "--dry-run", "--json").stdout)
    assert out["command"].endswith("executor.worker RUN_DIR/job.json --out-dir RUN_DIR/out")
    assert any("needs CUDA GPUs" in n for n in out["notes"])


def test_a_plan_the_simulator_says_will_not_fit_is_named_before_it_starts(config):
    """A GPU plan the simulator predicts out of memory gets a note in the dry run (the executor
    may still try it); on CPUs, where every process shares the host's memory, a plan whose
    predicted ranks exceed it is refused before any process starts."""
    long = ["--set", "training.seq_length=33554432"]
    r = paraplan(config, "--backend", "nccl", "--dry-run", *long)
    assert r.returncode == 0, r.stderr
    assert "note: paraplan simulate predicts" in r.stdout and "GiB of its GPU (h100-sxm-80gb)" in r.stdout
    assert "paraplan simulate predicts" not in paraplan(config, "--backend", "nccl", "--dry-run").stdout
    r = paraplan(config, "--dry-run", *long)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert "as paraplan simulate predicts each rank's memory, activations included" in r.stderr


def test_a_run_dir_may_hold_an_earlier_run_and_nothing_else(tmp_path):
    from executor.launch import check_run_dir
    from paraplan.errors import ConfigError

    check_run_dir(tmp_path / "new")  # not there yet
    check_run_dir(tmp_path)  # empty
    (tmp_path / "job.json").write_text(json.dumps({"backend": "gloo", "runs": []}))
    (tmp_path / "torchrun.log").write_text("")
    (tmp_path / "out").mkdir()
    check_run_dir(tmp_path)  # an earlier run's files: replaced by the next
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="holds notes.txt, not an earlier run's files only"):
        check_run_dir(tmp_path)
    (tmp_path / "notes.txt").unlink()
    (tmp_path / "job.json").write_text("{}")  # not a job a launch wrote
    with pytest.raises(ConfigError, match="--run-dir"):
        check_run_dir(tmp_path)


def test_a_worker_that_ignores_sigterm_is_killed_with_its_launcher(tmp_path):
    """torchrun starts its workers in sessions of their own: one that ignores SIGTERM is out of
    reach of a signal to torchrun's group, and is killed by its pid once the grace time is over."""
    import signal

    from executor.launch import _descendants, _terminate  # noqa: PLC2701

    pid_file = tmp_path / "worker.pid"
    worker = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    launcher = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}], "
                "start_new_session=True); time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the worker did not start"
            time.sleep(0.05)
        pid = int(pid_file.read_text())
        assert pid in _descendants(proc.pid)
        _terminate(proc, grace_s=1.0)
        from executor.launch import _running  # noqa: PLC2701

        deadline = time.monotonic() + 10
        while _running(pid):  # killed, it may stay a zombie until init reaps it
            assert time.monotonic() < deadline, "the worker outlived its launcher"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_plan_wider_than_a_node_needs_its_nodes_named(config):
    """A GPU plan of more processes than cluster.gpus_per_node is started node by node (--nnodes,
    --node-rank, --rdzv-endpoint); asked for one node it is refused with that line, not started as
    one node of them all. On CPUs (gloo) and with --nproc given, one host may run them all."""
    wide = ["--set", "cluster.gpus_per_node=1", "--set", "cluster.num_nodes=2"]
    r = paraplan(config, "--backend", "nccl", "--dry-run", *wide)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1
    assert "run on 2 nodes of 1 GPUs (cluster.gpus_per_node): start it on each node with --nnodes 2" in r.stderr
    r = paraplan(config, "--backend", "nccl", "--dry-run", *wide, "--nnodes", "2", "--rdzv-endpoint", "node0:29500")
    assert r.returncode == 0, r.stderr
    assert "--nproc-per-node 1" in r.stdout and "--nnodes 2" in r.stdout
    for extra in (["--backend", "gloo"], ["--backend", "nccl", "--nproc", "2"]):
        r = paraplan(config, "--dry-run", *wide, *extra)
        assert r.returncode == 0, r.stderr
    # fewer nodes than the plan's: each would get more processes than it has GPUs
    four = ["--set", "cluster.gpus_per_node=1", "--set", "cluster.num_nodes=4", "--set", "plan.dp=2"]
    r = paraplan(config, "--backend", "nccl", "--dry-run", *four, "--nnodes", "2", "--rdzv-endpoint", "node0:29500")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--nnodes 2 puts 2 processes on each node, more than its 1 GPUs" in r.stderr


def test_a_replicated_pipeline_run_logs_no_stage_view_warning(config, tmp_path):
    """FSDP2's replicate warns that a pipeline stage returned a view (a hazard only for in-place ops
    on it, which nothing here does): filtered in the workers, with the reason (executor.worker)."""
    r = paraplan(config, "--set", "cluster.gpus_per_node=8", "--set", "plan.dp=2", "--set", "plan.tp=2", "--steps", "1",
                 "--warmup", "0", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    log = (tmp_path / "run" / "torchrun.log").read_text()
    assert "[paraplan] run 1/1" in log and "returned a view tensor" not in log


@pytest.mark.parametrize("scenario, world", [("mixtral-8x7b-64xh100", 32), ("qwen3-235b-256xh100", None)])
def test_the_shrink_hint_keeps_expert_parallelism_feasible(scenario, world):
    """ep x expert_tp divides tp x cp x dp: Mixtral's ep 8 at tp 1 needs dp 8 (32 processes of its 64);
    Qwen3's ep 32 at tp 2 needs dp 16, all 256 of its processes, so no smaller layout is offered."""
    from paraplan.cli.launch import _fewer_processes
    from paraplan.loader import load_scenario

    hint = _fewer_processes(load_scenario(ROOT / "scenarios" / f"{scenario}.yaml"))
    if world is None:
        assert "no fewer-process layout" in hint
    else:
        assert f"shrink the plan to {world}: --set cluster.num_nodes=1 --set cluster.gpus_per_node={world} " in hint


def test_more_gloo_processes_than_the_cores_can_carry_are_warned_of(config):
    """A plan of 4x more processes than CPU cores is allowed but said to be slow, with how to shrink it."""
    import os

    ranks = 4 * (os.cpu_count() or 1) + 2
    r = paraplan(config, "--dry-run", "--set", f"cluster.gpus_per_node={ranks}", "--set", "plan.pp=1",
                 "--set", f"training.global_batch_size={4 * ranks}")
    assert r.returncode == 0, r.stderr
    assert f"{ranks} gloo processes on this host's {os.cpu_count()} CPU cores will run slowly" in r.stdout + r.stderr

