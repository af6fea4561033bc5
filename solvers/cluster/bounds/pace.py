"""A bound from the pace of every worker: stages cut whole layers, on unequal devices.

The per-layer bound (:mod:`.layers`) spreads each layer's micro-batches over the GPU kinds in any
fraction; a real worker cuts whole layers into contiguous stages, one device each, and runs at
the pace of its busiest device. This bound keeps that structure.

**One worker.** In a one-chunk flushing schedule without replication, the device of stage ``k``
does its work one action after another within the iteration ``T``: the forwards and backwards of
its ``m`` micro-batches and, where sends block their sender (``overlap_comm`` off, the
simulator's default; no shared NICs modelled), its ``m`` activation sends to stage ``k + 1`` and
``m`` gradient sends to stage ``k - 1``, each at least the least time of one boundary message
between the two devices' pools (a pool: the devices of one kind). Its step and all-reduce are
left out (they only add). So ``T >= m p_k`` with ``p_k`` one micro-batch's share of that work,
for every stage. A first micro-batch cut into slices changes none of it: a slice computes and
sends its share of the samples, so the slices add up to one micro-batch.

For a vector ``c`` of device counts per pool, ``P*(c)`` is the least ``max_k p_k`` over every
order of those devices and every split of the layers into contiguous stages on some of them (a
device may be left out: this only lowers ``P*``, so it bounds every worker of exactly those
devices), where a stage goes on a device only if its layers' least bytes fit the device's memory
(the per-layer least bytes of :mod:`.layers`, summed). A dynamic program over (devices used per
pool, the last stage's pool, the pool promised to the next stage, layers covered) computes
``P*`` for every ``c`` at once, charging each stage its sends both ways when it is placed. Nodes
are left out of the counts (they only constrain plans more); they enter through the least
message time between two pools, a link between nodes where no node holds both kinds. The table
holds for every ``K`` and ``m``.

**K workers.** Under ``sync`` every worker runs the whole iteration, so ``T >= m max_w P*(c_w)``
for disjoint vectors ``c_w`` within the pools; the rate ``K m b / T`` is at most ``K b / T_K``
with ``T_K`` the least ``P`` at which ``K`` disjoint vectors of ``P* <= P`` fit the pools (GPUs
may stay idle). ``T_K`` is found by bisection over the distinct values of ``P*``, each step a
reachability over the counts of each pool (only the vectors minimal at that ``P`` are needed).
Where no ``K`` such vectors exist, no plan of ``K`` workers fits and the bound is 0.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from partitioner.cluster import Device
from partitioner.cost import CostModel
from partitioner.schedule import Schedule

from .layers import _layer_columns

__all__ = ["MAX_STATES", "PaceTable", "least_pace_s", "pace_bound", "pace_table", "paced_schedule"]

MAX_STATES = 512  # most count vectors a table covers; past it, no bound (its program costs too much)


def paced_schedule(schedule: Schedule) -> bool:
    """Whether the pace argument holds for ``schedule``: one chunk per device, flushing."""
    return schedule.spec.flushes and not schedule.spec.multi_chunk


@dataclass(frozen=True)
class PaceTable:
    """``P*``, the least seconds per micro-batch of a worker's busiest device, for every vector of
    device counts within ``supply`` (one count per pool of ``pools``: a device kind), in C order
    over ``supply + 1``; ``inf`` where no split of the layers fits those devices."""

    pools: tuple[str, ...]
    supply: tuple[int, ...]
    least_s: np.ndarray

    def __post_init__(self) -> None:
        if len(self.pools) != len(self.supply) or any(n < 1 for n in self.supply):
            raise ValueError(f"PaceTable: one positive count per pool, not {self.pools} / {self.supply}")
        if self.least_s.shape != tuple(n + 1 for n in self.supply):
            raise ValueError(f"PaceTable: table of shape {self.least_s.shape} for supply {self.supply}")


def _pools(devices: Sequence[Device]) -> dict[str, list[Device]]:
    """The devices of each kind, kinds sorted."""
    out: dict[str, list[Device]] = {}
    for d in devices:
        out.setdefault(d.kind, []).append(d)
    return dict(sorted(out.items()))


def pace_table(cost: CostModel, devices: Sequence[Device], schedule: Schedule) -> PaceTable | None:
    """The table of ``P*`` over ``devices`` for plans of ``schedule`` (see the module docstring),
    per micro-batch: one micro-batch's forwards, backwards and sends (where they block their
    sender, ``overlap_comm`` off, at the least time between the two pools' devices) on the
    busiest device, the same for every K and m. None where it would have more than
    :data:`MAX_STATES` vectors or :func:`paced_schedule` does not cover the schedule."""
    if not paced_schedule(schedule):
        return None
    pools = _pools(devices)
    if math.prod(len(v) + 1 for v in pools.values()) > MAX_STATES:
        return None
    sends = not cost.options.overlap_comm and not cost.cluster.has_nics  # shared NICs: flows, left out
    names = tuple(pools)
    supply = tuple(len(pools[p]) for p in names)
    n_layers = cost.num_layers
    ahead = np.arange(n_layers + 1)[None, :] > np.arange(n_layers + 1)[:, None]
    stage_s = []  # per pool: busy seconds of layers [i, j) on one device, inf where they cannot fit it
    for p in names:
        kind = pools[p][0].kind
        comp, _, _, mem = _layer_columns(cost, kind, schedule.weight_versions)
        room = pools[p][0].memory_bytes - cost.options.reserved_bytes
        c_pre = np.concatenate([[0.0], np.cumsum(comp)])
        m_pre = np.concatenate([[0.0], np.cumsum(mem)])
        fits = (m_pre[None, :] - m_pre[:, None]) <= room
        stage_s.append(np.where(fits & ahead, c_pre[None, :] - c_pre[:, None], math.inf))
    n_pools = len(names)
    members = [pools[p] for p in names]
    zero = np.zeros(n_layers + 1)
    # send_s[a][b]: one boundary message per cut from a device of pool a to another of pool b (b =
    # n_pools: no stage there, nothing sent)
    send_s = [[_least_sends(cost, members[a], members[b]) if sends and b < n_pools else zero
               for b in range(n_pools + 1)] for a in range(n_pools)]
    # stage_cost[r][r2, q, i, j]: a stage of layers [i, j) on pool r after one on pool q (its
    # gradients back at cut i) and before one on pool r2 (its activations on at cut j)
    stage_cost = [np.stack([np.stack([stage_s[r] + send_s[r][q][:, None] if q < n_pools else stage_s[r]
                                      for q in range(n_pools + 1)]) + send_s[r][r2][None, None, :]
                            for r2 in range(n_pools + 1)]) for r in range(n_pools)]
    # cover[c, q, r, l]: the least bottleneck of stages covering layers [0, l) on at most c
    # devices, the last on pool q (n_pools: none yet), the next promised to pool r (n_pools: none)
    dims = [n + 1 for n in supply]
    cover = np.full((*dims, n_pools + 1, n_pools + 1, n_layers + 1), math.inf)
    cover[(0,) * n_pools][n_pools, :n_pools, 0] = 0.0
    for state in itertools.product(*[range(n + 1) for n in supply]):
        if not any(state):
            continue
        here = cover[state]
        for t, c in enumerate(state):
            if c == 0:
                continue
            prev = cover[_less(state, t)]
            np.minimum(here, prev, out=here)  # the device left out
            came = prev[:, t, :]  # stages before, the next promised to pool t
            if not np.isfinite(came).any():
                continue
            # a stage on pool t ending at l, the next promised to each pool (or none)
            got = np.maximum(came[None, :, :, None], stage_cost[t]).min(axis=(1, 2))
            np.minimum(here[t], got, out=here[t])
    return PaceTable(names, supply, cover[..., :n_pools, n_pools, n_layers].min(axis=-1))


def _less(state: tuple[int, ...], t: int) -> tuple[int, ...]:
    """``state`` with one device fewer of pool ``t``."""
    return (*state[:t], state[t] - 1, *state[t + 1:])


def _least_sends(cost: CostModel, senders: Sequence[Device], receivers: Sequence[Device]) -> np.ndarray:
    """Per cut, the least seconds of one boundary message from a device of ``senders`` to another
    of ``receivers`` (0 where the only pair is a device and itself). Without link overrides a
    message's time depends on the two nodes alone, so two devices per node stand for the rest."""

    def stand_ins(devices: Sequence[Device]) -> list[Device]:
        if cost.cluster.links:
            return list(devices)
        seen: dict[str, int] = {}
        out = []
        for d in devices:
            seen[d.node] = seen.get(d.node, 0) + 1
            if seen[d.node] <= 2:
                out.append(d)
        return out

    vectors = [cost.boundary_vector_s(a.name, b.name) for a in stand_ins(senders) for b in stand_ins(receivers)
               if a.name != b.name]
    return np.min(vectors, axis=0) if vectors else np.zeros(cost.num_layers + 1)


