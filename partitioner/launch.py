"""Launch orders: which machine starts which ranks, so that a job's rank -> device mapping holds
(torch-free; used by ``partitioner export`` and by the runtime's torchrun seats, runtime/nodes.py).

Plans name devices ``NODE:INDEX`` (a cluster's node and the GPU's index on it). A job gives each
process a rank; the ranks of a node must start on that node, each on its GPU:

* a launcher numbers processes node after node: torchrun with ``--node-rank k`` (static
  rendezvous) gives node ``k`` the ranks after those of nodes ``0 .. k-1``, ``LOCAL_RANK`` ``i`` the
  ``i``-th of them; DeepSpeed's launcher does the same in the hostfile's order. So a job whose ranks
  are fixed by the framework (DeepSpeed's and Megatron-LM's topologies) needs every node's ranks
  consecutive (:func:`contiguity_problem`), the nodes started in the order of their ranks;
* ``CUDA_VISIBLE_DEVICES`` lists a node's GPUs in the order of its local ranks, so local rank ``i``
  (``cuda:i``) is the GPU the plan gives rank ``base + i``; DeepSpeed's launcher sets it itself
  from the hostfile's slots, in ascending GPU order (:func:`deepspeed_launcher_problem`);
* a job that picks its own rank from its node and local rank (this project's runtime, the
  torch-pipelining export's script: :func:`seat`) runs with any rank order.

:func:`check_launch` reads a DeepSpeed hostfile (``HOST slots=N`` lines) or a rank order (the
devices of ranks 0, 1, ... separated by commas, or the node names in launch order) and refuses, in
one line, an order that would put a rank on another node or GPU than the plan's.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .errors import PartitionerError

__all__ = ["NodeLaunch", "check_launch", "contiguity_problem", "deepspeed_launcher_problem", "group_gpus", "hostfile",
           "node_launches", "read_launch_order", "seat", "split_device", "torchrun_command"]


def split_device(device: str) -> tuple[str, int]:
    """``NODE:INDEX`` as ``(node, index)``; anything else refused in one line."""
    node, _, index = device.rpartition(":")
    if not node or not index.isdigit():
        raise PartitionerError(f"device {device!r}: across machines a plan device must be named NODE:INDEX")
    return node, int(index)


def group_gpus(device: str) -> list[str]:
    """The GPUs of a plan device in tensor-parallel order: ``NODE:FIRST-LAST`` (a group) as
    ``NODE:FIRST``, ..., ``NODE:LAST``; ``NODE:INDEX`` as itself."""
    node, _, span = device.rpartition(":")
    first, dash, last = span.partition("-")
    if node and dash and first.isdigit() and last.isdigit() and int(last) > int(first):
        return [f"{node}:{i}" for i in range(int(first), int(last) + 1)]
    return [device]


@dataclass(frozen=True)
class NodeLaunch:
    """One machine of a job: its ranks in local-rank order and the GPU index of each."""

    node: str
    ranks: tuple[int, ...]
    gpus: tuple[int, ...]

    @property
    def nproc(self) -> int:
        return len(self.ranks)

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(g) for g in self.gpus)

    def to_dict(self, node_rank: int, devices: Sequence[str]) -> dict[str, object]:
        return {"node": self.node, "node_rank": node_rank, "ranks": list(self.ranks),
                "devices": [devices[r] for r in self.ranks], "cuda_visible_devices": self.cuda_visible_devices}


def node_launches(devices: Sequence[str], local_order: str = "rank") -> list[NodeLaunch]:
    """The nodes of a job whose rank ``r`` runs on ``devices[r]``, in the order of their first
    rank; a node's ranks in ``local_order``: ``"rank"`` (ascending ranks, as a launcher numbers
    them) or ``"index"`` (ascending GPU index, the runtime's own seats)."""
    if local_order not in ("rank", "index"):
        raise ValueError(f"local_order {local_order!r}: rank or index")
    by_node: dict[str, list[int]] = {}
    for r, dev in enumerate(devices):
        by_node.setdefault(split_device(dev)[0], []).append(r)
    out = []
    for node, ranks in by_node.items():
        if local_order == "index":
            ranks = sorted(ranks, key=lambda r: split_device(devices[r])[1])
        out.append(NodeLaunch(node, tuple(ranks), tuple(split_device(devices[r])[1] for r in ranks)))
    return out


def contiguity_problem(nodes: Sequence[NodeLaunch]) -> str | None:
    """Why a launcher that numbers ranks node after node cannot give these ranks (``None`` when it
    can: every node's ranks consecutive, the nodes in the order of their ranks)."""
    expect = 0
    for n in nodes:
        if list(n.ranks) != list(range(expect, expect + n.nproc)):
            return (f"node {n.node} holds ranks {list(n.ranks)}, not consecutive after the {expect} rank(s) of the "
                    "nodes before it")
        expect += n.nproc
    return None


def deepspeed_launcher_problem(nodes: Sequence[NodeLaunch]) -> str | None:
    """Why ``deepspeed --hostfile`` cannot give these ranks (``None`` when it can): it starts a
    host's slots in ascending GPU order and sets ``LOCAL_RANK = RANK % processes of the host``."""
    bad = contiguity_problem(nodes)
    if bad:
        return bad
    for n in nodes:
        if list(n.gpus) != sorted(n.gpus):
            return (f"node {n.node} runs its ranks on GPUs {list(n.gpus)}; DeepSpeed's launcher starts a host's "
                    "slots in ascending order")
        if n.ranks[0] % n.nproc:
            return (f"node {n.node} starts at rank {n.ranks[0]} with {n.nproc} process(es); DeepSpeed's launcher "
                    "takes LOCAL_RANK = RANK % processes per host, which needs equal counts per host")
    return None


def torchrun_command(nodes: Sequence[NodeLaunch], k: int, program: Sequence[str], *, master_addr: str = "",
                     master_port: int = 29500, rdzv_endpoint: str = "", rdzv_id: str = "partitioner",
                     visible_devices: bool = True) -> str:
    """The command that starts node ``k``: ``CUDA_VISIBLE_DEVICES`` (when ``visible_devices``) and
    torchrun with ``--node-rank k`` and the static rendezvous at ``master_addr`` (the first node's
    address), or, with ``rdzv_endpoint``, c10d's rendezvous there (nodes then join in any order:
    for jobs that find their own seats)."""
    n = nodes[k]
    cmd = ["torchrun", "--nnodes", str(len(nodes)), "--nproc-per-node", str(n.nproc)]
    if rdzv_endpoint:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id]
    else:
        cmd += ["--node-rank", str(k), "--master-addr", master_addr or nodes[0].node, "--master-port",
                str(master_port)]
    env = f"CUDA_VISIBLE_DEVICES={n.cuda_visible_devices} " if visible_devices else ""
    return env + shlex.join([*cmd, *program])


