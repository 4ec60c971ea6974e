"""The plan space (search section, canonical plans, validity, enumeration) and the objective."""
import dataclasses
import itertools
import math
from pathlib import Path

import pytest

from paraplan.errors import ConfigError
from paraplan.loader import load_scenario
from paraplan.specs import PlanSpec
from planner.objective import Evaluation, Evaluator, make_objective, pareto_front
from planner.scenario import load_for_planning
from planner.space import (
    DEFAULT_EXHAUSTIVE_THRESHOLD, DEFAULT_TRIALS, Candidate, PlanSpace, binding_constraint, parse_search,
    interleaved_edges, pipeline_parts, reason_key, uneven_stages,
)
from simulator.feasibility import structural_problems
from simulator.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "scenarios" / "tiny-gpt-8xa100.yaml"
SMALL = ["search.micro_batch_size=[1, 2]", "search.cp=[1]", "search.zero_stage=[1, 3]"]


def tiny(*overrides):
    return load_scenario(TINY, list(overrides))


def space(*overrides):
    sc = tiny(*overrides)
    return PlanSpace(sc, parse_search(sc))


# -- the search section -----------------------------------------------------------------------

BAD_SEARCH = [
    ("search.tpp=[2]", "search.tpp: unknown key, did you mean 'tp'?"),
    ("search.tp=[eight]", "search.tp: expected positive integers, got 'eight'"),
    ("search.tp=[0, 2]", "search.tp: expected positive integers, got 0"),
    ("search.tp=[2, 2]", "search.tp: candidate 2 is listed twice"),
    ("search.tp=[]", "search.tp: expected at least one candidate"),
    ("search.schedule=[1f1b, zb]", "search.schedule: 'zb' is not one of gpipe, 1f1b, interleaved-1f1b"),
    ("search.schedule=[interleaved]", "did you mean 'interleaved-1f1b'?"),
    ("search.recompute=[partial]", "search.recompute: 'partial' is not one of none, selective, full"),
    ("search.recompute=[selective(mlp+attn)]", "search.recompute: 'selective(mlp+attn)': 'attn' is not a recompute "
                                               "module, did you mean"),
    ("search.recompute=[selective()]", "search.recompute: 'selective()': name at least one module"),
    ("search.recompute=[selective(core_attn,mlp)]", "a comma inside [..] splits the candidate: write "
                                                    "selective(core_attn+mlp), or quote it"),
    ("search.recompute=[selective(mlp+mlp)]", "search.recompute: 'selective(mlp+mlp)': a module is listed twice"),
    ("search.recompute=[selective, selective(core_attn)]", "search.recompute: selective(core_attn) is the scenario's "
                                                           "plan.recompute_modules, which selective already recomputes"),
    ("search.recompute=[selective(mlp+core_attn), selective(core_attn+mlp)]",
     "search.recompute: candidate 'selective(core_attn,mlp)' is listed twice"),
    # layernorm frees nothing in a dense model without MLA (its norms are fused into the linears)
    ("search.recompute=[none, selective(layernorm)]", "search.recompute: selective(layernorm) runs as none: layernorm "
                                                      "recomputes nothing in a dense model without MLA"),
    ("search.zero_stage=[true]", "search.zero_stage: true is not one of 0, 1, 2, 3"),
    ("search.sequence_parallel=[yes please]", "search.sequence_parallel: 'yes please' is not one of false, true"),
    ("search.trials=0", "search.trials: expected a positive integer, got 0"),
    ("search.exhaustive_threshold=lots", "search.exhaustive_threshold: expected an integer >= 0"),
    ("search.allow_tp_across_nodes=1", "search.allow_tp_across_nodes: expected true or false, got 1"),
    ("search.gpu_hour_cost=-2", "search.gpu_hour_cost: expected a positive number, got -2"),
    ("search.ep=[1, 2]", "search.ep: expert parallelism needs an MoE model (model.moe); this model is dense"),
    ("search.tp={a: 1}", "search.tp: expected a list of candidates (or one value), got a mapping"),
    ("search.expert_tp=[1, 2]", "search.expert_tp: expert_tp needs an MoE model (model.moe); this model is dense"),
    ("search.moe_dispatcher=[deepep]", "search.moe_dispatcher: moe_dispatcher needs an MoE model"),
    ("search.moe_shared_expert_overlap=[false, true]", "search.moe_shared_expert_overlap: moe_shared_expert_overlap "
                                                       "needs an MoE model"),
    ("search.moe_dispatcher=[deep-ep]", "search.moe_dispatcher: 'deep-ep' is not one of alltoall, deepep, did you "
                                        "mean 'deepep'?"),
    ("search.expert_tp=[0]", "search.expert_tp: expected positive integers, got 0"),
    ("search.num_nodes=[1000000000000]", "search.num_nodes: expected integers up to 2**20, got 1000000000000"),
]


def test_layernorm_recompute_is_dropped_where_it_frees_nothing():
    """A dense model without MLA fuses each norm into the linear it feeds, so selective(mlp+layernorm)
    runs as selective(mlp) and selective(layernorm) as none (they had been simulated and ranked
    as plans of their own, with the same figures)."""
    spec = parse_search(tiny("search.recompute=[selective(layernorm), selective(mlp+layernorm)]"))
    assert spec.values("recompute") == ("none", "selective(mlp)")
    moe = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml", ["search.recompute=[selective(layernorm)]"])
    assert parse_search(moe).values("recompute") == ("selective(layernorm)",)  # an MoE layer's pre-MLP norm


@pytest.mark.parametrize("override,message", BAD_SEARCH, ids=[o for o, _ in BAD_SEARCH])
def test_bad_search_sections_name_the_key(override, message):
    sc = tiny(override)
    with pytest.raises(ConfigError) as e:
        parse_search(sc)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_absent_knobs_take_their_full_valid_range():
    sc = tiny()
    spec = parse_search(sc)
    assert spec.values("tp") == (1, 2, 4, 8)                 # divisors of 8 that fit in a node
    assert spec.values("pp") == (1, 2, 4)                    # divisors of 8 up to num_layers (4)
    assert spec.values("cp") == (1, 2, 4, 8)
    assert spec.values("micro_batch_size") == (1, 2, 4, 8, 16)
    assert spec.values("num_nodes") == (1,)
    assert spec.values("ep") == (1,)                         # dense model
    assert spec.values("zero_stage") == (0, 1, 2, 3)
    # zero-bubble only when listed: the Megatron-LM arguments the planner writes cannot run it
    assert spec.values("schedule") == ("gpipe", "1f1b", "interleaved-1f1b")
    assert parse_search(tiny("search.schedule=[1f1b, zero-bubble]")).values("schedule") == ("1f1b", "zero-bubble")
    assert parse_search(tiny("search.schedule=[zbv]")).values("schedule") == ("zbv",)
    assert parse_search(tiny("search.schedule=[dualpipev]")).values("schedule") == ("dualpipev",)
    assert spec.trials == DEFAULT_TRIALS and spec.exhaustive_threshold == DEFAULT_EXHAUSTIVE_THRESHOLD
    assert spec.allow_tp_across_nodes is False and spec.gpu_hour_cost is None


def test_given_knobs_and_settings():
    spec = parse_search(tiny("search.tp=4", "search.trials=50", "search.gpu_hour_cost=2.5",
                             "search.allow_tp_across_nodes=true"))
    assert spec.values("tp") == (4,) and spec.trials == 50 and spec.gpu_hour_cost == 2.5
    assert spec.allow_tp_across_nodes and spec.given == ("tp",)


def test_moe_model_offers_expert_parallelism():
    sc = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml")
    spec = parse_search(sc, {})
    assert spec.values("ep") == (1, 2, 4, 8)                # divisors of 64 GPUs that divide 8 experts


MIXTRAL_FIXED = ["search.tp=[1, 2]", "search.pp=[4]", "search.cp=[1]", "search.micro_batch_size=[1]",
                 "search.schedule=[1f1b]", "search.sequence_parallel=[true]", "search.zero_stage=[1]",
                 "search.recompute=[none]"]


