"""Heterogeneity emulation: a plan's GPU types played by this machine's device.

``partitioner train --emulate`` runs every rank of a plan on this machine (CPU processes and
gloo) and makes each rank as slow as the GPU type the plan gives its device, relative to the
others. The rule, per layer ``l``, GPU type ``T`` and direction (forward, backward):

    emulated_T(l) = local(l) * T(l) / ref(l)

``local(l)`` is the profile's time of the layer on this machine's device (``cpu``, measured by
``partitioner profile --device cpu``), ``T(l)`` its time on ``T`` (measured or projected) and
``ref(l)`` its time on the reference: a named type (``--emulate-reference``) or, by default, the
fastest on that layer of the cluster's GPU types that the profile has times for. So the fastest
type runs at this machine's real speed and a type ``k`` times slower is ``k`` times slower
here. (A layer with ``ref(l) = T(l) = 0`` keeps its local time; ``ref(l) = 0 < T(l)`` is
refused.)

The runtime cannot slow down single layers inside a stage, so it stretches each compute action
(forward or backward of one stage on one micro-batch) as a whole. With

    factor(stage, direction) = sum of emulated_T(l) / sum of local(l)   over the stage's layers

(1 when the local sum is 0) and ``target`` = the sum of ``emulated_T(l)`` (the emulated
profile's time of the stage), an action that computed for ``w`` seconds ends, by ``rule``:

* ``profiled`` (the default): at ``max(w, target)``, the emulated type's profiled time whenever
  this machine computed faster than that (an action that took longer is an *overrun*, counted
  and reported). With a reference faster than every type of the plan, every action has slack,
  and the run measures the schedule and the real communication rather than this machine's
  compute noise.
* ``scaled``: at ``w * factor``. This machine's real compute is kept, and its variations
  (other processes, shared memory bandwidth, cold caches after a sleep) are multiplied by the
  factor with it: on a 2-core machine a T4 played 8x slower than the reference ran 60 % over
  the prediction where ``profiled`` ran 4 % over (docs/runtime.md).

A stage that recomputes (``Stage.recompute``) runs its recomputed forward inside its backward:
its backward's target and local time both add that forward as the cost model prices it (the
whole forward under ``full``, the attention core's share under ``selective``:
``partitioner.recompute.recompute_extra_fwd_fraction``), and under a split backward it belongs to ``I``.

A zero-bubble schedule splits a backward into ``I`` (input gradient) and ``W`` (weight gradient):
each takes its part of the backward's target, ``1 - share`` and ``share`` with ``share`` the
stage's ``W`` over its backward as the simulator prices it (``EmulatedStage.bwd_weight_share``:
the emulated profile keeps every type's own split, its measured ``bwd_weight_share`` or, without
one, the estimate rule of ``Profile.backward_split_for``), so the run plays the ``I`` and ``W``
the model prices.

When the action takes its profiled local time, both rules give exactly the emulated profile's
time of the stage, which is what the simulator is given to predict the emulated run
(:func:`emulated_profile`, :func:`predict_emulated`). By default communication is not emulated:
sends and all-reduces are the real ones of this machine (gloo over loopback), so the prediction
prices every link at this machine's speed (:func:`emulated_cluster`). With ``links=True``
(``train --emulate-links``) the all-reduces between virtual workers (and WSP's pushes) take the
plan's cluster's time, dilated by the emulation's time scale
(:mod:`partitioner.emulated_links`), and the prediction prices the links the same way.

A factor below 1 cannot be played (emulation only adds time): with a named reference slower than
a type of the plan on some stage, the emulation is refused.

Torch-free: :mod:`runtime.emulation` applies the factors in the executors.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .cluster import Cluster, DeviceType, Node, gpu_family, resolve_gpu_type
from .cost import CostModel
from .emulated_links import EmulatedCollective, collectives, dilated_cluster, time_scale
from .errors import FormatError, OptionError, check
from .plan import Plan
from .pricing import CostOptions
from .profile import LayerTime, Profile
from .recompute import recompute_extra_fwd_fraction
from .schedule import spec
from .simulate import simulate_plan
from .timeline import Timeline

__all__ = ["EMULATION_RULES", "LOCAL_DEVICE", "LOCAL_LINK_GBPS", "EmulatedStage", "Emulation", "emulated_cluster",
           "emulated_cost", "emulated_profile", "emulation_for", "emulation_time_scale", "predict_emulated"]

LOCAL_DEVICE = "cpu"  # the profile key of this machine's own times (partitioner profile --device cpu)
# gloo over loopback on one machine, as examples/clusters/cpu4.yaml prices it
LOCAL_LINK_GBPS = 2.0
EMULATION_RULES = ("profiled", "scaled")  # how an action's end is set (module docstring)


@dataclass(frozen=True)
class EmulatedStage:
    """Stage ``stage`` of virtual worker ``worker`` (layers ``[start, stop)``) on ``device``, a
    ``gpu_type``: its forward and backward compute are stretched by these factors (>= 1); the
    emulated profile gives them ``fwd_s`` and ``bwd_s`` per micro-batch."""

    worker: int
    stage: int
    device: str
    gpu_type: str
    start: int
    stop: int
    fwd_factor: float
    bwd_factor: float
    fwd_s: float
    bwd_s: float
    # the weight-gradient part W of the backward's target, as the cost model splits it on the
    # emulated profile (``CostModel.backward_split_s``): a zero-bubble schedule's I takes
    # ``(1 - share) * bwd_s`` and its W ``share * bwd_s``
    bwd_weight_share: float = 0.5

    def __post_init__(self) -> None:
        check(isinstance(self.bwd_weight_share, (int, float)) and 0.0 <= self.bwd_weight_share <= 1.0,
              "bwd_weight_share", self.bwd_weight_share, "must be a number in [0, 1] (W's share of bwd_s)")
        for name in ("fwd_factor", "bwd_factor"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and math.isfinite(v) and v >= 1.0, name, v,
                  "must be a finite factor >= 1 (emulation only adds time)")
        for name in ("fwd_s", "bwd_s"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, name, v,
                  "must be a finite number of seconds >= 0")
        check(0 <= self.start < self.stop, "layers", [self.start, self.stop], "must be [start, stop), start < stop")


@dataclass(frozen=True)
class Emulation:
    """What ``train --emulate`` plays: the local device's profile key, the reference, the link
    speed the prediction assumes, and every stage's stretch factors."""

    local: str
    reference: str
    link_gbps: float
    stages: tuple[EmulatedStage, ...]
    rule: str = "profiled"
    # link emulation (``links=True``): the time scale of the emulated run (local / reference) and
    # every all-reduce between virtual workers with its emulated seconds; 0 and () when off
    time_scale: float = 0.0
    collectives: tuple[EmulatedCollective, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "collectives", tuple(self.collectives))
        check(isinstance(self.time_scale, (int, float)) and math.isfinite(self.time_scale) and self.time_scale >= 0,
              "time_scale", self.time_scale, "must be a finite number >= 0 (0: links not emulated)")
        check(not self.collectives or self.time_scale > 0, "collectives", len(self.collectives),
              "need the time scale of the emulated links")
        check(self.rule in EMULATION_RULES, "emulate_rule", self.rule, f"must be one of {', '.join(EMULATION_RULES)}",
              error=OptionError)
        check(bool(self.local), "local", self.local, "must name the profile's key of this machine's times")
        check(isinstance(self.link_gbps, (int, float)) and math.isfinite(self.link_gbps) and self.link_gbps > 0,
              "link_gbps", self.link_gbps, "must be a finite number of GB/s > 0")
        keys = [(s.device, s.stage) for s in self.stages]
        check(len(set(keys)) == len(keys), "stages", keys, "must name each (device, stage) once")

    def factors(self, device: str) -> dict[int, tuple[float, float]]:
        """Stage -> (forward, backward) factor of the stages ``device`` runs."""
        return {s.stage: (s.fwd_factor, s.bwd_factor) for s in self.stages if s.device == device}

    def targets_s(self, device: str) -> dict[int, tuple[float, float]]:
        """Stage -> (forward, backward) emulated seconds per micro-batch of the stages ``device`` runs."""
        return {s.stage: (s.fwd_s, s.bwd_s) for s in self.stages if s.device == device}

    def weight_shares(self, device: str) -> dict[int, float]:
        """Stage -> the weight-gradient share of the backward of the stages ``device`` runs (how a
        split backward's ``I`` and ``W`` divide the backward's target)."""
        return {s.stage: s.bwd_weight_share for s in self.stages if s.device == device}

    def gpu_type(self, device: str) -> str:
        return next((s.gpu_type for s in self.stages if s.device == device), "")

    @property
    def links(self) -> bool:
        """Whether the all-reduces between virtual workers take the plan's cluster's time."""
        return self.time_scale > 0

    def collective_s(self, devices: Iterable[str]) -> float | None:
        """Emulated seconds of the all-reduce over exactly ``devices`` (None: not emulated)."""
        want = sorted(devices)
        return next((c.seconds for c in self.collectives if sorted(c.devices) == want), None)

    def to_dict(self) -> dict[str, Any]:
        end = ("its measured compute time x the stage's factor" if self.rule == "scaled" else
               "the stage's emulated time, or its measured compute time when longer (an overrun)")
        return {"local": self.local, "reference": self.reference, "link_GBps": self.link_gbps, "rule": self.rule,
                "explained": "emulated(l) = local(l) * type(l) / reference(l) per layer; a forward or backward "
                             f"of a stage sleeps until its wall time is {end}; a split backward's I and W "
                             "take (1 - bwd_weight_share) and bwd_weight_share of the backward's",
                "stages": [{"worker": s.worker, "stage": s.stage, "device": s.device, "gpu_type": s.gpu_type,
                            "layers": [s.start, s.stop], "fwd_factor": s.fwd_factor, "bwd_factor": s.bwd_factor,
                            "fwd_s": s.fwd_s, "bwd_s": s.bwd_s, "bwd_weight_share": s.bwd_weight_share}
                           for s in self.stages],
                "links": ({"time_scale": self.time_scale,
                          "explained": "every all-reduce between virtual workers (and WSP's push) ends at its "
                                       "last member's start + the cost model's time on the plan's cluster x "
                                       "time_scale; sends between stages are this machine's",
                          "collectives": [c.to_dict() for c in self.collectives]}
                          if self.links else "not emulated: this machine's (gloo over loopback)")}


