"""Closed loop: simulate a plan, run it with the executor, compare, and (optionally) refit the profile.

`paraplan validate` is a thin CLI over this module. The pieces:

- `prepare(config, ...)`: the scaled-down scenario exactly as the executor will run it (the same
  checks and run-section overrides as `paraplan launch`, via `paraplan.cli.launch.prepare`), with
  `--profile` in place of `cluster.gpu`. The *same* scaled scenario is simulated and launched, so
  prediction and measurement describe one job.
- `cpu_bf16(sc)`: on CPUs (gloo) the executor would run a bf16 plan in fp32 unless asked not to;
  the closed loop asks it to run bf16 (its cpu_bf16 path), so the job measured is the job
  simulated (bf16, with the CPU profile's measured bf16 GEMM curve).
- `measure(scenarios, ...)`: one torchrun job for several plans (executor.launch.launch), which
  amortises torchrun's start-up.
- `compare(...)`: predicted vs measured step time (the executor's median over the measured
  steps) and the error. The executor times whole steps only (no per-component timers), so the
  per-component comparison is limited to the total; the predicted breakdown is reported
  alongside for information.
- `refit(...)`: scale the profile's GEMM and attention efficiency curves by one factor k
  (clamped into (0, 1]) so that re-simulating this run gives the measured step time, and return
  the new profile with provenance. k is found by a safeguarded secant search in log k on the
  simulator itself (a few simulations of a small plan), because the step time is not exactly
  proportional to 1/k: communication, memory-bound ops and the optimizer do not scale with it,
  and curves clamp at 1. Memory-bound (HBM) efficiency and the links are left alone: they are
  not "compute efficiency", and one total step time cannot tell them apart.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

from paraplan.errors import ParaplanError

__all__ = ["Refit", "compare", "cpu_bf16", "measure", "prepare", "refit", "resolve_profile"]

DEFAULT_TOLERANCE_PCT = 15.0
"""What the CLI calls a match by default: the accuracy target on a dedicated GPU node (see
tests/test_validate.py for why CPU runs need a much looser one)."""


def resolve_profile(profile: str | None) -> str | None:
    """A bundled name, or an absolute path to an existing profile file; ParaplanError otherwise."""
    if profile is None:
        return None
    from hwmodels.profile import BUNDLED, load_profile

    if profile in BUNDLED:
        return profile
    path = Path(profile).expanduser()
    if not path.is_file():
        raise ParaplanError(f"--profile {profile}: not found (neither a bundled profile: {', '.join(BUNDLED)}, "
                            "nor an existing profile file)")
    try:
        load_profile(str(path.resolve()))
    except ParaplanError as exc:
        raise ParaplanError(f"--profile {profile}: {exc}") from None
    return str(path.resolve())


def prepare(config: str, *, profile: str | None = None, overrides=(), backend: str | None = None,
            steps: int | None = None, warmup: int | None = None, seed: int | None = None,
            layers: int | None = None, hidden: int | None = None, timeout: float | None = None,
            nproc: int | None = None):
    """(scaled scenario, nproc): checked like `paraplan launch` does, with --profile as cluster.gpu."""
    from paraplan.cli.launch import prepare as launch_prepare

    if not Path(config).is_file():
        raise ParaplanError(f"{config}: config file not found")
    overrides = list(overrides)
    gpu = resolve_profile(profile)
    if gpu is not None:
        overrides.append(f"cluster.gpu={gpu}")
    args = argparse.Namespace(config=config, overrides=overrides, backend=backend, steps=steps, warmup=warmup,
                              seed=seed, layers=layers, hidden=hidden, timeout=timeout, nproc=nproc, nnodes=1,
                              node_rank=0, rdzv_endpoint=None, out=None, run_dir=None)
    return launch_prepare(args)


def cpu_bf16(sc) -> bool:
    """Run a bf16 plan in bf16 on CPUs too (the executor's cpu_bf16 test path).

    By default the executor runs bf16 plans in fp32 on CPUs, which is not the job the simulator
    predicts (and the simulator has no fp32-activation path to predict it with); the calibrated CPU
    profile has a measured bf16 GEMM curve, so the closed loop runs the plan as written."""
    return sc.run.backend == "gloo" and sc.training.precision == "bf16"


def measure(scenarios, *, nproc: int, backend: str, timeout_s: float, echo=None, run_dir=None) -> list[dict]:
    """Measure every scenario in one torchrun job (start-up paid once)."""
    from executor.launch import launch

    scenarios = list(scenarios)
    return launch(scenarios, nproc=nproc, backend=backend, timeout_s=timeout_s, echo=echo, run_dir=run_dir,
                  cpu_bf16=any(cpu_bf16(s) for s in scenarios))


def _profile_of(sc):
    from hwmodels.profile import load_profile

    return load_profile(sc.cluster.gpu)


def _plan_json(sc) -> dict:
    from executor.config import scenario_to_json

    return scenario_to_json(sc)["plan"]


def error_pct(predicted: float, measured: float) -> float:
    return 100.0 * (predicted - measured) / measured


def compare(sc, sim, measurement: dict, *, config: str, tolerance_pct: float, notes=()) -> dict:
    """The report: predicted vs measured step time, per component where measured, and the error."""
    pred, meas = sim.step_time_s, measurement["step_time_s"]
    err = error_pct(pred, meas)
    measured_steps = [s["time_s"] for s in measurement["steps"] if not s["warmup"]]
    prof = _profile_of(sc)
    return {
        "config": str(config),
        "scenario": sc.name,
        "profile": prof.name,
        "profile_source": sc.cluster.gpu,
        "profile_calibrated": prof.calibrated,
        "plan": _plan_json(sc),
        "model": {"name": sc.model.name, "num_layers": sc.model.num_layers, "hidden_size": sc.model.hidden_size},
        "seq_length": sc.training.seq_length,
        "global_batch_size": sc.training.global_batch_size,
        "precision_simulated": sc.training.precision,
        "compute_dtype_measured": measurement.get("compute_dtype"),
        "backend": measurement.get("backend"),
        "device": measurement.get("device"),
        "world_size": measurement.get("world_size"),
        "steps": len(measured_steps),
        "warmup_steps": sum(1 for s in measurement["steps"] if s["warmup"]),
        "predicted_step_time_s": pred,
        "measured_step_time_s": meas,
        "measured_step_times_s": measured_steps,
        "measured_spread_pct": (100.0 * (max(measured_steps) - min(measured_steps)) / meas) if measured_steps else None,
        "error_pct": err,
        "tolerance_pct": tolerance_pct,
        "within_tolerance": abs(err) <= tolerance_pct,
        "components": {
            "compared": ["step"],
            "why": "the executor measures whole-step time only (no per-component timers); "
                   "only the total is compared",
            "predicted_breakdown_s": dict(sim.breakdown),
        },
        "notes": _profile_notes(prof, measurement) + list(notes) + list(measurement.get("notes", [])),
    }


def _profile_notes(prof, measurement: dict) -> list[str]:
    """A GPU's profile predicting a run on CPUs: the error then measures the CPU, not the model."""
    if measurement.get("device") != "cpu" or prof.name.startswith("cpu"):
        return []
    return [f"predicted with {prof.name}, a GPU's profile, for a run on CPUs: the error compares two devices; "
            "calibrate this CPU (paraplan calibrate --device cpu --out cpu.yaml) and validate with --profile cpu.yaml"]


# ------------------------------------------------------------------------------------------ refit


@dataclass(frozen=True)
class Refit:
    profile: object
    """hwmodels.profile.GpuProfile with scaled GEMM and attention curves."""
    factor: float
    """k: every GEMM / attention efficiency was multiplied by it (then capped at 1)."""
    predicted_before_s: float
    predicted_after_s: float
    measured_s: float
    note: str = ""
    """Why the measurement was not reached, when it was not (every efficiency capped at 1, or the
    residual is in time the compute curves do not set)."""

    @property
    def error_before_pct(self) -> float:
        return error_pct(self.predicted_before_s, self.measured_s)

    @property
    def error_after_pct(self) -> float:
        return error_pct(self.predicted_after_s, self.measured_s)


def scaled_profile(profile, k: float):
    """`profile` with its GEMM and attention efficiencies (FlashAttention-2-class and, where the
    profile has them, FlashAttention-3-class and per head dim) times k, kept in (0, 1]."""
    from hwmodels.curves import Curve
    from hwmodels.profile import HEAD_DIM_FIELDS

    def scale(c):
        return Curve(c.xs, tuple(min(1.0, max(1e-9, y * k)) for y in c.ys))

    flash3 = profile.attention_flash3_efficiency
    return dataclasses.replace(
        profile,
        gemm_efficiency=tuple((d, scale(c)) for d, c in profile.gemm_efficiency),
        attention_fwd_efficiency=scale(profile.attention_fwd_efficiency),
        attention_bwd_efficiency=scale(profile.attention_bwd_efficiency),
        attention_flash3_efficiency=None if flash3 is None else tuple(scale(c) for c in flash3),
        **{f: tuple((d, scale(fw), scale(bw)) for d, fw, bw in getattr(profile, f))
           for f in HEAD_DIM_FIELDS},
    )


def _saturating_factor(profile) -> float:
    """The k beyond which every scaled efficiency sits at 1: more changes nothing."""
    from hwmodels.profile import HEAD_DIM_FIELDS

    ys = [y for _, c in profile.gemm_efficiency for y in c.ys]
    ys += list(profile.attention_fwd_efficiency.ys) + list(profile.attention_bwd_efficiency.ys)
    for c in profile.attention_flash3_efficiency or ():
        ys += list(c.ys)
    for f in HEAD_DIM_FIELDS:
        ys += [y for _, fw, bw in getattr(profile, f) for y in fw.ys + bw.ys]
    return 1.0 / min(ys)


def refit(sc, measured_s: float, *, config: str = "", when: _dt.datetime | None = None,
          iterations: int = 8, rel_tol: float = 0.005, simulated=None) -> Refit:
    """Refit the compute efficiency of `sc`'s profile so that simulating `sc` gives `measured_s`.

    `sc` is the scenario that was simulated and launched; `simulated`, its SimResult when the
    caller has it already. If no k in [1e-4, 1e4] reaches the measurement (e.g. it is faster than
    the predicted communication alone), the closest is kept. Only step times are compared, so the
    MoE balanced-router reference run is skipped.
    """
    from hwmodels.profile import write_profile
    from simulator.simulate import simulate

    base = _profile_of(sc)
    first = simulated if simulated is not None else simulate(sc, imbalance_reference=False, record_spans=False)
    before = first.step_time_s
    with tempfile.TemporaryDirectory(prefix="paraplan-refit-") as tmp:
        cache: dict[float, float] = {}

        def sim(k: float) -> float:
            if k not in cache:
                path = Path(tmp) / f"k{len(cache)}.yaml"
                write_profile(scaled_profile(base, k), path)
                cache[k] = simulate(dataclasses.replace(sc, cluster=dataclasses.replace(sc.cluster, gpu=str(path))),
                                    imbalance_reference=False, record_spans=False).step_time_s
            return cache[k]

        # first guess: the whole residual is compute (and recompute) time, which scales as 1/k
        bd = first.breakdown
        c = bd.get("compute", 0.0) + bd.get("recompute", 0.0)
        target_c = c + (measured_s - before)
        k = c / target_c if c > 0 and target_c > 0 else (1e4 if measured_s < before else 1e-4)
        lo, hi = 1e-4, 1e4
        k = min(hi, max(lo, k))
        # safeguarded secant on g(log k) = log sim(k) - log measured, which decreases with k
        g = lambda kk: math.log(sim(kk)) - math.log(measured_s)  # noqa: E731
        x0, g0 = 0.0, g(1.0)
        x1 = math.log(k)
        bracket_lo, bracket_hi = math.log(lo), math.log(hi)  # g >= 0 at lo side, g <= 0 at hi side
        if g0 > 0:
            bracket_lo = 0.0
        else:
            bracket_hi = 0.0
        for _ in range(iterations):
            g1 = g(math.exp(x1))
            if abs(g1) < rel_tol:
                break
            if g1 > 0:
                bracket_lo = max(bracket_lo, x1)
            else:
                bracket_hi = min(bracket_hi, x1)
            x2 = x1 - g1 * (x1 - x0) / (g1 - g0) if g1 != g0 else (bracket_lo + bracket_hi) / 2
            if not bracket_lo < x2 < bracket_hi:
                x2 = (bracket_lo + bracket_hi) / 2
            x0, g0, x1 = x1, g1, x2
        closest = min(abs(math.log(t / measured_s)) for t in cache.values())
        # of the factors that come as close, the smallest: past saturation every k predicts alike
        best = min(kk for kk, t in cache.items() if abs(math.log(t / measured_s)) <= closest + 1e-12)
        saturating = _saturating_factor(base)
        if best > saturating:  # every efficiency is at 1 from there on: report that factor, not the bracket's end
            best = saturating
        after = sim(best)
    note = ""
    if abs(math.log(after / measured_s)) > 2 * rel_tol:
        if measured_s < after:
            capped = best >= saturating
            note = (f"the measurement ({measured_s * 1e3:.4g} ms) is faster than any compute efficiency reaches: "
                    + ("every GEMM and attention efficiency is at 1 (peak), " if capped else "")
                    + f"the remaining {after * 1e3:.4g} ms is time the compute curves do not set (communication, "
                    "memory-bound kernels, the pipeline); the refit profile holds the closest it got")
        else:
            note = (f"the measurement ({measured_s * 1e3:.4g} ms) is slower than the lowest efficiency tried "
                    f"reaches ({after * 1e3:.4g} ms)")

    when = when or _dt.datetime.now(_dt.timezone.utc)
    what = (f"refit by paraplan validate on {when.strftime('%Y-%m-%d %H:%M UTC')} from run of {config or sc.name} "
            f"(plan tp{sc.plan.tp} pp{sc.plan.pp} dp{sc.plan.dp}, {sc.model.num_layers} layers, hidden "
            f"{sc.model.hidden_size}, seq {sc.training.seq_length}, {sc.training.precision}): measured step "
            f"{measured_s * 1e3:.4g} ms vs predicted {before * 1e3:.4g} ms; efficiency x{best:.4g} (capped at 1), "
            f"re-predicted {after * 1e3:.4g} ms; base profile {base.name}")
    prov = {key: (f"{text} [then scaled x{best:.4g} by a refit, see 'refit']"
                  if key.startswith(("gemm_efficiency", "attention_efficiency")) else text)
            for key, text in base.provenance}
    prov["refit"] = what + (f"; {note}" if note else "")
    name = base.name if base.name.endswith("-refit") else f"{base.name}-refit"
    profile = dataclasses.replace(scaled_profile(base, best), name=name, calibrated=True,
                                  provenance=tuple(prov.items()))
    return Refit(profile=profile, factor=best, predicted_before_s=before, predicted_after_s=after,
                 measured_s=measured_s, note=note)
