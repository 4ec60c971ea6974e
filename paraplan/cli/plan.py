"""paraplan plan SCENARIO: search the plan space, rank the plans, write a launchable config.

    paraplan plan scenarios/llama3-70b-1024xh100.yaml --out runs/llama70b
    paraplan plan SCENARIO --objective cost --trials 500 --workers 2
    paraplan plan SCENARIO --storage postgresql://host/db --study run1     # many machines, one search
    paraplan plan SCENARIO --study run1 --resume                          # after Ctrl-C or a crash

Writes, under --out DIR (default: a new folder plan-<scenario> here):
    report.txt          the ranked table and the rejection summary (also printed)
    top_plans.json      the ranked plans with their predicted metrics
    best_plan.yaml      the best plan as an executor config: `paraplan launch DIR/best_plan.yaml`
    megatron_args.txt   the same plan as Megatron-LM arguments
    torchtitan.toml     the same plan as a torchtitan job config
    history.png, importance.png, pareto.png (two-value objectives)
    study.journal       the Optuna study (unless --storage names another), what --resume reads
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from paraplan.errors import ConfigError, ParaplanError
from paraplan.fileio import check_distinct_files, check_output_dir, write_files_atomic
from paraplan.loader import MAX_SEED, MAX_SEED_TEXT
from paraplan.specs import OBJECTIVES

JOURNAL = "study.journal"


def _number(cast, what: str, ok):
    """An argparse type: `cast` the text, then require `ok(value)`; errors say `what` was expected."""
    def parse(text: str):
        try:
            v = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text if cast is float else v}")
        return v
    return parse


_positive_int = _number(int, "a positive integer", lambda v: v >= 1)
_seed = _number(int, f"an integer from 0 to {MAX_SEED_TEXT}", lambda v: 0 <= v <= MAX_SEED)
# a process per worker: more than a few per core only queue, and a typo like 100000 would fork-bomb
MAX_WORKERS = 256
_workers = _number(int, f"an integer from 1 to {MAX_WORKERS}", lambda v: 1 <= v <= MAX_WORKERS)
_positive_float = _number(float, "a positive number", lambda v: 0 < v < float("inf"))


def _name(what: str):
    """An argparse type for a name or path that must not be empty."""
    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"expected a {what}, got an empty string")
        return text
    return parse


def add_arguments(p) -> None:
    p.add_argument("scenario", help="scenario YAML file (its search: section defines the plan space)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a scenario key, e.g. --set search.tp=[4,8] (repeatable)")
    p.add_argument("--out", type=_name("folder name"), metavar="DIR",
                   help="output folder (default: a new folder plan-<scenario>)")
    p.add_argument("--objective", choices=OBJECTIVES, default="throughput",
                   help="throughput: max tokens/s (default); cost: min cost per 1M tokens; "
                        "throughput-vs-headroom / throughput-vs-gpus: a Pareto front")
    p.add_argument("--strategy", choices=("auto", "exhaustive", "tpe"), default="auto",
                   help="auto (default): exhaustive when the valid space has at most "
                        "search.exhaustive_threshold plans, else Optuna TPE")
    p.add_argument("--trials", type=_positive_int, metavar="N",
                   help="TPE trial budget for the whole study (default: search.trials, 300)")
    p.add_argument("--workers", type=_workers, default=1, metavar="N",
                   help="worker processes on this machine (default 1)")
    p.add_argument("--seed", type=_seed, default=0, help="sampler seed (default 0)")
    p.add_argument("--storage", type=_name("storage URL or journal file path"), metavar="URL",
                   help="Optuna storage URL (sqlite:///x.db, postgresql://..., mysql://..., redis://...) "
                        "or a journal file path (default: DIR/study.journal)")
    p.add_argument("--study", type=_name("study name"), metavar="NAME",
                   help="study name (default: <scenario>-<objective>)")
    p.add_argument("--resume", action="store_true",
                   help="continue an existing study (finished trials are kept, not recomputed)")
    p.add_argument("--gpu-hour-cost", type=_positive_float, metavar="PRICE",
                   help="price of one GPU-hour for --objective cost (default: search.gpu_hour_cost; "
                        "unpriced, cost is in GPU-hours)")
    p.add_argument("--top", type=_positive_int, default=10, metavar="N", help="plans in the table (default 10)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _default_out(stem: str, resume: bool, storage_given: bool) -> Path:
    """A new folder plan-<stem>[-N]; with --resume (and the default storage), the newest existing one."""
    base = Path(f"plan-{stem}")
    existing = [base] if base.exists() else []
    n = 2
    while Path(f"{base}-{n}").exists():
        existing.append(Path(f"{base}-{n}"))
        n += 1
    if resume and not storage_given:
        with_journal = [d for d in existing if (d / JOURNAL).is_file()]
        if not with_journal:
            raise ParaplanError(f"--resume: no earlier search folder {base}[-N] with a {JOURNAL} here; "
                                f"give --out DIR (or --storage) of the search to resume")
        return with_journal[-1]
    return base if not existing else Path(f"{base}-{n}")


class _Progress:
    """A one-line progress bar with the best plan so far, on stderr (plain lines when not a terminal)."""

    def __init__(self, stream, label: str, trials: int | None = None):
        self.stream = stream
        self.tty = stream.isatty()
        self.label = label
        self.trials = trials
        """--trials as given: said at once when the search turns out to run another number (exhaustive)."""
        self.t0 = time.monotonic()
        self.last_decile = -1
        self.shown = False

    def __call__(self, done: int, total: int, best) -> None:
        from planner.report import plan_label

        if self.trials is not None and total != self.trials:
            self.stream.write(f"note: --trials {self.trials} not used: the exhaustive search simulates every valid "
                              f"plan ({total:,}; --strategy tpe samples {self.trials} of them instead)\n")
            self.trials = None
        frac = min(1.0, done / total) if total else 1.0
        rate = done / max(time.monotonic() - self.t0, 1e-9)
        best_text = (f"best {best.tokens_per_s:,.0f} tok/s ({plan_label(best.candidate.plan)})"
                     if best is not None else "no plan fits yet")
        if self.tty:
            bar = "#" * int(frac * 24)
            self.stream.write(f"\r{self.label} [{bar:<24}] {done}/{total} {rate:5.1f}/s  {best_text}\033[K")
            self.stream.flush()
            self.shown = True
        elif int(frac * 10) > self.last_decile:
            self.last_decile = int(frac * 10)
            self.stream.write(f"{self.label} {done}/{total} trials, {rate:.1f}/s, {best_text}\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\n")
            self.stream.flush()


def run(args) -> int:
    import optuna

    from planner.objective import make_objective
    from planner.scenario import load_for_planning
    from planner.search import SearchRequest, run_search
    from planner.space import parse_search

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no line per trial: the progress bar says it
    scenario = load_for_planning(args.scenario, args.overrides)  # the scenario's plan may not fit the cluster
    spec = parse_search(scenario)
    price = args.gpu_hour_cost if args.gpu_hour_cost is not None else spec.gpu_hour_cost
    objective = make_objective(args.objective, gpu_hour_cost=price)
    if args.objective == "throughput-vs-gpus" and len(spec.values("num_nodes")) < 2:
        raise ConfigError("search.num_nodes", "--objective throughput-vs-gpus needs several cluster sizes "
                                              "to trade off: list them, e.g. num_nodes: [32, 64, 128]")
    _refuse_a_hopeless_search(scenario, spec)
    stem = Path(args.scenario).stem
    out = Path(args.out) if args.out else _default_out(stem, args.resume, args.storage is not None)
    if args.resume and args.storage is None and not (out / JOURNAL).is_file():
        raise ParaplanError(f"--resume: {out / JOURNAL} does not exist; nothing to resume there")
    check_output_dir(out, "--out")
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    storage = args.storage or str(out / JOURNAL)
    study = args.study or f"{stem}-{args.objective}"
    _check_results_belong(out, study)
    req = SearchRequest(scenario=scenario, spec=spec, objective=objective, storage=storage, study_name=study,
                        strategy=args.strategy, trials=args.trials, workers=args.workers, seed=args.seed,
                        resume=args.resume)
    progress = None if args.quiet else _Progress(sys.stderr, "searching", args.trials)
    try:
        try:
            result = run_search(req, progress=progress)
        finally:
            if progress is not None:
                progress.close()
        if args.resume and result.simulations == 0 and result.strategy == "exhaustive":
            print(f"note: the exhaustive search had already run every valid plan ({result.trials_before}); "
                  "nothing new was run", file=sys.stderr)
        elif args.resume and result.simulations == 0 and result.trials_before >= result.budget:
            print(f"note: the study already holds {result.trials_before} trials, the whole budget (--trials is the "
                  f"study's total, {result.budget}); nothing new was run: pass a larger --trials, e.g. "
                  f"{2 * result.trials_before} for {result.trials_before} more", file=sys.stderr)
        return _write_outputs(scenario, result, objective, out, args)
    except BaseException as exc:
        if created:  # a failed start (a bad --storage, say) leaves no empty folder
            _remove_if_empty(out)
        if isinstance(exc, KeyboardInterrupt) and (args.storage or (out / JOURNAL).exists()):
            from planner.search import mask_url  # the study is there: say how to pick up from it

            print(f"interrupted: the finished trials are kept in {mask_url(storage)}; continue with the same "
                  "command and --resume", file=sys.stderr)
        raise


def _check_results_belong(out: Path, study: str) -> None:
    """The result files in `out` are rewritten at the end of a search: only the study that wrote
    them may do so (its next run, or --resume), not a search of another scenario or objective."""
    try:
        earlier = json.loads((out / "top_plans.json").read_text())["study"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # no results there yet (or none this command wrote)
    if earlier != study:
        raise ParaplanError(f"--out: {out} holds the results of study {earlier!r}, which this search "
                            f"({study!r}) would overwrite; give another --out, or --study {earlier} to continue that one")


def _remove_if_empty(folder: Path) -> None:
    try:
        folder.rmdir()  # only succeeds when empty
    except OSError:
        pass


def _write_outputs(scenario, result, objective, out: Path, args) -> int:
    from planner import emit
    from planner.report import (
        build_report, format_report, history_png, importance_png, importances, pareto_png, report_json,
    )

    rep = build_report(scenario.name, result, objective, top=args.top)
    text = format_report(rep)
    unused = _unused_flags(args, result)
    if unused:
        text += "\n\n" + "\n".join(f"  note: {u}" for u in unused)
    failure = _failure(rep, result, scenario)
    if failure is not None:  # the report on stdout, no result files (the journal stays, for --resume)
        print(text)
        raise failure
    data = report_json(rep)
    files: dict[str, str | bytes] = {"report.txt": "", "top_plans.json": ""}  # filled last; listed first
    if not args.no_plots and result.records:
        files["history.png"] = history_png(rep)
        imp = importances(rep)
        data["importances"] = imp
        if imp:
            files["importance.png"] = importance_png(rep, imp)
        if objective.multi and rep.plans:
            files["pareto.png"] = pareto_png(rep)
    best = rep.best
    if best is not None:
        from executor.config import launch_problems, scaled_scenario

        sc = emit.best_scenario(scenario, best)
        config = out / "best_plan.yaml"
        # judged as `paraplan launch` judges it: on the model its run section scales it down to
        try:
            scaled = scaled_scenario(sc)
            refused = launch_problems(scaled)  # features the bundled executor lacks (MLA, MTP, fp8, ...)
            if refused and scaled.run.num_layers is not None:
                from paraplan.cli.launch import with_layer_hint

                refused = with_layer_hint(scaled, refused, "run.num_layers")
        except ConfigError as exc:
            refused = [str(exc)]
        launch = None if refused else emit.launch_command(str(config), sc.cluster.num_nodes)
        data["best_plan"] = {"config": str(config), "launch": launch, "executor_refuses": refused}
        files["best_plan.yaml"] = emit.executor_config_yaml(
            sc, best, launch=launch or "not with the bundled executor, which refuses it: " + "; ".join(refused))
        files["megatron_args.txt"] = emit.megatron_args_text(sc)
        files["torchtitan.toml"] = emit.torchtitan_toml(sc)
        text += f"\n\n  best plan: {config}"
        if launch:
            text += f"\n  launch it: {launch}"
        else:
            text += ("\n  the bundled executor cannot run it: " + "; ".join(refused)
                     + f"\n  run it with Megatron-LM ({out / 'megatron_args.txt'}) or torchtitan ({out / 'torchtitan.toml'})")
    files["top_plans.json"] = json.dumps(data, indent=2) + "\n"
    files["report.txt"] = text + "\n"
    check_distinct_files({"scenario": args.scenario, **{f"--out {name}": out / name for name in files}})
    write_files_atomic([(out / name, content, "--out") for name, content in files.items()])  # all or none
    stale = [name for name in RESULT_FILES if name not in files and (out / name).is_file()]
    for name in stale:  # an earlier run's (a resume without plots, or with no plan that fits now)
        (out / name).unlink()
    print(text)
    print(f"\n  wrote {', '.join(files)} to {out}/" + (f"; removed the earlier run's {', '.join(stale)}" if stale else ""))
    return 0


# every result file the command may write into --out (the journal aside)
RESULT_FILES = ("report.txt", "top_plans.json", "history.png", "importance.png", "pareto.png", "best_plan.yaml",
                "megatron_args.txt", "torchtitan.toml")


def _unused_flags(args, result) -> list[str]:
    """Flags given that this search had no use for, said rather than dropped silently."""
    out = []
    if args.trials is not None and result.strategy == "exhaustive":
        out.append(f"--trials {args.trials} not used: the exhaustive search simulates every valid plan "
                   f"(--strategy tpe samples {args.trials} of them instead)")
    if args.gpu_hour_cost is not None and args.objective != "cost":
        out.append("--gpu-hour-cost not used: only --objective cost prices the plans")
    return out


def _refuse_a_hopeless_search(scenario, spec) -> None:
    """Before any plan is simulated: where even the largest cluster of the search cannot hold the
    model states (_too_few_gpus), no plan can fit, and the search would only find that out."""
    from hwmodels.profile import load_profile

    gpus = max(spec.values("num_nodes")) * scenario.cluster.gpus_per_node
    reason = _too_few_gpus(scenario, load_profile(scenario.cluster.gpu).hbm_capacity * (1 - spec.memory_headroom), gpus)
    if reason is not None:
        raise ParaplanError(reason)


def _too_few_gpus(scenario, capacity: float, gpus: int) -> str | None:
    """Why no plan of any degrees can fit on `gpus` GPUs (the largest cluster the search tried),
    when that is so: the model states alone (weights, gradients, Adam; memory.state_bytes_per_param),
    sharded over every GPU as ZeRO-3 across all parallel dimensions would, plus the fixed
    reservation, exceed one GPU's memory."""
    from simulator.memory import RESERVED_BYTES, state_bytes_per_param

    params = scenario.model.total_params()
    per_param = sum(state_bytes_per_param(scenario.training.precision, scenario.training.grad_reduce_dtype))
    usable = capacity - RESERVED_BYTES
    if usable <= 0 or params * per_param / gpus <= usable:
        return None
    need = math.ceil(params * per_param / usable)
    return (f"no plan can fit: the model states alone ({params / 1e9:,.1f}B parameters x {per_param:g} bytes of "
            f"weights, gradients and Adam states) need {params * per_param / gpus / 2**30:,.1f} GiB per GPU even "
            f"sharded over all {gpus:,} GPUs; at least {need:,} GPUs of {capacity / 2**30:.4g} GiB are needed, "
            f"before activations")


