"""Discrete-event timing of schedule action lists, priced by the cost model.

Every rank runs its list from :mod:`partitioner.schedule` in order. Semantics (the ones the
runtime implements):

* ``F`` / ``B`` occupy the rank for the stage's forward / backward time
  (:meth:`CostModel.fwd_bwd_s` of the GPU type).
* A send starts the transfer of the boundary tensor as soon as the link is free
  (:meth:`CostModel.transfer_s` of :meth:`CostModel.boundary_bytes`). A link is one direction
  between two devices of a node, or between two nodes (so transfers from different GPUs of
  one node to another node share it); transfers on a link are served first come, first
  served. Without ``CostOptions.overlap_comm`` the sender waits for its transfer to finish
  (the additive model); with it, the sender goes on computing.
* A receive blocks the rank until the matching transfer has arrived.
* ``PUSH`` / ``PULL`` (WSP) take :meth:`CostModel.parameter_sync_s` each; a ``PULL`` also waits
  until the other virtual workers have pushed the wave it names.
* ``STEP`` takes no time (the profile does not time the optimizer).

The loop keeps one program counter per rank and a heap of runnable ranks keyed by their
clock, so work is done in time order (which makes first-come-first-served links exact) and
a blocked rank costs nothing until its message arrives. If ranks remain blocked when nothing
can run, the schedule deadlocks: :class:`DeadlockError` names the ranks of the wait cycle.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cluster import Cluster
from .cost import CostModel, CostOptions
from .errors import FormatError, PartitionerError
from .plan import Plan
from .profile import Profile
from .schedule import (
    ACTION_KINDS,
    PULL,
    PUSH,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    STEP,
    Action,
    Columns,
    match_key,
    schedule_columns,
    to_actions,
)

__all__ = [
    "DeadlockError",
    "Timeline",
    "default_iterations",
    "predict",
    "simulate_plan",
    "simulate_programs",
]

log = logging.getLogger(__name__)

_KIND_CODE = {k: i for i, k in enumerate(ACTION_KINDS)}
# op codes of the event loop
_COMPUTE, _SEND, _RECV, _STEP, _PUSH, _PULL = range(6)
_OP_OF_KIND = {"F": _COMPUTE, "B": _COMPUTE, SEND_ACT: _SEND, SEND_GRAD: _SEND, RECV_ACT: _RECV,
               RECV_GRAD: _RECV, STEP: _STEP, PUSH: _PUSH, PULL: _PULL}


class DeadlockError(PartitionerError):
    """The action lists cannot all run to the end: some ranks wait for each other forever."""


@dataclass(frozen=True, eq=False)
class Timeline:
    """What the simulator saw: every action's start and end, and the figures derived from them.

    Events are columns (numpy arrays, one entry per action): ``event_rank`` indexes
    ``devices``, ``event_kind`` indexes :data:`partitioner.schedule.ACTION_KINDS`. For a send
    the end is when the transfer arrives. ``iteration_s`` is the makespan of one iteration
    for flushing schedules, and the steady-state period for ``2bw`` and ``wsp`` (between
    iteration ends, leaving out the final drain and, under WSP, the first ``D + 1`` waves);
    with several virtual workers it is the slowest one's. Bubble fractions are measured over
    the same window. ``clock_gaps`` (WSP) is, at every ``PULL`` that lets a rank go on,
    its virtual worker's clock minus the slowest virtual worker's clock.
    """

    schedule: str
    micro_batches: int
    micro_batch_size: int
    iterations: int
    devices: tuple[str, ...]
    rank_worker: tuple[int, ...]
    event_rank: np.ndarray
    event_kind: np.ndarray
    event_micro_batch: np.ndarray
    event_stage: np.ndarray
    event_start_s: np.ndarray
    event_end_s: np.ndarray
    makespan_s: float
    iteration_s: float
    samples_per_s: float
    bubble_fraction: Mapping[str, float] = field(default_factory=dict)
    peak_memory_bytes: Mapping[str, float] = field(default_factory=dict)
    peak_activations: Mapping[str, int] = field(default_factory=dict)
    weight_versions: Mapping[str, int] = field(default_factory=dict)
    clock_gaps: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.event_rank)
        for name in ("event_kind", "event_micro_batch", "event_stage", "event_start_s", "event_end_s"):
            if len(getattr(self, name)) != n:
                raise FormatError(name, len(getattr(self, name)), f"must have one entry per event ({n})")
        if len(self.rank_worker) != len(self.devices):
            raise FormatError("rank_worker", list(self.rank_worker), "must name a virtual worker per device")
        if self.iteration_s < 0 or self.makespan_s < 0:
            raise FormatError("iteration_s", self.iteration_s, "times must be >= 0")

    @property
    def num_events(self) -> int:
        return len(self.event_rank)

    @property
    def max_clock_gap(self) -> int:
        return max(self.clock_gaps, default=0)

    def events(self, rank: int | None = None) -> list[tuple[int, str, int, int, float, float]]:
        """``(rank, kind, micro_batch, stage, start_s, end_s)`` tuples, optionally of one rank."""
        sel = np.arange(self.num_events) if rank is None else np.flatnonzero(self.event_rank == rank)
        return [(int(self.event_rank[i]), ACTION_KINDS[self.event_kind[i]], int(self.event_micro_batch[i]),
                 int(self.event_stage[i]), float(self.event_start_s[i]), float(self.event_end_s[i]))
                for i in sel]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "partitioner.timeline/1",
            "schedule": self.schedule, "micro_batches": self.micro_batches,
            "micro_batch_size": self.micro_batch_size, "iterations": self.iterations,
            "devices": list(self.devices), "rank_worker": list(self.rank_worker),
            "makespan_s": self.makespan_s, "iteration_s": self.iteration_s,
            "samples_per_s": self.samples_per_s,
            "bubble_fraction": dict(self.bubble_fraction),
            "peak_memory_bytes": dict(self.peak_memory_bytes),
            "peak_activations": dict(self.peak_activations),
            "weight_versions": dict(self.weight_versions),
            "clock_gaps": list(self.clock_gaps), "notes": list(self.notes),
            "kinds": list(ACTION_KINDS),
            "events": {"rank": self.event_rank.tolist(), "kind": self.event_kind.tolist(),
                       "micro_batch": self.event_micro_batch.tolist(), "stage": self.event_stage.tolist(),
                       "start_s": self.event_start_s.tolist(), "end_s": self.event_end_s.tolist()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Timeline:
        if d.get("format") != "partitioner.timeline/1":
            raise FormatError("format", d.get("format"), "expected 'partitioner.timeline/1'")
        ev = d["events"]
        return cls(
            d["schedule"], int(d["micro_batches"]), int(d["micro_batch_size"]), int(d["iterations"]),
            tuple(d["devices"]), tuple(d["rank_worker"]),
            np.asarray(ev["rank"], dtype=np.int32), np.asarray(ev["kind"], dtype=np.int8),
            np.asarray(ev["micro_batch"], dtype=np.int64), np.asarray(ev["stage"], dtype=np.int32),
            np.asarray(ev["start_s"], dtype=np.float64), np.asarray(ev["end_s"], dtype=np.float64),
            float(d["makespan_s"]), float(d["iteration_s"]), float(d["samples_per_s"]),
            dict(d["bubble_fraction"]), dict(d["peak_memory_bytes"]),
            {k: int(v) for k, v in d["peak_activations"].items()},
            {k: int(v) for k, v in d["weight_versions"].items()},
            tuple(d["clock_gaps"]), tuple(d["notes"]),
        )


# -- the event loop ---------------------------------------------------------------------------

# An op is (code, duration_s, key, link): key is the message key (send/recv) or the WSP wave
# (push/pull); link indexes the link a send uses (-1 for none).
_Op = tuple[int, float, int, int]


def _run(ops: Sequence[Sequence[_Op]], rank_worker: Sequence[int], overlap: bool, n_links: int
         ) -> tuple[list[list[float]], list[list[float]], list[int]]:
    """Time every op; returns per-rank start and end lists and each rank's program counter."""
    n_ranks = len(ops)
    n_workers = max(rank_worker, default=-1) + 1
    worker_size = [0] * n_workers
    for w in rank_worker:
        worker_size[w] += 1
    starts = [[0.0] * len(o) for o in ops]
    ends = [[0.0] * len(o) for o in ops]
    pc = [0] * n_ranks
    blocked = [-1.0] * n_ranks
    arrival: dict[int, float] = {}
    waiting: dict[int, int] = {}
    link_free = [0.0] * max(n_links, 1)
    pushes: dict[int, list[int]] = {}  # wave -> pushes counted per worker
    push_end: dict[int, list[float]] = {}  # wave -> latest push end per worker
    pull_wait: dict[int, list[int]] = {}
    heap = [(0.0, r) for r in range(n_ranks)]
    heappush, heappop = heapq.heappush, heapq.heappop
    inf = math.inf

    def pull_ready(wave: int, worker: int) -> float | None:
        cnt, end = pushes.get(wave), push_end.get(wave)
        if cnt is None or end is None:
            return None if n_workers > 1 else 0.0
        when = 0.0
        for b in range(n_workers):
            if b == worker:
                continue
            if cnt[b] < worker_size[b]:
                return None
            when = max(when, end[b])
        return when

    while heap:
        t, r = heappop(heap)
        o, st, en = ops[r], starts[r], ends[r]
        n, i = len(o), pc[r]
        limit = heap[0][0] if heap else inf
        while i < n:
            code, dur, key, link = o[i]
            if code == _COMPUTE:
                st[i] = t
                t += dur
                en[i] = t
            elif code == _RECV:
                a = arrival.pop(key, None)
                if a is None:
                    blocked[r] = t
                    waiting[key] = r
                    break
                if blocked[r] >= 0:
                    st[i] = blocked[r]
                    blocked[r] = -1.0
                else:
                    st[i] = t
                if a > t:
                    t = a
                en[i] = t
            elif code == _SEND:
                if dur > 0.0:
                    lf = link_free[link]
                    e = (t if t > lf else lf) + dur
                    link_free[link] = e
                else:
                    e = t
                arrival[key] = e
                st[i] = t
                en[i] = e
                if not overlap:
                    t = e
                w = waiting.pop(key, -1)
                if w >= 0:
                    heappush(heap, (e, w))
                    limit = heap[0][0]
            elif code == _STEP:
                st[i] = en[i] = t
            elif code == _PUSH:
                st[i] = t
                t += dur
                en[i] = t
                worker = rank_worker[r]
                cnt = pushes.setdefault(key, [0] * n_workers)
                ends_w = push_end.setdefault(key, [0.0] * n_workers)
                cnt[worker] += 1
                ends_w[worker] = max(ends_w[worker], t)
                if cnt[worker] == worker_size[worker] and key in pull_wait:
                    still = []
                    for q in pull_wait.pop(key):
                        when = pull_ready(key, rank_worker[q])
                        if when is None:
                            still.append(q)
                        else:
                            heappush(heap, (max(when, blocked[q]), q))
                    if still:
                        pull_wait[key] = still
                    limit = heap[0][0] if heap else inf
            else:  # _PULL
                when = pull_ready(key, rank_worker[r])
                if when is None:
                    blocked[r] = t
                    pull_wait.setdefault(key, []).append(r)
                    break
                if blocked[r] >= 0:
                    st[i] = blocked[r]
                    blocked[r] = -1.0
                else:
                    st[i] = t
                t = max(t, when) + dur
                en[i] = t
            i += 1
            if t > limit:
                heappush(heap, (t, r))
                break
        pc[r] = i
    if arrival:
        # a message sent but never received: the lists do not match
        raise DeadlockError(f"{len(arrival)} message(s) sent but never received; sends and receives "
                            f"do not match (see partitioner.schedule.match_key)")
    return starts, ends, pc


