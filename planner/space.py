"""The plan space: which knobs are free, their candidate values, and which combinations are valid.

A scenario's `search:` section names the free knobs and their candidates:

```yaml
search:
  tp: [1, 2, 4, 8]             # a plan knob -> its candidate values (a single value fixes it)
  allow_tp_across_nodes: false
  trials: 300                  # Optuna budget (trials of every state, pruned ones included)
  exhaustive_threshold: 3000   # enumerate every valid plan when there are at most this many
  gpu_hour_cost: 2.5           # currency per GPU-hour, for --objective cost
  memory_headroom: 0.1         # a plan fits if its peak leaves this share of GPU memory free (default 0)
  num_nodes: [64, 128]         # optional: let the planner choose the cluster size too
```

Decision (documented in the README): a knob the section leaves out is **free over its full valid
range**, so `search: {}` or no section at all means "every valid factorisation of the cluster":

| knob | candidates when absent |
|---|---|
| num_nodes | the scenario's own (the cluster size is fixed unless listed) |
| tp | divisors of the world size that fit in a node (any divisor with allow_tp_across_nodes) |
| pp | divisors of the world size up to model.num_layers |
| cp | divisors of the world size |
| dp | derived: world / (tp x pp x cp); a list filters the derived value |
| ep | 1 for a dense model; for MoE, divisors of the world size that divide num_experts |
| micro_batch_size | divisors of training.global_batch_size up to 16 |
| schedule | gpipe, 1f1b, interleaved-1f1b (zero-bubble, zbv and dualpipev only when listed: Megatron-LM cannot run them) |
| virtual_pipeline_stages | divisors of model.num_layers or of model.num_layers + 2 (interleaved-1f1b takes those >= 2, zero-bubble 1 and those >= 2, zbv and dualpipev exactly 2; the others run 1) |
| sequence_parallel | false, true |
| zero_stage | 0, 1, 2, 3 |
| recompute | none, selective, full |
| expert_tp | the scenario's plan.expert_tp (an MoE knob: searched only when listed) |
| cp_comm_type | the scenario's plan.cp_comm_type (p2p, all_gather, a2a, a2a+p2p; searched only when listed; acts with cp > 1) |
| moe_dispatcher | the scenario's plan.moe_dispatcher (alltoall, deepep; searched only when listed) |
| moe_shared_expert_overlap | the scenario's plan.moe_shared_expert_overlap (false, true; searched only when listed) |
| overlap_moe_expert_parallel_comm | the scenario's plan.overlap_moe_expert_parallel_comm (false, true; searched only when listed) |

search.recompute also takes selective recompute of named modules, `selective(moe_act,layernorm)`
or, inside a [..] list where a comma would split it, `selective(moe_act+layernorm)` (Megatron
--recompute-modules; the modules of plan.recompute_modules), beside plain `selective`, which
recomputes the scenario's own plan.recompute_modules (core_attn by default).

cp_comm_type is opt-in too: ring attention (p2p) is Megatron's default, and the others change
which kernels run and what must divide (a2a: the heads of a TP rank by cp).
The four MoE knobs are opt-in, as zero-bubble is: each changes what Megatron-Core runs (expert
tensor parallelism, DeepEP's kernels, the shared experts beside the dispatch, combined 1F1B) in ways
a team picks deliberately, and leaving them out keeps a dense search and an MoE one of a fixed MoE setup as small
as they were. Listing them for a dense model is an error, as ep is.

Every other plan field (overlap_grad_reduce, overlap_param_gather, tp_comm_overlap)
keeps the scenario's value; tp_comm_overlap is applied where it can be (sequence_parallel and
tp > 1), and so is overlap_param_gather (zero_stage >= 1 and overlap_grad_reduce). Uneven stages
are derived, not searched: when pp does not divide the layers (and the schedule is not
interleaved), the middle stages take ceil(layers / pp) each and the first and
last stages share the rest so that the costlier of the two, by forward FLOPs with the LM head and
any multi-token prediction modules on the last, costs least (Llama 3 405B's 126 layers on 16
stages are 7 + 14 x 8 + 7, Dubey et al. 2024 Sec. 3.3.2; DeepSeek-V3's 61 with its MTP module, 4 +
14 x 4 + 1); see uneven_stages; where that split leaves the first or last stage out of memory
(a 1F1B first stage holds pp microbatches), the evaluator moves it to the nearest split that fits,
if one does (planner.objective.Evaluator._fitting_edges);
interleaved, the embedding and the loss count as a layer each where the pp x vpp virtual stages
then split the layers evenly (Megatron --account-for-embedding/loss-in-pipeline-split: Qwen3-235B's
94 layers on 8 x 4 virtual stages are 2 + 30 x 3 + 2, on 32 x 3 the embedding and the loss alone at
the ends); the scenario's own plan, as written, is evaluated as the baseline.

Candidates are canonicalised so that plans that run identically are one plan (and one
simulation): virtual_pipeline_stages is 1 unless the schedule takes virtual stages (VIRTUAL_SCHEDULES),
and 2 under zbv and dualpipev whatever the candidate says (EXACT_VIRTUAL),
sequence_parallel takes its first candidate when tp = 1 (there is nothing to split), zero_stage
its first candidate when dp x cp = 1 and, for an MoE model, expert-dp = 1 (nothing to shard over),
and gpipe and 1f1b are one schedule when pp = 1, 1f1b (gpipe when 1f1b is not listed; see
`one_stage_schedule`: one stage has no pipeline to schedule, and GPipe's order there only holds more
activations), and likewise when a pipeline runs one microbatch (both orders are then its forward,
then its backward, on every stage). With ep x expert_tp = 1 no token leaves its rank, so the dispatcher is alltoall
(Megatron-Core's flex dispatcher, which runs DeepEP over the expert-TP x EP group, refuses ep x
expert_tp = 1; with expert_tp > 1 and ep 1 it exchanges over the expert-TP ranks, which the
all-to-all dispatcher gathers and scatters), and moe_shared_expert_overlap is
false wherever it cannot act (ep = 1, no shared experts, or a dispatcher other than alltoall, the
only one Megatron-Core overlaps shared experts with); overlap_moe_expert_parallel_comm is false
wherever it cannot run (ep = 1, pp > 1 without interleaved-1f1b or dualpipev, full or
moe recompute, the shared-expert overlap, ZeRO-2/3: `_ep_overlap_matters`), so a scenario that sets
it keeps it on the plans it fits. interleaved-1f1b, zero-bubble, zbv and dualpipev need pp >= 2:
with pp = 1 they stay invalid plans.

Validity: the planner's own rules (the derived dp, tp inside a node) and then
`simulator.feasibility.structural_problems`, the simulator's, on the candidate scenario; both give
reasons that name the key at fault.
"""
from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from paraplan.errors import ConfigError
from paraplan.loader import FrozenMapping
from paraplan.specs import (CP_COMM_TYPES, MOE_DISPATCHERS, RECOMPUTE, RECOMPUTE_MODULES, SCHEDULES, ZERO_STAGES, PlanSpec, Scenario,
                            nodes_x_gpus)
