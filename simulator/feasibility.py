"""Structural checks of a plan against the model and cluster: every reason, not the first one."""
from __future__ import annotations

from paraplan.placement import cp_split
from paraplan.specs import MOE_RECOMPUTE_MODULES, Scenario

# Microbatches one iteration may have: the engine plays every op, so time and memory grow with
# them (1e6 take ~10 s and ~1 GB); real runs have at most a few thousand per pipeline.
MAX_MICROBATCHES = 65_536


def _gradient_dtype(precision: str) -> str:
    """The dtype the backward computes weight gradients in: the 16-bit weights' (fp8 GEMMs write
    bf16 gradients, Transformer Engine), fp32 in fp32 training."""
    return {"fp8": "bf16"}.get(precision, precision)


def _cp_exchange_problems(sc: Scenario) -> list[str]:
    """What plan.cp_comm_type (and cp_a2a_size) need, as Transformer Engine checks it."""
    m, p = sc.model, sc.plan
    out = []
    if p.cp_a2a_size is not None and (p.cp_comm_type != "a2a+p2p" or p.cp == 1):
        out.append(f"plan.cp_a2a_size: sizes the all-to-all groups of cp_comm_type a2a+p2p with cp > 1; this plan "
                   f"runs {p.cp_comm_type} with cp {p.cp} (leave it null)")
    if p.cp == 1:
        return out
    if p.cp_comm_type in ("all_gather", "a2a") and m.mla is not None:
        # attn_forward_func_with_cp: MLA (differing K and V head dims) "is only supported with" p2p and a2a+p2p
        out.append(f"plan.cp_comm_type: {p.cp_comm_type} cannot run multi-latent attention (model.mla), whose keys "
                   f"and values differ in head dim; Transformer Engine runs it with p2p or a2a+p2p")
    hierarchical = p.cp_comm_type == "a2a+p2p"
    if hierarchical and p.cp_a2a_size is not None and p.cp % p.cp_a2a_size:
        out.append(f"plan.cp_a2a_size: {p.cp_a2a_size} does not divide cp = {p.cp} (a2a groups x ring = cp, Megatron "
                   f"--hierarchical-context-parallel-sizes)")
        return out
    if p.cp_comm_type not in ("a2a", "a2a+p2p"):
        return out
    # (a derived group always splits the heads: only a2a's cp or a given cp_a2a_size can fail)
    a2a = cp_split(p, m, sc.cluster.gpus_per_node)[0]
    for key, count in {"num_attention_heads": m.num_attention_heads, "num_kv_heads": m.num_kv_heads}.items():
        # AttnFuncWithCPAndQKVOA2A: "The number of attention heads needs to be divisible by CP size!"
        if count % (p.tp * a2a) == 0:
            continue
        if hierarchical:
            out.append(f"plan.cp_a2a_size: a2a+p2p splits each TP rank's heads over each group of {a2a} CP ranks, but "
                       f"model.{key} ({count}) is not divisible by tp x cp_a2a_size = {p.tp} x {a2a} (null derives "
                       f"a size that divides it)")
        else:
            out.append(f"plan.cp_comm_type: a2a splits each TP rank's heads over the cp ranks, but model.{key} "
                       f"({count}) is not divisible by tp x cp = {p.tp} x {a2a}")
    return out


