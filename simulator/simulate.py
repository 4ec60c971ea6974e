"""simulate(scenario) -> SimResult: one training iteration of a plan on the hardware models."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from itertools import accumulate

from hwmodels.compute import memory_bound_time
from hwmodels.network import COMM_SM_SHARE, build_network, collective_time, tier_names_crossed
from hwmodels.profile import load_profile
from paraplan.errors import InfeasiblePlanError
from paraplan.placement import (GroupLayout, cp_group_layouts, cp_split, expert_dispatch_layout, expert_group_layouts,
                                group_layout, pp_hop_layouts)
from paraplan.specs import DTYPE_BYTES, Scenario
from simulator.combined import LayerPhases, merged_cost, merged_layers_time
from simulator.cost import Cost
from simulator.engine import StageWork, run_iteration
from simulator.feasibility import structural_problems
from simulator.flops import flops_formula_for, hardware_flops, model_flops
from simulator.layout import layers_per_chunk, layers_per_virtual_stage
from simulator.memory import (
    CE_SOFTMAX_BYTES, activation_bytes_per_layer, cp_exchange_working_bytes, logits_bytes, recompute_working_bytes,
    stage_memory, state_bytes_per_param, unrecomputed_activation_bytes,
)
from simulator.moe import (
    dispatch_buffer_bytes, draw_routing, moe_activation_bytes, moe_block, moe_rebuilt_bytes, routed_tokens_per_rank,
)
from simulator.result import BREAKDOWN_KEYS, MoEReport, SimResult, StageResult
from simulator.schedules import (SPLIT_BACKWARD_SCHEDULES, WHOLE_AND_SPLIT_SCHEDULES, build_schedule,
                                 holder, merged_pairs, peak_in_flight, v_shaped, virtual_stage)
from simulator.workload import (
    MAIN_GRAD_BYTES, LayerContext, cp_groups_of, embedding_cost, head_cost, head_weight_grad, layer_backward,
    layer_forward, layer_weight_grad, mtp_projection, mtp_weight_grad,
)

# Megatron DDP bucket size: max(40M, 1M x dp) parameters, dp the gradient-reduction group (dp x cp)
# (megatron/core/distributed/distributed_data_parallel.py; training.py: dp_cp group size)
BUCKET_PARAMS = 40_000_000
# Adam step over fp32 master weights, bytes per parameter of the optimizer's shard: the fused
# multi-tensor kernel reads grad, master, m, v (16) and writes master, m, v (12); the gradient norm
# reads the grad (4, Megatron clip_grad_norm); the updated master is copied into the 16-bit weights
# by a kernel of its own, read 4 and write 2 (Megatron _copy_main_params_to_model_params,
# _multi_tensor_copy_this_to_that).
ADAM_BYTES_PER_PARAM = 38


# fp16's loss scaling: the fp32 main gradients are unscaled and checked for inf/nan in place before
# the step, a read and a write of 4 bytes each (Megatron MixedPrecisionOptimizer
# _unscale_main_grads_and_check_for_nan: torch._amp_foreach_non_finite_check_and_unscale_)
FP16_UNSCALE_BYTES_PER_PARAM = 8


def adam_bytes_per_param(precision: str, grad_bytes: int) -> int:
    """ADAM_BYTES_PER_PARAM per parameter of the optimizer's shard, less the 16-bit weight copy in
    fp32 training, plus fp16's unscaling pass. 16-bit main gradients are cast to an fp32 copy first
    (Megatron _copy_model_grads_to_main_grads: main_param.grad = model_grad.float(); read g,
    write 4), which the norm and Adam then read."""
    base = ADAM_BYTES_PER_PARAM - (6 if precision == "fp32" else 0) + (FP16_UNSCALE_BYTES_PER_PARAM
                                                                       if precision == "fp16" else 0)
    return base + (grad_bytes + 4 if grad_bytes < MAIN_GRAD_BYTES else 0)


def optimizer_time(gpu, shard_params: float, buffer_params: float, precision: str, grad_bytes: int) -> float:
    """The optimizer step of a rank: Adam over its shard (adam_bytes_per_param), then the zeroing
    of its gradient buffer, g bytes per parameter of the buffer (Megatron zero_grad_buffer): the
    whole model chunk's gradients under ZeRO-0/1, whose buffer is not sharded, the shard under
    ZeRO-2/3."""
    return memory_bound_time(gpu, shard_params * adam_bytes_per_param(precision, grad_bytes)) \
        + memory_bound_time(gpu, buffer_params * grad_bytes)


MFU_PEAK_DTYPE = {"fp8": "bf16"}
"""The peak MFU is quoted against, by GEMM dtype where it differs from that dtype's own."""


def compute_dtype(precision: str) -> str:
    """GEMM dtype: fp32 training runs its matmuls on TF32 tensor cores (PyTorch allow_tf32)."""
    return "tf32" if precision == "fp32" else precision


@dataclass(frozen=True)
class _Layers:
    """Per-layer costs and sizes of the two kinds of layer (dense FFN, MoE FFN) on one rank."""

    fwd: dict
    bwd: dict
    wgrad: dict  # kind -> seconds of the backward's weight-gradient GEMMs (the W pass)
    params: dict  # kind -> (params sharded over dp x cp, expert params sharded over edp)
    acts: dict  # kind -> stored activation bytes per microbatch
    working: dict  # kind -> transient bytes while one layer of the kind runs (recompute, dispatch buffers)
    phases: dict = field(default_factory=dict)
    """kind -> (forward, backward) combined.LayerPhases, under combined 1F1B only."""
    rebuilt: dict = field(default_factory=dict)
    """kind -> bytes per microbatch that recompute rebuilds in a split backward's B pass and that
    stay until its W pass (split-backward schedules with recompute only; none elsewhere)."""
    uncached: dict = field(default_factory=dict)
    """kind -> the part of its params[kind][0] with no fp8 copy (memory.FP8_WEIGHT_CACHE_BYTES): its
    norms and an MoE layer's router."""


