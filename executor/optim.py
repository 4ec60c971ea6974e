"""Optimizers: AdamW (or SGD for tests), and ZeRO-1 (optimizer states sharded over the data-parallel ranks).

ZeRO-1 is `ShardedOptimizer` for every plan (Rajbhandari et al. 2020, stage 1, sharded element-wise
as Megatron-Core's distributed optimizer shards it, which is what the simulator's memory model
assumes). `torch.distributed.optim.ZeroRedundancyOptimizer` is not used: it assigns whole
parameters to ranks, so the rank holding the embedding holds far more than 1/dp of the states, and
with TP its broadcast has no sharding strategy for DTensors in PyTorch 2.13. With EP the expert
parameters form a set of their own over their smaller data-parallel group. It acts on each
parameter's local tensor, so DTensor parameters are fine. Gradients must already be reduced (full)
on every rank, as DDP and `replicate` leave them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

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
    if kind == "sgd":
        # the tests' optimizer runs its plain loop: PyTorch 2.11's in-place foreach ops leave a
        # DTensor whose gradient is Partial (a sequence-parallel norm's) unchanged, and the fused
        # SGD kernel has no DTensor sharding strategy (NotImplementedError under TP or FSDP)
        kwargs = dict(kwargs, foreach=False)
    else:
        kwargs = dict(kwargs, fused=True) if fused else dict(kwargs, foreach=True)
    return cls([{"params": ps} for ps in groups.values()], **kwargs)


# torch 2.13 renamed all_gather_into_tensor (kept, deprecated); earlier releases have only the old name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _pieces(tensors: list, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """(index, start, stop) of each tensor's elements that fall in [lo, hi) of their concatenation."""
    out, offset = [], 0
    for i, t in enumerate(tensors):
        a, b = max(lo, offset), min(hi, offset + t.numel())
        if a < b:
            out.append((i, a - offset, b - offset))
        offset += t.numel()
    return out


def _gather_slice(tensors: list, pieces, like: torch.Tensor) -> torch.Tensor:
    """The [lo, hi) slice of the tensors' concatenation, built from their pieces only (no copy of
    the whole concatenation: the transient is the shard, not the model). A None tensor (a
    parameter without a gradient) reads as zeros."""
    parts = [like.new_zeros(b - a) if tensors[i] is None else tensors[i].reshape(-1)[a:b] for i, a, b in pieces]
    return torch.cat(parts) if parts else like.new_zeros(0)


class ShardedOptimizer:
    """ZeRO-1 over one or more (parameters, data-parallel group) sets, sharded element-wise.

    Per set, the parameters' local tensors, concatenated in order, are split into equal contiguous
    slices, one per rank (Megatron-Core's distributed optimizer), so the optimizer states are
    balanced to the element however large one parameter is. Each rank keeps a copy of its slice as
    the leaf the inner optimizer steps, takes its slice of the (already reduced) gradients, steps,
    and the slices are all-gathered into one flat buffer and copied back into the parameters.
    """

    def __init__(self, param_sets: list[tuple[list, object]], kind: str, *, fused: bool):
        self._sets, leaves = [], []
        for params, group in param_sets:
            size, rank = dist.get_world_size(group), dist.get_rank(group)
            locals_ = [_local(p) for p in params]
            total = sum(t.numel() for t in locals_)
            shard = -(-total // size)
            pieces = _pieces(locals_, min(rank * shard, total), min((rank + 1) * shard, total))
            with torch.no_grad():
                leaf = torch.nn.Parameter(_gather_slice([t.detach() for t in locals_], pieces, locals_[0]).clone())
            self._sets.append((params, group, size, shard, pieces, leaf))
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
        for params, _group, _size, _shard, pieces, leaf in self._sets:
            grads = [None if p.grad is None else _local(p.grad) for p in params]
            leaf.grad = _gather_slice(grads, pieces, leaf)
        self.inner.step()
        for params, group, size, shard, _pieces_, leaf in self._sets:
            mine = leaf.new_zeros(shard)
            mine[:leaf.numel()] = leaf.detach()
            flat = leaf.new_empty(shard * size)
            _all_gather_single(flat, mine, group=group)
            offset = 0
            for p in params:
                t = _local(p)
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
            leaf.grad = None
