"""Stage replication (PipeDream-style): a stage may run data-parallel on several GPUs.

For a fixed order of a virtual worker's GPUs, a *run* of consecutive GPUs may hold one stage
together: they share its micro-batches and all-reduce its gradients once per iteration. The GPUs
of a run may be of different types and tensor-parallel degrees (as Sailor replicates a stage over
a 2080 pair and four Titans): prices come from
:meth:`partitioner.cost.CostModel.replicated_stage_time_s` (speed-proportional share of the
micro-batches plus ``allreduce_s / m``; replicas of different degrees all-reduce the full
gradients, :meth:`~partitioner.cost.CostModel.sync_bytes`), memory from the same per-stage
formula as a plain stage, on each replica at its own degree and capacity (each replica keeps the
stage's weights and, as a conservative bound, the activations a plain stage at that depth would
keep). ``same_kind`` keeps runs to one device kind (the older, smaller space).

The DP over (first free GPU ``k``, stages left ``s``, first layer ``i``)

    f(k, s, i) = min_{r, j}  max(T_{k..k+r}(i, j), f(k + r, s - 1, j)),   f(p, 0, L) = 0,

is exact for the given order, over every way to cut it into runs (a pure pipeline is the
case of all runs of length 1, so replication never loses to it on the modelled
bottleneck). Which order to replicate is chosen outside: :func:`replicate_worker` tries the
mapping's best pure order and the order with each GPU type contiguous, and keeps the better.
With ``CostOptions(overlap_comm=True)`` the incoming transfer is priced from the previous
GPU in the order (the last replica of the previous stage), an approximation; the plan's
reported figures are always re-priced by the cost model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from partitioner.cluster import Device
from partitioner.cost import CostModel
from partitioner.schedule import Schedule

__all__ = ["ReplicatedSolution", "replicate_chain", "replicate_worker"]


@dataclass(frozen=True)
class ReplicatedSolution:
    """Stages as (layer range, devices); the first device of each is the stage's device."""

    bottleneck_s: float
    stages: tuple[tuple[tuple[int, int], tuple[Device, ...]], ...]


def _runs(devices: Sequence[Device], same_kind: bool) -> list[int]:
    """``run[k]``: how many GPUs from ``k`` on may hold one stage (with ``same_kind``, those of
    ``devices[k]``'s kind that follow consecutively; otherwise every GPU left)."""
    p = len(devices)
    if not same_kind:
        return [p - k for k in range(p)]
    run = [1] * p
    for k in range(p - 2, -1, -1):
        if devices[k + 1].kind == devices[k].kind:
            run[k] = run[k + 1] + 1
    return run


