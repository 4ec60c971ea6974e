"""The CLI as a user runs it: `python -m paraplan ...` in a subprocess."""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml")
GPT3 = str(ROOT / "scenarios" / "gpt3-175b-1024xa100.yaml")


def paraplan(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "paraplan", *args], capture_output=True, text=True, cwd=cwd)


def test_simulate_prints_the_table():
    r = paraplan("simulate", GPT3)
    assert r.returncode == 0, r.stderr
    for word in ("step time", "tokens/s", "TFLOP/s per GPU", "MFU", "peak memory", "pp_bubble", "FLOPs:"):
        assert word in r.stdout


def test_json_has_the_documented_keys():
    r = paraplan("simulate", GPT3, "--set", "plan.pp=4", "--set", "plan.dp=32",
                 "--set", "plan.virtual_pipeline_stages=3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("step_time_s", "tokens_per_s", "tflops_per_gpu", "mfu", "peak_memory_bytes",
                "memory_capacity_bytes", "fits", "breakdown"):
        assert key in out
    assert out["step_time_s"] > 0 and 0 < out["mfu"] < 1
    assert len(out["stages"]) == 4
    assert sum(out["breakdown"].values()) == pytest.approx(out["step_time_s"], rel=1e-9)
    # bytes are whole numbers, and the peak is the largest stage's total
    assert isinstance(out["peak_memory_bytes"], int)
    assert out["peak_memory_bytes"] == max(s["memory_bytes"]["total"] for s in out["stages"])


def test_version():
    r = paraplan("--version")
    assert (r.returncode, r.stdout) == (0, "paraplan 0.1.0\n")


