"""The strict scenario loader: YAML (or an already-parsed mapping) to a frozen `Scenario`.

A scenario has the sections `name`, `model`, `cluster`, `training`, `plan` and `search`; the
bundled files in `scenarios/` show every key. Strict means: an unknown key is rejected with its
full path and a "did you mean", a wrong type or an out-of-range value names the key and what it
expected, an enum lists its allowed values, and a missing required key is named. Every error is a
`ConfigError(path, message)` with `path` like `plan.tp` or `cluster.inter_node.topology`.

YAML keys carry their unit (`bandwidth_GBps`, `nic_bandwidth_Gbps`, `latency_us`); the specs are
SI (bytes/s, seconds), and the conversion lives in the schema next to the key.

`--set dotted.path=value` overrides are applied to the raw mapping *before* validation, so an
override goes through exactly the checks a key written in the file does.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from paraplan.errors import ConfigError
from paraplan.fileio import parse_yaml, read_text, yaml_problem
from paraplan.specs import (
    ACTIVATIONS, ATTENTION_KERNELS, BACKENDS, BANDWIDTH_RANGE, CP_COMM_TYPES, GRAD_REDUCE_DTYPES, LATENCY_RANGE,
    MOE_DISPATCHERS, NORMALIZATIONS, OVERSUBSCRIPTION_RANGE, POSITION_EMBEDDINGS, PRECISIONS, RECOMPUTE,
    RECOMPUTE_MODULES, ROPE_SCALINGS, ROUTING_DISTRIBUTIONS, SCHEDULES, TOPOLOGIES, ZERO_STAGES,
    ArchitectureSpec, ClusterSpec, InterNodeSpec, MLASpec, ModelSpec, MoESpec, PlanSpec, RoutingSpec, RunSpec,
    Scenario, TrainingSpec,
)

# ----------------------------------------------------------------------------------------------
# Value checks: each returns the value or raises _Invalid with what it expected.


class _Invalid(Exception):
    """A value failed its check; the caller adds the key path."""


Check = Callable[[Any], Any]


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML, for error messages."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    return repr(value)


def _integer(minimum: int | None = None, maximum: int | None = None, maximum_text: str | None = None) -> Check:
    """An int (a bool is not one), at least `minimum` and at most `maximum`."""
    def check(value):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Invalid(f"expected an integer, got {_show(value)}")
        if maximum is not None and value > maximum:
            raise _Invalid(f"expected an integer from {minimum} to {maximum_text or maximum}, got {value}")
        if minimum is not None and value < minimum:
            wanted = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise _Invalid(f"expected {wanted}, got {value}")
        return value
    return check


# The deepest published transformers have about a thousand layers; the simulator prices a layer at a
# time, so a typo like 10**9 would run for hours before reporting the plan does not fit.
MAX_LAYERS = 100_000


def _up_to_power_of_two(exponent: int, minimum: int = 1) -> Check:
    """An integer from `minimum` to 2**exponent, the bound named as such in errors."""
    return _integer(minimum=minimum, maximum=2**exponent, maximum_text=f"2**{exponent}")


# Likewise for the model's widths, vocabulary and experts, the sequence and the cluster: each far
# above any published model or cluster (widths ~2**15, vocabularies ~2**18, 384 experts, 100k-GPU
# clusters), below the sizes whose per-bucket and per-expert pricing would run for minutes or
# exhaust the host's memory before reporting that nothing fits.
WIDTH = _up_to_power_of_two(20)
HEADS = _up_to_power_of_two(16)
VOCAB = _up_to_power_of_two(24)
EXPERTS = _up_to_power_of_two(20)
SEQUENCE = _up_to_power_of_two(26)
BATCH = _up_to_power_of_two(40)
NODES = _up_to_power_of_two(20)
GPUS_PER_NODE = _up_to_power_of_two(10)

# numpy's generators (routing draws, Optuna's samplers) and torch's seeding through them take seeds
# in [0, 2**32)
MAX_SEED, MAX_SEED_TEXT = 2**32 - 1, "2**32 - 1"
SEED = _integer(minimum=0, maximum=MAX_SEED, maximum_text=MAX_SEED_TEXT)


def _probability(value):
    """A dropout probability: a number in [0, 1)."""
    value = _number(minimum=0)(value)
    if value >= 1:
        raise _Invalid(f"expected a probability in [0, 1), got {value}")
    return value


def _number(*, positive: bool = False, minimum: float | None = None, maximum: float | None = None) -> Check:
    """A finite int or float (not a bool), > 0 if `positive`, >= `minimum` and <= `maximum` if
    given; returned as float."""
    def check(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Invalid(f"expected a number, got {_show(value)}")
        if not math.isfinite(value):
            raise _Invalid(f"expected a finite number, got {value}")
        if positive and value <= 0:
            raise _Invalid(f"expected a positive number, got {value}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            low = f"{minimum:g}" if minimum is not None else "0"
            raise _Invalid(f"expected a number from {low} to {maximum:g}, got {value:g}" if maximum is not None
                           else f"expected a number >= {minimum:g}, got {value:g}")
        return float(value)
    return check


def _physical(si_range: tuple[float, float], per_unit: float) -> Check:
    """A figure in a unit of `per_unit` SI units, its SI value within `si_range` (paraplan.specs)."""
    return _number(minimum=si_range[0] / per_unit, maximum=si_range[1] / per_unit)


LINK_GBPS = _physical(BANDWIDTH_RANGE, 1e9)
NIC_GBITPS = _physical(BANDWIDTH_RANGE, 1e9 / 8)
LATENCY_US = _physical(LATENCY_RANGE, 1e-6)


def _boolean(value):
    if not isinstance(value, bool):
        raise _Invalid(f"expected true or false, got {_show(value)}")
    return value


def _string(value):
    if not isinstance(value, str) or not value:
        raise _Invalid(f"expected a non-empty string, got {_show(value)}")
    return value


def _one_of(choices: tuple) -> Check:
    """One of `choices`, of the same type (so `true` is not the zero stage 1)."""
    def check(value):
        if any(type(value) is type(c) and value == c for c in choices):
            return value
        words = all(isinstance(c, str) for c in choices)
        hint = _did_you_mean(value, choices) if words and isinstance(value, str) else ""
        if words and isinstance(value, bool):  # YAML 1.1 reads yes/no/on/off as booleans
            hint = " (YAML reads on/off/yes/no as true/false)"
        raise _Invalid(f"{_show(value)} is not one of {', '.join(map(str, choices))}{hint}")
    return check


def _distinct_list(check: Check) -> Check:
    """A non-empty list (or a single value) whose items each pass `check`, none twice; a tuple."""
    def check_list(value):
        items = value if isinstance(value, list) else [value]
        if not items:
            raise _Invalid("expected a non-empty list")
        out = tuple(check(v) for v in items)
        twice = sorted({str(v) for v in out if out.count(v) > 1})
        if twice:
            raise _Invalid(f"{', '.join(twice)} listed twice")
        return out
    return check_list


def _optional(check: Check) -> Check:
    """`check`, or null."""
    return lambda value: None if value is None else check(value)


def _anything(value):
    """Sections validated by their own schema later (model, cluster, intra_node, ...)."""
    return value


def _did_you_mean(word: Any, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(word), list(known), n=1)
    return f", did you mean '{close[0]}'?" if close else ""


# ----------------------------------------------------------------------------------------------
# Schemas: YAML key -> Key. `field` renames to the spec's field, `to_si` converts the unit.


@dataclass(frozen=True)
class Key:
    """How one YAML key is checked and turned into a spec field."""

    check: Check
    """Returns the value or raises _Invalid."""
    required: bool = False
    field: str | None = None
    """The spec field it fills, when the YAML name differs (it carries a unit)."""
    to_si: Callable[[float], float] | None = None
    """Converts the YAML unit to SI."""


Schema = Mapping[str, Key]


def _schema(**keys: Key) -> Schema:
    return MappingProxyType(keys)


def _gigabytes_per_s(value: float) -> float:
    """GB/s (1e9 bytes) -> bytes/s."""
    return value * 1e9


def _gigabits_per_s(value: float) -> float:
    """Gb/s (1e9 bits, how NICs are sold) -> bytes/s."""
    return value * 1e9 / 8


def _microseconds(value: float) -> float:
    """us -> s; a division, so 5 us is exactly the float 5e-6."""
    return value / 1e6


POSITIVE = _integer(minimum=1)

TOP = _schema(
    name=Key(_string),
    model=Key(_anything, required=True),
    cluster=Key(_anything, required=True),
    training=Key(_anything, required=True),
    plan=Key(_anything),
    search=Key(_anything),
    run=Key(_anything),
)

# activation is required although ModelSpec defaults it: guessing gelu for a swiglu model silently
# drops a third of the FFN weights.
MODEL = _schema(
    name=Key(_string),
    num_layers=Key(_integer(minimum=1, maximum=MAX_LAYERS), required=True),
    hidden_size=Key(WIDTH, required=True),
    num_attention_heads=Key(HEADS, required=True),
    num_kv_heads=Key(HEADS),
    head_dim=Key(WIDTH),
    ffn_hidden_size=Key(WIDTH),
    vocab_size=Key(VOCAB, required=True),
    activation=Key(_one_of(ACTIVATIONS), required=True),
    tied_embeddings=Key(_boolean),
    dropout=Key(_probability),
    linear_bias=Key(_boolean),
    qk_layernorm=Key(_boolean),
    moe=Key(_anything),
    mla=Key(_anything),
    mtp_layers=Key(_integer(minimum=0, maximum=MAX_LAYERS)),
    sliding_window=Key(_optional(POSITIVE)),
    architecture=Key(_anything),
)
ARCHITECTURE = _schema(
    normalization=Key(_one_of(NORMALIZATIONS), required=True),
    norm_epsilon=Key(_number(positive=True, maximum=1.0), required=True),
    position_embedding=Key(_one_of(POSITION_EMBEDDINGS), required=True),
    rotary_base=Key(_optional(_number(positive=True, maximum=1e12))),
    rope_scaling=Key(_optional(_one_of(ROPE_SCALINGS))),
    rope_scaling_factor=Key(_optional(_number(positive=True))),
    qkv_bias=Key(_boolean),
    output_bias=Key(_boolean),
)
MLA = _schema(
    q_lora_rank=Key(_optional(WIDTH), required=True),
    kv_lora_rank=Key(WIDTH, required=True),
    qk_head_dim=Key(WIDTH, required=True),
    qk_rope_head_dim=Key(WIDTH, required=True),
    v_head_dim=Key(WIDTH, required=True),
)
MOE = _schema(
    num_experts=Key(EXPERTS, required=True),
    top_k=Key(POSITIVE, required=True),
    expert_ffn_hidden_size=Key(WIDTH, required=True),
    num_shared_experts=Key(_up_to_power_of_two(20, minimum=0)),
    first_dense_layers=Key(_integer(minimum=0)),
    moe_layer_freq=Key(POSITIVE),
    capacity_factor=Key(_optional(_number(positive=True))),
    expert_groups=Key(POSITIVE),
    groups_per_token=Key(POSITIVE),
    routing=Key(_anything),
)
ROUTING = _schema(
    distribution=Key(_one_of(ROUTING_DISTRIBUTIONS)),
    s=Key(_number(positive=True)),
    tokens_per_expert=Key(_anything),
    seed=Key(SEED),
)
MODEL_SOURCES = ("preset", "hf_config")

CLUSTER = _schema(
    gpu=Key(_string, required=True),
    num_nodes=Key(NODES, required=True),
    gpus_per_node=Key(GPUS_PER_NODE, required=True),
    intra_node=Key(_anything),
    inter_node=Key(_anything),
)

INTRA_NODE = _schema(
    bandwidth_GBps=Key(LINK_GBPS, field="bandwidth", to_si=_gigabytes_per_s),
    latency_us=Key(LATENCY_US, field="latency", to_si=_microseconds),
)

INTER_NODE = _schema(
    nics_per_node=Key(POSITIVE),
    nic_bandwidth_Gbps=Key(NIC_GBITPS, field="nic_bandwidth", to_si=_gigabits_per_s),
    topology=Key(_one_of(TOPOLOGIES)),
    oversubscription=Key(_physical(OVERSUBSCRIPTION_RANGE, 1.0)),
    latency_us=Key(LATENCY_US, field="latency", to_si=_microseconds),
    nodes_per_leaf=Key(POSITIVE),
)

TRAINING = _schema(
    seq_length=Key(SEQUENCE, required=True),
    global_batch_size=Key(BATCH, required=True),
    precision=Key(_one_of(PRECISIONS), required=True),
    attention=Key(_one_of(ATTENTION_KERNELS)),
    grad_reduce_dtype=Key(_one_of(GRAD_REDUCE_DTYPES)),
)

RUN = _schema(
    steps=Key(POSITIVE),
    warmup_steps=Key(_integer(minimum=0)),
    seed=Key(SEED),
    backend=Key(_one_of(BACKENDS)),
    timeout_s=Key(_number(positive=True)),
    num_layers=Key(_optional(POSITIVE)),
    hidden_size=Key(_optional(POSITIVE)),
)

# Every plan key is optional; missing ones take PlanSpec's defaults, except dp, which is derived.
PLAN = _schema(
    tp=Key(POSITIVE),
    pp=Key(POSITIVE),
    dp=Key(POSITIVE),
    cp=Key(POSITIVE),
    cp_comm_type=Key(_one_of(CP_COMM_TYPES)),
    cp_a2a_size=Key(_optional(POSITIVE)),
    ep=Key(POSITIVE),
    micro_batch_size=Key(POSITIVE),
    virtual_pipeline_stages=Key(POSITIVE),
    schedule=Key(_one_of(SCHEDULES)),
    sequence_parallel=Key(_boolean),
    zero_stage=Key(_one_of(ZERO_STAGES)),
    recompute=Key(_one_of(RECOMPUTE)),
    recompute_modules=Key(_distinct_list(_one_of(RECOMPUTE_MODULES))),
    overlap_grad_reduce=Key(_boolean),
    overlap_param_gather=Key(_boolean),
    tp_comm_overlap=Key(_boolean),
    tp_backward_overlap=Key(_boolean),
    gradient_accumulation_fusion=Key(_optional(_boolean)),
    p2p_scatter_gather=Key(_boolean),
    wait_forward_sends=Key(_optional(_boolean)),
    expert_tp=Key(POSITIVE),
    moe_shared_expert_overlap=Key(_boolean),
    overlap_moe_expert_parallel_comm=Key(_boolean),
    moe_dispatcher=Key(_one_of(MOE_DISPATCHERS)),
    first_stage_layers=Key(_optional(_integer(minimum=0))),
    last_stage_layers=Key(_optional(_integer(minimum=0))),
)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _validate(raw: Any, path: str, schema: Schema, *, also_known: Iterable[str] = ()) -> dict[str, Any]:
    """Check `raw` against `schema`; return {spec field: checked, SI value} for the keys given.

    Unknown keys are reported first (a misspelt key is better named than the key it misspells
    reported missing), then missing required keys, then bad values. `also_known` only widens the
    "did you mean" vocabulary (e.g. `preset` in a model section).
    """
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"expected a mapping, got {_show(raw)}")
    for key in raw:
        if key not in schema:
            known = [*schema, *also_known]
            hint = _did_you_mean(key, known) or f"; expected one of: {', '.join(known)}"
            raise ConfigError(_join(path, key), f"unknown key{hint}")
    for key, spec in schema.items():
        if spec.required and key not in raw:
            raise ConfigError(_join(path, key), "required key missing")
    out = {}
    for key, value in raw.items():
        spec = schema[key]
        try:
            value = spec.check(value)
        except _Invalid as exc:
            raise ConfigError(_join(path, key), str(exc)) from None
        out[spec.field or key] = spec.to_si(value) if spec.to_si and value is not None else value
    return out


# ----------------------------------------------------------------------------------------------
# Reading files.


def read_scenario_file(path: Path) -> dict:
    """A scenario file's top-level mapping, parsed as load_scenario parses it (no validation)."""
    if not path.exists():
        raise ConfigError("", f"scenario file not found: {path}")
    text = read_text(path, "scenario")
    try:
        raw = parse_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"invalid YAML: {yaml_problem(exc)}") from None
    if not isinstance(raw, Mapping):
        raise ConfigError(str(path), f"expected a mapping at the top level, got {_show(raw)}")
    return dict(raw)