def test_moe_knobs_keep_the_scenarios_values_unless_listed():
    sc = load_scenario(ROOT / "scenarios" / "qwen3-235b-256xh100.yaml")
    spec = parse_search(sc, {})
    assert (spec.values("expert_tp"), spec.values("moe_dispatcher"), spec.values("moe_shared_expert_overlap")) == \
        ((1,), ("deepep",), (False,))
    listed = parse_search(sc, {"expert_tp": [2, 1], "moe_dispatcher": ["deepep", "alltoall"]})
    assert listed.values("expert_tp") == (1, 2) and listed.values("moe_dispatcher") == ("alltoall", "deepep")
    assert listed.given == ("expert_tp", "moe_dispatcher")


def test_moe_knobs_are_searched_where_they_change_the_plan():
    """expert_tp, the dispatcher and the shared-expert overlap are knobs: each valid combination is
    one plan, the dispatcher only where tokens leave their rank (ep x expert_tp > 1: DeepEP runs
    over the expert-TP x EP group), the overlap only where
    Megatron-Core runs it (shared experts, alltoall); enumerate agrees with the count and every plan
    maps back to its knob values."""
    mixtral = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml",
                            [*MIXTRAL_FIXED, "search.ep=[1, 8]", "search.expert_tp=[1, 2]",
                             "search.moe_dispatcher=[alltoall, deepep]"])
    sp = PlanSpace(mixtral, parse_search(mixtral))
    found = sp.enumerate()
    assert sp.count_combinations() == found.combinations
    plans = {(c.plan.tp, c.plan.ep, c.plan.expert_tp, c.plan.moe_dispatcher, c.plan.moe_shared_expert_overlap)
             for c in found.valid}
    # ep x expert_tp 1: one dispatcher, alltoall (no token leaves its rank; DeepEP's dispatcher
    # refuses one rank)
    assert plans == {(tp, ep, etp, d, False) for tp in (1, 2) for ep in (1, 8) for etp in (1, 2)
                     for d in (("alltoall",) if ep * etp == 1 else ("alltoall", "deepep")) if ep * etp <= 16 * tp}
    for c in found.valid:
        assert sp.candidate(sp.params_of(c)) == c and sp.in_space(c)
    base = {"tp": 1, "pp": 4, "cp": 1, "micro_batch_size": 1, "schedule": "1f1b", "zero_stage": 1, "recompute": "none"}
    assert sp.candidate({**base, "ep": 1, "expert_tp": 1, "moe_dispatcher": "deepep"}).plan.moe_dispatcher == "alltoall"
    # a model with shared experts overlaps them with the alltoall dispatch only
    shared = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml",
                           [*MIXTRAL_FIXED, "search.tp=[1]", "search.ep=[8]", "model.moe.num_shared_experts=1",
                            "search.moe_dispatcher=[alltoall, deepep]", "search.moe_shared_expert_overlap=[false, true]"])
    sp = PlanSpace(shared, parse_search(shared))
    got = {(c.plan.moe_dispatcher, c.plan.moe_shared_expert_overlap) for c in sp.enumerate().valid}
    assert got == {("alltoall", False), ("alltoall", True), ("deepep", False)}
    assert sp.count_combinations() == 3


def test_the_cp_exchange_is_searched_only_where_context_parallelism_runs():
    """plan.cp_comm_type keeps the scenario's value unless listed; listed, it is a knob of the plans
    with cp > 1 only (at cp 1 every exchange is one plan, the first candidate); a2a plans whose
    heads do not split over cp are invalid; enumerate agrees with the count, every plan maps back
    to its knob values, and a sampler reaches exactly the enumerated plans."""
    import itertools

    from planner.search import _knob_choices

    fixed = ["search.pp=[4]", "search.micro_batch_size=[1]", "search.schedule=[1f1b]", "search.zero_stage=[1]",
             "search.recompute=[selective]", "search.sequence_parallel=[true]", "training.seq_length=32768",
             "training.global_batch_size=256"]
    sc = load_scenario(ROOT / "scenarios" / "llama3-70b-1024xh100.yaml", [*fixed, "search.tp=[2, 8]", "search.cp=[1, 4]"])
    assert parse_search(sc).values("cp_comm_type") == ("p2p",)
    listed = load_scenario(ROOT / "scenarios" / "llama3-70b-1024xh100.yaml",
                           [*fixed, "search.tp=[2, 8]", "search.cp=[1, 4]", "search.cp_comm_type=[p2p, all_gather, a2a]"])
    sp = PlanSpace(listed, parse_search(listed))
    found = sp.enumerate()
    assert sp.count_combinations() == found.combinations
    got = {(c.plan.tp, c.plan.cp, c.plan.cp_comm_type) for c in found.valid}
    # a2a at tp 8, cp 4: 8 KV heads do not split over 32 ranks
    assert got == {(2, 1, "p2p"), (8, 1, "p2p"), (2, 4, "p2p"), (2, 4, "all_gather"), (2, 4, "a2a"),
                   (8, 4, "p2p"), (8, 4, "all_gather")}
    for c in found.valid:
        assert sp.candidate(sp.params_of(c)) == c and sp.in_space(c)
    choices, knobs = _knob_choices(sp, found)
    reached = set()
    for combo in itertools.product(*choices.values()):
        c = sp.candidate({**knobs, **dict(zip(choices, combo))})
        if c.plan.dp and not sp.problems(c):
            reached.add(c)
    assert reached == set(found.valid)
    with pytest.raises(ConfigError, match="search.cp_comm_type: 'allgather' is not one of p2p, all_gather, a2a, a2a\\+p2p, "
                                          "did you mean 'all_gather'"):
        parse_search(sc, {"cp_comm_type": ["allgather"]})


def test_a_scenarios_a2a_group_size_sizes_only_the_hierarchical_plans_of_a_search():
    """plan.cp_a2a_size belongs to a2a+p2p plans with cp > 1: the search's other plans (cp 1, the
    ring) run without it instead of being refused for carrying it; a candidate cp it does not
    divide is refused with that reason."""
    sc = load_scenario(ROOT / "scenarios" / "llama3-8b-64xh100.yaml", [
        "training.seq_length=131072", "training.global_batch_size=64", "plan.cp=8", "plan.dp=null",
        "plan.recompute=full", "plan.cp_comm_type=a2a+p2p", "plan.cp_a2a_size=4", "search.tp=[1]", "search.pp=[1]",
        "search.cp=[1, 2, 4, 8]", "search.cp_comm_type=[p2p, a2a+p2p]", "search.micro_batch_size=[1]",
        "search.zero_stage=[3]", "search.recompute=[full]", "search.schedule=[1f1b]"])
    sp = PlanSpace(sc, parse_search(sc))
    found = sp.enumerate()
    got = {(c.plan.cp, c.plan.cp_comm_type, c.plan.cp_a2a_size) for c in found.valid}
    assert got == {(1, "a2a+p2p", None), (2, "p2p", None), (4, "p2p", None), (8, "p2p", None),
                   (4, "a2a+p2p", 4), (8, "a2a+p2p", 4)}
    assert [r.example for r in found.rejections] == ["plan.cp_a2a_size: 4 does not divide cp = 2 (a2a groups x ring = "
                                                     "cp, Megatron --hierarchical-context-parallel-sizes)"]


