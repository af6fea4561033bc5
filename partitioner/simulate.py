"""Discrete-event timing of a plan: its schedule's action lists, priced by the cost model.

:func:`simulate_plan` builds every rank's action list from :mod:`partitioner.schedule`,
prices each action with :class:`partitioner.cost.CostModel` (compute per GPU type, boundary
transfers per link, WSP's asynchronous all-reduces), runs them with the event engine of
:mod:`partitioner.events` (whose docstring states the semantics the runtime implements) and
summarises the result as a :class:`partitioner.timeline.Timeline`: iteration time,
throughput, bubbles, peak memory, weight versions and WSP clock gaps.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .boundary import BoundaryHeld, boundary_held
from .cluster import Cluster, split_kind
from .cost import CostModel, CostOptions, SyncGroup
from .events import (
    FLOW_SEND,
    OP_OF_KIND,
    DeadlockError,
    Op,
    WaveGroups,
    raise_deadlock,
    run_ops,
    simulate_programs,
)
from .flows import FlowNet, FlowSpec
from .placement import PipelinePlacement, place, replica_shares
from .plan import Plan
from .profile import Profile
from .schedule import (
    ACTION_KINDS,
    ALLREDUCE,
    PULL,
    PUSH,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    STEP,
    ActionKind,
    B,
    Columns,
    F,
    I,
    W,
    schedule_columns,
    spec,
    to_actions,
)
from .timeline import Timeline

__all__ = [
    "DeadlockError",
    "Timeline",
    "default_iterations",
    "predict",
    "simulate_plan",
    "simulate_programs",
]

log = logging.getLogger(__name__)

# -- plans -------------------------------------------------------------------------------------


def default_iterations(schedule: str, staleness: int = 0, overlap: bool = False) -> int:
    """Iterations simulated by default: one for flushing schedules; enough for a steady state
    for ``2bw`` and for overlapping iterations (``overlap``: a flushing schedule under
    ``CostOptions.overlap_iterations``; its period is measured from the end of the second
    iteration to the end of the fourth), and for ``wsp`` a measured window of ``D + 1`` waves
    after the first ``D + 1`` (where the all-reduce binds, the pulls' waits repeat every ``D + 1``
    waves)."""
    sp = spec(schedule)
    if sp.sync == "wave":
        return 2 * staleness + 4
    if sp.flushes and overlap:
        return 5
    return 1 if sp.flushes else 4


def _replicated_ranks(pipe: PipelinePlacement, cols: list[Columns], assign: list[np.ndarray], m_run: int
                      ) -> list[tuple[str, int, Columns]]:
    """Every replica's program: its stage's actions on the micro-batches it is given, sends and
    receives addressed to the replica of the neighbouring stage that has that micro-batch (peer =
    rank within the virtual worker). Each replica keeps its stage's order, so the lists stay
    deadlock-free (every wait is for an action earlier in the unreplicated schedule)."""
    base = np.cumsum([0] + [len(r) for r in pipe.replicas])
    send_act, recv_act = SEND_ACT.code, RECV_ACT.code
    send_grad, recv_grad = SEND_GRAD.code, RECV_GRAD.code
    out = []
    for k, devs in enumerate(pipe.replicas):
        kind, mb, stage, peer, version = cols[k]
        slot = np.where(mb >= 0, mb % m_run, 0)
        for i, dev in enumerate(devs):
            keep = (mb < 0) | (assign[k][slot] == i)
            kk, jj, ss, pp, vv = kind[keep], mb[keep], stage[keep], peer[keep].copy(), version[keep]
            sl = slot[keep]
            up = (kk == send_act) | (kk == recv_grad)  # talks to stage k + 1
            down = (kk == recv_act) | (kk == send_grad)  # talks to stage k - 1
            if up.any():
                pp[up] = base[k + 1] + assign[k + 1][sl[up]]
            if down.any():
                pp[down] = base[k - 1] + assign[k - 1][sl[down]]
            out.append((dev, k, (kk, jj, ss, pp, vv)))
    return out


@dataclass(frozen=True)
class _Sync:
    """A plan's data-parallel synchronisation as the simulator runs it: the gradient all-reduce
    groups of flushing schedules (their times, and each device's groups), WSP's holder sets
    (each device's sets), and how many devices hold each layer (ZeRO's step shares), said once
    for every rank."""

    groups: tuple[SyncGroup, ...]
    group_s: tuple[float, ...]
    groups_of: dict[str, list[int]]
    wave: tuple[SyncGroup, ...]
    wave_of: dict[str, list[int]]
    holders: np.ndarray

    @classmethod
    def of(cls, plan: Plan, cost: CostModel) -> _Sync:
        groups, wave = cost.sync_groups(plan), cost.wave_groups(plan)
        timed = cost  # where nodes share NICs, the all-reduces that cross one share it (as the closed form)
        if cost.cluster.has_nics and cost.collective_sharers is None:
            timed = cost.with_plan_sharers(plan, pipeline=False)  # its pipeline sends are flows here
        return cls(groups, tuple(timed.sync_s(g) for g in groups), _members(groups), wave, _members(wave),
                   cost.layer_holders(plan))


def _members(groups: tuple[SyncGroup, ...]) -> dict[str, list[int]]:
    """Device -> the indices of the groups it belongs to."""
    out: dict[str, list[int]] = {}
    for gi, g in enumerate(groups):
        for holder in g.devices:
            out.setdefault(holder, []).append(gi)
    return out


@dataclass(frozen=True)
class _Ranks:
    """Every rank of the run, in order: its columns, priced ops, device, virtual worker,
    activation bytes per stage and the layer ranges it holds; with the links and the
    all-reduces' member counts they share."""

    columns: list[Columns] = field(default_factory=list)
    ops: list[list[Op]] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    rank_worker: list[int] = field(default_factory=list)
    act_bytes: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)
    posted: list[float] = field(default_factory=list)  # activation receive buffers posted ahead
    weights: list[list[tuple[int, int]]] = field(default_factory=list)
    coll_size: dict[int, int] = field(default_factory=dict)
    links: dict[tuple[str, str], int] = field(default_factory=dict)
    nic_index: dict[tuple[str, int, str], int] = field(default_factory=dict)
    nic_Bps: list[float] = field(default_factory=list)
    flow_specs: dict[FlowSpec, int] = field(default_factory=dict)

    def flow_of(self, cluster: Cluster, a: str, b: str, nbytes: float) -> int:
        """The :class:`FlowSpec` (its index) of a message of ``nbytes`` from ``a`` to ``b`` over
        shared NICs, or -1 where the transfer crosses none (inside a node, or no NIC modelled)."""
        route = cluster.nic_route(a, b)
        if not route or nbytes <= 0:
            return -1
        res = []
        for node, nic, way, gbps in route:
            k = self.nic_index.setdefault((node, nic, way), len(self.nic_index))
            if k == len(self.nic_Bps):
                self.nic_Bps.append(gbps * 1e9)
            res.append(k)
        link = cluster.link(a, b)
        spec = FlowSpec(tuple(res), link.send_gbps_at(nbytes) * 1e9, nbytes, link.latency_s + link.send_overhead_s)
        return self.flow_specs.setdefault(spec, len(self.flow_specs))

    def link_of(self, cluster: Cluster, a: str, b: str) -> int:
        """The link a transfer from device ``a`` to ``b`` uses: the device pair in a node, the
        node pair between nodes (numbered in the order first used)."""
        da, db = cluster.device(a), cluster.device(b)
        k = (a, b) if da.node == db.node else (da.node, db.node)
        return self.links.setdefault(k, len(self.links))


