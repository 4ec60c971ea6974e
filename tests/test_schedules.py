"""Pipeline schedules (pure op orders) and the engine's exact timelines on hand-made costs."""
import random

import pytest

from simulator.cost import Cost
from simulator.engine import StageWork, run_iteration
from simulator.schedules import (
    Op, build_schedule, holder, interleaved_1f1b, one_f_one_b, peak_in_flight, virtual_stage, zbv, zero_bubble,
)


def names(ops):
    return " ".join(f"{o.kind}{o.microbatch}" + (f".{o.chunk}" if o.chunk else "") for o in ops)


def test_1f1b_phases_match_pipedream_flush():
    assert names(one_f_one_b(4, 6, 0)) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5"
    assert names(one_f_one_b(4, 6, 3)) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"


def test_1f1b_with_fewer_microbatches_than_stages_caps_the_warm_up():
    # Megatron: num_warmup = min(pp - rank - 1, M); the pipeline is then GPipe-like, and stage s
    # holds min(pp - s, M) microbatches
    assert names(one_f_one_b(4, 2, 0)) == "F0 F1 B0 B1"
    assert names(one_f_one_b(4, 2, 2)) == "F0 F1 B0 B1"
    assert names(one_f_one_b(4, 2, 3)) == "F0 B0 F1 B1"
    assert [peak_in_flight(one_f_one_b(4, 2, s)) for s in range(4)] == [2, 2, 2, 1]
    works = uniform_works(build_schedule("1f1b", 4, 2))
    res = run_iteration(works, num_chunks=1, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0)
    # F of 2 microbatches through 4 stages, then their B back: (pp + M - 1) x (f + b) = 5 x 3
    assert res.step_time == pytest.approx(15.0)


def test_interleaved_matches_megatron_order():
    # p=2, M=4, v=2: stage 0 warms up with 2(p-1) + (v-1)p = 4 forwards
    assert names(interleaved_1f1b(2, 4, 0, 2)) == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    assert names(interleaved_1f1b(2, 4, 1, 2)) == "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3"

    # M == p: the same warm-up, capped at every forward (current Megatron-Core and PyTorch; earlier
    # Megatron-LM ran all forwards first), so the last stage holds fewer microbatches than the first
    assert names(interleaved_1f1b(2, 2, 0, 2)) == "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1"
    assert names(interleaved_1f1b(2, 2, 1, 2)) == "F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1"
    assert [peak_in_flight(interleaved_1f1b(2, 2, s, 2)) for s in range(2)] == [4, 3]


def test_interleaved_order_needs_whole_groups_of_pp_microbatches():
    with pytest.raises(ValueError, match=r"microbatches \(3\) to be a multiple of pp \(2\)"):
        interleaved_1f1b(2, 3, 0, 2)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                                    ("zero-bubble", 1), ("zero-bubble", 2), ("zbv", 2)])
def test_every_op_once(name, v):
    p, m = 3, 6
    kinds = "FBW" if name in ("zero-bubble", "zbv") else "FB"
    for ops in build_schedule(name, p, m, v):
        assert sorted(ops) == sorted(Op(k, mb, c) for k in kinds for mb in range(m) for c in range(v))


def test_zero_bubble_holds_back_s_weight_passes_on_stage_s():
    # 1F1B's F/B order; stage s runs each W right after a B once s of them are pending
    assert names(zero_bubble(4, 6, 0)) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5"
    assert names(zero_bubble(4, 6, 2)) == "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5"
    assert names(zero_bubble(4, 6, 3)) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"
    # a W never precedes its B
    for s, ops in enumerate(build_schedule("zero-bubble", 4, 8, 2)):
        seen = set()
        for op in ops:
            assert op.kind != "W" or ("B", op.microbatch, op.chunk) in seen
            seen.add((op.kind, op.microbatch, op.chunk))


@pytest.mark.parametrize("p,m,v", [(2, 2, 1), (3, 5, 1), (4, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2), (4, 12, 3), (8, 16, 2)])
def test_zero_bubble_never_deadlocks_and_ends_after_every_op(p, m, v):
    works = split_works(build_schedule("zero-bubble", p, m, v))
    res = run_iteration(works, num_chunks=v, p2p_time=0.1, overlap_grad_reduce=True, sync_time=0.0)
    assert all(t.ops_done == 3 * m * v for t in res.stages)


