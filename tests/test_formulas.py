"""Hand-computed checks of the closed-form pieces: FLOPs, activation memory, placement, layers."""
from dataclasses import replace
from pathlib import Path

import pytest

from paraplan.placement import GroupLayout, coords_to_rank, group_layout, rank_to_coords
from paraplan.specs import ModelSpec, PlanSpec
from simulator.flops import (hardware_flops, last_stage_extra_flops_per_token, layer_forward_flops_per_token,
                             model_flops)
from simulator.layout import layers_per_chunk
from simulator.memory import activation_bytes_per_layer, stage_memory

GPT3 = ModelSpec(name="gpt3-175b", num_layers=96, hidden_size=12288, num_attention_heads=96, num_kv_heads=96,
                 ffn_hidden_size=4 * 12288, vocab_size=51200, head_dim=128, tied_embeddings=True)


def test_model_flops_equal_megatron_closed_form():
    # Korthikanti et al. 2022 Appendix: 72 B s L h^2 (1 + s/6h + V/12hL)
    B, s, L, h, V = 1536, 2048, 96, 12288, 51200
    closed = 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    assert model_flops(GPT3, s, B * s) == pytest.approx(closed, rel=1e-12)


def test_stage_flops_by_hand():
    """A GPT layer's forward FLOPs per token are 24h^2 + 4sh (Korthikanti et al. 2022, Appendix A,
    per token and layer); the last stage adds the LM head, 2hV, and a multi-token prediction module
    its 2h x h projection, a layer and the head again. Summed, they are the model's FLOPs / 3."""
    s, h, V = 2048, 12288, 51200
    assert layer_forward_flops_per_token(GPT3, 5, s) == 24 * h**2 + 4 * s * h
    assert last_stage_extra_flops_per_token(GPT3, s) == 2 * h * V
    mtp = replace(GPT3, mtp_layers=1)
    assert last_stage_extra_flops_per_token(mtp, s) == 2 * (2 * h * V) + 4 * h**2 + 24 * h**2 + 4 * s * h
    per_token = 96 * layer_forward_flops_per_token(mtp, 0, s) + last_stage_extra_flops_per_token(mtp, s)
    assert 3 * per_token * 1000 == pytest.approx(model_flops(mtp, s, 1000), rel=1e-12)


def test_hfu_counts_the_recompute_forward():
    B, s = 8, 2048
    full = hardware_flops(GPT3, s, B * s, "full")
    none = hardware_flops(GPT3, s, B * s, "none")
    # full recompute adds one forward of every layer: (24h^2 + 4sh) per token per layer
    h = 12288
    assert full - none == pytest.approx(B * s * 96 * (24 * h * h + 4 * s * h), rel=1e-12)


def test_causal_count_halves_only_the_attention_square():
    """Megatron-LM's count since 2025: 72BsLh^2(1 + s/12h + V/12hL) for GPT; under full recompute
    the recomputed forward's products are halved too."""
    B, s, h, L, V = 8, 2048, 12288, 96, GPT3.vocab_size
    got = model_flops(GPT3, s, B * s, causal=True)
    assert got == pytest.approx(72 * B * s * L * h * h * (1 + s / (12 * h) + V / (12 * h * L)), rel=1e-12)
    whole, half = (hardware_flops(GPT3, s, B * s, "full", causal=c) for c in (False, True))
    assert whole - half == pytest.approx(B * s * L * (3 + 1) * 2 * s * h, rel=1e-12)  # (3 passes + the recompute) x 2sh


