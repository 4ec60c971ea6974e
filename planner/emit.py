"""The best plan as configs users can launch: the bundled executor's, Megatron-LM's, torchtitan's.

- `best_plan.yaml`: an executor config = a scenario (model, cluster, training, plan, written out
  in full by paraplan.serialize) plus its `run:` section; `paraplan launch DIR/best_plan.yaml`
  runs it, and `paraplan simulate` reads it too.
- `megatron_args.txt`: Megatron-LM (Megatron-Core) `pretrain_gpt.py` arguments for the same
  model and plan (flag names from megatron/training/arguments.py).
- `torchtitan.toml`: the [training], [parallelism] and [activation_checkpoint] sections of a
  torchtitan job config (field names from torchtitan/config/job_config.py); the model itself is
  chosen there by name and flavour, which paraplan cannot know, so they are left to fill in.
"""
from __future__ import annotations

import dataclasses
import shlex

import yaml

from paraplan.serialize import scenario_to_mapping
from paraplan.specs import Scenario
from planner.objective import GiB, Evaluation


def launch_command(config_path: str) -> str:
    return f"paraplan launch {shlex.quote(config_path)}"


def executor_config_yaml(sc: Scenario, ev: Evaluation, *, launch: str, header: str = "") -> str:
    """The executor config of `sc` (its plan already the chosen one), with comments on top."""
    comments = [
        f"Executor config written by `paraplan plan` for {sc.name}.",
        f"Predicted by the simulator: step {ev.step_time_s:.3f} s, {ev.tokens_per_s:,.0f} tokens/s, "
        f"MFU {ev.mfu * 100:.1f}%, peak memory {ev.peak_memory_bytes / GiB:.1f} of "
        f"{ev.memory_capacity_bytes / GiB:.1f} GiB per GPU.",
        f"Launch: {launch}",
    ]
    if header:
        comments.append(header)
    body = yaml.safe_dump(scenario_to_mapping(sc), sort_keys=False, default_flow_style=False)
    return "".join(f"# {c}\n" for c in comments) + body


def megatron_args(sc: Scenario) -> list[str]:
    """pretrain_gpt.py arguments for the model, batch and plan of `sc` (data, tokenizer,
    learning rate and checkpointing are left to the user)."""
    m, t, p = sc.model, sc.training, sc.plan
    a = [
        "--tensor-model-parallel-size", str(p.tp),
        "--pipeline-model-parallel-size", str(p.pp),
        "--context-parallel-size", str(p.cp),
    ]
    if p.virtual_pipeline_stages > 1:
        layers = m.num_layers // (p.pp * p.virtual_pipeline_stages)
        a += ["--num-layers-per-virtual-pipeline-stage", str(layers)]
    if p.first_stage_layers is not None:
        a += ["--decoder-first-pipeline-num-layers", str(p.first_stage_layers)]
    if p.last_stage_layers is not None:
        a += ["--decoder-last-pipeline-num-layers", str(p.last_stage_layers)]
    if p.sequence_parallel and p.tp > 1:
        a.append("--sequence-parallel")
    # ZeRO: 1 = the distributed optimizer; 2 and 3 = Megatron-FSDP sharding strategies
    if p.zero_stage >= 1:
        a.append("--use-distributed-optimizer")
    if p.zero_stage == 2:
        a += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads"]
    if p.zero_stage == 3:
        a += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]
    if p.recompute == "selective":
        a += ["--recompute-granularity", "selective"]
        if p.recompute_modules != ("core_attn",):
            a += ["--recompute-modules", *p.recompute_modules]
    elif p.recompute == "full":
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    if p.overlap_grad_reduce:
        a.append("--overlap-grad-reduce")
    if p.overlap_param_gather:
        a.append("--overlap-param-gather")
    if p.tp_comm_overlap:
        a.append("--tp-comm-overlap")
    a += [
        "--micro-batch-size", str(p.micro_batch_size),
        "--global-batch-size", str(t.global_batch_size),
        "--seq-length", str(t.seq_length),
        "--max-position-embeddings", str(t.seq_length),
        "--num-layers", str(m.num_layers),
        "--hidden-size", str(m.hidden_size),
        "--ffn-hidden-size", str(m.ffn_hidden_size),
        "--num-attention-heads", str(m.num_attention_heads),
        "--kv-channels", str(m.head_dim),
    ]
    if m.num_kv_heads != m.num_attention_heads:
        a += ["--group-query-attention", "--num-query-groups", str(m.num_kv_heads)]
    if m.activation == "swiglu":
        a.append("--swiglu")
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    if m.moe is not None:
        e = m.moe
        a += ["--num-experts", str(e.num_experts), "--moe-router-topk", str(e.top_k),
              "--moe-ffn-hidden-size", str(e.expert_ffn_hidden_size),
              "--expert-model-parallel-size", str(p.ep), "--expert-tensor-parallel-size", str(p.expert_tp)]
        if e.num_shared_experts:
            a += ["--moe-shared-expert-intermediate-size", str(e.num_shared_experts * e.expert_ffn_hidden_size)]
        if e.capacity_factor is not None:
            a += ["--moe-expert-capacity-factor", str(e.capacity_factor)]
        if e.first_dense_layers or e.moe_layer_freq > 1:
            pattern = [1 if m.is_moe_layer(i) else 0 for i in range(m.num_layers)]
            a += ["--moe-layer-freq", "([" + ",".join(map(str, pattern)) + "])"]
    if t.precision in ("bf16", "fp16"):
        a.append(f"--{t.precision}")
    elif t.precision == "fp8":
        a += ["--bf16", "--fp8-format", "hybrid"]
    a += ["--attention-backend", "flash" if t.attention == "flash" else "unfused"]
    return a