def _bundled_presets(filename: str) -> dict:
    """name -> mapping from paraplan/presets/<filename> (read afresh: callers may mutate it)."""
    text = resources.files("paraplan.presets").joinpath(filename).read_text(encoding="utf-8")
    return parse_yaml(text)


def _preset(kind: str, name: Any, path: str) -> dict:
    """The bundled `kind` ("model" or "cluster") preset `name`; errors name `path`."""
    presets = _bundled_presets(f"{kind}s.yaml")
    if not isinstance(name, str):
        raise ConfigError(path, f"expected a {kind} preset name, got {_show(name)}")
    if name not in presets:
        raise ConfigError(path, f"unknown {kind} preset {name!r}{_did_you_mean(name, presets)}; "
                                f"bundled: {', '.join(presets)}")
    return copy.deepcopy(presets[name])


def _deep_merge(base: Mapping, override: Mapping) -> dict:
    """`base` with `override` on top; nested mappings merge key by key."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _resolve_path(value: str, base_dir: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base_dir / path


# ----------------------------------------------------------------------------------------------
# Hugging Face config.json -> model mapping.

HF_PATH = "model.hf_config"


def _hf_llama(cfg: Mapping, need: Callable[[str], Any]) -> dict:
    """Llama, Mistral, Mixtral, Qwen2: a gated MLP; silu gating is SwiGLU."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(HF_PATH, f"hidden_act {act!r} with a gated MLP is not supported (silu -> swiglu)")
    heads = need("num_attention_heads")
    out = {
        "num_layers": need("num_hidden_layers"),
        "hidden_size": need("hidden_size"),
        "num_attention_heads": heads,
        "num_kv_heads": _hf_or(cfg, "num_key_value_heads", heads),  # absent in Llama 1 / Llama 2 7B
        "ffn_hidden_size": need("intermediate_size"),
        "vocab_size": need("vocab_size"),
        "activation": "swiglu",
        "tied_embeddings": cfg.get("tie_word_embeddings", False),
        "dropout": _hf_number(cfg, "attention_dropout", 0.0),  # the only dropout these configs have
    }
    if cfg.get("head_dim") is not None:
        out["head_dim"] = cfg["head_dim"]
    out["architecture"] = _hf_rope_architecture(cfg)
    window = _hf_sliding_window(cfg)
    if window is not None:
        out["sliding_window"] = window
    if cfg.get("num_local_experts") is not None:  # Mixtral: every layer MoE, intermediate_size is per expert
        out["moe"] = {"num_experts": cfg["num_local_experts"], "top_k": need("num_experts_per_tok"),
                      "expert_ffn_hidden_size": need("intermediate_size")}
    return out


