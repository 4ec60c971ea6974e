"""`paraplan plan` as a user runs it: `python -m paraplan plan ...` in a subprocess."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from paraplan.loader import load_scenario
from planner.emit import megatron_args
from simulator.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml")
SMALL = ["--set", "search.micro_batch_size=[1, 2]", "--set", "search.cp=[1]", "--set", "search.zero_stage=[1, 3]"]


def paraplan(*args, cwd=ROOT):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "paraplan", *args], capture_output=True, text=True, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "out"
    r = paraplan("plan", TINY, "--out", str(out), "--trials", "40", "--strategy", "tpe", *SMALL)
    assert r.returncode == 0, r.stderr
    return out, r


def test_the_table_and_the_launch_command(planned):
    out, r = planned
    for word in ("tpe search, objective throughput", "top plans:", "tokens/s", "MFU", "limited by",
                 "scenario's plan", "rejected:", f"launch it: paraplan launch {out}/best_plan.yaml"):
        assert word in r.stdout
    assert "searching" in r.stderr           # progress, with the best plan so far
    assert "best " in r.stderr


def test_output_files(planned):
    out, _ = planned
    names = {p.name for p in out.iterdir()}
    assert {"report.txt", "top_plans.json", "best_plan.yaml", "megatron_args.txt", "torchtitan.toml",
            "history.png", "importance.png", "study.journal"} <= names
    assert not [n for n in names if n.startswith(".") and n.endswith(".tmp")]  # atomic writes leave no temp files
    for png in ("history.png", "importance.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_top_plans_json_and_best_plan_agree(planned):
    out, _ = planned
    data = json.loads((out / "top_plans.json").read_text())
    assert data["strategy"] == "tpe" and data["search"]["trials"] == 40
    plans = data["plans"]
    assert plans and [p["rank"] for p in plans] == list(range(1, len(plans) + 1))
    tps = [p["metrics"]["tokens_per_s"] for p in plans]
    assert tps == sorted(tps, reverse=True)
    for key in ("step_time_s", "mfu", "memory_headroom", "limited_by", "peak_memory_bytes"):
        assert key in plans[0]["metrics"]
    assert data["space"]["valid_plans"] == 312 and data["space"]["rejected"]
    # best_plan.yaml is an executor config the loader (and so `paraplan launch`) accepts
    sc = load_scenario(out / "best_plan.yaml")
    assert sc.search == () and sc.run.backend == "nccl"
    for key, value in plans[0]["plan"].items():
        assert getattr(sc.plan, key) == value
    assert simulate(sc).tokens_per_s == pytest.approx(tps[0])
    raw = yaml.safe_load((out / "best_plan.yaml").read_text())
    assert set(raw) == {"name", "model", "cluster", "training", "plan", "run"}
    assert (out / "best_plan.yaml").read_text().startswith("# Executor config written by `paraplan plan`")


def test_megatron_and_torchtitan_exports(planned):
    out, _ = planned
    sc = load_scenario(out / "best_plan.yaml")
    args = (out / "megatron_args.txt").read_text()
    for flag in (f"--tensor-model-parallel-size {sc.plan.tp}", f"--pipeline-model-parallel-size {sc.plan.pp}",
                 f"--micro-batch-size {sc.plan.micro_batch_size}", "--global-batch-size 16", "--num-layers 4",
                 "--hidden-size 1024", "--bf16"):
        assert flag in args
    assert argv_of_launch_line(out) == megatron_args(sc)
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    cfg = tomllib.loads((out / "torchtitan.toml").read_text())
    par = cfg["parallelism"]
    assert par["tensor_parallel_degree"] == sc.plan.tp and par["pipeline_parallel_degree"] == sc.plan.pp
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == sc.plan.dp
    assert cfg["training"]["global_batch_size"] == 16 and cfg["training"]["seq_len"] == 1024
    assert cfg["activation_checkpoint"]["mode"] == sc.plan.recompute


def argv_of_launch_line(out):
    """The arguments pretrain_gpt.py receives from the Launch line of the written megatron_args.txt,
    run by bash in the output folder with torchrun ... pretrain_gpt.py swapped for an argv printer."""
    if shutil.which("bash") is None or shutil.which("xargs") is None:
        pytest.skip("needs bash and xargs")
    head = [line for line in (out / "megatron_args.txt").read_text().splitlines() if line.startswith("# Launch: ")]
    assert len(head) == 1
    printer = f"{shlex.quote(sys.executable)} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"
    command = re.sub(r"torchrun .*pretrain_gpt\.py", lambda _: printer, head[0][len("# Launch: "):])
    r = subprocess.run(["bash", "-c", command], cwd=out, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def test_report_says_how_many_plans_fit(planned):
    out, r = planned
    search = json.loads((out / "top_plans.json").read_text())["search"]
    line = f"{search['fit']} of the {search['distinct_plans']} plans fit in memory"
    assert line in (out / "report.txt").read_text() and line in r.stdout


def test_resume_in_the_same_folder(planned, tmp_path):
    out, _ = planned
    r = paraplan("plan", TINY, "--out", str(out), "--trials", "45", "--strategy", "tpe", "--resume",
                 "--quiet", "--no-plots", *SMALL)
    assert r.returncode == 0, r.stderr
    assert "trials: 45 (" in r.stdout and "40 before this run" in r.stdout


def test_a_resume_with_its_budget_spent_says_so(planned):
    """--trials is the study's total: a resume at or under what it holds runs nothing and says how to
    ask for more."""
    out, _ = planned
    r = paraplan("plan", TINY, "--out", str(out), "--trials", "10", "--strategy", "tpe", "--resume",
                 "--quiet", "--no-plots", *SMALL)
    assert r.returncode == 0, r.stderr
    assert "0 simulated in this run" in r.stdout
    assert re.search(r"note: the study already holds (\d+) trials, the whole budget .* pass a larger --trials", r.stderr)


def test_another_search_does_not_overwrite_a_folders_results(planned):
    """A folder's result files belong to the study that wrote them: a search of another objective
    (or scenario) into it is refused before it runs, and the files stay as they were."""
    out, _ = planned
    before = {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()}
    r = paraplan("plan", TINY, "--out", str(out), "--objective", "cost", "--trials", "5", "--strategy", "tpe",
                 "--quiet", "--no-plots", *SMALL)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: --out: {out} holds the results of study 'tiny-gpt-8xa100-throughput', "
                               "which this search ('tiny-gpt-8xa100-cost') would overwrite")
    assert {f.name: f.read_bytes() for f in out.iterdir() if f.is_file()} == before


def test_default_folder_is_new_and_named_after_the_scenario(tmp_path):
    args = ("plan", TINY, "--trials", "5", "--strategy", "tpe", "--quiet", "--no-plots", *SMALL)
    assert paraplan(*args, cwd=tmp_path).returncode == 0
    assert paraplan(*args, cwd=tmp_path).returncode == 0
    assert (tmp_path / "plan-tiny-gpt-8xa100" / "best_plan.yaml").is_file()
    assert (tmp_path / "plan-tiny-gpt-8xa100-2" / "best_plan.yaml").is_file()
    r = paraplan("plan", TINY, "--trials", "8", "--strategy", "tpe", "--quiet", "--no-plots", "--resume", *SMALL,
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "plan-tiny-gpt-8xa100-2/" in r.stdout   # --resume picks the newest search folder


def test_cost_objective(tmp_path):
    r = paraplan("plan", TINY, "--out", str(tmp_path), "--objective", "cost", "--gpu-hour-cost", "2.5",
                 "--trials", "20", "--strategy", "tpe", "--quiet", "--no-plots", *SMALL)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "top_plans.json").read_text())
    costs = [p["metrics"]["cost_per_1M_tokens"] for p in data["plans"]]
    assert costs == sorted(costs) and data["plans"][0]["metrics"]["cost_unit"] == "per 1M tokens"


BAD = [
    (["--set", "search.tp=16"], "error: search: no valid plan: every one of the"),
    (["--set", "search.tpp=[2]"], "error: search.tpp: unknown key, did you mean 'tp'?"),
    (["--set", "search.tp={a: 1}"], "error: search.tp: expected a list of candidates (or one value), got a mapping"),
    (["--set", "search.virtual_pipeline_stages=[1]", "--set", "search.schedule=[interleaved-1f1b]"],
     "error: search.virtual_pipeline_stages: schedule interleaved-1f1b takes 2 or more virtual stages per rank"),
    (["--storage", "bogus://x"], "error: --storage bogus://x: cannot open it:"),
    (["--study", "nope", "--resume", "--storage", "{tmp}/s.journal"], "error: --resume: {tmp}/s.journal does not exist"),
    # (it had created the database, empty, and left it behind)
    (["--resume", "--storage", "sqlite:///{tmp}/x.db"], "error: --resume: sqlite:///{tmp}/x.db does not exist, so"),
    (["--trials", "0"], "error: argument --trials: expected a positive integer, got 0"),
    (["--seed", "4294967296"], "error: argument --seed: expected an integer from 0 to 2**32 - 1, got 4294967296"),
    (["--workers", "100000"], "error: argument --workers: expected an integer from 1 to 256, got 100000"),
    (["--study", ""], "error: argument --study: expected a study name, got an empty string"),
    (["--objective", "throughput-vs-gpus"], "error: search.num_nodes: --objective throughput-vs-gpus needs"),
    # the model states fit when sharded over all 8 GPUs (no refusal before the search), the activations do not
    (["--set", "model.num_layers=44", "--set", "model.hidden_size=8192", "--set", "model.num_attention_heads=64",
      "--set", "training.seq_length=8192", "--set", "search.tp=[8]", "--set", "search.recompute=[none]"],
     "error: no plan fits in memory among the"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[m.split(":")[1].strip() for _, m in BAD])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    message = message.replace("{tmp}", str(tmp_path))
    r = paraplan("plan", TINY, "--out", str(tmp_path / "o"), "--quiet", "--no-plots", "--trials", "10", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), r.stderr
    assert not [p for p in tmp_path.iterdir() if p.name != "o"], list(tmp_path.iterdir())  # no storage created
    assert "Traceback" not in r.stderr
    out = tmp_path / "o"  # no result files; at most the search journal, which --resume reads
    assert not out.exists() or {p.name for p in out.iterdir()} <= {"study.journal", "study.journal.flock"}, \
        list(out.iterdir())


def test_a_storage_file_that_is_not_a_journal_is_refused_untouched(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    r = paraplan("plan", TINY, "--out", str(tmp_path / "o"), "--quiet", "--trials", "5", "--storage", str(notes))
    assert r.returncode == 2 and r.stderr.strip().startswith(f"error: --storage {notes}: not an Optuna journal file")
    assert notes.read_text() == "my notes\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_scenario_plan_that_does_not_fit_the_cluster_still_gets_a_search(tmp_path):
    """"What is best on this cluster?" without rewriting the plan: the search runs, the scenario's
    plan is reported invalid with the reason, and `simulate` still refuses it."""
    over = ["--set", "plan.tp=8", "--set", "plan.pp=2"]     # 16 GPUs' worth on 8
    r = paraplan("plan", TINY, "--out", str(tmp_path / "o"), "--quiet", "--no-plots", *SMALL, *over)
    assert r.returncode == 0, r.stderr
    assert ("scenario's plan: invalid (plan: tp*pp*cp = 8*2*1 = 16 does not divide the 8 GPUs (1 node x 8), "
            "so no dp completes the plan)") in r.stdout
    assert "top plans:" in r.stdout and (tmp_path / "o" / "best_plan.yaml").is_file()
    base = json.loads((tmp_path / "o" / "top_plans.json").read_text())["baseline"]
    assert base["status"] == "invalid" and base["reasons"][0].startswith("plan: tp*pp*cp = 8*2*1 = 16")
    s = paraplan("simulate", TINY, *over)
    assert s.returncode == 2 and s.stderr.strip() == ("error: plan: tp*pp*cp = 8*2*1 = 16 does not divide the "
                                                      "cluster's 8 GPUs (1 node x 8), so dp cannot be derived")


def test_flags_the_search_had_no_use_for_are_named(tmp_path):
    r = paraplan("plan", TINY, "--out", str(tmp_path), "--trials", "5", "--gpu-hour-cost", "2", "--quiet",
                 "--no-plots", *SMALL)
    assert r.returncode == 0, r.stderr
    assert "exhaustive search" in r.stdout
    assert "note: --trials 5 not used: the exhaustive search simulates every valid plan" in r.stdout
    assert "note: --gpu-hour-cost not used: only --objective cost prices the plans" in r.stdout
    assert "note: --trials" in (tmp_path / "report.txt").read_text()
    # said as the search starts too, beside its progress (not with --quiet)
    r = paraplan("plan", TINY, "--out", str(tmp_path / "again"), "--trials", "5", "--no-plots", *SMALL)
    first = r.stderr.splitlines()[0]
    assert first.startswith("note: --trials 5 not used: the exhaustive search simulates every valid plan (") and \
        r.stderr.count("note: --trials") == 1


def test_a_cluster_too_small_for_any_plan_says_how_many_gpus_are_needed(tmp_path):
    """When even ZeRO-3 over every GPU cannot hold the model states, the error says so and gives the
    smallest GPU count that could (states x 18 bytes / (capacity - the 1 GiB reservation))."""
    import math

    from hwmodels.profile import load_profile
    from paraplan.loader import load_scenario

    over = ["model.num_layers=64", "model.hidden_size=12288", "model.num_attention_heads=96"]
    sc = load_scenario(TINY, over)
    states = sc.model.total_params() * (2 + 4 + 12)
    capacity = load_profile(sc.cluster.gpu).hbm_capacity
    need = math.ceil(states / (capacity - 2**30))
    assert need > sc.cluster.world_size  # the premise: this model cannot fit on the tiny cluster
    args = [a for o in over for a in ("--set", o)]
    r = paraplan("plan", TINY, "--out", str(tmp_path / "o"), "--quiet", "--no-plots", "--trials", "5", *args)
    assert r.returncode == 2
    assert (f"no plan can fit: the model states alone ({sc.model.total_params() / 1e9:,.1f}B parameters x 18 bytes"
            in r.stderr), r.stderr
    assert f"at least {need:,} GPUs of {capacity / 2**30:.4g} GiB are needed, before activations" in r.stderr, r.stderr


def test_a_best_plan_the_executor_refuses_gets_its_reasons_not_a_launch_line(tmp_path):
    """fp16 trains under Megatron-LM and torchtitan but not the bundled executor: the report says
    so instead of printing a `paraplan launch` line that would fail."""
    out = tmp_path / "o"
    r = paraplan("plan", TINY, "--out", str(out), "--quiet", "--no-plots", "--trials", "5", *SMALL,
                 "--set", "training.precision=fp16")
    assert r.returncode == 0, r.stderr
    assert "launch it:" not in r.stdout
    assert "the bundled executor cannot run it: training.precision: the executor trains in fp32 or bf16, not fp16" \
        in r.stdout
    assert f"run it with Megatron-LM ({out}/megatron_args.txt) or torchtitan ({out}/torchtitan.toml)" in r.stdout
    best = json.loads((out / "top_plans.json").read_text())["best_plan"]
    assert best["launch"] is None and best["executor_refuses"][0].startswith("training.precision")
    assert "# Launch: not with the bundled executor, which refuses it: training.precision" in \
        (out / "best_plan.yaml").read_text()


def test_too_small_is_judged_on_the_largest_cluster_searched(tmp_path):
    """search.num_nodes lists 1 and 3 nodes: the states are sharded over the 24 GPUs of the larger,
    which is still short of the 25 they need, and the error says 24, not the scenario's 8."""
    over = ["model.num_layers=64", "model.hidden_size=12288", "model.num_attention_heads=96",
            "search.num_nodes=[1, 3]", "search.recompute=[none]", "search.tp=[8]", "search.micro_batch_size=[1]"]
    args = [a for o in over for a in ("--set", o)]
    r = paraplan("plan", TINY, "--out", str(tmp_path / "o"), "--quiet", "--no-plots", "--trials", "5", *args)
    assert r.returncode == 2 and "even sharded over all 24 GPUs; at least 25 GPUs" in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()  # refused before the search: nothing simulated, nothing written


