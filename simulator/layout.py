"""Which layers each pipeline stage and virtual chunk holds."""
from __future__ import annotations

from simulator.schedules import virtual_stage


def layers_per_virtual_stage(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None) -> list[int]:
    """Layers of each virtual stage g = chunk x pp + stage, in that order; each holds a contiguous
    block of layers (Megatron's interleaved layout). Even split over the pp x vpp virtual stages, or,
    with first/last overrides, those layers on the first virtual stage (stage 0, chunk 0) and the
    last (stage pp-1, chunk vpp-1) and the rest spread evenly over the others. Without interleaving
    that is Megatron-Core's --decoder-first/last-pipeline-num-layers; under interleaving those
    flags split a rank's count over its chunks instead, so a launch config spells this layout out
    with --pipeline-model-parallel-layout (planner.emit). One layer fewer at each end is what
    --account-for-embedding/loss-in-pipeline-split and DeepSpeed's 'type:transformer|embedding'
    partition amount to (room for the embedding and the loss, as the Llama 3 paper also does).
    Callers check divisibility first (simulator.feasibility)."""
    v = pp * vpp
    fixed = {}
    if first is not None:
        fixed[0] = first
    if last is not None:
        fixed[v - 1] = last
    rest = num_layers - sum(fixed.values())
    per = rest // (v - len(fixed)) if v > len(fixed) else 0
    sizes = [fixed.get(g, per) for g in range(v)]
    if sum(sizes) != num_layers or min(sizes) < 0:
        raise ValueError(f"{num_layers} layers do not split evenly over {v} virtual stages "
                         f"(first {first}, last {last}); check with simulator.feasibility first")
    return sizes


def layers_per_chunk(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None,
                     v_shaped: bool = False) -> list[list[int]]:
    """layers[stage][chunk]: layers_per_virtual_stage by pipeline rank, the chunks in a loop or in
    a V (schedules.virtual_stage)."""
    sizes = layers_per_virtual_stage(num_layers, pp, vpp, first, last)
    return [[sizes[virtual_stage(s, c, pp, v_shaped)] for c in range(vpp)] for s in range(pp)]


def embedding_and_loss_edge(num_layers: int, stages: int) -> int | None:
    """Layers of the first and of the last of `stages` virtual stages when the embedding and the
    loss count as one layer each (Megatron-Core --account-for-embedding/loss-in-pipeline-split,
    transformer_config.py: num_layers + 2 "must be divisible by pipeline_model_parallel_size", per
    virtual stage under interleaving): (L + 2) / stages - 1, which is 0 where a stage holds only the
    embedding or only the loss. None where the layers already split evenly or L + 2 does not."""
    if stages < 2 or num_layers % stages == 0 or (num_layers + 2) % stages:
        return None
    return (num_layers + 2) // stages - 1