def test_trace_and_plot_files(tmp_path):
    trace, plot = tmp_path / "iter.json", tmp_path / "iter.png"
    r = paraplan("simulate", TINY, "--trace", str(trace), "--plot", str(plot))
    assert r.returncode == 0, r.stderr
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {0, 1}  # one track per simulated stage
    assert {e["cat"] for e in events if e["ph"] == "X"} >= {"forward", "backward", "optimizer"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp files left
    # an op's event carries its cost by component: the tiny plan's TP 2 leaves some exposed, and an
    # op's components are its nominal cost, which its span (uncontended, here) lasts at least
    ops = [e for e in events if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    assert ops and all("compute ms" in e["args"] for e in ops) and any("tp_comm ms" in e["args"] for e in ops)
    assert all(sum(e["args"].values()) <= e["dur"] / 1e3 + 1e-5 for e in ops)  # args rounded to the ns


def test_trace_of_merged_pairs(tmp_path):
    """DualPipeV with its pairs overlapped: each pair is one span on the compute track (F..+BW..),
    whole backwards are BW spans, split ones B and W."""
    trace = tmp_path / "dpv.json"
    r = paraplan("simulate", ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml", "--set", "plan.schedule=dualpipev",
                 "--set", "plan.virtual_pipeline_stages=2", "--set", "plan.overlap_moe_expert_parallel_comm=true",
                 "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    pairs = [e for e in events if e["cat"] == "forward_backward"]
    assert pairs and all(e["name"].startswith("F") and "+BW" in e["name"] for e in pairs)
    names = {e["name"].split(".")[0].rstrip("0123456789") for e in events if e["tid"] == 0}
    assert {"F", "B", "W", "BW"} <= names


BAD_INPUT = [
    (["--set", "plan.tpp=4"], "plan.tpp: unknown key, did you mean 'tp'?"),
    (["--set", "plan.tp=eight"], "plan.tp: expected an integer"),
    (["--set", "plan.schedule=zb"], "plan.schedule: 'zb' is not one of gpipe, 1f1b, interleaved-1f1b"),
    (["--set", "plan.dp=4"], "plan: tp*pp*cp*dp = 2*2*1*4 = 16 but the cluster has 8 GPUs"),
    (["--set", "model.num_attention_heads=12", "--set", "model.head_dim=64", "--set", "plan.tp=8", "--set", "plan.pp=1"],
     "plan.tp: 8 does not divide model.num_attention_heads (12)"),
    (["--set", "plan.pp=8", "--set", "plan.tp=1"], "plan.pp: model.num_layers (4) is not divisible by pp x virtual_pipeline_stages"),
    (["--set", "model.num_layers=400", "--set", "model.hidden_size=8192", "--set", "model.num_attention_heads=64",
      "--set", "plan.zero_stage=0"], "out of memory: stage 0 needs"),
    (["--set", "plan"], "--set"),
    (["--set", "cluster.gpu=a100"], "cluster.gpu: unknown GPU profile 'a100'"),
    (["--set", "training.global_batch_size=100000000"], "microbatches per iteration; the simulator plays at most 65,536"),
    (["--set", "plan.first_stage_layers=10"], "10 layers on the first and last stages, more than model.num_layers (4)"),
    (["--set", "plan.schedule=zero-bubble", "--set", "plan.pp=1", "--set", "plan.tp=4"],
     "plan.schedule: zero-bubble needs pp >= 2"),
    (["--set", "plan.moe_dispatcher=deepep"], "plan.moe_dispatcher: deepep needs an MoE model"),
    (["--set", "plan.cp_comm_type=allgather"], "plan.cp_comm_type: 'allgather' is not one of p2p, all_gather, a2a, a2a+p2p, "
                                                "did you mean 'all_gather'?"),
    (["--set", "model.num_attention_heads=12", "--set", "model.head_dim=64", "--set", "plan.tp=4", "--set", "plan.pp=1",
      "--set", "plan.cp=2", "--set", "plan.cp_comm_type=a2a"],
     "plan.cp_comm_type: a2a splits each TP rank's heads over the cp ranks, but model.num_attention_heads (12) is not "
     "divisible by tp x cp = 4 x 2"),
    (["--set", "model=mixtral-8x7b", "--set", "plan.ep=2", "--set", "plan.tp=1", "--set", "plan.pp=1",
      "--set", "training.precision=fp16", "--set", "training.global_batch_size=16"],
     "training.precision: fp16 with expert parallelism"),
    (["--set", "plan.overlap_param_gather=true", "--set", "plan.zero_stage=0"],
     "plan.overlap_param_gather: needs zero_stage >= 1"),
    (["--set", "training.grad_reduce_dtype=fp16"],
     "training.grad_reduce_dtype: fp16 is not a dtype precision bf16 computes gradients in; allowed: fp32 or bf16"),
    (["--set", "training.grad_reduce_dtype=fp8"], "training.grad_reduce_dtype: 'fp8' is not one of fp32, bf16, fp16"),
    (["--set", "plan.recompute=off"],
     "plan.recompute: false is not one of none, selective, full (YAML reads on/off/yes/no as true/false)"),
    (["--set", "search.tpp=[1,2]"], "search.tpp: unknown key, did you mean 'tp'?"),
    (["--set", "model.num_layers=1000000000"], "model.num_layers: expected an integer from 1 to 100000"),
    (["--set", "model=mixtral-8x7b", "--set", "plan.ep=2", "--set", "plan.tp=1", "--set", "plan.pp=1",
      "--set", "training.global_batch_size=16", "--set", "plan.moe_shared_expert_overlap=true"],
     "plan.moe_shared_expert_overlap: needs shared experts"),
    (["--trace", "-"], "--trace: '-' (standard output) is not supported"),
]


@pytest.mark.parametrize("args,message", BAD_INPUT, ids=[m.split(":")[0] for _, m in BAD_INPUT])
def test_bad_input_is_one_line_exit_2(args, message):
    r = paraplan("simulate", TINY, *args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert message in lines[0]
    assert "Traceback" not in r.stderr


def test_missing_file_and_bad_flag(tmp_path):
    r = paraplan("simulate", str(tmp_path / "nope.yaml"))
    assert r.returncode == 2 and r.stderr.strip() == f"error: scenario file not found: {tmp_path / 'nope.yaml'}"
    r = paraplan("simulate", TINY, "--bogus")
    assert r.returncode == 2 and r.stderr.startswith("error: unrecognized arguments: --bogus")


def test_unreadable_inputs_and_unusable_outputs_are_one_line(tmp_path):
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"name: x\n\xff\xfe\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [
        (["simulate", str(binary)], f"error: scenario: {binary} is not UTF-8 text"),
        (["simulate", str(tmp_path)], f"error: scenario: {tmp_path} is a directory, expected a file"),
        (["simulate", TINY, "--set", f"cluster.gpu={binary}"], f"error: cluster.gpu: {binary} is not UTF-8 text"),
        (["simulate", TINY, "--trace", str(tmp_path)], "error: --trace: "),
        (["simulate", TINY, "--plot", str(a_file / "p.png")], f"error: --plot: {a_file} is a file"),
        (["plan", TINY, "--out", str(a_file)], f"error: --out: {a_file} exists and is not a directory"),
        (["simulate", TINY, "--plot", str(tmp_path / "t.svg")], "error: --plot: the timeline is a PNG image"),
    ]
    for args, message in cases:
        r = paraplan(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(message), (args, r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "binary.yaml"]


def test_outputs_never_overwrite_an_input_or_each_other_or_a_device(tmp_path):
    scenario = tmp_path / "s.yaml"
    scenario.write_text(Path(TINY).read_text())
    before = scenario.read_text()
    cases = [
        (["--trace", str(scenario)], f"error: --trace: {scenario} is the same file as scenario"),
        (["--trace", str(tmp_path / "x.png"), "--plot", str(tmp_path / "x.png")],
         f"error: --plot: {tmp_path / 'x.png'} is the same file as --trace"),
        (["--trace", "/dev/null"], "error: --trace: /dev/null is not a regular file"),
        (["--trace", ""], "error: --trace: empty"),
    ]
    for args, message in cases:
        r = paraplan("simulate", str(scenario), *args)
        assert r.returncode == 2 and r.stderr.startswith(message), (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1
    assert scenario.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]
    r = paraplan("simulate", "/dev/zero")  # a device is refused, never read into memory
    assert r.returncode == 2 and r.stderr.strip() == "error: scenario: /dev/zero is not a regular file (a device, FIFO or socket)"


def test_a_symlinked_output_is_written_through(tmp_path):
    target, link = tmp_path / "real.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    r = paraplan("simulate", TINY, "--trace", str(link))
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and json.loads(target.read_text())["traceEvents"]


def test_an_infeasible_run_writes_no_trace_or_plot(tmp_path):
    trace, plot = tmp_path / "t.json", tmp_path / "p.png"
    r = paraplan("simulate", TINY, "--set", "model.num_layers=400", "--set", "model.hidden_size=8192",
                 "--set", "model.num_attention_heads=64", "--set", "plan.zero_stage=0",
                 "--trace", str(trace), "--plot", str(plot))
    assert r.returncode == 2 and "out of memory" in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_no_torch_import_on_simulate():
    code = ("import sys, runpy; sys.argv=['paraplan','simulate',%r,'--json']\n"
            "from paraplan.cli.main import main\nmain()\n"
            "assert 'torch' not in sys.modules and 'optuna' not in sys.modules, 'heavy import'\n") % TINY
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_validate_published_bundled():
    import yaml

    r = paraplan("validate-published", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["summary"]["dense"]["simulated"] >= 35 and out["summary"]["moe"]["simulated"] == 3
    assert out["summary"]["dense"]["mape_pct"] is not None
    # the per-GPU summary partitions the rows, and its figures are those rows' errors
    for group, moe in (("dense", False), ("moe", True)):
        by_gpu = out["summary"][group]["by_gpu"]
        rows = [r for r in out["rows"] if r["moe"] == moe and r["error_pct"] is not None]
        assert sum(s["simulated"] for s in by_gpu.values()) == len(rows)
        for gpu, s in by_gpu.items():
            errs = [r["error_pct"] for r in rows if r["gpu"] == gpu]
            assert s["mape_pct"] == pytest.approx(sum(map(abs, errs)) / len(errs))
            assert s["mean_error_pct"] == pytest.approx(sum(errs) / len(errs))
    # H100 rows run on the profile measured on an H100, A100 rows on the public-source profile
    assert {"a100-sxm-80gb", "h100-sxm-80gb-calibrated"} <= set(out["summary"]["dense"]["by_gpu"])
    # records that cannot give a step time are named, with the reason, not dropped silently
    left_out = {r["id"]: r["reason"] for r in out["not_compared"]}
    assert sorted(left_out) == ["korthikanti_abstract_530B_2240gpu_full_recompute",
                                "korthikanti_abstract_530B_2240gpu_sp_selective"]
    assert all("no global batch size" in why and "mfu_pct" in why for why in left_out.values())
    records = yaml.safe_load((ROOT / "paraplan" / "data" / "public_runs.yaml").read_text())
    assert len(out["rows"]) + len(left_out) == len(records)


def test_validate_published_profile_swaps_a_gpu_profile_for_its_rows():
    r = paraplan("validate-published", "--json", "--profile", "h100-sxm-80gb-calibrated=h100-sxm-80gb")
    assert r.returncode == 0, r.stderr
    rows = {row["id"]: row for row in json.loads(r.stdout)["rows"]}
    mine = json.loads(paraplan("validate-published", "--json").stdout)["rows"]
    faster = h100 = 0
    for row in mine:
        other = rows[row["id"]]
        if row["gpu"] == "h100-sxm-80gb-calibrated":
            # rows are labelled with the profile they ran on, and what it replaced
            assert other["gpu"] == "h100-sxm-80gb (in place of h100-sxm-80gb-calibrated)"
            assert other["gpu_bundled"] == "h100-sxm-80gb-calibrated"
            assert other["predicted_step_time_s"] != row["predicted_step_time_s"], row["id"]
            faster += other["predicted_step_time_s"] < row["predicted_step_time_s"]
            h100 += 1
        else:
            assert other["predicted_step_time_s"] == row["predicted_step_time_s"], row["id"]
    # the datasheet profile's burst-rate GEMMs make the GEMM-bound H100 rows faster; its published
    # FlashAttention-3 figures are slower than the measured cuDNN attention where attention weighs
    # most (the in-node Qwen3 row, 1,024 tokens per rank)
    assert h100 >= 19 and faster >= h100 - 2


def test_validate_published_bad_files_are_one_line(tmp_path):
    import yaml

    one = tmp_path / "one.yaml"
    one.write_text("- id: x\n")
    numbers = tmp_path / "numbers.yaml"
    numbers.write_text("[1, 2]\n")
    records = yaml.safe_load((ROOT / "paraplan" / "data" / "public_runs.yaml").read_text())
    rec = next(r for r in records if r["id"] == "megatron_sc21_t1_1.7B")
    rec["parallelism"]["tp"] = "eight"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump([rec]))
    twice = tmp_path / "twice.yaml"
    twice.write_text(yaml.safe_dump([records[0], records[0]]))
    unsimulable = copy.deepcopy(next(r for r in records if r["id"] == "megatron_sc21_t1_1.7B"))
    unsimulable["parallelism"]["tp"] = 7
    none_run = tmp_path / "none_run.yaml"
    none_run.write_text(yaml.safe_dump([unsimulable]))
    rec_mbs = copy.deepcopy(next(r for r in records if r["id"] == "megatron_sc21_t1_1.7B"))
    rec_mbs["parallelism"]["tp"] = 1  # the record above had its tp spoiled in place
    rec_mbs["batch"]["micro_batch_size"] = 1.5
    bad_mbs = tmp_path / "bad_mbs.yaml"
    bad_mbs.write_text(yaml.safe_dump([rec_mbs]))
    rec_inf = copy.deepcopy(rec_mbs)
    rec_inf["parallelism"]["tp"] = float("inf")
    infinite = tmp_path / "inf.yaml"
    infinite.write_text(yaml.safe_dump([rec_inf]))
    rec_nan = copy.deepcopy(next(r for r in records if r["id"] == "korthikanti_t5_22B_sp_selective"))
    rec_nan["metrics"]["iteration_time_s"] = float("nan")
    nan_time = tmp_path / "nan.yaml"
    nan_time.write_text(yaml.safe_dump([rec_nan]))
    broken = tmp_path / "broken.yaml"
    broken.write_text("- id: [a\n")
    no_model = tmp_path / "no_model.yaml"
    no_model.write_text(yaml.safe_dump([{k: v for k, v in records[0].items() if k != "model"}]))
    cases = [
        ([str(tmp_path)], f"error: published-runs file: {tmp_path} is a directory"),
        ([str(one)], f"error: {one}: no record publishes a step time"),
        ([str(numbers)], f"error: {numbers}: record 1 is not a mapping with an 'id'"),
        ([str(bad)], "error: record megatron_sc21_t1_1.7B: parallelism.tp: expected an integer >= 1, got 'eight'\n"),
        ([str(bad_mbs)], "error: record megatron_sc21_t1_1.7B: batch.micro_batch_size: expected an integer >= 1 or "
                         "null, got 1.5\n"),
        ([str(infinite)], "error: record megatron_sc21_t1_1.7B: parallelism.tp: expected an integer >= 1, got inf\n"),
        ([str(nan_time)], "error: record korthikanti_t5_22B_sp_selective: metrics.iteration_time_s: expected a positive "
                          "number or null, got nan\n"),
        ([str(broken)], f"error: {broken}: invalid YAML: line 2, column 1: expected ',' or ']', but got '<stream end>'\n"),
        ([str(twice)], f"error: {twice}: record 2: id {records[0]['id']!r} is used twice"),
        ([str(no_model)], f"error: record {records[0]['id']}: model: expected a mapping, got None\n"),
        (["--json", "--markdown"], "error: argument --markdown: not allowed with argument --json"),
        (["--profile", "h100=mine.yaml"], "error: --profile h100=mine.yaml: expected BUNDLED=PROFILE with BUNDLED one of"),
        (["--profile", "h100-sxm-80gb-calibrated=nope"], "error: --profile nope: not found"),
        (["--profile", "h100-sxm-80gb-calibrated=h100-sxm-80gb", "--profile", "h100-sxm-80gb-calibrated=h200-sxm-141gb"],
         "error: --profile h100-sxm-80gb-calibrated=h200-sxm-141gb: h100-sxm-80gb-calibrated is already replaced"),
        (["--profile", "b200-sxm-180gb=h100-sxm-80gb"], "error: --profile b200-sxm-180gb=...: no compared record "
                                                         "runs on b200-sxm-180gb"),
        ([str(none_run)], f"error: {none_run}: none of the 1 comparable records could be simulated "
                          "(first, megatron_sc21_t1_1.7B: plan: tp*pp*cp*dp = 7*1*1*32 = 224"),
    ]
    for args, message in cases:
        r = paraplan("validate-published", *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith(message), (args, r.stderr)


@pytest.mark.parametrize("field,value,message", [
    # each had been read some other way: a string as true, a partial node dropped, 0 as the default
    ("parallelism.sequence_parallel", "false", "parallelism.sequence_parallel: expected true, false or null, got 'false'"),
    ("model.tied_embeddings", "no", "model.tied_embeddings: expected true, false or null, got 'no'"),
    ("hardware.num_gpus", 12, "hardware.num_gpus: 12 is not whole nodes of 8 GPUs"),
    ("hardware.gpus_per_node", 0, "hardware.gpus_per_node: expected an integer >= 1 or null, got 0"),
    ("parallelism.virtual_pipeline_stages", 0, "parallelism.virtual_pipeline_stages: expected an integer >= 1 or null"),
    ("metrics", [1], "metrics: expected a mapping, got [1]"),
    ("batch", 5, "batch: expected a mapping, got 5"),
    ("hardware.inter_node", 5, "hardware.inter_node: expected text or null, got 5"),
    ("source", "x", "source: expected a mapping, got 'x'"),
    ("hardware.gpu", "TPU v4", "hardware.gpu: no bundled profile for 'TPU v4'"),
])
def test_validate_published_names_the_record_and_field_it_cannot_read(tmp_path, field, value, message):
    import yaml

    records = yaml.safe_load((ROOT / "paraplan" / "data" / "public_runs.yaml").read_text())
    rec = next(r for r in records if r["id"] == "korthikanti_t5_22B_full_recompute")
    *path, last = field.split(".")
    node = rec
    for key in path:
        node = node[key]
    node[last] = value
    (tmp_path / "r.yaml").write_text(yaml.safe_dump([rec]))
    r = paraplan("validate-published", str(tmp_path / "r.yaml"))
    assert r.returncode == 2 and r.stderr.startswith(f"error: record korthikanti_t5_22B_full_recompute: {message}"), \
        r.stderr
    assert r.stderr.count("\n") == 1


def test_validate_published_reads_integers_written_as_floats(tmp_path):
    import yaml

    records = yaml.safe_load((ROOT / "paraplan" / "data" / "public_runs.yaml").read_text())
    rec = next(r for r in records if r["id"] == "korthikanti_t5_22B_full_recompute")
    (tmp_path / "a.yaml").write_text(yaml.safe_dump([rec]))
    rec["model"]["num_layers"] = float(rec["model"]["num_layers"])  # 8.0 for 8, as check_record_fields allows
    (tmp_path / "b.yaml").write_text(yaml.safe_dump([rec]))
    a, b = (json.loads(paraplan("validate-published", str(tmp_path / f), "--json").stdout) for f in ("a.yaml", "b.yaml"))
    assert a["rows"] == b["rows"] and a["rows"][0]["predicted_step_time_s"] > 0


@pytest.mark.parametrize("args,message", [
    (["calibrate", "--device", "cpu", "--out", "{tmp}/p.yaml"],
     "error: calibrate needs PyTorch, which is not installed: pip install 'torch>=2.11'\n"),
    (["launch", TINY, "--backend", "gloo", "--run-dir", "{tmp}/runs"],
     "error: the executor needs PyTorch >= 2.11, which is not installed: pip install 'torch>=2.11'\n"),
])
def test_commands_that_run_torch_say_so_when_it_is_missing(tmp_path, args, message):
    """Without torch (a `pip install -e .` machine) the torch commands give one line, exit 2, and
    write nothing."""
    r = _without_torch(tmp_path, args)
    assert (r.returncode, r.stderr) == (2, message)
    assert list(tmp_path.iterdir()) == []


def test_a_dry_run_checks_the_plan_without_torch(tmp_path):
    r = _without_torch(tmp_path, ["launch", TINY, "--dry-run", "--backend", "gloo", "--run-dir", "{tmp}/runs"])
    assert r.returncode == 0, r.stderr
    assert "plan OK" in r.stdout and "note: the launch needs PyTorch >= 2.11, which is not installed" in r.stdout
    assert list(tmp_path.iterdir()) == []


def _without_torch(tmp_path, args) -> subprocess.CompletedProcess:
    code = ("import sys; sys.modules['torch'] = None\n"  # find_spec('torch') is None, as if uninstalled
            "from paraplan.cli.main import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    argv = [a.format(tmp=tmp_path) for a in args]
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT)


def test_main_restores_the_callers_sigterm_handler():
    """main() turns SIGTERM into Terminated only while it runs (tests and tools call it in-process)."""
    import contextlib
    import io
    import signal

    from paraplan.cli.main import main

    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            assert main(["simulate", TINY]) == 0
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


def test_sigterm_during_calibration_says_terminated(monkeypatch, tmp_path, capsys):
    import argparse

    import calibrate.run
    from paraplan.cli import calibrate as cli
    from paraplan.errors import Terminated

    def stopped(opts):
        raise Terminated

    monkeypatch.setattr(calibrate.run, "calibrate", stopped)
    args = argparse.Namespace(out=str(tmp_path / "p.yaml"), device="cpu", quick=True, collectives=False, base=None,
                              name=None, dtypes=None, skip=[], report=None, threads=None, progress=False)
    assert cli.run(args) == 143
    assert capsys.readouterr().err == f"error: calibration terminated; nothing written to {tmp_path / 'p.yaml'}\n"


@pytest.mark.parametrize("kind", ["profile", "records", "hf_config", "report"])
def test_a_file_nested_past_the_recursion_limit_is_one_line(tmp_path, kind):
    """Each file paraplan reads: a document nested 100,000 deep is a one-line error naming the
    file, not a RecursionError traceback."""
    deep = "[" * 100_000 + "]" * 100_000
    if kind == "profile":
        (tmp_path / "g.yaml").write_text("name: " + deep + "\n")
        args = ("simulate", TINY, "--set", f"cluster.gpu={tmp_path / 'g.yaml'}")
    elif kind == "records":
        (tmp_path / "r.yaml").write_text("- " + deep + "\n")
        args = ("validate-published", str(tmp_path / "r.yaml"))
    elif kind == "hf_config":
        (tmp_path / "config.json").write_text(deep)
        args = ("simulate", TINY, "--set", f"model={{hf_config: {tmp_path / 'config.json'}}}")
    else:
        (tmp_path / "report.json").write_text(deep)
        args = ("calibrate", "--from-report", str(tmp_path / "report.json"), "--out", str(tmp_path / "p.yaml"))
    r = paraplan(*args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and str(tmp_path) in r.stderr, r.stderr


def test_an_output_path_spelt_as_a_folder_is_refused(tmp_path):
    """`--trace newdir/` (no such folder yet) had written a file named newdir."""
    r = paraplan("simulate", TINY, "--trace", f"{tmp_path}/newdir/")
    assert r.returncode == 2 and r.stderr == f"error: --trace: {tmp_path}/newdir/ names a folder; expected a file name\n"
    assert not (tmp_path / "newdir").exists()


def test_simulate_says_which_plan_it_simulated():
    """--json carries the plan as --set left it (dp derived) and the GPU profile; the text's plan
    line names an MoE model's expert parallelism and dispatcher."""
    r = paraplan("simulate", "scenarios/mixtral-8x7b-64xh100.yaml", "--set", "plan.ep=4",
                 "--set", "cluster.gpu=h100-sxm-80gb", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["gpu"] == "h100-sxm-80gb"
    assert {k: out["plan"][k] for k in ("tp", "pp", "dp", "ep")} == {"tp": 1, "pp": 4, "dp": 16, "ep": 4}
    text = paraplan("simulate", "scenarios/mixtral-8x7b-64xh100.yaml", "--set", "plan.ep=4").stdout
    assert "cp 1  ep 4  alltoall  mbs 1" in text
    assert "  ep " not in paraplan("simulate", "scenarios/tiny-gpt-8xa100.yaml").stdout  # dense: no EP


def test_simulate_names_the_hierarchical_cp_groups_it_derived():
    """An a2a+p2p plan without cp_a2a_size: the plan line and --json's plan carry the group the
    placement derived (Llama-3 8B, tp 1, cp 16 on 8-GPU nodes: all-to-all over 8, ring of 2), so
    the plan can be re-run or launched exactly."""
    sets = ["--set", "training.seq_length=131072", "--set", "training.global_batch_size=16", "--set", "plan.cp=16",
            "--set", "plan.dp=null", "--set", "plan.recompute=full", "--set", "plan.cp_comm_type=a2a+p2p"]
    text = paraplan("simulate", "scenarios/llama3-8b-64xh100.yaml", *sets)
    assert text.returncode == 0, text.stderr
    assert "cp 16 (a2a+p2p: a2a 8 x ring 2)" in text.stdout
    out = json.loads(paraplan("simulate", "scenarios/llama3-8b-64xh100.yaml", *sets, "--json").stdout)
    assert (out["plan"]["cp_comm_type"], out["plan"]["cp_a2a_size"]) == ("a2a+p2p", 8)


def test_memory_that_does_not_fit_never_reads_as_equal_to_the_capacity(tmp_path):
    import yaml

    from simulator.memory import GiB, gib_pair

    assert gib_pair(80.02 * GiB, 80 * GiB) == ("80.02", "80.00")
    assert gib_pair(80.0004 * GiB, 80 * GiB) == ("80.000", "80.000")  # three decimals at most
    assert gib_pair(79.99 * GiB, 80 * GiB) == ("80.0", "80.0")  # fits: one decimal
    assert gib_pair(33.8 * GiB, 80 * GiB) == ("33.8", "80.0")
    profile = yaml.safe_load((ROOT / "hwmodels" / "profiles" / "a100-sxm-80gb.yaml").read_text())
    profile["name"], profile["hbm"]["capacity_GiB"] = "a100-80gib", 80  # a plan 0.02 GiB over
    (tmp_path / "a100-80gib.yaml").write_text(yaml.safe_dump(profile))
    r = paraplan("simulate", "scenarios/gpt3-175b-1024xa100.yaml", "--set", "plan.tp=4", "--set",
                 "plan.virtual_pipeline_stages=6", "--set", "plan.sequence_parallel=false", "--set", "plan.recompute=none",
                 "--set", f"cluster.gpu={tmp_path / 'a100-80gib.yaml'}")
    assert r.returncode == 2 and "80.02 GiB of 80.00 GiB  -> DOES NOT FIT" in r.stdout
    assert r.stderr == "error: out of memory: stage 0 needs 80.02 GiB per GPU, the GPU has 80.00 GiB\n"


def test_layers_that_do_not_split_get_the_planners_split_suggested():
    """DeepSeek-V3's 61 layers on 8 stages: the scenario's 4/1 edges leave 56 for 6 stages; simulate
    names the edges the planner derives for pp 8 (balancing the edge stages' FLOPs, the LM head and
    multi-token prediction on the last), which then simulate."""
    from paraplan.loader import load_scenario
    from planner.space import PlanSpace, parse_search

    sc = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml")
    first, last = PlanSpace(sc, parse_search(sc, {}))._split(8)
    r = paraplan("simulate", "scenarios/deepseek-v3-2048xh800.yaml", "--set", "plan.pp=8")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.rstrip().endswith(f"(the planner would split them: --set plan.first_stage_layers={first} "
                                      f"--set plan.last_stage_layers={last})")
    assert (first, last) == (8, 5)
    ok = paraplan("simulate", "scenarios/deepseek-v3-2048xh800.yaml", "--set", "plan.pp=8", "--set",
                  f"plan.first_stage_layers={first}", "--set", f"plan.last_stage_layers={last}", "--json")
    assert ok.returncode in (0, 2) and json.loads(ok.stdout)["plan"]["pp"] == 8  # simulated (it may not fit)
    r = paraplan("simulate", "scenarios/gpt3-175b-1024xa100.yaml", "--set", "plan.schedule=1f1b")
    assert "(or virtual_pipeline_stages 1 for 1f1b)" in r.stderr