def test_zbv_order_and_v_placement():
    # rank r: 2(p - r) - 1 chunk-0 forwards, r pairs (F chunk 1, F chunk 0), p - r rounds of a
    # chunk-1 F, B, W; the steady state alternates the chunks (Qi et al. 2024, Sec. 6)
    assert names(zbv(2, 3, 0)) == "F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 B0 W0 F2.1 B2.1 W2.1 B1 W1 B2 W2"
    assert names(zbv(2, 3, 1)) == "F0 F0.1 F1 F1.1 B0.1 W0.1 F2 B0 W0 F2.1 B1.1 W1.1 B1 B2.1 B2 W1 W2.1 W2"
    # the V: rank r holds virtual stages r and 2p - 1 - r; holder inverts it
    assert [virtual_stage(r, c, 4, True) for r in range(4) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
    assert all(holder(virtual_stage(r, c, 4, v), 4, v) == (r, c) for r in range(4) for c in (0, 1)
               for v in (True, False))
    # fewer microbatches than the 2p - 1 the order is built for: the extra ones' ops are dropped
    for ops in build_schedule("zbv", 4, 5, 2):
        assert sorted(ops) == sorted(Op(k, mb, c) for k in "FBW" for mb in range(5) for c in (0, 1))


def _zbv_run(p, m, f=1.0, b=1.0, w=1.0, p2p=0.0):
    return run_iteration(split_works(build_schedule("zbv", p, m, 2), f, b, w), num_chunks=2, p2p_time=p2p,
                         overlap_grad_reduce=True, sync_time=0.0, v_shaped=True)


def test_exact_zbv_timeline_two_stages():
    # F = B = W = 1 s per chunk, no p2p. Rank 1 runs chunk 0 (virtual stage 1) and, in place, chunk
    # 1 (virtual stage 2) of microbatch 0 back to back; rank 0's chunk 1 (virtual stage 3, the LM
    # head's) follows at 3 s. Rank 1 waits at the start for its first input only.
    res = _zbv_run(2, 2)
    assert compute_log(res, 0) == [(0.0, "F0.0"), (1.0, "F1.0"), (3.0, "F0.1"), (4.0, "B0.1"), (5.0, "W0.1"),
                                   (6.0, "F1.1"), (7.0, "B1.1"), (8.0, "W1.1"), (9.0, "B0.0"), (10.0, "W0.0"),
                                   (12.0, "B1.0"), (13.0, "W1.0"), (14.0, "optimizer")]
    assert compute_log(res, 1) == [(1.0, "F0.0"), (2.0, "F0.1"), (3.0, "F1.0"), (4.0, "F1.1"), (5.0, "B0.1"),
                                   (6.0, "W0.1"), (7.0, "B0.0"), (8.0, "W0.0"), (9.0, "B1.1"), (10.0, "W1.1"),
                                   (11.0, "B1.0"), (12.0, "W1.0"), (14.0, "optimizer")]


def test_the_turn_of_the_v_sends_nothing():
    # with a 0.5 s link, the last rank's chunk-0 -> chunk-1 hand-off stays free: its F0.1 starts the
    # moment its F0.0 ends (a looped placement would send it to rank 0)
    res = _zbv_run(2, 2, p2p=0.5)
    log = dict((name, t) for t, name in compute_log(res, 1))
    assert log["F0.1"] == pytest.approx(log["F0.0"] + 1.0)


@pytest.mark.parametrize("p,m", [(2, 3), (2, 4), (3, 5), (4, 7), (4, 8), (8, 16)])
def test_zbv_with_equal_passes_idles_only_while_the_first_input_travels(p, m):
    # every rank does 2m chunks of F + B + W; the last rank cannot start before p - 1 chunk-0
    # forwards reach it, so m x 6 + (p - 1) is the least a step can take, and with m >= 2p - 1
    # ZB-V takes exactly that: half of ZB-H1's (p - 1)(F + B - W) on the same per-stage work
    assert _zbv_run(p, m).step_time == pytest.approx(6 * m + (p - 1))
    zb_h1 = run_iteration(split_works(build_schedule("zero-bubble", p, m), 2.0, 2.0, 2.0), num_chunks=1,
                          p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0)
    assert zb_h1.step_time - 6 * m == pytest.approx(2 * (_zbv_run(p, m).step_time - 6 * m))


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 3), (4, 4), (4, 9), (8, 8)])
def test_zbv_never_deadlocks_and_ends_after_every_op(p, m):
    res = _zbv_run(p, m, f=1.0, b=2.0, w=0.5, p2p=0.3)
    assert all(t.ops_done == 6 * m for t in res.stages)


def test_in_flight_activations_read_off_the_schedule():
    assert [peak_in_flight(one_f_one_b(4, 8, s)) for s in range(4)] == [4, 3, 2, 1]
    assert peak_in_flight(build_schedule("gpipe", 4, 8)[0]) == 8
    # zero-bubble holds a microbatch until its W (an upper bound): stage s keeps p - s in flight
    # plus its s held-back W passes, so stage 0, the one 1F1B already fills most, is unchanged
    assert [peak_in_flight(zero_bubble(4, 8, s)) for s in range(4)] == [4, 4, 4, 4]


def uniform_works(ops_per_stage, f=1.0, b=2.0, buckets=None, opt=0.0):
    return [
        StageWork(ops=ops, op_cost={("F", 0): Cost().add("compute", f), ("B", 0): Cost().add("compute", b),
                                    ("F", 1): Cost().add("compute", f), ("B", 1): Cost().add("compute", b)},
                  grad_buckets=buckets or {}, optimizer_time=opt, param_gather_time=0.0)
        for ops in ops_per_stage
    ]


def split_works(ops_per_stage, f=1.0, b=1.0, w=1.0):
    costs = {(k, c): Cost().add("compute", t) for k, t in (("F", f), ("B", b), ("W", w)) for c in range(3)}
    return [StageWork(ops=ops, op_cost=costs, grad_buckets={}, optimizer_time=0.0, param_gather_time=0.0)
            for ops in ops_per_stage]


def compute_log(res, stage):
    return [(sp.start, sp.name) for sp in res.spans if sp.stage == stage and sp.stream == "compute"]


def test_exact_1f1b_timeline_two_stages():
    # F = 1 s, B = 2 s, p2p = 0.5 s, 2 stages, 2 microbatches. Stage 1 gets F0 at 1 + 0.5; its
    # F1 arrives at 2.5 but waits for B0 to end at 4.5; B0 reaches stage 0 at 5.0, B1 at 8.0.
    works = uniform_works(build_schedule("1f1b", 2, 2))
    res = run_iteration(works, num_chunks=1, p2p_time=0.5, overlap_grad_reduce=True, sync_time=0.0)
    assert compute_log(res, 0) == [(0.0, "F0"), (1.0, "F1"), (5.0, "B0"), (8.0, "B1"), (10.0, "optimizer")]
    assert compute_log(res, 1) == [(1.5, "F0"), (2.5, "B0"), (4.5, "F1"), (5.5, "B1"), (10.0, "optimizer")]
    assert res.step_time == 10.0
    assert res.stages[1].breakdown["pp_comm"] == pytest.approx(0.5)