def _deadlock_message(programs: Sequence[Sequence[Action]], pc: Sequence[int], names: Sequence[str],
                      rank_worker: Sequence[int], pushed: set[tuple[int, int]]) -> str:
    """Describe the wait cycle among blocked ranks (or the wait on a finished rank)."""
    def waits_for(r: int) -> int | None:
        a = programs[r][pc[r]]
        if a.kind in (RECV_ACT, RECV_GRAD):
            return base[r] + a.peer
        if a.kind == PULL:
            for q in range(len(programs)):
                if rank_worker[q] != rank_worker[r] and (q, a.version) not in pushed:
                    return q
        return None

    base = [0] * len(programs)
    first: dict[int, int] = {}
    for r, w in enumerate(rank_worker):
        first.setdefault(w, r)
        base[r] = first[w]
    stuck = [r for r in range(len(programs)) if pc[r] < len(programs[r])]

    def what(r: int) -> str:
        a = programs[r][pc[r]]
        return f"rank {r} ({names[r]}) at {a.kind} micro-batch {a.micro_batch} stage {a.stage}"

    r, seen = stuck[0], []
    while r not in seen:
        seen.append(r)
        nxt = waits_for(r)
        if nxt is None or pc[nxt] >= len(programs[nxt]):
            return (f"deadlock: {what(r)} waits for "
                    f"{'rank ' + str(nxt) + ' (' + names[nxt] + '), which has finished' if nxt is not None else 'nothing that can come'}"
                    f"; {len(stuck)} rank(s) blocked")
        r = nxt
    cycle = seen[seen.index(r):]
    return "deadlock: " + "; ".join(f"{what(q)} waits for rank {waits_for(q)}" for q in cycle)


