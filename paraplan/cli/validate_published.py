"""paraplan validate-published [FILE]: predicted vs published step time for every usable record."""
from __future__ import annotations

import json
import statistics
from importlib.resources import files

from paraplan.errors import ParaplanError

BUNDLED = str(files("paraplan.data") / "public_runs.yaml")


def add_arguments(p) -> None:
    p.add_argument("file", nargs="?", default=None,
                   help="published runs YAML (a list of records); default: the bundled copy of the public runs")
    p.add_argument("--profile", action="append", default=[], metavar="BUNDLED=PROFILE",
                   help="simulate the records on a bundled GPU with another profile (a bundled name or a file), "
                        "e.g. h100-sxm-80gb-calibrated=h100-sxm-80gb for the H100 rows on the datasheet profile; "
                        "repeatable")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="print rows and summary as JSON")
    fmt.add_argument("--markdown", action="store_true", help="print the table as Markdown")


def summarise(rows) -> dict:
    """MAPE and worst row over the simulated rows, and the same per GPU profile (with the mean signed
    error, which says on which side a GPU's rows miss)."""
    errs = [abs(r.error_pct) for r in rows if r.error_pct is not None]
    by_gpu = {}
    for gpu in sorted({r.gpu for r in rows if r.error_pct is not None}):
        signed = [r.error_pct for r in rows if r.gpu == gpu and r.error_pct is not None]
        by_gpu[gpu] = {"simulated": len(signed), "mape_pct": statistics.fmean(abs(e) for e in signed),
                       "mean_error_pct": statistics.fmean(signed)}
    return {
        "rows": len(rows), "simulated": len(errs),
        "mape_pct": statistics.fmean(errs) if errs else None,
        "worst_abs_error_pct": max(errs) if errs else None,
        "by_gpu": by_gpu,
    }


def _by_gpu_line(summary: dict) -> str:
    return "by GPU: " + "; ".join(f"{gpu} MAPE {s['mape_pct']:.1f}% over {s['simulated']} rows "
                                  f"(mean error {s['mean_error_pct']:+.1f}%)" for gpu, s in summary["by_gpu"].items())


def _profiles(pairs: list[str]) -> dict[str, str]:
    """--profile BUNDLED=PROFILE pairs, checked: a bundled name on the left, a loadable profile on the right."""
    from calibrate.validate import resolve_profile
    from hwmodels.profile import BUNDLED as PROFILES

    out = {}
    for pair in pairs:
        old, sep, new = pair.partition("=")
        if not sep or old not in PROFILES or not new:
            raise ParaplanError(f"--profile {pair}: expected BUNDLED=PROFILE with BUNDLED one of {', '.join(PROFILES)}")
        if old in out:
            raise ParaplanError(f"--profile {pair}: {old} is already replaced by an earlier --profile; give it once")
        out[old] = resolve_profile(new)
    return out


def run(args) -> int:
    from paraplan.published import ASSUMPTIONS, evaluate, load_records, not_compared

    path = args.file or BUNDLED
    records = load_records(path)
    swaps = _profiles(args.profile)
    rows = evaluate(records, profiles=swaps)
    left_out = not_compared(records)
    if not rows:
        raise ParaplanError(f"{path}: no record publishes a step time (or enough to derive one) with a global batch size")
    unused = sorted(set(swaps) - {r.gpu_bundled for r in rows})
    if unused:
        raise ParaplanError(f"--profile {unused[0]}=...: no compared record runs on {unused[0]} "
                            f"(they run on {', '.join(sorted({r.gpu_bundled for r in rows if r.gpu_bundled}))})")
    if all(r.predicted_s is None for r in rows):
        first = rows[0]
        raise ParaplanError(f"{path}: none of the {len(rows)} comparable records could be simulated "
                            f"(first, {first.id}: {first.error})")
    groups = {"dense": [r for r in rows if not r.moe], "moe": [r for r in rows if r.moe]}
    summary = {name: summarise(g) for name, g in groups.items()}
    if args.json:
        print(json.dumps({"rows": [
            {"id": r.id, "moe": r.moe, "published_step_time_s": r.published_s, "published_is_derived": r.derived,
             "predicted_step_time_s": r.predicted_s, "error_pct": r.error_pct, "fits": r.fits,
             "error": r.error, "gpu": r.gpu, "gpu_bundled": r.gpu_bundled} for r in rows], "summary": summary,
            "not_compared": [{"id": i, "reason": why} for i, why in left_out],
            "assumptions": list(ASSUMPTIONS), "profile_swaps": swaps}, indent=2))
        return 0
    if args.markdown:
        for name, g in groups.items():
            if g:
                print(_markdown(g, summary[name], name))
                print()
        for i, why in left_out:
            print(f"Not compared: {i} ({why}).")
        return 0
    for name, g in groups.items():
        if not g:
            continue
        print(f"{name + ' records':<50} {'published s':>11} {'predicted s':>11} {'error':>8}  fits")
        for r in g:
            mark = "*" if r.derived else " "
            if r.predicted_s is None:
                print(f"{r.id:<50} {r.published_s:10.3f}{mark} {'-':>11} {'-':>8}  {r.error}")
                continue
            print(f"{r.id:<50} {r.published_s:10.3f}{mark} {r.predicted_s:11.3f} {r.error_pct:+7.1f}%  "
                  f"{'yes' if r.fits else 'NO'}")
        sm = summary[name]
        if sm["simulated"]:
            print(f"{name}: MAPE {sm['mape_pct']:.1f}% over {sm['simulated']} rows; "
                  f"worst |error| {sm['worst_abs_error_pct']:.1f}%")
            print(f"  {_by_gpu_line(sm)}\n")
    if left_out:
        print("not compared:")
        for i, why in left_out:
            print(f"  {i}: {why}")
        print()
    print("* published step time derived from the source's throughput (its TFLOP/s inverted with its own FLOP "
          "formula, or its tokens/s)")
    for old, new in swaps.items():
        print(f"profile swap (--profile): rows mapped to {old} ran on {new}; the GPU assumption below names the default")
    print("assumptions for fields a record leaves null:")
    for a in ASSUMPTIONS:
        print(f"  - {a}")
    return 0


def _markdown(rows, summary, name) -> str:
    out = ["| record | published step (s) | predicted (s) | error |", "|---|---:|---:|---:|"]
    for r in rows:
        pub = f"{r.published_s:.3f}" + ("*" if r.derived else "")
        if r.predicted_s is None:
            out.append(f"| {r.id} | {pub} | - | {r.error} |")
        else:
            out.append(f"| {r.id} | {pub} | {r.predicted_s:.3f} | {r.error_pct:+.1f}% |")
    out.append("")
    out.append(f"{name}: MAPE **{summary['mape_pct']:.1f}%** over {summary['simulated']} rows; "
               f"worst |error| {summary['worst_abs_error_pct']:.1f}%; {_by_gpu_line(summary)}.")
    return "\n".join(out)
