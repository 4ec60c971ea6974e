"""Combined 1F1B (plan.overlap_moe_expert_parallel_comm): its op order, the merged pairs in the
engine, the two-stream node schedule of a layer pair, and the plan's rules."""
import random
from pathlib import Path

import pytest

from paraplan.loader import load_scenario
from simulator.combined import LayerPhases, merged_cost, merged_layers_time
from simulator.cost import Cost
from simulator.engine import StageWork, run_iteration
from simulator.feasibility import structural_problems
from simulator.schedules import Op, build_schedule, combined_pairs, interleaved_1f1b, peak_in_flight
from simulator.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
MIXTRAL = ROOT / "scenarios" / "mixtral-8x7b-64xh100.yaml"
ON = "plan.overlap_moe_expert_parallel_comm=true"


def names(ops):
    return [f"{o.kind}{o.microbatch}" + (f".{o.chunk}" if o.chunk else "") for o in ops]


# -- the op order ------------------------------------------------------------------------------

def test_one_stage_runs_the_forward_of_the_next_microbatch_with_each_backward():
    """combined_1f1b_schedule_for_no_pipelining: F0 alone, then F(i+1) merged with B(i), then the
    last backward alone; with one microbatch nothing is merged."""
    ops = build_schedule("1f1b", 1, 4, 1, True)[0]
    assert names(ops) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert combined_pairs("1f1b", 1, 4) == ((1, 3, 5),)
    assert combined_pairs("gpipe", 1, 4) == ((1, 3, 5),)  # one stage: no pipeline either way
    assert combined_pairs("1f1b", 1, 1) == ((),) and names(build_schedule("1f1b", 1, 1, 1, True)[0]) == ["F0", "B0"]
    # two microbatches in flight where plain 1F1B on one stage holds one
    assert peak_in_flight(ops) == 2 and peak_in_flight(build_schedule("1f1b", 1, 4)[0]) == 1


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 2), (2, 2, 8), (4, 2, 8), (4, 3, 12), (8, 4, 16)])
def test_interleaved_warm_up_takes_one_forward_more_and_merges_the_steady_state(pp, vpp, m):
    """schedules.py: num_warmup_microbatches += 1 under --overlap-moe-expert-parallel-comm; each
    steady-state forward runs merged with the backward after it, which belongs to another
    microbatch or chunk; a stage whose warm-up takes every forward merges nothing."""
    orders = build_schedule("interleaved-1f1b", pp, m, vpp, True)
    pairs = combined_pairs("interleaved-1f1b", pp, m, vpp)
    total = m * vpp
    for s in range(pp):
        plain_warmup = min(total, 2 * (pp - s - 1) + (vpp - 1) * pp)
        warmup = min(total, plain_warmup + 1)
        ops = orders[s]
        assert sorted(ops) == sorted(interleaved_1f1b(pp, m, s, vpp))  # the same ops, in another order
        assert [o.kind for o in ops[:warmup]] == ["F"] * warmup
        assert pairs[s] == tuple(range(warmup, warmup + 2 * (total - warmup), 2))
        for i in pairs[s]:
            f, b = ops[i], ops[i + 1]
            assert (f.kind, b.kind) == ("F", "B") and (f.microbatch, f.chunk) != (b.microbatch, b.chunk)
    assert pairs[0] == () if 2 * (pp - 1) + (vpp - 1) * pp + 1 >= total else pairs[0]


# -- a layer pair on two streams -----------------------------------------------------------------

def test_a_layer_pair_runs_node_by_node_on_two_streams():
    """By hand, with forward nodes (attention 1, dispatch 0.5, experts 2, combine 0.5, after 0.1)
    and backward nodes twice as long (exchanges alike): B after 0-0.2, B combine 0.2-0.7 beside
    F attention 0.2-1.2 (+0.15 x 0.5 of SMs: 1.275), F dispatch 1.275-1.775 beside B experts
    1.275-5.35, B dispatch 5.35-5.85 beside F experts 5.35-7.425, F combine 7.425-7.925 beside
    B attention 7.425-9.5, F after 9.5-9.6: 9.6 s against 11.3 s one after the other."""
    f = LayerPhases(1.0, 0.5, 2.0, 0.5, 0.1)
    b = LayerPhases(2.0, 0.5, 4.0, 0.5, 0.2)
    assert merged_layers_time([f], [b]) == pytest.approx(9.6)
    assert merged_layers_time([f], []) == pytest.approx(4.1) and merged_layers_time([], [b]) == pytest.approx(7.2)


