"""Peak memory per rank, by category.

On a GPU the CUDA caching allocator's own statistics are the truth (`max_memory_allocated`). On a
CPU there are no allocator statistics and the process RSS is mostly the runtime, so a small
tracker of live tensor storages stands in: a TorchDispatchMode sees every tensor an operator
returns, remembers its storage (weakly, so a freed storage drops out), and keeps the running total
and its peak. FSDP2 frees and re-allocates its all-gathered parameters by resizing their storage
in place, which no operator reports; with `exact=True` (any FSDP-managed model) the total is
re-summed from the live storages' current sizes at every operator instead of kept incrementally.
Tensors allocated by other threads (gloo's) or outside the dispatcher are not seen; they are small.

Categories (both devices): parameters, gradients and optimizer states are summed from the local
(per-rank) tensors at the end of a step; `activations_and_buffers` is the peak total minus those
three: activations, FSDP all-gather buffers, pipeline send/receive buffers and temporaries.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class LiveTensorTracker(TorchDispatchMode):
    """Running total and peak of the bytes held by live tensor storages (CPU stand-in for the allocator)."""

    def __init__(self, *, exact: bool = False):
        super().__init__()
        self.exact = exact
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes counted
        self._refs: dict[int, weakref.ref] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        if self.exact:
            self.current = self._resum()
        self.peak = max(self.peak, self.current)
        return out

    def _resum(self) -> int:
        total = 0
        for ref in list(self._refs.values()):  # a copy: a storage freed meanwhile drops itself from the dict
            st = ref()
            if st is not None:
                total += st.nbytes()
        return total

    def _add(self, t: torch.Tensor) -> None:
        t = _local(t)
        if t.device.type == "meta":
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, functional wrappers)
            return
        key = id(st)
        if key in self._sizes:
            return
        size = st.nbytes()
        self._sizes[key] = size
        self._refs[key] = weakref.ref(st, lambda _r, k=key: self._drop(k))
        self.current += size

    def _drop(self, key: int) -> None:
        self._refs.pop(key, None)
        self.current -= self._sizes.pop(key, 0)

    def reset_peak(self) -> None:
        if self.exact:
            self.current = self._resum()
        self.peak = self.current


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = _local(t)
        if t.device.type == "meta":
            continue
        st = t.untyped_storage()
        if st.data_ptr() in seen and st.data_ptr() != 0:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def static_bytes(modules, optimizers) -> dict[str, int]:
    """Bytes of this rank's parameters, gradients and optimizer states (local shards, de-duplicated)."""
    params = [p for m in modules for p in m.parameters()]
    states = []
    for opt in optimizers:
        for st in opt.state.values():
            states += [v for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {
        "parameters": _storage_bytes(params),
        "gradients": _storage_bytes(p.grad for p in params),
        "optimizer_states": _storage_bytes(states),
    }
