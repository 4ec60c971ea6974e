"""The discrete-event engine: replays the pipeline schedule of one iteration on SimPy.

One process per pipeline stage runs that stage's compute stream (the representative rank of the
stage: every TP/CP/DP peer of it behaves alike under the placement, so one rank stands for all of
them, which is what makes a 16,384-GPU plan cost about what a 64-GPU one does). A second process
per stage runs its data-parallel gradient stream, which starts bucket reductions as the backward
produces them. Cross-stage dependencies are SimPy events; a pipeline send arrives `p2p` seconds
after the producer finishes, and where the framework waits for its sends (`blocking_sends`) the
sending stage starts its next op only then. At the end every stage waits for the global gradient-norm sync
(Megatron clips gradients with a norm reduced over all ranks), then runs its optimizer step.

NIC sharing (flow level): an op whose traffic crosses nodes (an MoE all-to-all), a gradient
bucket reduced over the network and a pipeline send between stages on different nodes share the
GPU's NIC while they overlap: each of two overlapping flows is delayed by the other's traffic in
the overlap (an op's traffic is taken as spread evenly over the op, buckets and sends saturate the
NIC while they run; not max-min fair: an op that moves little is slowed too). A flow's delay
lengthens its hold on the NIC at once, so a later flow meets the traffic it deferred. A stage's
pipeline sends leave one after another (one communicator's point-to-point operations run in
order), and a combined pair's two sends, issued in one batch, land together. A pipeline send uses the
sender's NIC and the receiver's: it shares with the sender's gradient bucket and with the
receiver's running op and bucket, and arrives late by the larger of the two sides' delays (the
running op's share is added to the receiver's next op, which saves an event per send and moves
that op's end by at most one send); an op or a bucket that starts while a send is on its NIC is
delayed by the overlap (the send's arrival was settled when it left).

SM sharing: a gradient bucket's collective holds COMM_SM_SHARE of the GPU's SMs while it runs, so
an op that runs beside it for t seconds ends COMM_SM_SHARE x t later (booked as data-parallel
communication); whichever of the two starts second settles it, so each overlap counts once.

Overlapped weight all-gather (ZeRO-1/2 with --overlap-param-gather): the distributed optimizer
gathers the updated weights bucket by bucket while the next forward runs, and a module's forward
pre-hook waits for its bucket (megatron/core/distributed/distributed_data_parallel.py,
_make_forward_pre_hook). So the first forward of each chunk ends no earlier than, for every bucket,
its arrival plus the part of the op from where that bucket is needed; the wait beyond the op's own
end is exposed data-parallel communication. The gather holds the NIC and the SMs like a gradient
bucket; while bucket k is in flight the gated forward can only move the traffic of the compute
that bucket k's predecessor made possible, so that is all the two share.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import simpy

from hwmodels.network import COMM_SM_SHARE
from simulator.schedules import Op, gradient_kinds, holder, virtual_stage


SPAN_CATEGORY = {"F": "forward", "B": "backward", "W": "weight_grad", "X": "backward"}
PAIR_CATEGORY = "forward_backward"
"""The span category of a merged pair (a forward with a whole backward: combined 1F1B, DualPipeV)."""


@dataclass(frozen=True)
class StageWork:
    """What one stage does in an iteration."""

    ops: Sequence[Op]
    op_cost: dict  # (kind, chunk) -> workload.Cost
    grad_buckets: dict  # chunk -> list of bucket reduction times (seconds)
    optimizer_time: float
    param_gather_time: float  # ZeRO-1/2 all-gather after the step, exposed (not overlapped)
    grad_bucket_nic: dict = field(default_factory=dict)  # chunk -> seconds of each bucket on the NIC
    pairs: tuple[int, ...] = ()
    """Pairs (schedules.merged_pairs: combined 1F1B, DualPipeV): indices of the forwards in `ops`
    that run paired with the (whole) backward right after them. Overlapped (`pairs_overlapped`), a
    pair is one op that starts once both inputs are there, lasts `pair_cost` and sends both outputs
    when it ends; else the forward runs once its input is there, the backward after it once its
    own is, and both outputs are sent when the backward ends (PyTorch's DualPipeV without an overlap
    callback: schedules.py _add_send_recv after the pair)."""
    pairs_overlapped: bool = True
    pair_cost: dict = field(default_factory=dict)
    """(forward's chunk, backward's chunk) -> workload.Cost of an overlapped pair."""
    param_gather_buckets: dict = field(default_factory=dict)
    """chunk -> [(seconds, seconds on the NIC, needed_from)] per bucket of the ZeRO-1/2 weight
    all-gather overlapped with the forward (Megatron --overlap-param-gather), launched when the step
    begins, bucket after bucket in dispatch order; needed_from is the fraction of the chunk's first
    forward that can run before that bucket's weights are needed."""


