"""Which process runs what: a plan's devices as ``torch.distributed`` ranks.

Rank order: virtual worker 0's devices first, in the order its pipeline first uses them
(stage 0's device, stage 1's, ...), then virtual worker 1's, and so on -- the order of
``Plan.devices``. Inside a virtual worker of ``p`` devices, the device of stage ``s`` is
pipeline rank ``s % p`` (chunk ``s // p`` for interleaved / bfs), as in
``partitioner.schedule``.

Data parallelism: layer ``l`` is held by one rank per virtual worker; those ranks form the
layer's *holder set*. Layers with the same holder set are averaged together, in one
all-reduce over a process group of exactly those ranks (:func:`holder_sets`).
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.errors import FormatError, PartitionerError
from partitioner.placement import place, supports
from partitioner.plan import Plan
from partitioner.schedule import check_schedule

__all__ = ["Layout", "RankInfo", "plan_layout"]


@dataclass(frozen=True)
class RankInfo:
    """One process: its device, virtual worker, pipeline rank and stages (global indices)."""

    rank: int
    device: str
    worker: int
    pipe_rank: int
    stages: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """The plan mapped onto ranks ``0 .. world_size - 1``."""

    plan: Plan
    ranks: tuple[RankInfo, ...]
    pipelines: tuple[tuple[int, ...], ...]  # worker -> pipeline rank -> global rank
    stage_layers: tuple[tuple[tuple[int, int], ...], ...]  # worker -> stage -> (start, stop)
    num_layers: int

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def workers(self) -> int:
        return len(self.pipelines)

    def global_rank(self, worker: int, pipe_rank: int) -> int:
        return self.pipelines[worker][pipe_rank]

    def holder_sets(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """``(ranks, layers)`` for every distinct set of ranks that hold the same layers, in the
        order of their first layer (every rank walks this list in the same order)."""
        holders: dict[tuple[int, ...], list[int]] = {}
        for layer in range(self.num_layers):
            key = []
            for w, stages in enumerate(self.stage_layers):
                s = next(k for k, (a, b) in enumerate(stages) if a <= layer < b)
                key.append(self.global_rank(w, s % len(self.pipelines[w])))
            holders.setdefault(tuple(sorted(key)), []).append(layer)
        return [(ranks, tuple(layers)) for ranks, layers in holders.items()]


def plan_layout(plan: Plan, num_layers: int, model: str = "") -> Layout:
    """Map ``plan`` onto ranks, refusing what the runtime does not execute (one line each).
    ``model`` names the model of ``num_layers`` layers in the messages.

    The pipelines come from :func:`partitioner.placement.place` (stage count a multiple of the
    chunks, distinct devices, stage ``c*p + d`` on the device of stage ``d``); what the runtime
    cannot run is what :func:`partitioner.placement.supports` says for ``"runtime"``."""
    the_model = f"model {model}" if model else "the model"
    pipelines_placed = place(plan)  # FormatError naming the broken placement rule
    cannot = supports(plan, "runtime")
    if cannot:
        raise PartitionerError(cannot)
    ranks: list[RankInfo] = []
    pipelines: list[tuple[int, ...]] = []
    stage_layers: list[tuple[tuple[int, int], ...]] = []
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
        check_schedule(plan.schedule, p, plan.micro_batches, plan.chunks, staleness=plan.staleness)
        base = len(ranks)
        for d in range(p):
            ranks.append(RankInfo(base + d, pipe.devices[d], w, d, tuple(range(d, n, p))))
        pipelines.append(tuple(range(base, base + p)))
        stage_layers.append(pipe.stages)
    return Layout(plan, tuple(ranks), tuple(pipelines), tuple(stage_layers), num_layers)
