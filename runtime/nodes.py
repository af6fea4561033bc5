"""Across machines: which plan device a torchrun process plays on its node.

torchrun numbers its processes node after node (``RANK``), but a plan's devices are in virtual
worker order, which may alternate between nodes (worker 0 on ``n0:0, n1:0``, worker 1 on
``n0:1, n1:1``). So a process does not take the plan device ``RANK``: it takes the ``LOCAL_RANK``-th
device (by index) that the plan uses on its own node, and joins the process group under that
device's rank of the layout. Its node is named (``plan_node``: the torchrun lines that
``partitioner train --launch-lines`` prints name it on every machine) or, without a name, the
``GROUP_RANK``-th node of the plan (nodes in the order the plan first uses them). On a GPU the
process uses the GPU whose index the device name gives (``n1:3``: GPU 3). A tensor-parallel group
``n1:2-3`` is two processes (:mod:`runtime.layout`), on GPUs 2 and 3 (``RankInfo.gpu``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from partitioner.errors import PartitionerError

from .layout import Layout

__all__ = ["NodeSeat", "plan_nodes", "seat"]


def _split(device: str) -> tuple[str, int]:
    node, _, index = device.rpartition(":")
    if not node or not index.isdigit():
        raise PartitionerError(f"device {device!r}: across machines a plan device must be named NODE:INDEX")
    return node, int(index)


def plan_nodes(layout: Layout) -> dict[str, list[int]]:
    """The plan's nodes in first-use order, each with its layout ranks sorted by device index."""
    nodes: dict[str, list[int]] = {}
    for r in layout.ranks:
        nodes.setdefault(_split(r.gpu)[0], []).append(r.rank)
    for ranks in nodes.values():
        ranks.sort(key=lambda k: _split(layout.ranks[k].gpu)[1])
    return nodes


@dataclass(frozen=True)
class NodeSeat:
    """What one torchrun process plays: the layout rank it joins as, and the local GPU index."""

    rank: int
    device: str
    gpu_index: int


def seat(layout: Layout, env: Mapping[str, str], node: str | None = None) -> NodeSeat:
    """The plan device of the torchrun process with environment ``env`` (``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``) on node ``node`` (default: the ``GROUP_RANK``-th)."""
    nodes = plan_nodes(layout)
    names = list(nodes)
    if node is None:
        group = int(env.get("GROUP_RANK", "0"))
        if not 0 <= group < len(names):
            raise PartitionerError(f"GROUP_RANK = {group}, but the plan uses {len(names)} node(s) "
                                   f"({', '.join(names)}); start one torchrun agent per node, or name the node (`plan_node`)")
        node = names[group]
    if node not in nodes:
        raise PartitionerError(f"`plan_node` {node}: the plan uses no device there; its nodes are {', '.join(names)}")
    ranks = nodes[node]
    local = int(env.get("LOCAL_RANK", "0"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(len(ranks))))
    if local_world != len(ranks):
        raise PartitionerError(f"node {node} holds {len(ranks)} device(s) of the plan "
                               f"({', '.join(layout.ranks[k].gpu for k in ranks)}): start it with "
                               f"--nproc-per-node {len(ranks)} (LOCAL_WORLD_SIZE = {local_world})")
    r = layout.ranks[ranks[local]]
    return NodeSeat(r.rank, r.device, _split(r.gpu)[1])
