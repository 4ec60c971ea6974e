"""The planner's cost-balanced uneven split against the halves, on a random sample of a space.

    python benchmarks/uneven_split_sample.py [SCENARIO] [--plans N] [--workers W]

Takes the valid non-interleaved plans of the scenario's default search space whose first/last
stage split (planner.space.uneven_stages with the model's FLOPs) differs from the halves (the same
function without costs), samples N of them with a fixed seed, simulates each with both splits and
prints how many got faster or slower, the step-time ratios, how many plans that fitted with the
halves no longer fit (the planner's evaluator moves a derived split whose edge stage is out of
memory to the nearest one that fits: it counts how many it moved), and the best fitting plan of the
sample under each rule.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paraplan.loader import load_scenario  # noqa: E402
from planner.objective import Evaluator  # noqa: E402
from planner.space import Candidate, PlanSpace, parse_search, uneven_stages  # noqa: E402

_SPACE: PlanSpace | None = None


def _space(path: str) -> PlanSpace:
    global _SPACE
    if _SPACE is None:
        sc = load_scenario(path)
        _SPACE = PlanSpace(sc, parse_search(sc))
    return _SPACE


def _halves(c: Candidate) -> Candidate:
    first, last = uneven_stages(_SPACE.scenario.model.num_layers, c.plan.pp)
    return Candidate(num_nodes=c.num_nodes,
                     plan=dataclasses.replace(c.plan, first_stage_layers=first, last_stage_layers=last))


def _pair(args: tuple[str, Candidate]) -> tuple:
    path, c = args
    ev = Evaluator(_space(path))
    new, old = ev.evaluate(c), ev.evaluate(_halves(c))
    return (new.fits, old.fits, new.step_time_s, old.step_time_s, new.tokens_per_s, old.tokens_per_s,
            new.candidate != c)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario", nargs="?", default=str(ROOT / "scenarios" / "qwen3-235b-256xh100.yaml"))
    ap.add_argument("--plans", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    sp = _space(args.scenario)
    layers = sp.scenario.model.num_layers
    changed = [c for c in sp.enumerate().valid if c.plan.virtual_pipeline_stages == 1
               and c.plan.first_stage_layers is not None
               and (c.plan.first_stage_layers, c.plan.last_stage_layers) != uneven_stages(layers, c.plan.pp)]
    random.seed(1)
    sample = random.sample(changed, min(args.plans, len(changed)))
    with ProcessPoolExecutor(args.workers) as ex:
        res = list(ex.map(_pair, [(args.scenario, c) for c in sample], chunksize=20))
    ratios = [r[2] / r[3] for r in res]
    print(f"{len(changed)} plans whose split changed; {len(res)} sampled")
    print(f"new split faster in {sum(r < 0.9999 for r in ratios)}, slower in {sum(r > 1.0001 for r in ratios)}; "
          f"step-time ratio median {statistics.median(ratios):.4f}, range {min(ratios):.2f}-{max(ratios):.2f}")
    print(f"fitted with the halves, out of memory with the new split: {sum(of and not nf for nf, of, *_ in res)}; "
          f"moved by the planner to a split that fits: {sum(r[6] for r in res)}")
    best_new = max((r[4] for r in res if r[0]), default=0.0)
    best_old = max((r[5] for r in res if r[1]), default=0.0)
    print(f"best fitting plan of the sample: {best_new:,.0f} tokens/s with the new split, {best_old:,.0f} with the halves")


if __name__ == "__main__":
    main()