def test_a_blocking_send_holds_its_sender_until_it_arrives():
    # The timeline above with every send blocking (Megatron's non-interleaved 1F1B): stage 0 runs F1
    # once F0's send is over (1.5), stage 1 its F1 once B0's is over (5.0); B1's gradient reaches
    # stage 0 at 8.5 and the step ends at 10.5. With only forward sends blocking (Megatron-Core's
    # interleaved schedule) stage 0 still waits 0.5 s after each F, hidden here by the pipeline.
    works = uniform_works(build_schedule("1f1b", 2, 2))
    res = run_iteration(works, num_chunks=1, p2p_time=0.5, overlap_grad_reduce=True, sync_time=0.0,
                        blocking_sends="all")
    assert compute_log(res, 0) == [(0.0, "F0"), (1.5, "F1"), (5.0, "B0"), (8.5, "B1"), (10.5, "optimizer")]
    assert compute_log(res, 1) == [(1.5, "F0"), (2.5, "B0"), (5.0, "F1"), (6.0, "B1"), (10.5, "optimizer")]
    assert res.step_time == 10.5
    assert res.stages[1].breakdown["pp_comm"] == pytest.approx(1.5)  # F0's arrival, then B0's and B1's sends
    assert [(sp.name, sp.start, sp.end) for sp in res.spans if sp.stage == 1 and sp.name.startswith("send")] == \
        [("send B0", 4.5, 5.0), ("send B1", 8.0, 8.5)]
    fwd = run_iteration(works, num_chunks=1, p2p_time=0.5, overlap_grad_reduce=True, sync_time=0.0,
                        blocking_sends="forward")
    assert compute_log(fwd, 0)[:3] == [(0.0, "F0"), (1.5, "F1"), (5.0, "B0")] and fwd.step_time == 10.0


def test_plans_block_on_sends_as_megatron_core_runs_their_schedule():
    from paraplan.specs import PlanSpec

    assert PlanSpec(pp=2, schedule="1f1b").blocking_sends == "all"
    assert PlanSpec(pp=2, schedule="interleaved-1f1b", virtual_pipeline_stages=2).blocking_sends == "forward"
    assert PlanSpec(pp=2, schedule="zero-bubble").blocking_sends == "none"
    assert PlanSpec(pp=2, schedule="interleaved-1f1b", virtual_pipeline_stages=2,
                    wait_forward_sends=False).blocking_sends == "none"
    assert PlanSpec(pp=2, schedule="1f1b", wait_forward_sends=False).blocking_sends == "all"


def test_each_pipeline_link_takes_its_own_time():
    # 3 stages, one microbatch, F = 1 s, B = 2 s; links 0 -> 1 and 1 -> 2 take 0.25 s and 0.5 s,
    # the wrap-around 2 -> 0 (unused by 1F1B) 5 s. The microbatch crosses each link forward and
    # back: 3 x (1 + 2) + 2 x (0.25 + 0.5) = 10.5 s.
    works = uniform_works(build_schedule("1f1b", 3, 1))
    res = run_iteration(works, num_chunks=1, p2p_time=[0.25, 0.5, 5.0], overlap_grad_reduce=True, sync_time=0.0)
    assert compute_log(res, 1) == [(1.25, "F0"), (6.25, "B0"), (10.5, "optimizer")]
    assert res.step_time == pytest.approx(10.5)


def test_exact_gpipe_timeline_and_bubble():
    works = uniform_works(build_schedule("gpipe", 2, 2))
    res = run_iteration(works, num_chunks=1, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0)
    assert compute_log(res, 0) == [(0.0, "F0"), (1.0, "F1"), (5.0, "B0"), (7.0, "B1"), (9.0, "optimizer")]
    assert compute_log(res, 1) == [(1.0, "F0"), (2.0, "F1"), (3.0, "B0"), (5.0, "B1"), (9.0, "optimizer")]
    # textbook bubble (p-1)(F+B) = 3 s for each stage
    assert res.stages[0].breakdown["pp_bubble"] == pytest.approx(3.0)
    assert res.stages[1].breakdown["pp_bubble"] == pytest.approx(3.0)



def test_a_stages_sends_leave_one_after_another():
    # GPipe on 2 stages, F = 1 s, B = 2 s, sends of 2 s: stage 0's F1 is ready at 2 while F0's
    # send holds the link until 3, so it arrives at 5 (not 4); likewise B1's send leaves stage 1
    # when B0's lands at 10 and arrives at 12 (NCCL runs one communicator's sends in order).
    works = uniform_works(build_schedule("gpipe", 2, 2))
    res = run_iteration(works, num_chunks=1, p2p_time=2.0, overlap_grad_reduce=True, sync_time=0.0)
    assert compute_log(res, 1) == [(3.0, "F0"), (5.0, "F1"), (6.0, "B0"), (8.0, "B1"), (14.0, "optimizer")]
    assert compute_log(res, 0) == [(0.0, "F0"), (1.0, "F1"), (10.0, "B0"), (12.0, "B1"), (14.0, "optimizer")]

def test_breakdown_sums_to_stage_end():
    works = uniform_works(build_schedule("interleaved-1f1b", 2, 4, 2), buckets={0: [0.3, 0.3], 1: [0.3]}, opt=0.2)
    res = run_iteration(works, num_chunks=2, p2p_time=0.1, overlap_grad_reduce=True, sync_time=0.05)
    for t in res.stages:
        assert sum(t.breakdown.values()) == pytest.approx(t.end)


def test_overlapped_grad_reduce_hides_behind_backward():
    ops = build_schedule("1f1b", 1, 2)
    hidden = run_iteration(uniform_works(ops, buckets={0: [0.5, 0.5]}), num_chunks=1, p2p_time=0,
                           overlap_grad_reduce=True, sync_time=0)
    exposed = run_iteration(uniform_works(ops, buckets={0: [0.5, 0.5]}), num_chunks=1, p2p_time=0,
                            overlap_grad_reduce=False, sync_time=0)
    # F F B B = 6 s of compute; the first bucket is ready mid-way through the last backward
    assert hidden.step_time == pytest.approx(6.5)
    assert exposed.step_time == pytest.approx(7.0)


