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

from partitioner.launch import NodeLaunch, node_launches, split_device
from partitioner.launch import seat as launch_seat

from .layout import Layout

__all__ = ["NodeSeat", "layout_nodes", "plan_nodes", "seat"]


def layout_nodes(layout: Layout) -> list[NodeLaunch]:
    """The plan's nodes in first-use order, each with its layout ranks by device index (the
    launch logic every export shares, :mod:`partitioner.launch`)."""
    return node_launches([r.gpu for r in layout.ranks], local_order="index")  # a group's ranks: one GPU each


def plan_nodes(layout: Layout) -> dict[str, list[int]]:
    """The plan's nodes in first-use order, each with its layout ranks sorted by device index."""
    return {n.node: list(n.ranks) for n in layout_nodes(layout)}


@dataclass(frozen=True)
class NodeSeat:
    """What one torchrun process plays: the layout rank it joins as, and the local GPU index."""

    rank: int
    device: str
    gpu_index: int


def seat(layout: Layout, env: Mapping[str, str], node: str | None = None) -> NodeSeat:
    """The plan device of the torchrun process with environment ``env`` (``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``) on node ``node`` (default: the ``GROUP_RANK``-th)."""
    rank, _ = launch_seat(layout_nodes(layout), env, node)
    me = layout.ranks[rank]
    return NodeSeat(rank, me.device, split_device(me.gpu)[1])
