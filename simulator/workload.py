"""Per-rank cost of one transformer layer, the embedding and the LM head, forward and backward.

Shapes follow Megatron-LM's tensor-parallel layer (Shoeybi et al. 2019, Fig. 3): QKV and the MLP
up-projection are column-parallel, the attention output projection and MLP down-projection are
row-parallel. Each piece is costed on the hardware models and kept apart so the breakdown can say
where time went. Everything here is per microbatch, per rank of one pipeline stage.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from hwmodels.compute import (GELU_BACKWARD, NORM_BACKWARD, ROTARY_BACKWARD, SWIGLU_BACKWARD, attention_time, gemm_time,
                              memory_bound_time, unfused_attention_time)
from hwmodels.network import COMM_SM_SHARE, collective_time, overlapped
from paraplan.placement import GroupLayout, cp_split
from paraplan.specs import DTYPE_BYTES
from simulator.schedules import SPLIT_BACKWARD_SCHEDULES
from simulator.cost import Cost
from simulator.memory import norm_outputs_recomputed

@dataclass(frozen=True)
class LayerContext:
    """Everything a layer's cost depends on, resolved once per simulation."""

    model: object
    plan: object
    gpu: object
    network: object
    seq_length: int
    dtype: str
    attention_kernel: str
    tp_layout: object
    cp_layout: object
    grad_bytes: int = 4
    """Bytes per element of the main gradient every microbatch adds into (training.grad_reduce_dtype):
    4 for fp32 (Megatron's DDP grad buffer under bf16), 2 when gradients accumulate in 16 bits."""
    cp_groups: tuple | None = None
    """Hierarchical context parallelism (cp_comm_type a2a+p2p): (a2a, ring, the all-to-all group's
    layout, the ring's), paraplan.placement.cp_split and cp_group_layouts; None: cp_groups_of
    derives the single-level ones from cp_layout."""

    @property
    def tokens(self) -> int:
        """Tokens a rank's GEMMs see: the microbatch, split by context parallelism."""
        return self.plan.micro_batch_size * self.seq_length // self.plan.cp

    @property
    def act_bytes(self) -> int:
        return 2 if self.dtype == "fp8" else DTYPE_BYTES[self.dtype]


def linear_time(ctx: LayerContext, k: int, n: int, backward: bool, tokens: float | None = None, *,
            cast_input: bool = True, cast_grad: bool = True) -> float:
    """A linear layer y = x W with x (tokens, k), W (k, n); `tokens` defaults to the microbatch's
    (ctx.tokens). Backward is dgrad (tokens, n)x(n, k) plus wgrad (k, tokens)x(tokens, n), each as
    many FLOPs as the forward (2x total). Under fp8, plus the casts of its 16-bit operands
    (fp8_cast_time): x in the forward unless not `cast_input` (Transformer Engine's LayerNormLinear
    writes the norm's output in fp8 itself), dY in the backward unless not `cast_grad` (a grouped
    GEMM casts all experts' operands at once)."""
    m = ctx.tokens if tokens is None else tokens
    if not backward:
        return gemm_time(ctx.gpu, m, n, k, ctx.dtype) + (fp8_cast_time(ctx, m * k) if cast_input else 0.0)
    return (gemm_time(ctx.gpu, m, k, n, ctx.dtype) + _weight_grad_gemm(ctx, k, n, m)
            + (fp8_cast_time(ctx, m * n) if cast_grad else 0.0))


FP8_CAST_BYTES = 4
"""Bytes per element of casting a 16-bit activation or gradient to fp8 for a GEMM: read 2, write
the fp8 copy the GEMM reads (1) and its transpose, which the weight-gradient GEMM reads (1)
(Transformer Engine's fused cast_transpose, transformer_engine/common/transpose/cast_transpose.cu;
Linear casts its input in the forward and grad_output in the backward)."""


def fp8_cast_time(ctx: LayerContext, elements: float) -> float:
    """Seconds to cast `elements` 16-bit values to fp8 for an fp8 GEMM (FP8_CAST_BYTES each); 0
    unless the layer's GEMMs run in fp8. The weights' casts (once per step, cached across
    microbatches) are left out."""
    if ctx.dtype != "fp8" or elements <= 0:
        return 0.0
    return memory_bound_time(ctx.gpu, elements * FP8_CAST_BYTES)


def _weight_grad_gemm(ctx: LayerContext, k: int, n: int, tokens: float | None = None) -> float:
    """dW of the linear layer x (tokens, k) @ W (k, n) on the microbatch's tokens by default."""
    return weight_grad_time(ctx, k, n, ctx.tokens if tokens is None else tokens)


MAIN_GRAD_BYTES = 4
"""Bytes per element of an fp32 main gradient (memory.py's gradient bytes, Megatron's DDP grad
buffer), the default; LayerContext.grad_bytes is the scenario's."""


def main_grad_add_bytes(grad_bytes: int, main_bytes: int) -> int:
    """Bytes per element of the hook that adds a gradient of `grad_bytes` per element into a main
    gradient of `main_bytes` (main_grad.add_(grad): read grad_bytes + main_bytes, write main_bytes;
    with 16-bit main gradients it is autograd's accumulation into .grad, 3 x 2 bytes)."""
    return grad_bytes + 2 * main_bytes


