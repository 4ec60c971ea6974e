"""Optimizers: AdamW, and ZeRO-1 (optimizer states sharded over the data-parallel ranks).

ZeRO-1 is `torch.distributed.optim.ZeroRedundancyOptimizer` where its broadcasts work: plain
tensors, one data-parallel group (no TP, no EP). With TP the parameters are DTensors, on which
ZeroRedundancyOptimizer's broadcast has no sharding strategy in PyTorch 2.13, and with EP the
expert parameters have their own, smaller data-parallel group; `ShardedOptimizer` covers those:
the same algorithm written out (Rajbhandari et al. 2020, stage 1). Per data-parallel group the
parameters are split into contiguous, size-balanced runs, one per rank; each rank keeps AdamW
states for its run only and steps it, then every run is broadcast from its owner, flattened into
one buffer per owner. It acts on each parameter's local shard, so DTensor parameters are fine.
Gradients must already be reduced (full) on every rank, as with DDP / `replicate`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
"""Fixed hyper-parameters: the executor measures speed and checks equivalence, it does not tune."""


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _mesh_key(p) -> tuple:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return (id(p.device_mesh), tuple(str(x) for x in p.placements))
    return ()


def adamw(params, *, fused: bool) -> torch.optim.AdamW:
    """AdamW with one parameter group per DTensor mesh/placement (foreach/fused kernels take one mesh)."""
    groups: dict[tuple, list] = {}
    for p in params:
        groups.setdefault(_mesh_key(p), []).append(p)
    kwargs = dict(ADAMW, fused=True) if fused else dict(ADAMW, foreach=True)
    return torch.optim.AdamW([{"params": ps} for ps in groups.values()], **kwargs)


def partition(sizes: list[int], parts: int) -> list[int]:
    """Owner of each item: contiguous runs, each close to sum/parts (greedy on the running total)."""
    total = sum(sizes) or 1
    owners, acc = [], 0
    for s in sizes:
        owners.append(min(parts - 1, int(parts * (acc + s / 2) / total)))
        acc += s
    return owners


class ShardedOptimizer:
    """ZeRO-1 over one or more (parameters, data-parallel group) sets; AdamW underneath."""

    def __init__(self, param_sets: list[tuple[list, object]], *, fused: bool):
        self._sets = []
        owned = []
        for params, group in param_sets:
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            owners = partition([_local(p).numel() for p in params], size)
            self._sets.append((params, owners, group, size))
            owned += [p for p, o in zip(params, owners) if o == rank]
        self.inner = adamw(owned, fused=fused) if owned else None

    @property
    def state(self):
        return self.inner.state if self.inner is not None else {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for params, *_ in self._sets:
            for p in params:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        if self.inner is not None:
            self.inner.step()
        for params, owners, group, size in self._sets:
            global_ranks = dist.get_process_group_ranks(group)
            for owner in range(size):
                mine = [_local(p) for p, o in zip(params, owners) if o == owner]
                if not mine:
                    continue
                flat = _flatten_dense_tensors(mine)
                dist.broadcast(flat, src=global_ranks[owner], group=group)
                for t, new in zip(mine, _unflatten_dense_tensors(flat, mine)):
                    t.copy_(new)
