"""Pipeline schedules as pure functions: the op order each stage executes in one iteration.

An op is (kind, microbatch, chunk): kind 'F' (forward), 'B' (backward) or, in the zero-bubble
schedules, 'B' for the input gradient only and 'W' for the weight gradient; chunk is the
virtual-pipeline model chunk held by that stage (0 when not interleaved; `virtual_stage` says
which part of the model it is). The engine replays these
lists; it never invents order.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from operator import itemgetter
from typing import NamedTuple


class Op(NamedTuple):
    kind: str  # 'F' forward, 'B' backward (input gradient only when the schedule has 'W' ops), 'W' weight
    # gradient, 'X' a whole backward (input and weight gradients) in a schedule that also splits some (DualPipeV)
    microbatch: int
    chunk: int = 0


def _forwards_and_backwards(num_microbatches: int) -> tuple[list[Op], list[Op]]:
    """Every microbatch's F and B op of a non-interleaved schedule, in microbatch order (built once
    per schedule and shared by its stages: ops are immutable)."""
    return [Op("F", m) for m in range(num_microbatches)], [Op("B", m) for m in range(num_microbatches)]


def gpipe(num_stages: int, num_microbatches: int, stage: int,
          units: tuple[list[Op], list[Op]] | None = None) -> list[Op]:
    """GPipe (Huang et al. 2019): every forward, then every backward (torch ScheduleGPipe order)."""
    fwd, bwd = units or _forwards_and_backwards(num_microbatches)
    return fwd + bwd


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int,
                units: tuple[list[Op], list[Op]] | None = None) -> list[Op]:
    """1F1B / PipeDream-Flush (Narayanan et al. SC'21, Sec. 2.2.1) in three phases:
    warmup (p - s - 1 forwards), steady state (one forward, one backward), cooldown (backwards)."""
    fwd, bwd = units or _forwards_and_backwards(num_microbatches)
    warmup = min(num_stages - stage - 1, num_microbatches)
    return _alternate(fwd, bwd, warmup)


def _alternate(fwd: list[Op], bwd: list[Op], warmup: int) -> list[Op]:
    """`warmup` forwards, then one forward and one backward alternately, then the remaining
    backwards."""
    steady = len(fwd) - warmup
    ops = fwd[:warmup] + [None] * (2 * steady)
    ops[warmup::2] = fwd[warmup:]
    ops[warmup + 1::2] = bwd[:steady]
    ops += bwd[steady:]
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


def _interleaved_units(num_stages: int, num_microbatches: int, num_chunks: int) -> tuple[list[Op], list[Op]]:
    """Every virtual microbatch's F and B op, in Megatron's order (`_interleaved_unit`); the same
    for every stage, so built once per schedule. The mapping walks whole groups of p microbatches,
    so over virtual stages M must be a multiple of p."""
    if num_chunks > 1 and num_microbatches % num_stages:
        raise ValueError(f"interleaved order over {num_chunks} virtual stages needs the number of "
                         f"microbatches ({num_microbatches}) to be a multiple of pp ({num_stages})")
    total = num_microbatches * num_chunks
    fwd = [Op("F", *_interleaved_unit(k, num_stages, num_chunks, True)) for k in range(total)]
    bwd = [Op("B", *_interleaved_unit(k, num_stages, num_chunks, False)) for k in range(total)]
    return fwd, bwd


def _interleaved_order(num_stages: int, num_microbatches: int, stage: int, num_chunks: int,
                       warmup: int, units: tuple[list[Op], list[Op]] | None = None) -> list[Op]:
    """`warmup` forwards, then one forward and one backward alternately, then the remaining
    backwards, over virtual microbatches in Megatron's order (`_interleaved_unit`)."""
    fwd, bwd = units or _interleaved_units(num_stages, num_microbatches, num_chunks)
    return _alternate(fwd, bwd, min(warmup, len(fwd)))


def interleaved_1f1b(num_stages: int, num_microbatches: int, stage: int, num_chunks: int,
                     units: tuple[list[Op], list[Op]] | None = None) -> list[Op]:
    """Interleaved 1F1B with virtual stages (Narayanan et al. SC'21, Sec. 2.2.2), Megatron order:
    warmup = 2(p - s - 1) + (v - 1)p forwards (at most all of them), then 1F1B, then cooldown.
    Needs M % p == 0. With M == p too (megatron/core/pipeline_parallel/schedules.py,
    get_pp_rank_microbatches; PyTorch ScheduleInterleaved1F1B): the all-forwards-first special case
    of earlier Megatron-LM releases is gone from both."""
    return _interleaved_order(num_stages, num_microbatches, stage, num_chunks,
                              _interleaved_warmup(num_stages, stage, num_chunks), units)


def _interleaved_warmup(num_stages: int, stage: int, num_chunks: int) -> int:
    """Megatron's interleaved warm-up forwards on `stage`, before its cap at all of them:
    2(p - s - 1) + (v - 1)p (schedules.py get_pp_rank_microbatches)."""
    return (num_stages - stage - 1) * 2 + (num_chunks - 1) * num_stages


def zero_bubble(num_stages: int, num_microbatches: int, stage: int, num_chunks: int = 1,
                units: tuple[list[Op], list[Op]] | None = None) -> list[Op]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Sec. 3.1; PyTorch
    ScheduleInterleavedZeroBubble). The backward is split into B, the input gradient that the
    previous stage waits for, and W, the weight gradient that only the optimizer needs.

    B and F follow 1F1B (interleaved over virtual stages when num_chunks > 1, one extra warm-up
    forward per hop to the last stage: (v - 1)p + p - s - 1). Stage s holds back its first s W
    passes and otherwise runs each W right after a B, oldest first; the held-back ones run at the
    end. Later stages thus keep the backward chain moving and do their weight gradients while
    earlier stages still work: with equal F, B, W the bubble falls from 1F1B's (p-1)(F+B+W) to
    (p-1)(F+B-W), at 1F1B's number of microbatches in flight. Needs M % p == 0 when interleaved."""
    warmup = (num_chunks - 1) * num_stages + num_stages - stage - 1
    ops: list[Op] = []
    pending: list[Op] = []
    for op in _interleaved_order(num_stages, num_microbatches, stage, num_chunks, warmup, units):
        ops.append(op)
        if op.kind == "B":
            pending.append(Op("W", op.microbatch, op.chunk))
            if len(pending) > stage:
                ops.append(pending.pop(0))
    return ops + pending