def test_merging_never_costs_more_than_one_pass_after_the_other():
    rng = random.Random(7)
    for _ in range(200):
        def layer():
            return LayerPhases(*(rng.uniform(0, 2) for _ in range(5)))
        fs, bs = [layer() for _ in range(rng.randint(0, 4))], [layer() for _ in range(rng.randint(0, 4))]
        serial = sum(x.attention + x.dispatch + x.experts + x.combine + x.after for x in fs + bs)
        assert merged_layers_time(fs, bs) <= serial + 1e-9
        # without exchanges there is nothing to hide and nothing slows down: the sum exactly
        quiet = [LayerPhases(x.attention, 0.0, x.experts, 0.0, x.after) for x in fs + bs]
        assert merged_layers_time(quiet[:len(fs)], quiet[len(fs):]) == pytest.approx(
            sum(x.attention + x.experts + x.after for x in quiet))


def test_a_pair_books_only_the_exposed_exchanges():
    f = Cost().add("compute", 3.0).add("ep_comm", 1.0).add_nic("ep_comm", 1.0)
    b = Cost().add("compute", 6.0).add("ep_comm", 1.0).add("tp_comm", 0.5).add_nic("ep_comm", 1.0)
    c = merged_cost(f, b, 9.8)
    assert c.total == pytest.approx(9.8) and c.parts["ep_comm"] == pytest.approx(0.3)
    assert c.parts["compute"] == 9.0 and c.parts["tp_comm"] == 0.5 and c.nic == 2.0


# -- the engine --------------------------------------------------------------------------------

def test_a_merged_pair_waits_for_both_inputs_and_sends_both_outputs():
    """pp 2 x 2 chunks, 2 microbatches, F 1 s, B 2 s, a merged pair 2.5 s, free sends. Stage 0's
    warm-up takes all four forwards; stage 1 merges F1.1 (its input from stage 0 at 4) with B0.1
    (the last virtual stage: no input) over 4-6.5, and B0.1's gradient reaches stage 0 at 6.5. By
    hand: stage 0 ends at 14.5, stage 1 at 12.5."""
    orders = build_schedule("interleaved-1f1b", 2, 2, 2, True)
    pairs = combined_pairs("interleaved-1f1b", 2, 2, 2)
    assert pairs == ((), (3,))

    def cost(t):
        return Cost().add("compute", t)

    works = [StageWork(ops=o, pairs=p, op_cost={(k, c): cost(t) for k, t in (("F", 1.0), ("B", 2.0)) for c in range(2)},
                       pair_cost={(fc, bc): cost(2.5) for fc in range(2) for bc in range(2)}, grad_buckets={},
                       optimizer_time=0.0, param_gather_time=0.0) for o, p in zip(orders, pairs)]
    res = run_iteration(works, num_chunks=2, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0)
    assert res.step_time == pytest.approx(14.5)
    assert [s.compute_end for s in res.stages] == [pytest.approx(14.5), pytest.approx(12.5)]
    spans = {(sp.stage, sp.name): (sp.start, sp.end, sp.category) for sp in res.spans if sp.stream == "compute"}
    assert spans[(1, "F1.1+B0.1")] == (4.0, 6.5, "forward_backward")
    assert spans[(0, "B0.1")][:2] == (6.5, 8.5)
    assert res.stages[1].breakdown["compute"] == pytest.approx(3 * 1.0 + 2.5 + 3 * 2.0)