@dataclass(slots=True)
class Span:
    stage: int
    stream: str  # 'compute' | 'dp-comm' | 'pp-comm'
    name: str
    category: str
    start: float
    end: float
    parts: dict | None = None
    """An op's cost by component (compute, recompute, exposed tp_comm, ep_comm, ...), seconds, before
    what sharing a NIC or the SMs with overlapping traffic adds: the span's breakdown."""


def _op_name(op, num_chunks: int) -> str:
    """An op's span name: F3, or F3.1 for chunk 1 when the schedule is interleaved; BW3 for a whole
    backward (X); a combined pair (forward, backward) F4+B3."""
    if not isinstance(op, Op):
        return "+".join(_op_name(o, num_chunks) for o in op)
    kind = "BW" if op.kind == "X" else op.kind  # a whole backward where others are split
    return f"{kind}{op.microbatch}" + (f".{op.chunk}" if num_chunks > 1 else "")


class Timeline(Sequence):
    """The spans of an iteration. The engine records its most frequent ones (a compute op, a
    pipeline receive) as bare tuples; they become Span objects, with their names, when the
    timeline is first read (--trace, --plot), not while the iteration is simulated."""

    def __init__(self, records: list, num_chunks: int, num_vstages: int):
        self._records = records
        self._num_chunks = num_chunks
        self._num_vstages = num_vstages
        self._spans: list[Span] | None = None

    def _span(self, rec) -> Span:
        if isinstance(rec, Span):
            return rec
        if len(rec) == 4:  # a receive (stage, input's output key, start, arrival), or a send ~key
            stage, key, start, end = rec
            what = "recv" if key >= 0 else "send"
            key = key if key >= 0 else ~key
            return Span(stage, "pp-comm", f"{what} {'FB'[key & 1]}{(key >> 1) // self._num_vstages}", "pp_comm",
                        start, end)
        stage, op, category, start, end, parts = rec  # an op, or a combined pair of them
        return Span(stage, "compute", _op_name(op, self._num_chunks), category, start, end, parts)

    def _built(self) -> list[Span]:
        if self._spans is None:
            self._spans = [self._span(rec) for rec in self._records]
            self._records = []
        return self._spans

    def __getitem__(self, index):
        return self._built()[index]

    def __iter__(self):
        return iter(self._built())

    def __len__(self) -> int:
        return len(self._spans if self._spans is not None else self._records)


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
    spans: Timeline
    sync_time: float


