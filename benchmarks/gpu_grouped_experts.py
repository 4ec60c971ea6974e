"""The executor's MoE experts on one GPU: the grouped-GEMM path against one GEMM per expert.

    python benchmarks/gpu_grouped_experts.py [--out FILE.json]
    python benchmarks/gpu_grouped_experts.py --device cpu --scale 0.0625   # the same checks, small, on a CPU

With --kernels, the grouped path's forward + backward also runs under torch.profiler (5 calls) and
the GPU time of its kernels is printed by kind (grouped GEMMs, casts, copies, ...), with the
calibrated profile's GEMM model beside the measured grouped-GEMM kernels: for the GEMMs torch ran
(each expert's gate, up and down projections' forward, dgrad and wgrad as GEMMs of their own), and
as the simulator prices the experts' GEMMs (gate and up fused, the wgrad accumulating into fp32 main
gradients).

For each shape (local experts, tokens per expert, hidden, expert FFN), with uneven random counts
that include an expert with no tokens: the two paths' outputs and gradients are compared (the
grouped path must match the per-expert one to bf16 rounding), then the forward + backward of each
is timed (median of 20 after 5 warm-ups, wall clock around the whole call after a synchronize, host included). The
shapes are the per-GPU expert loads of the closed loop's MoE plans and of Qwen3-235B on EP 8
(16 local experts, 512 tokens each, hidden 4096, FFN 1536).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = ((8, 2048, 2048, 5632), (64, 512, 2048, 768), (16, 512, 4096, 1536))


def counts_for(experts: int, per_expert: int, gen):
    """Uneven tokens per expert (a torch tensor) summing to about experts x per_expert."""
    import torch

    raw = torch.rand(experts, generator=gen) + 0.5
    raw[1] = 0.0  # an expert the router sent nothing
    c = (raw / raw.sum() * experts * per_expert).round().long()
    c[1] = 0
    return c


def kernel_kind(name: str) -> str:
    n = name.lower()
    if "gemm" in n or "cutlass" in n or "sm90" in n or "nvjet" in n or "xmma" in n:
        return "gemm"
    for kind in ("copy", "cast", "index", "scatter", "gather", "fill", "silu", "mul", "reduce", "cumsum", "sort"):
        if kind in n:
            return kind
    return "other"


def modelled_gemm_s(profile: str, counts: list[int], hidden: int, ffn: int) -> tuple[float, float]:
    """(the GEMM model's time for the GEMMs torch ran: each expert's gate, up and down projections'
    forward, dgrad and wgrad as GEMMs of their own; the simulator's price of the same experts'
    GEMMs (simulator.moe._gemm): gate and up fused into one GEMM, as Megatron-Core runs them, and
    the wgrad accumulating into the fp32 main gradient)."""
    from hwmodels.compute import gemm_time
    from hwmodels.profile import load_profile
    from paraplan.specs import ModelSpec, MoESpec, PlanSpec
    from simulator.moe import _expert_linears, _gemm
    from simulator.workload import LayerContext

    gpu, ran = load_profile(profile), 0.0
    for m in counts:
        for rows, out, inner in ((m, ffn, hidden), (m, ffn, hidden), (m, hidden, ffn)) if m else ():
            ran += gemm_time(gpu, rows, out, inner, "bf16") + gemm_time(gpu, rows, inner, out, "bf16") + \
                gemm_time(gpu, inner, out, rows, "bf16")
    model = ModelSpec(name="experts", num_layers=1, hidden_size=hidden, num_attention_heads=8, num_kv_heads=8,
                      head_dim=hidden // 8, ffn_hidden_size=ffn, vocab_size=32000, activation="swiglu",
                      moe=MoESpec(num_experts=len(counts), top_k=1, expert_ffn_hidden_size=ffn))
    ctx = LayerContext(model=model, plan=PlanSpec(), gpu=gpu, network=None, seq_length=max(counts),
                       dtype="bf16", attention_kernel="flash3", tp_layout=None, cp_layout=None)
    simulated = sum(_gemm(ctx, m, k, n, backward, casts=False)
                    for m in counts if m for k, n in _expert_linears(ctx) for backward in (False, True))
    return ran, simulated


def profile_kernels(run, dev, counts: list[int], hidden: int, ffn: int, profile: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    calls = 5
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run(True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    by_kind: dict[str, float] = {}
    names: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if ev.device_type != torch.autograd.DeviceType.CUDA or not us:
            continue
        kind = kernel_kind(ev.key)
        by_kind[kind] = by_kind.get(kind, 0.0) + us / 1e6 / calls
        names[ev.key[:90]] = us / 1e6 / calls
    ran, simulated = modelled_gemm_s(profile, counts, hidden, ffn)
    gpu_total = sum(by_kind.values())
    print(f"    GPU kernels per call {gpu_total * 1e3:.2f} ms: " +
          ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
    print(f"    grouped GEMM kernels {by_kind.get('gemm', 0.0) * 1e3:.2f} ms; {profile}'s GEMM model: "
          f"{ran * 1e3:.2f} ms for the GEMMs that ran, {simulated * 1e3:.2f} ms as the simulator prices "
          "the experts' GEMMs (gate and up fused, wgrad into fp32 main gradients)")
    for name, v in sorted(names.items(), key=lambda kv: -kv[1])[:8]:
        print(f"      {v * 1e3:7.3f} ms  {name}")
    return {"gpu_s_by_kind": by_kind, "top_kernels_s": dict(sorted(names.items(), key=lambda kv: -kv[1])[:12]),
            "modelled_gemm_s": ran, "simulated_gemm_s": simulated, "profile": profile}


def default_profile(dev) -> str:
    """The bundled profile of the device, its calibrated one where there is one."""
    import torch

    from calibrate.device import bundled_match
    from hwmodels.profile import BUNDLED

    if dev.type != "cuda":
        return "h100-sxm-80gb-calibrated"  # a CPU run checks the mechanics; any GPU's model will do
    props = torch.cuda.get_device_properties(dev)
    match = bundled_match(props.name, int(props.total_memory))
    if match is None:
        raise SystemExit(f"gpu_grouped_experts: {props.name!r} matches no bundled profile; pass --gpu-profile")
    return f"{match}-calibrated" if f"{match}-calibrated" in BUNDLED else match


def main() -> int:
    import torch

    from executor.moe import GroupedExperts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kernels", action="store_true", help="also profile the grouped path's kernels")
    ap.add_argument("--gpu-profile", help="the profile (bundled name or file) whose GEMM model prices the expert "
                                          "GEMMs (--kernels; default: the device's bundled profile, calibrated if "
                                          "one is bundled)")
    ap.add_argument("--scale", type=float, default=1.0, help="scale the tokens and widths (multiples of 8 kept)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_grouped_experts: no CUDA GPU here (--device cpu runs the checks on the CPU)")
        return 0
    dev = torch.device(args.device)
    if args.kernels and args.gpu_profile is None:
        args.gpu_profile = default_profile(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def scaled(v: int) -> int:
        return max(8, int(v * args.scale) // 8 * 8)
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'experts':>7s} {'tok/exp':>7s} {'hidden':>6s} {'ffn':>5s}  {'max rel err':>11s}  "
          f"{'grouped fwd+bwd':>15s}  {'per-expert':>10s}")
    for experts, per_expert, hidden, ffn in SHAPES:
        per_expert, hidden, ffn = scaled(per_expert), scaled(hidden), scaled(ffn)
        ex = GroupedExperts(experts, hidden, ffn, "swiglu").to(dev)
        for w in ex.parameters():
            torch.nn.init.normal_(w, std=0.02)
        counts = counts_for(experts, per_expert, gen).to(dev)
        n = int(counts.sum())
        x = torch.randn(n, hidden, device=dev, requires_grad=True)
        p = torch.rand(n, device=dev, requires_grad=True)
        g = torch.randn(n, hidden, device=dev, dtype=torch.bfloat16)
        assert ex.grouped_gemm(dev, torch.bfloat16)

        def run(grouped: bool):
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                y = ex(x, counts, p) if grouped else ex._per_expert(x, counts.tolist(), p)
            return y, torch.autograd.grad(y, [x, p, ex.w1, ex.w2, ex.w3], g)

        (ya, ga), (yb, gb) = run(True), run(False)
        errs = [float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                for a, b in zip((ya.detach(), *ga), (yb.detach(), *gb))]
        times = {}
        for grouped in (True, False):
            for _ in range(5):
                run(grouped)
            samples = []
            for _ in range(20):
                sync()
                t0 = time.perf_counter()
                run(grouped)
                sync()
                samples.append(time.perf_counter() - t0)
            times["grouped" if grouped else "per_expert"] = statistics.median(samples)
        kernels = profile_kernels(run, dev, counts.tolist(), hidden, ffn, args.gpu_profile) \
            if args.kernels else None
        rows.append({"kernels": kernels, "experts": experts, "tokens_per_expert": per_expert, "hidden": hidden, "ffn": ffn,
                     "counts": counts.tolist(), "max_rel_err": max(errs), "errs": errs, "time_s": times})
        print(f"{experts:7d} {per_expert:7d} {hidden:6d} {ffn:5d}  {max(errs):11.2e}  "
              f"{times['grouped'] * 1e3:12.2f} ms  {times['per_expert'] * 1e3:7.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                                              "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
