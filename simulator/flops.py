"""FLOP counts of one iteration, for TFLOP/s and MFU.

MODEL_FLOPS_FORMULA names the convention so every printed MFU says what it counts.
"""
from __future__ import annotations

MODEL_FLOPS_FORMULA = (
    "model FLOPs = 3 x forward GEMM FLOPs per token x tokens: per layer 2*(h*(q+2kv) + q*h + m*h*f) "
    "+ attention 4*s*q (QK^T and AV, causal mask not halved), plus the LM head 2*h*V; "
    "= 72*B*s*L*h^2*(1 + s/6h + V/12hL) for GPT (Korthikanti et al. 2022, Appendix A), "
    "generalised to GQA/SwiGLU; recompute not counted (that is HFU). MoE layers count the router "
    "and only the active experts (top_k routed + shared), not all experts"
)


def layer_gemm_flops_per_token(model, index: int) -> float:
    """Forward GEMM FLOPs per token of layer `index`: attention projections plus the dense MLP, or
    for an MoE layer the router and only the experts a token activates (top_k routed + shared)."""
    h, q, kv = model.hidden_size, model.q_channels, model.kv_channels
    attn = 2 * (h * (q + 2 * kv) + q * h)
    if model.is_moe_layer(index):
        e = model.moe
        active = (e.top_k + e.num_shared_experts) * model.ffn_matrices * h * e.expert_ffn_hidden_size
        return attn + 2 * (h * e.num_experts + active)
    return attn + 2 * model.ffn_matrices * h * model.ffn_hidden_size


def forward_flops_per_token(model, seq_length: int) -> tuple[float, float, float]:
    """(GEMMs of all layers, attention score/value products of all layers, LM head) per token."""
    gemm = sum(layer_gemm_flops_per_token(model, i) for i in range(model.num_layers))
    attention = model.num_layers * 4 * seq_length * model.q_channels
    head = 2 * model.hidden_size * model.vocab_size
    return gemm, attention, head


def model_flops(model, seq_length: int, tokens: int) -> float:
    gemm, attention, head = forward_flops_per_token(model, seq_length)
    return 3 * tokens * (gemm + attention + head)


def hardware_flops(model, seq_length: int, tokens: int, recompute: str) -> float:
    """Model FLOPs plus what recomputation re-runs (full: every layer's forward; selective: the
    attention core), as in Korthikanti et al. 2022's HFU."""
    gemm, attention, _ = forward_flops_per_token(model, seq_length)
    extra = {"full": gemm + attention, "selective": attention}.get(recompute, 0.0)
    return model_flops(model, seq_length, tokens) + tokens * extra