def test_the_ep_overlap_is_searched_only_where_megatron_core_runs_it():
    """overlap_moe_expert_parallel_comm is a knob where combined 1F1B can run (ep > 1, one stage
    or interleaved 1F1B, no full recompute): elsewhere every plan is one plan, without it; enumerate
    agrees with the count, every plan maps back to its knob values, and a scenario that sets it
    keeps it exactly where it can act."""
    mixtral = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml",
                            ["search.tp=[1]", "search.pp=[1, 4]", "search.cp=[1]", "search.micro_batch_size=[1]",
                             "search.schedule=[1f1b, interleaved-1f1b]", "search.virtual_pipeline_stages=[2]",
                             "search.sequence_parallel=[true]", "search.zero_stage=[1]",
                             "search.recompute=[none, full]", "search.ep=[1, 8]",
                             "search.overlap_moe_expert_parallel_comm=[false, true]"])
    sp = PlanSpace(mixtral, parse_search(mixtral))
    found = sp.enumerate()
    assert sp.count_combinations() == found.combinations
    on = {(c.plan.pp, c.plan.ep, c.plan.schedule, c.plan.recompute) for c in found.valid
          if c.plan.overlap_moe_expert_parallel_comm}
    assert on == {(1, 8, "1f1b", "none"), (4, 8, "interleaved-1f1b", "none")}
    assert len(found.valid) == len(set(found.valid))
    for c in found.valid:
        assert sp.candidate(sp.params_of(c)) == c and sp.in_space(c)
    base = {"tp": 1, "pp": 4, "cp": 1, "ep": 8, "micro_batch_size": 1, "zero_stage": 1,
            "overlap_moe_expert_parallel_comm": True}
    assert not sp.candidate({**base, "schedule": "1f1b", "recompute": "none"}).plan.overlap_moe_expert_parallel_comm
    assert sp.candidate({**base, "schedule": "interleaved-1f1b", "virtual_pipeline_stages": 2,
                         "recompute": "none"}).plan.overlap_moe_expert_parallel_comm
    # set in the scenario and not listed: on wherever it can act, off elsewhere, never a rejected plan
    fixed = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml",
                          ["plan.overlap_moe_expert_parallel_comm=true", "search.tp=[1]", "search.pp=[1, 4]",
                           "search.cp=[1]", "search.micro_batch_size=[1]", "search.zero_stage=[1]",
                           "search.schedule=[1f1b, interleaved-1f1b]", "search.virtual_pipeline_stages=[2]"])
    sp = PlanSpace(fixed, parse_search(fixed))
    found = sp.enumerate()
    assert not any("overlap_moe_expert_parallel_comm" in r.reason for r in found.rejections)
    assert {c.plan.overlap_moe_expert_parallel_comm for c in found.valid} == {False, True}
    with pytest.raises(ConfigError, match="search.overlap_moe_expert_parallel_comm: overlap_moe_expert_parallel_comm "
                                          "needs an MoE model"):
        parse_search(tiny(), {"overlap_moe_expert_parallel_comm": [True]})


DEEPSEEK_FIXED = ["search.pp=[16]", "search.tp=[1]", "search.cp=[1]", "search.micro_batch_size=[1]",
                  "search.schedule=[1f1b]", "search.recompute=[full]", "search.zero_stage=[1]"]


@pytest.mark.parametrize("overrides", [
    ["plan.moe_dispatcher=alltoall", "search.ep=[1, 8, 64]", "search.moe_shared_expert_overlap=[true]"],
    ["plan.moe_dispatcher=alltoall", "plan.moe_shared_expert_overlap=true", "search.ep=[1, 8, 64]"],
    ["search.ep=[8, 64]", "search.moe_dispatcher=[alltoall, deepep]", "search.moe_shared_expert_overlap=[true]"],
    ["search.ep=[1, 8, 64]", "search.moe_dispatcher=[deepep]", "search.expert_tp=[1, 2]"],
    ["search.ep=[1, 8]", "search.moe_dispatcher=[alltoall, deepep]", "search.moe_shared_expert_overlap=[false, true]"],
], ids=["overlap-true", "plan-overlap", "overlap-true-deepep", "deepep-etp", "all"])
def test_a_sampler_proposes_only_plans_of_the_space(overrides):
    """Every combination of the knob values a sampler chooses from is either invalid or a plan of
    the space: a canonical value (the overlap where it cannot act, the dispatcher at ep 1) is never
    offered as a choice of its own, so TPE cannot simulate a plan the search section excludes."""
    from planner.search import _knob_choices

    sc = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml", [*DEEPSEEK_FIXED, *overrides])
    sp = PlanSpace(sc, parse_search(sc))
    found = sp.enumerate()
    choices, fixed = _knob_choices(sp, found)
    for k, vals in choices.items():
        if k == "pipeline":
            assert {pipeline_parts(v)[0] for v in vals} <= set(sp.spec.values("schedule"))
            continue
        assert set(vals) <= set(sp.spec.values(k)), k
    reached = set()
    for combo in itertools.product(*choices.values()):
        c = sp.candidate({**fixed, **dict(zip(choices, combo))})
        if c.plan.dp and not sp.problems(c):
            assert sp.in_space(c), c.plan
            reached.add(c)
    assert reached == set(found.valid)
    assert all(c.plan.moe_dispatcher == "alltoall" for c in found.valid if c.plan.ep * c.plan.expert_tp == 1)


def test_deepep_needs_more_than_one_rank_to_dispatch_to():
    """Megatron-Core's flex dispatcher (DeepEP's) asserts tp x ep > 1 over the expert groups."""
    sc = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml", ["plan.ep=1"])
    assert any(r.startswith("plan.moe_dispatcher: deepep needs ep x expert_tp > 1") for r in structural_problems(sc))
    ok = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml", ["plan.ep=1", "plan.moe_dispatcher=alltoall"])
    assert not [r for r in structural_problems(ok) if r.startswith("plan.moe_dispatcher")]


def test_the_overlap_knob_needs_shared_experts():
    sc = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml", ["search.moe_shared_expert_overlap=[false, true]"])
    with pytest.raises(ConfigError, match=r"^search.moe_shared_expert_overlap: true needs shared experts"):
        parse_search(sc)
    assert parse_search(sc, {"moe_shared_expert_overlap": [False]}).values("moe_shared_expert_overlap") == (False,)


def test_a_study_from_before_the_moe_knobs_keeps_its_fingerprint():
    """The MoE knobs a search leaves out are the plan's values, which the fingerprint already holds:
    without them in the key, a study made before they were knobs can be resumed."""
    from planner.search import fingerprint

    sc = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml")
    spec = parse_search(sc)
    older = dataclasses.replace(spec, candidates=tuple((k, v) for k, v in spec.candidates if not k.startswith(
        ("expert_tp", "moe_"))))
    obj = make_objective("throughput")
    assert fingerprint(sc, spec, obj, "tpe", ()) == fingerprint(sc, older, obj, "tpe", ())
    listed = parse_search(sc, {"expert_tp": [1, 2]})
    assert fingerprint(sc, listed, obj, "tpe", ()) != fingerprint(sc, spec, obj, "tpe", ())


def test_expert_tp_and_the_dispatcher_reach_the_simulation():
    """The searched MoE settings are what is simulated: expert tensor parallelism changes the expert
    GEMMs and the memory, and DeepEP across nodes moves fewer bytes than the all-to-all."""
    sc = load_scenario(ROOT / "scenarios" / "qwen3-235b-256xh100.yaml",
                       ["search.tp=[2]", "search.pp=[8]", "search.cp=[1]", "search.ep=[16]", "search.expert_tp=[1, 2]",
                        "search.moe_dispatcher=[alltoall, deepep]", "search.micro_batch_size=[1]",
                        "search.schedule=[interleaved-1f1b]", "search.virtual_pipeline_stages=[4]",
                        "search.sequence_parallel=[true]", "search.zero_stage=[1]", "search.recompute=[full]"])
    sp = PlanSpace(sc, parse_search(sc))
    ev = Evaluator(sp)
    got = {(c.plan.expert_tp, c.plan.moe_dispatcher): ev.evaluate(c) for c in sp.enumerate().valid}
    assert set(got) == {(1, "alltoall"), (1, "deepep"), (2, "alltoall"), (2, "deepep")}
    assert dict(got[1, "deepep"].breakdown)["ep_comm"] < dict(got[1, "alltoall"].breakdown)["ep_comm"]
    assert got[2, "deepep"].peak_memory_bytes < got[1, "deepep"].peak_memory_bytes  # experts split 2 ways


