"""The event engine: runs per-rank action lists in time order and detects deadlocks.

Action lists are priced by :mod:`partitioner.simulate` before they run here. Every rank runs its list from :mod:`partitioner.schedule` in order. Semantics (the ones the
runtime implements):

* ``F`` / ``B`` occupy the rank for the stage's forward / backward time
  (:meth:`CostModel.fwd_bwd_s` of the GPU type); ``I`` / ``W`` for the two parts of the backward
  (:meth:`CostModel.backward_split_s`).
* A send starts the transfer of the boundary tensor as soon as the link is free
  (:meth:`CostModel.transfer_s` of :meth:`CostModel.boundary_bytes`). A link is one direction
  between two devices of a node, or between two nodes (so transfers from different GPUs of
  one node to another node share it); transfers on a link are served first come, first
  served. Without ``CostOptions.overlap_comm`` the sender waits for its transfer to finish
  (the additive model); with it, the sender goes on computing. Where the cluster gives its
  nodes NICs (``Node.nic_gbps``), a transfer between nodes is a flow instead
  (:mod:`partitioner.flows`): flows that overlap in time divide the bandwidth of the NICs they
  cross, and a flow's end (when the receiver gets it, and a blocking sender goes on) is known
  only as the flows around it start and end.
* A receive blocks the rank until the matching transfer has arrived.
* ``PUSH(c)`` (WSP) starts an asynchronous all-reduce of the wave's update over each holder set
  the rank belongs to (:class:`WaveGroups`: the holders of the same layers in every virtual
  worker) and goes on at once (the op's own duration is the local work: applying the update,
  and a replicated stage's blocking all-reduce over its replicas). The all-reduce of a holder
  set for wave ``c`` completes when its last holder has pushed ``c``, plus its all-reduce time.
  ``PULL(c)`` waits until every all-reduce of wave ``c`` the rank belongs to is complete. Without
  holder sets (:func:`simulate_programs`), ``PULL(c)`` waits until the other virtual workers have
  pushed ``c``.
* ``ALLREDUCE`` is a collective: a member blocks until every member of its group has arrived,
  then all finish together after the all-reduce time (:meth:`CostModel.sync_s`).
* ``STEP`` takes the optimizer step of the rank's layers (``LayerTime.update_s``; 0 where the
  profile did not time it).

The loop keeps one program counter per rank and a heap of runnable ranks keyed by their
clock, so work is done in time order (which makes first-come-first-served links exact) and
a blocked rank costs nothing until its message arrives. Compute, sends, receives and steps
are timed in :func:`run_ops`'s own loop, with its state in local variables; the rarer ops that
synchronise ranks (all-reduce, push, pull) by the methods of :class:`_SyncOps`. If ranks remain
blocked when nothing can run, the schedule deadlocks: :class:`DeadlockError` names the ranks of
the wait cycle.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .errors import PartitionerError
from .flows import FlowNet
from .schedule import (
    ALLREDUCE,
    PULL,
    PUSH,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    STEP,
    Action,
    ActionKind,
    B,
    F,
    I,
    W,
    match_key,
)

__all__ = ["FLOW_SEND", "OP_OF_KIND", "DeadlockError", "Op", "WaveGroups", "raise_deadlock", "run_ops",
           "simulate_programs"]

# op codes of the event loop, and the op that runs each action kind; FLOW_SEND is a send the
# simulator routes over shared NICs (its link field is the index of its FlowSpec)
_COMPUTE, _SEND, _RECV, _STEP, _PUSH, _PULL, _COLL, FLOW_SEND = range(8)
OP_OF_KIND: dict[ActionKind, int] = {F: _COMPUTE, B: _COMPUTE, I: _COMPUTE, W: _COMPUTE, SEND_ACT: _SEND, SEND_GRAD: _SEND, RECV_ACT: _RECV,
                                     RECV_GRAD: _RECV, STEP: _STEP, PUSH: _PUSH, PULL: _PULL, ALLREDUCE: _COLL}


class DeadlockError(PartitionerError):
    """The action lists cannot all run to the end: some ranks wait for each other forever."""


# -- the event loop ---------------------------------------------------------------------------

# An op is (code, duration_s, key, link): key is the message key (send/recv), the WSP wave
# (push/pull) or the collective's key (all-reduce); link indexes the link a send uses (-1 for none).
Op = tuple[int, float, int, int]


@dataclass(frozen=True)
class WaveGroups:
    """WSP's asynchronous all-reduces: ``of_rank[r]`` lists the holder sets rank ``r`` belongs to,
    ``size[g]`` is the number of ranks in set ``g`` and ``seconds[g]`` its all-reduce time."""

    of_rank: tuple[tuple[int, ...], ...]
    size: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.size) != len(self.seconds):
            raise ValueError(f"size has {len(self.size)} entries and seconds {len(self.seconds)}; one each per set")
        for r, groups in enumerate(self.of_rank):
            for g in groups:
                if not 0 <= g < len(self.size):
                    raise ValueError(f"of_rank[{r}] names set {g}; valid: 0..{len(self.size) - 1}")
        for g, (n, t) in enumerate(zip(self.size, self.seconds, strict=True)):
            if n < 1 or not (t >= 0.0 and math.isfinite(t)):
                raise ValueError(f"set {g}: size {n} and seconds {t}; need size >= 1 and finite seconds >= 0")


class _SyncOps:
    """The ops that make ranks wait for each other beyond a message: ``ALLREDUCE`` collectives and
    WSP's ``PUSH`` / ``PULL`` (with holder sets, or between whole virtual workers). They are rare
    (a few per rank and iteration), so :func:`run_ops` hands them here and keeps its own loop to
    compute, sends and receives. Each method times op ``i`` of rank ``r`` from ``t`` and returns
    when the rank goes on, or ``None`` when it blocks (it is then queued to resume and pushed
    back on the heap when what it waits for happens).

    State shared with the loop: ``starts`` / ``ends`` (per rank), ``blocked`` (when a rank
    began to wait, -1 when it does not) and the ``heap`` of runnable ranks.
    """

    __slots__ = ("ar_count", "ar_done", "ar_latest", "ar_wait", "blocked", "coll_count", "coll_end", "coll_latest",
                 "coll_size", "coll_wait", "ends", "heap", "n_workers", "pull_wait", "push_end", "pushes",
                 "rank_worker", "starts", "wave_groups", "worker_size")

    def __init__(self, starts: list[list[float]], ends: list[list[float]], blocked: list[float],
                 heap: list[tuple[float, int]], rank_worker: Sequence[int],
                 collective_size: Mapping[int, int] | None, wave_groups: WaveGroups | None) -> None:
        self.starts, self.ends, self.blocked, self.heap = starts, ends, blocked, heap
        self.rank_worker = rank_worker
        self.wave_groups = wave_groups
        # ALLREDUCE: key -> members, arrivals so far, latest arrival, finish, ranks waiting
        self.coll_size = collective_size or {}
        self.coll_count: dict[int, int] = {}
        self.coll_latest: dict[int, float] = {}
        self.coll_end: dict[int, float] = {}
        self.coll_wait: dict[int, list[int]] = {}
        # WSP without holder sets: wave -> pushes counted per worker, latest push end per worker
        self.n_workers = max(rank_worker, default=-1) + 1
        self.worker_size = [0] * self.n_workers
        for w in rank_worker:
            self.worker_size[w] += 1
        self.pushes: dict[int, list[int]] = {}
        self.push_end: dict[int, list[float]] = {}
        self.pull_wait: dict[int, list[int]] = {}
        # WSP with holder sets: (set, wave) -> pushes so far, latest push end, completion time
        self.ar_count: dict[tuple[int, int], int] = {}
        self.ar_latest: dict[tuple[int, int], float] = {}
        self.ar_done: dict[tuple[int, int], float] = {}
        self.ar_wait: dict[tuple[int, int], list[int]] = {}

    def handlers(self) -> tuple[Callable[[int, int, float, float, int], float | None], ...]:
        """Indexed by op code: the method that times that op, ``(r, i, t, dur, key)`` -> when
        the rank goes on or ``None`` (one that refuses, for the ops :func:`run_ops` times itself)."""
        wave = self.wave_groups is not None
        out: list[Callable[[int, int, float, float, int], float | None]] = [self._not_mine] * 8
        out[_COLL] = self.allreduce
        out[_PUSH] = self.wave_push if wave else self.push
        out[_PULL] = self.wave_pull if wave else self.pull
        return tuple(out)

    def _not_mine(self, r: int, i: int, t: float, dur: float, key: int) -> float | None:
        raise AssertionError(f"rank {r} op {i}: timed by run_ops, not by the synchronising ops")

    def _resumed(self, r: int, i: int, t: float) -> None:
        """The op's start: where a resumed wait blocked, else ``t``."""
        blocked = self.blocked
        self.starts[r][i] = blocked[r] if blocked[r] >= 0 else t
        blocked[r] = -1.0

    def allreduce(self, r: int, i: int, t: float, dur: float, key: int) -> float | None:
        """Members block until the last one arrives; all finish ``dur`` after that."""
        finish = self.coll_end.get(key)
        if finish is None:
            arrived = self.coll_count[key] = self.coll_count.get(key, 0) + 1
            self.coll_latest[key] = max(self.coll_latest.get(key, 0.0), t)
            if arrived < self.coll_size.get(key, 1):
                self.blocked[r] = t
                self.coll_wait.setdefault(key, []).append(r)
                return None
            finish = self.coll_end[key] = self.coll_latest[key] + dur
            for q in self.coll_wait.pop(key, []):
                heapq.heappush(self.heap, (finish, q))
        blocked = self.blocked
        self.starts[r][i] = blocked[r] if blocked[r] >= 0 else t  # a resumed wait starts where it blocked
        blocked[r] = -1.0
        self.ends[r][i] = finish
        return finish

    def wave_push(self, r: int, i: int, t: float, dur: float, key: int) -> float:
        """Local work, then count the push in each holder set of the rank; a set's all-reduce of
        the wave completes its time after its last holder's push."""
        groups = self.wave_groups
        assert groups is not None
        self.starts[r][i] = t
        t += dur
        self.ends[r][i] = t
        count, latest = self.ar_count, self.ar_latest
        for g in groups.of_rank[r]:
            k = (g, key)
            pushed = count[k] = count.get(k, 0) + 1
            latest[k] = max(latest.get(k, 0.0), t)
            if pushed == groups.size[g]:
                done = self.ar_done[k] = latest[k] + groups.seconds[g]
                for q in self.ar_wait.pop(k, []):
                    heapq.heappush(self.heap, (max(done, self.blocked[q]), q))
        return t

    def wave_pull(self, r: int, i: int, t: float, dur: float, key: int) -> float | None:
        """Wait until every all-reduce of wave ``key`` the rank belongs to is complete."""
        assert self.wave_groups is not None
        of_rank, done, blocked = self.wave_groups.of_rank[r], self.ar_done, self.blocked
        missing = next((g for g in of_rank if (g, key) not in done), -1)
        if missing >= 0:  # resumed when that all-reduce completes; then checked again
            self.ar_wait.setdefault((missing, key), []).append(r)
            if blocked[r] < 0:
                blocked[r] = t
            return None
        ready = 0.0
        for g in of_rank:
            ready = max(ready, done[(g, key)])
        self.starts[r][i] = blocked[r] if blocked[r] >= 0 else t  # a resumed wait starts where it blocked
        blocked[r] = -1.0
        t = max(t, ready) + dur
        self.ends[r][i] = t
        return t

    def push(self, r: int, i: int, t: float, dur: float, key: int) -> float:
        """Local work, then count the push of the rank's worker; once the worker has pushed the
        wave, wake the pulls it lets go on."""
        self.starts[r][i] = t
        t += dur
        self.ends[r][i] = t
        worker = self.rank_worker[r]
        cnt = self.pushes.setdefault(key, [0] * self.n_workers)
        ends_w = self.push_end.setdefault(key, [0.0] * self.n_workers)
        cnt[worker] += 1
        ends_w[worker] = max(ends_w[worker], t)
        if cnt[worker] == self.worker_size[worker] and key in self.pull_wait:
            still = []
            for q in self.pull_wait.pop(key):
                when = self.pull_ready(key, self.rank_worker[q])
                if when is None:
                    still.append(q)
                else:
                    heapq.heappush(self.heap, (max(when, self.blocked[q]), q))
            if still:
                self.pull_wait[key] = still
        return t

    def pull(self, r: int, i: int, t: float, dur: float, key: int) -> float | None:
        """Wait until every other virtual worker has pushed wave ``key``."""
        when = self.pull_ready(key, self.rank_worker[r])
        if when is None:
            self.blocked[r] = t
            self.pull_wait.setdefault(key, []).append(r)
            return None
        self._resumed(r, i, t)
        t = max(t, when) + dur
        self.ends[r][i] = t
        return t

    def pull_ready(self, wave: int, worker: int) -> float | None:
        """When every other worker has pushed ``wave`` (its latest push), or ``None`` if one has not."""
        cnt, end = self.pushes.get(wave), self.push_end.get(wave)
        if cnt is None or end is None:
            return None if self.n_workers > 1 else 0.0
        when = 0.0
        for b in range(self.n_workers):
            if b == worker:
                continue
            if cnt[b] < self.worker_size[b]:
                return None
            when = max(when, end[b])
        return when


