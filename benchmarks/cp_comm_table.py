"""The context-parallel exchanges (plan.cp_comm_type) side by side at long context.

    python benchmarks/cp_comm_table.py [--markdown]

Llama-3 8B on 64 H100 (the bundled scenario: pure data parallelism, ZeRO-3; full recompute, which
it needs to fit) with the sequence grown to 32k-128k tokens and split over cp 2-8 ranks inside a
node or 16 over two nodes, and Llama-3 70B on 1,024 H100 (tp 8, pp 4, full recompute) at 128k over
cp 8, whose CP group spans 8 nodes. Only the sequence, cp, dp, the batch (the same tokens per step)
and the exchange change between rows; a2a+p2p takes the all-to-all group paraplan derives
(paraplan.placement.cp_split: the largest inside a node that splits the heads). Simulated, not
measured: no published run in the validation file uses all_gather, a2a or a2a+p2p, so these prices
rest on Transformer Engine's implementations (simulator.workload._attention_core, _cp_exchange)
and the network model alone.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paraplan.loader import load_scenario  # noqa: E402
from paraplan.placement import cp_split  # noqa: E402
from paraplan.specs import CP_COMM_TYPES  # noqa: E402
from simulator.feasibility import structural_problems  # noqa: E402
from simulator.simulate import simulate  # noqa: E402

TOKENS_PER_STEP = 2**21  # 2M tokens a step in every row
# (scenario, seq, cp, extra overrides)
ROWS = [
    ("llama3-8b-64xh100.yaml", 32768, 2, ["plan.recompute=full"]),
    ("llama3-8b-64xh100.yaml", 65536, 4, ["plan.recompute=full"]),
    ("llama3-8b-64xh100.yaml", 131072, 8, ["plan.recompute=full"]),
    ("llama3-8b-64xh100.yaml", 131072, 16, ["plan.recompute=full"]),
    ("llama3-70b-1024xh100.yaml", 131072, 8, ["plan.tp=8", "plan.pp=4", "plan.virtual_pipeline_stages=1",
                                              "plan.schedule=1f1b", "plan.recompute=full"]),
]


def row(scenario: str, seq: int, cp: int, extra: list[str], kind: str):
    sc = load_scenario(ROOT / "scenarios" / scenario, [
        f"training.seq_length={seq}", f"training.global_batch_size={TOKENS_PER_STEP // seq}", f"plan.cp={cp}",
        "plan.dp=null", f"plan.cp_comm_type={kind}", *extra])
    problems = structural_problems(sc)
    if problems:
        return sc, None, problems[0]
    return sc, simulate(sc), None


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--markdown", action="store_true", help="a markdown table (the README's)")
    args = ap.parse_args()
    head = ["model", "seq", "plan"] + [f"{k} s (cp_comm)" for k in CP_COMM_TYPES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * len(CP_COMM_TYPES)]
    notes = []
    for scenario, seq, cp, extra in ROWS:
        cells = []
        for kind in CP_COMM_TYPES:
            sc, r, problem = row(scenario, seq, cp, extra, kind)
            if r is None:
                cells.append("-")
                notes.append(f"{sc.model.name} {kind}: {problem}")
            else:
                oom = "" if r.fits else ", does not fit"
                a2a = cp_split(sc.plan, sc.model, sc.cluster.gpus_per_node)[0]
                split = f", a2a {a2a} x ring {cp // a2a}" if kind == "a2a+p2p" else ""
                cells.append(f"{r.step_time_s:.3f} ({r.breakdown.get('cp_comm', 0.0):.3f}{split}{oom})")
        p = sc.plan
        nodes = "across nodes" if p.tp * cp > sc.cluster.gpus_per_node else "in a node"
        plan = f"tp {p.tp} pp {p.pp} cp {cp} ({nodes}) dp {p.dp}, {p.recompute_label} recompute"
        lines.append("| " + " | ".join([sc.model.name, f"{seq:,}", plan, *cells]) + " |")
    if not args.markdown:
        lines = [line for line in lines if not line.startswith("|--")]
    print("\n".join(lines))
    for n in notes:
        print(f"- {n}")


if __name__ == "__main__":
    main()