def _hf_sliding_window(cfg: Mapping) -> int | None:
    """The attention window as transformers reads the config: MistralConfig's sliding_window
    defaults to 4096 (null: none), MixtralConfig's to none, and Qwen2/Qwen3's applies only with
    use_sliding_window (default false); Llama has none."""
    kind = cfg.get("model_type")
    if kind == "mistral":
        return cfg.get("sliding_window", 4096)
    if kind == "mixtral":
        return cfg.get("sliding_window")
    if kind in ("qwen2", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window", False):
        # the layers from max_window_layers on use the window (transformers Qwen2Config): none if that is past the last
        layers, first = cfg.get("num_hidden_layers"), cfg.get("max_window_layers")
        if isinstance(layers, int) and isinstance(first, int) and first >= layers:
            return None
        return cfg.get("sliding_window")
    return None


def _hf_rope_architecture(cfg: Mapping) -> dict:
    """RMSNorm and rotary embeddings with the config's epsilon, base and scaling (transformers'
    defaults where it leaves them out: rms_norm_eps 1e-6, rope_theta 10000), and attention_bias
    (default false), which transformers' LlamaAttention (Mistral's, Qwen3's) puts on the q, k, v
    and o projections. Configs saved by transformers 5 keep the base and the scaling
    in rope_parameters."""
    bias = bool(cfg.get("attention_bias", False))
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping):
        cfg = {**cfg, "rope_theta": params.get("rope_theta", cfg.get("rope_theta")),
               "rope_scaling": params if params.get("rope_type", "default") != "default" else None}
    arch = {"normalization": "rmsnorm", "norm_epsilon": _hf_number(cfg, "rms_norm_eps", 1e-6),
            "position_embedding": "rope", "rotary_base": _hf_number(cfg, "rope_theta", 10000.0), "qkv_bias": bias,
            "output_bias": bias}
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, Mapping):
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ROPE_SCALINGS + ("default",):
            raise ConfigError(HF_PATH, f"rope_scaling type {kind!r} is not one of transformers' "
                                       f"({', '.join(ROPE_SCALINGS)}, default)")
        if kind != "default":
            arch["rope_scaling"] = kind
            arch["rope_scaling_factor"] = _hf_number(scaling, "factor", 8.0 if kind == "llama3" else 1.0)
    elif scaling is not None:
        raise ConfigError(HF_PATH, f"rope_scaling: expected a mapping or null, got {_show(scaling)}")
    return arch


