"""What the executor runs, decided before any process starts (no torch import here).

- `SCHEDULES`: every pipeline schedule the executor can run, how its stages sit on the ranks, and
  what it needs.
- `scaled_model`: the scaled-down copy of a model that `run.num_layers` / `run.hidden_size` ask for.
- `executor_problems`: the plans the executor refuses, each with its reason, beyond the simulator's
  structural checks (`simulator.feasibility.structural_problems`, run by the launcher).
- `effective_zero_stage` / `notes`: where the executor runs a plan differently from how it is
  written (always said in the measurement, never silent).
- `scenario_to_json` / `scenario_from_json`: how a scenario travels to the worker processes.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import accumulate

from paraplan.cli.torch_check import torch_version
from paraplan.errors import ConfigError
from paraplan.specs import (
    ClusterSpec, InterNodeSpec, LinkSpec, MLASpec, ModelSpec, MoESpec, PlanSpec, RoutingSpec, RunSpec, Scenario,
    TrainingSpec,
)
from simulator.layout import layers_per_virtual_stage
from simulator.schedules import holder, v_shaped, virtual_stage

OPTIMIZERS = ("adam", "adamw", "sgd")
"""What training.optimizer may name (executor.optim builds each)."""


@dataclass(frozen=True, kw_only=True)
class ScheduleInfo:
    """One pipeline schedule of `torch.distributed.pipelining`."""

    torch_class: str
    """Class name in torch.distributed.pipelining."""
    style: str
    """Stage-to-rank mapping: "loop" (stage s on pp rank s % pp) or "v" (rank r holds stages r and 2pp-1-r)."""
    stages_per_rank: tuple[int, int]
    """Allowed virtual_pipeline_stages (min, max); max 0 = no upper bound."""
    min_microbatches_per_pp: int
    """The schedule needs at least this many x pp microbatches (0: no minimum)."""
    splits_weight_grad: bool
    """Runs the weight gradient separately from the input gradient (zero-bubble family)."""


# Names as PlanSpec.schedule spells them: paraplan.specs.SCHEDULES, the ones the simulator models
# and a scenario may name (dualpipev, V-shaped like zbv, runs its overlapped forward/backward pairs
# one after the other here: PyTorch's OVERLAP_F_B without an overlap function).
# Minimum microbatch counts are those the torch classes raise ValueError for (1F1B: n >= pp,
# DualPipeV: n >= 2 pp); the Megatron rule for interleaved 1F1B (n a multiple of pp) is the
# simulator's structural check.
SCHEDULES = {
    "gpipe": ScheduleInfo(torch_class="ScheduleGPipe", style="loop", stages_per_rank=(1, 1),
                          min_microbatches_per_pp=0, splits_weight_grad=False),
    "1f1b": ScheduleInfo(torch_class="Schedule1F1B", style="loop", stages_per_rank=(1, 1),
                         min_microbatches_per_pp=1, splits_weight_grad=False),
    "interleaved-1f1b": ScheduleInfo(torch_class="ScheduleInterleaved1F1B", style="loop", stages_per_rank=(2, 0),
                                     min_microbatches_per_pp=1, splits_weight_grad=False),
    "zero-bubble": ScheduleInfo(torch_class="ScheduleInterleavedZeroBubble", style="loop", stages_per_rank=(1, 0),
                                min_microbatches_per_pp=1, splits_weight_grad=True),
    "zbv": ScheduleInfo(torch_class="ScheduleZBVZeroBubble", style="v", stages_per_rank=(2, 2),
                        min_microbatches_per_pp=0, splits_weight_grad=True),
    "dualpipev": ScheduleInfo(torch_class="ScheduleDualPipeV", style="v", stages_per_rank=(2, 2),
                              min_microbatches_per_pp=2, splits_weight_grad=True),
}

PRECISIONS_RUN = ("fp32", "bf16")
"""Training precisions the executor runs (bf16 as autocast / FSDP mixed precision on GPU)."""


# ----------------------------------------------------------------------------------------------
# Scale-down


def scaled_model(model: ModelSpec, run: RunSpec) -> ModelSpec:
    """The model `run.num_layers` / `run.hidden_size` ask for, or `model` itself.

    hidden_size scales the widths by r = new/old: head_dim stays, so attention heads, kv heads,
    ffn_hidden_size and expert_ffn_hidden_size scale by r. Heads and kv heads must come out whole
    (the GQA ratio is kept); ffn widths are rounded to a multiple of 8. Vocabulary, MoE expert count
    and top-k stay. num_layers replaces the layer count; MoE first_dense_layers is capped by it.
    """
    out = model
    if run.hidden_size is not None and run.hidden_size != model.hidden_size:
        h0, h1 = model.hidden_size, run.hidden_size
        heads = model.num_attention_heads * h1 / h0
        if heads != int(heads) or heads < 1:
            raise ConfigError("run.hidden_size", f"{h1} gives {heads:g} attention heads: heads scale with the hidden size "
                                                 f"(model: {model.num_attention_heads} heads at hidden {h0}, one per "
                                                 f"{h0 / model.num_attention_heads:g}; head_dim {model.head_dim} kept); "
                                                 f"use a multiple of {h0 // _gcd(h0, model.num_attention_heads)}")
        heads = int(heads)
        kv = model.num_kv_heads * heads / model.num_attention_heads
        if kv != int(kv) or kv < 1:
            raise ConfigError("run.hidden_size", f"{h1} gives {heads} heads but {kv:g} kv heads (GQA ratio "
                                                 f"{model.num_attention_heads}:{model.num_kv_heads} kept)")
        moe = model.moe
        if moe is not None:
            moe = dataclasses.replace(moe, expert_ffn_hidden_size=_scale_width(moe.expert_ffn_hidden_size, h1 / h0))
        out = dataclasses.replace(
            out, hidden_size=h1, num_attention_heads=heads, num_kv_heads=int(kv),
            ffn_hidden_size=_scale_width(model.ffn_hidden_size, h1 / h0), moe=moe)
    if run.num_layers is not None and run.num_layers != model.num_layers:
        moe = out.moe
        if moe is not None and moe.first_dense_layers > run.num_layers:
            moe = dataclasses.replace(moe, first_dense_layers=run.num_layers)
        out = dataclasses.replace(out, num_layers=run.num_layers, moe=moe)
    if out is not model:
        out = dataclasses.replace(out, name=f"{model.name} scaled to {out.num_layers} layers, hidden {out.hidden_size}")
    return out


def _scale_width(width: int, ratio: float) -> int:
    return max(8, int(round(width * ratio / 8)) * 8)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def scaled_scenario(sc: Scenario) -> Scenario:
    """The scenario with its model scaled down as its run section asks."""
    model = scaled_model(sc.model, sc.run)
    return sc if model is sc.model else dataclasses.replace(sc, model=model)


# ----------------------------------------------------------------------------------------------
# What the executor refuses, and what it runs differently


def launch_problems(sc: Scenario) -> list[str]:
    """Every reason `paraplan launch` refuses this (already scaled) plan: the simulator's structural
    checks, then the executor's own, a key the simulator already refused said once."""
    from simulator.feasibility import structural_problems

    problems = structural_problems(sc)
    flagged = {r.split(":", 1)[0] for r in problems}
    return problems + [r for r in executor_problems(sc) if r.split(":", 1)[0] not in flagged]


