"""Formulas at the settings the other tests leave at their neutral value (cp 1, no multi-token
prediction, no shared experts, tp 1 under MoE, a capacity factor of 1, no barrier time), each
checked against a hand-computed expectation: a term dropped or misplaced there fails here."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from hwmodels.network import collective_time, spread_hop
from paraplan.loader import load_scenario
from paraplan.specs import ModelSpec, MoESpec, PlanSpec, RoutingSpec
from simulator.cost import Cost
from simulator.engine import StageWork, run_iteration
from simulator.schedules import Op, build_schedule, peak_in_flight

ROOT = Path(__file__).resolve().parents[1]


def _setup(scenario: str, sets=()):
    from simulator.simulate import _layer_kinds, _setup as setup_of  # noqa: PLC2701

    sc = load_scenario(ROOT / "scenarios" / scenario, list(sets))
    setup = setup_of(sc)
    kinds, draw = _layer_kinds(setup.ctx, setup.dispatch_layout, setup.expert_layouts[0], balanced=False)
    return sc, setup, kinds, draw


# -- memory ----------------------------------------------------------------------------------------

def test_zero_shards_the_model_states_over_dp_times_cp():
    """ZeRO-1 shards the optimizer states over the data-parallel ranks, which include the
    context-parallel ones (Megatron's distributed optimizer group is dp x cp): 12 bytes x 1e9
    parameters over 2 x 2 ranks."""
    from simulator.memory import stage_memory

    mem = stage_memory(plan=PlanSpec(dp=2, cp=2, zero_stage=1), precision="bf16", dense_params=1e9, activations=0.0,
                       max_layer_params=0.0)
    assert mem.optimizer == pytest.approx(12e9 / 4)
    assert mem.weights == pytest.approx(2e9) and mem.gradients == pytest.approx(4e9)


def test_logits_count_each_multi_token_prediction_module():
    """One microbatch's logits and one more per MTP module: 2 x 4,096 tokens x 51,200 / tp 2 x 4 bytes."""
    from simulator.memory import logits_bytes

    sc = load_scenario(ROOT / "scenarios" / "gpt3-175b-1024xa100.yaml")
    model = replace(sc.model, mtp_layers=1)
    plan = replace(sc.plan, tp=2, micro_batch_size=1, cp=1)
    assert model.vocab_size == 51200
    assert logits_bytes(model, plan, 4096, 4) == 2 * 4096 * 51200 / 2 * 4 == 838_860_800


# -- FLOPs -----------------------------------------------------------------------------------------

def test_moe_flops_count_the_router_the_active_and_the_shared_experts():
    """Forward GEMM FLOPs per token of an MoE FFN: the router (h x E) and top_k + shared experts,
    each ffn_matrices x h x f: 2 x (64 h + 9 x 3 h f) for 64 experts, top 8, one shared, SwiGLU."""
    from simulator.flops import _ffn_flops_per_token  # noqa: PLC2701

    h, f = 64, 32
    model = ModelSpec(name="m", num_layers=2, hidden_size=h, num_attention_heads=4, num_kv_heads=4, head_dim=16,
                      ffn_hidden_size=128, vocab_size=256, activation="swiglu",
                      moe=MoESpec(num_experts=64, top_k=8, expert_ffn_hidden_size=f, num_shared_experts=1))
    assert _ffn_flops_per_token(model, 0) == 2 * (h * 64 + 9 * 3 * h * f)
    assert _ffn_flops_per_token(model, 0, shared_only=True) == 2 * 3 * h * f


def test_selective_recompute_of_the_attention_core_adds_its_products_once():
    """HFU under selective recompute of core_attn, GPT: 72BsLh^2 (1 + s/4.5h + V/12hL), the
    attention products (4 s h per token and layer) run once more on top of model FLOPs."""
    from simulator.flops import hardware_flops

    sc = load_scenario(ROOT / "scenarios" / "gpt3-175b-1024xa100.yaml")
    m, s = sc.model, sc.training.seq_length
    h, L, V, tokens = m.hidden_size, m.num_layers, m.vocab_size, 4 * s
    want = 72 * tokens * L * h * h * (1 + s / (4.5 * h) + V / (12 * h * L))
    assert hardware_flops(m, s, tokens, "selective", ("core_attn",)) == pytest.approx(want, rel=1e-12)


# -- schedules and the engine ----------------------------------------------------------------------

def test_a_whole_backward_frees_what_its_microbatch_held():
    """F0 X0 F1 B1 W1 with 1 byte per microbatch and 0.5 more (counted from its F) that a B frees:
    the whole backward X0 frees all 1.5 of microbatch 0, so the peak is microbatch 1's 1.5, never
    the two microbatches' 2.5 or 2.0."""
    ops = [Op("F", 0, 0), Op("X", 0, 0), Op("F", 1, 0), Op("B", 1, 0), Op("W", 1, 0)]
    assert peak_in_flight(ops, [1.0], [0.5]) == 1.5
    assert peak_in_flight([Op("F", 0, 0), Op("F", 1, 0), Op("X", 0, 0), Op("X", 1, 0)], [1.0]) == 2.0


def test_the_step_waits_for_the_barrier_time():
    """One stage, 1F1B, F = 1, B = 2 per microbatch, one microbatch, 0.5 s at the end of the step
    (the pipeline-embedding sync): the step is 3.5 s and none of it is bubble."""
    ops = build_schedule("1f1b", 1, 1)[0]
    work = StageWork(ops=ops, op_cost={("F", 0): Cost().add("compute", 1.0), ("B", 0): Cost().add("compute", 2.0)},
                     grad_buckets={}, optimizer_time=0.0, param_gather_time=0.0)
    res = run_iteration([work], num_chunks=1, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.5)
    assert res.step_time == pytest.approx(3.5)
    assert res.stages[0].breakdown.get("pp_bubble", 0.0) == pytest.approx(0.0)



def test_a_send_contended_at_both_ends_waits_for_the_busier_end():
    """1F1B on 2 stages, 2 microbatches, sends of 0.5 s all on the NICs. Stage 1 (F = B = 1 s)
    sends B1's output at 5.5 s while its first gradient bucket (2 s on the NIC, ready mid-B1 at
    5.0 s) holds its NIC for 0.5 s of the send, and stage 0's B0 (2 s, all NIC traffic, 4.0-6.0 s)
    moves 0.5 s over the send's window. The two ends share at once, so the send is late by the
    busier end's 0.5 s, not by the sum: it lands at 6.5 s, stage 0's B1 pays its 0.5 s share of the
    send and ends at 9.0 s."""
    ops = build_schedule("1f1b", 2, 2)
    first = StageWork(ops=ops[0], op_cost={("F", 0): Cost().add("compute", 1.0),
                                            ("B", 0): Cost().add("ep_comm", 2.0).add_nic("ep_comm", 2.0)},
                      grad_buckets={}, optimizer_time=0.0, param_gather_time=0.0)
    last = StageWork(ops=ops[1], op_cost={("F", 0): Cost().add("compute", 1.0), ("B", 0): Cost().add("compute", 1.0)},
                     grad_buckets={0: [2.0, 0.1]}, grad_bucket_nic={0: [2.0, 0.1]}, optimizer_time=0.0,
                     param_gather_time=0.0)
    res = run_iteration([first, last], num_chunks=1, p2p_time=0.5, p2p_nic=0.5, overlap_grad_reduce=True,
                        sync_time=0.0)
    assert res.stages[0].compute_end == pytest.approx(9.0)

# -- MoE -------------------------------------------------------------------------------------------

def test_a_tensor_parallel_rank_routes_its_sequence_parallel_shard():
    """Megatron-Core requires sequence parallelism for MoE with TP: each TP rank routes tokens / tp
    (Qwen3-235B bundled: TP 2)."""
    from simulator.moe import routed_tokens_per_rank

    sc, setup, _, draw = _setup("qwen3-235b-256xh100.yaml")
    assert sc.plan.tp == 2 and sc.plan.sequence_parallel
    assert routed_tokens_per_rank(setup.ctx) == setup.ctx.tokens / 2
    assert draw.sent_per_rank == setup.ctx.tokens / 2 * sc.model.moe.top_k


def test_the_busiest_receiver_sets_the_alltoall_time():
    """Zipf routing on Mixtral (EP 8, one expert per rank, alltoall dispatcher): the most loaded rank
    receives more than any rank sends, and the dispatch and the combine each move that many bytes."""
    sc, setup, kinds, draw = _setup("mixtral-8x7b-64xh100.yaml",
                                    ["model.moe.routing={distribution: zipf, s: 1.2}"])
    assert sc.plan.moe_dispatcher == "alltoall" and setup.expert_layouts[0].size == 1
    load = float(draw.rank_loads.max())
    assert load > draw.sent_per_rank
    b = setup.ctx.act_bytes
    a2a = collective_time(setup.net, "all_to_all", load * sc.model.hidden_size * b, setup.dispatch_layout)
    assert kinds.fwd["moe"].parts["ep_comm"] == pytest.approx(2 * a2a, rel=1e-12)


def test_an_expert_capacity_above_one_keeps_that_many_copies():
    """Capacity = factor x tokens x top_k / experts (Fedus et al. 2021, Eq. 3): factor 2, 1,024
    tokens, top 2 of 8 experts -> 512 copies per expert; a steep zipf fills the popular ones and the
    rest of their copies are dropped."""
    from simulator.moe import draw_routing

    moe = MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=32, capacity_factor=2.0,
                  routing=RoutingSpec(distribution="zipf", s=3.0))
    draw = draw_routing(moe, 1, 1024.0)
    assert draw.expert_tokens.max() == 512
    assert draw.dropped > 0 and draw.expert_tokens.sum() + draw.dropped == 2048