# transformers MixtralConfig's defaults: a Mixtral config.json may leave them out
MIXTRAL_DEFAULTS = MappingProxyType({"num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1e6,
                                     "rms_norm_eps": 1e-5})


def _hf_mixtral(cfg: Mapping, need: Callable[[str], Any]) -> dict:
    """Mixtral: Llama's layer with every MLP an MoE of num_local_experts (default 8, top 2)."""
    cfg = {**cfg, **{k: v for k, v in MIXTRAL_DEFAULTS.items() if cfg.get(k) is None}}
    return _hf_llama(cfg, lambda key: cfg[key] if cfg.get(key) is not None else need(key))


def _hf_qwen2(cfg: Mapping, need: Callable[[str], Any]) -> dict:
    """Qwen2: Llama's layer with biases on the query, key and value projections (transformers
    Qwen2Attention: q_proj, k_proj, v_proj bias=True)."""
    out = _hf_llama(cfg, need)
    out["architecture"]["qkv_bias"] = True
    out["architecture"]["output_bias"] = False  # Qwen2Attention: o_proj bias=False
    return out


def _hf_qwen3(cfg: Mapping, need: Callable[[str], Any]) -> dict:
    """Qwen3: Llama-style, with an RMSNorm over each head's queries and keys (transformers
    Qwen3Attention q_norm / k_norm)."""
    return {**_hf_llama(cfg, need), "qk_layernorm": True}


def _hf_qwen3_moe(cfg: Mapping, need: Callable[[str], Any]) -> dict:
    """Qwen3-MoE: Qwen3's attention, experts of moe_intermediate_size every decoder_sparse_step."""
    out = _hf_qwen3(cfg, need)
    out["moe"] = {"num_experts": need("num_experts"), "top_k": need("num_experts_per_tok"),
                  "expert_ffn_hidden_size": need("moe_intermediate_size"),
                  "moe_layer_freq": _hf_or(cfg, "decoder_sparse_step", 1)}
    if cfg.get("mlp_only_layers"):
        raise ConfigError(HF_PATH, "mlp_only_layers (dense layers between MoE layers) is not supported")
    return out