def _gathered_works(buckets, f_nic=0.0, bucket_nic=False):
    ops = build_schedule("1f1b", 1, 1)[0]
    forward = Cost().add("compute", 1.0).add_nic("ep_comm", f_nic)
    return [StageWork(ops=ops, op_cost={("F", 0): forward, ("B", 0): Cost().add("compute", 2.0)},
                      grad_buckets={}, optimizer_time=0.0, param_gather_time=0.0,
                      param_gather_buckets={0: [(t, t if bucket_nic else 0.0, j / len(buckets))
                                                for j, t in enumerate(buckets)]})]


def test_an_overlapped_weight_gather_gates_only_the_first_forward():
    # F = 1 s on 4 buckets of 0.5 s each, arriving at 0.5, 1.0, 1.5, 2.0: the forward's last
    # quarter needs the last bucket, so F ends at 2.0 + 0.25; B then runs 2.25 -> 4.25 untouched.
    res = run_iteration(_gathered_works([0.5] * 4), num_chunks=1, p2p_time=0, overlap_grad_reduce=True,
                        sync_time=0)
    assert compute_log(res, 0) == [(0.0, "F0"), (2.25, "B0"), (4.25, "optimizer")]
    assert res.step_time == pytest.approx(4.25)
    assert res.stages[0].breakdown["dp_comm"] == pytest.approx(1.25)
    gathers = [sp for sp in res.spans if sp.name.startswith("param all-gather")]
    assert [(sp.start, sp.end) for sp in gathers] == [(0.0, 0.5), (0.5, 1.0), (1.0, 1.5), (1.5, 2.0)]
    assert sum(res.stages[0].breakdown.values()) == pytest.approx(res.stages[0].end)


def test_a_short_overlapped_weight_gather_costs_its_sm_share_and_one_bucket():
    # 4 buckets of 0.1 s: the forward waits for none but the first, ready = 0.1 + 1.0; the
    # gather's SM share (0.4 s x COMM_SM_SHARE) is below that 0.1 s, so F ends at 1.1.
    from hwmodels.network import COMM_SM_SHARE

    assert 0.4 * COMM_SM_SHARE < 0.1
    res = run_iteration(_gathered_works([0.1] * 4), num_chunks=1, p2p_time=0, overlap_grad_reduce=True,
                        sync_time=0)
    assert res.step_time == pytest.approx(3.1)


def test_a_gated_forward_shares_the_nic_only_with_buckets_it_can_compute_beside():
    # One 1 s bucket on the NIC; F = 1 s with 0.5 s of its own network traffic (an all-to-all).
    # F cannot compute, so cannot send, before the bucket is here: no sharing, F runs 1 -> 2.
    res = run_iteration(_gathered_works([1.0], f_nic=0.5, bucket_nic=True), num_chunks=1, p2p_time=0,
                        overlap_grad_reduce=True, sync_time=0)
    assert res.step_time == pytest.approx(4.0)
    assert "ep_comm" not in res.stages[0].breakdown
    # Two 0.5 s buckets: the second is in flight while F computes on the first half, whose 0.25 s
    # of traffic it shares; both are delayed by that: bucket 1 lands at 1.25, F ends 1.25 + 0.5.
    res = run_iteration(_gathered_works([0.5, 0.5], f_nic=0.5, bucket_nic=True), num_chunks=1, p2p_time=0,
                        overlap_grad_reduce=True, sync_time=0)
    gathers = [(sp.start, sp.end) for sp in res.spans if sp.name.startswith("param all-gather")]
    assert gathers == [(0.0, 0.5), (0.5, pytest.approx(1.25))]
    assert res.step_time == pytest.approx(1.75 + 2.0)


def test_exact_zero_bubble_timeline_two_stages():
    # F = B = W = 1 s, no p2p: stage 1 defers W0 so B1 reaches stage 0 one second earlier than
    # if it ran W0 first (Qi et al. 2024, Fig. 3)
    res = run_iteration(split_works(build_schedule("zero-bubble", 2, 2)), num_chunks=1, p2p_time=0.0,
                        overlap_grad_reduce=True, sync_time=0.0)
    assert compute_log(res, 0) == [(0.0, "F0"), (1.0, "F1"), (3.0, "B0"), (4.0, "W0"), (5.0, "B1"), (6.0, "W1"),
                                   (7.0, "optimizer")]
    assert compute_log(res, 1) == [(1.0, "F0"), (2.0, "B0"), (3.0, "F1"), (4.0, "B1"), (5.0, "W0"), (6.0, "W1"),
                                   (7.0, "optimizer")]


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_bubble_is_p_minus_1_times_f_plus_b_minus_w(p, m):
    # ZB-H1 with T_F = T_B = T_W: step = m(F + B + W) + (p - 1)(F + B - W), against 1F1B's
    # m(F + B + W) + (p - 1)(F + B + W) with the same total backward (Qi et al. 2024, Sec. 3.1)
    zb = run_iteration(split_works(build_schedule("zero-bubble", p, m)), num_chunks=1, p2p_time=0.0,
                       overlap_grad_reduce=True, sync_time=0.0)
    ofob = run_iteration(uniform_works(build_schedule("1f1b", p, m), f=1.0, b=2.0), num_chunks=1, p2p_time=0.0,
                         overlap_grad_reduce=True, sync_time=0.0)
    assert zb.step_time == pytest.approx(3 * m + (p - 1) * 1)
    assert ofob.step_time == pytest.approx(3 * m + (p - 1) * 3)


def test_zero_bubble_gradients_flow_after_the_last_weight_pass():
    # one stage: F0 F1 B0 W0 B1 W1; the chunk's buckets follow the last W, not the last B
    ops = build_schedule("zero-bubble", 1, 2)
    works = [StageWork(ops=ops[0], op_cost={(k, 0): Cost().add("compute", 1.0) for k in "FBW"},
                       grad_buckets={0: [0.5, 0.5]}, optimizer_time=0.0, param_gather_time=0.0)]
    res = run_iteration(works, num_chunks=1, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0)
    reduce = [sp for sp in res.spans if sp.stream == "dp-comm"]
    assert reduce[0].start == pytest.approx(5.5)  # half-way through W1 (5 s to 6 s)
    assert res.step_time == pytest.approx(6.5)


