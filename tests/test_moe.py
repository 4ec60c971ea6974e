"""Mixture-of-experts: routing draws, all-to-all costs, imbalance, expert placement, bad input."""
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hwmodels.network import build_network, collective_time
from hwmodels.profile import load_profile
from paraplan.errors import ConfigError, InfeasiblePlanError
from paraplan.loader import load_scenario
from paraplan.placement import GroupLayout, expert_group_layouts, group_layout
from paraplan.specs import MoESpec, RoutingSpec
from simulator.moe import cap_shares, draw_routing, expert_compute_time, moe_block, nodes_reached
from simulator.simulate import simulate
from simulator.workload import LayerContext, dense_ffn_block, ffn_norm_residual

ROOT = Path(__file__).resolve().parents[1]


def moe(**kw):
    base = dict(num_experts=64, top_k=8, expert_ffn_hidden_size=2048)
    return MoESpec(**{**base, **kw})


@pytest.mark.parametrize("routing", [RoutingSpec(), RoutingSpec(distribution="zipf", s=1.2, seed=3),
                                     RoutingSpec(distribution="histogram", tokens_per_expert=tuple(range(1, 65)))])
def test_token_copies_are_conserved(routing):
    """Every dispatched copy is received by exactly one expert and combined back: the copies the
    ranks send equal the copies the experts receive (plus drops, none when dropless)."""
    draw = draw_routing(moe(routing=routing), ep=8, tokens_per_rank=4096)
    assert draw.expert_tokens.sum() + draw.dropped == pytest.approx(8 * draw.sent_per_rank)
    assert draw.dropped == 0 and draw.expert_tokens.shape == (8, 8)


def test_capacity_factor_drops_but_conserves():
    """Each rank's router drops the copies over an expert's capacity of that rank's tokens
    (Megatron-Core), before the dispatch: the ranks send only the kept copies."""
    draw = draw_routing(moe(routing=RoutingSpec(distribution="zipf", s=1.2), capacity_factor=1.0), 8, 4096)
    assert draw.dropped > 0
    assert draw.expert_tokens.max() <= 8 * np.ceil(1.0 * 4096 * 8 / 64)  # 8 source ranks' capacities
    assert draw.expert_tokens.sum() + draw.dropped == pytest.approx(8 * 4096 * 8)  # every routed copy
    assert draw.expert_tokens.sum() == pytest.approx(8 * draw.sent_per_rank)  # only kept copies travel
    # per rank, a uniform router's sampling noise alone overflows some capacities at factor 1.0
    uniform = draw_routing(moe(capacity_factor=1.0), 8, 4096)
    assert 0 < uniform.dropped < 0.05 * 8 * 4096 * 8
    assert draw_routing(moe(capacity_factor=1.0), 8, 4096, balanced=True).dropped == 0


def test_routing_is_deterministic_under_a_seed():
    a = draw_routing(moe(routing=RoutingSpec(distribution="zipf", seed=7)), 8, 1000)
    b = draw_routing(moe(routing=RoutingSpec(distribution="zipf", seed=7)), 8, 1000)
    c = draw_routing(moe(routing=RoutingSpec(distribution="zipf", seed=8)), 8, 1000)
    assert np.array_equal(a.expert_tokens, b.expert_tokens)
    assert not np.array_equal(a.expert_tokens, c.expert_tokens)


def test_nodes_reached_hand_computed():
    # 16 experts on 2 nodes, top-2: P(a node is missed) = C(8,2)/C(16,2) = 28/120
    assert nodes_reached(16, 2, 2) == pytest.approx(2 * (1 - 28 / 120))
    assert nodes_reached(64, 8, 1) == pytest.approx(1.0)


def test_nodes_reached_under_group_limited_routing():
    """Megatron-Core's group_limited_topk on independent scores (a seeded draw, within ~1%)."""
    # 8 experts on 4 nodes (2 each) in 2 groups of 4 (2 nodes each), 1 group per token, top-2: the
    # kept group's top 2 are a uniform pair of its 4 experts, on one node with probability 2/C(4,2),
    # else on the group's two nodes: 1/3 + 2 x 2/3
    assert nodes_reached(8, 2, 4, 2, 1) == pytest.approx(5 / 3, rel=0.01)
    assert nodes_reached(8, 2, 4) == pytest.approx(4 * (1 - 15 / 28))  # no limit: more nodes
    assert nodes_reached(8, 2, 4, 2, 2) == nodes_reached(8, 2, 4)  # every group kept: no limit
    # 6 experts in 3 groups (one per node) of 2, 2 groups kept by their best score, top-2: the kept
    # groups hold the token's two best experts, so the picks are its overall top 2, partners (one
    # node) with probability 1/5: 1/5 + 2 x 4/5
    assert nodes_reached(6, 2, 3, 3, 2) == pytest.approx(1.8, rel=0.01)
    # DeepSeek-V3 on 8 nodes, one group of 32 experts each, 4 groups kept by their top-2 sums: a
    # kept group nearly always holds some of the token's top 8, so nearly 4 nodes (picking the 8
    # uniformly among the kept groups' 128 experts would give 3.63), against 5.29 without the limit
    limited = nodes_reached(256, 8, 8, 8, 4)
    uniform_in_pool = 4 * (1 - math.comb(96, 8) / math.comb(128, 8))
    assert uniform_in_pool + 0.25 < limited <= 4 < nodes_reached(256, 8, 8)
    # and the 64 ranks of EP 64 (4 experts each): never more than 8 distinct, as many as the groups allow
    assert nodes_reached(256, 8, 4, 8, 4) < nodes_reached(256, 8, 8, 8, 4) < nodes_reached(256, 8, 64, 8, 4) <= 8