def weight_grad_time(ctx: LayerContext, k: int, n: int, tokens: int) -> float:
    """dW = x^T dY of the linear layer x (tokens, k) @ W (k, n), a (k, tokens) x (tokens, n) GEMM,
    and its accumulation into the main gradient (ctx.grad_bytes per element, fp32 by default):
    - plan.fused_grad_accumulation (Megatron --gradient-accumulation-fusion; Transformer Engine's
      fuse_wgrad_accumulation): the GEMM accumulates into main_grad itself (beta = 1,
      megatron/core/tensor_parallel/layers.py: fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32,
      wgrad_gemm_accum_fp16 for 16-bit main gradients), reading and writing it;
    - without it: the GEMM writes the gradient in the activation dtype and the parameter's gradient
      hook adds it into main_grad in a kernel of its own (main_grad.add_(grad): read w + g, write g;
      Megatron-LM before the fusion, e.g. megatron/mpu/layers.py of its 2021-22 sequence-parallel
      work, returns grad_weight = grad_output.t().matmul(input) to autograd)."""
    if ctx.plan.fused_grad_accumulation:
        return gemm_time(ctx.gpu, k, n, tokens, ctx.dtype, out_bytes=2 * ctx.grad_bytes)
    w = ctx.act_bytes  # fp8 GEMMs write a 16-bit gradient
    return (gemm_time(ctx.gpu, k, n, tokens, ctx.dtype, out_bytes=w)
            + memory_bound_time(ctx.gpu, k * n * main_grad_add_bytes(w, ctx.grad_bytes)))