def test_long_context_hfu_over_100_percent_is_explained_by_the_causal_count():
    """At 1M tokens attention is nearly all the work: the whole-square count makes HFU pass 100%,
    the causal count, about what the kernels run, stays below it; --json carries both."""
    from paraplan.loader import load_scenario
    from simulator.simulate import simulate

    raw = {"model": {"num_layers": 16, "hidden_size": 2048, "num_attention_heads": 16, "vocab_size": 32000,
                     "activation": "swiglu", "ffn_hidden_size": 5632, "dropout": 0},
           "cluster": {"preset": "dgx-h100-superpod", "num_nodes": 1},
           "training": {"seq_length": 1048576, "global_batch_size": 8, "precision": "bf16", "attention": "flash3"},
           "plan": {"tp": 1, "pp": 1, "cp": 8, "micro_batch_size": 1, "zero_stage": 1, "recompute": "full"}}
    r = simulate(load_scenario(raw))
    assert r.hfu > 1 > r.hfu_causal and r.mfu_causal < r.mfu
    assert r.to_json()["hfu_causal"] == r.hfu_causal


@pytest.mark.parametrize("sp", [False, True])
def test_activation_memory_matches_korthikanti_table2(sp):
    t, s, b, h, a = 8, 2048, 1, 12288, 96
    plan = PlanSpec(tp=t, pp=8, dp=16, sequence_parallel=sp, recompute="none")
    got = activation_bytes_per_layer(GPT3, plan, s, "unfused")
    if sp:  # sbh/t (34 + 5as/h)
        want = s * b * h / t * (34 + 5 * a * s / h)
    else:  # sbh (10 + 24/t + 5as/(ht))
        want = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert got == pytest.approx(want, rel=1e-12)
    sel = activation_bytes_per_layer(GPT3, replace(plan, recompute="selective"), s, "unfused")
    want_sel = s * b * h * 34 / t if sp else s * b * h * (10 + 24 / t)
    assert sel == pytest.approx(want_sel, rel=1e-12)
    full = activation_bytes_per_layer(GPT3, replace(plan, recompute="full"), s, "unfused")
    assert full == pytest.approx(2 * s * b * h / (t if sp else 1))


@pytest.mark.parametrize("sp", [False, True])
def test_no_dropout_stores_no_masks(sp):
    """Korthikanti's 34 sbh counts two 1-byte dropout masks (2sbh, h-wide) and in the 5as term the
    attention's mask (as) and dropout output (2as); without dropout torch's dropout returns its
    input, so 32 sbh and 2as remain (the softmax output AV reads)."""
    t, s, b, h, a = 8, 2048, 1, 12288, 96
    plan = PlanSpec(tp=t, pp=8, dp=16, sequence_parallel=sp, recompute="none")
    got = activation_bytes_per_layer(replace(GPT3, dropout=0.0), plan, s, "unfused")
    if sp:
        want = s * b * h / t * (32 + 2 * a * s / h)
    else:
        want = s * b * h * (8 + 24 / t + 2 * a * s / (h * t))
    assert got == pytest.approx(want, rel=1e-12)
    flash = [activation_bytes_per_layer(replace(GPT3, dropout=d), plan, s, "flash") for d in (0.1, 0.0)]
    assert flash[0] - flash[1] == pytest.approx(2 * s * b * h / (t if sp else 1), rel=1e-12)


def test_no_dropout_writes_no_masks():
    """The bias-dropout-add reads 2h and writes h, plus its 1-byte mask only with dropout; the
    unfused attention drops its dropout kernels."""
    from dataclasses import replace as _replace

    from paraplan.loader import load_scenario
    from simulator.simulate import _setup
    from simulator.workload import _attention_core, _residual

    ROOT = Path(__file__).resolve().parents[1]
    sc = load_scenario(ROOT / "scenarios" / "gpt3-175b-1024xa100.yaml", ["training.attention=unfused"])
    ctx = _setup(sc).ctx
    off = _replace(ctx, model=_replace(ctx.model, dropout=0.0))
    tokens, h = ctx.tokens / 8, 12288  # sequence parallel
    plain = _replace(off, model=_replace(off.model, linear_bias=False))
    assert ctx.model.linear_bias  # GPT-3: biases, as every GELU model by default
    (forward, factor), (forward_off, factor_off), (forward_plain, factor_plain) = map(_residual, (ctx, off, plain))
    assert forward - forward_off == pytest.approx(tokens * h) and forward_off == forward_plain
    # backward: the two branches' gradients added where the residual stream forked (read 4h, write
    # 2h bytes), the bias gradient reduced (read 2h) and the dropout's gradient (read 2h and the
    # mask, write 2h)
    assert forward_plain * factor_plain == pytest.approx(tokens * 6 * h)
    assert forward_off * factor_off == pytest.approx(tokens * 8 * h)
    assert forward * factor == pytest.approx(tokens * (12 * h + h))
    assert _attention_core(off, False) < _attention_core(ctx, False)
    assert _attention_core(off, True) < _attention_core(ctx, True)


