"""Link emulation: the plan's links, played on one machine in the emulation's time.

Under ``train --emulate`` the reference GPU type runs at this machine's speed, so the emulated
run is slower than the real cluster by the *time scale*

    time_scale = sum over layers of local(l) / sum over layers of ref(l)   (forward + backward)

(about 100 when a CPU plays an H100). Its compute is stretched by exactly that much on the
reference and proportionally on the other types (:mod:`partitioner.emulation`). Communication
played at the real links' speed would then be ``time_scale`` times too cheap against compute;
played at this machine's loopback it is nearly free. With link emulation
(``train --emulate-links``), every collective between virtual workers takes what the cost model
gives it on the plan's cluster, times the time scale: equivalently, the cost model's price on
:func:`dilated_cluster`, whose every link is ``time_scale`` times slower (bandwidths divided,
latencies multiplied). The simulator predicts the emulated run on the emulated profile and that
cluster (:func:`partitioner.emulation.predict_emulated`), so prediction and run see the same
ratio of communication to compute as the real cluster.

Emulated: the data-parallel gradient all-reduce between the holders of the same layers, and
WSP's push (an all-reduce of a wave's update over the same holders), each priced
:meth:`partitioner.cost.CostModel.allreduce_s` on its holders' devices. Not emulated:
activations and gradients sent between the stages of a pipeline (a receiver cannot know when
its sender posted a message without a second message; they stay this machine's real sends).
:func:`collectives` lists the holder sets; :mod:`runtime.emulation` makes each collective end at
the latest member's start plus its emulated seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .bandwidth import Bandwidth
from .cluster import Cluster, Link, Node
from .cost import CostModel
from .errors import check
from .plan import Plan
from .profile import Profile

__all__ = ["EmulatedCollective", "collectives", "dilated_cluster", "time_scale"]


@dataclass(frozen=True)
class EmulatedCollective:
    """The all-reduce over ``devices`` of the gradients (or WSP updates) of ``layers``:
    ``nbytes`` of them, ``seconds`` in the emulation's time (the plan's cluster, dilated)."""

    devices: tuple[str, ...]
    layers: tuple[int, ...]
    nbytes: float
    seconds: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "layers", tuple(self.layers))
        check(len(self.devices) >= 2 and len(set(self.devices)) == len(self.devices), "devices", list(self.devices),
              "must name two or more distinct devices")
        check(bool(self.layers), "layers", list(self.layers), "must name one layer or more")
        for name in ("nbytes", "seconds"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, name, v, "must be a finite number >= 0")

    def to_dict(self) -> dict[str, object]:
        return {"devices": list(self.devices), "layers": [min(self.layers), max(self.layers) + 1],
                "bytes": self.nbytes, "seconds": self.seconds}


def time_scale(local: tuple[np.ndarray, np.ndarray], reference: tuple[np.ndarray, np.ndarray]) -> float:
    """How much slower the emulated run is than the real cluster: the local time of the whole
    model (forward + backward) over the reference's (1 when the reference takes no time)."""
    loc = float(np.sum(local[0]) + np.sum(local[1]))
    ref = float(np.sum(reference[0]) + np.sum(reference[1]))
    return loc / ref if ref > 0 and loc > 0 else 1.0


def _dilate(bw: Bandwidth, k: float) -> Bandwidth:
    return replace(bw, gbps=bw.gbps / k, latency_s=bw.latency_s * k,
                   points=tuple((n, b / k) for n, b in bw.points),
                   log2_mb_poly=tuple(c / k for c in bw.log2_mb_poly))


def dilated_cluster(cluster: Cluster, scale: float) -> Cluster:
    """``cluster`` with every link ``scale`` times slower: bandwidths (flat, curve points and
    polynomial) divided by ``scale``, latencies multiplied; devices, types and nodes unchanged.
    Every transfer and all-reduce it prices takes ``scale`` times as long."""
    check(isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0, "time_scale", scale,
          "must be a finite number > 0")
    nodes = tuple(Node(n.name, n.gpus, n.intra_gbps / scale,
                       _dilate(n.intra_curve, scale) if n.intra_curve is not None else None) for n in cluster.nodes)
    links = tuple(Link(x.a, x.b, x.gbps / scale, _dilate(x.curve, scale) if x.curve is not None else None)
                  for x in cluster.links)
    inter = _dilate(cluster.inter_curve, scale) if cluster.inter_curve is not None else None
    return Cluster(f"{cluster.name} (links x{scale:.3g} slower: emulated time)", nodes, cluster.inter_gbps / scale,
                   cluster.device_types, links, inter)


def collectives(plan: Plan, profile: Profile, cluster: Cluster) -> tuple[EmulatedCollective, ...]:
    """Every set of two or more devices that hold the same layers in ``plan`` (the virtual
    workers' holders of each layer, replicas included), with the bytes of those layers'
    gradients and the all-reduce's seconds on ``cluster`` (:meth:`CostModel.allreduce_s`, in
    the order the devices first appear). One entry per distinct holder set, layers in order."""
    holders: dict[tuple[str, ...], list[int]] = {}
    for pos in range(profile.num_layers):  # positions in the plan's order (Plan.profile_view)
        key: list[str] = []
        for vw in plan.virtual_workers:
            st = next(s for s in vw.stages if s.start <= pos < s.stop)
            key.extend(st.devices)
        holders.setdefault(tuple(key), []).append(pos)
    cost = CostModel(plan.profile_view(profile), cluster)
    out = []
    for devices, layers in holders.items():
        if len(devices) < 2:
            continue
        nbytes = sum(cost.param_bytes(x, x + 1) for x in layers)
        out.append(EmulatedCollective(devices, tuple(layers), nbytes, cost.allreduce_s(nbytes, devices)))
    return tuple(out)
