"""What a search found: the ranked plans, why the rest were rejected, top_plans.json and plots.

Ranking: every distinct plan that fits (a plan tried twice counts once), ordered by the objective
(ties: fewer GPUs, then more free memory); for a two-value objective the top plans are the Pareto
front, best first value first. The scenario's own plan joins the ranking when the search section
allows its knob values, so the planner's best is never slower than it by the simulator.
"""
from __future__ import annotations

import io
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from paraplan.specs import PlanSpec
from planner.objective import TIGHT_MEMORY, GiB, Evaluation, Objective, pareto_front
from planner.search import SearchResult
from planner.space import reason_key
from simulator.memory import gib_pair


@dataclass(frozen=True, kw_only=True)
class Ranked:
    rank: int
    evaluation: Evaluation
    trial: int | None
    """The first trial that evaluated it (None: the scenario's own plan, evaluated outside the study)."""
    baseline: bool = False


@dataclass(frozen=True, kw_only=True)
class Report:
    scenario: str
    objective: Objective
    result: SearchResult
    plans: tuple[Ranked, ...]
    """The top plans (the Pareto front for two-value objectives), best first."""
    distinct: int
    fits: int
    oom: int
    invalid: int
    trial_rejections: tuple[tuple[str, int, str], ...]
    """(reason template, trials, example) of the pruned trials, most frequent first."""
    closest_oom: Evaluation | None

    @property
    def best(self) -> Evaluation | None:
        return self.plans[0].evaluation if self.plans else None


def build_report(scenario: str, result: SearchResult, objective: Objective, *, top: int = 10) -> Report:
    first_trial: dict[Any, int] = {}
    evals: dict[Any, Evaluation] = {}
    reasons: Counter = Counter()
    examples: dict[str, str] = {}
    for rec in sorted(result.records, key=lambda r: r.number):
        e = rec.evaluation
        if e.candidate not in evals:
            evals[e.candidate] = e
            first_trial[e.candidate] = rec.number
        if e.status == "invalid":
            for r in e.reasons:
                k = reason_key(r)
                reasons[k] += 1
                examples.setdefault(k, r)
    pool = [e for e in evals.values() if e.fits]
    base = result.baseline
    # the scenario's plan, or the same plan as the space writes it (its twin), ranks once
    own = {base.candidate, result.baseline_twin or base.candidate}
    base_added = result.baseline_in_space and base.fits and not own & evals.keys()
    if base_added:
        pool.append(base)
    if objective.multi:
        chosen = pareto_front(pool, objective)[:max(top, 1)]
    else:
        chosen = sorted(pool, key=objective.sort_key)[:top]
    plans = tuple(
        Ranked(rank=i + 1, evaluation=e, trial=first_trial.get(e.candidate),
               baseline=e.candidate in own)
        for i, e in enumerate(chosen)
    )
    ooms = [e for e in evals.values() if e.status == "oom"]
    return Report(
        scenario=scenario, objective=objective, result=result, plans=plans,
        distinct=len(evals), fits=sum(1 for e in evals.values() if e.fits), oom=len(ooms),
        invalid=sum(1 for e in evals.values() if e.status == "invalid"),
        trial_rejections=tuple((k, n, examples[k]) for k, n in reasons.most_common()),
        closest_oom=min(ooms, key=lambda e: e.overflow) if ooms else None,
    )


# ----------------------------------------------------------------------------------------------
# Text.


def plan_label(p: PlanSpec) -> str:
    """`tp8 pp8 dp16 mbs1 interleaved x6 sp zero1 selective` (cp/ep only when > 1, cp with its
    exchange unless p2p, e.g. `cp4-all_gather`; the MoE settings,
    e.g. `ep8 etp2 deepep shared-overlap ep-overlap`, only where they are not expert_tp 1, alltoall
    and no overlap)."""
    parts = [f"tp{p.tp}", f"pp{p.pp}", f"dp{p.dp}"]
    if p.cp > 1:
        parts.append(f"cp{p.cp}" + ("" if p.cp_comm_type == "p2p" else f"-{p.cp_comm_type}"))
    if p.ep > 1:
        parts.append(f"ep{p.ep}")
    if p.expert_tp > 1:
        parts.append(f"etp{p.expert_tp}")
    if p.moe_dispatcher != "alltoall":
        parts.append(p.moe_dispatcher)
    if p.moe_shared_expert_overlap:
        parts.append("shared-overlap")
    if p.overlap_moe_expert_parallel_comm:
        parts.append("ep-overlap")
    parts.append(f"mbs{p.micro_batch_size}")
    sched = p.schedule + (f" x{p.virtual_pipeline_stages}" if p.virtual_pipeline_stages > 1 else "")
    parts += [sched, "sp" if p.sequence_parallel else "no-sp", f"zero{p.zero_stage}", p.recompute_label]
    if stages := stage_layers(p):
        parts.append(f"stages {stages}")
    return " ".join(parts)


