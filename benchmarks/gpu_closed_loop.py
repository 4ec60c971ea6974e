"""Predicted vs measured on one GPU: single-GPU plans run by the bundled executor, each simulated
with the bundled profile of the GPU and with any calibrated profiles given.

    python benchmarks/gpu_closed_loop.py [--profile FILE.yaml ...] [--out FILE.json]      # on a GPU: measure, compare
    python benchmarks/gpu_closed_loop.py --measured FILE.json [--profile FILE.yaml ...]   # anywhere: re-simulate

The plans (PLANS) span what one GPU can show: GEMM-bound steps at two model widths, small
kernels (a 125M model), gradient accumulation, full and selective recompute, a long sequence
and GQA with SwiGLU. They run in one torchrun job (start-up paid once); a plan that fails (out
of memory, say) leaves the measurements of the plans before it. The measurements are written
with the GPU's name, torch and CUDA versions, so the comparison can be re-simulated later
without the GPU (--measured). Every row uses the same profile and settings; nothing is tuned
per row.

Error = (predicted - measured) / measured, measured = the executor's median step time.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paraplan.specs import (  # noqa: E402
    ClusterSpec, ModelSpec, MoESpec, PlanSpec, RoutingSpec, RunSpec, Scenario, TrainingSpec)


@dataclass(frozen=True)
class Plan:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    activation: str
    vocab: int
    seq: int
    mbs: int
    microbatches: int = 1
    recompute: str = "none"
    moe: tuple[int, int, int] | None = None
    """(experts, top_k, expert FFN width): every layer's FFN is a dropless MoE, all experts on the GPU."""


PLANS = (
    # ordered by the memory they need, the largest last: a plan that runs out of memory ends the job
    # GPT-2 small: heads of 64, short kernels
    Plan("gpt-125m mbs16", 12, 768, 12, 12, 3072, "gelu", 50304, 1024, 16),
    # bench_executor.py's model: 1.21B GPT, heads of 128
    Plan("gpt-1.2b mbs2x4 accum", 20, 2048, 16, 16, 8192, "gelu", 50304, 2048, 2, 4),
    Plan("gpt-1.2b mbs8 full recompute", 20, 2048, 16, 16, 8192, "gelu", 50304, 2048, 8, recompute="full"),
    # long sequence: attention-heavy
    Plan("swiglu-0.8b seq8k mbs1x2", 12, 2048, 16, 16, 5632, "swiglu", 32000, 8192, 1, 2),
    Plan("gpt-1.2b mbs8", 20, 2048, 16, 16, 8192, "gelu", 50304, 2048, 8),
    # Llama-style: GQA 32/8, SwiGLU, seq 4096, selective recompute
    Plan("llama-2b seq4k selective", 8, 4096, 32, 8, 14336, "swiglu", 32000, 4096, 2, recompute="selective"),
    # MoE, dropless, every expert on the one GPU (no all-to-all): the router, the permutation and the
    # expert GEMMs. Few large experts (Mixtral's 8, top 2: 2,048 tokens per expert), then many small
    # ones (64, top 8: 512 tokens per expert, the per-expert load of Qwen3-235B on EP 8), where the
    # GPU's work per expert is small and the executor's per-expert kernels and host time weigh most
    Plan("moe-8x top2 seq2k mbs4", 6, 2048, 16, 8, 5632, "swiglu", 32000, 2048, 4, moe=(8, 2, 5632)),
    Plan("moe-64x top8 seq2k mbs2", 6, 2048, 16, 8, 768, "swiglu", 32000, 2048, 2, moe=(64, 8, 768)),
)


def scenario(p: Plan, gpu: str, *, steps: int, warmup: int, routing: list[int] | None = None) -> Scenario:
    """`routing`: the router's measured tokens per expert (summed over layers and steps), simulated as
    a histogram; None: uniform."""
    moe = None
    if p.moe:
        experts, top_k, ffn = p.moe
        dist = RoutingSpec(distribution="histogram", tokens_per_expert=tuple(float(c) for c in routing)) \
            if routing else RoutingSpec()
        moe = MoESpec(num_experts=experts, top_k=top_k, expert_ffn_hidden_size=ffn, routing=dist)
    model = ModelSpec(name=p.name.split()[0], num_layers=p.layers, hidden_size=p.hidden,
                      num_attention_heads=p.heads, num_kv_heads=p.kv_heads, head_dim=p.hidden // p.heads,
                      ffn_hidden_size=p.ffn, vocab_size=p.vocab, activation=p.activation,
                      dropout=0.0, moe=moe)  # the executor trains without dropout
    return Scenario(
        name=p.name, model=model,
        cluster=ClusterSpec(gpu=gpu, num_nodes=1, gpus_per_node=1),
        training=TrainingSpec(seq_length=p.seq, global_batch_size=p.mbs * p.microbatches, precision="bf16"),
        plan=PlanSpec(micro_batch_size=p.mbs, recompute=p.recompute),
        run=RunSpec(steps=steps, warmup_steps=warmup, backend="nccl", timeout_s=600))


def measure(scenarios: list[Scenario]) -> tuple[list[dict], str | None]:
    """Every plan in one torchrun job: (measurements of the plans that ran, the failure or None)."""
    from executor.launch import LaunchError, launch

    with tempfile.TemporaryDirectory(prefix="paraplan-closed-loop-") as run_dir:
        try:
            return launch(scenarios, nproc=1, backend="nccl", timeout_s=600, run_dir=run_dir), None
        except LaunchError as exc:
            done = []
            for i in range(len(scenarios)):
                path = Path(run_dir) / "out" / f"run{i}.json"
                if not path.exists():
                    break
                done.append(json.loads(path.read_text()))
            log = Path(run_dir) / "torchrun.log"
            tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
            return done, f"{exc}\n{tail}"