def simulate_programs(programs: Sequence[Sequence[Action]], rank_worker: Sequence[int] | None = None,
                      names: Sequence[str] | None = None, fwd_s: float = 1.0, bwd_s: float = 2.0,
                      ) -> tuple[list[list[float]], list[list[float]]]:
    """Run action lists with unit prices (forward ``fwd_s``, backward ``bwd_s``, free transfers).

    For checking schedules without a cost model: raises :class:`DeadlockError` naming the ranks
    of any wait cycle, else returns per-rank start and end times. Peers in the lists are ranks
    within their virtual worker (``rank_worker`` groups consecutive ranks; default: one).
    """
    rank_worker = list(rank_worker) if rank_worker is not None else [0] * len(programs)
    names = list(names) if names is not None else [f"r{r}" for r in range(len(programs))]
    ops: list[list[_Op]] = []
    for r, prog in enumerate(programs):
        row: list[_Op] = []
        for a in prog:
            code = _OP_OF_KIND[a.kind]
            dur = fwd_s if a.kind == "F" else bwd_s if a.kind == "B" else 0.0
            if code in (_SEND, _RECV):
                sender, d = match_key(a)[2], int(a.kind in (SEND_GRAD, RECV_GRAD))
                key = ((a.micro_batch * 4096 + sender) * 2 + d) * 1024 + rank_worker[r]
            else:
                key = a.version
            row.append((code, dur, key, -1))
        ops.append(row)
    starts, ends, pc = _run(ops, rank_worker, True, 0)
    if any(pc[r] < len(ops[r]) for r in range(len(ops))):
        _raise_deadlock(programs, pc, names, rank_worker)
    return starts, ends


