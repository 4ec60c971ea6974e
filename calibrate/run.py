"""The whole calibration, as `paraplan calibrate` runs it: check the request, find the device and
its base profile, probe its speed, plan the sweep, run the collectives on every rank and the
single-device benchmarks on rank 0, fit, and write the profile (and the report) atomically.

Nothing is written until everything has run and fitted: an interrupted or failed calibration
leaves no file behind (hwmodels.profile.write_profile and paraplan.fileio.write_atomic write a
temporary file beside the target and rename it).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path

from calibrate.errors import CalibrationError
from paraplan.errors import first_line
from paraplan.fileio import check_distinct_files, check_output_file, check_profile_suffix

__all__ = ["BENCHMARKS", "Options", "Outcome", "calibrate", "check_options", "refit_report"]

BENCHMARKS = ("gemm", "hbm", "attention", "elementwise")
"""What --skip can name; elementwise covers the norms, activations and the optimizer step."""
DEFAULT_DTYPES = ("tf32", "fp16", "bf16")
COLLECTIVE_MAX_BYTES = {("cuda", True): 2**28, ("cuda", False): 2**32, ("cpu", True): 2**22, ("cpu", False): 2**26}
"""Largest collective message (nccl-tests convention) per device and --quick."""
PG_TIMEOUT = timedelta(minutes=30)
"""How long a rank waits for the others in a collective: generous, as a full sweep's largest
messages and a rank slow to start on a busy node should not time the others out."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """What `paraplan calibrate` was asked (its options, one field each)."""

    out: Path
    """the profile to write (.yaml or .yml)."""
    device: str = "cuda"
    """cuda | cpu"""
    quick: bool = False
    """fewer shapes and repeats, smaller time budget per call (plan.TIMINGS, plan.COUNTS)."""
    collectives: bool = False
    """sweep the collectives across the ranks torchrun started (needs WORLD_SIZE > 1)."""
    base: str | None = None
    """bundled profile name or file: peaks and unmeasured fields; None: matched by GPU name (none for a CPU)."""
    name: str | None = None
    """the profile's name; None: '<base>-calibrated' on a GPU; 'cpu-<model>' on a CPU, or
    'cpu-<model>-with-<base>' with a base of another device (calibrate.build._default_name)."""
    dtypes: tuple[str, ...] | None = None
    """GEMM dtypes; None: every dtype the device (and its base profile) supports."""
    skip: frozenset[str] = frozenset()
    """benchmarks (BENCHMARKS) left out; their fields come from the base."""
    report: Path | None = None
    """a JSON file for every measurement and fit, or None."""
    threads: int | None = None
    """torch.set_num_threads on a CPU; None: torch's default."""
    progress: bool = True
    """the progress line on stderr."""


@dataclass
class Outcome:
    """What rank 0 returns: the profile as written, and everything behind it."""

    profile: object
    """hwmodels.profile.GpuProfile, exactly as the written file loads."""
    path: Path
    info: object
    """device.DeviceInfo"""
    wall_s: float
    fits: dict
    """build.Built.fits: each fit's errors and values."""
    notes: list[str]
    """skipped ops and shapes, and other things the user should know."""
    plan_items: int
    estimate_s: float | None
    """the plan's predicted duration (GPU with a base profile), None otherwise."""
    measurements: list = field(default_factory=list)
    collectives: list = field(default_factory=list)
    measured_at: str = ""
    """when the measurements were taken (ISO 8601, UTC)."""


# ----------------------------------------------------------------------------- checks


def _world(env: Mapping[str, str]) -> tuple[int, int, int, int]:
    """(world size, rank, local rank, local world size) from torchrun's environment."""
    def num(key, default):
        try:
            return int(env.get(key, default))
        except ValueError:
            raise CalibrationError(f"environment variable {key}={env.get(key)!r} is not an integer") from None

    world = num("WORLD_SIZE", 1)
    local_world = num("LOCAL_WORLD_SIZE", world)
    return world, num("RANK", 0), num("LOCAL_RANK", 0), local_world