def _largest_cluster(scenario, result) -> int:
    """GPUs of the largest cluster the search evaluated (search.num_nodes may list several)."""
    nodes = max((r.evaluation.candidate.num_nodes for r in result.records), default=scenario.cluster.num_nodes)
    return max(nodes, scenario.cluster.num_nodes) * scenario.cluster.gpus_per_node


def _failure(rep, result, scenario) -> ParaplanError | None:
    """The error a search that found no usable plan ends with, or None."""
    if rep.best is not None:
        return None
    if rep.fits == 0 and rep.oom == 0 and rep.trial_rejections:
        _, count, example = rep.trial_rejections[0]
        return ConfigError("search", f"no valid plan among the {len(result.records)} trials; {count} fail one rule, "
                                     f"e.g. {example}")
    from simulator.memory import gib_pair

    c = rep.closest_oom
    detail = ""
    if c is not None:
        p = c.candidate.plan
        detail = (f"; the closest, tp {p.tp} x pp {p.pp} x cp {p.cp} x dp {p.dp}, needs "
                  + "{} of {} GiB per GPU{}: ".format(*gib_pair(c.peak_memory_bytes, c.limit), c.limit_note)
                  + (_too_few_gpus(scenario, c.limit, _largest_cluster(scenario, result))
                     or "allow more pp, recompute or zero_stage in the search section"))
    return ParaplanError(f"no plan fits in memory among the {rep.distinct} plans evaluated{detail}")
