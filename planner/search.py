"""Run a plan search: an Optuna study in a storage, worked by one or more processes.

Every search is an Optuna study, whatever the strategy, so it is persistent and shareable:

- storage: a journal file by default (`DIR/study.journal`, written line by line: a trial once
  told is on disk), or any Optuna storage URL (`sqlite:///x.db`, `postgresql://...`,
  `mysql://...`, `redis://...` for a journal in Redis) when several machines share one search.
- workers: `workers` processes on this machine (simulate() holds the GIL, so threads would not
  help), each asking the study for a plan, simulating it and telling the result. Processes on
  other machines that run the same command against the same storage URL and study join in.
- resume: the budget is the study's total, so a rerun with `resume` runs only what is missing.
  Finished trials are never recomputed: they are in the storage, and each worker seeds its memo
  with their evaluations. A trial that was running when its process died (kill -9) is marked
  failed on resume (only trials of dead processes on this host: live ones elsewhere are left
  alone) and, for the exhaustive strategy, its plan is run again.
- each trial records its evaluation as the user attribute `eval`, and the memory overflow as
  the Optuna constraint `memory` ((peak - capacity) / capacity; > 0 = does not fit). Plans the
  structural rules reject are told as pruned, with the constraint `structure` = 10.
"""
from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import multiprocessing
import os
import socket
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState

from paraplan.errors import ConfigError, ParaplanError, first_line
from paraplan.specs import RunSpec, Scenario
from planner.objective import Evaluation, Evaluator, Objective
from planner.space import (
    ENUMERATION_LIMIT, OPT_IN_KNOBS, PIPELINE, Candidate, Enumeration, PlanSpace, SearchSpec, binding_constraint,
    pipeline_values,
)
from planner.strategies import make_strategy

EVAL_ATTR = "eval"
WORKER_ATTR = "worker"
STRUCTURE_VIOLATION = 10.0
UNTAGGED_GRACE_S = 3.0
STRATEGIES = ("auto", "exhaustive", "tpe")


@dataclass(frozen=True, kw_only=True)
class SearchRequest:
    scenario: Scenario
    spec: SearchSpec
    objective: Objective
    storage: str
    """A journal file path or an Optuna storage URL."""
    study_name: str
    strategy: str = "auto"
    """auto: exhaustive when the valid space is at most spec.exhaustive_threshold, else tpe."""
    trials: int | None = None
    """The study's trial budget (tpe); None: spec.trials. Exhaustive runs every valid plan."""
    workers: int = 1
    seed: int = 0
    resume: bool = False
    """The study must exist (and was made for the same scenario, search and objective)."""


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    number: int
    evaluation: Evaluation


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    strategy: str
    study_name: str
    storage: str
    """The storage as shown to users (a URL's password masked)."""
    enumeration: Enumeration | None
    """The checked space (None when too large to enumerate)."""
    combinations: int
    records: tuple[TrialRecord, ...]
    """Every finished trial of the study (complete and pruned), by trial number."""
    baseline: Evaluation
    baseline_in_space: bool
    baseline_twin: Any = None
    """The scenario's plan as the space writes it (a Candidate; knobs that cannot act on it, such as
    sequence parallelism at tp 1, at the space's canonical values): the plan the search evaluates
    for it, which the report ranks as the scenario's own. None when the plan is not in the space."""
    budget: int
    wall_time_s: float
    simulations: int
    """simulate() calls made in this run, by every worker process on this machine."""
    trials_before: int
    """Trials the study had already finished before this run."""
    trials_failed: int
    """Trials of dead processes marked failed on this resume."""
    study: Any = dataclasses.field(default=None, compare=False, repr=False)
    """The optuna.Study (for importances and plots)."""
    memory_headroom: float = 0.0
    """search.memory_headroom: the share of GPU memory a plan had to leave free to fit."""


@dataclass(frozen=True, kw_only=True)
class _Job:
    """What a worker process needs (picklable)."""

    scenario: Scenario
    spec: SearchSpec
    objective: Objective
    storage: str
    study_name: str
    strategy: str
    plans: tuple[Candidate, ...] | None
    choices: tuple[tuple[str, tuple], ...]
    fixed: tuple[tuple[str, Any], ...]
    budget: int
    seed: int
    worker: int
    parent_pid: int = 0
    """The main process of an extra worker: the worker stops when it is gone (kill -9)."""