@dataclass(frozen=True)
class _Iteration:
    """What one simulated iteration leaves for the report (besides its _Setup)."""

    kinds: _Layers
    draw: object  # the routing draw (None for a dense model)
    mems: list  # per stage memory (empty when not asked for)
    eng: object  # engine.EngineResult


def simulate(sc: Scenario, *, imbalance_reference: bool = True, record_spans: bool = True) -> SimResult:
    """One iteration of `sc`'s plan. For an MoE model, `imbalance_reference` also simulates the
    iteration with a perfectly balanced router, for the report's step-time comparison (callers
    that only rank plans, like the planner, skip that second run). `record_spans` False leaves
    the timeline (SimResult.spans, for --trace and --plot) empty; every figure is the same."""
    setup = _setup(sc)
    it = _iterate(sc, setup, balanced=False, record_spans=record_spans, memory=True)
    m, p, tr = sc.model, sc.plan, sc.training
    gpu, ctx, layers = setup.gpu, setup.ctx, setup.layers
    draw, kinds, mems, eng = it.draw, it.kinds, it.mems, it.eng
    tokens = tr.global_batch_size * tr.seq_length
    # MFU against the 16-bit dense peak under fp8 too, as torchtitan and most published fp8 runs
    # quote it (attention and the LM head run in bf16 anyway), so MFU compares across precisions
    peak = gpu.peak(MFU_PEAK_DTYPE.get(ctx.dtype, ctx.dtype))
    kept = 1.0 - _dropped_fraction(draw) if draw is not None else 1.0  # copies the experts compute
    flops = model_flops(m, tr.seq_length, tokens, kept)
    hw_flops = hardware_flops(m, tr.seq_length, tokens, p.recompute, p.recompute_modules, kept)
    flops_causal = model_flops(m, tr.seq_length, tokens, kept, causal=True)
    hw_causal = hardware_flops(m, tr.seq_length, tokens, p.recompute, p.recompute_modules, kept, causal=True)
    world = p.world_size
    stages = tuple(
        StageResult(
            stage=s, layers=tuple(layers[s]), end_time_s=eng.stages[s].end,
            memory=mems[s].as_dict(),
            breakdown={k: eng.stages[s].breakdown.get(k, 0.0) for k in BREAKDOWN_KEYS},
        )
        for s in range(p.pp)
    )
    critical = _critical_stage(eng)
    peak_mem = max(mm.total for mm in mems)
    moe = None
    if draw is not None:
        moe = _moe_report(sc, setup, draw, kinds, reference=imbalance_reference)
    return SimResult(
        scenario=sc.name,
        step_time_s=eng.step_time,
        tokens_per_s=tokens / eng.step_time,
        tflops_per_gpu=flops / eng.step_time / world / 1e12,
        mfu=flops / eng.step_time / world / peak,
        hfu=hw_flops / eng.step_time / world / peak,
        mfu_causal=flops_causal / eng.step_time / world / peak,
        hfu_causal=hw_causal / eng.step_time / world / peak,
        flop_formula=flops_formula_for(m),
        peak_flops_per_gpu=peak,
        num_microbatches=sc.num_microbatches,
        peak_memory_bytes=peak_mem,
        memory_capacity_bytes=gpu.hbm_capacity,
        fits=peak_mem <= gpu.hbm_capacity,
        critical_stage=critical,
        breakdown=dict(stages[critical].breakdown),
        stages=stages,
        spans=eng.spans,
        moe=moe,
    )


@dataclass(frozen=True)
class _Setup:
    """What a plan's iteration needs that the routing does not change: the hardware models, the
    layer context, the groups' layouts, the layer split and schedule; shared by the iteration and
    its balanced-router reference. `buckets` keeps the DDP buckets already costed (stages with
    the same parameters have the same buckets)."""

    gpu: object
    net: object
    ctx: LayerContext
    dp_layout: GroupLayout
    expert_layouts: tuple[GroupLayout, GroupLayout, GroupLayout]  # (expert-TP, EP, expert-DP)
    dispatch_layout: GroupLayout  # the group MoE tokens are exchanged over (expert_dispatch_layout)
    hops: list
    layers: list
    schedule: tuple
    buckets: dict
    pairs: tuple = ()
    """Per stage, the merged pairs of its schedule (schedules.merged_pairs: combined 1F1B, DualPipeV);
    () each without."""


def _hierarchical_cp(p, m, gpn: int, leaf: int | None) -> tuple | None:
    """LayerContext.cp_groups of an a2a+p2p plan (None for the single-level exchanges)."""
    if p.cp == 1 or p.cp_comm_type != "a2a+p2p":
        return None
    a2a, ring = cp_split(p, m, gpn)
    return (a2a, ring, *cp_group_layouts(p, a2a, gpn, nodes_per_leaf=leaf))


def _setup(sc: Scenario) -> _Setup:
    """The routing-independent part of `sc`'s iteration; refuses a plan that breaks a structural
    rule (InfeasiblePlanError, every reason)."""
    gpu = load_profile(sc.cluster.gpu)
    problems = structural_problems(sc, gpu.arch)
    if problems:
        raise InfeasiblePlanError(problems)
    net = build_network(sc.cluster, gpu)
    m, p, tr = sc.model, sc.plan, sc.training
    gpn, leaf = sc.cluster.gpus_per_node, net.nodes_per_leaf
    ctx = LayerContext(
        model=m, plan=p, gpu=gpu, network=net, seq_length=tr.seq_length,
        dtype=compute_dtype(tr.precision), attention_kernel=tr.attention,
        tp_layout=group_layout(("tp",), p, gpn, nodes_per_leaf=leaf),
        cp_layout=group_layout(("cp",), p, gpn, nodes_per_leaf=leaf),
        grad_bytes=DTYPE_BYTES[tr.grad_reduce_dtype],
        cp_groups=_hierarchical_cp(p, m, gpn, leaf),
    )
    return _Setup(
        gpu=gpu, net=net, ctx=ctx, dp_layout=group_layout(("cp", "dp"), p, gpn, nodes_per_leaf=leaf),
        expert_layouts=expert_group_layouts(p, gpn, nodes_per_leaf=leaf),
        dispatch_layout=expert_dispatch_layout(p, gpn, nodes_per_leaf=leaf),
        hops=pp_hop_layouts(p, gpn, nodes_per_leaf=leaf),
        layers=layers_per_chunk(m.num_layers, p.pp, p.virtual_pipeline_stages, p.first_stage_layers,
                                p.last_stage_layers, v_shaped(p)),
        schedule=build_schedule(p.schedule, p.pp, sc.num_microbatches, p.virtual_pipeline_stages,
                                p.overlap_moe_expert_parallel_comm),
        buckets={},
        pairs=merged_pairs(p.schedule, p.pp, sc.num_microbatches, p.virtual_pipeline_stages,
                           p.overlap_moe_expert_parallel_comm),
    )


