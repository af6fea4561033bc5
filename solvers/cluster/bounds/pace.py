"""A bound from the pace of every worker: stages cut whole layers, on unequal devices.

The per-layer bound (:mod:`.layers`) spreads each layer's micro-batches over the GPU kinds in any
fraction; a real worker cuts whole layers into contiguous stages, one device each, and runs at
the pace of its busiest device. This bound keeps that structure.

**One worker.** In a one-chunk flushing schedule without replication, the device of stage ``k``
does its work one action after another within the iteration ``T``: the forwards and backwards of
its ``m`` micro-batches and, where sends block their sender (``overlap_comm`` off, the
simulator's default), its ``m`` activation sends to stage ``k + 1`` and ``m`` gradient sends to
stage ``k - 1``, each at least the least time of one boundary message alone (NICs it shares with
other flows only slow it) between the two devices' pools (a pool: the devices of one kind). Its step and all-reduce are
left out (they only add). So ``T >= m p_k`` with ``p_k`` one micro-batch's share of that work,
for every stage. A first micro-batch cut into slices changes none of it: a slice computes and
sends its share of the samples, so the slices add up to one micro-batch.

For a vector ``c`` of device counts per pool, ``P*(c)`` is the least ``max_k p_k`` over every
order of those devices and every split of the layers into contiguous stages on some of them (a
device may be left out: this only lowers ``P*``, so it bounds every worker of exactly those
devices), where a stage goes on a device only if it fits the device's memory as the plans are
checked (:meth:`partitioner.cost.CostModel.check_plan_memory`: the activations in flight at its
place from the end, with the least of every lever the options allow: each recompute mode at its
own compute, ZeRO's state over every GPU). A dynamic program from the last layer back over
(devices used per pool, the earliest stage's pool, the pool promised to the stage before it,
layers covered) computes it for every ``c`` that uses all its devices (so the number of stages
after a new one is known), charging each stage its sends both ways when it is placed; a least
over the smaller vectors then lets devices stay idle. A stage holds a layer or more on one
device, so no worker has more devices than the model has layers: the program covers only the
vectors of at most ``L`` devices (:func:`count_vectors` of them), and a larger vector takes the
least over those within it (its extra devices idle). Nodes are left out of the counts (they only
constrain plans more); they enter through the least message time between two pools, a link
between nodes where no node holds both kinds. Activations in flight grow with ``m``, so the
table at the fewest micro-batches of a view holds for all of its ``K`` and ``m``.

**K workers.** Under ``sync`` every worker runs the whole iteration, so ``T >= m max_w P*(c_w)``
for disjoint vectors ``c_w`` within the pools; the rate ``K m b / T`` is at most ``K b / T_K``
with ``T_K`` the least ``P`` at which ``K`` disjoint vectors of ``P* <= P`` fit the pools (GPUs
may stay idle). ``T_K`` is found by bisection over the distinct values of ``P*``, each step a
reachability over the counts of each pool (only the vectors minimal at that ``P`` are needed).
Where no ``K`` such vectors exist, no plan of ``K`` workers fits and the bound is 0.

**Edges, at one K and m.** The table above holds for every ``K`` and ``m`` of a view, so it
leaves out what depends on them. A table for one ``(K, m)`` also charges each stage of layers
``[i, l)`` what its device cannot overlap with its ``m`` micro-batches (:func:`edge_s`): it
starts no earlier than the first micro-batch's first slice has crossed ``[0, i)`` forward (the
head, each layer at its least time on any kind); and after its last backward, the last
micro-batch's gradient still crosses ``[0, i)`` backward (the tail, 1F1B and GPipe) while the
device all-reduces its gradients among ``K`` holders and steps (the hold, at least what
:func:`.layers.layer_bound` charges: ``2 (K - 1) / K`` of the bytes over the fastest link, the
whole message between nodes where ``K`` exceeds a node). So ``T >= m p_k + head + max(tail,
hold)`` for every stage, and the program runs on ``p_k + (head + max(tail, hold)) / m``. The
3D search builds these tables only for the candidates that reach the top of its queue.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from partitioner.cluster import Device, split_kind
from partitioner.cost import CostModel
from partitioner.schedule import Schedule

from .layers import FILL_SCHEDULES, least_allreduce_per_byte_s

__all__ = ["MAX_STATES", "PaceTable", "count_vectors", "edge_s", "least_pace_s", "pace_bound", "pace_table", "paced_schedule"]

MAX_STATES = 512  # most count vectors a table's program covers; past it, no bound (it costs too much)


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


def pace_table(cost: CostModel, devices: Sequence[Device], schedule: Schedule,
               fill_slices: int = 0, virtual_workers: int = 1) -> PaceTable | None:
    """The table of ``P*`` over ``devices`` for plans of ``schedule`` (see the module docstring),
    per micro-batch: one micro-batch's forwards, backwards and sends (where they block their
    sender, ``overlap_comm`` off, at the least time between the two pools' devices) on the
    busiest device, each stage within its device's memory with the activations in flight at its
    place from the end at ``schedule``'s micro-batches (so the table holds for more micro-batches
    too). None where its program would cover more than :data:`MAX_STATES` vectors (those of at
    most as many devices as layers) or
    :func:`paced_schedule` does not cover the schedule.

    ``fill_slices`` > 0: the table holds for ``schedule``'s micro-batches and ``virtual_workers``
    only (the first micro-batch cut in up to that many slices): each stage is also charged, over
    ``m``, what :func:`edge_s` says it cannot overlap with its ``m`` micro-batches."""
    if not paced_schedule(schedule):
        return None
    pools = _pools(devices)
    names = tuple(pools)
    members = [pools[p] for p in names]
    supply = tuple(len(v) for v in members)
    n_pools, n_layers = len(names), cost.num_layers
    if count_vectors(supply, n_layers) > MAX_STATES:
        return None
    sends = not cost.options.overlap_comm  # over shared NICs each message at least its time alone
    zero = np.zeros(n_layers + 1)
    # send_s[a][b]: one boundary message per cut from a device of pool a to another of pool b (b =
    # n_pools: no stage there, nothing sent)
    send_s = [[_least_sends(cost, members[a], members[b]) if sends and b < n_pools else zero
               for b in range(n_pools + 1)] for a in range(n_pools)]
    stage_s = _StageSeconds(cost, members, schedule)
    # per micro-batch, what a stage of layers [i, l) on each pool cannot overlap with its work
    edges = ([edge_s(cost, members, p, schedule, fill_slices, virtual_workers) / schedule.micro_batches
              for p in range(n_pools)] if fill_slices else [0.0] * n_pools)
    with_sends: dict[tuple[int, int], np.ndarray] = {}  # per (pool, in flight): [r, q, i, l] with both sends
    # cover[c, q, r, l]: stages covering layers [l, L) on exactly c devices, built from the last
    # stage back: the least busiest device, the earliest stage on pool q (n_pools: none yet), the
    # stage before it promised to pool r (n_pools: none)
    # a stage holds a layer or more on one device: a worker of more than n_layers devices does not
    # exist, so the program covers only the vectors of at most n_layers devices
    capped = tuple(min(n, n_layers) for n in supply)
    cover = np.full((*(n + 1 for n in capped), n_pools + 1, n_pools + 1, n_layers + 1), math.inf)
    cover[(0,) * n_pools][n_pools, :n_pools, n_layers] = 0.0
    for state in _vectors(capped, n_layers):
        if not any(state):
            continue
        here = cover[state]
        for t, c in enumerate(state):
            if c == 0:
                continue
            came = cover[_less(state, t)][:, t, :]  # stages after, the one before promised to pool t
            if not np.isfinite(came).any():
                continue
            # a stage on pool t of layers [i, l), sum(state) from the end: its activations to the
            # stage after (pool q) at cut l, its gradients to the one before (pool r) at cut i
            key = stage_s.key(t, sum(state))
            if key not in with_sends:
                own = stage_s.at(*key) + edges[t]
                with_sends[key] = np.stack([np.stack([own + send_s[t][q][None, :] + send_s[t][r][:, None]
                                                      for q in range(n_pools + 1)]) for r in range(n_pools + 1)])
            got = np.maximum(came[None, :, None, :], with_sends[key]).min(axis=(1, 3))
            np.minimum(here[t], got, out=here[t])
    exact = cover[..., :n_pools, n_pools, 0].min(axis=-1)  # every device of the vector used
    for axis in range(n_pools):  # a device may stay idle: the least over every smaller vector
        exact = np.minimum.accumulate(exact, axis=axis)
    # past the cap of a pool its extra devices stay idle: the value at the cap
    exact = np.pad(exact, [(0, n - c) for n, c in zip(supply, capped, strict=True)], mode="edge")
    return PaceTable(names, supply, exact)


def edge_s(cost: CostModel, members: Sequence[Sequence[Device]], pool: int, schedule: Schedule, slices: int,
           virtual_workers: int) -> np.ndarray:
    """``E[i, l]``: seconds of an iteration in which a stage of layers ``[i, l)`` on a device of
    ``pools[pool]`` cannot run its ``m`` micro-batches. Its first action waits for the first
    micro-batch's first slice (of up to ``slices``) to cross layers ``[0, i)`` forward (the head);
    after its last backward, under 1F1B and GPipe (every backward waits for the forward chain) the
    last micro-batch's gradient still crosses ``[0, i)`` backward (the tail), and the device itself
    all-reduces its layers' gradients among ``virtual_workers`` holders and steps them (the hold,
    priced as :func:`.layers.layer_bound` prices them; part of it may come before the last
    backward, which then ends that much later). So ``E = head + max(tail, hold)``. Each layer of the
    head and tail at the least seconds of any pool's kind and recompute mode; sends left out (they
    only add)."""
    n = cost.num_layers
    fwd, bwd = np.full(n, math.inf), np.full(n, math.inf)
    for devices in members:
        gpu_type, t = split_kind(devices[0].kind)
        for mode in cost.options.recompute_modes:
            f, b = cost.recomputing(mode).at_degree(t).direction_matrices(gpu_type)
            fwd, bwd = np.minimum(fwd, np.diagonal(f, 1)), np.minimum(bwd, np.diagonal(b, 1))
    zero = np.zeros(1)
    head = np.concatenate([zero, np.cumsum(fwd / slices)])
    tail = np.concatenate([zero, np.cumsum(bwd)]) if schedule.name in FILL_SCHEDULES else np.zeros(n + 1)
    k = virtual_workers
    allreduce = k > 1 and cost.options.sync and schedule.spec.sync == "allreduce"
    stepped = schedule.spec.sync != "wave"
    gpu_type, t = split_kind(members[pool][0].kind)
    shard = cost.at_degree(t)
    step = shard.update_prefix(gpu_type) if stepped else np.zeros(n + 1)
    per_byte_s = least_allreduce_per_byte_s(cost, [d for m in members for d in m], k) if allreduce else 0.0
    hold = step + per_byte_s * shard.param_prefix / t  # one GPU's gradient bytes
    return head[:, None] + np.maximum(hold[None, :] - hold[:, None], tail[:, None])


def count_vectors(supply: Sequence[int], most: int) -> int:
    """How many vectors of counts within ``supply`` hold at most ``most`` devices in all: the
    vectors :func:`pace_table`'s program covers."""
    ways = [1] + [0] * max(most, 0)  # ways[s]: vectors of the pools so far with s devices
    for n in supply:
        ways = [sum(ways[max(0, s - n):s + 1]) for s in range(len(ways))]
    return sum(ways) if most >= 0 else 0