def _raise_deadlock(programs: Sequence[Sequence[Action]], pc: Sequence[int], names: Sequence[str],
                    rank_worker: Sequence[int]) -> None:
    pushed = {(r, a.version) for r, prog in enumerate(programs) for a in prog[:pc[r]] if a.kind == PUSH}
    raise DeadlockError(_deadlock_message(programs, pc, names, rank_worker, pushed))


# -- plans -------------------------------------------------------------------------------------


def default_iterations(schedule: str, staleness: int = 0) -> int:
    """Iterations simulated by default: one for flushing schedules; enough for a steady state
    (and for the WSP staleness bound to bind) for ``2bw`` and ``wsp``."""
    if schedule == "2bw":
        return 4
    if schedule == "wsp":
        return staleness + 4
    return 1


@dataclass(frozen=True)
class _Pipeline:
    worker: int
    ranks: int  # p
    devices: tuple[str, ...]  # rank -> device
    stages: tuple[tuple[int, int], ...]  # stage -> (start, stop)


def _pipelines(plan: Plan) -> list[_Pipeline]:
    out = []
    v = plan.chunks
    for w, vw in enumerate(plan.virtual_workers):
        where = f"virtual_workers[{w}]"
        for k, st in enumerate(vw.stages):
            if st.replicas:
                raise PartitionerError(
                    f"{where}.stages[{k}] has replicas {list(st.replicas)}: the simulator does not price "
                    f"the gradient all-reduce of replicated stages; plan without replicas or use "
                    f"virtual workers (wsp) for data parallelism")
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
            if st.device != devs[s % p]:
                raise FormatError(f"{where}.stages[{s}].device", st.device,
                                  f"with chunks={v}, stage {s} (chunk {s // p}) must be on {devs[s % p]}: "
                                  f"stage c*p + d runs on the device of stage d")
        out.append(_Pipeline(w, p, devs, tuple(st.layers for st in vw.stages)))
    return out