def stage_layers(p: PlanSpec) -> str:
    """`4/1`: layers on the first / last (virtual) pipeline stage where they differ from the
    others (plan.first_stage_layers / last_stage_layers, '-' for one not set); '' when neither is."""
    if p.first_stage_layers is None and p.last_stage_layers is None:
        return ""
    first, last = ("-" if n is None else n for n in (p.first_stage_layers, p.last_stage_layers))
    return f"{first}/{last}"


def moe_label(p: PlanSpec) -> str:
    """The report's `moe` column: the dispatcher (a2a or deepep, +ovl with the shared experts
    overlapped), 1f1b-ovl under combined 1F1B, then the expert-TP degree when above 1, e.g.
    `a2a+ovl etp2`, `deepep 1f1b-ovl`."""
    text = ("a2a" if p.moe_dispatcher == "alltoall" else p.moe_dispatcher) + ("+ovl" if p.moe_shared_expert_overlap else "")
    text += " 1f1b-ovl" if p.overlap_moe_expert_parallel_comm else ""
    return text + (f" etp{p.expert_tp}" if p.expert_tp > 1 else "")


def _shows_moe(plans: list[PlanSpec]) -> bool:
    """A `moe` column only where a plan of the table sets one of the MoE knobs off its default."""
    return any(p.expert_tp > 1 or p.moe_dispatcher != "alltoall" or p.moe_shared_expert_overlap
               or p.overlap_moe_expert_parallel_comm for p in plans)


def _row(r: Ranked, objective: Objective, show_nodes: bool, show_stages: bool, recompute_width: int = 9,
         moe_width: int = 0, show_exchange: bool = False) -> str:
    e = r.evaluation
    p = e.candidate.plan
    sched = {"interleaved-1f1b": "inter", "1f1b": "1f1b", "gpipe": "gpipe", "zero-bubble": "zb", "zbv": "zbv",
             "dualpipev": "dpv"}[p.schedule]
    if p.virtual_pipeline_stages > 1:
        sched += f"x{p.virtual_pipeline_stages}"
    cols = [f"{r.rank:>2}"]
    if show_nodes:
        cols.append(f"{e.world_size:>5}")
    cols += [f"{p.tp:>2}", f"{p.pp:>3}", f"{p.dp:>4}", f"{p.cp:>2}"]
    if show_exchange:
        cols.append(f"{p.cp_comm_type if p.cp > 1 else '-':<10}")
    cols.append(f"{p.ep:>3}")
    if moe_width:
        cols.append(f"{moe_label(p):<{moe_width}}")
    cols += [f"{p.micro_batch_size:>3}", f"{sched:<8}"]
    if show_stages:
        cols.append(f"{stage_layers(p) or '-':<6}")
    cols += [f"{'on' if p.sequence_parallel else 'off':<3}",
             f"{p.zero_stage:>4}", f"{p.recompute_label:<{recompute_width}}", f"{e.step_time_s:8.4g}",
             f"{e.tokens_per_s:>11,.0f}",
             f"{e.mfu * 100:5.1f}%", f"{e.peak_memory_bytes / GiB:5.1f}/{e.memory_capacity_bytes / GiB:<5.1f}",
             f"{e.headroom * 100:4.0f}%"]
    if objective.name == "cost":
        cols.append(f"{objective.cost_per_mtokens(e):11.4g}")
    tag = "  (scenario's plan)" if r.baseline else ""
    return "  ".join(cols) + f"  {e.limiter()}{tag}"


