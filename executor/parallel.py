"""Parallelisms applied to the model stages, as a readable sequence of plain functions.

Order (each step's reason next to it in `build`):
  1. groups: one DeviceMesh ("pp", "dp", "cp", "tp") laid out by paraplan.placement, checked rank by
     rank against `rank_to_coords`; EP groups by MoE parallel folding (ep consecutive ranks of a
     stage's tp x cp x dp), as paraplan.placement.expert_group_layouts places them.
  2. model: this rank's pipeline stages, built on the meta device, experts cut to this EP rank's,
     then materialised and initialised deterministically (executor.model.init_parameters).
  3. TP / SP: `parallelize_module` (Colwise q/k/v/w1/w3, Rowwise o/w2, SequenceParallel norms,
     vocab-parallel embedding and head with `loss_parallel`). Before any data parallelism: FSDP2
     and `replicate` must see the TP DTensors to make them 2-D.
  4. recompute: torch.utils.checkpoint inside the blocks (full: the whole block; selective: the
     attention core), before FSDP so FSDP's hooks wrap the recomputed forward.
  5. data parallelism over dp x cp (CP ranks hold the same weights and see different tokens):
       ZeRO-0/1, pure DP             DistributedDataParallel (+ ShardedOptimizer for ZeRO-1)
       ZeRO-0/1 with TP, PP, CP, EP  replicate() (FSDP2's DDP; DDP itself breaks with TP and under
                                     most pipeline schedules) (+ ShardedOptimizer for ZeRO-1)
       ZeRO-2 / ZeRO-3               fully_shard(reshard_after_forward=False / True) per block, then
                                     the stage root
     MoE experts get their own unit over the expert-data-parallel group first (their gradients are
     then scaled by tp / ep: see `finish_gradients`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from executor.config import effective_zero_stage, num_stages, stage_layers, stage_rank, stages_of_rank
from executor.model import Stage, init_parameters
from executor.moe import MoE
from paraplan.placement import ORDER, rank_to_coords
from paraplan.specs import ModelSpec, Scenario


# ----------------------------------------------------------------------------------------------
# 1. Groups


@dataclass
class Groups:
    rank: int
    world: int
    coords: object
    mesh: object
    """DeviceMesh ("pp", "dp", "cp", "tp")."""
    tp_mesh: object
    dp_mesh: object
    """dp x cp flattened ("dp_cp"): the data-parallel group of dense weights."""
    pp_group: object
    tp_group: object
    dp_group: object
    ep_group: object = None
    ep_rank: int = 0
    edp_mesh: object = None
    """Expert-data-parallel mesh: ranks holding the same experts (tp x cp x dp / ep of them)."""
    embed_group: object = None
    """First and last pipeline stage, same (dp, cp, tp): the tied embedding's gradient is summed over it."""


