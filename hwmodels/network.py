"""Collective communication times on a cluster's network tiers (seconds).

The network is a list of dimensions, ASTRA-sim style (size, bandwidth, latency per tier): NVLink
inside a node, the InfiniBand leaf (rail) switches, the spine above them. Byte counts follow the
nccl-tests convention (doc/PERFORMANCE.md, https://github.com/NVIDIA/nccl-tests/blob/a0b82b2260cf5152b9f8c061bbf7eaf0ba096432/doc/PERFORMANCE.md):
all_reduce the buffer, all_gather the total output (per rank x n), reduce_scatter the total input,
all_to_all one rank's whole send buffer, send_recv and broadcast the message. A collective costs
    time = latency + busbw_factor(op, n) x nbytes / busbw
with nccl-tests' busbw factors (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all
(n-1)/n; broadcast, send_recv 1).

Inside one node busbw is the profile's measured 8-GPU all_reduce curve, which already holds the
size-dependent efficiency and the latency (so no latency is added on top of it).
Across nodes: NCCL's own cost model (src/graph/tuning.cc at 5067397c:
https://github.com/NVIDIA/nccl/blob/5067397c2676d5aed50042fc39e5c8ee96eb0027/src/graph/tuning.cc):
the minimum over ring (and tree, for all_reduce) and the LL / LL128 / Simple protocols of
tuning.cc latency + bytes / protocol bandwidth, as NCCL's tuner picks the fastest; the protocol
choice is what makes small messages slow. The bandwidth is a hierarchical ring's under a
symmetric load, min(NVLink ring busbw, ranks_per_node x per-GPU NIC share), over the spine's
oversubscription once a group leaves its leaf; a one-node collective of the node's ranks is a
lower bound. all_to_all and send_recv have their own rules (see their functions).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from hwmodels.profile import GpuProfile
from paraplan.placement import GroupLayout
from paraplan.specs import ClusterSpec

__all__ = ["COMM_SM_SHARE", "OPS", "Network", "build_network", "busbw_factor", "collective_time",
           "nccl_latency", "overlapped", "spread_hop", "tier_names_crossed"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")
US = 1e-6
CURVE_GPUS = 8
"""The profiles' nvlink_busbw curves are 8-GPU all_reduce measurements."""

COMM_SM_SHARE = 0.15
"""Fraction of the GPU's SMs a collective holds while it runs beside compute. NCCL's CTAs do not
share an SM with compute kernels, and on a DGX with 8 NICs it uses 16 of them (the NCCL maintainer
in https://github.com/NVIDIA/nccl/issues/689; 16 of an A100's 108 SMs is 0.148); a lone NCCL kernel
keeps 15% of the SMs active (https://github.com/NVIDIA/nccl/issues/1432); Calculon's NVLink
processor_usage is 0.15 (systems/h100_80g_nvl8.json, https://github.com/calculon-ai/calculon).
Calculon gives its InfiniBand tier 0.02, but NCCL's 16 SMs above are the 8-NIC multi-node case, so
one share is used for every tier."""


def overlapped(compute: float, comm: float) -> float:
    """Seconds for `compute` with `comm` running beside it on another stream: compute overlapped by
    a collective for t seconds finishes COMM_SM_SHARE x t later (Calculon's overlap accounting,
    calculon/llm/llm.py, exposed time = hidden communication x processor_usage), unless the
    communication is the longer of the two."""
    return max(compute + COMM_SM_SHARE * min(compute, comm), comm)