class _StageStub:
    """What torch's schedule constructor reads of a pipeline stage: enough to build its op order."""

    def __init__(self, index: int, pp: int, chunks: int):
        self.stage_index, self.group_size, self.group_rank = index, pp, 0
        self.num_stages, self.submod = pp * chunks, None
        self.is_first, self.is_last = index == 0, index == pp * chunks - 1


@pytest.mark.parametrize("name,torch_class,p,m,v", [
    ("zero-bubble", "ScheduleInterleavedZeroBubble", 2, 4, 1), ("zero-bubble", "ScheduleInterleavedZeroBubble", 4, 8, 1),
    ("zero-bubble", "ScheduleInterleavedZeroBubble", 4, 6, 1), ("zero-bubble", "ScheduleInterleavedZeroBubble", 2, 4, 2),
    ("zero-bubble", "ScheduleInterleavedZeroBubble", 4, 8, 2), ("zero-bubble", "ScheduleInterleavedZeroBubble", 4, 12, 3),
    ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2, 4, 2), ("interleaved-1f1b", "ScheduleInterleaved1F1B", 4, 8, 2),
    ("interleaved-1f1b", "ScheduleInterleaved1F1B", 4, 12, 3), ("interleaved-1f1b", "ScheduleInterleaved1F1B", 2, 2, 2),
    ("interleaved-1f1b", "ScheduleInterleaved1F1B", 4, 4, 2), ("zero-bubble", "ScheduleInterleavedZeroBubble", 4, 4, 2),
    ("zbv", "ScheduleZBVZeroBubble", 2, 2, 2), ("zbv", "ScheduleZBVZeroBubble", 2, 5, 2),
    ("zbv", "ScheduleZBVZeroBubble", 4, 4, 2), ("zbv", "ScheduleZBVZeroBubble", 4, 9, 2),
    ("zbv", "ScheduleZBVZeroBubble", 8, 16, 2),
])
def test_schedule_is_the_order_the_executor_runs(name, torch_class, p, m, v):
    # the simulator replays exactly what PyTorch's schedule class (the one paraplan launch runs for
    # this name) executes on each rank; torch names the input-gradient backward I (our B under
    # zero-bubble, the whole backward otherwise) and the weight gradient W
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    v_shaped = name == "zbv"
    stubs = [_StageStub(virtual_stage(0, c, p, v_shaped), p, v) for c in range(v)]
    torch_order = getattr(schedules, torch_class)(stubs, m).pipeline_order
    kind = {"F": "F", "I": "B", "W": "W", "B": "B"}
    for stage, ops in enumerate(build_schedule(name, p, m, v)):
        theirs = [str(a) for a in torch_order[stage] if a is not None]
        ours = [f"{virtual_stage(stage, o.chunk, p, v_shaped)}{o.kind}{o.microbatch}" for o in ops]
        assert ours == [_normalise(t, kind) for t in theirs]


def _normalise(action: str, kind: dict) -> str:
    """torch's action string '<stage><kind><microbatch>' with its kind letter mapped to ours."""
    i = next(j for j, ch in enumerate(action) if ch.isalpha())
    return action[:i] + kind[action[i]] + action[i + 1:]


def _span_times(res, stage, stream):
    return [(sp.name, sp.start, sp.end) for sp in res.spans if sp.stage == stage and sp.stream == stream]


def test_aligned_grad_reduce_1f1b_waits_for_the_bubble_except_on_the_first_stage():
    """Megatron-Core --align-grad-reduce under 1F1B (p 2, M 2, F 1 s, B 2 s): stage 0 reduces as
    its last backward (B1, 7-9 s) fills the buckets; stage 1 once its backward is over (7 s).
    Reducing during stage 1's B1 instead takes COMM_SM_SHARE (0.15) of its SMs while the buckets
    overlap it: all of the first (0.5 s) and the 0.075 s by which that made B1 outlast the second's
    start, so B1 ends 0.15 x 0.575 = 0.08625 s late and stage 0's B1 with it."""
    ops = build_schedule("1f1b", 2, 2)
    kw = dict(num_chunks=1, p2p_time=0, overlap_grad_reduce=True, sync_time=0)
    works = uniform_works(ops, buckets={0: [0.5, 0.5]})
    free = run_iteration(works, **kw)
    aligned = run_iteration(works, align_grad_reduce=True, **kw)
    starts = lambda res, s: [t0 for _, t0, _ in _span_times(res, s, "dp-comm")]  # noqa: E731
    assert starts(free, 1) == [6.0, 7.0]  # mid-way through and at the end of B1 (5-7 s)
    assert starts(aligned, 1) == [7.0, 7.5]
    assert starts(aligned, 0) == [8.0, 9.0]
    assert starts(free, 0) == pytest.approx([8.08625, 9.08625])
    assert aligned.step_time == pytest.approx(9.5)
    assert free.step_time == pytest.approx(9.58625)


def test_aligned_grad_reduce_interleaved_launches_s_backwards_later():
    """Interleaved (p 2, M 4, v 2): stage s launches a chunk's whole reduction when the backward s
    steps after the chunk's last one ends; stage 1's chunk 0 (last backward B3, its last op) after
    its last op."""
    ops = build_schedule("interleaved-1f1b", 2, 4, 2)
    works = uniform_works(ops, buckets={0: [0.5], 1: [0.5]})
    res = run_iteration(works, num_chunks=2, p2p_time=0, overlap_grad_reduce=True, sync_time=0,
                        align_grad_reduce=True)
    for stage, (chunk1_after, chunk0_after) in enumerate([("B3.1", "B3.0"), ("B2.0", "B3.0")]):
        ends = {name: t1 for name, _, t1 in _span_times(res, stage, "compute")}
        comm = _span_times(res, stage, "dp-comm")
        assert [name for name, _, _ in comm] == ["grad-reduce c1 b0", "grad-reduce c0 b0"]
        assert comm[0][1] == ends[chunk1_after]
        assert comm[1][1] == max(ends[chunk0_after], comm[0][2])