def _vectors(supply: tuple[int, ...], most: int) -> Iterator[tuple[int, ...]]:
    """The vectors within ``supply`` of at most ``most`` devices, in C order (so each comes after
    every vector one device below it)."""
    if not supply:
        yield ()
        return
    for c in range(min(supply[0], most) + 1):
        for rest in _vectors(supply[1:], most - c):
            yield (c, *rest)


class _StageSeconds:
    """Per pool and place from the end, one micro-batch's seconds of layers ``[i, j)`` on a device
    of the pool (``inf`` where ``j <= i`` or the layers cannot fit it): the least over the
    recompute modes the options allow of that mode's compute where that mode's memory, with the
    activations in flight at that place (:meth:`partitioner.schedule.ScheduleSpec.activations_in_flight`;
    one micro-batch for zero-bubble schedules, whose peak the simulator measures), fits the
    device (the memory :meth:`partitioner.cost.CostModel.check_plan_memory` checks, with ZeRO's
    state over every GPU)."""

    def __init__(self, cost: CostModel, members: Sequence[Sequence[Device]], schedule: Schedule):
        self.cost, self.members, self.schedule = cost, members, schedule
        n = cost.num_layers + 1
        self.ahead = np.arange(n)[None, :] > np.arange(n)[:, None]
        self.memo: dict[tuple[int, int], np.ndarray] = {}

    def key(self, pool: int, from_end: int) -> tuple[int, int]:
        """(pool, activations in flight) of a stage ``from_end`` places from the end."""
        spec, m = self.schedule.spec, self.schedule.micro_batches
        return pool, 1 if spec.split_backward else spec.activations_in_flight(from_end, m)

    def at(self, pool: int, flight: int) -> np.ndarray:
        """The seconds of :meth:`key`'s stage."""
        key = (pool, flight)
        if key not in self.memo:
            cost, dev = self.cost, self.members[pool][0]
            gpu_type, t = split_kind(dev.kind)
            holders = cost.cluster.num_gpus if cost.options.zero else 1
            best = np.full(self.ahead.shape, math.inf)
            for mode in cost.options.recompute_modes:
                cs = cost.recomputing(mode)
                pre = np.concatenate([[0.0], np.cumsum(cs.at_degree(t).layer_compute_s(gpu_type))])
                fits = cs.memory_matrix(flight, self.schedule, slice(None), t, holders) <= dev.memory_bytes
                best = np.minimum(best, np.where(fits & self.ahead, pre[None, :] - pre[:, None], math.inf))
            self.memo[key] = best
        return self.memo[key]


