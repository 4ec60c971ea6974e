"""The rank placement: which (tp, cp, dp, pp) coordinates a global rank holds.

One function for the simulator (which link tier a group crosses) and the executor (which process
groups to build), so the two cannot disagree. The order is Megatron-Core's default
`tp-cp-ep-dp-pp` (megatron/core/parallel_state.py, RankGenerator): tensor parallel varies
fastest, so a TP group sits on consecutive ranks inside a node, and pipeline parallel varies
slowest, so stages are spread across nodes. Expert layers re-divide a stage's tp x cp x dp ranks
into expert_tp x ep x expert-data-parallel, expert_tp fastest (MoE parallel folding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from paraplan.specs import PlanSpec

ORDER = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True, kw_only=True)
class Coords:
    tp: int
    cp: int
    dp: int
    pp: int


def _sizes(plan: PlanSpec) -> dict[str, int]:
    return {"tp": plan.tp, "cp": plan.cp, "dp": plan.dp, "pp": plan.pp}


def rank_to_coords(rank: int, plan: PlanSpec) -> Coords:
    sizes = _sizes(plan)
    out = {}
    for dim in ORDER:
        out[dim] = rank % sizes[dim]
        rank //= sizes[dim]
    return Coords(**out)


def coords_to_rank(coords: Coords, plan: PlanSpec) -> int:
    sizes = _sizes(plan)
    rank, stride = 0, 1
    for dim in ORDER:
        rank += getattr(coords, dim) * stride
        stride *= sizes[dim]
    return rank


def group_ranks(rank: int, dims: tuple[str, ...], plan: PlanSpec) -> list[int]:
    """Global ranks of the group along `dims` (e.g. ("dp",) or ("cp", "dp")) that contains `rank`:
    its coordinates along `dims` take every value, the others stay `rank`'s."""
    sizes, strides, stride = _sizes(plan), {}, 1
    for dim in ORDER:
        strides[dim] = stride
        stride *= sizes[dim]
    dims = tuple(dict.fromkeys(dims))
    base = rank - sum((rank // strides[dim]) % sizes[dim] * strides[dim] for dim in dims)
    ranks = [base]
    for dim in dims:
        ranks = [r + i * strides[dim] for r in ranks for i in range(sizes[dim])]
    return sorted(ranks)


@dataclass(frozen=True, kw_only=True)
class GroupLayout:
    """How a communication group sits on the nodes: what the network model needs to cost it."""

    size: int
    ranks_per_node: int
    """Members of this group on the node that holds the fewest of them: what a ring's crossing of
    that node can draw on, ranks_per_node NIC shares (the same on every node where the group is
    spread evenly)."""
    num_nodes: int
    crosses_leaf: bool | None = None
    """Whether the group's nodes sit under more than one leaf switch (its traffic then crosses the
    spine), read off the placement where the leaf size was given; None: not placed, the network
    model judges by the node count."""
    leaf_share: float | None = None
    """For a pipeline link: the share of a leaf's GPUs whose send over this link crosses to another
    leaf (all links send at about the same time), which sets how far the spine's oversubscription
    slows it; None: the network model's rule for the kind of collective."""


def _layout_at(residue: int, offsets: list[int], gpus_per_node: int) -> GroupLayout:
    """Layout of the group whose members sit at rank base + offset, base = residue (mod a node):
    shifting the base by whole nodes shifts every member's node alike, so the residue decides."""
    nodes: dict[int, int] = {}
    for off in offsets:
        node = (residue + off) // gpus_per_node
        nodes[node] = nodes.get(node, 0) + 1
    return GroupLayout(size=len(offsets), ranks_per_node=min(nodes.values()), num_nodes=len(nodes))


def _slowest_layout(others: list[tuple[int, int]], offsets: list[int], gpus_per_node: int,
                    nodes_per_leaf: int | None = None) -> GroupLayout:
    """Of the layouts the groups take (their bases the sums over `others`, see _residues), the one
    whose collectives take longest (they all run at once, so the step waits on it): crossing nodes
    first, then the fewest members on one node (the smallest share of NICs a ring crossing gets),
    then the most nodes. With `nodes_per_leaf`, crosses_leaf says whether any group's members sit
    under two leaves (leaves are runs of consecutive ranks, so its first and last member tell)."""
    layouts = {_layout_at(r, offsets, gpus_per_node) for r in _residues(others, gpus_per_node)}
    worst = max(layouts, key=lambda g: (g.num_nodes > 1, -g.ranks_per_node, g.num_nodes))
    if nodes_per_leaf is None:
        return worst
    leaf = gpus_per_node * nodes_per_leaf
    lo, hi = min(offsets), max(offsets)
    return replace(worst, crosses_leaf=any(_straddles(r + lo, r + hi, leaf) for r in _residues(others, leaf)))


def _straddles(first: int, last: int, unit: int) -> bool:
    """Whether ranks first..last (consecutive runs of `unit` ranks: a node's, a leaf's) lie in more
    than one unit."""
    return first // unit != last // unit


def _pairs_across(a: int, block: int, d: int, unit: int) -> int:
    """How many of the pairs (a + j, a + j + d), j < block, have their ranks in different runs of
    `unit` ranks: j with a + j < b <= a + j + d for some boundary b (a multiple of unit); each
    boundary's j form an interval, and the union of those intervals is counted."""
    count, reach = 0, 0  # reach: the first j not yet counted
    for b in range((a // unit + 1) * unit, a + block + d, unit):
        lo, hi = max(b - d - a, reach, 0), min(b - a, block)  # j in [lo, hi)
        if hi > lo:
            count += hi - lo
            reach = hi
    return count


def _residues(strides_sizes: list[tuple[int, int]], period: int) -> set[int]:
    """Group bases mod `period` (a node's ranks, or a leaf's): every sum of i x stride over the
    (stride, size) dimensions the groups differ in, i in range(size); at most `period` values, so
    cheap at any world size. A dimension's multiples of its stride repeat after period / gcd(stride,
    period) steps, so no more are taken."""
    out = {0}
    for stride, size in strides_sizes:
        steps = {(i * stride) % period for i in range(min(size, period // math.gcd(stride, period)))}
        if len(steps) > 1:
            out = {(r + x) % period for r in out for x in steps}
    return out


def group_layout(dims: tuple[str, ...], plan: PlanSpec, gpus_per_node: int, *,
                 nodes_per_leaf: int | None = None) -> GroupLayout:
    """Layout of the groups along `dims`, the slowest where they sit differently. Every group is a
    translate of rank 0's in rank space, but not in node space when a stage's block or the groups
    in it straddle nodes unevenly (tp 2 x dp 3 x pp 4 on 8-GPU nodes: stage 0's DP groups sit in
    node 0, stage 1's take 1 + 2 ranks of nodes 0 and 1), nor in leaf space when a group straddles
    a leaf boundary (`nodes_per_leaf` given: crosses_leaf is set)."""
    offsets = group_ranks(0, dims, plan)
    sizes, stride, others = _sizes(plan), 1, []
    for dim in ORDER:
        if dim not in dims:
            others.append((stride, sizes[dim]))
        stride *= sizes[dim]
    return _slowest_layout(others, offsets, gpus_per_node, nodes_per_leaf)


def cp_split(plan: PlanSpec, model, gpus_per_node: int) -> tuple[int, int]:
    """(a2a, ring): how many CP ranks exchange heads by all-to-all and how many pass K/V round a
    ring, a2a x ring = cp, by plan.cp_comm_type: p2p and all_gather (1, cp), a2a (cp, 1), a2a+p2p
    (cp_a2a_size, cp / cp_a2a_size), Transformer Engine's hierarchical groups. Without
    cp_a2a_size, the largest divisor of cp whose all-to-all group (CP ranks tp apart) stays inside a
    node, the NVLink domain where all-to-all is cheap, and splits each TP rank's query and key/value
    heads, as TE's all-to-all needs."""
    cp = plan.cp
    if plan.cp_comm_type == "a2a":
        return cp, 1
    if plan.cp_comm_type != "a2a+p2p":
        return 1, cp
    if plan.cp_a2a_size is not None:
        return plan.cp_a2a_size, cp // plan.cp_a2a_size
    heads = (model.num_attention_heads // plan.tp, model.num_kv_heads // plan.tp)
    # 1 always qualifies (TE then runs the ring alone), also where tp itself spans nodes
    a2a = max(d for d in range(1, cp + 1) if cp % d == 0 and all(h % d == 0 for h in heads)
              and (d == 1 or (plan.tp * d <= gpus_per_node and gpus_per_node % (plan.tp * d) == 0)))
    return a2a, cp // a2a


def cp_group_layouts(plan: PlanSpec, a2a: int, gpus_per_node: int, *,
                     nodes_per_leaf: int | None = None) -> tuple[GroupLayout, GroupLayout]:
    """(all-to-all, ring) group layouts of hierarchical context parallelism with `a2a` ranks in
    each all-to-all group: TE's a2a groups are consecutive CP ranks (CP ranks sit tp apart), its
    ring joins the ranks a2a CP ranks apart (Megatron-Core create_hierarchical_groups)."""
    tp, cp, block = plan.tp, plan.cp, plan.tp * plan.cp * plan.dp
    ring = cp // a2a
    tail = [(tp * cp, plan.dp), (block, plan.pp)]
    inner = _slowest_layout([(1, tp), (tp * a2a, ring), *tail], [i * tp for i in range(a2a)], gpus_per_node,
                            nodes_per_leaf)
    outer = _slowest_layout([(1, tp), (tp, a2a), *tail], [j * tp * a2a for j in range(ring)], gpus_per_node,
                            nodes_per_leaf)
    return inner, outer


def pp_hop_layouts(plan: PlanSpec, gpus_per_node: int, *, nodes_per_leaf: int | None = None) -> list[GroupLayout]:
    """Layout of each pipeline link: entry s joins stage s and stage (s + 1) % pp, so the last
    entry is the wrap-around from the last stage to the first (interleaved schedules' chunk
    boundary, the tied-embedding all-reduce). A stage's ranks are a block of tp x cp x dp
    consecutive ranks (pp varies slowest), and each rank sends to the rank with the same
    coordinates one stage on; a link leaves the node if any of those pairs does. Where a block is
    smaller than a node, some links stay inside one (tp 2 x dp 2 on 8-GPU nodes: stages 0-1 share
    node 0, the hop 1 -> 2 crosses to node 1). With `nodes_per_leaf`, a link crosses the spine if
    any pair sits under two leaves (tp 8 x dp 16 on 32-node leaves: stages 0 and 1 share leaf 0,
    the hop 1 -> 2 leaves it)."""
    if plan.pp == 1:
        return [GroupLayout(size=1, ranks_per_node=1, num_nodes=1)]
    block = plan.tp * plan.cp * plan.dp
    out = []
    for s in range(plan.pp):
        nxt = (s + 1) % plan.pp
        # rank a + j pairs with rank a + j + d for j < block: some pair straddles a node (leaf)
        # boundary exactly when one lies in (a, a + block - 1 + d], i.e. when ranks a and
        # a + block - 1 + d sit in different nodes (leaves)
        a, d = min(s, nxt) * block, abs(nxt - s) * block
        crosses = _straddles(a, a + block - 1 + d, gpus_per_node)
        leaf = share = None
        if nodes_per_leaf is not None:
            unit = gpus_per_node * nodes_per_leaf
            leaf = _straddles(a, a + block - 1 + d, unit)
            share = min(1.0, _pairs_across(a, block, d, unit) / unit) if leaf else None
        out.append(GroupLayout(size=2, ranks_per_node=1 if crosses else 2, num_nodes=2 if crosses else 1,
                               crosses_leaf=leaf, leaf_share=share))
    return out


def expert_group_layouts(plan: PlanSpec, gpus_per_node: int, *,
                         nodes_per_leaf: int | None = None) -> tuple[GroupLayout, GroupLayout, GroupLayout]:
    """(expert-TP, expert-parallel, expert-data-parallel) group layouts of MoE layers.

    Megatron-Core "MoE parallel folding" (Liu et al. 2025, megatron/core/parallel_state.py,
    expert RankGenerator order tp-ep-dp): inside one pipeline stage the tp x cp x dp ranks that
    attention uses are re-divided into expert_tp x ep x edp, expert_tp fastest. With expert_tp = 1
    an EP group is ep consecutive ranks, so EP 8 stays in an 8-GPU node and EP 32 spans 4 nodes.
    """
    etp, ep = plan.expert_tp, plan.ep
    edp = plan.tp * plan.cp * plan.dp // (etp * ep)
    return (_expert_layout(plan, 1, etp, gpus_per_node, nodes_per_leaf),
            _expert_layout(plan, etp, ep, gpus_per_node, nodes_per_leaf),
            _expert_layout(plan, etp * ep, edp, gpus_per_node, nodes_per_leaf))


def expert_dispatch_layout(plan: PlanSpec, gpus_per_node: int, *, nodes_per_leaf: int | None = None) -> GroupLayout:
    """Layout of the group an MoE layer's token dispatcher exchanges tokens over: the expert-parallel
    group for the all-to-all dispatcher, the expert-TP x EP group for DeepEP (Megatron-Core's
    MoEFlexTokenDispatcher runs DeepEP over tp_ep_group, a token sent to every expert-TP rank of its
    experts, with no expert-TP gather or scatter of its own). The same group when expert_tp is 1."""
    if plan.moe_dispatcher == "deepep":
        return _expert_layout(plan, 1, plan.expert_tp * plan.ep, gpus_per_node, nodes_per_leaf)
    return _expert_layout(plan, plan.expert_tp, plan.ep, gpus_per_node, nodes_per_leaf)


def _expert_layout(plan: PlanSpec, stride: int, size: int, gpus_per_node: int,
                   nodes_per_leaf: int | None) -> GroupLayout:
    """Layout of the expert groups of `size` members `stride` ranks apart inside each stage's block:
    they start at the other expert coordinates' offsets, blocks at s x block (one per stage); the
    slowest of them sets the pace."""
    block = plan.tp * plan.cp * plan.dp
    others = [(1, stride)] + [(stride * size, block // (stride * size)), (block, plan.pp)]
    offsets = [i * stride for i in range(size)]
    return _slowest_layout(others, offsets, gpus_per_node, nodes_per_leaf)