def zbv(num_stages: int, num_microbatches: int, stage: int) -> list[Op]:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, Sec. 6; PyTorch
    ScheduleZBVZeroBubble). Each rank holds two chunks placed in a V (`virtual_stage`): chunk 0 is
    virtual stage r and chunk 1 is 2p - 1 - r, so the last rank turns each microbatch around in
    place and rank 0 holds both ends of the model. The backward is split into B and W as in ZB-H1.

    Rank r runs, in order: 2(p - r) - 1 chunk-0 forwards; r pairs (chunk-1 forward, chunk-0
    forward); p - r rounds of a chunk-1 forward, B and W; then rounds of a chunk-0 forward (while
    any remain), B and W, and a chunk-1 forward, B and W, until every forward has run; then r
    pairs of B (chunk 0, chunk 1), p - r rounds of a chunk-0 B and the oldest chunk-0 W still
    owed, and last the W passes still owed, chunk 1's before chunk 0's. With equal F, B and W
    times per chunk and free sends the steady state has no bubble. The order is built for at
    least 2p - 1 microbatches and the ops of microbatches beyond the real count are dropped, as
    PyTorch does."""
    p, r = num_stages, stage
    total = max(2 * p - 1, num_microbatches)
    done = {(kind, chunk): 0 for kind in "FBW" for chunk in (0, 1)}
    ops: list[Op] = []

    def run(*steps: str) -> None:  # each step: kind then chunk, e.g. "F1"
        for kind, chunk in ((s[0], int(s[1])) for s in steps):
            ops.append(Op(kind, done[kind, chunk], chunk))
            done[kind, chunk] += 1

    for _ in range(2 * (p - r) - 1):
        run("F0")
    for _ in range(r):
        run("F1", "F0")
    for _ in range(p - r):
        run("F1", "B1", "W1")
    while done["F", 1] < done["F", 0] or done["F", 0] < total:
        if done["F", 0] < total:
            run("F0")
        run("B0", "W0", "F1", "B1", "W1")
    for _ in range(r):
        run("B0", "B1")
    for _ in range(p - r):
        run("B0", "W0")
    for chunk in ("1", "0"):
        while done["W", int(chunk)] < done["B", int(chunk)]:
            run("W" + chunk)
    return [op for op in ops if op.microbatch < num_microbatches]


def dualpipev_actions(num_stages: int, num_microbatches: int, stage: int) -> list[tuple]:
    """DualPipeV (DeepSeek-V3 technical report, Sec. 3.2.1, DualPipe cut in half into a V;
    deepseek-ai/DualPipe dualpipev.py, PyTorch ScheduleDualPipeV): rank r's actions, each
    (kind, chunk, microbatch) with kind F (forward), I (input gradient), W (weight gradient) or B
    (the whole backward), or ('FB', forward, backward) for a forward overlapped with a whole
    backward of the other chunk. Chunk 0 is virtual stage r and chunk 1 2p - 1 - r (`virtual_stage`).

    In order: 2(p - r - 1) chunk-0 forwards; r + 1 pairs of a chunk-0 and a chunk-1 forward; p - r - 1
    rounds of a chunk-1 input gradient, its weight gradient and a chunk-1 forward; M - 2p + r + 1
    rounds of (chunk-0 forward with a chunk-1 backward) and (chunk-1 forward with a chunk-0
    backward), overlapped, except that the last rank runs its first chunk-0 forward and chunk-1
    backward one after the other; p - r - 1 rounds of a chunk-1 backward and (chunk-1 forward with
    a chunk-0 backward); r + 1 rounds of a chunk-1 then a chunk-0 backward, which from the middle
    round on (an odd rank from its chunk-1 backward, an even one from its chunk-0 backward) compute
    only the input gradient; p - r - 1 rounds of a deferred weight gradient and a chunk-0 backward
    (input gradient only once that switch happened); and the r + 1 weight gradients still owed.
    Needs M >= 2p."""
    p, r = num_stages, stage
    fwd = [0, 0]  # the next microbatch per chunk: forwards, backwards (input gradients)
    bwd = [0, 0]
    deferred: list[tuple[int, int]] = []  # (chunk, microbatch) of input gradients whose W is owed
    out: list[tuple] = []

    def forward(chunk: int) -> tuple:
        fwd[chunk] += 1
        return ("F", chunk, fwd[chunk] - 1)

    def backward(chunk: int, whole: bool) -> tuple:
        bwd[chunk] += 1
        if not whole:
            deferred.append((chunk, bwd[chunk] - 1))
        return ("B" if whole else "I", chunk, bwd[chunk] - 1)

    def weight() -> None:
        if deferred:
            out.append(("W", *deferred.pop(0)))

    for _ in range(2 * (p - r - 1)):
        out.append(forward(0))
    for _ in range(r + 1):
        out += [forward(0), forward(1)]
    for _ in range(p - r - 1):
        out.append(backward(1, whole=False))
        weight()
        out.append(forward(1))
    for i in range(num_microbatches - 2 * p + r + 1):
        if i == 0 and r == p - 1:  # not overlapped, to shrink the bubble
            out += [forward(0), backward(1, whole=True)]
        else:
            out.append(("FB", forward(0), backward(1, whole=True)))
        out.append(("FB", forward(1), backward(0, whole=True)))
    for _ in range(p - r - 1):
        out.append(backward(1, whole=True))
        out.append(("FB", forward(1), backward(0, whole=True)))
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        out.append(backward(1, whole=not split))
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        out.append(backward(0, whole=not split))
    for _ in range(p - r - 1):
        weight()
        out.append(backward(0, whole=not split))
    for _ in range(r + 1):
        weight()
    return out


def dualpipev(num_stages: int, num_microbatches: int, stage: int) -> tuple[list[Op], list[int]]:
    """DualPipeV's op order (`dualpipev_actions`) as ops: a whole backward is an X, an input
    gradient a B, a weight gradient a W; and the indices of the forwards that run overlapped with
    the whole backward after them."""
    ops: list[Op] = []
    pairs: list[int] = []
    for action in dualpipev_actions(num_stages, num_microbatches, stage):
        if action[0] == "FB":
            (_, fc, fm), (_, bc, bm) = action[1], action[2]
            pairs.append(len(ops))
            ops += [Op("F", fm, fc), Op("X", bm, bc)]
        else:
            kind, chunk, mb = action
            ops.append(Op({"I": "B", "B": "X"}.get(kind, kind), mb, chunk))
    return ops, pairs


V_SHAPED_SCHEDULES = ("zbv", "dualpipev")
"""Schedules whose two chunks per rank sit in a V (`virtual_stage`) instead of in a loop."""


def v_shaped(plan) -> bool:
    """Whether the plan's chunks sit in a V on the pipeline ranks (virtual_stage)."""
    return plan.pp > 1 and plan.schedule in V_SHAPED_SCHEDULES


