"""Memory per GPU of each pipeline stage: weights, gradients, optimizer states, activations.

Model states follow Rajbhandari et al. 2020 (ZeRO, Sec. 3.1): mixed-precision Adam keeps 16-bit
weights, main gradients (Megatron's DDP grad buffer: fp32, or 16-bit with
training.grad_reduce_dtype), and K = 12 bytes/parameter of fp32
master weights + Adam m and v; ZeRO-1 shards the optimizer states, ZeRO-2 also the gradients,
ZeRO-3 also the weights, over the data-parallel (x context-parallel) group.
Activations follow Korthikanti et al. 2022, Sec. 4 / Table 2, generalised to GQA and SwiGLU.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from paraplan.specs import DTYPE_BYTES

GiB = 1024**3


def gib_pair(need: float, capacity: float) -> tuple[str, str]:
    """Bytes needed and available as GiB with one decimal, or as many more (up to three) as it takes
    for a plan that does not fit not to read as needing what the GPU has (80.02 of 80.00 GiB)."""
    for digits in (1, 2, 3):
        a, b = f"{need / GiB:.{digits}f}", f"{capacity / GiB:.{digits}f}"
        if a != b or need <= capacity:
            break
    return a, b

# Fixed reservation on every GPU: CUDA context (~0.5 GiB), NCCL communicator buffers and cuBLAS
# workspaces (~0.5 GiB together). Stated allowance, not measured per scenario.
RESERVED_BYTES = 1 * GiB
# Caching-allocator fragmentation, as a fraction of the dynamic (activation) bytes.
FRAGMENTATION = 0.10


@dataclass(frozen=True, kw_only=True)
class StageMemory:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    reserved: float
    optimizer_step: float = 0.0
    """Held only during the optimizer step, when the activations are freed: the fp32 copy of
    16-bit main gradients the optimizer works on (Megatron _copy_model_grads_to_main_grads:
    main_param.grad = main_grad.float()), of the parameters this rank updates."""

    @property
    def total(self) -> float:
        """The peak: the backward's (activations live) or the optimizer step's, whichever is higher."""
        during_step = RESERVED_BYTES + self.optimizer_step
        return self.weights + self.gradients + self.optimizer + max(self.activations + self.reserved, during_step)

    def as_dict(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "reserved": self.reserved,
            "optimizer_step": self.optimizer_step,
            "total": self.total,
        }


def state_bytes_per_param(precision: str, grad_dtype: str = "fp32") -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter before ZeRO sharding; the gradients in
    `grad_dtype` (training.grad_reduce_dtype: Megatron-Core's grad buffer is in the reduce dtype,
    param_and_grad_buffer.py)."""
    if precision == "fp32":
        return 4.0, 4.0, 8.0  # fp32 weights and grads, Adam m and v
    # fp16/bf16 weights (also under fp8: FP8_WEIGHT_CACHE), main grads, K=12
    return 2.0, float(DTYPE_BYTES[grad_dtype]), 12.0


# Under fp8 Transformer Engine keeps, per weight of its linear layers, an fp8 copy and (Hopper's
# fp8 GEMMs take TN layouts only) an fp8 transpose, cached across microbatches
# (TransformerEngine module/base.py get_weight_workspace; Megatron passes is_first_microbatch):
# 2 bytes on top of the bf16 weight. The embedding, the LM head and the MoE router are not TE
# linears (Megatron-Core's TopKRouter multiplies by its weight with torch), and a norm's weights
# are no GEMM operand: no cache.
FP8_WEIGHT_CACHE_BYTES = 2.0