def test_aligned_grad_reduce_under_zero_bubble_counts_weight_passes():
    """Zero-bubble interleaved (p 2, M 4, v 2) with aligned launch points: the W passes produce the
    weight gradients, so stage s launches a chunk's reduction when the W pass s steps after the
    chunk's last W ends (or after its last op when fewer remain)."""
    ops = build_schedule("zero-bubble", 2, 4, 2)
    costs = {(k, c): Cost().add("compute", 1.0) for k in "FBW" for c in range(2)}
    works = [StageWork(ops=o, op_cost=costs, grad_buckets={0: [0.5], 1: [0.5]}, optimizer_time=0.0,
                       param_gather_time=0.0) for o in ops]
    res = run_iteration(works, num_chunks=2, p2p_time=0, overlap_grad_reduce=True, sync_time=0,
                        align_grad_reduce=True)
    for stage in range(2):
        w_ends = [t1 for name, _, t1 in _span_times(res, stage, "compute") if name.startswith("W")]
        last_w = {c: max(i for i, op in enumerate(o for o in ops[stage] if o.kind == "W") if op.chunk == c)
                  for c in range(2)}
        comm = {name: t0 for name, t0, _ in _span_times(res, stage, "dp-comm")}
        for c, i in last_w.items():
            launch = w_ends[i + stage] if i + stage < len(w_ends) else w_ends[-1]
            assert comm[f"grad-reduce c{c} b0"] >= launch
        stage_trace = res.stages[stage]
        assert sum(stage_trace.breakdown.values()) == pytest.approx(stage_trace.end)


def test_kept_op_plan_gives_the_timeline_of_a_fresh_one():
    # the engine keeps the op plan of an immutable (cached) schedule; a replay must not differ
    from simulator.engine import clear_caches
    works = uniform_works(build_schedule("interleaved-1f1b", 4, 8, 2))
    first = run_iteration(works, num_chunks=2, p2p_time=0.25, overlap_grad_reduce=True, sync_time=0.0)
    again = run_iteration(works, num_chunks=2, p2p_time=0.25, overlap_grad_reduce=True, sync_time=0.0)
    clear_caches()
    fresh = run_iteration(works, num_chunks=2, p2p_time=0.25, overlap_grad_reduce=True, sync_time=0.0)
    assert [(s.stage, s.name, s.start, s.end) for s in again.spans] == \
        [(s.stage, s.name, s.start, s.end) for s in first.spans] == [(s.stage, s.name, s.start, s.end) for s in fresh.spans]


def test_a_schedule_given_as_a_list_is_read_on_every_run():
    # a list may change between runs: its op plan is not kept
    ops = [Op("F", 0), Op("B", 0)]
    works = [StageWork(ops=ops, op_cost={("F", 0): Cost().add("compute", 1.0), ("B", 0): Cost().add("compute", 2.0)},
                       grad_buckets={}, optimizer_time=0.0, param_gather_time=0.0)]
    assert run_iteration(works, num_chunks=1, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0).step_time == 3.0
    ops += [Op("F", 1), Op("B", 1)]
    assert run_iteration(works, num_chunks=1, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0).step_time == 6.0


def test_kept_op_plan_takes_each_runs_costs():
    # same (cached) schedule, other op costs: the exact 1F1B timeline of the new costs
    ops = build_schedule("1f1b", 2, 2)
    run_iteration(uniform_works(ops, f=1.0, b=2.0), num_chunks=1, p2p_time=0.5, overlap_grad_reduce=True,
                  sync_time=0.0)
    res = run_iteration(uniform_works(ops, f=2.0, b=4.0), num_chunks=1, p2p_time=0.5, overlap_grad_reduce=True,
                        sync_time=0.0)
    # stage 1 gets F0 at 2 + 0.5 and runs B0 4.5-8.5; B0 reaches stage 0 at 9.0, B1 at 15.0
    assert compute_log(res, 0) == [(0.0, "F0"), (2.0, "F1"), (9.0, "B0"), (15.0, "B1"), (19.0, "optimizer")]


def test_kept_op_plans_stay_within_their_bound(monkeypatch):
    from simulator import engine
    engine.clear_caches()
    monkeypatch.setattr(engine, "_PLAN_CACHE_OPS", 40)
    for m in (2, 3, 4, 5):  # 2 stages x 2m ops each: 8, 12, 16, 20 ops a schedule
        run_iteration(uniform_works(build_schedule("1f1b", 2, m)), num_chunks=1, p2p_time=0.5,
                      overlap_grad_reduce=True, sync_time=0.0)
        assert sum(len(entry[0]) for entry in engine._PLAN_CACHE.values()) <= 40
    assert engine._PLAN_CACHE  # the latest schedule's plans are kept
    engine.clear_caches()


def test_an_op_outside_the_chunks_or_without_a_cost_is_named():
    works = uniform_works([[Op("F", 0, 0), Op("F", 1, 1)]])
    with pytest.raises(ValueError, match=r"op Op\(kind='F', microbatch=1, chunk=1\) is not .* below 1"):
        run_iteration(works, num_chunks=1, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0)
    works = [StageWork(ops=[Op("F", 0), Op("B", 0)], op_cost={("F", 0): Cost().add("compute", 1.0)},
                       grad_buckets={}, optimizer_time=0.0, param_gather_time=0.0)]
    with pytest.raises(KeyError, match=r"no op cost for \(kind, chunk\) \[\('B', 0\)\]"):
        run_iteration(works, num_chunks=1, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0)