def predict(sc: Scenario, gpu: str, attention: str) -> dict:
    """The simulated step of `sc` on profile `gpu`, its attention priced as `attention`."""
    from dataclasses import replace

    from simulator.simulate import simulate

    sim = simulate(replace(sc, cluster=replace(sc.cluster, gpu=gpu), training=replace(sc.training, attention=attention)),
                   record_spans=False)
    return {"step_time_s": sim.step_time_s, "breakdown_s": dict(sim.breakdown), "mfu": sim.mfu,
            "peak_memory_bytes": sim.peak_memory_bytes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", action="append", default=[], help="calibrated profile file (repeatable)")
    ap.add_argument("--out", help="write the measurements and predictions as JSON")
    ap.add_argument("--measured", help="re-simulate the measurements in this JSON (no GPU needed)")
    ap.add_argument("--attention", choices=("flash", "flash3"),
                    help="the attention kernel to simulate (default: flash3 on Hopper, where torch's SDPA runs "
                         "cuDNN's fused attention, as seen with torch 2.11 on an H100; flash elsewhere)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    from calibrate.device import bundled_match
    from paraplan.fileio import write_atomic

    failure = None
    plans_by_name = {p.name: p for p in PLANS}
    if args.measured:
        saved = json.loads(Path(args.measured).read_text())
        device, device_info, rows = saved["device"], saved.get("device_info", {}), saved["rows"]
        scenarios = [scenario(plans_by_name[r["plan"]], "h100-sxm-80gb", steps=args.steps, warmup=args.warmup) for r in rows]
        measurements = [r["measured"] for r in rows]
        failure = saved.get("failure")
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_closed_loop: no CUDA GPU here; use --measured FILE.json to re-simulate saved measurements")
            return 0
        props = torch.cuda.get_device_properties(0)
        device = props.name
        device_info = {"name": props.name, "memory_bytes": int(props.total_memory), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "capability": f"{props.major}.{props.minor}"}
        scenarios = [scenario(p, "h100-sxm-80gb", steps=args.steps, warmup=args.warmup) for p in PLANS]
        measurements, failure = measure(scenarios)
    bundled = bundled_match(device, device_info.get("memory_bytes", 0))
    if bundled is None:
        print(f"gpu_closed_loop: {device!r} matches no bundled profile")
        return 2
    from calibrate.validate import resolve_profile
    from hwmodels.profile import load_profile

    attention = args.attention or ("flash3" if load_profile(bundled).arch == "hopper" else "flash")
    profiles = [bundled] + [resolve_profile(p) for p in args.profile]  # bundled names, or files
    names = [Path(p).name if Path(p).suffix in (".yaml", ".yml") else p for p in profiles]
    if len(set(names)) != len(names):
        print(f"gpu_closed_loop: two profiles share a name ({', '.join(names)}); rename one")
        return 2

    rows = []
    for sc, m in zip(scenarios, measurements):
        if m.get("tokens_per_expert"):  # simulate the routing the executor's router made
            counts = [sum(c) for c in zip(*m["tokens_per_expert"].values())]
            sc = scenario(plans_by_name[sc.name], "h100-sxm-80gb", steps=args.steps, warmup=args.warmup,
                          routing=counts)
        steps = [s["time_s"] for s in m["steps"] if not s["warmup"]]
        row = {"plan": sc.name, "measured": m, "measured_step_time_s": m["step_time_s"],
               "measured_spread_pct": 100.0 * (max(steps) - min(steps)) / statistics.median(steps),
               "measured_peak_memory_bytes": m["ranks"][0]["memory"]["peak_total"], "predicted": {}}
        for prof, label in zip(profiles, names):
            row["predicted"][label] = predict(sc, prof, attention)
        rows.append(row)
    print(f"{device} ({device_info.get('torch', '?')}, CUDA {device_info.get('cuda', '?')}); attention simulated "
          f"as {attention}; error = predicted / measured - 1")
    head = f"{'plan':32s} {'measured':>9s} {'spread':>6s}" + "".join(f" {n[:28]:>28s}" for n in names)
    print(head)
    for r in rows:
        line = f"{r['plan']:32s} {r['measured_step_time_s'] * 1e3:7.1f}ms {r['measured_spread_pct']:5.1f}%"
        for n in names:
            p = r["predicted"][n]["step_time_s"]
            line += f" {p * 1e3:10.1f}ms {100 * (p / r['measured_step_time_s'] - 1):+7.1f}%{'':8s}"
        print(line)
    for n in names:
        errs = [abs(r["predicted"][n]["step_time_s"] / r["measured_step_time_s"] - 1) for r in rows]
        if errs:
            print(f"MAPE {n}: {100 * statistics.mean(errs):.1f}% over {len(errs)} plans, "
                  f"worst {100 * max(errs):.1f}%")
    print("peak memory (measured torch.cuda.max_memory_allocated vs predicted, bundled profile):")
    for r in rows:
        pm = r["predicted"][names[0]]["peak_memory_bytes"]
        mm = r["measured_peak_memory_bytes"]
        if pm:
            print(f"  {r['plan']:32s} {mm / 2**30:6.2f} GiB vs {pm / 2**30:6.2f} GiB ({100 * (pm / mm - 1):+.1f}%)")
    if failure:
        print(f"not all plans ran: {failure.splitlines()[0]}")
    if args.out:
        write_atomic(args.out, json.dumps({"device": device, "device_info": device_info, "profiles": names,
                                           "rows": rows, "failure": failure}, indent=1) + "\n", "--out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