def test_fp32_activations_take_four_bytes_an_element():
    """Korthikanti's sbh(34 + 5as/h) counts 2-byte elements and 1-byte masks: with 4-byte
    elements the 2-byte terms double (LayerNorm/QKV/MLP inputs 8h -> 16h, the 24h tp-sharded ones
    -> 48h, softmax and dropout outputs 4as -> 8as) while the masks (2h, as) stay."""
    t, s, b, h, a = 8, 2048, 1, 12288, 96
    plan = PlanSpec(tp=t, pp=8, dp=16, sequence_parallel=True, recompute="none")
    got = activation_bytes_per_layer(GPT3, plan, s, "unfused", act_bytes=4)
    assert got == pytest.approx(s * b * h / t * (18 + 48 + 9 * a * s / h), rel=1e-12)
    full = activation_bytes_per_layer(GPT3, replace(plan, recompute="full"), s, "unfused", act_bytes=4)
    assert full == pytest.approx(4 * s * b * h / t)


def test_fp32_training_reports_more_activation_memory():
    from paraplan.loader import load_scenario
    from simulator.simulate import simulate

    bf16 = load_scenario("scenarios/llama3-8b-64xh100.yaml")
    fp32 = replace(bf16, training=replace(bf16.training, precision="fp32"))
    a16 = simulate(bf16).stages[0].memory["activations"]
    a32 = simulate(fp32).stages[0].memory["activations"]
    assert 1.8 * a16 < a32 < 2.0 * a16  # 1-byte masks and the fp32 flash logsumexp do not double


def test_zero_stages_shard_model_states():
    plan = PlanSpec(tp=1, pp=1, dp=64, recompute="full")
    kw = dict(precision="bf16", dense_params=1e9, max_layer_params=1e7, activations=0.0)
    z0 = stage_memory(plan=plan, **kw)
    assert (z0.weights, z0.gradients, z0.optimizer) == (2e9, 4e9, 12e9)
    z1 = stage_memory(plan=replace(plan, zero_stage=1), **kw)
    assert z1.optimizer == pytest.approx(12e9 / 64) and z1.gradients == 4e9
    z2 = stage_memory(plan=replace(plan, zero_stage=2), **kw)
    assert z2.gradients == pytest.approx(4e9 / 64 + 4 * 1e7)  # + one layer's full gradient before its reduce-scatter
    z3 = stage_memory(plan=replace(plan, zero_stage=3), **kw)
    assert z3.weights == pytest.approx(2e9 / 64 + 2 * 2 * 1e7)  # + the current and the prefetched layer
    assert z3.gradients == pytest.approx(4e9 / 64 + 4 * 1e7)  # + one layer's full gradient before its reduce-scatter


def test_expert_states_shard_over_the_expert_data_parallel_group():
    # tp 2 x dp 16 = 32 ranks per stage, ep 8 -> expert-data-parallel 4 (parallel folding)
    plan = PlanSpec(tp=2, pp=1, dp=16, ep=8, zero_stage=1)
    m = stage_memory(plan=plan, precision="bf16", dense_params=0.0, expert_params=1e9,
                     max_layer_params=0.0, activations=0.0)
    assert m.optimizer == pytest.approx(12e9 / 4) and m.gradients == pytest.approx(4e9)