# --- NCCL tuning.cc constants, microseconds, per protocol (LL, LL128, Simple):
# https://github.com/NVIDIA/nccl/blob/5067397c2676d5aed50042fc39e5c8ee96eb0027/src/graph/tuning.cc
PROTOCOLS = ("LL", "LL128", "Simple")
BASE_LAT = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 8.4)}
NVLINK_LAT = {"ring": (0.6, 1.9, 3.4), "tree": (0.6, 1.25, 4.0)}
NET_LAT = {"ring": (2.7, 4.0, 14.0), "tree": (5.0, 8.5, 14.0)}
NET_OVERHEAD = (1.0, 1.0, 3.0)
"""getNetOverhead: 1 us on Intel/ARM hosts, x3 for Simple; ring intra-node steps cost at least this."""
LL_MAX_BW_MULTINODE = {2: 39.0e9, 3: 20.4e9}
"""llMaxBws row 0 (Intel host): column 1 for 2 nodes, column 2 beyond; the LL busbw cap, bytes/s."""
LL_MAX_BW_ONE_NODE = {"ampere": 87.7e9, "hopper": 141.0e9, "blackwell": 282.0e9}
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9, .9),
)
"""treeCorrectionFactor per protocol, indexed by log2(nBytes / 64) for 64 B to 512 MiB: the tree
all_reduce's bandwidth at medium sizes, where trees fall short of the model ("Applying a static
correction factor is not ideal but works quite well"; ncclTopoGetAlgoTime multiplies it in)."""
RING_SIMPLE_MULTINODE_AR = 1.4
"""Ring/Simple all_reduce latency x1.4 on multi-node Ampere+ (tuning.cc, for nBytes/(nCh x nRanks) >= 64)."""
NVLS_FRACTION = {4: 363.3 / 473.1, 5: 414.2 / 473.1, 6: 435.6 / 473.1, 7: 460.0 / 473.1, 8: 1.0}
"""NVLS all_reduce busbw by group size relative to 8 GPUs, 8xH200 at 8 GiB
(https://github.com/NVIDIA/nccl/issues/1455); below 4 GPUs NCCL's ring is as fast."""
NVLS_ARCHS = ("hopper", "blackwell")
"""tuning.cc nvlsEfficiency: 0 on Ampere (no NVLink SHARP)."""


@dataclass(frozen=True, kw_only=True)
class Network:
    gpu: GpuProfile
    gpus_per_node: int
    num_nodes: int
    oversubscription: float
    nodes_per_leaf: int
    nic_share: float
    """bytes/s of NIC one GPU gets when every GPU communicates: nics x rate x efficiency / gpus_per_node."""
    intra_scale: float
    """The scenario's NVLink bandwidth over the profile's (1 by default): scales the measured curve."""
    intra_lat_scale: float
    """The scenario's NVLink / network latency over NCCL's LL ring hop latency: scales NCCL's tables."""
    inter_lat_scale: float
    ref_logs: tuple[tuple[float, ...], tuple[float, ...]]
    """(log size, log time) of the profile's all_reduce curve, time made non-decreasing."""


