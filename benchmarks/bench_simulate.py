"""Simulation speed: median wall time of simulate() in-process, and of the `paraplan simulate` CLI.

    python benchmarks/bench_simulate.py [--repeats N]

Targets: <= 50 ms per plan in-process for the dense headline scenarios, <= 100 ms for DeepSeek-V3
(an MoE plan is simulated twice: with its routing and with a balanced router, to report the
imbalance effect); the CLI under 1.5 s including interpreter start. Each timed run follows an untimed
first one, so what is computed once per model and process (the GPU profile, the group-limited
router's reach) is not in the figures; the schedules and op plans are.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paraplan.loader import load_scenario  # noqa: E402
from simulator.engine import clear_caches  # noqa: E402
from simulator.schedules import build_schedule  # noqa: E402
from simulator.simulate import simulate  # noqa: E402

CASES = [
    ("GPT-3 175B, 1,024 A100, tp8 pp8 dp16 interleaved", "scenarios/gpt3-175b-1024xa100.yaml", [], 50),
    ("Llama-3 405B, 16,384 H100, tp8 pp16 dp128", "scenarios/llama3-405b-16384xh100.yaml", [], 50),
    ("DeepSeek-V3 671B, 2,048 H800, pp16 ep64", "scenarios/deepseek-v3-2048xh800.yaml", [], 100),
]
# The same MoE plan as the planner simulates it: without the balanced-router reference run and
# without the timeline (spans for --trace / --plot).
PLANNER_CASE = ("DeepSeek-V3, as the planner runs it (no reference)", "scenarios/deepseek-v3-2048xh800.yaml", 100)


def time_inprocess(path: str, overrides: list[str], repeats: int, **kw) -> tuple[float, float, float]:
    """(median seconds, fastest seconds, the predicted step time) of `repeats` simulations."""
    sc = load_scenario(ROOT / path, overrides)
    simulate(sc, **kw)  # load the GPU profile and import lazily imported modules once
    times = []
    for _ in range(repeats):
        # every repeat times a plan the process has not simulated before: the schedules and their
        # op plans, which a planner's study reuses across trials, are built again
        build_schedule.cache_clear()
        clear_caches()
        t0 = time.perf_counter()
        res = simulate(sc, **kw)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times), res.step_time_s


def time_cli(path: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "paraplan", "simulate", str(ROOT / path)], check=True,
                       capture_output=True, cwd=ROOT)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    # the median is the figure; the fastest run shows the code's speed when this machine is quiet
    print(f"{'scenario':<52} {'simulate() median':>18} {'fastest':>9} {'target':>8}  predicted step")
    for label, path, overrides, target in CASES:
        med, fastest, step = time_inprocess(path, overrides, args.repeats)
        print(f"{label:<52} {med * 1e3:15.1f} ms {fastest * 1e3:6.1f} ms {f'{target} ms':>8}  {step:.2f} s")
    label, path, target = PLANNER_CASE
    med, fastest, step = time_inprocess(path, [], args.repeats, imbalance_reference=False, record_spans=False)
    print(f"{label:<52} {med * 1e3:15.1f} ms {fastest * 1e3:6.1f} ms {f'{target} ms':>8}  {step:.2f} s")
    cli = time_cli(CASES[0][1], max(3, args.repeats // 2))
    print(f"{'paraplan simulate (CLI, incl. interpreter start)':<52} {cli * 1e3:15.0f} ms {'':>9} {'1500 ms':>8}")


if __name__ == "__main__":
    main()