def _unknown_benchmarks(names) -> list[str]:
    """The names among `names` that are not benchmarks (BENCHMARKS), sorted."""
    return sorted(set(names) - set(BENCHMARKS))


def _check_name(name: str | None) -> None:
    if name is not None and not name.strip():
        raise CalibrationError("--name: expected a non-empty name")
    if name is not None and not name.isprintable():  # a line break would end the profile's comment line
        raise CalibrationError(f"--name {name!r}: expected printable text on one line")


def check_options(opts: Options, env: Mapping[str, str] | None = None) -> None:
    """Everything that can be wrong with the request before a device is touched."""
    from hwmodels.profile import DTYPES

    env = os.environ if env is None else env
    out = Path(opts.out)
    check_profile_suffix(out, "--out")
    if opts.report is not None and Path(opts.report).resolve() == out.resolve():
        raise CalibrationError("--report must be another file than --out")
    _check_name(opts.name)
    if opts.device not in ("cuda", "cpu"):
        raise CalibrationError(f"--device {opts.device!r}: expected cuda or cpu")
    unknown = _unknown_benchmarks(opts.skip)
    if unknown:
        raise CalibrationError(f"--skip {', '.join(unknown)}: unknown; expected some of {', '.join(BENCHMARKS)}")
    if opts.dtypes is not None:
        bad = [d for d in opts.dtypes if d not in DTYPES or d == "fp32"]
        if bad or not opts.dtypes:
            raise CalibrationError(f"--dtypes {','.join(opts.dtypes)}: expected some of tf32, fp16, bf16, fp8 "
                                   "(fp32 GEMMs are measured as tf32)")
        if "gemm" in opts.skip:
            raise CalibrationError("--dtypes selects GEMM dtypes, but --skip gemm skips the GEMMs")
    if opts.device == "cpu" and opts.dtypes and "fp8" in opts.dtypes:
        raise CalibrationError("--dtypes fp8: fp8 GEMMs need a GPU (torch._scaled_mm on compute capability 8.9+)")
    if opts.threads is not None:
        if opts.device != "cpu":
            raise CalibrationError("--threads applies to --device cpu (a GPU's kernels do not use CPU threads)")
        cores = os.cpu_count() or 1
        if not 1 <= opts.threads <= cores:
            raise CalibrationError(f"--threads {opts.threads}: expected 1 to {cores} (this machine's CPUs)")
    if opts.device == "cpu" and opts.base is None:
        needs = sorted(set(opts.skip) & {"gemm", "hbm", "attention"})
        if needs:
            raise CalibrationError(f"--skip {', '.join(needs)} on a CPU needs --base PROFILE to take those fields from "
                                   "(a CPU has no bundled profile)")
    if set(BENCHMARKS) <= set(opts.skip) and not opts.collectives:
        raise CalibrationError("nothing to measure: every benchmark is skipped and --collectives is not given")
    world = _world(env)[0]
    if opts.collectives and world < 2:
        raise CalibrationError("--collectives needs several ranks, and this is a single process (WORLD_SIZE is 1): "
                               "run it under torchrun, e.g. torchrun --nproc-per-node 8 -m paraplan calibrate "
                               "--collectives --out ...")
    if world > 1 and not opts.collectives:
        raise CalibrationError(f"running as {world} ranks without --collectives: every rank would calibrate the same "
                               "device and write the same file; add --collectives or run a single process")


def _load_base(name: str):
    from hwmodels.profile import load_profile
    from paraplan.errors import ConfigError

    try:
        return load_profile(name)
    except ConfigError as exc:
        msg = str(exc)
        if exc.path == "cluster.gpu":  # the loader speaks of scenarios; this is an option
            msg = msg[len("cluster.gpu: "):]
        raise CalibrationError(f"--base {name}: {' '.join(msg.split())}") from None  # one line, as the CLI prints it


