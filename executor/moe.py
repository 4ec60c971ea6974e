"""The MoE feed-forward layer: top-k router, experts, optional shared experts, and EP dispatch/combine.

Routing (per token): softmax over the router logits (fp32), the top-k experts, their weights
renormalised to sum to 1 when k > 1 (Mixtral; k = 1 keeps the raw probability, as Switch does, so
the router still gets a gradient). Group-limited routing (model.moe.expert_groups/groups_per_token):
a token first keeps the groups_per_token groups whose two highest probabilities sum highest
(DeepSeek-V3, arXiv 2412.19437 Sec. 2.1.2) and picks its top-k among their experts. No auxiliary
load-balancing loss: the measurement reports the tokens each expert received instead. With a
capacity factor, each rank keeps, per expert, the first ceil(cf x tokens x k / E) assignments of its
local tokens (GShard's per-group capacity) and drops the rest (their expert output is zero);
capacity None is dropless.

Expert parallelism: experts are split contiguously over the EP group (rank j holds experts
[j E/ep, (j+1) E/ep)). Dispatch and combine are `all_to_all_single` with uneven (possibly zero)
splits, made differentiable by `_functional_collectives.all_to_all_single_autograd` (its backward is
the reverse all-to-all). The per-expert token counts travel first in a small integer all-to-all.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from paraplan.specs import ModelSpec


ROW_ALIGN = 8
"""Rows each expert's token group is padded to a multiple of in the grouped GEMM: a bf16 group must
start 16 bytes aligned for the kernel's TMA loads (torch's grouped GEMM checks 16-byte strides,
pytorch#150374; torchtitan pads token groups to 8 rows for bf16, 16 for fp8, torchtitan#1503)."""


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in: autocast's where it is on, else the input's."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def _count(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert, without a host wait (CUDA's bincount reads the input's min and max
    on the host)."""
    return experts.new_zeros(num_experts).index_add_(0, experts, torch.ones_like(experts))


class GroupedExperts(nn.Module):
    """E_local experts' weights stacked on dim 0; tokens arrive grouped by expert.

    The experts run as grouped GEMMs (`torch._grouped_mm`: one kernel per projection for all local
    experts, as Megatron-Core's TEGroupedMLP and torchtitan run them) where torch has one for the
    device and dtype (CUDA bf16 on Hopper or Blackwell, or CPU) and the widths keep 16-byte
    strides; else as one GEMM per expert. The grouped path never makes the host wait for the token
    counts (the per-expert one reads them); either way a weight's gradient is written once per
    layer, not once per expert (indexing `w[e]` per expert made autograd write a zero gradient the
    size of all E experts for each of them: E^2 traffic)."""

    def __init__(self, num_local: int, hidden: int, ffn: int, activation: str):
        super().__init__()
        self.swiglu = activation == "swiglu"
        self.w1 = nn.Parameter(torch.empty(num_local, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(num_local, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(num_local, ffn, hidden)) if self.swiglu else None

    def forward(self, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """`counts`: rows per local expert (a tensor on x's device). Each row's routing probability
        `probs` (fp32) weights its activation before the down projection, as Megatron-Core's
        TEGroupedMLP does (weighted_bias_swiglu_impl with permuted_probs): the same product as
        weighting the expert output (no bias), but the backward keeps no expert output for a
        weighted combine."""
        dtype = _compute_dtype(x)
        if self.grouped_gemm(x.device, dtype):
            return self._grouped(x.to(dtype), counts, probs, dtype)
        return self._per_expert(x, counts.tolist(), probs)

    def grouped_gemm(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether torch's grouped GEMM runs these experts: it needs 16-byte strides, and on CUDA bf16
        on sm90/sm100 (elsewhere torch falls back to a loop over the groups that reads the offsets
        on the host: aten/src/ATen/native/cuda/GroupedBlas.cpp)."""
        if not hasattr(torch, "_grouped_mm") or dtype not in (torch.bfloat16, torch.float32):
            return False
        if device.type == "cuda" and (dtype != torch.bfloat16 or torch.cuda.get_device_capability(device)[0] not in (9, 10)):
            return False
        if device.type not in ("cuda", "cpu"):
            return False
        per_16_bytes = 16 // torch.empty((), dtype=dtype).element_size()
        return self.w1.shape[1] % per_16_bytes == 0 and self.w1.shape[2] % per_16_bytes == 0

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor, dtype) -> torch.Tensor:
        n, experts = x.shape[0], counts.numel()
        # each expert's rows move to a group padded to ROW_ALIGN rows (zero rows compute zeros), an
        # expert with no tokens to one of ROW_ALIGN zero rows (an empty group's weight gradient is
        # not zeroed on sm100: pytorch#172439); the buffer has a size fixed by n and E, so nothing
        # waits for the counts to reach the host
        padded = torch.clamp_min((counts + ROW_ALIGN - 1) // ROW_ALIGN * ROW_ALIGN, ROW_ALIGN)
        ends = torch.cumsum(padded, 0)
        expert_of_row = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=n)
        first_row = torch.cumsum(counts, 0) - counts
        dest = (ends - padded)[expert_of_row] + torch.arange(n, device=x.device) - first_row[expert_of_row]
        rows = n + experts * ROW_ALIGN
        # the last group runs to the buffer's end, so every row of the buffer belongs to a group
        offs = torch.cat([ends[:-1], ends.new_full((1,), rows)]).to(torch.int32)
        buf = x.new_zeros(rows, x.shape[1]).index_copy(0, dest, x)
        weight = probs.new_zeros(rows).index_copy(0, dest, probs)[:, None]

        def proj(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # a[rows of e] @ w[e].T for each e
            return torch._grouped_mm(a, w.to(dtype).transpose(-2, -1), offs=offs)

        if self.swiglu:
            a = F.silu(proj(buf, self.w1)) * proj(buf, self.w3)
        else:
            a = F.gelu(proj(buf, self.w1), approximate="tanh")
        return proj((a * weight).to(dtype), self.w2).index_select(0, dest)

    def _per_expert(self, x: torch.Tensor, counts: list[int], probs: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1.unbind(0), self.w2.unbind(0)  # one gradient write per weight, not per expert
        w3 = self.w3.unbind(0) if self.swiglu else None
        outs, start = [], 0
        for e, n in enumerate(counts):
            seg = x[start:start + n]
            w = probs[start:start + n, None]
            start += n
            if self.swiglu:
                a = F.silu(seg @ w1[e].t()) * (seg @ w3[e].t())
            else:
                a = F.gelu(seg @ w1[e].t(), approximate="tanh")
            outs.append((a * w).to(a.dtype) @ w2[e].t())
        if not outs:
            return x[:0]
        return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        m = spec.moe
        self.num_experts, self.top_k, self.capacity_factor = m.num_experts, m.top_k, m.capacity_factor
        self.expert_groups, self.groups_per_token = m.expert_groups, m.groups_per_token
        self.router = nn.Linear(spec.hidden_size, m.num_experts, bias=False)
        self.experts = GroupedExperts(m.num_experts, spec.hidden_size, m.expert_ffn_hidden_size, spec.activation)
        self.shared = None
        if m.num_shared_experts:
            from executor.model import MLP

            self.shared = MLP(spec.hidden_size, m.num_shared_experts * m.expert_ffn_hidden_size, spec.activation)
        self.shared_recompute = False
        """Checkpoint the shared experts (selective recompute of shared_experts)."""
        self.ep_group = None
        self.ep_size, self.ep_rank = 1, 0
        self.tokens_per_expert = torch.zeros(m.num_experts, dtype=torch.long, device="cpu")
        """Assignments the router made to each (global) expert from this rank's tokens (before any
        capacity drop), summed over the run."""

    def shard_experts(self, ep_group, ep_size: int, ep_rank: int) -> None:
        """Keep only this EP rank's experts (call before initialising the parameters)."""
        n = self.num_experts // ep_size
        e = self.experts
        self.experts = GroupedExperts(n, e.w1.shape[2], e.w1.shape[1], "swiglu" if e.swiglu else "gelu").to(e.w1.device)
        self.ep_group, self.ep_size, self.ep_rank = ep_group, ep_size, ep_rank

    def _limit_groups(self, probs: torch.Tensor) -> torch.Tensor:
        """The router probabilities with the experts outside each token's chosen groups zeroed (the
        top-k then picks among the chosen groups' experts only); unchanged without a group limit."""
        groups, keep = self.expert_groups, self.groups_per_token
        if keep >= groups:
            return probs
        per_group = probs.view(probs.shape[0], groups, -1)
        score = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(dim=-1)
        chosen = torch.zeros_like(score, dtype=torch.bool).scatter_(1, score.topk(keep, dim=-1).indices, True)
        return per_group.masked_fill(~chosen.unsqueeze(-1), 0.0).view_as(probs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        tokens = x.shape[0]
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, experts = self._limit_groups(probs).topk(self.top_k, dim=-1)
        if self.top_k > 1:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_e, flat_w = experts.reshape(-1), weights.reshape(-1)
        demand = counts = _count(flat_e, self.num_experts)  # the router's demand, before any capacity drop
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            # counted on the device: reading them here would make the host wait for the GPU every layer
            if self.tokens_per_expert.device != flat_e.device:
                self.tokens_per_expert = self.tokens_per_expert.to(flat_e.device)
            self.tokens_per_expert += demand
        keep = None
        if self.capacity_factor is not None:
            capacity = math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)
            # rank of each assignment within its expert, in token order (a stable sort by expert)
            by_expert = torch.argsort(flat_e, stable=True)
            starts = torch.cumsum(demand, 0) - demand
            position = torch.empty_like(flat_e)
            position[by_expert] = torch.arange(flat_e.numel(), device=flat_e.device) - starts[flat_e[by_expert]]
            keep = (position < capacity).nonzero().squeeze(-1)
            flat_e, flat_w = flat_e[keep], flat_w[keep]
            counts = _count(flat_e, self.num_experts)
        order = torch.argsort(flat_e, stable=True)
        token_of = (keep[order] if keep is not None else order) // self.top_k
        routed, routed_w = x[token_of], flat_w[order]
        if self.ep_size > 1:
            y = self._expert_parallel(routed, routed_w, counts)
        else:
            y = self.experts(routed, counts, routed_w)
        out = torch.zeros_like(x).index_add(0, token_of, y.to(x.dtype))
        if self.shared is not None:
            if self.shared_recompute:
                out = out + checkpoint(self.shared, x, use_reentrant=False)
            else:
                out = out + self.shared(x)
        return out.reshape(shape)

    def _expert_parallel(self, routed: torch.Tensor, routed_w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        ep, n_local = self.ep_size, self.num_experts // self.ep_size
        send_splits = counts.view(ep, n_local).sum(1).tolist()
        recv_counts = torch.empty_like(counts)  # [source rank, local expert]
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        recv_counts = recv_counts.view(ep, n_local)
        recv_splits = recv_counts.sum(1).tolist()
        received = funcol.all_to_all_single_autograd(routed.contiguous(), recv_splits, send_splits, self.ep_group)
        # each copy's probability travels with it (Megatron-Core's dispatchers send permuted_probs)
        received_w = funcol.all_to_all_single_autograd(routed_w.contiguous(), recv_splits, send_splits, self.ep_group)
        # rows arrive grouped by source rank, then expert: regroup by expert
        local_expert = torch.repeat_interleave(
            torch.arange(n_local, device=routed.device).repeat(ep), recv_counts.reshape(-1))
        regroup = torch.argsort(local_expert, stable=True)
        y = self.experts(received[regroup], recv_counts.sum(0), received_w[regroup])
        y = y[torch.argsort(regroup)]
        return funcol.all_to_all_single_autograd(y.contiguous(), send_splits, recv_splits, self.ep_group)
