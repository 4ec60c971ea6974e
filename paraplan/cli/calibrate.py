"""paraplan calibrate --out FILE: microbenchmarks on this machine, fitted into a hardware profile.

    paraplan calibrate --out profiles/my-h100.yaml                 # one GPU
    paraplan calibrate --device cpu --quick --out cpu.yaml         # the CPU (CI, laptops)
    torchrun --nproc-per-node 8 -m paraplan calibrate --collectives --out profiles/my-node.yaml

The profile is written only when the whole run has finished (atomically): use it in a scenario
as `cluster: {gpu: profiles/my-h100.yaml, ...}`.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from calibrate.run import BENCHMARKS, Options
from paraplan.cli.torch_check import require_torch
from paraplan.errors import Terminated

# Held-out error above which a fitted table is called out in the summary.
POOR_FIT_MAPE = 25.0  # percent, as the fits report it


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, metavar="FILE.yaml", help="profile to write (atomically, when done)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="what to calibrate (default cuda; under torchrun each rank uses cuda:LOCAL_RANK)")
    p.add_argument("--quick", action="store_true",
                   help="fewer shapes and repeats: about 30 GEMM shapes per dtype, 5 repeats (under 2 min on an H100)")
    p.add_argument("--collectives", action="store_true",
                   help="also sweep all_reduce, all_gather, reduce_scatter, all_to_all, send/recv across the "
                        "ranks torchrun started (NCCL; gloo with --device cpu)")
    p.add_argument("--base", metavar="NAME|FILE",
                   help="profile whose peaks and unmeasured fields to keep (default: the bundled profile matching "
                        "the GPU's name; none for a CPU)")
    p.add_argument("--name", help="the profile's name (default: BASE-calibrated on a GPU; cpu-<model> on a CPU, cpu-<model>-with-BASE when --base is another device's profile)")
    p.add_argument("--dtypes", type=_list, metavar="LIST",
                   help="GEMM dtypes, comma-separated from tf32,fp16,bf16,fp8 (default: all the device supports)")
    p.add_argument("--skip", type=_list, action="extend", default=[], metavar="LIST",
                   help=f"benchmarks to leave out, from {','.join(BENCHMARKS)} (their fields come from --base)")
    p.add_argument("--report", metavar="FILE.json", help="also write every measurement and fit as JSON")
    p.add_argument("--threads", type=int, metavar="N", help="CPU threads for --device cpu (default: torch's)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress line on stderr")
    p.add_argument("--from-report", metavar="REPORT.json",
                   help="measure nothing: fit and write the profile from the measurements of an earlier run's "
                        "--report (no GPU or torch needed); --base overrides the run's base")


def _list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def run(args) -> int:
    from calibrate.run import calibrate

    if getattr(args, "from_report", None) is not None:  # callers that build the namespace may leave it out
        return _refit(args)
    require_torch("calibrate", minimum=None)

    opts = Options(
        out=Path(args.out), device=args.device, quick=args.quick, collectives=args.collectives, base=args.base,
        name=args.name, dtypes=tuple(args.dtypes) if args.dtypes is not None else None, skip=frozenset(args.skip),
        report=Path(args.report) if args.report else None, threads=args.threads, progress=args.progress,
    )
    try:
        outcome = calibrate(opts)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (Terminated)
        word, code = ("terminated", 143) if isinstance(stop, Terminated) else ("interrupted", 130)
        print(f"error: calibration {word}; nothing written to {args.out}", file=sys.stderr)
        return code
    if outcome is not None:
        print(format_summary(outcome))
    return 0


def _refit(args) -> int:
    """--from-report: the options that choose what to measure do not apply."""
    from calibrate.errors import CalibrationError
    from calibrate.run import refit_report

    measuring = [flag for flag, given in (("--device", args.device != "cuda"), ("--quick", args.quick),
                                          ("--collectives", args.collectives),
                                          ("--dtypes", args.dtypes is not None), ("--skip", bool(args.skip)),
                                          ("--threads", args.threads is not None)) if given]
    if measuring:
        raise CalibrationError(f"--from-report refits an earlier run's measurements; {', '.join(measuring)} "
                               "choose what to measure and do not apply (the report records them)")
    outcome = refit_report(Path(args.from_report), Path(args.out), name=args.name, base=args.base,
                           new_report=Path(args.report) if args.report else None)
    lines = format_summary(outcome).splitlines()
    lines[0] = f"wrote {outcome.path}: {outcome.profile.name} (refitted from {args.from_report}, no measurement run)"
    print("\n".join(lines))
    return 0


def _pct(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}%"


def format_summary(o) -> str:
    p, f = o.profile, o.fits
    lines = [f"wrote {o.path}: {p.name} (calibrated in {o.wall_s:.1f} s)", f"  device      {o.info.describe()}"]
    gemm = [(d, f[f"gemm.{d}"]) for d in ("tf32", "fp16", "bf16", "fp8") if f"gemm.{d}" in f]
    if gemm:
        lines.append("  GEMM        shapes  best TFLOP/s  peak TFLOP/s  best eff  median eff  held-out MAPE (n)    fit MAPE")
        for d, g in gemm:
            lines.append(f"    {d:<8} {g['shapes']:>8}  {g['best_tflops']:>12.4g}  {p.peak(d) / 1e12:>12.4g}  "
                         f"{g['best_efficiency']:>8.3f}  {g['median_efficiency']:>10.3f}  "
                         f"{_pct(g['test_mape']):>10} ({g['n_test']:>2})  {_pct(g['train_mape']):>10}")
    if "hbm.copy" in f:
        h = f["hbm.copy"]
        copies = [m for m in o.measurements if m.kind == "copy"]
        best = max(m.work / m.seconds for m in copies) / 1e9
        lines.append(f"  HBM copy    best {best:.3g} GB/s of {p.hbm_bandwidth / 1e9:.4g} GB/s; efficiency "
                     f"{min(p.hbm_efficiency.ys):.2f}-{max(p.hbm_efficiency.ys):.2f}"
                     + (f", {h['overhead_s'] * 1e6:.2f} us per copy" if "overhead_s" in h else "")
                     + f"; held-out MAPE {_pct(h['test_mape'])} ({h['n_test']}), train {_pct(h['train_mape'])}")
    for d in ("fwd", "bwd"):
        if f"attention.{d}" in f:
            a = f[f"attention.{d}"]
            lines.append(f"  attention   {d}: {a['configs']} configs, best {a['best_tflops']:.4g} TFLOP/s, efficiency "
                         f"{min(a['values']):.3f}-{max(a['values']):.3f}; held-out MAPE {_pct(a['test_mape'])} "
                         f"({a['n_test']}), train {_pct(a['train_mape'])}"
                         + (f"; {'/'.join(a['backend'])} -> {a['field']}" if a.get("backend") else ""))
            per_dim = [(k.rsplit(".d", 1)[1], v) for k, v in f.items() if k.startswith(f"attention.{d}.d")]
            if per_dim:
                lines.append(f"              {d} per head dim (curves of their own, which the simulator reads "
                             "instead of the one above): " + ", ".join(
                    f"d{hd} held-out MAPE {_pct(v['test_mape'])} ({v['n_test']}), train {_pct(v['train_mape'])}"
                    for hd, v in per_dim))
    mb = [(k.split(".", 1)[1], v) for k, v in f.items() if k.startswith("memory_bound.")]
    if mb:
        lines.append("  memory-bound kernels, memory_bound_time vs measured (MAPE, model/measured): "
                     + ", ".join(f"{op} {_pct(v['test_mape'])} x{v['model_over_measured']:.2f}" for op, v in mb))
    bwd = [(k.split(".", 1)[1], v) for k, v in f.items() if k.startswith("memory_bound_backward.")]
    if bwd:
        lines.append("  memory-bound backward over forward, measured (the simulator's fused-kernel factor; torch's "
                     "SwiGLU is an unfused silu and product, whose bytes say 1.80): "
                     + ", ".join(f"{op} {v['measured_over_forward']:.2f} ({v['model_over_forward']:.2f})"
                                 for op, v in bwd))
    coll = [(k.split(".", 2)[1:], v) for k, v in f.items() if k.startswith("collective.")]
    if coll:
        lines.append("  collectives tier   op              ranks  alpha (us)  busbw GB/s  peak measured  held-out MAPE")
        for (tier, op), v in coll:
            lines.append(f"    {v['backend']:<7} {tier:<6} {op:<15} {v['ranks']:>5}  {v['alpha_us']:>10.2f}  "
                         f"{v['busbw_GBps']:>10.4g}  {v['max_measured_busbw_GBps']:>13.4g}  {_pct(v['test_mape']):>13}")
    for note in o.notes:
        lines.append(f"  note: {note}")
    # fits only: the memory-bound kernels are a check of the model, printed above
    poor = [(k, v["test_mape"]) for k, v in f.items()
            if isinstance(v, dict) and not k.startswith("memory_bound.") and (v.get("test_mape") or 0) > POOR_FIT_MAPE]
    for key, err in poor:
        lines.append(f"  warning: the {key} fit misses its held-out measurements by {_pct(err)} (MAPE): the timings "
                     f"on this device are noisy or do not follow the model; predictions from this profile inherit it")
    return "\n".join(lines)
