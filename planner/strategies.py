"""Search strategies behind one small interface: which Optuna sampler proposes the next plan,
how many trials the search runs, which plans go first, and when the strategy has nothing left.

- `Exhaustive`: every valid plan once, in enumeration order (a seeded shuffle across parallel
  workers, as Optuna's GridSampler does, so two workers rarely take the same plan).
- `TPE`: Optuna's seeded multivariate TPE (Bergstra et al. 2011; Falkner et al. 2018 for the
  multivariate kernel), constraint-aware (Optuna's c-TPE: infeasible trials, ranked by how much
  they violate, go to the "bad" group), with expert plans enqueued as its first trials.

Both are Optuna studies, so both get the same storage, resume and multi-machine behaviour.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from planner.space import Candidate, PlanSpace

PLAN_INDEX_ATTR = "paraplan:plan_index"
# TPE: random trials before the model kicks in (Optuna's default is 10; the expert plans and the
# baseline are on top of these).
TPE_STARTUP_TRIALS = 20


class PlanListSampler(BaseSampler):
    """Proposes each plan of a fixed list once: the next unvisited one (lowest index first for a
    single worker; a seeded random unvisited one for `worker` > 0, to avoid collisions)."""

    def __init__(self, plans: Sequence[dict[str, Any]], *, seed: int = 0, worker: int = 0):
        self._plans = list(plans)
        self._rng = np.random.RandomState(seed + worker)
        self._worker = worker
        self._final: set[int] = set()
        """Plan indices of finished trials (a finished trial never changes)."""
        self._first_open = 0
        """Every trial before this position in the study's list is finished and counted."""

    def reseed_rng(self) -> None:
        self._rng.seed()

    def unvisited(self, study: optuna.Study) -> list[int]:
        """Indices no trial has finished or is running (failed trials are run again), in order.
        Incremental: finished trials are read once."""
        trials = study._storage.get_all_trials(study._study_id, deepcopy=False)
        running = set()
        for pos in range(self._first_open, len(trials)):
            t = trials[pos]
            idx = t.system_attrs.get(PLAN_INDEX_ATTR)
            finished = t.state.is_finished()
            if finished and pos == self._first_open:
                self._first_open += 1
            if idx is None:
                continue
            if finished:
                if t.state != TrialState.FAIL:
                    self._final.add(idx)
            else:
                running.add(idx)
        return [i for i in range(len(self._plans)) if i not in self._final and i not in running]

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if PLAN_INDEX_ATTR in trial.system_attrs or "fixed_params" in trial.system_attrs:
            return
        free = self.unvisited(study) or list(range(len(self._plans)))
        idx = free[0] if self._worker == 0 else int(self._rng.choice(free))
        study._storage.set_trial_system_attr(trial._trial_id, PLAN_INDEX_ATTR, idx)

    def infer_relative_search_space(self, study, trial) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study, trial, search_space) -> dict[str, Any]:
        return {}

    def sample_independent(self, study, trial, param_name, param_distribution) -> Any:
        idx = study._storage.get_trial_system_attrs(trial._trial_id)[PLAN_INDEX_ATTR]
        return self._plans[idx][param_name]


@dataclass(frozen=True, kw_only=True)
class Exhaustive:
    """Every valid plan, each once."""

    plans: tuple[Candidate, ...]
    name: str = "exhaustive"

    def budget(self, requested: int) -> int:
        return len(self.plans)

    def sampler(self, space: PlanSpace, *, seed: int, worker: int) -> BaseSampler:
        return PlanListSampler([space.params_of(c) for c in self.plans], seed=seed, worker=worker)

    def first_trials(self, space: PlanSpace, budget: int) -> list[dict[str, Any]]:
        return []

    def exhausted(self, sampler: BaseSampler, study: optuna.Study) -> bool:
        return not sampler.unvisited(study)


@dataclass(frozen=True, kw_only=True)
class TPE:
    """Seeded multivariate TPE with expert plans first."""

    name: str = "tpe"
    startup_trials: int = TPE_STARTUP_TRIALS

    def budget(self, requested: int) -> int:
        return requested

    def sampler(self, space: PlanSpace, *, seed: int, worker: int) -> BaseSampler:
        import warnings

        with warnings.catch_warnings():
            # multivariate=True is explicit for multi-objective studies, where Optuna 5 warns
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(
                seed=seed + worker, multivariate=True, n_startup_trials=self.startup_trials,
                constant_liar=True,
            )

    def first_trials(self, space: PlanSpace, budget: int) -> list[dict[str, Any]]:
        return [space.params_of(c) for c in expert_plans(space, limit=max(1, budget // 10))]

    def exhausted(self, sampler: BaseSampler, study: optuna.Study) -> bool:
        return False


def expert_plans(space: PlanSpace, *, limit: int) -> list[Candidate]:
    """Plans an engineer would try first, valid ones only, at most `limit`:
    the scenario's own plan; then "TP within a node, PP across nodes" (Narayanan et al. SC'21,
    Sec. 3.3 takeaways 1-2): the largest tensor-parallel degree that fits in a node, sequence
    parallelism, the distributed optimizer (ZeRO-1), selective recompute, micro-batch 1 and no
    context parallelism, over every pipeline depth, each interleaved (fewest virtual stages) and
    plain 1F1B."""
    out: list[Candidate] = []

    def add(c: Candidate) -> None:
        if len(out) < limit and c not in out and space.in_space(c) and not space.problems(c):
            out.append(c)

    base = space.baseline()
    add(space.candidate(space.params_of(base)))
    vals = dict(space.spec.candidates)

    def pick(knob: str, preferred: Sequence[Any]) -> Any:
        return next((p for p in preferred if p in vals[knob]), vals[knob][0])

    gpn = space.scenario.cluster.gpus_per_node
    tps = [t for t in sorted(vals["tp"], reverse=True) if t <= gpn] or sorted(vals["tp"])
    common = {
        "num_nodes": base.num_nodes if base.num_nodes in vals["num_nodes"] else vals["num_nodes"][-1],
        "cp": vals["cp"][0], "ep": vals["ep"][0], "micro_batch_size": vals["micro_batch_size"][0],
        "sequence_parallel": pick("sequence_parallel", [True]),
        "zero_stage": pick("zero_stage", [1, 0, 2, 3]),
        "recompute": pick("recompute", ["selective", "none", "full"]),
    }
    vpps = [v for v in vals["virtual_pipeline_stages"] if v >= 2]
    for tp in tps:
        ok = [c for c in (space.candidate({**common, "tp": tp, "pp": pp, "schedule": "1f1b"}) for pp in vals["pp"])
              if not space.problems(c)]
        if not ok and tp != tps[-1]:
            continue  # tp does not divide the heads: try the next smaller one
        for pp in vals["pp"]:
            for v in vpps:
                before = len(out)
                add(space.candidate({**common, "tp": tp, "pp": pp, "schedule": "interleaved-1f1b",
                                     "virtual_pipeline_stages": v}))
                if len(out) > before:
                    break
            add(space.candidate({**common, "tp": tp, "pp": pp, "schedule": "1f1b"}))
        break
    return out


def make_strategy(name: str, *, plans: tuple[Candidate, ...] | None) -> Exhaustive | TPE:
    if name == "exhaustive":
        if plans is None:
            raise ValueError("exhaustive search needs the enumerated plans")
        return Exhaustive(plans=plans)
    if name == "tpe":
        return TPE()
    raise ValueError(f"unknown strategy {name!r}")