def build_network(cluster: ClusterSpec, gpu: GpuProfile) -> Network:
    intra = cluster.intra_node or gpu.default_intra_node()
    inter = cluster.inter_node or gpu.default_inter_node()
    gpn, nodes = cluster.gpus_per_node, cluster.num_nodes
    per_gpu_nic = inter.nics_per_node * inter.nic_bandwidth / gpn
    # Measured times of the reference 8-GPU all_reduce, made non-decreasing (nccl-tests noise makes
    # a few small sizes run faster than smaller ones) and kept as logs for power-law interpolation.
    factor = busbw_factor("all_reduce", CURVE_GPUS)
    times, running = [], 0.0
    for size, bw in zip(gpu.nvlink_busbw.xs, gpu.nvlink_busbw.ys):
        running = max(running, factor * size / bw)
        times.append(running)
    return Network(
        gpu=gpu, gpus_per_node=gpn, num_nodes=nodes,
        oversubscription=inter.oversubscription, nodes_per_leaf=inter.nodes_per_leaf,
        nic_share=per_gpu_nic * gpu.nic_efficiency,
        intra_scale=intra.bandwidth / gpu.nvlink_bandwidth,
        intra_lat_scale=intra.latency / (NVLINK_LAT["ring"][0] * US),
        inter_lat_scale=inter.latency / (NET_LAT["ring"][0] * US),
        ref_logs=(tuple(math.log(x) for x in gpu.nvlink_busbw.xs), tuple(math.log(t) for t in times)),
    )


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests PERFORMANCE.md: bytes each rank moves per byte of nbytes, over busbw."""
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _crosses_spine(net: Network, group: GroupLayout) -> bool:
    """Where the placement says (GroupLayout.crosses_leaf: its nodes under two leaves, e.g. a
    pipeline hop between stages on neighbouring leaves), that; otherwise the group's nodes are
    taken as packed under one leaf until it spans more nodes than a leaf holds. The topology enters
    through nodes_per_leaf alone (the loader counts the nodes a leaf holds for it: InterNodeSpec.leaf_ports):
    on a rail-optimized fabric every rail has its own leaf over the same nodes, NCCL keeps rings
    and trees on one rail, and PXN moves cross-rail point-to-point traffic over NVLink to the GPU on
    the destination's rail first (NVIDIA, "Doubling all2all Performance with NCCL 2.12",
    https://developer.nvidia.com/blog/doubling-all2all-performance-with-nvidia-collective-communication-library-2-12/),
    so traffic leaves the leaves where a fat tree's would, for leaves of the same node count."""
    if group.crosses_leaf is not None:
        return group.crosses_leaf and group.num_nodes > 1
    return group.num_nodes > net.nodes_per_leaf


def _spine_share(net: Network, group: GroupLayout, op: str) -> float:
    """The share of a leaf's network traffic that crosses to the spine while every group of this
    kind runs `op` at once (the symmetric assumption), its nodes packed under leaves of
    nodes_per_leaf: a ring (or tree) over the group's nodes leaves a leaf once for the
    min(N, nodes_per_leaf) edges it runs inside it; an all-to-all sends (N - n)/(N - 1) of each
    node's off-node bytes to nodes of other leaves, n = its nodes under the leaf (an even split for a
    group that straddles a boundary); a pipeline link, the share of the leaf's GPUs whose partner
    on it sits under another leaf (GroupLayout.leaf_share, from the placement), else all of it."""
    nodes = group.num_nodes
    here = min(nodes, net.nodes_per_leaf)
    if op == "send_recv":
        return 1.0 if group.leaf_share is None else group.leaf_share
    if op == "all_to_all":
        if nodes <= net.nodes_per_leaf:  # straddling a boundary: half of it on each side (the
            here = nodes / 2  # placement says it crosses, not where; n(N - n) pairs cross, most at n = N/2)
        return (nodes - here) / (nodes - 1)
    return 1.0 / here


def spread_hop(net: Network, group: GroupLayout) -> GroupLayout:
    """One network hop of traffic a rank spreads evenly over the group's other nodes (DeepEP's
    node-to-node leg), as a two-node point-to-point layout: it crosses the spine when the group
    does, for the share of its bytes an all-to-all over the group sends to other leaves."""
    crosses = _crosses_spine(net, group)
    return GroupLayout(size=2, ranks_per_node=1, num_nodes=2, crosses_leaf=crosses,
                       leaf_share=_spine_share(net, group, "all_to_all") if crosses else None)


def _nic_bw(net: Network, group: GroupLayout, op: str) -> float:
    """Per-GPU NIC bandwidth under the symmetric assumption (every group of this kind communicates
    at once, so each GPU owns 1/gpus_per_node of the node's NICs). Once the group leaves its leaf,
    its spine-crossing traffic shares uplinks of 1/oversubscription of the leaf's NIC capacity, so
    the NICs slow down by max(1, oversubscription x _spine_share): a ring over whole leaves never
    fills them (one edge in min(N, nodes_per_leaf) leaves the leaf), an all-to-all over many leaves
    nearly does."""
    if not _crosses_spine(net, group):
        return net.nic_share
    return net.nic_share / max(1.0, net.oversubscription * _spine_share(net, group, op))