# -- the rule -----------------------------------------------------------------------------------


def _profile_key(profile: Profile, name: str, device_types: Mapping[str, DeviceType]) -> str | None:
    """The profile's key for GPU type ``name``: the same name, or one the catalog resolves to it."""
    if name in profile.gpu_types:
        return name
    try:
        want = resolve_gpu_type(name, device_types).name
    except FormatError:
        return None
    for key in profile.gpu_types:
        with contextlib.suppress(FormatError):
            if resolve_gpu_type(key, device_types).name == want:
                return key
    return next((key for key in profile.gpu_types if want in gpu_family(key)), None)  # a family key (A100)


def _have(profile: Profile) -> str:
    return ", ".join(profile.gpu_types) or "none"


def _local_times(profile: Profile, local: str) -> tuple[np.ndarray, np.ndarray]:
    if local not in profile.gpu_types:
        raise OptionError("emulate_local", local,
                          f"profile '{profile.model}' has no times for this machine's device '{local}' on every "
                          f"layer (it has: {_have(profile)}); measure them on the CPU (`partitioner "
                          f"profile {profile.model}`) and merge them into it (`partitioner profile merge`)")
    return profile.times_for(local)


def _reference(profile: Profile, types: Mapping[str, str], reference: str | None,
               device_types: Mapping[str, DeviceType]) -> tuple[str, np.ndarray, np.ndarray]:
    """(name, forward, backward) of the reference: ``reference``, or the fastest of ``types`` (GPU
    type -> the profile's key) per layer."""
    if reference is not None:
        key = _profile_key(profile, reference, device_types)
        if key is None:
            raise OptionError("emulate_reference", reference,
                              f"profile '{profile.model}' has no times for this GPU type (it has: {_have(profile)}); "
                              "name one of them")
        f, b = profile.times_for(key)
        return reference, f, b
    arrays = {t: profile.times_for(key) for t, key in types.items()}
    f = np.min([fb[0] for fb in arrays.values()], axis=0)
    b = np.min([fb[1] for fb in arrays.values()], axis=0)
    everywhere = [t for t, (tf, tb) in arrays.items() if np.array_equal(tf, f) and np.array_equal(tb, b)]
    name = everywhere[0] if everywhere else f"the fastest per layer of {', '.join(types)}"
    return name, f, b


