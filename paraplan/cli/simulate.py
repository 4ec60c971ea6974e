"""paraplan simulate SCENARIO: one iteration of the scenario's plan."""
from __future__ import annotations

import json
from dataclasses import replace

from paraplan.errors import InfeasiblePlanError, ParaplanError
from paraplan.cli.tables import elided
from paraplan.fileio import check_distinct_files, check_output_file, write_files_atomic
from simulator.memory import gib_pair


GiB = 1024**3


def add_arguments(p) -> None:
    p.add_argument("scenario", help="scenario YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                   help="override a scenario key, e.g. --set plan.tp=4 (repeatable)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome/Perfetto trace of the iteration")
    p.add_argument("--plot", metavar="FILE", help="write a timeline PNG")


def run(args) -> int:
    from paraplan.loader import load_scenario
    from simulator.simulate import simulate

    check_output_file(args.trace, "--trace")
    check_output_file(args.plot, "--plot")
    check_distinct_files({"scenario": args.scenario, "--trace": args.trace, "--plot": args.plot})
    if args.plot is not None and not args.plot.lower().endswith(".png"):
        raise ParaplanError(f"--plot: the timeline is a PNG image; give a file name ending in .png, got {args.plot!r}")
    scenario = load_scenario(args.scenario, args.overrides)
    if scenario.search:  # the search section is the planner's, but a typo in it is an error here too
        from planner.space import parse_search

        parse_search(scenario)
    try:
        result = simulate(scenario, record_spans=bool(args.trace or args.plot))  # the timeline only when drawn
    except InfeasiblePlanError as exc:
        raise _with_split_hint(scenario, exc) from None
    outputs = []  # written together or not at all; an infeasible run ends with an error and writes nothing
    if result.fits and args.trace:
        from simulator.trace import chrome_trace_json

        outputs.append((args.trace, chrome_trace_json(result), "--trace"))
    if result.fits and args.plot:
        from simulator.plot import timeline_png

        outputs.append((args.plot, timeline_png(result), "--plot"))
    write_files_atomic(outputs)
    if args.json:
        from paraplan.serialize import plan_to_mapping

        # what was simulated, as --set left it: the plan (its derived dp and a2a+p2p group too) and the GPU profile
        out = result.to_json()
        out = {"scenario": out.pop("scenario"), "gpu": scenario.cluster.gpu,
               "plan": plan_to_mapping(_plan_as_simulated(scenario)), **out}
        print(json.dumps(out, indent=2))
    else:
        print(format_result(scenario, result))
    if not result.fits:
        worst = max(result.stages, key=lambda s: s.memory["total"])
        need, capacity = gib_pair(worst.memory["total"], result.memory_capacity_bytes)
        raise ParaplanError(f"out of memory: stage {worst.stage} needs {need} GiB per GPU, the GPU has {capacity} GiB")
    return 0


def _with_split_hint(scenario, exc: InfeasiblePlanError) -> InfeasiblePlanError:
    """The error, with the first and last stage layers the planner would choose where the layers
    do not split over the stages as given."""
    uneven = ("plan.pp: model.num_layers", "plan.first_stage_layers/last_stage_layers: the ")
    if not any(r.startswith(uneven) for r in exc.reasons):
        return exc
    from planner.space import edge_split_hint

    hint = edge_split_hint(replace(scenario, plan=replace(scenario.plan, first_stage_layers=None,
                                                          last_stage_layers=None)))
    if hint is None:
        return exc
    return InfeasiblePlanError([f"{r} (the planner would split them: {hint})" if r.startswith(uneven) else r
                                for r in exc.reasons])


def format_result(sc, r) -> str:
    p = sc.plan
    unit, scale = _time_unit(r.step_time_s)
    lines = [
        f"{sc.name}",
        f"  {sc.model.name} on {sc.cluster.world_size} x {_gpu_label(sc.cluster.gpu)}{_network_label(sc.cluster)}, "
        f"seq {sc.training.seq_length}, global batch {sc.training.global_batch_size}, {sc.training.precision}",
        f"  plan: tp {p.tp}  pp {p.pp}  dp {p.dp}  cp {p.cp}" + (f" ({_cp_exchange_label(sc)})" if p.cp > 1 else "")
        + (f"  ep {p.ep}" + (f"  etp {p.expert_tp}" if p.expert_tp > 1 else "") + f"  {p.moe_dispatcher}"
           if sc.model.moe is not None else "")
        + f"  mbs {p.micro_batch_size}  "
        f"{p.schedule}" + (f" x{p.virtual_pipeline_stages}" if p.virtual_pipeline_stages > 1 else "")
        + (f"  sp {'on' if p.sequence_parallel else 'off'}" if p.tp > 1 else "")
        + f"  zero {p.zero_stage}  recompute {p.recompute_label}"
        f"  ({r.num_microbatches} microbatch{'' if r.num_microbatches == 1 else 'es'})",
        "",
        f"  step time        {r.step_time_s * scale:10.3f} {unit}",
        f"  tokens/s         {r.tokens_per_s:10.0f}",
        f"  TFLOP/s per GPU  {_figure(r.tflops_per_gpu):>10}   (model FLOPs, see below)",
        f"  MFU              {r.mfu * 100:9.1f} %  of {r.peak_flops_per_gpu / 1e12:.4g} TFLOP/s   (HFU {r.hfu * 100:.1f} %)"
        + ("  bf16 dense peak, the usual basis for fp8 runs" if sc.training.precision == "fp8" else ""),
        *_causal_line(r),
        "  peak memory      {:>10} GiB of {} GiB".format(*gib_pair(r.peak_memory_bytes, r.memory_capacity_bytes))
        + f"  -> {'fits' if r.fits else 'DOES NOT FIT'}",
        "",
        f"  breakdown (stage {r.critical_stage}, the one that ends last; the pipeline's bottleneck):",
    ]
    for k, v in r.breakdown.items():
        if v > 0:
            lines.append(f"    {k:<12} {v * scale:10.3f} {unit:<2} {100 * v / r.step_time_s:5.1f} %")
    if r.moe is not None:
        lines += ["", *_moe_lines(sc, r.moe)]
    lines.append("")
    # 16-bit gradients: the optimizer step's fp32 copy, held while the activations are freed
    keys = ["weights", "gradients", "optimizer", "activations", "reserved"]
    header = "weights grads optim activ reserved"
    if any(st.memory.get("optimizer_step") for st in r.stages):
        keys.append("optimizer_step")
        header += "   step"
    lines.append(f"  memory per GPU by stage (GiB): {header} total")
    largest = max(r.stages, key=lambda st: st.memory["total"]).stage
    for s in elided(list(r.stages), largest):
        if s is None:
            lines.append("    ...")
            continue
        mm = s.memory
        lines.append(
            f"    stage {s.stage:<3} " + " ".join(f"{mm[k] / GiB:6.1f}" for k in (*keys, "total"))
        )
    if "optimizer_step" in keys:
        lines.append("    (step: the optimizer's fp32 copy of the 16-bit gradients, held while the activations are "
                     "freed; total is the higher of the backward's and the step's peak)")
    lines.append("")
    lines.append(f"  FLOPs: {r.flop_formula}")
    return "\n".join(lines)


def _moe_lines(sc, moe) -> list[str]:
    e, p = sc.model.moe, sc.plan
    shared = f" + {e.num_shared_experts} shared" if e.num_shared_experts else ""
    if e.groups_per_token < e.expert_groups:
        shared += f", each within {e.groups_per_token} of {e.expert_groups} expert groups"
    tiers = "+".join(moe.ep_tiers) or "local"
    out = [
        f"  MoE: {e.num_experts} experts top-{e.top_k}{shared}; EP {p.ep} = {moe.ep_group} over {tiers}; "
        f"expert-data-parallel {moe.expert_data_parallel}; dispatcher {p.moe_dispatcher}"
        + ("; shared experts beside the dispatch" if p.moe_shared_expert_overlap else "")
        + ("; combined 1F1B (each steady-state forward merged with a backward, their all-to-alls beside "
           "each other's compute)" if p.overlap_moe_expert_parallel_comm else ""),
        f"    routing {moe.routing}: the busiest EP rank gets {moe.imbalance:.2f}x the mean tokens"
        + (f", {100 * moe.dropped_fraction:.1f}% dropped at capacity" if moe.dropped_fraction else ""),
        f"    vs a perfectly balanced router: MoE layer {moe.moe_layer_time_s * 1e3:.2f} ms vs "
        f"{moe.balanced_moe_layer_time_s * 1e3:.2f} ms (x{moe.moe_layer_time_s / moe.balanced_moe_layer_time_s:.2f}); "
        f"step {moe.balanced_step_time_s:.3f} s balanced",
        "    FLOPs and MFU count the router and only the active experts (top-k routed + shared)"
        + (", not the copies dropped at capacity" if moe.dropped_fraction else ""),
    ]
    return out


def _plan_as_simulated(sc):
    """The plan with what the simulation derives filled in: an a2a+p2p plan's all-to-all group
    (paraplan.placement.cp_split) where cp_a2a_size leaves it to be derived."""
    from paraplan.placement import cp_split

    p = sc.plan
    if p.cp > 1 and p.cp_comm_type == "a2a+p2p" and p.cp_a2a_size is None:
        p = replace(p, cp_a2a_size=cp_split(p, sc.model, sc.cluster.gpus_per_node)[0])
    return p


def _cp_exchange_label(sc) -> str:
    """`p2p`, `a2a`, ..., and for a2a+p2p its groups, e.g. `a2a+p2p: a2a 8 x ring 2`."""
    p = _plan_as_simulated(sc)
    if p.cp_comm_type != "a2a+p2p":
        return p.cp_comm_type
    return f"a2a+p2p: a2a {p.cp_a2a_size} x ring {p.cp // p.cp_a2a_size}"


def _time_unit(step_time_s: float) -> tuple[str, float]:
    """The unit every time in the report is printed in: seconds from 1 s up, else ms, else us, so
    a small model's step does not read 0.000 s."""
    if step_time_s >= 1.0:
        return "s", 1.0
    if step_time_s >= 1e-3:
        return "ms", 1e3
    return "us", 1e6


def _figure(x: float) -> str:
    """One decimal from 10 up, else three significant digits (a CPU's 0.52 TFLOP/s is not 1)."""
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def _causal_line(r) -> list[str]:
    """MFU and HFU with the causal half of the attention square alone, where that is 5% or more
    below the whole-square MFU (long sequences): Megatron-LM's count since 2025, and about what
    causal flash kernels run, so an HFU over 100% under the whole-square count is explained."""
    if r.mfu_causal > 0.95 * r.mfu:
        return []
    why = ("; over 100% because the whole-square count includes the masked half the kernels skip"
           if r.hfu > 1 else "")
    return [f"                   causal attention counted half: MFU {r.mfu_causal * 100:.1f} %, "
            f"HFU {r.hfu_causal * 100:.1f} %  (Megatron-LM's count since 2025{why})"]


def _network_label(cluster) -> str:
    """The network the scenario runs on, as the loader filled it in (the cluster preset's or the GPU
    profile's defaults where the scenario states none), e.g. an H800's NVLink:
    ' (NVLink 200 GB/s, 8 x 400 Gb/s NICs rail-optimized)'; the NICs only across nodes, and the leaf
    size with an oversubscription that a cluster larger than one leaf meets."""
    parts = []
    if cluster.intra_node is not None:
        parts.append(f"NVLink {cluster.intra_node.bandwidth / 1e9:.4g} GB/s")
    net = cluster.inter_node
    if net is not None and cluster.num_nodes > 1:
        parts.append(f"{net.nics_per_node} x {net.nic_bandwidth * 8 / 1e9:.4g} Gb/s NICs {net.topology}"
                     + (f", {net.nodes_per_leaf} nodes a leaf, {net.oversubscription:g}:1 oversubscribed"
                        if net.oversubscription > 1 and cluster.num_nodes > net.nodes_per_leaf else ""))
    return f" ({', '.join(parts)})" if parts else ""


def _gpu_label(gpu: str) -> str:
    """The bundled profile's name, or a profile file's own name with the file it came from."""
    from hwmodels.profile import load_profile

    name = load_profile(gpu).name
    return gpu if name == gpu else f"{name} ({gpu})"