def _base_profile(opts: Options, info):
    """(profile, label) the calibration starts from, or (None, '') for a CPU without --base."""
    from calibrate.device import bundled_match
    from hwmodels.profile import BUNDLED, load_profile

    if opts.base is not None:
        return _load_base(opts.base), (f"{opts.base} (bundled)" if opts.base in BUNDLED else str(opts.base))
    if info.kind == "cpu":
        return None, ""
    name = bundled_match(info.name, info.memory_bytes)
    if name is None:
        raise CalibrationError(f"no bundled profile matches {info.name!r} ({info.memory_bytes / 2**30:.0f} GiB); pass "
                               f"--base NAME or --base FILE with its datasheet peaks (bundled: {', '.join(BUNDLED)})")
    return load_profile(name), f"{name} (bundled, matched to {info.name!r})"


def _dtypes(opts: Options, info, base, device) -> tuple[str, ...]:
    from calibrate.bench import fp8_supported

    peaks = dict(base.peak_flops) if base is not None else None
    ok8, why8 = fp8_supported(device)
    if opts.dtypes is not None:
        if "fp8" in opts.dtypes and not ok8:
            raise CalibrationError(f"--dtypes fp8: {why8}")
        if peaks is not None and info.kind == "cuda":
            missing = [d for d in opts.dtypes if d not in peaks]
            if missing:
                raise CalibrationError(f"--dtypes {','.join(missing)}: the base profile {base.name} has no "
                                       f"{'/'.join(missing)} peak ({base.arch})")
        return tuple(opts.dtypes)
    dts = DEFAULT_DTYPES
    if ok8 and (peaks is None or "fp8" in peaks) and info.kind == "cuda":
        dts = dts + ("fp8",)
    return dts


# ----------------------------------------------------------------------------- the run


