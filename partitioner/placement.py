"""Where a plan's stages run: pipelines, devices, the rank of every stage, said once.

A virtual worker of ``S`` stages over ``p`` devices runs stage ``s`` on pipeline rank ``s % p``
(chunk ``s // p``): with ``chunks = v`` the stage count is ``p * v`` and stage ``c*p + d`` is
on the device of stage ``d``. ZB-V's V (schedule ``zbv``, two chunks) deals the second chunk
back up the devices: stage ``p + d`` is on the device of stage ``p - 1 - d``, so the device of
stage ``p - 1`` also runs stage ``p`` (no transfer at the turn) and the first device holds the
first and the last stage (:func:`partitioner.schedule.stage_rank`, the rule both this module and
the action lists follow). A replicated stage (``Stage.replicas``) is one pipeline position
held by several devices, one chunk per device; its micro-batches are shared among the replicas
in proportion to their speed (:func:`replica_shares`). :func:`place` applies and checks these
rules for the simulator and the runtime alike, and :func:`supports` says before any run what
a target cannot execute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import FormatError
from .plan import Plan
from .schedule import spec, stage_rank

__all__ = ["RECOMPUTED_SCHEDULES", "REPLICATED_SCHEDULES", "TARGETS", "PipelinePlacement", "place", "replica_assignment", "replica_shares",
           "supports"]


@dataclass(frozen=True)
class PipelinePlacement:
    """One virtual worker's pipeline: ``ranks`` positions, the device of each (the first of a
    replicated stage), the layer range of each stage, and each position's devices when a stage
    is replicated."""

    worker: int
    ranks: int
    devices: tuple[str, ...]
    stages: tuple[tuple[int, int], ...]
    replicas: tuple[tuple[str, ...], ...] = ()
    placement: str = "loop"  # how stages are dealt to ranks (ScheduleSpec.placement)

    def rank_of(self, stage: int) -> int:
        """The pipeline rank of ``stage``."""
        return stage_rank(stage, self.ranks, self.placement)

    def held(self, rank: int) -> tuple[tuple[int, int], ...]:
        """The layer ranges of the stages pipeline rank ``rank`` runs, in stage order."""
        if self.replicas:
            return (self.stages[rank],)
        return tuple(st for s, st in enumerate(self.stages) if self.rank_of(s) == rank)


def place(plan: Plan) -> list[PipelinePlacement]:
    """Every virtual worker's pipeline, or a one-line error naming the broken rule: a device in
    two virtual workers, a stage count that is not a multiple of ``chunks``, the first ``p``
    stages not on ``p`` distinct devices, or stage ``c*p + d`` off the device of stage ``d``."""
    out = []
    v = plan.chunks
    rule = spec(plan.schedule).placement
    owner: dict[str, int] = {}
    for w, vw in enumerate(plan.virtual_workers):
        where = f"virtual_workers[{w}]"
        for k, st in enumerate(vw.stages):
            for dev in st.devices:
                if owner.setdefault(dev, w) != w:
                    raise FormatError(f"{where}.stages[{k}].device", dev,
                                      f"already used by virtual_workers[{owner[dev]}]: a device runs one virtual worker")
        if any(st.replicas for st in vw.stages):
            if v != 1:
                raise FormatError(f"{where}.stages", [s.device for s in vw.stages],
                                  f"replicated stages run one chunk per device; chunks={v} is not supported with them")
            out.append(PipelinePlacement(w, len(vw.stages), tuple(st.device for st in vw.stages),
                                         tuple(st.layers for st in vw.stages), tuple(st.devices for st in vw.stages)))
            continue
        n = len(vw.stages)
        if n % v != 0:
            raise FormatError(f"{where}.stages", n, f"with chunks={v} the stage count must be a multiple "
                              f"of {v} (p devices x {v} chunks); nearest valid: {max(v, n - n % v)} or "
                              f"{n - n % v + v}")
        p = n // v
        devs = tuple(vw.stages[d].device for d in range(p))
        if len(set(devs)) != p:
            raise FormatError(f"{where}.stages", [s.device for s in vw.stages],
                              f"the first {p} stages must be on {p} distinct devices (chunks={v})")
        for s, st in enumerate(vw.stages):
            want = devs[stage_rank(s, p, rule)]
            if st.device != want:
                how = ("stage p + d runs on the device of stage p - 1 - d (the V of zbv)" if rule == "v"
                       else "stage c*p + d runs on the device of stage d")
                raise FormatError(f"{where}.stages[{s}].device", st.device,
                                  f"with chunks={v}, stage {s} (chunk {s // p}) must be on {want}: {how}")
        out.append(PipelinePlacement(w, p, devs, tuple(st.layers for st in vw.stages), placement=rule))
    return out


def replica_shares(times_s: Sequence[float], micro_batches: int) -> np.ndarray:
    """The replica of each micro-batch for replicas taking ``times_s`` per micro-batch: each next
    one goes to the replica that would finish it first, so shares follow the replicas' speeds."""
    count = [0] * len(times_s)
    out = np.empty(micro_batches, dtype=np.int64)
    for j in range(micro_batches):
        i = min(range(len(times_s)), key=lambda r: ((count[r] + 1) * times_s[r], r))
        out[j] = i
        count[i] += 1
    return out


