"""Combined 1F1B (plan.overlap_moe_expert_parallel_comm) on the bundled MoE scenarios: the step, the
exposed expert-parallel communication, the pipeline bubble and the peak memory without and with it;
and the one published pair that measured it.

    python benchmarks/ep_overlap_table.py [--markdown] [--records paraplan/data/public_runs.yaml]

The published pair: the Megatron MoE Model Zoo's Qwen3 page (yanring/Megatron-MoE-ModelZoo,
best_practice/qwen3/readme.md, H100 table) ran Qwen3-235B-A22B on 256 H100 (TP 2, EP 32, PP 8 x
VPP 4, DeepEP, recompute norm and act, code moe_dev(f3e6c5)) in 19.7 s per step, and the same with
"+1f1b overlap" in 17.6 s. The first is the validation record
moe_modelzoo_qwen3_235b_h100_crossnode_ep32; `--records` simulates that record as
`paraplan validate-published` does, without and with the overlap, against both figures.

Each row is a bundled scenario with the overrides it needs for Megatron-Core to run combined 1F1B
(no full recompute: Qwen3-235B recomputes selectively instead; pp 1 or interleaved 1F1B), both
columns under those overrides. The bundled DeepSeek-V3 plan runs plain 1F1B on 16 stages with full
recompute, neither of which combined 1F1B accepts, and its 61 layers with the MTP module do not
split into interleaved virtual stages, so it has no row.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paraplan.loader import load_scenario  # noqa: E402
from simulator.simulate import simulate  # noqa: E402

GiB = 1024**3
ROWS = [
    ("mixtral-8x7b-64xh100", "pp4 interleaved x8, EP 8 in a node", []),
    ("mixtral-8x7b-64xh100", "pp1, EP 8 in a node", ["plan.pp=1", "plan.dp=64", "plan.schedule=1f1b",
                                                       "plan.virtual_pipeline_stages=1"]),
    ("qwen3-235b-256xh100", "pp8 interleaved x4, EP 32 over 4 nodes (DeepEP), selective recompute",
     ["plan.recompute=selective"]),
    ("qwen3-235b-256xh100", "the same with the alltoall dispatcher",
     ["plan.recompute=selective", "plan.moe_dispatcher=alltoall"]),
    ("mixtral-8x7b-64xh100", "pp4 dualpipev (its pairs overlapped, or one after the other)",
     ["plan.schedule=dualpipev", "plan.virtual_pipeline_stages=2"]),
    ("qwen3-235b-256xh100", "pp8 dualpipev, 5 + 6 x 14 + 5 layers, DeepEP, selective recompute",
     ["plan.recompute=selective", "plan.schedule=dualpipev", "plan.virtual_pipeline_stages=2",
      "plan.first_stage_layers=5", "plan.last_stage_layers=5"]),
]
ON = "plan.overlap_moe_expert_parallel_comm=true"
PAIR_RECORD = "moe_modelzoo_qwen3_235b_h100_crossnode_ep32"
PAIR_WITH_OVERLAP_S = 17.6  # the Model Zoo's "+1f1b overlap" row, same layout and code as the record


def published_pair(records_path: str) -> list[tuple[str, float, float]]:
    """(label, published s, predicted s) without and with combined 1F1B, for the record above."""
    import yaml

    from paraplan.published import published_step_time, record_to_scenario

    data = yaml.safe_load(Path(records_path).read_text())
    records = data if isinstance(data, list) else data.get("records", [])
    rec = next(r for r in records if r.get("id") == PAIR_RECORD)
    out = []
    for label, sets, published in (("without", [], published_step_time(rec)[0]), ("with", [ON], PAIR_WITH_OVERLAP_S)):
        sc = load_scenario(record_to_scenario(rec), sets)
        out.append((label, published, simulate(sc, imbalance_reference=False, record_spans=False).step_time_s))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--records", help="the validation file (public_runs.yaml): also compare the published pair")
    args = ap.parse_args()
    head = ("scenario", "plan", "step off -> on (s)", "change", "exposed ep_comm (s)", "pp_bubble (s)", "peak GiB",
            "fits")
    rows = []
    for name, what, sets in ROWS:
        path = ROOT / "scenarios" / f"{name}.yaml"
        off = simulate(load_scenario(path, sets), imbalance_reference=False, record_spans=False)
        on = simulate(load_scenario(path, [*sets, ON]), imbalance_reference=False, record_spans=False)
        rows.append((name, what, f"{off.step_time_s:.3f} -> {on.step_time_s:.3f}",
                     f"{100 * (on.step_time_s / off.step_time_s - 1):+.1f}%",
                     f"{off.breakdown['ep_comm']:.3f} -> {on.breakdown['ep_comm']:.3f}",
                     f"{off.breakdown['pp_bubble']:.3f} -> {on.breakdown['pp_bubble']:.3f}",
                     f"{off.peak_memory_bytes / GiB:.1f} -> {on.peak_memory_bytes / GiB:.1f}",
                     f"{'yes' if off.fits else 'no'} -> {'yes' if on.fits else 'no'}"))
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        for r in (head, *rows):
            print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)))
    if args.records:
        pair = published_pair(args.records)
        print(f"\n{PAIR_RECORD}, Megatron MoE Model Zoo (published) vs paraplan (predicted):")
        for label, published, predicted in pair:
            print(f"  {label} combined 1F1B: published {published:.2f} s, predicted {predicted:.3f} s "
                  f"({100 * (predicted / published - 1):+.1f}%)")
        (_, p0, s0), (_, p1, s1) = pair
        print(f"  gain: published {100 * (p1 / p0 - 1):+.1f}%, predicted {100 * (s1 / s0 - 1):+.1f}%")


if __name__ == "__main__":
    main()
