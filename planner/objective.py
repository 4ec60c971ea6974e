"""The planner's objective: a memoised simulate() per candidate, and what each objective reads off it.

`Evaluator.evaluate(candidate)` checks the candidate (the planner's rules, then the simulator's
structural rules) and only then simulates it; the result is memoised on the candidate, a frozen
(cluster size, PlanSpec) pair, so a plan suggested twice is simulated once. A plan that does not
fit is *not* dropped: it is an `Evaluation` with status "oom" and its overflow
(peak - capacity) / capacity, which the search tells Optuna as a constraint violation. A plan whose
derived uneven split (PlanSpace.edge_layers) leaves one edge stage out of memory moves to the
nearest split that fits, if one does, and is simulated again so (`Evaluator._fitting_edges`).

Objectives are small strategy objects (`name`, `directions`, `values(evaluation)`):

- throughput: maximise tokens/s.
- cost: minimise the cost of 1M tokens = GPUs x price per GPU-hour x hours per 1M tokens
  (priced in GPU-hours when search.gpu_hour_cost is not given).
- throughput-vs-headroom: maximise tokens/s and the free memory fraction (a Pareto front).
- throughput-vs-gpus: maximise tokens/s and minimise the GPU count (needs search.num_nodes).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from paraplan.errors import InfeasiblePlanError
from paraplan.specs import OBJECTIVES, PlanSpec
from planner.space import Candidate, PlanSpace

GiB = 1024**3
# Free memory below this fraction is named as a limit of the plan.
TIGHT_MEMORY = 0.05


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """What the planner knows about one candidate: valid or not, and its simulated metrics."""

    candidate: Candidate
    """The plan evaluated: the one asked for, or where its derived uneven split left an edge stage
    out of memory, that plan with the split that fits (Evaluator._fitting_edges)."""
    status: str
    """ok (simulated, fits), oom (simulated, does not fit) or invalid (not simulated)."""
    reasons: tuple[str, ...] = ()
    """Why it is invalid (each names the key at fault)."""
    world_size: int = 0
    step_time_s: float = math.nan
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    peak_memory_bytes: float = 0.0
    memory_capacity_bytes: float = 0.0
    memory_limit_bytes: float = 0.0
    """What the peak had to fit in: the capacity less search.memory_headroom (0: the capacity)."""
    num_microbatches: int = 0
    breakdown: tuple[tuple[str, float], ...] = ()
    """Seconds per component on the critical stage (simulator.result.BREAKDOWN_KEYS)."""

    @property
    def simulated(self) -> bool:
        return self.status in ("ok", "oom")

    @property
    def fits(self) -> bool:
        return self.status == "ok"

    @property
    def headroom(self) -> float:
        """Free memory as a fraction of the GPU's: (capacity - peak) / capacity."""
        if not self.memory_capacity_bytes:
            return 0.0
        return (self.memory_capacity_bytes - self.peak_memory_bytes) / self.memory_capacity_bytes

    @property
    def limit(self) -> float:
        """Bytes the plan's peak memory had to fit in (search.memory_headroom)."""
        return self.memory_limit_bytes or self.memory_capacity_bytes

    @property
    def limit_note(self) -> str:
        """Where the limit is the GPU's memory less search.memory_headroom, words that say so."""
        return "" if self.limit >= self.memory_capacity_bytes else " (the GPU's memory less search.memory_headroom)"

    @property
    def overflow(self) -> float:
        """The memory constraint told to Optuna: (peak - limit) / capacity, > 0 when it does not fit
        (the limit is the capacity less search.memory_headroom)."""
        if not self.memory_capacity_bytes:
            return 0.0
        return (self.peak_memory_bytes - self.limit) / self.memory_capacity_bytes

    def limiter(self) -> str:
        """What limits the plan: memory when (nearly) full, then the largest non-compute share."""
        parts = []
        if self.status == "oom":
            over = "over" if self.limit >= self.memory_capacity_bytes else "over the headroom's limit"
            parts.append(f"memory (+{self.overflow * 100:.0f}% {over})")
        elif self.simulated and self.headroom < TIGHT_MEMORY:
            parts.append(f"memory ({(1 - self.headroom) * 100:.0f}% used)")
        overheads = sorted(((v, k) for k, v in self.breakdown if k != "compute" and v > 0), reverse=True)
        if overheads and self.step_time_s > 0:
            v, k = overheads[0]
            parts.append(f"{k} {100 * v / self.step_time_s:.0f}%")
        elif self.simulated:
            parts.append("compute")
        return ", ".join(parts)

    # -- JSON, for trial user attributes and top_plans.json -------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "num_nodes": self.candidate.num_nodes,
            "plan": dataclasses.asdict(self.candidate.plan),
            "status": self.status,
            "reasons": list(self.reasons),
            "world_size": self.world_size,
            "step_time_s": None if math.isnan(self.step_time_s) else self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "memory_limit_bytes": self.limit,
            "num_microbatches": self.num_microbatches,
            "breakdown": dict(self.breakdown),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Evaluation:
        step = d.get("step_time_s")
        return cls(
            candidate=Candidate(num_nodes=int(d["num_nodes"]), plan=_plan_from_json(d["plan"])),
            status=d["status"], reasons=tuple(d.get("reasons", ())), world_size=int(d["world_size"]),
            step_time_s=math.nan if step is None else float(step), tokens_per_s=float(d["tokens_per_s"]),
            mfu=float(d["mfu"]), peak_memory_bytes=float(d["peak_memory_bytes"]),
            memory_capacity_bytes=float(d["memory_capacity_bytes"]),
            memory_limit_bytes=float(d.get("memory_limit_bytes", 0.0)),
            num_microbatches=int(d["num_microbatches"]),
            breakdown=tuple((k, float(v)) for k, v in d.get("breakdown", {}).items()),
        )


