"""Per-rank cost of one transformer layer, the embedding and the LM head, forward and backward.

Shapes follow Megatron-LM's tensor-parallel layer (Shoeybi et al. 2019, Fig. 3): QKV and the MLP
up-projection are column-parallel, the attention output projection and MLP down-projection are
row-parallel. Each piece is costed on the hardware models and kept apart so the breakdown can say
where time went. Everything here is per microbatch, per rank of one pipeline stage.
"""
from __future__ import annotations

from dataclasses import dataclass

from hwmodels.compute import attention_time, gemm_time, memory_bound_time, unfused_attention_time
from hwmodels.network import collective_time
from paraplan.specs import DTYPE_BYTES
from simulator.cost import Cost

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

    @property
    def tokens(self) -> int:
        """Tokens a rank's GEMMs see: the microbatch, split by context parallelism."""
        return self.plan.micro_batch_size * self.seq_length // self.plan.cp

    @property
    def act_bytes(self) -> int:
        return 2 if self.dtype == "fp8" else DTYPE_BYTES[self.dtype]


def _linear(ctx: LayerContext, k: int, n: int, backward: bool) -> float:
    """A linear layer y = x W with x (tokens, k), W (k, n). Backward is dgrad (tokens, n)x(n, k)
    plus wgrad (k, tokens)x(tokens, n), each as many FLOPs as the forward (2x total)."""
    m = ctx.tokens
    if not backward:
        return gemm_time(ctx.gpu, m, n, k, ctx.dtype)
    return gemm_time(ctx.gpu, m, k, n, ctx.dtype) + gemm_time(ctx.gpu, k, n, m, ctx.dtype)


def _attention_core(ctx: LayerContext, backward: bool) -> float:
    """Softmax(QK^T)V for this rank's heads. Under context parallelism each rank owns s/cp queries
    against the whole sequence, load-balanced over the causal mask (Megatron-Core CP), so the work
    is 1/cp of the full causal attention."""
    m, p = ctx.model, ctx.plan
    fn = attention_time if ctx.attention_kernel == "flash" else unfused_attention_time
    t = fn(
        ctx.gpu,
        batch=p.micro_batch_size,
        heads=m.num_attention_heads // p.tp,
        q_len=ctx.seq_length,
        kv_len=ctx.seq_length,
        head_dim=m.head_dim,
        dtype=ctx.dtype,
        causal=True,
        backward=backward,
    )
    return t / p.cp