def test_a_pairs_two_sends_share_the_link_and_land_together():
    """pp 2 x 2 chunks, 4 microbatches, F 1 s, B 2 s, pairs 2.5 s, sends of 0.5 s. Stage 1's pair
    F2.0+B1.1 ends at 10.5 and sends both outputs to stage 0 in one batch: they land together at
    11.5, one send after the other, not both at 11.0; stage 0's F3.0+B0.1 likewise sends both to
    stage 1 at 11.0, which has them at 12.0. The step ends at 30.5 (29.5 with each send alone on
    the link)."""
    orders = build_schedule("interleaved-1f1b", 2, 4, 2, True)
    pairs = combined_pairs("interleaved-1f1b", 2, 4, 2)
    cost = lambda t: Cost().add("compute", t)  # noqa: E731
    works = [StageWork(ops=o, pairs=p, op_cost={(k, c): cost(t) for k, t in (("F", 1.0), ("B", 2.0)) for c in range(2)},
                       pair_cost={(fc, bc): cost(2.5) for fc in range(2) for bc in range(2)}, grad_buckets={},
                       optimizer_time=0.0, param_gather_time=0.0) for o, p in zip(orders, pairs)]
    res = run_iteration(works, num_chunks=2, p2p_time=0.5, overlap_grad_reduce=True, sync_time=0.0)
    recv = {(sp.stage, sp.name, sp.start): sp.end for sp in res.spans if sp.stream == "pp-comm"}
    assert recv[(0, "recv F2", 11.0)] == recv[(0, "recv B1", 11.0)] == pytest.approx(11.5)
    assert recv[(1, "recv F3", 11.0)] == recv[(1, "recv B0", 11.0)] == pytest.approx(12.0)
    assert res.step_time == pytest.approx(30.5)

def test_no_combined_order_deadlocks():
    rng = random.Random(3)
    for pp in (2, 3, 4, 8):
        for vpp in (2, 3):
            for m in (pp, 2 * pp, 3 * pp):
                orders = build_schedule("interleaved-1f1b", pp, m, vpp, True)
                pairs = combined_pairs("interleaved-1f1b", pp, m, vpp)
                works = [StageWork(ops=o, pairs=p,
                                   op_cost={(k, c): Cost().add("compute", rng.uniform(0.5, 2)) for k in "FB"
                                            for c in range(vpp)},
                                   pair_cost={(fc, bc): Cost().add("compute", rng.uniform(1, 3)) for fc in range(vpp)
                                              for bc in range(vpp)},
                                   grad_buckets={}, optimizer_time=0.0, param_gather_time=0.0)
                         for o, p in zip(orders, pairs)]
                for blocking in ("none", "forward", "all"):
                    res = run_iteration(works, num_chunks=vpp, p2p_time=[rng.uniform(0, 0.5) for _ in range(pp)],
                                        overlap_grad_reduce=True, sync_time=0.0, blocking_sends=blocking)
                    assert all(s.ops_done == len(o) for s, o in zip(res.stages, orders))


def test_a_pair_that_is_not_a_forward_then_a_backward_is_refused():
    work = StageWork(ops=(Op("F", 0), Op("F", 1), Op("B", 0), Op("B", 1)), pairs=(0,),
                     op_cost={("F", 0): Cost(), ("B", 0): Cost()}, pair_cost={(0, 0): Cost()}, grad_buckets={},
                     optimizer_time=0.0, param_gather_time=0.0)
    with pytest.raises(ValueError, match="not a forward then a backward"):
        run_iteration([work], num_chunks=1, p2p_time=0.0, overlap_grad_reduce=True, sync_time=0.0)


# -- simulate() --------------------------------------------------------------------------------

def test_mixtral_hides_its_all_to_alls_and_holds_one_microbatch_more():
    base = simulate(load_scenario(MIXTRAL), imbalance_reference=False)
    on = simulate(load_scenario(MIXTRAL, [ON]), imbalance_reference=False)
    assert on.breakdown["compute"] == pytest.approx(base.breakdown["compute"])
    assert on.breakdown["ep_comm"] < 0.5 * base.breakdown["ep_comm"]
    assert on.peak_memory_bytes > base.peak_memory_bytes
    assert any(sp.category == "forward_backward" and "+" in sp.name for sp in on.spans)
    for st in on.stages:  # the components still add up to each stage's time
        assert sum(st.breakdown.values()) == pytest.approx(st.end_time_s, rel=1e-9)


def test_one_stage_plans_merge_too():
    sc = load_scenario(MIXTRAL, [ON, "plan.pp=1", "plan.dp=64", "plan.schedule=1f1b", "plan.virtual_pipeline_stages=1"])
    off = load_scenario(MIXTRAL, ["plan.pp=1", "plan.dp=64", "plan.schedule=1f1b", "plan.virtual_pipeline_stages=1"])
    on_r, off_r = simulate(sc, imbalance_reference=False), simulate(off, imbalance_reference=False)
    assert on_r.breakdown["ep_comm"] < off_r.breakdown["ep_comm"]
    assert sum(sp.category == "forward_backward" for sp in on_r.spans) == sc.num_microbatches - 1


