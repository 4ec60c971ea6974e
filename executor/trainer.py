"""Train one plan on this rank and measure it: build, parallelise, run the steps, time them.

`train(scenario, ...)` is called by every rank of the job with the same scenario and returns this
rank's record; `executor.worker` collects the records into the measurement. The process group
must already be initialised with as many ranks as the plan needs.

Step timing: every step starts after a barrier and ends after the optimizer step, a CUDA
synchronise (on GPU) and a barrier, so it is the slowest rank's time. The loss of a step is the
mean over all its tokens (every microbatch, every data-parallel and context-parallel rank).
"""
from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from executor import data
from executor.config import SCHEDULES, effective_zero_stage, notes, num_stages
from executor.memory import LiveTensorTracker, static_bytes
from executor.model import Stage, count_parameters
from executor.moe import MoE
from executor.optim import ShardedOptimizer, make_optimizer
from executor.parallel import (
    Groups, apply_dp, apply_tp, build_groups, build_stages, dp_style, finish_gradients, local_positions, padded_vocab,
)
from paraplan.specs import Scenario


TRACKED_STEPS = 2
"""CPU memory is measured on the first steps only: the second is the first steady one (Adam's
states exist from the first optimizer step on), and the default warm-up is two steps."""


def train(sc: Scenario, *, device: torch.device, fault: str | None = None, cpu_bf16: bool = False) -> dict:
    """Run sc.run.warmup_steps + sc.run.steps steps of sc.plan; return this rank's record.

    bf16 mixed precision is for GPUs; `cpu_bf16` runs it on the CPU too, so the tests can check
    the GPU's mixed-precision code paths (autocast, FSDP2 MixedPrecisionPolicy, bf16 pipeline
    activations) on CPU/gloo.
    """
    on_gpu = device.type == "cuda"
    bf16 = (on_gpu or cpu_bf16) and sc.training.precision == "bf16"
    tracker = None if on_gpu else LiveTensorTracker(exact=dp_style(sc) == "fsdp")
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    total = sc.run.warmup_steps + sc.run.steps
    records: list[dict] = []
    with tracker if tracker is not None else contextlib.nullcontext():
        job = _Job(sc, device, bf16)
        # the CPU tracker sees every operator (15-40% slower steps): it watches the first
        # TRACKED_STEPS steps, the warm-up by default, and is off for the rest
        while len(records) < (total if tracker is None else min(total, TRACKED_STEPS)):
            _maybe_fault(fault, job.g.rank, len(records))
            records.append(job.step(len(records), tracker))
    while len(records) < total:
        _maybe_fault(fault, job.g.rank, len(records))
        records.append(job.step(len(records), None))
    out = job.record(records, tracker)
    out["compute_dtype"] = "bf16" if bf16 else ("tf32" if on_gpu else "fp32")
    return out


def _maybe_fault(fault: str | None, rank: int, step: int) -> None:
    """Test hook (PARAPLAN_EXECUTOR_FAULT="RANK:STEP:raise|exit|hang"): make one rank die or hang."""
    if not fault:
        return
    r, s, kind = fault.split(":")
    if int(r) != rank or int(s) != step:
        return
    if kind == "exit":
        os._exit(3)
    if kind == "hang":
        time.sleep(10**6)
    raise RuntimeError(f"injected fault at step {step}")


