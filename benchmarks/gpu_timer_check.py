"""How the calibration's GPU timer reads small kernels: eager launches behind a sleep lead vs CUDA
graph replays, with the SM clock read (NVML) around each measurement.

    python benchmarks/gpu_timer_check.py

A kernel of a few microseconds launched eagerly can be timed as the host's cost of queueing it
(about 18 us per torch.matmul on the H100 measured) rather than as the GPU's; graph replays leave
the host out. The table shows both timers side by side, with the SM clock read after each, and
the clock an idle GPU, a sleeping one and a busy one reach, so a gap between the timers can be told
from a clock change.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def clock_mhz(torch) -> str:
    try:
        return f"{torch.cuda.clock_rate():4d}"
    except Exception as exc:  # noqa: BLE001 - NVML missing: say so in the table
        return f"n/a ({type(exc).__name__})"


def main() -> int:
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("gpu_timer_check: no CUDA GPU here; skipped")
        return 0
    from calibrate.bench import Clock
    from calibrate.plan import TIMINGS

    dev = torch.device("cuda", 0)
    clock, timing = Clock(dev), TIMINGS[("cuda", False)]
    torch.cuda.synchronize()
    time.sleep(0.5)
    print(f"{torch.cuda.get_device_name(dev)}; SM clock after 0.5 s idle: {clock_mhz(torch)} MHz")
    torch.cuda._sleep(int(2e8))
    time.sleep(0.05)
    print(f"  during a ~0.1 s torch.cuda._sleep: {clock_mhz(torch)} MHz")
    torch.cuda.synchronize()
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    for _ in range(200):
        a @ a
    time.sleep(0.02)
    print(f"  during back-to-back 4096^3 GEMMs: {clock_mhz(torch)} MHz")
    torch.cuda.synchronize()

    cases = []
    for n in (128, 256, 512, 1024, 2048):
        x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        cases.append((f"bf16 GEMM {n}^3", lambda x=x, out=out: torch.matmul(x, x, out=out), 2.0 * n**3, "TFLOP/s"))
    for rows in (16, 256, 4096):
        x = torch.randn(rows, 4096, device=dev, dtype=torch.bfloat16)
        w = torch.ones(4096, device=dev, dtype=torch.bfloat16)
        cases.append((f"layernorm {rows}x4096", lambda x=x, w=w: F.layer_norm(x, (4096,), w, w), 4.0 * x.numel(),
                      "GB/s"))
    print(f"{'kernel':24s} {'eager us':>9s} {'MHz':>5s} {'graph us':>9s} {'MHz':>5s} {'eager rate':>11s} {'graph rate':>11s}")
    for name, fn, work, unit in cases:
        time.sleep(0.2)  # idle, as between a calibration's shapes at worst
        e = clock.time(fn, timing)
        ce = clock_mhz(torch)
        time.sleep(0.2)
        g = clock.time(fn, timing, graph=True)
        cg = clock_mhz(torch)
        scale = 1e12 if unit == "TFLOP/s" else 1e9
        print(f"{name:24s} {e.seconds * 1e6:9.2f} {ce:>5s} {g.seconds * 1e6:9.2f} {cg:>5s} "
              f"{work / e.seconds / scale:7.1f} {unit:<3s} {work / g.seconds / scale:7.1f} {unit}"
              + ("" if g.graph else "  (timed eagerly: " + ("capture failed)" if clock.capture_failures
                                                             else "longer than the graph threshold)")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
