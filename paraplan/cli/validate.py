"""paraplan validate CONFIG: predict a plan's step time, run it with the executor, compare, optionally refit.

CONFIG is an executor config (a scenario with a `run:` section, as `paraplan launch` takes).
`--profile` replaces cluster.gpu; `--layers` / `--hidden` (or the run section) scale the model
down, and that scaled model is both simulated and launched. On CPUs (gloo) a bf16 plan runs in
bf16 (the executor's cpu_bf16 path), as it is simulated. The executor times whole steps only, so the comparison is of
the total step time (the median of the measured steps); the predicted breakdown is shown beside it.

`--refit OUT.yaml` scales the profile's GEMM and attention efficiency so that this run's
prediction matches the measurement, and writes the result (calibrated: true, provenance naming
the run) atomically. Bad input (missing config, unknown profile, unwritable --refit) is one
`error:` line and exit 2, before anything runs; nothing is half-written.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from paraplan.cli.tables import model_shape


def add_arguments(p) -> None:
    from calibrate.validate import DEFAULT_TOLERANCE_PCT

    p.add_argument("config", help="executor config: scenario YAML with a run: section (e.g. best_plan.yaml)")
    p.add_argument("--profile", metavar="PROFILE", help="GPU profile (bundled name or YAML file) in place of cluster.gpu")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="nccl on GPUs, gloo on CPUs")
    p.add_argument("--steps", type=int, help="measured steps")
    p.add_argument("--warmup", type=int, metavar="STEPS", help="warm-up steps, not measured")
    p.add_argument("--layers", type=int, help="scale the model down to this many layers (simulated and launched)")
    p.add_argument("--hidden", type=int, help="scale the model down to this hidden size (simulated and launched)")
    p.add_argument("--nproc", type=int, help="processes (default: the plan's world size)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="process-group timeout")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE_PCT, metavar="PCT",
                   help=f"|error| in percent counted as a match; the exit status is 1 outside it "
                        f"(default {DEFAULT_TOLERANCE_PCT:g}; CPU timings need far more)")
    p.add_argument("--refit", metavar="OUT.yaml", help="write a profile whose compute efficiency is refit to this run")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args) -> int:
    from calibrate.validate import compare, measure, prepare, refit
    from executor.launch import LaunchError
    from hwmodels.profile import write_profile
    from paraplan.errors import ParaplanError
    from paraplan.fileio import check_distinct_files, check_profile_output
    from simulator.simulate import simulate

    if args.tolerance is not None and not 0 < args.tolerance < math.inf:
        raise ParaplanError(f"--tolerance {args.tolerance:g}: expected a positive percentage")
    if args.refit:
        check_profile_output(args.refit, "--refit")
        check_distinct_files({"config": args.config, "--refit": args.refit,
                              **({"--profile": args.profile} if args.profile and Path(args.profile).exists() else {})})
    sc, nproc = prepare(args.config, profile=args.profile, overrides=args.overrides, backend=args.backend,
                        steps=args.steps, warmup=args.warmup, layers=args.layers, hidden=args.hidden,
                        timeout=args.timeout, nproc=args.nproc)
    sim = simulate(sc)  # before the launch: a plan the simulator refuses fails fast
    try:
        m = measure([sc], nproc=nproc, backend=sc.run.backend, timeout_s=sc.run.timeout_s,
                    echo=None if args.json else print)[0]
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    report = compare(sc, sim, m, config=args.config, tolerance_pct=args.tolerance)
    if args.refit:
        r = refit(sc, m["step_time_s"], config=args.config, simulated=sim)
        write_profile(r.profile, args.refit)
        report["refit"] = {"out": args.refit, "profile": r.profile.name, "factor": r.factor,
                           "predicted_step_time_s": r.predicted_after_s, "error_pct": r.error_after_pct,
                           "note": r.note}
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0 if report["within_tolerance"] else 1  # a check that failed, as diff and pytest report it


def format_report(r: dict) -> str:
    p, model = r["plan"], r["model"]
    shape = model_shape(model)
    source = "" if r["profile_source"] == r["profile"] else f" ({r['profile_source']})"  # a bundled profile's is its name
    lines = [
        f"{r['scenario']}: {model['name']}{f' ({shape})' if shape else ''}, seq {r['seq_length']}, "
        f"batch {r['global_batch_size']}",
        f"  plan: tp {p['tp']}  pp {p['pp']}  dp {p['dp']}  cp {p['cp']}  mbs {p['micro_batch_size']}  "
        f"{p['schedule'] if p['pp'] > 1 else 'no pipeline'}",
        f"  profile {r['profile']}{source}; {r['world_size']} ranks on {r['device']} ({r['backend']}), "
        f"{r['steps']} measured steps; simulated in {r['precision_simulated']}, run in {r['compute_dtype_measured']}",
        "",
        f"  step time  predicted {r['predicted_step_time_s'] * 1e3:9.2f} ms   measured (median) "
        f"{r['measured_step_time_s'] * 1e3:9.2f} ms   error {r['error_pct']:+.1f} %  "
        f"({'within' if r['within_tolerance'] else 'outside'} the ±{r['tolerance_pct']:g} % tolerance)",
        f"  measured steps spread {r['measured_spread_pct']:.1f} % of the median" if r["measured_spread_pct"] is not None else "",
        f"  components: {r['components']['why']}; predicted breakdown (ms): "
        + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in r["components"]["predicted_breakdown_s"].items() if v),
    ]
    if "refit" in r:
        f = r["refit"]
        lines.append(f"  refit: efficiency x{f['factor']:.3g} -> {f['out']} ({f['profile']}); "
                     f"re-predicted {f['predicted_step_time_s'] * 1e3:.2f} ms, error {f['error_pct']:+.1f} %")
        if f.get("note"):
            lines.append(f"  refit note: {f['note']}")
    lines += [f"  note: {n}" for n in r["notes"]]
    return "\n".join(x for x in lines if x is not None)