class _Flows:
    """The flows of ``FLOW_SEND`` ops in the event loop: a send starts a flow on the
    :class:`FlowNet`, whose end is a heap event ``(t, -1 - flow)``; an event whose time is no
    longer the flow's end (rates changed since) is stale and skipped. At the end the message
    arrives (its latency after its bytes), its receiver is woken and a blocking sender goes on."""

    __slots__ = ("arrival", "blocked", "end", "ends", "heap", "net", "overlap", "owner", "pc", "waiting")

    def __init__(self, net: FlowNet, overlap: bool, heap: list[tuple[float, int]], arrival: dict[int, float],
                 waiting: dict[int, int], ends: list[list[float]], pc: list[int], blocked: list[float]) -> None:
        self.net, self.overlap, self.heap, self.arrival, self.waiting = net, overlap, heap, arrival, waiting
        self.ends, self.pc, self.blocked = ends, pc, blocked
        self.end: dict[int, float] = {}
        self.owner: dict[int, tuple[int, int, int, int]] = {}  # flow -> (rank, op, message key, spec)

    def _schedule(self, ends: Mapping[int, float]) -> None:
        for f, e in ends.items():
            if self.end.get(f) != e:
                self.end[f] = e
                heapq.heappush(self.heap, (e, -1 - f))

    def send(self, r: int, i: int, t: float, key: int, spec: int) -> bool:
        """Start the flow of op ``i`` of rank ``r`` at ``t``; True when the rank goes on at once."""
        f, ends = self.net.start(t, spec)
        self.owner[f] = (r, i, key, spec)
        self._schedule(ends)
        if self.overlap:
            return True
        self.blocked[r] = t
        return False

    def event(self, t: float, token: int) -> None:
        f = -1 - token
        if self.end.get(f) != t:
            return  # stale: the flow's rate changed after this event was scheduled
        del self.end[f]
        r, i, key, spec = self.owner.pop(f)
        done = t + self.net.latency_s(spec)
        self._schedule(self.net.finish(t, f))
        self.arrival[key] = done
        self.ends[r][i] = done
        w = self.waiting.pop(key, -1)
        if w >= 0:
            heapq.heappush(self.heap, (done, w))
        if not self.overlap:  # the sender waited at op i: it goes on after it
            self.blocked[r] = -1.0
            self.pc[r] = i + 1
            heapq.heappush(self.heap, (done, r))