def test_selective_recompute_of_named_modules_is_a_candidate_of_its_own():
    """search.recompute may name modules (Megatron --recompute-modules): such a candidate sets
    plan.recompute_modules, the others keep the scenario's; a plan maps back to its candidate."""
    sc = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml",
                       ["search.recompute=[none, selective, 'selective(moe_act, layernorm)']", "search.tp=[1]",
                        "search.pp=[4]", "search.cp=[1]", "search.ep=[8]", "search.micro_batch_size=[1]",
                        "search.schedule=[1f1b]", "search.sequence_parallel=[false]", "search.zero_stage=[1]"])
    sp = PlanSpace(sc, parse_search(sc))
    assert sp.spec.values("recompute") == ("none", "selective", "selective(layernorm,moe_act)")  # one order per set
    plans = {sp.params_of(c)["recompute"]: c.plan for c in sp.enumerate().valid}
    assert set(plans) == {"none", "selective", "selective(layernorm,moe_act)"}
    assert plans["selective(layernorm,moe_act)"].recompute_modules == ("layernorm", "moe_act")
    assert plans["selective"].recompute_modules == sc.plan.recompute_modules
    assert plans["none"].recompute_modules == sc.plan.recompute_modules  # one plan, whatever the modules
    for plan in plans.values():
        cand = Candidate(num_nodes=sc.cluster.num_nodes, plan=plan)
        assert sp.candidate(sp.params_of(cand)) == cand and sp.in_space(cand)
    # the spelling for a [..] list, where a comma would split the candidate, is the same candidate
    plus = parse_search(sc, {"recompute": ["selective(moe_act+layernorm)"]})
    assert plus.values("recompute") == ("selective(layernorm,moe_act)",)
    none, moe_act = (simulate(sp.scenario_for(Candidate(num_nodes=sc.cluster.num_nodes, plan=plans[k])))
                     for k in ("none", "selective(layernorm,moe_act)"))
    assert moe_act.peak_memory_bytes < none.peak_memory_bytes and moe_act.step_time_s > none.step_time_s


# -- canonical plans and validity ---------------------------------------------------------------


def test_zero_bubble_is_searched_with_one_and_with_several_stages_per_rank():
    """Zero-bubble runs one stage per rank (ZB-H1) or several (the interleaved B/W split); both are
    candidates when the search lists virtual stages, and enumerate agrees with the count."""
    sp = space("search.schedule=[zero-bubble, interleaved-1f1b]", "search.virtual_pipeline_stages=[2]",
               "search.pp=[2]", "search.tp=[1]", "search.cp=[1]")
    found = sp.enumerate()
    plans = [c.plan for c in found.valid]
    zb = sorted({p.virtual_pipeline_stages for p in plans if p.schedule == "zero-bubble"})
    il = sorted({p.virtual_pipeline_stages for p in plans if p.schedule == "interleaved-1f1b"})
    assert zb == [1, 2] and il == [2]
    assert sp.count_combinations() == found.combinations
    two = sp.candidate({"tp": 1, "pp": 2, "cp": 1, "micro_batch_size": 1, "schedule": "zero-bubble",
                        "virtual_pipeline_stages": 2, "sequence_parallel": False, "zero_stage": 1, "recompute": "none"})
    assert two.plan.virtual_pipeline_stages == 2 and sp.in_space(two)


def test_zbv_is_searched_at_exactly_two_stages_per_rank():
    """ZB-V places two chunks per rank in a V and no other number: among the listed virtual stages
    it takes 2 only, enumerate agrees with the count, and a list without 2 is a one-line error."""
    sp = space("model.num_layers=8", "search.schedule=[zbv, interleaved-1f1b]",
               "search.virtual_pipeline_stages=[2, 4]", "search.pp=[2]", "search.tp=[1]", "search.cp=[1]")
    found = sp.enumerate()
    plans = [c.plan for c in found.valid]
    assert sorted({p.virtual_pipeline_stages for p in plans if p.schedule == "zbv"}) == [2]
    assert sorted({p.virtual_pipeline_stages for p in plans if p.schedule == "interleaved-1f1b"}) == [2, 4]
    assert sp.count_combinations() == found.combinations
    # a sampler that draws schedule and virtual stages apart proposes zbv x1 or x4: both are zbv x2
    base = {"tp": 1, "pp": 2, "cp": 1, "micro_batch_size": 1, "schedule": "zbv", "sequence_parallel": False,
            "zero_stage": 1, "recompute": "none"}
    for vpp in (1, 2, 4):
        cand = sp.candidate({**base, "virtual_pipeline_stages": vpp})
        assert cand.plan.virtual_pipeline_stages == 2 and sp.valid(cand)
    with pytest.raises(ConfigError, match="schedule zbv takes exactly 2 virtual stages per rank"):
        space("search.schedule=[zbv]", "search.virtual_pipeline_stages=[4]")
    # DualPipeV too: its V, two chunks per rank
    sp = space("model.num_layers=8", "search.schedule=[dualpipev]", "search.virtual_pipeline_stages=[2, 4]",
               "search.pp=[2]", "search.tp=[1]", "search.cp=[1]")
    found = sp.enumerate()
    assert found.valid and {c.plan.virtual_pipeline_stages for c in found.valid} == {2}
    assert sp.count_combinations() == found.combinations
    assert sp.candidate({**base, "schedule": "dualpipev", "virtual_pipeline_stages": 4}).plan.virtual_pipeline_stages == 2


def test_candidates_are_canonical():
    sp = space()
    base = {"tp": 1, "pp": 2, "cp": 1, "micro_batch_size": 1, "schedule": "1f1b", "recompute": "none"}
    a = sp.candidate({**base, "virtual_pipeline_stages": 4, "sequence_parallel": True, "zero_stage": 1})
    b = sp.candidate({**base, "virtual_pipeline_stages": 2, "sequence_parallel": False, "zero_stage": 1})
    assert a == b                                            # vpp ignored off interleaved, sp off at tp 1
    assert a.plan.virtual_pipeline_stages == 1 and a.plan.sequence_parallel is False
    assert a.plan.dp == 4                                    # derived: 8 / (1 x 2 x 1)
    one = sp.candidate({**base, "tp": 8, "pp": 1, "zero_stage": 3, "sequence_parallel": True})
    assert one.plan.dp == 1 and one.plan.zero_stage == 0     # nothing to shard over
    assert sp.candidate({**base, "tp": 4, "pp": 4, "cp": 2}).plan.dp == 0  # 32 does not divide 8


def test_overlap_param_gather_is_applied_only_where_megatron_allows_it():
    sp = space("plan.overlap_grad_reduce=true", "plan.overlap_param_gather=true")
    base = {"tp": 1, "pp": 2, "cp": 1, "micro_batch_size": 1, "schedule": "1f1b", "recompute": "none"}
    assert sp.candidate({**base, "zero_stage": 1}).plan.overlap_param_gather is True
    zero0 = sp.candidate({**base, "zero_stage": 0})
    assert zero0.plan.overlap_param_gather is False and sp.problems(zero0) == []
    no_grad_overlap = space("plan.overlap_grad_reduce=false", "plan.overlap_param_gather=true",
                            "plan.zero_stage=1")
    assert no_grad_overlap.candidate({**base, "zero_stage": 1}).plan.overlap_param_gather is False
    assert any(r.startswith("plan.overlap_param_gather: needs overlap_grad_reduce")
               for r in structural_problems(no_grad_overlap.scenario))


def test_a_templates_gradient_accumulation_fusion_does_not_rule_out_zero_2_and_3():
    """Megatron-FSDP (ZeRO-2/3) accumulates outside the GEMMs: the template's fusion holds for the
    other ZeRO stages and is left to ZeRO-2/3's own default there, not a reason to refuse them."""
    sp = space("plan.gradient_accumulation_fusion=true")
    base = {"tp": 1, "pp": 2, "cp": 1, "micro_batch_size": 1, "schedule": "1f1b", "recompute": "none"}
    one = sp.candidate({**base, "zero_stage": 1})
    assert one.plan.gradient_accumulation_fusion is True
    for zero in (2, 3):
        c = sp.candidate({**base, "zero_stage": zero})
        assert c.plan.fused_grad_accumulation is False and sp.problems(c) == []