def _add(d: dict, key: str, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


KINDS = ("F", "B", "W", "X")
_KIND_INDEX = {kind: i for i, kind in enumerate(KINDS)}
_PLAN_CACHE: dict = {}
_PLAN_CACHE_LOCK = threading.Lock()
# kept op plans, counted in ops (about 300 bytes each with the schedule's Op they keep alive; per
# process): a planner's study meets few schedules
_PLAN_CACHE_OPS = 200_000


def _op_slot(kind: str, chunk: int) -> int:
    """An int naming an op's (kind, chunk), its key in a stage's table of op costs."""
    return chunk * len(KINDS) + _KIND_INDEX[kind]


def _pair_slot(f_chunk: int, b_chunk: int, num_chunks: int) -> int:
    """The slot of a combined pair's cost: after every (kind, chunk) slot."""
    return len(KINDS) * num_chunks + f_chunk * num_chunks + b_chunk


# An op's output is named by an int (cheaper to hash than a tuple, on every op), its output key:
# (microbatch x number of virtual stages + virtual stage) x 2, plus 1 for a B's (_op_plan).




def _link(stage: int, to: int, pp: int) -> int:
    """The link a send between neighbouring stages takes (forward s -> s + 1 and the wrap-around
    pp - 1 -> 0 are links s and pp - 1; backward s -> s - 1 is link s - 1)."""
    return stage if to == (stage + 1) % pp else to


def _op_plan(ops: Sequence[Op], stage: int, pp: int, num_chunks: int, final_b: dict, launch_after: dict,
             gates: dict, v_shaped: bool = False, pairs: tuple[int, ...] = (),
             overlapped: bool = True) -> tuple[list[tuple], dict]:
    """Per op of `stage`, what its stream needs besides the op's cost: the key of the input it
    waits for, its slot in the cost table, the output it sends (key, receiving stage, link; link
    None where the next virtual stage is on the same rank, the turn of a V), for
    the few ops that do more (else None) the chunk whose gradient flow it starts, the chunks whose
    reduction starts when it ends and the chunk whose gathered weights gate it, and the op itself;
    and how many ops of each (kind, chunk) the stage runs. It follows from the schedule alone, so
    an immutable schedule's is kept (the planner and the balanced-router reference replay the same
    schedules again and again).

    `pairs` (StageWork.pairs: combined 1F1B, DualPipeV), `overlapped`: each forward at those indices
    and the backward after it become one entry, which waits for both inputs and sends both outputs;
    its slot is the pair's (`_pair_slot`), its count keyed ('FB', forward's chunk, backward's chunk),
    and its last field (None for a single op) is (the backward's input key, the backward's output,
    the backward op). Where the pair has specials, the backward's (gradient flow, launches) and the
    forward's gate are the entry's. Not overlapped, the two stay entries of their own, the
    forward's output sent with the backward's (_sequential_pairs)."""
    key = (id(ops), stage, pp, num_chunks, v_shaped, pairs, overlapped, tuple(final_b.items()),
           tuple((i, tuple(chunks)) for i, chunks in launch_after.items()), tuple(gates.items()))
    hit = _PLAN_CACHE.get(key)
    if hit is not None and hit[0] is ops:
        return hit[1], hit[2]
    vstages = pp * num_chunks
    last_vstage = vstages - 1

    def neighbour(vstage: int) -> tuple[int, int | None]:
        """The rank holding `vstage` and the link to it (None: this rank)."""
        to = holder(vstage, pp, v_shaped)[0]
        return to, None if to == stage else _link(stage, to, pp)

    slot_of = {(kind, chunk): _op_slot(kind, chunk) for kind in KINDS for chunk in range(num_chunks)}
    special = final_b.keys() | launch_after.keys() | gates.keys()
    plan = []
    append = plan.append
    counts: dict[tuple[str, int], int] = {}  # in order of first use
    for i, op in enumerate(ops):
        kind, mb, chunk = op
        kind_chunk = (kind, chunk)
        slot = slot_of.get(kind_chunk)
        if slot is None:
            raise ValueError(f"stage {stage}: op {op} is not an F, B or W of a chunk below {num_chunks}")
        counts[kind_chunk] = counts.get(kind_chunk, 0) + 1
        vstage = virtual_stage(stage, chunk, pp, v_shaped)
        unit = mb * vstages + vstage  # output keys: unit x 2 for an F, + 1 for a B
        dep = out = None  # a W waits only for its own stage's B, which the op order puts first
        if kind == "F":
            if vstage > 0:
                dep = (unit - 1) * 2
            if vstage < last_vstage:
                out = (unit * 2, *neighbour(vstage + 1))
        elif kind == "B" or kind == "X":
            if vstage < last_vstage:
                dep = (unit + 1) * 2 + 1
            if vstage > 0:
                out = (unit * 2 + 1, *neighbour(vstage - 1))
        append((dep, slot, out, (final_b.get(i), launch_after.get(i, ()), gates.get(i)) if i in special else None,
                op, None))
    if pairs:
        plan = _merge_pairs(plan, counts, pairs, num_chunks) if overlapped else _sequential_pairs(plan, pairs)
    if isinstance(ops, tuple) and len(ops) <= _PLAN_CACHE_OPS:  # a list may change after the call
        with _PLAN_CACHE_LOCK:  # simulate() may run in several threads
            kept = sum(len(entry[0]) for entry in _PLAN_CACHE.values())
            while _PLAN_CACHE and kept + len(ops) > _PLAN_CACHE_OPS:  # drop the oldest
                kept -= len(_PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))[0])
            _PLAN_CACHE[key] = (ops, plan, counts)
    return plan, counts


def _merge_pairs(plan: list[tuple], counts: dict, pairs: tuple[int, ...], num_chunks: int) -> list[tuple]:
    """The op plan with each combined pair (forward at i, backward at i + 1) as one entry (_op_plan)."""
    pairs = set(pairs)
    merged = []
    i = 0
    while i < len(plan):
        entry = plan[i]
        if i not in pairs:
            merged.append(entry)
            i += 1
            continue
        f, b = entry, plan[i + 1]
        f_op, b_op = _pair_ops(f, b, i)
        for key in (("F", f_op.chunk), (b_op.kind, b_op.chunk)):
            counts[key] -= 1
            if not counts[key]:
                del counts[key]
        pair = ("FB", f_op.chunk, b_op.chunk)
        counts[pair] = counts.get(pair, 0) + 1
        special = None
        if f[3] is not None or b[3] is not None:
            grads_of, launched, _ = b[3] or (None, (), None)
            special = (grads_of, launched, f[3][2] if f[3] is not None else None)
        merged.append((f[0], _pair_slot(f_op.chunk, b_op.chunk, num_chunks), f[2], special, (f_op, b_op),
                       (b[0], b[2], b_op)))
        i += 2
    return merged


def _pair_ops(f: tuple, b: tuple, i: int) -> tuple:
    """The two ops of the pair at op `i` (op-plan entries `f`, `b`): a forward, then a backward."""
    f_op, b_op = f[4], b[4]
    if f_op.kind != "F" or b_op.kind not in ("B", "X"):
        raise ValueError(f"pair at op {i}: {f_op} and {b_op} are not a forward then a backward")
    return f_op, b_op


