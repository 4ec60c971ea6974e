"""paraplan launch CONFIG: train the config's plan with the bundled torch.distributed executor and measure it.

CONFIG is an executor config: a scenario (model, cluster, training, plan) with a `run:` section
(steps, warmup_steps, seed, backend, timeout_s, num_layers, hidden_size), e.g. the planner's
best_plan.yaml. Flags override the run section. Everything a user can get wrong is checked before
any process starts (one `error:` line, exit 2): the file, its keys, the plan against the model
(the simulator's structural checks), what the executor refuses (executor.config), and the process
count against the plan. A rank that fails during training ends the job within run.timeout_s; the
error names the rank (exit 1).
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import NamedTuple

from paraplan.cli.tables import elided, model_shape
from paraplan.cli.torch_check import require_torch, torch_problem
from paraplan.errors import ConfigError, InfeasiblePlanError, ParaplanError
from paraplan.fileio import write_atomic

MiB = 1024**2


def add_arguments(p) -> None:
    p.add_argument("config", help="executor config: a scenario YAML, its optional run: section giving the run settings "
                                  "(e.g. best_plan.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a config key, e.g. --set plan.tp=2 (repeatable)")
    run = p.add_argument_group("run settings (override the config's run: section)")
    run.add_argument("--backend", choices=("nccl", "gloo"), help="nccl on GPUs, gloo on CPUs")
    run.add_argument("--steps", type=int, help="measured steps")
    run.add_argument("--warmup", type=int, metavar="STEPS", help="warm-up steps, not measured")
    run.add_argument("--seed", type=int)
    run.add_argument("--layers", type=int, help="scale the model down to this many layers")
    run.add_argument("--hidden", type=int, help="scale the model down to this hidden size (head_dim kept)")
    run.add_argument("--timeout", type=float, metavar="SECONDS", help="process-group timeout: a dead rank ends the job after this")
    procs = p.add_argument_group("processes")
    procs.add_argument("--nproc", type=int, help="processes on this node (default: the plan's world size / --nnodes)")
    procs.add_argument("--nnodes", type=int, default=1, help="nodes (each runs this command with its --node-rank)")
    procs.add_argument("--node-rank", type=int, default=0)
    procs.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="rendezvous on node 0 (multi-node)")
    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="FILE", help="write the measurement (all ranks, JSON) to FILE")
    out.add_argument("--json", action="store_true", help="print the measurement as JSON instead of the summary")
    out.add_argument("--run-dir", metavar="DIR", help="keep the job file, torchrun log and raw results in DIR")
    out.add_argument("--dry-run", action="store_true", help="check everything, print what would run, start nothing")


_RUN_FLAGS = {"backend": "backend", "steps": "steps", "warmup": "warmup_steps", "seed": "seed", "layers": "num_layers",
              "hidden": "hidden_size", "timeout": "timeout_s"}


def _fewer_processes(sc) -> str:
    """How to run the plan's layout on the fewest processes: one node holding one data-parallel
    replica, or as many as expert parallelism needs (Megatron-Core's folding: ep x expert_tp divides
    tp x cp x dp, simulator.feasibility), and two microbatches per pipeline stage, dp derived again.
    Where that is no fewer than the plan has, it says which degrees to lower instead."""
    p = sc.plan
    need = p.ep * p.expert_tp
    dp = need // math.gcd(need, p.tp * p.cp)
    world = p.tp * p.pp * p.cp * dp
    if world >= p.world_size:
        return "the plan has no fewer-process layout with the same tp, pp, cp and ep: lower those to shrink it"
    batch = p.micro_batch_size * dp * 2 * p.pp
    return (f"for fewer processes shrink the plan to {world}: --set cluster.num_nodes=1 --set cluster.gpus_per_node={world} "
            f"--set plan.dp=null --set training.global_batch_size={batch} (with --layers/--hidden on CPUs; "
            "smaller plan.tp/pp/cp for fewer still)")


def prepare(args, *, need_torch: bool = True, notes: list | None = None):
    """The checked, scaled scenario and the process layout; raises ParaplanError for any bad input.
    With `notes` (a dry run, which may check a GPU plan from a machine without GPUs), what this
    host lacks to run it is appended there instead of refused."""
    from executor.config import launch_problems, scaled_scenario
    from executor.launch import check_run_dir
    from paraplan.fileio import check_distinct_files, check_output_dir, check_output_file
    from paraplan.loader import load_scenario

    overrides = list(args.overrides)
    given = {}  # run.<key> -> the flag that set it
    for flag, key in _RUN_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"run.{key}={value}")
            given[f"run.{key}"] = f"--{flag}"
    try:
        sc = scaled_scenario(load_scenario(args.config, overrides))
    except ConfigError as exc:
        if exc.path not in given:
            raise
        # the user typed the flag, not the config key: name both
        raise ConfigError(f"{given[exc.path]} ({exc.path})", exc.message) from None
    problems = launch_problems(sc)
    if problems and sc.run.num_layers is not None:
        problems = with_layer_hint(sc, problems, "--layers" if args.layers is not None else "run.num_layers")
    if problems:
        raise InfeasiblePlanError(problems)
    if args.nnodes < 1 or (args.nproc is not None and args.nproc < 1):
        raise ParaplanError("--nproc and --nnodes must be positive")
    world = sc.plan.world_size
    nproc = args.nproc if args.nproc is not None else world // args.nnodes
    gpn = sc.cluster.gpus_per_node
    if args.nproc is None and nproc > gpn and sc.run.backend == "nccl":  # more processes than a node has GPUs
        nodes = -(-world // gpn)
        if args.nnodes == 1:
            raise ParaplanError(f"the plan's {world} processes run on {nodes} nodes of {gpn} GPUs "
                                f"(cluster.gpus_per_node): start it on each node with --nnodes {nodes} "
                                "--node-rank N --rdzv-endpoint HOST:PORT, or on this node with --backend gloo "
                                f"(or --nproc, if this node has the GPUs); {_fewer_processes(sc)}")
        raise ParaplanError(f"--nnodes {args.nnodes} puts {nproc} processes on each node, more than its {gpn} GPUs "
                            f"(cluster.gpus_per_node): the plan's {world} processes run on {nodes} nodes")
    if nproc * args.nnodes != world:
        raise ParaplanError(f"the plan needs tp*pp*cp*dp = {sc.plan.tp}*{sc.plan.pp}*{sc.plan.cp}*{sc.plan.dp} = {world} "
                            f"processes, but --nproc {nproc} x --nnodes {args.nnodes} = {nproc * args.nnodes}"
                            + (f"; {_fewer_processes(sc)}" if nproc * args.nnodes < world else ""))
    if args.nnodes > 1 and not args.rdzv_endpoint:
        raise ParaplanError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's address)")
    endpoint = args.rdzv_endpoint and re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[^:\s\[\]]+)(?::(\d{1,5}))?", args.rdzv_endpoint)
    if args.rdzv_endpoint and not (endpoint and int(endpoint.group(2) or 0) <= 65535):
        raise ParaplanError(f"--rdzv-endpoint: expected HOST[:PORT] (an IPv6 host in brackets), got {args.rdzv_endpoint!r}")
    check_output_file(args.out, "--out")
    check_distinct_files({"config": args.config, "--out": args.out})
    check_output_dir(args.run_dir, "--run-dir")
    if args.run_dir:
        check_run_dir(args.run_dir)
    if not 0 <= args.node_rank < args.nnodes:
        raise ParaplanError(f"--node-rank {args.node_rank} is not in 0..{args.nnodes - 1}")
    if need_torch:
        require_torch("the executor")
    peak = _predicted_peak(sc)
    if sc.run.backend == "gloo":
        _check_host_memory(sc, nproc, peak)
        cores = os.cpu_count() or 1
        if nproc > 4 * cores:  # each gloo rank is a process with its own intra-op threads
            _warn(notes, f"{nproc} gloo processes on this host's {cores} CPU cores will run slowly; "
                         f"{_fewer_processes(sc)}")
    elif peak is not None and peak.bytes > peak.capacity:
        _warn(notes, f"paraplan simulate predicts {peak.bytes / 2**30:,.1f} GiB per GPU on stage {peak.stage}, above "
                     f"the {peak.capacity / 2**30:,.1f} GiB of its GPU ({sc.cluster.gpu}): the run will likely run out "
                     f"of GPU memory (scale the model down with --layers and --hidden, or choose another plan)")
    if sc.run.backend == "nccl" and torch_problem("the executor") is None:
        import torch

        problem = None
        if not torch.cuda.is_available():
            problem = "run.backend nccl needs CUDA GPUs and this host has none; use --backend gloo to run on CPUs"
        elif torch.cuda.device_count() < nproc:
            problem = f"{nproc} processes need {nproc} GPUs on this node, it has {torch.cuda.device_count()}"
        if problem and notes is None:
            raise ParaplanError(problem)
        if problem:
            notes.append(f"not on this host: {problem}")
    return sc, nproc


def _warn(notes: list | None, warning: str) -> None:
    """Into the caller's notes (a dry run prints them), or straight to stderr."""
    if notes is not None:
        notes.append(warning)
    else:
        import sys

        print(f"warning: {warning}", file=sys.stderr)


