"""Mixture-of-experts FFN block: router, token dispatch all-to-all, grouped expert GEMMs, combine
all-to-all, shared experts; routing imbalance from a seeded draw.

Megatron-Core's MoE layer (megatron/core/transformer/moe/, the alltoall token dispatcher): each
rank routes its tokens (the sequence-parallel shard when tp > 1) to top_k experts, permutes them by
expert, exchanges them with an all-to-all-v over the EP group, runs its local experts as a grouped
GEMM, and returns the results with a second all-to-all-v. The rank whose experts got the most
tokens sets the pace of the layer: its expert GEMMs are the longest and it receives the most bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from hwmodels.compute import memory_bound_time
from hwmodels.network import collective_time, overlapped, spread_hop
from paraplan.placement import GroupLayout
from simulator.cost import Cost
from simulator.workload import (activation_time, ffn_norm_residual, fp8_cast_time, linear_time, mlp_linear_shapes,
                                mlp_transfers, outside_fp8, tp_exposed, weight_grad_time)


@dataclass(frozen=True)
class RoutingDraw:
    """Token copies per expert in one EP group for one microbatch, laid out (ep ranks, local experts)."""

    expert_tokens: np.ndarray
    sent_per_rank: float
    """Token copies each rank dispatches (its tokens x top_k, less the copies its router dropped at
    capacity): the all-to-all send side."""
    dropped: float
    """Copies over an expert's capacity (capacity_factor), dropped as in GShard/Switch."""

    @property
    def rank_loads(self) -> np.ndarray:
        return self.expert_tokens.sum(axis=1)

    @property
    def busiest_rank(self) -> int:
        return int(np.argmax(self.rank_loads))

    @property
    def busiest_tokens(self) -> list[float]:
        """Token copies per local expert of the busiest rank, as Python floats: the costs built
        from them feed the engine's arithmetic, which NumPy scalars would slow several-fold."""
        return self.expert_tokens[self.busiest_rank].tolist()

    @property
    def imbalance(self) -> float:
        """Most loaded rank's tokens over the mean (1.0 = balanced)."""
        loads = self.rank_loads
        return float(loads.max() / loads.mean()) if loads.mean() > 0 else 1.0


def expert_probabilities(moe, rng: np.random.Generator) -> np.ndarray:
    """Share of routed token copies each expert receives.
    uniform: 1/E (what a load-balancing loss aims for);
    zipf: proportional to 1/(rank+1)^s (Zipf's law over expert popularity), with the popular
    experts placed on EP ranks at random by the seeded generator;
    histogram: a measured router histogram, experts in order (Megatron places expert i on EP rank
    i // (E/ep))."""
    e = moe.num_experts
    r = moe.routing
    if r.distribution == "uniform":
        return np.full(e, 1.0 / e)
    if r.distribution == "zipf":
        p = np.exp(-r.s * np.log(np.arange(1, e + 1)))  # 1/(rank+1)^s; a steep s underflows to 0, not inf
        return rng.permutation(cap_shares(p / p.sum(), 1.0 / moe.top_k))
    hist = np.asarray(r.tokens_per_expert, dtype=float)
    return cap_shares(hist / hist.sum(), 1.0 / moe.top_k)


def cap_shares(p: np.ndarray, cap: float) -> np.ndarray:
    """Shares `p` (summing to 1) with none above `cap`, the excess spread over the others in
    proportion to their shares. Top-k routing sends a token to k distinct experts (Shazeer et al.
    2017, noisy top-k gating), so an expert receives at most one copy per token: at most 1/k of the
    copies. Capping k x p at 1 and spreading the rest proportionally is the usual treatment of
    certainty units in probability-proportional-to-size sampling without replacement (Sarndal,
    Swensson and Wretman, "Model Assisted Survey Sampling", 1992, Sec. 3.6)."""
    p = np.asarray(p, dtype=float).copy()
    while True:
        over = p > cap * (1 + 1e-12)
        if not over.any():
            return p
        excess = float((p[over] - cap).sum())
        p[over] = cap
        free = p < cap
        if p[free].sum() <= 0:  # nothing left to take the excess (fewer than 1/cap experts in use)
            return p
        p[free] += excess * p[free] / p[free].sum()