# ----------------------------------------------------------------------------------------------
# Storage.


def mask_url(url: str) -> str:
    """`postgresql://user:secret@host/db` -> `postgresql://user:***@host/db`."""
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    cred, at, host = rest.rpartition("@")
    if at and ":" in cred:
        user = cred.split(":", 1)[0]
        return f"{scheme}://{user}:***@{host}"
    return url


def open_storage(spec: str) -> optuna.storages.BaseStorage:
    """An Optuna storage from a URL, or a journal file from a path; one-line error if it cannot be opened."""
    from optuna.storages import JournalStorage, RDBStorage

    from planner.journal import JournalFile

    shown = mask_url(spec)
    try:
        if spec.startswith("redis://") or spec.startswith("rediss://"):
            from optuna.storages.journal import JournalRedisBackend

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return JournalStorage(JournalRedisBackend(spec))
        if "://" in spec:
            return RDBStorage(spec)
        path = os.path.abspath(spec)
        if not os.path.isdir(os.path.dirname(path)):
            raise ParaplanError(f"--storage: the folder of the journal file {spec} does not exist")
        _check_journal_file(path, spec)
        return JournalStorage(JournalFile(path))
    except ParaplanError:
        raise
    except Exception as e:  # noqa: BLE001  sqlalchemy, drivers, redis: all one line for the user
        msg = first_line(e) or type(e).__name__
        raise ParaplanError(f"--storage {shown}: cannot open it: {msg.replace(spec, shown)}") from None


