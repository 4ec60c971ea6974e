"""Check the simulator against published training runs (validation/public_runs.yaml format).

Each record is turned into an ordinary scenario mapping and loaded through the same strict loader
as a user's file, then simulated with the bundled profiles and defaults: one set of models and
settings for every row. Where a record leaves a field null, the ASSUMPTIONS below fill it, the
same way for every row.
"""
from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass
from importlib import resources

import yaml

from hwmodels.profile import load_profile
from paraplan.errors import ConfigError
from simulator.layout import embedding_and_loss_edge

ASSUMPTIONS = (
    "null fields the source set in its launch scripts are filled from them (paraplan/data/launch_scripts.yaml): "
    "SC'21 Table 1 micro-batch sizes, virtual pipeline stages and DDP implementation from Megatron-LM "
    "examples/sc21/run_table_1.sh (DDP torch: gradients all-reduced during the backward; local: after it)",
    "micro_batch_size null -> 1 (Megatron's default)",
    "Qwen3 models normalise each head's queries and keys (the architecture's q_norm / k_norm; Megatron "
    "--qk-layernorm), which the records do not state",
    "dropout (records never state it) -> 0 for SwiGLU models (the Llama-family, Mixtral and Qwen3 configs "
    "train without it) and MPT (llm-foundry's attn_pdrop and resid_pdrop 0), else Megatron's default 0.1 "
    "(--hidden-dropout, --attention-dropout); without dropout no masks are stored or written",
    "expert_tp null on an MoE record -> tp (Megatron's default: --expert-tensor-parallel-size follows "
    "--tensor-model-parallel-size)",
    "activation_recompute null -> none (Megatron-Core default when the plan fits); 'selective (norm, act)' and "
    "the like name Megatron-Core --recompute-modules (norm -> layernorm, act -> moe_act, attention -> core_attn); "
    "plain 'selective' -> core_attn",
    "sequence_parallel null -> on when tp > 1 for records from 2023 on (Megatron-Core practice), off before",
    "ZeRO: the record's zero_stage (FSDP FULL_SHARD -> 3, SHARD_GRAD_OP -> 2); else distributed optimizer -> 1; "
    "null, but the notes list --overlap-param-gather (which needs the distributed optimizer) -> 1; null on "
    "Megatron-Core MoE runs -> 1 with --overlap-param-gather (the Megatron-Core MoE benchmark configs set "
    "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather); else 0",
    "Megatron flags named in a record's notes (--overlap-grad-reduce, --overlap-param-gather, --tp-comm-overlap) are set",
    "layers not divisible by pp x vpp: the embedding and the loss count as one layer each (DeepSpeed's "
    "'type:transformer|embedding' partition, Megatron-Core --account-for-embedding/loss-in-pipeline-split), "
    "so the first and last virtual stages hold (L + 2)/(pp x vpp) - 1 layers",
    "linear biases: GELU models have them (Megatron's default --add-bias-linear: GPT-3, MT-NLG, BLOOM), "
    "except MPT (llm-foundry's no_bias); SwiGLU models do not",
    "tied_embeddings null -> true for GELU models (Megatron GPT and MPT tie the input embedding and the LM head), "
    "false for SwiGLU ones (the Llama family: Mixtral, Qwen3 untie them)",
    "attention kernel: records from before 2023 -> unfused (Megatron-LM and Megatron-DeepSpeed gained --use-flash-attn in 2023); "
    "Megatron-Core runs on Hopper -> flash3 (Transformer Engine gives its cuDNN fused attention preference on Hopper, "
    "transformer_engine/pytorch/attention/dot_product_attention/utils.py, priced with the profile's flash3 curve: "
    "cuDNN's fused attention as measured on an H100); other later runs -> flash (FlashAttention-2)",
    "gradient reduction overlapped with backward from 2023 on (Megatron --overlap-grad-reduce, FSDP); earlier runs reduce after the backward",
    "weight gradients: runs from 2022 on keep the default, accumulation into the fp32 main gradients inside the "
    "GEMMs except under ZeRO-2/3 (Megatron --gradient-accumulation-fusion reached its tensor-parallel layers in "
    "early 2022, as their apex.transformer port, NVIDIA/apex PR #1297 of 2022-02, shows; FSDP rows get the "
    "separate kernel); earlier Megatron-LM runs and DeepSpeed-based ones add each microbatch's gradient in with a "
    "kernel of its own (Megatron's main_grad hook; DeepSpeed's fp16 engine adds into .grad, 6 bytes per element "
    "where the modelled hook moves 10)",
    "backward tensor-parallel collectives: the same runs (from 2022 on, not DeepSpeed-based) overlap a column-parallel "
    "layer's input-gradient reduce-scatter/all-reduce with its weight-gradient GEMM and the sequence-parallel input "
    "re-gather with its input-gradient GEMM (the 'AsyncCommunication' of that port's "
    "LinearWithGradAccumulationAndAsyncCommunication); the earlier ones expose every backward TP collective",
    "pipeline sends without sequence parallelism: records from before 2023 (Megatron-LM with its default "
    "--scatter-gather-tensors-in-pipeline, DeepSpeed's partitioned pipeline activations) send each TP rank's 1/tp "
    "slice and all-gather it on the receiving node; later ones send the whole activation from every TP rank, as "
    "Megatron-Core does (plan.p2p_scatter_gather)",
    "pipeline sends and the sender: plain 1F1B rows wait for every send before the next op, as Megatron's "
    "non-interleaved schedule and DeepSpeed's pipeline engine always have; interleaved rows do not wait for their "
    "forward sends (plan.wait_forward_sends false: every record predates Megatron-Core's wait, PR #4047 of 2026-04)",
    "GPU: H100 rows run on the profile measured on an H100 SXM (h100-sxm-80gb-calibrated: paraplan calibrate, "
    "torch 2.11 + CUDA 13.0; its large bf16 GEMMs ran at a median 0.68 of peak sustained at the 700 W power "
    "limit, below the 0.80 of the burst-measured public figures in h100-sxm-80gb; its flash3 curve is cuDNN's fused attention as "
    "measured); A100 rows on the public-source A100 profiles (no A100 was measured)",
    "inter-node network from the record's text (NIC count x rate); unstated -> the GPU generation's typical node (8 NICs, HDR 200G for A100, NDR 400G for H100)",
    "virtual_pipeline_stages null -> 1 (1F1B); > 1 -> interleaved 1F1B",
    "vocabulary: padded to a multiple of 128 x tp (Megatron --make-vocab-size-divisible-by 128) where the record "
    "says Megatron padded it (MT-NLG: 50257 -> 51200)",
    "precision: fp16 where the record or its launch script names it (SC'21: --fp16 in examples/sc21/CONFIG.sh), "
    "else bf16 ('mixed 16-bit' included); gradients accumulated and reduced in fp16 under Megatron's --fp16 "
    "without --accumulate-allreduce-grads-in-fp32 (SC'21), in bf16 under Composer's FSDP mixed precision PURE, "
    "in fp32 otherwise (Megatron forces it under bf16)",
)