def _hf_deepseek_v3(cfg: Mapping, need: Callable[[str], Any]) -> dict:
    """DeepSeek-V3 (and V2): multi-head latent attention, leading dense layers, routed + shared
    experts (transformers DeepseekV3Config: q_lora_rank null means a direct query projection)."""
    heads = need("num_attention_heads")
    return {
        "num_layers": need("num_hidden_layers"), "hidden_size": need("hidden_size"),
        "num_attention_heads": heads,
        "mtp_layers": _hf_or(cfg, "num_nextn_predict_layers", 0),
        "mla": {"q_lora_rank": cfg.get("q_lora_rank"), "kv_lora_rank": need("kv_lora_rank"),
                "qk_head_dim": need("qk_nope_head_dim"), "qk_rope_head_dim": need("qk_rope_head_dim"),
                "v_head_dim": need("v_head_dim")},
        "ffn_hidden_size": need("intermediate_size"), "vocab_size": need("vocab_size"),
        "activation": "swiglu", "tied_embeddings": cfg.get("tie_word_embeddings", False),
        "dropout": _hf_number(cfg, "attention_dropout", 0.0),
        # MLA's latent projections are no QKV projection: attention_bias does not map to --add-qkv-bias
        "architecture": {**_hf_rope_architecture(cfg), "qkv_bias": False, "output_bias": False},
        "moe": {"num_experts": need("n_routed_experts"), "top_k": need("num_experts_per_tok"),
                "expert_ffn_hidden_size": need("moe_intermediate_size"),
                "num_shared_experts": _hf_or(cfg, "n_shared_experts", 0),
                "first_dense_layers": _hf_or(cfg, "first_k_dense_replace", 0),
                "moe_layer_freq": _hf_or(cfg, "moe_layer_freq", 1),
                # group-limited routing (DeepseekV3Config n_group / topk_group)
                "expert_groups": _hf_or(cfg, "n_group", 1),
                "groups_per_token": _hf_or(cfg, "topk_group", _hf_or(cfg, "n_group", 1))},
    }


GPT2_ACTIVATIONS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")


def _hf_gpt2(cfg: Mapping, need: Callable[[str], Any]) -> dict:
    """GPT-2: n_* names, 4h FFN unless n_inner says otherwise, tied embeddings by default."""
    act = cfg.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise ConfigError(HF_PATH, f"activation_function {act!r} is not supported ({', '.join(GPT2_ACTIVATIONS)})")
    out = {
        "num_layers": need("n_layer"),
        "hidden_size": need("n_embd"),
        "num_attention_heads": need("n_head"),
        "vocab_size": need("vocab_size"),
        "activation": "gelu",
        "tied_embeddings": cfg.get("tie_word_embeddings", True),
        "dropout": _hf_number(cfg, "resid_pdrop", 0.1),  # GPT2Config's default
        "architecture": {"normalization": "layernorm", "norm_epsilon": _hf_number(cfg, "layer_norm_epsilon", 1e-5),
                         "position_embedding": "learned"},
    }
    if cfg.get("n_inner") is not None:
        out["ffn_hidden_size"] = cfg["n_inner"]
    return out


def _hf_or(cfg: Mapping, key: str, default: Any) -> Any:
    """The config's value, or `default` where the key is absent or null (transformers' defaults);
    a 0 or false stays, for the model schema to refuse where it is not allowed."""
    value = cfg.get(key)
    return default if value is None else value


def _hf_number(cfg: Mapping, key: str, default: float) -> float:
    """A number of the config (a float, as the schema takes it); `default` when absent or null."""
    value = cfg.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(HF_PATH, f"{key}: expected a number, got {_show(value)}")
    return float(value)


HF_PARSERS = MappingProxyType({
    "llama": _hf_llama, "mistral": _hf_llama, "mixtral": _hf_mixtral, "qwen2": _hf_qwen2,
    "qwen3": _hf_qwen3, "qwen3_moe": _hf_qwen3_moe, "deepseek_v3": _hf_deepseek_v3,
    "gpt2": _hf_gpt2,
})


