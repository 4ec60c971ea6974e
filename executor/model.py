"""The GPT-style decoder (and its MoE variant) built from a `ModelSpec`, one pipeline stage at a time.

A stage holds the embedding (first stage), a run of transformer blocks keyed by their *global*
layer index, and the final norm and LM head (last stage); the unsplit model is the one stage that
holds everything. Parameters are initialised from a generator seeded by (seed, parameter name), and
each expert from (seed, name, global expert index), so a stage, a TP shard or an EP rank holds
exactly the values the single-process model holds, without ever building the full model.

What matches `ModelSpec.total_params()`: attention q/k/v/o without biases (GQA through
num_kv_heads, head_dim as given), a 2-matrix GELU or 3-matrix SwiGLU FFN without biases, two
LayerNorms per block and a final one (with biases where spec.norm_bias: a LayerNorm model with
biases, as Megatron's GPT; an RMSNorm model's norms run as LayerNorms without them), input
embedding and (unless tied) LM head.
Positions are rotary (parameter-free, so the count is unchanged). MoE layers replace the FFN with a
router (h x E), the experts and the optional shared experts (one FFN of num_shared x expert width).

Module names are what the parallelisers address ("layers.3.attn.wq", "layers.3.ffn.experts");
keep them stable.
"""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from paraplan.specs import ModelSpec


# ----------------------------------------------------------------------------------------------
# Rotary positions


