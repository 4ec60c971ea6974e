"""The bundled executor on CPU with gloo: every parallelism against a single-process reference.

Each plan trains a tiny model (4 layers, hidden 64) for 3 steps on the same synthetic data as a
one-process run of the same model with the same global batch; the loss of every step must match
the reference within LOSS_ATOL. Most plans use SGD with momentum: unlike Adam its update changes
when a gradient is off by a constant factor (a wrong divisor in a reduction), so that class of bug
shows in the loss. Plans are grouped by world size into one torchrun job each (start-up is
5-11 s per job on 2 cores): world size 1 (references), 2, 4, and one 8-process smoke run.
"""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from executor.config import (  # noqa: E402
    launch_problems, notes, scaled_model, scaled_scenario, scenario_from_json, scenario_to_json,
)
from paraplan.errors import ConfigError  # noqa: E402
from paraplan.specs import (  # noqa: E402
    ClusterSpec, MLASpec, ModelSpec, MoESpec, PlanSpec, RunSpec, Scenario, TrainingSpec,
)

LOSS_ATOL = 1e-5
"""Per-step loss tolerance, fp32 on CPU. Observed differences are about 1e-6 (reduction order); a
router gradient halved on one plan moved its loss by 8e-5."""

DENSE = ModelSpec(name="tiny", num_layers=4, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=16,
                  ffn_hidden_size=128, vocab_size=256, activation="swiglu", dropout=0.0)
TIED = dataclasses.replace(DENSE, name="tiny-tied", activation="gelu", num_kv_heads=4, tied_embeddings=True)
MOE = dataclasses.replace(DENSE, name="tiny-moe", activation="gelu", moe=MoESpec(
    num_experts=4, top_k=2, expert_ffn_hidden_size=64, num_shared_experts=1, first_dense_layers=1))
MOE_CAPACITY = dataclasses.replace(MOE, name="tiny-moe-capacity",
                                   moe=dataclasses.replace(MOE.moe, capacity_factor=1.0, num_shared_experts=0))
MODELS = {"dense": DENSE, "tied": TIED, "moe": MOE, "moe-capacity": MOE_CAPACITY}


def scenario(name: str, model: str = "dense", *, opt: str = "sgd", gbs: int = 8, seq: int = 32, attention: str = "flash",
             **plan) -> Scenario:
    p = PlanSpec(**plan)
    return Scenario(
        name=name, model=MODELS[model],
        cluster=ClusterSpec(gpu="h100-sxm-80gb", num_nodes=1, gpus_per_node=p.world_size),
        training=TrainingSpec(seq_length=seq, global_batch_size=gbs, precision="fp32", optimizer=opt,
                              attention=attention),
        plan=p, run=RunSpec(steps=3, warmup_steps=0, seed=7, backend="gloo", timeout_s=120))


def reference_of(sc: Scenario) -> Scenario:
    """The same model, data and optimizer on one process, the whole batch as one microbatch; with
    an expert capacity, microbatches of the plan's size (capacity is per group of local tokens)."""
    t = sc.training
    mbs = sc.plan.micro_batch_size if sc.model.moe and sc.model.moe.capacity_factor else t.global_batch_size
    return dataclasses.replace(sc, name=f"ref/{sc.model.name}/{t.optimizer}/{t.global_batch_size}x{t.seq_length}/{mbs}",
                               plan=PlanSpec(micro_batch_size=mbs),
                               cluster=dataclasses.replace(sc.cluster, gpus_per_node=1))