_LAYER_SPLIT_KEYS = ("plan.first_stage_layers/last_stage_layers", "plan.pp: model.num_layers")


def with_layer_hint(sc, problems: list[str], source: str) -> list[str]:
    """A scaled-down layer count (`source`: the --layers flag or the config's run.num_layers) that
    the plan's pipeline layout cannot split is named as such, with the nearest counts that split
    and leave no middle virtual stage empty (the plan's first/last stage layers, e.g. as the
    planner wrote them, stay as they are)."""
    import dataclasses

    from simulator.feasibility import structural_problems

    from simulator.layout import layers_per_virtual_stage

    p = sc.plan

    def splits(n: int) -> bool:
        """n splits over the layout, every virtual stage between the first and last with a layer."""
        model = dataclasses.replace(sc.model, num_layers=n)
        problems_at_n = structural_problems(dataclasses.replace(sc, model=model))
        if any(r.startswith(_LAYER_SPLIT_KEYS) for r in problems_at_n):
            return False
        try:
            sizes = layers_per_virtual_stage(n, p.pp, p.virtual_pipeline_stages, p.first_stage_layers,
                                             p.last_stage_layers)
        except ValueError:
            return False
        return all(sizes[1:-1])

    n = sc.model.num_layers
    fits = [k for k in range(max(1, n - 64), n + 65) if splits(k)]
    nearest = sorted(fits, key=lambda k: (abs(k - n), k))[:2]
    hint = (f" ({source} {n} sets model.num_layers; this layout splits "
            + (" or ".join(map(str, sorted(nearest))) if nearest else "no count near it") + ")")
    return [r + hint if r.startswith(_LAYER_SPLIT_KEYS) else r for r in problems]