class Rotary:
    """cos/sin tables for the positions this rank holds (all of them, or its CP chunks)."""

    def __init__(self, head_dim: int, positions: torch.Tensor, base: float = 10000.0):
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
        angles = positions.float()[:, None] * inv[None, :]
        angles = torch.cat([angles, angles], dim=-1)
        self.cos, self.sin, self.positions = angles.cos(), angles.sin(), positions

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [b, s, heads, head_dim]."""
        cos = self.cos[None, :, None, :].to(x.dtype)
        sin = self.sin[None, :, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


# ----------------------------------------------------------------------------------------------
# Blocks


class Attention(nn.Module):
    """Causal self-attention with GQA. Head counts are read from the projected width, so the module
    works unchanged on a TP shard (ColwiseParallel q/k/v give each rank its heads)."""

    def __init__(self, spec: ModelSpec, rotary_ref: list):
        super().__init__()
        h = spec.hidden_size
        self.head_dim = spec.head_dim
        self.wq = nn.Linear(h, spec.q_channels, bias=False)
        self.wk = nn.Linear(h, spec.kv_channels, bias=False)
        self.wv = nn.Linear(h, spec.kv_channels, bias=False)
        self.wo = nn.Linear(spec.q_channels, h, bias=False)
        self.selective_recompute = False
        self.cp_group = None
        """Context-parallel group: keys and values are all-gathered over it (Llama 3 style CP, the
        plan's cp_comm_type all_gather; p2p runs so too), or with `cp_heads` the heads are scattered."""
        self.cp_heads = False
        """cp_comm_type a2a (DeepSpeed-Ulysses): all-to-alls trade the sequence split for a head split
        around the attention core."""
        self.unfused = False
        """training.attention unfused: the s x s scores as tensors of their own (_core_attention)."""
        self._rotary = rotary_ref  # [Rotary], shared by the stage's blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        rot = self._rotary[0]
        q = rot.apply(self.wq(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        k = rot.apply(self.wk(x).view(b, s, -1, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        mask = order = None
        if self.cp_group is not None and self.cp_heads:
            q, k, v, order = _cp_scatter_heads(q, k, v, rot.positions, self.cp_group)
        elif self.cp_group is not None:
            k, v, mask = _cp_gather_kv(k, v, rot.positions, self.cp_group)
        if self.selective_recompute:
            out = checkpoint(_core_attention, q, k, v, mask, self.unfused, use_reentrant=False)
        else:
            out = _core_attention(q, k, v, mask, self.unfused)
        if order is not None:
            out = _cp_gather_heads(out.index_select(2, order), self.cp_group)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _core_attention(q, k, v, mask, unfused: bool = False):
    """softmax(QK^T / sqrt(d)) V, causal; k/v heads repeated for GQA (flash-attention compatible).
    `unfused`: as Megatron's attention before fused kernels, the QK^T GEMM, a masked softmax in fp32
    and the AV GEMM as ops of their own, autograd keeping the s x s probabilities for the backward
    (Korthikanti et al. 2022, Sec. 4.1; the simulator's training.attention unfused)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if unfused:
        if mask is None:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")).float(), dim=-1).to(v.dtype)
        return torch.matmul(probs, v)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _cp_gather_kv(k, v, positions, group):
    """All-gather K and V (and the positions they hold) over the CP group; the causal mask follows
    the true positions, so the load-balanced chunk order does not matter. The all-gather's
    backward is a reduce-scatter of the K/V gradients (functional collectives, differentiable)."""
    import torch.distributed._functional_collectives as funcol

    k_all = funcol.all_gather_tensor_autograd(k.contiguous(), gather_dim=2, group=group)
    v_all = funcol.all_gather_tensor_autograd(v.contiguous(), gather_dim=2, group=group)
    mask = positions[:, None] >= _all_positions(positions, group)[None, :]
    return k_all, v_all, mask


def _all_positions(positions, group):
    """The sequence positions every CP rank holds, in rank order (the load-balanced chunks)."""
    import torch.distributed as dist

    pos_all = [torch.empty_like(positions) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pos_all, positions, group=group)
    return torch.cat(pos_all)


def _cp_scatter_heads(q, k, v, positions, group):
    """DeepSpeed-Ulysses (Transformer Engine's cp_comm_type a2a): an all-to-all per tensor sends
    head group j of this rank's sequence chunk to CP rank j, which then holds the whole sequence
    (the chunks in rank order) for 1/cp of the heads. Query group j's heads read key/value group
    j's (GQA groups are contiguous). The sequence is put in position order, so the attention is
    plainly causal (no mask tensor, the fused kernel); returns q, k, v and the index that puts the
    output back in the received order. Differentiable (functional collectives): the backward is
    the inverse all-to-all."""
    ranked = torch.argsort(_all_positions(positions, group))  # received order -> position order
    q, k, v = (_heads_to_sequence(t, group).index_select(2, ranked) for t in (q, k, v))
    return q, k, v, torch.argsort(ranked)


def _heads_to_sequence(x, group):
    """[b, heads, s, d] -> [b, heads/cp, cp*s, d]: head group j to rank j, the chunks received in rank order."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()  # [cp, b, h/cp, s, d]
    recv = funcol.all_to_all_single_autograd(send, None, None, group)  # [cp (source rank), b, h/cp, s, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _cp_gather_heads(out, group):
    """The inverse of _heads_to_sequence: [b, heads/cp, cp*s, d] -> [b, heads, s, d], each rank's
    chunk of the sequence back to it, the head groups in rank order."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    cp = dist.get_world_size(group)
    b, h, total, d = out.shape
    send = out.reshape(b, h, cp, total // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp (dest), b, h, s, d]
    recv = funcol.all_to_all_single_autograd(send, None, None, group)  # [cp (head group), b, h, s, d]
    return recv.transpose(0, 1).reshape(b, cp * h, total // cp, d)


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, activation: str):
        super().__init__()
        self.swiglu = activation == "swiglu"
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False) if self.swiglu else None

    def forward(self, x):
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, rotary_ref: list):
        super().__init__()
        self.index = index
        self.attn_norm = nn.LayerNorm(spec.hidden_size, bias=spec.norm_bias)
        self.attn = Attention(spec, rotary_ref)
        self.ffn_norm = nn.LayerNorm(spec.hidden_size, bias=spec.norm_bias)
        if spec.moe is not None and spec.moe.is_moe_layer(index):
            from executor.moe import MoE

            self.ffn = MoE(spec)
        else:
            self.ffn = MLP(spec.hidden_size, spec.ffn_hidden_size, spec.activation)
        self.full_recompute = False
        self.ffn_recompute = False
        """Checkpoint the FFN module (selective recompute of mlp, or of moe in an MoE layer)."""

    def forward(self, x):
        if self.full_recompute:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)

    def _forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        return x + (checkpoint(self.ffn, h, use_reentrant=False) if self.ffn_recompute else self.ffn(h))


class Stage(nn.Module):
    """One pipeline stage (or the whole model): [embedding] blocks [final norm, LM head].

    Input: token ids [b, s] on the first stage, hidden states [b, s', h] elsewhere. Output: hidden
    states in `act_dtype`, or fp32 logits [b, s, V'] on the last stage (V' = V / tp under TP).
    """

    def __init__(self, spec: ModelSpec, layer_ids, *, first: bool, last: bool, act_dtype=torch.float32):
        super().__init__()
        self.spec, self.act_dtype = spec, act_dtype
        self.layer_ids = tuple(layer_ids)
        self._rotary: list = [None]
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size) if first else None
        self.layers = nn.ModuleDict({str(i): Block(spec, i, self._rotary) for i in self.layer_ids})
        self.norm = nn.LayerNorm(spec.hidden_size, bias=spec.norm_bias) if last else None
        self.head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False) if last else None
        if first and last and spec.tied_embeddings:
            self.head.weight = self.embed.weight

    def set_positions(self, positions: torch.Tensor) -> None:
        """Token positions this rank holds along the sequence (arange, or its CP chunks)."""
        self._rotary[0] = Rotary(self.spec.head_dim, positions)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x).to(self.act_dtype)
        for layer in self.layers.values():
            x = layer(x)
        if self.head is not None:
            return self.head(self.norm(x)).float()
        return x.to(self.act_dtype)

    def set_recompute(self, mode: str, modules: tuple[str, ...] = ("core_attn",)) -> None:
        """full: checkpoint whole blocks; selective: the plan's modules (core_attn, mlp, moe,
        shared_experts; executor_problems refuses the rest)."""
        selective = set(modules) if mode == "selective" else set()
        for layer in self.layers.values():
            layer.full_recompute = mode == "full"
            layer.attn.selective_recompute = "core_attn" in selective
            is_moe = hasattr(layer.ffn, "router")
            layer.ffn_recompute = ("moe" if is_moe else "mlp") in selective
            if is_moe and layer.ffn.shared is not None:
                layer.ffn.shared_recompute = "shared_experts" in selective and "moe" not in selective


# ----------------------------------------------------------------------------------------------
# Initialisation


def _seed_for(seed: int, name: str) -> int:
    return zlib.crc32(f"{seed}:{name}".encode()) & 0x7FFFFFFF


@torch.no_grad()
def init_parameters(stage: Stage, seed: int, *, expert_offset: int = 0) -> None:
    """Deterministic init: each parameter from its own generator, seeded by (seed, its name).

    Normal(0, 0.02) for matrices, the residual-output ones (attn.wo, ffn w2) scaled by
    1/sqrt(2 L) as in GPT-2; LayerNorm weight 1 and bias 0. Stacked expert weights are drawn one
    expert at a time with the expert's global index, so an EP rank that holds experts
    [expert_offset, expert_offset + E_local) gets the values the full model has there. A tied LM
    head is drawn as the embedding it is tied to.
    """
    spec = stage.spec
    std = 0.02
    out_std = std / math.sqrt(2 * spec.num_layers)
    for name, p in stage.named_parameters():
        device = p.device
        key = "embed.weight" if name == "head.weight" and spec.tied_embeddings else name
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        if name.endswith("norm.bias"):
            p.zero_()
            continue
        scale = out_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else std
        if ".experts." in name:
            for e in range(p.shape[0]):
                g = torch.Generator(device=device).manual_seed(_seed_for(seed, f"{key}:{expert_offset + e}"))
                p[e].copy_(torch.randn(p[e].shape, generator=g, device=device) * scale)
        else:
            g = torch.Generator(device=device).manual_seed(_seed_for(seed, key))
            p.copy_(torch.randn(p.shape, generator=g, device=device) * scale)


def count_parameters(spec: ModelSpec) -> int:
    """Parameters of the model the executor builds (equals ModelSpec.total_params() for dense models)."""
    h = spec.hidden_size
    norm = (2 if spec.norm_bias else 1) * h
    total = spec.embedding_params() + (0 if spec.tied_embeddings else spec.embedding_params()) + norm
    for i in range(spec.num_layers):
        attn = h * (spec.q_channels + 2 * spec.kv_channels) + spec.q_channels * h + 2 * norm
        if spec.moe is not None and spec.moe.is_moe_layer(i):
            m = spec.moe
            ffn = h * m.num_experts + (m.num_experts + m.num_shared_experts) * spec.ffn_matrices * h * m.expert_ffn_hidden_size
        else:
            ffn = spec.ffn_matrices * h * spec.ffn_hidden_size
        total += attn + ffn
    return total