def test_pipeline_receives_on_the_timeline_and_the_timeline_as_a_sequence():
    # the 2-stage 1F1B above: stage 1 waits for F0 from 1.0 (stage 0's end) to 1.5 (its arrival);
    # stage 0 for B0 from 4.5 to 5.0 and for B1 from 7.5 to 8.0
    import pickle
    works = uniform_works(build_schedule("1f1b", 2, 2))
    res = run_iteration(works, num_chunks=1, p2p_time=0.5, overlap_grad_reduce=True, sync_time=0.0)
    n = len(res.spans)  # known before the spans are built
    assert [(s.stage, s.name, s.category, s.start, s.end) for s in res.spans if s.stream == "pp-comm"] == [
        (1, "recv F0", "pp_comm", 1.0, 1.5), (0, "recv B0", "pp_comm", 4.5, 5.0), (0, "recv B1", "pp_comm", 7.5, 8.0)]
    assert len(res.spans) == n == len(list(res.spans)) and res.spans[-1].name == "optimizer"
    again = pickle.loads(pickle.dumps(res.spans))
    assert [(s.stage, s.name, s.start) for s in again] == [(s.stage, s.name, s.start) for s in res.spans]


def test_runs_in_threads_share_the_kept_op_plans_safely(monkeypatch):
    # simulate() called from several threads: the op-plan cache evicts under a lock
    from concurrent.futures import ThreadPoolExecutor

    from simulator import engine
    monkeypatch.setattr(engine, "_PLAN_CACHE_OPS", 60)  # evict all the time
    engine.clear_caches()

    def run(m):
        res = run_iteration(uniform_works(build_schedule("1f1b", 3, m)), num_chunks=1, p2p_time=0.5,
                            overlap_grad_reduce=True, sync_time=0.0)
        return m, res.step_time

    alone = dict(run(m) for m in range(2, 10))
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(run, [2, 3, 4, 5, 6, 7, 8, 9] * 6))
    engine.clear_caches()
    assert all(step == alone[m] for m, step in got)
    assert sum(len(entry[0]) for entry in engine._PLAN_CACHE.values()) == 0


def test_a_bucket_that_ends_before_the_next_op_starts_charges_it_nothing():
    """Interleaved 1F1B on 2 stages, 4 microbatches, F = 1 s, B = 2 s, sends of 1 s: a chunk's
    last bucket of 3 s overlaps a whole 2 s backward (0.15 x 2 = 0.3 s of SM sharing), and the short
    buckets before it start and end while the stage waits for its next input, which they must not
    charge (nor, with NIC traffic on both, give a negative delay)."""
    ops = build_schedule("interleaved-1f1b", 2, 4, 2)

    def works(buckets, nic):
        cost = (lambda t: Cost().add("compute", t).add_nic("ep_comm", 0.5 * t)) if nic else \
            (lambda t: Cost().add("compute", t))
        return [StageWork(ops=o, op_cost={(k, c): cost(t) for k, t in (("F", 1.0), ("B", 2.0)) for c in range(2)},
                          grad_buckets=buckets, grad_bucket_nic={c: list(v) for c, v in buckets.items()} if nic else {},
                          optimizer_time=0.0, param_gather_time=0.0) for o in ops]

    res = run_iteration(works({c: [0.1, 0.1, 0.1, 3.0] for c in range(2)}, nic=False), num_chunks=2, p2p_time=1.0,
                        overlap_grad_reduce=True, sync_time=0.0, align_grad_reduce=True)
    assert res.step_time == pytest.approx(36.6)
    assert [s.compute_end for s in res.stages] == [pytest.approx(33.3), pytest.approx(30.3)]
    run_iteration(works({c: [0.1, 0.1, 0.1, 0.5] for c in range(2)}, nic=True), num_chunks=2, p2p_time=1.0,
                  p2p_nic=1.0, overlap_grad_reduce=True, sync_time=0.0, align_grad_reduce=True)  # no negative delay


# -- DualPipeV ---------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_dualpipev_is_the_order_pytorch_runs(p):
    """dualpipev_actions against PyTorch's ScheduleDualPipeV, rank by rank: torch prints a forward
    overlapped with a whole backward as '(F;B)OVERLAP_F_B', an input gradient I, a whole backward B."""
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    from simulator.schedules import dualpipev_actions

    def name(action, rank):
        kind, chunk, mb = action
        return f"{virtual_stage(rank, chunk, p, True)}{kind}{mb}"

    for m in (2 * p, 2 * p + 1, 3 * p, 4 * p + 1):
        stubs = [_StageStub(0, p, 2), _StageStub(2 * p - 1, p, 2)]
        torch_order = schedules.ScheduleDualPipeV(stubs, m).pipeline_order
        for rank in range(p):
            ours = [f"({name(a[1], rank)};{name(a[2], rank)})OVERLAP_F_B" if a[0] == "FB" else name(a, rank)
                    for a in dualpipev_actions(p, m, rank)]
            assert ours == [str(a) for a in torch_order[rank] if a is not None]


def test_dualpipev_ops_spell_whole_and_split_backwards_apart():
    """A whole backward is an X (input and weight gradients in one pass), an input gradient alone
    a B whose W comes later; each overlapped pair is a forward and the other chunk's X."""
    from simulator.schedules import dualpipev, dualpipev_actions, merged_pairs

    ops, pairs = dualpipev(2, 4, 0)
    kinds = [o.kind for o in ops]
    assert kinds.count("F") == 2 * 4 and kinds.count("X") + kinds.count("B") == 2 * 4
    assert kinds.count("W") == kinds.count("B") > 0
    for i in pairs:
        assert ops[i].kind == "F" and ops[i + 1].kind == "X" and ops[i].chunk != ops[i + 1].chunk
    assert len(pairs) == sum(a[0] == "FB" for a in dualpipev_actions(2, 4, 0))
    assert merged_pairs("dualpipev", 2, 4, 2) == tuple(tuple(dualpipev(2, 4, s)[1]) for s in range(2))
    assert build_schedule("dualpipev", 2, 4, 2)[0] == tuple(ops)
    # the DualPipe README's activation memory, PP + 1 microbatches of a stage (one chunk here) with
    # PP = 2p stages, on every rank: a whole backward frees its microbatch at once, a split one at its W
    for p in range(2, 9):
        for m in (2 * p, 4 * p, 8 * p):
            assert {peak_in_flight(o) for o in build_schedule("dualpipev", p, m, 2)} == {2 * p + 1}