def _hf_model(value: Any, base_dir: Path) -> tuple[dict, str]:
    """(model mapping, default name) from a Hugging Face config.json (or a folder holding one)."""
    path = _resolve_path(_checked(value, _string, HF_PATH), base_dir)
    if path.is_dir():
        path = path / "config.json"
    text = read_text(path, HF_PATH)
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(HF_PATH, f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from None
    except RecursionError:
        raise ConfigError(HF_PATH, f"{path}: invalid JSON: nested too deeply") from None
    if not isinstance(cfg, dict):
        raise ConfigError(HF_PATH, f"{path}: expected a JSON object")
    model_type = cfg.get("model_type")
    parser = HF_PARSERS.get(model_type) if isinstance(model_type, str) else None
    if parser is None:
        raise ConfigError(HF_PATH, f"{path}: model_type {cfg.get('model_type')!r} is not supported; "
                                   f"supported: {', '.join(HF_PARSERS)}")

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise ConfigError(HF_PATH, f"{path}: missing {key!r}")
        return cfg[key]

    full = path.absolute()  # a bare "config.json" has no parent name until made absolute (not resolved:
    # a Hugging Face cache links config.json to a blob named by its hash)
    name = (full.parent.name if full.name == "config.json" else full.stem) or "model"
    return parser(cfg, need), name


def _checked(value: Any, check: Check, path: str) -> Any:
    try:
        return check(value)
    except _Invalid as exc:
        raise ConfigError(path, str(exc)) from None


# ----------------------------------------------------------------------------------------------
# Sections.


def _model(raw: Any, base_dir: Path) -> ModelSpec:
    """A preset name, or a mapping: plain, `{preset: NAME, ...}` or `{hf_config: PATH, ...}`. A
    fault in a model read from a Hugging Face config names the config too (its keys have other
    names than the scenario's)."""
    if isinstance(raw, Mapping) and "hf_config" in raw:
        source = raw["hf_config"]
        try:
            return _model_spec(*_expand_model_source(dict(raw), base_dir))
        except ConfigError as exc:
            if not exc.path.startswith("model") or exc.path == HF_PATH:
                raise
            raise ConfigError(exc.path, f"{exc.message} (in the model read from hf_config {source})") from None
    if isinstance(raw, str):
        mapping, name = _preset("model", raw, "model"), raw
    elif isinstance(raw, Mapping):
        mapping, name = _expand_model_source(dict(raw), base_dir)
    else:
        raise ConfigError("model", f"expected a preset name or a mapping, got {_show(raw)}")
    return _model_spec(mapping, name)


def _check_sliding_window(model: ModelSpec, training: TrainingSpec) -> None:
    """A window shorter than the sequence is refused: each token would attend to the last W only,
    which paraplan does not price (it would charge full causal attention, up to s/W times too much)."""
    w = model.sliding_window
    if w is not None and w < training.seq_length:
        raise ConfigError("model.sliding_window", f"{w} < training.seq_length {training.seq_length}: sliding-window "
                                                  f"attention is not modelled; set training.seq_length <= {w}, or "
                                                  f"model.sliding_window: null to price full causal attention")


def _model_spec(mapping: dict, name: str) -> ModelSpec:
    """The model section's mapping (a preset or a config already expanded), checked."""
    values = _validate(mapping, "model", MODEL, also_known=MODEL_SOURCES)
    values.setdefault("name", name)
    if values.get("moe") is not None:
        values["moe"] = _moe(values["moe"], values["num_layers"])
    if values.get("architecture") is not None:
        values["architecture"] = _architecture(values["architecture"])
    if values.get("mla") is not None:
        values["mla"] = _mla(values)
        if values.get("qk_layernorm"):
            raise ConfigError("model.qk_layernorm", "true with model.mla: MLA's latent norms are part of the MLA "
                                                    "model; qk_layernorm is for query and key heads; leave it out")
    return ModelSpec(**_derive_model_defaults(values))


def _architecture(raw: Any) -> ArchitectureSpec:
    """model.architecture: a rotary base and scaling only with rope."""
    arch = ArchitectureSpec(**_validate(raw, "model.architecture", ARCHITECTURE))
    if arch.rope_scaling_factor is not None and arch.rope_scaling is None:
        raise ConfigError("model.architecture.rope_scaling_factor", "only with rope_scaling (llama3, yarn, linear, "
                                                                     "dynamic or longrope)")
    if arch.position_embedding != "rope":
        for key in ("rotary_base", "rope_scaling", "rope_scaling_factor"):
            if getattr(arch, key) is not None:
                raise ConfigError(f"model.architecture.{key}", f"only with position_embedding: rope, not "
                                                               f"{arch.position_embedding}")
    return arch


def _mla(values: dict) -> MLASpec:
    """model.mla: every head has its own keys and values (num_kv_heads, when given, is
    num_attention_heads) and head_dim is the value head width."""
    mla = MLASpec(**_validate(values["mla"], "model.mla", MLA))
    heads = values["num_attention_heads"]
    if values.setdefault("num_kv_heads", heads) != heads:
        raise ConfigError("model.num_kv_heads", f"{values['num_kv_heads']}: with model.mla every head has its "
                                                f"own keys and values; leave it out or set {heads}")
    if values.setdefault("head_dim", mla.v_head_dim) != mla.v_head_dim:
        raise ConfigError("model.head_dim", f"{values['head_dim']}: with model.mla it is model.mla.v_head_dim "
                                            f"({mla.v_head_dim}); leave it out")
    return mla


def _moe(raw: Any, num_layers: int) -> MoESpec:
    """model.moe with its cross-field rules: top_k <= num_experts, a histogram with one count per
    expert, leading dense layers fewer than the model's."""
    values = _validate(raw, "model.moe", MOE)
    experts = values["num_experts"]
    if values["top_k"] > experts:
        raise ConfigError("model.moe.top_k", f"{values['top_k']} is more than num_experts ({experts})")
    groups, per_token = values.get("expert_groups", 1), values.get("groups_per_token")
    if per_token is None:
        values["groups_per_token"] = per_token = groups  # every group: no limit
    if experts % groups:
        raise ConfigError("model.moe.expert_groups", f"{groups} does not divide num_experts ({experts})")
    if per_token > groups:
        raise ConfigError("model.moe.groups_per_token", f"{per_token} is more than expert_groups ({groups})")
    if per_token * (experts // groups) < values["top_k"]:
        raise ConfigError("model.moe.groups_per_token",
                          f"{per_token} groups of {experts // groups} experts hold fewer than top_k "
                          f"({values['top_k']}) experts")
    if values.get("first_dense_layers", 0) >= num_layers:
        raise ConfigError("model.moe.first_dense_layers",
                          f"{values['first_dense_layers']} leaves no MoE layer of num_layers ({num_layers})")
    routing = _validate(values.get("routing", {}), "model.moe.routing", ROUTING)
    if "s" in routing and routing.get("distribution", "uniform") != "zipf":
        raise ConfigError("model.moe.routing.s", f"is the zipf exponent, but distribution is "
                                                 f"{routing.get('distribution', 'uniform')}")
    hist = routing.get("tokens_per_expert")
    if hist is not None and routing.get("distribution", "uniform") != "histogram":
        raise ConfigError("model.moe.routing.tokens_per_expert", f"is the histogram's counts, but distribution is "
                                                                 f"{routing.get('distribution', 'uniform')}")
    if hist is not None:
        path = "model.moe.routing.tokens_per_expert"
        if not isinstance(hist, list) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x < math.inf for x in hist):
            raise ConfigError(path, "expected a list of finite, non-negative token counts, one per expert")
        if len(hist) != experts:
            raise ConfigError(path, f"has {len(hist)} counts but model.moe.num_experts is {experts}")
        if not math.isfinite(sum(hist)):
            raise ConfigError(path, "the counts sum beyond a float's range; scale them down (only their shares matter)")
        if sum(1 for x in hist if x > 0) < values["top_k"]:
            raise ConfigError(path, f"has {sum(1 for x in hist if x > 0)} non-zero counts, fewer than "
                                    f"model.moe.top_k ({values['top_k']}): each token goes to top_k distinct experts")
        routing["tokens_per_expert"] = tuple(float(x) for x in hist)
    if routing.get("distribution") == "histogram" and hist is None:
        raise ConfigError("model.moe.routing.tokens_per_expert", "required when distribution is histogram")
    values["routing"] = RoutingSpec(**routing)
    return MoESpec(**values)


def _expand_model_source(raw: dict, base_dir: Path) -> tuple[dict, str]:
    if "preset" in raw and "hf_config" in raw:
        raise ConfigError("model", "give either preset or hf_config, not both")
    if "preset" in raw:
        name = raw.pop("preset")
        return _deep_merge(_preset("model", name, "model.preset"), raw), name
    if "hf_config" in raw:
        base, name = _hf_model(raw.pop("hf_config"), base_dir)
        return _deep_merge(base, raw), name
    return raw, "custom"


def _derive_model_defaults(values: dict) -> dict:
    """num_kv_heads = heads, head_dim = hidden // heads, ffn_hidden_size = 4 * hidden, linear biases
    on GELU models (GPT-2 and GPT-3 have them, Megatron's default) and not on SwiGLU ones."""
    heads, hidden = values["num_attention_heads"], values["hidden_size"]
    kv = values.setdefault("num_kv_heads", heads)
    if heads % kv:
        raise ConfigError("model.num_kv_heads", f"{kv} does not divide num_attention_heads {heads}")
    if "head_dim" not in values:
        if hidden % heads:
            raise ConfigError("model.head_dim", f"not given, and hidden_size {hidden} is not "
                                                f"divisible by num_attention_heads {heads}")
        values["head_dim"] = hidden // heads
    values.setdefault("ffn_hidden_size", 4 * hidden)
    values.setdefault("linear_bias", values["activation"] == "gelu")
    return values


def _cluster(raw: Any, base_dir: Path) -> ClusterSpec:
    """A mapping, optionally `{preset: NAME, num_nodes: N, ...}`; link defaults from the GPU profile.
    A bare preset name is refused with the form to write: a preset is a node type and its fabric,
    not a node count."""
    if isinstance(raw, str):
        _preset("cluster", raw, "cluster")  # an unknown name is named as such
        raise ConfigError("cluster", f"a preset gives the node type, not how many nodes: write "
                                     f"cluster: {{preset: {raw}, num_nodes: N}}")
    inter_layers = []  # the inter_node keys of the preset, then the scenario's own
    if isinstance(raw, Mapping) and "preset" in raw:
        rest = dict(raw)
        preset = _preset("cluster", rest.pop("preset"), "cluster.preset")
        inter_layers.append(preset.get("inter_node"))
        raw = _deep_merge(preset, rest)
        inter_layers.append(rest.get("inter_node"))
    elif isinstance(raw, Mapping):
        inter_layers.append(raw.get("inter_node"))
    values = _validate(raw, "cluster", CLUSTER, also_known=("preset",))
    gpu = _gpu_name_or_path(values["gpu"], base_dir)
    profile = _gpu_profile(gpu)
    intra = _validate(values.get("intra_node", {}), "cluster.intra_node", INTRA_NODE)
    _validate(values.get("inter_node", {}), "cluster.inter_node", INTER_NODE)  # the merged keys, for errors
    inter = profile.default_inter_node()
    for layer in inter_layers:
        keys = _validate(layer if isinstance(layer, Mapping) else {}, "cluster.inter_node", INTER_NODE)
        inter = _inter_node_over(inter, keys)
    return ClusterSpec(
        gpu=gpu,
        num_nodes=values["num_nodes"],
        gpus_per_node=values["gpus_per_node"],
        intra_node=dataclasses.replace(profile.default_intra_node(), **intra),
        inter_node=inter,
    )


def _inter_node_over(base: InterNodeSpec, keys: Mapping) -> InterNodeSpec:
    """`base` with `keys` on top. Where `keys` leave nodes_per_leaf out, the leaf switches stay the
    same and the nodes under one are counted again for the new topology and NIC count
    (InterNodeSpec.leaf_ports): a rail-optimized fabric (the profiles' and presets') with
    `topology: fat-tree` put on top has nics_per_node times fewer nodes under a leaf."""
    spec = dataclasses.replace(base, **keys)
    if "nodes_per_leaf" in keys:
        return spec
    return dataclasses.replace(spec, nodes_per_leaf=spec.nodes_under_leaf(base.leaf_ports))


def _is_profile_path(gpu: str) -> bool:
    """A `cluster.gpu` value naming a file rather than a bundled profile."""
    return "/" in gpu or os.sep in gpu or gpu.endswith((".yaml", ".yml", ".json"))


def _gpu_name_or_path(gpu: str, base_dir: Path) -> str:
    """A bundled profile name as is; a profile file path resolved against the scenario's folder."""
    if not _is_profile_path(gpu):
        return gpu
    path = _resolve_path(gpu, base_dir)
    if path.exists() and not path.is_file():
        raise ConfigError("cluster.gpu", f"{path}: a directory or device, not a GPU profile file")
    if not path.is_file():
        raise ConfigError("cluster.gpu", f"GPU profile file not found: {path}")
    return str(path)


def _gpu_profile(gpu: str):
    """The hardware profile for `gpu`; its errors are re-raised under `cluster.gpu`."""
    # Imported here, not at the top: parsing a scenario does not need hwmodels loaded, and the
    # import stays one-way (hwmodels imports paraplan.specs, never the loader).
    from hwmodels.profile import load_profile

    try:
        return load_profile(gpu)
    except ConfigError as exc:
        if exc.path.startswith("cluster.gpu"):
            raise
        raise ConfigError("cluster.gpu", str(exc)) from None


def _plan(raw: Any, cluster: ClusterSpec) -> PlanSpec:
    values = _validate(raw, "plan", PLAN)
    if "recompute_modules" in values and values.get("recompute") != "selective":
        raise ConfigError("plan.recompute_modules", "applies only with recompute: selective "
                                                    f"(recompute is {values.get('recompute', 'none')})")
    values["dp"] = _data_parallel(values, cluster)
    return PlanSpec(**values)


def _data_parallel(values: Mapping, cluster: ClusterSpec) -> int:
    """dp as given (checked against the world size) or derived as world // (tp*pp*cp)."""
    tp, pp, cp = (values.get(k, 1) for k in ("tp", "pp", "cp"))  # PlanSpec's defaults
    world = cluster.world_size
    gpus = f"{world} GPUs ({cluster.shape})"
    dp = values.get("dp")
    if dp is None:
        if world % (tp * pp * cp):
            raise ConfigError("plan", f"tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp} does not divide "
                                      f"the cluster's {gpus}, so dp cannot be derived")
        return world // (tp * pp * cp)
    if tp * pp * cp * dp != world:
        raise ConfigError("plan", f"tp*pp*cp*dp = {tp}*{pp}*{cp}*{dp} = {tp * pp * cp * dp} "
                                  f"but the cluster has {gpus}")
    return dp


class FrozenMapping(tuple):
    """A mapping as _freeze keeps it: its (key, value) pairs sorted by key, a tuple (so hashable and
    equal to the plain tuple of those pairs) that a reader can still tell from a frozen list."""

    __slots__ = ()


def _freeze(value: Any, memo: dict | None = None) -> Any:
    """Mappings -> FrozenMapping (sorted (key, value) pairs), lists -> tuples, recursively: hashable.
    A node YAML aliases many times is frozen once (`memo`, by identity), so nested aliases (the
    "billion laughs" file) cost their distinct nodes, not their expansion."""
    memo = {} if memo is None else memo
    if not isinstance(value, (Mapping, list, tuple)):
        return value
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, Mapping):
        frozen = FrozenMapping(sorted(((k, _freeze(v, memo)) for k, v in value.items()), key=lambda kv: str(kv[0])))
    else:
        frozen = tuple(_freeze(v, memo) for v in value)
    memo[id(value)] = frozen
    return frozen


