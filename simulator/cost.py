"""Seconds spent per component of an op: what the breakdown is made of."""
from __future__ import annotations

from dataclasses import dataclass, field

COMPONENTS = ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "dp_comm")


@dataclass
class Cost:
    """Seconds spent per component; `total` is the op's duration on the compute stream."""

    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COMPONENTS, 0.0))
    nic_parts: dict[str, float] = field(default_factory=dict)
    """Per component, seconds inside the op during which its traffic of that kind saturates this
    GPU's NIC share (ep_comm: an MoE all-to-all, dp_comm: ZeRO-2/3 per-unit gathers and
    reduce-scatters, cp_comm: a context-parallel exchange, when their group leaves the node; tensor
    parallelism across nodes is not counted); the engine shares the NIC with gradient reduction and
    pipeline sends over them, and books the delays the op suffers under those components."""
    dp_spans: tuple[tuple[float, float, str], ...] = ()
    """Data-parallel transfers that run inside the op on their own stream (ZeRO-2/3 per-unit
    gathers and reduce-scatters): (start, end, name), as fractions of the op's duration, for the
    trace; their exposed part is already in `parts`."""

    def add(self, component: str, seconds: float) -> "Cost":
        self.parts[component] += seconds
        return self

    def add_nic(self, component: str, seconds: float) -> "Cost":
        if component not in self.parts:
            raise KeyError(f"unknown cost component {component!r}")
        self.nic_parts[component] = self.nic_parts.get(component, 0.0) + seconds
        return self

    @property
    def nic(self) -> float:
        """Seconds of the op that hold the NIC, all kinds of traffic together."""
        return sum(self.nic_parts.values())

    def __iadd__(self, other: "Cost") -> "Cost":
        if self.dp_spans or other.dp_spans:  # placed on a whole op (simulate._zero3_chain), after every sum
            raise ValueError("Cost.dp_spans are placed on a finished op; add costs before placing transfers")
        for k, v in other.parts.items():
            self.parts[k] += v
        for k, v in other.nic_parts.items():
            self.nic_parts[k] = self.nic_parts.get(k, 0.0) + v
        return self

    def scaled(self, factor: float) -> "Cost":
        return Cost({k: v * factor for k, v in self.parts.items()}, {k: v * factor for k, v in self.nic_parts.items()},
                    self.dp_spans)

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def concatenated(*costs: Cost) -> Cost:
    """The cost of running `costs` one after the other as one op: components and NIC time added,
    each one's in-op transfers (dp_spans) placed at its share of the whole."""
    out = Cost()
    total = sum(c.total for c in costs)
    spans, start = [], 0.0
    for c in costs:
        for k, v in c.parts.items():
            out.parts[k] += v
        for k, v in c.nic_parts.items():
            out.nic_parts[k] = out.nic_parts.get(k, 0.0) + v
        if total > 0:
            spans += [((start + a * c.total) / total, (start + b * c.total) / total, what) for a, b, what in c.dp_spans]
        start += c.total
    out.dp_spans = tuple(spans)
    return out