def simulate_plan(plan: Plan, profile: Profile, cluster: Cluster, options: CostOptions | None = None,
                  iterations: int | None = None, *, cost: CostModel | None = None) -> Timeline:
    """Simulate ``plan`` under its schedule with the cost model; see :class:`Timeline`. ``cost``:
    the :class:`CostModel` of ``profile``, ``cluster`` and ``options`` when the caller has one."""
    cost = cost or CostModel(plan.profile_view(profile), cluster, options)
    sched = plan.schedule
    overlap = cost.overlaps(plan)
    n_iter = iterations if iterations is not None else default_iterations(sched, plan.staleness, overlap)
    pipes = place(plan)
    notes: list[str] = []
    sync = _Sync.of(plan, cost)
    if len(pipes) > 1 and spec(sched).sync == "allreduce" and not cost.options.sync:
        notes.append(f"{len(pipes)} virtual workers simulated as independent pipelines; the gradient "
                     f"all-reduce between them is not priced (sync off)")
    if spec(sched).split_backward:
        kinds = sorted({cluster.device(d).kind for d in plan.devices})
        guessed = sum(int(cost.at_degree(split_kind(k)[1]).profile.backward_split_for(cost.times_key(k))[2].sum())
                      for k in kinds)
        if guessed:
            notes.append(f"backward split into I and W estimated for {guessed} layer time(s) (no measured "
                         f"bwd_weight_share: W = bwd/2 for layers with parameters, 0 without)")
    ranks = _Ranks()
    for pipe in pipes:
        _add_pipeline(ranks, plan, cost, cluster, pipe, sync, n_iter)
    wave_groups = None
    if spec(sched).sync == "wave":
        wave_groups = WaveGroups(tuple(tuple(sync.wave_of.get(dev, ())) for dev in ranks.names),
                                 tuple(len(g.devices) for g in sync.wave), tuple(cost.sync_s(g) for g in sync.wave))
    flows = FlowNet(ranks.nic_Bps, list(ranks.flow_specs)) if ranks.flow_specs else None
    starts, ends, pc = run_ops(ranks.ops, ranks.rank_worker, cost.options.overlap_comm, len(ranks.links),
                               ranks.coll_size, wave_groups, flows)
    if any(pc[r] < len(ranks.ops[r]) for r in range(len(ranks.ops))):
        raise_deadlock([to_actions(c) for c in ranks.columns], pc, ranks.names, ranks.rank_worker)
    return _summarise(plan, cost, n_iter, ranks.columns, starts, ends, ranks.names, ranks.rank_worker,
                      ranks.act_bytes, ranks.weights, notes, wave_groups, ranks.posted)


