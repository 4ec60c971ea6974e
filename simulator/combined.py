"""Combined 1F1B (Megatron-Core --overlap-moe-expert-parallel-comm): a forward merged with another
microbatch's backward, layer by layer, on two CUDA streams.

Megatron-Core splits each layer's pass into nodes (models/common/model_chunk_schedule_plan.py,
schedule_layer_1f1b) and issues a forward layer and a backward layer together, compute nodes on
the compute stream and the expert-parallel exchanges on a communication stream, in this order:

    backward: after-combine, combine      forward: attention (with router and permutation)
    forward: dispatch                     backward: experts
    backward: dispatch                    forward: experts
    forward: combine                      backward: attention
    forward: after-combine

so the forward's dispatch runs beside the backward's expert compute, the backward's dispatch
beside the forward's experts, and each combine beside the other pass's attention. Each stream runs
its nodes in that order and a node also waits for the one before it in its own pass. A compute node
that runs beside an exchange gives the exchange COMM_SM_SHARE of the SMs for the overlap
(hwmodels.network.overlapped). The forward's layers pair with the backward's in reverse order
(schedule_chunk_1f1b); a layer without a partner runs its nodes alone, and what is not a layer
(embedding, LM head and loss, multi-token prediction) runs before and after the layers, alone.
DualPipeV's overlapped pairs are priced the same way: the DeepSeek-V3 report's Fig. 4 overlaps the
same parts of a forward and a backward chunk (attention, dispatch, MLP, combine).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hwmodels.network import COMM_SM_SHARE
from simulator.cost import Cost, concatenated


@dataclass(frozen=True)
class LayerPhases:
    """One layer's pass in combined 1F1B's nodes, seconds: compute `attention` (the attention
    sublayer, the norm, router and permutation before the dispatch; in the backward also what
    recompute re-runs), exchange `dispatch`, compute `experts`, exchange `combine`, compute `after`
    (the unpermutation). A dense layer is all attention. The five sum to the pass's duration."""

    attention: float
    dispatch: float = 0.0
    experts: float = 0.0
    combine: float = 0.0
    after: float = 0.0

    @classmethod
    def of(cls, total: float, moe_phases: tuple[float, float, float, float] | None) -> LayerPhases:
        """The phases of a pass of `total` seconds whose MoE module (if any) has `moe_phases`
        (MoEBlock.forward_phases / backward_phases): the rest of the pass is attention."""
        if moe_phases is None:
            return cls(total)
        dispatch, experts, combine, after = moe_phases
        return cls(total - dispatch - experts - combine - after, dispatch, experts, combine, after)


# Per layer pair, the nodes in issue order: (pass: 0 forward / 1 backward, phase, runs on the compute stream)
_ORDER = ((1, "after", True), (1, "combine", False), (0, "attention", True), (0, "dispatch", False),
          (1, "experts", True), (1, "dispatch", False), (0, "experts", True), (0, "combine", False),
          (1, "attention", True), (0, "after", True))


def merged_layers_time(forward: Sequence[LayerPhases], backward: Sequence[LayerPhases]) -> float:
    """Seconds from the first node to the last of a forward over `forward`'s layers (in order) and
    a backward over `backward`'s layers (given in forward order; it runs them last to first),
    paired layer by layer as the module docstring describes."""
    free = [0.0, 0.0]  # when the comm stream (0) and the compute stream (1) are free
    ready = [0.0, 0.0]  # when the forward's (0) and the backward's (1) previous node ends
    exchanges: list[tuple[float, float]] = []
    for i in range(max(len(forward), len(backward))):
        layer = (forward[i] if i < len(forward) else None,
                 backward[len(backward) - 1 - i] if i < len(backward) else None)
        for which, phase, compute in _ORDER:
            if layer[which] is None:
                continue
            seconds = getattr(layer[which], phase)
            start = max(free[compute], ready[which])
            end = start + seconds
            if seconds > 0 and compute:
                # every exchange that can overlap this node was issued before it (module docstring)
                beside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in exchanges[-2:])
                end += COMM_SM_SHARE * beside
            elif seconds > 0:
                exchanges.append((start, end))
            free[compute] = ready[which] = end
    return max(free)


def merged_cost(forward: Cost, backward: Cost, seconds: float) -> Cost:
    """The cost of a merged pair lasting `seconds`: the two passes' components, except that the
    expert-parallel exchanges count only for what the merge leaves exposed (the pair's time beyond
    every other component, SM sharing included); their NIC traffic is both passes'."""
    cost = concatenated(forward, backward)
    others = cost.total - cost.parts["ep_comm"]
    cost.parts["ep_comm"] = max(0.0, seconds - others)
    return cost
