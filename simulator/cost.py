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
    dp_spans: tuple[tuple[float, float, str], ...] = ()
    """Data-parallel transfers that run inside the op on their own stream (ZeRO-2/3 per-unit
    gathers and reduce-scatters): (start, end, name), as fractions of the op's duration, for the
    trace; their exposed part is already in `parts`."""

    def add(self, component: str, seconds: float) -> "Cost":
        self.parts[component] += seconds
        return self

    def __iadd__(self, other: "Cost") -> "Cost":
        """The two ops run one after the other: their transfers keep their place on the joint span."""
        if self.dp_spans or other.dp_spans:
            t1, t2 = self.total, other.total
            t = (t1 + t2) or 1.0
            self.dp_spans = tuple((a * t1 / t, b * t1 / t, n) for a, b, n in self.dp_spans) + tuple(
                ((t1 + a * t2) / t, (t1 + b * t2) / t, n) for a, b, n in other.dp_spans)
        for k, v in other.parts.items():
            self.parts[k] += v
        self.nic += other.nic
        return self

    def scaled(self, factor: float) -> "Cost":
        return Cost({k: v * factor for k, v in self.parts.items()}, self.nic * factor, self.dp_spans)

    @property
    def total(self) -> float:
        return sum(self.parts.values())
