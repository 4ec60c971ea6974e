"""paraplan validate-published FILE: predicted vs published step time for every usable record."""
from __future__ import annotations

import json
import statistics

from importlib.resources import files

BUNDLED = str(files("paraplan.data") / "public_runs.yaml")


def add_arguments(p) -> None:
    p.add_argument("file", nargs="?", default=None,
                   help="published runs YAML (a list of records); default: the bundled copy of the public runs")
    p.add_argument("--json", action="store_true", help="print rows and summary as JSON")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")


def run(args) -> int:
    from paraplan.published import ASSUMPTIONS, evaluate, load_records

    rows = evaluate(load_records(args.file or BUNDLED))
    errs = [abs(r.error_pct) for r in rows if r.error_pct is not None]
    summary = {
        "rows": len(rows), "simulated": len(errs),
        "mape_pct": statistics.fmean(errs) if errs else None,
        "worst_abs_error_pct": max(errs) if errs else None,
    }
    if args.json:
        print(json.dumps({"rows": [
            {"id": r.id, "published_step_time_s": r.published_s, "published_is_derived": r.derived,
             "predicted_step_time_s": r.predicted_s, "error_pct": r.error_pct, "fits": r.fits,
             "error": r.error} for r in rows], "summary": summary, "assumptions": list(ASSUMPTIONS)}, indent=2))
        return 0
    if args.markdown:
        print(_markdown(rows, summary))
        return 0
    print(f"{'record':<46} {'published s':>11} {'predicted s':>11} {'error':>8}  fits")
    for r in rows:
        if r.predicted_s is None:
            print(f"{r.id:<46} {r.published_s:11.3f} {'-':>11} {'-':>8}  {r.error}")
            continue
        mark = "*" if r.derived else " "
        print(f"{r.id:<46} {r.published_s:10.3f}{mark} {r.predicted_s:11.3f} {r.error_pct:+7.1f}%  {'yes' if r.fits else 'NO'}")
    if errs:
        print(f"\nMAPE {summary['mape_pct']:.1f}% over {len(errs)} rows; worst |error| {summary['worst_abs_error_pct']:.1f}%")
    print("* published step time derived from the source's own FLOP formula and TFLOP/s")
    print("assumptions for fields a record leaves null:")
    for a in ASSUMPTIONS:
        print(f"  - {a}")
    return 0


def _markdown(rows, summary) -> str:
    out = ["| record | published step (s) | predicted (s) | error |", "|---|---:|---:|---:|"]
    for r in rows:
        pub = f"{r.published_s:.3f}" + ("*" if r.derived else "")
        if r.predicted_s is None:
            out.append(f"| {r.id} | {pub} | - | {r.error} |")
        else:
            out.append(f"| {r.id} | {pub} | {r.predicted_s:.3f} | {r.error_pct:+.1f}% |")
    out.append("")
    out.append(f"MAPE **{summary['mape_pct']:.1f}%** over {summary['simulated']} rows; "
               f"worst |error| {summary['worst_abs_error_pct']:.1f}%.")
    return "\n".join(out)