def norm_outputs_recomputed(model, recomputed: tuple[str, ...], moe_layer: bool) -> int:
    """How many of a layer's two norm outputs selective recompute leaves unstored. Megatron-Core's
    Transformer Engine layer fuses a norm into the linear it feeds (TELayerNormColumnParallelLinear:
    the input norm into QKV, a dense layer's pre-MLP norm into fc1), builds the fused one as
    IdentityOp, and `layernorm` recomputes only norms that are modules of their own
    (TransformerLayer: recompute_input_layernorm / recompute_pre_mlp_layernorm when not
    IdentityOp; gpt_layer_specs: pre_mlp_layernorm TENorm only with experts, input_layernorm TENorm
    only under MLA, whose down-projections are plain linears). A dense layer's `mlp` checkpoint
    holds its fused pre-MLP norm, which then stores no output either."""
    freed = 0
    if "layernorm" in recomputed:
        freed += moe_layer + (model.mla is not None)
    if "mlp" in recomputed and not moe_layer:
        freed += 1
    return freed


def saved_input_bytes(act_bytes: int, fp8_inputs: bool) -> int:
    """Bytes an element of a linear layer's input saved for its backward: the fp8 copy cast for
    the GEMM under fp8 (activation_bytes_per_layer), else the activations' width."""
    return 1 if fp8_inputs else act_bytes


def activation_bytes_per_layer(model, plan, seq_length: int, attention_kernel: str,
                               moe_ffn_bytes: float | None = None, act_bytes: int = 2, *,
                               fp8_inputs: bool = False) -> float:
    """Stored activations of one layer for one microbatch on one rank (Korthikanti et al. 2022,
    Sec. 4.1 and Table 2, there with 2-byte activations; here with `act_bytes` per element, 4 for
    fp32 training, and 1-byte dropout masks): h-wide tensors (LayerNorm inputs 2 x h, QKV and MLP
    inputs 2 x h elements, two dropout masks 2h bytes) = 10h bytes at 2 bytes, divided by tp only
    under sequence parallelism; tensor-parallel tensors (Q, K, V, attention output, MLP
    intermediates: 24h for GPT's MHA + 4h GELU MLP; the inputs of query/key norms) divided by tp;
    the s^2 softmax terms (5as:
    softmax and dropout outputs, dropout mask) unless the attention is fused (FlashAttention keeps
    only the fp32 logsumexp) or recomputed (selective core_attn: nothing). Full recompute keeps only each
    layer's input (2h). Selective recompute of other modules frees what they would keep: layernorm
    the outputs of the norms that are not fused into a linear (norm_outputs_recomputed: 2h each of
    the 10h), mlp the dense MLP intermediates and its fused norm's output. Without dropout
    (model.dropout 0) there are no masks and no dropout output: the h-wide tensors lose their 2h
    bytes of masks and the unfused softmax terms keep only the softmax output.
    For an MoE layer `moe_ffn_bytes` (this rank's router, dispatch and expert tensors, from
    simulator.moe.moe_activation_bytes, at the activations' width) replaces the dense MLP
    intermediates.
    `fp8_inputs` (fp8 training): a linear layer keeps for its backward the fp8 copy of its input it
    cast for the GEMM, 1 byte an element (Transformer Engine's _Linear and _LayerNormLinear save
    the fp8 input, or its transpose, when fp8 is on: transformer_engine/pytorch/module/linear.py,
    layernorm_linear.py): the norm outputs feeding QKV and fc1, fc2's input, MLA's up-projection
    inputs, and the output projection's input, which a fused attention also keeps at 16 bits for
    its own backward unless it is recomputed. Q, K, V, the norms' inputs and the MLP
    intermediates an activation function reads stay at `act_bytes`."""
    e = act_bytes
    g = saved_input_bytes(act_bytes, fp8_inputs)
    t = plan.tp
    s = seq_length // plan.cp
    tokens = plan.micro_batch_size * s
    h, f = model.hidden_size, model.ffn_hidden_size
    a = model.num_attention_heads
    sp = t if plan.sequence_parallel else 1
    if plan.recompute == "full":
        return tokens * e * h / sp
    recomputed = plan.recomputed_modules
    masks = 2 if model.dropout else 0  # the two bias-dropout-adds' 1-byte masks
    moe = moe_ffn_bytes is not None
    # the two norms' inputs, and their outputs (QKV's and fc1's inputs) unless recomputed
    h_wide = (2 * e + (2 - norm_outputs_recomputed(model, recomputed, moe)) * g + masks) * h / sp
    mlp_mats = model.ffn_matrices - 1
    mlp = (e * mlp_mats * f + g * f) / t if not moe and "mlp" not in recomputed else 0.0
    # the attention output: the output projection's input, and a fused attention's own (one tensor at 16 bits)
    kept_by_attention = attention_kernel != "unfused" and "core_attn" not in recomputed
    o_width = e if g == e else g + (e if kept_by_attention else 0)
    if kept_by_attention and plan.cp > 1 and plan.cp_comm_type == "all_gather":
        # Transformer Engine's AttnFuncWithCPAndKVAllGather saves its two chunks' outputs
        # (out_per_step) for the backward and returns a copy of its own, which the output projection saves
        o_width += e
    tp_sharded = (e * (model.q_channels + model.k_channels + model.v_channels) + o_width * model.o_channels) / t + mlp
    if model.qk_layernorm:  # the query and key norms keep their inputs
        tp_sharded += e * (model.q_channels + model.k_channels) / t
    # MLA keeps each latent twice (its norm's input and the up-projection's input), SP-sharded
    latents = (e + g) * model.latent_channels / sp
    if "core_attn" in recomputed:  # the checkpoint keeps q, k and v (counted above), nothing of its own
        scores = 0.0
    elif attention_kernel != "unfused":  # flash, flash3
        scores = 4 * a / t  # fp32 logsumexp per head
    else:
        scores = unfused_scores_bytes(model, plan, seq_length, e)
    return tokens * (h_wide + tp_sharded + latents + scores) + (moe_ffn_bytes or 0.0)


