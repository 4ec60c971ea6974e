"""The Megatron-LM arguments and the torchtitan config that `paraplan plan` writes for its best plan,
checked against the rules those frameworks apply to them (restated here from their sources, cited
at each check) and against the simulated layout."""
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from paraplan.loader import load_scenario
from planner.emit import (
    layers_per_virtual_stage, megatron_args, megatron_args_text, megatron_launch_command, torchtitan_toml,
)
from simulator.layout import layers_per_chunk

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def scenario(name, *overrides):
    return load_scenario(ROOT / "scenarios" / f"{name}.yaml", list(overrides))


def flag_value(args, flag):
    return args[args.index(flag) + 1]


def simulated_virtual_stages(sc):
    """Layers per virtual stage in Megatron's order g = chunk x pp + stage, from the simulator."""
    p = sc.plan
    layers = layers_per_chunk(sc.model.num_layers, p.pp, p.virtual_pipeline_stages, p.first_stage_layers,
                              p.last_stage_layers)
    return [layers[g % p.pp][g // p.pp] for g in range(p.pp * p.virtual_pipeline_stages)]


# -- Megatron-LM: the pipeline split ----------------------------------------------------------------

VPP_FLAGS = ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
             "--pipeline-model-parallel-layout")


def megatron_split(args, num_layers, pp):
    """Megatron-Core's layers per virtual stage for these arguments, following
    megatron/training/arguments.py validate_args and transformer_config.py __post_init__: at most
    one vpp flag; --decoder-first/last-pipeline-num-layers only with --num-virtual-stages-per-
    pipeline-rank (or no vpp) and counted per pipeline rank, divisible by the vpp degree; neither
    with the account-for flags nor with a layout."""
    given = [f for f in VPP_FLAGS if f in args]
    assert len(given) <= 1, given
    uneven = "--decoder-first-pipeline-num-layers" in args or "--decoder-last-pipeline-num-layers" in args
    accounted = "--account-for-embedding-in-pipeline-split" in args
    if "--pipeline-model-parallel-layout" in args:
        assert not uneven and not accounted
        mtp = int(flag_value(args, "--mtp-num-layers")) if "--mtp-num-layers" in args else 0
        return parse_layout(flag_value(args, "--pipeline-model-parallel-layout"), num_layers, mtp)
    if "--num-layers-per-virtual-pipeline-stage" in args:
        assert not uneven, "please use --num-virtual-stages-per-pipeline-rank ... when enable uneven pipeline"
        per = int(flag_value(args, "--num-layers-per-virtual-pipeline-stage"))
        assert num_layers % pp == 0 and (num_layers // pp) % per == 0
        return [per] * (num_layers // per)
    vpp = int(flag_value(args, "--num-virtual-stages-per-pipeline-rank")) if given else 1
    if accounted:
        assert not uneven and "--account-for-loss-in-pipeline-split" in args
        assert (num_layers + 2) % (pp * vpp) == 0
        per = (num_layers + 2) // (pp * vpp)
        return [per - 1] + [per] * (pp * vpp - 2) + [per - 1]
    first = int(flag_value(args, "--decoder-first-pipeline-num-layers")) if uneven else None
    last = (int(flag_value(args, "--decoder-last-pipeline-num-layers"))
            if "--decoder-last-pipeline-num-layers" in args else None)
    ranks = {0: first, pp - 1: last}
    fixed = {r: n for r, n in ranks.items() if n is not None}
    for n in fixed.values():
        assert n > 0, "num_layers_in_first_pipeline_stage must be larger than 0"
        assert n % vpp == 0, "number of layers at first stage must be divisible by virtual pipeline degree"
    rest = (num_layers - sum(fixed.values())) // (pp - len(fixed)) if pp > len(fixed) else 0
    per_rank = [fixed.get(r, rest) for r in range(pp)]
    return [per_rank[g % pp] // vpp for g in range(pp * vpp)]


def parse_layout(layout, num_layers, mtp_layers=0):
    """Transformer layers per stage of a --pipeline-model-parallel-layout string, as
    megatron/core/transformer/pipeline_parallel_layer_layout.py documents it: "(...)*n" and "x*n"
    repeat, "|" ends a stage, E / L / t / m are the embedding, the loss, a transformer layer and a
    multi-token-prediction layer; the embedding opens the first stage, the loss closes the last, and
    validate_layer_layout wants exactly --mtp-num-layers MTP layers, after every decoder layer."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    stages = text.split("|")
    assert set(text) <= set("ELtm|"), layout
    assert stages[0].startswith("E") and stages[-1].endswith("L"), layout
    assert text.count("E") == 1 and text.count("L") == 1 and text.count("t") == num_layers, layout
    assert text.count("m") == mtp_layers and "t" not in text[text.find("m"):] if mtp_layers else True, layout
    return [s.count("t") for s in stages]


SPLITS = [
    ("qwen3-235b-256xh100", []),                                                    # 2 + 30 x 3 + 2, vpp 4
    ("qwen3-235b-256xh100", ["plan.first_stage_layers=3", "plan.last_stage_layers=1"]),
    ("qwen3-235b-256xh100", ["plan.first_stage_layers=1", "plan.last_stage_layers=3"]),
    ("llama3-405b-16384xh100", ["plan.virtual_pipeline_stages=2", "plan.schedule=interleaved-1f1b",
                                "plan.first_stage_layers=3", "plan.last_stage_layers=3"]),
    ("llama3-405b-16384xh100", ["plan.virtual_pipeline_stages=2", "plan.schedule=interleaved-1f1b",
                                "plan.first_stage_layers=2", "plan.last_stage_layers=4"]),
    ("llama3-405b-16384xh100", []),                                                 # 7 + 14 x 8 + 7, vpp 1
    ("deepseek-v3-2048xh800", []),                                                  # 4 + 14 x 4 + 1, vpp 1
    ("deepseek-v3-2048xh800", ["plan.schedule=interleaved-1f1b", "plan.virtual_pipeline_stages=2",
                               "plan.first_stage_layers=1", "plan.last_stage_layers=0",
                               "training.global_batch_size=16384"]),                 # E t | 30 x 2 | m L
    ("mixtral-8x7b-64xh100", []),                                                   # even, vpp 8
    ("qwen3-235b-256xh100", ["plan.pp=32", "plan.virtual_pipeline_stages=3", "plan.ep=8",
                             "plan.first_stage_layers=0", "plan.last_stage_layers=0"]),   # E | 94 x 1 | L
    ("qwen3-235b-256xh100", ["plan.first_stage_layers=0", "plan.last_stage_layers=4"]),   # E | 30 x 3 | 4 L
    ("llama3-405b-16384xh100", ["plan.pp=128", "plan.first_stage_layers=0",
                                "plan.last_stage_layers=0"]),                              # E | 126 x 1 | L, vpp 1
    ("llama3-405b-16384xh100", ["plan.pp=2", "plan.first_stage_layers=0",
                                "plan.last_stage_layers=126"]),                            # E | 126 L
]


@pytest.mark.parametrize("name, overrides", SPLITS, ids=[f"{n}{o}" for n, o in SPLITS])
def test_megatron_builds_the_simulated_layers_per_virtual_stage(name, overrides):
    sc = scenario(name, *overrides)
    assert layers_per_virtual_stage(sc) == simulated_virtual_stages(sc)
    split = megatron_split(megatron_args(sc), sc.model.num_layers, sc.plan.pp)
    assert split == simulated_virtual_stages(sc)


def test_interleaved_embedding_and_loss_split_uses_virtual_stages_per_rank():
    """Qwen3-235B on pp 8 x vpp 4: 94 + embedding + loss = 96 = 32 x 3 (Megatron MoE model zoo)."""
    args = megatron_args(scenario("qwen3-235b-256xh100"))
    assert flag_value(args, "--num-virtual-stages-per-pipeline-rank") == "4"
    assert "--account-for-embedding-in-pipeline-split" in args and "--account-for-loss-in-pipeline-split" in args
    for wrong in ("--num-layers-per-virtual-pipeline-stage", "--decoder-first-pipeline-num-layers",
                  "--decoder-last-pipeline-num-layers"):
        assert wrong not in args


def test_a_stage_with_only_the_embedding_or_the_loss_is_never_a_zero_layer_count():
    """Megatron-Core refuses --decoder-first/last-pipeline-num-layers 0 ("must be larger than 0"):
    the embedding and loss are counted as layers, or the layout is spelled out."""
    accounted = megatron_args(scenario("llama3-405b-16384xh100", "plan.pp=128", "plan.first_stage_layers=0",
                                       "plan.last_stage_layers=0"))
    assert "--account-for-embedding-in-pipeline-split" in accounted
    assert "--num-virtual-stages-per-pipeline-rank" not in accounted      # one virtual stage per rank
    spelled = megatron_args(scenario("llama3-405b-16384xh100", "plan.pp=2", "plan.first_stage_layers=0",
                                     "plan.last_stage_layers=126"))
    assert flag_value(spelled, "--pipeline-model-parallel-layout") == "E|t*126L"
    for args in (accounted, spelled):
        assert "--decoder-first-pipeline-num-layers" not in args and "--decoder-last-pipeline-num-layers" not in args


@pytest.mark.parametrize("kernel, backend", [("flash", "flash"), ("flash3", "fused"), ("unfused", "unfused")])
def test_attention_kernel_becomes_megatrons_attention_backend(kernel, backend):
    args = megatron_args(scenario("llama3-70b-1024xh100", f"training.attention={kernel}"))
    assert flag_value(args, "--attention-backend") == backend


def test_latent_attention_gets_the_fused_backend_transformer_engines_flash_refuses_it():
    """DeepSeek-V3's query/key heads (192) are wider than its value heads (128): TE's
    FlashAttention says it "does not support MLA", and --attention-backend flash leaves nothing."""
    args = megatron_args(scenario("deepseek-v3-2048xh800", "training.attention=flash"))
    assert "--multi-latent-attention" in args and flag_value(args, "--attention-backend") == "fused"


def test_other_interleaved_uneven_splits_spell_out_the_layout():
    args = megatron_args(scenario("qwen3-235b-256xh100", "plan.first_stage_layers=3", "plan.last_stage_layers=1"))
    assert flag_value(args, "--pipeline-model-parallel-layout") == "Et*3|(t*3|)*30tL"


# -- Megatron-LM: experts, FSDP ---------------------------------------------------------------------

def test_moe_arguments_name_the_dispatcher_and_grouped_gemm():
    deepep = megatron_args(scenario("qwen3-235b-256xh100"))
    assert "--moe-grouped-gemm" in deepep
    assert flag_value(deepep, "--moe-token-dispatcher-type") == "flex"
    assert flag_value(deepep, "--moe-flex-dispatcher-backend") == "deepep"
    alltoall = megatron_args(scenario("mixtral-8x7b-64xh100"))
    assert "--moe-grouped-gemm" in alltoall and flag_value(alltoall, "--moe-token-dispatcher-type") == "alltoall"
    assert "--moe-flex-dispatcher-backend" not in alltoall
    assert "--moe-grouped-gemm" in megatron_args(scenario("deepseek-v3-2048xh800"))  # fp8 runs with --bf16


def test_latent_attention_arguments():
    """Megatron-LM's MLA arguments (arguments.py _add_mla_args) carry the model's latent ranks and
    head widths; a model without MLA gets none of them."""
    args = megatron_args(scenario("deepseek-v3-2048xh800"))
    assert "--multi-latent-attention" in args
    assert [flag_value(args, f) for f in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
                                          "--v-head-dim")] == ["1536", "512", "128", "64", "128"]
    assert "--multi-latent-attention" not in megatron_args(scenario("mixtral-8x7b-64xh100"))


def test_shared_expert_overlap_only_where_megatron_runs_it():
    """transformer_config.py: "moe_shared_expert_overlap only works with alltoall token dispatcher"."""
    on = ["plan.moe_shared_expert_overlap=true"]
    sc = scenario("deepseek-v3-2048xh800", *on, "plan.moe_dispatcher=alltoall")
    assert "--moe-shared-expert-overlap" in megatron_args(sc)
    sc = scenario("deepseek-v3-2048xh800", *on)  # deepep
    assert "--moe-shared-expert-overlap" not in megatron_args(sc)
    assert "shared experts" in megatron_args_text(sc)
    assert "--moe-shared-expert-overlap" not in megatron_args(scenario("mixtral-8x7b-64xh100", *on))  # none shared
    off = scenario("deepseek-v3-2048xh800", "plan.moe_dispatcher=alltoall")
    assert "--moe-shared-expert-overlap" not in megatron_args(off)


def test_combined_1f1b_exports():
    """Megatron-Core 0.14's --overlap-moe-expert-parallel-comm, with the CUDA_DEVICE_MAX_CONNECTIONS its
    second stream needs; torchtitan has no such schedule and says so."""
    on = scenario("mixtral-8x7b-64xh100", "plan.overlap_moe_expert_parallel_comm=true")
    assert "--overlap-moe-expert-parallel-comm" in megatron_args(on)
    assert "CUDA_DEVICE_MAX_CONNECTIONS=32 " in megatron_launch_command(on)
    assert "needs Megatron-Core 0.14 or later" in megatron_args_text(on)
    assert "torchtitan has no combined 1F1B" in torchtitan_toml(on)
    off = scenario("mixtral-8x7b-64xh100")
    assert "--overlap-moe-expert-parallel-comm" not in megatron_args(off)
    assert "combined 1F1B" not in torchtitan_toml(off)
    tp2 = scenario("mixtral-8x7b-64xh100", "plan.overlap_moe_expert_parallel_comm=true", "plan.tp=2",
                   "plan.dp=8", "plan.sequence_parallel=true")
    assert "the tensor-parallel collectives may hide less than simulated" in megatron_args_text(tp2)


def test_grouped_gemm_left_out_where_megatron_refuses_it():
    """arguments.py: "Currently GroupedGEMM for MoE only supports bf16 dtype"."""
    sc = scenario("mixtral-8x7b-64xh100", "training.precision=fp32")
    assert "--moe-grouped-gemm" not in megatron_args(sc)
    assert "grouped expert GEMM needs bf16" in megatron_args_text(sc)


@pytest.mark.parametrize("zero, strategy", [(2, "optim_grads"), (3, "optim_grads_params")])
def test_megatron_fsdp_gets_the_flags_megatron_requires(zero, strategy):
    sc = load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml", [f"plan.zero_stage={zero}"])
    args = megatron_args(sc)
    assert "--use-megatron-fsdp" in args and flag_value(args, "--data-parallel-sharding-strategy") == strategy
    assert flag_value(args, "--ckpt-format") == "fsdp_dtensor"  # arguments.py asserts it
    assert "--use-distributed-optimizer" in args and "--no-gradient-accumulation-fusion" in args  # user guide
    assert "env -u CUDA_DEVICE_MAX_CONNECTIONS" in megatron_launch_command(sc)


def test_paraplan_launch_line_rendezvous_on_several_nodes():
    """`paraplan launch CONFIG` alone starts every rank on the node it runs on."""
    from planner.emit import launch_command

    assert launch_command("/o/best_plan.yaml") == "paraplan launch /o/best_plan.yaml"
    assert launch_command("/o/best plan.yaml", 8) == \
        "paraplan launch '/o/best plan.yaml' --nnodes 8 --node-rank \"$NODE_RANK\" --rdzv-endpoint \"$MASTER_ADDR:29500\""


def test_megatron_launch_line_rendezvous_on_several_nodes():
    """torchrun's static defaults (node rank 0, master 127.0.0.1) would make every node node 0."""
    one = megatron_launch_command(load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml"))
    assert "--nnodes 1 --nproc-per-node 8" in one and "--node-rank" not in one
    many = megatron_launch_command(scenario("llama3-70b-1024xh100"))
    assert ('--nnodes 128 --node-rank "$NODE_RANK" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:29500" '
            '--nproc-per-node 8 pretrain_gpt.py') in many


def test_zero1_is_the_distributed_optimizer_alone():
    sc = load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml")  # zero 1, tp 2
    args = megatron_args(sc)
    assert "--use-distributed-optimizer" in args
    assert not {"--use-megatron-fsdp", "--ckpt-format", "--no-gradient-accumulation-fusion"} & set(args)
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 " in megatron_launch_command(sc)  # arguments.py, tp > 1



GRAD_FLAGS = ("--bf16", "--fp16", "--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16")


@pytest.mark.parametrize("precision, grads, flags", [
    ("bf16", "fp32", ["--bf16"]), ("fp16", "fp32", ["--fp16", "--accumulate-allreduce-grads-in-fp32"]),
    ("bf16", "bf16", ["--bf16", "--grad-reduce-in-bf16"]), ("fp16", "fp16", ["--fp16"])])
def test_gradients_are_reduced_in_the_dtype_simulated(precision, grads, flags):
    """Megatron turns fp32 gradient accumulation and reduction on for bf16 by itself (unless
    --grad-reduce-in-bf16), not for fp16."""
    args = megatron_args(scenario("tiny-gpt-8xa100", f"training.precision={precision}",
                                  f"training.grad_reduce_dtype={grads}"))
    assert [a for a in args if a in GRAD_FLAGS] == flags


def test_torchtitan_reduces_in_bf16_under_fsdp_only():
    fsdp = torchtitan_toml(scenario("llama3-8b-64xh100", "training.grad_reduce_dtype=bf16", "plan.zero_stage=3"))
    assert 'mixed_precision_reduce = "bfloat16"' in fsdp and "applies mixed_precision_reduce under FSDP only" not in fsdp
    assert 'mixed_precision_reduce = "float32"' in torchtitan_toml(scenario("llama3-8b-64xh100", "plan.zero_stage=3"))
    replicated = torchtitan_toml(scenario("llama3-8b-64xh100", "training.grad_reduce_dtype=bf16", "plan.zero_stage=0",
                                          "plan.tp=1", "plan.pp=1"))
    assert "data_parallel_shard_degree = 1" in replicated
    assert "applies mixed_precision_reduce under FSDP only" in replicated
    # context parallelism runs FSDP too (torchtitan: fsdp_enabled = dp_shard or cp): the policy applies
    cp = torchtitan_toml(scenario("llama3-8b-64xh100", "training.grad_reduce_dtype=bf16", "plan.zero_stage=0",
                                  "plan.tp=8", "plan.cp=8", "plan.pp=1"))
    assert "context_parallel_degree = 8" in cp and "applies mixed_precision_reduce under FSDP only" not in cp

# -- the suggested launch line gives argparse exactly megatron_args ---------------------------------

def argv_through_launch_line(sc, folder: Path) -> list[str]:
    """Run the file's own Launch line in bash, with torchrun ... pretrain_gpt.py replaced by a
    program that prints the arguments it received."""
    text = megatron_args_text(sc)
    (folder / "megatron_args.txt").write_text(text)
    for name in ("(0)", "(1)", "(,)", "t"):  # files a glob of the values would match
        (folder / name).write_text("")
    launch = next(line for line in text.splitlines() if line.startswith("# Launch: "))[len("# Launch: "):]
    printer = f"{shlex.quote(sys.executable)} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"
    command = re.sub(r"torchrun .*pretrain_gpt\.py", lambda _: printer, launch)
    assert command != launch
    r = subprocess.run(["bash", "-c", command], cwd=folder, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


LAUNCHES = [("deepseek-v3-2048xh800", []), ("qwen3-235b-256xh100", ["plan.first_stage_layers=3",
                                                                     "plan.last_stage_layers=1"]),
            ("llama3-70b-512xh100", []), ("qwen3-235b-256xh100", ["plan.zero_stage=3"])]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("xargs") is None, reason="needs bash and xargs")
@pytest.mark.parametrize("name, overrides", LAUNCHES, ids=[f"{n}{o}" for n, o in LAUNCHES])
def test_launch_line_passes_the_arguments_unchanged(tmp_path, name, overrides):
    sc = scenario(name, *overrides)
    argv = argv_through_launch_line(sc, tmp_path)
    assert argv == megatron_args(sc)
    assert not any(a in ("\\", "'") or a.startswith("'") for a in argv)


def test_arguments_file_has_no_line_continuations():
    text = megatron_args_text(scenario("deepseek-v3-2048xh800"))
    assert not [line for line in text.splitlines() if line.rstrip().endswith("\\")]
    assert "--moe-layer-freq '([0,0,0," in text


# -- torchtitan ------------------------------------------------------------------------------------

def torchtitan_builds(par, world) -> bool:
    """torchtitan/distributed/parallel_dims.py ParallelDims._validate: the degrees multiply to the
    world size; with ep > 1, etp is tp (EP borrows cp and part of dp_shard) or 1 (EP borrows cp, tp
    and part of dp_shard)."""
    dp_r, dp_s, cp, tp, pp = (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"],
                              par["context_parallel_degree"], par["tensor_parallel_degree"],
                              par["pipeline_parallel_degree"])
    ep, etp = par.get("expert_parallel_degree", 1), par.get("expert_tensor_parallel_degree", 1)
    if dp_r * dp_s * cp * tp * pp != world:
        return False
    if ep == 1:
        return True
    if etp == tp:
        return ep % cp == 0 and (dp_s * cp) % ep == 0
    if etp == 1:
        return ep % (cp * tp) == 0 and (dp_s * cp * tp) % ep == 0
    return False


EXPERT_PLANS = [
    ("mixtral-8x7b-64xh100", ["plan.pp=1", "plan.virtual_pipeline_stages=1", "plan.schedule=1f1b"]),  # tp=pp=cp=1
    ("mixtral-8x7b-64xh100", ["plan.pp=1", "plan.virtual_pipeline_stages=1", "plan.schedule=1f1b",
                              "plan.zero_stage=0"]),
    ("mixtral-8x7b-64xh100", []),
    ("qwen3-235b-256xh100", []),
    ("deepseek-v3-2048xh800", []),
]


@pytest.mark.parametrize("name, overrides", EXPERT_PLANS, ids=[f"{n}{o}" for n, o in EXPERT_PLANS])
def test_torchtitan_can_build_the_expert_parallel_mesh(name, overrides):
    sc = scenario(name, *overrides)
    cfg = tomllib.loads(torchtitan_toml(sc))
    par = cfg["parallelism"]
    assert torchtitan_builds(par, sc.plan.world_size)
    assert par["expert_parallel_degree"] == sc.plan.ep
    assert par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] == sc.plan.dp


def test_expert_parallel_zero1_plan_says_its_weights_are_sharded():
    sc = scenario("mixtral-8x7b-64xh100", "plan.pp=1", "plan.virtual_pipeline_stages=1", "plan.schedule=1f1b")
    text = torchtitan_toml(sc)
    par = tomllib.loads(text)["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (1, sc.plan.dp)
    assert "expert parallelism needs FSDP" in text


def test_pure_data_parallel_zero1_plan_says_its_optimizer_is_replicated():
    sc = load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml", ["plan.tp=1", "plan.pp=1", "plan.zero_stage=1"])
    text = torchtitan_toml(sc)
    par = tomllib.loads(text)["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"]) == (sc.plan.dp, 1)
    assert "replicates the optimizer states" in text
    zero0 = torchtitan_toml(load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml",
                                          ["plan.tp=1", "plan.pp=1", "plan.zero_stage=0"]))
    assert "Note:" not in zero0


@pytest.mark.parametrize("zero, pp, policy", [(3, 2, "always"), (3, 1, "always"), (2, 2, "never")])
def test_torchtitan_reshards_as_the_zero_stage_says(zero, pp, policy):
    """torchtitan's "default" is reshard_after_forward = not pp_enabled (llama3 parallelize)."""
    sc = load_scenario(ROOT / "scenarios" / "tiny-gpt-8xa100.yaml", [f"plan.zero_stage={zero}", f"plan.pp={pp}"])
    assert tomllib.loads(torchtitan_toml(sc))["parallelism"]["fsdp_reshard_after_forward"] == policy


def test_zero_bubble_with_one_stage_per_rank_runs_a_single_stage_schedule():
    tiny = ROOT / "scenarios" / "tiny-gpt-8xa100.yaml"
    one = torchtitan_toml(load_scenario(tiny, ["plan.schedule=zero-bubble"]))
    assert tomllib.loads(one)["parallelism"]["pipeline_parallel_schedule"] == "1F1B"
    assert "no zero-bubble schedule for one stage per rank" in one
    two = torchtitan_toml(load_scenario(tiny, ["plan.schedule=zero-bubble", "plan.virtual_pipeline_stages=2",
                                              "plan.micro_batch_size=1"]))
    assert tomllib.loads(two)["parallelism"]["pipeline_parallel_schedule"] == "InterleavedZeroBubble"


def test_fp8_plans_convert_the_linears_and_moe_models_are_not_llama3():
    cfg = tomllib.loads(torchtitan_toml(scenario("deepseek-v3-2048xh800")))  # fp8, MoE
    assert cfg["model"]["converters"] == ["quantize.linear.float8"]
    assert cfg["model"]["name"] != "llama3"
    dense = tomllib.loads(torchtitan_toml(scenario("llama3-70b-512xh100")))
    assert dense["model"]["name"] == "llama3" and "converters" not in dense["model"]
    assert "keys follow torchtitan 0.2" in torchtitan_toml(scenario("llama3-70b-512xh100"))


def test_multi_token_prediction_argument():
    assert flag_value(megatron_args(scenario("deepseek-v3-2048xh800")), "--mtp-num-layers") == "1"
    assert "--mtp-num-layers" not in megatron_args(scenario("deepseek-v3-2048xh800", "model.mtp_layers=0"))


def test_gradient_accumulation_fusion_is_passed_as_simulated():
    """On by default (Megatron's default too); off on request; ZeRO-2/3 plans run Megatron-FSDP,
    which needs it off and gets the flag once, and refuse an explicit `true`."""
    flag = "--no-gradient-accumulation-fusion"
    assert flag not in megatron_args(scenario("tiny-gpt-8xa100"))
    off = scenario("tiny-gpt-8xa100", "plan.gradient_accumulation_fusion=false")
    assert megatron_args(off).count(flag) == 1
    fsdp = scenario("tiny-gpt-8xa100", "plan.zero_stage=3")
    assert not fsdp.plan.fused_grad_accumulation and megatron_args(fsdp).count(flag) == 1
    from simulator.feasibility import structural_problems
    sc = scenario("tiny-gpt-8xa100", "plan.zero_stage=3", "plan.gradient_accumulation_fusion=true")
    assert any(p.startswith("plan.gradient_accumulation_fusion:") for p in structural_problems(sc))


def test_exposed_backward_tp_collectives_are_said_to_be_slower_than_megatron():
    # Megatron-Core's tensor-parallel layers always overlap the backward collectives
    # (LinearWithGradAccumulationAndAsyncCommunication); no argument can ask for the exposed ones
    exposed = megatron_args_text(scenario("gpt3-175b-1024xa100", "plan.tp_backward_overlap=false"))
    assert "tp_backward_overlap: false" in exposed
    assert "tp_backward_overlap" not in megatron_args_text(scenario("gpt3-175b-1024xa100"))
    assert "tp_backward_overlap" not in megatron_args_text(
        scenario("gpt3-175b-1024xa100", "plan.tp_backward_overlap=false", "plan.tp=1"))


def test_torchtitan_config_says_its_backward_tp_collectives_are_not_overlapped():
    note = "reduce-scatters each layer's input gradient after its weight gradient"
    assert note in torchtitan_toml(scenario("gpt3-175b-1024xa100"))
    assert note not in torchtitan_toml(scenario("gpt3-175b-1024xa100", "plan.tp_backward_overlap=false"))
    assert note not in torchtitan_toml(scenario("llama3-8b-64xh100", "plan.tp=1"))


def test_torchtitan_config_says_its_selective_checkpointing_is_another_recompute():
    """torchtitan's op-level policy keeps the attention kernels' outputs, the opposite of the
    attention core Megatron's selective recompute runs again."""
    note = "it keeps the attention kernels' outputs and recomputes every second matmul"
    assert note in torchtitan_toml(scenario("gpt3-175b-1024xa100"))  # recompute: selective (core_attn)
    assert note not in torchtitan_toml(scenario("gpt3-175b-1024xa100", "plan.recompute=full"))


def test_an_irregular_layout_places_the_mtp_layers_last():
    """validate_layer_layout: "Number of mtp layers in layout must match mtp_num_layers", all in the
    last virtual stage after the decoder layers."""
    args = megatron_args(scenario("deepseek-v3-2048xh800", "plan.schedule=interleaved-1f1b",
                                  "plan.virtual_pipeline_stages=2", "plan.first_stage_layers=1",
                                  "plan.last_stage_layers=0", "training.global_batch_size=16384"))
    assert flag_value(args, "--pipeline-model-parallel-layout") == "Et|(t*2|)*30mL"
    assert flag_value(args, "--mtp-num-layers") == "1"


def test_fp8_names_a_recipe_that_recomputes_what_the_plan_recomputes():
    """arguments.py defaults --fp8-recipe to delayed, and transformer_config.py: "Delayed scaling
    does not support moe_act and layernorm recompute for fp8"."""
    args = megatron_args(scenario("qwen3-235b-256xh100", "training.precision=fp8", "plan.recompute=selective",
                                  "plan.recompute_modules=[moe_act, layernorm]"))
    assert flag_value(args, "--fp8-recipe") == "tensorwise"
    assert "--fp8-recipe" not in megatron_args(scenario("qwen3-235b-256xh100"))


def test_moe_act_recompute_left_out_where_megatron_has_no_grouped_gemm():
    """transformer_config.py: "moe_act in recompute_modules is only supported with moe_grouped_gemm",
    and grouped GEMM needs bf16."""
    sc = scenario("mixtral-8x7b-64xh100", "training.precision=fp32", "plan.recompute=selective",
                  "plan.recompute_modules=[moe_act, layernorm]")
    args = megatron_args(sc)
    assert flag_value(args, "--recompute-modules") == "layernorm" and "moe_act" not in args
    assert "keeps those activations" in megatron_args_text(sc)
    only = scenario("mixtral-8x7b-64xh100", "training.precision=fp32", "plan.recompute=selective",
                    "plan.recompute_modules=[moe_act]")
    assert "--recompute-granularity" not in megatron_args(only)
    kept = megatron_args(scenario("mixtral-8x7b-64xh100", "plan.recompute=selective",
                                  "plan.recompute_modules=[moe_act, layernorm]"))
    assert "moe_act" in kept


def test_shared_experts_recompute_with_their_overlap_is_refused_as_megatron_refuses_it():
    """transformer_config.py: "shared_experts recompute cannot work with --moe-shared-expert-overlap"."""
    from simulator.feasibility import structural_problems
    both = scenario("deepseek-v3-2048xh800", "plan.moe_dispatcher=alltoall", "plan.moe_shared_expert_overlap=true",
                    "plan.recompute=selective", "plan.recompute_modules=[shared_experts]")
    assert any(p.startswith("plan.recompute_modules: shared_experts cannot be recomputed")
               for p in structural_problems(both))
    one = scenario("deepseek-v3-2048xh800", "plan.moe_dispatcher=alltoall", "plan.recompute=selective",
                   "plan.recompute_modules=[shared_experts]")
    assert not structural_problems(one)


def test_a_line_break_in_the_scenario_name_stays_inside_the_comments():
    """A name is free text; interpolated into a comment line it must not end the comment."""
    import yaml
    from planner.emit import executor_config_yaml
    from planner.objective import Evaluation

    sc = scenario("tiny-gpt-8xa100", r'name="evil\nplan: {tp: 8}"')
    assert "\n" in sc.name
    args_text = megatron_args_text(sc)
    assert all(line.startswith(("#", "--")) for line in args_text.splitlines() if line), args_text
    tomllib.loads(torchtitan_toml(sc))
    ev = Evaluation(candidate=None, status="ok", step_time_s=1.0, tokens_per_s=1.0, mfu=0.5, peak_memory_bytes=1.0,
                    memory_capacity_bytes=2.0)
    assert yaml.safe_load(executor_config_yaml(sc, ev, launch="paraplan launch 'a\nb'"))["plan"]["tp"] == sc.plan.tp


def test_megatron_fsdp_with_pipeline_parallelism_is_flagged():
    text = megatron_args_text(scenario("llama3-70b-512xh100", "plan.zero_stage=3", "plan.pp=2",
                                       "plan.schedule=1f1b", "plan.virtual_pipeline_stages=1"))
    assert "not with pipeline parallelism" in text
    assert "not with pipeline parallelism" not in megatron_args_text(scenario("llama3-70b-512xh100", "plan.zero_stage=1"))


def test_pp2_with_virtual_stages_says_it_needs_overlapped_pipeline_communication():
    """Megatron-LM's validate_args refuses virtual stages on pp 2 unless its pipeline
    communication is overlapped (on by default since 2024): the arguments say so there only."""
    from planner.emit import megatron_notes

    pp2 = scenario("mixtral-8x7b-64xh100", "plan.pp=2")
    assert pp2.plan.virtual_pipeline_stages > 1
    assert any("--no-overlap-p2p-communication" in n for n in megatron_notes(pp2))
    assert not any("overlap-p2p" in n for n in megatron_notes(scenario("mixtral-8x7b-64xh100")))


def test_torchtitan_says_it_shards_experts_over_tp_at_ep1():
    """torchtitan's apply_moe_ep_tp shards the experts over the TP mesh when there is no EP mesh: an
    ep 1 plan whose expert tp differs from tp says so; one with expert tp = tp does not."""
    from planner.emit import _torchtitan_experts

    replicated = scenario("mixtral-8x7b-64xh100", "plan.tp=2", "plan.ep=1", "plan.sequence_parallel=true")
    assert replicated.plan.expert_tp == 1
    assert any("shards the experts over the tp 2 ranks" in n for n in _torchtitan_experts(replicated)[1])
    sharded = scenario("mixtral-8x7b-64xh100", "plan.tp=2", "plan.ep=1", "plan.expert_tp=2",
                       "plan.sequence_parallel=true")
    assert _torchtitan_experts(sharded)[1] == []


def test_an_fp32_plan_asks_megatron_for_the_unfused_attention():
    """Transformer Engine filters its flash and fused attention out for fp32 q/k/v: with
    --attention-backend flash nothing would be left to run (get_attention_backend)."""
    sc = scenario("tiny-gpt-8xa100", "training.precision=fp32")
    assert flag_value(megatron_args(sc), "--attention-backend") == "unfused"
    assert "Transformer Engine has no fp32 flash attention kernel" in megatron_args_text(sc)
    assert flag_value(megatron_args(scenario("tiny-gpt-8xa100")), "--attention-backend") == "flash"


def test_a_top1_softmax_router_gets_pre_softmax():
    """transformer_config.py raises "Please use --moe-router-pre-softmax when topk is 1" for a softmax router."""
    top1 = megatron_args(scenario("mixtral-8x7b-64xh100", "model.moe.top_k=1"))
    assert "--moe-router-pre-softmax" in top1
    assert "--moe-router-pre-softmax" not in megatron_args(scenario("mixtral-8x7b-64xh100"))
    assert megatron_args(scenario("deepseek-v3-2048xh800")).count("--moe-router-pre-softmax") == 1  # its family's


def test_torchtitan_dualpipev_says_whether_to_overlap_its_expert_parallel_pairs():
    """torchtitan's pipeline_parallel_expert_parallel_overlap defaults to true and refuses activation
    checkpointing: it follows the plan, and is off (with a note) where the plan recomputes."""
    base = ("plan.schedule=dualpipev", "plan.virtual_pipeline_stages=2", "plan.pp=4", "plan.dp=16")
    off = torchtitan_toml(scenario("mixtral-8x7b-64xh100", *base))
    on = torchtitan_toml(scenario("mixtral-8x7b-64xh100", *base, "plan.overlap_moe_expert_parallel_comm=true"))
    recomputing = torchtitan_toml(scenario("mixtral-8x7b-64xh100", *base, "plan.overlap_moe_expert_parallel_comm=true",
                                           "plan.recompute=full"))
    assert "pipeline_parallel_expert_parallel_overlap = false" in off
    assert "pipeline_parallel_expert_parallel_overlap = true" in on
    assert "pipeline_parallel_expert_parallel_overlap = false" in recomputing
    assert "refuses DualPipeV's expert-parallel overlap with activation checkpointing" in recomputing


def test_torchtitan_notes_name_what_it_runs_otherwise():
    dense = torchtitan_toml(scenario("llama3-70b-1024xh100"))
    assert "shards the experts" not in dense  # a dense model has none (the note had been written for tp > 1)
    fp8_moe = torchtitan_toml(scenario("deepseek-v3-2048xh800"))
    assert "routed experts' grouped GEMMs run in bf16" in fp8_moe
    cp = torchtitan_toml(scenario("llama3-8b-64xh100", "plan.cp=2", "plan.dp=32"))
    assert "dK/dV round a ring in fp32" in cp
    assert "--job.config_file" in dense
    te = megatron_args_text(scenario("llama3-8b-64xh100", "training.precision=fp8", "plan.recompute=selective",
                                     "plan.recompute_modules=[core_attn, layernorm]"))
    assert "needs Transformer Engine 2.6 or later" in te


@pytest.mark.parametrize("cp_comm_type, rotate", [("p2p", "alltoall"), ("all_gather", "allgather"),
                                                  ("a2a", "allgather"), ("a2a+p2p", "alltoall")])
def test_the_context_parallel_exchange_reaches_both_configs(cp_comm_type, rotate):
    """plan.cp_comm_type is Megatron's --cp-comm-type in Transformer Engine's spelling (all_gather,
    which TE takes as written) and torchtitan's context_parallel_rotate_method: a ring of shard
    swaps for p2p and a2a+p2p, the all-gather for all_gather and a2a (torchtitan has no head
    scatter, and says so)."""
    sets = ("plan.cp=2", "plan.dp=32", f"plan.cp_comm_type={cp_comm_type}")
    args = megatron_args(scenario("llama3-8b-64xh100", *sets))
    assert args[args.index("--cp-comm-type") + 1] == cp_comm_type
    toml = torchtitan_toml(scenario("llama3-8b-64xh100", *sets))
    assert f'context_parallel_rotate_method = "{rotate}"' in toml
    assert ("no head-scattering (a2a)" in toml) == cp_comm_type.startswith("a2a")
    # hierarchical: [a2a group, ring] as the placement derives them (Llama-3 8B, tp 1, cp 2: a2a over both)
    assert ("--hierarchical-context-parallel-sizes" in args) == (cp_comm_type == "a2a+p2p")
    if cp_comm_type == "a2a+p2p":
        assert args[args.index("--hierarchical-context-parallel-sizes") + 1:][:2] == ["2", "1"]
    assert "--cp-comm-type" not in megatron_args(scenario("llama3-8b-64xh100"))  # cp 1: nothing to say
    assert "context_parallel_rotate_method" not in torchtitan_toml(scenario("llama3-8b-64xh100"))