# Every parallel dimension and the compositions the planner emits, by world size.
PLANS = {
    2: [
        scenario("dp2-ddp", dp=2, micro_batch_size=2),
        scenario("dp2-zero1-adam", dp=2, micro_batch_size=2, zero_stage=1, opt="adam"),
        scenario("dp2-zero1-sgd", dp=2, micro_batch_size=2, zero_stage=1),
        scenario("dp2-zero2-fsdp", dp=2, micro_batch_size=2, zero_stage=2),
        scenario("dp2-zero3-fsdp", dp=2, micro_batch_size=2, zero_stage=3),
        scenario("dp2-full-recompute", dp=2, micro_batch_size=4, recompute="full"),
        scenario("tp2", tp=2, micro_batch_size=4),
        scenario("tp2-sp-selective", tp=2, micro_batch_size=4, sequence_parallel=True, recompute="selective"),
        scenario("tp2-sp-selective-mlp", tp=2, micro_batch_size=4, sequence_parallel=True, recompute="selective",
                 recompute_modules=("core_attn", "mlp")),
        scenario("pp2-gpipe", pp=2, micro_batch_size=2, schedule="gpipe"),
        scenario("pp2-1f1b", pp=2, micro_batch_size=2, schedule="1f1b"),
        scenario("pp2-interleaved", pp=2, micro_batch_size=2, schedule="interleaved-1f1b", virtual_pipeline_stages=2),
        scenario("pp2-zero-bubble", pp=2, micro_batch_size=2, schedule="zero-bubble"),
        scenario("pp2-zbv", pp=2, micro_batch_size=2, schedule="zbv", virtual_pipeline_stages=2),
        # one microbatch, fewer than pp: PyTorch drops the ops of the 2p - 2 it builds the order for
        scenario("pp2-zbv-one-microbatch", pp=2, micro_batch_size=8, schedule="zbv", virtual_pipeline_stages=2),
        scenario("pp2-dualpipev", pp=2, micro_batch_size=2, schedule="dualpipev", virtual_pipeline_stages=2),
        scenario("cp2", cp=2, micro_batch_size=4),
        # the unfused attention's own mask over the gathered keys, against the fused kernel's reference
        scenario("cp2-unfused", cp=2, micro_batch_size=4, attention="unfused"),
        # DeepSpeed-Ulysses: heads scattered, the sequence gathered, GQA groups kept together
        scenario("cp2-a2a", cp=2, micro_batch_size=4, cp_comm_type="a2a"),
        scenario("cp2-a2a-selective", cp=2, micro_batch_size=4, cp_comm_type="a2a", recompute="selective"),
        scenario("moe-dp2-ddp", "moe", dp=2, micro_batch_size=2),
        scenario("moe-ep2", "moe", dp=2, ep=2, micro_batch_size=2),
        scenario("moe-ep2-zero1-adam", "moe", dp=2, ep=2, micro_batch_size=2, zero_stage=1, opt="adam"),
        scenario("moe-ep2-selective-moe", "moe", dp=2, ep=2, micro_batch_size=2, recompute="selective",
                 recompute_modules=("mlp", "moe")),
        scenario("moe-ep2-selective-shared", "moe", dp=2, ep=2, micro_batch_size=2, recompute="selective",
                 recompute_modules=("shared_experts",)),
        scenario("moe-capacity-ep2", "moe-capacity", dp=2, ep=2, micro_batch_size=2),
        scenario("moe-tp2-sp", "moe", tp=2, micro_batch_size=4, sequence_parallel=True),
        scenario("moe-tp2-sp-ep2", "moe", tp=2, ep=2, micro_batch_size=4, sequence_parallel=True),
        scenario("tied-pp2", "tied", pp=2, micro_batch_size=2),
        scenario("tied-pp2-embedding-stage", "tied", pp=2, micro_batch_size=2, first_stage_layers=0),
        scenario("tied-pp2-zbv-same-rank", "tied", pp=2, micro_batch_size=2, schedule="zbv", virtual_pipeline_stages=2),
    ],
    4: [
        scenario("tp2-dp2-zero1", tp=2, dp=2, micro_batch_size=2, zero_stage=1),
        scenario("tp2-dp2-sp-zero2", tp=2, dp=2, micro_batch_size=2, zero_stage=2, sequence_parallel=True),
        scenario("tp2-dp2-sp-zero3", tp=2, dp=2, micro_batch_size=2, zero_stage=3, sequence_parallel=True),
        scenario("pp2-tp2-sp-1f1b", pp=2, tp=2, micro_batch_size=2, sequence_parallel=True),
        scenario("pp2-tp2-interleaved", pp=2, tp=2, micro_batch_size=1, schedule="interleaved-1f1b",
                 virtual_pipeline_stages=2),
        scenario("pp2-dp2-replicate", pp=2, dp=2, micro_batch_size=2),
        scenario("pp2-dp2-zero1", pp=2, dp=2, micro_batch_size=2, zero_stage=1),
        scenario("pp2-dp2-zero3-zero-bubble", pp=2, dp=2, micro_batch_size=2, zero_stage=3, schedule="zero-bubble"),
        scenario("pp2-dp2-uneven", pp=2, dp=2, micro_batch_size=1, first_stage_layers=1),
        scenario("moe-pp2-ep2", "moe", pp=2, dp=2, ep=2, micro_batch_size=2),
        scenario("moe-dp4-ep2", "moe", dp=4, ep=2, micro_batch_size=1),
        scenario("moe-dp4-ep4-zero2", "moe", dp=4, ep=4, micro_batch_size=1, zero_stage=2),
        scenario("cp2-tp2-sp", cp=2, tp=2, micro_batch_size=2, sequence_parallel=True),
        scenario("cp2-tp2-sp-a2a", "tied", cp=2, tp=2, micro_batch_size=2, sequence_parallel=True, cp_comm_type="a2a"),
        scenario("cp2-dp2-zero3", cp=2, dp=2, micro_batch_size=2, zero_stage=3),
        scenario("moe-cp2-dp2-ep4", "moe", cp=2, dp=2, ep=4, micro_batch_size=2),
        scenario("moe-tp2-sp-dp2-ep2-zero1", "moe", tp=2, dp=2, ep=2, micro_batch_size=2, sequence_parallel=True,
                 zero_stage=1),
        scenario("moe-tp2-sp-dp2-ep4-zero3", "moe", tp=2, dp=2, ep=4, micro_batch_size=2, sequence_parallel=True,
                 zero_stage=3),
        scenario("tied-pp2-tp2", "tied", pp=2, tp=2, micro_batch_size=2),
        # dp x cp = 1: the experts' replicas over the TP ranks are averaged outside any wrapper,
        # which torch's split-backward schedules need
        scenario("moe-pp2-tp2-sp-zero-bubble", "moe", pp=2, tp=2, micro_batch_size=2, sequence_parallel=True,
                 schedule="zero-bubble"),
    ],
    8: [
        scenario("3d-pp2-dp2-tp2", "tied", pp=2, dp=2, tp=2, micro_batch_size=1, sequence_parallel=True, zero_stage=1,
                 schedule="interleaved-1f1b", virtual_pipeline_stages=2, recompute="selective"),
    ],
}
ALL = [sc for group in PLANS.values() for sc in group]

BF16_ATOL = 5e-3
"""bf16 mixed precision against the fp32 reference: observed differences are below 5e-4."""