def calibrate(opts: Options, *, env: Mapping[str, str] | None = None, stream=None) -> Outcome | None:
    """Run the calibration `opts` asks for; the Outcome on rank 0, None on the other ranks."""
    env = os.environ if env is None else env
    stream = sys.stderr if stream is None else stream
    t_start = time.monotonic()
    from datetime import datetime, timezone

    measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    check_options(opts, env)
    world, rank, local_rank, local_world = _world(env)
    out = Path(opts.out)
    if rank == 0:  # fail now, not after the sweep, if a file cannot be written where asked
        check_output_file(out, "--out")
        check_output_file(opts.report, "--report")
        check_distinct_files({"--out": out, "--report": opts.report})
    if opts.base is not None:
        _load_base(opts.base)  # a bad --base fails before torch is imported

    import torch

    from calibrate import bench
    from calibrate.device import detect
    from calibrate.plan import TIMINGS, build_plan, estimate_seconds
    from calibrate.progress import Progress

    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    info = detect(opts.device, local_rank if opts.device == "cuda" else 0)
    if info.kind == "cuda":
        torch.cuda.set_device(info.index)
        device = torch.device("cuda", info.index)
    else:
        device = torch.device("cpu")
    base, base_label = _base_profile(opts, info)
    singles = [b for b in BENCHMARKS if b not in opts.skip]
    dtypes = _dtypes(opts, info, base, device) if "gemm" in singles else ()
    timing = TIMINGS[(info.kind, opts.quick)]
    notes: list[str] = []
    samples: list = []
    measurements: list = []

    pg = False
    try:
        if world > 1:
            if world % local_world:
                raise CalibrationError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local_world}")
            backend = "nccl" if info.kind == "cuda" else "gloo"
            import torch.distributed as dist

            kwargs = {"device_id": device} if info.kind == "cuda" else {}
            _guarded(f"starting {backend} on {world} ranks", out,
                     lambda: dist.init_process_group(backend=backend, timeout=PG_TIMEOUT, **kwargs))
            pg = True
            samples = _guarded("collective sweep", out, lambda: _collectives(
                opts, info, device, backend, timing, world, rank, local_world, notes, stream if rank == 0 else None))
            if rank != 0:
                return None

        clock = bench.Clock(device)
        plan = rates = est = None
        if singles:
            rates = _guarded("speed probe", out, lambda: bench.probe_rates(
                device, dtypes or ("bf16",), clock, budget_s=timing.max_kernel_s))
            plan = build_plan(device=info.kind, quick=opts.quick, dtypes=dtypes, rates=rates)
            if base is not None and info.kind == "cuda":
                est = estimate_seconds(plan, base)
        phases = _phases(plan, rates, singles, dtypes, device=device, clock=clock, timing=timing, notes=notes)
        items = sum(count for _, count, _ in phases)
        progress = Progress(items, stream=stream, enabled=opts.progress)
        if phases:
            progress.note(f"{info.describe()}: {items} benchmarks" + (f", about {est:.0f} s" if est else ""))
        for name, count, fn in phases:
            progress.phase(name, count)
            try:
                measurements += _guarded(name + " benchmark", out, lambda: fn(progress))
            finally:
                progress.clear()

        if clock.capture_failures:
            notes.append(f"{clock.capture_failures} short call(s) could not be captured into a CUDA graph and were "
                         "timed eagerly, behind a sleep lead")
        from calibrate.build import build_profile

        wall = time.monotonic() - t_start
        try:
            built = _guarded("fitting", out, lambda: build_profile(
                info=info, base=base, base_label=base_label, measurements=measurements, collectives=samples,
                name=opts.name, mode="quick" if opts.quick else "full", timing=timing, notes=notes, wall_s=wall,
                when=measured_at))
        except CalibrationError as exc:
            if opts.report is None:
                raise
            # the measurements outlive a fit that failed: --from-report refits them once it is fixed
            _write_report(opts, Outcome(profile=None, path=out, info=info, wall_s=wall, fits={}, notes=notes,
                                        plan_items=items, estimate_s=est, measurements=measurements,
                                        collectives=samples, measured_at=measured_at))
            raise CalibrationError(f"{exc}; the measurements are in {opts.report}") from exc
        outcome = Outcome(profile=built.profile, path=out, info=info, wall_s=wall, fits=built.fits, notes=built.notes,
                          plan_items=items, estimate_s=est, measurements=measurements, collectives=samples,
                          measured_at=measured_at)
        _write(outcome, opts)
        outcome.wall_s = time.monotonic() - t_start
        return outcome
    finally:
        if pg:
            import torch.distributed as dist

            dist.destroy_process_group()


def _guarded(what: str, out: Path, fn):
    """fn(), with any failure but an interrupt or a CalibrationError turned into one line that
    names `what` failed (the traceback stays behind --debug, chained)."""
    try:
        return fn()
    except (KeyboardInterrupt, CalibrationError):
        raise
    except Exception as exc:  # noqa: BLE001 - a failure mid-way: say which, write nothing
        raise CalibrationError(f"{what} failed: {first_line(exc) or type(exc).__name__}; "
                               f"nothing written to {out}") from exc


def _phases(plan, rates, singles, dtypes, *, device, clock, timing, notes) -> list:
    """(name, items, fn(progress) -> measurements) for each single-device benchmark to run."""
    from calibrate import bench

    if plan is None:
        return []
    common = dict(device=device, clock=clock, timing=timing)
    phases = []
    if "gemm" in singles:
        for dt in dtypes:
            phases.append((f"gemm {dt}", len(plan.gemm[dt]), lambda pr, dt=dt: bench.run_gemm(
                plan.gemm[dt], dt, progress=pr, notes=notes, budget=rates.memory_budget, **common)))
    if "hbm" in singles:
        phases.append(("hbm copy/triad", 2 * len(plan.hbm_sizes), lambda pr: bench.run_hbm(
            plan.hbm_sizes, progress=pr, budget=rates.memory_budget, **common)))
    if "attention" in singles:
        phases.append(("attention fwd/bwd", 2 * len(plan.attention), lambda pr: bench.run_attention(
            plan.attention, progress=pr, notes=notes, **common)))
    if "elementwise" in singles:
        phases.append(("elementwise fwd/bwd", 2 * len(plan.elementwise), lambda pr: bench.run_elementwise(
            plan.elementwise, progress=pr, budget=rates.memory_budget, **common)))
        phases.append(("adamw step", len(plan.optimizer), lambda pr: bench.run_optimizer(
            plan.optimizer, progress=pr, notes=notes, **common)))
    return phases