# ----------------------------------------------------------------------------- inside one node


def _reference_time(net: Network, nbytes: float) -> float:
    """Time of the profile's 8-GPU all_reduce of `nbytes`: interpolated as a power law between the
    measured sizes (monotone, unlike busbw linear in log size), constant below the smallest
    (latency-bound), proportional to size beyond the largest. On a link intra_scale times the
    profile's bandwidth it is the measured time of nbytes / intra_scale: the bandwidth-bound part
    scales, the latency-bound part (small buffers) does not."""
    logs, logt = net.ref_logs
    x = math.log(nbytes / net.intra_scale)
    if x <= logs[0]:
        log_t = logt[0]
    elif x >= logs[-1]:
        log_t = logt[-1] + x - logs[-1]
    else:
        i = bisect.bisect_right(logs, x)
        log_t = logt[i - 1] + (x - logs[i - 1]) / (logs[i] - logs[i - 1]) * (logt[i] - logt[i - 1])
    return math.exp(log_t)


def _intra_time(net: Network, op: str, nbytes: float, n: int) -> float:
    """n ranks in one node: the measured 8-GPU time at the same buffer size, scaled by
    busbw_factor(op, n) / busbw_factor(all_reduce, 8). For n < 8 that shrinks the latency-bound
    time about as NCCL's ring latency shrinks (2 GPUs: 0.57x here; LL 6.6 + 2(n-1) x 0.6 us gives
    7.8 vs 15.0 us, 0.52x, tuning.cc). Capped by the algorithm's ceiling:
    the ring busbw for all_gather / reduce_scatter / all_to_all / broadcast (8xH100: AG 350, RS 360
    vs NVLS all_reduce 480, nccl#1281); for all_reduce the larger of ring and NVLS at this group
    size (NVLS_FRACTION)."""
    ceiling = net.gpu.nvlink_ring_busbw * net.intra_scale
    if op == "all_reduce":
        nvls = NVLS_FRACTION.get(min(n, 8), 0.0) if net.gpu.arch in NVLS_ARCHS else 1.0
        ceiling = max(ceiling, net.gpu.nvlink_busbw.max * net.intra_scale * nvls)
    factor = busbw_factor(op, n)
    curve = factor / busbw_factor("all_reduce", CURVE_GPUS) * _reference_time(net, nbytes)
    return max(curve, factor * nbytes / ceiling)


# ----------------------------------------------------------------------------- NCCL's model


def nccl_latency(net: Network, algo: str, proto: int, op: str, n: int, ppn: int, nodes: int) -> float:
    """tuning.cc latency (seconds) of one collective, hop latencies scaled to the scenario's:
    ring  base + (nsteps - nInter) x max(intraLat, netOverhead) + nInter x interLat,
          nsteps 2(n-1) all_reduce, n-1 all_gather/reduce_scatter, n otherwise;
          nInter 0 on one node, 2(N-1) all_reduce, N-1 otherwise;
    tree  (all_reduce) base + 2 x ((ppn-1) x intraLat + log2(N) x interLat);
    interLat is the network's tree latency when ppn == 1 ("latencies fully exposed");
    broadcast (ring only) base + one hop: NVLink's on one node, the network's across nodes (its
    chunks pipeline down the ring; tuning.cc's sameChannels case, an NVSwitch node's rings)."""
    intra = NVLINK_LAT[algo][proto] * net.intra_lat_scale
    inter = NET_LAT["tree" if ppn == 1 else algo][proto] * net.inter_lat_scale
    lat = BASE_LAT[algo][proto]
    if op == "broadcast":
        hop = intra if nodes == 1 else NET_LAT[algo][proto] * net.inter_lat_scale  # the ring's, even at ppn 1
        return (lat + hop) * US
    if algo == "tree":
        lat += 2 * ((ppn - 1) * intra + (nodes.bit_length() - 1) * inter)  # log2i: floor
    else:
        nsteps = 2 * (n - 1) if op == "all_reduce" else n - 1 if op in ("all_gather", "reduce_scatter") else n
        n_inter = 0 if nodes == 1 else 2 * (nodes - 1) if op == "all_reduce" else nodes - 1
        if nodes > 1:
            intra = max(intra, NET_OVERHEAD[proto])
        lat += (nsteps - n_inter) * intra + n_inter * inter
        if op == "all_reduce" and nodes > 1 and PROTOCOLS[proto] == "Simple":
            lat *= RING_SIMPLE_MULTINODE_AR
    return lat * US


