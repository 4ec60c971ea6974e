"""The search engine: a contract every strategy meets, quality against the exhaustive optimum,
determinism, constraint handling, resume after a crash, and storage and study errors."""
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from paraplan.errors import ConfigError, ParaplanError
from paraplan.loader import load_scenario
from planner.objective import Evaluator, make_objective, pareto_front
from planner.report import build_report, format_report
from planner.search import SearchRequest, open_storage, run_search
from planner.space import PlanSpace, parse_search

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "scenarios" / "tiny-gpt-8xa100.yaml"
# 312 valid plans of the tiny model: small enough to enumerate in a test, large enough to search
# (384 while pp = 1 plans ran gpipe and 1f1b as two: 72 of them, 12 + 24 + 24 + 12 over tp 1, 2, 4, 8)
SMALL = ["search.micro_batch_size=[1, 2]", "search.cp=[1]", "search.zero_stage=[1, 3]"]
# a 13B-parameter model on the 8 GPUs: many plans do not fit
BIG = ["model.num_layers=16", "model.hidden_size=8192", "model.num_attention_heads=64",
       "search.cp=[1]", "search.micro_batch_size=[1, 2]", "search.schedule=[1f1b]"]


def request(tmp_path, *overrides, study="s", **kw):
    tmp_path.mkdir(parents=True, exist_ok=True)
    sc = load_scenario(TINY, list(overrides))
    return SearchRequest(scenario=sc, spec=parse_search(sc), objective=make_objective(kw.pop("objective", "throughput")),
                         storage=str(tmp_path / "study.journal"), study_name=study, **kw)


def best_tokens(result):
    return max(r.evaluation.tokens_per_s for r in result.records if r.evaluation.fits)


@pytest.fixture(scope="module")
def exhaustive(tmp_path_factory):
    return run_search(request(tmp_path_factory.mktemp("exh"), *SMALL, strategy="exhaustive"))


# -- the contract every strategy meets ------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["exhaustive", "tpe"])
def test_strategy_contract(tmp_path, strategy, exhaustive):
    req = request(tmp_path, *SMALL, strategy=strategy, trials=40)
    res = run_search(req)
    assert res.strategy == strategy
    space = PlanSpace(req.scenario, req.spec)
    study = optuna.load_study(study_name="s", storage=open_storage(req.storage))
    trials = study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert len(trials) == len(res.records) == res.budget
    assert study.get_trials(states=(TrialState.RUNNING, TrialState.FAIL, TrialState.WAITING)) == []
    valid = set(exhaustive.enumeration.valid)
    check = Evaluator(space)
    for t, rec in zip(trials, res.records):
        e = rec.evaluation
        assert rec.number == t.number
        assert e.candidate == space.candidate(t.params)       # the trial's knobs are the plan simulated
        assert (t.state == TrialState.PRUNED) == (e.status == "invalid")
        if e.simulated:
            assert e.candidate in valid
            assert t.values == [e.tokens_per_s]
        if rec.number < 5:                                    # and re-simulating gives the same
            assert check.evaluate(e.candidate) == e
    assert res.simulations <= len({r.evaluation.candidate for r in res.records if r.evaluation.simulated})


def test_exhaustive_simulates_every_valid_plan_once(exhaustive):
    plans = [r.evaluation.candidate for r in exhaustive.records]
    assert len(plans) == len(set(plans)) == len(exhaustive.enumeration.valid) == 312
    assert set(plans) == set(exhaustive.enumeration.valid)
    assert exhaustive.simulations == 312


def test_tpe_finds_the_exhaustive_optimum_within_1_percent(tmp_path, exhaustive):
    res = run_search(request(tmp_path, *SMALL, strategy="tpe", trials=60, seed=0))
    assert len(res.records) == 60
    assert best_tokens(res) >= 0.99 * best_tokens(exhaustive)


def test_auto_picks_exhaustive_below_the_threshold_and_tpe_above(tmp_path):
    small = run_search(request(tmp_path, *SMALL, "search.exhaustive_threshold=400", study="a"))
    assert small.strategy == "exhaustive"
    large = run_search(request(tmp_path, *SMALL, "search.exhaustive_threshold=100", "search.trials=12", study="b"))
    assert large.strategy == "tpe" and len(large.records) == 12


