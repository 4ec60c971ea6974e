"""FLOP counts of one iteration, for TFLOP/s and MFU.

MODEL_FLOPS_FORMULA names the convention so every printed MFU says what it counts.
"""
from __future__ import annotations

MODEL_FLOPS_FORMULA = (
    "model FLOPs = 3 x forward GEMM FLOPs per token x tokens: per layer 2*(h*(q+2kv) + q*h + m*h*f) "
    "+ attention 4*s*q (QK^T and AV, causal mask not halved), plus the LM head 2*h*V; "
    "= 72*B*s*L*h^2*(1 + s/6h + V/12hL) for GPT (Korthikanti et al. 2022, Appendix A), "
    "generalised to GQA/SwiGLU; recompute not counted (that is HFU)"
)


def forward_flops_per_token(model, seq_length: int) -> tuple[float, float, float]:
    """(layer GEMMs, attention score/value products, LM head) forward FLOPs per token."""
    h, q, kv, f = model.hidden_size, model.q_channels, model.kv_channels, model.ffn_hidden_size
    gemm = 2 * (h * (q + 2 * kv) + q * h + model.ffn_matrices * h * f)
    attention = 4 * seq_length * q
    head = 2 * h * model.vocab_size
    return gemm, attention, head


def model_flops(model, seq_length: int, tokens: int) -> float:
    gemm, attention, head = forward_flops_per_token(model, seq_length)
    return 3 * tokens * (model.num_layers * (gemm + attention) + head)


def hardware_flops(model, seq_length: int, tokens: int, recompute: str) -> float:
    """Model FLOPs plus what recomputation re-runs (full: every layer's forward; selective: the
    attention core), as in Korthikanti et al. 2022's HFU."""
    gemm, attention, _ = forward_flops_per_token(model, seq_length)
    extra = {"full": gemm + attention, "selective": attention}.get(recompute, 0.0)
    return model_flops(model, seq_length, tokens) + tokens * model.num_layers * extra
