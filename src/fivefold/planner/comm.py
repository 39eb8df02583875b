"""Collective times: latency + bandwidth per collective, per link level.

The process grid puts tp innermost, then cp, then dp, then pp outermost (ranks of one tp group are neighbours,
inside a node). A group of `size` ranks whose neighbours are `stride` ranks apart spans
ceil(size * stride / gpus_per_node) nodes when it leaves the node; ring collectives then move their bytes at
the bus bandwidth of that many nodes (measured, when the hardware profile has it, else the per-device network
bandwidth). Ring algorithms pay one latency per step: 2 (n - 1) steps for an all-reduce, n - 1 for an
all-gather or reduce-scatter; across nodes an all-reduce pays a ring inside the node and a tree between the
nodes (2 (local - 1 + log2 nodes) steps), as NCCL runs it; a buffer sent in buckets pays them once per bucket.
A group moves its bytes at the bus bandwidth measured across the nodes it spans, whatever the size of the job
around it (the measured table falls with the node count because one collective spans more nodes, not because
other groups share the fabric: capping a 2-node TP group of a 64-node job at the 64-node figure made large
cross-node TP runs twice too slow, docs/planner.md).

Inside a node, a profile from `fivefold calibrate` replaces the formula with what it measured: seconds per call
by kind, group size and message bytes (`Cluster.collective_time`), once per bucket.
"""

from __future__ import annotations

import functools
import math

from fivefold.planner.hardware import Cluster
from fivefold.planner.layout import Layout


def nodes_spanned(size: int, stride: int, gpus_per_node: int) -> int:
    if size <= 1:
        return 1
    if stride >= gpus_per_node:
        return size
    return max(1, math.ceil(size * stride / gpus_per_node))