def draw_routing(moe, ep: int, tokens_per_rank: float, *, balanced: bool = False) -> RoutingDraw:
    """Per-expert token copies for one microbatch of one EP group: tokens_per_rank x top_k copies
    from each of the ep ranks, drawn from the routing distribution as a multinomial with the
    scenario's seed (deterministic). `balanced` gives the exact expectation of a uniform router,
    the reference the imbalance is measured against."""
    if moe.capacity_factor is not None:
        return _draw_with_capacity(moe, ep, tokens_per_rank, balanced)
    e, k = moe.num_experts, moe.top_k
    total = tokens_per_rank * k * ep
    if balanced:
        counts = np.full(e, total / e)
    else:
        rng = np.random.default_rng(moe.routing.seed)
        counts = rng.multinomial(int(round(total)), expert_probabilities(moe, rng)).astype(float)
        # sampling noise can push a capped expert past one copy per token; keep it at the cap
        counts = cap_shares(counts / counts.sum(), 1.0 / k) * counts.sum()
    return RoutingDraw(counts.reshape(ep, e // ep), tokens_per_rank * k, 0.0)


def _draw_with_capacity(moe, ep: int, tokens_per_rank: float, balanced: bool) -> RoutingDraw:
    """The draw under an expert capacity, applied where Megatron-Core applies it: in each rank's
    router, before the dispatch. Expert capacity = capacity_factor x tokens x top_k / experts
    (Fedus et al. 2021, Eq. 3) of the rank's own tokens (moe_utils.get_capacity on the rank's
    num_tokens x topk; TopKRouter.apply_token_drop masks the copies over it out of the routing map),
    so a dropped copy is never sent: the ranks dispatch the kept copies only (sent_per_rank is
    their mean), and a rank's copies are drawn on their own, not pooled over the EP group."""
    e, k = moe.num_experts, moe.top_k
    per_rank = tokens_per_rank * k
    if balanced:
        rows = np.full((ep, e), per_rank / e)
    else:
        rng = np.random.default_rng(moe.routing.seed)
        probs = expert_probabilities(moe, rng)
        rows = rng.multinomial(int(round(per_rank)), probs, size=ep).astype(float)
        rows = np.stack([cap_shares(r / r.sum(), 1.0 / k) * r.sum() for r in rows])
    kept = np.minimum(rows, math.ceil(moe.capacity_factor * per_rank / e))
    counts = kept.sum(axis=0)
    return RoutingDraw(counts.reshape(ep, e // ep), float(counts.sum()) / ep, float((rows - kept).sum()))


def routed_tokens_per_rank(ctx) -> float:
    """Tokens a rank routes: its sequence-parallel shard when tp > 1 (Megatron-Core requires
    sequence parallelism for MoE with TP), else all its tokens."""
    return ctx.tokens / ctx.plan.tp if ctx.plan.tp > 1 else ctx.tokens


@dataclass(frozen=True)
class MoEBlock:
    """The FFN of an MoE layer for one rank (the busiest of its EP group), forward and backward.
    Call it as the `ffn` of simulator.workload.layer_forward / layer_backward."""

    forward: Cost
    backward: Cost
    weight_grad: float = 0.0
    """Seconds of the backward's weight-gradient GEMMs (router, experts, shared experts): the W
    pass of a split-backward schedule."""
    expert_activation: float = 0.0
    """Seconds of the routed experts' activation function in the forward (what moe_act recompute
    re-runs)."""
    module_forward: Cost = field(default_factory=Cost)
    """The MoE module's forward without the norm and residual around it (what moe recompute
    re-runs)."""
    shared_forward: Cost = field(default_factory=Cost)
    """The shared experts' forward, compute and TP collectives (what shared_experts recompute
    re-runs)."""
    forward_phases: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    backward_phases: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """(dispatch, experts, combine, after the combine) seconds of the module's forward and of its
    backward, as combined 1F1B schedules a layer's parts (simulator.combined): the dispatch and
    combine exchanges (all-to-all, expert-TP gather and scatter), the expert and shared-expert
    compute between them with the sorts by local expert, and the unpermutation after; the rest of
    the block (the norm, router and permutation before the dispatch) runs with the attention."""

    def __call__(self, ctx, backward: bool) -> Cost:
        return (self.backward if backward else self.forward).scaled(1.0)


def moe_block(ctx, draw: RoutingDraw, ep_layout, etp_layout, *, overlap_shared: bool) -> MoEBlock:
    """The MoE module's costs, plus the post-attention norm and residual around it for the FFN
    sublayer's forward and backward; `ep_layout` is the group the dispatcher exchanges tokens over
    (paraplan.placement.expert_dispatch_layout: under DeepEP the expert-TP x EP group)."""
    module, fwd_phases = _moe_cost(ctx, draw, ep_layout, etp_layout, overlap_shared, backward=False)
    backward, bwd_phases = _moe_cost(ctx, draw, ep_layout, etp_layout, overlap_shared, backward=True)
    return MoEBlock(
        forward=module.scaled(1.0).add("compute", ffn_norm_residual(ctx, False)),
        backward=backward.add("compute", ffn_norm_residual(ctx, True)),
        forward_phases=fwd_phases, backward_phases=bwd_phases,
        module_forward=module,
        weight_grad=_moe_weight_grad(ctx, draw),
        # one kernel over all local experts' tokens, as the forward runs it (expert_compute_time)
        expert_activation=_expert_activation(ctx, sum(n * ctx.plan.expert_tp for n in draw.busiest_tokens if n > 0),
                                             False),
        shared_forward=_shared_forward(ctx),
    )


def _moe_weight_grad(ctx, draw: RoutingDraw) -> float:
    """dW = x^T dY of the router, of each local expert's projections at the tokens it received
    (the busiest rank) and of the shared experts: the weight-gradient halves of the backward GEMMs
    that `_gemm(..., backward=True)` prices."""
    m, etp = ctx.model, ctx.plan.expert_tp
    total = _wgrad(outside_fp8(ctx), routed_tokens_per_rank(ctx), m.hidden_size, m.moe.num_experts)
    for n in draw.busiest_tokens:
        if n > 0:
            total += sum(_wgrad(ctx, n * etp, k, w) for k, w in _expert_linears(ctx))
    if m.moe.num_shared_experts:
        total += sum(_wgrad(ctx, ctx.tokens, k, w) for k, w in _shared_linears(ctx))
    return total


def _gemm(ctx, m: float, k: int, n: int, backward: bool, casts: bool = True) -> float:
    """A linear layer (workload.linear_time) on a whole number of the m tokens, x (m, k) @ W (k, n);
    backward is dgrad plus wgrad. Under fp8 with the cast of its 16-bit operand (x forward, dY
    backward) unless `casts` is False (a grouped GEMM's experts are cast together:
    expert_compute_time)."""
    return linear_time(ctx, k, n, backward, _rows(m), cast_input=casts, cast_grad=casts)


def _wgrad(ctx, m: float, k: int, n: int) -> float:
    """dW = x^T dY of that layer, a (k, m) x (m, n) GEMM, with its main-gradient accumulation."""
    return weight_grad_time(ctx, k, n, _rows(m))


def _rows(m: float) -> int:
    """Token counts are expected values; a GEMM gets a whole number of rows, at least one."""
    return max(1, int(round(m)))


def _expert_width(ctx) -> int:
    """One routed expert's intermediate on an expert-TP rank."""
    return ctx.model.moe.expert_ffn_hidden_size // ctx.plan.expert_tp


def _shared_width(ctx) -> int:
    """The shared experts' intermediate on a TP rank (one dense FFN of num_shared x expert width)."""
    return ctx.model.moe.num_shared_experts * ctx.model.moe.expert_ffn_hidden_size // ctx.plan.tp


def _expert_linears(ctx) -> list[tuple[int, int]]:
    return mlp_linear_shapes(ctx.model, _expert_width(ctx))


def _shared_linears(ctx) -> list[tuple[int, int]]:
    return mlp_linear_shapes(ctx.model, _shared_width(ctx))


def expert_compute_time(ctx, tokens_per_expert, backward: bool) -> float:
    """Grouped expert GEMMs of one rank: per local expert, up(+gate) then down projection on the
    tokens it received (a grouped GEMM runs each expert's problem at its own size); the activation
    runs once over all local experts' intermediates, and under fp8 each projection's operands are
    cast for all experts in one kernel (Megatron-Core TEGroupedMLP: activation_func on the whole
    fc1 output; Transformer Engine GroupedLinear casts its inputs with one multi-tensor quantize).
    With expert_tp each expert is column/row split etp ways and works on the etp ranks' tokens
    together."""
    etp = ctx.plan.expert_tp
    rows = [n * etp for n in tokens_per_expert if n > 0]
    if not rows:
        return 0.0
    linears = _expert_linears(ctx)
    total = sum(_gemm(ctx, n, k, w, backward, casts=False) for n in rows for k, w in linears)
    tokens = sum(_rows(n) for n in rows)
    total += sum(fp8_cast_time(ctx, tokens * (w if backward else k)) for k, w in linears)
    return total + _expert_activation(ctx, sum(rows), backward)


def _expert_activation(ctx, n: float, backward: bool) -> float:
    """The routed experts' activation over their intermediates for n tokens in all."""
    return activation_time(ctx, n, _expert_width(ctx), backward)


@lru_cache(maxsize=256)
def nodes_reached(experts: int, top_k: int, nodes: int, groups: int = 1, groups_per_token: int = 1) -> float:
    """Expected distinct nodes (or ranks) holding a token's top_k experts, each node holding an
    equal slice of consecutive experts, every expert equally likely.

    Without a group limit the experts are picked uniformly without replacement:
    N x (1 - C(E - E/N, k) / C(E, k)).

    Under group-limited routing (the experts in `groups` equal groups of consecutive experts, a
    token keeping `groups_per_token` of them: DeepSeek-V3's node-limited routing, arXiv 2412.19437
    Sec. 2.1.2, which with one group per node caps a token at groups_per_token nodes) the groups are
    ranked by the sum of their top (top_k / groups_per_token) scores, so a kept group nearly always
    holds some of the token's top_k: the count is that of Megatron-Core's rule
    (moe_utils.group_limited_topk) over routed_experts' seeded draw of independent scores."""
    if groups_per_token == groups:  # every group: no limit
        per_node = experts // nodes
        miss = math.comb(experts - per_node, top_k) / math.comb(experts, top_k)
        return nodes * (1.0 - miss)
    holders = np.sort(routed_experts(experts, top_k, groups, groups_per_token) // (experts // nodes), axis=1)
    return float(1 + (np.diff(holders, axis=1) != 0).sum(axis=1).mean())


ROUTER_DRAW_TOKENS = 4096
"""Tokens in routed_experts' draw: the mean distinct count it gives is within about 0.2% of the
expectation (a count's standard deviation is under 1, over 64, the draw's root)."""


@lru_cache(maxsize=16)
def routed_experts(experts: int, top_k: int, groups: int, groups_per_token: int) -> np.ndarray:
    """The experts (ROUTER_DRAW_TOKENS x top_k) Megatron-Core's group-limited router picks for tokens
    whose scores are independent draws, the same for every expert (balanced routing), from a fixed
    seed: DeepSeek-V3's sigmoid gate of normal logits (arXiv 2412.19437 Eq. 15); each group scored by
    the sum of its top (top_k // groups_per_token) scores, the best groups_per_token kept, the token's
    top_k taken among their experts (moe_utils.group_limited_topk). About 20 ms, once per model."""
    n, size = ROUTER_DRAW_TOKENS, experts // groups
    rng = np.random.default_rng(0)
    scores = 1.0 / (1.0 + np.exp(-rng.standard_normal((n, groups, size), dtype=np.float32)))
    per_group = max(1, top_k // groups_per_token)
    group_score = np.partition(scores, size - per_group, axis=2)[:, :, size - per_group:].sum(axis=2)
    kept = np.argpartition(-group_score, groups_per_token - 1, axis=1)[:, :groups_per_token]  # (n, g)
    pool = np.take_along_axis(scores, kept[:, :, None], axis=1).reshape(n, groups_per_token * size)
    best = np.argpartition(-pool, top_k - 1, axis=1)[:, :top_k]  # positions in the kept groups' pool
    picked = np.take_along_axis(kept, best // size, axis=1) * size + best % size
    picked.setflags(write=False)
    return picked


def deepep_time(ctx, routed: float, skew: float, ep_layout) -> float:
    """One DeepEP dispatch (or combine) across nodes (DeepSeek-V3 report, Sec. 3.2.2; DeepEP
    "normal" kernels): a token crosses the network once per destination node (to the GPU with the
    same local index there) and is forwarded over NVLink to that node's experts. Network bytes per
    rank: routed tokens x expected remote nodes reached x h. NVLink: every copy a GPU receives crosses
    NVLink once, sent directly by a peer in its node or forwarded by the peer that took it off the
    network, so the NVLink leg moves a token once per destination rank (DeepEP's is_token_in_rank:
    a rank receives each token once however many of its experts chose it, and expands it to those
    experts itself), as a one-node DeepEP dispatch would. The two overlap; `skew` scales both for
    the busiest rank's receive side."""
    m, b = ctx.model, ctx.act_bytes
    h, nodes = m.hidden_size, ep_layout.num_nodes
    e = m.moe
    remote_nodes = nodes_reached(e.num_experts, e.top_k, nodes, e.expert_groups, e.groups_per_token) \
        * (nodes - 1) / nodes
    net_bytes = routed * remote_nodes * h * b * skew
    # one network hop per destination node, each a point-to-point transfer of its share
    rdma = collective_time(ctx.network, "send_recv", net_bytes, spread_hop(ctx.network, ep_layout))
    ppn = ep_layout.ranks_per_node
    nvl_bytes = routed * m.moe.top_k * deepep_rank_share(ctx) * h * b * skew
    nvl = collective_time(ctx.network, "all_to_all", nvl_bytes, GroupLayout(size=ppn, ranks_per_node=ppn, num_nodes=1))
    return max(rdma, nvl)


def deepep_rank_share(ctx) -> float:
    """The copies DeepEP moves per token, as a fraction of its top_k: one per distinct destination
    rank, E[EP ranks reached] / top_k with the experts spread evenly over the EP ranks and picked
    uniformly (nodes_reached with ranks for nodes; Megatron-Core fused_a2a FusedDispatch builds
    is_token_in_rank with get_dispatch_layout, DeepEP Buffer.intranode_dispatch receives
    num_recv_tokens distinct tokens), times expert_tp: every expert-TP rank of a chosen expert
    receives the token (MoEFlexTokenDispatcher._initialize_metadata expands the routing map over
    the expert-TP ranks). Qwen3-235B, 128 experts top-8 on EP 8: 5.3 of 8."""
    e = ctx.model.moe
    reached = nodes_reached(e.num_experts, e.top_k, ctx.plan.ep, e.expert_groups, e.groups_per_token)
    return ctx.plan.expert_tp * reached / e.top_k


def _shared_experts(ctx, backward: bool) -> tuple[float, float, float]:
    """(compute of the up projection and the activation, compute of the down projection, TP
    communication) of the shared experts: a dense FFN of num_shared x expert width, tensor-parallel
    like the dense MLP (all-gather in, reduce-scatter out under SP)."""
    if not ctx.model.moe.num_shared_experts:
        return 0.0, 0.0, 0.0
    shapes = [(k, w, ctx.tokens) for k, w in _shared_linears(ctx)]
    gemms = [_gemm(ctx, ctx.tokens, k, w, backward) for k, w, _ in shapes]
    # the shared experts are a dense MLP (Megatron-Core SharedExpertMLP), biased like the model's
    up = gemms[0] + activation_time(ctx, ctx.tokens, _shared_width(ctx), backward, bias=ctx.model.linear_bias)
    # Transformer Engine's userbuffers serve the attention and dense MLP GEMMs, not the shared experts'
    return up, gemms[1], tp_exposed(ctx, mlp_transfers(ctx), shapes, gemms, backward, userbuffers=False)


def _shared_forward(ctx) -> Cost:
    up, down, tp = _shared_experts(ctx, False)
    return Cost().add("compute", up + down).add("tp_comm", tp)


def _moe_cost(ctx, draw: RoutingDraw, ep_layout, etp_layout, overlap_shared: bool,
              backward: bool) -> tuple[Cost, tuple[float, float, float, float]]:
    """The MoE module's cost (router to unpermutation) and its (dispatch, experts, combine, after
    the combine) phases (MoEBlock.forward_phases)."""
    m, b = ctx.model, ctx.act_bytes
    h, experts = m.hidden_size, m.moe.num_experts
    routed = routed_tokens_per_rank(ctx)
    copies = draw.sent_per_rank
    busiest = draw.busiest_tokens
    load = sum(busiest)
    factor = 2 if backward else 1
    # Router: (tokens, h) x (h, E) logits, then softmax and top-k over fp32 logits (Megatron-Core
    # moe_utils.topk_softmax_with_capacity): the softmax reads the logits and writes the
    # probabilities, torch.topk reads them, 3 passes of tokens x E x 4 bytes; the backward's softmax
    # reads the probabilities and their gradient and writes the logits' (3 passes), after top-k's
    # backward scattered the selected gradients into a zeroed tokens x E tensor (about 2 more,
    # counted as 3: factor 2).
    router = _gemm(outside_fp8(ctx), routed, h, experts, backward) + memory_bound_time(ctx.gpu, factor * 3 * routed * experts * 4)
    # Permute and unpermute as Transformer Engine's fused kernels run them (Megatron-Core
    # --moe-permute-fusion; TE permutation.py): a permute reads each token once and writes one row
    # per copy, an unpermute reads the copies and writes each token's sum, and each one's backward is
    # the other's kernel on the gradients; the router's probabilities travel with the copies and
    # weigh them in the experts' activation, so the unpermute reads nothing more. The alltoall
    # dispatcher permutes the routed tokens before it sends them (token_dispatcher.py
    # MoEAlltoAllTokenDispatcher.dispatch_preprocess); DeepEP sends the tokens and the receiving
    # rank permutes the distinct tokens it received, one per source token and destination rank, into
    # its local experts' copies (MoEFlexTokenDispatcher.dispatch_postprocess).
    if ctx.plan.moe_dispatcher == "deepep":  # the expert-TP group's copies, from the distinct tokens received
        rows = load * ctx.plan.expert_tp + load * deepep_rank_share(ctx)
    else:
        rows = copies + routed
    permute = unpermute = memory_bound_time(ctx.gpu, rows * h * b)  # each direction, each kernel
    etp = ctx.plan.expert_tp
    sort = 0.0
    if ctx.plan.moe_dispatcher == "alltoall" and experts // ctx.plan.ep > 1:
        # the received tokens arrive grouped by source rank: Megatron-Core's alltoall dispatcher sorts
        # them by local expert after the exchange (and the expert-TP gather) and back before the
        # combine (token_dispatcher.py dispatch_postprocess "Permutation 2: Sort tokens by local
        # expert", combine_preprocess "Unpermutation 2", sort_chunks_by_idxs, whenever a rank holds
        # more than one expert), each a read and a write of the expert-TP group's received tokens
        sort = memory_bound_time(ctx.gpu, 2 * load * etp * h * b)  # its backward is the inverse sort
    experts_t = expert_compute_time(ctx, busiest, backward)
    # All-to-all-v: every rank sends copies x h; the busiest receives load x h. The exchange ends
    # when the largest of those has moved (dispatch and combine move the same bytes; backward the
    # gradients of both).
    a2a_bytes = max(copies, load) * h * b
    deepep = ctx.plan.moe_dispatcher == "deepep"
    if deepep and ep_layout.num_nodes > 1:
        # the tokens sent: top_k copies each (with drops, about the kept copies' share of them)
        a2a = deepep_time(ctx, copies / m.moe.top_k, max(1.0, load / copies), ep_layout)
    elif deepep:  # inside one node: each token once per destination rank
        a2a = collective_time(ctx.network, "all_to_all", a2a_bytes * deepep_rank_share(ctx), ep_layout)
    else:
        a2a = collective_time(ctx.network, "all_to_all", a2a_bytes, ep_layout)
    etp_comm = 0.0
    if etp_layout.size > 1 and not deepep:
        # expert-TP under the all-to-all dispatcher: gather the group's tokens in, reduce-scatter them
        # out (DeepEP reaches the expert-TP ranks in its own exchange: expert_dispatch_layout)
        etp_bytes = load * etp_layout.size * h * b
        etp_comm = (collective_time(ctx.network, "all_gather", etp_bytes, etp_layout)
                    + collective_time(ctx.network, "reduce_scatter", etp_bytes, etp_layout))
    up, down, shared_tp = _shared_experts(ctx, backward)
    shared = up + down
    dispatch = combine = a2a
    if overlap_shared:
        # Megatron --moe-shared-expert-overlap: the shared experts run on a stream of their own
        # (SharedExpertMLP.stream), the input's TP gather, the up projection and the activation
        # while the tokens are dispatched, the down projection and its TP reduce-scatter while
        # they are combined (token_dispatcher.py: linear_fc1_forward_and_act after the dispatch's
        # all-to-all, linear_fc2_forward and post_forward_comm after the combine's), each beside
        # its exchange on the SMs the exchange leaves; half the TP traffic goes with each (under
        # sequence parallelism the gather and the reduce-scatter move the same bytes)
        dispatch = overlapped(up + shared_tp / 2, a2a) - (up + shared_tp / 2)
        combine = overlapped(down + shared_tp / 2, a2a) - (down + shared_tp / 2)
    cost = Cost().add("compute", router + (permute + sort) + (unpermute + sort) + experts_t + shared)
    cost.add("ep_comm", dispatch + combine + etp_comm).add("tp_comm", shared_tp)
    if ep_layout.num_nodes > 1:
        cost.add_nic("ep_comm", 2 * a2a)  # network-bound: the NIC is busy for both exchanges
    # the expert-TP gather goes with the dispatch, its reduce-scatter with the combine
    phases = (dispatch + etp_comm / 2, experts_t + shared + shared_tp + 2 * sort, a2a + etp_comm / 2, unpermute)
    return cost, phases


def moe_activation_bytes(ctx, draw: RoutingDraw, *, recomputed: tuple[str, ...] | None = None) -> float:
    """Tensors one MoE FFN keeps for its backward on the busiest rank, one microbatch: fp32 router
    logits and probabilities (tokens x E each), each copy's fp32 routing probability (Megatron-Core
    applies it inside the expert activation, TEGroupedMLP's weighted_bias_swiglu_impl with
    permuted_probs, and unpermutes without it, so no expert output is kept for a weighted combine;
    releases of 2024, e.g. v0.8, weighted in the unpermute and kept copies x h), the received
    expert inputs for the weight gradients (load x h), the
    expert intermediates (up/gate outputs and activation output: load x f x ffn_matrices), and
    the shared experts' like a dense MLP of their width. The all-to-all inputs are not kept (its
    backward is another all-to-all). Selective recompute frees what it re-runs: moe everything
    (the layer's input is kept with the attention block's), moe_act the activation outputs,
    shared_experts the shared experts' tensors. `recomputed` overrides the plan's modules (() for
    everything the layer makes, e.g. while it is being recomputed)."""
    m, b, p = ctx.model, ctx.act_bytes, ctx.plan
    if recomputed is None:
        recomputed = p.recomputed_modules
    if "moe" in recomputed:
        return 0.0
    h = m.hidden_size
    routed = routed_tokens_per_rank(ctx)
    load = float(draw.rank_loads.max()) * p.expert_tp
    out = 2 * routed * m.moe.num_experts * 4 + draw.sent_per_rank * 4
    out += load * h * b + _expert_output_bytes(ctx, draw) * (m.ffn_matrices - 1)
    if "moe_act" not in recomputed:
        out += _expert_output_bytes(ctx, draw)
    if "shared_experts" not in recomputed:
        out += _shared_expert_bytes(ctx)
    return out


def _expert_output_bytes(ctx, draw: RoutingDraw) -> float:
    """One of the busiest rank's expert intermediates (an up/gate output, the activation output):
    its received tokens x the expert width."""
    return float(draw.rank_loads.max()) * ctx.plan.expert_tp * _expert_width(ctx) * ctx.act_bytes


def _shared_expert_bytes(ctx) -> float:
    """The shared experts' stored tensors, like a dense MLP of their width."""
    return ctx.tokens * _shared_width(ctx) * ctx.model.ffn_matrices * ctx.act_bytes


def moe_rebuilt_bytes(ctx, draw: RoutingDraw) -> float:
    """What selective recompute of `moe_act` or `shared_experts` re-creates during one MoE layer's
    backward, on top of its stored activations: the activation outputs, or the shared experts'
    tensors, one module at a time (each just before its own backward), so the larger of the two
    recomputed. `moe` and full recompute rebuild the whole FFN instead (memory.recompute_working_bytes)."""
    recomputed = ctx.plan.recomputed_modules
    return max(_expert_output_bytes(ctx, draw) if "moe_act" in recomputed else 0.0,
               _shared_expert_bytes(ctx) if "shared_experts" in recomputed else 0.0)


def dispatch_buffer_bytes(ctx, draw: RoutingDraw) -> float:
    """All-to-all send and receive buffers of one MoE layer (transient); with expert_tp the received
    tokens are all-gathered over the expert-TP group before the experts run on them (expert_tp x
    the busiest rank's load, as expert_compute_time computes)."""
    received = float(draw.rank_loads.max()) * ctx.plan.expert_tp
    return (draw.sent_per_rank + received) * ctx.model.hidden_size * ctx.act_bytes
