"""Executor speed on one GPU: MFU of a ~1.2B-parameter GPT at bf16 (target >= 40% on an H100).

    python benchmarks/bench_executor.py [--steps 10] [--mbs 8] [--layers 20] [--hidden 2048]

A slow executor would make measured-vs-predicted comparisons meaningless, so its single-GPU
efficiency is checked against a published-class target. The model: 20 layers, hidden 2048, 16
heads of 128, GELU FFN 8192, vocabulary 50304, sequence 2048, untied head (1.21B parameters);
micro-batch 8, one microbatch per step, AdamW (fused), bf16 autocast, flash attention through
scaled_dot_product_attention. It runs through the same launcher as `paraplan launch` (torchrun,
NCCL, one process).

MFU = model FLOPs per step / step time / peak bf16 FLOP/s of the GPU, with model FLOPs from
simulator.flops.model_flops (the simulator's formula, printed below): 3 x forward GEMM FLOPs per
token x tokens, attention counted without the causal halving, recompute not counted. The peak
is the bundled profile's for the detected GPU (H100 SXM: 989.4 TFLOP/s dense bf16).

Without CUDA it says so and exits 0 (it is a GPU benchmark; CPU correctness is in tests/).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paraplan.specs import ClusterSpec, ModelSpec, PlanSpec, RunSpec, Scenario, TrainingSpec  # noqa: E402

TARGET_MFU = 0.40


def scenario(args) -> Scenario:
    model = ModelSpec(name=f"gpt-{args.layers}x{args.hidden}", num_layers=args.layers, hidden_size=args.hidden,
                      num_attention_heads=args.hidden // 128, num_kv_heads=args.hidden // 128, head_dim=128,
                      ffn_hidden_size=4 * args.hidden, vocab_size=50304, activation="gelu")
    return Scenario(
        name="bench-executor-1gpu", model=model,
        cluster=ClusterSpec(gpu="h100-sxm-80gb", num_nodes=1, gpus_per_node=1),
        training=TrainingSpec(seq_length=args.seq, global_batch_size=args.mbs * args.microbatches, precision="bf16"),
        plan=PlanSpec(micro_batch_size=args.mbs, recompute=args.recompute),
        run=RunSpec(steps=args.steps, warmup_steps=args.warmup, backend="nccl", timeout_s=600))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_executor: needs torch; skipped")
        return 0
    if not torch.cuda.is_available():
        print("bench_executor: no CUDA GPU here; skipped (this benchmark measures MFU on a GPU)")
        return 0

    from executor.launch import launch
    from paraplan.cli.launch import add_flops

    sc = scenario(args)
    m = add_flops(sc, launch([sc], nproc=1, backend="nccl", timeout_s=600)[0])
    peak_gib = m["ranks"][0]["memory"]["peak_total"] / 1024**3
    print(f"{m['model']['name']}: {m['parameters'] / 1e9:.2f}B parameters, seq {args.seq}, "
          f"micro-batch {args.mbs} x {args.microbatches}, bf16, recompute {args.recompute}, on {m['device']}")
    print(f"  step time (median)  {m['step_time_s'] * 1e3:8.1f} ms   tokens/s {m['tokens_per_s']:,.0f}")
    print(f"  TFLOP/s             {m['tflops_per_rank']:8.1f}      peak memory {peak_gib:.1f} GiB")
    verdict = "meets" if m["mfu"] >= TARGET_MFU else "BELOW"
    print(f"  MFU                 {m['mfu'] * 100:7.1f} %   of {m['peak_flops_per_rank'] / 1e12:.1f} TFLOP/s "
          f"({m['peak_profile']}); {verdict} the {TARGET_MFU * 100:.0f}% target")
    print(f"  FLOPs: {m['flop_formula']}")
    return 0 if m["mfu"] >= TARGET_MFU else 1


if __name__ == "__main__":
    sys.exit(main())