def _add_pipeline(ranks: _Ranks, plan: Plan, cost: CostModel, cluster: Cluster, pipe: PipelinePlacement,
                  sync: _Sync, n_iter: int) -> None:
    """Add one virtual worker's ranks to ``ranks``: its schedule's action lists (a replicated
    stage's replicas each with their share of the micro-batches), the all-reduces before each
    step, and every action priced."""
    m_run = plan.micro_batching.count  # a first micro-batch in s slices runs as s micro-batches
    # a replicated position keeps one micro-batch in flight per replica downstream of it
    depths = ([sum(len(r) for r in pipe.replicas[k + 1:]) for k in range(pipe.ranks)]
              if pipe.replicas else None)
    cols = schedule_columns(plan.schedule, pipe.ranks, m_run, plan.chunks, n_iter, plan.staleness, depths)
    p = pipe.ranks
    if pipe.replicas:
        assign = [replica_shares([cost.compute_s(cluster.device(d).kind, a, b) for d in devs], m_run)
                  for devs, (a, b) in zip(pipe.replicas, pipe.stages, strict=True)]
        members = _replicated_ranks(pipe, cols, assign, m_run)
    else:
        members = [(pipe.devices[r], r, cols[r]) for r in range(p)]
    rank_dev = [dev for dev, _, _ in members]  # rank within the worker -> device
    modes = _stage_models(plan, cost, pipe)
    for dev, r, col in members:
        t = cluster.device(dev).tensor_parallel
        # per stage: the activations a micro-batch keeps (M_B), of them what its W needs (M_W), and
        # what its backward holds on top while it runs (full recomputation's recomputed activations)
        saved = (np.array([cs.activation_bytes(a, b, t) for cs, (a, b) in zip(modes, pipe.stages, strict=True)]),
                 np.array([cs.weight_grad_bytes(a, b, t) for cs, (a, b) in zip(modes, pipe.stages, strict=True)]),
                 np.array([cs.recompute_peak_bytes(a, b, t) for cs, (a, b) in zip(modes, pipe.stages, strict=True)]))
        until_b, until_w, posted = _boundary_held(col, modes, pipe.stages, t, boundary_held(plan.schedule))
        saved = (saved[0] + until_b, saved[1] + until_w, saved[2])
        col = _with_allreduce(col, sync.groups_of.get(dev, []), ALLREDUCE.code)
        held = pipe.held(r)
        d, lnk = _durations(ranks, plan, cost, cluster, pipe, dev, r, col, rank_dev, sync.holders)
        d, key = _keys(ranks.coll_size, col, d, pipe.worker, sync, n_iter)
        code = _OP_CODE[col[0]]
        if cluster.has_nics:  # sends over shared NICs are flows; their link field names the flow
            code, lnk = _flows(ranks, plan, cost, cluster, pipe, dev, col, rank_dev, code, lnk)
        ranks.ops.append(list(zip(code.tolist(), d.tolist(), key.tolist(), lnk.tolist(), strict=True)))
        ranks.columns.append(col)
        ranks.names.append(dev)
        ranks.rank_worker.append(pipe.worker)
        ranks.act_bytes.append(saved)
        ranks.posted.append(posted)
        ranks.weights.append(list(held))