def unfused_scores_bytes(model, plan, seq_length: int, act_bytes: int) -> float:
    """Per token on one rank, the s^2 terms of an unfused attention (Korthikanti et al. 2022, 5as/h):
    softmax out (e), dropout mask (1), dropout out (e); without dropout AV reads the softmax out."""
    per_head = (2 * act_bytes + 1) if model.dropout else act_bytes
    return per_head * model.num_attention_heads * seq_length / plan.tp


def stage_memory(
    *,
    plan,
    precision: str,
    grad_dtype: str = "fp32",
    dense_params: float,
    expert_params: float = 0.0,
    max_layer_params: float,
    activations: float,
    working_set: float = 0.0,
    prefetched_params: float | None = None,
    uncached_params: float = 0.0,
) -> StageMemory:
    """Memory of one rank of a stage.
    `dense_params`: parameters this rank holds whose states shard over dp x cp (already divided by
    tp); `expert_params`: its local experts, whose states shard over the expert-data-parallel group
    (dp x cp x tp / (ep x expert_tp), Megatron-Core parallel folding); `activations`: the peak of
    microbatches in flight x their activation bytes, read off the schedule; `working_set`:
    transient buffers on top (the layer being recomputed, logits, all-to-all buffers);
    `max_layer_params`: under ZeRO-2/3, the sharded parameters of the largest unit this rank
    reduces (ZeRO-3: and gathers): a layer, or the embedding / LM head on the stages holding them;
    0 where nothing is sharded;
    `prefetched_params`: the unit gathered beside it (a layer; default the same size);
    `uncached_params`: the part of `dense_params` with no fp8 cache: the embedding / LM head, the
    norms and the routers (FP8_WEIGHT_CACHE_BYTES);
    `grad_dtype`: training.grad_reduce_dtype, the gradients' dtype; 16-bit gradients get an fp32 copy
    of the rank's optimizer shard during the step (StageMemory.optimizer_step)."""
    w, g, o = state_bytes_per_param(precision, grad_dtype)
    shard = plan.dp * plan.cp
    expert_shard = max(1, plan.tp * plan.cp * plan.dp // (plan.ep * plan.expert_tp))
    zero = plan.zero_stage

    def states(params: float, n: int) -> tuple[float, float, float]:
        weights, grads, optim = params * w, params * g, params * o
        if zero >= 1:
            optim /= n
        if zero >= 2:
            grads /= n
        if zero >= 3:
            weights /= n
        return weights, grads, optim

    dw, dg, do = states(dense_params, shard)
    ew, eg, eo = states(expert_params, expert_shard)
    weights, grads = dw + ew, dg + eg
    if zero >= 2:
        # a unit's full gradient until its reduce-scatter (Zhao et al., "PyTorch FSDP", VLDB 2023,
        # Sec. 3; ZeRO-2 reduces each unit as its backward produces it, like ZeRO-3)
        grads += max_layer_params * g
    prefetched = max_layer_params if prefetched_params is None else prefetched_params
    if zero >= 3:
        # the current and the prefetched unit gathered in full (FSDP prefetch)
        weights += (max_layer_params + prefetched) * w
    if precision == "fp8":
        # TE's fp8 caches of the linear weights: all of them, or under ZeRO-3 those of the two
        # gathered layers (a sharded weight is cast when gathered) and of the weights ZeRO-3 leaves
        # whole, which stay resident (experts whose expert-data-parallel group is one rank, every
        # weight when dp x cp is 1); the embedding, the norms and the routers have none
        resident = expert_params * (expert_shard == 1) + (dense_params - uncached_params) * (shard == 1)
        cached = 2 * prefetched + resident if zero >= 3 else dense_params - uncached_params + expert_params
        weights += cached * FP8_WEIGHT_CACHE_BYTES
    acts = activations + working_set
    reserved = RESERVED_BYTES + FRAGMENTATION * acts
    # the optimizer's fp32 copy of the 16-bit gradients of the parameters whose states this rank holds
    step_copy = 4.0 * (do + eo) / o if g < 4 else 0.0
    return StageMemory(weights=weights, gradients=grads, optimizer=do + eo, activations=acts, reserved=reserved,
                       optimizer_step=step_copy)


# the cross-entropy keeps its softmax over the vocabulary in fp32 (Megatron-Core
# tensor_parallel/cross_entropy.py: the logits cast to float, exponentiated and normalised in place,
# ctx.save_for_backward(exp_logits, ...))
CE_SOFTMAX_BYTES = 4


def unrecomputed_activation_bytes(model, plan, seq_length: int, attention_kernel: str,
                                  moe_ffn_bytes: float | None = None, act_bytes: int = 2, *,
                                  fp8_inputs: bool = False) -> float:
    """A layer's activations as stored without recompute (activation_bytes_per_layer under
    recompute none; an MoE layer's `moe_ffn_bytes` are those it keeps unrecomputed): what
    recomputing the whole layer rebuilds."""
    return activation_bytes_per_layer(model, replace(plan, recompute="none"), seq_length, attention_kernel,
                                      moe_ffn_bytes=moe_ffn_bytes, act_bytes=act_bytes, fp8_inputs=fp8_inputs)


def cp_exchange_working_bytes(model, plan, seq_length: int, act_bytes: int, a2a: int) -> float:
    """What a layer's context-parallel exchange holds while its attention runs, on top of the stored
    activations, by plan.cp_comm_type (Transformer Engine's context_parallel.py): p2p keeps every
    K/V chunk the ring brought in until the forward returns (p2p_comm_buffers: cp chunks, the whole
    sequence's K and V) and every step's partial output until they are merged after the ring
    (out_per_step: cp outputs of the rank's slice on the last rank, whose steps all see all its
    queries), and two K/V + dK/dV buffers in the backward; all_gather the gathered K and V and
    their reordered copy in the forward, the gathered K and V and the whole sequence's dK and dV in
    the backward; a2a about three copies of the rank's Q, K and V while they are exchanged; a2a+p2p
    the exchanged Q, K and V with its ring's buffers, whose chunks are as large as p2p's, or its
    all-to-alls' copies, whichever is more. (The attention's output itself is a stored activation,
    activation_bytes_per_layer.) `a2a`: the CP ranks of an all-to-all group
    (paraplan.placement.cp_split: 1 for p2p, cp for a2a)."""
    if plan.cp == 1:
        return 0.0
    local = plan.micro_batch_size * seq_length // plan.cp * act_bytes / plan.tp  # one channel of the rank's slice
    kv = local * (model.k_channels + model.v_channels)
    if plan.cp_comm_type == "all_gather":
        return 2 * plan.cp * kv
    ring = plan.cp // a2a
    qkv = local * model.q_channels + kv
    # TE's flash_attn_a2a_communicate: each of Q, K, V is laid out contiguous in send order (one
    # copy), received (a second) and moved back to the kernel's layout (a third) while the caller's
    # tensor stays referenced
    exchanged = 3 * qkv if a2a > 1 else 0.0
    # a2a+p2p: the exchanged q, k and v stay referenced while the ring runs
    ringed = ((qkv if a2a > 1 else 0.0) + max(ring * (kv + local * model.o_channels), 4 * kv)) if ring > 1 else 0.0
    return max(exchanged, ringed)


def recompute_working_bytes(model, plan, seq_length: int, attention_kernel: str, act_bytes: int = 2,
                            moe_ffn_bytes: float | None = None, *, fp8_inputs: bool = False) -> float:
    """What recomputing one layer holds during its backward, on top of the stored activations: under
    full recompute the layer's full activations (a dense layer's, or with `moe_ffn_bytes` an MoE
    layer's, whose FFN tensors replace the dense MLP's); under selective recompute of the dense
    `mlp` its intermediates and its fused norm's output (an MoE layer's recomputed `moe` part is
    `moe_ffn_bytes`, passed by the caller only when it is recomputed), and of an unfused attention
    core its s^2 tensors. One layer at a time: a stage's working set takes the largest over the
    kinds of layer it holds."""
    if plan.recompute == "full":
        return unrecomputed_activation_bytes(model, plan, seq_length, attention_kernel, moe_ffn_bytes, act_bytes,
                                             fp8_inputs=fp8_inputs)
    tokens = plan.micro_batch_size * seq_length // plan.cp
    # the modules of a layer are recomputed one at a time, each just before its own backward
    attention = 0.0
    if attention_kernel == "unfused" and "core_attn" in plan.recomputed_modules:
        # the s^2 softmax (and dropout) tensors the stored activations leave out (Korthikanti Sec. 5)
        attention = tokens * unfused_scores_bytes(model, plan, seq_length, act_bytes)
    if moe_ffn_bytes is not None:
        return max(attention, moe_ffn_bytes)
    if "mlp" in plan.recomputed_modules:  # its intermediates and its fused norm's output
        sp = plan.tp if plan.sequence_parallel else 1
        g = saved_input_bytes(act_bytes, fp8_inputs)  # fc1's and fc2's
        f = model.ffn_hidden_size
        return max(attention, tokens * ((act_bytes * (model.ffn_matrices - 1) + g) * f / plan.tp
                                        + g * model.hidden_size / sp))
    return attention


def logits_bytes(model, plan, seq_length: int, bytes_per_element: float) -> float:
    """One microbatch of logits over the (tp-sharded) vocabulary on the last stage, and as many
    again per multi-token prediction module (their losses are computed in the same forward). At
    the activations' width it is the LM head's 16-bit GEMM output, a transient the cross-entropy
    frees once it has cast it to fp32; at CE_SOFTMAX_BYTES it is the softmax the cross-entropy
    saves for its backward, held per microbatch in flight (simulator.simulate)."""
    tokens = plan.micro_batch_size * seq_length // plan.cp
    return (1 + model.mtp_layers) * tokens * model.vocab_shard(plan.tp) * bytes_per_element