# -- the rules ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sets,reason", [
    (["plan.ep=1"], "plan.overlap_moe_expert_parallel_comm: needs expert parallelism, ep > 1"),
    (["plan.schedule=1f1b", "plan.virtual_pipeline_stages=1"],
     "plan.overlap_moe_expert_parallel_comm: with pp > 1 needs schedule interleaved-1f1b"),
    (["plan.recompute=full"], "plan.overlap_moe_expert_parallel_comm: does not run with recompute full"),
    (["plan.recompute=selective", "plan.recompute_modules=[moe]"],
     "plan.overlap_moe_expert_parallel_comm: does not run with the moe recompute module"),
    (["training.precision=fp32"], "plan.overlap_moe_expert_parallel_comm: needs 16-bit training"),
    (["plan.zero_stage=3"], "plan.overlap_moe_expert_parallel_comm: modelled with zero_stage 0 or 1"),
])
def test_megatron_core_rules(sets, reason):
    sc = load_scenario(MIXTRAL, [ON, *sets])
    assert any(p.startswith(reason) for p in structural_problems(sc)), structural_problems(sc)


def test_a_dense_model_cannot_overlap_expert_exchanges():
    sc = load_scenario(ROOT / "scenarios" / "llama3-8b-64xh100.yaml", [ON])
    assert "plan.overlap_moe_expert_parallel_comm: needs an MoE model (model.moe); this model is dense" \
        in structural_problems(sc)


def test_bad_values_are_one_line_errors_with_exit_code_2():
    import subprocess
    import sys

    def run(*sets):
        args = [sys.executable, "-m", "paraplan", "simulate", str(MIXTRAL)]
        for s in sets:
            args += ["--set", s]
        return subprocess.run(args, capture_output=True, text=True, cwd=ROOT)

    r = run("plan.overlap_moe_expert_parallel_comm=maybe")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert r.stderr.startswith("error: plan.overlap_moe_expert_parallel_comm: expected true or false")
    r = run(ON, "plan.recompute=full")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "does not run with recompute full" in r.stderr


# -- DualPipeV's pairs ---------------------------------------------------------------------------

DUALPIPEV = ["plan.schedule=dualpipev", "plan.virtual_pipeline_stages=2"]


def test_dualpipev_pairs_run_one_after_the_other_unless_overlapped():
    """Without the overlap a DualPipeV pair is its forward and whole backward back to back (as
    PyTorch's OVERLAP_F_B runs without an overlap function): every all-to-all exposed; with it the
    pairs are merged as combined 1F1B's are."""
    plain = simulate(load_scenario(MIXTRAL, DUALPIPEV), imbalance_reference=False)
    zbv = simulate(load_scenario(MIXTRAL, ["plan.schedule=zbv", "plan.virtual_pipeline_stages=2"]),
                   imbalance_reference=False)
    on = simulate(load_scenario(MIXTRAL, [*DUALPIPEV, ON]), imbalance_reference=False)
    assert plain.breakdown["ep_comm"] == pytest.approx(zbv.breakdown["ep_comm"])  # the same passes, all exposed
    assert plain.breakdown["compute"] == pytest.approx(zbv.breakdown["compute"])
    assert on.breakdown["ep_comm"] < 0.6 * plain.breakdown["ep_comm"] and on.step_time_s < plain.step_time_s
    # one after the other, the two passes are ops of their own; overlapped, one merged op
    assert not any(sp.category == "forward_backward" for sp in plain.spans)
    assert any(sp.category == "forward_backward" for sp in on.spans)
    assert plain.peak_memory_bytes <= on.peak_memory_bytes  # an overlapped pair holds both layers' buffers


@pytest.mark.parametrize("sets,reason", [
    (["plan.virtual_pipeline_stages=4"], "plan.virtual_pipeline_stages: dualpipev runs exactly 2 virtual stages"),
    (["training.global_batch_size=96"], "plan.schedule: dualpipev needs at least 2 x pp = 8 microbatches, got 6"),
])
def test_dualpipev_rules(sets, reason):
    sc = load_scenario(MIXTRAL, [*DUALPIPEV, *sets])
    assert any(p.startswith(reason) for p in structural_problems(sc)), structural_problems(sc)
    # the overlap is DualPipe's own under dualpipev: no interleaved 1F1B needed
    ok = load_scenario(MIXTRAL, [*DUALPIPEV, ON])
    assert structural_problems(ok) == []
