"""Selective recompute by module (Megatron-Core --recompute-modules): time, memory, FLOPs, input."""
from dataclasses import replace
from pathlib import Path

import pytest

from hwmodels.compute import memory_bound_time
from hwmodels.network import build_network
from hwmodels.profile import load_profile
from paraplan.errors import ConfigError
from paraplan.loader import load_scenario
from paraplan.placement import expert_group_layouts, group_layout
from paraplan.serialize import plan_to_mapping
from simulator.feasibility import structural_problems
from simulator.flops import hardware_flops, model_flops
from simulator.memory import activation_bytes_per_layer
from simulator.moe import draw_routing, moe_activation_bytes, moe_block, routed_tokens_per_rank
from simulator.simulate import simulate
from simulator.workload import (LayerContext, _attention_core, dense_ffn_block, ffn_norm_residual, layer_backward,
                                mlp_block, selective_recompute)

ROOT = Path(__file__).resolve().parents[1]


def with_modules(sc, *modules):
    return replace(sc, plan=replace(sc.plan, recompute="selective", recompute_modules=tuple(modules)))


@pytest.fixture(scope="module")
def llama8b():
    """Llama-3 8B with tp 2 and sequence parallelism, so the MLP has TP collectives."""
    sc = load_scenario(ROOT / "scenarios" / "llama3-8b-64xh100.yaml")
    return replace(sc, plan=replace(sc.plan, tp=2, dp=sc.plan.dp // 2, sequence_parallel=True))


@pytest.fixture(scope="module")
def mixtral():
    return load_scenario(ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml")


def context(sc):
    gpu = load_profile(sc.cluster.gpu)
    p, gpn = sc.plan, sc.cluster.gpus_per_node
    return LayerContext(model=sc.model, plan=p, gpu=gpu, network=build_network(sc.cluster, gpu),
                        seq_length=sc.training.seq_length, dtype="bf16", attention_kernel="flash",
                        tp_layout=group_layout(("tp",), p, gpn), cp_layout=group_layout(("cp",), p, gpn))


def test_default_module_is_the_attention_core(llama8b):
    """selective without modules = [core_attn]: the previous meaning, exactly."""
    sc = replace(llama8b, plan=replace(llama8b.plan, recompute="selective"))
    assert sc.plan.recompute_modules == ("core_attn",)
    ctx = context(sc)
    cost = selective_recompute(ctx)
    assert cost.parts["recompute"] == _attention_core(ctx, False)
    assert cost.total == cost.parts["recompute"]


def test_each_module_costs_its_forward(llama8b):
    """A dense layer's norms are fused into QKV and fc1 (TELayerNormColumnParallelLinear):
    layernorm re-runs none of them, mlp re-runs its fc1's norm with it."""
    sc = with_modules(llama8b, "layernorm", "mlp")
    ctx = context(sc)
    m, p = sc.model, sc.plan
    tokens_h = ctx.tokens / (p.tp if p.sequence_parallel else 1)
    norms = 1 * memory_bound_time(ctx.gpu, tokens_h * 2 * m.hidden_size * 2)
    mlp = mlp_block(ctx, False)
    assert selective_recompute(context(with_modules(llama8b, "layernorm"))).total == 0.0
    cost = selective_recompute(ctx)
    assert cost.parts["recompute"] == pytest.approx(norms + mlp.parts["compute"], rel=1e-12)
    # the mlp block leaves out the pre-MLP norm (added once above, fused into fc1) and the residual
    sublayer = dense_ffn_block(ctx, False).parts["compute"]
    assert mlp.parts["compute"] == pytest.approx(sublayer - ffn_norm_residual(ctx, False), rel=1e-12)
    assert mlp.parts["compute"] < sublayer
    assert cost.parts["tp_comm"] == pytest.approx(mlp.parts["tp_comm"], rel=1e-12)  # the MLP's collectives re-run
    assert mlp.parts["tp_comm"] > 0
    # the backward is the plain backward plus exactly that
    plain = layer_backward(context(replace(sc, plan=replace(p, recompute="none"))))
    assert layer_backward(ctx).total == pytest.approx(plain.total + cost.total, rel=1e-12)


def test_module_recompute_trades_time_for_memory(llama8b):
    none = simulate(replace(llama8b, plan=replace(llama8b.plan, recompute="none")))
    norm = simulate(with_modules(llama8b, "layernorm"))
    mlp = simulate(with_modules(llama8b, "layernorm", "mlp"))
    # a dense Transformer Engine layer has no norm of its own to recompute
    assert none.step_time_s == norm.step_time_s < mlp.step_time_s
    assert none.stages[0].memory["activations"] == norm.stages[0].memory["activations"] \
        > mlp.stages[0].memory["activations"]
    assert none.hfu < mlp.hfu and none.mfu == pytest.approx(mlp.mfu * mlp.step_time_s / none.step_time_s)


def test_layernorm_and_mlp_activation_savings_by_hand(llama8b):
    """Of Korthikanti's 10h h-wide bytes per token, layernorm frees the outputs (2h each) of the
    norms Megatron-Core runs as modules of their own: none in a dense layer (both fused into the
    linear they feed), the pre-MLP norm in an MoE layer, also the input norm under MLA; mlp frees
    the MLP intermediates (2 bytes x (gate + up + activation output) x f / tp) and its fused
    norm's output."""
    m, p, s = llama8b.model, llama8b.plan, llama8b.training.seq_length
    tokens = p.micro_batch_size * s
    sp = p.tp if p.sequence_parallel else 1

    def acts(*modules, model=m, moe=None):
        plan = replace(p, recompute="selective", recompute_modules=modules) if modules else replace(p, recompute="none")
        return activation_bytes_per_layer(model, plan, s, "flash", moe_ffn_bytes=moe)

    assert acts() - acts("layernorm") == 0.0
    assert acts() - acts("mlp") == pytest.approx(tokens * (2 * 3 * m.ffn_hidden_size / p.tp + 2 * m.hidden_size / sp))
    assert acts(moe=1e6) - acts("layernorm", moe=1e6) == pytest.approx(tokens * 2 * m.hidden_size / sp)
    assert acts(moe=1e6) - acts("mlp", moe=1e6) == 0.0  # mlp is a dense layer's module
    mla = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml").model
    assert acts(model=mla) - acts("layernorm", model=mla) == pytest.approx(tokens * 2 * mla.hidden_size / sp)
    assert acts(model=mla, moe=1e6) - acts("layernorm", model=mla, moe=1e6) == \
        pytest.approx(tokens * 4 * mla.hidden_size / sp)


def test_layernorm_recompute_time_by_layer_kind(mixtral):
    """An MoE layer re-runs its pre-MLP norm (a TENorm of its own), not the input norm fused into QKV."""
    ctx = context(with_modules(mixtral, "layernorm"))
    gpn = mixtral.cluster.gpus_per_node
    etp, ep, _ = expert_group_layouts(mixtral.plan, gpn)
    draw = draw_routing(mixtral.model.moe, mixtral.plan.ep, routed_tokens_per_rank(ctx))
    block = moe_block(ctx, draw, ep, etp, overlap_shared=False)
    m, p = mixtral.model, mixtral.plan
    tokens_h = ctx.tokens / (p.tp if p.sequence_parallel else 1)
    one_norm = memory_bound_time(ctx.gpu, tokens_h * 2 * m.hidden_size * 2)
    assert selective_recompute(ctx, block).parts["recompute"] == pytest.approx(one_norm, rel=1e-12)


def test_moe_modules(mixtral):
    sc = mixtral
    ctx = context(sc)
    gpn = sc.cluster.gpus_per_node
    etp, ep, _ = expert_group_layouts(sc.plan, gpn)
    draw = draw_routing(sc.model.moe, sc.plan.ep, routed_tokens_per_rank(ctx))
    block = moe_block(ctx, draw, ep, etp, overlap_shared=False)
    f = sc.model.moe.expert_ffn_hidden_size
    load = float(draw.rank_loads.max())
    # moe_act re-runs the routed experts' SwiGLU, one kernel over all their tokens as in the forward:
    # reads gate and up (2f), writes f, per routed token
    by_hand = memory_bound_time(ctx.gpu, sum(n for n in draw.expert_tokens[draw.busiest_rank] if n > 0) * 3 * f * 2)
    assert block.expert_activation == pytest.approx(by_hand, rel=1e-12)
    act_ctx = context(with_modules(sc, "moe_act"))
    assert selective_recompute(act_ctx, block).parts["recompute"] == pytest.approx(by_hand, rel=1e-12)
    # ... and frees the activation outputs; moe frees the whole layer's FFN tensors
    kept = moe_activation_bytes(ctx, draw)
    assert kept - moe_activation_bytes(act_ctx, draw) == pytest.approx(load * f * 2)
    assert moe_activation_bytes(context(with_modules(sc, "moe")), draw) == 0.0
    whole = selective_recompute(context(with_modules(sc, "moe")), block)
    # the MoE module re-runs; the pre-MLP norm and the residual around it do not
    sublayer = block.forward.parts["compute"]
    assert whole.parts["recompute"] == pytest.approx(sublayer - ffn_norm_residual(ctx, False), rel=1e-12)
    assert whole.parts["ep_comm"] == pytest.approx(block.forward.parts["ep_comm"], rel=1e-12)
    assert whole.parts["ep_comm"] > 0  # the dispatch and combine re-run


def test_moe_recompute_in_the_simulation(mixtral):
    none = simulate(replace(mixtral, plan=replace(mixtral.plan, recompute="none")))
    act = simulate(with_modules(mixtral, "layernorm", "moe_act"))
    whole = simulate(with_modules(mixtral, "moe"))
    assert none.step_time_s < act.step_time_s < whole.step_time_s
    assert none.peak_memory_bytes > act.peak_memory_bytes > whole.peak_memory_bytes


def test_hardware_flops_count_recomputed_gemms(llama8b, mixtral):
    m, s = llama8b.model, llama8b.training.seq_length
    base = model_flops(m, s, 1000)
    mlp_per_token = m.num_layers * 2 * 3 * m.hidden_size * m.ffn_hidden_size
    assert hardware_flops(m, s, 1000, "selective", ("mlp",)) == pytest.approx(base + 1000 * mlp_per_token)
    assert hardware_flops(m, s, 1000, "selective", ("layernorm",)) == base  # no matmuls
    mm = mixtral.model
    e = mm.moe
    moe_per_token = mm.num_layers * 2 * (mm.hidden_size * e.num_experts + e.top_k * 3 * mm.hidden_size * e.expert_ffn_hidden_size)
    assert hardware_flops(mm, s, 1000, "selective", ("moe",)) == pytest.approx(model_flops(mm, s, 1000) + 1000 * moe_per_token)


def test_bad_input(llama8b):
    base = ROOT / "scenarios" / "llama3-8b-64xh100.yaml"
    with pytest.raises(ConfigError, match=r"plan\.recompute_modules.*not one of core_attn, layernorm"):
        load_scenario(base, ["plan.recompute=selective", "plan.recompute_modules=[core_atn]"])
    with pytest.raises(ConfigError, match=r"plan\.recompute_modules.*mlp listed twice"):
        load_scenario(base, ["plan.recompute=selective", "plan.recompute_modules=[mlp, mlp]"])
    with pytest.raises(ConfigError, match=r"plan\.recompute_modules: applies only with recompute: selective"):
        load_scenario(base, ["plan.recompute=full", "plan.recompute_modules=[mlp]"])
    sc = load_scenario(base, ["plan.recompute=selective", "plan.recompute_modules=moe_act"])
    assert sc.plan.recompute_modules == ("moe_act",)
    assert any("plan.recompute_modules: moe_act need an MoE model" in r for r in structural_problems(sc))


def test_round_trip_and_exports(llama8b):
    from planner.emit import megatron_args, torchtitan_toml

    sc = with_modules(llama8b, "layernorm", "mlp")
    mapping = plan_to_mapping(sc.plan)
    assert mapping["recompute_modules"] == ["layernorm", "mlp"]
    assert "recompute_modules" not in plan_to_mapping(replace(sc.plan, recompute="full"))
    assert load_scenario({"model": "llama3-8b", "cluster": {"gpu": "h100-sxm-80gb", "num_nodes": 8, "gpus_per_node": 8},
                          "training": {"seq_length": 8192, "global_batch_size": 512, "precision": "bf16"},
                          "plan": mapping}).plan == sc.plan
    assert "--recompute-modules layernorm mlp" in " ".join(megatron_args(sc))
    assert "--recompute-modules" not in megatron_args(replace(sc, plan=replace(sc.plan, recompute_modules=("core_attn",))))
    assert "chooses by op, not by module" in torchtitan_toml(sc)


@pytest.mark.parametrize("text, keys", [
    ("selective (norm, act)", {"recompute": "selective", "recompute_modules": ["layernorm", "moe_act"]}),
    ("selective (attention-core recompute) + sequence parallelism ('present work')", {"recompute": "selective"}),
    ("selective + sequence parallelism", {"recompute": "selective"}),
    ("full (--checkpoint-activations)", {"recompute": "full"}),
    (None, {"recompute": "none"}),
])
def test_published_records_name_their_modules(text, keys):
    from paraplan.published import _recompute  # noqa: PLC2701

    assert _recompute(text) == keys


def test_plan_survives_the_planner_journal(llama8b):
    """The study journal stores plans as JSON (tuples become lists); reading one back gives the
    same, hashable plan."""
    import dataclasses
    import json

    from planner.objective import _plan_from_json  # noqa: PLC2701

    plan = with_modules(llama8b, "layernorm", "mlp").plan
    back = _plan_from_json(json.loads(json.dumps(dataclasses.asdict(plan))))
    assert back == plan and hash(back) == hash(plan)


def test_core_attn_recompute_under_context_parallelism_repeats_the_kv_ring():
    """The checkpointed attention is the whole CP attention, its K/V ring included: recomputing it
    exposes the forward ring again. Llama-3 70B, tp 8, cp 8 puts the ring across nodes."""
    from simulator.workload import _cp_exchange

    sc = load_scenario(ROOT / "scenarios" / "llama3-70b-1024xh100.yaml",
                       ["plan.cp=8", "plan.recompute=selective"])
    ctx = context(sc)
    ring = _cp_exchange(ctx, False).parts["cp_comm"]
    assert ring > 0
    cost = selective_recompute(ctx)
    assert cost.parts["cp_comm"] == ring
    assert cost.parts["recompute"] == _attention_core(ctx, False)


def test_context_parallel_attention_is_cp_kernels_of_one_step_each():
    """Each rank runs cp ring steps of equal FLOPs, each a causal (s/cp)^2 attention (Transformer
    Engine's load-balanced CP); the efficiency is read at that size, not the whole sequence's."""
    from hwmodels.compute import attention_time

    sc = load_scenario(ROOT / "scenarios" / "llama3-70b-1024xh100.yaml", ["plan.cp=4"])
    ctx = context(sc)
    m, p = sc.model, sc.plan
    step = attention_time(ctx.gpu, batch=p.micro_batch_size, heads=m.num_attention_heads // p.tp,
                          q_len=sc.training.seq_length // 4, kv_len=sc.training.seq_length // 4,
                          head_dim=m.head_dim, dtype="bf16", causal=True, backward=False)
    assert _attention_core(ctx, False) == pytest.approx(4 * step, rel=1e-12)
    whole = attention_time(ctx.gpu, batch=p.micro_batch_size, heads=m.num_attention_heads // p.tp,
                           q_len=sc.training.seq_length, kv_len=sc.training.seq_length,
                           head_dim=m.head_dim, dtype="bf16", causal=True, backward=False)
    assert _attention_core(ctx, False) > whole / 4  # smaller kernels run less efficiently


def test_a_hidden_context_parallel_ring_costs_its_sm_share():
    """Llama-3 8B, cp 2 inside a node: each K/V exchange hides behind its ring step's attention,
    which it slows by COMM_SM_SHARE of the exchange (it cost nothing before SM sharing)."""
    from hwmodels.network import COMM_SM_SHARE, collective_time
    from simulator.workload import _cp_exchange

    sc = load_scenario(ROOT / "scenarios" / "llama3-8b-64xh100.yaml", ["plan.cp=2", "plan.dp=32"])
    ctx = context(sc)
    kv_bytes = 2 * ctx.tokens * sc.model.kv_channels // sc.plan.tp * ctx.act_bytes
    step = collective_time(ctx.network, "send_recv", kv_bytes, ctx.cp_layout)
    assert 0 < step < _attention_core(ctx, False) / 2  # one of the cp = 2 ring steps
    assert _cp_exchange(ctx, False).parts["cp_comm"] == pytest.approx(COMM_SM_SHARE * step)


def test_query_key_norms_cost_their_kernels_and_keep_their_inputs(llama8b):
    """model.qk_layernorm (Qwen3's q_norm / k_norm): a norm over this rank's query and key heads,
    read + write forward and twice that backward, keeping its inputs (q and k channels / tp)."""
    from simulator.workload import _attention_elementwise

    plain = llama8b
    normed = replace(llama8b, model=replace(llama8b.model, qk_layernorm=True))
    m, p, s = plain.model, plain.plan, plain.training.seq_length
    tokens = p.micro_batch_size * s
    qk = tokens * (m.q_channels + m.kv_channels) // p.tp * 2
    for backward, factor in ((False, 1), (True, 2)):
        extra = _attention_elementwise(context(normed), backward) - _attention_elementwise(context(plain), backward)
        assert extra == pytest.approx(memory_bound_time(context(plain).gpu, factor * 2 * qk), rel=1e-9)
    none = replace(p, recompute="none")
    kept = activation_bytes_per_layer(normed.model, none, s, "flash") - activation_bytes_per_layer(m, none, s, "flash")
    assert kept == pytest.approx(tokens * 2 * (m.q_channels + m.kv_channels) / p.tp)
    assert simulate(normed).step_time_s > simulate(plain).step_time_s


def test_core_attn_recompute_with_flash_frees_the_logsumexp(llama8b):
    """A fused attention keeps only its fp32 logsumexp (4 bytes per head per token); checkpointed
    (core_attn), it keeps nothing of its own: its q, k and v are the projections' outputs, kept anyway."""
    m, p, s = llama8b.model, llama8b.plan, llama8b.training.seq_length
    tokens = p.micro_batch_size * s
    kept = activation_bytes_per_layer(m, replace(p, recompute="none"), s, "flash")
    recomputed = activation_bytes_per_layer(m, replace(p, recompute="selective", recompute_modules=("core_attn",)),
                                            s, "flash")
    assert kept - recomputed == pytest.approx(tokens * 4 * m.num_attention_heads / p.tp)


@pytest.mark.parametrize("modules", [("moe_act",), ("shared_experts",), ("moe_act", "shared_experts")])
def test_recomputed_moe_act_and_shared_experts_are_rebuilt_one_at_a_time(modules):
    """Selective recompute of moe_act or shared_experts re-creates, in the MoE layer's backward, what
    it did not store: the busiest rank's activation outputs (received tokens x expert width), or
    the shared experts' tensors; the two modules one after the other, so the larger of them."""
    from simulator.moe import dispatch_buffer_bytes
    from simulator.simulate import _layer_kinds, _setup  # noqa: PLC2701

    sc = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml",
                       ["plan.recompute=selective", f"plan.recompute_modules=[{','.join(modules)}]"])
    setup = _setup(sc)
    kinds, draw = _layer_kinds(setup.ctx, setup.dispatch_layout, setup.expert_layouts[0], balanced=False)
    m, p, b = sc.model, sc.plan, setup.ctx.act_bytes
    act = float(draw.rank_loads.max()) * p.expert_tp * m.moe.expert_ffn_hidden_size / p.expert_tp * b
    shared = setup.ctx.tokens * m.moe.num_shared_experts * m.moe.expert_ffn_hidden_size / p.tp * m.ffn_matrices * b
    want = max(act if "moe_act" in modules else 0.0, shared if "shared_experts" in modules else 0.0)
    assert kinds.working["moe"] - dispatch_buffer_bytes(setup.ctx, draw) == pytest.approx(want, rel=1e-12)
    assert want > 0
