"""What a framework needs to build a bundled preset's architecture beyond paraplan's model schema,
for the launch configs planner.emit writes (Megatron-LM arguments, the torchtitan config).

paraplan.specs.ModelSpec carries the shapes, the activation, the key/value heads, the head width,
embedding tying, MLA and MoE: all the simulation needs. Building the model also takes the
normalization, the position embedding, whether the linear layers have biases, QK normalization
and, for MoE models, the router's scoring; left unset, Megatron-LM builds GPT-2's choices
(megatron/training/arguments.py defaults: --normalization LayerNorm, --position-embedding-type
learned_absolute, biases unless --disable-bias-linear, a softmax router). The schema does not
carry them and they cannot be derived from it (SwiGLU models differ in RoPE base, norm epsilon and
QK norm), so they are kept here per preset family, each from the model's own published config.

A model belongs to a family when its name is one of the family's presets (`model: llama3-8b`,
`model: {preset: llama3-70b, ...}`, or a best_plan.yaml written from one) and it still has the
family's activation, embedding tying and attention kind; overridden sizes keep the family. A model
read from a Hugging Face config.json carries the config's own normalization, position embedding
and biases (model.architecture), and the exports build those. Every other model (plain mappings,
MPT) is not guessed at: family_of gives None and the exports say which flags the user must set. MPT has no family here: its released models use ALiBi
(mosaicml/mpt-7b config.json attn_config.alibi), which Megatron-LM's --position-embedding-type
choices (learned_absolute, rope, mrope, relative, none) do not offer.
"""
from __future__ import annotations

from dataclasses import dataclass

from paraplan.specs import ModelSpec

__all__ = ["FAMILIES", "Family", "family_of", "megatron_architecture_args", "megatron_architecture_comments",
           "torchtitan_model"]


@dataclass(frozen=True, kw_only=True)
class Family:
    name: str
    presets: tuple[str, ...]
    source: str
    """Where the facts below come from."""
    activation: str
    tied_embeddings: bool
    latent_attention: bool = False
    """What the model schema carries of the family, to check a model that claims its name."""
    normalization: str
    """Megatron-LM --normalization: LayerNorm or RMSNorm."""
    norm_epsilon: float
    position_embedding: str
    """Megatron-LM --position-embedding-type: learned_absolute or rope."""
    rotary_base: int | None = None
    rope_extra: tuple[str, ...] = ()
    """Megatron-LM flags of the RoPE variant (Llama 3.1 scaling, YaRN)."""
    rope_variant: str = ""
    """That variant in words."""
    linear_bias: bool
    qkv_bias: bool = False
    """Biases on the query/key/value projection alone (Megatron-LM --add-qkv-bias)."""
    qk_norm: bool = False
    router: tuple[str, ...] = ()
    """Megatron-LM router flags where the family's router is not Megatron's default."""
    notes: tuple[str, ...] = ()
    torchtitan_name: str | None = None
    """torchtitan's model of this architecture, where its flavors are this family's."""
    torchtitan_flavors: tuple[tuple[str, tuple[int, int, int, int, int]], ...] = ()
    """(flavor, the (layers, hidden, heads, KV heads, FFN width) it builds)."""

    def describe(self) -> str:
        norm = f"{self.normalization} (eps {self.norm_epsilon:g})"
        if self.position_embedding == "rope":
            base = f"RoPE base {self.rotary_base}" if self.rotary_base is not None else "RoPE (Megatron-LM's base)"
            position = base + (f" with {self.rope_variant}" if self.rope_variant else "")
        else:
            position = "learned absolute positions"
        parts = [norm, position, "biases in every linear layer" if self.linear_bias else
                 "biases on the query, key and value projections only" if self.qkv_bias else "no linear biases"]
        if self.qk_norm:
            parts.append("RMS-normalised MLA latents" if self.latent_attention else "QK norm")
        return f"{self.name}: " + ", ".join(parts)