def test_problems_combine_planner_and_simulator_rules():
    sp = space("search.tp=[1, 2, 4, 8, 16]")
    c = sp.candidate({"tp": 16, "pp": 1, "cp": 1, "micro_batch_size": 1, "schedule": "1f1b"})
    reasons = sp.problems(c)
    assert any(r.startswith("plan: tp*pp*cp = 16*1*1 = 16 does not divide the 8 GPUs") for r in reasons)
    assert any(r.startswith("search.allow_tp_across_nodes: tp = 16 would span nodes of 8 GPUs") for r in reasons)
    bad_pp = sp.candidate({"tp": 1, "pp": 4, "cp": 1, "micro_batch_size": 1, "schedule": "interleaved-1f1b",
                           "virtual_pipeline_stages": 2})
    assert sp.problems(bad_pp) == structural_problems(sp.scenario_for(bad_pp))


def test_enumeration_keeps_exactly_the_valid_plans():
    sp = space(*SMALL)
    enum = sp.enumerate()
    assert len(enum.valid) == len(set(enum.valid)) > 100
    for c in enum.valid:
        assert sp.problems(c) == []
        assert sp.in_space(c)
    assert enum.combinations > len(enum.valid)
    total_rejected = enum.combinations - len(enum.valid)
    assert sum(r.count for r in enum.rejections) >= total_rejected  # a plan can fail several rules
    assert enum.rejections[0].count >= enum.rejections[-1].count
    assert "#" in enum.rejections[0].reason and "#" not in enum.rejections[0].example


def test_no_valid_plan_names_the_binding_constraint():
    sp = space("search.tp=16")
    enum = sp.enumerate()
    assert enum.valid == ()
    text = binding_constraint(enum)
    assert text.startswith(f"every one of the {enum.combinations} candidate plans fails the same rule, e.g. ")
    assert "plan: tp*pp*cp = 16*" in text or "tp = 16 would span nodes" in text


def test_reason_key_groups_numbers_but_not_names():
    assert reason_key("plan.schedule: interleaved-1f1b needs pp >= 2") == "plan.schedule: interleaved-1f1b needs pp >= #"


def test_uneven_stages_are_derived_when_pp_does_not_divide_the_layers():
    sc = load_scenario(ROOT / "scenarios" / "llama3-405b-16384xh100.yaml")
    sp = PlanSpace(sc, parse_search(sc, {"tp": 8}))
    assert sp.baseline().plan == sc.plan and sc.plan.first_stage_layers == 7
    # 126 layers on 16 stages: 7 + 14 x 8 + 7, the Llama 3 paper's split
    assert sp.candidate(sp.params_of(sp.baseline())).plan == sc.plan
    c = sp.candidate({**sp.params_of(sp.baseline()), "pp": 32})        # 3 + 30 x 4 + 3
    assert (c.plan.first_stage_layers, c.plan.last_stage_layers) == (3, 3) and sp.problems(c) == []
    assert uneven_stages(61, 16) == (3, 2) and uneven_stages(61, 2) == (31, 30)
    assert uneven_stages(61, 32) == (None, None)                        # 61 - 30 x 2 leaves 1 layer for two stages
    assert uneven_stages(96, 8) == (None, None)                         # even
    # where ceil(L / pp) in the middle leaves an edge empty, floor(L / pp) with edges within the ceiling
    assert uneven_stages(5, 4) == (2, 1) and uneven_stages(9, 8) == (2, 1) and uneven_stages(10, 8) == (2, 2)
    assert uneven_stages(3, 4) == (None, None)                          # fewer layers than stages
    inter = sp.candidate({**sp.params_of(sp.baseline()), "schedule": "interleaved-1f1b", "virtual_pipeline_stages": 2})
    # 126 + embedding + loss = 128 = 16 x 2 x 4: the first and last virtual stages 3, the others 4
    assert (inter.plan.first_stage_layers, inter.plan.last_stage_layers) == (3, 3) and sp.problems(inter) == []


def test_uneven_edges_balance_the_lm_head_and_the_mtp_modules():
    """The rest of an uneven split goes so that the costlier edge stage, by forward FLOPs with the
    LM head and multi-token prediction on the last, costs least: DeepSeek-V3's 61 layers on 16
    stages with its MTP module are 4 + 14 x 4 + 1, the scenario's own split (so its plan is one of
    the space's), and simulate faster than the halves 3 / 2."""
    sc = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml")
    sp = PlanSpace(sc, parse_search(sc, {}))
    assert sp.candidate(sp.params_of(sp.baseline())) == sp.baseline()
    assert (sc.plan.first_stage_layers, sc.plan.last_stage_layers) == (4, 1)
    halves = dataclasses.replace(sc, plan=dataclasses.replace(sc.plan, first_stage_layers=3, last_stage_layers=2))
    assert simulate(sc, imbalance_reference=False).step_time_s < simulate(halves, imbalance_reference=False).step_time_s
    # by hand: uniform layers and a head of 1.5 layers put the 5 remaining layers 3 + 2 (3 vs 3.5;
    # 4 + 1 is 4 vs 2.5), a head of 2.5 layers 4 + 1 (4 vs 3.5; 3 + 2 is 3 vs 4.5)
    assert uneven_stages(61, 16, [1.0] * 61, 1.5) == (3, 2) and uneven_stages(61, 16, [1.0] * 61, 2.5) == (4, 1)
    assert uneven_stages(61, 16, [1.0] * 61, 0.0) == uneven_stages(61, 16) == (3, 2)  # no head: the halves
    assert uneven_stages(1, 2, [1.0], 0.5) == uneven_stages(1, 2) == (1, 0)              # one layer, two stages


def test_interleaved_uneven_splits_count_the_embedding_and_the_loss_as_layers():
    assert interleaved_edges(94, 32) == (2, 2)          # Qwen3-235B, pp 8 x vpp 4 (Megatron MoE model zoo)
    assert interleaved_edges(94, 96) == (0, 0)          # pp 32 x vpp 3: embedding alone, loss alone
    assert interleaved_edges(96, 32) == (None, None)    # even
    assert interleaved_edges(61, 16) == (None, None)    # 63 does not split into 16
    sc = load_scenario(ROOT / "scenarios" / "qwen3-235b-256xh100.yaml")
    sp = PlanSpace(sc, parse_search(sc, {"tp": 2}))
    assert sp.candidate(sp.params_of(sp.baseline())).plan == sc.plan   # the scenario's own 2 + 30 x 3 + 2
    # vpp candidates: divisors of 94 (1, 2, 47, 94) and of 96 (3, 4, 6, ...), so the model zoo's 4 is searched
    assert {3, 4, 47} <= set(dict(sp.spec.candidates)["virtual_pipeline_stages"])
    c = sp.candidate({**sp.params_of(sp.baseline()), "pp": 32, "virtual_pipeline_stages": 3, "ep": 8})
    assert (c.plan.first_stage_layers, c.plan.last_stage_layers) == (0, 0)
    assert not [r for r in sp.problems(c) if "stage" in r]