def stage_peak_memory(sc: Scenario) -> list[float]:
    """Each pipeline stage's peak memory in bytes under `sc`'s plan, as simulate() reports it
    (StageMemory.total), without playing the iteration: what the planner checks a plan's fit by
    before it simulates one. Refuses a plan that breaks a structural rule, as simulate() does."""
    _, _, _, mems = _stage_work(sc, _setup(sc), balanced=False, memory=True)
    return [mm.total for mm in mems]


def _iterate(sc: Scenario, setup: _Setup, *, balanced: bool, record_spans: bool, memory: bool) -> _Iteration:
    """Build every stage's work and run the engine; `balanced`: a perfectly balanced router in
    place of the scenario's routing draw; `memory`: also each stage's memory (the balanced
    reference needs only the step time)."""
    kinds, draw, works, mems = _stage_work(sc, setup, balanced=balanced, memory=memory)
    p = sc.plan
    v = v_shaped(p)
    last_rank, _ = holder(p.pp * p.virtual_pipeline_stages - 1, p.pp, v)
    net, ctx, hops = setup.net, setup.ctx, setup.hops
    p2p = [_p2p_time(ctx, hop) if p.pp > 1 else 0.0 for hop in hops]
    sync = _sync_time(sc, net, sc.model.vocab_shard(p.tp) * sc.model.hidden_size, hops[-1] if last_rank != 0 else None)
    eng = run_iteration(works, num_chunks=p.virtual_pipeline_stages, p2p_time=p2p,
                        overlap_grad_reduce=p.overlap_grad_reduce, sync_time=sync,
                        p2p_nic=[t if hop.num_nodes > 1 else 0.0 for t, hop in zip(p2p, hops)],
                        align_grad_reduce=p.schedule in ("1f1b", "interleaved-1f1b"), record_spans=record_spans,
                        blocking_sends=p.blocking_sends, v_shaped=v)
    return _Iteration(kinds=kinds, draw=draw, mems=mems, eng=eng)


def _pair_costs(kinds: _Layers, chunk_kinds: list[list[str]], op_cost: dict, ops, pairs: tuple[int, ...]) -> dict:
    """(forward's chunk, backward's chunk) -> Cost of each overlapped pair the stage runs (combined
    1F1B; DualPipe's overlapped pairs): a forward and a whole backward (its input and weight
    gradients where the schedule splits them), the two chunks' layers merged node by node
    (simulator.combined), plus what is not a layer (embedding, LM head, multi-token prediction:
    each chunk's pass minus its layers) alone. Pairs that are not overlapped (DualPipeV as PyTorch
    runs them without an overlap callback) run as their two ops (engine.StageWork.pairs)."""
    out = {}
    for i in pairs:
        fc, bc = ops[i].chunk, ops[i + 1].chunk
        if (fc, bc) in out:
            continue
        f, b = op_cost[("F", fc)], op_cost[(ops[i + 1].kind, bc)]  # a whole backward: B or X
        f_layers = [kinds.phases[k][0] for k in chunk_kinds[fc]]
        b_layers = [kinds.phases[k][1] for k in chunk_kinds[bc]]
        alone = (f.total - sum(kinds.fwd[k].total for k in chunk_kinds[fc])
                 + b.total - sum(kinds.bwd[k].total for k in chunk_kinds[bc]))
        out[(fc, bc)] = merged_cost(f, b, alone + merged_layers_time(f_layers, b_layers))
    return out