def test_a_steep_zipf_is_capped_at_one_copy_per_token():
    """Top-k picks k distinct experts, so no expert takes more than 1/k of the copies."""
    from simulator.moe import expert_probabilities

    moe = MoESpec(num_experts=8, top_k=2, expert_ffn_hidden_size=32, routing=RoutingSpec(distribution="zipf", s=3.0))
    p = expert_probabilities(moe, np.random.default_rng(0))
    assert p.max() == pytest.approx(0.5) and p.sum() == pytest.approx(1.0)


def test_deepep_sends_each_token_to_the_other_nodes_only():
    """DeepEP across 2 nodes: a token goes over the network to the nodes it reaches other than its
    own, nodes_reached x (2 - 1) / 2 of them."""
    from simulator.moe import deepep_rank_share, deepep_time, nodes_reached

    sc, setup, _, _ = _setup("qwen3-235b-256xh100.yaml", ["plan.tp=2", "plan.ep=16", "plan.moe_dispatcher=deepep"])
    layout = setup.dispatch_layout
    assert layout.num_nodes == 2
    ctx, m = setup.ctx, sc.model
    e, h, b, routed = m.moe, m.hidden_size, ctx.act_bytes, 1000.0
    net = routed * nodes_reached(e.num_experts, e.top_k, 2, e.expert_groups, e.groups_per_token) * 0.5 * h * b
    rdma = collective_time(ctx.network, "send_recv", net, spread_hop(ctx.network, layout))
    from paraplan.placement import GroupLayout

    ppn = layout.ranks_per_node
    nvl = collective_time(ctx.network, "all_to_all", routed * e.top_k * deepep_rank_share(ctx) * h * b,
                          GroupLayout(size=ppn, ranks_per_node=ppn, num_nodes=1))
    assert deepep_time(ctx, routed, 1.0, layout) == pytest.approx(max(rdma, nvl), rel=1e-12)
    assert rdma > nvl  # the network leg is the one this checks