def test_placement_is_megatron_order():
    plan = PlanSpec(tp=2, cp=1, dp=2, pp=2)
    assert [vars(rank_to_coords(r, plan)) for r in (0, 1, 2, 5)] == [
        {"tp": 0, "cp": 0, "dp": 0, "pp": 0}, {"tp": 1, "cp": 0, "dp": 0, "pp": 0},
        {"tp": 0, "cp": 0, "dp": 1, "pp": 0}, {"tp": 1, "cp": 0, "dp": 0, "pp": 1}]
    for r in range(8):
        assert coords_to_rank(rank_to_coords(r, plan), plan) == r


def test_group_layouts_on_nodes():
    plan = PlanSpec(tp=8, pp=8, dp=16)
    assert group_layout(("tp",), plan, 8) == GroupLayout(size=8, ranks_per_node=8, num_nodes=1)
    assert group_layout(("dp",), plan, 8) == GroupLayout(size=16, ranks_per_node=1, num_nodes=16)
    assert group_layout(("dp",), PlanSpec(tp=2, dp=32), 8) == GroupLayout(size=32, ranks_per_node=4, num_nodes=8)


def test_group_layouts_take_the_slowest_group_where_groups_straddle_nodes_unevenly():
    """Rank 0's group is not every group's: with tp 2 x dp 3 x pp 4 on 8-GPU nodes stage 0's DP
    group (0, 2, 4) sits in node 0, but stage 1's (6, 8, 10) has one rank on node 0 and two on
    node 1, so its ring crosses nodes with one NIC share on node 0's side."""
    from paraplan.placement import expert_group_layouts, group_ranks

    plan = PlanSpec(tp=2, pp=4, dp=3)
    assert group_ranks(6, ("cp", "dp"), plan) == [6, 8, 10]
    assert group_layout(("cp", "dp"), plan, 8) == GroupLayout(size=3, ranks_per_node=1, num_nodes=2)
    # pp 2 x dp 12: stage 0 holds nodes 0 (8 ranks) and 1 (4), so the ring crosses on 4 NIC shares
    assert group_layout(("cp", "dp"), PlanSpec(pp=2, dp=12), 8) == GroupLayout(size=12, ranks_per_node=4, num_nodes=2)
    # EP 6 inside 12-rank blocks: the second group (ranks 6-11) takes 2 + 4 ranks of nodes 0 and 1
    _, ep, _ = expert_group_layouts(PlanSpec(dp=12, ep=6, pp=2), 8)
    assert ep == GroupLayout(size=6, ranks_per_node=2, num_nodes=2)
    # whole-node blocks: every group alike, as before
    assert group_layout(("dp",), PlanSpec(tp=8, pp=8, dp=16), 8) == GroupLayout(size=16, ranks_per_node=1, num_nodes=16)


def test_uneven_first_and_last_stages():
    assert layers_per_chunk(126, 16, 1, 7, 7) == [[7]] + [[8]] * 14 + [[7]]
    assert layers_per_chunk(96, 8, 2, None, None) == [[6, 6]] * 8


def test_fp8_weights_add_transformer_engines_cached_copy_and_transpose():
    """fp8: the bf16 weight plus TE's fp8 copy and fp8 transpose (2 + 1 + 1 bytes) for the linear
    layers; the embedding / LM head (not TE modules) stay at 2 bytes. Under ZeRO-3 only the
    gathered units carry the cache."""
    plan = PlanSpec(tp=1, pp=1, dp=8, zero_stage=1)
    kw = dict(dense_params=1e9, expert_params=2e8, max_layer_params=1e7, activations=0.0, uncached_params=1e8)
    bf16 = stage_memory(plan=plan, precision="bf16", **kw)
    fp8 = stage_memory(plan=plan, precision="fp8", **kw)
    assert bf16.weights == 2 * 1.2e9
    assert fp8.weights == pytest.approx(2 * 1.2e9 + 2 * (1.2e9 - 1e8))
    z3 = replace(plan, zero_stage=3)
    gathered = 2 * 1e7
    assert stage_memory(plan=z3, precision="fp8", **kw).weights == pytest.approx(
        stage_memory(plan=z3, precision="bf16", **kw).weights + 2 * gathered)