def test_one_pipeline_stage_is_one_plan_whatever_the_schedule():
    """With pp = 1 there is no pipeline to schedule: the sampler's view (any schedule, any virtual
    stages, canonicalised by `candidate`) and the enumeration's both hold one valid plan there, 1f1b."""
    sp = space(*SMALL)
    base = {"tp": 2, "pp": 1, "cp": 1, "micro_batch_size": 1, "recompute": "none", "zero_stage": 1}
    one = {sp.candidate({**base, "schedule": s, "virtual_pipeline_stages": 2}) for s in ("gpipe", "1f1b")}
    assert len(one) == 1 and next(iter(one)).plan.schedule == "1f1b"
    inter = sp.candidate({**base, "schedule": "interleaved-1f1b", "virtual_pipeline_stages": 2})
    assert not sp.valid(inter)                                    # needs pp >= 2: stays an invalid plan
    assert sp.candidate({**base, "pp": 2, "schedule": "gpipe"}).plan.schedule == "gpipe"  # a pipeline: kept
    valid = sp.enumerate().valid
    assert {c.plan.schedule for c in valid if c.plan.pp == 1} == {"1f1b"}
    assert {c.plan.schedule for c in valid if c.plan.pp > 1} == {"gpipe", "1f1b", "interleaved-1f1b"}
    knobs = sp.free_knobs()
    sampled = {sp.candidate(dict(zip(knobs, values)))
               for values in itertools.product(*(sp.spec.values(k) for k in knobs))}
    assert {c for c in sampled if sp.valid(c)} == set(valid)
    # without 1f1b among the candidates the one-stage plans run the other one that can
    gpipe = space(*SMALL, "search.schedule=[gpipe, interleaved-1f1b]")
    assert {c.plan.schedule for c in gpipe.enumerate().valid if c.plan.pp == 1} == {"gpipe"}
    # and the one kept loses nothing: GPipe's order on one stage (every forward, then every
    # backward) takes as long and holds every microbatch's activations instead of one
    sc = tiny("plan.pp=1", "plan.micro_batch_size=1")            # dp 4: 16 / 4 = 4 microbatches
    runs = {s: simulate(dataclasses.replace(sc, plan=dataclasses.replace(sc.plan, schedule=s)))
            for s in ("gpipe", "1f1b")}
    assert runs["1f1b"].num_microbatches == 4
    assert runs["gpipe"].step_time_s == pytest.approx(runs["1f1b"].step_time_s, rel=1e-9)
    assert runs["gpipe"].peak_memory_bytes > runs["1f1b"].peak_memory_bytes



def test_one_microbatch_per_pipeline_is_one_plan_whatever_the_schedule():
    """A pipeline that runs one microbatch does each stage's forward, then its backward, under
    gpipe and 1f1b alike (the same step time and memory): one plan, 1f1b, in the sampler's view and
    the enumeration's. (Both had been searched, simulated and ranked, 5% of the tiny model's space.)"""
    sp = space("search.tp=[1]", "search.pp=[2]", "search.cp=[1]", "search.micro_batch_size=[4, 1]",
               "search.schedule=[gpipe, 1f1b]", "search.zero_stage=[1]", "search.recompute=[none]")
    base = {"tp": 1, "pp": 2, "cp": 1, "zero_stage": 1, "recompute": "none"}  # dp 4: 16 / (4 x mbs)
    one = {sp.candidate({**base, "micro_batch_size": 4, "schedule": s}) for s in ("gpipe", "1f1b")}
    assert len(one) == 1 and next(iter(one)).plan.schedule == "1f1b"
    four = {sp.candidate({**base, "micro_batch_size": 1, "schedule": s}).plan.schedule for s in ("gpipe", "1f1b")}
    assert four == {"gpipe", "1f1b"}  # four microbatches: two schedules
    valid = sp.enumerate().valid
    assert sorted((c.plan.micro_batch_size, c.plan.schedule) for c in valid) == [(1, "1f1b"), (1, "gpipe"), (4, "1f1b")]
    assert sp.count_combinations() == 3
    sc = sp.scenario_for(next(iter(one)))
    runs = {s: simulate(dataclasses.replace(sc, plan=dataclasses.replace(sc.plan, schedule=s))) for s in ("gpipe", "1f1b")}
    assert runs["1f1b"].num_microbatches == 1
    assert runs["gpipe"].step_time_s == pytest.approx(runs["1f1b"].step_time_s, rel=1e-12)
    assert runs["gpipe"].peak_memory_bytes == runs["1f1b"].peak_memory_bytes

# -- the scenario's own plan on another cluster ---------------------------------------------------


def test_a_plan_that_does_not_fit_the_cluster_is_an_invalid_baseline_for_the_planner():
    over = ["plan.tp=8", "plan.pp=2"]                            # 16 GPUs' worth on 8
    with pytest.raises(ConfigError, match="so dp cannot be derived"):
        load_scenario(TINY, over)                                # simulate still refuses it
    sc = load_for_planning(TINY, over)
    assert (sc.plan.tp, sc.plan.pp, sc.plan.cp, sc.plan.dp) == (8, 2, 1, 0)
    assert dataclasses.replace(sc.plan, tp=2, pp=2, dp=2) == load_scenario(TINY).plan  # the rest as written
    sp = PlanSpace(sc, parse_search(sc))
    base = Evaluator(sp).evaluate_baseline(sp.baseline())
    assert base.status == "invalid"
    assert base.reasons == ("plan: tp*pp*cp = 8*2*1 = 16 does not divide the 8 GPUs (1 node x 8), "
                            "so no dp completes the plan",)
    # a dp given that does not multiply out stays as written, and the simulator's rule says why
    given = load_for_planning(TINY, ["plan.dp=3"])
    assert given.plan.dp == 3
    reasons = Evaluator(sp).evaluate_baseline(Candidate(num_nodes=1, plan=given.plan)).reasons
    assert reasons[0] == "plan: tp*pp*cp*dp = 2*2*1*3 = 12 but the cluster has 8 GPUs (1 node x 8)"
    assert load_for_planning(TINY) == load_scenario(TINY)


FATAL_FOR_THE_PLANNER_TOO = [
    (["plan.tp=8", "plan.pp=2", "plan.tpp=2"], "plan.tpp: unknown key, did you mean 'tp'?"),
    (["plan.tp=8", "plan.pp=two"], "plan.pp: "),
    (["plan=3"], "plan: expected a mapping, got 3"),
    (["plan.tp=8", "plan.pp=2", "run.steps=0"], "run.steps: "),
    (["plan.tp=8", "plan.pp=2", "search=3"], "search: expected a mapping, got 3"),
    (["cluster.num_nodes=0"], "cluster.num_nodes: "),
]


@pytest.mark.parametrize("overrides,message", FATAL_FOR_THE_PLANNER_TOO, ids=[m.split(":")[0] for _, m in
                                                                           FATAL_FOR_THE_PLANNER_TOO])