def replica_assignment(plan: Plan, time_s: Callable[[str, int, int], float] | None = None
                       ) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Virtual worker -> stage -> the replica (index into ``Stage.devices``) of each micro-batch of
    an iteration's action lists (``Plan.micro_batching.count``: a slice of a sliced first
    micro-batch counts as one), by :func:`replica_shares` on ``time_s(device, start, stop)``, the
    seconds the device takes for the stage's layers per micro-batch (the simulator uses the cost
    model's forward + backward time); ``None``: equal times, so micro-batches go round-robin. A
    stage without replicas gives every micro-batch to its device (index 0)."""
    m = plan.micro_batching.count
    out = []
    for vw in plan.virtual_workers:
        per_stage = []
        for st in vw.stages:
            if not st.replicas:
                per_stage.append((0,) * m)
                continue
            times = [1.0 if time_s is None else float(time_s(d, st.start, st.stop)) for d in st.devices]
            per_stage.append(tuple(int(i) for i in replica_shares(times, m)))
        out.append(tuple(per_stage))
    return tuple(out)


# What each target executes: the simulator every plan the planner makes; the runtime every
# schedule, a sliced first micro-batch, replicated stages with the one-chunk schedules
# (runtime/layout.py).
TARGETS = ("simulator", "runtime")
REPLICATED_SCHEDULES = ("gpipe", "1f1b", "2bw", "wsp")  # the schedules whose replicated stages the runtime executes
# the schedules whose executors run a recomputing stage (every schedule: runtime/executor.py recomputes a
# full stage's forward inside its backward, the I of a split one; on tensor-parallel groups too)
RECOMPUTED_SCHEDULES = ("gpipe", "1f1b", "interleaved", "bfs", "zb-h1", "zb-h2", "zbv", "2bw", "wsp")


def supports(plan: Plan, target: str) -> str | None:
    """None when ``target`` can run ``plan``, else the reason it cannot (one line)."""
    if target not in TARGETS:
        raise FormatError("target", target, f"must be one of {', '.join(TARGETS)}")
    try:
        place(plan)
    except FormatError as err:
        return str(err)
    if target == "simulator":
        return None
    if plan.layer_order is not None:
        return ("layer_order: the stages are convex sets of the model's graph, not ranges of its layer list; the "
                "runtime runs ranges of the layer list; plan the chain order (the dp solver, or `chain_order`)")
    sp = spec(plan.schedule)
    if plan.staleness != 0 and sp.sync != "wave":
        return (f"staleness = {plan.staleness} with schedule '{plan.schedule}': the runtime keeps virtual workers of "
                f"a flushing schedule exactly synchronous; bounded staleness needs schedule wsp")
    if plan.pricing is not None and plan.pricing.zero and sp.executor != "pipeline":
        return (f"zero = {plan.pricing.zero} with schedule '{plan.schedule}': the runtime shards optimizer state under "
                "the flushing schedules (gpipe, 1f1b, interleaved, bfs, zb-h1, zb-h2, zbv); the "
                f"{plan.schedule} executor keeps its own weight versions and steps them with plain SGD; re-plan "
                "with `zero` 0 or a flushing schedule")
    for w, vw in enumerate(plan.virtual_workers):
        for k, st in enumerate(vw.stages):
            if st.recompute != "none" and sp.name not in RECOMPUTED_SCHEDULES:
                return (f"virtual_workers[{w}].stages[{k}] recomputes ({st.recompute}): the runtime recomputes "
                        f"stages under {', '.join(RECOMPUTED_SCHEDULES)}, not under '{plan.schedule}'; re-plan "
                        "with `recompute` none or one of those schedules")
            if st.replicas and plan.schedule not in REPLICATED_SCHEDULES:
                return (f"virtual_workers[{w}].stages[{k}] has replicas {list(st.replicas)}: the runtime executes "
                        f"replicated stages with schedule {', '.join(REPLICATED_SCHEDULES[:-1])} or "
                        f"{REPLICATED_SCHEDULES[-1]}, not "
                        f"'{plan.schedule}'; re-plan without `replication` or with one of those schedules")
    return _tensor_parallel_support(plan)


def _tensor_parallel_support(plan: Plan) -> str | None:
    """Why the runtime cannot run ``plan``'s tensor-parallel groups, or None: 2bw and wsp keep their
    weights outside the stage modules (no shards), and a layer's gradients are averaged between
    shards of one degree, so every device that holds a layer holds it at the same degree."""
    held: dict[int, tuple[int, str, str]] = {}  # layer -> (degree, where, device) of its first holder
    for w, vw in enumerate(plan.virtual_workers):
        for k, st in enumerate(vw.stages):
            for i, (dev, t) in enumerate(zip(st.devices, st.tensor_parallel, strict=True)):
                where = f"virtual_workers[{w}].stages[{k}]" + (f".replicas[{i - 1}]" if i else "")
                if t > 1 and spec(plan.schedule).executor != "pipeline":
                    return (f"{where} runs on {dev}, a tensor-parallel group of {t}: the runtime shards stages with "
                            f"the flushing schedules, not '{plan.schedule}' (its weights are kept outside the "
                            f"stage modules); re-plan without tensor-parallel groups or with a flushing schedule")
                for layer in range(st.start, st.stop):
                    first = held.setdefault(layer, (t, where, dev))
                    if first[0] != t:
                        return (f"layer {layer} is held at tensor-parallel degree {first[0]} by {first[1]} ({first[2]}) "
                                f"and {t} by {where} ({dev}): the runtime averages a layer's gradients between "
                                f"shards of one degree; plan every holder of a layer at the same degree")
    return None