def simulate_plan(plan: Plan, profile: Profile, cluster: Cluster, options: CostOptions | None = None,
                  iterations: int | None = None) -> Timeline:
    """Simulate ``plan`` under its schedule with the cost model; see :class:`Timeline`."""
    cost = CostModel(profile, cluster, options)
    sched, m = plan.schedule, plan.micro_batches
    n_iter = iterations if iterations is not None else default_iterations(sched, plan.staleness)
    pipes = _pipelines(plan)
    notes: list[str] = []
    if len(pipes) > 1 and sched != "wsp":
        notes.append(f"{len(pipes)} virtual workers simulated as independent pipelines; the gradient "
                     f"all-reduce between them is not priced (use schedule wsp for WSP synchronisation)")
    links: dict[tuple[str, str], int] = {}

    def link_of(a: str, b: str) -> int:
        da, db = cluster.device(a), cluster.device(b)
        k = (a, b) if da.node == db.node else (da.node, db.node)
        return links.setdefault(k, len(links))

    columns: list[Columns] = []
    ops: list[list[_Op]] = []
    names: list[str] = []
    rank_worker: list[int] = []
    act_bytes: list[np.ndarray] = []  # per rank: activation bytes of each stage (global index)
    weights: list[list[tuple[int, int]]] = []  # per rank: layer ranges it holds
    op_code = np.array([_OP_OF_KIND[k] for k in ACTION_KINDS], dtype=np.int64)
    # message keys, equal for a send and its receive:
    # ((micro_batch * 4096 + sending stage) * 2 + direction) * 1024 + virtual worker
    sender_shift = np.array([0, 0, 0, -1, 0, 1, 0, 0, 0])
    direction = np.array([0, 0, 0, 0, 1, 1, 0, 0, 0])
    is_msg = np.isin(np.arange(9), [_KIND_CODE[k] for k in (SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)])
    is_sync = np.isin(np.arange(9), [_KIND_CODE[k] for k in (STEP, PUSH, PULL)])
    for pipe in pipes:
        cols = schedule_columns(sched, pipe.ranks, m, plan.chunks, n_iter, plan.staleness)
        p, n_st, w = pipe.ranks, len(pipe.stages), pipe.worker
        dev = [pipe.devices[s % p] for s in range(n_st)]
        # tables indexed [kind, stage]; stage -1 (STEP, PUSH, PULL) reads the extra last column
        dur = np.zeros((9, n_st + 1))
        link = np.full((9, n_st + 1), -1, dtype=np.int64)
        for s, (a, b) in enumerate(pipe.stages):
            dur[0, s], dur[1, s] = cost.fwd_bwd_s(cluster.device(dev[s]).gpu_type, a, b)
            if s + 1 < n_st:
                dur[2, s] = cost.transfer_s(cost.boundary_bytes(b), dev[s], dev[s + 1])
                link[2, s] = link_of(dev[s], dev[s + 1])
            if s > 0:
                dur[4, s] = cost.transfer_s(cost.boundary_bytes(a), dev[s], dev[s - 1])
                link[4, s] = link_of(dev[s], dev[s - 1])
        saved = np.array([cost.activation_bytes(a, b) for a, b in pipe.stages])
        for r in range(p):
            kind, mb, stage, _, version = cols[r]
            sync = sum(cost.parameter_sync_s(a, b) for a, b in pipe.stages[r::p])
            dur[7, -1] = dur[8, -1] = sync
            d = dur[kind, stage]
            key = np.where(is_msg[kind], ((mb * 4096 + stage + sender_shift[kind]) * 2 + direction[kind]) * 1024 + w,
                           np.where(is_sync[kind], version, -1))
            ops.append(list(zip(op_code[kind].tolist(), d.tolist(), key.tolist(), link[kind, stage].tolist(),
                                strict=True)))
            columns.append(cols[r])
            names.append(pipe.devices[r])
            rank_worker.append(w)
            act_bytes.append(saved)
            weights.append(list(pipe.stages[r::p]))
    starts, ends, pc = _run(ops, rank_worker, cost.options.overlap_comm, len(links))
    if any(pc[r] < len(ops[r]) for r in range(len(ops))):
        _raise_deadlock([to_actions(c) for c in columns], pc, names, rank_worker)
    return _summarise(plan, cost, n_iter, columns, starts, ends, names, rank_worker, act_bytes,
                      weights, notes)


