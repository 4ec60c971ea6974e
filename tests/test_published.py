"""How published records become scenarios: null fields filled from the sources' launch scripts."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from paraplan.loader import load_scenario
from paraplan.published import _precision, launch_script_settings, published_step_time, record_to_scenario  # noqa: PLC2701

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def records():
    recs = yaml.safe_load((ROOT / "paraplan" / "data" / "public_runs.yaml").read_text())
    return {r["id"]: r for r in recs}


def test_every_launch_script_entry_names_a_bundled_record_whose_field_is_null(records):
    settings = launch_script_settings()
    assert settings
    for rid, s in settings.items():
        rec = records[rid]
        if "micro_batch_size" in s:
            assert rec["batch"]["micro_batch_size"] is None, rid
        if "layers_per_virtual_stage" in s:
            assert rec["parallelism"]["virtual_pipeline_stages"] is None, rid
            per_chunk = rec["parallelism"]["pp"] * s["layers_per_virtual_stage"]
            assert rec["model"]["num_layers"] % per_chunk == 0, rid


def test_sc21_rows_run_the_authors_micro_batches_virtual_stages_and_ddp(records):
    small = record_to_scenario(records["megatron_sc21_t1_1.7B"])["plan"]
    assert small["micro_batch_size"] == 16 and small["overlap_grad_reduce"] is True  # --DDP-impl torch
    assert small["virtual_pipeline_stages"] == 1 and small["schedule"] == "1f1b"
    big = record_to_scenario(records["megatron_sc21_t1_76.1B"])["plan"]
    # 60 layers, pp 4, 5 layers per virtual stage -> 3 chunks per stage
    assert big["micro_batch_size"] == 2 and big["virtual_pipeline_stages"] == 3
    assert big["schedule"] == "interleaved-1f1b" and big["overlap_grad_reduce"] is False  # --DDP-impl local


def test_a_value_the_record_states_wins_over_the_launch_script(records):
    rec = copy.deepcopy(records["megatron_sc21_t1_76.1B"])
    rec["batch"]["micro_batch_size"] = 4
    rec["parallelism"]["virtual_pipeline_stages"] = 5
    plan = record_to_scenario(rec)["plan"]
    assert plan["micro_batch_size"] == 4 and plan["virtual_pipeline_stages"] == 5


def test_records_without_launch_scripts_keep_the_general_defaults(records):
    rec = copy.deepcopy(records["megatron_sc21_t1_76.1B"])
    rec["id"] = "not_in_any_launch_script"
    plan = record_to_scenario(rec)["plan"]
    assert plan["micro_batch_size"] == 1 and plan["virtual_pipeline_stages"] == 1
    assert plan["overlap_grad_reduce"] is False  # 2021: reduce after the backward


def test_a_published_moe_tflops_becomes_a_step_time_with_the_sources_flop_count(records):
    # Mixtral 8x7B, MCore v0.8 (2024): 12 B s L h^2 [(1 + 8/32 + 4096/4096) + (14336/4096) 2 (3/2)
    # + 32000/(2 32 4096)], the whole s x s attention counted, at 438 TFLOP/s on each of 64 GPUs
    rec = copy.deepcopy(records["mcore_moe_readme_mixtral_8x7b_64xh100"])
    per = (1 + 0.25 + 1.0) + 3.5 * 2 * 1.5 + 32000 / (2 * 32 * 4096)
    flops = 12 * 256 * 4096 * 32 * 4096 ** 2 * per
    assert published_step_time(rec) == (pytest.approx(flops / (438e12 * 64)), True)
    # a 2025 record is counted as Megatron-LM counts it since: the s/h term halved for the causal mask
    rec["source"]["date"] = "2025-03"
    halved = 12 * 256 * 4096 * 32 * 4096 ** 2 * (per - 0.5)
    assert published_step_time(rec) == (pytest.approx(halved / (438e12 * 64)), True)


def test_weight_gradient_accumulation_follows_the_framework_and_its_date(records):
    """Megatron-LM fused it into the wgrad GEMMs in early 2022; SC'21 (2021) and the DeepSpeed-based
    runs add each microbatch's gradient in with a kernel of their own; later runs keep the plan's
    default, which is unfused only under ZeRO-2/3 (the FSDP rows)."""
    def fused(rid):
        sc = load_scenario(record_to_scenario(records[rid]))
        return sc.plan.fused_grad_accumulation

    assert not fused("megatron_sc21_t1_1.7B") and not fused("megatron_sc21_t1_1008.0B")
    assert not fused("mtnlg_530b_2240gpu") and not fused("bloom_176b_384gpu")
    assert fused("korthikanti_t5_175B_sp_selective") and fused("megatron_readme_h100_70B")
    assert fused("moe_modelzoo_qwen3_235b_h100_crossnode_ep32")
    assert not fused("mosaic_mpt_13b_h100_16gpu_seq2048")  # FSDP FULL_SHARD = ZeRO-3


def test_precision_and_gradient_dtype_follow_the_record_and_its_scripts(records):
    """SC'21's CONFIG.sh trains in fp16 without fp32 gradient accumulation; Composer's PURE mode
    reduces in bf16; 'mixed 16-bit' is bf16 with Megatron's fp32 gradients."""
    def training(rid):
        t = load_scenario(record_to_scenario(records[rid])).training
        return t.precision, t.grad_reduce_dtype

    assert training("megatron_sc21_t1_1.7B") == ("fp16", "fp16")
    assert training("mosaic_mpt_70b_a100_64gpu_seq2048") == ("bf16", "bf16")
    assert training("mosaic_mpt_70b_h100_512gpu_seq2048") == ("bf16", "fp32")  # amp_bf16, FSDP DEFAULT
    assert training("korthikanti_t5_175B_sp_selective") == training("mtnlg_530b_2240gpu") == ("bf16", "fp32")
    # without its launch script, SC'21's 'fp16 vs bf16 not stated' names no precision
    assert _precision(records["megatron_sc21_t1_1.7B"], {}) == ("bf16", "fp32")


def test_vocabulary_is_padded_where_the_record_says_megatron_padded_it(records):
    def vocab(rid):
        return load_scenario(record_to_scenario(records[rid])).model.vocab_size

    assert vocab("mtnlg_530b_2240gpu") == 51200  # 50257 up to a multiple of 128 x tp 8
    assert vocab("megatron_sc21_t1_1.7B") == 51200 and vocab("moe_modelzoo_qwen3_235b_h100_crossnode_ep32") == 151936


def test_attention_kernel_follows_the_framework_the_gpu_and_the_date(records):
    """Before 2023 Megatron materialised the scores (unfused); Megatron-Core on Hopper runs Transformer
    Engine's Hopper kernel (flash3); other later runs FlashAttention-2 (flash)."""
    def kernel(rid):
        return load_scenario(record_to_scenario(records[rid])).training.attention

    assert kernel("megatron_sc21_t1_1.7B") == kernel("mtnlg_530b_2240gpu") == "unfused"
    assert kernel("megatron_readme_h100_70B") == kernel("mcore_moe_readme_mixtral_8x7b_64xh100") == "flash3"
    assert kernel("moe_modelzoo_qwen3_235b_h100_intranode_ep8_tp4_pp8") == "flash3"
    assert kernel("mosaic_mpt_70b_h100_512gpu_seq2048") == "flash"     # Composer + FSDP: FlashAttention-2
    assert kernel("mosaic_mpt_70b_a100_64gpu_seq2048") == "flash"      # Ampere
