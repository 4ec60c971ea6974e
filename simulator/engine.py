"""The discrete-event engine: replays the pipeline schedule of one iteration on SimPy.

One process per pipeline stage runs that stage's compute stream (the representative rank of the
stage: every TP/CP/DP peer of it behaves alike under the placement, so one rank stands for all of
them, which is what makes a 16,384-GPU plan cost about what a 64-GPU one does). A second process
per stage runs its data-parallel gradient stream, which starts bucket reductions as the backward
produces them. Cross-stage dependencies are SimPy events; a pipeline send arrives `p2p` seconds
after the producer finishes. At the end every stage waits for the global gradient-norm sync
(Megatron clips gradients with a norm reduced over all ranks), then runs its optimizer step.

NIC sharing (flow-level, max-min fair): an op whose traffic crosses nodes (an MoE all-to-all) and a
gradient bucket reduced over the network at the same time each get half the GPU's NIC share while
both are active, so each is delayed by the smaller of the two overlapping transfers.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import simpy

from simulator.schedules import Op


SPAN_CATEGORY = {"F": "forward", "B": "backward", "W": "weight_grad"}


@dataclass(frozen=True)
class StageWork:
    """What one stage does in an iteration."""

    ops: Sequence[Op]
    op_cost: dict  # (kind, chunk) -> workload.Cost
    grad_buckets: dict  # chunk -> list of bucket reduction times (seconds)
    optimizer_time: float
    param_gather_time: float  # ZeRO-1/2 all-gather after the step, exposed; 0 when overlapped
    grad_bucket_nic: dict = field(default_factory=dict)  # chunk -> seconds of each bucket on the NIC


@dataclass
class Span:
    stage: int
    stream: str  # 'compute' | 'dp-comm' | 'pp-comm'
    name: str
    category: str
    start: float
    end: float


@dataclass
class StageTrace:
    compute_end: float = 0.0
    ops_done: int = 0
    comm_end: float = 0.0
    end: float = 0.0
    breakdown: dict = field(default_factory=dict)


@dataclass
class EngineResult:
    step_time: float
    stages: list[StageTrace]
    spans: list[Span]
    sync_time: float


def _add(d: dict, key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


def run_iteration(
    works: list[StageWork],
    *,
    num_chunks: int,
    p2p_time: float,
    overlap_grad_reduce: bool,
    sync_time: float,
) -> EngineResult:
    """Simulate one iteration; returns per-stage breakdowns summing to each stage's end time."""
    env = simpy.Environment()
    pp = len(works)
    last_vstage = pp * num_chunks - 1
    waiting: dict[tuple, simpy.Event] = {}
    spans: list[Span] = []
    traces = [StageTrace() for _ in range(pp)]
    grad_ready = [{c: env.event() for c in w.grad_buckets} for w in works]
    # NIC state per stage: until when the current gradient bucket holds the NIC, the running op's
    # (end, NIC seconds, duration), and delays one stream owes the other from sharing.
    bucket_nic_until = [0.0] * pp
    op_nic = [(0.0, 0.0, 0.0)] * pp
    owed_compute = [0.0] * pp
    owed_grad = [0.0] * pp

    # When each cross-stage output was produced; a SimPy event only for an input a stage waits on
    # before it exists (most inputs are ready when asked for, and skip the event queue).
    produced_at: dict[tuple, float] = {}

    def wait_for(key):
        ev = waiting.get(key)
        if ev is None:
            ev = waiting[key] = env.event()
        return ev

    def produce(key, when: float) -> None:
        produced_at[key] = when
        ev = waiting.pop(key, None)
        if ev is not None:
            ev.succeed(when)

    def producer_of(stage: int, op: Op):
        """The op of another stage this one waits for (a W waits only for its own stage's B,
        which the op order already puts before it)."""
        vstage = op.chunk * pp + stage
        if op.kind == "F":
            return ("F", op.microbatch, vstage - 1) if vstage > 0 else None
        if op.kind == "B":
            return ("B", op.microbatch, vstage + 1) if vstage < last_vstage else None
        return None

    def consumed_elsewhere(stage: int, op: Op) -> bool:
        vstage = op.chunk * pp + stage
        return (op.kind == "F" and vstage < last_vstage) or (op.kind == "B" and vstage > 0)

    def last_grad_ops(ops: Sequence[Op]) -> dict[int, int]:
        """Per chunk, the index of the op that produces its last weight gradients: its last W
        when the backward is split, else its last B."""
        kind = "W" if any(o.kind == "W" for o in ops) else "B"
        return {o.chunk: i for i, o in enumerate(ops) if o.kind == kind}

    last_b = [{c: i for c, i in last_grad_ops(w.ops).items() if c in w.grad_buckets} for w in works]

    def prepared(stage: int, work: StageWork):
        """Per op, everything the stream needs, computed once: its dependency, duration, NIC time,
        the event it produces for another stage, whether it starts a chunk's gradient flow."""
        totals = {key: (cost.total, cost.nic) for key, cost in work.op_cost.items()}
        final_b = {i: c for c, i in last_b[stage].items()}
        out = []
        for i, op in enumerate(work.ops):
            duration, nic = totals[(op.kind, op.chunk)]
            name = f"{op.kind}{op.microbatch}" + (f".{op.chunk}" if num_chunks > 1 else "")
            produces = (op.kind, op.microbatch, op.chunk * pp + stage) if consumed_elsewhere(stage, op) else None
            out.append((producer_of(stage, op), duration, nic, name, SPAN_CATEGORY[op.kind], produces, final_b.get(i)))
        return out

    def compute_stream(stage: int):
        work = works[stage]
        bd = traces[stage].breakdown
        timeout = env.timeout
        now = lambda: env.now  # noqa: E731
        bubble = comm = contention = 0.0
        for dep, duration, nic, name, category, produces, grads_of in prepared(stage, work):
            if dep is not None:
                t0 = now()
                produced = produced_at.get(dep)
                if produced is None:
                    produced = yield wait_for(dep)
                t1 = now()
                bubble += t1 - t0
                arrival = produced + p2p_time
                if arrival > t1:
                    yield timeout(arrival - t1)
                    comm += arrival - t1
                    spans.append(Span(stage, "pp-comm", f"recv {dep[0]}{dep[1]}", "pp_comm", t1, arrival))
            start = now()
            if grads_of is not None:  # this chunk's gradients start flowing now
                grad_ready[stage][grads_of].succeed((start, start + duration))
            shared = min(nic, max(0.0, bucket_nic_until[stage] - start)) if nic else 0.0
            if nic:
                owed_grad[stage] += shared
                op_nic[stage] = (start + duration + shared, nic, duration)
            yield timeout(duration + shared)
            while owed_compute[stage] > 0:  # a bucket that started during this op took NIC time
                extra, owed_compute[stage] = owed_compute[stage], 0.0
                shared += extra
                yield timeout(extra)
            contention += shared
            spans.append(Span(stage, "compute", name, category, start, now()))
            if produces is not None:
                produce(produces, now())
            traces[stage].ops_done += 1
        # the op costs are fixed per (kind, chunk): book their components by count
        counts: dict = {}
        for op in work.ops:
            counts[(op.kind, op.chunk)] = counts.get((op.kind, op.chunk), 0) + 1
        for key, n in counts.items():
            for k, v in work.op_cost[key].parts.items():
                if v:
                    _add(bd, k, n * v)
        for k, v in (("pp_bubble", bubble), ("pp_comm", comm), ("ep_comm", contention)):
            if v:
                _add(bd, k, v)
        traces[stage].compute_end = env.now

    def grad_stream(stage: int):
        work = works[stage]
        order = sorted(work.grad_buckets, key=lambda c: last_b[stage][c])
        if not overlap_grad_reduce and order:  # reduce everything once the backward is over
            spans_of = yield simpy.AllOf(env, list(grad_ready[stage].values()))
            backward_end = max(end for _, end in spans_of.values())
            yield env.timeout(backward_end - env.now)
        for c in order:
            start, end = yield grad_ready[stage][c]
            buckets = work.grad_buckets[c]
            nics = work.grad_bucket_nic.get(c, [0.0] * len(buckets))
            n = len(buckets)
            for j, (seconds, nic) in enumerate(zip(buckets, nics)):
                # bucket j is complete once the backward has produced (j+1)/n of this chunk's
                # gradients (buckets fill in reverse layer order, Megatron DDP / PyTorch DDP)
                ready = start + (j + 1) / n * (end - start) if overlap_grad_reduce else env.now
                if ready > env.now:
                    yield env.timeout(ready - env.now)
                t0 = env.now
                if nic:
                    op_end, op_nic_s, op_dur = op_nic[stage]
                    # the running op's NIC traffic still to come, spread evenly over the op
                    left = op_nic_s * max(0.0, op_end - t0) / op_dur if op_dur else 0.0
                    clash = min(nic, left)
                    owed_compute[stage] += clash
                    seconds += clash
                    bucket_nic_until[stage] = t0 + seconds
                yield env.timeout(seconds)
                while owed_grad[stage] > 0:  # an op that started during this bucket took NIC time
                    extra, owed_grad[stage] = owed_grad[stage], 0.0
                    bucket_nic_until[stage] = env.now + extra
                    yield env.timeout(extra)
                spans.append(Span(stage, "dp-comm", f"grad-reduce c{c} b{j}", "dp_comm", t0, env.now))
        traces[stage].comm_end = env.now

    for s in range(pp):
        env.process(compute_stream(s))
        env.process(grad_stream(s))
    env.run()
    stuck = [s for s in range(pp) if traces[s].ops_done != len(works[s].ops)]
    if stuck:
        raise RuntimeError(f"pipeline schedule deadlocked on stages {stuck}")

    # Global gradient-norm / embedding sync: every stage waits for the slowest one.
    barrier = max(max(t.compute_end, t.comm_end) for t in traces) + sync_time
    step = 0.0
    for s, (t, work) in enumerate(zip(traces, works)):
        bd = t.breakdown
        _add(bd, "dp_comm", max(0.0, t.comm_end - t.compute_end))
        _add(bd, "pp_bubble", barrier - sync_time - max(t.compute_end, t.comm_end))
        _add(bd, "dp_comm", sync_time)
        opt_end = barrier + work.optimizer_time
        spans.append(Span(s, "compute", "optimizer", "optimizer", barrier, opt_end))
        _add(bd, "optimizer", work.optimizer_time)
        t.end = opt_end + work.param_gather_time
        if work.param_gather_time:
            spans.append(Span(s, "dp-comm", "param all-gather", "dp_comm", opt_end, t.end))
            _add(bd, "dp_comm", work.param_gather_time)
        step = max(step, t.end)
    return EngineResult(step_time=step, stages=traces, spans=spans, sync_time=sync_time)