def _stage_work(sc: Scenario, setup: _Setup, *, balanced: bool, memory: bool):
    """(layer kinds, routing draw, each stage's StageWork, each stage's StageMemory: empty unless
    `memory`): everything the engine plays and the memory report reads."""
    gpu, net, ctx, dp_layout, layers, schedule = \
        setup.gpu, setup.net, setup.ctx, setup.dp_layout, setup.layers, setup.schedule
    etp_layout, _, edp_layout = setup.expert_layouts
    a2a_layout = setup.dispatch_layout
    m, p, tr = sc.model, sc.plan, sc.training
    shard = p.dp * p.cp
    vpp = p.virtual_pipeline_stages
    kinds, draw = _layer_kinds(ctx, a2a_layout, etp_layout, balanced=balanced)
    # a schedule that runs some backwards whole beside split ones (DualPipeV's X ops) prices those
    # as a schedule that never splits does: the weight-gradient GEMMs are there to hide the
    # input gradient's TP collectives behind (workload.tp_exposed)
    ctx_whole = kinds_whole = None
    if p.schedule in WHOLE_AND_SPLIT_SCHEDULES:
        ctx_whole = dataclasses.replace(ctx, plan=dataclasses.replace(p, schedule="1f1b"))
        kinds_whole, _ = _layer_kinds(ctx_whole, a2a_layout, etp_layout, balanced=balanced)
    w_bytes, _, _ = state_bytes_per_param(tr.precision)
    emb_params = m.vocab_shard(p.tp) * m.hidden_size  # the largest vocabulary shard's rows

    # ZeRO-2 and -3 shard the gradients, so every microbatch's backward reduce-scatters each unit's
    # gradients as it produces them (there is no full gradient buffer to accumulate into:
    # DeepSpeed ZeRO-2 reduces after every backward, PyTorch FSDP SHARD_GRAD_OP/FULL_SHARD
    # reduce-scatter in each backward, Zhao et al., VLDB 2023, Sec. 3); ZeRO-3 also all-gathers
    # each unit's weights (forward and backward). Dense weights over the data-parallel group, expert
    # weights over the expert-data-parallel group (where they are sharded, memory.stage_memory).
    per_unit = {}
    if p.zero_stage >= 2 and (shard > 1 or edp_layout.size > 1):
        gather_bytes = w_bytes if p.zero_stage == 3 else 0.0
        per_unit = {kind: _zero3_comm(net, [(dense, dp_layout), (expert, edp_layout)], gather_bytes, ctx.grad_bytes)
                    for kind, (dense, expert) in kinds.params.items()}
        per_unit["embedding"] = _zero3_comm(net, [(emb_params, dp_layout)], gather_bytes, ctx.grad_bytes)
    # per layer kind, the parameters ZeRO-3 gathers (the parts that are sharded)
    gathered_of = {kind: dense * (shard > 1) + expert * (edp_layout.size > 1)
                   for kind, (dense, expert) in kinds.params.items()}

    # the rank and chunk holding the last virtual stage (the LM head): the embedding's rank, 0,
    # when pp is 1 or the chunks sit in a V
    v = v_shaped(p)
    last_rank, last_chunk = holder(p.pp * vpp - 1, p.pp, v)
    # a tied LM head on the embedding's stage (pp 1) uses the embedding's weights: no copy of its
    # own. Pipelined, the last stage is a model chunk of its own with its own copy, also where a V
    # puts it on the embedding's rank (PyTorch pipelining builds a module per stage; paraplan
    # launch sums the two copies' gradients there, without an all-reduce between ranks)
    own_head = not (m.tied_embeddings and p.pp == 1)
    # multi-token prediction embeds tokens on the last stage: an untied pipelined model keeps a copy
    # of the input embedding there (Megatron-Core GPTModel builds it on the MTP stage)
    mtp_embedding = m.mtp_layers > 0 and p.pp > 1 and not m.tied_embeddings
    works, mems = [], []
    # the loss's fp32 softmax: an activation of the last chunk's microbatches in flight, which the
    # B pass frees (memory.logits_bytes)
    softmax = logits_bytes(m, p, tr.seq_length, CE_SOFTMAX_BYTES)
    # global index of the first layer of each virtual stage g = chunk x pp + stage
    first_layer = [0, *accumulate(layers_per_virtual_stage(m.num_layers, p.pp, vpp, p.first_stage_layers,
                                                            p.last_stage_layers))]
    for s in range(p.pp):
        stage_kinds: set[str] = set()
        op_cost, buckets, gathers, chunk_acts, chunk_rebuilt = {}, {}, {}, [], []
        chunk_kinds = []
        dense_params = expert_params = 0.0
        for c in range(len(layers[s])):
            start = first_layer[virtual_stage(s, c, p.pp, v)]
            kinds_in_chunk = ["moe" if m.is_moe_layer(i) else "dense" for i in range(start, start + layers[s][c])]
            chunk_kinds.append(kinds_in_chunk)
            stage_kinds.update(kinds_in_chunk)
            if (s, c) == (last_rank, last_chunk) and m.mtp_layers:
                # the multi-token prediction modules run their layer here (_chunk_work), also on a
                # last stage with no decoder layers of its own
                stage_kinds.add(_mtp_layer_kind(m))
            chunk = _chunk_work(ctx, kinds, kinds_in_chunk, per_unit, first=s == 0 and c == 0,
                                last=(s, c) == (last_rank, last_chunk), emb_params=emb_params,
                                own_head=own_head, mtp_embedding=mtp_embedding)
            f, b, w, c_dense, c_expert, acts = chunk
            op_cost[("F", c)], op_cost[("B", c)] = f, b
            if w is not None:  # a split backward's W pass
                op_cost[("W", c)] = w
            if ctx_whole is not None:  # a whole backward (X)
                op_cost[("X", c)] = _chunk_work(ctx_whole, kinds_whole, kinds_in_chunk, per_unit, first=s == 0 and c == 0,
                                                last=(s, c) == (last_rank, last_chunk), emb_params=emb_params,
                                                own_head=own_head, mtp_embedding=mtp_embedding)[1]
            dense_params += c_dense
            expert_params += c_expert
            chunk_acts.append(acts)
            chunk_rebuilt.append(sum(kinds.rebuilt.get(k, 0.0) for k in kinds_in_chunk))
            # Megatron buckets only the first stage's first chunk, and only with the reduction
            # overlapped (DistributedDataParallel: bucket_size None on pipeline ranks > 0 and
            # without overlap_grad_reduce; training.py get_model: disable_bucketing for model
            # chunks > 0); elsewhere a buffer's gradients and weights move in one collective
            whole = s > 0 or c > 0
            if p.zero_stage < 2:  # ZeRO-2/3 reduce per microbatch, in the backward (per_unit)
                whole_grads = whole or not p.overlap_grad_reduce
                buckets[c] = (_grad_buckets(setup, c_dense, dp_layout, shard, whole=whole_grads)
                              + _grad_buckets(setup, c_expert, edp_layout, edp_layout.size, whole=whole_grads))
            if p.zero_stage in (1, 2) and p.overlap_param_gather:
                # dense and expert weights are separate buffers, each gathered bucket after bucket
                # as the forward's pre-hooks reach them: in order of need
                gathers[c] = sorted(((t, nic, j / len(bl)) for bl in (
                    _buckets(setup, c_dense, dp_layout, shard, "all_gather", w_bytes, whole=whole),
                    _buckets(setup, c_expert, edp_layout, edp_layout.size, "all_gather", w_bytes, whole=whole))
                    for j, (t, nic) in enumerate(bl)), key=lambda b: b[2])
        local_opt = dense_params / (shard if p.zero_stage >= 1 else 1) \
            + expert_params / (edp_layout.size if p.zero_stage >= 1 else 1)
        buffer = local_opt if p.zero_stage >= 2 else dense_params + expert_params
        param_gather = 0.0
        if p.zero_stage in (1, 2) and not p.overlap_param_gather:  # gathered whole after the step
            param_gather = (collective_time(net, "all_gather", dense_params * w_bytes, dp_layout)
                            + collective_time(net, "all_gather", expert_params * w_bytes, edp_layout))
        works.append(StageWork(
            ops=schedule[s], op_cost=op_cost,
            pairs=setup.pairs[s], pairs_overlapped=p.overlap_moe_expert_parallel_comm,
            pair_cost=_pair_costs(kinds_whole or kinds, chunk_kinds, op_cost, schedule[s], setup.pairs[s])
            if p.overlap_moe_expert_parallel_comm else {},
            grad_buckets={c: [t for t, _ in bl] for c, bl in buckets.items() if bl},
            grad_bucket_nic={c: [nic for _, nic in bl] for c, bl in buckets.items() if bl},
            optimizer_time=optimizer_time(gpu, local_opt, buffer, tr.precision, ctx.grad_bytes),
            param_gather_time=param_gather,
            param_gather_buckets={c: bl for c, bl in gathers.items() if bl},
        ))
        if not memory:
            continue
        working = max(kinds.working[k] for k in stage_kinds) if stage_kinds else 0.0
        if setup.pairs[s] and p.overlap_moe_expert_parallel_comm:
            # an overlapped pair runs a forward layer and a backward layer at once: both their transient
            # buffers (dispatch buffers, what recompute rebuilds) are live together
            working *= 2
        freed_by_b = [0.0] * len(layers[s])
        if s == last_rank:
            # the LM head's 16-bit logits live in the forward, a recomputed layer's tensors (and the
            # dispatch buffers) in the layers' passes: never both at once
            working = max(working, logits_bytes(m, p, tr.seq_length, ctx.act_bytes))
            freed_by_b[last_chunk] = softmax
        holds_embedding = s == 0 or (s == last_rank and own_head)
        gathered_layer = max((gathered_of[k] for k in stage_kinds), default=0.0)
        gathered = max(gathered_layer, emb_params * (shard > 1) if holds_embedding else 0.0)
        mems.append(stage_memory(
            plan=p, precision=tr.precision, grad_dtype=tr.grad_reduce_dtype, dense_params=dense_params, expert_params=expert_params,
            max_layer_params=gathered, working_set=working,
            activations=peak_in_flight(schedule[s], chunk_acts, freed_by_b=freed_by_b, rebuilt_by_b=chunk_rebuilt),
            prefetched_params=gathered_layer,
            uncached_params=emb_params * ((s == 0) + (s == last_rank) * (own_head + mtp_embedding))
            + sum(kinds.uncached[k] for kinds_in_chunk in chunk_kinds for k in kinds_in_chunk)
            + (m.mtp_layers * (kinds.uncached[_mtp_layer_kind(m)] + m.mtp_norm_params()) if s == last_rank else 0),
        ))

    return kinds, draw, works, mems


