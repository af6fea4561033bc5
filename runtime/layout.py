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
from partitioner.plan import Plan
from partitioner.schedule import check_schedule

__all__ = ["SUPPORTED_SCHEDULES", "Layout", "RankInfo", "plan_layout"]

# Flushing schedules: every iteration ends with all gradients in, so synchronous data
# parallelism is exact; wsp runs Wave Synchronous Parallel (runtime/wsp.py), 2bw PipeDream-2BW's
# double-buffered weight updates (runtime/twobw.py).
SUPPORTED_SCHEDULES = ("gpipe", "1f1b", "interleaved", "bfs", "2bw", "wsp")


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
    ``model`` names the model of ``num_layers`` layers in the messages."""
    the_model = f"model {model}" if model else "the model"
    if plan.schedule not in SUPPORTED_SCHEDULES:
        raise PartitionerError(
            f"schedule '{plan.schedule}' is not executed by the runtime: it runs {', '.join(SUPPORTED_SCHEDULES)}; "
            f"re-plan with one of those")
    if plan.staleness != 0 and plan.schedule != "wsp":
        raise PartitionerError(
            f"staleness = {plan.staleness} with schedule '{plan.schedule}': the runtime keeps virtual workers of "
            f"a flushing schedule exactly synchronous; bounded staleness needs schedule wsp")
    if plan.first_slices != 1:
        raise PartitionerError(
            f"first_slices = {plan.first_slices}: the runtime runs micro-batches of one size "
            f"({plan.micro_batch_size}); re-plan without slicing the first micro-batch (first_slices 1)")
    ranks: list[RankInfo] = []
    pipelines: list[tuple[int, ...]] = []
    stage_layers: list[tuple[tuple[int, int], ...]] = []
    v = plan.chunks
    for w, vw in enumerate(plan.virtual_workers):
        where = f"virtual_workers[{w}]"
        expect = 0
        for k, st in enumerate(vw.stages):
            if st.replicas:
                raise PartitionerError(f"{where}.stages[{k}] has replicas {list(st.replicas)}: the runtime does not "
                                       f"replicate stages; express data parallelism as virtual workers")
            if st.start != expect:
                raise FormatError(f"{where}.stages[{k}].layers", list(st.layers), f"must start at layer {expect}")
            if st.stop > num_layers:
                raise FormatError(f"{where}.stages[{k}].layers", list(st.layers),
                                  f"layer {num_layers} does not exist: {the_model} has {num_layers} layers "
                                  f"[0, {num_layers}))")
            expect = st.stop
        if expect != num_layers:
            raise FormatError(f"{where}.stages[{len(vw.stages) - 1}].layers", list(vw.stages[-1].layers),
                              f"the last stage ends before layer {expect}, but {the_model} has {num_layers} layers: "
                              f"layers [{expect}, {num_layers}) are in no stage")
        n = len(vw.stages)
        if n % v != 0:
            raise FormatError(f"{where}.stages", n, f"with chunks={v} the stage count must be a multiple of {v}")
        p = n // v
        devs = [vw.stages[d].device for d in range(p)]
        if len(set(devs)) != p or any(st.device != devs[s % p] for s, st in enumerate(vw.stages)):
            raise FormatError(f"{where}.stages", [s.device for s in vw.stages],
                              f"stage c*p + d must run on the device of stage d ({p} distinct devices, chunks={v})")
        check_schedule(plan.schedule, p, plan.micro_batches, v, staleness=plan.staleness)
        base = len(ranks)
        for d in range(p):
            if any(r.device == devs[d] for r in ranks):
                raise FormatError(f"{where}.stages[{d}].device", devs[d], "already used by another virtual worker")
            ranks.append(RankInfo(base + d, devs[d], w, d, tuple(range(d, n, p))))
        pipelines.append(tuple(range(base, base + p)))
        stage_layers.append(tuple(st.layers for st in vw.stages))
    return Layout(plan, tuple(ranks), tuple(pipelines), tuple(stage_layers), num_layers)
