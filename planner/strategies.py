"""Search strategies behind one small interface: which Optuna sampler proposes the next plan,
how many trials the search runs, which plans go first, and when the strategy has nothing left.

- `Exhaustive`: every valid plan once, in enumeration order (a seeded shuffle across parallel
  workers, as Optuna's GridSampler does, so two workers rarely take the same plan).
- `TPE`: Optuna's seeded multivariate TPE (Bergstra et al. 2011; Falkner et al. 2018 for the
  multivariate kernel), constraint-aware (Optuna's c-TPE, Watanabe and Hutter 2023: infeasible
  trials, ranked by how much they violate, go to the "bad" group), with expert plans enqueued as
  its first trials and, for the last 70 % of the budget, a local refinement around the best plans
  (`RefiningSampler`): on the bundled spaces TPE alone lands within 1 % of the optimum in about a
  third of the seeds, TPE + refinement in most (benchmarks/bench_planner.py).

Both are Optuna studies, so both get the same storage, resume and multi-machine behaviour.
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import optuna
from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from planner.space import OPT_IN_KNOBS, Candidate, PlanSpace

PLAN_INDEX_ATTR = "paraplan:plan_index"
# TPE: trials before its model kicks in (Optuna's default is 10; 20 explored better on the bundled
# spaces, see benchmarks/bench_planner.py); the expert plans count among them.
TPE_STARTUP_TRIALS = 20
# The last 70 % of a TPE budget refines the best plans found (RefiningSampler): on the bundled
# spaces TPE settles its region within ~90 trials, and the local moves do the rest.
REFINE_FRACTION = 0.7
# Refinement moves the settings of the best plans of this many layouts (1: the incumbent's) to
# every other layout; more spread the budget thinner and did worse on the bundled spaces.
TRANSPLANT_CENTRES = 1


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
    runs_every_plan = True
    """Stops when no plan is left unvisited, not on a trial count: workers sharing the study may
    both pick a plan (a repeat costs nothing, it is memoised), and a count would then end one
    plan short."""

    def budget(self, requested: int) -> int:
        return len(self.plans)

    def sampler(self, space: PlanSpace, *, seed: int, worker: int, choices: dict[str, tuple] | None = None,
                fixed: dict[str, Any] | None = None, budget: int | None = None) -> BaseSampler:
        return PlanListSampler([space.sampler_params(c) for c in self.plans], seed=seed, worker=worker)

    def first_trials(self, space: PlanSpace, budget: int) -> list[dict[str, Any]]:
        return []

    def exhausted(self, sampler: BaseSampler, study: optuna.Study) -> bool:
        return not sampler.unvisited(study)


class RefiningSampler(BaseSampler):
    """TPE, then a local search around the incumbent for the last part of the budget.

    TPE finds the good region quickly but, on these discrete spaces, often stops a knob or two
    short of the best plan (its Parzen estimators over categories never look at "this plan with
    one thing changed"), or settles in one layout's basin. From `refine_from` finished trials on,
    each trial is instead a not-yet-tried valid neighbour of a good plan, in this order:

    1. one knob changed around the incumbent (the schedule and its virtual stages count as one);
    2. the incumbent's settings moved to every other layout (tp, pp, cp, cluster size; dp
       follows), the way an engineer tries "the same, with tp 2 and pp 8"; then the same again
       at the smallest micro-batch, which is what a plan that no longer fits needs first;
    3. one knob changed around the best feasible plan of every other layout, best first;
    4. two knobs changed around the incumbent.

    A move that lands on a structurally invalid plan is repaired by changing one more non-layout
    knob (a new layout often needs another micro-batch size or number of virtual stages). Moves
    are in a seeded order within each group, and every improvement recentres the search: a
    first-improvement hill climb with a restart per layout. When no neighbour is left it falls
    back to TPE. Single-objective studies only (a Pareto front has no single incumbent).
    """

    def __init__(self, tpe: BaseSampler, space: PlanSpace, *, choices: dict[str, tuple], fixed: dict[str, Any],
                 refine_from: int, seed: int):
        self._tpe = tpe
        self._space = space
        self._choices = choices
        self._fixed = fixed
        self._refine_from = refine_from
        self._rng = np.random.RandomState(seed)
        self._proposal: dict[str, Any] | None = None

    def reseed_rng(self) -> None:
        self._tpe.reseed_rng()
        self._rng.seed()

    def before_trial(self, study, trial) -> None:
        self._tpe.before_trial(study, trial)

    def after_trial(self, study, trial, state, values) -> None:
        self._tpe.after_trial(study, trial, state, values)

    def infer_relative_search_space(self, study, trial) -> dict[str, BaseDistribution]:
        self._proposal = None
        if not study._is_multi_objective():
            finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
            if len(finished) >= self._refine_from:
                self._proposal = self._propose(study)
        if self._proposal is not None:
            return {k: optuna.distributions.CategoricalDistribution(v) for k, v in self._choices.items()}
        return self._tpe.infer_relative_search_space(study, trial)

    def sample_relative(self, study, trial, search_space) -> dict[str, Any]:
        if self._proposal is not None:
            return dict(self._proposal)
        return self._tpe.sample_relative(study, trial, search_space)

    def sample_independent(self, study, trial, param_name, param_distribution) -> Any:
        return self._tpe.sample_independent(study, trial, param_name, param_distribution)

    def _axes(self) -> dict[str, tuple[tuple[str, ...], list[tuple]]]:
        """The directions a move changes: one knob each (the schedule and its virtual stages are
        one knob, planner.space.PIPELINE, so an interleaved plan is one move from a plain one)."""
        return {k: ((k,), [(v,) for v in vals]) for k, vals in self._choices.items()}

    def _candidate(self, params: dict[str, Any]) -> Candidate:
        return self._space.candidate({**self._fixed, **params})

    def _propose(self, study) -> dict[str, Any] | None:
        trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                          TrialState.RUNNING, TrialState.WAITING))
        tried = {self._candidate(t.params) for t in trials if t.params}
        sign = 1.0 if study.direction == optuna.study.StudyDirection.MAXIMIZE else -1.0
        # centres: the best feasible plan of each layout (cluster size, tp, pp, cp), best first
        by_layout: dict[tuple, FrozenTrial] = {}
        for t in trials:
            if t.state != TrialState.COMPLETE or t.constraints.get("memory", 0.0) > 0:
                continue
            c = self._candidate(t.params)
            key = (c.num_nodes, c.plan.tp, c.plan.pp, c.plan.cp)
            if key not in by_layout or sign * t.values[0] > sign * by_layout[key].values[0]:
                by_layout[key] = t
        if not by_layout:
            return None
        centres = [self._params(t) for t in sorted(by_layout.values(), key=lambda t: -sign * t.values[0])]
        axes = self._axes()
        layout_axes = [a for a in ("num_nodes", "tp", "pp", "cp") if a in axes]
        inner_axes = [a for a in sorted(axes) if a not in layout_axes]
        incumbent = centres[0]
        one_knob = self._moves(axes, sorted(axes), 1)
        # 1. one knob changed around the incumbent
        phases = [(incumbent, one_knob)]
        # 2. the incumbent's settings on every other layout (a layout move keeps dp derived)
        layout_moves = self._moves(axes, layout_axes, len(layout_axes), same_size=False)
        phases += [(c, layout_moves) for c in centres[:TRANSPLANT_CENTRES]]
        # 2b. the same at the smallest micro-batch: on a deeper pipeline or a wider context-parallel
        #     group the incumbent's micro-batch often overflows memory
        if "micro_batch_size" in self._choices:
            smallest = min(self._choices["micro_batch_size"])
            phases += [({**c, "micro_batch_size": smallest}, layout_moves) for c in centres[:TRANSPLANT_CENTRES]
                       if c.get("micro_batch_size") != smallest]
        # 3. one knob changed around the best plan of every other layout
        phases += [(c, one_knob) for c in centres[1:]]
        # 4. two knobs changed around the incumbent
        phases.append((incumbent, self._moves(axes, sorted(axes), 2)))
        for centre, moves in phases:
            for move in moves:
                params = self._repair({**centre, **move}, axes, inner_axes, tried)
                if params is not None:
                    return params
        return None

    def _params(self, t: FrozenTrial) -> dict[str, Any]:
        return {k: t.params.get(k, self._choices[k][0]) for k in self._choices}

    def _moves(self, axes, names, radius: int, *, same_size: bool = True) -> list[dict[str, Any]]:
        """Every change of exactly `radius` of the axes `names` (of at most `radius` when not
        `same_size`), in a seeded order."""
        moves = []
        sizes = [radius] if same_size else range(1, radius + 1)
        for r in sizes:
            for combo in itertools.combinations(names, r):
                for values in itertools.product(*(axes[a][1] for a in combo)):
                    move = {}
                    for a, v in zip(combo, values):
                        move.update(zip(axes[a][0], v))
                    moves.append(move)
        return [moves[i] for i in self._rng.permutation(len(moves))]

    def _repair(self, params, axes, inner_axes, tried) -> dict[str, Any] | None:
        """`params` if it is a valid, untried plan; else, when it is structurally invalid, the
        first valid untried plan with one more inner knob changed (a new layout often needs
        another micro-batch size or number of virtual stages); None when there is none."""
        cand = self._candidate(params)
        if cand in tried:
            return None
        tried.add(cand)
        if not self._space.in_space(cand):
            return None
        if self._space.valid(cand):
            return params
        for a in inner_axes:
            for v in axes[a][1]:
                fixed = {**params, **dict(zip(axes[a][0], v))}
                c = self._candidate(fixed)
                if c not in tried and self._space.valid(c):
                    tried.add(c)
                    return fixed
        return None


@dataclass(frozen=True, kw_only=True)
class TPE:
    """Seeded multivariate TPE with expert plans first and a local refinement at the end."""

    name: str = "tpe"
    startup_trials: int = TPE_STARTUP_TRIALS
    refine_fraction: float = REFINE_FRACTION
    """The last part of the budget spent refining the incumbent (RefiningSampler)."""

    def budget(self, requested: int) -> int:
        return requested

    def sampler(self, space: PlanSpace, *, seed: int, worker: int, choices: dict[str, tuple] | None = None,
                fixed: dict[str, Any] | None = None, budget: int | None = None) -> BaseSampler:
        import warnings

        with warnings.catch_warnings():
            # multivariate=True is explicit for multi-objective studies, where Optuna 5 warns
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            tpe = optuna.samplers.TPESampler(
                seed=seed + worker, multivariate=True, n_startup_trials=self.startup_trials,
                constant_liar=True,
            )
        if choices is None or budget is None or self.refine_fraction <= 0:
            return tpe
        refine_from = int(round(budget * (1.0 - self.refine_fraction)))
        return RefiningSampler(tpe, space, choices=choices, fixed=fixed or {}, refine_from=refine_from,
                               seed=seed + worker)

    def first_trials(self, space: PlanSpace, budget: int) -> list[dict[str, Any]]:
        return [space.sampler_params(c) for c in expert_plans(space, limit=max(1, budget // 10))]

    def exhausted(self, sampler: BaseSampler, study: optuna.Study) -> bool:
        return False


def expert_plans(space: PlanSpace, *, limit: int) -> list[Candidate]:
    """Plans an engineer would try first, valid ones only, at most `limit`:
    the scenario's own plan; then "TP within a node, PP across nodes" (Narayanan et al. SC'21,
    Sec. 3.3 takeaways 1-2): the largest tensor-parallel degree that fits in a node, sequence
    parallelism, the distributed optimizer (ZeRO-1), selective recompute, micro-batch 1 and no
    context parallelism, over every pipeline depth, each interleaved (fewest virtual stages) and
    plain 1F1B; for an MoE model the narrowest tensor parallelism instead (rule 1 of the Megatron-Core
    MoE README's tuning guide), the widest expert parallelism inside a node, and the MoE knobs
    (expert_tp, dispatcher, shared-expert overlap) as the scenario's plan sets them, where they are
    candidates."""
    out: list[Candidate] = []

    def add(c: Candidate) -> None:
        if len(out) < limit and c not in out and space.valid(c):
            out.append(c)

    base = space.baseline()
    add(space.candidate(space.params_of(base)))
    vals = dict(space.spec.candidates)

    def pick(knob: str, preferred: Sequence[Any]) -> Any:
        return next((p for p in preferred if p in vals[knob]), vals[knob][0])

    gpn = space.scenario.cluster.gpus_per_node
    moe = space.scenario.model.moe is not None
    # dense: the widest TP in a node (SC'21); MoE: the narrowest, expert parallelism doing the
    # splitting (Megatron-Core MoE README: "Keep the model parallism size as small as possible",
    # "Prefer EP over TP for the expert layer"; its Mixtral 8x7B mapping is TP 1 EP 8)
    tps = [t for t in sorted(vals["tp"], reverse=not moe) if t <= gpn] or sorted(vals["tp"])
    opt_in = {k: pick(k, [getattr(base.plan, k)]) for k in OPT_IN_KNOBS}
    # MoE: the widest expert parallelism whose EP x expert-TP group stays in the NVLink domain of a
    # node (Megatron-Core MoE README, "Tuning Guide of Parallel Mappings": "Ensure the EPxTP
    # communication within the NVLink domain", "Prefer EP over TP for the expert layer")
    in_node = sorted((e for e in vals["ep"] if e * opt_in["expert_tp"] <= gpn), reverse=True)
    ep_order = in_node + [e for e in vals["ep"] if e not in in_node]
    common = {
        "num_nodes": base.num_nodes if base.num_nodes in vals["num_nodes"] else vals["num_nodes"][-1],
        "cp": vals["cp"][0],
        "micro_batch_size": vals["micro_batch_size"][0],
        "sequence_parallel": pick("sequence_parallel", [True]),
        "zero_stage": pick("zero_stage", [1, 0, 2, 3]),
        "recompute": pick("recompute", ["selective", "none", "full"]),
        # the opt-in knobs (the MoE ones, cp_comm_type) as the scenario sets them, where they are among the
        # candidates
        **opt_in,
    }
    vpps = [v for v in vals["virtual_pipeline_stages"] if v >= 2]
    def candidate(params: dict[str, Any]) -> Candidate:
        """The plan with the first EP of ep_order it is valid with (ep x expert_tp must divide the
        stage's ranks, which depend on tp and pp), else with the first."""
        for ep in ep_order:
            c = space.candidate({**params, "ep": ep})
            if not space.problems(c):
                return c
        return space.candidate({**params, "ep": ep_order[0]})

    for tp in tps:
        ok = [c for c in (candidate({**common, "tp": tp, "pp": pp, "schedule": "1f1b"}) for pp in vals["pp"])
              if not space.problems(c)]
        if not ok and tp != tps[-1]:
            continue  # tp does not divide the heads: try the next one
        for pp in vals["pp"]:
            for v in vpps:
                before = len(out)
                add(candidate({**common, "tp": tp, "pp": pp, "schedule": "interleaved-1f1b",
                               "virtual_pipeline_stages": v}))
                if len(out) > before:
                    break
            add(candidate({**common, "tp": tp, "pp": pp, "schedule": "1f1b"}))
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