def _bf16(sc: Scenario) -> Scenario:
    return dataclasses.replace(sc, name=f"bf16-{sc.name}", training=dataclasses.replace(sc.training, precision="bf16"))


def _bf16_grads(sc: Scenario) -> Scenario:
    return dataclasses.replace(sc, training=dataclasses.replace(sc.training, grad_reduce_dtype="bf16"))


# The GPU's mixed-precision code paths (autocast, FSDP2 MixedPrecisionPolicy, bf16 pipeline
# activations, bf16 all-to-all) run on CPU too when asked: one extra job.
BF16_PLANS = [_bf16(sc) for sc in (
    scenario("dp2-zero2", dp=2, micro_batch_size=2, zero_stage=2, opt="adam"),
    scenario("pp2-zbv", pp=2, micro_batch_size=2, schedule="zbv", virtual_pipeline_stages=2, opt="adam"),
    # backward TP collectives exposed, as the executor runs them (no note expected)
    scenario("tp2-sp-dp-none", tp=2, micro_batch_size=2, sequence_parallel=True, tp_backward_overlap=False,
             opt="adam"),
    scenario("moe-ep2", "moe", dp=2, ep=2, micro_batch_size=2, opt="adam"),
)] + [_bf16_grads(_bf16(sc)) for sc in (
    # gradients reduced in bf16 (training.grad_reduce_dtype): DDP's communication hook, FSDP2's reduce_dtype
    scenario("dp2-ddp-bf16-grads", dp=2, micro_batch_size=2, opt="adam"),
    # SGD: a gradient off by a constant factor (the hook's average) changes the losses, which Adam's would not
    scenario("dp2-ddp-bf16-grads-sgd", dp=2, micro_batch_size=2),
    scenario("dp2-zero2-bf16-grads", dp=2, micro_batch_size=2, zero_stage=2, opt="adam"),
)]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Run every plan (and the references) once; {name: measurement}."""
    from executor.launch import launch

    out, refs = {}, {}
    for sc in ALL:
        ref = reference_of(sc)
        refs.setdefault(ref.name, ref)
    jobs = [(1, list(refs.values()))] + [(n, plans) for n, plans in PLANS.items()]
    for nproc, plans in jobs:
        results = launch(plans, nproc=nproc, backend="gloo", timeout_s=120, echo=None, job_timeout_s=900,
                         run_dir=tmp_path_factory.mktemp(f"ws{nproc}"))
        out.update({r["scenario"]: r for r in results})
    results = launch(BF16_PLANS, nproc=2, backend="gloo", timeout_s=120, echo=None, job_timeout_s=900,
                     run_dir=tmp_path_factory.mktemp("bf16"), cpu_bf16=True)
    out.update({r["scenario"]: r for r in results})
    return out


@pytest.mark.parametrize("sc", ALL, ids=[sc.name for sc in ALL])
def test_loss_matches_single_process(measured, sc):
    got = [s["loss"] for s in measured[sc.name]["steps"]]
    want = [s["loss"] for s in measured[reference_of(sc).name]["steps"]]
    assert len(got) == 3
    assert got == pytest.approx(want, abs=LOSS_ATOL), f"{sc.name}: {got} vs reference {want}"
    assert got[0] != got[-1]  # it trained


@pytest.mark.parametrize("sc", BF16_PLANS, ids=[sc.name for sc in BF16_PLANS])
def test_bf16_mixed_precision_path(measured, sc):
    m = measured[sc.name]
    # these plans run without warm-up, so only the memory tracker's timing note may appear, and with
    # bf16 gradient reduction the note that the executor still holds the gradients in fp32
    expected = ["training.grad_reduce_dtype bf16: gradients are reduced in bf16 but accumulated and held in fp32"] \
        if sc.training.grad_reduce_dtype == "bf16" else []
    other = [n for n in m["notes"] if "CPU memory tracker" not in n]
    assert m["compute_dtype"] == "bf16" and [n[:len(e)] for n, e in zip(other, expected)] == expected
    assert len(other) == len(expected)
    got = [s["loss"] for s in m["steps"]]
    want = [s["loss"] for s in measured[reference_of(sc).name]["steps"]]  # the fp32 reference
    assert got == pytest.approx(want, abs=BF16_ATOL)
    assert got != pytest.approx(want, abs=1e-6)  # it did run in bf16


def test_each_plan_runs_as_written(measured):
    m = measured
    assert m["dp2-ddp"]["data_parallel"] == "ddp"
    assert m["tp2-dp2-zero1"]["data_parallel"] == "replicate"
    assert m["dp2-zero3-fsdp"]["data_parallel"] == "fsdp"
    assert m["tp2"]["data_parallel"] == "none"
    run = m["pp2-dp2-zero3-zero-bubble"]
    assert run["zero_stage_run"] == 2 and any("ZeRO-2" in n for n in run["notes"])
    assert m["dp2-zero3-fsdp"]["zero_stage_run"] == 3
    # stages on ranks: the loop layout for interleaved, the V layout for zbv
    assert [r["stages"] for r in m["pp2-interleaved"]["ranks"]] == [[0, 2], [1, 3]]
    assert [r["stages"] for r in m["pp2-zbv"]["ranks"]] == [[0, 3], [1, 2]]
    assert [r["layers"] for r in m["pp2-dp2-uneven"]["ranks"] if r["coords"]["dp"] == 0] == [[[0]], [[1, 2, 3]]]


def test_ranks_agree_with_the_placement(measured):
    from paraplan.placement import rank_to_coords

    for name in ("3d-pp2-dp2-tp2", "cp2-tp2-sp", "moe-cp2-dp2-ep4", "moe-tp2-sp-dp2-ep2-zero1"):
        m = measured[name]
        sc = next(s for s in ALL if s.name == name)
        block = sc.plan.tp * sc.plan.cp * sc.plan.dp
        for r in m["ranks"]:
            assert r["coords"] == vars(rank_to_coords(r["rank"], sc.plan))
            # MoE parallel folding: an EP group is ep consecutive ranks of the stage
            assert r["ep_rank"] == (r["rank"] % block) % sc.plan.ep


def test_memory_categories(measured):
    def mem(name, key):
        return [r["memory"][key] for r in measured[name]["ranks"]]

    for name in ("dp2-ddp", "tp2", "pp2-1f1b", "dp2-zero3-fsdp"):
        for r in measured[name]["ranks"]:
            mm = r["memory"]
            assert mm["source"] == "live-tensor-tracker"
            assert mm["peak_total"] >= mm["parameters"] + mm["gradients"] + mm["optimizer_states"] > 0
    full = mem("dp2-ddp", "parameters")[0]
    # SGD with momentum: one state per parameter; ZeRO-1 halves it over dp = 2
    assert mem("dp2-ddp", "optimizer_states")[0] == full
    assert sum(mem("dp2-zero1-sgd", "optimizer_states")) == pytest.approx(full, rel=0.01)
    # element-wise slices: each rank holds half, the embedding's states included (whole-parameter
    # assignment, as ZeroRedundancyOptimizer does, would leave one rank most of them)
    assert mem("dp2-zero1-sgd", "optimizer_states") == [pytest.approx(full / 2, rel=0.01)] * 2
    # ZeRO-3 (FSDP2) keeps only its shard of the parameters and gradients between steps
    assert mem("dp2-zero3-fsdp", "parameters")[0] == pytest.approx(full / 2, rel=0.01)
    assert mem("dp2-zero3-fsdp", "gradients")[0] == pytest.approx(full / 2, rel=0.01)
    # pipeline stages hold their layers only
    assert sum(mem("pp2-1f1b", "parameters")) == pytest.approx(full, rel=0.01)


def test_expert_token_counts(measured):
    m = measured["moe-ep2"]
    # every token of every step goes to top_k = 2 experts in each of the 3 MoE layers (layer 0 is dense)
    assert sorted(m["tokens_per_expert"]) == ["1", "2", "3"]
    tokens = m["tokens_per_step"] * len(m["steps"])
    for counts in m["tokens_per_expert"].values():
        assert len(counts) == 4 and sum(counts) == 2 * tokens
    assert measured["moe-tp2-sp"]["tokens_per_expert"] == measured["moe-ep2"]["tokens_per_expert"]
    # the router's demand is counted before the capacity drops
    m = measured["moe-capacity-ep2"]
    assert all(sum(c) == 2 * m["tokens_per_step"] * 3 for c in m["tokens_per_expert"].values())


def test_measurement_has_the_documented_keys(measured):
    m = measured["pp2-1f1b"]
    for key in ("scenario", "model", "plan", "training", "run", "parameters", "world_size", "backend", "device",
                "compute_dtype", "notes", "num_microbatches", "tokens_per_step", "steps", "step_time_s",
                "tokens_per_s", "peak_memory_bytes", "ranks"):
        assert key in m
    assert m["steps"][0].keys() >= {"step", "warmup", "time_s", "loss", "tokens_per_s"}
    assert m["ranks"][0].keys() >= {"rank", "coords", "stages", "step_times_s", "memory"}
    assert m["step_time_s"] > 0 and m["tokens_per_s"] == pytest.approx(m["tokens_per_step"] / m["step_time_s"])


# ----------------------------------------------------------------------------------------------
# No processes: model fidelity, scale-down, refusals, the wire format


def test_parameter_count_matches_the_model_spec():
    from executor.model import Stage, count_parameters

    for spec in (DENSE, TIED, dataclasses.replace(DENSE, activation="gelu", num_kv_heads=1),
                 dataclasses.replace(DENSE, activation="gelu", linear_bias=True),  # LayerNorms with biases
                 dataclasses.replace(DENSE, linear_bias=True)):  # biased linears, RMSNorm-style norms without
        with torch.device("meta"):
            stage = Stage(spec, range(spec.num_layers), first=True, last=True)
        assert sum(p.numel() for p in stage.parameters()) == spec.total_params() == count_parameters(spec)
    with torch.device("meta"):
        stage = Stage(MOE, range(MOE.num_layers), first=True, last=True)
    assert sum(p.numel() for p in stage.parameters()) == count_parameters(MOE)


def test_stages_hold_exactly_the_single_process_weights():
    from executor.model import Stage, init_parameters

    whole = Stage(MOE, range(4), first=True, last=True)
    init_parameters(whole, seed=3)
    first = Stage(MOE, range(2), first=True, last=False)
    init_parameters(first, seed=3)
    for name, p in first.named_parameters():
        assert torch.equal(p, whole.get_parameter(name)), name
    # an EP rank's experts are the full model's experts [2, 4)
    from executor.moe import MoE

    last = Stage(MOE, range(2, 4), first=False, last=True)
    for b in last.layers.values():
        if isinstance(b.ffn, MoE):
            b.ffn.shard_experts(None, 2, 1)
    init_parameters(last, seed=3, expert_offset=2)
    assert torch.equal(last.layers["3"].ffn.experts.w1, whole.layers["3"].ffn.experts.w1[2:])


def test_scale_down_keeps_head_dim_and_ratios():
    big = ModelSpec(name="llama", num_layers=80, hidden_size=8192, num_attention_heads=64, num_kv_heads=8,
                    head_dim=128, ffn_hidden_size=28672, vocab_size=128256, activation="swiglu")
    small = scaled_model(big, RunSpec(num_layers=4, hidden_size=1024))
    assert (small.num_layers, small.hidden_size, small.head_dim) == (4, 1024, 128)
    assert (small.num_attention_heads, small.num_kv_heads, small.ffn_hidden_size) == (8, 1, 3584)
    assert small.vocab_size == big.vocab_size and "scaled" in small.name
    assert scaled_model(big, RunSpec()) is big
    with pytest.raises(ConfigError, match="run.hidden_size: 1000 gives 7.8125 attention heads"):
        scaled_model(big, RunSpec(hidden_size=1000))
    with pytest.raises(ConfigError, match="kv heads"):
        scaled_model(big, RunSpec(hidden_size=512))  # 4 heads, 0.5 kv heads


def test_executor_refusals():
    def problems(**kw):
        model = kw.pop("model", DENSE)
        training = kw.pop("training", {})
        sc = scenario("x", **kw)
        sc = dataclasses.replace(sc, model=model, training=dataclasses.replace(sc.training, **training))
        return " | ".join(launch_problems(sc))

    assert problems(dp=2) == ""
    assert "plan.schedule: dualpipev needs at least 2 x pp = 4 microbatches, got 2" in problems(
        pp=2, schedule="dualpipev", virtual_pipeline_stages=2, micro_batch_size=4)  # the simulator's check
    assert "zbv runs exactly 2 virtual stages per rank" in problems(pp=2, schedule="zbv")  # the simulator's check
    assert "5 microbatches to be a multiple of 2 rounds" in problems(pp=2, schedule="zero-bubble", micro_batch_size=1,
                                                                    virtual_pipeline_stages=1, gbs=5)
    assert "not one of gpipe" in problems(schedule="zb1p")
    assert "training.precision: the executor trains in fp32 or bf16, not fp8" in problems(training={"precision": "fp8"})
    assert "plan.ep: expert parallelism needs an MoE model" in problems(dp=2, ep=2)
    assert "plan.ep: ep x expert_tp = 3 x 1 does not divide the 2 ranks" in problems(dp=2, ep=3, model=MOE)
    assert "plan.sequence_parallel: MoE with tp > 1 needs sequence_parallel" in problems(tp=2, model=MOE)
    assert "plan.expert_tp" in problems(expert_tp=2)
    assert "plan.tp_comm_overlap" in problems(tp=2, sequence_parallel=True, tp_comm_overlap=True)
    # what the executor would run differently from the plan it was given: refused, not mis-measured
    assert "plan.moe_dispatcher: the executor dispatches tokens with torch's all-to-all, not deepep's" in problems(
        dp=2, ep=2, model=MOE, moe_dispatcher="deepep")
    assert "plan.moe_dispatcher: deepep needs ep x expert_tp > 1" in problems(dp=2, ep=1, model=MOE,
                                                                             moe_dispatcher="deepep")
    assert "plan.moe_shared_expert_overlap: the executor runs the shared experts after the combine" in problems(
        dp=2, ep=2, model=MOE, moe_shared_expert_overlap=True)
    assert "plan.overlap_moe_expert_parallel_comm: the executor runs each forward and backward whole" in problems(
        dp=2, ep=2, model=MOE, overlap_moe_expert_parallel_comm=True, training={"precision": "bf16"})
    assert "does not recompute layernorm, moe_act" in problems(
        dp=2, model=MOE, recompute="selective", recompute_modules=("layernorm", "moe_act", "moe"))
    assert problems(dp=2, model=MOE, recompute="selective", recompute_modules=("core_attn", "mlp", "shared_experts")) == ""
    mla = dataclasses.replace(DENSE, mla=MLASpec(q_lora_rank=None, kv_lora_rank=16, qk_head_dim=DENSE.head_dim,
                                                 qk_rope_head_dim=8, v_head_dim=DENSE.head_dim))
    assert "model.mla: the executor implements multi-head and grouped-query attention" in problems(dp=2, model=mla)
    assert "model.mtp_layers: the executor has no multi-token prediction" in problems(
        dp=2, model=dataclasses.replace(DENSE, mtp_layers=1))
    assert "plan.cp_comm_type: the executor has no hierarchical context parallelism" in problems(
        cp=2, cp_comm_type="a2a+p2p")
    assert problems(cp=2, cp_comm_type="a2a") == problems(cp=2, cp_comm_type="all_gather") == ""
    assert "model.head_dim: the executor's rotary position embedding needs an even head_dim, got 15" in problems(
        dp=2, model=dataclasses.replace(DENSE, head_dim=15))


def test_zero3_under_zero_bubble_is_said():
    sc = scenario("x", pp=2, dp=2, zero_stage=3, schedule="zbv", virtual_pipeline_stages=2)
    assert any("ZeRO-2" in n for n in notes(sc, on_gpu=True))
    plain = notes(scenario("x", pp=2, dp=2, zero_stage=3, schedule="1f1b"), on_gpu=True)
    assert not any("ZeRO-2" in n for n in plain)
    # PyTorch's pipeline stages sync FSDP2's gradients on the last microbatch only
    assert any(n.startswith("zero_stage 3 under a pipeline: PyTorch's pipeline stages reduce-scatter") for n in plain)
    assert not any("under a pipeline" in n for n in notes(scenario("x", dp=2, zero_stage=3), on_gpu=True))


def test_zero1_all_reduce_is_said():
    said = notes(scenario("x", dp=2, zero_stage=1), on_gpu=True)
    assert any(n.startswith("zero_stage 1: the executor all-reduces the gradients") for n in said)
    assert not any("all-reduces" in n for n in notes(scenario("x", dp=2), on_gpu=True))


def test_overlapped_backward_tp_collectives_are_said_to_run_exposed():
    assert any("plan.tp_backward_overlap" in n for n in notes(scenario("x", tp=2), on_gpu=True))
    assert not notes(scenario("x", tp=2, tp_backward_overlap=False), on_gpu=True)
    assert not notes(scenario("x", dp=2), on_gpu=True)  # no TP, nothing to overlap


def test_forward_sends_the_executors_interleaved_schedule_does_not_wait_for_are_said():
    interleaved = scenario("x", pp=2, schedule="interleaved-1f1b", virtual_pipeline_stages=2)
    assert any(n.startswith("plan.wait_forward_sends:") for n in notes(interleaved, on_gpu=True))
    unblocked = scenario("x", pp=2, schedule="interleaved-1f1b", virtual_pipeline_stages=2, wait_forward_sends=False)
    assert not any("wait_forward_sends" in n for n in notes(unblocked, on_gpu=True))
    assert not any("wait_forward_sends" in n for n in notes(scenario("x", pp=2, schedule="1f1b"), on_gpu=True))


def test_dropout_the_executor_does_not_run_is_said():
    sc = scenario("x", dp=2)
    with_dropout = dataclasses.replace(sc, model=dataclasses.replace(sc.model, dropout=0.1))
    assert notes(with_dropout, on_gpu=True) == ["model.dropout 0.1: the executor trains without dropout"]


def test_the_ring_the_executor_runs_as_an_all_gather_is_said():
    """plan.cp_comm_type p2p runs as the executor's all-gather (said, with the key that predicts it);
    all_gather and a2a run as written."""
    ring = scenario("cp2", cp=2, micro_batch_size=4)
    assert any("plan.cp_comm_type p2p" in n for n in notes(ring, on_gpu=False))
    for kind in ("all_gather", "a2a"):
        sc = scenario("cp2", cp=2, micro_batch_size=4, cp_comm_type=kind)
        assert not any("cp_comm_type" in n for n in notes(sc, on_gpu=False))
    assert not any("cp_comm_type" in n for n in notes(scenario("dp2", dp=2), on_gpu=False))


def test_linear_biases_the_executor_does_not_build_are_said():
    sc = scenario("x", dp=2)
    assert not any("linear_bias" in n for n in notes(sc, on_gpu=True))
    biased = dataclasses.replace(sc, model=dataclasses.replace(sc.model, linear_bias=True))
    assert notes(biased, on_gpu=True) == ["model.linear_bias: the executor's linear layers have no biases; "
                                         "model.linear_bias: false predicts it"]


def test_scenario_round_trip():
    sc = scaled_scenario(scenario("x", "moe", dp=2, ep=2))
    assert scenario_from_json(scenario_to_json(sc)) == sc
    from pathlib import Path

    from paraplan.loader import load_scenario  # every nested spec comes back typed, latent attention's too
    mla = load_scenario(Path(__file__).resolve().parents[1] / "scenarios" / "deepseek-v3-2048xh800.yaml")
    assert scenario_from_json(scenario_to_json(mla)) == mla


def test_synthetic_data_is_deterministic_and_split_by_rank():
    from executor.data import global_batch, local_batch

    a = global_batch(seed=1, step=2, batch=4, seq=16, vocab=50)
    assert torch.equal(a, global_batch(seed=1, step=2, batch=4, seq=16, vocab=50))
    assert not torch.equal(a, global_batch(seed=1, step=3, batch=4, seq=16, vocab=50))
    assert a.shape == (4, 17) and int(a.max()) < 50
    x, y = local_batch(a, dp=2, dp_rank=1, positions=torch.tensor([0, 1, 14, 15]))
    assert torch.equal(x, a[2:, [0, 1, 14, 15]]) and torch.equal(y, a[2:, [1, 2, 15, 16]])


def test_stage_layout():
    from executor.parallel import stage_layers, stages_of_rank

    sc = scenario("x", pp=2, dp=2, micro_batch_size=1, first_stage_layers=1)
    assert stage_layers(sc) == [range(0, 1), range(1, 4)]
    sc = scenario("x", pp=2, micro_batch_size=1, first_stage_layers=0)      # the embedding alone
    assert stage_layers(sc) == [range(0, 0), range(0, 4)]
    sc = scenario("x", pp=2, schedule="interleaved-1f1b", virtual_pipeline_stages=2, micro_batch_size=2)
    assert stage_layers(sc) == [range(i, i + 1) for i in range(4)]
    assert [stages_of_rank(r, sc) for r in (0, 1)] == [[0, 2], [1, 3]]
    sc = scenario("x", pp=2, schedule="dualpipev", virtual_pipeline_stages=2, micro_batch_size=1)
    assert [stages_of_rank(r, sc) for r in (0, 1)] == [[0, 3], [1, 2]]


@pytest.mark.parametrize("schedule,first", [("zbv", None), ("zbv", 1), ("dualpipev", None), ("dualpipev", 1),
                                            ("interleaved-1f1b", None), ("interleaved-1f1b", 1)])
def test_each_rank_builds_the_layers_the_simulator_placed_on_it(schedule, first):
    from executor.parallel import stage_layers, stages_of_rank
    from simulator.layout import layers_per_chunk
    from simulator.schedules import v_shaped

    sc = scenario("x", "dense", pp=2, schedule=schedule, virtual_pipeline_stages=2, micro_batch_size=1,
                  first_stage_layers=first, last_stage_layers=first)
    sc = dataclasses.replace(sc, model=dataclasses.replace(sc.model, num_layers=8 if first is None else 6))
    p = sc.plan
    simulated = layers_per_chunk(sc.model.num_layers, p.pp, 2, first, first, v_shaped(p))
    built = [[len(stage_layers(sc)[g]) for g in stages_of_rank(r, sc)] for r in range(p.pp)]
    assert built == simulated
    if first is not None:  # 1 + 2 + 2 + 1: in a V rank 0 holds both short ends, in a loop one of them
        assert simulated == ([[1, 1], [2, 2]] if schedule in ("zbv", "dualpipev") else [[1, 2], [2, 1]])


def test_zero1_shards_are_balanced_to_the_element():
    """ShardedOptimizer's slices: equal sizes however large one parameter is (no processes needed
    beyond a one-rank group)."""
    import torch.distributed as dist

    from executor.optim import SGD, ShardedOptimizer

    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        params = [torch.nn.Parameter(torch.ones(1000)), torch.nn.Parameter(torch.ones(3))]
        opt = ShardedOptimizer([(params, dist.group.WORLD)], "sgd", fused=False)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        want = 1 - SGD["lr"]  # one SGD step on a gradient of ones
        assert torch.allclose(params[0], torch.full((1000,), want)) and torch.allclose(params[1], torch.full((3,), want))
    finally:
        dist.destroy_process_group()


def test_bf16_all_reduce_hook_rounds_the_bucket_to_bf16():
    """The DDP hook of training.grad_reduce_dtype bf16: the fp32 bucket comes back as its bf16
    rounding averaged over the group (one rank here), written into the bucket's own buffer."""
    import torch.distributed as dist

    from executor.parallel import _bf16_all_reduce  # noqa: PLC2701

    class Bucket:
        def __init__(self, t):
            self.t = t

        def buffer(self):
            return self.t

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        grads = torch.tensor([1.0 + 2**-10, 3.0, -0.1])
        out = _bf16_all_reduce(dist.group.WORLD, Bucket(grads)).wait()
        assert out is grads and out.dtype == torch.float32
        assert torch.equal(out, torch.tensor([1.0 + 2**-10, 3.0, -0.1]).to(torch.bfloat16).float())
        assert out[0].item() == 1.0  # 1 + 2^-10 is below bf16's resolution at 1
    finally:
        dist.destroy_process_group()