def _elementwise(ctx: LayerContext, backward: bool) -> float:
    """Memory-bound kernels of one layer (norms, residual adds, dropout, activation, rotary).
    Bytes read+written per token (elements x act_bytes), after Korthikanti et al. 2022 Sec. 4.1:
    each LayerNorm reads and writes h; each bias-dropout-add reads 2h and writes h (+ a 1-byte
    mask); the activation reads f (2f for SwiGLU's gate and up) and writes f. Under sequence
    parallelism the h-wide kernels run on tokens/tp. Backward moves about twice the bytes
    (reads the saved input and the incoming gradient, writes the gradient)."""
    m, p = ctx.model, ctx.plan
    h, f = m.hidden_size, m.ffn_hidden_size // p.tp
    b = ctx.act_bytes
    seq_share = p.tp if p.sequence_parallel else 1
    tokens_h = ctx.tokens / seq_share
    kernels = [
        tokens_h * 2 * h * b,  # input LayerNorm
        tokens_h * (3 * h * b + h),  # attention bias-dropout-add (+ mask)
        tokens_h * 2 * h * b,  # post-attention LayerNorm
        tokens_h * (3 * h * b + h),  # MLP bias-dropout-add (+ mask)
        ctx.tokens * (3 if m.activation == "swiglu" else 2) * f * b,  # activation
    ]
    if m.activation == "swiglu":  # rotary embedding on q and k (Llama family)
        kernels.append(ctx.tokens * 2 * (m.q_channels + m.kv_channels) // p.tp * b)
    factor = 2 if backward else 1
    return sum(memory_bound_time(ctx.gpu, factor * nbytes) for nbytes in kernels)


# Fraction of the GPU's SMs an NVLink collective occupies while it runs beside compute
# (Calculon systems/*.json nvlink processor_usage = 0.15, hardware_specs comm_sm_stealing_fraction).
NVLINK_SM_SHARE = 0.15


def _tp_collective_pairs(ctx: LayerContext) -> list[float]:
    """Tensor-parallel collectives of one layer in one direction, one per linear layer in the order
    QKV, attention projection, MLP up, MLP down: with sequence parallelism an all-gather before each
    column-parallel and a reduce-scatter after each row-parallel GEMM (Korthikanti et al. 2022,
    Sec. 4.2.2, Fig. 5); without it an all-reduce after each row-parallel GEMM (Shoeybi et al. 2019)."""
    if ctx.plan.tp == 1:
        return [0.0] * 4
    nbytes = ctx.tokens * ctx.model.hidden_size * ctx.act_bytes
    if ctx.plan.sequence_parallel:
        ag = collective_time(ctx.network, "all_gather", nbytes, ctx.tp_layout)
        rs = collective_time(ctx.network, "reduce_scatter", nbytes, ctx.tp_layout)
        return [ag, rs, ag, rs]
    ar = collective_time(ctx.network, "all_reduce", nbytes, ctx.tp_layout)
    return [0.0, ar, 0.0, ar]


def _tp_comm(ctx: LayerContext, gemms: list[float]) -> float:
    """Exposed TP communication of one layer in one direction. Without overlap every collective is
    on the critical path. With --tp-comm-overlap each collective is split into tp chunks pipelined
    against its GEMM (Transformer Engine userbuffers ring exchange; Wang et al. 2023, "Overlap
    communication with dependent computation"): the first chunk is exposed, the rest hides behind
    the GEMM, and while they overlap the collective takes NVLINK_SM_SHARE of the SMs from it."""
    comms = _tp_collective_pairs(ctx)
    if not ctx.plan.tp_comm_overlap:
        return sum(comms)
    tp = ctx.plan.tp
    exposed = 0.0
    for comm, gemm in zip(comms, gemms):
        exposed += max(comm / tp, comm - gemm) + NVLINK_SM_SHARE * min(comm, gemm)
    return exposed


def _cp_comm(ctx: LayerContext, backward: bool) -> float:
    """Ring attention KV exchange (Megatron-Core context parallelism): cp-1 steps, each sending
    this rank's K and V chunk to the next rank while computing on the current one; the backward
    also returns dK, dV (twice the bytes). Only the part not hidden behind the attention compute
    of a step is exposed."""
    p, m = ctx.plan, ctx.model
    if p.cp == 1:
        return 0.0
    kv_bytes = 2 * ctx.tokens * m.kv_channels // p.tp * ctx.act_bytes * (2 if backward else 1)
    step_comm = collective_time(ctx.network, "send_recv", kv_bytes, ctx.cp_layout)
    step_compute = _attention_core(ctx, backward) / p.cp
    return (p.cp - 1) * max(0.0, step_comm - step_compute)


def _layer_gemms(ctx: LayerContext, backward: bool) -> list[float]:
    """The four linear layers: QKV, attention projection, MLP up (+gate), MLP down."""
    m, p = ctx.model, ctx.plan
    h = m.hidden_size
    return [
        _linear(ctx, h, (m.q_channels + 2 * m.kv_channels) // p.tp, backward),
        _linear(ctx, m.q_channels // p.tp, h, backward),
        _linear(ctx, h, (m.ffn_matrices - 1) * m.ffn_hidden_size // p.tp, backward),
        _linear(ctx, m.ffn_hidden_size // p.tp, h, backward),
    ]


def layer_forward(ctx: LayerContext) -> Cost:
    gemms = _layer_gemms(ctx, False)
    compute = sum(gemms) + _attention_core(ctx, False) + _elementwise(ctx, False)
    return Cost().add("compute", compute).add("tp_comm", _tp_comm(ctx, gemms)).add("cp_comm", _cp_comm(ctx, False))


def layer_backward(ctx: LayerContext) -> Cost:
    """Backward of one layer plus what the recompute mode re-runs first:
    full = the whole layer forward (GEMMs, attention, TP communication; Chen et al. 2016 /
    Megatron --recompute-granularity full); selective = the attention core only
    (Korthikanti et al. 2022, Sec. 5)."""
    p = ctx.plan
    gemms = _layer_gemms(ctx, True)
    compute = sum(gemms) + _attention_core(ctx, True) + _elementwise(ctx, True)
    cost = Cost().add("compute", compute).add("tp_comm", _tp_comm(ctx, gemms)).add("cp_comm", _cp_comm(ctx, True))
    if p.recompute == "full":
        fwd = layer_forward(ctx)
        cost.add("recompute", fwd.parts["compute"])
        cost.add("tp_comm", fwd.parts["tp_comm"])
        cost.add("cp_comm", fwd.parts["cp_comm"])
    elif p.recompute == "selective":
        cost.add("recompute", _attention_core(ctx, False))
    return cost


def embedding_cost(ctx: LayerContext, backward: bool) -> Cost:
    """Vocab-parallel embedding lookup (Megatron VocabParallelEmbedding): gather rows, then an
    all-reduce of the (tokens, h) output over TP (a reduce-scatter with sequence parallelism)."""
    nbytes = ctx.tokens * ctx.model.hidden_size * ctx.act_bytes
    cost = Cost().add("compute", memory_bound_time(ctx.gpu, (4 if backward else 2) * nbytes))
    if ctx.plan.tp > 1:
        op = "reduce_scatter" if ctx.plan.sequence_parallel else "all_reduce"
        cost.add("tp_comm", collective_time(ctx.network, op, nbytes, ctx.tp_layout))
    return cost


def head_cost(ctx: LayerContext, backward: bool) -> Cost:
    """Final norm, LM head (column-parallel over the vocabulary) and vocab-parallel cross-entropy
    (Megatron _VocabParallelCrossEntropy: fp32 logits read for max, exp-sum and gradient)."""
    m, p = ctx.model, ctx.plan
    vocab = m.vocab_size // p.tp
    gemm = _linear(ctx, m.hidden_size, vocab, backward)
    logits = ctx.tokens * vocab * 4
    ce = memory_bound_time(ctx.gpu, (2 if backward else 3) * logits)
    norm = memory_bound_time(ctx.gpu, (2 if backward else 1) * 2 * ctx.tokens * m.hidden_size * ctx.act_bytes)
    cost = Cost().add("compute", gemm + ce + norm)
    if p.tp > 1 and p.sequence_parallel:  # gather the sequence-parallel input of the head
        nbytes = ctx.tokens * m.hidden_size * ctx.act_bytes
        cost.add("tp_comm", collective_time(ctx.network, "all_gather", nbytes, ctx.tp_layout))
    return cost