def format_report(rep: Report) -> str:
    res, obj = rep.result, rep.objective
    lines = [f"{rep.scenario}: {res.strategy} search, objective {obj.name}"]
    enum = res.enumeration
    if enum is not None:
        lines.append(f"  space: {res.combinations:,} candidate plans, {len(enum.valid):,} valid")
    else:
        lines.append(f"  space: {res.combinations:,} candidate plans (too many to enumerate; checked per trial)")
    n = len(res.records)
    rate = (n - res.trials_before) / res.wall_time_s if res.wall_time_s > 0 else 0.0
    resumed = f", {res.trials_before} before this run" if res.trials_before else ""
    if res.trials_failed:
        resumed += f"; {res.trials_failed} left running by dead processes, marked failed and run again"
    headroom = (f" leaving {res.memory_headroom:.0%} of it free (search.memory_headroom)"
                if res.memory_headroom else "")
    lines.append(f"  trials: {n} ({rep.distinct} distinct plans{resumed}), {rep.fits} of the {rep.distinct} plans "
                 f"fit in memory{headroom}; {res.simulations} simulated in this run, {res.wall_time_s:.1f} s, "
                 f"{rate:.1f} trials/s")
    lines.append(f"  study: {res.study_name} in {res.storage}")
    lines.append("")
    if not rep.plans:
        lines.append("  no evaluated plan fits in memory")
    else:
        show_nodes = len({r.evaluation.world_size for r in rep.plans}) > 1
        # the stage split is derived from pp (and the virtual stages), not searched: a column only
        # when some plan in the table has an uneven one
        show_stages = any(stage_layers(r.evaluation.candidate.plan) for r in rep.plans)
        # selective recompute names its modules, e.g. selective(core_attn,mlp): the column fits the longest
        rc_width = max(len("recompute"), *(len(r.evaluation.candidate.plan.recompute_label) for r in rep.plans))
        shown = [r.evaluation.candidate.plan for r in rep.plans]
        moe_width = max(len("moe"), *(len(moe_label(p)) for p in shown)) if _shows_moe(shown) else 0
        # the context-parallel exchange: a column only where a plan shown runs one other than the ring
        show_exchange = any(p.cp > 1 and p.cp_comm_type != "p2p" for p in shown)
        head = [" #"] + (["  GPUs"] if show_nodes else []) + [
            "tp", " pp", "  dp", "cp"] + ([f"{'cp_comm':<10}"] if show_exchange else []) + [
            " ep"] + ([f"{'moe':<{moe_width}}"] if moe_width else []) + [
            "mbs", "schedule"] + (["stages"] if show_stages else []) + [
            "sp ", "zero", f"{'recompute':<{rc_width}}", "  step s", "   tokens/s", "   MFU", "mem GiB    ", "free"]
        if obj.name == "cost":
            head.append("cost/1M tok")
        title = "Pareto front (tokens/s vs " + obj.labels[1] + ")" if obj.multi else "top plans"
        lines.append(f"  {title}:")
        lines.append("  " + "  ".join(head) + "  limited by")
        for r in rep.plans:
            lines.append("  " + _row(r, obj, show_nodes, show_stages, rc_width, moe_width, show_exchange))
        if moe_width:
            lines.append("  (moe: the token dispatcher, a2a = alltoall, +ovl = shared experts overlapped with it; "
                         "1f1b-ovl = combined 1F1B, forward and backward all-to-alls overlapped; "
                         "etpN = expert tensor parallelism)")
        if any(p.overlap_moe_expert_parallel_comm for p in shown):
            lines.append("  (1f1b-ovl gains are an upper bound: on the one published run that measured the overlap, "
                         "paraplan overstates the gain; see the README, Combined 1F1B)")
        if show_stages:
            lines.append("  (stages: layers on the first/last pipeline stage, or virtual stage when interleaved, "
                         "where they differ from the rest; - even)")
        if obj.name == "cost":
            lines.append(f"  (cost {obj.cost_unit})")
        tight = sum(1 for r in rep.plans if r.evaluation.simulated and r.evaluation.headroom < TIGHT_MEMORY)
        if tight and res.memory_headroom < TIGHT_MEMORY:
            lines.append(f"  ({tight} of these {len(rep.plans)} use over {1 - TIGHT_MEMORY:.0%} of GPU memory, where the "
                         "memory model's error can mean an out-of-memory run: search.memory_headroom holds plans "
                         "to a share of it)")
    lines.append("")
    base = res.baseline
    if base.simulated and rep.best is not None:
        b = rep.best
        if obj.name == "cost":
            gain = objective_gain(obj, b, base)
            lines.append(f"  scenario's plan ({plan_label(base.candidate.plan)}): {base.tokens_per_s:,.0f} tokens/s, "
                         f"{obj.cost_per_mtokens(base):.4g} {obj.cost_unit}"
                         f"{'' if base.fits else ', does not fit'}; best is {gain:+.1f}% cheaper")
        else:
            gpus, base_gpus = b.candidate.plan.world_size, base.candidate.plan.world_size
            per_gpu = "" if gpus == base_gpus else (
                f" on {gpus:,} GPUs vs {base_gpus:,}, "
                f"{100 * (b.tokens_per_s * base_gpus / (base.tokens_per_s * gpus) - 1):+.1f}% per GPU")
            lines.append(f"  scenario's plan ({plan_label(base.candidate.plan)}): {base.tokens_per_s:,.0f} tokens/s"
                         f"{'' if base.fits else ' (does not fit)'}; best is "
                         f"{100 * (b.tokens_per_s / base.tokens_per_s - 1):+.1f}%{per_gpu}")
    elif not base.simulated:
        lines.append(f"  scenario's plan: invalid ({base.reasons[0] if base.reasons else 'unknown'})")
    lines.append("")
    lines.append("  rejected:")
    if rep.oom:
        c = rep.closest_oom
        lines.append(f"    {rep.oom:>6,} out of memory (closest: {plan_label(c.candidate.plan)} needs "
                     "{} of {} GiB{})".format(*gib_pair(c.peak_memory_bytes, c.limit), c.limit_note))
    for _, count, example in rep.trial_rejections[:6]:
        lines.append(f"    {count:>6,} {_plural(count, 'trial')}, e.g. {example}")
    if enum is not None and enum.rejections:
        lines.append(f"    in the space, {res.combinations - len(enum.valid):,} of {res.combinations:,} "
                     f"candidate plans fail the structural rules (a plan can fail several); per rule, "
                     f"how many fail it and one of them:")
        for rj in enum.rejections[:6]:
            lines.append(f"    {rj.count:>6,} {_plural(rj.count, 'plan')}, e.g. {rj.example}")
    if not rep.oom and not rep.trial_rejections and not (enum and enum.rejections):
        lines.append("    none")
    return "\n".join(lines)


