"""Planner quality and speed, and the planner against published plans.

    python benchmarks/bench_planner.py [--workers 2] [--seeds 1] [--skip-published] [--only NAME]

1. Quality: on bundled scenarios whose search space can be enumerated (a dense 8B on 64 H100, a
   70B on 512 H100, GPT-3 175B on 1,024 A100, and Mixtral 8x7B on 64 H100 with its MoE knobs in a
   cut-down space), the exhaustive optimum (every valid plan
   simulated, `--workers` processes) against Optuna mode (seeded TPE + refinement, 300 trials,
   seed 0, one worker so the run is reproducible): space size, optimum and best tokens/s, gap,
   wall time, trials/s. `--seeds N` repeats Optuna mode with seeds 0..N-1 and reports how many
   land within 1 %.
2. Speed: the full search of GPT-3 175B on 1,024 A100 as a user runs it (`paraplan plan`, default
   options: auto strategy, one worker, plots and exports included), interpreter start included.
   Target: <= 60 s on a 2-core machine.
3. Published plans: Megatron-LM SC'21 Table 1 and Korthikanti et al. 2022 Table 5 runs
   (paraplan/data/public_runs.yaml), each simulated as published and searched by the planner on
   the same model, cluster and batch, with the knobs of its time (SC'21: no sequence parallelism,
   no selective recompute, no distributed optimizer; Korthikanti: sequence parallelism and
   selective recompute, no distributed optimizer). The planner's best is reported from its
   search trials only (the published plan itself is not counted).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from paraplan.loader import load_scenario  # noqa: E402
from paraplan.published import record_to_scenario  # noqa: E402
from planner.objective import make_objective  # noqa: E402
from planner.report import plan_label  # noqa: E402
from planner.search import SearchRequest, run_search  # noqa: E402
from planner.space import parse_search  # noqa: E402

QUALITY = [
    ("Llama-3 8B, 64 H100", "scenarios/llama3-8b-64xh100.yaml", None),
    ("Llama-3 70B, 512 H100", "scenarios/llama3-70b-512xh100.yaml", None),
    ("GPT-3 175B, 1,024 A100", "scenarios/gpt3-175b-1024xa100.yaml", None),
    # an MoE space with its own knobs (the dispatcher, expert TP), cut to a size the exhaustive
    # ground truth can cover in minutes (the full default space has 63,123 valid plans)
    ("Mixtral 8x7B, 64 H100 (cp 1, mbs 1-2, ZeRO 1/3, dispatcher, expert TP)", "scenarios/mixtral-8x7b-64xh100.yaml",
     {"cp": [1], "micro_batch_size": [1, 2], "zero_stage": [1, 3], "moe_dispatcher": ["alltoall", "deepep"],
      "expert_tp": [1, 2]}),
]
SPEED = "scenarios/gpt3-175b-1024xa100.yaml"
TRIALS = 300

PUBLISHED = [
    "megatron_sc21_t1_39.1B", "megatron_sc21_t1_76.1B", "megatron_sc21_t1_145.6B",
    "korthikanti_t5_22B_sp_selective", "korthikanti_t5_175B_sp_selective", "korthikanti_t5_530B_sp_selective",
]
# the knobs each publication's software had (see the module docstring)
ERA_SEARCH = {
    "megatron_sc21": {"cp": [1], "micro_batch_size": [1, 2, 4, 8], "schedule": ["1f1b", "interleaved-1f1b"],
                      "sequence_parallel": [False], "zero_stage": [0], "recompute": ["none", "full"]},
    "korthikanti": {"cp": [1], "micro_batch_size": [1, 2, 4], "schedule": ["1f1b", "interleaved-1f1b"],
                    "zero_stage": [0], "recompute": ["none", "selective", "full"]},
}


def _search(sc, *, strategy: str, seed: int = 0, workers: int = 1, trials: int = TRIALS, search=None):
    with tempfile.TemporaryDirectory() as d:
        spec = parse_search(sc, search)
        req = SearchRequest(scenario=sc, spec=spec, objective=make_objective("throughput"),
                            storage=os.path.join(d, "study.journal"), study_name="bench", strategy=strategy,
                            trials=trials, workers=workers, seed=seed)
        return run_search(req)


def _best(res):
    fits = [r.evaluation for r in res.records if r.evaluation.fits]
    return max(fits, key=lambda e: e.tokens_per_s) if fits else None


def quality(args) -> None:
    print(f"## Quality: Optuna mode ({TRIALS} trials, seed 0, 1 worker) vs the exhaustive optimum "
          f"({args.workers} workers)\n")
    print("| scenario | valid plans | exhaustive optimum tok/s | exhaustive wall | Optuna best tok/s | gap | "
          "Optuna wall | trials/s | seeds within 1% |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for label, path, search in QUALITY:
        if args.only and args.only not in path:
            continue
        sc = load_scenario(ROOT / path)
        ex = _search(sc, strategy="exhaustive", workers=args.workers, search=search)
        opt = _best(ex)
        runs = [_search(sc, strategy="tpe", seed=s, search=search) for s in range(max(1, args.seeds))]
        tpe = runs[0]
        best = _best(tpe)
        gap = 100.0 * (1.0 - best.tokens_per_s / opt.tokens_per_s)
        within = sum(_best(r).tokens_per_s >= 0.99 * opt.tokens_per_s for r in runs)
        print(f"| {label} | {len(ex.enumeration.valid):,} | {opt.tokens_per_s:,.0f} | {ex.wall_time_s:.0f} s | "
              f"{best.tokens_per_s:,.0f} | {gap:.2f}% | {tpe.wall_time_s:.1f} s | "
              f"{len(tpe.records) / tpe.wall_time_s:.1f} | {within}/{len(runs)} |", flush=True)
        print(f"|  optimum: {plan_label(opt.candidate.plan)}; Optuna: {plan_label(best.candidate.plan)} "
              f"({tpe.simulations} simulations) | | | | | | | | |", flush=True)
    print()


def speed(args) -> None:
    print("## Speed: `paraplan plan scenarios/gpt3-175b-1024xa100.yaml` (defaults: auto strategy, 1 worker, "
          "plots and exports), end to end\n")
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "paraplan", "plan", str(ROOT / SPEED), "--out", d, "--quiet"],
                           capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            print(f"FAILED: {r.stderr.strip()}")
            return
        import json

        data = json.loads(Path(d, "top_plans.json").read_text())
    s = data["search"]
    print(f"- strategy {data['strategy']}, {s['trials']} trials, {s['distinct_plans']} distinct plans, "
          f"{s['simulations_this_run']} simulations")
    print(f"- search {s['wall_time_s']:.1f} s ({s['trials_per_s']:.1f} trials/s); whole command {wall:.1f} s "
          f"(target <= 60 s)")
    print(f"- best: {data['plans'][0]['label']}, {data['plans'][0]['metrics']['tokens_per_s']:,.0f} tokens/s\n")


def published(args) -> None:
    text = resources.files("paraplan.data").joinpath("public_runs.yaml").read_text(encoding="utf-8")
    records = {r["id"]: r for r in yaml.safe_load(text)}
    print("## Published plans vs the planner (same model, cluster, batch; the knobs of the publication's time)\n")
    print("| run | GPUs | published plan | simulated tok/s | planner best (search) | tok/s | vs published | "
          "strategy, plans | wall |")
    print("|---|---:|---|---:|---|---:|---:|---|---:|")
    for rid in PUBLISHED:
        if args.only and args.only not in rid:
            continue
        sc = load_scenario(record_to_scenario(records[rid]))
        era = next(v for k, v in ERA_SEARCH.items() if rid.startswith(k))
        res = _search(sc, strategy="auto", search=era)
        base = res.baseline
        best = _best(res)
        if best is None or not base.simulated:
            print(f"| {rid} | {sc.cluster.world_size} | {plan_label(sc.plan)} | "
                  f"{'invalid' if not base.simulated else f'{base.tokens_per_s:,.0f}'} | "
                  f"{'none fits' if best is None else plan_label(best.candidate.plan)} | | | | |")
            continue
        fits = "" if base.fits else " (does not fit)"
        size = f"{len(res.enumeration.valid):,}" if res.enumeration else "?"
        print(f"| {rid} | {sc.cluster.world_size:,} | {plan_label(sc.plan)} | {base.tokens_per_s:,.0f}{fits} | "
              f"{plan_label(best.candidate.plan)} | {best.tokens_per_s:,.0f} | "
              f"{100 * (best.tokens_per_s / base.tokens_per_s - 1):+.1f}% | {res.strategy}, {size} | "
              f"{res.wall_time_s:.0f} s |", flush=True)
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="processes for the exhaustive ground truth")
    ap.add_argument("--seeds", type=int, default=1, help="Optuna runs per scenario (seeds 0..N-1)")
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-published", action="store_true")
    ap.add_argument("--only", help="only scenarios / records whose path or id contains this")
    args = ap.parse_args()
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    print(f"# bench_planner: {os.cpu_count()} CPUs, python {sys.version.split()[0]}\n", flush=True)
    if not args.skip_speed:
        speed(args)
    if not args.skip_quality:
        quality(args)
    if not args.skip_published:
        published(args)


if __name__ == "__main__":
    main()