def _attention_shapes(ctx: LayerContext) -> list[tuple[int, int, float]]:
    """(k, n, tokens) of the attention projections on one TP rank (model.attention_linears): a
    column-parallel layer's n and a row-parallel one's k divided by tp; a replicated one (MLA's
    down-projections) runs whole on the h-wide tokens, tokens/tp under sequence parallelism."""
    tp = ctx.plan.tp
    out = []
    for k, n, mode in ctx.model.attention_linears():
        if mode == "replicated":
            out.append((k, n, _h_wide_tokens(ctx)))
        else:
            out.append((k // tp, n, ctx.tokens) if mode == "row" else (k, n // tp, ctx.tokens))
    return out


def _mlp_shapes(ctx: LayerContext) -> list[tuple[int, int]]:
    """(k, n) of the dense MLP's up (+gate) and down projections on one TP rank."""
    return mlp_linear_shapes(ctx.model, ctx.model.ffn_hidden_size // ctx.plan.tp)


def mlp_linear_shapes(model, width: int) -> list[tuple[int, int]]:
    """(k, n) of an MLP's up (+gate) and down projections with intermediate `width` on one rank:
    the dense MLP, a routed expert, the shared experts."""
    h = model.hidden_size
    return [(h, (model.ffn_matrices - 1) * width), (width, h)]


def cp_groups_of(ctx: LayerContext) -> tuple:
    """(a2a, ring, all-to-all group layout, ring layout) of the plan's context parallelism: a2a CP
    ranks exchange heads by all-to-all, ring of those groups pass K/V round a ring (a2a x ring = cp):
    p2p and all_gather (1, cp), a2a (cp, 1), a2a+p2p as LayerContext.cp_groups says."""
    if ctx.cp_groups is not None:
        return ctx.cp_groups
    assert ctx.plan.cp == 1 or ctx.plan.cp_comm_type != "a2a+p2p", "a2a+p2p needs LayerContext.cp_groups"
    a2a, ring = cp_split(ctx.plan, ctx.model, ctx.network.gpus_per_node)
    single = GroupLayout(size=1, ranks_per_node=1, num_nodes=1)  # a level of one rank exchanges nothing
    return a2a, ring, ctx.cp_layout if a2a > 1 else single, ctx.cp_layout if ring > 1 else single


def _attention_core(ctx: LayerContext, backward: bool) -> float:
    """Softmax(QK^T)V for this rank's heads, as plan.cp_comm_type runs it under context parallelism
    (Transformer Engine, transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py).
    Each rank owns s/cp queries, 2 chunks of the 2cp-chunk causal load balance (DualChunkSwap):
    - p2p (AttnFuncWithCPAndKVP2P): cp kernels, one per ring step: the diagonal step a causal
      (s/cp)^2 block, the others (s/cp) x (s/2cp) unmasked ones, all of the same FLOPs. So cp calls
      of a causal (s/cp)^2 attention, together 1/cp of the full causal work, each at its own size.
    - all_gather (AttnFuncWithCPAndKVAllGather): one call per local chunk, s/2cp queries against
      the gathered keys up to that chunk (bottom-right causal): (r + 1) and (2cp - r) chunks of keys
      on rank r. Every rank has the same FLOPs but not the same shapes; the slowest rank's pair.
    - a2a (AttnFuncWithCPAndQKVOA2A): one causal call over the whole sequence with 1/cp of the
      rank's heads.
    - a2a+p2p (AttnFuncWithCPAndKVP2P over hierarchical groups): the all-to-all gives each rank
      s/ring tokens of 1/a2a of its heads, and the ring runs as p2p over ring ranks."""
    p = ctx.plan
    if p.cp > 1 and p.cp_comm_type == "all_gather":
        chunk = ctx.seq_length // (2 * p.cp)
        return max(_attention_call(ctx, backward, chunk, (r + 1) * chunk)
                   + _attention_call(ctx, backward, chunk, (2 * p.cp - r) * chunk) for r in range(p.cp))
    a2a, ring, _, _ = cp_groups_of(ctx)
    return ring * _attention_call(ctx, backward, ctx.seq_length // ring, ctx.seq_length // ring, heads_split=a2a)


def _attention_call(ctx: LayerContext, backward: bool, q_len: int, kv_len: int, heads_split: int = 1) -> float:
    """One causal (bottom-right aligned) attention kernel of q_len queries and kv_len keys over this
    TP rank's heads, or 1/heads_split of them."""
    m, p = ctx.model, ctx.plan
    if ctx.attention_kernel == "unfused":
        fn = partial(unfused_attention_time, dropout=bool(m.dropout))
    else:
        fn = partial(attention_time, kernel=ctx.attention_kernel)
    return fn(
        ctx.gpu,
        batch=p.micro_batch_size,
        heads=m.num_attention_heads // p.tp // heads_split,
        q_len=q_len,
        kv_len=kv_len,
        # QK^T runs over q_head_dim, AV over v's; their mean gives the FLOPs (equal but for MLA)
        head_dim=(m.q_head_dim + m.o_channels // m.num_attention_heads) / 2,
        dtype=ctx.dtype,
        causal=True,
        backward=backward,
    )


def _memory_bound(ctx: LayerContext, kernels: list[tuple[float, float]], backward: bool) -> float:
    """Memory-bound kernels, each (forward bytes, backward bytes over forward's)."""
    return sum(memory_bound_time(ctx.gpu, nbytes * (factor if backward else 1)) for nbytes, factor in kernels)


def _h_wide_tokens(ctx: LayerContext) -> float:
    """Tokens the h-wide kernels (norms, residuals) see: tokens/tp under sequence parallelism."""
    return ctx.tokens / (ctx.plan.tp if ctx.plan.sequence_parallel else 1)


def _attention_elementwise(ctx: LayerContext, backward: bool) -> float:
    """Bytes per token after Korthikanti et al. 2022 Sec. 4.1: the input LayerNorm reads and writes
    h; the bias-dropout-add reads 2h and writes h plus a 1-byte mask; rotary embeddings (model.rotary:
    the Llama family's, or a config's rope) rotate q and k (read + write). MLA also normalises its latents (read + write, on
    the h-wide tokens) and rotates only the rotary parts: qk_rope_head_dim per query head and one
    shared key of that width. With model.qk_layernorm the queries and keys of this rank's heads are
    normalised too (read + write; Megatron-Core SelfAttention q_layernorm / k_layernorm)."""
    m, p, b = ctx.model, ctx.plan, ctx.act_bytes
    kernels = [(_norm_bytes(ctx), NORM_BACKWARD), _residual(ctx)]
    qk = ctx.tokens * 2 * (m.q_channels + m.kv_channels) // p.tp * b  # read + write this rank's q and k
    if m.qk_layernorm:
        kernels.append((qk, NORM_BACKWARD))
    if m.mla is not None:
        kernels.append((_h_wide_tokens(ctx) * 2 * m.latent_channels * b, NORM_BACKWARD))
        rope = m.mla.qk_rope_head_dim
        kernels.append((ctx.tokens * 2 * (m.num_attention_heads // p.tp + 1) * rope * b, ROTARY_BACKWARD))
    elif m.rotary:
        kernels.append((qk, ROTARY_BACKWARD))
    return _memory_bound(ctx, kernels, backward)


def ffn_norm_residual(ctx: LayerContext, backward: bool) -> float:
    """What the FFN sublayer runs outside its MLP (Korthikanti et al. 2022 Sec. 4.1): the
    post-attention LayerNorm (reads and writes h) and the bias-dropout-add (reads 2h, writes h plus
    a 1-byte mask) on the h-wide tokens. Megatron-Core keeps the residual outside the `mlp` and
    `moe` modules (TransformerLayer: pre_mlp_layernorm, mlp, mlp_bda), and the norm outside `moe`;
    a dense layer's norm is fused into the MLP's fc1, so recomputing `mlp` re-runs it
    (selective_recompute)."""
    return _memory_bound(ctx, [(_norm_bytes(ctx), NORM_BACKWARD), _residual(ctx)], backward)


def _norm_bytes(ctx: LayerContext) -> float:
    """One LayerNorm/RMSNorm forward on the h-wide tokens: reads and writes h."""
    return _h_wide_tokens(ctx) * 2 * ctx.model.hidden_size * ctx.act_bytes


def _residual(ctx: LayerContext) -> tuple[float, float]:
    """One bias-dropout-add on the h-wide tokens, (forward bytes, backward over forward): it reads
    2h and writes h plus a 1-byte mask. Backward, the residual branch takes the incoming gradient as
    it is; with dropout the other branch's gradient is masked (read the gradient and the mask, write
    2h + 1 bytes a token); with a bias (model.linear_bias) autograd reduces the bias gradient the
    fused function returns at full size (read h); and where the residual stream forked, at the
    sublayer's input, autograd adds the two branches' gradients (read 2h, write h; Megatron-Core
    TransformerLayer feeds the sublayer's input to its norm and keeps it as the residual)."""
    h, b = ctx.model.hidden_size, ctx.act_bytes
    mask = h if ctx.model.dropout else 0
    forward = 3 * h * b + mask
    backward = 3 * h * b + (2 * h * b + mask if ctx.model.dropout else 0) + (h * b if ctx.model.linear_bias else 0)
    return _h_wide_tokens(ctx) * forward, backward / forward


def activation_time(ctx: LayerContext, tokens: float, width: int, backward: bool, *, bias: bool = False) -> float:
    """The activation over a tokens x `width` intermediate (the dense MLP, an expert, the shared
    experts): GELU reads f and writes f; SwiGLU reads the gate and up halves, 2f, and writes f.
    `bias`: the first linear's bias is added in the activation (Megatron bias_gelu / bias_swiglu),
    whose backward returns the bias gradient at full size for autograd to reduce over the tokens:
    one more read of f (megatron/core/fusions/fused_bias_gelu.py GeLUFunction.backward)."""
    swiglu = ctx.model.activation == "swiglu"
    act = (3 if swiglu else 2) * width * ctx.act_bytes
    kernels = [(tokens * act, SWIGLU_BACKWARD if swiglu else GELU_BACKWARD)]
    if bias and backward:  # the bias of fc1's output: f wide, 2f for SwiGLU's gate and up halves
        kernels.append((tokens * (2 if swiglu else 1) * width * ctx.act_bytes, 1.0))
    return _memory_bound(ctx, kernels, backward)


def _tp_transfers(ctx: LayerContext, linears: list[tuple[int, int, str]]) -> list[tuple[str, float]]:
    """(mode, bytes) of each linear layer's TP collective: the h-wide tokens after a row-parallel
    layer, its k-wide input before a column-parallel one. A column-parallel layer fed by a
    replicated one (MLA's latents) gathers that latent, not h (Megatron-Core MLASelfAttention: the
    down-projections run on the sequence-parallel shard)."""
    h = ctx.model.hidden_size
    return [(mode, ctx.tokens * (h if mode == "row" else k) * ctx.act_bytes) for k, _, mode in linears]


def _tp_collectives(ctx: LayerContext, transfers: list[tuple[str, float]]) -> list[float]:
    """Tensor-parallel collectives of a chain of linear layers in one direction, one per layer: with
    sequence parallelism an all-gather of the input before a column-parallel GEMM and a
    reduce-scatter after a row-parallel one (Korthikanti et al. 2022, Sec. 4.2.2, Fig. 5); without
    it an all-reduce after each row-parallel GEMM (Shoeybi et al. 2019). The backward mirrors them
    (same sizes and algorithms)."""
    if ctx.plan.tp == 1:
        return [0.0] * len(transfers)
    out = []
    for mode, nbytes in transfers:
        if mode == "replicated":
            out.append(0.0)
        elif ctx.plan.sequence_parallel:
            op = "reduce_scatter" if mode == "row" else "all_gather"
            out.append(collective_time(ctx.network, op, nbytes, ctx.tp_layout))
        else:
            out.append(collective_time(ctx.network, "all_reduce", nbytes, ctx.tp_layout) if mode == "row" else 0.0)
    return out


def _backward_collectives(ctx: LayerContext, transfers: list[tuple[str, float]]) -> list[float]:
    """The backward's TP collectives, one per layer, as Megatron's
    LinearWithGradAccumulationAndAsyncCommunication.backward runs them: a column-parallel layer's
    input gradient (its k-wide input's size) reduce-scattered, or all-reduced without sequence
    parallelism; a row-parallel layer's output gradient all-gathered under sequence parallelism,
    nothing without. For the usual chain (a column layer's input h wide) the same collectives as
    the forward's in another order; MLA's up-projections reduce their latent-wide inputs'
    gradients, not h."""
    if ctx.plan.tp == 1:
        return [0.0] * len(transfers)
    sp, net, lay = ctx.plan.sequence_parallel, ctx.network, ctx.tp_layout
    out = []
    for mode, nbytes in transfers:
        if mode == "column":
            out.append(collective_time(net, "reduce_scatter" if sp else "all_reduce", nbytes, lay))
        elif mode == "row" and sp:
            out.append(collective_time(net, "all_gather", nbytes, lay))
        else:
            out.append(0.0)
    return out


def _attention_transfers(ctx: LayerContext) -> list[tuple[str, float]]:
    """The attention projections' TP transfers (model.attention_linears); MLA's key/value latent is
    gathered with the shared rotary key (kv_lora_rank + qk_rope_head_dim)."""
    linears = ctx.model.attention_linears()
    if ctx.model.mla is not None:  # [..., kv down, kv up, output]
        k, n, mode = linears[-2]
        linears[-2] = (k + ctx.model.mla.qk_rope_head_dim, n, mode)
    return _tp_transfers(ctx, linears)


def mlp_transfers(ctx: LayerContext) -> list[tuple[str, float]]:
    """An MLP's TP transfers (column-parallel up, row-parallel down): the dense MLP's, and the
    shared experts' (the same tensor-parallel layout)."""
    h = ctx.model.hidden_size
    return _tp_transfers(ctx, [(h, 0, "column"), (h, h, "row")])


def _cp_exchange(ctx: LayerContext, backward: bool) -> Cost:
    """The context-parallel exchange of one attention core, forward or backward, by
    plan.cp_comm_type (Transformer Engine's context_parallel.py; see _attention_core):
    - p2p: cp-1 ring steps, each sending this rank's K and V chunk to the next rank while
      computing on the current one; the backward also returns dK, dV (twice the bytes). Only the
      part not hidden behind a step's attention is exposed; the hidden part slows that compute by
      COMM_SM_SHARE of itself.
    - all_gather: an all-gather of K and one of V over the whole sequence, exposed (TE: "KV
      all-gather between CP ranks is exposed"); the backward gathers them again (they are not
      saved) and reduce-scatters dK and dV, exposed too.
    - a2a: all-to-alls of Q, K and V before the attention and of its output after, exposed; the
      backward's of the output and its gradient, then of dQ, dK and dV.
    - a2a+p2p: a2a's all-to-alls over each group of a2a ranks, then p2p's ring over the groups, its
      K/V chunks as large as p2p's (s/ring tokens of 1/a2a of the heads).
    A transfer between nodes holds the NIC, hidden or not (Cost.nic), and the engine shares the
    NIC with it."""
    p, m = ctx.plan, ctx.model
    cost = Cost()
    if p.cp == 1:
        return cost
    local = ctx.tokens * ctx.act_bytes / p.tp  # bytes per channel of this rank's slice of the sequence

    def book(layout, exposed: float, on_links: float) -> None:
        cost.add("cp_comm", exposed)
        if layout.num_nodes > 1:
            cost.add_nic("cp_comm", on_links)

    def each(op: str, layout, *nbytes: float) -> float:
        return sum(collective_time(ctx.network, op, b, layout) for b in nbytes)

    if p.cp_comm_type == "all_gather":
        k_all, v_all = p.cp * local * m.k_channels, p.cp * local * m.v_channels  # gathered (nccl-tests size)
        t = each("all_gather", ctx.cp_layout, k_all, v_all)
        t += each("reduce_scatter", ctx.cp_layout, k_all, v_all) if backward else 0.0
        book(ctx.cp_layout, t, t)
        return cost
    a2a, ring, a2a_layout, ring_layout = cp_groups_of(ctx)
    if a2a > 1:  # each tensor's all-to-all in turn (nccl-tests size: the rank's send buffer)
        q, k, v, o = (local * c for c in (m.q_channels, m.k_channels, m.v_channels, m.o_channels))
        t = each("all_to_all", a2a_layout, *((o, o, q, k, v) if backward else (q, k, v, o)))
        book(a2a_layout, t, t)
    if ring > 1:
        kv_bytes = local * (m.k_channels + m.v_channels) * (2 if backward else 1)
        step_comm = collective_time(ctx.network, "send_recv", kv_bytes, ring_layout)
        step = ctx.seq_length // ring
        step_compute = _attention_call(ctx, backward, step, step, heads_split=a2a)
        book(ring_layout, (ring - 1) * (overlapped(step_compute, step_comm) - step_compute), (ring - 1) * step_comm)
    return cost


def tp_exposed(ctx: LayerContext, transfers: list[tuple[str, float]], shapes: list[tuple[int, int, float]],
               gemms: list[float], backward: bool, userbuffers: bool = True) -> float:
    """Exposed TP communication of a chain of linear layers (their GEMM times `gemms`, shapes
    (k, n, tokens)): with --tp-comm-overlap, for the layers it reaches (`userbuffers`), see
    _chunked_exposed; else the backward's asynchronous collectives (_async_backward_exposed) when
    plan.tp_backward_overlap, and every collective otherwise. The backward includes the
    sequence-parallel re-gathers of the column-parallel layers' inputs (_input_regathers)."""
    p = ctx.plan
    regathers = _input_regathers(ctx, transfers, shapes, gemms) if backward else []
    if p.tp_comm_overlap and userbuffers:
        exposed = _chunked_exposed(ctx, _tp_collectives(ctx, transfers), _hiding_gemms(ctx, shapes, gemms, backward))
        # Transformer Engine's bulk overlap of the re-gather with the input-gradient GEMM
        # (LayerNormLinear/Linear backward, ub_bulk_dgrad)
        return exposed + sum(overlapped(dgrad, c) - dgrad for c, dgrad in regathers)
    if backward and p.tp_backward_overlap and p.tp > 1:
        return _async_backward_exposed(ctx, transfers, shapes, regathers)
    collectives = _backward_collectives(ctx, transfers) if backward else _tp_collectives(ctx, transfers)
    return sum(collectives) + sum(c for c, _ in regathers)


def _input_regathers(ctx: LayerContext, transfers: list[tuple[str, float]], shapes: list[tuple[int, int, float]],
                     gemms: list[float]) -> list[tuple[float, float]]:
    """(all-gather seconds, input-gradient GEMM seconds) per column-parallel layer whose backward
    re-gathers its saved input: under sequence parallelism the forward keeps only the 1/tp shard it
    gathered, and the weight gradient needs it whole (Korthikanti et al. 2022, Sec. 4.2.2;
    LinearWithGradAccumulationAndAsyncCommunication.backward)."""
    p = ctx.plan
    if p.tp == 1 or not p.sequence_parallel:
        return []
    return [(collective_time(ctx.network, "all_gather", nbytes, ctx.tp_layout),
             gemm - _weight_grad_gemm(ctx, k, n, tokens))
            for (mode, nbytes), (k, n, tokens), gemm in zip(transfers, shapes, gemms) if mode == "column"]


def _chunked_exposed(ctx: LayerContext, comms: list[float], gemms: list[float]) -> float:
    """With --tp-comm-overlap each collective is split into tp chunks pipelined against its GEMM
    (Transformer Engine userbuffers; Wang et al. 2023, "Overlap communication with dependent
    computation"): the first chunk is exposed, the rest hides behind the GEMM, and while they
    overlap the collective takes COMM_SM_SHARE of the SMs."""
    tp = ctx.plan.tp
    return sum(max(c / tp, c - g) + COMM_SM_SHARE * min(c, g) for c, g in zip(comms, gemms))


def _async_backward_exposed(ctx: LayerContext, transfers: list[tuple[str, float]],
                            shapes: list[tuple[int, int, float]], regathers: list[tuple[float, float]]) -> float:
    """The backward's TP communication as Megatron runs it without --tp-comm-overlap
    (LinearWithGradAccumulationAndAsyncCommunication.backward, megatron/core/tensor_parallel/
    layers.py; Transformer Engine's Linear/LayerNormLinear backward alike), in launch order on one
    stream (CUDA_DEVICE_MAX_CONNECTIONS=1):
    - a column-parallel layer's input gradient is reduce-scattered (all-reduced without sequence
      parallelism: async_tensor_model_parallel_allreduce, "asynchronous execution of
      tensor-model-parallel all-reduce with weight gradient computation of a column-linear
      layer", TransformerConfig) while its weight-gradient GEMM runs;
    - under sequence parallelism the same layer first re-gathers its saved input shard, needed
      by that weight gradient, while its input-gradient GEMM runs (`regathers`, _input_regathers);
    - a row-parallel layer's output-gradient all-gather (sequence parallelism; nothing without)
      feeds both its GEMMs and is exposed.
    Each overlap costs the collective's excess over the GEMM plus COMM_SM_SHARE of the overlap
    (hwmodels.network.overlapped). A split-backward schedule computes weight gradients later in
    their W pass, so nothing hides the input gradient's collective there."""
    p, net, lay = ctx.plan, ctx.network, ctx.tp_layout
    split = p.schedule in SPLIT_BACKWARD_SCHEDULES
    regathers = iter(regathers)  # one per column-parallel layer, in order
    total = 0.0
    for (mode, nbytes), (k, n, tokens) in zip(transfers, shapes):
        if mode == "replicated":
            continue
        if mode == "row":
            total += collective_time(net, "all_gather", nbytes, lay) if p.sequence_parallel else 0.0
            continue
        wgrad = _weight_grad_gemm(ctx, k, n, tokens)
        grad_input = collective_time(net, "reduce_scatter" if p.sequence_parallel else "all_reduce", nbytes, lay)
        hiding = 0.0 if split else wgrad
        total += overlapped(hiding, grad_input) - hiding
        if p.sequence_parallel:
            regather, dgrad = next(regathers)
            total += overlapped(dgrad, regather) - dgrad
    return total


def _hiding_gemms(ctx: LayerContext, shapes: list[tuple[int, int, float]], gemms: list[float],
                  backward: bool) -> list[float]:
    """The GEMM time each TP collective can hide behind: the whole linear layer, except in the
    backward of a split-backward (zero-bubble) schedule, where the weight-gradient GEMM runs later
    in its own W pass and only the input-gradient GEMM is there to overlap with."""
    if not (backward and ctx.plan.schedule in SPLIT_BACKWARD_SCHEDULES):
        return gemms
    return [g - _weight_grad_gemm(ctx, k, n, tokens) for g, (k, n, tokens) in zip(gemms, shapes)]


def attention_block(ctx: LayerContext, backward: bool) -> Cost:
    """Input norm, the attention projections (QKV column-parallel; MLA's replicated
    down-projections and column-parallel up-projections), attention core, output projection
    (row-parallel) and the residual; with its TP collectives and the context-parallel exchange."""
    shapes = _attention_shapes(ctx)
    transfers = _attention_transfers(ctx)
    # the column-parallel projections read a norm's output through Megatron-Core's
    # TELayerNormColumnParallelLinear: QKV the input norm's, MLA's up-projections their latent
    # norms'; MLA's down-projections (and a query projection without a latent) are plain linears
    # after a separate input norm (gpt_layer_specs, MLASelfAttentionSubmodules)
    mla = ctx.model.mla is not None
    h = ctx.model.hidden_size
    gemms = [linear_time(ctx, k, n, backward, tokens, cast_input=not (mode == "column" and not (mla and k == h)))
             for (k, n, tokens), (mode, _) in zip(shapes, transfers)]
    compute = sum(gemms) + _attention_core(ctx, backward) + _attention_elementwise(ctx, backward)
    tp = tp_exposed(ctx, transfers, shapes, gemms, backward)
    cost = Cost().add("compute", compute).add("tp_comm", tp)
    cost += _cp_exchange(ctx, backward)
    return cost


def mlp_block(ctx: LayerContext, backward: bool) -> Cost:
    """The MLP module: up (+gate, column-parallel), activation, down (row-parallel), with their TP
    collectives."""
    shapes = [(k, n, ctx.tokens) for k, n in _mlp_shapes(ctx)]
    gemms = [linear_time(ctx, k, n, backward, cast_input=i > 0) for i, (k, n, _) in enumerate(shapes)]  # fc1: norm-fed
    compute = sum(gemms) + activation_time(ctx, ctx.tokens, ctx.model.ffn_hidden_size // ctx.plan.tp, backward,
                                           bias=ctx.model.linear_bias)
    tp = tp_exposed(ctx, mlp_transfers(ctx), shapes, gemms, backward)
    return Cost().add("compute", compute).add("tp_comm", tp)


def dense_ffn_block(ctx: LayerContext, backward: bool) -> Cost:
    """The dense FFN sublayer: post-attention norm, the MLP, residual."""
    return mlp_block(ctx, backward).add("compute", ffn_norm_residual(ctx, backward))


def layer_forward(ctx: LayerContext, ffn=dense_ffn_block) -> Cost:
    """One layer's forward; `ffn(ctx, backward)` is its FFN block (dense, or an MoE block)."""
    cost = attention_block(ctx, False)
    cost += ffn(ctx, False)
    return cost


def layer_backward(ctx: LayerContext, ffn=dense_ffn_block) -> Cost:
    """Backward of one layer plus what the recompute mode re-runs first:
    full = the whole layer forward (GEMMs, attention, TP/EP communication; Chen et al. 2016 /
    Megatron --recompute-granularity full); selective = the plan's recompute_modules (see
    selective_recompute). Recomputed compute is booked under `recompute`, its communication
    under its own kind."""
    cost = attention_block(ctx, True)
    cost += ffn(ctx, True)
    if ctx.plan.recompute == "full":
        cost += _as_recompute(layer_forward(ctx, ffn))
    elif ctx.plan.recompute == "selective":
        cost += selective_recompute(ctx, ffn)
    return cost


def _as_recompute(fwd: Cost) -> Cost:
    """A forward re-run in the backward: its compute moved under `recompute`."""
    fwd.parts["recompute"] += fwd.parts["compute"]
    fwd.parts["compute"] = 0.0
    return fwd


def selective_recompute(ctx: LayerContext, ffn=dense_ffn_block) -> Cost:
    """The forward pieces selective recompute re-runs before a layer's backward, by Megatron-Core
    --recompute-modules: core_attn = the attention core (Korthikanti et al. 2022, Sec. 5);
    layernorm = the norms not fused into a linear (simulator.memory.norm_outputs_recomputed: an MoE
    layer's pre-MLP norm, MLA's input norm); mlp = a dense layer's MLP (GEMMs, activation, TP
    collectives, and the pre-MLP norm fused into its fc1);
    moe = the MoE layer (router, dispatch, experts, combine, shared experts); moe_act = the routed experts'
    activation function; shared_experts = the shared experts. Modules a layer does not have cost
    nothing there (mlp in an MoE layer, the MoE ones in a dense layer)."""
    mods = ctx.plan.recompute_modules
    cost = Cost()
    if "core_attn" in mods:
        # the checkpointed call is the whole CP attention, its exchange included (Megatron-Core
        # Attention._checkpointed_attention_forward around TE's attn_forward_func_with_cp)
        cost.add("recompute", _attention_core(ctx, False))
        cost += _cp_exchange(ctx, False)
    dense = ffn is dense_ffn_block
    norms = norm_outputs_recomputed(ctx.model, mods, moe_layer=not dense)
    if norms:  # the separate norms under layernorm; a dense mlp's fused norm (re-run inside its fc1)
        cost.add("recompute", norms * memory_bound_time(ctx.gpu, _norm_bytes(ctx)))
    if dense:
        if "mlp" in mods:
            cost += _as_recompute(mlp_block(ctx, False))
    elif "moe" in mods:
        cost += _as_recompute(ffn.module_forward.scaled(1.0))
    else:
        if "moe_act" in mods:
            cost.add("recompute", ffn.expert_activation)
        if "shared_experts" in mods:
            cost += _as_recompute(ffn.shared_forward.scaled(1.0))
    return cost


def layer_weight_grad(ctx: LayerContext, ffn=dense_ffn_block) -> float:
    """The W pass of one layer under a split-backward (zero-bubble) schedule: the weight-gradient
    GEMMs, which layer_backward also contains (Qi et al. 2024, Sec. 2: B computes the input
    gradient, W the parameter gradient). An MoE FFN brings its own (`weight_grad` of the block)."""
    attention = sum(_weight_grad_gemm(ctx, k, n, tokens) for k, n, tokens in _attention_shapes(ctx))
    if ffn is dense_ffn_block:
        return attention + sum(_weight_grad_gemm(ctx, k, n) for k, n in _mlp_shapes(ctx))
    return attention + ffn.weight_grad


def head_weight_grad(ctx: LayerContext) -> float:
    """The W pass of the LM head (the vocabulary-parallel projection's weight gradient)."""
    return _weight_grad_gemm(outside_fp8(ctx), ctx.model.hidden_size, ctx.model.vocab_shard(ctx.plan.tp))


def outside_fp8(ctx: LayerContext) -> LayerContext:
    """The context of GEMMs that run in 16-bit under fp8 training: the LM head (Megatron-Core's
    output layer is a tensor_parallel.ColumnParallelLinear, not a Transformer Engine module, so fp8
    autocast does not reach it) and the MoE router (TopKRouter's gating is a plain F.linear)."""
    return replace(ctx, dtype="bf16") if ctx.dtype == "fp8" else ctx


def embedding_cost(ctx: LayerContext, backward: bool) -> Cost:
    """Vocab-parallel embedding lookup (Megatron VocabParallelEmbedding): gather rows, then an
    all-reduce of the (tokens, h) output over TP (reduce_from_tensor_model_parallel_region), or a
    reduce-scatter with sequence parallelism. Their backwards: the all-reduce's is the identity,
    the reduce-scatter's an all-gather of the gradient (Megatron-Core tensor_parallel/mappings.py).
    The backward also writes the table's weight gradient (embedding_weight_grad_kernels)."""
    nbytes = ctx.tokens * ctx.model.hidden_size * ctx.act_bytes
    # forward: read the tokens' rows of the table, write the output (2 passes of tokens x h); the
    # backward (PyTorch's embedding_dense_backward: sort the token ids, sum the gradient rows of each
    # id, add them into the table's gradient) reads the output gradient, writes and reads the
    # per-id sums and writes the rows: about 4 passes
    compute = memory_bound_time(ctx.gpu, (4 if backward else 2) * nbytes)
    if backward:
        table = ctx.model.hidden_size * ctx.model.vocab_shard(ctx.plan.tp)
        compute += sum(memory_bound_time(ctx.gpu, table * b) for b in embedding_weight_grad_kernels(ctx))
    cost = Cost().add("compute", compute)
    if ctx.plan.tp > 1 and (ctx.plan.sequence_parallel or not backward):
        op = {(False, False): "all_reduce", (True, False): "reduce_scatter", (True, True): "all_gather"}
        cost.add("tp_comm", collective_time(ctx.network, op[ctx.plan.sequence_parallel, backward], nbytes, ctx.tp_layout))
    return cost


def embedding_weight_grad_kernels(ctx: LayerContext) -> list[int]:
    """Bytes per element of the (vocab/tp x h) embedding table that its weight gradient moves each
    microbatch, one kernel each: PyTorch's embedding backward (embedding_dense_backward) starts
    from a zero-filled gradient of the whole table in the weight's dtype (write w), and Megatron's
    gradient hook adds it into the main_grad (main_grad.add_(grad): read w + g, write g;
    megatron/core/distributed param hook). The scatter of the tokens' rows is tokens x h, small."""
    w = ctx.act_bytes  # the table's dtype: 16-bit, also under fp8 (it is no fp8 module); fp32 in fp32
    return [w, main_grad_add_bytes(w, ctx.grad_bytes)]


def mtp_projection(ctx: LayerContext, backward: bool) -> Cost:
    """What a multi-token prediction module runs around its layer (Megatron-Core
    MultiTokenPredictionLayer): the norms of the next token's embedding and of the hidden state, and
    the column-parallel 2h -> h projection of their concatenation, whose input is all-gathered under
    sequence parallelism and whose output is gathered back to h for the layer. Its embedding lookup
    and LM head are the model's (embedding_cost, head_cost)."""
    h, p = ctx.model.hidden_size, ctx.plan
    gemm = linear_time(ctx, 2 * h, h // p.tp, backward)
    norms = _memory_bound(ctx, [(2 * _norm_bytes(ctx), NORM_BACKWARD)], backward)
    linears = [(2 * h, h // p.tp, "column")]
    tp = tp_exposed(ctx, _tp_transfers(ctx, linears), [(2 * h, h // p.tp, ctx.tokens)], [gemm], backward)
    # its output gathered to h (gather_from_tensor_model_parallel_region, whose backward splits);
    # under sequence parallelism scattered back to the shard, whose backward gathers
    if p.tp > 1 and (not backward or p.sequence_parallel):
        tp += collective_time(ctx.network, "all_gather", ctx.tokens * h * ctx.act_bytes, ctx.tp_layout)
    return Cost().add("compute", gemm + norms).add("tp_comm", tp)


def mtp_weight_grad(ctx: LayerContext) -> float:
    """The W pass of a multi-token prediction module's projection (its layer's and the head's are
    layer_weight_grad and head_weight_grad)."""
    h = ctx.model.hidden_size
    return _weight_grad_gemm(ctx, 2 * h, h // ctx.plan.tp)


def head_cost(ctx: LayerContext, backward: bool) -> Cost:
    """Final norm (on the tokens/tp shard under sequence parallelism: it runs before the gather),
    LM head (column-parallel over the vocabulary) and vocab-parallel cross-entropy
    (cross_entropy_kernels). The head's input: with sequence parallelism all-gathered in the
    forward and its gradient reduce-scattered in the backward; without, copied (identity) forward
    and its gradient all-reduced backward (copy_to_tensor_model_parallel_region)."""
    m, p = ctx.model, ctx.plan
    vocab = m.vocab_shard(p.tp)
    head = outside_fp8(ctx)
    gemm = linear_time(head, m.hidden_size, vocab, backward)
    logits = ctx.tokens * vocab
    ce = sum(memory_bound_time(ctx.gpu, logits * nbytes) for nbytes in cross_entropy_kernels(ctx, backward))
    norm = _memory_bound(ctx, [(_norm_bytes(ctx), NORM_BACKWARD)], backward)
    # the head is a ColumnParallelLinear (GPTModel.output_layer): its backward overlaps the input
    # gradient's reduce-scatter (all-reduce) with its weight gradient and the re-gather of its input
    # with its input gradient, as every column-parallel layer's; no userbuffers (not a TE module)
    linears = [(m.hidden_size, vocab, "column")]
    tp = tp_exposed(head, _tp_transfers(head, linears), [(m.hidden_size, vocab, ctx.tokens)], [gemm], backward,
                    userbuffers=False)
    return Cost().add("compute", gemm + ce + norm).add("tp_comm", tp)


def cross_entropy_kernels(ctx: LayerContext, backward: bool) -> list[int]:
    """Bytes per logit each kernel of Megatron's unfused vocab-parallel cross-entropy moves
    (megatron/core/tensor_parallel/cross_entropy.py, VocabParallelCrossEntropy; the same passes as
    Megatron-LM's 2021 mpu/cross_entropy.py behind `output.float()`), one kernel per pass over the
    (tokens x vocab/tp) logits. Forward: cast the 16-bit logits to fp32 (read 2, write 4; no copy
    when they are fp32 already), max over the vocabulary (read 4), subtract it in place (read 4,
    write 4), exp in place (8), sum (read 4), divide by the sum to keep the softmax (8). Backward:
    multiply the softmax by the incoming gradient in place (8; the target's -1 is a gather), and the
    cast's backward back to the logits' dtype (read 4, write 2)."""
    cast = [ctx.act_bytes + 4] if ctx.act_bytes < 4 else []  # fp32 logits: no cast kernel runs
    if backward:
        return [8, *cast]
    return [*cast, 4, 8, 8, 4, 8]
