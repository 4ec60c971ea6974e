"""Does a slower network ever make a step faster? Sweeps the bundled MoE scenarios' NIC and NVLink
bandwidth (2x down to 0.5x, 31 steps) and inter-node latency (1 to 30 us) and prints every step
time that falls as the network gets worse. Flow-level contention depends on who overlaps whom, so
it need not be monotone; this measures how far from monotone it is.

    python benchmarks/contention_monotonicity.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paraplan.loader import load_scenario  # noqa: E402
from simulator.simulate import simulate  # noqa: E402

SCENARIOS = ("deepseek-v3-2048xh800", "mixtral-8x7b-64xh100", "qwen3-235b-256xh100")
STEPS = 31


def sweep(path: Path) -> dict[str, list[float]]:
    """Step times per knob, in the order the network gets worse."""
    c = load_scenario(path).cluster

    def step(override: str) -> float:
        return simulate(load_scenario(path, [override]), imbalance_reference=False, record_spans=False).step_time_s

    scales = np.linspace(2.0, 0.5, STEPS)
    nic_gbps, nvl_gbps = c.inter_node.nic_bandwidth * 8 / 1e9, c.intra_node.bandwidth / 1e9
    return {
        "NIC bandwidth": [step(f"cluster.inter_node.nic_bandwidth_Gbps={nic_gbps * k}") for k in scales],
        "NVLink bandwidth": [step(f"cluster.intra_node.bandwidth_GBps={nvl_gbps * k}") for k in scales],
        "inter-node latency": [step(f"cluster.inter_node.latency_us={us}") for us in np.linspace(1, 30, 30)],
    }


def main() -> None:
    print(f"{'scenario':24} {'knob':20} {'falls':>5} {'largest fall':>14}")
    for name in SCENARIOS:
        for knob, times in sweep(ROOT / "scenarios" / f"{name}.yaml").items():
            falls = [(a - b) / a for a, b in zip(times, times[1:]) if b < a]
            largest = f"{max(falls) * 1e6:.2f} ppm" if falls else "-"
            print(f"{name:24} {knob:20} {len(falls):5d} {largest:>14}")


if __name__ == "__main__":
    main()