# GPT-3: Brown et al. 2020 (arXiv 2005.14165) Sec. 2.1, "the same model and architecture as GPT-2"
# (pre-LayerNorm, learned position embeddings, biased linear layers: openai-community/gpt2
# config.json layer_norm_epsilon 1e-05), which is what Megatron-LM's defaults build.
GPT3 = Family(
    name="GPT-3", presets=("gpt3-175b",),
    source="Brown et al. 2020, Sec. 2.1 (GPT-2's architecture) and openai-community/gpt2 config.json",
    activation="gelu", tied_embeddings=True,
    normalization="LayerNorm", norm_epsilon=1e-5, position_embedding="learned_absolute", linear_bias=True,
    notes=("GPT-3 alternates dense and locally banded sparse attention layers (Brown et al. 2020, Sec. 2.1); "
           "Megatron-LM, like the simulation, runs dense attention in every layer.",),
)

# Llama 3.1: meta-llama/Llama-3.1-{8B,70B,405B} config.json (the preset's source): rms_norm_eps
# 1e-05, rope_theta 500000, rope_scaling rope_type llama3 (factor 8, low/high frequency factors
# 1/4, original context 8192: Megatron-LM's --use-rope-scaling, rotary_pos_embedding.py
# _apply_scaling defaults), attention_bias and mlp_bias false. torchtitan's llama3 flavors
# (torchtitan/models/llama3/__init__.py) are these models: RMSNorm, rope_theta 500000 with the same
# scaling (RoPEScalingArgs), no biases, an untied output layer.
LLAMA3 = Family(
    name="Llama 3.1", presets=("llama3-8b", "llama3-70b", "llama3-405b"),
    source="meta-llama/Llama-3.1-{8B,70B,405B} config.json",
    activation="swiglu", tied_embeddings=False,
    normalization="RMSNorm", norm_epsilon=1e-5, position_embedding="rope", rotary_base=500000,
    rope_extra=("--use-rope-scaling",), rope_variant="Llama 3.1 scaling", linear_bias=False,
    notes=("RoPE has Llama 3.1's scaling (--use-rope-scaling), as in the preset's config.json; Llama 3.0 has "
           "none: delete that line for it.",),
    torchtitan_name="llama3",
    torchtitan_flavors=(("8B", (32, 4096, 32, 8, 14336)), ("70B", (80, 8192, 64, 8, 28672)),
                        ("405B", (126, 16384, 128, 8, 53248))),
)

# Llama 2: meta-llama/Llama-2-{7b,70b}-hf config.json: rms_norm_eps 1e-05, rope_theta absent
# (transformers' LlamaConfig default 10000), no biases. torchtitan's llama3 model class builds it
# with a flavor of rope_theta 10000 and no RoPE scaling, which torchtitan does not bundle.
LLAMA2 = Family(
    name="Llama 2", presets=("llama2-7b", "llama2-70b"),
    source="meta-llama/Llama-2-{7b,70b}-hf config.json",
    activation="swiglu", tied_embeddings=False,
    normalization="RMSNorm", norm_epsilon=1e-5, position_embedding="rope", rotary_base=10000, linear_bias=False,
    torchtitan_name="llama3",
)

# Mixtral: mistralai/Mixtral-8x7B-v0.1 and Mixtral-8x22B-v0.1 config.json: rms_norm_eps 1e-05,
# rope_theta 1e6, no biases; the router's softmax over the top 2 of the logits
# equals its softmax-then-renormalise, so Megatron's default router (top-k, then softmax) is it.
MIXTRAL = Family(
    name="Mixtral", presets=("mixtral-8x7b", "mixtral-8x22b"),
    source="mistralai/Mixtral-8x7B-v0.1, Mixtral-8x22B-v0.1 config.json",
    activation="swiglu", tied_embeddings=False,
    normalization="RMSNorm", norm_epsilon=1e-5, position_embedding="rope", rotary_base=1000000, linear_bias=False,
)