class _Peak(NamedTuple):
    """The largest stage's memory per GPU as paraplan simulate predicts it, and the GPU's capacity."""

    bytes: float
    stage: int
    capacity: float


def _predicted_peak(sc) -> _Peak | None:
    """The peak paraplan simulate predicts for the plan the executor runs; None where the
    simulator refuses the plan (the executor's own checks have passed it)."""
    from hwmodels.profile import load_profile
    from simulator.simulate import stage_peak_memory

    try:
        peaks = stage_peak_memory(sc)
    except InfeasiblePlanError:
        return None
    stage = max(range(len(peaks)), key=peaks.__getitem__)
    return _Peak(peaks[stage], stage, load_profile(sc.cluster.gpu).hbm_capacity)


def _check_host_memory(sc, nproc: int, peak: _Peak | None) -> None:
    """A CPU run holds fp32 weights, gradients and Adam's two moments in host memory: 16 bytes per
    parameter (Rajbhandari et al., "ZeRO", SC'20, Sec. 3.1, with fp32 weights), however the plan
    shards them, so this node's processes hold at least nproc / world of the model's 16 x params;
    and each process about what the simulator predicts for a GPU rank, activations included (less
    the allowance for a CUDA context and NCCL buffers). A plan that cannot fit that is refused
    before any process starts."""
    from simulator.memory import RESERVED_BYTES

    params = sc.model.total_params()
    states = 16 * params * nproc / sc.plan.world_size
    ranks = max(0.0, peak.bytes - RESERVED_BYTES) * nproc if peak is not None else 0.0
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if max(states, ranks) > have:
        what = (f"for fp32 weights, gradients and Adam states ({params / 1e9:,.2f}B parameters)" if states >= ranks
                else f"as paraplan simulate predicts each rank's memory, activations included ({peak.bytes / 2**30:,.1f} "
                     f"GiB on stage {peak.stage})")
        raise ParaplanError(
            f"run.backend gloo: the {nproc} CPU process(es) need at least {max(states, ranks) / 2**30:,.1f} GiB of "
            f"host memory {what}, this host has {have / 2**30:,.1f} GiB; scale the model down with --layers and "
            f"--hidden (or the sequence)")