def _p2p_time(ctx, hop) -> float:
    """One pipeline send of a microbatch's activation (or its gradient) over `hop`: each TP rank
    sends its sequence-parallel shard, or with p2p_scatter_gather its 1/tp slice, which the
    receivers then all-gather inside their node (SC'21 Sec. 4.1); else the whole activation
    (Megatron-Core p2p_communication: the sequence is divided by tp only under sequence parallelism).
    ctx.tokens is the microbatch's tokens on one CP rank, before the sequence-parallel split; the
    re-gather runs on the receiver before its op, so it is counted in the send."""
    p, net = ctx.plan, ctx.network
    whole = ctx.tokens * ctx.model.hidden_size * ctx.act_bytes
    if p.tp == 1 or p.sequence_parallel:
        return collective_time(net, "send_recv", whole / p.tp, hop)
    if not p.p2p_scatter_gather:
        return collective_time(net, "send_recv", whole, hop)
    return collective_time(net, "send_recv", whole / p.tp, hop) + collective_time(net, "all_gather", whole,
                                                                                   ctx.tp_layout)


def _dropped_fraction(draw) -> float:
    """Share of the routed token copies dropped at expert capacity."""
    return draw.dropped / max(1.0, float(draw.expert_tokens.sum()) + draw.dropped)


def _critical_stage(eng) -> int:
    """The stage the report breaks down: one that ends last (its breakdown sums to the step time)
    and, of those, the one with the most work in its breakdown (the least pipeline idle), the
    pipeline's bottleneck. Every stage leaves the closing sync together, but their optimizer steps
    and weight gathers after it differ (the embedding's stages own more parameters)."""
    step = eng.step_time
    last = [s for s, t in enumerate(eng.stages) if t.end >= step * (1 - 1e-12)]
    return max(last, key=lambda s: (eng.stages[s].end - eng.stages[s].breakdown.get("pp_bubble", 0.0), -s))


def _routed_block(ctx, a2a_layout, etp_layout, *, balanced: bool):
    """(routing draw, MoE block) of an MoE layer: the seeded draw of the scenario's router, or a
    perfectly balanced one; tokens exchanged over `a2a_layout` (expert_dispatch_layout)."""
    p = ctx.plan
    draw = draw_routing(ctx.model.moe, p.ep, routed_tokens_per_rank(ctx), balanced=balanced)
    return draw, moe_block(ctx, draw, a2a_layout, etp_layout, overlap_shared=p.moe_shared_expert_overlap)


