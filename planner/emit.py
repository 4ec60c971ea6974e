"""The best plan as configs users can launch: the bundled executor's, Megatron-LM's, torchtitan's.

- `best_plan.yaml`: an executor config = a scenario (model, cluster, training, plan, written out
  in full by paraplan.serialize) plus its `run:` section; `paraplan launch DIR/best_plan.yaml`
  runs it, and `paraplan simulate` reads it too.
- `megatron_args.txt`: Megatron-LM (Megatron-Core) `pretrain_gpt.py` arguments for the same
  model and plan (flag names from megatron/training/arguments.py), one flag and its value a line,
  under comment lines with the launch command (which feeds the lines to torchrun through xargs)
  and notes on what Megatron-LM runs differently from the simulation.
- `torchtitan.toml`: the [model], [training], [parallelism] and [activation_checkpoint] sections
  of a torchtitan job config (field names from torchtitan/config/job_config.py); the model itself
  is chosen there by name and flavour: filled in where a torchtitan flavour builds exactly the
  model (planner.model_families), otherwise left to fill in, with the architecture to match.

The architecture beyond the model schema (normalization, position embedding, biases, QK norm, the
router) comes from the model's preset family (planner.model_families); a model of no known family
gets a comment line naming the flags the user must set.
"""
from __future__ import annotations

import dataclasses
import itertools
import shlex

import yaml

from paraplan.placement import cp_split
from paraplan.serialize import scenario_to_mapping
from paraplan.specs import Scenario
from planner.model_families import (
    family_of, megatron_architecture_args, megatron_architecture_comments, torchtitan_model,
)
from planner.objective import GiB, Evaluation
from simulator import layout


def comment(text: str) -> str:
    """`text` as comment lines ("# " before each of its lines): a scenario name or a path with a line
    break in it must not end the comment and leave the rest as YAML, TOML or a Megatron argument."""
    return "\n".join(f"# {line}" for line in (str(text).splitlines() or [""]))


def launch_command(config_path: str, num_nodes: int = 1) -> str:
    """The `paraplan launch` line for the config; on several nodes, the line each node runs with its
    own NODE_RANK and node 0's address (as megatron_launch_command: `paraplan launch` alone starts
    every rank on the one node it runs on)."""
    line = f"paraplan launch {shlex.quote(config_path)}"
    if num_nodes > 1:
        line += f' --nnodes {num_nodes} --node-rank "$NODE_RANK" --rdzv-endpoint "$MASTER_ADDR:29500"'
    return line


def executor_config_yaml(sc: Scenario, ev: Evaluation, *, launch: str, header: str = "") -> str:
    """The executor config of `sc` (its plan already the chosen one), with comments on top."""
    comments = [
        f"Executor config written by `paraplan plan` for {sc.name}.",
        f"Predicted by the simulator: step {ev.step_time_s:.4g} s, {ev.tokens_per_s:,.0f} tokens/s, "
        f"MFU {ev.mfu * 100:.1f}%, peak memory {ev.peak_memory_bytes / GiB:.1f} of "
        f"{ev.memory_capacity_bytes / GiB:.1f} GiB per GPU.",
        f"Launch: {launch}",
    ]
    if header:
        comments.append(header)
    body = yaml.safe_dump(scenario_to_mapping(sc), sort_keys=False, default_flow_style=False)
    return "".join(comment(c) + "\n" for c in comments) + body


def layers_per_virtual_stage(sc: Scenario) -> list[int]:
    """Transformer layers of each virtual stage, in virtual-stage order (g = chunk x pp + stage,
    Megatron's interleaved order): the simulated split (simulator.layout)."""
    p = sc.plan
    return layout.layers_per_virtual_stage(sc.model.num_layers, p.pp, p.virtual_pipeline_stages,
                                           p.first_stage_layers, p.last_stage_layers)


def megatron_args(sc: Scenario) -> list[str]:
    """pretrain_gpt.py arguments for the model, batch and plan of `sc` (data, tokenizer,
    learning rate and checkpoint paths are left to the user)."""
    p = sc.plan
    a = [
        "--tensor-model-parallel-size", str(p.tp),
        "--pipeline-model-parallel-size", str(p.pp),
        "--context-parallel-size", str(p.cp),
    ]
    if p.cp > 1:
        # TransformerConfig.cp_comm_type, passed to Transformer Engine as written: TE's spellings
        # (p2p, all_gather, a2a, a2a+p2p), though arguments.py's help says "allgather"
        a += ["--cp-comm-type", p.cp_comm_type]
        if p.cp_comm_type == "a2a+p2p":  # [a2a group, p2p group] (ModelParallelConfig.hierarchical_context_parallel_sizes)
            a += ["--hierarchical-context-parallel-sizes",
                  *map(str, cp_split(p, sc.model, sc.cluster.gpus_per_node))]
    a += _megatron_pipeline_split(sc)
    if p.sequence_parallel and p.tp > 1:
        a.append("--sequence-parallel")
    a += _megatron_data_parallel(p)
    a += _megatron_recompute(sc)
    if p.overlap_grad_reduce:
        a.append("--overlap-grad-reduce")
    if p.overlap_param_gather:
        a.append("--overlap-param-gather")
    if p.tp_comm_overlap:
        a.append("--tp-comm-overlap")
    if not p.fused_grad_accumulation and p.zero_stage < 2:  # Megatron-FSDP's flags carry it already
        a.append("--no-gradient-accumulation-fusion")
    a += _megatron_model(sc)
    a += _megatron_moe(sc)
    a += _megatron_precision(sc.training.precision, sc.training.grad_reduce_dtype)
    a += ["--attention-backend", _megatron_attention_backend(sc)]
    return a