def test_selective_recompute_modules_reach_the_blocks():
    from executor.model import Stage

    st = Stage(MOE, range(MOE.num_layers), first=True, last=True)
    st.set_recompute("selective", ("mlp", "shared_experts"))
    dense, moe = st.layers["0"], st.layers["1"]
    assert dense.ffn_recompute and not moe.ffn_recompute and moe.ffn.shared_recompute
    assert not dense.attn.selective_recompute and not dense.full_recompute
    st.set_recompute("selective", ("core_attn", "moe"))
    assert not dense.ffn_recompute and moe.ffn_recompute and not moe.ffn.shared_recompute
    assert dense.attn.selective_recompute
    st.set_recompute("full")
    assert dense.full_recompute and not dense.ffn_recompute and not dense.attn.selective_recompute


def test_older_torch_is_held_to_what_was_checked_on_it(monkeypatch):
    """PyTorch 2.11 is the floor (every equivalence plan matched on it); its V-schedule start-up
    sends a rank's first message to itself, which gloo cannot do: refused there, NCCL allowed."""
    import importlib.metadata

    from executor.config import executor_problems
    from paraplan.cli.torch_check import require_torch
    from paraplan.errors import ParaplanError

    zbv = scenario("pp2-zbv", pp=2, micro_batch_size=2, schedule="zbv", virtual_pipeline_stages=2)
    for version, refused in (("2.11.0+cu130", True), ("2.13.0", False)):
        monkeypatch.setattr(importlib.metadata, "version", lambda name, v=version: v)
        gloo = [r for r in executor_problems(zbv) if "on gloo needs PyTorch >= 2.13" in r]
        assert bool(gloo) is refused, (version, gloo)
        nccl = dataclasses.replace(zbv, run=dataclasses.replace(zbv.run, backend="nccl"))
        assert not [r for r in executor_problems(nccl) if "on gloo" in r]
        require_torch("the executor")  # 2.11 and 2.13 both pass the floor
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.10.1")
    with pytest.raises(ParaplanError, match=r"the executor needs PyTorch >= 2.11, found 2.10.1"):
        require_torch("the executor")