def megatron_args_text(sc: Scenario) -> str:
    args = megatron_args(sc)
    lines, i = [], 0
    while i < len(args):
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            lines.append(f"{args[i]} {shlex.quote(args[i + 1])}")
            i += 2
        else:
            lines.append(args[i])
            i += 1
    world = sc.cluster.world_size
    head = (f"# Megatron-LM pretrain_gpt.py arguments for {sc.name} on {world} GPUs "
            f"({sc.cluster.shape}); add data, tokenizer, optimizer.\n"
            f"# torchrun --nnodes {sc.cluster.num_nodes} --nproc-per-node {sc.cluster.gpus_per_node} "
            f"pretrain_gpt.py $(grep -v '^#' megatron_args.txt)\n")
    if sc.plan.schedule == "gpipe" and sc.plan.pp > 1:
        head += "# Note: Megatron-LM has no GPipe schedule; it runs 1F1B (same bubble, less activation memory).\n"
    if sc.plan.schedule == "zero-bubble" and sc.plan.pp > 1:
        head += ("# Note: Megatron-LM has no zero-bubble schedule; these arguments run (interleaved) 1F1B, which "
                 "keeps the weight gradients in the backward (a larger bubble than predicted): simulate the plan with "
                 "--set plan.schedule=1f1b for its step time, or launch it with paraplan launch / torchtitan.\n")
    return head + " \\\n".join(lines) + "\n"


