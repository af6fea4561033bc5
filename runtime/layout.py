"""Which process runs what: a plan's devices as ``torch.distributed`` ranks.

Rank order: virtual worker 0's devices first, in the order its pipeline first uses them
(stage 0's device, stage 1's, ...), then virtual worker 1's, and so on -- the order of
``Plan.devices``. Inside a virtual worker of ``p`` devices, the device of stage ``s`` is
pipeline rank ``s % p`` (chunk ``s // p`` for interleaved / bfs; ZB-V's V deals the second chunk
back, :func:`partitioner.schedule.stage_rank`), as in ``partitioner.schedule``.

A replicated stage (``Stage.replicas``, schedules gpipe and 1f1b, one chunk) is one pipeline
position held by several ranks, one per device of ``Stage.devices``, numbered position after
position (``VirtualWorker.devices``' order): each replica runs the micro-batches
:func:`partitioner.placement.replica_assignment` gives it (``Layout.assignment``), and its
action list is its position's list kept to those micro-batches, with every send and receive
addressed to the neighbouring stage's replica that holds the same micro-batch
(:meth:`Layout.actions`, the simulator's own derivation).

Tensor parallelism: a plan device ``NODE:FIRST-LAST`` is a group of ``t = LAST - FIRST + 1``
GPUs (:func:`partitioner.plan.group_size`) that runs its stages' shards Megatron-style
(:mod:`runtime.tensor_parallel`). It is ``t`` consecutive ranks, in GPU order: the rank of the
device's place in the order above is its first GPU's (tensor-parallel index 0), the next ``t - 1``
ranks its other GPUs (``RankInfo.tp_rank``, ``RankInfo.gpu``). Everything said of a device above
is said of the group: its pipeline rank, its stages and its action list are the same on its ``t``
ranks, and ``pipelines``, ``stage_ranks`` and the action lists' peers name each device by its
first rank. The pipeline's messages carry a stage's replicated output (or input gradient), and
**every rank receives from the rank of the sending group whose index is its own index modulo
the sending group's degree** (:meth:`Layout.peers`, :meth:`Layout.send_to`): between groups of
the same degree, index ``i`` talks to index ``i``; from a group of ``a`` to a group of ``b > a``
ranks, sender ``i`` sends to every receiver ``j`` with ``j % a == i``; from ``a > b``, senders
``i >= b`` send nothing (each message is one copy of the same replicated tensor). The same rule
carries the gradients back.

Data parallelism: layer ``l`` is held by the ranks of its stage in every virtual worker (every
replica of a replicated stage); those ranks form the layer's *holder set*. Layers with the same
holder set are averaged together, in one all-reduce over a process group of exactly those
ranks (:func:`holder_sets`). Under tensor parallelism a layer's holders are its shards' holders:
one holder set per tensor-parallel index ``i``, the ranks of index ``i`` of every device that holds
the layer, all of the same degree (a layer held at two degrees is refused,
:func:`partitioner.placement.supports`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from partitioner.channels import Message, channel_order
from partitioner.errors import FormatError, PartitionerError
from partitioner.placement import PipelinePlacement, place, replica_assignment, supports
from partitioner.plan import Plan, group_size
from partitioner.schedule import (
    Action,
    build_schedule,
    check_schedule,
    schedule_columns,
    to_actions,
)
from partitioner.simulate import _replicated_ranks

__all__ = ["Layout", "RankInfo", "plan_layout"]


@dataclass(frozen=True)
class RankInfo:
    """One process: its device (the plan's name, a group ``NODE:FIRST-LAST`` under tensor
    parallelism), virtual worker, pipeline rank (its device's index among the worker's devices) and
    stages (global indices); ``replica`` indexes ``Stage.devices`` of its stage; ``tp_rank`` is its
    index in its device's tensor-parallel group of ``tp_size`` ranks."""

    rank: int
    device: str
    worker: int
    pipe_rank: int
    stages: tuple[int, ...]
    replica: int = 0
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def gpu(self) -> str:
        """The one GPU this process runs on: ``NODE:INDEX`` (the ``tp_rank``-th of a group)."""
        if self.tp_size == 1:
            return self.device
        node, _, span = self.device.rpartition(":")
        return f"{node}:{int(span.partition('-')[0]) + self.tp_rank}"

    @property
    def tp_group(self) -> tuple[int, ...]:
        """The ranks of this process's tensor-parallel group (itself alone at degree 1)."""
        first = self.rank - self.tp_rank
        return tuple(range(first, first + self.tp_size))