# Qwen3-235B-A22B: Qwen/Qwen3-235B-A22B config.json: rms_norm_eps 1e-06, rope_theta 1e6,
# attention_bias false, RMSNorm on each head's queries and keys (Qwen3 q_norm / k_norm: Megatron's
# --qk-layernorm, of the model's --normalization kind), norm_topk_prob true (softmax, top 8,
# renormalised: Megatron's default router).
QWEN3_MOE = Family(
    name="Qwen3-MoE", presets=("qwen3-235b-a22b",),
    source="Qwen/Qwen3-235B-A22B config.json",
    activation="swiglu", tied_embeddings=False,
    normalization="RMSNorm", norm_epsilon=1e-6, position_embedding="rope", rotary_base=1000000, linear_bias=False,
    qk_norm=True,
)

# DeepSeek-V3: deepseek-ai/DeepSeek-V3 config.json: rms_norm_eps 1e-06, rope_theta 10000,
# rope_scaling yarn (factor 40, original_max_position_embeddings 4096, beta_fast 32, beta_slow 1,
# mscale 1, mscale_all_dim 1; Megatron's MLATransformerConfig defaults hold the 4096, 32 and 1,
# arguments.py's --rotary-scaling-factor (default 1.0) and --mscale-all-dim (0.0) must be given),
# RMSNorm on the MLA latents (Megatron: --qk-layernorm), no biases; router scoring_func sigmoid,
# aux-loss-free expert bias (topk_method noaux_tc), routed_scaling_factor 2.5 (its n_group 8 /
# topk_group 4 are the preset's model.moe.expert_groups / groups_per_token, emitted with the
# experts). Flags as in NVIDIA's examples/post_training/modelopt/conf/deepseek-ai/DeepSeek-R1.sh
# (same architecture), --moe-router-pre-softmax included because arguments.py's help ties the
# scaling factor to it ("only works when --moe-router-pre-softmax enabled").
DEEPSEEK_V3 = Family(
    name="DeepSeek-V3", presets=("deepseek-v3",),
    source="deepseek-ai/DeepSeek-V3 config.json",
    activation="swiglu", tied_embeddings=False, latent_attention=True,
    normalization="RMSNorm", norm_epsilon=1e-6, position_embedding="rope", rotary_base=10000,
    rope_extra=("--rope-type", "yarn", "--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim", "1.0"),
    rope_variant="YaRN (factor 40 over 4096 positions)", linear_bias=False, qk_norm=True,
    router=("--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-pre-softmax",
            "--moe-router-topk-scaling-factor", "2.5"),
    notes=("RoPE is YaRN as in the released config.json; DeepSeek-V3 pretrained with plain RoPE and added YaRN for "
           "its long-context phases (arXiv 2412.19437, Sec. 4.3): to pretrain as it did, replace the --rope-type, "
           "--rotary-scaling-factor, --mscale and --mscale-all-dim lines with --rope-type rope and --no-rope-fusion "
           "(transformer_config.py: \"apply_rope_fusion for MLA only works with YARN RoPE\").",),
)

FAMILIES = (GPT3, LLAMA3, LLAMA2, MIXTRAL, QWEN3_MOE, DEEPSEEK_V3)


def family_of(model: ModelSpec) -> Family | None:
    """The preset family `model` is named after, if it still has that family's activation,
    embedding tying, linear biases and attention kind; else, for a model whose architecture a
    config.json gave (model.architecture), that architecture."""
    if model.architecture is not None:  # the model's own, stated: it wins over a preset name's family
        return _family_of_architecture(model)
    for fam in FAMILIES:
        if model.name in fam.presets:
            same = (model.activation == fam.activation and model.tied_embeddings == fam.tied_embeddings
                    and model.linear_bias == fam.linear_bias and (model.mla is not None) == fam.latent_attention
                    and (fam.latent_attention or model.qk_layernorm == fam.qk_norm))
            return fam if same else None
    return None


_MEGATRON_NORM = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}
_MEGATRON_POSITION = {"rope": "rope", "learned": "learned_absolute", "none": "none"}


