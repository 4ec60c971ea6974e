"""Pipeline schedules as pure functions: the op order each stage executes in one iteration.

An op is (kind, microbatch, chunk): kind 'F' or 'B', chunk the virtual-pipeline model chunk held
by that stage (0 when not interleaved). The engine replays these lists; it never invents order.
"""
from __future__ import annotations

from typing import NamedTuple


class Op(NamedTuple):
    kind: str  # 'F' forward, 'B' backward
    microbatch: int
    chunk: int = 0


def gpipe(num_stages: int, num_microbatches: int, stage: int) -> list[Op]:
    """GPipe (Huang et al. 2019): every forward, then every backward (torch ScheduleGPipe order)."""
    fwd = [Op("F", m) for m in range(num_microbatches)]
    bwd = [Op("B", m) for m in range(num_microbatches)]
    return fwd + bwd


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[Op]:
    """1F1B / PipeDream-Flush (Narayanan et al. SC'21, Sec. 2.2.1) in three phases:
    warmup (p - s - 1 forwards), steady state (one forward, one backward), cooldown (backwards)."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    ops = [Op("F", m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):  # steady
        ops.append(Op("F", warmup + i))
        ops.append(Op("B", i))
    ops += [Op("B", m) for m in range(num_microbatches - warmup, num_microbatches)]  # cooldown
    return ops


def _interleaved_unit(k: int, num_stages: int, num_chunks: int, forward: bool) -> tuple[int, int]:
    """Megatron-LM's mapping of the k-th virtual microbatch to (microbatch, chunk)
    (megatron/core/pipeline_parallel/schedules.py, get_model_chunk_id): groups of p microbatches
    walk through the chunks in order (reversed for backward)."""
    group = num_stages * num_chunks
    chunk = (k % group) // num_stages
    if not forward:
        chunk = num_chunks - 1 - chunk
    microbatch = (k // group) * num_stages + k % num_stages
    return microbatch, chunk


def interleaved_1f1b(num_stages: int, num_microbatches: int, stage: int, num_chunks: int) -> list[Op]:
    """Interleaved 1F1B with virtual stages (Narayanan et al. SC'21, Sec. 2.2.2), Megatron order:
    warmup = 2(p - s - 1) + (v - 1)p forwards, then 1F1B, then cooldown. Needs M % p == 0."""
    total = num_microbatches * num_chunks
    if num_microbatches == num_stages:
        warmup = total
    else:
        warmup = min((num_stages - stage - 1) * 2 + (num_chunks - 1) * num_stages, total)
    fwd = [Op("F", *_interleaved_unit(k, num_stages, num_chunks, True)) for k in range(total)]
    bwd = [Op("B", *_interleaved_unit(k, num_stages, num_chunks, False)) for k in range(total)]
    ops = fwd[:warmup]
    for i in range(total - warmup):
        ops.append(fwd[warmup + i])
        ops.append(bwd[i])
    ops += bwd[total - warmup:] if warmup else []
    return ops


def build_schedule(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> list[list[Op]]:
    """Op lists for every stage."""
    if name == "gpipe":
        return [gpipe(num_stages, num_microbatches, s) for s in range(num_stages)]
    if name == "1f1b":
        return [one_f_one_b(num_stages, num_microbatches, s) for s in range(num_stages)]
    if name == "interleaved-1f1b":
        return [interleaved_1f1b(num_stages, num_microbatches, s, num_chunks) for s in range(num_stages)]
    raise ValueError(f"unknown schedule {name!r}")


def peak_in_flight(ops: list[Op], chunk_weights: list[float] | None = None) -> float:
    """Largest activation footprint a stage holds: forwards done whose backward has not run,
    weighted per chunk (e.g. by its layer count). Read off the op order, not a formula."""
    live = 0.0
    peak = 0.0
    for op in ops:
        w = chunk_weights[op.chunk] if chunk_weights else 1.0
        if op.kind == "F":
            live += w
            peak = max(peak, live)
        else:
            live -= w
    return peak