def run(args) -> int:
    from executor.launch import LaunchError, Rendezvous, launch

    # a dry run checks the plan without torch, and a GPU plan on a host without GPUs
    notes: list[str] | None = [] if args.dry_run else None
    sc, nproc = prepare(args, need_torch=not args.dry_run, notes=notes)
    rdzv = Rendezvous(nnodes=args.nnodes, node_rank=args.node_rank, endpoint=args.rdzv_endpoint) if args.nnodes > 1 else None
    if args.dry_run:
        import shlex

        from executor.launch import torchrun_command

        shape = f"{sc.model.num_layers} layers, hidden {sc.model.hidden_size}"
        missing = torch_problem("the launch")
        notes += [missing] if missing else []
        run_dir = args.run_dir or "RUN_DIR"
        cmd = shlex.join(torchrun_command(nproc, rdzv, f"{run_dir}/job.json", f"{run_dir}/out"))
        if args.json:
            print(json.dumps({"scenario": sc.name, "plan_ok": True, "processes_per_node": nproc, "nodes": args.nnodes,
                              "backend": sc.run.backend, "model": sc.model.name, "num_layers": sc.model.num_layers,
                              "hidden_size": sc.model.hidden_size, "torch_problem": missing, "command": cmd,
                              "notes": notes}, indent=1))
            return 0
        print(f"{sc.name}: plan OK; would start {nproc} process(es) x {args.nnodes} node(s), backend {sc.run.backend}, "
              f"model {sc.model.name}" + ("" if shape in sc.model.name else f" ({shape})"))
        print(f"  command: {cmd}")
        print(f"  ({run_dir}/job.json holds the plan; the executor's root goes on PYTHONPATH)")
        for note in notes:
            print(f"note: {note}")
        return 0
    try:
        results = launch([sc], nproc=nproc, backend=sc.run.backend, timeout_s=sc.run.timeout_s, run_dir=args.run_dir,
                         rendezvous=rdzv, echo=None if args.json else print)
    except LaunchError as e:
        import sys

        print(f"error: {e}", file=sys.stderr)
        return 1
    if not results:  # a node other than 0: node 0 writes the measurement
        return 0
    m = add_flops(sc, results[0])
    if args.out:
        write_atomic(args.out, json.dumps(m, indent=1) + "\n", "--out")
    print(json.dumps(m, indent=1) if args.json else format_summary(m, sc.plan))
    return 0