def _ratio(profile: Profile, gpu: str, times: np.ndarray, ref: np.ndarray, ref_name: str, what: str) -> np.ndarray:
    bad = np.flatnonzero((ref <= 0) & (times > 0))
    if bad.size:
        layer = int(bad[0])
        raise FormatError(f"layers[{layer}].times.{ref_name}.{what}_s", float(ref[layer]),
                          f"the emulation's reference takes no time on layer {layer} "
                          f"({profile.layers[layer].name}) while {gpu} takes {times[layer]:.3g} s: no ratio to "
                          "play; name another `emulate_reference`")
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ref > 0, times / np.where(ref > 0, ref, 1.0), 1.0)


def _cluster_types(profile: Profile, cluster: Cluster, required: Iterable[str]) -> dict[str, str]:
    """GPU type -> the profile's key: every type in ``required`` (refused when missing), and the
    cluster's other types that the profile has times for."""
    out: dict[str, str] = {}
    for t in dict.fromkeys(required):
        key = _profile_key(profile, t, cluster.device_types)
        if key is None:
            raise OptionError("emulate", t,
                              f"the plan's GPU type {t} has no times in profile '{profile.model}' (it has: "
                              f"{_have(profile)}); project them to {t} (`partitioner profile "
                              f"project`)")
        out[t] = key
    for t in cluster.gpu_types:
        key = _profile_key(profile, t, cluster.device_types)
        if key is not None:
            out.setdefault(t, key)
    return out