class _Job:
    """Everything built for one plan on this rank, and one training step."""

    def __init__(self, sc: Scenario, device: torch.device, bf16: bool):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        self.sc, self.device, self.bf16 = sc, device, bf16
        p = sc.plan
        self.g: Groups = build_groups(sc, device.type)
        act_dtype = torch.bfloat16 if bf16 else torch.float32
        self.parts = build_stages(sc, self.g, device, act_dtype)
        self.stages: list[Stage] = [st for _, st in self.parts]
        cp_group = self.g.mesh["cp"].get_group() if p.cp > 1 else None
        for st in self.stages:
            st.set_recompute(p.recompute, p.recompute_modules)
            for block in st.layers.values():
                block.attn.cp_group = cp_group
                block.attn.cp_heads = p.cp_comm_type == "a2a"
                block.attn.unfused = sc.training.attention == "unfused"
            if p.tp > 1:
                apply_tp(st, sc, self.g)
        # gradients reduced in training.grad_reduce_dtype: bf16 or fp32 (FSDP2's reduce_dtype)
        reduce_dtype = torch.bfloat16 if sc.training.grad_reduce_dtype == "bf16" else torch.float32
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype) if bf16 else MixedPrecisionPolicy()
        self.modules = apply_dp(self.stages, sc, self.g, mp)
        self.optimizer, self.inner_optimizers = self._optimizer()
        self.n_micro = sc.num_microbatches
        self.positions = local_positions(sc, self.g, device)
        self.has_first = any(s == 0 for s, _ in self.parts)
        self.has_last = any(s == num_stages(sc) - 1 for s, _ in self.parts)
        self.schedule = self._schedule() if p.pp > 1 else None

    # -- building ---------------------------------------------------------------------------

    def _optimizer(self):
        sc, g = self.sc, self.g
        params = [p for st in self.stages for p in st.parameters()]
        fused, kind = self.device.type == "cuda", sc.training.optimizer
        if effective_zero_stage(sc.plan) != 1 or sc.plan.dp * sc.plan.cp == 1:
            opt = make_optimizer(params, kind, fused=fused)
            return opt, [opt]
        experts = {id(p) for st in self.stages for b in st.layers.values() if isinstance(b.ffn, MoE)
                   for p in b.ffn.experts.parameters()}
        sets = [([p for p in params if id(p) not in experts], g.dp_group)]
        if experts:
            sets.append(([p for p in params if id(p) in experts], g.edp_mesh.get_group()))
        opt = ShardedOptimizer(sets, kind, fused=fused)
        return opt, [opt.inner] if opt.inner is not None else []

    def _schedule(self):
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining import PipelineStage

        sc, p = self.sc, self.sc.plan
        mb, seq, h = p.micro_batch_size, sc.training.seq_length // p.cp, sc.model.hidden_size
        vocab = padded_vocab(sc.model, p.tp).vocab_size // p.tp
        hidden_seq = seq // p.tp if p.sequence_parallel and p.tp > 1 else seq
        act_dtype = torch.bfloat16 if self.bf16 else torch.float32
        n = num_stages(sc)

        def meta(*shape, dtype):
            # floating activations carry gradients back: say so, or no gradient is sent
            return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)

        stages = []
        for (s, _), module in zip(self.parts, self.modules):
            inp = meta(mb, seq, dtype=torch.long) if s == 0 else meta(mb, hidden_seq, h, dtype=act_dtype)
            out = meta(mb, seq, vocab, dtype=torch.float32) if s == n - 1 else meta(mb, hidden_seq, h, dtype=act_dtype)
            stages.append(PipelineStage(module, s, n, self.device, input_args=(inp,), output_args=(out,),
                                        group=self.g.pp_group))
        cls = getattr(pipelining, SCHEDULES[p.schedule].torch_class)
        single = issubclass(cls, pipelining.schedules.PipelineScheduleSingle)
        return cls(stages[0] if single else stages, n_microbatches=self.n_micro, loss_fn=self._loss)

    # -- one step ---------------------------------------------------------------------------

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.sc.plan.tp > 1:  # vocab-sharded logits: cross-entropy under loss_parallel()
            from torch.distributed.tensor import DTensor, Shard

            logits = DTensor.from_local(logits, self.g.tp_mesh, [Shard(-1)])
        return F.cross_entropy(logits.flatten(0, 1), target.flatten(0, 1))

    def _context(self):
        stack = contextlib.ExitStack()
        if self.sc.plan.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            stack.enter_context(loss_parallel())
        if self.bf16:
            stack.enter_context(torch.autocast(self.device.type, dtype=torch.bfloat16))
        return stack

    def step(self, step: int, tracker) -> dict:
        sc, p, g = self.sc, self.sc.plan, self.g
        tokens = data.global_batch(seed=sc.run.seed, step=step, batch=sc.training.global_batch_size,
                                   seq=sc.training.seq_length, vocab=sc.model.vocab_size)
        x, y = data.local_batch(tokens, dp=p.dp, dp_rank=g.coords.dp, positions=self.positions)
        x, y = x.to(self.device), y.to(self.device)
        self._sync()
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        on_gpu = self.device.type == "cuda"
        if tracker is not None:
            tracker.reset_peak()
        elif on_gpu:  # the step's own peak, not model building's (unsharded stages)
            torch.cuda.reset_peak_memory_stats(self.device)
        losses = self._pipeline(x, y) if self.schedule is not None else self._accumulate(x, y)
        finish_gradients(self.stages, sc, g)
        self.optimizer.step()
        self._sync()
        elapsed = time.perf_counter() - start
        # mean loss over every rank that computed one (the last stage; all TP ranks there agree)
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        if losses:
            total[0], total[1] = torch.stack(losses).double().sum(), len(losses)
        dist.all_reduce(total)
        record = {"time_s": elapsed, "loss": float(total[0] / total[1]), "tracked": tracker is not None or on_gpu,
                  "static": static_bytes(self.stages, self.inner_optimizers)}
        if tracker is not None:
            record["peak_bytes"] = tracker.peak
        elif on_gpu:
            record["peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            record["peak_reserved"] = torch.cuda.max_memory_reserved(self.device)
        return record

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier()

    def _accumulate(self, x, y) -> list[torch.Tensor]:
        """No pipeline: microbatches one after another, gradients accumulated, reduced on the last."""
        module, stage = self.modules[0], self.stages[0]
        style = dp_style(self.sc)
        mb, losses = self.sc.plan.micro_batch_size, []
        for i in range(self.n_micro):
            last = i == self.n_micro - 1
            sync = contextlib.nullcontext()
            if style == "ddp" and not last:
                sync = module.no_sync()
            elif style == "replicate":
                stage.set_requires_gradient_sync(last)
            with sync, self._context():
                loss = self._loss(module(x[i * mb:(i + 1) * mb]), y[i * mb:(i + 1) * mb])
                (loss / self.n_micro).backward()
            losses.append(_value(loss))
        return losses

    def _pipeline(self, x, y) -> list[torch.Tensor]:
        losses: list = []
        with self._context():
            args = (x,) if self.has_first else ()
            kwargs = {"target": y, "losses": losses} if self.has_last else {}
            self.schedule.step(*args, **kwargs)
        return [_value(v) for v in losses] if self.has_last else []

    # -- the record -------------------------------------------------------------------------

    def record(self, steps: list[dict], tracker) -> dict:
        g = self.g
        static = steps[-1]["static"]
        peak = max(s["peak_bytes"] for s in steps if "peak_bytes" in s)
        memory = {**static, "peak_total": int(peak),
                  "activations_and_buffers": max(0, int(peak) - sum(static.values())),
                  "source": "cuda-allocator" if tracker is None else "live-tensor-tracker"}
        if tracker is None:  # every step's own peak, warm-up included, as for peak_total
            memory["peak_reserved"] = int(max(s["peak_reserved"] for s in steps))
        return {
            "rank": g.rank,
            "coords": {"tp": g.coords.tp, "cp": g.coords.cp, "dp": g.coords.dp, "pp": g.coords.pp},
            "ep_rank": g.ep_rank,
            "stages": [s for s, _ in self.parts],
            "layers": [list(st.layer_ids) for st in self.stages],
            "parameters": sum(p.numel() if not hasattr(p, "_local_tensor") else p._local_tensor.numel()
                              for st in self.stages for p in st.parameters()),
            "step_times_s": [s["time_s"] for s in steps],
            "memory_tracked_steps": [i for i, s in enumerate(steps) if s["tracked"]],
            "losses": [s["loss"] for s in steps],
            "memory": memory,
            "tokens_per_expert": self._tokens_per_expert(),
        }

    def _tokens_per_expert(self) -> dict | None:
        moes = {b.index: b.ffn for st in self.stages for b in st.layers.values() if isinstance(b.ffn, MoE)}
        if not moes:
            return None
        return {str(i): m.tokens_per_expert.tolist() for i, m in sorted(moes.items())}


def _value(loss) -> torch.Tensor:
    """The loss as a plain detached tensor (no host sync: read once per step)."""
    from torch.distributed.tensor import DTensor

    loss = loss.detach()
    return loss.to_local() if isinstance(loss, DTensor) else loss


def summary(sc: Scenario, ranks: list[dict], *, backend: str, device_name: str, on_gpu: bool,
            device_memory: int = 0) -> dict:
    """The measurement of one plan from every rank's record (built on rank 0)."""
    from executor.config import scenario_to_json

    p, t = sc.plan, sc.training
    warm = sc.run.warmup_steps
    times = [max(r["step_times_s"][i] for r in ranks) for i in range(len(ranks[0]["step_times_s"]))]
    losses = ranks[0]["losses"]
    tokens = t.global_batch_size * t.seq_length
    steps = [{"step": i, "warmup": i < warm, "time_s": times[i], "loss": losses[i], "tokens_per_s": tokens / times[i]}
             for i in range(len(times))]
    measured = sorted(times[warm:])
    median = measured[len(measured) // 2] if len(measured) % 2 else sum(measured[len(measured) // 2 - 1:len(measured) // 2 + 1]) / 2
    raw = scenario_to_json(sc)
    out = {
        "scenario": sc.name,
        "model": raw["model"], "training": raw["training"], "plan": raw["plan"], "run": raw["run"],
        "parameters": count_parameters(padded_vocab(sc.model, p.tp)),
        "world_size": p.world_size, "backend": backend, "device": device_name, "device_memory_bytes": device_memory,
        # fp32 on a GPU runs its matmuls in TF32 (the worker allows it), so its peak is TF32's
        "compute_dtype": ranks[0]["compute_dtype"],
        "data_parallel": dp_style(sc), "zero_stage_run": effective_zero_stage(p),
        "notes": notes(sc, on_gpu=on_gpu or ranks[0]["compute_dtype"] == "bf16"),
        "num_microbatches": sc.num_microbatches, "tokens_per_step": tokens,
        "steps": steps,
        "step_time_s": median,
        "step_time_mean_s": sum(measured) / len(measured),
        "tokens_per_s": tokens / median,
        "peak_memory_bytes": max(r["memory"]["peak_total"] for r in ranks),
        "ranks": ranks,
    }
    tracked_timed = [i for i in ranks[0]["memory_tracked_steps"] if i >= warm]
    if tracked_timed and ranks[0]["memory"]["source"] == "live-tensor-tracker":
        out["notes"].append(f"measured step(s) {', '.join(str(i + 1) for i in tracked_timed)} (counting from 1) ran "
                            "with the CPU memory tracker, "
                            f"which slows a step by 15-40%: set run.warmup_steps >= {TRACKED_STEPS} to time none")
    if padded_vocab(sc.model, p.tp).vocab_size != sc.model.vocab_size:
        out["notes"].append(f"vocabulary padded from {sc.model.vocab_size} to "
                            f"{padded_vocab(sc.model, p.tp).vocab_size} (a multiple of tp)")
    moe = [r["tokens_per_expert"] for r in ranks if r["tokens_per_expert"]]
    if moe:
        # every rank counts the assignments of the tokens it routes; without SP all TP ranks route
        # the same tokens, so count TP rank 0 only
        merged: dict[str, list[int]] = {}
        for r in ranks:
            if not r["tokens_per_expert"] or (not p.sequence_parallel and r["coords"]["tp"] != 0):
                continue
            for layer, counts in r["tokens_per_expert"].items():
                acc = merged.setdefault(layer, [0] * len(counts))
                merged[layer] = [a + c for a, c in zip(acc, counts)]
        out["tokens_per_expert"] = merged
    return out