@dataclass(frozen=True)
class Layout:
    """The plan mapped onto ranks ``0 .. world_size - 1`` (a device of tensor-parallel degree ``t``
    is ``t`` consecutive ranks; ``pipelines`` and ``stage_ranks`` name each device by its first)."""

    plan: Plan
    ranks: tuple[RankInfo, ...]
    pipelines: tuple[tuple[int, ...], ...]  # worker -> pipeline rank -> global rank (a group's first)
    stage_layers: tuple[tuple[tuple[int, int], ...], ...]  # worker -> stage -> (start, stop)
    num_layers: int
    stage_ranks: tuple[tuple[tuple[int, ...], ...], ...] = ()  # worker -> stage -> global ranks (replicas; a group's first)
    # worker -> stage -> the replica of each micro-batch (replica_assignment)
    assignment: tuple[tuple[tuple[int, ...], ...], ...] = ()
    placements: tuple[PipelinePlacement, ...] = ()

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def workers(self) -> int:
        return len(self.pipelines)

    def global_rank(self, worker: int, pipe_rank: int) -> int:
        return self.pipelines[worker][pipe_rank]

    @property
    def tensor_parallel(self) -> bool:
        """Whether any device is a tensor-parallel group of more than one rank."""
        return any(r.tp_size > 1 for r in self.ranks)

    def holder_sets(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(ranks, layers)`` for every distinct set of ranks that hold the same layers (the same
        shard of them: one set per tensor-parallel index), in the order of their first layer (every
        rank walks this list in the same order)."""
        holders: dict[tuple[int, ...], list[int]] = {}
        for layer in range(self.num_layers):
            firsts: list[int] = []
            for w, stages in enumerate(self.stage_layers):
                s = next(k for k, (a, b) in enumerate(stages) if a <= layer < b)
                firsts.extend(self.stage_ranks[w][s])
            for i in range(self.ranks[firsts[0]].tp_size):  # one degree per layer (supports())
                holders.setdefault(tuple(sorted(r + i for r in firsts)), []).append(layer)
        return [(ranks, tuple(layers)) for ranks, layers in holders.items()]

    def peers(self, rank: int) -> tuple[int, ...]:
        """Pipeline rank -> the global rank ``rank`` receives that device's messages from: the rank
        of index ``tp_rank % t`` of the device's group of ``t`` (its first rank when ``t = 1``); the
        action lists' peers are pipeline ranks of the worker."""
        me = self.ranks[rank]
        return tuple(first + me.tp_rank % self.ranks[first].tp_size for first in self.pipelines[me.worker])

    def send_to(self, rank: int) -> dict[int, tuple[int, ...]]:
        """Pipeline rank -> the global ranks a message of ``rank`` to that device goes to: every rank
        ``j`` of its group with ``j % t_me == tp_rank`` (none, or several, when the degrees differ),
        so that each receives from the rank :meth:`peers` names."""
        me = self.ranks[rank]
        out = {}
        for d, first in enumerate(self.pipelines[me.worker]):
            t = self.ranks[first].tp_size
            out[d] = tuple(first + j for j in range(t) if j % me.tp_size == me.tp_rank)
        return out

    def replicated(self, worker: int) -> bool:
        return any(len(r) > 1 for r in self.stage_ranks[worker])

    def actions(self, rank: int, iterations: int = 1) -> list[Action]:
        """Rank ``rank``'s action list for ``iterations`` iterations of the plan's schedule (a
        flushing schedule's list is one iteration, run once per step; 2bw and wsp run the whole run
        as one list): its pipeline rank's list of ``build_schedule`` over the
        ``Plan.micro_batching.count`` micro-batches of an iteration (a sliced first micro-batch is
        ``first_slices`` of them); for a replica, its position's list kept to the micro-batches it
        is assigned, its peers the replicas that hold the same micro-batches (with the deeper
        1F1B warm-up the simulator gives replicated pipelines)."""
        me = self.ranks[rank]
        return self.pipeline_actions(me.worker, iterations)[me.pipe_rank]

    def pipeline_actions(self, worker: int, iterations: int = 1) -> list[list[Action]]:
        """Every pipeline rank's action list of virtual worker ``worker`` (:meth:`actions`)."""
        plan, pipe = self.plan, self.placements[worker]
        m_run = plan.micro_batching.count
        if not self.replicated(worker):
            return build_schedule(plan.schedule, len(self.pipelines[worker]), m_run, plan.chunks, iterations,
                                  plan.staleness)
        depths = [sum(len(r) for r in pipe.replicas[k + 1:]) for k in range(pipe.ranks)]
        cols = schedule_columns(plan.schedule, pipe.ranks, m_run, plan.chunks, iterations, plan.staleness, depths)
        assign = [np.asarray(a, dtype=np.int64) for a in self.assignment[worker]]
        return [to_actions(ranked[2]) for ranked in _replicated_ranks(pipe, cols, assign, m_run)]

    def channels(self, rank: int, iterations: int = 1) -> dict[int, list[Message]]:
        """Per pipeline rank that rank ``rank`` exchanges messages with: those messages in the
        order both ends post them (:func:`partitioner.channels.channel_order` over the lists of
        :meth:`actions`)."""
        me = self.ranks[rank]
        return channel_order(self.pipeline_actions(me.worker, iterations))[me.pipe_rank]


def plan_layout(plan: Plan, num_layers: int, model: str = "",
                assignment: Sequence[Sequence[Sequence[int]]] | None = None) -> Layout:
    """Map ``plan`` onto ranks, refusing what the runtime does not execute (one line each).
    ``model`` names the model of ``num_layers`` layers in the messages. ``assignment``: worker
    -> stage -> the replica of each micro-batch (:func:`partitioner.placement.replica_assignment`,
    from the stage times the cost model gives); ``None`` or empty: equal times (round-robin).

    The pipelines come from :func:`partitioner.placement.place` (stage count a multiple of the
    chunks, distinct devices, stage ``c*p + d`` on the device of stage ``d``); what the runtime
    cannot run is what :func:`partitioner.placement.supports` says for ``"runtime"``. A device of
    tensor-parallel degree ``t`` becomes ``t`` consecutive ranks (the module's docstring)."""
    the_model = f"model {model}" if model else "the model"
    pipelines_placed = place(plan)  # FormatError naming the broken placement rule
    cannot = supports(plan, "runtime")
    if cannot:
        raise PartitionerError(cannot)
    assign = _checked_assignment(plan, assignment)
    ranks: list[RankInfo] = []
    pipelines: list[tuple[int, ...]] = []
    stage_layers: list[tuple[tuple[int, int], ...]] = []
    stage_ranks: list[tuple[tuple[int, ...], ...]] = []
    for w, pipe in enumerate(pipelines_placed):
        where = f"virtual_workers[{w}]"
        expect = 0
        for k, (start, stop) in enumerate(pipe.stages):
            if start != expect:
                raise FormatError(f"{where}.stages[{k}].layers", [start, stop], f"must start at layer {expect}")
            if stop > num_layers:
                raise FormatError(f"{where}.stages[{k}].layers", [start, stop],
                                  f"layer {num_layers} does not exist: {the_model} has {num_layers} layers "
                                  f"[0, {num_layers}))")
            expect = stop
        if expect != num_layers:
            raise FormatError(f"{where}.stages[{len(pipe.stages) - 1}].layers", list(pipe.stages[-1]),
                              f"the last stage ends before layer {expect}, but {the_model} has {num_layers} layers: "
                              f"layers [{expect}, {num_layers}) are in no stage")
        p, n = pipe.ranks, len(pipe.stages)
        check_schedule(plan.schedule, p, plan.micro_batching.count, plan.chunks, staleness=plan.staleness)
        if pipe.replicas:
            devices = [d for devs in pipe.replicas for d in devs]
            if len(set(devices)) != len(devices):
                raise FormatError(f"{where}.stages", [list(devs) for devs in pipe.replicas],
                                  "a pipeline with replicated stages runs each stage on devices of its own; "
                                  "a device is named twice")
            held: list[tuple[int, ...]] = []
            firsts: list[int] = []
            for k, devs in enumerate(pipe.replicas):
                group_firsts = []
                for i, dev in enumerate(devs):
                    first, t = len(ranks), group_size(dev)
                    ranks.extend([RankInfo(first + j, dev, w, len(firsts), (k,), i, j, t) for j in range(t)])
                    group_firsts.append(first)
                    firsts.append(first)
                held.append(tuple(group_firsts))
            pipelines.append(tuple(firsts))
            stage_ranks.append(tuple(held))
        else:
            firsts = []
            for d in range(p):
                first, t = len(ranks), group_size(pipe.devices[d])
                stages_here = tuple(s for s in range(n) if pipe.rank_of(s) == d)
                ranks.extend([RankInfo(first + j, pipe.devices[d], w, d, stages_here, 0, j, t) for j in range(t)])
                firsts.append(first)
            pipelines.append(tuple(firsts))
            stage_ranks.append(tuple((firsts[pipe.rank_of(s)],) for s in range(n)))
        stage_layers.append(pipe.stages)
    return Layout(plan, tuple(ranks), tuple(pipelines), tuple(stage_layers), num_layers, tuple(stage_ranks),
                  assign, tuple(pipelines_placed))


def _checked_assignment(plan: Plan, assignment: Sequence[Sequence[Sequence[int]]] | None
                        ) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``assignment`` checked against the plan (one line naming the entry), or the equal-times one."""
    if not assignment:
        return replica_assignment(plan)
    m = plan.micro_batching.count
    if len(assignment) != len(plan.virtual_workers):
        raise FormatError("replica_assignment", len(assignment),
                          f"must give one entry per virtual worker ({len(plan.virtual_workers)})")
    out = []
    for w, (vw, per_stage) in enumerate(zip(plan.virtual_workers, assignment, strict=True)):
        if len(per_stage) != len(vw.stages):
            raise FormatError(f"replica_assignment[{w}]", len(per_stage), f"must give one entry per stage ({len(vw.stages)})")
        rows = []
        for k, (st, row) in enumerate(zip(vw.stages, per_stage, strict=True)):
            row = tuple(int(i) for i in row)
            if len(row) != m or any(not 0 <= i < len(st.devices) for i in row):
                raise FormatError(f"replica_assignment[{w}][{k}]", list(row),
                                  f"must give each of the {m} micro-batches of an iteration a replica in 0..{len(st.devices) - 1}")
            rows.append(row)
        out.append(tuple(rows))
    return tuple(out)