def _sequential_pairs(plan: list[tuple], pairs: tuple[int, ...]) -> list[tuple]:
    """The op plan with each pair (forward at i, backward at i + 1) run one op after the other: the
    forward sends nothing, and the backward, once its own input is there, sends the forward's
    output and its own when it ends (its last field (None, its output, itself): an entry of the
    engine's pair form with no second input to wait for)."""
    out = list(plan)
    for i in pairs:
        f, b = out[i], out[i + 1]
        f_op, b_op = _pair_ops(f, b, i)
        out[i] = (f[0], f[1], None, f[3], f_op, None)
        out[i + 1] = (b[0], b[1], f[2], b[3], b_op, (None, b[2], b_op))
    return out


def clear_caches() -> None:
    """Forget the kept op plans (for benchmarks that time a plan never simulated before)."""
    with _PLAN_CACHE_LOCK:
        _PLAN_CACHE.clear()


def run_iteration(
    works: list[StageWork],
    *,
    num_chunks: int,
    p2p_time: float | Sequence[float],
    overlap_grad_reduce: bool,
    sync_time: float,
    p2p_nic: float | Sequence[float] = 0.0,
    align_grad_reduce: bool = False,
    record_spans: bool = True,
    blocking_sends: str = "none",
    v_shaped: bool = False,
) -> EngineResult:
    """Simulate one iteration; returns per-stage breakdowns summing to each stage's end time.
    `p2p_time`: seconds of a pipeline send, one for every link or per link (entry s joins stage s
    and stage (s + 1) % pp, placement.pp_hop_layouts). `p2p_nic`: seconds of each send on the NICs,
    likewise (0 where the two stages share a node).
    `overlap_grad_reduce`: a chunk's gradient buckets are reduced as its last backward produces
    them; else every bucket waits for the end of the stage's backward.
    `align_grad_reduce` (with overlap): Megatron-Core's default launch points instead
    (--align-grad-reduce, pipeline_parallel/schedules.py): under 1F1B only the first stage reduces
    during its last backward, the others once their backward is over, in the pipeline's closing
    bubble; under interleaved 1F1B stage s launches a chunk's whole reduction when it finishes the
    backward s steps after the chunk's last one (all stages launch together), or after its last
    backward when fewer remain. Under a split backward (zero-bubble) the W passes, which produce
    the weight gradients, are the ones counted.
    `blocking_sends` (PlanSpec.blocking_sends): which sends the sending stage waits for before its
    next op: none, forward (each forward activation's) or all.
    `v_shaped`: the two chunks of each stage sit in a V (schedules.virtual_stage), so sends run
    up the ranks in chunk 0 and down them in chunk 1, and the last rank hands each microbatch from
    one chunk to the other in place.
    A stage's `pairs` (combined 1F1B, Megatron-Core --overlap-moe-expert-parallel-comm; DualPipeV)
    merge forwards with the backwards after them (StageWork.pairs).
    `record_spans` False leaves the timeline out (EngineResult.spans empty): the planner needs only
    the figures. Recorded, the spans of ops and receives are bare records until the timeline is
    read; built as they ran, they had cost a fifth to a third of the engine's time."""
    env = simpy.Environment()
    pp = len(works)
    link_time = list(p2p_time) if isinstance(p2p_time, Sequence) else [p2p_time] * pp
    link_nic = list(p2p_nic) if isinstance(p2p_nic, Sequence) else [p2p_nic] * pp
    last_vstage = pp * num_chunks - 1
    waiting: dict[int, simpy.Event] = {}
    spans: list = []  # Span objects, and the bare records Timeline names when read
    traces = [StageTrace() for _ in range(pp)]
    grad_ready = [{c: env.event() for c in w.grad_buckets} for w in works]
    # per chunk with an overlapped weight gather: an event carrying its buckets' arrival times
    gathered = [{c: env.event() for c in w.param_gather_buckets} for w in works]
    gated_chunk: list[int | None] = [None] * pp  # the chunk whose gated first forward is running
    # NIC state per stage: until when the current gradient bucket holds the NIC, the current op's
    # (start, end, NIC seconds, duration), and delays one stream owes the other from sharing.
    bucket_nic_until = [0.0] * pp
    op_nic = [(0.0, 0.0, 0.0, 0.0)] * pp
    owed_compute = [0.0] * pp
    owed_grad = [0.0] * pp
    # until when a pipeline send (out) or receive (in) holds each stage's NIC; the share a send
    # took from the receiver's running op, paid when that op's successor starts
    link_nic_until = [0.0] * pp
    sent_until = [0.0] * pp  # until when each stage's last pipeline send holds its outgoing link
    owed_next = [0.0] * pp
    # SM sharing: until when the current bucket runs and the current op is expected to end, and
    # the slowdown a bucket that started mid-op owes that op
    bucket_until = [0.0] * pp
    op_until = [0.0] * pp
    op_from = [0.0] * pp  # when the current op starts (after the waits folded into its timeout)
    owed_sm = [0.0] * pp

    # When each cross-stage output arrives at its consumer; a SimPy event (in `waiting`) only for
    # an input a stage waits on before it is sent (most inputs are there when asked for, and skip
    # the event queue).
    arrives_at: dict[int, float] = {}  # by output key

    def held(until: float, t: float, window: float) -> float:
        """Seconds of [t, t + window] before `until`: how long a flow that holds the NIC or the
        SMs until then (a gradient bucket, a pipeline send, a running op) overlaps that window."""
        busy = until - t
        return 0.0 if busy <= 0 else busy if busy < window else window

    def occupy_sms(stage: int, t: float, seconds: float) -> None:
        """A data-parallel bucket (gradients or weights) holds its SM share over [t, t + seconds]:
        the op running then owes COMM_SM_SHARE of the overlap (paid when it ends; not the part
        before it starts, while its stage waits for its input), and ops starting before
        t + seconds see the bucket through bucket_until."""
        begin = op_from[stage] if op_from[stage] > t else t
        window = seconds - (begin - t)  # the bucket's time from the op's start on
        slowdown = COMM_SM_SHARE * held(op_until[stage], begin, window) if window > 0 else 0.0
        owed_sm[stage] += slowdown
        op_until[stage] += slowdown
        bucket_until[stage] = t + seconds

    def op_nic_left(stage: int, t: float, window: float = float("inf")) -> float:
        """NIC seconds the stage's current op (running, or about to start once its input has
        arrived) moves between t and t + window, its traffic spread evenly over the op."""
        op_start, op_end, op_nic_s, op_dur = op_nic[stage]
        overlap = min(t + window, op_end) - max(t, op_start)
        return op_nic_s * overlap / op_dur if overlap > 0 and op_dur else 0.0

    def send(stage: int, to: int, t: float, seconds: float, nic: float) -> float:
        """A pipeline send leaving `stage` at t for `to` over a link of `seconds`, `nic` of them on
        the NICs (a link between nodes): its arrival, after sharing the sender's NIC with its
        gradient bucket and the receiver's with its current op and bucket."""
        busy = bucket_nic_until[stage] - t  # held(), inlined: this runs for every send
        sender = 0.0 if busy <= 0 else busy if busy < nic else nic
        busy = bucket_nic_until[to] - t
        with_bucket = 0.0 if busy <= 0 else busy if busy < nic else nic
        op_start, op_end, op_nic_s, op_dur = op_nic[to]  # op_nic_left(to, t, nic), inlined
        with_op = 0.0
        if op_nic_s:
            overlap = (t + nic if t + nic < op_end else op_end) - (t if t > op_start else op_start)
            if overlap > 0 and op_dur:
                with_op = op_nic_s * overlap / op_dur
        if sender:  # the bucket holds the NIC that much longer (it pays when its transfer ends)
            owed_grad[stage] += sender
            bucket_nic_until[stage] += sender
        if with_op:
            owed_next[to] += with_op
        if with_bucket:
            owed_grad[to] += with_bucket
            bucket_nic_until[to] += with_bucket
        delay = sender if sender > with_op + with_bucket else with_op + with_bucket
        until = t + nic + delay
        if until > link_nic_until[stage]:
            link_nic_until[stage] = until
        if until > link_nic_until[to]:
            link_nic_until[to] = until
        return t + seconds + delay

    def transfer(stage: int, out: tuple, end: float) -> float:
        """When an op's output (key, receiving stage, link; link None: the next virtual stage is on
        this rank, nothing is sent), ready at `end`, arrives. A stage's sends leave one after
        another: NCCL runs the point-to-point operations of one communicator in issue order on its
        stream, so a send issued while an earlier one is still on the link starts when it ends."""
        _, to, hop = out
        if hop is None:
            return end
        leave = end if end > sent_until[stage] else sent_until[stage]
        hop_nic = link_nic[hop]
        arrival = send(stage, to, leave, link_time[hop], hop_nic) if hop_nic else leave + link_time[hop]
        sent_until[stage] = arrival
        return arrival

    def land(key: int, arrival: float) -> None:
        """An output's arrival, which wakes a consumer already waiting for it."""
        arrives_at[key] = arrival
        ev = waiting.pop(key, None)
        if ev is not None:
            ev.succeed(arrival)

    def deliver(stage: int, out: tuple, end: float) -> float:
        """Send an op's output at `end` (transfer); its arrival."""
        arrival = transfer(stage, out, end)
        land(out[0], arrival)
        return arrival

    blocking = {"none": (), "forward": ("F",), "all": ("F", "B", "X")}[blocking_sends]
    grad_kinds = [gradient_kinds(w.ops) for w in works]

    def last_grad_ops(ops: Sequence[Op], kinds: tuple[str, ...]) -> dict[int, int]:
        """Per chunk, the index of the op of `kinds` (those that produce weight gradients: W and a
        whole backward X when the backward is split, else B) that produces its last weight
        gradients (found from the end)."""
        last: dict[int, int] = {}
        for i in range(len(ops) - 1, -1, -1):
            op = ops[i]
            if op[0] in kinds and op[2] not in last:
                last[op[2]] = i
                if len(last) == num_chunks:
                    break
        return last

    last_b = [{c: i for c, i in last_grad_ops(w.ops, k).items() if c in w.grad_buckets}
              for w, k in zip(works, grad_kinds)]

    def launch_points(stage: int) -> tuple[dict[int, int], dict[int, list[int]], list[int]]:
        """Where each chunk's gradient reduction starts: (op index -> chunk whose buckets fill
        during that op, op index -> chunks launched whole when that op ends, chunks launched
        after the stage's last op)."""
        chunks = last_b[stage]
        if not (overlap_grad_reduce and align_grad_reduce):
            return {i: c for c, i in chunks.items()}, {}, []
        if num_chunks == 1:
            return ({i: c for c, i in chunks.items()}, {}, []) if stage == 0 else ({}, {}, sorted(chunks))
        # the passes that produce weight gradients: W (and whole backwards) when the backward is split, else B
        kinds = grad_kinds[stage]
        backwards = [i for i, o in enumerate(works[stage].ops) if o.kind in kinds]
        at_end: dict[int, list[int]] = {}
        after: list[int] = []
        for c, i in sorted(chunks.items(), key=lambda kv: kv[1]):
            k = backwards.index(i) + stage
            if k < len(backwards):
                at_end.setdefault(backwards[k], []).append(c)
            else:
                after.append(c)
        return {}, at_end, after

    launches = [launch_points(s) for s in range(pp)]

    def first_forwards(stage: int) -> dict[int, int]:
        """Op index -> chunk, for the first forward of each chunk whose weights are gathered
        during the iteration."""
        out: dict[int, int] = {}
        wanted = set(gathered[stage])
        for i, op in enumerate(works[stage].ops):
            if not wanted:
                break
            if op.kind == "F" and op.chunk in wanted:
                out[i] = op.chunk
                wanted.discard(op.chunk)
        return out

    gate_ops = [first_forwards(s) for s in range(pp)]

    def op_costs(work: StageWork) -> tuple[list, list]:
        """Indexed by (kind, chunk) slot (_op_slot): the op's duration, seconds on the NIC, span
        category and ZeRO transfers; and the share of its NIC traffic of each kind ((component,
        fraction), ...), under which the delays it suffers from sharing the NIC are booked. The NIC
        is held at most for the whole op (traffic of several kinds inside one op, e.g. a ZeRO-3
        gather and a cross-node CP exchange, can add up to more than its duration)."""
        table = [None] * (len(KINDS) * num_chunks + (num_chunks * num_chunks if work.pairs else 0))
        shares = [()] * len(table)
        slots = [(_op_slot(kind, chunk), SPAN_CATEGORY[kind], cost) for (kind, chunk), cost in work.op_cost.items()
                 if kind in _KIND_INDEX and 0 <= chunk < num_chunks]
        if work.pairs:
            slots += [(_pair_slot(fc, bc, num_chunks), PAIR_CATEGORY, cost) for (fc, bc), cost in work.pair_cost.items()]
        for slot, category, cost in slots:
            nic = cost.nic
            table[slot] = (cost.total, min(nic, cost.total), category, cost.dp_spans, cost.parts)
            if nic:
                shares[slot] = tuple((k, v / nic) for k, v in cost.nic_parts.items() if v)
        return table, shares

    def cost_of(work: StageWork, key: tuple):
        """The cost of an op plan's count key: (kind, chunk), or ('FB', forward's chunk, backward's chunk)."""
        return work.pair_cost.get(key[1:]) if key[0] == "FB" else work.op_cost.get(key)

    def compute_stream(stage: int):
        work = works[stage]
        bd = traces[stage].breakdown
        timeout = env.timeout
        bubble = comm = slowed = 0.0
        ready_events = grad_ready[stage]
        gathered_events = gathered[stage]
        final_b, launch_after, _ = launches[stage]
        ops, counts = _op_plan(work.ops, stage, pp, num_chunks, final_b, launch_after, gate_ops[stage], v_shaped,
                               work.pairs, work.pairs_overlapped)
        costs, nic_shares = op_costs(work)
        contended = [0.0] * len(costs)  # per slot, the delays its ops' traffic took from sharing the NIC
        prev_slot = None
        missing = sorted(key for key in counts if cost_of(work, key) is None)
        if missing:
            raise KeyError(f"stage {stage}: no op cost for (kind, chunk) {missing}")
        sm_share = COMM_SM_SHARE
        gate = launched_after = None
        for dep, slot, produces, special, op, pair in ops:
            duration, nic, category, dp_spans, parts = costs[slot]
            start = env.now
            recv = 0.0  # waiting for the input to arrive, folded into the op's timeout (one event)
            if pair is None:
                if dep is not None:
                    arrival = arrives_at.get(dep)
                    if arrival is None:  # not sent yet: wait (its producer triggers the event)
                        t0 = start
                        waiting[dep] = ev = env.event()  # each output has one consumer
                        arrival = yield ev
                        start = env.now
                        bubble += start - t0
                    if arrival > start:
                        recv = arrival - start
                        comm += recv
                        if record_spans:  # named when the timeline is read (Timeline)
                            spans.append((stage, dep, start, arrival))
                        start += recv
            else:  # a combined pair: both inputs; waiting for a producer is bubble, then for a transfer comm
                t0 = start
                arrivals = []
                for d in (dep, pair[0]):
                    if d is not None:
                        arrival = arrives_at.get(d)
                        if arrival is None:
                            waiting[d] = ev = env.event()
                            arrival = yield ev
                        arrivals.append((d, arrival))
                start = env.now
                bubble += start - t0
                ready = max((a for _, a in arrivals), default=start)
                if ready > start:
                    recv = ready - start
                    comm += recv
                    if record_spans:
                        spans.extend((stage, d, start, a) for d, a in arrivals if a > start)
                    start += recv
            if special is not None:
                grads_of, launched_after, gate = special
                if grads_of is not None:  # this chunk's gradients start flowing now
                    ready_events[grads_of].succeed((start, start + duration))
                if gate is not None:
                    gated_chunk[stage] = gate  # reset to None once the gated op ends
            # a send that landed while the previous op ran: its share, paid now (one event fewer)
            paid = shared = owed_next[stage]
            if shared:
                owed_next[stage] = 0.0
                contended[prev_slot] += shared  # the previous op's traffic met the send
            if nic:  # the op's traffic (spread evenly) that falls while a bucket or a send holds the NIC
                # (a gated forward's traffic waits for its weights: the gather charges that overlap)
                busy = bucket_nic_until[stage] - start
                with_bucket = 0.0
                if busy > 0 and (gate is None or gathered_events[gate].triggered):
                    with_bucket = nic * (busy if busy < duration else duration) / duration
                    owed_grad[stage] += with_bucket
                    bucket_nic_until[stage] += with_bucket
                busy = link_nic_until[stage] - start
                if busy > 0:
                    shared += with_bucket + nic * (busy if busy < duration else duration) / duration
                elif with_bucket:
                    shared += with_bucket
                op_nic[stage] = (start, start + duration + shared, nic, duration)
            busy = bucket_until[stage] - start  # the SMs a gradient bucket holds (held())
            sm = sm_share * (busy if busy < duration else duration) if busy > 0 else 0.0
            op_until[stage] = start + duration + shared + sm
            op_from[stage] = start
            yield timeout(recv + duration + shared + sm)
            while owed_compute[stage] > 0 or owed_sm[stage] > 0:  # a bucket started during this op
                extra, owed_compute[stage] = owed_compute[stage], 0.0
                extra_sm, owed_sm[stage] = owed_sm[stage], 0.0
                shared += extra
                sm += extra_sm
                if extra:  # the traffic it gave up still crosses the NIC: a later bucket meets it
                    s0, e0, n0, d0 = op_nic[stage]
                    op_nic[stage] = (s0, e0 + extra, n0, d0)
                yield timeout(extra + extra_sm)
            if gate is not None:  # the first forward of a chunk computes on weights still being gathered
                t_wait = env.now
                ev = gathered_events[gate]
                arrivals = ev.value if ev.processed else (yield ev)
                ready = max(t + (1.0 - needed_from) * duration for t, needed_from in arrivals)
                if ready > env.now:
                    yield timeout(ready - env.now)
                slowed += env.now - t_wait
                gated_chunk[stage] = None
            if shared:
                contended[slot] += shared - paid
            prev_slot = slot
            slowed += sm
            end = env.now
            if record_spans:
                spans.append((stage, op, category, start, end, parts))  # named when the timeline is read
                for a, b, what in dp_spans:  # transfers inside the op (ZeRO-2/3), placed on its span
                    name = _op_name(op, num_chunks)
                    spans.append(Span(stage, "dp-comm", f"{what} {name}", "dp_comm",
                                      start + a * (end - start), start + b * (end - start)))
            if pair is None:
                if produces is not None:
                    arrival = deliver(stage, produces, end)
                if special is not None:
                    for c in launched_after:  # whole chunks whose reduction is launched now
                        ready_events[c].succeed((end, end))
                    gate = launched_after = None
                if produces is not None and arrival > end and op[0] in blocking:  # it waits for its send
                    yield timeout(arrival - end)
                    comm += arrival - end
                    if record_spans:
                        spans.append((stage, ~produces[0], end, arrival))  # named when the timeline is read
                continue
            # a combined pair: the forward's output and the backward's, sent in one batch
            # (torch.distributed.batch_isend_irecv: PyTorch's schedules.py _add_send_recv,
            # Megatron-Core's p2p_communication), so they share the link and both land when the
            # second is through
            outs = [(out, kind) for out, kind in ((produces, "F"), (pair[1], "B")) if out is not None]
            arrivals = [transfer(stage, out, end) for out, _ in outs]
            together = max((a for (out, _), a in zip(outs, arrivals) if out[2] is not None), default=end)
            waits = []  # the sends this stage waits for before its next op: (arrival, key)
            for (out, kind), arrival in zip(outs, arrivals):  # an X waits for its send as a B does
                if out[2] is not None:
                    arrival = together
                land(out[0], arrival)
                if arrival > end and kind in blocking:
                    waits.append((arrival, out[0]))
            if special is not None:
                for c in launched_after:
                    ready_events[c].succeed((end, end))
                gate = launched_after = None
            if waits:
                arrival = max(a for a, _ in waits)
                yield timeout(arrival - end)
                comm += arrival - end
                if record_spans:
                    spans.extend((stage, ~key, end, a) for a, key in waits)
        traces[stage].ops_done = len(work.ops)
        if owed_next[stage]:  # a send landed during the last op
            contended[prev_slot] += owed_next[stage]
            yield timeout(owed_next[stage])
        for c in launches[stage][2]:
            ready_events[c].succeed((env.now, env.now))
        # the op costs are fixed per (kind, chunk): book their components by count
        for key, n in counts.items():
            for k, v in cost_of(work, key).parts.items():
                if v:
                    _add(bd, k, n * v)
        for slot, v in enumerate(contended):
            for k, share in nic_shares[slot] if v else ():
                _add(bd, k, v * share)
        for k, v in (("pp_bubble", bubble), ("pp_comm", comm), ("dp_comm", slowed)):
            if v:
                _add(bd, k, v)
        traces[stage].compute_end = env.now

    def bucket_collective(stage: int, seconds: float, nic: float, op_cap: float = float("inf")):
        """One data-parallel bucket collective from now: it shares the NIC with the running op
        (the op's traffic while the bucket is on the NIC, at most `op_cap` NIC seconds) and any
        pipeline send, and holds its SM share (occupy_sms)."""
        t0 = env.now
        if nic:
            clash = min(nic, op_cap, op_nic_left(stage, t0, nic))
            owed_compute[stage] += clash
            seconds += clash + held(link_nic_until[stage], t0, nic)
            bucket_nic_until[stage] = t0 + seconds
        occupy_sms(stage, t0, seconds)
        yield env.timeout(seconds)
        while owed_grad[stage] > 0:  # an op that started during this bucket took NIC time
            extra, owed_grad[stage] = owed_grad[stage], 0.0
            bucket_nic_until[stage] = env.now + extra
            occupy_sms(stage, env.now, extra)
            yield env.timeout(extra)

    def grad_stream(stage: int):
        work = works[stage]
        during, at_end, after = launches[stage]
        launch_order = {c: (i, 0) for i, c in during.items()}
        launch_order.update({c: (i, 1) for i, cs in at_end.items() for c in cs})
        launch_order.update({c: (len(work.ops), n) for n, c in enumerate(after)})
        order = sorted(work.grad_buckets, key=lambda c: launch_order[c])
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
                yield from bucket_collective(stage, seconds, nic)
                if record_spans:
                    spans.append(Span(stage, "dp-comm", f"grad-reduce c{c} b{j}", "dp_comm", t0, env.now))
        traces[stage].comm_end = env.now

    def gather_stream(stage: int):
        """The overlapped weight all-gather, chunk by chunk in the order of their first forwards."""
        work = works[stage]
        for c in gate_ops[stage].values():
            buckets = work.param_gather_buckets[c]
            # how far the gated forward can run while bucket j is in flight: up to the first
            # point a bucket not yet here is needed
            limit = list(accumulate((b[2] for b in reversed(buckets)), min))[::-1]
            arrivals = []
            for j, (seconds, nic, needed_from) in enumerate(buckets):
                t0 = env.now
                cap = float("inf")
                if gated_chunk[stage] == c:  # it moves only what the newly possible compute moves
                    cap = op_nic[stage][2] * max(0.0, limit[j] - (limit[j - 1] if j else 0.0))
                yield from bucket_collective(stage, seconds, nic, cap)
                if record_spans:
                    spans.append(Span(stage, "dp-comm", f"param all-gather c{c} b{j}", "dp_comm", t0, env.now))
                arrivals.append((env.now, needed_from))
            gathered[stage][c].succeed(arrivals)

    for s in range(pp):
        env.process(compute_stream(s))
        env.process(grad_stream(s))
        if gathered[s]:
            env.process(gather_stream(s))
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
        if record_spans:
            spans.append(Span(s, "compute", "optimizer", "optimizer", barrier, opt_end))
        _add(bd, "optimizer", work.optimizer_time)
        t.end = opt_end + work.param_gather_time
        if work.param_gather_time:
            if record_spans:
                spans.append(Span(s, "dp-comm", "param all-gather", "dp_comm", opt_end, t.end))
            _add(bd, "dp_comm", work.param_gather_time)
        step = max(step, t.end)
    return EngineResult(step_time=step, stages=traces, spans=Timeline(spans, num_chunks, last_vstage + 1),
                        sync_time=sync_time)