def hostfile(nodes: Sequence[NodeLaunch]) -> str:
    """A DeepSpeed hostfile: one ``HOST slots=N`` line per node, in rank order."""
    return "".join(f"{n.node} slots={n.nproc}\n" for n in nodes)


def seat(nodes: Sequence[NodeLaunch], env: Mapping[str, str], node: str | None = None) -> tuple[int, int]:
    """``(rank, gpu index)`` of the process with environment ``env`` (``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``) on node ``node`` (default: the ``GROUP_RANK``-th):
    its node's ``LOCAL_RANK``-th rank, whatever torchrun's ``RANK``."""
    names = [n.node for n in nodes]
    if node is None:
        group = int(env.get("GROUP_RANK", "0"))
        if not 0 <= group < len(names):
            raise PartitionerError(f"GROUP_RANK = {group}, but the plan uses {len(names)} node(s) "
                                   f"({', '.join(names)}); start one torchrun agent per node, or name the node "
                                   "(`plan_node`)")
        node = names[group]
    if node not in names:
        raise PartitionerError(f"`plan_node` {node}: the plan uses no device there; its nodes are {', '.join(names)}")
    me = nodes[names.index(node)]
    local = int(env.get("LOCAL_RANK", "0"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(me.nproc)))
    if local_world != me.nproc:
        raise PartitionerError(f"node {node} holds {me.nproc} device(s) of the plan: start it with "
                               f"--nproc-per-node {me.nproc} (LOCAL_WORLD_SIZE = {local_world})")
    return me.ranks[local], me.gpus[local]


# -- checking a launch order ------------------------------------------------------------------

_HOSTFILE_LINE = re.compile(r"^\s*(\S+)\s+slots\s*=\s*(\d+)\s*$")