def _layer_kinds(ctx, a2a_layout, etp_layout, *, balanced: bool):
    """Per-layer forward/backward costs, parameters and activations of a dense layer and, for an
    MoE model, of an MoE layer (whose costs follow the seeded routing draw; its tokens exchanged
    over `a2a_layout`)."""
    m, p = ctx.model, ctx.plan
    attn_params = m.attention_params(p.tp)
    fp8 = ctx.dtype == "fp8"  # linears keep fp8 copies of their inputs (memory.activation_bytes_per_layer)
    dense_acts = activation_bytes_per_layer(m, p, ctx.seq_length, ctx.attention_kernel, act_bytes=ctx.act_bytes,
                                            fp8_inputs=fp8)
    # the attention's exchange buffers and a recomputed layer's tensors can be live at once: both counted
    cp_working = cp_exchange_working_bytes(m, p, ctx.seq_length, ctx.act_bytes, a2a=cp_groups_of(ctx)[0])
    kinds = _Layers(
        fwd={"dense": layer_forward(ctx)}, bwd={"dense": layer_backward(ctx)}, wgrad={"dense": layer_weight_grad(ctx)},
        params={"dense": (attn_params + m.ffn_matrices * m.hidden_size * m.ffn_hidden_size / p.tp, 0.0)},
        acts={"dense": dense_acts},
        working={"dense": cp_working + recompute_working_bytes(m, p, ctx.seq_length, ctx.attention_kernel,
                                                               ctx.act_bytes, fp8_inputs=fp8)},
        uncached={"dense": m.norm_params()},
    )
    rebuilds = p.schedule in SPLIT_BACKWARD_SCHEDULES and (p.recompute == "full" or p.recomputed_modules)
    if rebuilds:
        kinds.rebuilt["dense"] = unrecomputed_activation_bytes(
            m, p, ctx.seq_length, ctx.attention_kernel, act_bytes=ctx.act_bytes, fp8_inputs=fp8) - dense_acts
    if m.moe is None:
        return kinds, None
    e = m.moe
    draw, block = _routed_block(ctx, a2a_layout, etp_layout, balanced=balanced)
    kinds.fwd["moe"] = layer_forward(ctx, block)
    kinds.bwd["moe"] = layer_backward(ctx, block)
    kinds.wgrad["moe"] = layer_weight_grad(ctx, block)
    shared = e.num_shared_experts * m.expert_params() / p.tp
    local_experts = e.num_experts // p.ep * m.expert_params() / p.expert_tp
    kinds.params["moe"] = (attn_params + m.router_params() + shared, local_experts)
    kinds.uncached["moe"] = m.norm_params() + m.router_params()
    ffn = moe_activation_bytes(ctx, draw)
    kinds.acts["moe"] = activation_bytes_per_layer(m, p, ctx.seq_length, ctx.attention_kernel, ffn, ctx.act_bytes,
                                                   fp8_inputs=fp8)
    recomputed_ffn = p.recompute == "full" or "moe" in p.recomputed_modules
    ffn_whole = moe_activation_bytes(ctx, draw, recomputed=()) if rebuilds or recomputed_ffn else 0.0
    if rebuilds:
        kinds.rebuilt["moe"] = unrecomputed_activation_bytes(
            m, p, ctx.seq_length, ctx.attention_kernel, ffn_whole, ctx.act_bytes, fp8_inputs=fp8) - kinds.acts["moe"]
    kinds.working["moe"] = cp_working + dispatch_buffer_bytes(ctx, draw) + recompute_working_bytes(
        m, p, ctx.seq_length, ctx.attention_kernel, ctx.act_bytes,
        moe_ffn_bytes=ffn_whole if recomputed_ffn else moe_rebuilt_bytes(ctx, draw), fp8_inputs=fp8)
    if p.overlap_moe_expert_parallel_comm:
        kinds.phases.update({
            "dense": (LayerPhases.of(kinds.fwd["dense"].total, None), LayerPhases.of(kinds.bwd["dense"].total, None)),
            "moe": (LayerPhases.of(kinds.fwd["moe"].total, block.forward_phases),
                    LayerPhases.of(kinds.bwd["moe"].total, block.backward_phases))})
    return kinds, draw


