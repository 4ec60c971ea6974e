"""Which layers each pipeline stage and virtual chunk holds."""
from __future__ import annotations


def layers_per_chunk(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> list[list[int]]:
    """layers[stage][chunk]. Even split over pp x vpp virtual stages (Megatron), or, with
    first/last overrides (Megatron --decoder-first/last-pipeline-num-layers, as the Llama 3 paper
    does to make room for the embedding and the head), the rest spread evenly over the middle.
    Callers check divisibility first (simulator.feasibility)."""
    if first is None and last is None:
        per = num_layers // (pp * vpp)
        return [[per] * vpp for _ in range(pp)]
    if pp == 1:
        return [[num_layers]]
    f = first if first is not None else None
    l_ = last if last is not None else None
    middle_stages = pp - (f is not None) - (l_ is not None)
    rest = num_layers - (f or 0) - (l_ or 0)
    per = rest // middle_stages if middle_stages else 0
    out = [[per] for _ in range(pp)]
    if f is not None:
        out[0] = [f]
    if l_ is not None:
        out[-1] = [l_]
    return out