def _summarise(plan: Plan, cost: CostModel, n_iter: int, columns: list[Columns],
               starts: list[list[float]], ends: list[list[float]], names: list[str],
               rank_worker: list[int], act_bytes: list[np.ndarray], weights: list[list[tuple[int, int]]],
               notes: list[str]) -> Timeline:
    sched, m = plan.schedule, plan.micro_batches
    n_workers = max(rank_worker) + 1
    boundary = _KIND_CODE[PUSH] if sched == "wsp" else _KIND_CODE[STEP]
    offset = 0 if sched == "wsp" else 1  # STEP(v) ends iteration v - 1; PUSH(c) ends wave c
    st_col = [np.asarray(x, dtype=np.float64) for x in starts]
    en_col = [np.asarray(x, dtype=np.float64) for x in ends]
    t_end = np.zeros((n_workers, n_iter))
    worker_end = np.zeros(n_workers)
    for r, (kind, _, _, _, version) in enumerate(columns):
        w, en = rank_worker[r], en_col[r]
        sel = kind == boundary
        np.maximum.at(t_end[w], version[sel] - offset, en[sel])
        if len(en):
            worker_end[w] = max(worker_end[w], float(en.max()))
    windows = []
    for w in range(n_workers):
        if n_iter == 1:
            windows.append((0.0, float(worker_end[w]), 1))
        else:
            # the last iteration drains the pipeline: measure up to the end of the one before;
            # under WSP the first D + 1 waves run ahead of the slowest worker unchecked: skip them
            last = n_iter - 2 if n_iter >= 3 else n_iter - 1
            first = min(plan.staleness + 1, last - 1) if sched == "wsp" and last >= 2 else 0
            windows.append((float(t_end[w, first]), float(t_end[w, last]), last - first))
    iteration = max((hi - lo) / k if n_iter > 1 else hi for lo, hi, k in windows)
    samples = n_workers * m * plan.micro_batch_size
    samples_per_s = samples / iteration if iteration > 0 else math.inf

    bubble: dict[str, float] = {}
    peak_mem: dict[str, float] = {}
    peak_act: dict[str, int] = {}
    versions: dict[str, int] = {}
    for r, (kind, mb, stage, _, version) in enumerate(columns):
        name, st, en = names[r], st_col[r], en_col[r]
        comp = kind <= 1
        lo, hi, _ = windows[rank_worker[r]]
        busy = np.clip(np.minimum(en[comp], hi) - np.maximum(st[comp], lo), 0.0, None).sum()
        bubble[name] = float(1.0 - busy / (hi - lo)) if hi > lo else 0.0
        # activations held: +saved at each forward, -saved at each backward, in program order
        sign = 1 - 2 * kind[comp].astype(np.int64)
        held = np.cumsum(sign * act_bytes[r][stage[comp]])
        count = np.cumsum(sign)
        live = _live_versions(kind, mb, stage, version) if sched == "2bw" else 1
        w_bytes = sum(cost.weight_bytes(a, b, live) for a, b in weights[r])
        peak_mem[name] = w_bytes + (float(held.max()) if len(held) else 0.0) + cost.options.reserved_bytes
        peak_act[name] = int(count.max()) if len(count) else 0
        versions[name] = live
    gaps = _clock_gaps(columns, en_col, rank_worker) if sched == "wsp" else ()
    for line in notes:
        log.info(line)
    cat = np.concatenate
    return Timeline(
        sched, m, plan.micro_batch_size, n_iter, tuple(names), tuple(rank_worker),
        cat([np.full(len(c[0]), r, dtype=np.int32) for r, c in enumerate(columns)]),
        cat([c[0] for c in columns]).astype(np.int8), cat([c[1] for c in columns]),
        cat([c[2] for c in columns]).astype(np.int32), cat(st_col), cat(en_col),
        float(worker_end.max()), iteration, samples_per_s, bubble, peak_mem, peak_act, versions, gaps,
        tuple(notes))