def _plural(count: int, noun: str) -> str:
    return noun if count == 1 else noun + "s"


def objective_gain(obj: Objective, best: Evaluation, other: Evaluation) -> float:
    """How much better `best` is than `other` on the first value, in percent."""
    a, b = obj.values(best)[0], obj.values(other)[0]
    if obj.directions[0] == "maximize":
        return 100.0 * (a / b - 1.0) if b else math.inf
    return 100.0 * (1.0 - a / b) if b else math.inf


# ----------------------------------------------------------------------------------------------
# JSON.


def _metrics(e: Evaluation, obj: Objective) -> dict[str, Any]:
    return {
        "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s, "mfu": e.mfu,
        "peak_memory_bytes": e.peak_memory_bytes, "memory_capacity_bytes": e.memory_capacity_bytes,
        "memory_headroom": e.headroom, "cost_per_1M_tokens": obj.cost_per_mtokens(e),
        "cost_unit": obj.cost_unit, "num_microbatches": e.num_microbatches,
        "limited_by": e.limiter(), "breakdown_s": dict(e.breakdown),
    }


def _plan_entry(e: Evaluation, obj: Objective, **extra) -> dict[str, Any]:
    from paraplan.serialize import plan_to_mapping

    return {**extra, "num_nodes": e.candidate.num_nodes, "world_size": e.world_size,
            "plan": plan_to_mapping(e.candidate.plan), "label": plan_label(e.candidate.plan),
            "metrics": _metrics(e, obj)}


def report_json(rep: Report) -> dict[str, Any]:
    res, obj = rep.result, rep.objective
    enum = res.enumeration
    n = len(res.records)
    base = res.baseline
    return {
        "scenario": rep.scenario,
        "objective": {"name": obj.name, "directions": list(obj.directions), "labels": list(obj.labels),
                      "gpu_hour_cost": obj.gpu_hour_cost},
        "strategy": res.strategy,
        "study": {"name": res.study_name, "storage": res.storage},
        "space": {
            "candidate_plans": res.combinations,
            "valid_plans": len(enum.valid) if enum is not None else None,
            "rejected": [{"reason": r.reason, "count": r.count, "example": r.example}
                         for r in (enum.rejections if enum is not None else ())],
        },
        "search": {
            "trials": n, "trials_before_this_run": res.trials_before, "budget": res.budget,
            "trials_failed_on_resume": res.trials_failed,
            "distinct_plans": rep.distinct, "fit": rep.fits, "out_of_memory": rep.oom, "invalid": rep.invalid,
            "memory_headroom": res.memory_headroom,
            "simulations_this_run": res.simulations, "wall_time_s": res.wall_time_s,
            "trials_per_s": (n - res.trials_before) / res.wall_time_s if res.wall_time_s > 0 else None,
            "rejected_trials": [{"reason": k, "count": c, "example": ex} for k, c, ex in rep.trial_rejections],
        },
        "baseline": ({**_plan_entry(base, obj), "status": base.status} if base.simulated
                     else {"status": base.status, "reasons": list(base.reasons)}),
        "plans": [_plan_entry(r.evaluation, obj, rank=r.rank, trial=r.trial, scenario_plan=r.baseline)
                  for r in rep.plans],
        "pareto_front": obj.multi,
    }