def virtual_stage(stage: int, chunk: int, num_stages: int, v_shaped: bool) -> int:
    """The model's virtual stage that `chunk` of pipeline rank `stage` holds: chunk x p + stage
    in Megatron's looped layout; stage, then 2p - 1 - stage in a V (ZB-V, DualPipeV)."""
    if v_shaped:
        return stage if chunk == 0 else 2 * num_stages - 1 - stage
    return chunk * num_stages + stage


def holder(vstage: int, num_stages: int, v_shaped: bool) -> tuple[int, int]:
    """(pipeline rank, chunk) holding virtual stage `vstage`: the inverse of `virtual_stage`."""
    if v_shaped:
        return (vstage, 0) if vstage < num_stages else (2 * num_stages - 1 - vstage, 1)
    return vstage % num_stages, vstage // num_stages


def splits_backward(ops: Sequence[Op]) -> bool:
    """Whether an op order splits the backward into B and W (it has a W op)."""
    return "W" in map(itemgetter(0), ops)


def gradient_kinds(ops: Sequence[Op]) -> tuple[str, ...]:
    """The kinds of op that produce weight gradients: W and whole backwards (X) where the order
    splits backwards, else B."""
    return ("W", "X") if splits_backward(ops) else ("B",)


SPLIT_BACKWARD_SCHEDULES = ("zero-bubble", "zbv", "dualpipev")
"""Schedules whose ops split the backward into B (input gradient) and W (weight gradient)."""
WHOLE_AND_SPLIT_SCHEDULES = ("dualpipev",)
"""Split-backward schedules that also run whole backwards (X ops: DualPipeV's pairs and most of
its backwards)."""


