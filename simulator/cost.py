"""Seconds spent per component of an op: what the breakdown is made of."""
from __future__ import annotations

from dataclasses import dataclass, field

COMPONENTS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm")


@dataclass
class Cost:
    """Seconds spent per component; `total` is the op's duration on the compute stream."""

    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    nic: float = 0.0
    """Seconds inside the op during which its traffic saturates this GPU's NIC share (MoE
    all-to-all across nodes); the engine shares the NIC with gradient reduction over them."""

    def add(self, component: str, seconds: float) -> "Cost":
        self.parts[component] += seconds
        return self

    def __iadd__(self, other: "Cost") -> "Cost":
        for k, v in other.parts.items():
            self.parts[k] += v
        self.nic += other.nic
        return self

    def scaled(self, factor: float) -> "Cost":
        return Cost({k: v * factor for k, v in self.parts.items()}, self.nic * factor)

    @property
    def total(self) -> float:
        return sum(self.parts.values())