def _megatron_attention_backend(sc: Scenario) -> str:
    """flash3: Transformer Engine's cuDNN fused attention, its Hopper kernel of that class. Latent
    attention's query/key heads are wider than its value heads (192 vs 128 in DeepSeek-V3), which
    Transformer Engine's FlashAttention refuses ("does not support MLA", get_attention_backend), so
    an MLA model gets the fused backend for flash too."""
    if sc.training.precision == "fp32":  # Transformer Engine's flash and fused kernels take fp16/bf16/fp8 only
        return "unfused"
    if sc.training.attention == "flash" and sc.model.mla is not None:
        return "fused"
    return {"flash": "flash", "flash3": "fused", "unfused": "unfused"}[sc.training.attention]


def _megatron_pipeline_split(sc: Scenario) -> list[str]:
    """The simulated layers per virtual stage in Megatron-Core's terms (megatron/training/arguments.py,
    megatron/core/transformer/transformer_config.py):
    - one virtual stage per rank: --decoder-first/last-pipeline-num-layers, which count a pipeline
      rank's layers; they must be > 0 (transformer_config.py: "num_layers_in_first_pipeline_stage
      must be larger than 0"), so a stage holding only the embedding or only the loss takes one of
      the two forms below;
    - interleaved, even: --num-layers-per-virtual-pipeline-stage;
    - first and last virtual stages one layer short with (L + 2) a multiple of pp x vpp: the
      embedding and the loss counted as layers (--account-for-embedding/loss-in-pipeline-split),
      under interleaving the vpp degree as --num-virtual-stages-per-pipeline-rank (arguments.py:
      "please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline parallel degree
      when enable uneven pipeline parallelism");
    - any other split: --pipeline-model-parallel-layout, every virtual stage spelled out.
    Not --decoder-first/last-pipeline-num-layers under interleaving: TransformerConfig wants those
    divisible by the vpp degree and spreads them evenly over the rank's virtual stages, so they
    cannot give the first or last virtual stage alone a different count."""
    p = sc.plan
    vpp = p.virtual_pipeline_stages
    edges = [n for n in (p.first_stage_layers, p.last_stage_layers) if n is not None]
    if vpp == 1 and all(edges):
        a = []
        if p.first_stage_layers is not None:
            a += ["--decoder-first-pipeline-num-layers", str(p.first_stage_layers)]
        if p.last_stage_layers is not None:
            a += ["--decoder-last-pipeline-num-layers", str(p.last_stage_layers)]
        return a
    sizes = layers_per_virtual_stage(sc)
    if len(set(sizes)) == 1:
        return ["--num-layers-per-virtual-pipeline-stage", str(sizes[0])]
    if _embedding_and_loss_accounted(sizes, sc.model.num_layers):
        per_rank = ["--num-virtual-stages-per-pipeline-rank", str(vpp)] if vpp > 1 else []
        return [*per_rank, "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    return ["--pipeline-model-parallel-layout", megatron_pipeline_layout(sizes, sc.model.mtp_layers)]


def _embedding_and_loss_accounted(sizes: list[int], num_layers: int) -> bool:
    """Whether `sizes` is the split Megatron makes when the embedding and the loss count as one
    layer each (simulator.layout.embedding_and_loss_edge): the first and last virtual stages one
    layer short of the others."""
    edge = layout.embedding_and_loss_edge(num_layers, len(sizes))
    return edge is not None and [edge] + [edge + 1] * (len(sizes) - 2) + [edge] == sizes


def megatron_pipeline_layout(sizes: list[int], mtp_layers: int = 0) -> str:
    """A --pipeline-model-parallel-layout string for these layers per virtual stage, e.g.
    "Et*3|(t*3|)*30tL": megatron/core/transformer/pipeline_parallel_layer_layout.py reads "E" as the
    embedding, "L" as the loss, "t" as a transformer layer, "m" as a multi-token-prediction layer,
    "|" as the end of a stage, "x*n" and "(...)*n" as repetitions, and the stages in virtual-stage
    order (i = vpp rank x pp + pp rank, transformer_config.py's pipeline_model_parallel_layout). Runs
    of equal middle stages are written once with a repeat count. The MTP layers go where the
    simulator runs them, on the last virtual stage after its transformer layers (its
    validate_layer_layout: their number must match --mtp-num-layers, all in one virtual stage, after
    every decoder layer)."""
    first = "E" + _transformer_layers(sizes[0])
    last = _transformer_layers(sizes[-1]) + "m" * mtp_layers + "L"
    middle = "".join(f"({stage}|)*{count}" if count > 1 else f"{stage}|"
                     for stage, count in _runs([_transformer_layers(n) for n in sizes[1:-1]]))
    return f"{first}|{middle}{last}"


def _transformer_layers(count: int) -> str:
    return "t" * count if count < 2 else f"t*{count}"


def _runs(items: list[str]) -> list[tuple[str, int]]:
    """Consecutive equal items as (item, how many)."""
    return [(item, len(list(group))) for item, group in itertools.groupby(items)]


def _megatron_data_parallel(p) -> list[str]:
    """ZeRO-1 is the distributed optimizer; ZeRO-2 and -3 are Megatron-FSDP's optim_grads and
    optim_grads_params sharding. Megatron-FSDP also needs, by arguments.py's checks, --ckpt-format
    fsdp_dtensor ("Megatron FSDP only supports fsdp_dtensor checkpoint format"), and by the
    Megatron-FSDP user guide's required flags (docs/discussions/megatron-fsdp-user-guide)
    --use-distributed-optimizer and --no-gradient-accumulation-fusion."""
    a = ["--use-distributed-optimizer"] if p.zero_stage >= 1 else []
    if p.zero_stage >= 2:
        strategy = "optim_grads" if p.zero_stage == 2 else "optim_grads_params"
        a += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy,
              "--no-gradient-accumulation-fusion", "--ckpt-format", "fsdp_dtensor"]
    return a


