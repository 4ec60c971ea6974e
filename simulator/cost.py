"""Seconds spent per component of an op: what the breakdown is made of."""
from __future__ import annotations

from dataclasses import dataclass, field

COMPONENTS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm")


@dataclass
class Cost:
    """Seconds spent per component; `total` is the op's duration on the compute stream."""

    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    nic: float = 0.0
    """Seconds inside the op during which its traffic saturates this GPU's NIC share (an MoE
    all-to-all, ZeRO-2/3 per-unit gathers and reduce-scatters, a context-parallel ring, when their
    group leaves the node; tensor parallelism across nodes is not counted); the engine shares the
    NIC with gradient reduction and pipeline sends over them."""
    dp_spans: tuple[tuple[float, float, str], ...] = ()
    """Data-parallel transfers that run inside the op on their own stream (ZeRO-2/3 per-unit
    gathers and reduce-scatters): (start, end, name), as fractions of the op's duration, for the
    trace; their exposed part is already in `parts`."""

    def add(self, component: str, seconds: float) -> "Cost":
        self.parts[component] += seconds
        return self

    def __iadd__(self, other: "Cost") -> "Cost":
        if self.dp_spans or other.dp_spans:  # placed on a whole op (simulate._zero3_chain), after every sum
            raise ValueError("Cost.dp_spans are placed on a finished op; add costs before placing transfers")
        for k, v in other.parts.items():
            self.parts[k] += v
        self.nic += other.nic
        return self

    def scaled(self, factor: float) -> "Cost":
        return Cost({k: v * factor for k, v in self.parts.items()}, self.nic * factor, self.dp_spans)

    @property
    def total(self) -> float:
        return sum(self.parts.values())