def structural_problems(sc: Scenario, gpu_arch: str | None = None) -> list[str]:
    """Reasons a plan cannot run at all, each naming the key at fault. Empty when it can."""
    m, p, t, c = sc.model, sc.plan, sc.training, sc.cluster
    out: list[str] = []
    if p.world_size != c.world_size:
        out.append(
            f"plan: tp*pp*cp*dp = {p.tp}*{p.pp}*{p.cp}*{p.dp} = {p.world_size} but the cluster has "
            f"{c.world_size} GPUs ({c.shape})"
        )
    if m.num_attention_heads % p.tp:
        out.append(f"plan.tp: {p.tp} does not divide model.num_attention_heads ({m.num_attention_heads})")
    elif m.num_kv_heads % p.tp:
        # Megatron-Core requires num_query_groups % tensor_model_parallel_size == 0
        out.append(f"plan.tp: {p.tp} does not divide model.num_kv_heads ({m.num_kv_heads})")
    if m.ffn_hidden_size % p.tp:
        out.append(f"plan.tp: {p.tp} does not divide model.ffn_hidden_size ({m.ffn_hidden_size})")
    out += _pipeline_problems(sc)
    if t.global_batch_size % (p.dp * p.micro_batch_size):
        out.append(
            f"training.global_batch_size: {t.global_batch_size} is not a multiple of "
            f"plan.dp x plan.micro_batch_size = {p.dp} x {p.micro_batch_size}"
        )
    if p.cp > 1 and t.seq_length % (2 * p.cp):
        # load-balanced causal CP splits the sequence into 2*cp chunks (Megatron-Core)
        out.append(f"plan.cp: training.seq_length {t.seq_length} is not divisible by 2*cp = {2 * p.cp}")
    if p.cp > 1 and t.attention == "unfused":
        # Transformer Engine's get_attention_backend: "Disabling UnfusedDotProductAttention as it
        # does not support context parallelism"; unfused leaves flash and fused off, so nothing runs
        out.append("plan.cp: context parallelism needs a fused attention kernel (training.attention flash or flash3), "
                   "not unfused")
    out += _cp_exchange_problems(sc)
    if p.sequence_parallel and p.tp > 1 and (t.seq_length // p.cp) % p.tp:
        out.append(f"plan.sequence_parallel: seq_length/cp = {t.seq_length // p.cp} is not divisible by tp = {p.tp}")
    if p.tp_comm_overlap and not (p.sequence_parallel and p.tp > 1):
        # Megatron: "Tensor parallel communication/GEMM overlap can happen only when sequence parallelism is enabled"
        out.append("plan.tp_comm_overlap: needs sequence_parallel: true and tp > 1")
    if p.overlap_param_gather and p.zero_stage == 0:
        # Megatron-LM validate_args: "--overlap-param-gather only supported with distributed optimizer"
        out.append("plan.overlap_param_gather: needs zero_stage >= 1 (the distributed optimizer gathers the parameters)")
    if p.overlap_param_gather and not p.overlap_grad_reduce:
        # Megatron-LM validate_args: "Must use --overlap-param-gather with --overlap-grad-reduce"
        out.append("plan.overlap_param_gather: needs overlap_grad_reduce: true (Megatron-LM)")
    if p.gradient_accumulation_fusion and p.zero_stage >= 2:
        # ZeRO-2/3 is Megatron-FSDP, whose user guide requires --no-gradient-accumulation-fusion
        out.append("plan.gradient_accumulation_fusion: zero_stage 2 and 3 (Megatron-FSDP) accumulate "
                   "gradients outside the GEMMs; set it false or leave it out")
    out += _moe_problems(sc)
    out += _ep_overlap_problems(sc)
    native = _gradient_dtype(t.precision)
    if t.grad_reduce_dtype not in ("fp32", native):
        allowed = "fp32" if native == "fp32" else f"fp32 or {native}"
        out.append(f"training.grad_reduce_dtype: {t.grad_reduce_dtype} is not a dtype precision {t.precision} "
                   f"computes gradients in; allowed: {allowed}")
    if t.precision == "fp8" and gpu_arch == "ampere":
        out.append("training.precision: fp8 needs Hopper or newer; this GPU is Ampere")
    if t.attention == "flash3" and gpu_arch not in (None, "hopper"):
        # FlashAttention-3 (Shah et al. 2024) is written for Hopper's wgmma and TMA
        out.append(f"training.attention: flash3 (FlashAttention-3-class kernels) runs on Hopper; this GPU is "
                   f"{gpu_arch.capitalize()}")
    return out


def _pipeline_problems(sc: Scenario) -> list[str]:
    m, p = sc.model, sc.plan
    out: list[str] = []
    vpp = p.virtual_pipeline_stages
    if p.schedule == "interleaved-1f1b" and vpp < 2:
        out.append("plan.virtual_pipeline_stages: interleaved-1f1b needs at least 2 virtual stages per rank")
    if p.schedule in ("zbv", "dualpipev") and vpp != 2:
        # ZB-V and DualPipeV place exactly two chunks per rank in a V (PyTorch ScheduleZBVZeroBubble
        # and ScheduleDualPipeV: "ZBV requires exactly 2 stages per rank")
        out.append(f"plan.virtual_pipeline_stages: {p.schedule} runs exactly 2 virtual stages per rank (its V), "
                   f"got {vpp}")
    if p.schedule not in ("interleaved-1f1b", "zero-bubble", "zbv", "dualpipev") and vpp > 1:
        out.append(f"plan.virtual_pipeline_stages: {vpp} virtual stages need schedule interleaved-1f1b, "
                   f"zero-bubble, zbv or dualpipev (or virtual_pipeline_stages 1 for {p.schedule})")
    if p.schedule in ("interleaved-1f1b", "zero-bubble", "zbv", "dualpipev") and p.pp < 2:
        out.append(f"plan.schedule: {p.schedule} needs pp >= 2 (one stage has no pipeline bubble to fill)")
    uneven = p.first_stage_layers is not None or p.last_stage_layers is not None
    virtual = p.pp * vpp
    if uneven:
        given = (p.first_stage_layers is not None) + (p.last_stage_layers is not None)
        rest = m.num_layers - (p.first_stage_layers or 0) - (p.last_stage_layers or 0)
        middle = virtual - given
        if virtual < 2:
            out.append("plan.first_stage_layers: uneven first/last stages need pp x virtual_pipeline_stages >= 2")
        elif rest < 0:
            out.append(
                f"plan.first_stage_layers/last_stage_layers: {m.num_layers - rest} layers on the first and last "
                f"stages, more than model.num_layers ({m.num_layers})"
            )
        elif (middle and rest % middle) or (not middle and rest):
            out.append(
                f"plan.first_stage_layers/last_stage_layers: the {rest} remaining of model.num_layers "
                f"({m.num_layers}) do not split evenly over the other {middle} (virtual) stages"
            )
    elif m.num_layers % virtual:
        out.append(
            f"plan.pp: model.num_layers ({m.num_layers}) is not divisible by pp x virtual_pipeline_stages "
            f"= {p.pp} x {vpp}"
        )
    if p.dp > 0 and p.micro_batch_size > 0 and sc.training.global_batch_size % (p.dp * p.micro_batch_size) == 0:
        mbs = sc.num_microbatches
        if mbs > MAX_MICROBATCHES:
            out.append(
                f"training.global_batch_size: {sc.training.global_batch_size} sequences / (dp x micro_batch_size "
                f"= {p.dp} x {p.micro_batch_size}) = {mbs} microbatches per iteration; the simulator plays at most "
                f"{MAX_MICROBATCHES:,} (raise plan.micro_batch_size or plan.dp)"
            )
        elif vpp > 1 and p.pp > 1 and mbs % p.pp and p.schedule not in ("zbv", "dualpipev"):
            # Megatron: "number of microbatches must be divisible by pipeline-model-parallel-size
            # when using interleaved schedule" (the zero-bubble order walks the chunks the same way)
            out.append(
                f"plan.schedule: {p.schedule} with virtual stages needs the number of microbatches ({mbs}) "
                f"to be a multiple of pp ({p.pp})"
            )
        # plain 1F1B runs any number of microbatches: Megatron caps its warm-up at the microbatch
        # count (forward_backward_pipelining_without_interleaving: min(pp - rank - 1, M)), as
        # schedules.build_schedule does; the interleaved and zero-bubble orders need a full round
        # (ZB-V any count: PyTorch's ScheduleZBVZeroBubble builds its order for 2p - 1 and drops
        # the ops of microbatches that are not there)
        if p.schedule in ("interleaved-1f1b", "zero-bubble") and mbs < p.pp:
            out.append(f"plan.schedule: {p.schedule} needs at least pp = {p.pp} microbatches, got {mbs}")
        if p.schedule == "dualpipev" and p.pp > 1 and mbs < 2 * p.pp:
            # PyTorch ScheduleDualPipeV: "DualPipeV requires at least as many microbatches as stages"
            out.append(f"plan.schedule: dualpipev needs at least 2 x pp = {2 * p.pp} microbatches, got {mbs}")
    return out


def _ep_overlap_problems(sc: Scenario) -> list[str]:
    """Megatron-Core's rules for combined 1F1B (TransformerConfig.__post_init__, the
    overlap_moe_expert_parallel_comm block), and the one paraplan adds: it models the schedule
    with ZeRO 0/1 (Megatron's distributed optimizer) only."""
    p, t = sc.plan, sc.training
    if not p.overlap_moe_expert_parallel_comm:
        return []
    key = "plan.overlap_moe_expert_parallel_comm"
    if sc.model.moe is None:
        return [f"{key}: needs an MoE model (model.moe); this model is dense"]
    out = []
    if p.ep < 2:
        out.append(f"{key}: needs expert parallelism, ep > 1 (Megatron-Core); got ep {p.ep}")
    if p.pp > 1 and p.schedule not in ("interleaved-1f1b", "dualpipev"):
        out.append(f"{key}: with pp > 1 needs schedule interleaved-1f1b (Megatron-Core requires virtual "
                   f"pipeline stages) or dualpipev (its overlapped pairs), not {p.schedule}")
    if p.recompute == "full":
        out.append(f"{key}: does not run with recompute full (Megatron-Core); use none or selective")
    if "moe" in p.recomputed_modules:
        out.append(f"{key}: does not run with the moe recompute module, whose recompute re-runs the dispatch "
                   "(Megatron-Core); recompute moe_act, layernorm or core_attn instead")
    if p.moe_shared_expert_overlap:
        out.append(f"{key}: does not run with moe_shared_expert_overlap (Megatron-Core); set one of them false")
    if t.precision not in ("bf16", "fp16", "fp8"):
        out.append(f"{key}: needs 16-bit training (training.precision bf16, fp16 or fp8), not {t.precision}")
    if p.zero_stage > 1:
        out.append(f"{key}: modelled with zero_stage 0 or 1 (Megatron's distributed optimizer); "
                   f"got {p.zero_stage}")
    return out


def _moe_problems(sc: Scenario) -> list[str]:
    m, p = sc.model, sc.plan
    if m.moe is None:
        out = []
        if p.ep != 1:
            out.append("plan.ep: expert parallelism needs an MoE model (model.moe); this model is dense, use ep: 1")
        if p.expert_tp != 1:
            out.append("plan.expert_tp: needs an MoE model (model.moe); this model is dense, use expert_tp: 1")
        if p.moe_dispatcher != "alltoall":
            out.append(f"plan.moe_dispatcher: {p.moe_dispatcher} needs an MoE model (model.moe); this model is dense")
        moe_only = [mod for mod in p.recomputed_modules if mod in MOE_RECOMPUTE_MODULES]
        if moe_only:
            out.append(f"plan.recompute_modules: {', '.join(moe_only)} need an MoE model (model.moe); this model is dense")
        if p.moe_shared_expert_overlap:
            out.append("plan.moe_shared_expert_overlap: needs an MoE model with shared experts; this model is dense")
        return out
    e = m.moe
    out = []
    if p.moe_shared_expert_overlap and not e.num_shared_experts:
        # Megatron-Core TransformerConfig: "moe_shared_expert_overlap only works with shared expert model."
        out.append("plan.moe_shared_expert_overlap: needs shared experts (model.moe.num_shared_experts > 0); "
                   "this model has none")
    if p.moe_shared_expert_overlap and p.moe_dispatcher != "alltoall":
        # Megatron-Core TransformerConfig: "moe_shared_expert_overlap only works with alltoall token
        # dispatcher" (the flex/DeepEP dispatcher's set_shared_experts raises NotImplementedError)
        out.append(f"plan.moe_shared_expert_overlap: works with moe_dispatcher alltoall only, not {p.moe_dispatcher} "
                   "(Megatron-Core); set it false")
    if p.moe_shared_expert_overlap and "shared_experts" in p.recomputed_modules:
        # Megatron-Core TransformerConfig: "shared_experts recompute cannot work with
        # --moe-shared-expert-overlap."
        out.append("plan.recompute_modules: shared_experts cannot be recomputed with plan.moe_shared_expert_overlap "
                   "(Megatron-Core); drop one of them")
    if p.moe_dispatcher == "deepep" and p.ep * p.expert_tp == 1:
        # Megatron-Core MoEFlexTokenDispatcher (DeepEP's): "Flex token dispatcher requires TPxEP > 1"
        out.append("plan.moe_dispatcher: deepep needs ep x expert_tp > 1 (Megatron-Core's flex dispatcher refuses "
                   "one rank); with ep 1 no token leaves its rank: use alltoall")
    if e.num_experts % p.ep:
        out.append(f"plan.ep: {p.ep} does not divide model.moe.num_experts ({e.num_experts})")
    block = p.tp * p.cp * p.dp
    if block % (p.ep * p.expert_tp):
        # Megatron-Core MoE parallel folding: expert_tp x ep x expert-dp = tp x cp x dp
        out.append(f"plan.ep: ep x expert_tp = {p.ep} x {p.expert_tp} does not divide the {block} ranks of a "
                   f"pipeline stage (tp x cp x dp = {p.tp} x {p.cp} x {p.dp})")
    if e.expert_ffn_hidden_size % p.expert_tp:
        out.append(f"plan.expert_tp: {p.expert_tp} does not divide model.moe.expert_ffn_hidden_size "
                   f"({e.expert_ffn_hidden_size})")
    if p.ep > 1 and sc.training.precision == "fp16":
        # Megatron-LM validate_args: "Expert parallelism is not supported with fp16 training."
        out.append("training.precision: fp16 with expert parallelism (plan.ep > 1) is not supported by Megatron-LM; "
                   "use bf16")
    if p.tp > 1 and not p.sequence_parallel:
        # Megatron-Core: "During training, performance may degrade if MoE and tensor parallelism
        # are enabled without also enabling sequence parallelism" -- it requires it.
        out.append("plan.sequence_parallel: MoE with tp > 1 needs sequence_parallel: true (Megatron-Core)")
    return out