def test_the_recompute_column_fits_named_modules(tmp_path):
    r = paraplan("plan", TINY, "--trials", "5", "--strategy", "tpe", "--quiet", "--no-plots", *SMALL,
                 "--set", "plan.recompute=selective", "--set", "plan.recompute_modules=[core_attn,mlp]",
                 "--set", "search.recompute=[selective]", "--out", str(tmp_path / "p"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    head = next(line for line in lines if "recompute" in line and "step s" in line)
    rows = [line for line in lines[lines.index(head) + 1:] if "selective(core_attn,mlp)" in line and "%" in line
            and line.split()[0].isdigit()]
    assert rows
    for row in rows:  # every column after the label starts where its heading does
        assert row.index("selective(core_attn,mlp)") == head.index("recompute")
        assert row[head.index("step s") + len("step s") - 1] != " "  # the step time ends under its heading


def test_the_launch_line_is_judged_on_the_scaled_down_model_launch_runs(tmp_path):
    """`paraplan launch` scales the model by run.num_layers before it checks the plan; a best plan
    whose pipeline cannot split the scaled-down layers gets the reason, not a launch line."""
    out = tmp_path / "o"
    r = paraplan("plan", TINY, "--out", str(out), "--quiet", "--no-plots", "--set", "run.num_layers=3",
                 "--set", "run.backend=gloo", "--set", "search.tp=[2]", "--set", "search.pp=[2]", "--set", "search.cp=[1]")
    assert r.returncode == 0, r.stderr
    assert "launch it:" not in r.stdout
    assert "do not split evenly" in r.stdout and "(run.num_layers 3 sets model.num_layers; this layout splits" in r.stdout
    assert json.loads((out / "top_plans.json").read_text())["best_plan"]["launch"] is None


def test_the_scenarios_plan_ranks_once_when_written_otherwise_than_the_space_writes_it(tmp_path):
    """sequence_parallel: true at tp 1 is the same plan as the space's (off): one row, marked as the
    scenario's plan (it had been ranked twice, once from the search and once as the baseline)."""
    r = paraplan("plan", TINY, "--out", str(tmp_path / "o"), "--no-plots", "--quiet", "--set", "plan.tp=1",
                 "--set", "plan.pp=1", "--set", "plan.sequence_parallel=true", "--set", "search.tp=[1]",
                 "--set", "search.pp=[1]", "--set", "search.cp=[1]", "--set", "search.micro_batch_size=[2]",
                 "--set", "search.zero_stage=[1]", "--set", "search.recompute=[none]")
    assert r.returncode == 0, r.stderr
    top = json.loads((tmp_path / "o" / "top_plans.json").read_text())
    assert len(top["plans"]) == 1 and top["plans"][0]["scenario_plan"], top["plans"]


def test_a_resume_without_plots_removes_the_earlier_runs_plots(tmp_path):
    """The plots beside the new report would be an earlier run's (fewer trials) read as this one's."""
    out = tmp_path / "o"
    args = ("plan", TINY, "--out", str(out), "--quiet", *SMALL)
    assert paraplan(*args, "--trials", "12").returncode == 0
    assert (out / "history.png").exists()
    r = paraplan(*args, "--trials", "20", "--resume", "--no-plots")
    assert r.returncode == 0, r.stderr
    assert not (out / "history.png").exists() and not (out / "importance.png").exists()
    assert "removed the earlier run's history.png" in r.stdout


def test_an_interrupted_search_says_how_to_resume(tmp_path):
    """Ctrl-C keeps the journal's finished trials; the message names it and --resume, with no
    traceback wherever in a trial the interrupt lands (after its result was recorded, too)."""
    import signal

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "paraplan", "plan", str(ROOT / "scenarios" / "llama3-8b-64xh100.yaml"),
                             "--strategy", "tpe", "--trials", "100000", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    first = proc.stderr.readline()  # the progress line of the first trial: the search is running
    assert first.startswith("searching 1/100000 trials"), first
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130
    lines = [line for line in err.splitlines() if not line.startswith("searching")]
    assert lines == [f"interrupted: the finished trials are kept in {out / 'study.journal'}; continue with the same "
                     "command and --resume", "error: interrupted"], err


def test_plans_near_the_memory_limit_point_to_the_headroom_setting(tmp_path):
    """Top plans over 95% of GPU memory get a note naming search.memory_headroom; with it set,
    no plan that close is kept, and the trials line says what fitting meant."""
    scenario = str(ROOT / "scenarios" / "llama3-70b-1024xh100.yaml")
    r = paraplan("plan", scenario, "--trials", "60", "--strategy", "tpe", "--no-plots", "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    assert re.search(r"\(\d+ of these 10 use over 95% of GPU memory, .*search\.memory_headroom", r.stdout)
    r = paraplan("plan", scenario, "--trials", "60", "--strategy", "tpe", "--no-plots", "--out", str(tmp_path / "b"),
                 "--set", "search.memory_headroom=0.15")
    assert r.returncode == 0, r.stderr
    assert "use over 95% of GPU memory" not in r.stdout and "leaving 15% of it free (search.memory_headroom)" in r.stdout
    free = [int(m) for m in re.findall(r"/79\.2\s+(\d+)%", r.stdout)]
    assert free and min(free) >= 15