def _megatron_recompute(sc: Scenario) -> list[str]:
    p = sc.plan
    if p.recompute == "selective":
        modules = _megatron_recompute_modules(sc)
        if not modules:
            return []
        a = ["--recompute-granularity", "selective"]
        if modules != ("core_attn",):
            a += ["--recompute-modules", *modules]
        return a
    if p.recompute == "full":
        return ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return []


def _megatron_recompute_modules(sc: Scenario) -> tuple[str, ...]:
    """The plan's selective checkpoints as Megatron runs them: transformer_config.py refuses
    "moe_act in recompute_modules is only supported with moe_grouped_gemm", which needs bf16
    (_grouped_gemm_runs), so an fp16 or fp32 MoE plan leaves moe_act out (megatron_notes says so)."""
    modules = sc.plan.recompute_modules
    if sc.model.moe is not None and not _grouped_gemm_runs(sc.training.precision):
        modules = tuple(m for m in modules if m != "moe_act")
    return modules


def _megatron_model(sc: Scenario) -> list[str]:
    m, t, p = sc.model, sc.training, sc.plan
    a = [
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
    if m.mla is not None:  # Megatron-LM arguments.py _add_mla_args
        a += ["--multi-latent-attention", "--kv-lora-rank", str(m.mla.kv_lora_rank),
              "--qk-head-dim", str(m.mla.qk_head_dim), "--qk-pos-emb-head-dim", str(m.mla.qk_rope_head_dim),
              "--v-head-dim", str(m.mla.v_head_dim)]
        if m.mla.q_lora_rank:
            a += ["--q-lora-rank", str(m.mla.q_lora_rank)]
    if m.mtp_layers:
        a += ["--mtp-num-layers", str(m.mtp_layers)]
    if m.activation == "swiglu":
        a.append("--swiglu")
    if m.qk_layernorm:
        a.append("--qk-layernorm")
    if not m.tied_embeddings:
        a.append("--untie-embeddings-and-output-weights")
    # the simulated dropout (arguments.py _add_regularization_args: both default to 0.1)
    a += ["--hidden-dropout", f"{m.dropout:g}", "--attention-dropout", f"{m.dropout:g}"]
    a += _megatron_vocabulary(m.vocab_size, p.tp)
    a += megatron_architecture_args(m)
    return a


def _megatron_vocabulary(vocab_size: int, tp: int) -> list[str]:
    """Megatron pads the tokenizer's vocabulary up to a multiple of --make-vocab-size-divisible-by
    x tp (megatron/training/tokenizer/tokenizer.py _vocab_size_with_padding; default 128), which
    would grow e.g. Llama 3's 128256 to 129024 at tp 8. With vocab_size / tp as the divisor the
    multiple is vocab_size itself, so any tokenizer of up to vocab_size entries gives the simulated
    vocabulary exactly. A vocabulary tp does not divide cannot be kept (the embedding is split over
    tp): divisor 1 pads it to the next multiple of tp, and megatron_notes says so."""
    return ["--make-vocab-size-divisible-by", str(vocab_size // tp if vocab_size % tp == 0 else 1)]


def _megatron_moe(sc: Scenario) -> list[str]:
    """Experts, their parallelism and the token dispatcher (megatron/training/arguments.py
    _add_moe_args; transformer_config.py for the flex dispatcher's backend)."""
    m, p = sc.model, sc.plan
    if m.moe is None:
        return []
    e = m.moe
    a = ["--num-experts", str(e.num_experts), "--moe-router-topk", str(e.top_k),
         "--moe-ffn-hidden-size", str(e.expert_ffn_hidden_size),
         "--expert-model-parallel-size", str(p.ep), "--expert-tensor-parallel-size", str(p.expert_tp)]
    if _grouped_gemm_runs(sc.training.precision):
        a.append("--moe-grouped-gemm")
    a += _megatron_dispatcher(p.moe_dispatcher)
    if e.num_shared_experts:
        a += ["--moe-shared-expert-intermediate-size", str(e.num_shared_experts * e.expert_ffn_hidden_size)]
        if _shared_expert_overlap_runs(sc):
            a.append("--moe-shared-expert-overlap")
    if p.overlap_moe_expert_parallel_comm:
        a.append("--overlap-moe-expert-parallel-comm")
    if _needs_pre_softmax(m):
        a.append("--moe-router-pre-softmax")
    # the loader checked num_experts % groups == 0, as transformer_config.py does
    if e.groups_per_token < e.expert_groups:
        a += ["--moe-router-num-groups", str(e.expert_groups), "--moe-router-group-topk", str(e.groups_per_token)]
    if e.capacity_factor is not None:
        a += ["--moe-expert-capacity-factor", str(e.capacity_factor)]
    if e.first_dense_layers or e.moe_layer_freq > 1:
        pattern = [1 if m.is_moe_layer(i) else 0 for i in range(m.num_layers)]
        a += ["--moe-layer-freq", "([" + ",".join(map(str, pattern)) + "])"]
    return a


def _grouped_gemm_runs(precision: str) -> bool:
    """The simulation prices the experts as grouped GEMMs; arguments.py: "Currently GroupedGEMM for
    MoE only supports bf16 dtype" (fp8 plans run with --bf16)."""
    return precision in ("bf16", "fp8")


def _megatron_dispatcher(dispatcher: str) -> list[str]:
    """alltoall: --moe-token-dispatcher-type alltoall. deepep: the flex dispatcher with its DeepEP
    backend; transformer_config.py: "moe_enable_deepep is deprecated. Please use
    --moe-flex-dispatcher-backend=deepep instead." (the backend choice came with Megatron-Core 0.15,
    megatron/core/transformer/moe/README.md: "Add HybridEP backend to Flex Dispatcher")."""
    if dispatcher == "deepep":
        return ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", "deepep"]
    return ["--moe-token-dispatcher-type", "alltoall"]


def _shared_expert_overlap_runs(sc: Scenario) -> bool:
    """transformer_config.py: "moe_shared_expert_overlap only works with alltoall token dispatcher"."""
    p = sc.plan
    return bool(p.moe_shared_expert_overlap and sc.model.moe.num_shared_experts and p.moe_dispatcher == "alltoall")


def _megatron_precision(precision: str, grad_reduce_dtype: str) -> list[str]:
    """The simulator accumulates and reduces gradients in training.grad_reduce_dtype (the main
    grads of memory.py, simulate._grad_buckets). arguments.py turns accumulate_allreduce_grads_in_fp32
    on for bf16 itself unless --grad-reduce-in-bf16 is given; under fp16 it stays off (grads
    reduced in fp16) unless asked for."""
    bf16_grads = ["--grad-reduce-in-bf16"] if grad_reduce_dtype == "bf16" else []
    if precision == "bf16":
        return ["--bf16", *bf16_grads]
    if precision == "fp16":
        return ["--fp16"] if grad_reduce_dtype == "fp16" else ["--fp16", "--accumulate-allreduce-grads-in-fp32"]
    if precision == "fp8":
        # current per-tensor scaling: the fp8 GEMMs calibration measures (torch._scaled_mm, one scale
        # per tensor); Megatron's default recipe, delayed, refuses the moe_act and layernorm
        # checkpoints ("Delayed scaling does not support moe_act and layernorm recompute for fp8",
        # transformer_config.py)
        return ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", *bf16_grads]
    return []


def megatron_launch_command(sc: Scenario) -> str:
    """The torchrun line for megatron_args.txt: xargs splits the file's lines at blanks, removes the
    quotes shlex.quote put around a value and starts torchrun without a shell (no globbing, no
    expansion), so every argument reaches argparse as megatron_args returns it, parentheses, "*"
    and "|" included.
    The environment: arguments.py asserts CUDA_DEVICE_MAX_CONNECTIONS == 1 under tensor or context
    parallelism (before Blackwell), and != 1 under Megatron-FSDP ("FSDP always requires
    CUDA_DEVICE_MAX_CONNECTIONS value large than one"). Combined 1F1B (--overlap-moe-expert-parallel-comm)
    runs its all-to-alls on a stream of their own beside the compute, which needs more than one
    hardware queue: its guide and arguments.py ask for 32, and with tensor or context parallelism
    arguments.py only warns ("you can set CUDA_DEVICE_MAX_CONNECTIONS to 1 or 32, which depends on
    which parallelization you want to prioritize"); the simulation overlapped both, so 32."""
    c, p = sc.cluster, sc.plan
    env = ""
    if p.overlap_moe_expert_parallel_comm:
        env = "CUDA_DEVICE_MAX_CONNECTIONS=32 "
    elif p.zero_stage >= 2:
        env = "env -u CUDA_DEVICE_MAX_CONNECTIONS "
    elif p.tp > 1 or p.cp > 1:
        env = "CUDA_DEVICE_MAX_CONNECTIONS=1 "
    # several nodes: each runs the line with its own NODE_RANK and node 0's address (torchrun's
    # static defaults, node rank 0 at 127.0.0.1, would make every node node 0)
    nodes = (" --node-rank \"$NODE_RANK\" --rdzv-backend c10d --rdzv-endpoint \"$MASTER_ADDR:29500\""
             if c.num_nodes > 1 else "")
    return (f"grep -v '^#' megatron_args.txt | {env}xargs torchrun --nnodes {c.num_nodes}{nodes} "
            f"--nproc-per-node {c.gpus_per_node} pretrain_gpt.py")


def _needs_pre_softmax(model) -> bool:
    """Whether a top-1 MoE router needs --moe-router-pre-softmax that its preset family does not set
    (transformer_config.py __post_init__ raises "Please use --moe-router-pre-softmax when topk is 1"
    for a softmax router)."""
    if model.moe is None or model.moe.top_k != 1:
        return False
    fam = family_of(model)
    return "--moe-router-pre-softmax" not in (fam.router if fam is not None else ())


def megatron_notes(sc: Scenario) -> list[str]:
    """Where Megatron-LM runs something other than what was simulated."""
    m, t, p = sc.model, sc.training, sc.plan
    notes = []
    if t.precision == "fp32" and t.attention != "unfused":
        # transformer_engine/pytorch/attention/dot_product_attention/utils.py get_attention_backend:
        # FlashAttention and FusedAttention are filtered out for a qkv dtype other than fp16/bf16/fp8
        notes.append(f"Transformer Engine has no fp32 {t.attention} attention kernel, so this fp32 plan runs the "
                     "unfused attention (--attention-backend unfused), slower than simulated: simulate it with "
                     "--set training.attention=unfused.")
    if _needs_pre_softmax(m):
        notes.append("A top-1 router needs --moe-router-pre-softmax in Megatron-LM: the chosen expert's weight is its "
                     "softmax probability over all experts, not 1.")
    if m.vocab_size % p.tp:
        notes.append(f"Megatron-LM splits the vocabulary over tp {p.tp}, so it pads the simulated {m.vocab_size} "
                     f"entries to {-(-m.vocab_size // p.tp) * p.tp}.")
    if p.schedule == "gpipe" and p.pp > 1:
        notes.append("Megatron-LM has no GPipe schedule; it runs 1F1B (same bubble, less activation memory).")
    if p.schedule in ("zero-bubble", "zbv", "dualpipev") and p.pp > 1:
        runs = "1f1b" if p.virtual_pipeline_stages == 1 else "interleaved-1f1b"
        looped = " with its chunks in a loop, not a V" if p.schedule in ("zbv", "dualpipev") else ""
        n = sc.num_microbatches
        if runs == "interleaved-1f1b" and n % p.pp:
            # megatron/core/pipeline_parallel/schedules.py: "number of microbatches must be
            # divisible by pipeline-model-parallel-size when using interleaved schedule"
            notes.append(f"Megatron-LM has no {p.schedule} schedule, and the interleaved 1F1B these arguments ask "
                         f"for refuses {n} microbatches on pp {p.pp} (it needs a multiple of pp): launch the plan "
                         "with paraplan launch / torchtitan.")
        else:
            notes.append(f"Megatron-LM has no {p.schedule} schedule; these arguments run (interleaved) 1F1B{looped}, "
                         "which keeps the weight gradients in the backward (a larger bubble than predicted): "
                         f"simulate the plan with --set plan.schedule={runs} for its step time, or launch it with "
                         "paraplan launch / torchtitan.")
    if p.pp == 2 and p.virtual_pipeline_stages > 1:
        # megatron/training/arguments.py validate_args: with virtual stages and overlap_p2p_comm off,
        # "pipeline-model-parallel size should be greater than 2"; the overlap is on by default
        # (--no-overlap-p2p-communication turns it off) since 2024, off (--overlap-p2p-communication)
        # before
        notes.append("pp 2 with virtual stages needs Megatron-LM's overlapped pipeline communication: the default "
                     "since 2024 (do not pass --no-overlap-p2p-communication); older versions need "
                     "--overlap-p2p-communication.")
    if p.tp > 1 and not p.tp_backward_overlap and not p.tp_comm_overlap:
        notes.append("Megatron-LM always runs its backward tensor-parallel collectives beside the GEMMs (no flag "
                     "turns that off), so it is faster than this plan's tp_backward_overlap: false predicts.")
    if m.moe is not None and not _grouped_gemm_runs(t.precision):
        notes.append(f"Megatron-LM's grouped expert GEMM needs bf16, so this {t.precision} plan runs one GEMM per "
                     "local expert (slower than simulated).")
    if p.zero_stage >= 2 and p.pp > 1:
        # Megatron-FSDP's documentation lists TP, CP and EP as what it composes with, not PP
        # (NVIDIA/Megatron-LM issue #1455, open); examples/multimodal_dev/scripts/run_qwen35_vl.sh
        # refuses FSDP with PP > 1: "FSDP and PP are mutually exclusive in Megatron's standard path"
        notes.append(f"Megatron-FSDP (ZeRO-{p.zero_stage} here) is documented with tensor, context and expert "
                     f"parallelism, not with pipeline parallelism: Megatron-LM may refuse this pp {p.pp} plan; "
                     f"simulate it with plan.zero_stage=1 for the distributed optimizer, or run it with torchtitan.")
    if p.recompute == "selective" and _megatron_recompute_modules(sc) != p.recompute_modules:
        notes.append(f"Megatron-LM recomputes moe_act only with its grouped expert GEMM (bf16), so this "
                     f"{t.precision} plan keeps those activations instead (more memory than simulated).")
    if m.moe is not None and p.moe_dispatcher == "deepep":
        notes.append("--moe-flex-dispatcher-backend needs Megatron-Core 0.15 or later; older versions take "
                     "--moe-enable-deepep instead.")
        if m.moe.capacity_factor is not None:
            # older transformer_config.py: "moe_expert_capacity_factor only works with alltoall token dispatcher"
            notes.append("older Megatron-Core versions accept --moe-expert-capacity-factor only with the alltoall "
                         "dispatcher, not the flex (DeepEP) one.")
    if p.overlap_moe_expert_parallel_comm and (p.tp > 1 or p.cp > 1):
        notes.append(f"Megatron-LM wants CUDA_DEVICE_MAX_CONNECTIONS=1 for its tensor/context-parallel overlap and "
                     f"more for --overlap-moe-expert-parallel-comm; the command sets 32, so with tp {p.tp} cp {p.cp} "
                     "the tensor-parallel collectives may hide less than simulated.")
    if p.overlap_moe_expert_parallel_comm:
        notes.append("--overlap-moe-expert-parallel-comm needs Megatron-Core 0.14 or later and PyTorch 2.6 or later.")
    if t.precision == "fp8" and p.recompute == "selective" and {"layernorm", "moe_act"} & set(p.recompute_modules):
        # transformer_config.py: "moe_act and layernorm recompute for fp8 needs transformer-engine>=2.6.0dev0"
        notes.append("recomputing layernorm or moe_act under fp8 needs Transformer Engine 2.6 or later.")
    if m.moe is not None and p.moe_shared_expert_overlap and m.moe.num_shared_experts \
            and not _shared_expert_overlap_runs(sc):
        notes.append(f"Megatron-LM overlaps the shared experts with the dispatch only under the alltoall "
                     f"dispatcher and refuses the flag with {p.moe_dispatcher}, so it is left out (the simulator "
                     f"refuses this plan for the same reason).")
    return notes


def megatron_args_text(sc: Scenario) -> str:
    """megatron_args.txt: comment lines, then one flag (with its value, shell-quoted) per line."""
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
    head = [f"Megatron-LM pretrain_gpt.py arguments for {sc.name} on {world} GPUs ({sc.cluster.shape}); "
            "add data, tokenizer, optimizer.",
            f"Launch: {megatron_launch_command(sc)}",
            *megatron_architecture_comments(sc.model),
            *[f"Note: {n}" for n in megatron_notes(sc)]]
    return "".join(comment(h) + "\n" for h in head) + "\n".join(lines) + "\n"


# torchtitan job config keys and values: torchtitan/config/job_config.py after the quantization
# rename of Sept 2025 (float8 converter "quantize.linear.float8"), the 0.2 releases.
TORCHTITAN_KEYS_VERSION = "torchtitan 0.2.x (torchtitan/config/job_config.py)"
_TORCHTITAN_ROTATE = {"p2p": "alltoall", "all_gather": "allgather", "a2a": "allgather", "a2a+p2p": "alltoall"}
"""plan.cp_comm_type -> [parallelism] context_parallel_rotate_method: a ring of shard swaps, or
one all-gather (torchtitan has no Ulysses-style head scatter)."""
_TORCHTITAN_NO_A2A = {"a2a": "the config keeps its all-gather", "a2a+p2p": "the config runs the ring over all cp ranks"}


def torchtitan_toml(sc: Scenario) -> str:
    """A torchtitan job config for the plan: FSDP2 shards over dp x cp for ZeRO 2-3 (ZeRO-2 as
    reshard_after_forward = never, ZeRO-3 as always); ZeRO 0-1 replicate (torchtitan has no
    sharded-optimizer-only mode: with tp, pp, cp or ep > 1 it still needs FSDP, so that case is
    written as FSDP and flagged)."""
    m, t, p = sc.model, sc.training, sc.plan
    replicate, shard, notes = _torchtitan_data_parallel(p)
    schedule, schedule_notes = _torchtitan_schedule(p)
    notes += schedule_notes
    expert_lines, expert_notes = _torchtitan_experts(sc)
    notes += expert_notes
    local_batch = t.global_batch_size // p.dp if p.pp > 1 else p.micro_batch_size
    if not p.sequence_parallel and p.tp > 1:
        notes.append("torchtitan always shards activations along the sequence under TP (sequence parallel)")
    if p.tp > 1 and p.tp_backward_overlap and not p.tp_comm_overlap:
        # DTensor's redistribute backward runs after the matmul's backward node (dgrad and wgrad)
        notes.append("torchtitan's eager tensor parallelism (DTensor) reduce-scatters each layer's input gradient "
                     "after its weight gradient, not beside it as simulated (plan.tp_backward_overlap)")
    if t.grad_reduce_dtype == "bf16" and shard == 1 and p.cp == 1 and replicate > 1:
        # torchtitan applies its FSDP mixed-precision policy where FSDP runs (dp_shard > 1 or cp > 1);
        # its DDP path (replicate only) reduces in fp32
        notes.append("torchtitan applies mixed_precision_reduce under FSDP only; replicated (DDP) it reduces "
                     "gradients in fp32, not in bf16 as simulated (training.grad_reduce_dtype)")
    if t.grad_reduce_dtype == "bf16":
        notes.append("mixed_precision_reduce: torchtitan 0.2.x declares float32 only (later releases add bfloat16); "
                     "its FSDP reduces in bf16 but keeps the gradients in fp32, where the simulator holds them in bf16")
    if t.precision == "fp16":
        notes.append("torchtitan has no fp16 training (no loss scaling); mixed_precision_param is bf16")
    if p.recompute == "selective":
        # torchtitan's op-level policy (distributed/activation_checkpoint.py _custom_policy): save the
        # outputs of the ops in its save list, the attention kernels among them, and of every second mm
        notes.append(f"the plan recomputes {', '.join(p.recomputed_modules) or 'nothing'} (selective); torchtitan's "
                     "selective_ac_option \"op\" chooses by op, not by module: it keeps the attention kernels' "
                     "outputs and recomputes every second matmul, so its memory and recompute time differ from "
                     "the simulation's")
    if t.precision == "fp8" and m.moe is not None:
        # components/quantization/float8.py: quantize.linear.float8 converts nn.Linear; the experts'
        # grouped GEMMs need quantize.grouped_mm.float8 (a prototype, torchao nightly; fqns empty by default)
        notes.append("quantize.linear.float8 converts nn.Linear only: the routed experts' grouped GEMMs run in bf16 "
                     "(slower than simulated) unless the prototype quantize.grouped_mm.float8 converter is added "
                     'with [quantize.grouped_mm.float8] fqns = ["experts"]')
    if p.cp > 1:
        # PyTorch's context_parallel (torch/distributed/tensor/experimental/_context_parallel/_attention.py):
        # "alltoall" (_AllToAllRotater) passes the K/V shards round a ring, each step's overlapped;
        # "allgather" (_AllGatherRotater) gathers them once beside the first step; either way the
        # backward passes dK/dV round the ring in fp32
        notes.append(f"torchtitan's context parallelism passes dK/dV round a ring in fp32 in the backward "
                     f"(context_parallel_rotate_method {_TORCHTITAN_ROTATE[p.cp_comm_type]!r}), not as "
                     f"Transformer Engine's {p.cp_comm_type} the simulation prices"
                     + (f"; it has no head-scattering (a2a) context parallelism: {_TORCHTITAN_NO_A2A[p.cp_comm_type]}"
                        if p.cp_comm_type in _TORCHTITAN_NO_A2A else ""))
    name, flavor, architecture = torchtitan_model(m)
    chosen = name != "CHANGE-ME" and flavor != "CHANGE-ME"
    lines = [
        comment(f"torchtitan job config for {sc.name}: {p.tp * p.pp * p.cp * p.dp} GPUs "
                f"({sc.cluster.shape}), written by `paraplan plan`; keys follow {TORCHTITAN_KEYS_VERSION}, "
                "whose train.py reads it with --job.config_file (later releases take the same values through "
                "a Python config recipe, --module/--config)."),
        comment(f"Model: {_torchtitan_shape(m)}"
                + ("" if chosen else "; set [model] name/flavor to it")
                + (" (an MoE model: one of torchtitan's MoE models such as deepseek_v3 or llama4, not llama3)."
                   if m.moe is not None else ".")),
        *[comment(line) for line in architecture],
        *[comment(f"Note: {n}") for n in notes],
        "",
        "[model]",
        f'name = "{name}"',
        f'flavor = "{flavor}"',
    ]
    if t.precision == "fp8":
        # torchtitan/components/quantization/float8.py registers the converter as "quantize.linear.float8"
        lines.append('converters = ["quantize.linear.float8"]')
    lines += [
        "",
        "[training]",
        f"local_batch_size = {local_batch}",
        f"global_batch_size = {t.global_batch_size}",
        f"seq_len = {t.seq_length}",
        f'mixed_precision_param = "{"float32" if t.precision == "fp32" else "bfloat16"}"',
        f'mixed_precision_reduce = "{"bfloat16" if t.grad_reduce_dtype == "bf16" else "float32"}"',
        "",
        "[parallelism]",
        f"data_parallel_replicate_degree = {replicate}",
        f"data_parallel_shard_degree = {shard}",
        f'fsdp_reshard_after_forward = "{_torchtitan_reshard_after_forward(p)}"',
        f"tensor_parallel_degree = {p.tp}",
        f"pipeline_parallel_degree = {p.pp}",
        f'pipeline_parallel_schedule = "{schedule}"',
        f"pipeline_parallel_microbatch_size = {p.micro_batch_size}",
    ]
    if p.pp > 1:
        lines += _torchtitan_stage_split(sc)
    lines += [
        f"context_parallel_degree = {p.cp}",
        *([f'context_parallel_rotate_method = "{_TORCHTITAN_ROTATE[p.cp_comm_type]}"'] if p.cp > 1 else []),
        *expert_lines,
        "",
        "[activation_checkpoint]",
        f'mode = "{p.recompute}"',
    ]
    if p.recompute == "selective":
        lines.append('selective_ac_option = "op"')
    return "\n".join(lines) + "\n"


def _torchtitan_data_parallel(p) -> tuple[int, int, list[str]]:
    """(replicate, shard, notes). ZeRO-2/3 shard over dp. ZeRO-0/1 replicate, but torchtitan's DDP
    (replicate only) runs without TP, PP and CP (llama3 parallelize: "DDP has not supported > 1D
    parallelism"), and its expert parallelism borrows ranks from dp_shard (distributed/
    parallel_dims.py: (dp_shard x cp) % ep == 0, or (dp_shard x cp x tp) % ep == 0 with etp = 1):
    those plans shard over dp too, and say so."""
    if p.zero_stage >= 2:
        return 1, p.dp, []
    if p.ep > 1:
        why = "torchtitan's expert parallelism needs FSDP (EP borrows from dp_shard)"
    elif p.tp > 1 or p.pp > 1 or p.cp > 1:
        why = "torchtitan composes TP/PP/CP with FSDP only"
    elif p.zero_stage == 1 and p.dp > 1:
        return p.dp, 1, ["the plan uses ZeRO-1; torchtitan has no sharded-optimizer-only mode, so this config "
                         "replicates the optimizer states (more memory per GPU than simulated)"]
    else:
        return p.dp, 1, []
    return 1, p.dp, [f"the plan uses ZeRO-{p.zero_stage}; {why}, so this config shards the weights over dp "
                     "too (more all-gathers than simulated)"]


def _torchtitan_reshard_after_forward(p) -> str:
    """torchtitan's "default" reshards after forward only without PP (llama3 parallelize apply_fsdp:
    reshard_after_forward = not pp_enabled), which under PP is ZeRO-2: ZeRO-3 says "always", the
    other stages "never" (the weights stay gathered from forward to backward)."""
    return "always" if p.zero_stage == 3 else "never"


def _torchtitan_schedule(p) -> tuple[str, list[str]]:
    """torch.distributed.pipelining schedule names. Zero bubble there is multi-stage only
    (InterleavedZeroBubble; ZBVZeroBubble needs two stages per rank in V order), and torchtitan
    refuses those with one stage per rank (distributed/pipeline_parallel.py pipeline_llm:
    "Multi-stage schedule requires at least 2 stages per rank"), so a one-stage zero-bubble plan
    runs 1F1B, the single-stage schedule with the same bubble as the simulator's 1f1b."""
    if p.schedule == "zero-bubble" and p.virtual_pipeline_stages == 1:
        note = ("torchtitan has no zero-bubble schedule for one stage per rank; this config runs 1F1B, which "
                "keeps the weight gradients in the backward (a larger bubble than predicted)")
        return "1F1B", [note] if p.pp > 1 else []
    return {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B",
            "zero-bubble": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}[p.schedule], []


def _torchtitan_experts(sc: Scenario) -> tuple[list[str], list[str]]:
    """(config lines, notes) for expert parallelism. torchtitan's ParallelDims takes etp = tp (EP
    borrows cp and part of dp_shard) or etp = 1 (EP borrows cp, tp and part of dp_shard)
    (distributed/parallel_dims.py _validate); job_config.py's expert_parallel_comm_backend picks DeepEP."""
    p = sc.plan
    lines = [f"expert_parallel_degree = {p.ep}"]
    if p.ep == 1:
        if sc.model.moe is not None and p.tp > 1 and p.expert_tp != p.tp:
            # torchtitan's apply_moe_ep_tp without an EP mesh: experts_mesh = tp_mesh, TensorParallel()
            return lines, [f"torchtitan at expert_parallel_degree 1 shards the experts over the tp {p.tp} ranks, "
                           f"where this plan (expert tp {p.expert_tp}) keeps them whole on each: its expert "
                           "memory and traffic differ from the simulation"]
        return lines, []
    lines.append(f"expert_tensor_parallel_degree = {p.expert_tp}")
    if p.moe_dispatcher == "deepep":
        lines.append('expert_parallel_comm_backend = "deepep"')
    notes = []
    if p.schedule == "dualpipev" and p.pp > 1:
        # job_config.py Parallelism.pipeline_parallel_expert_parallel_overlap (default true) registers
        # torchtitan's overlap callback for DualPipeV's OVERLAP_F_B pairs (distributed/pipeline_parallel.py
        # build_pipeline_schedule); distributed/dual_pipe_v.py refuses it with activation checkpointing
        overlap = p.overlap_moe_expert_parallel_comm
        if overlap and p.recompute != "none":
            overlap = False
            notes.append("torchtitan refuses DualPipeV's expert-parallel overlap with activation checkpointing, so "
                         "this config turns the overlap off and the pairs run one after the other: simulate the plan "
                         "with --set plan.overlap_moe_expert_parallel_comm=false for its step time")
        lines.append(f"pipeline_parallel_expert_parallel_overlap = {'true' if overlap else 'false'}")
    elif p.overlap_moe_expert_parallel_comm:
        notes.append("torchtitan has no combined 1F1B (Megatron-Core --overlap-moe-expert-parallel-comm): its "
                     "all-to-alls run in line with the compute, slower than simulated; simulate the plan with "
                     "--set plan.overlap_moe_expert_parallel_comm=false for its step time")
    if not _torchtitan_accepts_experts(p):
        return lines, [f"torchtitan cannot build ep {p.ep} with expert tp {p.expert_tp}, tp {p.tp}, cp {p.cp}, "
                       f"dp {p.dp}: it needs expert tp = tp with ep a multiple of cp dividing dp x cp, or "
                       "expert tp = 1 with ep a multiple of cp x tp dividing dp x cp x tp", *notes]
    return lines, notes


def _torchtitan_accepts_experts(p) -> bool:
    """torchtitan distributed/parallel_dims.py _validate, with dp_shard = dp (the EP plans shard)."""
    if p.expert_tp == p.tp:
        return p.ep % p.cp == 0 and (p.dp * p.cp) % p.ep == 0
    if p.expert_tp == 1:
        return p.ep % (p.cp * p.tp) == 0 and (p.dp * p.cp * p.tp) % p.ep == 0
    return False


def _torchtitan_shape(m) -> str:
    """What a torchtitan flavor must build: the simulated layers, widths, heads and vocabulary
    (which torchtitan takes from the tokenizer)."""
    attention = (f"{m.num_attention_heads} MLA heads" if m.mla is not None else
                 f"{m.num_attention_heads} heads / {m.num_kv_heads} KV heads of {m.head_dim}")
    experts = (f", {m.moe.num_experts} experts of {m.moe.expert_ffn_hidden_size} (top {m.moe.top_k})"
               if m.moe is not None else "")
    mtp = f", {m.mtp_layers} MTP module(s)" if m.mtp_layers else ""
    return (f"{m.name} ({m.num_layers} layers, hidden {m.hidden_size}, {attention}, FFN {m.ffn_hidden_size}"
            f"{experts}{mtp}, vocabulary {m.vocab_size} from the tokenizer, "
            f"{'tied' if m.tied_embeddings else 'untied'} embeddings)")


def _torchtitan_stage_split(sc: Scenario) -> list[str]:
    """The plan's layers per virtual stage in torchtitan's terms: it makes
    ceil((layers + first_less + last_less) / layers_per_stage) virtual stages and gives the first
    and last `*_less_layers` fewer layers (torchtitan pipeline_llm / generate_llm_fqn_per_model_part;
    both default to 1, so an even split must say 0). The counts are the simulated ones
    (simulator.layout.layers_per_virtual_stage)."""
    by_vstage = layers_per_virtual_stage(sc)
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