def _boundary_held(col: Columns, modes: list[CostModel], stages: Sequence[tuple[int, int]], t: int,
                   held: BoundaryHeld) -> tuple[np.ndarray, np.ndarray, float]:
    """What the executor holds besides saved activations (:mod:`partitioner.boundary`), from a rank's
    list: per stage that sends its output (``SEND_ACT``), the output-sized tensors per micro-batch from
    its forward to its backward (its ``I``), and from its ``I`` to its ``W``; and, fixed, per peer the
    receives posted ahead and the gradient a backward takes (the largest of the stages concerned):
    activations from a peer that sends this rank activations, gradients from one it sends them to."""
    kind, _, stage, peer, _ = col
    sizes = [(cs.at_degree(t).boundary_bytes(a), cs.at_degree(t).boundary_bytes(b))
             for cs, (a, b) in zip(modes, stages, strict=True)]
    sends = set(stage[kind == SEND_ACT.code].tolist())
    out = np.array([b if s in sends else 0.0 for s, (_, b) in enumerate(sizes)])
    fixed: dict[tuple[int, int], float] = {}
    for code, side, count in ((RECV_ACT.code, 0, held.fixed_inputs), (SEND_ACT.code, 1, held.fixed_outputs)):
        sel = kind == code
        for s, q in zip(stage[sel].tolist(), peer[sel].tolist(), strict=True):
            fixed[(side, q)] = max(fixed.get((side, q), 0.0), count * sizes[s][side])
    return held.until_backward * out, held.until_weight * out, sum(fixed.values())


def _stage_models(plan: Plan, cost: CostModel, pipe: PipelinePlacement) -> list[CostModel]:
    """The cost model of each stage of ``pipe``: the view of its recompute mode."""
    stages = plan.virtual_workers[pipe.worker].stages
    return [cost.recomputing(st.recompute) for st in stages]