@functools.lru_cache(maxsize=64)
def build_schedule(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1,
                   combined: bool = False) -> tuple[tuple[Op, ...], ...]:
    """Op sequences for every stage (immutable and cached: the planner and the balanced-router
    reference run ask for the same schedules again and again). `combined`: the order of combined
    1F1B (`_combined`), whose merged pairs `combined_pairs` names; DualPipeV keeps its own order,
    whose pairs are merged either way (`merged_pairs`)."""
    if combined and name != "dualpipev":
        return tuple(tuple(ops) for ops in _combined(name, num_stages, num_microbatches, num_chunks))
    return tuple(tuple(ops) for ops in _build_schedule(name, num_stages, num_microbatches, num_chunks))


def _combined(name: str, num_stages: int, num_microbatches: int, num_chunks: int) -> list[list[Op]]:
    """Combined 1F1B (Megatron-Core --overlap-moe-expert-parallel-comm). With one stage
    (pipeline_parallel/combined_1f1b.py, combined_1f1b_schedule_for_no_pipelining): microbatch 0's
    forward alone, then the forward of i + 1 merged with the backward of i, then the last backward
    alone: 1F1B's alternation after one warm-up forward. Pipelined it needs the interleaved
    schedule (schedules.py forward_backward_pipelining_with_interleaving), whose warm-up takes one
    forward more than interleaved 1F1B's (num_warmup_microbatches += 1) so that each steady-state
    forward and the backward merged with it belong to different microbatches."""
    warmups = _combined_warmups(name, num_stages, num_microbatches, num_chunks)
    if num_stages == 1:
        fwd, bwd = _forwards_and_backwards(num_microbatches)
        return [_alternate(fwd, bwd, warmups[0])]
    units = _interleaved_units(num_stages, num_microbatches, num_chunks)
    return [_interleaved_order(num_stages, num_microbatches, s, num_chunks, w, units) for s, w in enumerate(warmups)]


def _combined_warmups(name: str, num_stages: int, num_microbatches: int, num_chunks: int) -> list[int]:
    """Per stage, the forwards combined 1F1B runs before its first merged pair (at most all)."""
    if num_stages == 1 and name in ("gpipe", "1f1b"):
        return [min(1, num_microbatches)]
    if name != "interleaved-1f1b":
        raise ValueError(f"combined 1F1B runs on one stage or under interleaved-1f1b, not {name}")
    total = num_microbatches * num_chunks
    return [min(total, _interleaved_warmup(num_stages, s, num_chunks) + 1) for s in range(num_stages)]


