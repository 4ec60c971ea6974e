"""simulate(scenario) -> SimResult: one training iteration of a plan on the hardware models."""
from __future__ import annotations

import math

from hwmodels.compute import memory_bound_time
from hwmodels.network import build_network, collective_time
from hwmodels.profile import load_profile
from paraplan.errors import InfeasiblePlanError
from paraplan.placement import GroupLayout, group_layout, pp_neighbour_layout
from paraplan.specs import Scenario
from simulator.engine import StageWork, run_iteration
from simulator.feasibility import structural_problems
from simulator.flops import MODEL_FLOPS_FORMULA, hardware_flops, model_flops
from simulator.layout import layers_per_chunk
from simulator.memory import stage_memory, state_bytes_per_param
from simulator.result import BREAKDOWN_KEYS, SimResult, StageResult
from simulator.schedules import build_schedule, peak_in_flight
from simulator.cost import Cost
from simulator.workload import LayerContext, embedding_cost, head_cost, layer_backward, layer_forward

# Megatron DDP bucket size: max(40M, 1M x dp) parameters (megatron/core/distributed/distributed_data_parallel.py)
BUCKET_PARAMS = 40_000_000
# Adam step over fp32 master weights, bytes per parameter moved by the fused multi-tensor kernel:
# read grad, master, m, v (16), write master, m, v (12), write the 16-bit weight copy (2), plus the
# gradient-norm read (4) and the grad-buffer zeroing (4) (Megatron clip_grad_norm + zero_grad).
ADAM_BYTES_PER_PARAM = 38


def compute_dtype(precision: str) -> str:
    """GEMM dtype: fp32 training runs its matmuls on TF32 tensor cores (PyTorch allow_tf32)."""
    return "tf32" if precision == "fp32" else precision