class Evaluator:
    """Memoised evaluation of candidates of one plan space (one per process: no shared state)."""

    def __init__(self, space: PlanSpace):
        self.space = space
        self._memo: dict[Candidate, Evaluation] = {}
        self.simulations = 0
        """simulate() calls this evaluator made (memo hits and invalid plans cost none)."""

    def remember(self, ev: Evaluation) -> None:
        """Seed the memo with an evaluation made elsewhere (another worker, an earlier run), under its
        plan and the candidate a sampler's knob values give (they differ where the evaluation moved
        an uneven split to fit: `_fitting_edges`)."""
        self._memo.setdefault(ev.candidate, ev)
        self._memo.setdefault(self.space.candidate(self.space.params_of(ev.candidate)), ev)

    def evaluate(self, cand: Candidate) -> Evaluation:
        ev = self._memo.get(cand)
        if ev is None:
            ev = self._memo[cand] = self._evaluate(cand)
        return ev

    def evaluate_baseline(self, cand: Candidate) -> Evaluation:
        """The scenario's own plan: the simulator's rules only (not the search section's), not memoised."""
        return self._evaluate(cand, planner_rules=False)

    def _evaluate(self, cand: Candidate, *, planner_rules: bool = True) -> Evaluation:
        from simulator.simulate import simulate

        world = cand.num_nodes * self.space.scenario.cluster.gpus_per_node
        problems = self.space.problems(cand, planner_rules=planner_rules)
        if problems:
            return Evaluation(candidate=cand, status="invalid", reasons=tuple(problems), world_size=world)
        self.simulations += 1
        try:
            r = simulate(self.space.scenario_for(cand), imbalance_reference=False, record_spans=False)
            if planner_rules and not self._fits(r):
                moved = self._fitting_edges(cand, [st.memory["total"] for st in r.stages])
                if moved != cand:
                    self.simulations += 1
                    cand, r = moved, simulate(self.space.scenario_for(moved), imbalance_reference=False,
                                              record_spans=False)
        except InfeasiblePlanError as e:  # a rule the structural check does not know yet
            return Evaluation(candidate=cand, status="invalid", reasons=e.reasons, world_size=world)
        return Evaluation(
            candidate=cand, status="ok" if self._fits(r) else "oom", world_size=world,
            step_time_s=r.step_time_s, tokens_per_s=r.tokens_per_s, mfu=r.mfu,
            peak_memory_bytes=r.peak_memory_bytes, memory_capacity_bytes=r.memory_capacity_bytes,
            memory_limit_bytes=min(self.space.memory_limit, r.memory_capacity_bytes),
            num_microbatches=r.num_microbatches, breakdown=tuple(r.breakdown.items()),
        )


    def _fits(self, r) -> bool:
        """Fits the GPU, less the search section's memory_headroom."""
        return r.fits and r.peak_memory_bytes <= self.space.memory_limit

    def _fitting_edges(self, cand: Candidate, stage_memory: list[float]) -> Candidate:
        """The candidate, or where its derived uneven split leaves one edge stage over the GPU's
        memory (`stage_memory`: its stages' peaks, as simulated), the same plan with the split nearest to it under which both edge stages fit (when
        one does). The derived split balances the edge stages' FLOPs, but a 1F1B first stage holds
        pp microbatches' activations and the last one the LM head's logits: the split fastest on
        paper can be one that does not fit while a lighter first (or last) stage would, as a
        Megatron user would then set --decoder-first/last-pipeline-num-layers. Nearest, because
        the costlier edge stage only gets costlier as the split moves away from the balance. A
        stage's memory only grows with its layers, so the edge stage over capacity has a largest
        layer count that fits, found by bisection on the memory model alone (no simulation);
        a middle stage over capacity, or both edges, no split can help."""
        from simulator.simulate import stage_peak_memory

        rest = self.space.edge_layers(cand)
        if rest is None:
            return cand
        cap = self.space.memory_limit

        def over(c: Candidate) -> list[bool]:
            return [m > cap for m in stage_peak_memory(self.space.scenario_for(c))]

        try:
            now = [m > cap for m in stage_memory]
            first = cand.plan.first_stage_layers
            if not (now[0] ^ now[-1]) or any(now[1:-1]):
                return cand
            # lighten the edge over capacity: the first stage over -> fewer layers first (search
            # 1..first-1 for the most that fit); the last over -> more first (first+1..rest-1)
            lo, hi = (1, first - 1) if now[0] else (first + 1, rest - 1)
            edge = 0 if now[0] else -1
            found = None
            while lo <= hi:
                mid = (lo + hi) // 2
                if over(self.space.with_first_layers(cand, mid))[edge]:
                    lo, hi = (lo, mid - 1) if now[0] else (mid + 1, hi)
                else:
                    found = mid
                    lo, hi = (mid + 1, hi) if now[0] else (lo, mid - 1)
            if found is None:
                return cand
            moved = self.space.with_first_layers(cand, found)
            return cand if any(over(moved)) else moved
        except InfeasiblePlanError:  # a moved split breaks a rule: keep the plan as derived
            return cand