def _durations(ranks: _Ranks, plan: Plan, cost: CostModel, cluster: Cluster, pipe: PipelinePlacement, dev: str,
               r: int, col: Columns, rank_dev: list[str], holders: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each action's own time on ``dev`` (position ``r`` of ``pipe``; ``holders``: the devices
    holding each layer, :meth:`CostModel.layer_holders`) and the link of each send
    (-1 for none): compute, optimizer step, a replicated stage's blocking all-reduce at PUSH,
    transfers; a slice of the first micro-batch at its share."""
    kind, mb, stage, peer, _ = col
    held = pipe.held(r)
    gpu = cluster.device(dev).kind
    fb = np.array([cs.fwd_bwd_s(gpu, a, b) + cs.backward_split_s(gpu, a, b)
                   for cs, (a, b) in zip(_stage_models(plan, cost, pipe), pipe.stages, strict=True)]
                  + [(0.0,) * 4])  # per stage: forward, backward, its input-gradient and weight-gradient parts
    d = np.zeros(len(kind))
    lnk = np.full(len(kind), -1, dtype=np.int64)
    for k, part in ((F, 0), (B, 1), (I, 2), (W, 3)):
        d = np.where(kind == k.code, fb[stage, part], d)
    d = np.where(kind == STEP.code, sum(cost.update_shard_s(gpu, a, b, holders) for a, b in held), d)
    if pipe.replicas and len(pipe.replicas[r]) > 1:  # PUSH first sums the replicas' parts (blocking)
        local = cost.allreduce_s(sum(cost.sync_bytes(a, b, pipe.replicas[r]) for a, b in held), pipe.replicas[r])
        d = np.where(kind == PUSH.code, local, d)
    boundary_out = np.array([cost.boundary_bytes(b) for _, b in pipe.stages])
    boundary_in = np.array([cost.boundary_bytes(a) for a, _ in pipe.stages])
    for send, nbytes in ((SEND_ACT.code, boundary_out), (SEND_GRAD.code, boundary_in)):
        rows = np.flatnonzero(kind == send)
        if not len(rows):
            continue
        width = len(rank_dev) + 1
        pairs, inverse = np.unique(stage[rows] * width + peer[rows], return_inverse=True)
        price = np.array([cost.transfer_s(float(nbytes[x // width]), dev, rank_dev[x % width])
                          for x in pairs.tolist()])
        via = np.array([ranks.link_of(cluster, dev, rank_dev[x % width]) for x in pairs.tolist()], dtype=np.int64)
        d[rows] = price[inverse]
        lnk[rows] = via[inverse]
    n_slices, m_run = plan.first_slices, plan.micro_batching.count
    if n_slices > 1:  # compute and transfers of a slice scale with its share of the samples
        d = np.where((mb >= 0) & (mb % m_run < n_slices), d / n_slices, d)
    return d, lnk


def _flows(ranks: _Ranks, plan: Plan, cost: CostModel, cluster: Cluster, pipe: PipelinePlacement, dev: str,
           col: Columns, rank_dev: list[str], code: np.ndarray, lnk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sends of ``dev`` that cross shared NICs as ``FLOW_SEND`` ops, each with its
    :class:`FlowSpec` in the link field (a slice of the first micro-batch moves its share)."""
    kind, mb, stage, peer, _ = col
    code, lnk = code.copy(), lnk.copy()
    n_slices, m_run = plan.first_slices, plan.micro_batching.count
    for send, out in ((SEND_ACT.code, True), (SEND_GRAD.code, False)):
        for i in np.flatnonzero(kind == send).tolist():
            a, b = pipe.stages[stage[i]]
            nbytes = cost.boundary_bytes(b if out else a)
            if n_slices > 1 and mb[i] >= 0 and mb[i] % m_run < n_slices:
                nbytes /= n_slices
            f = ranks.flow_of(cluster, dev, rank_dev[peer[i]], nbytes)
            if f >= 0:
                code[i], lnk[i] = FLOW_SEND, f
    return code, lnk


def _keys(coll_size: dict[int, int], col: Columns, d: np.ndarray, worker: int, sync: _Sync, n_iter: int
          ) -> tuple[np.ndarray, np.ndarray]:
    """Each action's key for the event engine (equal for a send and its receive; the version of
    a step, push or pull; the all-reduce of an ALLREDUCE), the ALLREDUCEs' times put into ``d``,
    and each all-reduce's member count recorded in ``coll_size``."""
    kind, mb, stage, peer, version = col
    # ((micro_batch * 4096 + sending stage) * 2 + direction) * 1024 + virtual worker
    key = np.where(_IS_MSG[kind], ((mb * 4096 + stage + _SENDER_SHIFT[kind]) * 2 + _DIRECTION[kind]) * 1024 + worker,
                   np.where(_IS_SYNC[kind], version, -1))
    ar = kind == ALLREDUCE.code
    if ar.any():
        d = np.where(ar, np.asarray([*sync.group_s, 0.0])[np.where(ar, peer, -1)], d)
        key = np.where(ar, peer * (n_iter + 2) + version, key)
        for gi in set(peer[ar].tolist()):
            for v in set(version[ar].tolist()):
                coll_size[gi * (n_iter + 2) + v] = len(sync.groups[gi].devices)
    return d, key


def _per_kind(values: dict[ActionKind, int]) -> np.ndarray:
    """An array indexed by kind code: ``values[kind]``, 0 for the kinds not named."""
    out = np.zeros(len(ACTION_KINDS), dtype=np.int64)
    for k, v in values.items():
        out[k.code] = v
    return out


# per kind code: the event engine's op, and how a message's key is formed
_OP_CODE = np.array([OP_OF_KIND[k] for k in ACTION_KINDS], dtype=np.int64)
_SENDER_SHIFT = _per_kind({RECV_ACT: -1, RECV_GRAD: 1})  # a receive's sender is its stage -1 / +1
_DIRECTION = _per_kind({SEND_GRAD: 1, RECV_GRAD: 1})
_IS_MSG = _per_kind({SEND_ACT: 1, RECV_ACT: 1, SEND_GRAD: 1, RECV_GRAD: 1}).astype(bool)
_IS_SYNC = _per_kind({STEP: 1, PUSH: 1, PULL: 1}).astype(bool)
_COMPUTE_CODES = np.array([F.code, B.code, I.code, W.code])