def _chunk_work(ctx, kinds: _Layers, kinds_in_chunk: list[str], per_unit: dict, *, first: bool, last: bool,
                emb_params: float, own_head: bool, mtp_embedding: bool = False,
                ) -> tuple[Cost, Cost, Cost | None, float, float, float]:
    """(forward cost, backward cost, W-pass cost, params sharded over dp x cp, expert params,
    activation bytes per microbatch) of one model chunk: its layers, plus the embedding on the first
    chunk of the pipeline and the LM head and the multi-token prediction modules on the last
    (`mtp_embedding`: the last stage holds its own copy of the input embedding for them). Under a
    split backward (zero-bubble) the backward cost is the B pass's and the W pass runs the
    weight-gradient GEMMs with the ZeRO-2/3 reduce-scatters (the weight gradients exist only after
    it); otherwise the backward cost is the whole backward and there is no W pass (None)."""
    dense = expert = acts = 0.0
    for kind in dict.fromkeys(kinds_in_chunk):  # the kinds present, in a fixed order
        n = kinds_in_chunk.count(kind)
        dense += n * kinds.params[kind][0]
        expert += n * kinds.params[kind][1]
        acts += n * kinds.acts[kind]
    # (forward cost, backward cost, ZeRO-2/3 (gather, scatter), weight-gradient seconds) of each
    # piece in forward order
    pieces = [(kinds.fwd[k], kinds.bwd[k], per_unit.get(k, NO_ZERO3_COMM), kinds.wgrad[k])
              for k in kinds_in_chunk]
    no_comm = NO_ZERO3_COMM
    if first:
        pieces.insert(0, (embedding_cost(ctx, backward=False), embedding_cost(ctx, backward=True),
                          per_unit.get("embedding", no_comm), 0.0))
        dense += emb_params
        if ctx.model.dropout:
            # the embedding dropout's 1-byte mask, on the sequence-parallel shard (Korthikanti et al.
            # 2022, Sec. 4.3; Megatron-Core LanguageModelEmbedding scatters to the sequence-parallel
            # region before its dropout)
            acts += ctx.tokens * ctx.model.hidden_size / (ctx.plan.tp if ctx.plan.sequence_parallel else 1)
    if last:
        # a head without its own weights (own_head false) uses those gathered with the embedding
        head = {backward: head_cost(ctx, backward) for backward in (False, True)}
        pieces.append((head[False], head[True], per_unit.get("embedding", no_comm) if own_head else no_comm,
                       head_weight_grad(ctx)))
        if own_head:
            dense += emb_params
        if mtp_embedding:
            dense += emb_params
        m, p = ctx.model, ctx.plan
        sp = p.tp if p.sequence_parallel else 1
        h_wide = ctx.tokens * m.hidden_size * ctx.act_bytes / sp  # one h-wide tensor, SP-sharded
        # the final norm's input and the head's (the norm's output; a sequence-parallel head keeps
        # its shard and re-gathers it for the weight gradient, as every column-parallel layer)
        acts += 2 * h_wide
        if m.mtp_layers:
            # each module (all alike): embed the next tokens, project [norm(embedding), norm(hidden)]
            # to h, one more layer like the last, the shared head (Megatron-Core
            # MultiTokenPredictionBlock, after the decoder)
            kind = _mtp_layer_kind(m)
            module = {}
            for backward in (False, True):
                module[backward] = embedding_cost(ctx, backward)
                module[backward] += mtp_projection(ctx, backward)
                module[backward] += (kinds.bwd if backward else kinds.fwd)[kind]
                module[backward] += head[backward]
            module_wgrad = kinds.wgrad[kind] + mtp_weight_grad(ctx) + head_weight_grad(ctx)
            pieces += [(module[False], module[True], per_unit.get(kind, no_comm), module_wgrad)] * m.mtp_layers
            # the projection split over TP (Megatron-Core's eh_proj is column-parallel), the norms whole
            norms = m.mtp_norm_params()
            dense += m.mtp_layers * (kinds.params[kind][0] + (m.mtp_projection_params() - norms) / p.tp + norms)
            expert += m.mtp_layers * kinds.params[kind][1]
            # its layer's activations, the saved 2h projection input, the inputs of its two norms
            # (enorm, hnorm), of its final norm and of the head (MultiTokenPredictionLayer), all
            # SP-sharded; its logits and softmax are counted with the head's (memory.logits_bytes)
            acts += m.mtp_layers * (kinds.acts[kind] + 6 * h_wide)
    f = _zero3_chain([(fwd, c.gather, 0.0, c.gather_nic) for fwd, _, c, _ in pieces])
    if ctx.plan.schedule in SPLIT_BACKWARD_SCHEDULES:
        b = _zero3_chain([(bwd.scaled(1.0).add("compute", -wg), c.gather, 0.0, c.gather_nic)
                          for _, bwd, c, wg in reversed(pieces)])
        w = _zero3_chain([(Cost().add("compute", wg), 0.0, c.scatter, c.scatter_nic)
                          for _, _, c, wg in reversed(pieces)])
        return f, b, w, dense, expert, acts
    b = _zero3_chain([(bwd, c.gather, c.scatter, c.gather_nic + c.scatter_nic) for _, bwd, c, _ in reversed(pieces)])
    return f, b, None, dense, expert, acts


def _mtp_layer_kind(m) -> str:
    """The kind of layer a multi-token prediction module runs: one like the model's last."""
    return "moe" if m.is_moe_layer(m.num_layers - 1) else "dense"


def _grad_buckets(setup: _Setup, params: float, layout: GroupLayout, group: int, *,
                  whole: bool = False) -> list[tuple[float, float]]:
    """(seconds, seconds of it on the NIC) per gradient bucket of `params` over `layout`, reduced
    in the main-gradient buffer's dtype (ctx.grad_bytes per parameter: Megatron reduces the buffer
    itself, accumulate_allreduce_grads_in_fp32 under bf16): all-reduce without ZeRO, reduce-scatter
    with ZeRO-1 (Megatron distributed optimizer); ZeRO-2/3 reduce per unit instead (_zero3_comm)."""
    op = "all_reduce" if setup.ctx.plan.zero_stage == 0 else "reduce_scatter"
    return _buckets(setup, params, layout, group, op, setup.ctx.grad_bytes, whole=whole)


def _buckets(setup: _Setup, params: float, layout: GroupLayout, group: int, op: str,
             bytes_per_param: float, *, whole: bool = False) -> list[tuple[float, float]]:
    """(seconds, seconds of it on the NIC) per DDP bucket of `params` running collective `op` over
    `layout`, `bytes_per_param` each (`whole`: one bucket). The distributed optimizer gathers the
    updated weights in the same buckets it reduces the gradients in
    (megatron/core/distributed/param_and_grad_buffer.py)."""
    if group <= 1 or params <= 0:
        return []
    key = (params, layout, group, op, bytes_per_param, whole)
    kept = setup.buckets.get(key)
    if kept is None:
        p = setup.ctx.plan
        n = 1 if whole else max(1, math.ceil(params / max(BUCKET_PARAMS, 1_000_000 * p.dp * p.cp)))
        t = collective_time(setup.net, op, params / n * bytes_per_param, layout)
        kept = setup.buckets[key] = [(t, t if layout.num_nodes > 1 else 0.0)] * n
    return list(kept)


@dataclass(frozen=True)
class Zero3Comm:
    """Seconds of one ZeRO-2/3 unit's all-gather and reduce-scatter, and of each the part over a
    group that leaves the node (its traffic holds the NIC, which pipeline sends then share)."""

    gather: float = 0.0
    scatter: float = 0.0
    gather_nic: float = 0.0
    scatter_nic: float = 0.0


NO_ZERO3_COMM = Zero3Comm()