def build_groups(sc: Scenario, device_type: str) -> Groups:
    from torch.distributed.device_mesh import init_device_mesh

    p = sc.plan
    rank, world = dist.get_rank(), dist.get_world_size()
    if p.world_size != world:
        raise RuntimeError(f"plan needs {p.world_size} ranks (tp*pp*cp*dp), the job has {world}")
    # paraplan.placement.ORDER lists the dims fastest first; a DeviceMesh lists them slowest first.
    names = tuple(reversed(ORDER))
    sizes = {"tp": p.tp, "cp": p.cp, "dp": p.dp, "pp": p.pp}
    mesh = init_device_mesh(device_type, tuple(sizes[d] for d in names), mesh_dim_names=names)
    for r in range(world):  # the executor's groups are the simulator's: checked, not assumed
        coords = rank_to_coords(r, p)
        if mesh.mesh[tuple(getattr(coords, d) for d in names)].item() != r:
            raise RuntimeError(f"DeviceMesh layout disagrees with paraplan.placement at rank {r}")
    coords = rank_to_coords(rank, p)
    dp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    g = Groups(rank=rank, world=world, coords=coords, mesh=mesh, tp_mesh=mesh["tp"], dp_mesh=dp_mesh,
               pp_group=mesh["pp"].get_group(), tp_group=mesh["tp"].get_group(), dp_group=dp_mesh.get_group())
    if sc.model.moe is not None:
        # MoE parallel folding, as paraplan.placement.expert_group_layouts places it: inside a
        # pipeline stage the tp x cp x dp ranks (tp fastest) are re-divided into ep x edp, ep
        # fastest, so an EP group is ep consecutive ranks (TP ranks first).
        block = p.tp * p.cp * p.dp
        ep_mesh = init_device_mesh(device_type, (p.pp, block // p.ep, p.ep), mesh_dim_names=("pp", "edp", "ep"))
        b = rank % block
        if ep_mesh.get_local_rank("ep") != b % p.ep or ep_mesh.get_local_rank("edp") != b // p.ep:
            raise RuntimeError(f"expert mesh disagrees with the MoE parallel folding at rank {rank}")
        g.ep_group, g.edp_mesh = ep_mesh["ep"].get_group(), ep_mesh["edp"]
        g.ep_rank = b % p.ep
    if sc.model.tied_embeddings and p.pp > 1:
        first, last = stage_rank(0, sc), stage_rank(num_stages(sc) - 1, sc)
        if first != last:
            for dp in range(p.dp):
                for cp in range(p.cp):
                    for tp in range(p.tp):
                        ranks = [int(mesh.mesh[pp, dp, cp, tp]) for pp in (first, last)]
                        pg = dist.new_group(ranks)
                        if rank in ranks:
                            g.embed_group = pg
    return g


# ----------------------------------------------------------------------------------------------
# 2. Pipeline stages


def padded_vocab(spec: ModelSpec, tp: int) -> ModelSpec:
    """Vocabulary padded to a multiple of tp (Megatron pads too), so the vocab-parallel head splits evenly."""
    v = -(-spec.vocab_size // tp) * tp
    return spec if v == spec.vocab_size else dataclasses.replace(spec, vocab_size=v)


def build_stages(sc: Scenario, g: Groups, device: torch.device, act_dtype: torch.dtype) -> list[tuple[int, Stage]]:
    spec = padded_vocab(sc.model, sc.plan.tp)
    layers, n = stage_layers(sc), num_stages(sc)
    out = []
    for s in stages_of_rank(g.coords.pp, sc):
        with torch.device("meta"):
            stage = Stage(spec, layers[s], first=s == 0, last=s == n - 1, act_dtype=act_dtype)
        for block in stage.layers.values():
            if isinstance(block.ffn, MoE) and sc.plan.ep > 1:
                block.ffn.shard_experts(g.ep_group, sc.plan.ep, g.ep_rank)
        stage.to_empty(device=device)
        if stage.embed is not None and stage.head is not None and spec.tied_embeddings:
            stage.head.weight = stage.embed.weight
        e_local = spec.moe.num_experts // sc.plan.ep if spec.moe else 0
        init_parameters(stage, sc.run.seed, expert_offset=g.ep_rank * e_local)
        stage.set_positions(local_positions(sc, g, device))
        out.append((s, stage))
    return out


def local_positions(sc: Scenario, g: Groups, device) -> torch.Tensor:
    """Sequence positions this rank holds: all, or under CP the load-balanced chunks c and 2cp-1-c
    of 2cp equal chunks (Megatron-Core's causal load balancing)."""
    s, cp = sc.training.seq_length, sc.plan.cp
    if cp == 1:
        return torch.arange(s, device=device)
    chunk, c = s // (2 * cp), g.coords.cp
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk), torch.arange((2 * cp - 1 - c) * chunk, (2 * cp - c) * chunk)]).to(device)


# ----------------------------------------------------------------------------------------------
# 3. Tensor and sequence parallelism