# -- layer pieces ----------------------------------------------------------------------------------

def test_the_ffn_norm_and_residual_move_their_bytes():
    """The pre-MLP norm reads and writes h; the bias-dropout-add reads 2h and writes h plus a 1-byte
    mask: memory_bound_time of T x 2h x b and of T x (3h x b + h), T the h-wide tokens."""
    from hwmodels.compute import memory_bound_time
    from simulator.workload import ffn_norm_residual

    sc, setup, _, _ = _setup("gpt3-175b-1024xa100.yaml")
    ctx, h = setup.ctx, sc.model.hidden_size
    assert sc.model.dropout > 0 and sc.plan.sequence_parallel
    t, b = ctx.tokens / sc.plan.tp, ctx.act_bytes
    want = memory_bound_time(ctx.gpu, t * 2 * h * b) + memory_bound_time(ctx.gpu, t * (3 * h * b + h))
    assert ffn_norm_residual(ctx, False) == pytest.approx(want, rel=1e-12)


def test_context_parallel_backward_sends_twice_the_kv_bytes():
    """Ring attention's backward returns dK and dV with K and V: each step's send_recv moves twice
    the forward's bytes (Llama-3 70B at CP 2 over two nodes, where every step's send holds the NIC)."""
    from simulator.workload import _cp_exchange  # noqa: PLC2701

    sc, setup, _, _ = _setup("llama3-70b-1024xh100.yaml", ["plan.cp=2"])
    ctx, m, p = setup.ctx, sc.model, sc.plan
    assert ctx.cp_layout.num_nodes > 1  # every step's send holds the NIC: Cost.nic counts them all
    kv = ctx.tokens * (m.k_channels + m.v_channels) // p.tp * ctx.act_bytes
    for backward, factor in ((False, 1), (True, 2)):
        step = collective_time(ctx.network, "send_recv", kv * factor, ctx.cp_layout)
        assert _cp_exchange(ctx, backward).nic == pytest.approx((p.cp - 1) * step, rel=1e-12)