def _check_journal_file(path: str, spec: str) -> None:
    """An existing journal must be a regular file whose first line is one of Optuna's journal
    operations (a JSON object with an op_code); anything else is refused before it is locked."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise ParaplanError(f"--storage {spec}: not a regular file")
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb") as f:
        first = f.readline(1 << 20)
    try:
        ok = isinstance(op := json.loads(first), dict) and "op_code" in op
    except ValueError:
        ok = False
    if not ok:
        raise ParaplanError(f"--storage {spec}: not an Optuna journal file (its first line is not a journal "
                            f"operation); give a new file name or an existing study's journal")


# ----------------------------------------------------------------------------------------------
# The search.


def fingerprint(sc: Scenario, spec: SearchSpec, objective: Objective, strategy: str, choices) -> str:
    """What a study was made for: trials of another scenario, search or objective must not mix."""
    plain = dataclasses.replace(sc, name="", search=(), run=RunSpec())
    # the opt-in knobs a search leaves out take the plan's values (in `plain`), so they need no place
    # of their own in the key; a plan field added since changes `plain` itself, and a study made by an
    # earlier version is then refused (with a message that says a version may be why)
    cands = tuple((k, v) for k, v in spec.candidates if k in spec.given or k not in OPT_IN_KNOBS)
    key = repr((plain, dataclasses.replace(spec, trials=0, candidates=cands), objective, strategy, choices))
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _knob_choices(space: PlanSpace, enum: Enumeration | None) -> tuple[dict[str, tuple], dict[str, Any]]:
    """(the sampled knobs and their choices, the knobs with one possible value), the schedule and
    its virtual stages drawn together (planner.space.PIPELINE).

    Choices are the values that occur in some valid plan when the space was enumerated (a sampler
    never wastes a trial on a value no valid plan has), else every candidate."""
    if enum is not None:
        seen: dict[str, set] = {}
        for c in enum.valid:
            for k, v in space.sampler_params(c).items():
                seen.setdefault(k, set()).add(v)
        values = {k: tuple(sorted(v, key=lambda x: (str(type(x)), x))) for k, v in seen.items()}
    else:
        values = dict(space.spec.candidates)
        values[PIPELINE] = pipeline_values(values.pop("schedule"), values.pop("virtual_pipeline_stages"))
    sampled = {k: v for k, v in values.items() if len(v) > 1}
    fixed = {k: v[0] for k, v in values.items() if len(v) == 1}
    return sampled, fixed


def run_search(req: SearchRequest, *, progress: Callable[[int, int, Evaluation | None], None] | None = None
               ) -> SearchResult:
    """Search the plan space of `req.scenario`; raises ConfigError when no plan is valid and
    ParaplanError for storage and study problems. Returns every finished trial."""
    t0 = time.perf_counter()
    space = PlanSpace(req.scenario, req.spec)
    combos = space.count_combinations()
    enum = space.enumerate() if combos <= ENUMERATION_LIMIT else None
    if enum is not None and not enum.valid:
        raise ConfigError("search", f"no valid plan: {binding_constraint(enum)}")
    if enum is not None:
        combos = enum.combinations  # every candidate plan, layouts the planner's rules reject included
    strategy_name = _choose_strategy(req, enum, combos)
    strategy = make_strategy(strategy_name, plans=enum.valid if enum is not None else None)
    budget = strategy.budget(req.trials if req.trials is not None else req.spec.trials)
    choices, fixed = _knob_choices(space, enum)
    choice_key = tuple(sorted(choices.items()))
    fp = fingerprint(req.scenario, req.spec, req.objective, strategy_name, choice_key)

    if req.resume:
        _check_resumable(req.storage)
    storage = open_storage(req.storage)
    try:
        study, created = _open_study(req, storage, fp)
    except ParaplanError:
        raise
    except Exception as e:  # noqa: BLE001  a file that is not a journal, a database of another schema
        msg = first_line(e)
        raise ParaplanError(f"--storage {mask_url(req.storage)}: not a usable Optuna storage "
                            f"({type(e).__name__}{': ' + msg if msg else ''})") from None
    failed = 0 if created else _fail_dead_trials(study)
    evaluator = Evaluator(space)
    baseline_cand = space.baseline()
    if created:
        # the fingerprint first, right after the study is made: a joiner tells this search from
        # another at once, and one that finds none within _wait_for_attr's wait knows its creator died
        study.set_user_attr("paraplan_strategy", strategy_name)
        study.set_user_attr("paraplan_fingerprint", fp)
        baseline = evaluator.evaluate_baseline(baseline_cand)
        study.set_user_attr("paraplan_baseline", baseline.to_json())
        for params in strategy.first_trials(space, budget):
            study.enqueue_trial({k: v for k, v in params.items() if k in choices}, skip_if_exists=True)
    else:
        shared = _wait_for_attr(study, "paraplan_baseline")
        if shared is None:  # its creator stopped before the baseline: the same search, so the same plan
            baseline = evaluator.evaluate_baseline(baseline_cand)
            study.set_user_attr("paraplan_baseline", baseline.to_json())
        else:
            baseline = Evaluation.from_json(shared)
    before = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))

    job = _Job(scenario=req.scenario, spec=req.spec, objective=req.objective, storage=req.storage,
               study_name=req.study_name, strategy=strategy_name,
               plans=enum.valid if strategy_name == "exhaustive" else None,
               choices=choice_key, fixed=tuple(sorted(fixed.items())), budget=budget, seed=req.seed, worker=0,
               parent_pid=os.getpid())
    procs = []
    ctx = multiprocessing.get_context("spawn")
    child_sims = ctx.Value("i", 0)
    try:
        for w in range(1, req.workers):
            p = ctx.Process(target=_worker_main, args=(dataclasses.replace(job, worker=w), child_sims), daemon=True)
            p.start()
            procs.append(p)
        sims = _work(job, evaluator=evaluator, study_storage=storage, progress=progress)
        for p in procs:
            p.join()
        sims += child_sims.value
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if bad:
        print(f"warning: {len(bad)} worker process(es) exited with an error (codes {bad}); "
              f"their unfinished trials are marked failed on --resume", file=sys.stderr)

    study = optuna.load_study(study_name=req.study_name, storage=storage)
    records = tuple(
        TrialRecord(number=t.number, evaluation=Evaluation.from_json(t.user_attrs[EVAL_ATTR]))
        for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        if EVAL_ATTR in t.user_attrs
    )
    return SearchResult(
        strategy=strategy_name, study_name=req.study_name, storage=mask_url(req.storage),
        enumeration=enum, combinations=combos, records=records, baseline=baseline,
        baseline_in_space=space.valid(baseline_cand) and baseline.simulated,
        baseline_twin=space.candidate(space.params_of(baseline_cand)) if space.in_space(baseline_cand) else None,
        budget=budget, wall_time_s=time.perf_counter() - t0, simulations=sims,
        trials_before=before, trials_failed=failed, study=study, memory_headroom=space.spec.memory_headroom,
    )


def _choose_strategy(req: SearchRequest, enum: Enumeration | None, combos: int) -> str:
    if req.strategy not in STRATEGIES:
        raise ConfigError("--strategy", f"{req.strategy!r} is not one of {', '.join(STRATEGIES)}")
    if req.strategy == "exhaustive" and enum is None:
        raise ConfigError("--strategy", f"exhaustive search needs the space enumerated, and it has "
                                        f"{combos:,} candidate plans (limit {ENUMERATION_LIMIT:,}); "
                                        f"narrow the search section or use tpe")
    if req.strategy != "auto":
        return req.strategy
    if enum is not None and len(enum.valid) <= req.spec.exhaustive_threshold:
        return "exhaustive"
    return "tpe"


def _check_resumable(spec: str) -> None:
    """--resume of a journal file or an SQLite database that is not there: refused before opening
    it, which would create an empty one and leave it behind."""
    path = spec[len("sqlite:///"):] if spec.startswith("sqlite:///") else None if "://" in spec else spec
    if path is not None and not os.path.exists(path):
        raise ParaplanError(f"--resume: {mask_url(spec)} does not exist, so there is no search to resume; "
                            f"drop --resume to start one")


def _open_study(req: SearchRequest, storage, fp: str) -> tuple[optuna.Study, bool]:
    """(study, created): --resume loads an existing one; otherwise create it, or join it when it
    exists for the same search (how several machines share one)."""
    directions = list(req.objective.directions)
    created = False
    if req.resume:
        try:
            study = optuna.load_study(study_name=req.study_name, storage=storage)
        except KeyError:
            names = sorted(s.study_name for s in storage.get_all_studies())
            there = f"; studies there: {', '.join(names)}" if names else "; the storage has no study"
            raise ParaplanError(f"--resume: no study named {req.study_name!r} in {mask_url(req.storage)}"
                                f"{there}") from None
    else:
        try:
            study = optuna.create_study(study_name=req.study_name, storage=storage, directions=directions)
            created = True
        except optuna.exceptions.DuplicatedStudyError:
            study = optuna.load_study(study_name=req.study_name, storage=storage)
    if not created:
        theirs = _wait_for_attr(study, "paraplan_fingerprint")
        if theirs is None and not study.get_trials(deepcopy=False):
            # its creator stopped between making it and writing the fingerprint, its next step:
            # nothing in it to keep, so this run sets it up as its creator would have
            return study, True
        if theirs is None:
            raise ParaplanError(f"study {req.study_name!r} in {mask_url(req.storage)} has trials but was not set up "
                                f"by paraplan plan; choose another --study name")
        if theirs != fp:
            raise ParaplanError(
                f"study {req.study_name!r} in {mask_url(req.storage)} was made for a different scenario, "
                f"search section, objective or strategy (or by a paraplan version that searched other knobs); "
                f"choose another --study name or --out folder, or delete that journal to start over")
    return study, created


def _wait_for_attr(study: optuna.Study, key: str, timeout_s: float = 10.0):
    """A study attribute its creator (maybe on another machine) is about to write."""
    deadline = time.monotonic() + timeout_s
    while True:
        attrs = study._storage.get_study_user_attrs(study._study_id)
        if key in attrs or time.monotonic() > deadline:
            return attrs.get(key)
        time.sleep(0.1)


def _worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fail_dead_trials(study: optuna.Study) -> int:
    """Mark failed the running trials whose process is gone (kill -9, a crash): those tagged with
    a process of this host that no longer exists, and those never tagged at all (the process died
    between creating the trial and tagging it, a few microseconds; a live one tags it at once, so
    such a trial is failed once it is UNTAGGED_GRACE_S old)."""
    host = socket.gethostname()
    n = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        who = t.user_attrs.get(WORKER_ATTR)
        if who is None:
            age = (datetime.datetime.now() - t.datetime_start).total_seconds() if t.datetime_start else 1e9
            if age < UNTAGGED_GRACE_S:
                time.sleep(UNTAGGED_GRACE_S - age)
            t = study._storage.get_trial(t._trial_id)
            dead = t.state == TrialState.RUNNING and WORKER_ATTR not in t.user_attrs
        else:
            h, _, pid = who.rpartition(":")
            dead = h == host and pid.isdigit() and not _pid_alive(int(pid))
        if dead:
            try:
                study._storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL)
                n += 1
            except optuna.exceptions.UpdateFinishedTrialError:
                pass
    return n


def _worker_main(job: _Job, simulations) -> None:
    """Entry point of an extra worker process (a fresh interpreter: its logging is its own);
    adds its simulate() calls to the shared counter `simulations`."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        n = _work(job, evaluator=None, study_storage=None, progress=None)
    except KeyboardInterrupt:
        sys.exit(130)
    with simulations.get_lock():
        simulations.value += n


