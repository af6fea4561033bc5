"""A floor on one virtual worker's iteration among ``K`` that charges every stage's all-reduce.

:func:`solvers.cluster.bounds.sync.sync_bound` bounds a worker by its pipeline and, after it, the
all-reduce of what its stage 0 holds. Stage 0 is the last to finish its backward, but it need
not hold the heavy layers: VGG's fully connected layers (most of its parameters) sit on the
last stage, whose all-reduce starts only the backward of the stages before it earlier. This
module charges every stage.

In the closed form (:meth:`partitioner.cost.CostModel.plan_iteration_s`, flushing schedules,
no replication) stage ``k`` of a worker finishes its last backward at ``T_w - B_k``, with
``T_w`` the worker's iteration and ``B_k`` the backward compute and gradient messages of
stages ``0 .. k - 1`` (the closed form then adds the stage's own gradient send back where
transfers are not overlapped, so this is the earliest it frees); under GPipe at the end of its
part of the backward flow shop, ``sum_{j >= k} (b + g)_j + (m - 1) max_{j >= k} t_b`` after the
forward one (earlier than ``T_w - B_k`` where a stage before it is slower). Its device then runs, one after
another, the all-reduce of every group of layers it holds, each over ``K`` members (one
device per worker), and steps. So the plan's iteration is at least

    max_k  T_w - B_k + F_K(w_k) + U(k)

with ``w_k`` the stage's parameter bytes, ``F_K`` :func:`solvers.cluster.bounds.sync.allreduce_floor`
(subadditive where it applies, so the groups of a device together take at least ``F_K`` of
their bytes) and ``U`` the stage's optimizer step. ``T_w`` is the closed form's own iteration
of the split (:meth:`~partitioner.cost.CostModel.worker_iteration_s`: the fill, then ``m - 1``
times the pace, the slowest stage or under 1F1B a round trip over the stages left; under GPipe
the forward and the backward flow shops apart). :func:`worker_tail_floor_s` takes the least of
that over every order of the worker's GPUs and every split, enumerated; it is ``None`` where
they are too many.

The groups of a device run in the order of their first layer, and the group of layer 0 holds
every worker's stage 0, which finishes at its worker's ``T_w``; each next group shares a device
with the one before it up to the first layer ``c`` at which every worker has a stage boundary.
So where that layer is ``c`` the plan's iteration is also at least ``T_w + F_K(w[0, c))`` for
every worker: :attr:`TailTable.by_common_cut_s`, which :mod:`solvers.cluster.bounds.sync` takes per ``c``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from partitioner.cluster import Device
from partitioner.cost import CostModel
from partitioner.schedule import Schedule
from solvers.pipeline.mapping import device_labels, label_orders, num_label_orders, realise_order

__all__ = ["TailTable", "count_splits", "worker_tail_floor_s", "worker_tail_table"]

CHUNK = 65_536  # splits priced at once


def count_splits(num_layers: int, gpus: int, orders: int) -> int:
    """Order-and-split pairs :func:`worker_tail_floor_s` enumerates for a worker of ``gpus``."""
    return orders * math.comb(num_layers - 1, gpus - 1) if gpus <= num_layers else 0


@dataclass(frozen=True)
class TailTable:
    """What :func:`worker_tail_table` learns of one worker template among ``K``.

    ``own_s``: the least ``max_k T_w - B_k + F_K(w_k) + U(k)`` over its orders and splits.
    ``by_common_cut_s[c]`` (``c`` in ``1 .. L``): the least of ``max(own, T_w + F_K(w[0, c)))``
    over the splits with a stage boundary at layer ``c`` (every split where ``c = L``); inf
    where none. Where every worker of a plan has a boundary at ``c``, the first such layer,
    the all-reduces of layers ``[0, c)`` run one after another after the last pipeline ends
    (the module docstring), so the plan's iteration is at least this for every worker.
    """

    own_s: float
    by_common_cut_s: np.ndarray

    def __post_init__(self) -> None:
        if not self.by_common_cut_s.ndim == 1:
            raise ValueError("TailTable: by_common_cut_s must be one value per layer boundary")


def worker_tail_floor_s(cost: CostModel, devices: Sequence[Device], schedule: Schedule,
                        allreduce_floor_s: Callable[[np.ndarray], np.ndarray], limit: int = 500_000) -> float | None:
    """The least over orders and splits of ``devices`` of the module docstring's
    ``max_k T_w - B_k + F_K(w_k) + U(k)`` (:attr:`TailTable.own_s`); ``None`` as
    :func:`worker_tail_table`."""
    table = worker_tail_table(cost, devices, schedule, allreduce_floor_s, limit)
    return None if table is None else table.own_s


def worker_tail_table(cost: CostModel, devices: Sequence[Device], schedule: Schedule,
                      allreduce_floor_s: Callable[[np.ndarray], np.ndarray], limit: int = 500_000) -> TailTable | None:
    """:class:`TailTable` of ``devices`` (one stage each, memory respected); ``allreduce_floor_s``
    is ``F_K`` (an array of bytes -> seconds). ``None`` where the schedule is not a flushing
    all-reduce one or more than ``limit`` order-and-split pairs would be priced."""
    sp = schedule.spec
    if not sp.flushes or sp.sync != "allreduce":
        return None
    devices = list(devices)
    labels = device_labels(cost, devices)
    q, n_layers, m = len(devices), cost.num_layers, schedule.micro_batches
    if q == 0 or count_splits(n_layers, q, num_label_orders(labels)) > limit:
        return None
    pools: dict[tuple[str, str], list[Device]] = {}
    for lab, d in zip(labels, devices, strict=True):
        pools.setdefault(lab, []).append(d)
    # F_K and the step of every layer range, per GPU type
    q_bytes = np.asarray(cost.param_prefix, float)
    span = np.maximum(q_bytes[None, :] - q_bytes[:, None], 0.0)
    floor = np.where(np.triu(np.ones_like(span, bool), 1), allreduce_floor_s(span), 0.0)
    tails: dict[str, np.ndarray] = {}
    for t in {d.kind for d in devices}:
        upd = np.array([cost.update_s(t, 0, j) for j in range(n_layers + 1)])
        tails[t] = floor + (upd[None, :] - upd[:, None])
    join = np.maximum if cost.options.overlap_comm else np.add
    own_best = math.inf
    by_cut = np.full(n_layers + 1, math.inf)
    prefix_floor = floor[0]  # F_K(w[0, c)) for every c
    for order in label_orders(labels):
        devs = realise_order(order, pools)
        parts = _stage_parts(cost, devs, schedule, tails)
        for chunk in _chunks(n_layers, q):
            starts = np.concatenate([np.zeros((len(chunk), 1), int), chunk], axis=1)
            stops = np.concatenate([chunk, np.full((len(chunk), 1), n_layers)], axis=1)
            cells = [(starts[:, k], stops[:, k]) for k in range(q)]
            fits = np.all([p["fits"][c] for p, c in zip(parts, cells, strict=True)], axis=0)
            if not fits.any():
                continue
            keep = np.flatnonzero(fits)
            cells = [(a[keep], b[keep]) for a, b in cells]
            pick = list(zip(parts, cells, strict=True))
            fwd = sum(p["f"][c] + p["a"][c] for p, c in pick)  # compute forward + activation out
            bwd = sum(p["b"][c] + p["g"][c] for p, c in pick)  # compute backward + gradient out
            if sp.all_forwards_first:
                total = (fwd + (m - 1) * np.max([join(p["f"][c], p["a"][c]) for p, c in pick], axis=0)
                         + bwd + (m - 1) * np.max([join(p["b"][c], p["g"][c]) for p, c in pick], axis=0))
            else:  # the closed form's pace: the slowest stage, or a round trip over the stages left (Little's law)
                pace = np.max([p["t"][c] for p, c in pick], axis=0)
                trip = np.zeros(len(keep))
                for k in range(q - 1, -1, -1):
                    p, c = pick[k]
                    trip = trip + p["round"][c]
                    pace = np.maximum(pace, trip / (q - k))
                total = fwd + bwd + (m - 1) * pace
            own = np.full(len(keep), -np.inf)
            stage_tail = np.stack([p["tail"][c] for p, c in pick], axis=1)
            if sp.all_forwards_first:
                # GPipe's backward flow shop reaches stage k with its last micro-batch at
                # sum_{j >= k} (b + g)_j + (m - 1) max_{j >= k} t_b after the forward one ends
                start = fwd + (m - 1) * np.max([join(p["f"][c], p["a"][c]) for p, c in pick], axis=0)
                fill, slowest = np.zeros(len(keep)), np.zeros(len(keep))
                for k in range(q - 1, -1, -1):
                    p, c = pick[k]
                    fill = fill + p["b"][c] + p["g"][c]
                    slowest = np.maximum(slowest, join(p["b"][c], p["g"][c]))
                    sent = p["g"][c] if cost.options.overlap_comm else 0.0  # an overlapped send does not hold it
                    own = np.maximum(own, start + fill + (m - 1) * slowest - sent + stage_tail[:, k])
            else:  # stage k finishes B_k earlier: the backward compute and gradients received of stages < k
                done = np.zeros(len(keep))
                for k, (p, c) in enumerate(pick):
                    own = np.maximum(own, total - done + stage_tail[:, k])
                    done = done + p["back"][c]
            own_best = min(own_best, float(own.min()))
            for k in range(1, q):  # a boundary at every stage start but the first
                at = cells[k][0]
                np.minimum.at(by_cut, at, np.maximum(own, total + prefix_floor[at]))
            np.minimum.at(by_cut, np.full(len(keep), n_layers), np.maximum(own, total + prefix_floor[n_layers]))
    return TailTable(own_best, by_cut)


def _stage_parts(cost: CostModel, devs: Sequence[Device], schedule: Schedule,
                 tails: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Per stage position of one order: ``[start, stop]`` matrices of what the closed form uses."""
    q, out = len(devs), []
    for k, d in enumerate(devs):
        prev = devs[k - 1] if k else None
        nxt = devs[k + 1] if k + 1 < q else None
        f, b = cost.direction_matrices(d.kind)
        a = np.broadcast_to(cost.boundary_vector_s(d, nxt)[None, :], f.shape)  # activation sent on at stop
        g = np.broadcast_to(cost.boundary_vector_s(d, prev)[:, None], f.shape)  # gradient sent back at start
        received = np.broadcast_to(cost.boundary_vector_s(nxt, d)[None, :], f.shape)  # gradient from the next
        # the least memory any lever allows (recomputation, ZeRO): valid over the planner's larger space
        mem = cost.least_memory_matrix(schedule.activations_in_flight(q - k), schedule, tensor_parallel=d.tensor_parallel)
        out.append({"f": f, "b": b, "a": a, "g": g, "back": b + received, "round": f + b + a + received,
                    "t": cost.pipeline_stage_time_matrix(d, prev, nxt, schedule),
                    "fits": mem <= d.memory_bytes, "tail": tails[d.kind]})
    return out


def _chunks(n_layers: int, q: int) -> Iterator[np.ndarray]:
    """Every split of ``n_layers`` into ``q`` non-empty ranges, as blocks of arrays of the ``q - 1`` cuts."""
    combos = itertools.combinations(range(1, n_layers), q - 1)
    while block := list(itertools.islice(combos, CHUNK)):
        yield np.array(block, int).reshape(len(block), q - 1)