def _time(kind: str, nbytes: float, size: int, stride: int, hw: Cluster, bucket: float = 0.0,
          nodes: int = 0) -> float:
    """Seconds of one collective; `nodes`: the nodes the group spans where the caller knows them (else from `size`
    and `stride`)."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    nodes = nodes or nodes_spanned(size, stride, hw.gpus_per_node)
    buckets = max(1, math.ceil(nbytes / bucket)) if bucket else 1
    measured = hw.collective_time(kind, nbytes / buckets, size) if nodes <= 1 else None
    if measured is not None:
        return buckets * measured
    bw = hw.bus_bandwidth(nodes)
    if nodes > 1 and not hw.busbw_gbps and kind != "p2p":
        # no measured table: NCCL runs one ring per NIC (rail), so the group's members on a node send over as
        # many NICs at once; the node's NVLink bounds it
        bw = min(hw.intra_node_gbps, hw.inter_node_gbps * max(1, size // nodes)) * 1e9
    # latency per bucket: a ring pays one step per member (n - 1), each as slow as the slowest link of the ring;
    # across nodes NCCL's all-reduce runs a tree between nodes (log2 of the nodes, up and down) after a ring inside
    # each node, so only the tree's hops pay the inter-node latency
    steps = (size - 1) * buckets
    frac = (size - 1) / size
    if kind == "all_reduce":
        if nodes > 1:
            local = max(1, size // nodes)
            latency = ((local - 1) * hw.latency(1) + math.ceil(math.log2(nodes)) * hw.latency(nodes)) * buckets
        else:
            latency = steps * hw.latency(nodes)
        return 2 * frac * nbytes / bw + 2 * latency
    if kind in ("all_gather", "reduce_scatter"):
        if hw.gather_busbw_gbps:  # measured for these collectives
            return frac * nbytes / hw.bus_bandwidth(nodes, gather=True) + steps * hw.latency(nodes)
        # without that table: about 0.57 of all-reduce's across nodes (the playbook's 64-node figures; NCCL runs
        # all-reduce as a tree there); inside a node they match
        scale = 1.0 if nodes <= 1 or not hw.busbw_gbps else 0.57
        return frac * nbytes / (bw * scale) + steps * hw.latency(nodes)
    if kind == "all_to_all":
        return frac * nbytes / bw + steps * hw.latency(nodes)
    if kind == "p2p":
        if nodes > 1:  # one pair across nodes: the sender's own network link, whatever a collective's table says
            # (a collective's bus bandwidth across nodes adds up its members' links and NVLink)
            bw = min(bw, hw.inter_node_gbps * 1e9)
        return nbytes / bw + hw.latency(nodes)  # one hop
    raise ValueError(kind)


def all_reduce(nbytes: float, size: int, stride: int, hw: Cluster, bucket: float = 0.0, nodes: int = 0) -> float:
    """`nbytes` is the size of the buffer each rank contributes (and receives), sent in `bucket`-byte pieces."""
    return _time("all_reduce", nbytes, size, stride, hw, bucket, nodes)


def all_gather(nbytes: float, size: int, stride: int, hw: Cluster) -> float:
    """`nbytes` is the size of the gathered (full) buffer."""
    return _time("all_gather", nbytes, size, stride, hw)


def reduce_scatter(nbytes: float, size: int, stride: int, hw: Cluster, bucket: float = 0.0, nodes: int = 0
                   ) -> float:
    """`nbytes` is the size of the full buffer before scattering."""
    return _time("reduce_scatter", nbytes, size, stride, hw, bucket, nodes)


def all_to_all(nbytes: float, size: int, stride: int, hw: Cluster) -> float:
    """`nbytes` is what each rank sends (its whole send buffer, its own share included) to `size` ranks `stride`
    apart, evenly: inside a node at the node's (measured or nominal) bandwidth; across nodes each rank sends the
    share for its own node's peers over the node's links and the rest over its own network link at once (an
    all-to-all is point-to-point: no ring, no NIC shared between ranks), so the slower of the two sets the time."""
    return expert_all_to_all(nbytes, size, nodes_spanned(size, stride, hw.gpus_per_node), hw)


def expert_all_to_all(nbytes: float, size: int, nodes: int, hw: Cluster) -> float:
    """An all-to-all of `nbytes` per rank over `size` ranks spread over `nodes` nodes (`all_to_all`): inside one
    node (n - 1) / n of the bytes at the intra-node bandwidth (or the measured table); across nodes the rank with
    the fewest peers on its node (size // nodes of the group there) sends (local - 1) / n of them over the node's
    links and (n - local) / n over its network link, at once; one latency per peer."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    if nodes <= 1:
        return _time("all_to_all", nbytes, size, 1, hw, nodes=1)
    local = max(1, size // nodes)
    intra = (local - 1) / size * nbytes / (hw.intra_node_gbps * 1e9)
    inter = (size - local) / size * nbytes / (hw.inter_node_gbps * 1e9)
    return max(intra, inter) + (size - 1) * hw.latency(nodes)


def ep_group_nodes(lay: Layout, gpus_per_node: int) -> int:
    """The most nodes that one ep group of `lay` spans (every ep group runs its all-to-alls at once, so the slowest
    sets the step). An ep group is `ep` consecutive members of a dp x cp group (`parallel.mesh.expert_groups`),
    which lie tp ranks apart: global ranks pp_rank x (dp cp tp) + (b ep + j) tp + t, j < ep, for block b and tp
    rank t (rank = ((pp_rank dp + dp_rank) cp + cp_rank) tp + tp_rank). So a group spans ep x tp consecutive-rank
    positions: inside one node when ep x tp divides the node's devices (the blocks are aligned to ep x tp), else
    counted over every offset such a block can start at on a node."""
    return _ep_group_nodes(lay.ep, lay.tp, lay.dp * lay.cp, lay.pp, gpus_per_node)


@functools.lru_cache(maxsize=4096)
def _ep_group_nodes(ep: int, tp: int, dpcp: int, pp: int, gpn: int) -> int:
    if ep <= 1:
        return 1
    # the offsets (mod gpn) a group's first rank can take: pp_rank dpcp tp + b ep tp + t, each term periodic mod gpn
    starts = {0}
    for step, count in ((dpcp * tp, pp), (ep * tp, dpcp // ep), (1, tp)):
        terms = {(i * step) % gpn for i in range(min(count, gpn))}
        starts = {(a + b) % gpn for a in starts for b in terms}
    return max(len({(o + j * tp) // gpn for j in range(ep)}) for o in starts)


def send_recv(nbytes: float, stride: int, hw: Cluster) -> float:
    """A send/recv pair between ranks `stride` apart: one step of a ring (context parallel's K/V, every member
    sending to the next while receiving from the previous), or a pipeline stage's hand-over."""
    return _time("p2p", nbytes, 2, stride, hw)


def p2p(nbytes: float, lay: Layout, hw: Cluster) -> float:
    """Send between neighbouring pipeline stages: pp is the outermost axis."""
    return send_recv(nbytes, strides(lay)["pp"], hw)


def strides(lay: Layout) -> dict[str, int]:
    """Distance in ranks between neighbours of each axis' group (tp innermost, then cp, dp, pp)."""
    return {"tp": 1, "cp": lay.tp, "dp": lay.tp * lay.cp, "dpcp": lay.tp, "pp": lay.tp * lay.cp * lay.dp}
