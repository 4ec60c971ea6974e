"""nccl-tests-style collective sweeps over the ranks torchrun started (NCCL on GPUs, gloo on CPUs).

Conventions are nccl-tests' doc/PERFORMANCE.md
(https://github.com/NVIDIA/nccl-tests/blob/a0b82b2260cf5152b9f8c061bbf7eaf0ba096432/doc/PERFORMANCE.md),
the same as hwmodels.network's: the size S of an all_reduce is its buffer, of an all_gather its
total output, of a reduce_scatter its total input, of an all_to_all one rank's whole send buffer,
of a send/recv the message; algbw = S / t; busbw = algbw x busbw_factor(op, n) (all_reduce
2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; send_recv 1). send_recv is
nccl-tests' sendrecv_perf: every rank sends to the next and receives from the previous at once.

Time of one size: warm-up, then `repeats` blocks of `inner` back-to-back ops ending in a device
synchronisation, timed on the host as nccl-tests does; each rank's median block, and the slowest
rank's median is the collective's time (it has finished only when every rank has).

Tiers: within a node (each node's ranks as a group, all nodes at once) and, when the world spans
nodes, across them (the whole world). Node membership follows torchrun's numbering (rank =
node x LOCAL_WORLD_SIZE + local rank).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from calibrate.plan import Timing
from calibrate.results import CollectiveSample
from hwmodels.network import busbw_factor
from paraplan.errors import first_line

__all__ = ["COLLECTIVES", "CollectiveSample", "Tier", "probe_support", "sweep"]

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
ELEMENT = 4  # float32, nccl-tests' default
MAX_INNER = 1000


@dataclass(frozen=True, kw_only=True)
class Tier:
    name: str
    """intra (one node's ranks) or inter (the world, across nodes)."""
    group: object
    ranks: tuple[int, ...]
    """global ranks of this rank's group."""
    nodes: int
    ranks_per_node: int


def _op(op: str, nbytes: int, tier: Tier, device: torch.device):
    """A callable running `op` once on a buffer of `nbytes` (nccl-tests convention), and the
    byte count it really moves (rounded to whole elements per rank)."""
    n = len(tier.ranks)
    per = max(1, nbytes // (ELEMENT * n)) if op in ("all_gather", "reduce_scatter", "all_to_all") else 0
    count = per * n if per else max(1, nbytes // ELEMENT)
    g = tier.group
    full = torch.ones(count, device=device)
    if op == "all_reduce":
        return (lambda: dist.all_reduce(full, group=g)), count * ELEMENT
    if op == "all_gather":
        part = torch.ones(per, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return (lambda: gather(full, part, group=g)), count * ELEMENT
    if op == "reduce_scatter":
        part = torch.empty(per, device=device)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return (lambda: scatter(part, full, group=g)), count * ELEMENT
    if op == "all_to_all":
        out = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(out, full, group=g)), count * ELEMENT
    if op == "send_recv":
        me = tier.ranks.index(dist.get_rank())
        nxt, prv = tier.ranks[(me + 1) % n], tier.ranks[(me - 1) % n]
        recv = torch.empty_like(full)

        def sendrecv():
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, full, nxt), dist.P2POp(dist.irecv, recv, prv)]):
                work.wait()

        return sendrecv, count * ELEMENT
    raise ValueError(f"unknown collective {op!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _group_max(value: float, tier: Tier, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=tier.group)
    return float(t.item())


def probe_support(tier: Tier, device: torch.device) -> dict[str, str]:
    """op -> why it cannot run on this backend ('' when it can), tried once on a tiny buffer.
    Every rank tries the same ops in the same order; a backend refuses an op before any traffic
    (gloo builds without reduce_scatter or all_to_all raise at the call), so no rank is left waiting.
    The verdict is agreed over the group (an op is skipped if any rank could not run it)."""
    out = {}
    for op in COLLECTIVES:
        try:
            fn, _ = _op(op, 64 * len(tier.ranks), tier, device)
            fn()
            _sync(device)
            why = ""
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            why = first_line(exc) or type(exc).__name__
        failed = _group_max(1.0 if why else 0.0, tier, device)
        out[op] = why or ("unsupported on another rank" if failed else "")
    return out


def sweep(op: str, sizes, tier: Tier, *, device: torch.device, timing: Timing, backend: str,
          progress=None) -> list[CollectiveSample]:
    """One op over every size on this tier; every rank of the tier calls it with the same arguments."""
    n = len(tier.ranks)
    factor = busbw_factor(op, n)
    samples = []
    for size in sizes:
        if progress is not None:
            progress.step(f"{op} {tier.name} {n} ranks {size / 2**20:.3g} MiB")
        fn, nbytes = _op(op, size, tier, device)
        for _ in range(timing.warmup):
            fn()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        one = _group_max(time.perf_counter() - t0, tier, device)
        inner = int(min(MAX_INNER, max(1, math.ceil(timing.min_block_s / max(one, 1e-7)))))
        blocks = []
        for _ in range(timing.repeats):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            _sync(device)
            blocks.append((time.perf_counter() - t0) / inner)
        seconds = _group_max(statistics.median(blocks), tier, device)
        algbw = nbytes / seconds
        samples.append(CollectiveSample(op=op, tier=tier.name, ranks=n, nodes=tier.nodes, backend=backend,
                                        nbytes=nbytes, seconds=seconds, algbw=algbw, busbw=algbw * factor,
                                        inner=inner, repeats=timing.repeats))
        del fn
    return samples