def executor_problems(sc: Scenario) -> list[str]:
    """Reasons the executor refuses this (already scaled) plan beyond the simulator's structural
    checks (launch_problems gives both), each naming the key at fault: the plans PyTorch 2.11-2.13's
    pipelining and DTensor APIs cannot run correctly, and the features this executor does not
    implement; every other plan the simulator accepts runs.
    """
    m, p, t, r = sc.model, sc.plan, sc.training, sc.run
    out: list[str] = []
    if m.mla is not None:
        out.append("model.mla: the executor implements multi-head and grouped-query attention, not multi-head "
                   "latent attention")
    if m.mtp_layers:
        out.append("model.mtp_layers: the executor has no multi-token prediction modules; set 0")
    if p.cp > 1 and p.cp_comm_type == "a2a+p2p":
        out.append("plan.cp_comm_type: the executor has no hierarchical context parallelism (a2a+p2p); it runs "
                   "all_gather and a2a (and p2p as its all-gather)")
    if m.mla is None and m.head_dim % 2:
        # rotary embeddings turn pairs of channels (RoFormer, Su et al. 2021, eq. 34)
        out.append(f"model.head_dim: the executor's rotary position embedding needs an even head_dim, got {m.head_dim}")
    info = SCHEDULES.get(p.schedule)
    if info is None:
        out.append(f"plan.schedule: {p.schedule!r} is not one of {', '.join(SCHEDULES)}")
    elif p.pp > 1:
        lo, hi = info.stages_per_rank
        v = p.virtual_pipeline_stages
        if v < lo or (hi and v > hi):
            want = f"exactly {lo}" if lo == hi else f"at least {lo}"
            out.append(f"plan.virtual_pipeline_stages: schedule {p.schedule} needs {want} stages per rank, got {v}")
        else:
            try:
                layers, last = stage_layers(sc), num_stages(sc) - 1
            except ValueError:  # a split that drops layers: simulator.feasibility names it
                layers, last = None, 0
            empty = [] if layers is None else [
                r for r in range(p.pp) if all(not layers[s] and s not in (0, last) for s in stages_of_rank(r, sc))]
            if empty:  # its optimizer would get no parameters (torch refuses an empty parameter list)
                out.append(f"plan.first_stage_layers / plan.last_stage_layers: pipeline rank"
                           f"{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} would hold no layer, "
                           "embedding or head, which the executor cannot train; give the middle stages at least one "
                           "layer each")
        if info.min_microbatches_per_pp and p.dp * p.micro_batch_size and \
                t.global_batch_size % (p.dp * p.micro_batch_size) == 0:
            n, need = sc.num_microbatches, info.min_microbatches_per_pp * p.pp
            if n < need:
                out.append(f"plan.schedule: {p.schedule} needs at least {need} microbatches per pipeline, "
                           f"got {n} (global_batch_size / (dp x micro_batch_size))")
            rounds = max(1, n // p.pp)
            if p.schedule in ("interleaved-1f1b", "zero-bubble") and n % rounds:
                # torch's looped schedules run the microbatches in rounds of about pp
                out.append(f"plan.schedule: {p.schedule} needs the {n} microbatches to be a multiple of "
                           f"{rounds} rounds (microbatches // pp)")
    if t.precision not in PRECISIONS_RUN:
        out.append(f"training.precision: the executor trains in {' or '.join(PRECISIONS_RUN)}, not {t.precision} "
                   f"({'no loss scaling' if t.precision == 'fp16' else 'no fp8 GEMMs (Transformer Engine)'}); "
                   f"use --set training.precision=bf16")
    if t.optimizer not in OPTIMIZERS:
        out.append(f"training.optimizer: {t.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if p.expert_tp != 1:
        out.append("plan.expert_tp: tensor parallelism inside experts is not implemented by the executor; use expert_tp: 1")
    unsupported = [mod for mod in p.recomputed_modules if mod in ("layernorm", "moe_act")]
    if unsupported:
        # Megatron-Core frees these outputs and rebuilds them before the backward
        # (CheckpointWithoutOutput); torch.utils.checkpoint around the op alone would keep them
        # alive in the next GEMM's saved input, saving no memory.
        out.append(f"plan.recompute_modules: the executor does not recompute {', '.join(unsupported)} (it needs "
                   "checkpointing without the output, as Megatron-Core does); it runs core_attn, mlp, moe, shared_experts")
    if p.tp_comm_overlap:
        out.append("plan.tp_comm_overlap: the executor does not overlap TP communication with GEMMs (no "
                   "Transformer Engine userbuffers), so its step time would not measure this plan; use tp_comm_overlap: false")
    if p.moe_dispatcher != "alltoall" and m.moe is not None and p.ep > 1:
        out.append(f"plan.moe_dispatcher: the executor dispatches tokens with torch's all-to-all, not {p.moe_dispatcher}'s "
                   "kernels, so its step time would not measure this plan; use moe_dispatcher: alltoall")
    if p.moe_shared_expert_overlap:
        out.append("plan.moe_shared_expert_overlap: the executor runs the shared experts after the combine, not beside "
                   "the dispatch, so its step time would not measure this plan; use moe_shared_expert_overlap: false")
    if p.overlap_moe_expert_parallel_comm:
        out.append("plan.overlap_moe_expert_parallel_comm: the executor runs each forward and backward whole, one "
                   "after the other, not merged layer by layer on two streams (combined 1F1B), so its step time would "
                   "not measure this plan; use overlap_moe_expert_parallel_comm: false")
    if p.cp > 1 and (t.seq_length // p.cp) % 2:
        out.append(f"plan.cp: seq_length / cp = {t.seq_length // p.cp} must be even (two load-balanced chunks per rank)")
    if r.steps < 1:
        out.append("run.steps: needs at least 1 measured step")
    torch_found = torch_version()  # None: not installed, which the launch itself then says
    if info is not None and info.style == "v" and p.pp > 1 and r.backend == "gloo" \
            and torch_found is not None and torch_found < (2, 13):
        # PyTorch before 2.13 exchanges a first message between neighbouring stages, which a V
        # placement puts on one rank: gloo cannot send to itself ("Pair is not connected")
        out.append(f"plan.schedule: {p.schedule} on gloo needs PyTorch >= 2.13 (earlier releases send "
                   "between a rank's own two stages at start-up)")
    return out


def num_stages(sc: Scenario) -> int:
    return sc.plan.pp * (sc.plan.virtual_pipeline_stages if sc.plan.pp > 1 else 1)


def stages_of_rank(pp_rank: int, sc: Scenario) -> list[int]:
    """The pipeline stages (virtual stages, in the simulator's words) this pipeline rank holds, in a
    loop or in a V: the simulator's placement (simulator.schedules.virtual_stage)."""
    p = sc.plan
    if p.pp == 1:
        return [0]
    return [virtual_stage(pp_rank, c, p.pp, v_shaped(sc.plan)) for c in range(p.virtual_pipeline_stages)]


def stage_rank(stage: int, sc: Scenario) -> int:
    return holder(stage, sc.plan.pp, v_shaped(sc.plan))[0]


def stage_layers(sc: Scenario) -> list[range]:
    """Layers of each pipeline stage (in stage order), honouring first/last_stage_layers: the
    simulator's split (simulator.layout.layers_per_virtual_stage)."""
    p = sc.plan
    counts = layers_per_virtual_stage(sc.model.num_layers, p.pp, num_stages(sc) // p.pp, p.first_stage_layers,
                                      p.last_stage_layers)
    starts = [0, *accumulate(counts)]
    return [range(a, b) for a, b in zip(starts, starts[1:])]


def effective_zero_stage(plan: PlanSpec) -> int:
    """ZeRO stage the executor runs: 2 instead of 3 under a zero-bubble schedule.

    PyTorch 2.13's FSDP2 with reshard_after_forward=True (ZeRO-3) computes wrong weight gradients
    on some stages under ScheduleInterleavedZeroBubble / ScheduleZBVZeroBubble / ScheduleDualPipeV
    (split input/weight backward); ZeRO-2 (parameters kept unsharded between forward and backward)
    is correct with every schedule.
    """
    if plan.zero_stage == 3 and plan.pp > 1 and SCHEDULES[plan.schedule].splits_weight_grad:
        return 2
    return plan.zero_stage


def notes(sc: Scenario, *, on_gpu: bool) -> list[str]:
    """Where this run differs from the plan as written: printed and kept in the measurement.

    on_gpu: bf16 mixed precision runs (a GPU, or a CPU test of that code path)."""
    p, out = sc.plan, []
    if effective_zero_stage(p) != p.zero_stage:
        out.append(f"zero_stage 3 runs as ZeRO-2 under schedule {p.schedule}: FSDP2 resharding after forward "
                   "gives wrong weight gradients with split-backward schedules in PyTorch 2.13")
    if sc.training.precision == "bf16" and not on_gpu:
        out.append("training.precision bf16 runs in fp32 on CPU (bf16 mixed precision is for GPUs; paraplan validate "
                   "runs it in bf16, as it is simulated)"
                   + ("; gradients are reduced in fp32 too" if sc.training.grad_reduce_dtype == "bf16" else ""))
    elif sc.training.grad_reduce_dtype == "bf16" and p.dp * p.cp > 1:
        out.append("training.grad_reduce_dtype bf16: gradients are reduced in bf16 but accumulated and held in fp32 "
                   "(DDP's .grad, FSDP2's sharded gradient), where the simulator holds them in bf16")
    zero = effective_zero_stage(p)
    if p.zero_stage and p.dp * p.cp == 1:
        out.append(f"zero_stage {p.zero_stage} has nothing to shard with dp x cp = 1")
    elif zero == 1:
        # executor.optim.ShardedOptimizer steps on full gradients (DDP's or replicate's all-reduce)
        out.append("zero_stage 1: the executor all-reduces the gradients and keeps its shard, twice the bytes of the "
                   "reduce-scatter the simulator prices (Megatron's distributed optimizer)")
    elif zero >= 2 and p.pp > 1:
        # torch.distributed.pipelining's PipelineStage.backward_maybe_with_nosync turns FSDP2's
        # gradient sync (and resharding after backward) off for all but the last microbatch
        out.append(f"zero_stage {zero} under a pipeline: PyTorch's pipeline stages reduce-scatter the gradients once, "
                   "after the last microbatch's backward, and hold them whole until then, where the simulator "
                   "reduces each microbatch's as its backward makes them")
    if p.tp > 1 and p.tp_backward_overlap and not p.tp_comm_overlap:
        out.append("plan.tp_backward_overlap: the executor's tensor-parallel backward (DTensor) reduces each input "
                   "gradient after its layer's weight gradient, not beside it")
    if sc.model.dropout:
        out.append(f"model.dropout {sc.model.dropout:g}: the executor trains without dropout")
    if sc.model.qk_layernorm:
        out.append("model.qk_layernorm: the executor's attention has no query/key norm")
    if sc.model.linear_bias:
        out.append("model.linear_bias: the executor's linear layers have no biases; model.linear_bias: false "
                   "predicts it")
    if p.cp > 1 and p.cp_comm_type == "p2p":
        # executor.model._cp_gather_kv: one masked attention call, the gathered K/V kept for the backward
        out.append("plan.cp_comm_type p2p: the executor all-gathers the keys and values over the context-parallel "
                   "group instead of passing them round a ring; plan.cp_comm_type: all_gather is the closer "
                   "prediction (the executor keeps the gathered K/V for the backward instead of gathering them "
                   "again, and runs one masked attention call instead of two)")
    if p.p2p_scatter_gather and p.tp > 1 and p.pp > 1 and not p.sequence_parallel:
        out.append("plan.p2p_scatter_gather: the executor's pipeline stages send whole activations, not 1/tp slices")
    if p.pp > 1 and p.blocking_sends == "forward":
        # torch.distributed.pipelining's _PipelineScheduleRuntime keeps its send works and waits for them
        # at the end of the step
        out.append("plan.wait_forward_sends: the executor's PyTorch interleaved schedule waits for its forward sends "
                   "at the end of the step, not before the next op; plan.wait_forward_sends: false predicts it")
    if not p.overlap_grad_reduce and p.dp * p.cp > 1:
        out.append("plan.overlap_grad_reduce false: DDP / FSDP2 always overlap the gradient reduction with backward")
    if p.overlap_param_gather and effective_zero_stage(p) == 1 and p.dp * p.cp > 1:
        out.append("plan.overlap_param_gather: the ZeRO-1 parameter gather after the optimizer step is not overlapped")
    if sc.model.moe is not None and sc.model.moe.routing.distribution != "uniform":
        out.append("model.moe.routing is the simulator's routing assumption; the executor's router is learned "
                   "(its measured tokens per expert are in the measurement)")
    return out


# ----------------------------------------------------------------------------------------------
# Scenario <-> JSON (how a plan travels to the worker processes)


_NESTED = {
    (Scenario, "model"): ModelSpec, (Scenario, "cluster"): ClusterSpec, (Scenario, "training"): TrainingSpec,
    (Scenario, "plan"): PlanSpec, (Scenario, "run"): RunSpec, (ModelSpec, "moe"): MoESpec, (ModelSpec, "mla"): MLASpec,
    (MoESpec, "routing"): RoutingSpec, (ClusterSpec, "intra_node"): LinkSpec,
    (ClusterSpec, "inter_node"): InterNodeSpec,
}


def scenario_to_json(sc: Scenario) -> dict:
    """A JSON-able mapping of the scenario (the planner's opaque search section is left out)."""
    return _to_json(dataclasses.replace(sc, search=()))


def _to_json(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_json(v) for v in obj]
    return obj


def scenario_from_json(raw: dict) -> Scenario:
    return _from_json(Scenario, raw)


def _from_json(cls, raw: dict):
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        value = raw[f.name]
        nested = _NESTED.get((cls, f.name))
        if nested is not None and value is not None:
            value = _from_json(nested, value)
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)