def add_flops(sc, m: dict) -> dict:
    """Model FLOPs per step with the simulator's formula, TFLOP/s per rank, and MFU on a GPU."""
    from simulator.flops import flops_formula_for, model_flops

    flops = model_flops(sc.model, sc.training.seq_length, m["tokens_per_step"])
    m["model_flops_per_step"] = flops
    m["flop_formula"] = flops_formula_for(sc.model)
    m["tflops_per_rank"] = flops / m["step_time_s"] / m["world_size"] / 1e12
    if m["backend"] == "nccl":
        from calibrate.device import bundled_match
        from hwmodels.profile import load_profile

        # the peak of the GPU the run used, matched as calibrate matches it (SXM parts by name and
        # memory); a device no bundled profile describes is measured against the scenario's GPU
        name = bundled_match(m["device"], m.get("device_memory_bytes", 0))
        if name is None:
            name = sc.cluster.gpu
            m["notes"].append(f"{m['device']} matches no bundled GPU profile: MFU is against the scenario's "
                              f"cluster.gpu ({name})")
        peak = load_profile(name).peak(m["compute_dtype"])
        m["peak_flops_per_rank"] = peak
        m["peak_profile"] = name
        m["mfu"] = flops / m["step_time_s"] / m["world_size"] / peak
    return m


def format_summary(m: dict, plan) -> str:
    """The measurement `m` as a table; `plan` is the PlanSpec it ran (for its recompute label)."""
    p, model = m["plan"], m["model"]
    sched = p["schedule"] + (f" x{p['virtual_pipeline_stages']}" if p["virtual_pipeline_stages"] > 1 else "")
    shape = model_shape(model)
    lines = [
        f"{m['scenario']}: {model['name']} ({m['parameters'] / 1e6:.1f}M parameters{', ' + shape if shape else ''}"
        f"{', MoE' if model.get('moe') else ''})",
        f"  plan: tp {p['tp']}  pp {p['pp']}  dp {p['dp']}  cp {p['cp']}  ep {p['ep']}  mbs {p['micro_batch_size']}  "
        f"{sched if p['pp'] > 1 else 'no pipeline'}  sp {'on' if p['sequence_parallel'] else 'off'}  zero {p['zero_stage']}  "
        f"recompute {plan.recompute_label}  ({m['num_microbatches']} microbatch{'es' if m['num_microbatches'] != 1 else ''})",
        f"  {m['world_size']} ranks on {m['device']} ({m['backend']}), {m['compute_dtype']}, data parallel: {m['data_parallel']}",
        "",
        "  step   time (ms)    tokens/s      loss",
    ]
    for s in m["steps"]:
        lines.append(f"  {s['step'] + 1:4d} {s['time_s'] * 1e3:11.1f} {s['tokens_per_s']:11.0f} {s['loss']:9.4f}"
                     + ("   (warm-up)" if s["warmup"] else ""))
    lines += [
        "",
        f"  step time (median)  {m['step_time_s'] * 1e3:10.1f} ms",
        f"  tokens/s            {m['tokens_per_s']:10.0f}",
        f"  TFLOP/s per rank    {m['tflops_per_rank']:10.4g}   (model FLOPs, see below)",
    ]
    if "mfu" in m:
        lines.append(f"  MFU                 {m['mfu'] * 100:9.1f} %  of {m['peak_flops_per_rank'] / 1e12:.0f} TFLOP/s ({m['peak_profile']})")
    lines += ["", "  peak memory per rank (MiB): params  grads  optim  act+buf   peak  "
              f"[{m['ranks'][0]['memory']['source']}]"]
    ranks = m["ranks"]
    largest = max(range(len(ranks)), key=lambda i: ranks[i]["memory"]["peak_total"])
    for r in elided(ranks, largest):
        if r is None:
            lines.append("    ...")
            continue
        mm = r["memory"]
        lines.append(f"    rank {r['rank']:<4} " + " ".join(
            f"{mm[k] / MiB:7.1f}" for k in ("parameters", "gradients", "optimizer_states", "activations_and_buffers", "peak_total")))
    for note in m["notes"]:
        lines.append(f"  note: {note}")
    lines.append(f"  FLOPs: {m['flop_formula']}")
    return "\n".join(lines)