def test_group_limited_router_draw_is_balanced_and_seeded():
    """The draw picks top_k distinct experts per token, every expert about equally often, only from
    groups_per_token groups, and is the same on every call (a fixed seed)."""
    from simulator.moe import ROUTER_DRAW_TOKENS, routed_experts

    picked = routed_experts(256, 8, 8, 4)
    assert picked.shape == (ROUTER_DRAW_TOKENS, 8)
    ordered = np.sort(picked, axis=1)
    assert (np.diff(ordered, axis=1) > 0).all()
    groups_used = 1 + (np.diff(np.sort(picked // 32, axis=1), axis=1) != 0).sum(axis=1)
    assert groups_used.max() <= 4
    counts = np.bincount(picked.ravel(), minlength=256)
    mean = ROUTER_DRAW_TOKENS * 8 / 256
    assert abs(counts - mean).max() < 5 * math.sqrt(mean)
    routed_experts.cache_clear()
    assert np.array_equal(routed_experts(256, 8, 8, 4), picked)


def test_node_limited_routing_moves_fewer_bytes_across_nodes():
    sc = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml")
    free = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml", ["model.moe.groups_per_token=8"])
    limited, unlimited = (simulate(s, imbalance_reference=False, record_spans=False) for s in (sc, free))
    assert limited.breakdown["ep_comm"] < unlimited.breakdown["ep_comm"]
    assert limited.step_time_s < unlimited.step_time_s


@pytest.fixture(scope="module")
def h100_net():
    sc = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml")
    gpu = load_profile(sc.cluster.gpu)
    return sc, gpu, build_network(sc.cluster, gpu)


def test_all_to_all_on_two_tiers_hand_computed(h100_net):
    """16 ranks on 2 nodes (8 per node): the off-node half of each rank's buffer leaves through its
    1/8 share of the node's 8 x 400 Gb/s NICs at 94% efficiency; that dominates the on-node half."""
    _, gpu, net = h100_net
    nbytes = 256e6
    t = collective_time(net, "all_to_all", nbytes, GroupLayout(size=16, ranks_per_node=8, num_nodes=2))
    nic_share = 8 * 400e9 / 8 / 8 * 0.94
    off_node = nbytes * (2 - 1) / 2 / nic_share
    # latency: NCCL tuning.cc Simple base 8.4 us + network hop 14.0 us + 1 us per peer (15 peers)
    latency = (8.4 + 14.0 + 15 * 1.0) * 1e-6
    assert t == pytest.approx(off_node + latency, rel=1e-9)
    # inside one node the same exchange runs over NVLink and is much faster
    t1 = collective_time(net, "all_to_all", nbytes, GroupLayout(size=8, ranks_per_node=8, num_nodes=1))
    assert t1 < t / 3


def _ctx(sc, gpu, net, **plan):
    sc = replace(sc, plan=replace(sc.plan, **plan))
    p = sc.plan
    return sc, LayerContext(model=sc.model, plan=p, gpu=gpu, network=net, seq_length=sc.training.seq_length,
                            dtype="bf16", attention_kernel="flash", tp_layout=group_layout(("tp",), p, 8),
                            cp_layout=group_layout(("cp",), p, 8))


def test_ep1_expert_cost_equals_the_dense_ffn(h100_net):
    """One expert, top-1, EP 1: the expert GEMMs are exactly the dense MLP's."""
    sc, gpu, net = h100_net
    one = replace(sc.model, moe=MoESpec(num_experts=1, top_k=1, expert_ffn_hidden_size=sc.model.ffn_hidden_size))
    sc, ctx = _ctx(replace(sc, model=one), gpu, net, ep=1, tp=1, pp=1, dp=64, virtual_pipeline_stages=1, schedule="1f1b")
    draw = draw_routing(one.moe, 1, ctx.tokens)
    for backward in (False, True):
        experts = expert_compute_time(ctx, draw.expert_tokens[0], backward)
        dense = dense_ffn_block(ctx, backward).parts["compute"]
        # the dense block also runs the post-attention norm and residual kernels
        assert experts == pytest.approx(dense - ffn_norm_residual(ctx, backward), rel=1e-9)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_grouped_experts_run_one_activation_and_one_cast_per_projection(h100_net, dtype):
    """Four local experts of 512 tokens each: four GEMM problems per projection, but one activation
    over the 2,048 rows (Megatron-Core TEGroupedMLP) and, under fp8, one cast of each projection's
    operands for all experts (Transformer Engine's multi-tensor quantize)."""
    from simulator.moe import _expert_activation, _expert_linears, _gemm
    from simulator.workload import fp8_cast_time

    sc, gpu, net = h100_net
    sc, ctx = _ctx(sc, gpu, net)
    ctx = replace(ctx, dtype=dtype)
    for backward in (False, True):
        gemms = sum(_gemm(ctx, 512, k, w, backward, casts=False) for k, w in _expert_linears(ctx))
        casts = sum(fp8_cast_time(ctx, 2048 * (w if backward else k)) for k, w in _expert_linears(ctx))
        assert (casts > 0) == (dtype == "fp8")
        want = 4 * gemms + casts + _expert_activation(ctx, 2048, backward)
        assert expert_compute_time(ctx, [512] * 4, backward) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("routing", [RoutingSpec(), RoutingSpec(distribution="zipf", s=1.0, seed=1),
                                     RoutingSpec(distribution="zipf", s=2.0, seed=2)])
def test_imbalance_never_makes_a_layer_faster(h100_net, routing):
    sc, gpu, net = h100_net
    model = replace(sc.model, moe=replace(sc.model.moe, routing=routing))
    sc, ctx = _ctx(replace(sc, model=model), gpu, net)
    etp, ep, _ = expert_group_layouts(sc.plan, 8)
    drawn = moe_block(ctx, draw_routing(model.moe, 8, ctx.tokens), ep, etp, overlap_shared=False)
    balanced = moe_block(ctx, draw_routing(model.moe, 8, ctx.tokens, balanced=True), ep, etp, overlap_shared=False)
    for backward in (False, True):
        assert drawn(ctx, backward).total >= balanced(ctx, backward).total


def test_simulated_imbalance_report_and_step(h100_net):
    sc, _, _ = h100_net
    zipf = replace(sc, model=replace(sc.model, moe=replace(sc.model.moe, routing=RoutingSpec(distribution="zipf", s=1.2))))
    r = simulate(zipf)
    assert r.moe.imbalance > 1.2
    assert r.step_time_s > r.moe.balanced_step_time_s
    assert r.moe.moe_layer_time_s > r.moe.balanced_moe_layer_time_s


def test_an_moe_result_holds_python_floats_not_numpy_scalars(h100_net):
    """The routing draw is a NumPy array; what reaches the result (and the engine) is plain floats."""
    r = simulate(h100_net[0])
    numbers = [r.step_time_s, r.tokens_per_s, r.mfu, *r.breakdown.values(), *vars(r.moe).values()]
    for st in r.stages:
        numbers += [st.end_time_s, *st.breakdown.values()]
    assert not [x for x in numbers if isinstance(x, np.generic)]


def test_ep_leaving_the_node_costs_more():
    sc = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml")
    inside = simulate(replace(sc, plan=replace(sc.plan, ep=8)))
    across = simulate(replace(sc, plan=replace(sc.plan, ep=64)))
    assert inside.moe.ep_tiers == ("nvlink",) and "ib" in across.moe.ep_tiers
    ep = lambda r: r.breakdown["ep_comm"]
    assert ep(across) > ep(inside)


def test_nic_sharing_slows_overlapping_traffic():
    """Gradient buckets reduced over the network while all-to-alls cross nodes share the NIC."""
    from simulator.cost import Cost
    from simulator.engine import StageWork, run_iteration
    from simulator.schedules import build_schedule

    def works(nic):
        op = Cost().add("ep_comm", 1.0).add_nic("ep_comm", nic)
        return [StageWork(ops=build_schedule("1f1b", 1, 2)[0], op_cost={("F", 0): op, ("B", 0): op.scaled(1.0)},
                          grad_buckets={0: [1.0, 1.0]}, grad_bucket_nic={0: [1.0, 1.0]}, optimizer_time=0.0,
                          param_gather_time=0.0)]
    quiet = run_iteration(works(0.0), num_chunks=1, p2p_time=0, overlap_grad_reduce=True, sync_time=0)
    shared = run_iteration(works(1.0), num_chunks=1, p2p_time=0, overlap_grad_reduce=True, sync_time=0)
    # bucket 0 starts mid-way through the last backward (3.5 s) and shares the NIC with its
    # all-to-all for 0.5 s: both are delayed by 0.5 s
    assert (quiet.step_time, shared.step_time) == (5.5, 6.0)



def test_traffic_an_op_gives_up_to_a_bucket_still_meets_the_next_bucket(monkeypatch):
    """One stage: a 1 s backward that holds the NIC throughout (an all-to-all) and four gradient
    buckets of 0.5 s, all on the NIC, the first ready at 0.25 s (SM sharing off, to see the NIC
    alone). The NIC carries 1 + 4 x 0.5 = 3 s of traffic, so the last bucket ends at 3.0 s, as
    processor sharing has it: b0 and the backward share 0.25-1.25 s; the backward's 0.25 s left
    shares with b1 (backward ends 1.75, b1 2.0); b2 and b3 run alone to 3.0. (A bucket starting
    after the backward's undelayed end had seen an idle NIC: 2.75 s, more than the NIC can carry.)"""
    import simulator.engine as engine
    from simulator.cost import Cost
    from simulator.engine import StageWork, run_iteration
    from simulator.schedules import Op

    monkeypatch.setattr(engine, "COMM_SM_SHARE", 0.0)
    work = StageWork(ops=(Op("F", 0, 0), Op("B", 0, 0)),
                     op_cost={("F", 0): Cost(), ("B", 0): Cost().add("ep_comm", 1.0).add_nic("ep_comm", 1.0)},
                     grad_buckets={0: [0.5] * 4}, grad_bucket_nic={0: [0.5] * 4}, optimizer_time=0.0,
                     param_gather_time=0.0)
    res = run_iteration([work], num_chunks=1, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0)
    assert res.step_time == pytest.approx(3.0)
    assert res.stages[0].compute_end == pytest.approx(1.75)


def test_a_bucket_delayed_by_one_op_still_meets_the_next(monkeypatch):
    """One stage, two chunks, two microbatches; chunk 1's backwards (1 s, no traffic) run first,
    then chunk 0's (0.2 s each, all NIC traffic). Chunk 1's first bucket (1 s on the NIC) starts
    mid-way through its last backward, at 1.5 s, with 0.5 s left when B0.0 starts at 2.0: they share,
    B0.0 ends at 2.4 and the bucket has 0.3 s left, which B1.0 shares (ends 2.8, the bucket 2.9), as
    processor sharing has it (0.9 s of traffic from 2.0 s). (Had the bucket's hold on the NIC kept
    its undelayed end, 2.5 s, until its transfer ended, B1.0 would have shared 0.1 s: 2.7 s.)"""
    import simulator.engine as engine
    from simulator.cost import Cost
    from simulator.engine import StageWork, run_iteration
    from simulator.schedules import Op

    monkeypatch.setattr(engine, "COMM_SM_SHARE", 0.0)
    ops = [Op("F", m, c) for m in range(2) for c in range(2)] + [Op("B", m, c) for c in (1, 0) for m in range(2)]
    costs = {("F", 0): Cost(), ("F", 1): Cost(), ("B", 1): Cost().add("compute", 1.0),
             ("B", 0): Cost().add("ep_comm", 0.2).add_nic("ep_comm", 0.2)}
    work = StageWork(ops=ops, op_cost=costs, grad_buckets={1: [1.0, 0.01]}, grad_bucket_nic={1: [1.0, 0.0]},
                     optimizer_time=0.0, param_gather_time=0.0)
    res = run_iteration([work], num_chunks=2, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0)
    assert res.stages[0].compute_end == pytest.approx(2.8)
    reduce = next(s for s in res.spans if s.name == "grad-reduce c1 b0")
    assert (reduce.start, reduce.end) == (pytest.approx(1.5), pytest.approx(2.9))

def test_nic_sharing_delays_are_booked_under_the_ops_own_traffic():
    """The same op and bucket as above, its NIC time half all-to-all and half a ZeRO-3 transfer:
    the 0.5 s it loses to the bucket is booked half as ep_comm, half as dp_comm; a dense ZeRO-3
    plan books none as ep_comm."""
    from simulator.cost import Cost
    from simulator.engine import StageWork, run_iteration
    from simulator.schedules import build_schedule

    op = Cost().add("compute", 1.0).add_nic("ep_comm", 0.5).add_nic("dp_comm", 0.5)
    work = StageWork(ops=build_schedule("1f1b", 1, 2)[0], op_cost={("F", 0): op, ("B", 0): op.scaled(1.0)},
                     grad_buckets={0: [1.0, 1.0]}, grad_bucket_nic={0: [1.0, 1.0]}, optimizer_time=0.0,
                     param_gather_time=0.0)
    res = run_iteration([work], num_chunks=1, p2p_time=0, overlap_grad_reduce=True, sync_time=0)
    bd = res.stages[0].breakdown
    assert res.step_time == 6.0 and bd["ep_comm"] == pytest.approx(0.25)
    assert sum(bd.values()) == pytest.approx(res.step_time)
    dense = simulate(load_scenario(ROOT / "scenarios/gpt3-175b-1024xa100.yaml", ["plan.zero_stage=3"]))
    assert dense.breakdown.get("ep_comm", 0.0) == 0.0 and dense.breakdown["dp_comm"] > 0


def test_pipeline_send_shares_the_nic_with_the_receivers_all_to_all():
    """pp 2 on two nodes, 2 microbatches, every op 1 s; the last stage's forwards are all-to-all
    bound (NIC busy throughout), each send takes 0.5 s on the NICs. Without sharing: 7.0 s.
    With it: the second send (t = 2) lands while stage 1's F0 moves traffic, so both take the
    0.5 s overlap (the send arrives 3.0; stage 1 pays its 0.5 s as its next op, B0, starts: B0
    runs 2.5-4.0); stage 1's B0 send leaves at 4.0 and F1,
    starting then, shares its first 0.5 s with it (ends 5.5); B1 ends 6.5, arrives 7.0, stage 0's
    B1 ends 8.0."""
    from simulator.cost import Cost
    from simulator.engine import StageWork, run_iteration
    from simulator.schedules import build_schedule

    def works():
        out = []
        for stage, ops in enumerate(build_schedule("1f1b", 2, 2)):
            f = Cost().add("compute", 1.0)
            if stage == 1:
                f = Cost().add("ep_comm", 1.0).add_nic("ep_comm", 1.0)
            out.append(StageWork(ops=ops, op_cost={("F", 0): f, ("B", 0): Cost().add("compute", 1.0)},
                                 grad_buckets={}, optimizer_time=0.0, param_gather_time=0.0))
        return out
    run = lambda nic: run_iteration(works(), num_chunks=1, p2p_time=0.5, overlap_grad_reduce=True,  # noqa: E731
                                    sync_time=0, p2p_nic=nic)
    quiet, shared = run(0.0), run(0.5)
    assert (quiet.step_time, shared.step_time) == (7.0, 8.0)
    assert shared.stages[1].breakdown["ep_comm"] == 2 * 1.0 + 2 * 0.5


def test_pipeline_sends_use_the_nic_only_between_nodes(monkeypatch):
    """pp 4 over 64 GPUs puts neighbouring stages on different nodes (a stage is 16 GPUs): every
    send holds the NICs; pp 4 inside one 8-GPU node (tp 2): none does; tp 2 x dp 2 x pp 4 on two
    nodes puts stages 0-1 on node 0 and 2-3 on node 1: the hop 1 -> 2 and the wrap-around 3 -> 0
    leave the node, and cost more than the two that stay."""
    import simulator.simulate as sim
    seen = []
    real = sim.run_iteration
    monkeypatch.setattr(sim, "run_iteration", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    sim.simulate(load_scenario(MOE_BASE))
    inside = {"model": {"preset": "llama3-8b"}, "cluster": {"gpu": "h100-sxm-80gb", "num_nodes": 1, "gpus_per_node": 8},
              "training": {"seq_length": 4096, "global_batch_size": 16, "precision": "bf16"},
              "plan": {"tp": 2, "pp": 4}}
    sim.simulate(load_scenario(inside))
    straddling = {**inside, "cluster": {**inside["cluster"], "num_nodes": 2}}
    sim.simulate(load_scenario(straddling))
    across, within, mixed = seen[0], seen[-2], seen[-1]  # (an MoE plan is also run with balanced routing)
    assert across["p2p_nic"] == across["p2p_time"] and min(across["p2p_time"]) > 0
    assert within["p2p_nic"] == [0.0] * 4 and min(within["p2p_time"]) > 0
    t, nic = mixed["p2p_time"], mixed["p2p_nic"]
    assert nic[0] == nic[2] == 0 and nic[1] == t[1] and nic[3] == t[3]
    assert t[1] == t[3] > t[0] == t[2] > 0


MOE_BASE = {"model": {"preset": "mixtral-8x7b"},
            "cluster": {"gpu": "h100-sxm-80gb", "num_nodes": 8, "gpus_per_node": 8},
            "training": {"seq_length": 4096, "global_batch_size": 256, "precision": "bf16"},
            "plan": {"tp": 1, "pp": 4, "ep": 8}}


def with_(section, **kw):
    raw = {k: dict(v) for k, v in MOE_BASE.items()}
    raw[section].update(kw)
    return raw


def test_bad_moe_input_is_named():
    with pytest.raises(ConfigError, match=r"model.moe.top_k: 9 is more than num_experts \(8\)"):
        load_scenario(with_("model", moe={"num_experts": 8, "top_k": 9, "expert_ffn_hidden_size": 14336}))
    with pytest.raises(ConfigError, match=r"model.moe.routing.tokens_per_expert: has 3 counts but model.moe.num_experts is 8"):
        load_scenario(with_("model", moe={"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 14336,
                                          "routing": {"distribution": "histogram", "tokens_per_expert": [1, 2, 3]}}))
    for extra, words in (({"expert_groups": 3}, r"model.moe.expert_groups: 3 does not divide num_experts \(8\)"),
                         ({"expert_groups": 2, "groups_per_token": 3},
                          r"model.moe.groups_per_token: 3 is more than expert_groups \(2\)"),
                         ({"expert_groups": 8, "groups_per_token": 1},
                          r"model.moe.groups_per_token: 1 groups of 1 experts hold fewer than top_k \(2\)")):
        with pytest.raises(ConfigError, match=words):
            load_scenario(with_("model", moe={"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 14336, **extra}))
    grouped = load_scenario(with_("model", moe={"num_experts": 8, "top_k": 2, "expert_ffn_hidden_size": 14336,
                                                "expert_groups": 4}))
    assert grouped.model.moe.groups_per_token == 4  # every group unless limited
    with pytest.raises(InfeasiblePlanError, match=r"plan.ep: 16 does not divide model.moe.num_experts \(8\)"):
        simulate(load_scenario(with_("plan", ep=16)))
    with pytest.raises(InfeasiblePlanError, match=r"plan.ep: ep x expert_tp = 8 x 1 does not divide the 4 ranks"):
        simulate(load_scenario(with_("plan", tp=1, pp=16, ep=8)))


def test_flops_count_active_experts_only(h100_net):
    from simulator.flops import forward_flops_per_token

    sc, _, _ = h100_net
    gemm, _, _ = forward_flops_per_token(sc.model, 4096)
    m = sc.model
    attn = 2 * (m.hidden_size * (m.q_channels + 2 * m.kv_channels) + m.q_channels * m.hidden_size)
    experts = 2 * (2 * 3 * m.hidden_size * 14336 + m.hidden_size * 8)  # top-2 SwiGLU experts + router
    assert gemm == pytest.approx(32 * (attn + experts))


@pytest.mark.parametrize("s", [1.2, 2.0])
def test_an_expert_gets_at_most_one_copy_per_token(s):
    """Top-8 of 256 experts under a steep zipf: uncapped the favourite expert's share k x p
    exceeds 1 (more copies than tokens); capped it takes every token once and the excess goes to
    the others in proportion."""
    moe = MoESpec(num_experts=256, top_k=8, expert_ffn_hidden_size=2048,
                  routing=RoutingSpec(distribution="zipf", s=s, seed=3))
    tokens, ep = 4096.0, 64
    draw = draw_routing(moe, ep, tokens)
    assert draw.expert_tokens.max() <= tokens * ep * (1 + 1e-9)
    assert draw.expert_tokens.sum() == pytest.approx(tokens * ep * 8)  # copies are conserved


def test_cap_shares_by_hand():
    # 0.7 over a cap of 0.5: 0.2 spread over 0.2 and 0.1 in proportion (2:1)
    assert cap_shares(np.array([0.7, 0.2, 0.1]), 0.5) == pytest.approx([0.5, 0.2 + 0.2 * 2 / 3, 0.1 + 0.2 / 3])
    # a spread that pushes another share over the cap is capped in turn
    assert cap_shares(np.array([0.6, 0.3, 0.1]), 0.4) == pytest.approx([0.4, 0.4, 0.2])
    uniform = np.full(8, 1 / 8)
    assert cap_shares(uniform, 1 / 8) == pytest.approx(uniform)


def test_a_histogram_needs_top_k_experts_in_use():
    with pytest.raises(ConfigError, match=r"has 1 non-zero counts, fewer than model.moe.top_k \(2\)"):
        load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml",
                      ["model.moe.routing.distribution=histogram", "model.moe.routing.tokens_per_expert=[100,0,0,0,0,0,0,0]"])


def test_a_zipf_exponent_with_another_distribution_is_refused():
    with pytest.raises(ConfigError, match="model.moe.routing.s: is the zipf exponent, but distribution is uniform"):
        load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml", ["model.moe.routing.s=1.5"])
    sc = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml",
                       ["model.moe.routing.s=1.5", "model.moe.routing.distribution=zipf"])
    assert sc.model.moe.routing.s == 1.5


@pytest.mark.parametrize("distribution", ["uniform", "zipf"])
def test_a_histogram_with_another_distribution_is_refused(distribution):
    """(It had been ignored: the uniform step time, where the histogram's skew does not fit.)"""
    with pytest.raises(ConfigError, match="model.moe.routing.tokens_per_expert: is the histogram's counts, "
                                          f"but distribution is {distribution}"):
        load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml",
                      [f"model.moe.routing.distribution={distribution}",
                       "model.moe.routing.tokens_per_expert=[100,1,1,1,1,1,1,1]"])


@pytest.mark.parametrize("shared_experts", [1, 4])
def test_shared_expert_overlap_hides_both_exchanges_minus_their_sm_share(h100_net, shared_experts):
    """--moe-shared-expert-overlap runs the shared experts on their own stream: the up projection
    and activation beside the dispatch all-to-all, the down projection beside the combine. Each
    exchange costs only what its half does not cover, and the shared experts run COMM_SM_SHARE of
    the overlap longer (hwmodels.network.overlapped; both of its branches are checked in
    tests/test_hwmodels_network.py). Mixtral's in-node exchanges are shorter than either half, so
    both hide whole and each costs 0.15 of itself."""
    from hwmodels.network import overlapped
    from simulator.moe import _shared_experts  # noqa: PLC2701

    sc, gpu, net = h100_net
    model = replace(sc.model, moe=replace(sc.model.moe, num_shared_experts=shared_experts))
    sc, ctx = _ctx(replace(sc, model=model), gpu, net)
    assert sc.plan.tp == 1  # no shared-expert TP traffic
    etp, ep, _ = expert_group_layouts(sc.plan, 8)
    draw = draw_routing(model.moe, sc.plan.ep, ctx.tokens)
    for backward in (False, True):
        plain = moe_block(ctx, draw, ep, etp, overlap_shared=False)(ctx, backward)
        hidden = moe_block(ctx, draw, ep, etp, overlap_shared=True)(ctx, backward)
        a2a = plain.parts["ep_comm"] / 2  # dispatch + combine, no expert-TP
        up, down, tp = _shared_experts(ctx, backward)
        assert tp == 0 and a2a < down < up
        assert hidden.parts["ep_comm"] == pytest.approx(overlapped(up, a2a) - up + overlapped(down, a2a) - down)
        assert hidden.parts["ep_comm"] == pytest.approx(2 * 0.15 * a2a)
        assert hidden.parts["compute"] == pytest.approx(plain.parts["compute"])


def test_shared_expert_overlap_runs_the_shared_tp_traffic_on_the_side_stream(h100_net):
    """Under TP the shared experts' gather and reduce-scatter run on their stream too
    (SharedExpertMLP pre_forward_comm / post_forward_comm): half of that traffic goes with each
    exchange's overlap, so an exchange shorter than its half costs 0.15 of itself, and the TP time
    still counts once, as without the overlap."""
    from hwmodels.network import overlapped
    from simulator.moe import _shared_experts  # noqa: PLC2701

    sc, gpu, net = h100_net
    model = replace(sc.model, moe=replace(sc.model.moe, num_shared_experts=2))
    sc, ctx = _ctx(replace(sc, model=model), gpu, net, tp=2, dp=32, sequence_parallel=True)
    etp, ep, _ = expert_group_layouts(sc.plan, 8)
    draw = draw_routing(model.moe, sc.plan.ep, ctx.tokens)
    for backward in (False, True):
        plain = moe_block(ctx, draw, ep, etp, overlap_shared=False)(ctx, backward)
        hidden = moe_block(ctx, draw, ep, etp, overlap_shared=True)(ctx, backward)
        a2a = plain.parts["ep_comm"] / 2
        up, down, tp = _shared_experts(ctx, backward)
        assert tp > 0
        halves = (up + tp / 2, down + tp / 2)
        assert hidden.parts["ep_comm"] == pytest.approx(sum(overlapped(x, a2a) - x for x in halves), rel=1e-12)
        assert hidden.parts["tp_comm"] == pytest.approx(plain.parts["tp_comm"], rel=1e-12)
        assert hidden.total < plain.total


def test_copies_dropped_at_capacity_are_not_counted_as_model_flops():
    """With a capacity factor the experts skip the copies over capacity: TFLOP/s and MFU count
    the routed experts' work times the share kept."""
    from simulator.flops import model_flops

    over = ["model.moe.routing.distribution=zipf", "model.moe.capacity_factor=1.0"]
    sc = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml", over)
    r = simulate(sc, imbalance_reference=False)
    tokens, world = sc.training.global_batch_size * sc.training.seq_length, sc.plan.world_size
    assert r.moe.dropped_fraction > 0.05
    done = r.tflops_per_gpu * 1e12 * r.step_time_s * world
    assert done == pytest.approx(model_flops(sc.model, sc.training.seq_length, tokens, 1 - r.moe.dropped_fraction))
    assert done < model_flops(sc.model, sc.training.seq_length, tokens)


def test_a_recomputed_moe_layer_holds_no_dense_mlp():
    """Under full recompute the layer being recomputed holds its full activations during its
    backward; in an all-MoE model that layer has experts, not the dense MLP, so the (unused) dense
    ffn_hidden_size must not change any stage's memory, while the experts' width does."""
    sc = load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml")
    sc = replace(sc, plan=replace(sc.plan, recompute="full"))

    def activations(model):
        return [s.memory["activations"] for s in simulate(replace(sc, model=model)).stages]

    base = activations(sc.model)
    assert activations(replace(sc.model, ffn_hidden_size=4 * sc.model.ffn_hidden_size)) == base
    wider = replace(sc.model.moe, expert_ffn_hidden_size=2 * sc.model.moe.expert_ffn_hidden_size)
    assert all(w > b for w, b in zip(activations(replace(sc.model, moe=wider)), base))


def _moe_kernel_bytes(monkeypatch, ctx, draw, ep, etp) -> list[float]:
    """The bytes of every memory-bound kernel simulator.moe prices for one MoE block, forward then
    backward (router softmax, permute, unpermute, then any sort, per direction)."""
    import simulator.moe as moe_module

    seen: list[float] = []
    real = moe_module.memory_bound_time
    monkeypatch.setattr(moe_module, "memory_bound_time", lambda g, nbytes: seen.append(nbytes) or real(g, nbytes))
    moe_block(ctx, draw, ep, etp, overlap_shared=False)
    monkeypatch.setattr(moe_module, "memory_bound_time", real)
    return seen


def test_alltoall_dispatcher_sorts_received_tokens_by_local_expert(h100_net, monkeypatch):
    """Megatron-Core's alltoall dispatcher sorts what it received by local expert and back
    ("Permutation 2" / "Unpermutation 2"): with two local experts (EP 4 of Mixtral's 8) each
    direction pays one more read and write of the received tokens (the backward's sort is the
    inverse permutation: the same bytes); DeepEP's and one expert's do not."""
    sc, gpu, net = h100_net
    h = sc.model.hidden_size
    base = dict(tp=1, pp=1, dp=64, ep=4, virtual_pipeline_stages=1, schedule="1f1b")
    # the sort runs after the expert-TP gather, on expert_tp times the tokens, and at EP 1 too
    # (sort_chunks_by_idxs whenever a rank holds more than one expert)
    for plan, ranks in ((base, 4), (dict(base, ep=2, expert_tp=2), 2), (dict(base, ep=1), 1)):
        _, a2a = _ctx(sc, gpu, net, **plan, moe_dispatcher="alltoall")
        _, flex = _ctx(sc, gpu, net, **plan, moe_dispatcher="deepep")
        etp, ep, _ = expert_group_layouts(a2a.plan, 8)
        draw = draw_routing(sc.model.moe, ranks, a2a.tokens)
        sort = 2 * float(draw.expert_tokens[draw.busiest_rank].sum()) * a2a.plan.expert_tp * h * 2
        assert _moe_kernel_bytes(monkeypatch, a2a, draw, ep, etp).count(pytest.approx(sort, rel=1e-12)) == 2
        assert pytest.approx(sort, rel=1e-12) not in _moe_kernel_bytes(monkeypatch, flex, draw, ep, etp)


def test_deepep_moves_a_token_once_per_destination_rank(h100_net):
    """DeepEP sends a token to a rank once however many of that rank's experts chose it; the rank
    expands it to its experts. Qwen3's 128 experts top-8 on EP 8 reach 5.34 ranks: 2/3 of the copies."""
    from simulator.moe import deepep_rank_share

    sc, gpu, net = h100_net
    qwen = replace(sc.model, moe=replace(sc.model.moe, num_experts=128, top_k=8))
    base = dict(tp=1, pp=1, dp=64, ep=8, virtual_pipeline_stages=1, schedule="1f1b")
    _, a2a = _ctx(replace(sc, model=qwen), gpu, net, **base, moe_dispatcher="alltoall")
    _, flex = _ctx(replace(sc, model=qwen), gpu, net, **base, moe_dispatcher="deepep")
    etp, ep, _ = expert_group_layouts(a2a.plan, 8)
    assert ep.num_nodes == 1 and deepep_rank_share(flex) == pytest.approx(5.3394 / 8, rel=1e-4)
    draw = draw_routing(qwen.moe, 8, a2a.tokens, balanced=True)
    ep_comm = lambda ctx: moe_block(ctx, draw, ep, etp, overlap_shared=False)(ctx, False).parts["ep_comm"]  # noqa: E731
    copies = draw.sent_per_rank * qwen.hidden_size * 2
    assert ep_comm(a2a) == pytest.approx(2 * collective_time(net, "all_to_all", copies, ep), rel=1e-6)
    assert ep_comm(flex) == pytest.approx(2 * collective_time(net, "all_to_all", copies * 5.3394 / 8, ep), rel=1e-4)


def test_deepep_reaches_expert_tp_ranks_in_its_own_exchange(h100_net):
    """Megatron-Core runs DeepEP over the expert-TP x EP group (MoEFlexTokenDispatcher, tp_ep_group)
    and sends a token to every expert-TP rank of its experts: no expert-TP gather or scatter, and
    expert_tp times the copies per token. Qwen3 on EP 4 x expert-TP 2 inside a node, by hand."""
    from paraplan.placement import expert_dispatch_layout
    from simulator.moe import deepep_rank_share

    sc, gpu, net = h100_net
    qwen = replace(sc.model, moe=replace(sc.model.moe, num_experts=128, top_k=8))
    base = dict(tp=1, pp=1, dp=64, ep=4, expert_tp=2, virtual_pipeline_stages=1, schedule="1f1b")
    _, a2a = _ctx(replace(sc, model=qwen), gpu, net, **base, moe_dispatcher="alltoall")
    _, flex = _ctx(replace(sc, model=qwen), gpu, net, **base, moe_dispatcher="deepep")
    etp, ep, _ = expert_group_layouts(flex.plan, 8)
    group = expert_dispatch_layout(flex.plan, 8)
    assert (group.size, group.num_nodes) == (8, 1) and expert_dispatch_layout(a2a.plan, 8) == ep
    reached = nodes_reached(128, 8, 4)
    assert deepep_rank_share(flex) == pytest.approx(2 * reached / 8, rel=1e-12)
    draw = draw_routing(qwen.moe, 4, flex.tokens, balanced=True)
    load = float(draw.rank_loads.max())
    nbytes = max(draw.sent_per_rank, load) * qwen.hidden_size * 2 * 2 * reached / 8
    for backward in (False, True):
        cost = moe_block(flex, draw, group, etp, overlap_shared=False)(flex, backward)
        assert cost.parts["ep_comm"] == pytest.approx(2 * collective_time(net, "all_to_all", nbytes, group), rel=1e-12)
        # the all-to-all dispatcher gathers and scatters over expert-TP besides its EP exchange
        plain = moe_block(a2a, draw, ep, etp, overlap_shared=False)(a2a, backward).parts["ep_comm"]
        gathered = load * 2 * qwen.hidden_size * 2
        etp_comm = (collective_time(net, "all_gather", gathered, etp)
                    + collective_time(net, "reduce_scatter", gathered, etp))
        a2a_bytes = max(draw.sent_per_rank, load) * qwen.hidden_size * 2
        assert plain == pytest.approx(2 * collective_time(net, "all_to_all", a2a_bytes, ep) + etp_comm, rel=1e-12)


def test_moe_activations_keep_each_copys_probability_not_its_output(h100_net):
    """Megatron-Core weights each copy inside the expert activation (TEGroupedMLP,
    weighted_bias_swiglu_impl with permuted_probs) and unpermutes unweighted: the backward keeps a
    4-byte probability per copy, not its h-wide expert output. By hand for Mixtral at EP 8."""
    from simulator.moe import moe_activation_bytes

    sc, gpu, net = h100_net
    _, ctx = _ctx(sc, gpu, net, tp=1, pp=1, dp=64, ep=8, virtual_pipeline_stages=1, schedule="1f1b",
                  recompute="none")
    e, h, f = sc.model.moe, sc.model.hidden_size, sc.model.moe.expert_ffn_hidden_size
    draw = draw_routing(e, 8, ctx.tokens, balanced=True)
    load = float(draw.rank_loads.max())
    by_hand = (2 * ctx.tokens * e.num_experts * 4 + draw.sent_per_rank * 4
               + load * h * 2 + load * f * sc.model.ffn_matrices * 2)
    assert moe_activation_bytes(ctx, draw) == pytest.approx(by_hand, rel=1e-12)


def test_the_balanced_reference_does_not_depend_on_the_drawn_routing(h100_net):
    """The reference run shares the plan's setup with the drawn-routing run; nothing of the draw
    may leak into it: zipf and uniform routing report the same balanced step and layer, and the
    balanced layer the reference run simulates is the one costed without it."""
    sc, _, _ = h100_net
    zipf = replace(sc, model=replace(sc.model, moe=replace(sc.model.moe, routing=RoutingSpec(distribution="zipf", s=1.2))))
    a, b = simulate(sc), simulate(zipf)
    assert a.moe.balanced_step_time_s == b.moe.balanced_step_time_s
    assert a.moe.balanced_moe_layer_time_s == b.moe.balanced_moe_layer_time_s
    assert b.step_time_s > a.moe.balanced_step_time_s
    without = simulate(zipf, imbalance_reference=False)
    assert without.moe.balanced_step_time_s is None
    assert without.moe.balanced_moe_layer_time_s == b.moe.balanced_moe_layer_time_s
    assert without.step_time_s == b.step_time_s


def test_dispatch_buffers_hold_the_expert_tp_gathered_tokens(h100_net):
    """Send buffer: the rank's routed copies; receive side: the busiest rank's copies, all-gathered
    over the expert-TP group before its experts run (expert_tp x as many)."""
    from simulator.moe import dispatch_buffer_bytes

    sc, gpu, net = h100_net
    h = sc.model.hidden_size
    for etp in (1, 2):
        _, ctx = _ctx(sc, gpu, net, tp=2, pp=4, dp=8, ep=4, expert_tp=etp)
        draw = draw_routing(sc.model.moe, 4, ctx.tokens, balanced=True)
        want = (draw.sent_per_rank + etp * float(draw.rank_loads.max())) * h * 2
        assert dispatch_buffer_bytes(ctx, draw) == pytest.approx(want, rel=1e-12)


def test_permutation_bytes_follow_transformer_engine_kernels(h100_net, monkeypatch):
    """Transformer Engine's fused permute reads each token once and writes its copies, the
    unpermute the reverse, and each one's backward is the other's kernel (TE permutation.py): every
    one moves copies + tokens rows. The alltoall dispatcher permutes the routed tokens before
    sending; DeepEP's receiving rank permutes the distinct tokens it received (one per source token
    and destination rank) into its experts' copies."""
    from simulator.moe import deepep_rank_share, routed_tokens_per_rank

    sc, gpu, net = h100_net
    row = sc.model.hidden_size * 2
    for dispatcher in ("alltoall", "deepep"):
        _, ctx = _ctx(sc, gpu, net, tp=1, pp=1, dp=64, ep=8, virtual_pipeline_stages=1, schedule="1f1b",
                      moe_dispatcher=dispatcher)
        etp, ep, _ = expert_group_layouts(ctx.plan, 8)
        draw = draw_routing(sc.model.moe, 8, ctx.tokens)
        load = float(draw.expert_tokens[draw.busiest_rank].sum())
        rows = (draw.sent_per_rank + routed_tokens_per_rank(ctx) if dispatcher == "alltoall"
                else load * (1 + deepep_rank_share(ctx)))
        seen = _moe_kernel_bytes(monkeypatch, ctx, draw, ep, etp)
        # each direction: the router's softmax, then the permute, priced once for the unpermute too
        # (the same rows; one expert a rank: no sort)
        assert len(seen) == 4
        assert [seen[1], seen[3]] == pytest.approx([rows * row] * 2, rel=1e-12)
    # DeepEP with expert TP: every expert-TP rank of a chosen expert receives the token and runs its
    # copies (deepep_rank_share counts those ranks), so the rows are the group's copies
    _, ctx = _ctx(sc, gpu, net, tp=1, pp=1, dp=64, ep=4, expert_tp=2, virtual_pipeline_stages=1, schedule="1f1b",
                  moe_dispatcher="deepep")
    etp, ep, _ = expert_group_layouts(ctx.plan, 8)
    draw = draw_routing(sc.model.moe, 4, ctx.tokens)
    load = float(draw.expert_tokens[draw.busiest_rank].sum())
    seen = _moe_kernel_bytes(monkeypatch, ctx, draw, ep, etp)
    assert seen[1] == pytest.approx((2 * load + load * deepep_rank_share(ctx)) * row, rel=1e-12)