def read_launch_order(text: str) -> tuple[str, list[tuple[str, int | None]]]:
    """``text`` (a hostfile's path or contents, or a comma-separated list) as what it says:
    ``("hostfile", [(host, slots)])``, ``("devices", [(NODE:INDEX of rank r, None)])`` or
    ``("nodes", [(node, None)])`` in launch order."""
    source = text
    if os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            source = f.read()
    lines = [ln.split("#", 1)[0].strip() for ln in source.splitlines()]
    matches = [_HOSTFILE_LINE.match(ln) for ln in lines if ln]
    if matches and all(matches):
        return "hostfile", [(m.group(1), int(m.group(2))) for m in matches if m is not None]
    items = [x.strip() for x in source.replace("\n", ",").split(",") if x.strip()]
    if not items:
        raise PartitionerError(f"launch order {text!r}: give a hostfile (HOST slots=N lines), the devices of "
                               "ranks 0, 1, ... (NODE:INDEX,...) or the nodes in launch order (NODE,...)")
    if all(":" in x for x in items):
        for x in items:
            split_device(x)
        return "devices", [(x, None) for x in items]
    if any(":" in x for x in items):
        raise PartitionerError(f"launch order {text!r}: mixes devices (NODE:INDEX) and nodes; give one or the other")
    return "nodes", [(x, None) for x in items]


def check_launch(nodes: Sequence[NodeLaunch], devices: Sequence[str], given: str,
                 slots: Mapping[str, int | None] | None = None, roles: Sequence[str] | None = None) -> str:
    """Check the launch order ``given`` (:func:`read_launch_order`) against a job whose rank ``r``
    must run on ``devices[r]``, its nodes started as ``nodes`` (:func:`node_launches`: node ``k``
    with ``--node-rank k``, or ``k``-th in the hostfile). Returns a line saying that it holds;
    raises :class:`PartitionerError` (one line) naming the first rank that would land elsewhere.
    ``slots``: a hostfile's slot count per node that is right besides the node's process count
    (a hostfile whose ``--include`` picks GPUs that are not ``0 .. n-1``). ``roles``: what each
    rank is in the job (``"tensor-parallel index 1 of n0:0-1"``), named in a refusal."""
    kind, order = read_launch_order(given)
    plan_nodes = {n.node: n for n in nodes}
    if kind == "devices":
        got_devices = [d for d, _ in order]
        if len(got_devices) != len(devices):
            raise PartitionerError(f"launch order gives {len(got_devices)} rank(s); the job has {len(devices)} "
                                   f"({', '.join(devices)})")
        for r, (got, want) in enumerate(zip(got_devices, devices)):
            if got != want:
                role = f" ({roles[r]})" if roles and roles[r] else ""
                raise PartitionerError(f"launch order puts rank {r}{role} on {got}; the plan runs it on {want}")
        return f"ok: the {len(devices)} ranks run on the plan's devices ({', '.join(devices)})"
    names = [h for h, _ in order]
    unknown = [h for h in names if h not in plan_nodes]
    if unknown:
        raise PartitionerError(f"launch order names {unknown[0]}, which the plan does not use (its nodes: "
                               f"{', '.join(plan_nodes)}); name the hosts as the cluster's nodes")
    missing = [n for n in plan_nodes if n not in names]
    if missing or len(set(names)) != len(names):
        what = f"leaves out node {missing[0]}" if missing else "names a node twice"
        raise PartitionerError(f"launch order {what}; the plan runs on {', '.join(plan_nodes)}")
    for host, count in order:
        if count is not None and count != plan_nodes[host].nproc and count != (slots or {}).get(host):
            raise PartitionerError(f"launch order gives {host} {count} slot(s); the plan runs {plan_nodes[host].nproc} "
                                   f"rank(s) there ({', '.join(devices[r] for r in plan_nodes[host].ranks)})")
    for k, (host, node) in enumerate(zip(names, nodes)):
        if host != node.node:
            r = node.ranks[0]
            raise PartitionerError(f"launch order starts {host} as node {k}, where the plan runs rank {r} on "
                                   f"{devices[r]}; start the nodes in the order {', '.join(x.node for x in nodes)}")
    return f"ok: nodes started in the order {', '.join(names)} hold the plan's rank -> device mapping"