def _family_of_architecture(model: ModelSpec) -> Family | None:
    """The Megatron-LM flags of the normalization, position embedding and biases the model's
    config.json gave (arguments.py: --normalization, --norm-epsilon, --position-embedding-type,
    --rotary-base, --use-rope-scaling (Llama 3.1's scaling, of factor 8 by default), --rope-type
    yarn with --rotary-scaling-factor, --add-qkv-bias). None for ALiBi, which Megatron-LM does not
    offer. The router stays Megatron's default (softmax, top-k) and is said to."""
    a = model.architecture
    if a.position_embedding not in _MEGATRON_POSITION:
        return None
    rope_extra: tuple[str, ...] = ()
    variant, notes = "", []
    if a.rope_scaling == "llama3":
        rope_extra, variant = ("--use-rope-scaling",), "Llama 3.1 scaling"
        if a.rope_scaling_factor not in (None, 8.0):
            rope_extra += ("--rope-scaling-factor", f"{a.rope_scaling_factor:g}")
            variant += f" (factor {a.rope_scaling_factor:g})"
    elif a.rope_scaling == "linear" and a.rope_scaling_factor and a.rope_scaling_factor.is_integer():
        # position interpolation (Chen et al. 2023): Megatron-LM's integer interpolation factor
        rope_extra = ("--rotary-seq-len-interpolation-factor", f"{a.rope_scaling_factor:g}")
        variant = f"linear position interpolation (factor {a.rope_scaling_factor:g})"
    elif a.rope_scaling in ("linear", "dynamic", "longrope"):
        variant = f"{a.rope_scaling} scaling (factor {a.rope_scaling_factor or 1:g})"
        notes.append(f"Megatron-LM has no flag for the config's {variant}: these arguments train plain RoPE")
    elif a.rope_scaling == "yarn" and model.mla is not None:
        # Megatron-LM reads --rope-type and its YaRN settings for multi-latent attention only
        # (MLATransformerConfig); DeepSeek-V3's config.json has mscale = mscale_all_dim = 1
        factor = a.rope_scaling_factor or 1.0
        rope_extra, variant = ("--rope-type", "yarn", "--rotary-scaling-factor", f"{factor:g}"), f"YaRN (factor {factor:g})"
        notes.append("YaRN's other settings (original context, beta_fast/slow, --mscale, --mscale-all-dim, whose "
                     "Megatron-LM default 0 differs from DeepSeek-V3's 1) are left at Megatron-LM's defaults: set them "
                     "from the config.json's rope_scaling")
    elif a.rope_scaling == "yarn":
        variant = f"YaRN (factor {a.rope_scaling_factor or 1:g})"
        notes.append(f"Megatron-LM builds YaRN for multi-latent attention only (--rope-type): these arguments train "
                     f"plain RoPE, not the config's {variant}")
    llama_like = (model.activation == "swiglu" and a.normalization == "rmsnorm" and a.position_embedding == "rope"
                  and not (a.qkv_bias or model.linear_bias or model.qk_layernorm or model.mla or model.moe))
    if a.output_bias and not model.linear_bias:
        notes.append("the config's attention_bias also biases the attention's output projection, which Megatron-LM "
                     "has no flag for alone (--add-qkv-bias covers the query, key and value projections)")
    if model.moe is not None:
        notes.append("the router is Megatron-LM's default (softmax over the top-k logits); set --moe-router-* "
                     "where the model's differs (sigmoid scoring, expert bias, scaling)")
    return Family(
        name="as model.architecture states it", presets=(), source="model.architecture (read from the config.json of an "
                                                                   "hf_config model)",
        activation=model.activation, tied_embeddings=model.tied_embeddings, latent_attention=model.mla is not None,
        normalization=_MEGATRON_NORM[a.normalization], norm_epsilon=a.norm_epsilon,
        position_embedding=_MEGATRON_POSITION[a.position_embedding],
        rotary_base=None if a.rotary_base is None else round(a.rotary_base),  # Megatron's --rotary-base is an int
        rope_extra=rope_extra, rope_variant=variant, linear_bias=model.linear_bias, qkv_bias=a.qkv_bias,
        qk_norm=model.qk_layernorm or model.mla is not None, notes=tuple(notes),
        torchtitan_name="llama3" if llama_like else None,
        # torchtitan's llama3 flavors have Llama 3.1's RoPE (base 500000, scaling of factor 8)
        torchtitan_flavors=LLAMA3.torchtitan_flavors if llama_like and (a.rotary_base, a.rope_scaling,
                                                                        a.rope_scaling_factor) == (500000, "llama3", 8) else (),
    )