def _proto_busbw(busbw: float, algo: str, proto: int, ll_max: float) -> float:
    """tuning.cc per-protocol bandwidth: ring LL min(llMaxBw, busbw/2), LL128 x0.92, Simple x1;
    tree all_reduce first x0.92 for every protocol, then LL min(busbw/3.8, llMaxBw), LL128
    x120/128 (more than one node). Per-channel caps are left out (they bind only with few
    channels)."""
    name = PROTOCOLS[proto]
    if algo == "ring":
        return {"LL": min(ll_max, 0.5 * busbw), "LL128": 0.92 * busbw, "Simple": busbw}[name]
    busbw *= 0.92
    return {"LL": min(busbw / 3.8, ll_max), "LL128": busbw * 120 / 128, "Simple": busbw}[name]


def _tree_correction(proto: int, nbytes: float) -> float:
    """TREE_CORRECTION at log2(nBytes / 64), interpolated linearly between the table's powers of two
    (NCCL steps at each: log2i(nBytes >> 6)), so that a larger message never takes less time (the
    factor grows at most 1.34x per doubling); the end values beyond the table."""
    row = TREE_CORRECTION[proto]
    x = math.log2(max(nbytes, 1.0) / 64.0)
    if x <= 0:
        return row[0]
    if x >= len(row) - 1:
        return row[-1]
    i = int(x)
    return row[i] + (x - i) * (row[i + 1] - row[i])


def _multi_node_time(net: Network, op: str, nbytes: float, g: GroupLayout) -> float:
    n, ppn, nodes = g.size, g.ranks_per_node, g.num_nodes
    ring_intra = net.gpu.nvlink_ring_busbw * net.intra_scale
    # Hierarchical ring: each node's ranks share ppn GPUs' worth of NIC (inter-node ring busbw =
    # min(B_intra, gpus_per_node x B_nic), stas00 ml-engineering network README:
    # https://github.com/stas00/ml-engineering/blob/744d01e18b79512572f64a6bbd8b5f4a725203a7/network/README.md).
    busbw = min(ring_intra, ppn * _nic_bw(net, g, op))
    ll_max = LL_MAX_BW_MULTINODE[min(nodes, 3)]
    best = math.inf
    for algo in ("ring", "tree") if op == "all_reduce" else ("ring",):
        for proto in range(len(PROTOCOLS)):
            bw = _proto_busbw(busbw, algo, proto, ll_max)
            if algo == "tree":
                bw *= _tree_correction(proto, nbytes)
            # algBw = busBw x nRanks/nsteps for ring; busBw / 2 for tree all_reduce (tuning.cc).
            bytes_term = busbw_factor(op, n) * nbytes if algo == "ring" else 2.0 * nbytes
            best = min(best, nccl_latency(net, algo, proto, op, n, ppn, nodes) + bytes_term / bw)
    # The intra-node legs move the same bytes over the same NVLink as a one-node collective of the
    # node's ppn ranks, so it bounds the time from below (and keeps its measured small-size latency).
    floor = _intra_time(net, op, nbytes, ppn) if ppn > 1 else 0.0
    return max(best, floor)