def _work(job: _Job, *, evaluator: Evaluator | None, study_storage, progress) -> int:
    """Ask, evaluate, tell until the budget is spent or the strategy has nothing left.
    Returns the number of simulate() calls this worker made."""
    storage = study_storage if study_storage is not None else open_storage(job.storage)
    space = PlanSpace(job.scenario, job.spec)
    strategy = make_strategy(job.strategy, plans=job.plans)
    sampler = strategy.sampler(space, seed=job.seed, worker=job.worker, choices=dict(job.choices),
                               fixed=dict(job.fixed), budget=job.budget)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.load_study(study_name=job.study_name, storage=storage, sampler=sampler)
    ev = evaluator or Evaluator(space)
    sims0 = ev.simulations
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        if EVAL_ATTR in t.user_attrs:
            ev.remember(Evaluation.from_json(t.user_attrs[EVAL_ATTR]))
    dists = {k: CategoricalDistribution(v) for k, v in job.choices}
    fixed = dict(job.fixed)
    me = _worker_id()
    last_report, best = 0.0, None
    objective = job.objective
    while True:
        if job.worker > 0 and os.getppid() != job.parent_pid:
            break  # the main process was killed: its orphans stop too (--resume picks the search up)
        if strategy.exhausted(sampler, study):
            break
        done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)))
        if done >= job.budget and not getattr(strategy, "runs_every_plan", False):
            break
        trial = study.ask(dists)
        try:
            trial.set_user_attr(WORKER_ATTR, me)
            e = ev.evaluate(space.candidate({**fixed, **trial.params}))
            trial.set_user_attr(EVAL_ATTR, e.to_json())
            if e.simulated:
                trial.set_constraint("memory", e.overflow)
                trial.set_constraint("structure", 0.0)
                study.tell(trial, list(objective.values(e)))
            else:
                trial.set_constraint("memory", 0.0)
                trial.set_constraint("structure", STRUCTURE_VIOLATION)
                study.tell(trial, state=TrialState.PRUNED)
        except BaseException:
            # an interrupt can land after the tell was recorded (while Optuna reads the trial back):
            # the trial is then finished already, and stays as it was told
            study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            raise
        if e.fits and (best is None or objective.better(e, best)):
            best = e
        if progress is not None and time.monotonic() - last_report > 0.25:
            last_report = time.monotonic()
            progress(done + 1, job.budget, _best_so_far(study, objective) or best)
    if progress is not None:
        total = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
        progress(total, job.budget, _best_so_far(study, objective) or best)
    return ev.simulations - sims0


def _best_so_far(study: optuna.Study, objective: Objective) -> Evaluation | None:
    best_t, best_v = None, -math.inf
    sign = 1.0 if objective.directions[0] == "maximize" else -1.0
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.constraints.get("memory", 0.0) > 0:
            continue
        v = sign * t.values[0]
        if v > best_v:
            best_t, best_v = t, v
    return Evaluation.from_json(best_t.user_attrs[EVAL_ATTR]) if best_t is not None else None