def simulate(sc: Scenario) -> SimResult:
    gpu = load_profile(sc.cluster.gpu)
    problems = structural_problems(sc, gpu.arch)
    if problems:
        raise InfeasiblePlanError(problems)
    net = build_network(sc.cluster, gpu)
    m, p, tr = sc.model, sc.plan, sc.training
    gpn = sc.cluster.gpus_per_node
    ctx = LayerContext(
        model=m, plan=p, gpu=gpu, network=net, seq_length=tr.seq_length,
        dtype=compute_dtype(tr.precision), attention_kernel=tr.attention,
        tp_layout=group_layout(("tp",), p, gpn), cp_layout=group_layout(("cp",), p, gpn),
    )
    dp_layout = group_layout(("cp", "dp"), p, gpn)
    shard = p.dp * p.cp
    vpp = p.virtual_pipeline_stages
    layers = layers_per_chunk(m.num_layers, p.pp, vpp, p.first_stage_layers, p.last_stage_layers)
    n_mb = sc.num_microbatches
    schedule = build_schedule(p.schedule, p.pp, n_mb, vpp)

    fwd, bwd = layer_forward(ctx), layer_backward(ctx)
    layer_params = m.layer_params() / p.tp
    emb_params = m.embedding_params() / p.tp
    w_bytes, _, _ = state_bytes_per_param(tr.precision)
    grad_reduce_bytes = 4  # fp32 gradient reduction (Megatron accumulate_allreduce_grads_in_fp32)
    if p.zero_stage == 3 and shard > 1:
        gather = collective_time(net, "all_gather", layer_params * w_bytes, dp_layout)
        scatter = collective_time(net, "reduce_scatter", layer_params * grad_reduce_bytes, dp_layout)
    else:
        gather = scatter = 0.0

    works, mems, param_counts = [], [], []
    for s in range(p.pp):
        op_cost, buckets, stage_params = {}, {}, 0.0
        for c in range(len(layers[s])):
            n = layers[s][c]
            f = _zero3_overlap(fwd, n, gather)
            b = _zero3_overlap(bwd, n, gather + scatter)
            params = n * layer_params
            if s == 0 and c == 0:
                f += embedding_cost(ctx, backward=False)
                b += embedding_cost(ctx, backward=True)
                params += emb_params
            if s == p.pp - 1 and c == len(layers[s]) - 1:
                f += head_cost(ctx, backward=False)
                b += head_cost(ctx, backward=True)
                if not (m.tied_embeddings and p.pp == 1):
                    params += emb_params
            op_cost[("F", c)], op_cost[("B", c)] = f, b
            stage_params += params
            if shard > 1 and p.zero_stage < 3:
                op = "all_reduce" if p.zero_stage == 0 else "reduce_scatter"
                n_buckets = max(1, math.ceil(params / max(BUCKET_PARAMS, 1_000_000 * p.dp)))
                t = collective_time(net, op, params / n_buckets * grad_reduce_bytes, dp_layout)
                buckets[c] = [t] * n_buckets
        local_opt_params = stage_params / (shard if p.zero_stage >= 1 else 1)
        opt_bytes = ADAM_BYTES_PER_PARAM - (2 if tr.precision == "fp32" else 0)
        param_gather = 0.0
        if p.zero_stage in (1, 2) and shard > 1 and not p.overlap_param_gather:
            param_gather = collective_time(net, "all_gather", stage_params * w_bytes, dp_layout)
        works.append(StageWork(
            ops=schedule[s], op_cost=op_cost, grad_buckets=buckets,
            optimizer_time=memory_bound_time(gpu, local_opt_params * opt_bytes),
            param_gather_time=param_gather,
        ))
        mems.append(stage_memory(
            model=m, plan=p, precision=tr.precision, seq_length=tr.seq_length,
            attention_kernel=tr.attention, stage_params=stage_params, max_layer_params=layer_params,
            in_flight_layers=peak_in_flight(schedule[s], layers[s]), is_last_stage=s == p.pp - 1,
        ))
        param_counts.append(stage_params)

    p2p_bytes = ctx.tokens * m.hidden_size * ctx.act_bytes / p.tp  # scatter-gather (SC'21 Sec. 4.1)
    p2p = collective_time(net, "send_recv", p2p_bytes, pp_neighbour_layout(p, gpn)) if p.pp > 1 else 0.0
    sync = _sync_time(sc, net, emb_params, gpn)
    eng = run_iteration(works, num_chunks=vpp, p2p_time=p2p, overlap_grad_reduce=p.overlap_grad_reduce, sync_time=sync)

    tokens = tr.global_batch_size * tr.seq_length
    peak = gpu.peak(ctx.dtype)
    flops = model_flops(m, tr.seq_length, tokens)
    hw_flops = hardware_flops(m, tr.seq_length, tokens, p.recompute)
    world = p.world_size
    stages = tuple(
        StageResult(
            stage=s, layers=tuple(layers[s]), end_time_s=eng.stages[s].end,
            memory=mems[s].as_dict(),
            breakdown={k: eng.stages[s].breakdown.get(k, 0.0) for k in BREAKDOWN_KEYS},
        )
        for s in range(p.pp)
    )
    critical = max(range(p.pp), key=lambda s: (eng.stages[s].end, -s))
    peak_mem = max(mm.total for mm in mems)
    return SimResult(
        scenario=sc.name,
        step_time_s=eng.step_time,
        tokens_per_s=tokens / eng.step_time,
        tflops_per_gpu=flops / eng.step_time / world / 1e12,
        mfu=flops / eng.step_time / world / peak,
        hfu=hw_flops / eng.step_time / world / peak,
        flop_formula=MODEL_FLOPS_FORMULA,
        peak_flops_per_gpu=peak,
        num_microbatches=n_mb,
        peak_memory_bytes=peak_mem,
        memory_capacity_bytes=gpu.hbm_capacity,
        fits=peak_mem <= gpu.hbm_capacity,
        critical_stage=critical,
        breakdown=dict(stages[critical].breakdown),
        stages=stages,
        spans=eng.spans,
    )


def _zero3_overlap(layer: Cost, n_layers: int, comm_per_layer: float) -> Cost:
    """n identical layers; under ZeRO-3 each layer's parameters are all-gathered (and in backward
    its gradients reduce-scattered) on a separate stream, prefetched one layer ahead (FSDP
    forward/backward prefetch): time = comm + (n-1) x max(compute, comm) + compute. The part above
    n x compute is exposed data-parallel communication."""
    total = layer.scaled(n_layers)
    if comm_per_layer <= 0 or n_layers == 0:
        return total
    c = layer.total
    span = comm_per_layer + (n_layers - 1) * max(c, comm_per_layer) + c
    return total.add("dp_comm", span - n_layers * c)


def _sync_time(sc: Scenario, net, emb_params: float, gpn: int) -> float:
    """End-of-iteration syncs every rank waits for: the gradient-norm all-reduce over the
    model-parallel group (Megatron clip_grad_norm_fp32, a few bytes) and, when the embedding is
    tied and pipelined, the all-reduce of its gradient between the first and last stage
    (Megatron _allreduce_word_embedding_grads)."""
    p = sc.plan
    t = collective_time(net, "all_reduce", 4, group_layout(("tp", "pp"), p, gpn))
    if sc.model.tied_embeddings and p.pp > 1:
        pair = pp_neighbour_layout(p, gpn)
        layout = GroupLayout(size=2, ranks_per_node=pair.ranks_per_node, num_nodes=pair.num_nodes)
        t += collective_time(net, "all_reduce", emb_params * 4, layout)
    return t
