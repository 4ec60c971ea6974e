"""The GEMM model against measured H100 GEMM times: OpenXLA's sm_90 matmul table.

OpenXLA ships measured matmul throughput for Hopper (sm_90) as the default table of its GPU cost
model: 375 shapes, batch 1, 2, 4 x m, n, k in {256, ..., 4096}, in bf16 and in f32 (run on the
TF32 tensor cores: 4096^3 reaches 402 TFLOP/s, six times the FP32 peak of 66.9), from
https://github.com/tensorflow/tensorflow/blob/372d578bb861cc5804e56d37d93aec931a59762c/third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h
(Apache-2.0), copied to benchmarks/data/openxla_sm90_matmul.csv. Its 4096^3 bf16 rate, 783 TFLOP/s,
is above the H100 PCIe's 756 TFLOP/s dense peak, so the table was measured on an SXM-class part.

    python benchmarks/gemm_table_accuracy.py                 # the bundled profile vs the table
    python benchmarks/gemm_table_accuracy.py --fit           # refit the curves, print the knots

Prints, per FLOP range, the mean signed and absolute error of hwmodels.compute.gemm_time (the
function the simulator calls) against every measured shape. `--fit` fits the efficiency curves
with calibrate.fit.fit_gemm (what `paraplan calibrate` runs on a user's GPU) on the batch-1
shapes, so the batch-2 and batch-4 shapes are held out.
"""
from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

from calibrate.fit import fit_gemm
from hwmodels.compute import gemm_time
from hwmodels.profile import load_profile

TABLE = Path(__file__).with_name("data") / "openxla_sm90_matmul.csv"
DTYPES = {"bf16xbf16->bf16": "bf16", "f32xf32->f32": "tf32"}
BANDS = ((0, 1), (1, 4), (4, 16), (16, 64), (64, 600))
"""GFLOP ranges of one GEMM (2 x b x m x n x k)."""


def read_table(path: Path = TABLE) -> list[dict]:
    """Rows of the table: b, m, n, k, dtype (bf16 or tf32), measured seconds."""
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            b, m, n, k = (int(r[x]) for x in "bmnk")
            rows.append({"b": b, "m": m, "n": n, "k": k, "dtype": DTYPES[r["dtype"]],
                         "seconds": 2.0 * b * m * n * k / float(r["flops_per_s"])})
    return rows


def errors(profile, rows: list[dict]) -> list[float]:
    """predicted / measured - 1 for each row, through hwmodels.compute.gemm_time."""
    return [gemm_time(profile, r["m"], r["n"], r["k"], r["dtype"], batch=r["b"]) / r["seconds"] - 1.0 for r in rows]


def gflops(r: dict) -> float:
    return 2e-9 * r["b"] * r["m"] * r["n"] * r["k"]


def mape(errs: list[float]) -> float:
    return 100.0 * statistics.fmean(abs(e) for e in errs)


def report(profile_name: str) -> None:
    profile = load_profile(profile_name)
    rows = read_table()
    print(f"{profile.name} gemm_time vs OpenXLA sm_90 measurements (error = predicted / measured time - 1)")
    for dtype in ("bf16", "tf32"):
        of_dtype = [r for r in rows if r["dtype"] == dtype]
        errs = errors(profile, of_dtype)
        held = [e for r, e in zip(of_dtype, errs) if r["b"] > 1]
        print(f"\n{dtype}: {len(errs)} shapes, MAPE {mape(errs):.1f}%, median error "
              f"{100 * statistics.median(errs):+.1f}%; batch 2 and 4 only: MAPE {mape(held):.1f}%")
        print("  GFLOP per GEMM   shapes   mean error   MAPE")
        for lo, hi in BANDS:
            band = [e for r, e in zip(of_dtype, errs) if lo <= gflops(r) < hi]
            if band:
                print(f"  [{lo:>3}, {hi:>3})     {len(band):>6}   {100 * statistics.fmean(band):+9.1f}%  {mape(band):5.1f}%")


def refit(profile_name: str) -> None:
    profile = load_profile(profile_name)
    table = read_table()
    for dtype in ("bf16", "tf32"):
        rows = [r for r in table if r["dtype"] == dtype and r["b"] == 1]
        res = fit_gemm([(r["m"], r["n"], r["k"]) for r in rows], [r["seconds"] for r in rows],
                       dtype=dtype, profile=profile)
        print(f"{dtype}: fitted to all {res.n_train} shapes (MAPE {res.train_mape:.1f}%); a fit without {res.n_test} "
              f"of them predicted those with MAPE {res.test_mape:.1f}% (worst {res.test_max_ape:.1f}%)")
        print(f"  gflops: {[round(x / 1e9, 4) for x in res.curve.xs]}")
        print(f"  efficiency: {[round(y, 4) for y in res.curve.ys]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="h100-sxm-80gb", help="GPU profile name or file (default h100-sxm-80gb)")
    ap.add_argument("--fit", action="store_true", help="fit the bf16 and tf32 curves to the batch-1 shapes")
    args = ap.parse_args()
    (refit if args.fit else report)(args.profile)


if __name__ == "__main__":
    main()