def test_seeded_search_is_reproducible(tmp_path):
    runs = [run_search(request(tmp_path / str(i), *SMALL, strategy="tpe", trials=40, seed=3)) for i in (1, 2)]
    a, b = ([r.evaluation.candidate for r in res.records] for res in runs)
    assert a == b
    other = run_search(request(tmp_path / "3", *SMALL, strategy="tpe", trials=40, seed=4))
    assert [r.evaluation.candidate for r in other.records] != a


def test_memory_overflow_is_told_as_a_constraint(tmp_path):
    res = run_search(request(tmp_path, *BIG, strategy="tpe", trials=40))
    study = optuna.load_study(study_name="s", storage=open_storage(str(tmp_path / "study.journal")))
    statuses = set()
    for t in study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED)):
        e = next(r.evaluation for r in res.records if r.number == t.number)
        statuses.add(e.status)
        if e.status == "oom":
            assert t.state == TrialState.COMPLETE and e.overflow > 0
            assert t.constraints["memory"] == pytest.approx(e.overflow)
            assert t.values == [e.tokens_per_s]            # told with its value: the sampler learns the boundary
        elif e.status == "ok":
            assert t.constraints["memory"] < 0 and t.constraints["structure"] == 0
        else:
            assert t.state == TrialState.PRUNED and t.constraints["structure"] > 0
    assert {"ok", "oom"} <= statuses
    rep = build_report("big", res, make_objective("throughput"))
    assert rep.oom > 0 and all(r.evaluation.fits for r in rep.plans)


def test_no_valid_plan_is_a_one_line_error_naming_the_constraint(tmp_path):
    with pytest.raises(ConfigError) as e:
        run_search(request(tmp_path, "search.tp=16"))
    msg = str(e.value)
    assert msg.startswith("search: no valid plan: every one of the ") and "\n" not in msg
    assert "tp = 16" in msg or "16*" in msg


def test_pareto_objective(tmp_path):
    res = run_search(request(tmp_path, *BIG, strategy="tpe", trials=30, objective="throughput-vs-headroom"))
    obj = make_objective("throughput-vs-headroom")
    rep = build_report("big", res, obj)
    front = [r.evaluation for r in rep.plans]
    assert front and front == pareto_front(front, obj)
    fits = [r.evaluation for r in res.records if r.evaluation.fits]
    for e in fits:  # nothing that fits dominates a front plan
        assert not any(e.tokens_per_s > f.tokens_per_s and e.headroom > f.headroom for f in front)


# -- resume ---------------------------------------------------------------------------------------


def test_resume_continues_without_recomputing(tmp_path):
    first = run_search(request(tmp_path, *SMALL, strategy="tpe", trials=20))
    again = run_search(request(tmp_path, *SMALL, strategy="tpe", trials=30, resume=True))
    assert again.trials_before == 20 and len(again.records) == 30
    assert [r.number for r in again.records] == list(range(30))
    assert again.records[:20] == first.records                     # finished trials kept as they were
    new = {r.evaluation.candidate for r in again.records[20:] if r.evaluation.simulated}
    old = {r.evaluation.candidate for r in first.records}
    assert again.simulations == len(new - old) <= 10               # memo seeded from the study


def test_resume_of_a_missing_study_names_what_is_there(tmp_path):
    run_search(request(tmp_path, *SMALL, strategy="tpe", trials=3, study="run1"))
    with pytest.raises(ParaplanError) as e:
        run_search(request(tmp_path, *SMALL, strategy="tpe", trials=3, study="run2", resume=True))
    assert str(e.value) == f"--resume: no study named 'run2' in {tmp_path / 'study.journal'}; studies there: run1"


def test_a_study_made_for_another_search_is_not_joined(tmp_path):
    run_search(request(tmp_path, *SMALL, strategy="tpe", trials=3))
    with pytest.raises(ParaplanError) as e:
        run_search(request(tmp_path, *SMALL, "search.recompute=[full]", strategy="tpe", trials=3))
    assert "was made for a different scenario, search section, objective or strategy" in str(e.value)