def emulated_profile(profile: Profile, cluster: Cluster, *, local: str = LOCAL_DEVICE,
                     reference: str | None = None, required: Iterable[str] = ()) -> Profile:
    """``profile`` with the emulated times (see the module docstring) of every GPU type of
    ``cluster`` it has times for, under the cluster's names (the types in ``required`` must be
    among them). Optimizer-step times are the local ones (the step is not stretched)."""
    local_f, local_b = _local_times(profile, local)
    types = _cluster_types(profile, cluster, required)
    check(bool(types), "emulate", cluster.name,
          f"profile '{profile.model}' has times for no GPU type of cluster '{cluster.name}' "
          f"(it has: {_have(profile)})", error=OptionError)
    ref_name, ref_f, ref_b = _reference(profile, types, reference, cluster.device_types)
    update = profile.update_times_for(local)
    emulated: dict[str, list[LayerTime]] = {}
    for t, key in types.items():
        f, b = profile.times_for(key)
        ef = local_f * _ratio(profile, t, f, ref_f, ref_name, "fwd")
        eb = local_b * _ratio(profile, t, b, ref_b, ref_name, "bwd")
        # the backward keeps the type's own split (its measured share, or none: the estimate rule)
        shares = [layer.times[key].bwd_weight_share for layer in profile.layers]
        emulated[t] = [LayerTime(float(x), float(y), measured_on=f"emulated on {local}", update_s=float(u),
                                 bwd_weight_share=w)
                       for x, y, u, w in zip(ef, eb, update, shares, strict=True)]
    # only the local times and the emulated ones: a type's other keys (aliases) and the times at
    # other micro-batch sizes would otherwise be priced in their place
    layers = tuple(replace(layer, times={local: layer.times[local], **{t: ts[i] for t, ts in emulated.items()}},
                           times_at={})
                   for i, layer in enumerate(profile.layers))
    return replace(profile, layers=layers, meta={**profile.meta, "emulated": {"local": local, "reference": ref_name}})


def _weight_share(emu: Profile, gpu: str, start: int, stop: int, redo_s: float = 0.0) -> float:
    """W's share of the backward of layers ``[start, stop)`` on ``gpu`` in the emulated profile,
    as the simulator prices a split backward (``Profile.backward_split_for``; 0.5 for a stage
    whose backward takes no time); ``redo_s``, a recomputed forward in it, belongs to ``I``."""
    b_in, b_w, _ = emu.backward_split_for(gpu)
    total = float(np.sum(b_in[start:stop]) + np.sum(b_w[start:stop])) + redo_s
    return min(max(float(np.sum(b_w[start:stop])) / total, 0.0), 1.0) if total > 0 else 0.5


def emulation_time_scale(profile: Profile, cluster: Cluster, *, local: str = LOCAL_DEVICE,
                         reference: str | None = None, required: Iterable[str] = ()) -> float:
    """How much slower the emulated run is than the real cluster: the model's local time over
    the reference's (:func:`partitioner.emulated_links.time_scale`)."""
    types = _cluster_types(profile, cluster, required)
    _, ref_f, ref_b = _reference(profile, types, reference, cluster.device_types)
    return time_scale(_local_times(profile, local), (ref_f, ref_b))