# ----------------------------------------------------------------------------------------------
# Objectives.


@dataclass(frozen=True, kw_only=True)
class Objective:
    """What the search optimises: one value (ranked) or two (a Pareto front)."""

    name: str
    directions: tuple[str, ...]
    """"maximize" or "minimize", one per value."""
    labels: tuple[str, ...]
    gpu_hour_cost: float | None = None

    @property
    def multi(self) -> bool:
        return len(self.directions) > 1

    def values(self, ev: Evaluation) -> tuple[float, ...]:
        if self.name == "throughput":
            return (ev.tokens_per_s,)
        if self.name == "cost":
            return (self.cost_per_mtokens(ev),)
        if self.name == "throughput-vs-headroom":
            return (ev.tokens_per_s, ev.headroom)
        if self.name == "throughput-vs-gpus":
            return (ev.tokens_per_s, float(ev.world_size))
        raise ValueError(self.name)

    def cost_per_mtokens(self, ev: Evaluation) -> float:
        """Cost of one million tokens: world x price/GPU-hour x (1e6 / tokens_per_s) / 3600."""
        if ev.tokens_per_s <= 0:
            return math.inf
        price = self.gpu_hour_cost if self.gpu_hour_cost is not None else 1.0
        return ev.world_size * price * 1e6 / ev.tokens_per_s / 3600.0

    @property
    def cost_unit(self) -> str:
        return "per 1M tokens" if self.gpu_hour_cost is not None else "GPU-hours per 1M tokens"

    def better(self, a: Evaluation, b: Evaluation) -> bool:
        """a ranks above b on the first value (ties: fewer GPUs, then more headroom)."""
        return self.sort_key(a) < self.sort_key(b)

    def sort_key(self, ev: Evaluation) -> tuple:
        v = self.values(ev)[0]
        first = -v if self.directions[0] == "maximize" else v
        return (first, ev.world_size, -ev.headroom)


def make_objective(name: str, *, gpu_hour_cost: float | None = None) -> Objective:
    if name == "throughput":
        return Objective(name=name, directions=("maximize",), labels=("tokens/s",))
    if name == "cost":
        return Objective(name=name, directions=("minimize",), labels=("cost per 1M tokens",),
                         gpu_hour_cost=gpu_hour_cost)
    if name == "throughput-vs-headroom":
        return Objective(name=name, directions=("maximize", "maximize"), labels=("tokens/s", "memory headroom"))
    if name == "throughput-vs-gpus":
        return Objective(name=name, directions=("maximize", "minimize"), labels=("tokens/s", "GPUs"))
    raise ValueError(f"unknown objective {name!r}; expected one of {', '.join(OBJECTIVES)}")


def pareto_front(evs: list[Evaluation], objective: Objective) -> list[Evaluation]:
    """The evaluations no other one dominates (both values at least as good, one better), best
    first value first; of plans with equal values, the first listed. One sweep after sorting
    (Kung, Luccio and Preparata 1975, the two-dimensional case)."""
    if len(objective.directions) != 2:
        raise ValueError("a Pareto front needs two objectives")
    s0, s1 = (1.0 if d == "maximize" else -1.0 for d in objective.directions)
    order = sorted(range(len(evs)), key=lambda i: (-s0 * objective.values(evs[i])[0],
                                                   -s1 * objective.values(evs[i])[1], i))
    front, best = [], -math.inf
    for i in order:
        v1 = s1 * objective.values(evs[i])[1]
        if v1 > best:
            front.append(evs[i])
            best = v1
    return front


def _plan_from_json(d: Mapping[str, Any]) -> PlanSpec:
    """A PlanSpec from its asdict() JSON form (lists back to the tuples the spec holds)."""
    return PlanSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