@pytest.mark.parametrize("url,shown", [
    ("bogus://nowhere", "--storage bogus://nowhere: cannot open it: "),
    ("postgresql://me:secret@localhost:1/db", "--storage postgresql://me:***@localhost:1/db: cannot open it: "),
    ("/no/such/folder/study.journal", "--storage: the folder of the journal file /no/such/folder/study.journal"),
])
def test_bad_storage_is_a_one_line_error(url, shown):
    with pytest.raises(ParaplanError) as e:
        open_storage(url)
    assert str(e.value).startswith(shown) and "\n" not in str(e.value) and "secret" not in str(e.value)


def _journal_counts(path):
    storage = open_storage(str(path))
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    return study.get_trials(deepcopy=False)



def test_a_journal_cut_mid_line_resumes_and_stays_readable(tmp_path):
    """A full disk or a kill mid-write leaves a journal whose last line has no newline: `--resume`
    drops that unfinished operation instead of gluing its next one onto it, so the journal still
    reads after every resume (it had become unreadable after the second). The trial whose
    completion was cut off is marked failed, as after a kill."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "paraplan", "plan", str(TINY), "--out", str(out), "--strategy", "tpe",
           "--quiet", "--no-plots", *[a for s in SMALL for a in ("--set", s)]]
    assert subprocess.run(cmd + ["--trials", "12"], cwd=ROOT, capture_output=True).returncode == 0
    journal = out / "study.journal"
    journal.write_bytes(journal.read_bytes()[:-40])  # the last operation, cut 40 bytes short
    for trials in (16, 20):
        r = subprocess.run(cmd + ["--trials", str(trials), "--resume"], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert journal.read_bytes().endswith(b"\n")
        states = [t.state for t in _journal_counts(journal)]
        assert states.count(TrialState.COMPLETE) + states.count(TrialState.PRUNED) == trials
        assert states.count(TrialState.FAIL) == 1 and TrialState.RUNNING not in states


def test_a_journal_write_that_fails_names_the_journal(tmp_path):
    from planner.journal import JournalFile

    path = tmp_path / "j"
    journal = JournalFile(str(path))
    path.unlink()
    path.mkdir()  # a folder where the journal was: it cannot be written
    with pytest.raises(OSError) as e:
        journal.append_logs([{"op_code": 0}])
    assert e.value.filename == str(path) and "cannot write the study journal" in e.value.strerror


def test_kill_9_then_resume_loses_and_recomputes_nothing(tmp_path):
    """A search killed with SIGKILL mid-run, then `--resume`: every trial finished before the kill
    is kept as it was, the interrupted one is marked failed, and only the missing trials run."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "paraplan", "plan", str(TINY), "--out", str(out), "--strategy", "tpe",
           "--quiet", "--no-plots", *[a for s in SMALL for a in ("--set", s)]]
    proc = subprocess.Popen(cmd + ["--trials", "5000"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    journal = out / "study.journal"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.2)
        if journal.exists() and sum(t.state.is_finished() for t in _journal_counts(journal)) >= 25:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = [t for t in _journal_counts(journal) if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(before) >= 25
    n = len(before) + 15
    r = subprocess.run(cmd + ["--trials", str(n), "--resume"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    after = _journal_counts(journal)
    done = [t for t in after if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(done) == n
    assert [(t.number, t.params, t.values) for t in done[:len(before)]] == \
           [(t.number, t.params, t.values) for t in before]
    assert not [t for t in after if t.state == TrialState.RUNNING]
    assert len([t for t in after if t.state == TrialState.FAIL]) <= 1
    data = json.loads((out / "top_plans.json").read_text())
    assert data["search"]["trials_before_this_run"] == len(before)
    assert data["search"]["simulations_this_run"] <= 15


def test_parallel_workers_share_one_study(tmp_path, exhaustive):
    res = run_search(request(tmp_path, *SMALL, strategy="exhaustive", workers=2))
    plans = {r.evaluation.candidate for r in res.records}
    assert plans == set(exhaustive.enumeration.valid)
    workers = {t.user_attrs["worker"] for t in res.study.get_trials(deepcopy=False)}
    assert len(workers) == 2
    assert len(plans) <= res.simulations <= len(res.records)   # both workers' simulations counted
    assert best_tokens(res) == best_tokens(exhaustive)


def test_baseline_joins_the_ranking_so_the_best_is_never_slower(tmp_path):
    res = run_search(request(tmp_path, *SMALL, strategy="tpe", trials=5))
    rep = build_report("tiny", res, make_objective("throughput"))
    assert res.baseline_in_space and res.baseline.fits
    assert rep.best.tokens_per_s >= res.baseline.tokens_per_s
    assert dataclasses.replace(res.baseline).candidate.plan == load_scenario(TINY).plan


def test_cluster_size_as_a_knob_gives_a_gpu_count_front(tmp_path):
    res = run_search(request(tmp_path, *SMALL, "search.num_nodes=[1, 2]", "search.tp=[1, 2]", strategy="exhaustive",
                             objective="throughput-vs-gpus"))
    worlds = {r.evaluation.world_size for r in res.records}
    assert worlds == {8, 16}
    for r in res.records:  # dp follows the cluster size
        p = r.evaluation.candidate.plan
        assert p.tp * p.pp * p.cp * p.dp == r.evaluation.world_size or r.evaluation.status == "invalid"
    rep = build_report("tiny", res, make_objective("throughput-vs-gpus"))
    front = [(r.evaluation.world_size, r.evaluation.tokens_per_s) for r in rep.plans]
    assert front[0][0] == 16 and front[-1][0] == 8 and front[0][1] > front[-1][1]
    # the gain over the scenario's 8-GPU plan is also given per GPU, not only in total
    best, base = rep.best, res.baseline
    assert best.world_size == 16 and base.world_size == 8
    per_gpu = 100 * (best.tokens_per_s * 8 / (base.tokens_per_s * 16) - 1)
    assert f"on 16 GPUs vs 8, {per_gpu:+.1f}% per GPU" in format_report(rep)


def test_optuna_proposes_one_schedule_for_one_pipeline_stage(tmp_path):
    """TPE samples gpipe and 1f1b at pp = 1; both land on the exhaustive search's one plan there."""
    res = run_search(request(tmp_path, *SMALL, strategy="tpe", trials=60))
    one_stage = [r.evaluation for r in res.records if r.evaluation.candidate.plan.pp == 1]
    assert {e.candidate.plan.schedule for e in one_stage if e.simulated} == {"1f1b"}
    trials = res.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    assert "gpipe" in {t.params.get("pipeline") for t in trials if t.params.get("pp") == 1}  # it did sample it


def test_the_table_shows_the_stage_split_when_a_plan_has_one(tmp_path):
    """Plans that differ only in their first / last stage layers do not look alike in the table."""
    fixed = ["search.tp=[1]", "search.cp=[1]", "search.micro_batch_size=[1]", "search.zero_stage=[1]",
             "search.recompute=[none]", "search.sequence_parallel=[false]", "search.schedule=[1f1b]"]
    uneven = run_search(request(tmp_path / "u", "model.num_layers=6", "search.pp=[2, 4]", *fixed,
                                strategy="exhaustive"))
    text = format_report(build_report("tiny", uneven, make_objective("throughput")))
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.rstrip().endswith("limited by"))
    assert "schedule  stages  sp" in lines[head]
    rows = {int(line.split()[2]): line.split()[8] for line in lines[head + 1:head + 3]}
    assert rows == {4: "1/1", 2: "-"}                         # 6 layers on 4 stages: 1 + 2 + 2 + 1
    even = run_search(request(tmp_path / "e", "search.pp=[2, 4]", *fixed, strategy="exhaustive"))
    assert "stages" not in format_report(build_report("tiny", even, make_objective("throughput")))


def test_rejections_are_counts_with_one_example(tmp_path):
    """A rejection line is a count of plans (or trials) and one of them as an example, and says so."""
    res = run_search(request(tmp_path, *SMALL, "search.schedule=[1f1b, gpipe, interleaved-1f1b]", strategy="tpe",
                             trials=60))
    rep = build_report("tiny", res, make_objective("throughput"))
    text = format_report(rep)
    assert res.enumeration.rejections and rep.trial_rejections
    for r in res.enumeration.rejections[:6]:
        assert f"{r.count:>6,} plan{'s' if r.count > 1 else ''}, e.g. {r.example}" in text
    for _, count, example in rep.trial_rejections[:6]:
        assert f"{count:>6,} trial{'s' if count > 1 else ''}, e.g. {example}" in text


def test_a_study_its_creator_never_set_up_is_taken_over_not_refused(tmp_path, monkeypatch):
    """A run stopped between creating its study and writing the study's fingerprint leaves an empty
    study behind; the next run sets it up instead of calling it another search's."""
    import types

    from planner import search

    storage = open_storage(str(tmp_path / "study.journal"))
    optuna.create_study(study_name="s", storage=storage)
    monkeypatch.setattr(search, "_wait_for_attr", lambda study, key, timeout_s=10.0: None)  # the creator is gone
    req = types.SimpleNamespace(resume=False, study_name="s", storage=str(tmp_path / "study.journal"),
                                objective=types.SimpleNamespace(directions=("minimize",)))
    study, created = search._open_study(req, storage, "fingerprint")
    assert created and study.study_name == "s"
    study.add_trial(optuna.trial.create_trial(params={}, distributions={}, value=1.0))
    with pytest.raises(ParaplanError, match="has trials but was not set up by paraplan plan"):
        search._open_study(req, storage, "fingerprint")


def test_a_study_whose_creator_stopped_before_the_baseline_is_joined(tmp_path, monkeypatch):
    """The creator writes the study's fingerprint first, then simulates the baseline; a run that
    joins a study its creator left without a baseline simulates the baseline itself."""
    from planner import search
    from planner.objective import Evaluator

    real = Evaluator.evaluate_baseline
    monkeypatch.setattr(Evaluator, "evaluate_baseline", lambda self, cand: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        run_search(request(tmp_path, *SMALL, strategy="tpe", trials=5))
    study = optuna.load_study(study_name="s", storage=open_storage(str(tmp_path / "study.journal")))
    assert "paraplan_fingerprint" in study.user_attrs and "paraplan_baseline" not in study.user_attrs
    monkeypatch.setattr(Evaluator, "evaluate_baseline", real)
    monkeypatch.setattr(search, "_wait_for_attr", lambda study, key, timeout_s=10.0:
                        study._storage.get_study_user_attrs(study._study_id).get(key))  # no creator to wait for
    res = run_search(request(tmp_path, *SMALL, strategy="tpe", trials=5))
    assert res.records and "paraplan_baseline" in optuna.load_study(
        study_name="s", storage=open_storage(str(tmp_path / "study.journal"))).user_attrs


def test_the_table_shows_the_moe_settings_when_the_search_varies_them(tmp_path):
    """Plans that differ in expert_tp or the dispatcher carry them in the table (a moe column) and
    in their labels; a search that leaves them at Megatron-Core's defaults shows no such column."""
    fixed = ["search.tp=[1]", "search.pp=[4]", "search.cp=[1]", "search.ep=[8]", "search.micro_batch_size=[1]",
             "search.schedule=[1f1b]", "search.zero_stage=[1]", "search.recompute=[none]"]
    mixtral = ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml"

    def search(name, *knobs):
        sc = load_scenario(mixtral, [*fixed, *knobs])
        req = SearchRequest(scenario=sc, spec=parse_search(sc), objective=make_objective("throughput"),
                            storage=str(tmp_path / f"{name}.journal"), study_name=name, strategy="exhaustive")
        return format_report(build_report("mixtral", run_search(req), make_objective("throughput")))

    text = search("moe", "search.expert_tp=[1, 2]", "search.moe_dispatcher=[alltoall, deepep]")
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.rstrip().endswith("limited by"))
    assert " ep  moe          mbs" in lines[head]
    shown = {" ".join(line.split()[6:8]) if "etp" in line.split()[7] else line.split()[6]
             for line in lines[head + 1:head + 5]}
    assert shown == {"a2a", "deepep", "a2a etp2", "deepep etp2"}
    assert "(moe: the token dispatcher" in text
    plain = search("plain").splitlines()
    assert "moe" not in next(line for line in plain if line.rstrip().endswith("limited by"))
    assert not any("(moe:" in line for line in plain)
    assert not any("upper bound" in line for line in plain)
    # combined 1F1B (interleaved 1F1B here): labelled, and its gains flagged as an upper bound
    ovl = search("ovl", "search.schedule=[interleaved-1f1b]", "search.virtual_pipeline_stages=[2]",
                 "search.overlap_moe_expert_parallel_comm=[false, true]")
    assert "a2a 1f1b-ovl" in ovl and "(1f1b-ovl gains are an upper bound" in ovl


def test_the_table_shows_the_cp_exchange_when_a_plan_runs_one_other_than_the_ring(tmp_path):
    """A search over plan.cp_comm_type shows each plan's exchange in a cp_comm column; plans that
    all pass K/V round the ring show no such column."""
    fixed = ["search.tp=[4]", "search.pp=[1]", "search.micro_batch_size=[1]", "search.schedule=[1f1b]",
             "search.zero_stage=[1]", "search.recompute=[none]", "search.sequence_parallel=[true]",
             "training.seq_length=65536", "training.global_batch_size=32"]

    def search(name, *knobs):
        sc = load_scenario(ROOT / "scenarios" / "llama3-8b-64xh100.yaml", [*fixed, *knobs])
        req = SearchRequest(scenario=sc, spec=parse_search(sc), objective=make_objective("throughput"),
                            storage=str(tmp_path / f"{name}.journal"), study_name=name, strategy="exhaustive")
        return format_report(build_report("llama3-8b", run_search(req), make_objective("throughput")))

    lines = search("cp", "search.cp=[2, 4]", "search.cp_comm_type=[p2p, all_gather, a2a]",
                   "training.global_batch_size=16").splitlines()
    head = next(i for i, line in enumerate(lines) if line.rstrip().endswith("limited by"))
    assert " cp  cp_comm      ep" in lines[head]
    rows = [line.split() for line in lines[head + 1:] if line.strip()][:5]
    # a2a at tp 4 x cp 4 cannot split 8 KV heads: five plans
    assert sorted((r[4], r[5]) for r in rows) == [("2", "a2a"), ("2", "all_gather"), ("2", "p2p"),
                                                  ("4", "all_gather"), ("4", "p2p")]
    ring = search("ring", "search.cp=[1, 2]").splitlines()
    assert "cp_comm" not in next(line for line in ring if line.rstrip().endswith("limited by"))


def test_an_interrupt_after_a_trial_is_told_leaves_it_as_told(tmp_path, monkeypatch):
    """Ctrl-C can land after study.tell recorded a trial (while Optuna reads it back): the search
    then stops with the KeyboardInterrupt, the trial keeps its result, and no second tell (FAIL)
    of a finished trial turns it into a ValueError."""
    import optuna
    from optuna.trial import TrialState

    from paraplan.loader import load_scenario
    from planner.objective import make_objective
    from planner.search import SearchRequest, run_search
    from planner.space import parse_search

    real, told = optuna.Study.tell, []

    def tell(self, trial, values=None, state=None, skip_if_finished=False):
        out = real(self, trial, values, state, skip_if_finished)
        if values is not None:
            told.append(trial.number)
            if len(told) == 3:
                raise KeyboardInterrupt
        return out

    monkeypatch.setattr(optuna.Study, "tell", tell)
    sc = load_scenario(ROOT / "scenarios" / "llama3-8b-64xh100.yaml")
    storage = str(tmp_path / "j.journal")
    req = SearchRequest(scenario=sc, spec=parse_search(sc), objective=make_objective("throughput"),
                        storage=storage, study_name="s", strategy="tpe", trials=10)
    with pytest.raises(KeyboardInterrupt):
        run_search(req)
    study = optuna.load_study(study_name="s", storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(storage)))
    assert study.trials[told[-1]].state == TrialState.COMPLETE