def _with_allreduce(cols: Columns, groups: list[int], code: int) -> Columns:
    """Insert one ALLREDUCE per sync group (``peer`` = the group) before every STEP of a rank."""
    kind, mb, stage, peer, version = cols
    if not groups:
        return cols
    at = np.flatnonzero(kind == STEP.code)
    if not len(at):
        return cols
    pos = np.repeat(at, len(groups))
    g = np.tile(np.asarray(groups, dtype=np.int64), len(at))
    ver = np.repeat(version[at], len(groups))
    return (np.insert(kind, pos, code).astype(kind.dtype), np.insert(mb, pos, -1), np.insert(stage, pos, -1),
            np.insert(peer, pos, g), np.insert(version, pos, ver))


def _summarise(plan: Plan, cost: CostModel, n_iter: int, columns: list[Columns],
               starts: list[list[float]], ends: list[list[float]], names: list[str],
               rank_worker: list[int], act_bytes: list[tuple[np.ndarray, np.ndarray, np.ndarray]], weights: list[list[tuple[int, int]]],
               notes: list[str], wave_groups: WaveGroups | None = None, posted: list[float] | None = None
               ) -> Timeline:
    sched, m = plan.schedule, plan.micro_batches
    batching = plan.micro_batching
    overlap = cost.overlaps(plan)
    n_workers = max(rank_worker) + 1
    wave = spec(sched).sync == "wave"
    boundary = PUSH.code if wave else STEP.code
    offset = 0 if wave else 1  # STEP(v) ends iteration v - 1; PUSH(c) ends wave c
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
            first = min(plan.staleness + 1, last - 1) if wave and last >= 2 else 0
            if overlap and last >= 2:  # overlapping iterations: the steady state after the first
                first = 1
            windows.append((float(t_end[w, first]), float(t_end[w, last]), last - first))
    iteration = max((hi - lo) / k if n_iter > 1 else hi for lo, hi, k in windows)
    first_iteration = float(t_end[:, 0].max()) if overlap and n_iter > 1 else 0.0
    samples = n_workers * m * plan.micro_batch_size
    samples_per_s = samples / iteration if iteration > 0 else math.inf

    holders = cost.layer_holders(plan)
    bubble: dict[str, float] = {}
    peak_mem: dict[str, float] = {}
    peak_act: dict[str, int] = {}
    versions: dict[str, int] = {}
    for r, (kind, mb, stage, _, version) in enumerate(columns):
        name, st, en = names[r], st_col[r], en_col[r]
        comp = np.isin(kind, _COMPUTE_CODES)
        lo, hi, _ = windows[rank_worker[r]]
        busy = np.clip(np.minimum(en[comp], hi) - np.maximum(st[comp], lo), 0.0, None).sum()
        bubble[name] = float(1.0 - busy / (hi - lo)) if hi > lo else 0.0
        # activations held, in program order: +M_B at each forward, -M_B at each backward; a split
        # backward frees M_B - M_W at its I and M_W at its W (Qi et al.'s accounting); M_B and M_W
        # count the output-sized tensors a sending stage holds per micro-batch (_boundary_held)
        kc = kind[comp]
        full, kept = act_bytes[r][0][stage[comp]], act_bytes[r][1][stage[comp]]
        saved = np.where(kc == F.code, full, np.where(kc == I.code, kept - full, np.where(kc == W.code, -kept, -full)))
        if plan.first_slices > 1:  # a slice of the first micro-batch holds its share of the activations
            saved = np.where(mb[comp] % batching.count < batching.first_slices, saved / batching.first_slices, saved)
        held = np.cumsum(saved)
        # a backward (or its input-gradient part) that recomputes holds its recomputed activations
        # while it runs: on top of what was held before it (held after it, plus what it freed)
        extra = act_bytes[r][2][stage[comp]]
        running = np.where((kc == B.code) | (kc == I.code), held - saved + extra, held)
        count = np.cumsum(np.where(kc == F.code, 1, np.where((kc == B.code) | (kc == W.code), -1, 0)))
        live = _live_versions(kind, mb, stage, version) if spec(sched).weight_versions > 1 else 1
        tp = cost.cluster.device(name).tensor_parallel
        w_bytes = sum(cost.weight_bytes(a, b, live, tp, d) for a0, b0 in weights[r]
                      for a, b, d in _zero_runs(cost, holders, a0, b0))
        peak_mem[name] = (w_bytes + (float(running.max()) if len(running) else 0.0) + (posted[r] if posted else 0.0)
                          + cost.options.reserved_bytes)
        peak_act[name] = int(count.max()) if len(count) else 0
        versions[name] = live
    gaps = _clock_gaps(columns, en_col, wave_groups) if wave else ()
    for line in notes:
        log.info(line)
    cat = np.concatenate
    return Timeline(
        sched, m, plan.micro_batch_size, n_iter, tuple(names), tuple(rank_worker),
        cat([np.full(len(c[0]), r, dtype=np.int32) for r, c in enumerate(columns)]),
        cat([c[0] for c in columns]).astype(np.int8), cat([c[1] for c in columns]),
        cat([c[2] for c in columns]).astype(np.int32), cat(st_col), cat(en_col),
        float(worker_end.max()), iteration, samples_per_s, bubble, peak_mem, peak_act, versions, gaps,
        tuple(notes), first_iteration)