def test_an_all_gather_exchange_gathers_k_and_v_and_reduce_scatters_their_gradients():
    """cp_comm_type all_gather (Transformer Engine's AttnFuncWithCPAndKVAllGather): the forward
    all-gathers K and V over the whole sequence, exposed; the backward gathers them again and
    reduce-scatters dK and dV (nccl-tests sizes: the gathered tensor). Llama-3 70B at CP 2 over two
    nodes, where every transfer holds the NIC."""
    from simulator.workload import _cp_exchange  # noqa: PLC2701

    sc, setup, _, _ = _setup("llama3-70b-1024xh100.yaml", ["plan.cp=2", "plan.cp_comm_type=all_gather"])
    ctx, m, p = setup.ctx, sc.model, sc.plan
    assert ctx.cp_layout.num_nodes > 1
    whole = p.micro_batch_size * sc.training.seq_length * m.k_channels / p.tp * ctx.act_bytes  # K (V alike)
    gather = collective_time(ctx.network, "all_gather", whole, ctx.cp_layout)
    scatter = collective_time(ctx.network, "reduce_scatter", whole, ctx.cp_layout)
    assert m.k_channels == m.v_channels
    for backward, want in ((False, 2 * gather), (True, 2 * gather + 2 * scatter)):
        cost = _cp_exchange(ctx, backward)
        assert cost.parts["cp_comm"] == pytest.approx(want, rel=1e-12)
        assert cost.nic == pytest.approx(want, rel=1e-12)