def _all_to_all_time(net: Network, nbytes: float, g: GroupLayout) -> float:
    """Each rank sends nbytes/n to every peer. Off-node share (n - ppn)/n, (N-1)/N when the group is
    spread evenly (ppn: the ranks on the node that holds the fewest, whose members send the most
    off-node and set the pace), leaves through this GPU's NIC share only: all-to-all cannot
    aggregate several NICs per GPU (busbw ~ N/(N-1) x B_nic;
    https://github.com/NVIDIA/nccl-tests/issues/130, https://github.com/NVIDIA/nccl-tests/issues/267).
    On-node share (ppn-1)/n over NVLink. The two overlap. Latency: Simple's base and network hop
    (tuning.cc) plus 1 us per peer for the n-1 grouped sends and receives NCCL runs it as. tuning.cc
    has no all-to-all model; the per-peer term is getNetOverhead's 1 us (its LL figure, not Simple's
    3 us), a modelling choice no measurement here pins down, so an all-to-all of small messages over
    many ranks is priced with less certainty than its large-message bandwidth."""
    n, ppn = g.size, g.ranks_per_node
    t_off = nbytes * (n - ppn) / n / _nic_bw(net, g, "all_to_all")
    # the node's own all-to-all among its ppn ranks moves the same (ppn-1)/n of the buffer
    t_on = _intra_time(net, "all_to_all", nbytes * ppn / n, ppn) if ppn > 1 else 0.0
    simple = PROTOCOLS.index("Simple")
    lat = (BASE_LAT["ring"][simple] + NET_LAT["ring"][simple] * net.inter_lat_scale
           + (n - 1) * NET_OVERHEAD[0]) * US
    return lat + max(t_off, t_on)


def _send_recv_time(net: Network, nbytes: float, g: GroupLayout) -> float:
    """One hop of the tier crossed, as a one-step NCCL ring: min over protocols of base + hop latency
    + nbytes / protocol bandwidth. NVLink p2p runs at the ring busbw fraction of the link (8xH100:
    ~370 of 450 GB/s app-level; 450 from https://www.nvidia.com/en-us/data-center/h100/, ring busbw measured in
    https://github.com/NVIDIA/nccl/issues/1455); the network at the NIC share."""
    one_node = g.num_nodes == 1
    if one_node:
        bw = net.gpu.nvlink_ring_busbw * net.intra_scale
        ll_max = LL_MAX_BW_ONE_NODE[net.gpu.arch]
    else:
        bw = _nic_bw(net, g, "send_recv")
        ll_max = LL_MAX_BW_MULTINODE[2]
    best = math.inf
    for proto in range(len(PROTOCOLS)):
        hop = (NVLINK_LAT["ring"][proto] * net.intra_lat_scale if one_node
               else NET_LAT["ring"][proto] * net.inter_lat_scale)
        t = (BASE_LAT["ring"][proto] + hop) * US + nbytes / _proto_busbw(bw, "ring", proto, ll_max)
        best = min(best, t)
    return best


def collective_time(net: Network, op: str, nbytes: float, group: GroupLayout) -> float:
    """Seconds for one `op` of `nbytes` (nccl-tests convention) over `group`."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if op == "send_recv":
        return _send_recv_time(net, nbytes, group)
    if group.num_nodes == 1:
        return _intra_time(net, op, nbytes, group.size)
    if op == "all_to_all":
        return _all_to_all_time(net, nbytes, group)
    return _multi_node_time(net, op, nbytes, group)


def tier_names_crossed(net: Network, group: GroupLayout) -> tuple[str, ...]:
    """The tiers a group's traffic uses, e.g. ("nvlink",) or ("nvlink", "ib"), for reports."""
    if group.size <= 1:
        return ()
    if group.num_nodes == 1:
        return ("nvlink",)
    names = ("nvlink", "ib") if group.ranks_per_node > 1 else ("ib",)
    return names + (("spine",) if _crosses_spine(net, group) else ())