def test_the_flop_formula_names_only_what_the_model_has():
    from paraplan.loader import load_scenario
    from simulator.flops import flops_formula_for

    root = Path(__file__).resolve().parents[1] / "scenarios"
    dense = flops_formula_for(load_scenario(root / "tiny-gpt-8xa100.yaml").model)
    deepseek = flops_formula_for(load_scenario(root / "deepseek-v3-2048xh800.yaml").model)
    assert "72*B*s*L*h^2" in dense and "72*B*s*L*h^2" in deepseek
    for clause in ("MLA", "multi-token prediction", "MoE layers"):
        assert clause not in dense and clause in deepseek
    assert "capacity_factor" not in deepseek  # dropless


def test_leaf_crossing_is_read_off_the_placement():
    """With the leaf size known, a group or a pipeline hop crosses the spine when its nodes sit
    under two leaves, however few nodes it spans (2 nodes of a hop; a DP group straddling a leaf
    boundary), and not when many nodes share one leaf."""
    from paraplan.placement import pp_hop_layouts

    plan = PlanSpec(tp=8, pp=4, dp=16)  # 16-node stages on 32-node leaves
    hops = pp_hop_layouts(plan, 8, nodes_per_leaf=32)
    assert [h.crosses_leaf for h in hops] == [False, True, False, True]  # 0-1 leaf 0, 1-2 leaves 0/1, wrap 3-0
    assert [h.num_nodes for h in hops] == [2, 2, 2, 2]
    assert pp_hop_layouts(plan, 8)[1].crosses_leaf is None  # no leaf size: left to the network model
    assert group_layout(("dp",), plan, 8, nodes_per_leaf=32).crosses_leaf is False  # 16 nodes inside a leaf
    # 24-node DP groups on 32-node leaves: the second stage's group (nodes 24-47) straddles leaves
    assert group_layout(("dp",), PlanSpec(tp=8, pp=2, dp=24), 8, nodes_per_leaf=32).crosses_leaf is True


def test_a_hop_between_leaves_pays_the_spine_oversubscription():
    from hwmodels.network import build_network, collective_time
    from hwmodels.profile import load_profile
    from paraplan.placement import pp_hop_layouts
    from paraplan.specs import ClusterSpec, InterNodeSpec

    def cluster(over):
        return ClusterSpec(gpu="h100-sxm-80gb", num_nodes=64, gpus_per_node=8,
                           inter_node=InterNodeSpec(nics_per_node=8, nic_bandwidth=50e9, oversubscription=over,
                                                    latency=2.7e-6, nodes_per_leaf=32))

    gpu = load_profile("h100-sxm-80gb")
    flat, over = build_network(cluster(1.0), gpu), build_network(cluster(4.0), gpu)
    same_leaf, across = pp_hop_layouts(PlanSpec(tp=8, pp=4, dp=16), 8, nodes_per_leaf=32)[:2]
    big = 256e6  # bandwidth-bound
    assert collective_time(over, "send_recv", big, same_leaf) == collective_time(flat, "send_recv", big, same_leaf)
    # the 16 nodes of stage 1 fill half of leaf 0 and all send to leaf 1 at once: half the leaf's
    # NICs through uplinks of a quarter of their bandwidth, 4 x 0.5 = 2x slower
    assert across.leaf_share == 0.5
    ratio = collective_time(over, "send_recv", big, across) / collective_time(flat, "send_recv", big, across)
    assert 1.95 < ratio <= 2.0
    # 32-node stages fill their leaves: every NIC of the leaf sends across, the full 4x
    whole = pp_hop_layouts(PlanSpec(tp=8, pp=4, dp=32), 8, nodes_per_leaf=32)[0]
    assert whole.leaf_share == 1.0
    ratio = collective_time(over, "send_recv", big, whole) / collective_time(flat, "send_recv", big, whole)
    assert 3.9 < ratio <= 4.0