_GPUS = (("a100", "40gb", "a100-sxm-40gb"), ("a100", "", "a100-sxm-80gb"), ("h100", "", "h100-sxm-80gb-calibrated"),
         ("h200", "", "h200-sxm-141gb"), ("b200", "", "b200-sxm-180gb"))
# (pattern, nics, Gb/s per NIC) read off the record's inter_node text
_NIC_PATTERNS = (
    (re.compile(r"(\d+)\s*x\s*(\d+)\s*(?:Gb/s|Gbit|Gbps)"), lambda m: (int(m[1]), float(m[2]))),  # bits
    (re.compile(r"(\d+)\s*x\s*(\d+)\s*GB/s"), lambda m: (int(m[1]), 8 * float(m[2]))),  # bytes
    (re.compile(r"(\d+)\s*Gbps node-to-node", re.I), lambda m: (8, float(m[1]) / 8)),
    # Intel Omni-Path links run at 100 Gb/s
    (re.compile(r"(\d+)\s*OPA links", re.I), lambda m: (int(m[1]), 100.0)),
)


@dataclass(frozen=True)
class Row:
    id: str
    moe: bool
    published_s: float
    derived: bool
    predicted_s: float | None
    fits: bool | None
    error: str | None = None
    gpu: str | None = None
    """The GPU profile the record was simulated on (None where the record could not be mapped)."""
    gpu_bundled: str | None = None
    """The bundled profile the record maps to, before a `profiles` swap."""

    @property
    def error_pct(self) -> float | None:
        if self.predicted_s is None:
            return None
        return 100.0 * (self.predicted_s - self.published_s) / self.published_s


