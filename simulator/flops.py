"""FLOP counts of one iteration, for TFLOP/s and MFU.

flops_formula_for names the convention so every printed MFU says what it counts.
"""
from __future__ import annotations


def flops_formula_for(model) -> str:
    """The model-FLOP convention every printed MFU follows, in the clauses that apply to `model`
    (no MLA, multi-token prediction or MoE wording for a model that has none of them)."""
    parts = [
        "model FLOPs = 3 x forward GEMM FLOPs per token x tokens: per layer 2*(h*(q+2kv) + q*h + m*h*f)",
        " (MLA: its down- and up-projections)" if model.mla is not None else "",
        " + attention 4*s*q (QK^T and AV, causal mask not halved",
        "; MLA: 2*s*(q+o)" if model.mla is not None else "",
        "), plus the LM head 2*h*V",
        "; each multi-token prediction module adds a layer, its 2h x h projection and the head again"
        if model.mtp_layers else "",
        "; = 72*B*s*L*h^2*(1 + s/6h + V/12hL) for GPT (Korthikanti et al. 2022, Appendix A), "
        "generalised to GQA/SwiGLU; recompute not counted (that is HFU)",
    ]
    if model.moe is not None:
        parts.append(". MoE layers count the router and only the active experts (top_k routed + shared), "
                     "not all experts")
        if model.moe.capacity_factor is not None:
            parts.append("; with a capacity_factor, not the routed copies dropped at capacity")
    return "".join(parts)


def layer_gemm_flops_per_token(model, index: int, kept: float = 1.0) -> float:
    """Forward GEMM FLOPs per token of layer `index`: attention projections plus the dense MLP, or
    for an MoE layer the router and only the experts a token activates (top_k routed + shared;
    `kept`: the share of routed copies an expert computes, below 1 when some are dropped at
    capacity)."""
    attention = sum(k * n for k, n, _ in model.attention_linears())
    return 2 * attention + _ffn_flops_per_token(model, index, kept=kept)


def _ffn_flops_per_token(model, index: int, *, shared_only: bool = False, kept: float = 1.0) -> float:
    """Forward GEMM FLOPs per token of layer `index`'s FFN (dense MLP, or router + active experts;
    `shared_only`: just an MoE layer's shared experts)."""
    h = model.hidden_size
    if not model.is_moe_layer(index):
        return 0.0 if shared_only else 2 * model.ffn_matrices * h * model.ffn_hidden_size
    e = model.moe
    experts = e.num_shared_experts + (0 if shared_only else e.top_k * kept)
    router = 0 if shared_only else h * e.num_experts
    return 2 * (router + experts * model.ffn_matrices * h * e.expert_ffn_hidden_size)


def _attention_products_per_token(model, seq_length: int) -> float:
    """One layer's QK^T over q_channels and AV over o_channels: 4*s*q when they are equal (MLA: 192
    vs 128 per head)."""
    return 2 * seq_length * (model.q_channels + model.o_channels)


def _mtp_module_gemm_per_token(model, kept: float = 1.0) -> float:
    """A multi-token prediction module's GEMMs: its 2h -> h projection and a layer like the last
    (the LM head it runs again is counted with the head)."""
    h = model.hidden_size
    return 2 * 2 * h * h + layer_gemm_flops_per_token(model, model.num_layers - 1, kept)


def _heads_per_token(model) -> float:
    """The LM head, 2*h*V, once for the model and once per multi-token prediction module."""
    return (1 + model.mtp_layers) * 2 * model.hidden_size * model.vocab_size


def layer_forward_flops_per_token(model, index: int, seq_length: int) -> float:
    """Forward FLOPs per token of layer `index`: its GEMMs (layer_gemm_flops_per_token) and its
    attention score/value products, as forward_flops_per_token counts them."""
    return layer_gemm_flops_per_token(model, index) + _attention_products_per_token(model, seq_length)


def last_stage_extra_flops_per_token(model, seq_length: int) -> float:
    """Forward FLOPs per token the last pipeline stage runs besides its layers: the LM head (2*h*V)
    and each multi-token prediction module (its 2h -> h projection, a layer like the last, the head
    again), as forward_flops_per_token counts them."""
    per_module = _mtp_module_gemm_per_token(model) + _attention_products_per_token(model, seq_length)
    return _heads_per_token(model) + model.mtp_layers * per_module


def forward_flops_per_token(model, seq_length: int, kept: float = 1.0) -> tuple[float, float, float]:
    """(GEMMs of all layers, attention score/value products of all layers, LM head) per token;
    `kept` as in layer_gemm_flops_per_token."""
    mtp = model.mtp_layers
    # a layer's count depends on its index only through its kind (dense or MoE): one per kind
    moe = [model.is_moe_layer(i) for i in range(model.num_layers)]
    per_kind = {kind: layer_gemm_flops_per_token(model, moe.index(kind), kept) for kind in set(moe)}
    gemm = sum(per_kind[kind] for kind in moe) + mtp * _mtp_module_gemm_per_token(model, kept)
    attention = (model.num_layers + mtp) * _attention_products_per_token(model, seq_length)
    return gemm, attention, _heads_per_token(model)


CAUSAL_SHARE = 0.5
"""The share of the s x s attention products a causal mask leaves (s(s+1)/2 of s^2 pairs), which
Megatron-LM's num_floating_point_operations counts since its 2025 rewrite and causal flash kernels
compute (they skip the masked blocks); the published records' counts (Korthikanti et al. 2022,
Megatron-Core before it, PaLM's MFU) take the whole square."""


def model_flops(model, seq_length: int, tokens: int, kept: float = 1.0, *, causal: bool = False) -> float:
    """`kept`: the share of routed expert copies computed (1 - the share dropped at capacity);
    `causal`: count the attention products of the causal half alone (CAUSAL_SHARE)."""
    gemm, attention, head = forward_flops_per_token(model, seq_length, kept)
    return 3 * tokens * (gemm + attention * (CAUSAL_SHARE if causal else 1.0) + head)


def hardware_flops(model, seq_length: int, tokens: int, recompute: str,
                   recompute_modules: tuple[str, ...] = ("core_attn",), kept: float = 1.0, *,
                   causal: bool = False) -> float:
    """Model FLOPs plus what recomputation re-runs (hardware FLOPs, Korthikanti et al. 2022's HFU):
    full = every layer's forward; selective = its modules' GEMMs once (core_attn the attention
    products, mlp the dense MLPs, moe the router and active experts, shared_experts the shared
    experts; the norm and activation modules are elementwise). For GPT with core_attn that is
    72BsLh^2(1 + s/4.5h + V/12hL); Korthikanti's Table 5 selective HFU follows 1 + s/3h, which
    counts the attention products twice more than they are run."""
    gemm, attention, _ = forward_flops_per_token(model, seq_length, kept)
    attention *= CAUSAL_SHARE if causal else 1.0
    extra = 0.0
    if recompute == "full":
        extra = gemm + attention
    elif recompute == "selective":
        mods = recompute_modules
        extra = attention if "core_attn" in mods else 0.0
        for i in range(model.num_layers):
            moe_layer = model.is_moe_layer(i)
            if ("mlp" in mods and not moe_layer) or ("moe" in mods and moe_layer):
                extra += _ffn_flops_per_token(model, i, kept=kept)
            elif "shared_experts" in mods and moe_layer:
                extra += _ffn_flops_per_token(model, i, shared_only=True)
    return model_flops(model, seq_length, tokens, kept, causal=causal) + tokens * extra