def _live_versions(kind: np.ndarray, mb: np.ndarray, stage: np.ndarray, version: np.ndarray) -> int:
    """Most weight versions a rank must hold at once: the current one plus every version still
    used by a micro-batch between its forward and its backward."""
    current, peak = 0, 1
    live: dict[int, int] = {0: 1}  # version -> references (the current version holds one)
    used: dict[tuple[int, int], int] = {}
    step = _KIND_CODE[STEP]
    for k, j, s, v in zip(kind.tolist(), mb.tolist(), stage.tolist(), version.tolist(), strict=True):
        if k == 0:
            used[(j, s)] = current
            live[current] += 1
        elif k == 1:
            u = used.pop((j, s))
            live[u] -= 1
            if live[u] == 0:
                del live[u]
        elif k == step:
            live[current] -= 1
            if live[current] == 0:
                del live[current]
            current = v
            live[current] = live.get(current, 0) + 1
            peak = max(peak, len(live))
    return peak


def _clock_gaps(columns: list[Columns], ends: list[np.ndarray], rank_worker: list[int]) -> tuple[int, ...]:
    """At each PULL's end: the rank's virtual-worker clock minus the slowest one's."""
    n_workers = max(rank_worker) + 1
    size = [rank_worker.count(w) for w in range(n_workers)]
    done: dict[tuple[int, int], list[float]] = {}  # (worker, wave) -> push ends
    pulls: list[tuple[float, int]] = []
    push, pull = _KIND_CODE[PUSH], _KIND_CODE[PULL]
    for r, (kind, _, _, _, version) in enumerate(columns):
        for i in np.flatnonzero(kind == push):
            done.setdefault((rank_worker[r], int(version[i])), []).append(float(ends[r][i]))
        pulls += [(float(ends[r][i]), rank_worker[r]) for i in np.flatnonzero(kind == pull)]
    finished = [sorted(max(t) for (w2, _), t in done.items() if w2 == w and len(t) == size[w])
                for w in range(n_workers)]

    def clock(w: int, t: float) -> int:
        return int(np.searchsorted(finished[w], t, side="right"))

    return tuple(clock(w, t) - min(clock(b, t) for b in range(n_workers)) for t, w in pulls)


def predict(plan: Plan, profile: Profile, cluster: Cluster, options: CostOptions | None = None,
            timeline: Timeline | None = None) -> dict[str, float]:
    """The ``Plan.predicted`` figures, from the simulator.

    ``bottleneck_s`` is the largest per-micro-batch work of one device (its stages' times
    from :meth:`CostModel.stage_time_s`, summed over its chunks); ``bubble_fraction`` is the
    mean over devices and ``peak_memory_bytes`` the largest device's (per-device figures are
    on the :class:`Timeline`).
    """
    cost = CostModel(profile, cluster, options)
    tl = timeline if timeline is not None else simulate_plan(plan, profile, cluster, options)
    per_device: dict[str, float] = {}
    for vw in plan.virtual_workers:
        st = vw.stages
        for k, s in enumerate(st):
            t = cost.stage_time_s(s.start, s.stop, s.device, st[k - 1].device if k > 0 else None,
                                  st[k + 1].device if k + 1 < len(st) else None)
            per_device[s.device] = per_device.get(s.device, 0.0) + t
    bubbles = list(tl.bubble_fraction.values())
    return {
        "bottleneck_s": max(per_device.values()),
        "iteration_s": tl.iteration_s,
        "samples_per_s": tl.samples_per_s,
        "bubble_fraction": float(np.mean(bubbles)) if bubbles else 0.0,
        "peak_memory_bytes": max(tl.peak_memory_bytes.values()),
    }