def test_the_test_optimizer_runs_its_plain_loop():
    """SGD (the equivalence tests' optimizer) without foreach or fused kernels: 2.11's in-place
    foreach ops skip a Partial DTensor gradient, and fused SGD has no DTensor strategy."""
    from executor.optim import make_optimizer

    opt = make_optimizer([torch.nn.Parameter(torch.ones(3))], "sgd", fused=True)
    assert opt.defaults["foreach"] is False and not opt.defaults.get("fused")
    adam = make_optimizer([torch.nn.Parameter(torch.ones(3))], "adam", fused=False)
    assert adam.defaults["foreach"] is True


def test_moe_weights_each_copy_inside_the_expert_activation():
    """As Megatron-Core's TEGroupedMLP: the probability scales the activation before the down
    projection (the same product as scaling the output: no bias), and its gradient reaches it."""
    from executor.moe import GroupedExperts

    torch.manual_seed(0)
    ex = GroupedExperts(2, 8, 16, "swiglu")
    for w in (ex.w1, ex.w2, ex.w3):
        torch.nn.init.normal_(w, std=0.1)
    x = torch.randn(5, 8)
    p = torch.rand(5, requires_grad=True)
    inside = ex(x, torch.tensor([3, 2]), p)
    outside = ex(x, torch.tensor([3, 2]), torch.ones(5)) * p[:, None]
    assert torch.allclose(inside, outside, atol=1e-6)
    inside.sum().backward()
    assert p.grad is not None and p.grad.abs().sum() > 0


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_expert_gemms_match_one_gemm_per_expert(activation):
    """The grouped-GEMM path (rows padded per expert, an expert with no tokens among them) computes
    what one GEMM per expert does, forward and every gradient; widths without 16-byte strides fall
    back to the per-expert GEMMs."""
    from executor.moe import GroupedExperts

    torch.manual_seed(0)
    ex = GroupedExperts(4, 16, 24, activation)
    for w in ex.parameters():
        torch.nn.init.normal_(w, std=0.2)
    assert ex.grouped_gemm(torch.device("cpu"), torch.float32)
    counts = torch.tensor([5, 0, 9, 3])
    x = torch.randn(17, 16, requires_grad=True)
    p = torch.rand(17, requires_grad=True)
    g = torch.randn(17, 16)
    params = [x, p, *ex.parameters()]
    grouped = ex(x, counts, p)
    looped = ex._per_expert(x, counts.tolist(), p)
    assert torch.allclose(grouped, looped, atol=1e-5)
    for a, b in zip(torch.autograd.grad(grouped, params, g), torch.autograd.grad(looped, params, g)):
        assert torch.allclose(a, b, atol=1e-5)
    assert not GroupedExperts(2, 16, 6, activation).grouped_gemm(torch.device("cpu"), torch.float32)