def _collectives(opts, info, device, backend, timing, world, rank, local_world, notes, stream) -> list:
    """Every rank: build the tier groups, agree on what the backend supports, sweep. Rank 0's
    samples come back (the others' are the same numbers: each size's time is the group's max)."""
    import torch
    import torch.distributed as dist

    from calibrate import collectives as coll
    from calibrate.bench import memory_budget
    from calibrate.plan import collective_sizes
    from calibrate.progress import Progress

    nodes = world // local_world
    tiers = []
    if local_world > 1:
        mine = None
        for node in range(nodes):  # every rank creates every group, in the same order
            ranks = tuple(range(node * local_world, (node + 1) * local_world))
            g = dist.new_group(ranks=list(ranks))
            if rank in ranks:
                mine = coll.Tier(name="intra", group=g, ranks=ranks, nodes=1, ranks_per_node=local_world)
        tiers.append(mine)
    if nodes > 1:
        tiers.append(coll.Tier(name="inter", group=dist.group.WORLD, ranks=tuple(range(world)), nodes=nodes,
                               ranks_per_node=local_world))

    cap = COLLECTIVE_MAX_BYTES[(info.kind, opts.quick)]
    cap = min(cap, 2 ** int(math.log2(max(memory_budget(device) / 4, 2**20))))
    agreed = torch.tensor([cap], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    sizes = collective_sizes(opts.quick, int(agreed.item()))

    supported = {t.name: coll.probe_support(t, device) for t in tiers}
    total = sum(len(sizes) for t in tiers for op, why in supported[t.name].items() if not why)
    progress = Progress(total, stream=stream, enabled=stream is not None and opts.progress)
    samples = []
    for t in tiers:
        for op in coll.COLLECTIVES:
            why = supported[t.name][op]
            if why:
                note = f"{op} ({backend}, {t.name}-node) is not supported by this build: {why}; skipped"
                if note not in notes:
                    notes.append(note)
                    progress.note(note)
                continue
            progress.phase(f"{op} {t.name}-node, {len(t.ranks)} ranks", len(sizes))
            try:
                samples += coll.sweep(op, sizes, t, device=device, timing=timing, backend=backend, progress=progress)
            finally:
                progress.clear()
    dist.barrier()
    return samples


def _clean(value):
    """JSON without NaN (not valid JSON): None instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _same(a, b, rel: float = 1e-9) -> bool:
    """Equal dataclasses / tuples / curves, floats to `rel` (a YAML unit conversion can move the last bit)."""
    import dataclasses

    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b):
        return type(a) is type(b) and all(_same(getattr(a, f.name), getattr(b, f.name), rel)
                                           for f in dataclasses.fields(a) if f.compare)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=rel, abs_tol=0.0)
    return a == b


def _write_report(opts: Options, outcome: Outcome) -> None:
    """The run's --report: its device, options, fits, notes and every measurement."""
    from paraplan.fileio import write_atomic

    report = {
        "profile": str(outcome.path), "device": outcome.info.to_json(),
        "measured_at": outcome.measured_at,
        "options": {k: (sorted(v) if isinstance(v, frozenset) else str(v) if isinstance(v, Path) else v)
                    for k, v in asdict(opts).items()},
        "wall_s": outcome.wall_s, "estimate_s": outcome.estimate_s, "fits": outcome.fits, "notes": outcome.notes,
        "measurements": [m.to_json() for m in outcome.measurements],
        "collectives": [s.to_json() for s in outcome.collectives],
    }
    write_atomic(opts.report, json.dumps(_clean(report), indent=1) + "\n", "--report")


def _write(outcome: Outcome, opts: Options) -> None:
    """The report first (the measurements are kept whatever happens to the profile: `--from-report`
    refits them), the profile last, checked: its appearance means the run completed."""
    from hwmodels.profile import load_profile, write_profile

    if opts.report is not None:
        _write_report(opts, outcome)
    kept = (f"; the measurements are in {opts.report} (refit them with --from-report)" if opts.report is not None
            else "")
    # Written beside the target under a hidden name, loaded back (the format's round trip, checked
    # where the file is made), then renamed over the target: a profile that would not load is never
    # left where a scenario looks for it. A symlink at --out is written through, as every output is
    # (paraplan.fileio).
    out = Path(os.path.realpath(outcome.path))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.verify{out.suffix}")
    try:
        write_profile(outcome.profile, tmp)
        loaded = load_profile(str(tmp))
        if not _same(loaded, outcome.profile):
            raise CalibrationError(f"{outcome.path}: the profile does not load back as built (a bug; please report "
                                   f"it); not written{kept}")
        outcome.profile = loaded  # exactly what the file says (YAML units round the last bit)
        os.replace(tmp, out)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise


# ----------------------------------------------------------------------------- refit a saved run


MEASUREMENT_DTYPES = {  # per kind, the dtypes calibrate measures it in (bench.py)
    "gemm": ("tf32", "fp16", "bf16", "fp8"), "copy": ("fp32",), "triad": ("fp32",), "attention_fwd": ("bf16",),
    "attention_bwd": ("bf16",), "elementwise": ("bf16",), "elementwise_bwd": ("bf16",), "optimizer": ("fp32",)}
MEASUREMENT_KINDS = tuple(MEASUREMENT_DTYPES)
MAX_RATE = 1e18
"""FLOP/s or bytes/s no device reaches (an H100's bf16 peak is about 1e15): a report's measurement
above it is corrupt, and would fit a curve to it."""


def _positive(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{what} is {value!r}; expected a positive finite number")
    return float(value)


def _expected_work(m) -> float:
    """The work a measurement of this kind and these params does, as bench computes it: a report
    whose `work` disagrees was edited or is corrupt (its rates, and the curves, would be wrong)."""
    from calibrate.plan import ADAMW_BYTES_PER_PARAM
    from hwmodels.compute import attention_flops

    p = m.params if isinstance(m.params, dict) else {}
    if m.kind == "gemm":
        return 2.0 * math.prod(_positive(p.get(k), f"a gemm measurement's params.{k}") for k in "mnk")
    if m.kind in ("copy", "triad"):
        return (2.0 if m.kind == "copy" else 3.0) * _positive(p.get("bytes"), f"a {m.kind} measurement's params.bytes")
    if m.kind.startswith("attention"):
        keys = ("batch", "heads", "q_len", "kv_len", "head_dim")
        args = {k: int(_positive(p.get(k), f"an attention measurement's params.{k}")) for k in keys}
        return attention_flops(**args, causal=bool(p.get("causal", True)), backward=m.kind == "attention_bwd")
    kernels = p.get("kernels")
    if not isinstance(kernels, list) or not kernels:
        raise ValueError(f"a {m.kind} measurement's params.kernels is {kernels!r}; expected a list of byte counts")
    total = sum(_positive(k, f"a {m.kind} measurement's params.kernels entry") for k in kernels)
    if m.kind == "optimizer" and not math.isclose(
            total, ADAMW_BYTES_PER_PARAM * _positive(p.get("parameters"), "an optimizer measurement's params.parameters"),
            rel_tol=1e-9):
        raise ValueError(f"an optimizer measurement's params.kernels {kernels!r} do not move "
                         f"{ADAMW_BYTES_PER_PARAM} bytes per parameter")
    return total


def _check_measurement(m) -> None:
    """A measurement read back from a report: a kind and dtype calibrate writes, work and seconds
    that are positive, finite and a rate a device can reach, and work that its params do
    (ValueError otherwise)."""
    if m.kind not in MEASUREMENT_DTYPES:
        raise ValueError(f"measurement kind {m.kind!r}; known: {', '.join(MEASUREMENT_KINDS)}")
    if m.dtype not in MEASUREMENT_DTYPES[m.kind]:
        raise ValueError(f"a {m.kind} measurement in {m.dtype!r}; calibrate measures it in "
                         f"{', '.join(MEASUREMENT_DTYPES[m.kind])}")
    work = _positive(m.work, f"a {m.kind} measurement's work")
    seconds = _positive(m.seconds, f"a {m.kind} measurement's seconds")
    if work / seconds > MAX_RATE:
        raise ValueError(f"a {m.kind} measurement runs at {work / seconds:.3g} per second, "
                         f"above the {MAX_RATE:.0e} no device reaches")
    expected = _expected_work(m)
    if not math.isclose(work, expected, rel_tol=1e-6):
        raise ValueError(f"a {m.kind} measurement's work is {work:.6g}, but its params do {expected:.6g}")


def _checked_collective(s):
    """A collective sample read back from a report: an op and tier calibrate runs, at least two
    ranks on at least one node, positive bytes and seconds; its algbw and busbw recomputed from
    them (nccl-tests' definitions, calibrate.collectives), not taken from the file."""
    from calibrate.collectives import COLLECTIVES
    from hwmodels.network import busbw_factor

    if s.op not in COLLECTIVES:
        raise ValueError(f"collective op {s.op!r}; known: {', '.join(COLLECTIVES)}")
    if s.tier not in ("intra", "inter"):
        raise ValueError(f"collective tier {s.tier!r}; expected intra or inter")
    for what, value, least in (("ranks", s.ranks, 2), ("nodes", s.nodes, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"a collective's {what} is {value!r}; expected an integer of at least {least}")
    if s.tier == "inter" and s.nodes < 2:
        raise ValueError(f"an inter-node collective on {s.nodes} node; expected at least 2")
    algbw = _positive(s.nbytes, "a collective's nbytes") / _positive(s.seconds, "a collective's seconds")
    if algbw > MAX_RATE:
        raise ValueError(f"a collective moves {algbw:.3g} bytes per second, above the {MAX_RATE:.0e} "
                         "no network reaches")
    return replace(s, algbw=algbw, busbw=algbw * busbw_factor(s.op, s.ranks))


def refit_report(report: Path, out: Path, *, name: str | None = None, base: str | None = None,
                 new_report: Path | None = None) -> Outcome:
    """Fit and write a profile from the measurements a `--report` file holds, without measuring
    again (after a change to the fits, say): the run's base (its --base, or the bundled profile
    matched by the device's name) unless `base`, its name unless `name`, and a provenance line that
    says when it was refitted from which report. The new report keeps the run's options, date and
    wall time. Needs no torch."""
    from datetime import datetime, timezone

    from calibrate.build import build_profile
    from calibrate.device import DeviceInfo
    from calibrate.plan import TIMINGS
    from calibrate.results import CollectiveSample, Measurement

    report, out = Path(report), Path(out)
    _check_name(name)
    check_profile_suffix(out, "--out")
    check_output_file(out, "--out")
    check_output_file(new_report, "--report")
    check_distinct_files({"--from-report": report, "--out": out, "--report": new_report})

    def bad(why: str | BaseException) -> CalibrationError:
        if isinstance(why, BaseException):
            why = f"{type(why).__name__}: {first_line(why)}"
        return CalibrationError(f"--from-report {report}: not a report written by paraplan calibrate --report ({why})")

    try:
        data = json.loads(report.read_text())
    except FileNotFoundError:
        raise CalibrationError(f"--from-report {report}: not found") from None
    except (OSError, ValueError, RecursionError) as exc:
        raise bad(exc) from None
    if not isinstance(data, dict) or not isinstance(data.get("options"), dict) or not isinstance(data.get("device"), dict):
        raise bad("expected an object with 'device', 'options' and 'measurements'")
    options = data["options"]

    def text_or_none(value, what: str):
        if value is not None and not (isinstance(value, str) and value.strip()):
            raise TypeError(f"{what} must be a non-empty string or null, got {value!r}")
        return value

    def texts(value, what: str) -> list:
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise TypeError(f"{what} must be a list of strings or null, got {value!r}")
        return value

    try:
        device = dict(data["device"])
        if not isinstance(device.get("name"), str):
            raise TypeError(f"device.name must be a string, got {device.get('name')!r}")
        if device.get("kind") not in ("cuda", "cpu"):
            raise TypeError(f"device.kind must be cuda or cpu, got {device.get('kind')!r}")
        _positive(device.get("memory_bytes"), "device.memory_bytes")
        count = device.get("count", 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise TypeError(f"device.count must be a whole number of GPUs (0: not recorded), got {count!r}")
        info = DeviceInfo(**device)
        measurements = [Measurement(**m) for m in data["measurements"]]
        collectives = [_checked_collective(CollectiveSample(**c)) for c in data.get("collectives") or []]
        wall_s = data.get("wall_s") or 0.0
        if isinstance(wall_s, bool) or not isinstance(wall_s, (int, float)) or not 0 <= wall_s < math.inf:
            raise TypeError(f"wall_s must be a finite number of seconds >= 0, got {wall_s!r}")
        quick = options.get("quick", False)
        if not isinstance(quick, bool):
            raise TypeError(f"options.quick must be true or false, got {quick!r}")
        if not isinstance(data["measurements"], list):
            raise TypeError(f"measurements must be a list, got {type(data['measurements']).__name__}")
        timing = TIMINGS[(info.kind, quick)]
        run_notes = texts(data.get("notes"), "notes")
        dtypes = texts(options.get("dtypes"), "options.dtypes")
        skip = texts(options.get("skip"), "options.skip")
        text_or_none(options.get("base"), "options.base")
        text_or_none(options.get("name"), "options.name")
        for m in measurements:
            _check_measurement(m)
        unknown = _unknown_benchmarks(skip)
        if unknown:
            raise ValueError(f"options.skip names {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    except (KeyError, TypeError, ValueError) as exc:
        raise bad(exc) from None
    if not measurements and not collectives:
        raise CalibrationError(f"--from-report {report}: holds no measurements to fit")
    base_opt = base if base is not None else options.get("base")
    if base_opt is not None:
        _load_base(base_opt)
    base_profile, label = _base_profile(Options(out=out, device=info.kind, base=base_opt), info)
    notes = list(run_notes)
    name = name or options.get("name")
    when = data.get("measured_at") or "date not in the report"
    built = _guarded("fitting", out, lambda: build_profile(
        info=info, base=base_profile, base_label=label, measurements=measurements, collectives=collectives,
        name=name, mode=("quick" if quick else "full"), timing=timing, notes=notes, wall_s=wall_s, when=when))
    prov = dict(built.profile.provenance)
    prov["calibration"] += (f"; refitted from the report {report.name} by paraplan calibrate --from-report, "
                            f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}")
    outcome = Outcome(profile=replace(built.profile, provenance=tuple(prov.items())), path=out, info=info,
                      wall_s=wall_s, fits=built.fits, notes=list(dict.fromkeys(built.notes)),  # a refit's refit
                      plan_items=len(measurements),
                      estimate_s=None, measurements=measurements, collectives=collectives,
                      measured_at=data.get("measured_at", ""))
    _write(outcome, Options(out=out, device=info.kind, quick=quick, collectives=bool(options.get("collectives")),
                            base=base_opt, name=name, dtypes=tuple(dtypes) if dtypes else None,
                            skip=frozenset(skip), report=new_report,
                            threads=options.get("threads"), progress=False))
    return outcome