def _less(state: tuple[int, ...], t: int) -> tuple[int, ...]:
    """``state`` with one device fewer of pool ``t``."""
    return (*state[:t], state[t] - 1, *state[t + 1:])


def _least_sends(cost: CostModel, senders: Sequence[Device], receivers: Sequence[Device]) -> np.ndarray:
    """Per cut, the least seconds of one boundary message from a device of ``senders`` to another
    of ``receivers`` (0 where the only pair is a device and itself), each message alone (a NIC
    shared with other flows only slows it). Its time depends on the two ends' nodes and NICs
    (their link, or a device pair's override), so one pair per two ends stands for the rest."""
    cl = cost.cluster
    nodes = {n.name: n for n in cl.nodes}
    per_device = any(x.a not in nodes or x.b not in nodes for x in cl.links)  # an override of a device pair

    def end(d: Device) -> tuple[str, ...]:  # what a message's time can depend on at this end
        node = nodes[d.node]
        return (d.name,) if per_device else (d.node, str(node.nic_of(d.index)) if node.nic_gbps > 0 else "")

    by_end: dict[tuple[str, ...], list[Device]] = {}
    for d in receivers:
        by_end.setdefault(end(d), []).append(d)
    pairs: dict[tuple[tuple[str, ...], tuple[str, ...]], tuple[Device, Device]] = {}
    for a in senders:
        ea = end(a)
        for eb, group in by_end.items():
            if (ea, eb) not in pairs:
                b = next((d for d in group if d.name != a.name), None)
                if b is not None:
                    pairs[(ea, eb)] = (a, b)
    vectors = [cost.boundary_vector_s(a.name, b.name) for a, b in pairs.values()]
    return np.min(vectors, axis=0) if vectors else np.zeros(cost.num_layers + 1)


def _minimal(feasible: np.ndarray) -> list[tuple[int, ...]]:
    """The vectors of ``feasible`` (an up-set: more devices of a kind never hurt) with no
    feasible vector one device below them."""
    below = np.zeros_like(feasible)
    for axis in range(feasible.ndim):  # below[state]: state less one device of some kind is feasible
        head = [slice(None)] * feasible.ndim
        tail = [slice(None)] * feasible.ndim
        head[axis], tail[axis] = slice(1, None), slice(None, -1)
        below[tuple(head)] |= feasible[tuple(tail)]
    return [tuple(int(i) for i in idx) for idx in np.argwhere(feasible & ~below)]


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
