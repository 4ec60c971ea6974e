"""A `Scenario` back to the plain YAML-ready mapping the loader reads: the inverse of load_scenario.

`load_scenario(scenario_to_mapping(sc)) == sc` for every scenario the loader makes (tested for
every bundled scenario). Units go back to the YAML's (bandwidth_GBps, nic_bandwidth_Gbps,
latency_us); each converted number is the shortest decimal that converts back to exactly the
same float, so the file reads `5.0`, not `4.999999999999999`. The model is written out in full
(no preset, every derived default explicit), the cluster's links too, and the `search:` section
is left out: the mapping describes one plan, as the executor config does (`run:` included).

A `cluster.gpu` that is a profile file is written as an absolute path, so the mapping loads the
same from any folder; a bundled profile name is written as is.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from typing import Any

from paraplan.loader import _gigabits_per_s, _gigabytes_per_s, _microseconds  # noqa: PLC2701
from paraplan.specs import (
    ClusterSpec, InterNodeSpec, LinkSpec, ModelSpec, MoESpec, PlanSpec, RunSpec, Scenario, TrainingSpec,
)

# Plan keys written always (the ones every reader of a plan looks for); the other PlanSpec fields
# only when they differ from their default, which keeps the file short and loadable by a loader
# that predates a newer, defaulted field.
CORE_PLAN_KEYS = (
    "tp", "pp", "dp", "cp", "ep", "micro_batch_size", "virtual_pipeline_stages", "schedule",
    "sequence_parallel", "zero_stage", "recompute",
)


def _shortest(value: float, to_si: Callable[[float], float], scale: float) -> float:
    """The shortest decimal y with to_si(y) == value (y is about value * scale)."""
    guess = value * scale
    for digits in range(1, 18):
        y = float(f"{guess:.{digits}g}")
        if to_si(y) == value:
            return y
    for y in (guess, math.nextafter(guess, math.inf), math.nextafter(guess, -math.inf)):
        if to_si(y) == value:
            return y
    return guess


# Inverses of the loader's own conversions, so a written value loads back to the same float.
def _gbps(bytes_per_s: float) -> float:
    return _shortest(bytes_per_s, _gigabytes_per_s, 1e-9)


def _gbits(bytes_per_s: float) -> float:
    return _shortest(bytes_per_s, _gigabits_per_s, 8e-9)


def _us(seconds: float) -> float:
    return _shortest(seconds, _microseconds, 1e6)


def _defaults_dropped(spec: Any, always: tuple[str, ...] = ()) -> dict[str, Any]:
    """Fields of a spec dataclass, those equal to their default left out (unless in `always`)."""
    out = {}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if f.name in always:
            out[f.name] = value
            continue
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        if f.default_factory is not dataclasses.MISSING and value == f.default_factory():
            continue
        out[f.name] = value
    return out


def model_to_mapping(m: ModelSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": m.name, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads, "num_kv_heads": m.num_kv_heads,
        "head_dim": m.head_dim, "ffn_hidden_size": m.ffn_hidden_size, "vocab_size": m.vocab_size,
        "activation": m.activation, "tied_embeddings": m.tied_embeddings, "dropout": m.dropout,
        "linear_bias": m.linear_bias,
    }
    if m.qk_layernorm:
        out["qk_layernorm"] = True
    if m.moe is not None:
        out["moe"] = moe_to_mapping(m.moe)
    if m.mla is not None:
        out["mla"] = dataclasses.asdict(m.mla)
    if m.mtp_layers:
        out["mtp_layers"] = m.mtp_layers
    if m.sliding_window is not None:
        out["sliding_window"] = m.sliding_window
    if m.architecture is not None:
        out["architecture"] = {k: v for k, v in dataclasses.asdict(m.architecture).items() if v is not None}
    return out


def moe_to_mapping(e: MoESpec) -> dict[str, Any]:
    r = e.routing
    routing: dict[str, Any] = {"distribution": r.distribution, "seed": r.seed}
    if r.distribution == "zipf":  # the loader takes the exponent with zipf only
        routing["s"] = r.s
    if r.tokens_per_expert:
        routing["tokens_per_expert"] = list(r.tokens_per_expert)
    out = {
        "num_experts": e.num_experts, "top_k": e.top_k, "expert_ffn_hidden_size": e.expert_ffn_hidden_size,
        "num_shared_experts": e.num_shared_experts, "first_dense_layers": e.first_dense_layers,
        "moe_layer_freq": e.moe_layer_freq, "capacity_factor": e.capacity_factor, "routing": routing,
    }
    if e.expert_groups > 1:
        out.update(expert_groups=e.expert_groups, groups_per_token=e.groups_per_token)
    return out


def _gpu(gpu: str) -> str:
    is_path = "/" in gpu or os.sep in gpu or gpu.endswith((".yaml", ".yml", ".json"))
    return os.path.abspath(gpu) if is_path else gpu


def _intra(link: LinkSpec) -> dict[str, Any]:
    return {"bandwidth_GBps": _gbps(link.bandwidth), "latency_us": _us(link.latency)}


def _inter(n: InterNodeSpec) -> dict[str, Any]:
    return {
        "nics_per_node": n.nics_per_node, "nic_bandwidth_Gbps": _gbits(n.nic_bandwidth),
        "topology": n.topology, "oversubscription": n.oversubscription, "latency_us": _us(n.latency),
        "nodes_per_leaf": n.nodes_per_leaf,
    }


def cluster_to_mapping(c: ClusterSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"gpu": _gpu(c.gpu), "num_nodes": c.num_nodes, "gpus_per_node": c.gpus_per_node}
    if c.intra_node is not None:
        out["intra_node"] = _intra(c.intra_node)
    if c.inter_node is not None:
        out["inter_node"] = _inter(c.inter_node)
    return out


def training_to_mapping(t: TrainingSpec) -> dict[str, Any]:
    return _defaults_dropped(t, always=("seq_length", "global_batch_size", "precision", "attention"))


def plan_to_mapping(p: PlanSpec) -> dict[str, Any]:
    out = _defaults_dropped(p, always=CORE_PLAN_KEYS)
    if "recompute_modules" in out:  # meaningful (and accepted by the loader) only with selective
        if p.recomputed_modules:
            out["recompute_modules"] = list(p.recomputed_modules)
        else:
            del out["recompute_modules"]
    return out


def run_to_mapping(r: RunSpec) -> dict[str, Any]:
    return {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if getattr(r, f.name) is not None}


def scenario_to_mapping(sc: Scenario) -> dict[str, Any]:
    """Plain data (dicts, lists, str, int, float, bool, None) in the loader's keys and units."""
    return {
        "name": sc.name,
        "model": model_to_mapping(sc.model),
        "cluster": cluster_to_mapping(sc.cluster),
        "training": training_to_mapping(sc.training),
        "plan": plan_to_mapping(sc.plan),
        "run": run_to_mapping(sc.run),
    }