def _zero3_comm(net, parts: list[tuple[float, GroupLayout]], w_bytes: float, grad_bytes: int) -> Zero3Comm:
    """The all-gather and reduce-scatter of one ZeRO-3 unit whose parameters are `parts` (count,
    the group they are sharded over), `w_bytes` per gathered weight (0: ZeRO-2, which gathers
    nothing per unit), `grad_bytes` per reduced gradient (FSDP MixedPrecision reduce_dtype); a
    group of one holds them whole and moves nothing."""
    gather = scatter = gather_nic = scatter_nic = 0.0
    for n, lay in parts:
        if n <= 0 or lay.size <= 1:
            continue
        g = collective_time(net, "all_gather", n * w_bytes, lay) if w_bytes else 0.0
        r = collective_time(net, "reduce_scatter", n * grad_bytes, lay)
        gather, scatter = gather + g, scatter + r
        if lay.num_nodes > 1:
            gather_nic, scatter_nic = gather_nic + g, scatter_nic + r
    return Zero3Comm(gather=gather, scatter=scatter, gather_nic=gather_nic, scatter_nic=scatter_nic)


def _zero3_chain(pieces: list[tuple[Cost, float, float, float]], gather_name: str = "param all-gather",
                 scatter_name: str = "grad reduce-scatter") -> Cost:
    """Pieces run in order on the compute stream, each (cost, its weights' all-gather, its
    gradients' reduce-scatter, seconds of the two that cross nodes), their transfers in issue order
    on one communication stream (PyTorch FSDP, Zhao et al., "PyTorch FSDP", VLDB 2023, Sec. 3.3,
    issues gathers and reduce-scatters on two streams, whose transfers then share the links; one
    stream moves the same bytes in the same time):
    the first gather when the op starts, piece i + 1's gather when piece i starts (prefetch one
    ahead), piece i's reduce-scatter when piece i ends (its gradients exist only then). A piece
    waits for its own gather; the op ends when the last piece and the last transfer have. A
    compute overlapped by transfers for t seconds finishes COMM_SM_SHARE x t later
    (network.overlapped). Gathers alone give comm_1 + sum_i max(compute_i (slowed), comm_(i+1)) +
    compute_n. The time above the compute is exposed data-parallel communication; the transfers'
    places go to the trace as `dp_spans`. The NIC seconds: the op holds the NIC that long (Cost.nic),
    which the engine shares with pipeline sends and gradient buckets."""
    total = Cost()
    for cost, _, _, nic in pieces:
        total += cost
        total.add_nic("dp_comm", nic)
    if not any(g or r for _, g, r, _ in pieces):
        return total
    transfers = []  # (start, end, name)
    free = 0.0  # when the communication stream is free
    ready = 0.0  # when the next piece's weights are there
    if pieces[0][1]:
        free = ready = pieces[0][1]
        transfers.append((0.0, free, f"{gather_name} (unit 0)"))
    t = 0.0  # when the compute stream is free
    for k, (cost, _, scatter, _) in enumerate(pieces):
        start = t if t > ready else ready
        if k + 1 < len(pieces) and pieces[k + 1][1]:  # prefetch the next piece's weights
            a = start if start > free else free
            free = ready = a + pieces[k + 1][1]
            transfers.append((a, free, f"{gather_name} (unit {k + 1})"))
        else:
            ready = 0.0
        d = cost.total
        busy = free - start
        t = start + d + (COMM_SM_SHARE * (busy if busy < d else d) if busy > 0 else 0.0)
        if scatter:
            a = t if t > free else free
            free = a + scatter
            transfers.append((a, free, f"{scatter_name} (unit {k})"))
    span = t if t > free else free
    total.dp_spans = tuple((a / span, b / span, name) for a, b, name in transfers if b > a)
    return total.add("dp_comm", span - sum(cost.total for cost, _, _, _ in pieces))


def _sync_time(sc: Scenario, net, emb_params: float, first_last: GroupLayout | None) -> float:
    """End-of-iteration syncs every rank waits for: the gradient-norm all-reduce over the
    model-parallel group (Megatron clip_grad_norm_fp32, a few bytes) and, when the embedding is
    tied (or multi-token prediction embeds tokens on the last stage) and pipelined, the all-reduce
    of its gradient between the first and last stage (Megatron _allreduce_word_embedding_grads),
    whose pair of ranks is `first_last` (None: one rank holds both ends, as in a V); that gradient
    is the main_grad, in the grad buffer's dtype (training.grad_reduce_dtype)."""
    p = sc.plan
    t = collective_time(net, "all_reduce", 4, group_layout(("tp", "pp"), p, sc.cluster.gpus_per_node,
                                                          nodes_per_leaf=net.nodes_per_leaf))
    if (sc.model.tied_embeddings or sc.model.mtp_layers) and first_last is not None:
        t += collective_time(net, "all_reduce", emb_params * DTYPE_BYTES[sc.training.grad_reduce_dtype], first_last)
    return t


def _moe_report(sc, setup: _Setup, draw, kinds, *, reference: bool) -> MoEReport:
    """The imbalance effect: the drawn routing against a perfectly balanced router, per MoE layer
    and, when `reference`, for the whole step (a second simulation with balanced routing)."""
    m, ctx = sc.model, setup.ctx
    etp_layout, ep_layout, edp_layout = setup.expert_layouts
    layer = kinds.fwd["moe"].total + kinds.bwd["moe"].total
    uniform_step = None
    if reference:
        ref = _iterate(sc, setup, balanced=True, record_spans=False, memory=False)
        uniform_step = ref.eng.step_time
        ref_layer = ref.kinds.fwd["moe"].total + ref.kinds.bwd["moe"].total
    else:
        _, ref_block = _routed_block(ctx, setup.dispatch_layout, etp_layout, balanced=True)
        ref_layer = layer_forward(ctx, ref_block).total + layer_backward(ctx, ref_block).total
    return MoEReport(
        routing=m.moe.routing.distribution,
        imbalance=draw.imbalance,
        dropped_fraction=_dropped_fraction(draw),
        moe_layer_time_s=layer,
        balanced_moe_layer_time_s=ref_layer,
        balanced_step_time_s=uniform_step,
        ep_group=f"{ep_layout.size} ranks on {ep_layout.num_nodes} node(s)",
        ep_tiers=tier_names_crossed(ctx.network, ep_layout),
        expert_data_parallel=edp_layout.size,
    )