from simulator import layout
from simulator.flops import last_stage_extra_flops_per_token, layer_forward_flops_per_token

# Knobs in the order they are enumerated and shown.
KNOBS = (
    "num_nodes", "tp", "pp", "dp", "cp", "ep", "micro_batch_size", "schedule",
    "virtual_pipeline_stages", "sequence_parallel", "zero_stage", "recompute", "cp_comm_type",
    "expert_tp", "moe_dispatcher", "moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm",
)
DEGREE_KNOBS = ("num_nodes", "tp", "pp", "dp", "cp", "ep", "micro_batch_size", "virtual_pipeline_stages",
                "expert_tp")
ENUM_KNOBS = {"schedule": SCHEDULES, "zero_stage": ZERO_STAGES, "recompute": RECOMPUTE,
              "sequence_parallel": (False, True), "moe_dispatcher": MOE_DISPATCHERS, "cp_comm_type": CP_COMM_TYPES,
              "moe_shared_expert_overlap": (False, True), "overlap_moe_expert_parallel_comm": (False, True)}
MAX_DEGREE = 2**20
MOE_KNOBS = ("expert_tp", "moe_dispatcher", "moe_shared_expert_overlap", "overlap_moe_expert_parallel_comm")
OPT_IN_KNOBS = ("cp_comm_type", *MOE_KNOBS)
"""Searched only when the search section lists them (their default is the scenario's value)."""
# zero-bubble, zbv and dualpipev are searched only when the scenario lists them: Megatron-LM, whose
# arguments `plan` writes, has none of them (torchtitan and `paraplan launch` run them).
DEFAULT_SCHEDULES = tuple(s for s in SCHEDULES if s not in ("zero-bubble", "zbv", "dualpipev"))
SETTINGS = ("allow_tp_across_nodes", "trials", "exhaustive_threshold", "gpu_hour_cost", "memory_headroom")
# The schedules that run on one stage: with pp = 1 they are one, the first the search lists (one_stage_schedule).
ONE_STAGE_SCHEDULES = ("1f1b", "gpipe")
VIRTUAL_SCHEDULES = {"interleaved-1f1b": 2, "zero-bubble": 1, "zbv": 2, "dualpipev": 2}
"""Schedules that run virtual stages, with the fewest per rank each takes: interleaved 1F1B needs
two (one is plain 1F1B); zero-bubble runs one (ZB-H1) or more, its B/W split walking the chunks as
the interleaved order does (Qi et al. 2024; torchtitan's InterleavedZeroBubble); zbv and dualpipev
exactly two, their V (EXACT_VIRTUAL)."""
EXACT_VIRTUAL = {"zbv": 2, "dualpipev": 2}
"""Schedules that run one number of virtual stages per rank and no other."""


def _overlap_schedule(pp: int, schedule: str, vpp: int) -> bool:
    """Whether overlap_moe_expert_parallel_comm can run on the schedule: Megatron-Core's combined
    1F1B on one stage or under interleaved 1F1B, or DualPipeV's overlapped pairs."""
    return ((pp == 1 and schedule in ONE_STAGE_SCHEDULES) or (schedule == "interleaved-1f1b" and vpp > 1)
            or (schedule == "dualpipev" and pp > 1))


def _overlap_recompute(recompute: str, modules: tuple[str, ...]) -> bool:
    """Whether overlap_moe_expert_parallel_comm can run with the recompute: not full, and not the
    moe module (Megatron-Core)."""
    return recompute != "full" and not (recompute == "selective" and "moe" in modules)


def vpp_options(schedule: str, candidates, *, one: int = 1) -> list[int]:
    """The virtual stages per rank a schedule is searched at: `one` unless it takes virtual
    stages; interleaved-1f1b the candidates >= 2; zero-bubble `one` (a stage per rank) and the
    candidates >= 2; zbv and dualpipev 2 where it is a candidate. `one` is how one stage per rank is spelled: 1 for a plan, the smallest
    candidate where a sampler must pick among the candidates."""
    if schedule not in VIRTUAL_SCHEDULES:
        return [one]
    if schedule in EXACT_VIRTUAL:
        return [v for v in candidates if v == EXACT_VIRTUAL[schedule]]
    least = VIRTUAL_SCHEDULES[schedule]
    more = [v for v in candidates if v >= max(least, 2)]
    return list(dict.fromkeys(([one] if least == 1 else []) + more))

PIPELINE = "pipeline"
"""The knob a sampler draws the schedule and its virtual stages as, together ("1f1b",
"interleaved-1f1b x4"): drawn apart, a sampler spends trials on pairs no plan has (interleaved
1F1B at one stage per rank) or that collapse onto one already drawn (1F1B at 4)."""


def pipeline_value(schedule: str, vpp: int) -> str:
    """The PIPELINE knob's value for a schedule at `vpp` virtual stages per rank."""
    return schedule if vpp == 1 else f"{schedule} x{vpp}"


def pipeline_parts(value: str) -> tuple[str, int]:
    """(schedule, virtual stages per rank) of a PIPELINE value (pipeline_value's inverse)."""
    schedule, _, vpp = value.partition(" x")
    return schedule, int(vpp) if vpp else 1


def pipeline_values(schedules, vpps) -> tuple[str, ...]:
    """PIPELINE's values for candidate schedules and virtual stages: each schedule at the virtual
    stages it is searched at (vpp_options)."""
    return tuple(pipeline_value(s, v) for s in schedules for v in vpp_options(s, vpps))


DEFAULT_TRIALS = 300
# simulate() costs 1-150 ms per plan on the big scenarios (about 30 ms on average over a GPT-3
# space, plus ~5 ms of journal writes): 3,000 plans is about a minute with two workers.
DEFAULT_EXHAUSTIVE_THRESHOLD = 3000
# Above this many candidate combinations (after the layout rules), the valid ones are not counted
# up front: enumeration costs ~8 us a combination, and Optuna needs no list.
ENUMERATION_LIMIT = 400_000
MAX_DEFAULT_MICRO_BATCH = 16


@dataclass(frozen=True, kw_only=True)
class SearchSpec:
    """The `search:` section, validated, with every knob's candidates resolved."""

    candidates: tuple[tuple[str, tuple], ...]
    """(knob, candidate values) for every knob in KNOBS except dp; ascending."""
    dp_filter: tuple[int, ...] | None = None
    """search.dp: allowed values of the derived dp (None: any)."""
    allow_tp_across_nodes: bool = False
    trials: int = DEFAULT_TRIALS
    exhaustive_threshold: int = DEFAULT_EXHAUSTIVE_THRESHOLD
    gpu_hour_cost: float | None = None
    """Currency per GPU-hour; None prices the cost objective in GPU-hours."""
    memory_headroom: float = 0.0
    """Share of a GPU's memory a plan must leave free to count as fitting: a margin for what the
    memory model leaves out (allocator fragmentation beyond its allowance, a framework's own
    buffers), which a run near the limit meets as an out-of-memory error."""
    given: tuple[str, ...] = ()
    """The knobs the section listed (the others took their defaults)."""

    def values(self, knob: str) -> tuple:
        return dict(self.candidates)[knob]


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """One point of the plan space: a cluster size and a plan. Hashable: the memo key."""

    num_nodes: int
    plan: PlanSpec


