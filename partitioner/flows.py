"""Flows on shared resources: concurrent transfers divide a resource's bandwidth (max-min fair).

A node's GPUs reach other nodes through the node's NICs (``Node.nic_gbps``, ``Node.nics``): a
NIC is two resources, one per direction (full duplex), each of ``nic_gbps`` GB/s. A transfer
between GPUs of two nodes is a *flow*: it crosses the sender's NIC out and the receiver's NIC
in, and alone it would move at its link's rate (``Bandwidth.gbps_at`` of its size: the measured
curve, its own cap). Flows that overlap in time share each resource they cross, max-min fairly
(progressive filling: every flow gets an equal share of its tightest resource, and what a flow
capped elsewhere leaves is shared by the others), so

* bytes are conserved: a flow ends when its bytes are moved, at whatever rates it was given;
* no flow beats its link's rate, and no resource carries more than its bandwidth at any time.

A flow's latency (``Bandwidth.latency_s``, the per-message cost) is paid after its bytes, holding
no resource. :class:`FlowNet` is the state the event engine (:mod:`partitioner.events`) keeps:
flows start at the clock of their send, and :meth:`FlowNet.start` / :meth:`FlowNet.finish`
return the completion time each active flow has under the new rates. The closed form
(:meth:`partitioner.cost.CostModel.plan_iteration_s`) charges a cross-node message the rate it
gets when the plan's cross-node senders behind one NIC send at once (:func:`shared_rate_gbps`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .cluster import Cluster
    from .cost import SyncGroup
    from .plan import Plan

__all__ = ["FlowNet", "FlowSpec", "collective_sharers", "fair_rates", "nic_sharers", "shared_rate_gbps"]


@dataclass(frozen=True)
class FlowSpec:
    """What one kind of flow needs: the resources it crosses, its rate alone (bytes/s), the bytes
    it moves and the latency paid after them (s)."""

    resources: tuple[int, ...]
    rate_Bps: float
    nbytes: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.rate_Bps > 0 and math.isfinite(self.rate_Bps)):
            raise ValueError(f"rate_Bps = {self.rate_Bps}: must be a finite number > 0")
        if not (self.nbytes >= 0 and math.isfinite(self.nbytes)) or not self.latency_s >= 0:
            raise ValueError(f"nbytes = {self.nbytes}, latency_s = {self.latency_s}: must be finite and >= 0")

    @property
    def alone_s(self) -> float:
        """Seconds the flow takes with no other flow on its resources."""
        return self.latency_s + self.nbytes / self.rate_Bps


def fair_rates(caps: Sequence[float], routes: Sequence[Sequence[int]], capacity: Sequence[float]) -> list[float]:
    """Max-min fair rates of flows with their own ``caps`` crossing ``routes`` (resource indices)
    of ``capacity`` each (progressive filling)."""
    n = len(caps)
    rate = [0.0] * n
    left = list(capacity)
    todo = set(range(n))
    users: dict[int, set[int]] = {}
    for f in todo:
        for res in routes[f]:
            users.setdefault(res, set()).add(f)
    while todo:
        # the tightest resource share, and the smallest own cap, among flows not yet fixed
        share, tight = math.inf, -1
        for res, fs in users.items():
            live = len(fs & todo)
            if live and left[res] / live < share:
                share, tight = left[res] / live, res
        f_min = min(todo, key=lambda f: caps[f])
        if caps[f_min] <= share:
            fixed, value = {f_min}, caps[f_min]
        else:
            fixed, value = users[tight] & todo, share
        for f in fixed:
            rate[f] = value
            for res in routes[f]:
                left[res] = max(0.0, left[res] - value)
        todo -= fixed
    return rate


def shared_rate_gbps(alone_gbps: float, nic_gbps: Sequence[float], sharers: Sequence[int]) -> float:
    """The rate of one of ``sharers[i]`` flows that cross NIC ``i`` of ``nic_gbps[i]`` at once, each
    at most ``alone_gbps``: ``min(alone, min_i nic_i / sharers_i)`` (a flow capped below its fair
    share leaves the rest to the others, which :func:`fair_rates` shares out; when every flow is
    alike, as the closed form assumes, this is the fair rate)."""
    out = alone_gbps
    for cap, k in zip(nic_gbps, sharers, strict=True):
        if cap > 0 and k > 0:
            out = min(out, cap / k)
    return out


class FlowNet:
    """Active flows on the shared resources; all times are absolute seconds."""

    def __init__(self, capacity_Bps: Sequence[float], specs: Sequence[FlowSpec]):
        self.capacity = list(capacity_Bps)
        self.specs = list(specs)
        self.now = 0.0
        self.left: dict[int, float] = {}  # flow id -> bytes still to move
        self.rate: dict[int, float] = {}  # flow id -> bytes/s now
        self.spec_of: dict[int, int] = {}
        self.moved: dict[int, float] = {}  # per resource: bytes carried (for checks)
        self.on: dict[int, set[int]] = {}  # per resource: the active flows crossing it
        self._next = 0

    def _advance(self, t: float) -> None:
        dt = t - self.now
        if dt > 0:
            for f, r in self.rate.items():
                self.left[f] -= r * dt
                for res in self.specs[self.spec_of[f]].resources:
                    self.moved[res] = self.moved.get(res, 0.0) + r * dt
        self.now = max(self.now, t)

    def _reshare(self, resources: Sequence[int], also: Sequence[int] = ()) -> dict[int, float]:
        """Share out again the resources the flows connected to ``resources`` cross (through
        resources they share: max-min fair rates of other flows do not depend on them), with
        flows ``also``; their ends of bytes."""
        ids: set[int] = set(also)
        stack, seen = list(resources), set()
        while stack:
            res = stack.pop()
            if res in seen:
                continue
            seen.add(res)
            for f in self.on.get(res, ()):
                if f not in ids:
                    ids.add(f)
                    stack.extend(self.specs[self.spec_of[f]].resources)
        order = sorted(ids)
        specs = [self.specs[self.spec_of[f]] for f in order]
        rates = fair_rates([s.rate_Bps for s in specs], [s.resources for s in specs], self.capacity)
        self.rate.update(zip(order, rates, strict=True))
        return {f: self.now + max(0.0, self.left[f]) / self.rate[f] for f in order}

    def start(self, t: float, spec: int) -> tuple[int, Mapping[int, float]]:
        """A flow of ``specs[spec]`` starts at ``t``: its id, and the end of bytes of every active
        flow whose rate it changes (its own included)."""
        self._advance(t)
        f = self._next
        self._next += 1
        self.left[f] = self.specs[spec].nbytes
        self.spec_of[f] = spec
        for res in self.specs[spec].resources:
            self.on.setdefault(res, set()).add(f)
        return f, self._reshare(self.specs[spec].resources, (f,))

    def finish(self, t: float, flow: int) -> Mapping[int, float]:
        """Flow ``flow`` has moved its bytes at ``t``: the new ends of bytes of the flows whose
        rates it changes (the others keep theirs)."""
        self._advance(t)
        self.left.pop(flow)
        self.rate.pop(flow)
        resources = self.specs[self.spec_of.pop(flow)].resources
        for res in resources:
            self.on[res].discard(flow)
        return self._reshare(resources)

    def latency_s(self, flow_spec: int) -> float:
        return self.specs[flow_spec].latency_s


def nic_sharers(plan: Plan, cluster: Cluster) -> dict[tuple[str, int, str], int]:
    """Per NIC direction ``(node, nic, "out" | "in")``: how many of ``plan``'s devices send (out)
    or receive (in) pipeline messages across it. Replicas of a pipeline run in step, so these
    devices' messages cross the NIC at the same time, one message per device at a time where
    sends block the sender (the default): what the closed form charges. With overlapped sends
    (``overlap_comm``) a device's activation and gradient may be in flight together or not,
    as the schedule has it; the simulator times that, the closed form counts devices."""
    users: dict[tuple[str, int, str], set[str]] = {}
    for vw in plan.virtual_workers:
        for k, st in enumerate(vw.stages):
            for j in (k - 1, k + 1):
                if not 0 <= j < len(vw.stages):
                    continue
                peer = vw.stages[j].device
                for d in st.devices:
                    for node, nic, way, _ in cluster.nic_route(d, peer):
                        users.setdefault((node, nic, way), set()).add(d if way == "out" else peer)
    return {k: len(v) for k, v in users.items()}


def collective_sharers(groups: Sequence[SyncGroup], cluster: Cluster) -> dict[tuple[str, int, str], int]:
    """Per NIC direction ``(node, nic, "out" | "in")``: how many of the all-reduce ``groups`` cross
    it (a ring step between members on two nodes goes out of one NIC and into the other). A plan's
    all-reduces run at the end of its iteration, close together where they are long (on slow
    links, where sharing matters), so the closed form and the simulator both charge each group
    the NIC's bandwidth divided among the groups that cross it."""
    users: dict[tuple[str, int, str], set[int]] = {}
    for i, g in enumerate(groups):
        ring = list(g.devices)
        for a, b in zip(ring, ring[1:] + ring[:1], strict=True):
            for node, nic, way, _ in cluster.nic_route(a, b):
                users.setdefault((node, nic, way), set()).add(i)
    return {k: len(v) for k, v in users.items()}
