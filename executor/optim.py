"""Optimizers: AdamW (or SGD for tests), and ZeRO-1 (optimizer states sharded over the data-parallel ranks).

ZeRO-1 is `torch.distributed.optim.ZeroRedundancyOptimizer` where its broadcasts work: plain
tensors, one data-parallel group (pure DP). With TP the parameters are DTensors, on which
ZeroRedundancyOptimizer's broadcast has no sharding strategy in PyTorch 2.13, and with EP the
expert parameters have their own, smaller data-parallel group; `ShardedOptimizer` covers those
(Rajbhandari et al. 2020, stage 1, as Megatron-Core's distributed optimizer shards it). It acts on
each parameter's local tensor, so DTensor parameters are fine. Gradients must already be reduced
(full) on every rank, as `replicate` leaves them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
"""Fixed hyper-parameters: the executor measures speed and checks equivalence, it does not tune."""
SGD = dict(lr=0.2, momentum=0.9)
"""training.optimizer "sgd": for equivalence tests. Adam's update is invariant to a constant factor
on a gradient, so a gradient reduced with the wrong divisor still trains identically; SGD's is not."""


def _local(t):
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _mesh_key(p) -> tuple:
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return (id(p.device_mesh), tuple(str(x) for x in p.placements))
    return ()


def optimizer_class(kind: str):
    """(class, keyword arguments) of training.optimizer: "adam"/"adamw" (AdamW, as Megatron's adam) or "sgd"."""
    return (torch.optim.SGD, SGD) if kind == "sgd" else (torch.optim.AdamW, ADAMW)


def make_optimizer(params, kind: str, *, fused: bool) -> torch.optim.Optimizer:
    """The optimizer, one parameter group per DTensor mesh/placement (foreach/fused kernels take one mesh)."""
    groups: dict[tuple, list] = {}
    for p in params:
        groups.setdefault(_mesh_key(p), []).append(p)
    cls, kwargs = optimizer_class(kind)
    kwargs = dict(kwargs, fused=True) if fused else dict(kwargs, foreach=True)
    return cls([{"params": ps} for ps in groups.values()], **kwargs)


class ShardedOptimizer:
    """ZeRO-1 over one or more (parameters, data-parallel group) sets, sharded element-wise.

    Per set, the parameters' local tensors are concatenated (in order) into one flat vector and
    split into equal contiguous slices, one per rank (Megatron-Core's distributed optimizer), so
    the optimizer states are balanced to the element however large one parameter is. Each rank
    keeps a copy of its slice as the leaf the inner optimizer steps, takes its slice of the
    (already reduced) gradients, steps, and the slices are all-gathered back into the parameters.
    """

    def __init__(self, param_sets: list[tuple[list, object]], kind: str, *, fused: bool):
        self._sets, leaves = [], []
        for params, group in param_sets:
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            total = sum(_local(p).numel() for p in params)
            shard = -(-total // size)
            lo, hi = min(rank * shard, total), min((rank + 1) * shard, total)
            with torch.no_grad():
                flat = _flatten_dense_tensors([_local(p).detach() for p in params])
                leaf = torch.nn.Parameter(flat[lo:hi].clone())
            self._sets.append((params, group, size, shard, lo, hi, leaf))
            leaves.append(leaf)
        self.inner = make_optimizer(leaves, kind, fused=fused)

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for params, *_ in self._sets:
            for p in params:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for params, _group, _size, _shard, lo, hi, leaf in self._sets:
            grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in params]
            leaf.grad = _flatten_dense_tensors(grads)[lo:hi].clone()
        self.inner.step()
        for params, group, size, shard, lo, hi, leaf in self._sets:
            mine = torch.zeros(shard, dtype=leaf.dtype, device=leaf.device)
            mine[:hi - lo] = leaf.detach()
            gathered = [torch.empty_like(mine) for _ in range(size)]
            dist.all_gather(gathered, mine, group=group)
            locals_ = [_local(p) for p in params]
            flat = torch.cat(gathered)[:sum(t.numel() for t in locals_)]
            for t, new in zip(locals_, _unflatten_dense_tensors(flat, locals_)):
                t.copy_(new)
            leaf.grad = None