def published_step_time(rec: dict) -> tuple[float, bool] | None:
    """(step time, whether it was derived rather than published as a time)."""
    met = rec.get("metrics") or {}
    if met.get("iteration_time_s"):
        return float(met["iteration_time_s"]), "metrics.iteration_time_s" in " ".join(rec.get("derived_fields") or [])
    if met.get("derived_iteration_time_s"):
        return float(met["derived_iteration_time_s"]), True
    if met.get("tflops_per_gpu") and "Megatron-Core" in str(rec.get("flop_formula")) and not is_dense(rec):
        flops = megatron_core_moe_flops(rec)
        return flops / (float(met["tflops_per_gpu"]) * 1e12 * int(rec["hardware"]["num_gpus"])), True
    return None


def megatron_core_moe_flops(rec: dict) -> float:
    """FLOPs per iteration as Megatron-Core counts them for an MoE model (megatron/training/training.py,
    num_floating_point_operations): 12 B s L h^2 x [(1 + g/a + s/h) q/h + (f_moe/h) k (3/2 if SwiGLU)
    + (f_shared/h)(3/2) + V/(2Lh)]; used only to turn a published TFLOP/s into a step time. The 2024
    releases (MCore v0.8/v0.9, with the shared-expert term) count the whole s x s attention; the 2025
    rewrite of the function (the one with DeepSeek-style dense layers) halves the s/h term for the
    causal mask, so records dated 2025 or later get the halved term."""
    m, b = rec["model"], rec["batch"]
    e = m["moe"]
    h, layers, s = m["hidden_size"], m["num_layers"], m["seq_length"]
    heads, groups = m["num_attention_heads"], m.get("num_kv_heads") or m["num_attention_heads"]
    q = (m.get("head_dim") or h // heads) * heads
    gated = 1.5 if m.get("activation") == "swiglu" else 1.0
    shared = (e.get("num_shared_experts") or 0) * e["expert_ffn_hidden_size"]
    causal_halved = _date(rec) >= "2025"
    per = ((1 + groups / heads + s / h / (2 if causal_halved else 1)) * q / h
           + e["expert_ffn_hidden_size"] / h * e["top_k"] * gated
           + shared / h * gated
           + m["vocab_size"] / (2 * layers * h))
    return 12 * b["global_batch_size"] * s * layers * h * h * per


def _attention_kernel(rec: dict, modern: bool) -> str:
    """ASSUMPTIONS' attention kernel: unfused before 2023; Megatron-Core (Transformer Engine) on a
    Hopper GPU -> flash3; else flash."""
    if not modern:
        return "unfused"
    hopper = load_profile(_gpu_name(rec["hardware"]["gpu"])).arch == "hopper"
    return "flash3" if hopper and "Megatron-Core" in str(rec.get("framework")) else "flash"


def _date(rec: dict) -> str:
    """The source's date as written ('2024-08'; '' when unknown): compared as text, '2025' and later."""
    return str((rec.get("source") or {}).get("date") or "")


def is_dense(rec: dict) -> bool:
    return not (rec.get("model") or {}).get("moe")


def _gpu_name(text: str) -> str:
    t = text.lower()
    for key, extra, name in _GPUS:
        if key in t and extra in t:
            return name
    raise ConfigError("hardware.gpu", f"no bundled profile for {text!r}")


def _inter_node(text: str | None) -> dict:
    for pattern, read in _NIC_PATTERNS:
        m = pattern.search(text or "")
        if m:
            nics, gbps = read(m)
            return {"nics_per_node": nics, "nic_bandwidth_Gbps": gbps}
    return {}


# Words a record uses inside 'selective (...)' -> Megatron-Core --recompute-modules names
_RECOMPUTE_WORDS = {"norm": "layernorm", "layernorm": "layernorm", "act": "moe_act", "moe_act": "moe_act",
                    "mlp": "mlp", "moe": "moe", "shared": "shared_experts", "shared_experts": "shared_experts",
                    "attention": "core_attn", "attention-core": "core_attn", "core_attn": "core_attn"}


def _recompute(text) -> dict:
    """The plan's recompute keys for a record's activation_recompute text."""
    t = str(text or "").lower()
    for mode in ("full", "selective", "none"):
        if t.startswith(mode):
            break
    else:
        return {"recompute": "none"}
    out = {"recompute": mode}
    named = re.match(r"selective\s*\(([^)]*)\)", t)
    if named:
        words = re.findall(r"[a-z_-]+", named[1])
        modules = list(dict.fromkeys(_RECOMPUTE_WORDS[w] for w in words if w in _RECOMPUTE_WORDS))
        if modules and modules != ["core_attn"]:
            out["recompute_modules"] = modules
    return out


def _megatron_core_moe_defaults(rec: dict) -> bool:
    """A Megatron-Core MoE record that leaves ZeRO null: its benchmark configs' distributed
    optimizer with --overlap-param-gather applies."""
    par = rec["parallelism"]
    return ("megatron-core" in str(rec.get("framework")).lower() and bool(rec["model"].get("moe"))
            and par.get("zero_stage") is None and par.get("distributed_optimizer") is None)


def _zero(rec: dict, flags: set[str]) -> int:
    par = rec["parallelism"]
    if par.get("zero_stage") is not None:
        return int(par["zero_stage"])
    if _megatron_core_moe_defaults(rec) or (par.get("distributed_optimizer") is None and "--overlap-param-gather" in flags):
        return 1
    return 1 if par.get("distributed_optimizer") else 0


def _flags(rec: dict) -> set[str]:
    """Megatron command-line flags a record quotes in its notes."""
    return set(re.findall(r"--[a-z][a-z-]+", str(rec.get("notes") or "")))


def _uneven_stages(num_layers: int, pp: int, vpp: int) -> dict:
    edge = embedding_and_loss_edge(num_layers, pp * vpp)
    if edge is None:
        return {}
    return {"first_stage_layers": edge, "last_stage_layers": edge}


_SCRIPT_KEYS = {"micro_batch_size", "layers_per_virtual_stage", "ddp_impl", "precision", "grad_reduce_dtype"}


# Megatron --make-vocab-size-divisible-by default (megatron/training/arguments.py), times tp
MEGATRON_VOCAB_DIVISOR = 128


def _llm_foundry(rec: dict) -> bool:
    """A MosaicML llm-foundry run (the MPT rows)."""
    return "llm-foundry" in str(rec.get("framework"))


def _dropout(rec: dict) -> float:
    """ASSUMPTIONS' dropout: none for SwiGLU (Llama-family) models and llm-foundry's MPT, whose
    configs train without it; Megatron's default 0.1 otherwise."""
    if rec["model"].get("activation") == "swiglu" or _llm_foundry(rec):
        return 0.0
    return 0.1


def _vocab(model: dict, tp: int) -> int:
    """The record's vocabulary; padded as Megatron pads it, to a multiple of 128 x tp, where the
    record says Megatron padded it (MT-NLG: 'GPT-2 BPE vocabulary (50257, padded by Megatron)')."""
    v = int(model["vocab_size"])
    if "padded by megatron" in str(model.get("notes")).lower():
        step = MEGATRON_VOCAB_DIVISOR * tp
        v = -(-v // step) * step
    return v


def _precision(rec: dict, script: dict) -> tuple[str, str]:
    """(training.precision, training.grad_reduce_dtype) of a record: the launch script's where it
    gives them; else fp16 where the record's precision names it ('fp16', 'amp_fp16'), bf16 otherwise
    ('mixed 16-bit' included); gradients reduced in bf16 under Composer's FSDP mixed precision
    PURE (param, reduce and buffer dtypes all bf16), in fp32 otherwise."""
    text = str(rec.get("precision")).lower()
    precision = script.get("precision") or ("fp16" if re.match(r"(amp_)?fp16\b", text) else "bf16")
    grads = script.get("grad_reduce_dtype") or ("bf16" if "pure" in text and precision == "bf16" else "fp32")
    return precision, grads


@functools.lru_cache(maxsize=1)
def launch_script_settings() -> dict[str, dict]:
    """Record id -> the settings its source's launch scripts give (paraplan/data/launch_scripts.yaml)."""
    text = resources.files("paraplan.data").joinpath("launch_scripts.yaml").read_text(encoding="utf-8")
    out: dict[str, dict] = {}
    for entry in yaml.safe_load(text):
        for rid, settings in entry["records"].items():
            unknown = set(settings) - _SCRIPT_KEYS
            if unknown or settings.get("ddp_impl", "torch") not in ("torch", "local"):
                raise ConfigError(f"launch_scripts.yaml: {rid}", f"unknown setting {sorted(unknown) or settings['ddp_impl']!r}")
            out.setdefault(rid, {}).update(settings)  # a record's settings may come from several scripts
    return out


def record_to_scenario(rec: dict) -> dict:
    """A scenario mapping for the loader, with ASSUMPTIONS applied to null fields."""
    m, h, par, b = rec["model"], rec["hardware"], rec["parallelism"], rec["batch"]
    date = _date(rec)
    script = launch_script_settings().get(rec["id"], {})
    vpp = par.get("virtual_pipeline_stages")
    if vpp is None and "layers_per_virtual_stage" in script:
        vpp = int(m["num_layers"]) // (int(par["pp"]) * int(script["layers_per_virtual_stage"]))
    tp, vpp = int(par["tp"]), int(vpp or 1)
    sp = par.get("sequence_parallel")
    modern = date >= "2023"
    sp = bool(sp) if sp is not None else (tp > 1 and modern)
    flags = _flags(rec)
    # Megatron's tensor-parallel layers as of early 2022 (LinearWithGradAccumulationAndAsyncCommunication,
    # ported to apex in NVIDIA/apex PR #1297, 2022-02): fused wgrad accumulation, async backward collectives
    megatron_2022 = date >= "2022" and "deepspeed" not in str(rec.get("framework")).lower()
    m = {**m, **{k: int(v) for k, v in m.items() if k in _MODEL_INTS and v is not None}}  # 24.0 -> 24
    model = {
        "num_layers": m["num_layers"], "hidden_size": m["hidden_size"],
        "num_attention_heads": m["num_attention_heads"],
        "num_kv_heads": m.get("num_kv_heads") or m["num_attention_heads"],
        "ffn_hidden_size": m.get("ffn_hidden_size") or 4 * m["hidden_size"],
        "vocab_size": _vocab(m, tp), "activation": m.get("activation") or "gelu",
        "tied_embeddings": (m.get("activation") != "swiglu") if m.get("tied_embeddings") is None
        else bool(m["tied_embeddings"]),
        "dropout": _dropout(rec),
    }
    if _llm_foundry(rec):
        model["linear_bias"] = False  # MPT: llm-foundry's MPTConfig no_bias
    if str(m.get("name", "")).lower().startswith("qwen3"):
        model["qk_layernorm"] = True
    if m.get("head_dim"):
        model["head_dim"] = m["head_dim"]
    if m.get("moe"):
        e = m["moe"]
        model["moe"] = {"num_experts": int(e["num_experts"]), "top_k": int(e["top_k"]),
                        "expert_ffn_hidden_size": int(e["expert_ffn_hidden_size"]),
                        "num_shared_experts": int(e.get("num_shared_experts") or 0),
                        "first_dense_layers": int(e.get("num_dense_layers") or 0)}
    gpn = int(h.get("gpus_per_node") or 8)
    if int(h["num_gpus"]) % gpn:
        raise ConfigError(f"{rec['id']}.hardware.num_gpus", f"{h['num_gpus']} GPUs do not fill nodes of {gpn}")
    precision, grad_reduce_dtype = _precision(rec, script)
    return {
        "name": rec["id"],
        "model": model,
        "cluster": {"gpu": _gpu_name(h["gpu"]), "num_nodes": int(h["num_gpus"]) // gpn,
                    "gpus_per_node": gpn, "inter_node": _inter_node(h.get("inter_node"))},
        "training": {"seq_length": m["seq_length"], "global_batch_size": int(b["global_batch_size"]),
                     "precision": precision, "grad_reduce_dtype": grad_reduce_dtype,
                     "attention": _attention_kernel(rec, modern)},
        "plan": {
            "tp": tp, "pp": int(par["pp"]), "dp": int(par["dp"]), "cp": int(par.get("cp") or 1),
            "micro_batch_size": int(b.get("micro_batch_size") or script.get("micro_batch_size") or 1),
            "virtual_pipeline_stages": vpp,
            "schedule": "interleaved-1f1b" if vpp > 1 else "1f1b",
            "sequence_parallel": sp,
            "zero_stage": _zero(rec, flags),
            **_recompute(rec.get("activation_recompute")),
            "overlap_grad_reduce": modern or "--overlap-grad-reduce" in flags or script.get("ddp_impl") == "torch",
            "overlap_param_gather": "--overlap-param-gather" in flags or _megatron_core_moe_defaults(rec),
            "tp_comm_overlap": "--tp-comm-overlap" in flags and sp and tp > 1,
            # null: the plan's default (fused, unfused under ZeRO-2/3)
            "gradient_accumulation_fusion": None if megatron_2022 else False,
            "tp_backward_overlap": megatron_2022,
            # Megatron-LM before Megatron-Core (--scatter-gather-tensors-in-pipeline on by default)
            # and DeepSpeed's pipeline engine send each TP rank's slice of a pipeline activation
            "p2p_scatter_gather": not modern,
            "wait_forward_sends": False,
            "ep": int(par.get("ep") or 1),
            # unset on an MoE run, Megatron shards the experts like the dense layers (arguments.py:
            # expert tensor parallelism defaults to --tensor-model-parallel-size)
            "expert_tp": int(par.get("expert_tp") or (tp if m.get("moe") else 1)),
            **({"moe_dispatcher": "deepep"} if "deepep" in str(par.get("moe_dispatcher")).lower() else {}),
            **_uneven_stages(int(m["num_layers"]), int(par["pp"]), vpp),
        },
    }


def load_records(path: str) -> list[dict]:
    from paraplan.fileio import parse_yaml, read_text, yaml_problem

    if not os.path.exists(path):
        raise ConfigError("", f"published-runs file not found: {path}")
    try:
        data = parse_yaml(read_text(path, "published-runs file"))
    except yaml.YAMLError as e:
        raise ConfigError("", f"{path}: invalid YAML: {yaml_problem(e)}") from None
    if not isinstance(data, list):
        raise ConfigError("", f"{path}: expected a list of records")
    seen: set[str] = set()
    for i, rec in enumerate(data):
        if not isinstance(rec, dict) or not isinstance(rec.get("id"), str):
            raise ConfigError("", f"{path}: record {i + 1} is not a mapping with an 'id'")
        if rec["id"] in seen:
            raise ConfigError("", f"{path}: record {i + 1}: id {rec['id']!r} is used twice; ids name rows, make them unique")
        seen.add(rec["id"])
    return data


def not_compared(records: list[dict], *, include_moe: bool = True) -> list[tuple[str, str]]:
    """(id, why) for each record `evaluate` leaves out as incomparable (_incomparable)."""
    return [(rec["id"], why) for rec in records
            if (include_moe or is_dense(rec)) and (why := _incomparable(rec)) is not None]


def _incomparable(rec: dict) -> str | None:
    """Why the record cannot be compared, or None: it gives neither a step time nor a metric one can
    be derived from, or it leaves the global batch size open (the step time depends on it through
    the pipeline's microbatch count)."""
    if published_step_time(rec) is None:
        metrics = ", ".join(sorted(k for k, v in (rec.get("metrics") or {}).items() if v is not None))
        no_batch = (rec.get("batch") or {}).get("global_batch_size") is None
        missing = "no step time and no global batch size" if no_batch else "no step time"
        return f"{missing} to derive one from its metrics ({metrics or 'none'})"
    return "global batch size not published" if rec["batch"].get("global_batch_size") is None else None


# The numeric fields record_to_scenario and published_step_time read: (dotted path, required).
# Integers may be written as 8 or 8.0 (never negative); step times and rates are positive numbers.
_INT_FIELDS = (
    ("model.num_layers", True), ("model.hidden_size", True), ("model.num_attention_heads", True),
    ("model.vocab_size", True), ("model.seq_length", True), ("model.num_kv_heads", False),
    ("model.ffn_hidden_size", False), ("model.head_dim", False), ("hardware.num_gpus", True),
    ("hardware.gpus_per_node", False), ("parallelism.tp", True), ("parallelism.pp", True),
    ("parallelism.dp", True), ("parallelism.cp", False), ("parallelism.ep", False),
    ("parallelism.expert_tp", False), ("parallelism.virtual_pipeline_stages", False),
    ("parallelism.zero_stage", False), ("batch.micro_batch_size", False), ("batch.global_batch_size", False),
)
_MOE_INT_FIELDS = (("model.moe.num_experts", True), ("model.moe.top_k", True),
                   ("model.moe.expert_ffn_hidden_size", True), ("model.moe.num_shared_experts", False),
                   ("model.moe.num_dense_layers", False))
_NUMBER_FIELDS = ("metrics.iteration_time_s", "metrics.derived_iteration_time_s", "metrics.tflops_per_gpu")
# integers that may be 0; every other integer field is a count or a degree, at least 1
_ZERO_ALLOWED = ("parallelism.zero_stage", "model.moe.num_shared_experts", "model.moe.num_dense_layers")
_MODEL_INTS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length", "num_kv_heads",
               "ffn_hidden_size", "head_dim")
_BOOL_FIELDS = ("parallelism.sequence_parallel", "model.tied_embeddings")
# sections the mapping reads: a mapping where given (model.moe and hardware.inter_node: or null, text)
_SECTIONS = ("model", "hardware", "parallelism", "batch", "metrics")


def _field(rec: dict, dotted: str) -> tuple[bool, object]:
    """(present, value) of a dotted path; a missing section counts as a missing key."""
    node: object = rec
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def check_record_fields(rec: dict) -> None:
    """Every field the mapping reads has the type it needs, or a ConfigError names the record, the
    field's dotted path and what is allowed (before any conversion could fail somewhere deeper)."""
    where = f"record {rec.get('id')}"
    for section in _SECTIONS:
        if not isinstance(rec.get(section), dict):
            raise ConfigError(where, f"{section}: expected a mapping, got {rec.get(section)!r}")
    if not isinstance(_field(rec, "model.moe")[1], (dict, type(None))):
        raise ConfigError(where, f"model.moe: expected a mapping or null, got {_field(rec, 'model.moe')[1]!r}")
    if not isinstance(rec.get("source", {}), dict):
        raise ConfigError(where, f"source: expected a mapping, got {rec.get('source')!r}")
    for dotted in ("hardware.gpu", "hardware.inter_node", "framework"):
        value = _field(rec, dotted)[1]
        if not isinstance(value, str) and (dotted == "hardware.gpu" or value is not None):
            raise ConfigError(where, f"{dotted}: expected text{'' if dotted == 'hardware.gpu' else ' or null'}, "
                                     f"got {value!r}")
    for dotted in _BOOL_FIELDS:
        value = _field(rec, dotted)[1]
        if value is not None and not isinstance(value, bool):
            raise ConfigError(where, f"{dotted}: expected true, false or null, got {value!r}")
    fields = _INT_FIELDS + (_MOE_INT_FIELDS if _field(rec, "model.moe")[1] else ())
    for dotted, required in fields:
        present, value = _field(rec, dotted)
        if value is None:
            if required:
                raise ConfigError(where, f"{dotted}: {'required' if present else 'missing'}, expected an integer")
            continue
        least = 0 if dotted in _ZERO_ALLOWED else 1
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value != int(value) or value < least:
            allowed = f"an integer >= {least}" + ("" if required else " or null")
            raise ConfigError(where, f"{dotted}: expected {allowed}, got {value!r}")
    gpus, per_node = _field(rec, "hardware.num_gpus")[1], _field(rec, "hardware.gpus_per_node")[1] or 8
    if gpus % per_node:
        raise ConfigError(where, f"hardware.num_gpus: {gpus} is not whole nodes of {per_node} GPUs "
                                 f"(hardware.gpus_per_node, 8 when null)")
    for dotted in _NUMBER_FIELDS:
        value = _field(rec, dotted)[1]
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise ConfigError(where, f"{dotted}: expected a positive number or null, got {value!r}")


def evaluate(records: list[dict], *, include_moe: bool = True, profiles: dict[str, str] | None = None) -> list[Row]:
    """Simulate every comparable record. `profiles` replaces a bundled GPU profile by another (a
    calibrated one, say) for every record on that GPU: {'h100-sxm-80gb': 'h100-sxm-80gb-calibrated'}."""
    from paraplan.errors import ParaplanError
    from paraplan.loader import load_scenario
    from simulator.simulate import simulate

    profiles = profiles or {}
    if profiles:
        from hwmodels.profile import load_profile

        # a swapped row says what it ran on and in place of what: grouping by GPU then never merges it
        # with rows of another bundled profile, nor passes a same-named file off as the bundled one
        labels = {old: f"{load_profile(new).name} (in place of {old})" for old, new in profiles.items()}

    rows = []
    for rec in records:
        given = any(_field(rec, f)[1] is not None for f in _NUMBER_FIELDS) or \
            not isinstance(rec.get("metrics", {}), (dict, type(None)))
        if (include_moe or is_dense(rec)) and given:
            check_record_fields(rec)  # a record that gives a step time or a rate is about to be mapped
        try:
            usable = (include_moe or is_dense(rec)) and _incomparable(rec) is None
            target = published_step_time(rec)
            scenario = record_to_scenario(rec) if usable else None
            gpu = scenario["cluster"]["gpu"] if usable else None
            bundled = gpu
            if usable and gpu in profiles:
                scenario["cluster"]["gpu"], gpu = profiles[gpu], labels[gpu]
        except ConfigError as exc:  # a field the mapping cannot read (an unknown GPU): named with its record
            raise ConfigError(f"record {rec.get('id')}", str(exc)) from None
        except KeyError as exc:
            raise ConfigError(f"record {rec.get('id')}", f"malformed: missing key {exc.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:
            raise ConfigError(f"record {rec.get('id')}", f"malformed: a field has the wrong type or value ({exc})") from None
        if not usable:
            continue
        try:
            # the step time and fit only: no timeline, no balanced-router reference run
            res = simulate(load_scenario(scenario), imbalance_reference=False, record_spans=False)
            rows.append(Row(rec["id"], not is_dense(rec), target[0], target[1], res.step_time_s, res.fits, gpu=gpu,
                            gpu_bundled=bundled))
        except ParaplanError as e:
            rows.append(Row(rec["id"], not is_dense(rec), target[0], target[1], None, None, str(e), gpu=gpu,
                            gpu_bundled=bundled))
    return rows
