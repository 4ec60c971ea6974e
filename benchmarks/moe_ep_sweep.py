"""Expert-parallel sweep for DeepSeek-V3 on 2,048 H800-class GPUs: uniform vs zipf routing.

    python benchmarks/moe_ep_sweep.py [--s 1.2] [--markdown]

Shows where the all-to-all leaves the node (EP > 8 GPUs per node) and what an unbalanced router
costs. Every row is the bundled scenario with only plan.ep and the routing changed.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paraplan.loader import load_scenario  # noqa: E402
from paraplan.specs import RoutingSpec  # noqa: E402
from simulator.simulate import simulate  # noqa: E402


def with_routing(sc, routing):
    return replace(sc, model=replace(sc.model, moe=replace(sc.model.moe, routing=routing)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--s", type=float, default=1.2, help="zipf exponent")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    base = load_scenario(ROOT / "scenarios" / "deepseek-v3-2048xh800.yaml")
    rows = []
    for ep in (1, 2, 4, 8, 16, 32, 64):
        # at EP 1 no token leaves its rank: the alltoall dispatcher (DeepEP's refuses a single rank)
        sc = replace(base, plan=replace(base.plan, ep=ep, moe_dispatcher=base.plan.moe_dispatcher if ep > 1 else "alltoall"))
        # step times, the routing draw and the placement: no timeline, no balanced-router reference
        uni = simulate(with_routing(sc, RoutingSpec(distribution="uniform")), imbalance_reference=False,
                       record_spans=False)
        zipf = simulate(with_routing(sc, RoutingSpec(distribution="zipf", s=args.s)), imbalance_reference=False,
                        record_spans=False)
        rows.append((ep, uni.moe.ep_group, "+".join(uni.moe.ep_tiers) or "-", uni.step_time_s,
                     uni.breakdown["ep_comm"] / uni.step_time_s, zipf.step_time_s, zipf.moe.imbalance,
                     zipf.step_time_s / uni.step_time_s, uni.peak_memory_bytes / 2**30, uni.fits))
    head = ("EP", "EP group", "tiers", "uniform step s", "a2a share", f"zipf(s={args.s}) step s",
            "busiest rank x mean", "zipf / uniform", "peak GiB", "fits")
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {100 * r[4]:.0f}% | {r[5]:.1f} | {r[6]:.2f} | "
                  f"{r[7]:.2f} | {r[8]:.0f} | {'yes' if r[9] else 'no'} |")
        return
    print(f"{'EP':>3} {'EP group':<24} {'tiers':<10} {'uniform s':>10} {'a2a':>5} {'zipf s':>9} "
          f"{'busiest':>8} {'zipf/uni':>8} {'GiB':>6}  fits")
    for r in rows:
        print(f"{r[0]:>3} {r[1]:<24} {r[2]:<10} {r[3]:10.1f} {100 * r[4]:4.0f}% {r[5]:9.1f} {r[6]:8.2f} "
              f"{r[7]:8.2f} {r[8]:6.0f}  {'yes' if r[9] else 'no'}")


if __name__ == "__main__":
    main()