def torchtitan_toml(sc: Scenario) -> str:
    """A torchtitan job config for the plan: FSDP2 shards over dp x cp for ZeRO 2-3 (ZeRO-2 as
    reshard_after_forward = never); ZeRO 0-1 replicate (torchtitan has no sharded-optimizer-only
    mode: with tp or pp > 1 it still needs FSDP, so that case is written as FSDP and flagged)."""
    m, t, p = sc.model, sc.training, sc.plan
    notes = []
    if p.zero_stage >= 2 or p.tp > 1 or p.pp > 1 or p.cp > 1:
        replicate, shard = 1, p.dp
        if p.zero_stage < 2:
            notes.append(f"the plan uses ZeRO-{p.zero_stage}; torchtitan composes TP/PP/CP with FSDP only, "
                         f"so this config shards weights too (more all-gathers than simulated)")
    else:
        replicate, shard = p.dp, 1
    schedule = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
                "zero-bubble": "InterleavedZeroBubble"}[p.schedule]
    local_batch = t.global_batch_size // p.dp if p.pp > 1 else p.micro_batch_size
    if not p.sequence_parallel and p.tp > 1:
        notes.append("torchtitan always shards activations along the sequence under TP (sequence parallel)")
    if p.recomputed_modules not in ((), ("core_attn",)):
        notes.append(f"the plan recomputes {', '.join(p.recompute_modules)}; torchtitan's selective "
                     "checkpointing chooses by op, not by module, so its memory and recompute time differ")
    lines = [
        f"# torchtitan job config for {sc.name}: {p.tp * p.pp * p.cp * p.dp} GPUs "
        f"({sc.cluster.shape}), written by `paraplan plan`.",
        f"# Model: {m.name} ({m.num_layers} layers, hidden {m.hidden_size}); set [model] name/flavor to it.",
        *[f"# Note: {n}" for n in notes],
        "",
        "[model]",
        f'name = "{"llama3" if m.activation == "swiglu" else "CHANGE-ME"}"',
        'flavor = "CHANGE-ME"',
        "",
        "[training]",
        f"local_batch_size = {local_batch}",
        f"global_batch_size = {t.global_batch_size}",
        f"seq_len = {t.seq_length}",
        f'mixed_precision_param = "{"float32" if t.precision == "fp32" else "bfloat16"}"',
        "",
        "[parallelism]",
        f"data_parallel_replicate_degree = {replicate}",
        f"data_parallel_shard_degree = {shard}",
        f'fsdp_reshard_after_forward = "{"never" if p.zero_stage == 2 else "default"}"',
        f"tensor_parallel_degree = {p.tp}",
        f"pipeline_parallel_degree = {p.pp}",
        f'pipeline_parallel_schedule = "{schedule}"',
        f"pipeline_parallel_microbatch_size = {p.micro_batch_size}",
    ]
    if p.pp > 1:
        lines += _torchtitan_stage_split(sc)
    lines += [
        f"context_parallel_degree = {p.cp}",
        f"expert_parallel_degree = {p.ep}",
        "",
        "[activation_checkpoint]",
        f'mode = "{p.recompute}"',
    ]
    if p.recompute == "selective":
        lines.append('selective_ac_option = "op"')
    return "\n".join(lines) + "\n"


def _torchtitan_stage_split(sc: Scenario) -> list[str]:
    """The plan's layers per virtual stage in torchtitan's terms: it makes
    ceil((layers + first_less + last_less) / layers_per_stage) virtual stages and gives the first
    and last `*_less_layers` fewer layers (torchtitan pipeline_llm / generate_llm_fqn_per_model_part;
    both default to 1, so an even split must say 0). The counts are the simulated ones
    (simulator.layout.layers_per_chunk)."""
    from simulator.layout import layers_per_chunk

    p = sc.plan
    layers = layers_per_chunk(sc.model.num_layers, p.pp, p.virtual_pipeline_stages,
                              p.first_stage_layers, p.last_stage_layers)
    by_vstage = [layers[g % p.pp][g // p.pp] for g in range(p.pp * p.virtual_pipeline_stages)]
    first, last = by_vstage[0], by_vstage[-1]
    middle = max(by_vstage[1:-1], default=max(first, last))
    if first > middle or last > middle:
        return ["# pipeline split: torchtitan cannot give the first or last stage more layers than the others "
                f"({by_vstage}); set module_fqns_per_model_part by hand"]
    return [f"pipeline_parallel_layers_per_stage = {middle}",
            f"pipeline_parallel_first_stage_less_layers = {middle - first}",
            f"pipeline_parallel_last_stage_less_layers = {middle - last}"]


def best_scenario(base: Scenario, ev: Evaluation) -> Scenario:
    """The base scenario with the chosen cluster size and plan, and no search section."""
    cluster = dataclasses.replace(base.cluster, num_nodes=ev.candidate.num_nodes)
    return dataclasses.replace(base, cluster=cluster, plan=ev.candidate.plan, search=())
