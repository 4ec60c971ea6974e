"""Every bundled scenario with pp > 1 under its own schedule, zero-bubble (ZB-H1, same virtual
stages), zbv (ZB-V, two chunks per rank in a V) and dualpipev (DualPipeV, its forward/backward pairs
one after the other, as PyTorch runs them without an overlap function) beside interleaved 1F1B at
the same two chunks.

    python benchmarks/schedule_table.py [--markdown]

Each row changes only plan.schedule and plan.virtual_pipeline_stages (and, at two chunks, the
uneven edges, see `run`); a schedule the plan cannot run (layers that do not split over 2 x pp
chunks, fewer microbatches than stages) prints its reason. The bubble is the busiest stage's idle time (the stage the breakdown reports).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paraplan.errors import InfeasiblePlanError  # noqa: E402
from paraplan.loader import load_scenario  # noqa: E402
from simulator.layout import embedding_and_loss_edge  # noqa: E402
from simulator.simulate import simulate  # noqa: E402

GIB = 2**30


def run(sc, schedule: str, vpp: int) -> tuple[float, float, float] | str:
    """(step s, bubble s, peak GiB) of `sc` under `schedule` at `vpp` chunks per rank, or why not.
    At a chunk count other than the scenario's own, its uneven edges give way to the planner's
    rule for virtual stages: the embedding and the loss count as a layer each where the layers
    then split evenly (simulator.layout.embedding_and_loss_edge)."""
    plan = replace(sc.plan, schedule=schedule, virtual_pipeline_stages=vpp)
    if vpp != sc.plan.virtual_pipeline_stages:
        edge = embedding_and_loss_edge(sc.model.num_layers, plan.pp * vpp)
        plan = replace(plan, first_stage_layers=edge, last_stage_layers=edge)
    try:
        r = simulate(replace(sc, plan=plan), imbalance_reference=False, record_spans=False)
    except InfeasiblePlanError as e:
        return str(e).split(";")[0]
    return r.step_time_s, r.breakdown["pp_bubble"], r.peak_memory_bytes / GIB


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    columns = ("bundled", "zero-bubble", "interleaved-1f1b x2", "zbv", "dualpipev")
    rows, refused = [], []
    for path in sorted((ROOT / "scenarios").glob("*.yaml")):
        sc = load_scenario(path)
        p = sc.plan
        if p.pp < 2:
            continue
        label = f"pp{p.pp} {p.schedule}" + (f" x{p.virtual_pipeline_stages}" if p.virtual_pipeline_stages > 1 else "")
        runs = (run(sc, p.schedule, p.virtual_pipeline_stages), run(sc, "zero-bubble", p.virtual_pipeline_stages),
                run(sc, "interleaved-1f1b", 2), run(sc, "zbv", 2), run(sc, "dualpipev", 2))
        for name, r in zip(columns, runs):
            if isinstance(r, str):
                refused.append(f"{path.stem} {name}: {r}")
        rows.append((path.stem, label, runs))
    cell = "{:.3f} / {:.3f} / {:.1f}"
    if args.markdown:
        print("| scenario | bundled plan | " + " | ".join(f"{c}: step s / bubble s / GiB" for c in columns) + " |")
        print("|---|---|" + "---:|" * len(columns))
        for name, label, runs in rows:
            print(f"| {name} | {label} | " + " | ".join(cell.format(*r) if not isinstance(r, str) else "refused"
                                                       for r in runs) + " |")
    else:
        print(f"{'scenario':24} {'bundled plan':28} " + " ".join(f"{c:>24}" for c in columns))
        print(f"{'':53} " + " ".join(f"{'step s / bubble s / GiB':>24}" for _ in columns))
        for name, label, runs in rows:
            print(f"{name:24} {label:28} " + " ".join(f"{cell.format(*r) if not isinstance(r, str) else 'refused':>24}"
                                                      for r in runs))
    for line in refused:
        print(f"refused: {line}")


if __name__ == "__main__":
    main()