def _minimal(feasible: np.ndarray) -> list[tuple[int, ...]]:
    """The vectors of ``feasible`` (an up-set: more devices of a kind never hurt) with no
    feasible vector one device below them."""
    out = []
    for idx in zip(*np.nonzero(feasible), strict=True):
        state = tuple(int(i) for i in idx)
        if not any(state[t] > 0 and feasible[_less(state, t)] for t in range(len(state))):
            out.append(state)
    return out


def _fits(vectors: Sequence[tuple[int, ...]], supply: tuple[int, ...], workers: int) -> bool:
    """Whether ``workers`` vectors of ``vectors`` (repeats allowed) sum to within ``supply``."""
    shape = tuple(n + 1 for n in supply)
    reach = np.zeros(shape, bool)
    reach[(0,) * len(shape)] = True
    for _ in range(workers):
        new = np.zeros(shape, bool)
        for v in vectors:
            src = tuple(slice(0, n + 1 - x) for n, x in zip(supply, v, strict=True))
            tgt = tuple(slice(x, n + 1) for n, x in zip(supply, v, strict=True))
            new[tgt] |= reach[src]
        if not new.any():
            return False
        reach = new
    return True


def least_pace_s(table: PaceTable, workers: int) -> float:
    """``T_K``: the least ``P`` at which ``workers`` disjoint vectors of ``P* <= P`` fit the
    pools; ``inf`` where none does."""
    values = np.unique(table.least_s[np.isfinite(table.least_s)])
    if workers < 1 or not len(values):
        return math.inf

    def ok(i: int) -> bool:
        return _fits(_minimal(table.least_s <= values[i]), table.supply, workers)

    if not ok(len(values) - 1):
        return math.inf
    lo, hi = 0, len(values) - 1  # ok(hi) holds
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return float(values[hi])


def pace_bound(cost: CostModel, devices: Sequence[Device], virtual_workers: int, schedule: Schedule,
               table: PaceTable | None = None) -> float:
    """Samples/s no plan of ``virtual_workers`` workers of ``schedule``'s micro-batches over
    ``devices`` beats: ``K m b / (m T_K)`` (0 where no ``K`` workers fit; ``inf``, no bound, for a
    schedule the argument does not cover or a table too large). ``table``: the devices' table,
    made once for every K and m of them (:func:`pace_table`)."""
    if not paced_schedule(schedule):
        return math.inf
    if table is None:
        table = pace_table(cost, devices, schedule)
    if table is None:
        return math.inf
    pace_s = least_pace_s(table, virtual_workers)
    if not math.isfinite(pace_s):
        return 0.0
    return virtual_workers * cost.profile.micro_batch_size / pace_s if pace_s > 0 else math.inf