def _search(raw: Any) -> tuple:
    if not isinstance(raw, Mapping):
        raise ConfigError("search", f"expected a mapping, got {_show(raw)}")
    return _freeze(raw)


# ----------------------------------------------------------------------------------------------
# Public entry points.


# Overrides after which a scenario's dp no longer multiplies out, so it is derived again.
REDERIVE_DP = frozenset({"plan.tp", "plan.pp", "plan.cp", "cluster", "cluster.preset", "cluster.num_nodes",
                         "cluster.gpus_per_node"})


def apply_overrides(raw: Mapping, overrides: Iterable[str]) -> dict:
    """A deep copy of `raw` with each `dotted.path=value` override set; `raw` is not modified.

    Values are parsed as YAML (`plan.tp=4` is an int, `plan.sequence_parallel=false` a bool).
    Missing sections on the way are created, and a `model`/`cluster` preset name becomes
    `{preset: NAME}` so `model.num_layers=40` works on `model: llama3-70b`. An override of tp, pp,
    cp or the cluster size drops the file's dp so it is derived again (unless dp is overridden
    too); `plan.dp=null` drops it outright. Nothing is validated here: the result goes through
    the same checks as the file, so an unknown key errors as one.
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'dotted.path=value' strings, not one string")
    out = copy.deepcopy(dict(raw))
    touched = set()
    for item in overrides:
        keys, value = _parse_override(item)
        _set_path(out, keys, _paths_from_the_working_directory(keys, value))
        touched.add(".".join(keys))
    plan = out.get("plan")
    if isinstance(plan, dict) and "dp" in plan:
        # dp is derived from the world size: overriding another degree or the cluster size
        # re-derives it unless dp is overridden too, and plan.dp=null asks for it explicitly
        if plan["dp"] is None or ("plan.dp" not in touched and touched & REDERIVE_DP):
            del plan["dp"]
    return out


def _paths_from_the_working_directory(keys: list[str], value: Any) -> Any:
    """A relative file path typed on the command line (`--set cluster.gpu=my.yaml`, `--set
    model.hf_config=config.json`, or either inside a mapping) is the user's, relative to the
    working directory, where the shell completed it; made absolute here, it is not read against
    the scenario's folder as the file's own paths are."""
    def anchored(path: Any, gpu: bool) -> Any:
        if not isinstance(path, str) or (gpu and not _is_profile_path(path)):
            return path
        return str(_resolve_path(path, Path.cwd()))

    dotted = ".".join(keys)
    if dotted in ("cluster.gpu", "model.hf_config"):
        return anchored(value, dotted == "cluster.gpu")
    if dotted in ("cluster", "model") and isinstance(value, dict):
        key = "gpu" if dotted == "cluster" else "hf_config"
        if key in value:
            return {**value, key: anchored(value[key], key == "gpu")}
    return value


def _parse_override(item: Any) -> tuple[list[str], Any]:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError("--set", f"expected dotted.path=value, got {item!r}")
    path, _, text = item.partition("=")
    keys = path.strip().split(".")
    if not all(keys):
        raise ConfigError("--set", f"expected dotted.path=value, got {item!r}")
    try:
        value = parse_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError("--set", f"cannot parse the value in {item!r}: {yaml_problem(exc)}") from None
    return keys, value


def _set_path(root: dict, keys: list[str], value: Any) -> None:
    node = root
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif depth == 0 and key in ("model", "cluster") and isinstance(child, str):
            child = node[key] = {"preset": child}
        elif not isinstance(child, dict):
            where = ".".join(keys[:depth + 1])
            raise ConfigError(where, f"cannot set {'.'.join(keys)}: {where} is {_show(child)}, not a mapping")
        node = child
    node[keys[-1]] = value


def load_scenario(source: str | os.PathLike | Mapping, overrides: Iterable[str] = ()) -> Scenario:
    """Load and validate a scenario from a YAML file path or an already-parsed mapping.

    Relative paths inside it (`model.hf_config`, a `cluster.gpu` profile file) are resolved
    against the scenario file's folder, or the working directory for a mapping; those given in
    `overrides` against the working directory. The name defaults
    to the file's stem ("scenario" for a mapping). Raises ConfigError for anything malformed.
    """
    if isinstance(source, Mapping):
        raw, base_dir, default_name = dict(source), Path.cwd(), "scenario"
    elif isinstance(source, (str, os.PathLike)):
        path = Path(source)
        raw, base_dir, default_name = read_scenario_file(path), path.parent, path.stem
    else:
        raise TypeError(f"source must be a path or a mapping, not {type(source).__name__}")
    raw = apply_overrides(raw, overrides)
    top = _validate(raw, "", TOP)
    model = _model(top["model"], base_dir)
    cluster = _cluster(top["cluster"], base_dir)
    training = TrainingSpec(**_validate(top["training"], "training", TRAINING))
    _check_sliding_window(model, training)
    return Scenario(
        name=top.get("name", default_name),
        model=model,
        cluster=cluster,
        training=training,
        plan=_plan(top.get("plan", {}), cluster),
        search=_search(top.get("search", {})),
        run=RunSpec(**_validate(top.get("run", {}), "run", RUN)),
    )