# ----------------------------------------------------------------------------------------------
# Plots (matplotlib's object API: no pyplot state).


def _figure(w: float, h: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h))


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def history_png(rep: Report) -> bytes:
    """Objective value per trial (fits / out of memory), and the best so far."""
    obj = rep.objective
    fig = _figure(8, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    recs = sorted(rep.result.records, key=lambda r: r.number)
    ok = [(r.number, obj.values(r.evaluation)[0]) for r in recs if r.evaluation.fits]
    oom = [(r.number, obj.values(r.evaluation)[0]) for r in recs if r.evaluation.status == "oom"]
    bad = [r.number for r in recs if r.evaluation.status == "invalid"]
    scale, unit = (1e3, "k tokens/s") if obj.labels[0] == "tokens/s" else (1.0, obj.labels[0])
    if ok:
        ax.scatter([n for n, _ in ok], [v / scale for _, v in ok], s=9, color="#4C72B0", label="fits")
    if oom:
        ax.scatter([n for n, _ in oom], [v / scale for _, v in oom], s=9, marker="x", color="#C44E52",
                   label="out of memory")
    if ok:
        sign = 1 if obj.directions[0] == "maximize" else -1
        xs, ys, best = [], [], None
        for n, v in ok:
            if best is None or sign * v > sign * best:
                best = v
            xs.append(n)
            ys.append(best / scale)
        ax.step(xs, ys, where="post", color="#55A868", label="best so far")
    ax.set_xlabel(f"trial ({len(bad)} pruned as structurally invalid, not shown)")
    ax.set_ylabel(unit)
    ax.set_title(f"{rep.scenario}: optimisation history ({rep.result.strategy})", fontsize=10)
    ax.legend(fontsize=8)
    return _png(fig)


def pareto_png(rep: Report) -> bytes:
    obj = rep.objective
    fig = _figure(7, 4.5)
    ax = fig.add_subplot(1, 1, 1)
    pts = [r.evaluation for r in rep.result.records if r.evaluation.fits]
    ax.scatter([obj.values(e)[1] for e in pts], [e.tokens_per_s / 1e3 for e in pts], s=9, color="#BBBBBB",
               label="fits")
    front = pareto_front(pts, obj)  # the whole front, not only the plans in the table
    ax.plot([obj.values(e)[1] for e in front], [e.tokens_per_s / 1e3 for e in front], "o-", color="#C44E52",
            label="Pareto front")
    ax.set_xlabel(obj.labels[1] + (" (fraction of GPU memory free)" if obj.labels[1] == "memory headroom" else ""))
    ax.set_ylabel("k tokens/s")
    ax.set_title(f"{rep.scenario}: tokens/s vs {obj.labels[1]}", fontsize=10)
    ax.legend(fontsize=8)
    return _png(fig)


def importances(rep: Report) -> dict[str, float]:
    """Parameter importances for the first objective value, plans that do not fit scored as the
    worst value seen: Optuna's PED-ANOVA (Watanabe et al. 2023), which needs no scikit-learn and
    scores how much each knob's distribution among the top 10 % of trials differs from all of
    them. Empty when there is too little to learn from (fewer than 10 simulated trials or one
    free knob)."""
    import warnings

    import optuna
    from optuna.trial import TrialState

    study = rep.result.study
    if study is None:
        return {}
    trials = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    if len(trials) < 10 or len({k for t in trials for k in t.params}) < 2:
        return {}
    obj = rep.objective
    sign = 1.0 if obj.directions[0] == "maximize" else -1.0
    feasible = [sign * t.values[0] for t in trials if t.constraints.get("memory", 0.0) <= 0]
    if len(feasible) < 2:
        return {}
    worst = min(feasible)

    def target(t) -> float:
        return sign * t.values[0] if t.constraints.get("memory", 0.0) <= 0 else worst

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            ev = optuna.importance.PedAnovaImportanceEvaluator()
            return dict(optuna.importance.get_param_importances(study, evaluator=ev, target=target))
        except Exception:  # noqa: BLE001  importances are a nicety; a failure must not lose the search
            return {}


def importance_png(rep: Report, imp: dict[str, float]) -> bytes:
    fig = _figure(7, 0.5 + 0.35 * max(len(imp), 1))
    ax = fig.add_subplot(1, 1, 1)
    names = list(imp)[::-1]
    ax.barh(names, [imp[n] for n in names], color="#4C72B0")
    ax.set_xlabel("importance (PED-ANOVA over the top 10% of trials)")
    ax.set_title(f"{rep.scenario}: which knobs matter", fontsize=10)
    return _png(fig)