def _zero_runs(cost: CostModel, holders: np.ndarray, start: int, stop: int) -> list[tuple[int, int, int]]:
    """``[start, stop)`` as runs of layers with one holder count under ZeRO (one run otherwise)."""
    if not cost.options.zero:
        return [(start, stop, 1)]
    return cost.holder_runs(start, stop, holders)


def _live_versions(kind: np.ndarray, mb: np.ndarray, stage: np.ndarray, version: np.ndarray) -> int:
    """Most weight versions a rank must hold at once: the current one plus every version still
    used by a micro-batch between its forward and its backward."""
    current, peak = 0, 1
    live: dict[int, int] = {0: 1}  # version -> references (the current version holds one)
    used: dict[tuple[int, int], int] = {}
    fwd, bwd, step = F.code, B.code, STEP.code
    for k, j, s, v in zip(kind.tolist(), mb.tolist(), stage.tolist(), version.tolist(), strict=True):
        if k == fwd:
            used[(j, s)] = current
            live[current] += 1
        elif k == bwd:
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


def _clock_gaps(columns: list[Columns], ends: list[np.ndarray], groups: WaveGroups | None) -> tuple[int, ...]:
    """At each PULL's end: the rank's clock (waves it has pushed) minus the least clock of the
    holders of its layers (the ranks of its holder sets, over every virtual worker)."""
    push, pull = PUSH.code, PULL.code
    pushed = [np.sort(ends[r][kind == push]) for r, (kind, *_) in enumerate(columns)]
    members: dict[int, set[int]] = {}
    if groups is not None:
        for r, gs in enumerate(groups.of_rank):
            for g in gs:
                members.setdefault(g, set()).add(r)
    out: list[int] = []
    for r, (kind, *_) in enumerate(columns):
        peers = sorted(set().union(*(members[g] for g in groups.of_rank[r])) if groups is not None
                       and groups.of_rank[r] else {r})
        for t in ends[r][kind == pull].tolist():
            own = int(np.searchsorted(pushed[r], t, side="right"))
            least = min(int(np.searchsorted(pushed[q], t, side="right")) for q in peers)
            out.append(own - least)
    return tuple(out)


def predict(plan: Plan, profile: Profile, cluster: Cluster, options: CostOptions | None = None,
            timeline: Timeline | None = None, *, cost: CostModel | None = None) -> dict[str, float]:
    """The ``Plan.predicted`` figures, from the simulator.

    ``bottleneck_s`` is the largest per-micro-batch work of one device (its stages' times
    from :meth:`CostModel.stage_time_s`, summed over its chunks); ``bubble_fraction`` is the
    mean over devices and ``peak_memory_bytes`` the largest device's (per-device figures are
    on the :class:`Timeline`).
    """
    cost = cost or CostModel(plan.profile_view(profile), cluster, options)
    tl = timeline if timeline is not None else simulate_plan(plan, profile, cluster, options, cost=cost)
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