@pytest.mark.gpu
def test_a_dropless_moe_layer_never_makes_the_host_wait_on_a_gpu():
    """Without a capacity factor and with EP 1 nothing in the MoE layer reads a GPU value on the host
    (CUDA's bincount and a list of counts both did, every layer)."""
    from executor.moe import MoE

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("needs a Hopper or Blackwell GPU")
    spec = dataclasses.replace(MOE, hidden_size=64, moe=dataclasses.replace(MOE.moe, expert_ffn_hidden_size=128))
    layer = MoE(spec).cuda()
    x = torch.randn(2, 16, 64, device="cuda", requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.float().square().sum().backward()

    step()  # the first call moves the token counter to the GPU, once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert x.grad is not None and int(layer.tokens_per_expert.sum()) == 2 * 2 * 16 * spec.moe.top_k


def test_group_limited_routing_keeps_each_token_in_its_chosen_groups():
    """DeepSeek-V3's node-limited routing: a token picks groups_per_token groups (by the sum of
    their two highest probabilities), then its top-k among their experts only."""
    from executor.moe import MoE

    spec = dataclasses.replace(MOE, moe=dataclasses.replace(MOE.moe, num_experts=8, top_k=2, expert_groups=4,
                                                            groups_per_token=1))
    torch.manual_seed(0)
    layer = MoE(spec)
    probs = torch.softmax(layer.router(torch.randn(64, spec.hidden_size)), dim=-1)
    limited = layer._limit_groups(probs)
    _, experts = limited.topk(2, dim=-1)
    assert bool(((experts // 2)[:, 0] == (experts // 2)[:, 1]).all())  # both experts in one group of 2
    best = probs.view(64, 4, 2).sum(dim=-1).argmax(dim=-1)  # groups of 2: the top-2 sum is the group's sum
    assert torch.equal(experts[:, 0] // 2, best)
    unlimited = probs[:, :4]
    assert MoE(MOE)._limit_groups(unlimited) is unlimited
    for w in layer.parameters():
        torch.nn.init.normal_(w, std=0.1)
    layer(torch.randn(2, 8, spec.hidden_size)).sum().backward()  # the masked routing still trains the router
    assert layer.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("gathered", [False, True])
def test_unfused_attention_computes_what_the_fused_kernel_does(gathered):
    """training.attention unfused: QK^T, a masked fp32 softmax and AV as ops of their own, the same
    values and gradients as torch's fused kernel, with the causal mask or a context-parallel one."""
    from executor.model import _core_attention  # noqa: PLC2701

    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 16, requires_grad=True) for _ in range(2))  # GQA: 2 kv heads
    mask = None
    if gathered:  # this rank's positions against the gathered keys' (executor.model._cp_gather_kv)
        mine, theirs = torch.tensor([0, 1, 6, 7, 2, 3, 4, 5]), torch.arange(8)
        mask = mine[:, None] >= theirs[None, :]
    outs = [_core_attention(q, k, v, mask, unfused) for unfused in (False, True)]
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    grads = [torch.autograd.grad(o.square().sum(), (q, k, v)) for o in outs]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-4)