# ----------------------------------------------------------------------------------------------
# Parsing the search section.


def _did_you_mean(word: str, known) -> str:
    close = difflib.get_close_matches(str(word), list(known), n=1)
    return f", did you mean '{close[0]}'?" if close else f"; expected one of: {', '.join(known)}"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, Mapping):
        return "a mapping"
    return repr(value)


def _thaw(frozen: Any) -> dict:
    """Scenario.search (sorted (key, value) pairs, lists as tuples) back to a dict."""
    if isinstance(frozen, Mapping):
        return dict(frozen)
    return {k: v for k, v in frozen}


def _as_list(path: str, value: Any) -> list:
    if isinstance(value, FrozenMapping):  # a mapping in the scenario's search section, frozen by the loader
        raise ConfigError(path, "expected a list of candidates (or one value), got a mapping")
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(path, "expected at least one candidate, got an empty list")
        return list(value)
    if isinstance(value, Mapping):
        raise ConfigError(path, "expected a list of candidates (or one value), got a mapping")
    return [value]


def _check_candidates(knob: str, raw: Any) -> tuple:
    path = f"search.{knob}"
    values = _as_list(path, raw)
    out = []
    for v in values:
        if knob in DEGREE_KNOBS:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(path, f"expected positive integers, got {_show(v)}")
            if v < 1:
                raise ConfigError(path, f"expected positive integers, got {v}")
            if v > MAX_DEGREE:  # as cluster.num_nodes (paraplan.loader NODES): past any cluster
                raise ConfigError(path, f"expected integers up to 2**20, got {v}")
        elif knob == "recompute" and isinstance(v, str) and _SELECTIVE_OF.fullmatch(v.strip()):
            v = _check_selective_of(path, v)
        else:
            choices = ENUM_KNOBS[knob]
            if not any(type(v) is type(c) and v == c for c in choices):
                allowed = ", ".join(_show(c) if isinstance(c, bool) else str(c) for c in choices)
                hint = ""
                if knob == "recompute":
                    allowed += f" or selective(MODULE,...) with modules among {', '.join(RECOMPUTE_MODULES)}"
                if knob == "recompute" and isinstance(v, str) and v.strip().startswith("selective(") and ")" not in v:
                    hint = "; a comma inside [..] splits the candidate: write selective(core_attn+mlp), or quote it"
                elif isinstance(v, str):
                    close = difflib.get_close_matches(v, [str(c) for c in choices], n=1)
                    hint = f", did you mean '{close[0]}'?" if close else ""
                raise ConfigError(path, f"{_show(v)} is not one of {allowed}{hint}")
        if v in out:
            raise ConfigError(path, f"candidate {_show(v)} is listed twice")
        out.append(v)
    return tuple(sorted(out, key=lambda x: (str(type(x)), x)))


_SELECTIVE_OF = re.compile(r"selective\((.*)\)")


def recompute_choice(value: str) -> tuple[str, tuple[str, ...] | None]:
    """A search.recompute candidate as (plan.recompute, plan.recompute_modules): `selective(a,b)`
    names the modules; none, selective and full keep the scenario's modules (None)."""
    named = _SELECTIVE_OF.fullmatch(value)
    if named is None:
        return value, None
    return "selective", tuple(m for m in re.split(r"[,+\s]+", named.group(1).strip()) if m)


def _without_layernorm(value: str) -> str:
    """A search.recompute candidate without the layernorm module: `none` if nothing is left."""
    _, modules = recompute_choice(value)
    if modules is None or "layernorm" not in modules:
        return value
    rest = tuple(m for m in modules if m != "layernorm")
    return _selective_of(rest) if rest else "none"


def _selective_of(modules) -> str:
    """`selective(a,b)` with the modules in RECOMPUTE_MODULES' order: the order recompute runs them in
    does not matter, so one spelling per set."""
    return f"selective({','.join(m for m in RECOMPUTE_MODULES if m in modules)})"