def test_pipeline_pairs_across_a_leaf_boundary_counted_by_hand():
    """Pairs (a + j, a + j + d), j < block, split by a boundary every `unit` ranks, against a count."""
    import itertools

    from paraplan.placement import _pairs_across

    for a, block, d, unit in itertools.product((0, 5, 250), (1, 7, 128, 300), (1, 8, 128, 700), (8, 256)):
        want = sum((a + j) // unit != (a + j + d) // unit for j in range(block))
        assert _pairs_across(a, block, d, unit) == want


def test_fp8_linears_pay_the_casts_of_their_16_bit_operands():
    """Under fp8 a linear's forward casts its input (unless a norm wrote it in fp8) and its backward
    casts the output gradient, each to an fp8 copy and its transpose: read 2, write 1 + 1 bytes."""
    from hwmodels.compute import gemm_time, memory_bound_time
    from paraplan.loader import load_scenario
    from simulator.simulate import _setup
    from simulator.workload import linear_time, _weight_grad_gemm

    ROOT = Path(__file__).resolve().parents[1]
    sc = load_scenario(ROOT / "scenarios" / "llama3-70b-512xh100.yaml", ["training.precision=fp8"])
    ctx = _setup(sc).ctx
    m, k, n = ctx.tokens, 8192, 28672 // 8
    fwd = gemm_time(ctx.gpu, m, n, k, "fp8")
    bwd = gemm_time(ctx.gpu, m, k, n, "fp8") + _weight_grad_gemm(ctx, k, n, m)
    assert linear_time(ctx, k, n, False) == pytest.approx(fwd + memory_bound_time(ctx.gpu, 4 * m * k))
    assert linear_time(ctx, k, n, False, cast_input=False) == pytest.approx(fwd)
    assert linear_time(ctx, k, n, True) == pytest.approx(bwd + memory_bound_time(ctx.gpu, 4 * m * n))
    bf16 = _setup(load_scenario(ROOT / "scenarios" / "llama3-70b-512xh100.yaml")).ctx
    assert linear_time(bf16, k, n, False) == gemm_time(bf16.gpu, m, n, k, "bf16")


def test_fp8_mla_down_projections_pay_their_input_casts():
    """MLA's down-projections follow a separate input norm (plain linears), so under fp8 they cast
    their input; the up-projections read their latent norms' fp8 output (TELayerNormColumnParallelLinear)."""
    from hwmodels.compute import memory_bound_time
    from paraplan.loader import load_scenario
    from simulator.simulate import _setup
    from simulator.workload import (_attention_core, _attention_elementwise, _attention_shapes, linear_time,
                                    attention_block)

    ROOT = Path(__file__).resolve().parents[1]
    ctx = _setup(load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml")).ctx
    h = ctx.model.hidden_size
    shapes = _attention_shapes(ctx)
    modes = [mode for _, _, mode in ctx.model.attention_linears()]
    casts = sum(memory_bound_time(ctx.gpu, 4 * t * k) for (k, n, t), mode in zip(shapes, modes)
                if mode == "replicated" or mode == "row")
    assert [k == h for k, _, _ in shapes] == [True, False, True, False, False]  # q down, q up, kv down, kv up, out
    plain = sum(linear_time(ctx, k, n, False, t, cast_input=False) for k, n, t in shapes)
    got = attention_block(ctx, False).parts["compute"]
    assert got == pytest.approx(plain + casts + _attention_core(ctx, False) + _attention_elementwise(ctx, False))


def test_fp8_linears_keep_one_byte_copies_of_their_inputs():
    """Llama-3 70B, tp 8 with sequence parallelism, per token on one rank: under fp8 the norm
    outputs feeding QKV and fc1 (2 x 8192 / 8), fc2's input (28672 / 8) and the output projection's
    input (8192 / 8) are kept at 1 byte instead of 2 (Transformer Engine saves the fp8 copy it cast):
    6,656 B less with the attention core recomputed. Without that recompute FlashAttention also
    keeps its 16-bit output, so the projection's input costs 3 bytes: 4,608 B less."""
    from dataclasses import replace

    from pathlib import Path

    from paraplan.loader import load_scenario

    sc = load_scenario(Path(__file__).resolve().parents[1] / "scenarios" / "llama3-70b-1024xh100.yaml")
    m, p = sc.model, replace(sc.plan, micro_batch_size=1, cp=1, recompute="selective", recompute_modules=("core_attn",))
    assert p.tp == 8 and p.sequence_parallel and m.hidden_size == 8192 and m.ffn_hidden_size == 28672

    def per_token(plan, fp8):
        return activation_bytes_per_layer(m, plan, 8192, "flash3", act_bytes=2, fp8_inputs=fp8) / 8192

    assert per_token(p, False) - per_token(p, True) == pytest.approx(2 * 8192 / 8 + 28672 / 8 + 8192 / 8)
    none = replace(p, recompute="none", recompute_modules=())
    assert per_token(none, False) - per_token(none, True) == pytest.approx(2 * 8192 / 8 + 28672 / 8 - 8192 / 8)


def test_memory_bound_backwards_move_their_kernels_bytes():
    """Backward over forward bytes: GELU 3 passes for 2, SwiGLU 5 for 3 (read gate, up and the
    gradient, write both gradients), a norm 2 (measured; its bytes alone say 1.5)."""
    from dataclasses import replace as _replace

    from hwmodels.compute import memory_bound_time
    from paraplan.loader import load_scenario
    from simulator.simulate import _setup
    from simulator.workload import activation_time, ffn_norm_residual

    ROOT = Path(__file__).resolve().parents[1]
    ctx = _setup(load_scenario(ROOT / "scenarios" / "llama3-8b-64xh100.yaml")).ctx
    tokens, width, e = 8192.0, 14336, ctx.act_bytes
    for activation, passes, backward in (("swiglu", 3, 5), ("gelu", 2, 3)):
        c = _replace(ctx, model=_replace(ctx.model, activation=activation))
        assert activation_time(c, tokens, width, False) == pytest.approx(memory_bound_time(ctx.gpu, tokens * passes * width * e))
        assert activation_time(c, tokens, width, True) == pytest.approx(memory_bound_time(ctx.gpu, tokens * backward * width * e))
        # a bias added in the activation: its gradient reduced over the tokens, one more read of fc1's
        # output (f for GELU, the gate and up halves' 2f for SwiGLU)
        assert activation_time(c, tokens, width, False, bias=True) == activation_time(c, tokens, width, False)
        assert activation_time(c, tokens, width, True, bias=True) == pytest.approx(
            memory_bound_time(ctx.gpu, tokens * backward * width * e)
            + memory_bound_time(ctx.gpu, tokens * (passes - 1) * width * e))
    # the FFN's norm (read + write h) and its residual add without dropout (read 2h, write h): the
    # norm's backward twice its forward, the add's the branches' gradients summed at the fork
    h_tokens = ctx.tokens / ctx.plan.tp if ctx.plan.sequence_parallel else ctx.tokens
    h = ctx.model.hidden_size
    assert ctx.model.dropout == 0
    assert ffn_norm_residual(ctx, True) == pytest.approx(
        memory_bound_time(ctx.gpu, 2 * h_tokens * 2 * h * e) + memory_bound_time(ctx.gpu, h_tokens * 3 * h * e))
