"""What a simulation returns, and its JSON form."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

BREAKDOWN_KEYS = (
    "compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "pp_comm", "dp_comm", "pp_bubble", "optimizer",
)


@dataclass(frozen=True, kw_only=True)
class StageResult:
    stage: int
    layers: tuple[int, ...]
    end_time_s: float
    memory: dict  # component -> bytes, with 'total'
    breakdown: dict  # component -> seconds, summing to end_time_s


@dataclass(frozen=True, kw_only=True)
class MoEReport:
    """What routing did to an MoE model's iteration."""

    routing: str
    imbalance: float
    """Tokens of the most loaded EP rank over the mean."""
    dropped_fraction: float
    moe_layer_time_s: float
    """One MoE layer, forward + backward, on the most loaded rank."""
    balanced_moe_layer_time_s: float
    """The same with a perfectly balanced router."""
    balanced_step_time_s: float | None
    """The step with a balanced router; None when the reference run was skipped."""
    ep_group: str
    ep_tiers: tuple[str, ...]
    expert_data_parallel: int

    def to_json(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(self).items()}


@dataclass(frozen=True, kw_only=True)
class SimResult:
    scenario: str
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    mfu_causal: float
    """MFU with the attention products of the causal half alone (flops.CAUSAL_SHARE)."""
    hfu_causal: float
    flop_formula: str
    peak_flops_per_gpu: float
    num_microbatches: int
    peak_memory_bytes: float
    memory_capacity_bytes: float
    fits: bool
    critical_stage: int
    breakdown: dict
    stages: tuple[StageResult, ...]
    spans: Sequence = field(default_factory=list, repr=False, compare=False)  # engine.Span, built when read
    notes: tuple[str, ...] = ()
    moe: MoEReport | None = None

    def to_json(self) -> dict:
        return {
            "scenario": self.scenario,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "mfu_causal": self.mfu_causal,
            "hfu_causal": self.hfu_causal,
            "flop_formula": self.flop_formula,
            "peak_flops_per_gpu": self.peak_flops_per_gpu,
            "num_microbatches": self.num_microbatches,
            "peak_memory_bytes": round(self.peak_memory_bytes),
            "memory_capacity_bytes": self.memory_capacity_bytes,
            "fits": self.fits,
            "critical_stage": self.critical_stage,
            "breakdown": dict(self.breakdown),
            "stages": [
                {
                    "stage": s.stage,
                    "layers": list(s.layers),
                    "end_time_s": s.end_time_s,
                    "memory_bytes": {k: round(v) for k, v in s.memory.items()},
                    "breakdown": dict(s.breakdown),
                }
                for s in self.stages
            ],
            "notes": list(self.notes),
            "moe": self.moe.to_json() if self.moe else None,
        }