def run_ops(ops: Sequence[Sequence[Op]], rank_worker: Sequence[int], overlap: bool, n_links: int,
            collective_size: Mapping[int, int] | None = None, wave_groups: WaveGroups | None = None,
            flows: FlowNet | None = None) -> tuple[list[list[float]], list[list[float]], list[int]]:
    """Time every op; returns per-rank start and end lists and each rank's program counter.

    ``collective_size[key]`` is the number of members of the all-reduce ``key``; ``wave_groups``
    the holder sets of WSP's asynchronous all-reduces (``None``: a ``PULL`` waits for the other
    virtual workers' pushes, with no all-reduce time); ``flows`` the shared NICs that
    ``FLOW_SEND`` ops cross (their link field indexes ``flows.specs``).

    The simulator's hot loop: compute, sends, receives and steps are timed inline, with the
    state in local variables; the rare ops that synchronise ranks go to :class:`_SyncOps`.
    ``limit`` is always the earliest clock on the heap: a rank runs on until it passes it.
    """
    n_ranks = len(ops)
    starts = [[0.0] * len(o) for o in ops]
    ends = [[0.0] * len(o) for o in ops]
    pc = [0] * n_ranks
    blocked = [-1.0] * n_ranks
    arrival: dict[int, float] = {}
    waiting: dict[int, int] = {}
    link_free = [0.0] * max(n_links, 1)
    heap = [(0.0, r) for r in range(n_ranks)]
    sync = _SyncOps(starts, ends, blocked, heap, rank_worker, collective_size, wave_groups).handlers()
    net = _Flows(flows, overlap, heap, arrival, waiting, ends, pc, blocked) if flows is not None else None
    heappush, heappop = heapq.heappush, heapq.heappop
    inf = math.inf

    while heap:
        t, r = heappop(heap)
        if r < 0:
            assert net is not None
            net.event(t, r)
            continue
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
                st[i] = blocked[r] if blocked[r] >= 0 else t  # a resumed wait starts where it blocked
                blocked[r] = -1.0
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
                st[i] = t
                t += dur
                en[i] = t
            elif code == FLOW_SEND:
                assert net is not None
                st[i] = t
                if not net.send(r, i, t, key, link):
                    break  # the flow's end moves the rank on (pc[r] = i + 1)
                limit = heap[0][0]
            else:
                goes_on = sync[code](r, i, t, dur, key)
                if goes_on is None:
                    break
                t = goes_on
                limit = heap[0][0] if heap else inf
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
                      weight_s: float | None = None,
                      ) -> tuple[list[list[float]], list[list[float]]]:
    """Run action lists with unit prices (forward ``fwd_s``, backward ``bwd_s``, free transfers;
    a split backward's ``W`` takes ``weight_s``, default half the backward, and its ``I`` the rest).

    For checking schedules without a cost model: raises :class:`DeadlockError` naming the ranks
    of any wait cycle, else returns per-rank start and end times. Peers in the lists are ranks
    within their virtual worker (``rank_worker`` groups consecutive ranks; default: one).
    """
    rank_worker = list(rank_worker) if rank_worker is not None else [0] * len(programs)
    names = list(names) if names is not None else [f"r{r}" for r in range(len(programs))]
    w_s = bwd_s / 2 if weight_s is None else weight_s
    price = {F: fwd_s, B: bwd_s, I: bwd_s - w_s, W: w_s}
    ops: list[list[Op]] = []
    for r, prog in enumerate(programs):
        row: list[Op] = []
        for a in prog:
            code = OP_OF_KIND[a.kind]
            dur = price.get(a.kind, 0.0)
            if code in (_SEND, _RECV):
                sender, d = match_key(a)[2], int(a.kind in (SEND_GRAD, RECV_GRAD))
                key = ((a.micro_batch * 4096 + sender) * 2 + d) * 1024 + rank_worker[r]
            else:
                key = a.version
            row.append((code, dur, key, -1))
        ops.append(row)
    starts, ends, pc = run_ops(ops, rank_worker, True, 0)
    if any(pc[r] < len(ops[r]) for r in range(len(ops))):
        raise_deadlock(programs, pc, names, rank_worker)
    return starts, ends


def raise_deadlock(programs: Sequence[Sequence[Action]], pc: Sequence[int], names: Sequence[str],
                    rank_worker: Sequence[int]) -> None:
    pushed = {(r, a.version) for r, prog in enumerate(programs) for a in prog[:pc[r]] if a.kind == PUSH}
    raise DeadlockError(_deadlock_message(programs, pc, names, rank_worker, pushed))