def replicate_chain(cost: CostModel, devices: Sequence[Device], schedule: Schedule, max_replicas: int | None = None,
                    same_kind: bool = False) -> ReplicatedSolution | None:
    """Minimum-bottleneck stages with replication over ``devices`` in this order, or None."""
    devices = list(devices)
    p, n = len(devices), cost.num_layers
    if p == 0:
        return None
    run = _runs(devices, same_kind)
    cap = max_replicas or p
    cols = np.arange(n + 1)
    upper = cols[None, :] > cols[:, None]
    # f[(k, s)] = vector over i; choice[(k, s)] = (r per i, j per i)
    f: dict[tuple[int, int], np.ndarray] = {}
    reduce_s: dict[tuple[int, int], np.ndarray] = {}  # (first GPU, replicas): the all-reduce of every stage
    choice: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    end = np.full(n + 1, np.inf)
    end[n] = 0.0
    f[(p, 0)] = end
    for k in range(p - 1, -1, -1):
        prev = devices[k - 1] if k > 0 else None
        for s in range(1, p - k + 1):
            in_flight = schedule.activations_in_flight(s)
            best = np.full(n + 1, np.inf)
            best_r = np.zeros(n + 1, dtype=np.intp)
            best_j = np.full(n + 1, -1, dtype=np.intp)
            for r in range(1, min(run[k], cap) + 1):
                nxt_f = f.get((k + r, s - 1))
                if nxt_f is None or not np.isfinite(nxt_f).any():
                    continue
                group = devices[k:k + r]
                nxt = devices[k + r] if k + r < p else None
                rate = np.zeros((n + 1, n + 1))
                for d in group:
                    rate += 1.0 / np.maximum(cost.stage_time_matrix(d, prev, nxt), 1e-300)
                t = 1.0 / rate
                if r > 1:
                    # every shard of the groups; replicas of different degrees all-reduce the full gradients
                    degrees = {d.tensor_parallel for d in group}
                    shards = cost.at_degree(degrees.pop() if len(degrees) == 1 else 1).param_prefix
                    if (k, r) not in reduce_s:  # the same group for every count of stages left
                        reduce_s[(k, r)] = _allreduce_matrix(cost, group, shards[None, :] - shards[:, None])
                    t = t + reduce_s[(k, r)] / schedule.micro_batches
                if schedule.spec.sync == "wave":
                    t = t + cost.wave_sync_matrix(schedule.micro_batches)
                ok = upper.copy()
                for degree, capacity in {(d.tensor_parallel, d.memory_bytes) for d in group}:
                    ok &= cost.memory_matrix(in_flight, schedule, tensor_parallel=degree) <= capacity
                cand = np.where(ok, np.maximum(t, nxt_f[None, :]), np.inf)
                arg = cand.argmin(axis=1)
                val = cand[cols, arg]
                better = val < best
                best = np.where(better, val, best)
                best_r = np.where(better, r, best_r)
                best_j = np.where(better, arg, best_j)
            f[(k, s)] = best
            choice[(k, s)] = (best_r, best_j)
    s_best = min(range(1, p + 1), key=lambda s: f[(0, s)][0])
    if not math.isfinite(f[(0, s_best)][0]):
        return None
    stages = []
    k, s, i = 0, s_best, 0
    while k < p:
        r, j = int(choice[(k, s)][0][i]), int(choice[(k, s)][1][i])
        stages.append(((i, j), tuple(devices[k:k + r])))
        k, s, i = k + r, s - 1, j
    return ReplicatedSolution(float(f[(0, s_best)][0]), tuple(stages))


ALLREDUCE_GRID = 24  # message sizes an all-reduce matrix is priced at exactly (interpolated between them)


def _allreduce_matrix(cost: CostModel, group: Sequence[Device], nbytes: np.ndarray) -> np.ndarray:
    """``allreduce_s(nbytes[i, j], group)`` for every stage (0 where there is nothing to reduce):
    exact at :data:`ALLREDUCE_GRID` sizes spread geometrically over the stages' own sizes and
    linear in the bytes between them, so exact on links of a fixed rate and latency, and priced
    only at sizes the stages have (a measured curve is valid over the sizes it was measured on)."""
    out = np.zeros(nbytes.shape)
    positive = nbytes > 0
    if not positive.any():
        return out
    lo, hi = float(nbytes[positive].min()), float(nbytes[positive].max())
    grid = np.unique(np.geomspace(lo, hi, ALLREDUCE_GRID)) if hi > lo else np.array([lo])
    grid[0], grid[-1] = lo, hi
    times = np.array([cost.allreduce_s(float(x), group) for x in grid])
    out[positive] = np.interp(nbytes[positive], grid, times)
    return out


def replicate_worker(cost: CostModel, order: Sequence[Device], schedule: Schedule) -> ReplicatedSolution | None:
    """Best replicated split over ``order`` and over ``order`` with each GPU type contiguous."""
    speed = {t: cost.compute_s(t, 0, cost.num_layers) for t in {d.kind for d in order}}
    first = {t: k for k, t in reversed(list(enumerate(d.kind for d in order)))}
    grouped = sorted(order, key=lambda d: (first[d.kind], speed[d.kind]))
    best: ReplicatedSolution | None = None
    for cand in ([*order], grouped):
        sol = replicate_chain(cost, cand, schedule)
        if sol is not None and (best is None or sol.bottleneck_s < best.bottleneck_s):
            best = sol
    return best