def test_an_all_gather_attention_runs_two_chunk_calls_on_the_slowest_rank():
    """Each rank's two chunks of s/2cp queries attend to the gathered keys up to themselves (r + 1
    and 2cp - r chunks, bottom-right causal): together 1/cp of the causal FLOPs on every rank, and
    the slowest rank's pair is the layer's."""
    from hwmodels.compute import attention_flops, attention_time
    from simulator.workload import _attention_core  # noqa: PLC2701

    cp = 4
    sc, setup, _, _ = _setup("llama3-70b-1024xh100.yaml", [f"plan.cp={cp}", "plan.cp_comm_type=all_gather",
                                                          "training.seq_length=32768", "training.global_batch_size=256"])
    ctx, m, p = setup.ctx, sc.model, sc.plan
    seq, chunk = sc.training.seq_length, sc.training.seq_length // (2 * cp)
    kw = dict(batch=p.micro_batch_size, heads=m.num_attention_heads // p.tp, head_dim=m.head_dim, causal=True)
    for r in range(cp):
        pair = sum(attention_flops(q_len=chunk, kv_len=k * chunk, backward=False, **kw) for k in (r + 1, 2 * cp - r))
        assert pair == pytest.approx(attention_flops(q_len=seq, kv_len=seq, backward=False, **kw) / cp, rel=1e-12)
    for backward in (False, True):
        pairs = [sum(attention_time(ctx.gpu, q_len=chunk, kv_len=k * chunk, dtype="bf16", backward=backward,
                                    kernel=ctx.attention_kernel, **kw) for k in (r + 1, 2 * cp - r)) for r in range(cp)]
        assert _attention_core(ctx, backward) == pytest.approx(max(pairs), rel=1e-12)
        assert len({round(t, 15) for t in pairs}) > 1  # the ranks' shapes differ


def test_the_cp_exchange_buffers_count_in_the_working_set():
    """What the exchange holds beside the stored activations (Transformer Engine): p2p every K/V
    chunk the ring brought in and every step's partial output (cp of each), all_gather the gathered
    K/V and a copy (2cp chunks), a2a three copies of the rank's Q, K and V; the working set of a
    stage grows by exactly that. all_gather also stores its output twice (its own saved chunks and
    the copy it returns). Llama-3 70B, 64k tokens, tp 1, cp 8: K/V of one rank's slice is 8,192
    tokens x 2 x 1,024 channels x 2 bytes, its Q and output 8,192 x 8,192 x 2 bytes each."""
    from simulator.memory import cp_exchange_working_bytes
    from simulator.workload import cp_groups_of

    base = ["training.seq_length=65536", "training.global_batch_size=256", "plan.cp=8", "plan.tp=1", "plan.dp=null",
            "plan.recompute=none"]  # the attention keeps its output (no core_attn checkpoint)
    kv = 8192 * 2 * 1024 * 2
    q = 8192 * 8192 * 2
    want = {"p2p": 8 * (kv + q), "all_gather": 16 * kv, "a2a": 3 * (q + kv)}
    peaks, stored = {}, {}
    for kind, expected in want.items():
        sc, setup, kinds, _ = _setup("llama3-70b-1024xh100.yaml", [*base, f"plan.cp_comm_type={kind}"])
        assert cp_exchange_working_bytes(sc.model, sc.plan, 65536, 2, a2a=cp_groups_of(setup.ctx)[0]) == expected
        peaks[kind], stored[kind] = kinds.working["dense"], kinds.acts["dense"]
    assert peaks["all_gather"] - peaks["p2p"] == pytest.approx(16 * kv - 8 * (kv + q))
    assert peaks["a2a"] - peaks["p2p"] == pytest.approx(3 * (q + kv) - 8 * (kv + q))
    assert stored["all_gather"] - stored["p2p"] == pytest.approx(q) and stored["a2a"] == stored["p2p"]
    assert cp_exchange_working_bytes(sc.model, PlanSpec(), 65536, 2, a2a=1) == 0  # cp 1: no exchange
    # a2a+p2p, 2 x 4: the exchanged q, k, v held through a ring of 4 chunks as large as p2p's
    hier = replace(sc.plan, cp_comm_type="a2a+p2p", cp_a2a_size=2)
    assert cp_exchange_working_bytes(sc.model, hier, 65536, 2, a2a=2) == (q + kv) + 4 * (kv + q)


def test_an_a2a_exchange_trades_the_sequence_split_for_a_head_split():
    """cp_comm_type a2a (DeepSpeed-Ulysses, TE's AttnFuncWithCPAndQKVOA2A): all-to-alls of Q, K, V
    and the output in the forward, of the output, its gradient, dQ, dK and dV in the backward, all
    exposed; one causal attention over the whole sequence on 1/cp of the rank's heads. Llama-3 8B
    (32 heads, 8 KV heads) at TP 2, CP 4 inside a node."""
    from hwmodels.compute import attention_time
    from simulator.workload import _attention_core, _cp_exchange  # noqa: PLC2701

    sc, setup, _, _ = _setup("llama3-8b-64xh100.yaml", ["plan.tp=2", "plan.cp=4", "plan.cp_comm_type=a2a",
                                                        "plan.pp=1", "plan.dp=8"])
    ctx, m, p = setup.ctx, sc.model, sc.plan
    assert ctx.cp_layout.num_nodes == 1
    local = ctx.tokens / p.tp * ctx.act_bytes
    q, kv = (collective_time(ctx.network, "all_to_all", local * c, ctx.cp_layout) for c in (m.q_channels, m.k_channels))
    assert m.o_channels == m.q_channels and m.k_channels == m.v_channels
    assert _cp_exchange(ctx, False).parts["cp_comm"] == pytest.approx(2 * q + 2 * kv, rel=1e-12)
    assert _cp_exchange(ctx, True).parts["cp_comm"] == pytest.approx(3 * q + 2 * kv, rel=1e-12)
    assert _cp_exchange(ctx, True).nic == 0  # inside a node
    seq = sc.training.seq_length
    whole = attention_time(ctx.gpu, batch=p.micro_batch_size, heads=m.num_attention_heads // p.tp // p.cp, q_len=seq,
                           kv_len=seq, head_dim=m.head_dim, dtype="bf16", causal=True, backward=False,
                           kernel=ctx.attention_kernel)
    assert _attention_core(ctx, False) == pytest.approx(whole, rel=1e-12)


def test_hierarchical_cp_runs_a2a_inside_each_group_and_the_ring_across_them():
    """cp_comm_type a2a+p2p (TE's hierarchical groups): all-to-alls of Q, K, V, O over each group of
    cp_a2a_size consecutive CP ranks, then p2p's ring over the cp / cp_a2a_size groups with K/V
    chunks of s/ring tokens and 1/a2a of the heads (as many bytes as p2p's), hidden behind ring
    steps of that shape. Llama-3 8B, tp 1, cp 16 over two nodes: a2a 4 (in a node), ring 4 (across)."""
    from hwmodels.compute import attention_time
    from hwmodels.network import COMM_SM_SHARE
    from paraplan.placement import cp_group_layouts, cp_split
    from simulator.workload import _attention_core, _cp_exchange, cp_groups_of  # noqa: PLC2701

    sets = ["training.seq_length=131072", "training.global_batch_size=16", "plan.cp=16", "plan.dp=null",
            "plan.recompute=full", "plan.cp_comm_type=a2a+p2p", "plan.cp_a2a_size=4"]
    sc, setup, _, _ = _setup("llama3-8b-64xh100.yaml", sets)
    ctx, m, p = setup.ctx, sc.model, sc.plan
    a2a, ring, inner, outer = cp_groups_of(ctx)
    assert (a2a, ring) == (4, 4) and (inner.num_nodes, outer.num_nodes) == (1, 2)
    seq, local = sc.training.seq_length, ctx.tokens * ctx.act_bytes
    kw = dict(batch=1, heads=m.num_attention_heads // a2a, head_dim=m.head_dim, causal=True, dtype="bf16",
              kernel=ctx.attention_kernel)
    for backward in (False, True):
        step = attention_time(ctx.gpu, q_len=seq // ring, kv_len=seq // ring, backward=backward, **kw)
        assert _attention_core(ctx, backward) == pytest.approx(ring * step, rel=1e-12)
        sends = collective_time(ctx.network, "send_recv", local * 2 * m.kv_channels * (2 if backward else 1), outer)
        q, kv = (collective_time(ctx.network, "all_to_all", local * c, inner) for c in (m.q_channels, m.kv_channels))
        a2as = (3 * q + 2 * kv) if backward else (2 * q + 2 * kv)
        hidden = (ring - 1) * (max(step, sends) + COMM_SM_SHARE * min(step, sends) - step)
        cost = _cp_exchange(ctx, backward)
        assert cost.parts["cp_comm"] == pytest.approx(a2as + hidden, rel=1e-9)
        assert cost.nic == pytest.approx((ring - 1) * sends, rel=1e-12)  # only the ring leaves the node
    # without cp_a2a_size: the largest group inside a node that splits the heads (8 CP ranks at tp 1)
    derived = load_scenario(ROOT / "scenarios" / "llama3-8b-64xh100.yaml", sets[:-1])
    assert cp_split(derived.plan, derived.model, 8) == (8, 2)
    assert cp_split(replace(derived.plan, tp=4), derived.model, 8) == (2, 8)  # 4 x 2 ranks fill a node
    assert cp_split(replace(derived.plan, tp=8), derived.model, 4) == (1, 16)  # tp spans nodes: the ring alone
    # one level: the all-to-all group or the ring is the whole CP group
    leaf = setup.net.nodes_per_leaf
    full = cp_group_layouts(p, 1, 8, nodes_per_leaf=leaf)[1], cp_group_layouts(p, 16, 8, nodes_per_leaf=leaf)[0]
    assert full[0] == full[1] == ctx.cp_layout


def test_a2a_needs_each_tp_ranks_heads_divisible_by_cp_and_mla_needs_p2p():
    """Transformer Engine: "The number of attention heads needs to be divisible by CP size!" (per TP
    rank, query and key/value heads alike); multi-latent attention runs with p2p only."""
    from simulator.feasibility import structural_problems

    sc = load_scenario(ROOT / "scenarios" / "llama3-70b-1024xh100.yaml", ["plan.cp=4", "plan.cp_comm_type=a2a"])
    problems = structural_problems(sc)
    assert problems == ["plan.cp_comm_type: a2a splits each TP rank's heads over the cp ranks, but "
                        "model.num_kv_heads (8) is not divisible by tp x cp = 8 x 4"]
    fine = load_scenario(ROOT / "scenarios" / "llama3-70b-1024xh100.yaml",
                         ["plan.cp=4", "plan.tp=2", "plan.dp=32", "plan.cp_comm_type=a2a"])
    assert not structural_problems(fine)
    for kind in ("all_gather", "a2a"):
        mla = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml", ["plan.cp=2", "plan.dp=64",
                                                                                f"plan.cp_comm_type={kind}"])
        assert any(x.startswith(f"plan.cp_comm_type: {kind} cannot run multi-latent attention")
                   for x in structural_problems(mla))
    hier = ["plan.cp=4", "plan.tp=2", "plan.dp=32", "plan.cp_comm_type=a2a+p2p"]
    assert not structural_problems(load_scenario(ROOT / "scenarios" / "llama3-70b-1024xh100.yaml", hier))
    for extra, message in ((["plan.cp_a2a_size=3"], "plan.cp_a2a_size: 3 does not divide cp = 4"),
                           (["plan.cp_a2a_size=2", "plan.cp_comm_type=p2p"],
                            "plan.cp_a2a_size: sizes the all-to-all groups of cp_comm_type a2a+p2p with cp > 1")):
        bad = load_scenario(ROOT / "scenarios" / "llama3-70b-1024xh100.yaml", [*hier, *extra])
        assert [x for x in structural_problems(bad) if x.startswith("plan.cp_a2a_size")][0].startswith(message)