@pytest.mark.parametrize("overlapped", [3.0, 2.5])
@pytest.mark.parametrize("p,m", [(2, 4), (3, 9), (4, 8), (4, 20), (8, 16)])
def test_dualpipev_bubble_is_deepseeks(p, m, overlapped):
    """The DualPipe README's table: DualPipeV on p ranks (2p stages) leaves (p - 1)(F&B + B - 3W) of
    bubble, B the whole backward and F&B an overlapped pair. With F = 1, input gradient 1, W = 1
    (B = 2) and F&B 3 (one after the other) or 2.5 (overlapped), free sends: the rank with the
    fewest pairs idles exactly that long, every rank the same when F&B = F + B."""
    from simulator.schedules import merged_pairs

    orders, pairs = build_schedule("dualpipev", p, m, 2), merged_pairs("dualpipev", p, m, 2)
    cost = {"F": 1.0, "B": 1.0, "W": 1.0, "X": 2.0}
    works = [StageWork(ops=o, pairs=q, op_cost={(k, c): Cost().add("compute", t) for k, t in cost.items() for c in range(2)},
                       pairs_overlapped=overlapped != 3.0,
                       pair_cost={(a, b): Cost().add("compute", overlapped) for a in range(2) for b in range(2)},
                       grad_buckets={}, optimizer_time=0.0, param_gather_time=0.0) for o, q in zip(orders, pairs)]
    res = run_iteration(works, num_chunks=2, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0, v_shaped=True)
    busy = [len(q) * (overlapped - 3.0) + sum(cost[op.kind] for op in o) for o, q in zip(orders, pairs)]
    assert res.step_time - min(busy) == pytest.approx((p - 1) * (overlapped + 2 - 3))
    if overlapped == 3.0:
        assert len({round(b, 9) for b in busy}) == 1


@pytest.mark.parametrize("overlapped", [True, False])
def test_dualpipev_never_deadlocks(overlapped):
    from simulator.schedules import merged_pairs

    rng = random.Random(5)
    for p in range(2, 9):
        for m in (2 * p, 2 * p + 3, 4 * p):
            orders, pairs = build_schedule("dualpipev", p, m, 2), merged_pairs("dualpipev", p, m, 2)
            works = [StageWork(ops=o, pairs=q, pairs_overlapped=overlapped,
                               op_cost={(k, c): Cost().add("compute", rng.uniform(0.5, 2)) for k in "FBWX" for c in range(2)},
                               pair_cost={(a, b): Cost().add("compute", rng.uniform(1, 4)) for a in range(2) for b in range(2)},
                               grad_buckets={c: [0.1] for c in range(2)}, optimizer_time=0.0, param_gather_time=0.0)
                     for o, q in zip(orders, pairs)]
            res = run_iteration(works, num_chunks=2, p2p_time=[rng.uniform(0, 0.5) for _ in range(p)],
                                overlap_grad_reduce=True, sync_time=0.0, v_shaped=True)
            assert all(s.ops_done == len(o) for s, o in zip(res.stages, orders))


def test_dualpipev_pairs_run_as_pytorch_runs_them():
    """Without an overlap callback PyTorch runs a pair's forward once its input is there and its
    backward after it once the backward's input is (and sends both outputs after the pair): never
    later than a merged op of the same total cost that waits for both inputs first, and sooner
    where the backward's input arrives last. Random per-stage costs and sends, p = 2-6."""
    from simulator.schedules import merged_pairs

    rng = random.Random(11)
    faster = 0
    for p in range(2, 7):
        for m in (2 * p, 3 * p + 1):
            orders, pairs = build_schedule("dualpipev", p, m, 2), merged_pairs("dualpipev", p, m, 2)
            costs = [{(k, c): Cost().add("compute", rng.uniform(0.5, 2)) for k in "FBWX" for c in range(2)}
                     for _ in range(p)]
            sends = [rng.uniform(0, 1.5) for _ in range(p)]
            step = {}
            for overlapped in (False, True):
                works = [StageWork(ops=o, pairs=q, op_cost=c, pairs_overlapped=overlapped,
                                   pair_cost={(a, b): Cost().add("compute", c[("F", a)].total + c[("X", b)].total)
                                              for a in range(2) for b in range(2)},
                                   grad_buckets={}, optimizer_time=0.0, param_gather_time=0.0)
                         for o, q, c in zip(orders, pairs, costs)]
                step[overlapped] = run_iteration(works, num_chunks=2, p2p_time=sends, overlap_grad_reduce=True,
                                                 sync_time=0.0, v_shaped=True).step_time
            assert step[False] <= step[True] + 1e-9
            faster += step[False] < step[True] - 1e-9
    assert faster > 0


def test_what_recompute_rebuilds_for_the_weight_gradients_stays_from_b_to_w():
    """A split backward under recompute rebuilds the forward's tensors in its B pass and the W pass
    still reads them: F0 F1 B0 W0 B1 W1 with a 1-byte checkpoint and 3 bytes rebuilt peaks at
    B0 (two checkpoints and one rebuilt microbatch), not at the two checkpoints; a whole backward
    (1F1B) holds nothing past its B."""
    ops = [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("W", 0, 0), ("B", 1, 0), ("W", 1, 0)]
    assert peak_in_flight(ops, [1.0]) == 2.0
    assert peak_in_flight(ops, [1.0], rebuilt_by_b=[3.0]) == 5.0
    whole = [("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)]
    assert peak_in_flight(whole, [1.0], rebuilt_by_b=[3.0]) == 2.0