def megatron_architecture_args(model: ModelSpec) -> list[str]:
    """The family's normalization, position embedding, biases, QK norm and router as Megatron-LM
    pretrain_gpt.py flags (megatron/training/arguments.py: --normalization, --norm-epsilon,
    --position-embedding-type, --rotary-base, --use-rope-scaling, --rope-type,
    --rotary-scaling-factor, --mscale, --mscale-all-dim, --disable-bias-linear, --qk-layernorm,
    --moe-router-*); none for a model of no known family."""
    fam = family_of(model)
    if fam is None:  # the biases are the model's own (model.linear_bias); the rest is the user's to set
        return [] if model.linear_bias else ["--disable-bias-linear"]
    a = ["--normalization", fam.normalization, "--norm-epsilon", f"{fam.norm_epsilon:g}",
         "--position-embedding-type", fam.position_embedding]
    if fam.rotary_base is not None:
        a += ["--rotary-base", str(fam.rotary_base)]
    a += fam.rope_extra
    if not fam.linear_bias:
        a.append("--disable-bias-linear")
    if fam.qkv_bias and not fam.linear_bias:
        a.append("--add-qkv-bias")
    if fam.qk_norm and not model.qk_layernorm:  # MLA's latent norms (a head norm is the model's own flag)
        a.append("--qk-layernorm")
    if model.moe is not None:
        a += fam.router
    return a


def megatron_architecture_comments(model: ModelSpec) -> list[str]:
    """Comment lines for megatron_args.txt: the architecture the arguments build, and what the user
    must know or set about it."""
    fam = family_of(model)
    if fam is None:
        return [f"Architecture: {model.name!r} is not a bundled preset family ({', '.join(_preset_names())}) or "
                "differs from it in activation, embedding tying, linear biases or attention, and has no "
                "model.architecture (a config.json gives one; ALiBi has no Megatron-LM flag), so these arguments "
                "leave Megatron-LM's "
                "defaults (LayerNorm, learned absolute positions) and follow model.linear_bias ("
                + ("biases in every linear layer" if model.linear_bias else "--disable-bias-linear")
                + "): set --normalization, --norm-epsilon, --position-embedding-type (rope with --rotary-base), "
                "--add-qkv-bias and --qk-layernorm as your model has them."]
    lines = [f"Architecture: {fam.describe()}; from {fam.source}."]
    lines += [f"Note: {n}" for n in fam.notes]
    return lines


def torchtitan_model(model: ModelSpec) -> tuple[str, str, list[str]]:
    """([model] name, flavor, comment lines) for torchtitan. A flavor is named only where it builds
    exactly this model: the family's architecture and the flavor's layers, widths and heads (the
    vocabulary comes from the tokenizer there)."""
    fam = family_of(model)
    shape = (model.num_layers, model.hidden_size, model.num_attention_heads, model.num_kv_heads,
             model.ffn_hidden_size)
    flavor = "CHANGE-ME"
    if fam is not None and model.moe is None and model.head_dim * model.num_attention_heads == model.hidden_size:
        flavor = next((f for f, s in fam.torchtitan_flavors if s == shape), flavor)
    name = fam.torchtitan_name if fam is not None and fam.torchtitan_name and model.moe is None else "CHANGE-ME"
    if fam is None:
        lines = ["Architecture: not known to paraplan (no bundled preset family and no model.architecture); choose "
                 "a torchtitan model and flavor with your model's."]
    elif flavor != "CHANGE-ME":
        lines = [f"Architecture: {fam.describe()}; from {fam.source}: torchtitan's {name} flavor {flavor}."]
    else:
        lines = [f"Architecture: {fam.describe()}; from {fam.source}. Choose or define a torchtitan flavor with it."]
    return name, flavor, lines


def _preset_names() -> list[str]:
    return [p for fam in FAMILIES for p in fam.presets]