def _check_selective_of(path: str, v: str) -> str:
    """A `selective(a,b)` search.recompute candidate, checked and spelled canonically (_selective_of)."""
    _, modules = recompute_choice(v.strip())
    if not modules:
        raise ConfigError(path, f"{v!r}: name at least one module, e.g. selective(core_attn)")
    for m in modules:
        if m not in RECOMPUTE_MODULES:
            raise ConfigError(path, f"{v!r}: {m!r} is not a recompute module{_did_you_mean(m, RECOMPUTE_MODULES)}")
    if len(set(modules)) != len(modules):
        raise ConfigError(path, f"{v!r}: a module is listed twice")
    return _selective_of(modules)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def parse_search(scenario: Scenario, raw: Any = None) -> SearchSpec:
    """Validate `raw` (default: scenario.search) and resolve every knob's candidates.

    Raises ConfigError with paths like `search.tp` for an unknown key (with a did-you-mean), a
    wrong type, an enum value that is not allowed, or expert parallelism on a dense model.
    """
    raw = _thaw(scenario.search if raw is None else raw)
    for key in raw:
        if key not in KNOBS and key not in SETTINGS:
            raise ConfigError(f"search.{key}", f"unknown key{_did_you_mean(key, KNOBS + SETTINGS)}")
    settings: dict[str, Any] = {}
    if "allow_tp_across_nodes" in raw:
        v = raw["allow_tp_across_nodes"]
        if not isinstance(v, bool):
            raise ConfigError("search.allow_tp_across_nodes", f"expected true or false, got {_show(v)}")
        settings["allow_tp_across_nodes"] = v
    for key, minimum in (("trials", 1), ("exhaustive_threshold", 0)):
        if key in raw:
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                wanted = "a positive integer" if minimum == 1 else "an integer >= 0"
                raise ConfigError(f"search.{key}", f"expected {wanted}, got {_show(v)}")
            settings[key] = v
    if "gpu_hour_cost" in raw:
        v = raw["gpu_hour_cost"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError("search.gpu_hour_cost", f"expected a positive number, got {_show(v)}")
        settings["gpu_hour_cost"] = float(v)
    if "memory_headroom" in raw:
        v = raw["memory_headroom"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise ConfigError("search.memory_headroom", f"expected a share of GPU memory in [0, 1), got {_show(v)}")
        settings["memory_headroom"] = float(v)

    given = {k: _check_candidates(k, v) for k, v in raw.items() if k in KNOBS}
    if "recompute" in given:
        # layernorm recomputes only norms that are modules of their own (simulator.memory.
        # norm_outputs_recomputed): none in a dense model without MLA, where it is dropped
        idle = scenario.model.moe is None and scenario.model.mla is None
        acting = [_without_layernorm(v) if idle else v for v in given["recompute"]]
        # selective of the scenario's own modules is plain selective: one plan
        own = _selective_of(scenario.plan.recompute_modules)
        canonical = ["selective" if v == own else v for v in acting]
        if len(set(canonical)) != len(canonical):
            idle_ones = [f"{a} runs as {c}" for a, c in zip(given["recompute"], acting) if a != c]
            if idle_ones and len(set(acting)) != len(acting):
                raise ConfigError("search.recompute", f"{'; '.join(idle_ones)}: layernorm recomputes nothing in a "
                                                      f"dense model without MLA (its norms are fused into the linears "
                                                      f"they feed), so two candidates are one plan: list it once")
            raise ConfigError("search.recompute", f"{own} is the scenario's plan.recompute_modules, which "
                                                  f"selective already recomputes: list it once")
        given["recompute"] = tuple(sorted(canonical))
    if scenario.model.moe is None:
        dense = {"ep": 1, "expert_tp": 1, "moe_dispatcher": "alltoall", "moe_shared_expert_overlap": False,
                 "overlap_moe_expert_parallel_comm": False}
        for knob, only in dense.items():
            if any(v != only for v in given.get(knob, (only,))):
                what = "expert parallelism" if knob == "ep" else knob
                raise ConfigError(f"search.{knob}", f"{what} needs an MoE model (model.moe); this model is dense")
    elif True in given.get("moe_shared_expert_overlap", ()) and not scenario.model.moe.num_shared_experts:
        raise ConfigError("search.moe_shared_expert_overlap", "true needs shared experts "
                                                              "(model.moe.num_shared_experts > 0); this model has none")
    allow_tp = settings.get("allow_tp_across_nodes", False)
    cands = _defaults(scenario, given.get("num_nodes", (scenario.cluster.num_nodes,)), allow_tp)
    cands.update({k: v for k, v in given.items() if k != "dp"})
    for schedule in given.get("schedule", ()):  # one the search section lists but could never search
        if schedule in VIRTUAL_SCHEDULES and not vpp_options(schedule, cands["virtual_pipeline_stages"]):
            raise ConfigError("search.virtual_pipeline_stages",
                              f"schedule {schedule} takes {'exactly 2' if schedule in EXACT_VIRTUAL else '2 or more'} "
                              f"virtual stages per rank, and the candidates "
                              f"{list(cands['virtual_pipeline_stages'])} have none; add one or drop {schedule} "
                              f"from search.schedule")
    return SearchSpec(
        candidates=tuple((k, cands[k]) for k in KNOBS if k != "dp"),
        dp_filter=given.get("dp"),
        given=tuple(k for k in KNOBS if k in given),
        **settings,
    )


def _defaults(sc: Scenario, num_nodes: tuple[int, ...], allow_tp_across_nodes: bool) -> dict[str, tuple]:
    gpn = sc.cluster.gpus_per_node
    worlds = [n * gpn for n in num_nodes]
    divisors = sorted({d for w in worlds for d in _divisors(w)})
    m, t = sc.model, sc.training
    if m.moe is None:
        ep = (1,)
    else:
        ep = tuple(d for d in divisors if m.moe.num_experts % d == 0)
    return {
        "num_nodes": tuple(num_nodes),
        "tp": tuple(d for d in divisors if allow_tp_across_nodes or (d <= gpn and gpn % d == 0)),
        "pp": tuple(d for d in divisors if d <= m.num_layers),
        "cp": tuple(divisors),
        "ep": ep,
        "micro_batch_size": tuple(d for d in _divisors(t.global_batch_size) if d <= MAX_DEFAULT_MICRO_BATCH),
        "schedule": DEFAULT_SCHEDULES,
        "virtual_pipeline_stages": tuple(sorted(set(_divisors(m.num_layers)) | set(_divisors(m.num_layers + 2)))),
        "sequence_parallel": (False, True),
        "zero_stage": ZERO_STAGES,
        "recompute": RECOMPUTE,
        "cp_comm_type": (sc.plan.cp_comm_type,),
        "expert_tp": (sc.plan.expert_tp,),
        "moe_dispatcher": (sc.plan.moe_dispatcher,),
        "moe_shared_expert_overlap": (sc.plan.moe_shared_expert_overlap,),
        "overlap_moe_expert_parallel_comm": (sc.plan.overlap_moe_expert_parallel_comm,),
    }


# ----------------------------------------------------------------------------------------------
# The space.


@dataclass(frozen=True, kw_only=True)
class Rejection:
    """Why some candidate plans are invalid: a reason template, how many, one full example."""

    reason: str
    """The reason with its numbers replaced by '#', so plans rejected alike count together."""
    count: int
    example: str


@dataclass(frozen=True, kw_only=True)
class Enumeration:
    """Every candidate plan, checked: the valid ones and the reasons the rest were rejected."""

    valid: tuple[Candidate, ...]
    combinations: int
    """Candidate plans considered (after canonicalisation)."""
    rejections: tuple[Rejection, ...]
    """Most frequent first; a plan with several problems counts under each."""


def uneven_stages(num_layers: int, pp: int, layer_costs: Sequence[float] | None = None,
                  last_extra: float = 0.0) -> tuple[int | None, int | None]:
    """(first, last) stage layers when pp does not divide num_layers, else (None, None): middle
    stages ceil(L / pp) each, the rest shared by the first and last stages, at least one layer
    each. Without costs the last takes the smaller half. With `layer_costs` (per layer) and
    `last_extra` (what the last stage runs besides its layers: the LM head, multi-token prediction)
    the rest is split so that the costlier of the two edge stages costs least, ties going to the
    split with more layers first: a pipeline runs at the pace of its slowest stage, which is what
    Megatron's --decoder-first/last-pipeline-num-layers are set by (the Llama 3 paper, Sec. 3.3.2,
    takes a layer off the first and last stages for the embedding and the head; Llama 3 405B's
    126 layers on 16 stages are 7 + 14 x 8 + 7). Where ceil(L / pp) middle layers would leave an
    edge stage empty, the middle stages take floor(L / pp) if the edges can then stay within
    ceil(L / pp) each (5 layers on 4 stages: 2 + 1 + 1 + 1). (None, None) when no such split exists
    (61 layers on 32 stages: 1 layer in the middle would leave 31 to the edges): the plan is then
    rejected as uneven."""
    if pp < 2 or num_layers % pp == 0:
        return None, None
    if pp == 2:
        rest = num_layers
    else:
        middle = -(-num_layers // pp)
        rest = num_layers - (pp - 2) * middle
        if rest < 2:
            ceil, middle = middle, num_layers // pp
            rest = num_layers - (pp - 2) * middle
            if middle < 1 or rest < 2 or rest > 2 * ceil:
                return None, None
    if layer_costs is None:
        return rest - rest // 2, rest // 2
    tail = num_layers - rest  # the middle stages' layers: the last stage's start at tail + first
    best = None
    for first in range(rest - 1, 0, -1):
        cost = max(sum(layer_costs[:first]), sum(layer_costs[tail + first:]) + last_extra)
        if best is None or cost < best[0]:
            best = (cost, first)
    if best is None:  # one layer on two stages: it goes first, as without costs
        return rest - rest // 2, rest // 2
    return best[1], rest - best[1]


def interleaved_edges(num_layers: int, virtual_stages: int) -> tuple[int | None, int | None]:
    """(first, last) virtual-stage layers of an interleaved plan whose virtual stages do not divide
    the layers: the embedding and the loss counted as a layer each (Megatron-Core
    --account-for-embedding/loss-in-pipeline-split, the Megatron MoE Model Zoo's Qwen3-235B split:
    94 + 2 = 96 = 8 x 4 x 3), possibly leaving a stage only the embedding or the loss. (None, None)
    when the split is even or no such split exists (the plan is then rejected as uneven)."""
    edge = layout.embedding_and_loss_edge(num_layers, virtual_stages)
    return (None, None) if edge is None else (edge, edge)


def edge_split_hint(sc: Scenario) -> str | None:
    """Where a plan's layers do not split evenly over its (virtual) stages: the first and last
    stage layers the planner would give it (uneven_stages balancing the edge stages' forward FLOPs,
    as PlanSpace._split does; interleaved_edges), as the --set arguments that ask for them; None
    where it would reject the plan too."""
    p, m, seq = sc.plan, sc.model, sc.training.seq_length
    stages = p.pp * p.virtual_pipeline_stages
    if p.virtual_pipeline_stages == 1:
        costs = [layer_forward_flops_per_token(m, i, seq) for i in range(m.num_layers)]
        first, last = uneven_stages(m.num_layers, stages, costs, last_stage_extra_flops_per_token(m, seq))
    else:
        first, last = interleaved_edges(m.num_layers, stages)
    if first is None:
        return None
    return f"--set plan.first_stage_layers={first} --set plan.last_stage_layers={last}"


def one_stage_schedule(schedules: tuple[str, ...]) -> str | None:
    """The schedule a pp = 1 plan of gpipe or 1f1b takes, of the candidate `schedules`: 1f1b, else
    gpipe; None when neither is listed (interleaved-1f1b and zero-bubble need pp >= 2, so with pp = 1
    they stay invalid plans). With one stage there is no pipeline: Megatron-LM runs any pp = 1 plan with
    forward_backward_no_pipelining, each microbatch's forward then its backward
    (megatron/core/pipeline_parallel/schedules.py, get_forward_backward_func), which is 1F1B's order
    on one stage. GPipe's order (every forward, then every backward) does the same work with no
    pipeline to wait for, so the same step time, but holds every microbatch's activations instead
    of one: never better, so the space keeps one plan there, not two. The same schedule stands for
    both on more stages when a pipeline runs one microbatch, where the two orders are the same."""
    return next((s for s in ONE_STAGE_SCHEDULES if s in schedules), None)


def reason_key(reason: str) -> str:
    """The reason with its numbers replaced by '#': plans rejected for the same rule count together."""
    return re.sub(r"\b\d+(\.\d+)?\b", "#", reason)


class PlanSpace:
    """The candidates of one scenario's search: canonicalises, checks and enumerates plans."""

    def __init__(self, scenario: Scenario, spec: SearchSpec):
        from hwmodels.profile import load_profile

        self.scenario = scenario
        self.spec = spec
        gpu = load_profile(scenario.cluster.gpu)
        self._arch = gpu.arch
        self.memory_capacity = gpu.hbm_capacity
        """Bytes a GPU of the scenario's cluster holds."""
        self.memory_limit = gpu.hbm_capacity * (1 - spec.memory_headroom)
        """What a plan's peak memory must fit in: the capacity less search.memory_headroom."""
        # every plan field the search does not set keeps the scenario's (stages are derived in _make)
        self._template = scenario.plan
        self._cands = dict(spec.candidates)
        self._one_stage_schedule = one_stage_schedule(self._cands["schedule"])
        self._valid: dict[Candidate, bool] = {}
        # what uneven_stages balances the edge stages by: forward FLOPs per token of each layer, and
        # of the LM head and multi-token prediction modules the last stage adds
        m, seq = scenario.model, scenario.training.seq_length
        self._layer_costs = tuple(layer_forward_flops_per_token(m, i, seq) for i in range(m.num_layers))
        self._last_extra = last_stage_extra_flops_per_token(m, seq)
        self._splits: dict[int, tuple[int | None, int | None]] = {}

    # -- points ---------------------------------------------------------------------------------

    def free_knobs(self) -> tuple[str, ...]:
        """Knobs with more than one candidate: the parameters a sampler chooses."""
        return tuple(k for k, v in self.spec.candidates if len(v) > 1)

    def candidate(self, params: Mapping[str, Any]) -> Candidate:
        """The canonical candidate for sampled knob values (knobs not given take their only or
        first candidate; PIPELINE stands for the schedule and its virtual stages); dp is derived,
        0 when the world size is not divisible."""
        if PIPELINE in params:
            schedule, vpp = pipeline_parts(params[PIPELINE])
            params = {**params, "schedule": schedule, "virtual_pipeline_stages": vpp}
        v = {k: params.get(k, vals[0]) for k, vals in self.spec.candidates}
        world = v["num_nodes"] * self.scenario.cluster.gpus_per_node
        layout = v["tp"] * v["pp"] * v["cp"]
        dp = world // layout if world % layout == 0 else 0
        return self._make(v, dp)

    def _make(self, v: Mapping[str, Any], dp: int) -> Candidate:
        schedule = self._schedule(v["pp"], v["schedule"], self._microbatches(dp, v["micro_batch_size"]))
        vpp = EXACT_VIRTUAL.get(schedule, v["virtual_pipeline_stages"])  # zbv: 2, whatever was sampled
        virtual = schedule in VIRTUAL_SCHEDULES and vpp >= VIRTUAL_SCHEDULES[schedule]
        interleaved = virtual and vpp > 1
        sp = v["sequence_parallel"] if v["tp"] > 1 else self._cands["sequence_parallel"][0]
        etp = v["expert_tp"]
        zero = (v["zero_stage"] if self._zero_matters(v["tp"], dp, v["cp"], v["ep"], etp)
                else self._cands["zero_stage"][0])
        # with ep x expert_tp 1 no token leaves its rank: one plan, alltoall (Megatron's flex/DeepEP
        # dispatcher refuses ep x expert_tp = 1)
        dispatcher = v["moe_dispatcher"] if v["ep"] * etp > 1 else "alltoall"
        shared_overlap = v["moe_shared_expert_overlap"] and self._overlap_matters(v["ep"], dispatcher)
        recompute, modules = recompute_choice(v["recompute"])
        modules_run = self._modules(modules)
        ep_overlap = v["overlap_moe_expert_parallel_comm"] and self._ep_overlap_matters(
            v["ep"], shared_overlap, v["pp"], schedule, vpp, zero, recompute, modules_run)
        layers = self.scenario.model.num_layers
        if interleaved:
            first, last = interleaved_edges(layers, v["pp"] * vpp)
        else:
            first, last = self._split(v["pp"])
        # the exchange acts only with cp > 1: elsewhere one plan, the scenario's value
        cp_comm = v["cp_comm_type"] if v["cp"] > 1 else self._template.cp_comm_type
        # the scenario's a2a group size sizes hierarchical plans only (elsewhere it would be refused)
        a2a_size = self._template.cp_a2a_size if v["cp"] > 1 and cp_comm == "a2a+p2p" else None
        plan = dataclasses.replace(
            self._template, tp=v["tp"], pp=v["pp"], dp=dp, cp=v["cp"], cp_comm_type=cp_comm, cp_a2a_size=a2a_size,
            ep=v["ep"],
            expert_tp=etp, moe_dispatcher=dispatcher, moe_shared_expert_overlap=shared_overlap,
            overlap_moe_expert_parallel_comm=ep_overlap,
            first_stage_layers=first, last_stage_layers=last,
            micro_batch_size=v["micro_batch_size"], schedule=schedule,
            virtual_pipeline_stages=vpp if virtual else 1,
            sequence_parallel=sp, zero_stage=zero, recompute=recompute,
            recompute_modules=modules_run,
            tp_comm_overlap=self._template.tp_comm_overlap and sp and v["tp"] > 1,
            overlap_param_gather=self._template.overlap_param_gather and zero >= 1 and self._template.overlap_grad_reduce,
            # ZeRO-2/3 accumulate outside the GEMMs (Megatron-FSDP): a template's fusion applies to the other stages
            gradient_accumulation_fusion=(None if zero >= 2 and self._template.gradient_accumulation_fusion
                                          else self._template.gradient_accumulation_fusion),
        )
        return Candidate(num_nodes=v["num_nodes"], plan=plan)

    def _split(self, pp: int) -> tuple[int | None, int | None]:
        """The derived (first, last) stage layers of a non-interleaved plan with `pp` stages."""
        split = self._splits.get(pp)
        if split is None:  # depends on pp alone: once per pp, not per candidate
            split = self._splits[pp] = uneven_stages(self.scenario.model.num_layers, pp, self._layer_costs,
                                                      self._last_extra)
        return split

    def edge_layers(self, cand: Candidate) -> int | None:
        """The layers the first and last stages share when the candidate's uneven split is the one
        the space derives (uneven_stages, by the stages' FLOPs), else None (an even or interleaved
        split, or one a scenario set by hand): the plans whose split `with_first_layers` may move."""
        p = cand.plan
        if p.virtual_pipeline_stages > 1 or p.first_stage_layers is None:
            return None
        if (p.first_stage_layers, p.last_stage_layers) != self._split(p.pp):
            return None
        return p.first_stage_layers + p.last_stage_layers

    def with_first_layers(self, cand: Candidate, first: int) -> Candidate:
        """The candidate with `first` layers on its first stage and the rest of `edge_layers` on its last."""
        rest = self.edge_layers(cand)
        if rest is None or not 1 <= first < rest:
            raise ValueError(f"first stage layers {first}: the split of this plan cannot move there")
        plan = dataclasses.replace(cand.plan, first_stage_layers=first, last_stage_layers=rest - first)
        return Candidate(num_nodes=cand.num_nodes, plan=plan)

    def _schedule(self, pp: int, schedule: str, microbatches: int | None = None) -> str:
        """The canonical schedule: on one stage, or with one microbatch per pipeline (each stage
        runs its forward, then its backward), gpipe and 1f1b are one, the one-stage schedule."""
        if (pp == 1 or microbatches == 1) and self._one_stage_schedule and schedule in ONE_STAGE_SCHEDULES:
            return self._one_stage_schedule
        return schedule

    def _schedules(self, pp: int, microbatches: int | None = None) -> tuple[str, ...]:
        """The candidate schedules, canonical for plans with `pp` stages and `microbatches` (each once)."""
        return tuple(dict.fromkeys(self._schedule(pp, s, microbatches) for s in self._cands["schedule"]))

    def _microbatches(self, dp: int | None, mbs: int) -> int | None:
        """Microbatches per pipeline at data parallelism `dp` and micro-batch size `mbs`; None where
        dp is not known or the global batch does not divide (the plan is refused for that)."""
        gbs = self.scenario.training.global_batch_size
        return gbs // (dp * mbs) if dp and gbs % (dp * mbs) == 0 else None

    def baseline(self) -> Candidate:
        """The scenario's own plan, exactly as written."""
        return Candidate(num_nodes=self.scenario.cluster.num_nodes, plan=self.scenario.plan)

    def params_of(self, cand: Candidate) -> dict[str, Any]:
        """Every knob value of a candidate except the derived dp (the inverse of `candidate`). A
        knob that cannot act on the plan (the dispatcher at ep x expert_tp 1, the shared-expert overlap where
        _overlap_matters is false) gives its first candidate, which `candidate` maps back to the
        canonical value: so a sampler's choices, read from these, hold only candidates."""
        p = cand.plan
        c = self._cands
        return {"num_nodes": cand.num_nodes, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep,
                "micro_batch_size": p.micro_batch_size, "schedule": p.schedule,
                "virtual_pipeline_stages": p.virtual_pipeline_stages,
                "sequence_parallel": p.sequence_parallel, "zero_stage": p.zero_stage,
                "recompute": self._recompute_value(p), "expert_tp": p.expert_tp,
                "cp_comm_type": p.cp_comm_type if p.cp > 1 else c["cp_comm_type"][0],
                "moe_dispatcher": p.moe_dispatcher if p.ep * p.expert_tp > 1 else c["moe_dispatcher"][0],
                "moe_shared_expert_overlap": (p.moe_shared_expert_overlap if self._overlap_matters(p.ep, p.moe_dispatcher)
                                              else c["moe_shared_expert_overlap"][0]),
                "overlap_moe_expert_parallel_comm": (p.overlap_moe_expert_parallel_comm if self._plan_ep_overlap_matters(p)
                                                     else c["overlap_moe_expert_parallel_comm"][0])}

    def sampler_params(self, cand: Candidate) -> dict[str, Any]:
        """params_of with the schedule and its virtual stages as one PIPELINE value: the knobs a
        sampler draws."""
        params = self.params_of(cand)
        params[PIPELINE] = pipeline_value(params.pop("schedule"), params.pop("virtual_pipeline_stages"))
        return params

    def _recompute_value(self, p: PlanSpec) -> str:
        """The plan's search.recompute value: selective names its modules unless they are the scenario's."""
        if p.recompute == "selective" and set(p.recompute_modules) != set(self._template.recompute_modules):
            return _selective_of(p.recompute_modules)
        return p.recompute

    def valid(self, cand: Candidate) -> bool:
        """In the space and free of problems: a plan the search may simulate (memoised: samplers
        ask about the same neighbours again and again)."""
        ok = self._valid.get(cand)
        if ok is None:
            ok = self._valid[cand] = self.in_space(cand) and not self.problems(cand)
        return ok

    def in_space(self, cand: Candidate) -> bool:
        """Whether the candidate's knob values are all among the candidates (vpp: where the schedule
        takes virtual stages and runs more than one)."""
        p = cand.plan
        checks = {"num_nodes": cand.num_nodes, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep,
                  "micro_batch_size": p.micro_batch_size, "schedule": p.schedule,
                  "recompute": self._recompute_value(p), "expert_tp": p.expert_tp}
        if p.cp > 1:
            checks["cp_comm_type"] = p.cp_comm_type
        if p.ep * p.expert_tp > 1:
            checks["moe_dispatcher"] = p.moe_dispatcher
        if self._overlap_matters(p.ep, p.moe_dispatcher):
            checks["moe_shared_expert_overlap"] = p.moe_shared_expert_overlap
        if self._plan_ep_overlap_matters(p):
            checks["overlap_moe_expert_parallel_comm"] = p.overlap_moe_expert_parallel_comm
        if p.schedule in VIRTUAL_SCHEDULES and p.virtual_pipeline_stages > 1:
            checks["virtual_pipeline_stages"] = p.virtual_pipeline_stages
        if p.tp > 1:
            checks["sequence_parallel"] = p.sequence_parallel
        if self._zero_matters(p.tp, p.dp, p.cp, p.ep, p.expert_tp):
            checks["zero_stage"] = p.zero_stage
        return all(val in self._cands[k] for k, val in checks.items())

    def scenario_for(self, cand: Candidate) -> Scenario:
        """The base scenario with this candidate's cluster size and plan."""
        sc = self.scenario
        cluster = sc.cluster
        if cluster.num_nodes != cand.num_nodes:
            cluster = dataclasses.replace(cluster, num_nodes=cand.num_nodes)
        return dataclasses.replace(sc, cluster=cluster, plan=cand.plan)

    # -- validity -------------------------------------------------------------------------------

    def _world_problem(self, num_nodes: int, tp: int, pp: int, cp: int) -> str | None:
        """Why no dp completes the layout, or None when world / (tp x pp x cp) does."""
        gpn = self.scenario.cluster.gpus_per_node
        world = num_nodes * gpn
        if world % (tp * pp * cp) == 0:
            return None
        return (f"plan: tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp} does not divide the "
                f"{world} GPUs ({nodes_x_gpus(num_nodes, gpn)}), so no dp completes the plan")

    def _layout_problems(self, num_nodes: int, tp: int, pp: int, cp: int) -> list[str]:
        """The planner's own rules, which depend only on the layout: dp derivable, tp in a node."""
        out = []
        gpn = self.scenario.cluster.gpus_per_node
        world = num_nodes * gpn
        no_dp = self._world_problem(num_nodes, tp, pp, cp)
        if no_dp:
            out.append(no_dp)
        elif self.spec.dp_filter is not None and world // (tp * pp * cp) not in self.spec.dp_filter:
            out.append(f"search.dp: the derived dp = {world // (tp * pp * cp)} is not among the "
                       f"candidates {', '.join(map(str, self.spec.dp_filter))}")
        if not self.spec.allow_tp_across_nodes and (tp > gpn or gpn % tp):
            out.append(f"search.allow_tp_across_nodes: tp = {tp} would span nodes of {gpn} GPUs "
                       f"(tensor parallelism stays inside a node unless allowed)")
        return out

    def problems(self, cand: Candidate, *, planner_rules: bool = True) -> list[str]:
        """Every reason the candidate cannot run; empty when it can (then simulate it).
        `planner_rules=False` applies only the simulator's (for the scenario's own plan), and says
        why dp is 0 when it is (a plan planner/scenario.py let load although no dp completes it)."""
        from simulator.feasibility import structural_problems

        p = cand.plan
        if planner_rules:
            out = self._layout_problems(cand.num_nodes, p.tp, p.pp, p.cp)
        elif p.dp == 0:
            no_dp = self._world_problem(cand.num_nodes, p.tp, p.pp, p.cp)
            out = [no_dp or "plan.dp: expected a positive integer, got 0"]
        else:
            out = []
        if p.dp == 0:
            return out
        return out + structural_problems(self.scenario_for(cand), self._arch)

    # -- enumeration ----------------------------------------------------------------------------

    def _inner(self, tp: int, pp: int, dp: int | None, cp: int) -> Iterator[dict[str, Any]]:
        """Canonical combinations of the knobs below the layout."""
        c = self._cands
        sps = c["sequence_parallel"] if tp > 1 else c["sequence_parallel"][:1]
        cp_comms = c["cp_comm_type"] if cp > 1 else c["cp_comm_type"][:1]
        for (ep, etp, dispatcher, overlap), cp_comm in itertools.product(self._expert_settings(), cp_comms):
            zeros = c["zero_stage"] if self._zero_matters(tp, dp, cp, ep, etp) else c["zero_stage"][:1]
            for mbs in c["micro_batch_size"]:
                for schedule in self._schedules(pp, self._microbatches(dp, mbs)):
                    for vpp in self._vpps(schedule):
                        for sp in sps:
                            for zero in zeros:
                                for rc in c["recompute"]:
                                    recompute, modules = recompute_choice(rc)
                                    acts = self._ep_overlap_matters(
                                        ep, overlap, pp, schedule, vpp, zero, recompute,
                                        self._modules(modules))
                                    for ep_overlap in c["overlap_moe_expert_parallel_comm"] if acts else (False,):
                                        yield {"ep": ep, "expert_tp": etp, "moe_dispatcher": dispatcher,
                                               "cp_comm_type": cp_comm,
                                               "moe_shared_expert_overlap": overlap, "micro_batch_size": mbs,
                                               "schedule": schedule, "virtual_pipeline_stages": vpp,
                                               "sequence_parallel": sp, "zero_stage": zero, "recompute": rc,
                                               "overlap_moe_expert_parallel_comm": ep_overlap}

    def _expert_settings(self) -> Iterator[tuple[int, int, str, bool]]:
        """Canonical (ep, expert_tp, moe_dispatcher, moe_shared_expert_overlap) combinations: the
        dispatcher only with ep x expert_tp > 1, the shared-expert overlap only where it acts
        (_overlap_matters)."""
        c = self._cands
        for ep in c["ep"]:
            for etp in c["expert_tp"]:
                for dispatcher in c["moe_dispatcher"] if ep * etp > 1 else ("alltoall",):
                    overlaps = c["moe_shared_expert_overlap"] if self._overlap_matters(ep, dispatcher) else (False,)
                    for overlap in overlaps:
                        yield ep, etp, dispatcher, overlap

    def _overlap_matters(self, ep: int, dispatcher: str) -> bool:
        """Whether moe_shared_expert_overlap changes the plan: shared experts to overlap, a dispatch
        to overlap them with (ep > 1), and the alltoall dispatcher, the only one Megatron-Core
        overlaps them with (TransformerConfig: "moe_shared_expert_overlap only works with alltoall
        token dispatcher")."""
        moe = self.scenario.model.moe
        return moe is not None and moe.num_shared_experts > 0 and ep > 1 and dispatcher == "alltoall"

    def _ep_overlap_matters(self, ep: int, shared_overlap: bool, pp: int, schedule: str, vpp: int, zero: int,
                            recompute: str, modules: tuple[str, ...]) -> bool:
        """Whether overlap_moe_expert_parallel_comm can act on the plan: Megatron-Core runs combined
        1F1B only with expert parallelism, on one stage or under interleaved 1F1B, without full
        recompute, moe recompute or the shared-expert overlap, in 16-bit training, and paraplan
        models it with ZeRO 0/1 (simulator.feasibility). Elsewhere the plan runs without it (one
        plan, as tp_comm_overlap where sequence parallelism is off)."""
        return (self.scenario.model.moe is not None and ep > 1 and not shared_overlap and zero <= 1
                and _overlap_recompute(recompute, modules) and _overlap_schedule(pp, schedule, vpp)
                and self.scenario.training.precision in ("bf16", "fp16", "fp8"))

    def _modules(self, modules: tuple[str, ...] | None) -> tuple[str, ...]:
        """The modules a recompute candidate re-runs: its own, or the scenario's (recompute_choice None)."""
        return self._template.recompute_modules if modules is None else modules

    def _plan_ep_overlap_matters(self, p: PlanSpec) -> bool:
        return self._ep_overlap_matters(p.ep, p.moe_shared_expert_overlap, p.pp, p.schedule,
                                        p.virtual_pipeline_stages, p.zero_stage, p.recompute, p.recompute_modules)

    def _zero_matters(self, tp: int, dp: int | None, cp: int, ep: int, expert_tp: int) -> bool:
        """ZeRO shards over dp x cp and, for an MoE model, expert states over expert-dp =
        tp x cp x dp / (ep x expert_tp): with both groups of one there is nothing to shard, and the
        space keeps the first (lowest) candidate stage. The stages are not quite the same plan there
        (ZeRO-2/3 accumulate gradients outside the GEMMs, a little slower), but the lowest is never
        the slower one."""
        if dp is None or dp * cp != 1:
            return True
        return self.scenario.model.moe is not None and tp * cp * dp > ep * expert_tp

    def _vpps(self, schedule: str) -> list[int]:
        """The canonical virtual stages per rank of a schedule (zero-bubble's 1 counts once even
        where the candidates do not list it)."""
        return vpp_options(schedule, self._cands["virtual_pipeline_stages"])

    def _inner_count(self, tp: int, pp: int, dp: int | None, cp: int) -> int:
        """len(list(self._inner(...))), counted without building them: every combination once, and
        the EP-overlap candidates again where that knob acts (it acts on a product of conditions,
        _ep_overlap_matters, so the combinations where it does multiply out)."""
        c = self._cands
        n_sp = (len(c["sequence_parallel"]) if tp > 1 else 1) * (len(c["cp_comm_type"]) if cp > 1 else 1)
        extra = len(c["overlap_moe_expert_parallel_comm"]) - 1
        rcs = [recompute_choice(rc) for rc in c["recompute"]]
        total = 0
        for mbs in c["micro_batch_size"]:
            scheds = [(s, v) for s in self._schedules(pp, self._microbatches(dp, mbs)) for v in self._vpps(s)]
            for ep, etp, _, overlap in self._expert_settings():
                zeros = c["zero_stage"] if self._zero_matters(tp, dp, cp, ep, etp) else c["zero_stage"][:1]
                n = len(zeros) * len(scheds) * len(rcs)
                if extra and self._ep_overlap_matters(ep, overlap, 1, "1f1b", 1, 0, "none", ()):
                    n += extra * (sum(z <= 1 for z in zeros)
                                  * sum(_overlap_schedule(pp, s, v) for s, v in scheds)
                                  * sum(_overlap_recompute(r, self._modules(mods)) for r, mods in rcs))
                total += n_sp * n
        return total

    def _layouts(self) -> Iterator[tuple[int, int, int, int]]:
        c = self._cands
        for n in c["num_nodes"]:
            for tp in c["tp"]:
                for pp in c["pp"]:
                    for cp in c["cp"]:
                        yield n, tp, pp, cp

    def count_combinations(self) -> int:
        """Candidate plans whose layout passes the planner's rules (the enumeration's work)."""
        gpn = self.scenario.cluster.gpus_per_node
        total = 0
        for n, tp, pp, cp in self._layouts():
            if not self._layout_problems(n, tp, pp, cp):
                total += self._inner_count(tp, pp, n * gpn // (tp * pp * cp), cp)
        return total

    def enumerate(self) -> Enumeration:
        """Check every candidate plan: layouts first by the planner's rules (a rejected layout
        rejects all its plans without building them), then each plan by the simulator's."""
        from simulator.feasibility import structural_problems

        gpn = self.scenario.cluster.gpus_per_node
        counts: Counter = Counter()
        examples: dict[str, str] = {}
        valid: list[Candidate] = []
        combos = 0

        def reject(reasons: list[str], weight: int) -> None:
            for r in reasons:
                key = reason_key(r)
                counts[key] += weight
                examples.setdefault(key, r)

        for n, tp, pp, cp in self._layouts():
            world = n * gpn
            dp = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else None
            bad = self._layout_problems(n, tp, pp, cp)
            if bad:
                weight = self._inner_count(tp, pp, dp, cp)
                combos += weight
                reject(bad, weight)
                continue
            sc = self.scenario_for(Candidate(num_nodes=n, plan=self._template))
            for inner in self._inner(tp, pp, dp, cp):
                combos += 1
                cand = self._make({"num_nodes": n, "tp": tp, "pp": pp, "cp": cp, **inner}, dp)
                problems = structural_problems(dataclasses.replace(sc, plan=cand.plan), self._arch)
                if problems:
                    reject(problems, 1)
                else:
                    valid.append(cand)
        rejections = tuple(
            Rejection(reason=k, count=v, example=examples[k])
            for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        return Enumeration(valid=tuple(valid), combinations=combos, rejections=rejections)


def binding_constraint(enum: Enumeration) -> str:
    """One line on why a space has no valid plan: the rule every candidate breaks if there is
    one, else the most frequent; each with one plan's reason as the example (`Rejection`)."""
    if not enum.rejections:
        return "the search section leaves no candidate plan"
    top = enum.rejections[0]
    if top.count >= enum.combinations:
        return f"every one of the {enum.combinations} candidate plans fails the same rule, e.g. {top.example}"
    rest = "; ".join(f"{r.count} another, e.g. {r.example}" for r in enum.rejections[1:3])
    return (f"none of the {enum.combinations} candidate plans is valid; {top.count} fail one rule, "
            f"e.g. {top.example}" + (f"; {rest}" if rest else ""))