def test_an_mtp_module_splits_its_projection_over_tp_and_keeps_its_norms_whole():
    """DeepSeek-V3 at TP 2, bf16: the last stage's weights with one MTP module less are 2 bytes x
    (a layer like the last: its attention and router, shared experts / tp, its local experts; the
    2h -> h projection / tp (Megatron-Core's column-parallel eh_proj); its three norms whole; the
    copy of the untied input embedding the module embeds with, V x h / tp)."""
    sets = ["plan.tp=2", "plan.sequence_parallel=true", "training.precision=bf16", "plan.recompute=full"]
    one = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml", sets)
    m, p = one.model, one.plan
    assert m.mtp_layers == 1 and not m.tied_embeddings and m.is_moe_layer(m.num_layers - 1)
    none = replace(one, model=replace(m, mtp_layers=0))
    from simulator.simulate import simulate

    gap = simulate(one).stages[-1].memory["weights"] - simulate(none).stages[-1].memory["weights"]
    e, h = m.moe, m.hidden_size
    layer = (m.attention_params(p.tp) + h * e.num_experts + e.num_shared_experts * m.expert_params() / p.tp
             + e.num_experts // p.ep * m.expert_params() / p.expert_tp)
    want = 2 * (layer + 2 * h * h / p.tp + 3 * h + m.vocab_size * h / p.tp)
    assert gap == pytest.approx(want, rel=1e-12)


def test_fp16_pays_its_loss_scale_unscaling_before_the_step():
    """Megatron's fp16 optimizer unscales the fp32 main gradients and checks them for inf/nan in
    place before the step (read and write, 8 bytes a parameter); bf16 has no loss scale."""
    from simulator.simulate import adam_bytes_per_param

    assert adam_bytes_per_param("fp16", 4) == adam_bytes_per_param("bf16", 4) + 8 == 46
    assert adam_bytes_per_param("fp32", 4) == 32