def test_bad_input_stays_fatal_for_the_planner(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_for_planning(TINY, overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


# -- the objective ------------------------------------------------------------------------------


def test_memo_simulates_each_plan_once():
    sp = space(*SMALL)
    ev = Evaluator(sp)
    c = sp.enumerate().valid[0]
    a, b = ev.evaluate(c), ev.evaluate(dataclasses.replace(c))
    assert a is b and ev.simulations == 1
    bad = sp.candidate({"tp": 4, "pp": 4, "cp": 2})
    assert ev.evaluate(bad).status == "invalid" and ev.simulations == 1  # invalid plans are never simulated


def test_out_of_memory_is_a_constraint_violation_by_its_overflow():
    sc = tiny("model.num_layers=48", "model.hidden_size=8192", "model.num_attention_heads=64")
    sp = PlanSpace(sc, parse_search(sc, {}))
    oom = sp.candidate({"tp": 1, "pp": 1, "cp": 1, "micro_batch_size": 2, "schedule": "gpipe",
                        "zero_stage": 0, "recompute": "none"})
    e = Evaluator(sp).evaluate(oom)
    r = simulate(sp.scenario_for(oom))
    assert e.status == "oom" and not r.fits
    assert e.overflow == pytest.approx((r.peak_memory_bytes - r.memory_capacity_bytes) / r.memory_capacity_bytes)
    assert e.overflow > 0 and e.tokens_per_s == r.tokens_per_s  # simulated, told, not dropped
    small = space()
    fits = Evaluator(small).evaluate(small.baseline())
    assert fits.status == "ok" and fits.overflow < 0 and fits.headroom == -fits.overflow
    assert e.limiter().startswith("memory (+")


def test_an_uneven_split_out_of_memory_moves_to_the_nearest_split_that_fits():
    """Llama-3 8B's 32 layers on 3 stages of one H100 each: the FLOP balance gives 11 + 11 + 10,
    but a 1F1B first stage holds 3 microbatches and does not fit there; with 10 first it still does
    not, with 9 (and 12 on the last stage) it does: the planner evaluates that plan. The stage
    memory is the simulator's own (simulate() agrees on every plan), and only a derived split moves."""
    from simulator.simulate import stage_peak_memory

    sc = load_scenario(ROOT / "scenarios" / "llama3-8b-64xh100.yaml",
                       ["cluster.num_nodes=3", "plan.pp=3", "plan.tp=1", "plan.dp=8"])
    sp = PlanSpace(sc, parse_search(sc, {"pp": [3], "tp": [1], "cp": [1], "micro_batch_size": [1],
                                         "zero_stage": [0], "recompute": ["none"], "schedule": ["1f1b"]}))
    c = sp.candidate({})
    assert (c.plan.first_stage_layers, c.plan.last_stage_layers) == (11, 10) and sp.edge_layers(c) == 21
    cap = sp.memory_capacity
    for first, fits in ((11, False), (10, False), (9, True)):
        moved = sp.with_first_layers(c, first)
        mem = stage_peak_memory(sp.scenario_for(moved))
        r = simulate(sp.scenario_for(moved), record_spans=False)
        assert mem == [s.memory["total"] for s in r.stages] and r.fits == fits
        assert (mem[0] <= cap) == fits and mem[1] <= cap and mem[2] <= cap
    ev = Evaluator(sp)
    e = ev.evaluate(c)
    assert e.status == "ok" and e.candidate == sp.with_first_layers(c, 9) and ev.simulations == 2  # derived, moved
    assert (e.candidate.plan.first_stage_layers, e.candidate.plan.last_stage_layers) == (9, 12)
    assert ev.evaluate(c) is e and ev.simulations == 2
    # a journal's evaluation seeds the memo under the sampled candidate too
    again = Evaluator(sp)
    again.remember(Evaluation.from_json(e.to_json()))
    assert again.evaluate(c) == e and again.simulations == 0
    # a split set by hand, or the scenario's own plan, is evaluated as written
    hand = sp.with_first_layers(c, 10)
    assert sp.edge_layers(hand) is None and ev.evaluate(hand).status == "oom"
    assert Evaluator(sp).evaluate_baseline(c).status == "oom"
    with pytest.raises(ValueError, match="first stage layers 21"):
        sp.with_first_layers(c, 21)


def test_no_split_is_tried_when_a_middle_stage_is_out_of_memory(monkeypatch):
    """Llama-3 8B on 5 stages at micro-batch 2: the first stage and the second (a middle one, which
    no edge split changes) are over the GPU's memory, the last fits. The plan is reported out of
    memory as derived, without one pass of the memory model over another split."""
    import simulator.simulate

    sc = load_scenario(ROOT / "scenarios" / "llama3-8b-64xh100.yaml",
                       ["cluster.num_nodes=5", "plan.pp=5", "plan.tp=1", "plan.dp=8"])
    sp = PlanSpace(sc, parse_search(sc, {"pp": [5], "tp": [1], "cp": [1], "micro_batch_size": [2],
                                         "zero_stage": [0], "recompute": ["none"], "schedule": ["1f1b"]}))
    c = sp.candidate({})
    over = [m > sp.memory_capacity for m in simulator.simulate.stage_peak_memory(sp.scenario_for(c))]
    assert over[:2] == [True, True] and not over[-1] and sp.edge_layers(c)
    calls = []
    real = simulator.simulate.stage_peak_memory
    monkeypatch.setattr(simulator.simulate, "stage_peak_memory", lambda s: calls.append(s) or real(s))
    ev = Evaluator(sp)
    e = ev.evaluate(c)
    assert e.status == "oom" and e.candidate == c and calls == [] and ev.simulations == 1


def test_evaluation_json_round_trip():
    sp = space(*SMALL)
    e = Evaluator(sp).evaluate(sp.enumerate().valid[3])
    assert Evaluation.from_json(e.to_json()) == e


def test_cost_per_million_tokens_by_hand():
    c = Candidate(num_nodes=2, plan=PlanSpec(tp=8, dp=2))
    e = Evaluation(candidate=c, status="ok", world_size=16, tokens_per_s=100_000.0)
    # 16 GPUs x 2.5 per GPU-hour x (1e6 / 1e5) s / 3600 s per hour
    assert make_objective("cost", gpu_hour_cost=2.5).values(e) == (pytest.approx(16 * 2.5 * 10 / 3600),)
    assert make_objective("cost").cost_unit == "GPU-hours per 1M tokens"
    assert make_objective("throughput-vs-gpus").values(e) == (100_000.0, 16.0)


def test_every_objective_the_cli_offers_is_made():
    from paraplan.specs import OBJECTIVES

    assert [make_objective(name).name for name in OBJECTIVES] == list(OBJECTIVES)
    with pytest.raises(ValueError, match="expected one of throughput, cost"):
        make_objective("latency")


def test_pareto_front():
    obj = make_objective("throughput-vs-gpus")

    def ev(tps, gpus):
        return Evaluation(candidate=Candidate(num_nodes=gpus // 8, plan=PlanSpec(dp=gpus)), status="ok",
                          world_size=gpus, tokens_per_s=tps)

    pts = [ev(100, 8), ev(180, 16), ev(150, 16), ev(300, 32), ev(290, 64), ev(100, 8)]
    front = pareto_front(pts, obj)
    assert [(e.tokens_per_s, e.world_size) for e in front] == [(300, 32), (180, 16), (100, 8)]
    assert not any(math.isnan(e.tokens_per_s) for e in front)


def test_dp_candidates_filter_the_derived_dp():
    sp = space(*SMALL, "search.dp=[2]")
    enum = sp.enumerate()
    assert enum.valid and {c.plan.dp for c in enum.valid} == {2}
    assert any(r.reason.startswith("search.dp: the derived dp = # is not among the candidates")
               for r in enum.rejections)


def test_zero_bubble_exports_say_what_each_framework_runs():
    from planner.emit import megatron_args_text, torchtitan_toml

    sc = tiny("plan.pp=2", "plan.tp=1", "plan.dp=4", "plan.schedule=zero-bubble", "plan.virtual_pipeline_stages=2")
    assert simulate(sc).step_time_s > 0
    assert 'pipeline_parallel_schedule = "InterleavedZeroBubble"' in torchtitan_toml(sc)
    assert "Megatron-LM has no zero-bubble schedule" in megatron_args_text(sc)
    assert "--set plan.schedule=interleaved-1f1b for its step time" in megatron_args_text(sc)
    one_stage = tiny("plan.pp=2", "plan.tp=1", "plan.dp=4", "plan.schedule=zero-bubble")
    assert 'pipeline_parallel_schedule = "1F1B"' in torchtitan_toml(one_stage)
    assert "--set plan.schedule=1f1b for its step time" in megatron_args_text(one_stage)
    zbv = tiny("plan.pp=2", "plan.tp=1", "plan.dp=4", "plan.schedule=zbv", "plan.virtual_pipeline_stages=2")
    assert 'pipeline_parallel_schedule = "ZBVZeroBubble"' in torchtitan_toml(zbv)
    assert "Megatron-LM has no zbv schedule; these arguments run (interleaved) 1F1B with its chunks in a loop" \
        in megatron_args_text(zbv)
    # zbv runs any number of microbatches, Megatron's interleaved 1F1B only multiples of pp
    odd = tiny("plan.pp=2", "plan.tp=1", "plan.dp=4", "plan.schedule=zbv", "plan.virtual_pipeline_stages=2",
               "plan.micro_batch_size=1", "training.global_batch_size=12")
    assert odd.num_microbatches == 3 and simulate(odd).step_time_s > 0
    assert "refuses 3 microbatches on pp 2 (it needs a multiple of pp)" in megatron_args_text(odd)
    dpv = tiny("plan.pp=2", "plan.tp=1", "plan.dp=4", "plan.schedule=dualpipev", "plan.virtual_pipeline_stages=2",
               "plan.micro_batch_size=1")
    assert simulate(dpv).step_time_s > 0
    assert 'pipeline_parallel_schedule = "DualPipeV"' in torchtitan_toml(dpv)
    assert "Megatron-LM has no dualpipev schedule; these arguments run (interleaved) 1F1B with its chunks in a loop" \
        in megatron_args_text(dpv)


def test_zero_stages_stay_distinct_while_expert_states_shard():
    """dp x cp = 1 leaves ZeRO nothing to shard for a dense model, but an MoE model with tp 8 and
    ep 2 still has an expert-data-parallel group of 4: its ZeRO stages are different plans."""
    sc = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml", ["cluster.num_nodes=1"])
    sp = PlanSpace(sc, parse_search(sc, {}))
    base = {"tp": 8, "pp": 1, "cp": 1, "micro_batch_size": 1, "schedule": "1f1b", "recompute": "full"}
    assert sp.candidate({**base, "ep": 2, "zero_stage": 3}).plan.zero_stage == 3
    assert sp.candidate({**base, "ep": 8, "zero_stage": 3}).plan.zero_stage == 0  # expert-dp 1 as well


@pytest.mark.parametrize("name, overrides", [("llama3-405b-16384xh100", []), ("llama3-8b-64xh100", ["plan.pp=4", "plan.tp=1"]),
                                             ("qwen3-235b-256xh100", []), ("gpt3-175b-1024xa100", [])])
def test_torchtitan_export_splits_the_layers_as_simulated(name, overrides):
    """torchtitan makes ceil((layers + first_less + last_less) / layers_per_stage) virtual stages
    (both *_less default to 1): the export must give pp x vpp of them, with the simulated counts."""
    tomllib = pytest.importorskip("tomllib")
    from planner.emit import torchtitan_toml
    from simulator.layout import layers_per_chunk

    sc = load_scenario(ROOT / "scenarios" / f"{name}.yaml", overrides)
    p = sc.plan
    par = tomllib.loads(torchtitan_toml(sc))["parallelism"]
    per, first_less, last_less = (par[f"pipeline_parallel_{k}"] for k in
                                  ("layers_per_stage", "first_stage_less_layers", "last_stage_less_layers"))
    assert -(-(sc.model.num_layers + first_less + last_less) // per) == p.pp * p.virtual_pipeline_stages
    layers = layers_per_chunk(sc.model.num_layers, p.pp, p.virtual_pipeline_stages, p.first_stage_layers,
                              p.last_stage_layers)
    assert (layers[0][0], layers[-1][-1]) == (per - first_less, per - last_less)


def test_samplers_draw_the_schedule_and_its_virtual_stages_together():
    """A sampler draws (schedule, virtual stages) as one knob holding every pair the space admits
    (zero-bubble at one stage per rank and at the listed counts >= 2; interleaved 1F1B never at
    one): drawn apart, TPE had spent trials on interleaved 1F1B at vpp 1 (invalid) and 1F1B at
    vpp 2 (a plan already drawn). The refining search moves along the same knob."""
    import optuna

    from planner.search import _knob_choices
    from planner.space import PIPELINE
    from planner.strategies import RefiningSampler

    sp = space("search.schedule=[1f1b, interleaved-1f1b, zero-bubble]", "search.virtual_pipeline_stages=[1, 2, 4]",
               "search.pp=[2]")
    choices, fixed = _knob_choices(sp, None)
    assert "schedule" not in choices and "virtual_pipeline_stages" not in choices
    assert choices[PIPELINE] == ("1f1b", "interleaved-1f1b x2", "interleaved-1f1b x4", "zero-bubble",
                                 "zero-bubble x2", "zero-bubble x4")
    enumerated, _ = _knob_choices(sp, sp.enumerate())
    assert set(enumerated[PIPELINE]) <= set(choices[PIPELINE])
    c = sp.candidate({**fixed, **{k: v[0] for k, v in choices.items()}, PIPELINE: "interleaved-1f1b x4"})
    assert (c.plan.schedule, c.plan.virtual_pipeline_stages) == ("interleaved-1f1b", 4)
    assert sp.sampler_params(c)[PIPELINE] == "interleaved-1f1b x4"
    sampler = RefiningSampler(optuna.samplers.RandomSampler(seed=0), sp, choices=choices, fixed=fixed, refine_from=0,
                              seed=0)
    assert sampler._axes()[PIPELINE] == ((PIPELINE,), [(v,) for v in choices[PIPELINE]])
    zbv = space("search.schedule=[1f1b, zbv]", "search.virtual_pipeline_stages=[1, 2, 4]", "search.pp=[2]")
    assert _knob_choices(zbv, None)[0][PIPELINE] == ("1f1b", "zbv x2")


def test_expert_plans_follow_the_dense_and_the_moe_tuning_guides():
    """The plans TPE starts from: for a dense model the widest TP in a node (SC'21), for an MoE
    model TP 1 with the widest EP inside a node (Megatron-Core's MoE tuning guide; its Mixtral
    8x7B mapping is TP 1 EP 8), after the scenario's own plan."""
    from planner.strategies import expert_plans

    dense = load_scenario(ROOT / "scenarios" / "llama3-70b-512xh100.yaml")
    sp = PlanSpace(dense, parse_search(dense))
    assert {c.plan.tp for c in expert_plans(sp, limit=8)[1:]} == {8}
    moe = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml")
    sp = PlanSpace(moe, parse_search(moe))
    plans = expert_plans(sp, limit=8)
    assert plans[0] == sp.candidate(sp.params_of(sp.baseline()))
    assert {(c.plan.tp, c.plan.ep) for c in plans[1:]} == {(1, 8)}
    narrow = PlanSpace(moe, parse_search(moe, {"ep": [1, 2, 4], "expert_tp": [2]}))
    got = {c.plan.pp: (c.plan.ep, c.plan.expert_tp) for c in expert_plans(narrow, limit=8)[1:]}
    assert got[min(got)] == (4, 2) and all(ep * etp <= 64 // pp for pp, (ep, etp) in got.items())  # 4 x 2 <= 8
    # where the widest EP does not divide a stage's ranks (8 GPUs, pp 2 and 4: 4 and 2 ranks), the
    # next narrower one that does
    one_node = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml", ["cluster.num_nodes=1"])
    sp = PlanSpace(one_node, parse_search(one_node, {"pp": [2, 4, 8]}))
    plans = expert_plans(sp, limit=8)[1:]
    assert plans and all(c.plan.ep * c.plan.expert_tp <= c.plan.tp * c.plan.dp for c in plans)
    assert {c.plan.pp: c.plan.ep for c in plans if c.plan.tp == 1} == {2: 4, 4: 2, 8: 1}


def test_memory_headroom_holds_plans_to_a_share_of_the_gpu():
    """search.memory_headroom: a plan fits only if its peak leaves that share of the GPU's memory
    free; the same plan fits without it. Out of range, it is a one-line error naming the key."""
    sc = load_scenario(ROOT / "scenarios" / "llama3-8b-64xh100.yaml")
    knobs = {"tp": [1], "pp": [1], "cp": [1], "micro_batch_size": [1], "zero_stage": [2], "recompute": ["none"],
             "schedule": ["1f1b"], "sequence_parallel": [False]}
    plain = Evaluator(PlanSpace(sc, parse_search(sc, knobs))).evaluate(PlanSpace(sc, parse_search(sc, knobs)).candidate({}))
    share = plain.peak_memory_bytes / plain.memory_capacity_bytes
    assert plain.status == "ok" and 0.5 < share < 0.95
    for headroom, status in ((round(1 - share, 3) - 0.01, "ok"), (round(1 - share, 3) + 0.01, "oom")):
        sp = PlanSpace(sc, parse_search(sc, {**knobs, "memory_headroom": headroom}))
        e = Evaluator(sp).evaluate(sp.candidate({}))
        assert e.status == status and e.peak_memory_bytes == plain.peak_memory_bytes
        # what Optuna is told agrees: the memory constraint is over the limit exactly when the plan is
        assert (e.overflow > 0) == (status == "oom") and e.limit == pytest.approx(sp.memory_limit)
        assert Evaluation.from_json(e.to_json()) == e
    for bad in (1.0, -0.1, True, "10%"):
        with pytest.raises(ConfigError) as err:
            parse_search(sc, {"memory_headroom": bad})
        assert err.value.path == "search.memory_headroom" and "expected a share of GPU memory in [0, 1)" in str(err.value)