def emulation_for(plan: Plan, profile: Profile, cluster: Cluster, *, local: str = LOCAL_DEVICE,
                  reference: str | None = None, link_gbps: float = LOCAL_LINK_GBPS, rule: str = "profiled",
                  links: bool = False) -> Emulation:
    """The stretch factors of every stage of ``plan`` (refused in one line: no local times, a
    type of the plan or the reference without times, a factor below 1); with ``links``, the
    emulated seconds of every all-reduce between virtual workers as well."""
    check(isinstance(link_gbps, (int, float)) and math.isfinite(link_gbps) and link_gbps > 0,
          "emulate_link_gbps", link_gbps, "must be a number of GB/s > 0", error=OptionError)
    plan_types = [cluster.device(d).gpu_type for vw in plan.virtual_workers for st in vw.stages for d in st.devices]
    emu = emulated_profile(profile, cluster, local=local, reference=reference, required=plan_types)
    ref_name = str(emu.meta["emulated"]["reference"])
    local_f, local_b = profile.times_for(local)
    lf = np.concatenate([[0.0], np.cumsum(local_f)])
    lb = np.concatenate([[0.0], np.cumsum(local_b)])
    stages = []
    for w, vw in enumerate(plan.virtual_workers):
        for k, st in enumerate(vw.stages):
            # a recomputing stage's backward runs its recomputed forward too, as the cost model prices it
            again = recompute_extra_fwd_fraction(emu, st.recompute)[st.start:st.stop]
            redo_local = float(np.sum(np.asarray(local_f)[st.start:st.stop] * again))
            for d in st.devices:
                gpu = cluster.device(d).gpu_type
                ef, eb = emu.times_for(gpu)
                redo = float(np.sum(np.asarray(ef)[st.start:st.stop] * again))
                factors, targets = [], []
                for emu_t, pre, what, extra, extra_local in ((ef, lf, "forward", 0.0, 0.0),
                                                             (eb, lb, "backward", redo, redo_local)):
                    base = float(pre[st.stop] - pre[st.start]) + extra_local
                    target = float(np.sum(emu_t[st.start:st.stop])) + extra
                    targets.append(target)
                    x = target / base if base > 0 else 1.0
                    if x < 1.0 - 1e-9:
                        raise OptionError("emulate_reference", reference,
                                          f"device {d} ({gpu}) would run stage {k} of virtual worker {w} "
                                          f"({what}) in {x:.3g}x this machine's time: emulation can only slow "
                                          "down; name a type at least as fast as every type of the plan, or "
                                          "leave `emulate_reference` out (the fastest type per layer)")
                    factors.append(max(x, 1.0))
                stages.append(EmulatedStage(w, k, d, gpu, st.start, st.stop, factors[0], factors[1], targets[0], targets[1],
                                            bwd_weight_share=_weight_share(emu, gpu, st.start, st.stop, redo)))
    if not links:
        return Emulation(local, ref_name, float(link_gbps), tuple(stages), rule)
    executor = spec(plan.schedule).executor  # (the runtime's executor: 2bw's all-reduce has no delay)
    check(executor != "2bw", "emulate_links", plan.schedule,
          "the 2bw all-reduce is not emulated: use a flushing schedule or wsp", error=OptionError)
    scale = emulation_time_scale(profile, cluster, local=local, reference=reference, required=plan_types)
    return Emulation(local, ref_name, float(link_gbps), tuple(stages), rule, scale,
                     collectives(plan, profile, dilated_cluster(cluster, scale)))


def emulated_cluster(cluster: Cluster, link_gbps: float = LOCAL_LINK_GBPS) -> Cluster:
    """``cluster`` with every link at ``link_gbps`` (the emulated run's real communication:
    processes of one machine), its devices, types and nodes unchanged."""
    nodes = tuple(Node(n.name, n.gpus, float(link_gbps)) for n in cluster.nodes)
    return Cluster(f"{cluster.name} (emulated)", nodes, float(link_gbps), cluster.device_types)


def predict_emulated(plan: Plan, profile: Profile, cluster: Cluster, *, local: str = LOCAL_DEVICE,
                     reference: str | None = None, link_gbps: float = LOCAL_LINK_GBPS,
                     options: CostOptions | None = None, iterations: int | None = None,
                     links: bool = False) -> Timeline:
    """The simulator's timeline of ``plan`` as ``train --emulate`` runs it: the emulated times of
    the plan's GPU types, every link at ``link_gbps`` or, with ``links`` (``--emulate-links``),
    the plan's cluster's links dilated by the emulation's time scale."""
    cost = emulated_cost(plan, profile, cluster, local=local, reference=reference, link_gbps=link_gbps,
                         options=options, links=links)
    return simulate_plan(plan, cost.profile, cost.cluster, options, iterations, cost=cost)


def emulated_cost(plan: Plan, profile: Profile, cluster: Cluster, *, local: str = LOCAL_DEVICE,
                  reference: str | None = None, link_gbps: float = LOCAL_LINK_GBPS,
                  options: CostOptions | None = None, links: bool = False) -> CostModel:
    """The cost model :func:`predict_emulated` simulates with (its closed forms price the plan
    as ``train --emulate`` runs it)."""
    plan_types = [cluster.device(d).gpu_type for d in plan.devices]
    emu = emulated_profile(profile, cluster, local=local, reference=reference, required=plan_types)
    if links:
        scale = emulation_time_scale(profile, cluster, local=local, reference=reference, required=plan_types)
        net = dilated_cluster(cluster, scale)
    else:
        net = emulated_cluster(cluster, link_gbps)
    return CostModel(emu, net, options)