def apply_tp(stage: Stage, sc: Scenario, g: Groups) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    sp = sc.plan.sequence_parallel
    hidden = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    plan = {}
    if stage.embed is not None:
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=hidden)
    if stage.head is not None:
        if sp:
            plan["norm"] = SequenceParallel()
        # logits stay sharded over the vocabulary; the loss is computed under loss_parallel()
        plan["head"] = ColwiseParallel(input_layouts=hidden, output_layouts=Shard(-1), use_local_output=True)
    for i, block in stage.layers.items():
        pre = f"layers.{i}"
        if sp:
            plan[f"{pre}.attn_norm"] = SequenceParallel()
            plan[f"{pre}.ffn_norm"] = SequenceParallel()
            plan[f"{pre}.attn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for name in ("wq", "wk", "wv"):
            plan[f"{pre}.attn.{name}"] = ColwiseParallel()
        plan[f"{pre}.attn.wo"] = RowwiseParallel(output_layouts=hidden)
        if isinstance(block.ffn, MoE):
            # Experts are not TP-sharded (expert_tp = 1): under SP (required with MoE, as in
            # Megatron-Core) each TP rank routes the tokens of its sequence shard, so for the MoE
            # layer TP ranks are like data-parallel ranks.
            plan[f"{pre}.ffn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                                    use_local_output=True)
            continue
        if sp:
            plan[f"{pre}.ffn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan[f"{pre}.ffn.w1"] = ColwiseParallel()
        if block.ffn.w3 is not None:
            plan[f"{pre}.ffn.w3"] = ColwiseParallel()
        plan[f"{pre}.ffn.w2"] = RowwiseParallel(output_layouts=hidden)
    # every rank initialised the full tensors identically: take the local chunk, no broadcast
    parallelize_module(stage, g.tp_mesh, plan, src_data_rank=None)
    if stage.embed is not None and stage.head is not None and sc.model.tied_embeddings:
        stage.head.weight = stage.embed.weight  # both Shard(0) over the vocabulary: re-tie the DTensors


# ----------------------------------------------------------------------------------------------
# 5. Data parallelism


def dp_style(sc: Scenario) -> str:
    """"none", "ddp", "replicate" or "fsdp" for this plan."""
    p = sc.plan
    if p.dp * p.cp == 1:
        return "none"
    if effective_zero_stage(p) >= 2:
        return "fsdp"
    if p.tp == 1 and p.pp == 1 and p.ep == 1:
        return "ddp"  # MoE too: with ep = 1 and no TP the experts are ordinary replicated weights
    return "replicate"


def _bf16_all_reduce(group, bucket):
    """DDP communication hook: all-reduce the bucket in bf16 and average it back into the fp32
    gradients (DDP keeps fp32 gradients under autocast). The behaviour of PyTorch's
    bf16_compress_hook, which refuses backends other than NCCL and XCCL; this one runs on gloo too."""
    buffer = bucket.buffer()
    reduced = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(reduced, group=group, async_op=True).get_future()

    def back_to_fp32(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(back_to_fp32)


def apply_dp(stages: list[Stage], sc: Scenario, g: Groups, mp_policy) -> list[nn.Module]:
    """Wrap each stage for data parallelism; returns the modules to run (a DDP wrapper or the stage)."""
    from torch.distributed.fsdp import fully_shard

    style = dp_style(sc)
    if style == "none":  # experts replicated over TP ranks are averaged in finish_gradients
        return list(stages)
    if style == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = [DDP(st, process_group=g.dp_group) for st in stages]
        if mp_policy.reduce_dtype == torch.bfloat16:
            for ddp in wrapped:
                ddp.register_comm_hook(g.dp_group, _bf16_all_reduce)
        return wrapped
    if style == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate

        def wrap(module, mesh, _reshard):
            replicate(module, mesh=mesh, mp_policy=mp_policy)
    else:
        def wrap(module, mesh, reshard):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    zero3 = effective_zero_stage(sc.plan) == 3
    for stage in stages:
        for block in stage.layers.values():
            # experts differ across an EP group: their own unit over the expert-data-parallel
            # ranks keeps them out of the block's (a one-rank unit when ep spans the whole stage)
            if isinstance(block.ffn, MoE):
                wrap(block.ffn.experts, g.edp_mesh, zero3)
            wrap(block, g.dp_mesh, zero3)
        # the root unit (embedding, final norm, head) is needed right after the last block's
        # forward and at the start of backward: keep it unsharded in between
        wrap(stage, g.dp_mesh, False)
    return list(stages)


@torch.no_grad()
def finish_gradients(stages: list[Stage], sc: Scenario, g: Groups) -> None:
    """What the data-parallel wrappers do not do, after every gradient reduction has finished:

    - The router and shared experts under TP + SP saw only their TP rank's tokens: sum over TP.
    - Experts: the all-to-all's backward already summed the contributions of the EP group's
      tokens, and the expert-data-parallel reduction averaged over tp x cp x dp / ep ranks; the
      loss is an average over the dp x cp ranks only (TP ranks share one loss), so scale by tp / ep.
      With dp x cp = 1 no wrapper reduces them (a nested replicate unit under an unwrapped stage
      root breaks torch's split-backward pipeline schedules): average over the tp / ep ranks here.
    - A tied embedding split over the first and last pipeline stage: sum the two gradients.
    """
    from torch.distributed.tensor import DTensor

    def local(t):
        return t._local_tensor if isinstance(t, DTensor) else t

    moes = [b.ffn for st in stages for b in st.layers.values() if isinstance(b.ffn, MoE)]
    tp, ep = sc.plan.tp, sc.plan.ep
    if tp > 1:
        partial = [local(p.grad) for m in moes for name, p in m.named_parameters()
                   if p.grad is not None and not name.startswith("experts.")]
        _all_reduce_flat(partial, g.tp_group)
    if dp_style(sc) == "none" and moes and g.edp_mesh.size() > 1:
        replicas = [local(p.grad) for m in moes for p in m.experts.parameters() if p.grad is not None]
        _all_reduce_flat(replicas, g.edp_mesh.get_group())
        for t in replicas:
            t.div_(g.edp_mesh.size())
    if tp != ep:
        for m in moes:
            for p in m.experts.parameters():
                if p.grad is not None:
                    local(p.grad).mul_(tp / ep)
    if sc.model.tied_embeddings and sc.plan.pp > 1:
        tied = [st.embed.weight for st in stages if st.embed is not None] + \
               [st.head.weight for st in stages if st.head is not None]
        for p in tied:  # a vocab-parallel embedding's gradient can come back replicated: shard it like its weight
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        if g.embed_group is not None:
            _all_reduce_flat([local(tied[0].grad)], g.embed_group)
        elif len(tied) == 2:  # both on this rank (V-shaped schedules)
            total = local(tied[0].grad) + local(tied[1].grad)
            local(tied[0].grad).copy_(total)
            local(tied[1].grad).copy_(total)


def _all_reduce_flat(tensors: list[torch.Tensor], group) -> None:
    if not tensors:
        return
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    for t, new in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(new)
