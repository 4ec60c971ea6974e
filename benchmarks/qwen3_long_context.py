"""Qwen3-235B-A22B on 256 H100 at 16k-128k tokens: predicted vs the Megatron MoE Model Zoo's figures.

    python benchmarks/qwen3_long_context.py

The Model Zoo's Qwen3 page (yanring/Megatron-MoE-ModelZoo, best_practice/qwen3/readme.md, "Long
Context", H100, DeepEP, bf16; not in the validation file) gives TFLOP/s per GPU for TP 4, EP 8,
PP 8 x VPP 4, GBS 256 and CP 1-8, with forced load balancing and dropless. Its command selectively
recomputes layernorm and moe. Each TFLOP/s becomes a step time with Megatron-Core's own FLOP count
(paraplan.published.megatron_core_moe_flops, the 2025 form); paraplan runs the bundled Qwen3 scenario
with only those knobs changed, uniform routing (what forced balancing gives), under both attention
kernels: flash (FlashAttention-2 figures) and flash3 (the Hopper kernel: in the default profile, the
one measured on an H100, cuDNN's fused attention as measured; in h100-sxm-80gb, FlashAttention-3's
published figures). `--profile` picks the GPU profile.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paraplan.loader import load_scenario  # noqa: E402
from paraplan.published import megatron_core_moe_flops  # noqa: E402
from simulator.simulate import simulate  # noqa: E402

GPUS, GBS = 256, 256
# (sequence, cp, TFLOP/s forced balance, TFLOP/s dropless), Model Zoo Qwen3 "Long Context" table
PUBLISHED = [(16384, 1, 295, 237), (32768, 2, 335, 277), (65536, 4, 368, 320), (131072, 8, 389, 357)]
QWEN3 = {"model": {"hidden_size": 4096, "num_layers": 94, "num_attention_heads": 64, "num_kv_heads": 4,
                   "head_dim": 128, "vocab_size": 151936, "activation": "swiglu",
                   "moe": {"num_experts": 128, "top_k": 8, "expert_ffn_hidden_size": 1536}},
         "source": {"date": "2025"}}


def published_step(seq: int, tflops: float) -> float:
    rec = {**QWEN3, "model": {**QWEN3["model"], "seq_length": seq}, "batch": {"global_batch_size": GBS}}
    return megatron_core_moe_flops(rec) / (tflops * 1e12 * GPUS)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--profile", default="h100-sxm-80gb-calibrated",
                    help="GPU profile (default: the one measured on an H100, as the published H100 rows use)")
    args = ap.parse_args()
    print(f"GPU profile: {args.profile}")
    print("| seq | cp | published s (balanced / dropless) | flash s | error | flash3 s | error |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for seq, cp, balanced, dropless in PUBLISHED:
        pub = published_step(seq, balanced)
        cells = []
        for kernel in ("flash", "flash3"):
            sc = load_scenario(ROOT / "scenarios" / "qwen3-235b-256xh100.yaml", [
                "plan.tp=4", "plan.ep=8", f"plan.cp={cp}", f"training.seq_length={seq}",
                f"training.global_batch_size={GBS}", f"training.attention={kernel}", "plan.recompute=selective",
                "plan.recompute_modules=[layernorm, moe]", f"cluster.gpu={args.profile}",
                # the 2025 Megatron-Core of these runs did not wait for its interleaved forward sends
                "plan.wait_forward_sends=false"])
            t = simulate(sc, imbalance_reference=False, record_spans=False).step_time_s
            cells += [f"{t:.2f}", f"{100 * (t / pub - 1):+.1f}%"]
        print(f"| {seq:,} | {cp} | {pub:.2f} / {published_step(seq, dropless):.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