@functools.lru_cache(maxsize=64)
def merged_pairs(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1,
                 combined: bool = False) -> tuple[tuple[int, ...], ...]:
    """Per stage, the indices of the forwards in `build_schedule(name, ..., combined)`'s order that
    run merged with the (whole) backward after them: DualPipeV's overlapped pairs, or combined
    1F1B's (`combined_pairs`); () per stage elsewhere."""
    if name == "dualpipev":
        return tuple(tuple(dualpipev(num_stages, num_microbatches, s)[1]) for s in range(num_stages))
    if combined:
        return combined_pairs(name, num_stages, num_microbatches, num_chunks)
    return ((),) * num_stages


@functools.lru_cache(maxsize=64)
def combined_pairs(name: str, num_stages: int, num_microbatches: int, num_chunks: int = 1) -> tuple[tuple[int, ...], ...]:
    """Per stage, the indices in its combined-1F1B order (`build_schedule(..., combined=True)`) of
    the forwards that run merged with the backward right after them: the steady state's, after the
    warm-up. A stage whose warm-up takes every forward has none (Megatron then runs all forwards
    and all backwards alone), though its last forward is followed by a backward."""
    total = num_microbatches * (num_chunks if num_stages > 1 else 1)
    return tuple(tuple(w + 2 * j for j in range(total - w))
                 for w in _combined_warmups(name, num_stages, num_microbatches, num_chunks))


def _build_schedule(name: str, num_stages: int, num_microbatches: int, num_chunks: int) -> list[list[Op]]:
    per_stage = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved-1f1b": interleaved_1f1b,
                 "zero-bubble": zero_bubble, "zbv": zbv, "dualpipev": dualpipev}.get(name)
    if per_stage is None:
        raise ValueError(f"unknown schedule {name!r}")
    if name == "zbv":
        return [zbv(num_stages, num_microbatches, s) for s in range(num_stages)]
    if name == "dualpipev":
        return [dualpipev(num_stages, num_microbatches, s)[0] for s in range(num_stages)]
    if name in ("gpipe", "1f1b"):
        units = _forwards_and_backwards(num_microbatches)
        return [per_stage(num_stages, num_microbatches, s, units) for s in range(num_stages)]
    units = _interleaved_units(num_stages, num_microbatches, num_chunks)
    return [per_stage(num_stages, num_microbatches, s, num_chunks, units) for s in range(num_stages)]


def peak_in_flight(ops: Sequence[Op], chunk_weights: list[float] | None = None,
                   freed_by_b: list[float] | None = None, rebuilt_by_b: list[float] | None = None) -> float:
    """Largest activation footprint a stage holds: forwards done whose backward has not run,
    weighted per chunk (e.g. by its layer count). Read off the op order, not a formula.

    With split backwards a microbatch's activations count until its W: an upper bound, since the
    B pass already frees what only the input gradient needed (the weight gradients keep the
    inputs of the linear layers, the M_W of Qi et al. 2024, Sec. 3). `freed_by_b` (per chunk, also
    counted from the F) is what is known to be freed by the B pass even then, e.g. the loss's
    softmax, which only the input gradient of the logits reads. `rebuilt_by_b` (per chunk) is what
    recompute rebuilds in the B pass and the W pass still reads (the recomputed linear layers'
    inputs), counted the same way from the B to the W, the B's peak included: the forward's
    activations that the stored checkpoints stand for."""
    split = splits_backward(ops)
    chunks = 1 + max((op[2] for op in ops), default=0)
    weight = chunk_weights or [1.0] * chunks
    freed = freed_by_b or [0.0] * chunks
    rebuilt = (rebuilt_by_b or [0.0] * chunks) if split else [0.0] * chunks
    taken = [w + b for w, b in zip(weight, freed)]  # by an F
    given_by_b = freed if split else taken
    live = 0.0
    peak = 0.0
    for kind, _, chunk in ops:
        if kind == "F":
            live += taken[chunk]
            if live > peak:
                peak = live
        elif kind == "B":
            live += rebuilt[chunk]
            if live > peak:
                peak = live
            live -= given_by_b[chunk]
        elif kind == "W":
            live -= weight[chunk] + rebuilt[chunk]
        elif kind == "X":  # a whole backward frees all its microbatch held
            live -= taken[chunk]
    return peak
