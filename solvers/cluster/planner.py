"""Heterogeneity-aware planning of a whole cluster: virtual workers, device mapping, split.

:func:`plan_cluster` groups the cluster's GPUs into K virtual workers (a HetPipe policy or
``opt``), orders each worker's GPUs and splits the layers (:mod:`solvers.pipeline.mapping`),
optionally replicating stages (:mod:`solvers.cluster.replication`), and prices the result with the
cost model. The objective is the total throughput in samples per second; the
``SolveResult.objective`` is its inverse, seconds per sample (smaller is better), with a
lower bound from the cluster's total speed: ``1 / (micro_batch_size * sum_d 1 / T_d)``,
``T_d`` the whole model's time on GPU ``d``.

Objectives: both are K times the slowest worker's rate, the long-run rate of synchronous
data parallelism and of WSP alike (WSP's staleness bound D keeps every worker within D waves
of the slowest, so a faster worker's own rate is not sustained; the sum of the workers' own
rates, HetPipe's figure of merit, rewards unbalanced workers that then wait). ``sync`` (the
default) adds the gradient all-reduce and the optimizer step when it prices a plan, as
synchronous training pays them; ``wsp`` leaves them out, as WSP hides its all-reduce behind
the next waves while it is no longer than ``D`` waves' compute.

A virtual worker's throughput is ``m * micro_batch_size / iteration_s`` with the closed-form
iteration time of the schedule (:meth:`partitioner.cost.CostModel.worker_iteration_s`); the mapping
and replication DPs minimise its bottleneck stage, which dominates it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from partitioner.cluster import Cluster, Device
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError, PartitionerError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import Profile
from partitioner.schedule import DEFAULT_MICRO_BATCHES, Schedule, spec
from solvers.cluster.grouping import OBJECTIVES, POLICIES, combine, group, search_opt
from solvers.cluster.replication import replicate_worker
from solvers.pipeline.dp import diagnose_infeasible
from solvers.pipeline.mapping import map_worker
from solvers.predictions import with_predictions
from solvers.progress import Status, status
from solvers.result import SolveDetails, SolveResult, SolveStatus

if TYPE_CHECKING:
    from solvers.cluster.bounds.fleet import FleetBound

__all__ = ["WorkerPlanner", "WorkerUnfit", "pinned_link_ends", "plan_cluster", "plan_of", "price_plan", "solve"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Worker:
    stages: tuple[Stage, ...] | None
    throughput: float
    exact: bool
    ranges: tuple[tuple[int, int], ...] = ()  # the layer ranges of its stages (kept in the memo)


class WorkerPlanner:
    """Plans one virtual worker at a time, remembering answers for equivalent GPU sets.

    Two GPU sets are equivalent when they have the same GPU types on nodes of the same kind
    (:attr:`partitioner.cluster.Node.kind`: GPU mix, intra-node link and NICs; a node named by a link override is a kind of its
    own unless the overrides price every pair of nodes by their kinds alone,
    :func:`pinned_link_ends`): such nodes are interchangeable.
    """

    def __init__(self, cost: CostModel, schedule: Schedule, replication: bool = False,
                 exact_limit: int = 720, max_evaluations: int = 200):
        self.cost = cost
        self.max_evaluations = max_evaluations
        self.schedule = schedule
        self.replication = replication
        self.exact_limit = exact_limit
        self._memo: dict[Any, _Worker] = {}
        cl = cost.cluster
        overridden = pinned_link_ends(cl)
        self._node_kind = {n.name: (n.name if n.name in overridden else n.kind) for n in cl.nodes}
        self._pinned = overridden
        self.evaluations = 0
        self.deadline: float | None = None  # time.perf_counter() value past which mappings stop early
        self.progress = Status("", show=False)  # plan_cluster's status line, while it runs
        # The holders of every layer a worker may count on under ZeRO (K workers hold every layer
        # once each: K when it is fixed; 1, no sharing, while K is searched)
        self.holders = 1

    def key(self, devices: Sequence[Device]) -> Any:
        if self.holders > 1:
            return (self.holders, self._key(devices))
        return self._key(devices)

    def _key(self, devices: Sequence[Device]) -> Any:
        if any(d.name in self._pinned for d in devices):
            return tuple(sorted(d.name for d in devices))
        per_node: dict[str, Counter[str]] = {}
        for d in devices:
            per_node.setdefault(d.node, Counter())[d.kind] += 1
        return tuple(sorted((self._node_kind[n], tuple(sorted(c.items()))) for n, c in per_node.items()))

    def throughput_bound(self, devices: Sequence[Device]) -> float:
        """An upper bound on :meth:`throughput`: ``micro_batch_size / lower_bound_s``, since an
        iteration of ``m`` micro-batches takes at least ``m`` bottlenecks."""
        k = ("bound", self.key(devices))
        if k not in self._memo:
            lb = self.cost.lower_bound_s(devices)
            self._memo[k] = _Worker(None, self.cost.profile.micro_batch_size / lb if lb > 0 else math.inf, False)
        return self._memo[k].throughput

    def throughput(self, devices: Sequence[Device]) -> float:
        return self._plan(devices, keep=False).throughput

    def exact(self, devices: Sequence[Device]) -> bool:
        """Whether :meth:`throughput` is optimal for ``devices`` (the mapping search was exhaustive)."""
        return self._plan(devices, keep=False).exact

    def node_kind(self, node: str) -> Any:
        """Nodes of one kind are interchangeable (the node's own name where a link override names it)."""
        return self._node_kind[node]

    def interchangeable(self, devices: Sequence[Device]) -> bool:
        """Whether no device of ``devices`` is singled out by a device-level link override."""
        return not any(d.name in self._pinned for d in devices)

    def stages(self, devices: Sequence[Device]) -> _Worker:
        return self._plan(devices, keep=True)

    def _plan(self, devices: Sequence[Device], keep: bool) -> _Worker:
        """``keep``: return the stages for exactly these devices (the memo is shared by
        equivalent GPU sets, so a kept plan of an equivalent set is relabelled onto them)."""
        k = self.key(devices)
        if not keep and k in self._memo:
            return self._memo[k]
        if keep and ("stages", k) in self._memo:
            template = self._memo[("stages", k)]
            assert template.stages is not None
            if any(d.name in self._pinned for d in devices):
                return template  # such a key names the devices themselves: the very same set
            return replace(template, stages=_relabel(template.stages, self.cost, devices))
        self.evaluations += 1
        cost, sched = self.cost, self.schedule
        res = map_worker(cost, devices, sched, exact_limit=self.exact_limit,
                         max_evaluations=self.max_evaluations, deadline=self.deadline, holders=self.holders)
        options: list[tuple[Stage, ...]] = []
        if res.solution is not None:
            sol = res.solution
            options.append(sol.stages())
        if self.replication and len(devices) > 1:
            order = list(res.solution.devices) if res.solution is not None else list(devices)
            rep = replicate_worker(cost, order, sched)
            if rep is not None:
                options.append(tuple(Stage(r, ds[0].name, ds[0].gpu_type, tuple(d.name for d in ds[1:]))
                                     for r, ds in rep.stages))
        best = _Worker(None, -math.inf, res.exact)
        for stages in options:
            thr = worker_throughput(cost, stages, sched, self.holders)
            if thr > best.throughput:
                best = _Worker(stages, thr, res.exact)
        best = replace(best, ranges=tuple(st.layers for st in best.stages or ()))
        self._memo[k] = replace(best, stages=None)
        if keep and best.stages is not None:
            self._memo[("stages", k)] = best
        return best

    def ranges(self, devices: Sequence[Device]) -> tuple[tuple[int, int], ...]:
        """The layer ranges of the stages of the best plan for ``devices``."""
        return self._plan(devices, keep=False).ranges

    def sync_estimate_s(self, grouping: Sequence[Sequence[Device]]) -> float:
        """The gradient all-reduce between the workers of ``grouping``, as the grouping search
        prices it: every stage's gradients over one device of every worker (the first), the
        largest such all-reduce. The finished plan is priced exactly (``plan_iteration_s``)."""
        cost = self.cost
        if len(grouping) < 2 or not cost.options.sync:
            return 0.0
        heads = [w[0] for w in grouping]
        largest = max((cost.param_bytes(a, b) for w in grouping for a, b in self.ranges(w)), default=0.0)
        return cost.allreduce_s(largest, heads)


def pinned_link_ends(cluster: Cluster) -> frozenset[str]:
    """The nodes and devices that link overrides single out (each a kind of its own for the
    planners): every override's ends, or none where each override joins two different nodes and
    the link between any two different nodes depends only on their kinds (:attr:`Node.kind`: GPU
    mix, intra-node link, NICs): then moving a worker from nodes to nodes of the same kinds
    changes none of its prices alone, overrides or not (a cluster measured per pair of GPU types;
    how a plan's workers share NICs is priced once the plan is known)."""
    ends = frozenset(end for link in cluster.links for end in (link.a, link.b))
    names = {n.name for n in cluster.nodes}
    if not ends or any(x.a == x.b or x.a not in names or x.b not in names for x in cluster.links):
        return ends
    kind = {n.name: n.kind for n in cluster.nodes}
    first: dict[str, str] = {}
    for d in cluster.devices:
        first.setdefault(d.node, d.name)
    seen: dict[Any, Any] = {}
    nodes = [n for n in cluster.nodes if n.name in first]
    for i, a in enumerate(nodes):
        for b in nodes[i + 1:]:
            pair = frozenset((kind[a.name], kind[b.name])) if kind[a.name] != kind[b.name] else (kind[a.name],)
            bw = replace(cluster.link(first[a.name], first[b.name]), name="")  # the name prices nothing
            if seen.setdefault(pair, bw) != bw:
                return ends
    return frozenset()


def _relabel(stages: Sequence[Stage], cost: CostModel, devices: Sequence[Device]) -> tuple[Stage, ...]:
    """``stages`` (planned for an equivalent GPU set: the same GPU types on nodes of the same
    kind) moved onto ``devices``: node to node of the same kind and GPU mix, GPU to GPU of the
    same type, so every price is unchanged."""
    cluster = cost.cluster
    names = [st.device for st in stages] + [r for st in stages for r in st.replicas]
    old = [cluster.device(nm) for nm in names]

    def by_node(devs: Sequence[Device]) -> dict[str, list[Device]]:
        out: dict[str, list[Device]] = {}
        for d in devs:
            out.setdefault(d.node, []).append(d)
        return out

    def kind(node: str, devs: list[Device]) -> Any:
        nd = next(n for n in cluster.nodes if n.name == node)
        return nd.kind, tuple(sorted(Counter(d.kind for d in devs).items()))

    free: dict[Any, list[list[Device]]] = {}
    for node, devs in by_node(devices).items():
        free.setdefault(kind(node, devs), []).append(list(devs))
    mapping: dict[str, str] = {}
    for node, devs in by_node(old).items():
        target = free[kind(node, devs)].pop()
        for d in devs:
            match = next(t for t in target if t.kind == d.kind)
            target.remove(match)
            mapping[d.name] = match.name
    return tuple(replace(st, device=mapping[st.device], replicas=tuple(mapping[r] for r in st.replicas))
                 for st in stages)


def worker_throughput(cost: CostModel, stages: Sequence[Stage], schedule: Schedule, holders: int = 1) -> float:
    """Samples per second of one pipeline, priced by the cost model (-inf if it does not fit, one of
    ``holders`` holders of every layer under ZeRO)."""
    plan = Plan(cost.profile.model, (VirtualWorker(tuple(stages)),), schedule.name, cost.profile.micro_batch_size,
                schedule.micro_batches)
    try:
        cost.check_plan_memory(plan, holders)
    except FormatError:
        return -math.inf
    it = cost.worker_iteration_s(plan, holders_known=False)  # the other workers are not known yet
    return schedule.micro_batches * cost.profile.micro_batch_size / it if it > 0 else math.inf


def price_plan(cost: CostModel, plan: Plan, objective: str = "sync") -> dict[str, float]:
    """Predicted figures of a multi-worker plan: total samples/s under ``objective``, the slowest
    worker's iteration and the largest bottleneck stage. Under ``sync`` the iteration is the
    closed form with the gradient all-reduce and the optimizer step (:meth:`CostModel.plan_iteration_s`).
    Under ``wsp``, K times the slowest worker's rate without them. A plan of the ``wsp``
    schedule keeps, in every worker, the conservative push and pull the search optimised
    (:meth:`CostModel.wave_sync_s`), so the figures agree with the search's values and bounds;
    ``CostModel.plan_iteration_s`` prices the plan's own holder sets and staleness."""
    thr, its, necks = [], [], []
    for w in range(len(plan.virtual_workers)):
        times = cost.plan_stage_times_s(plan, w)
        it = cost.worker_iteration_s(plan, w, holders_known=False)
        its.append(it)
        necks.append(max(times))
        thr.append(plan.micro_batches * plan.micro_batch_size / it if it > 0 else math.inf)
    if objective == "sync" and spec(plan.schedule).sync == "allreduce":
        it = cost.plan_iteration_s(plan)
        samples = len(plan.virtual_workers) * plan.micro_batches * plan.micro_batch_size
        return {"samples_per_s": samples / it if it > 0 else math.inf, "iteration_s": it,
                "bottleneck_s": max(necks)}
    return {"samples_per_s": combine(thr, objective), "iteration_s": max(its), "bottleneck_s": max(necks)}


def throughput_upper_bound(cost: CostModel, devices: Sequence[Device]) -> float:
    """No plan on ``devices`` beats ``micro_batch_size * sum_d 1 / T_d`` samples per second (``T_d``
    from :func:`solvers.cluster.bounds.fleet.effective_whole_s`)."""
    from solvers.cluster.bounds.fleet import effective_whole_s

    whole = effective_whole_s(cost, sorted({d.kind for d in devices}))  # valid for any profile
    return cost.profile.micro_batch_size * sum(1.0 / whole[d.kind] if whole[d.kind] > 0 else math.inf
                                               for d in devices)


# The largest chain DP one virtual worker may need (devices x layers^2 cells): 64 devices over
# 1,000 layers, about 0.4 s (docs/benchmarks.md). The mapping search runs several per worker.
MAX_WORKER_DP_CELLS = 64 * 1000**2


def max_worker_gpus(num_layers: int) -> int:
    """The most GPUs one virtual worker may hold for a model of ``num_layers`` layers."""
    return max(1, MAX_WORKER_DP_CELLS // max(1, num_layers) ** 2)


def _check_worker_size(n: int, k: int, num_layers: int, largest: int) -> int:
    """``k`` if ``n`` GPUs in ``k`` virtual workers keep every worker within ``largest`` GPUs;
    otherwise one line with the numbers and the smallest ``K`` that would."""
    per = -(-n // k)
    if per > largest:
        need = -(-n // largest)
        raise FormatError("virtual_workers", k, f"{n:,} GPUs in {k} virtual worker(s) put up to {per:,} GPUs in "
                          f"one pipeline; planning one over {num_layers:,} layers is a DP of {per * num_layers**2:.2g} "
                          f"cells, above the {MAX_WORKER_DP_CELLS:.2g} this planner handles (at most {largest:,} "
                          f"GPUs per worker): use K >= {need:,}")
    return k


def _candidate_ks(n: int, nodes: int) -> list[int]:
    if n <= 8:
        return list(range(1, n + 1))
    return sorted({k for k in range(1, n + 1) if n % k == 0} | {nodes})


IDENTICAL_FINALISTS = 2  # groupings of identical workers priced exactly beside the counts plan (small clusters)
FINISH_SHARE = 0.15  # of the time limit, kept for the answer's pricing and simulation (policy opt: its
# bounds are taken before the search, out of the search's share)


def plan_cluster(profile: Profile, cluster: Cluster, virtual_workers: int | str = "auto", policy: str = "opt",
                 *, objective: str = "sync", replication: bool = False, schedule: str = "1f1b",
                 micro_batches: int = DEFAULT_MICRO_BATCHES, options: CostOptions | None = None, exact_limit: int = 720,
                 time_limit_s: float = 50.0, devices: Sequence[str] | None = None,
                 simulate_top: int = 0, slices: int = 1) -> SolveResult:
    """Group, map and split ``profile`` over ``cluster`` (see the module docstring).

    ``virtual_workers``: K, or ``"auto"`` (np: one per node; ed/hd: the largest K the policy
    allows; opt: the best K). ``objective``: ``sync`` or ``wsp`` (the module docstring).
    Infeasible problems are returned as ``SolveStatus.INFEASIBLE``.
    Policy ``opt`` enumerates groupings exactly on up to 8 GPUs; on larger clusters whose GPUs
    are interchangeable within node classes it plans over counts (:mod:`solvers.cluster.templates`),
    otherwise it runs a local search. ``simulate_top = N > 0`` (policy ``opt``): the N best
    groupings by the closed form are built into plans and the one with the most simulated
    samples/s wins (:func:`solvers.pipeline.ranking.rank_plans`); the ranking is in ``details["ranking"]``.
    ``time_limit_s`` bounds the whole call: the bounds (taken first), then the search, take
    ``1 - FINISH_SHARE`` of it, the rest is kept for pricing and simulating the answer (it may run
    past the limit by what that takes beyond its share, and a search never stops before its
    first plan).
    The certificate is :func:`solvers.cluster.bounds.fleet.fleet_bound` (fill, memory, K);
    ``slices`` > 1: the plan's first micro-batch may afterwards be cut into up to that many
    slices, and the bounds that hold for any order of the actions (``details.bound.any_order``)
    cover such plans too.
    """
    t0 = time.perf_counter()
    _check_options(policy, objective, micro_batches, virtual_workers, time_limit_s)
    if not (isinstance(slices, int) and not isinstance(slices, bool) and slices >= 1):
        raise FormatError("slices", slices, "must be an integer >= 1")
    sched = Schedule.of(schedule, micro_batches)
    sched.activations_in_flight(1)  # refuses schedules priced only by simulation
    cost = CostModel(profile, cluster, options)
    devs = list(cluster.subset(devices) if devices is not None else cluster.devices)
    n = len(devs)
    if isinstance(virtual_workers, int) and not 1 <= virtual_workers <= n:
        raise FormatError("virtual_workers", virtual_workers, f"must be between 1 and the cluster's {n} GPUs")
    largest = max_worker_gpus(cost.num_layers)
    if isinstance(virtual_workers, int):
        _check_worker_size(n, virtual_workers, cost.num_layers, largest)
    planner = WorkerPlanner(cost, sched, replication, exact_limit)
    search_s = (1.0 - FINISH_SHARE) * time_limit_s  # the rest prices, simulates and certifies the plan
    planner.deadline = t0 + search_s
    k = None if virtual_workers == "auto" else int(virtual_workers)
    if k is not None and cost.options.zero:
        planner.holders = k  # every layer has K holders to share its optimizer state with
    found: _Found | str
    bounds: _Bounds | None = None
    with status(f"cluster planner ({n:,} GPUs)") as planner.progress:
        if policy == "opt":
            planner.progress.note("bounding")
            bounds = _bounds(cost, devs, sched, k, replication, slices)  # they need no plan
            found = _plan_opt(devs, k, planner, objective, replication, search_s, t0, simulate_top,
                              (profile, cluster, options), largest)
            # within the time limit; unfinished, the fleet bound stands (no other clock: the
            # plan must not depend on the machine's load)
            found = _sync_certified(found, devs, k, planner, objective, replication, t0 + search_s)
        else:
            found = _plan_fixed(devs, k, policy, planner, objective, largest)
        planner.progress.note("pricing the plan")
        if isinstance(found, str):
            return SolveResult(SolveStatus.INFEASIBLE, None, runtime_s=time.perf_counter() - t0,
                               method=f"hetero:{policy}", reason=found)
    if found.best is None:
        reason = ("no grouping of the cluster's GPUs into virtual workers fits in memory; even one "
                  "pipeline over all of them fails: " + diagnose_infeasible(cost, devs, sched))
        return SolveResult(SolveStatus.INFEASIBLE, None, runtime_s=time.perf_counter() - t0,
                           method=f"hetero:{policy}", reason=reason)
    return _finish(found, cost, devs, policy, objective, replication, sched, options, k, t0,
                   bounds or _bounds(cost, devs, sched, k, replication, slices))


def _check_options(policy: str, objective: str, micro_batches: Any, virtual_workers: Any, time_limit_s: Any) -> None:
    """One line naming the first bad option."""
    if policy not in POLICIES:
        raise FormatError("policy", policy, f"must be one of {', '.join(POLICIES)}")
    if objective not in OBJECTIVES:
        raise FormatError("objective", objective, f"must be one of {', '.join(OBJECTIVES)}")
    if not (isinstance(micro_batches, int) and not isinstance(micro_batches, bool) and micro_batches >= 1):
        raise FormatError("micro_batches", micro_batches, "must be an integer >= 1")
    if virtual_workers != "auto" and not (isinstance(virtual_workers, int) and not isinstance(virtual_workers, bool)):
        raise FormatError("virtual_workers", virtual_workers, "must be an integer >= 1 or 'auto'")
    if not (isinstance(time_limit_s, (int, float)) and not isinstance(time_limit_s, bool) and time_limit_s > 0):
        raise FormatError("time_limit_s", time_limit_s, "must be > 0 seconds")


@dataclass
class _Found:
    """A grouping search's answer: the best (value, grouping), the planner whose mappings it
    takes, whether the search was exhaustive, and what it reports."""

    best: tuple[float, list[list[Device]]] | None
    used: WorkerPlanner
    exact: bool
    details: SolveDetails


def _plan_fixed(devs: list[Device], k: int | None, policy: str, planner: WorkerPlanner, objective: str,
                largest: int) -> _Found | str:
    """A HetPipe baseline grouping (np, ed, hd): the found plan, or why it cannot run."""
    cost, n = planner.cost, len(devs)
    nodes = len(dict.fromkeys(d.node for d in devs))
    speed = _speed_of(cost, devs)
    if k is None:
        ks = [nodes] if policy == "np" else sorted(range(1, n + 1), reverse=True)
        ks = [x for x in ks if -(-n // x) <= largest] or [_check_worker_size(n, max(ks), cost.num_layers, largest)]
    else:
        ks = [k]
    g = None
    err: FormatError | None = None
    for x in ks:
        try:
            g = group(policy, devs, x, speed)
            break
        except FormatError as e:
            err = err or e
    if g is None:
        assert err is not None
        raise err
    val = combine([planner.throughput(w) for w in g], objective)
    if val > -math.inf:
        return _Found((val, g), planner, True, {})
    failing = next(w for w in g if planner.throughput(w) == -math.inf)
    return (f"policy {policy} with K={len(g)}: a virtual worker of {len(failing)} GPU(s) "
            f"({', '.join(d.name for d in failing)}) cannot hold the model: "
            + diagnose_infeasible(cost, failing, planner.schedule))


def _speed_of(cost: CostModel, devs: Sequence[Device]) -> Any:
    whole = {t: cost.compute_s(t, 0, cost.num_layers) for t in {d.kind for d in devs}}
    return lambda t: whole[t]


def _plan_opt(devs: list[Device], k: int | None, planner: WorkerPlanner, objective: str, replication: bool,
              time_limit_s: float, t0: float, simulate_top: int, sim: tuple[Profile, Cluster, CostOptions | None],
              largest: int) -> _Found:
    """Policy ``opt``: exhaustive on small clusters, over counts where the GPUs fall in node
    classes, else a local search; the N best by simulation with ``simulate_top``."""
    n = len(devs)
    counts = None
    if n > 8 and planner.interchangeable(devs):
        counts = _plan_symmetric(devs, k, planner, objective, replication, time_limit_s, t0, largest)
        if counts is not None and (n > 32 or counts.exact):
            return counts
    # Small clusters: the local search too (it prices the all-reduce while it searches, which the
    # counts program does not); the better plan by the cost model wins.
    search = _plan_search(devs, k, planner, objective, time_limit_s, t0, simulate_top, sim, largest)
    if counts is None or counts.best is None or search.best is None:
        return search if counts is None or counts.best is None else counts
    cost = planner.cost

    def priced(f: _Found) -> float:
        assert f.best is not None
        plan = plan_of(f.best[1], f.used, cost.profile, planner.schedule)[0]
        return price_plan(cost, plan, objective)["samples_per_s"]

    if priced(search) > priced(counts) * (1 + 1e-9):
        return replace(search, details={**search.details, "grouping": "local search (above the counts plan)"})
    return counts


def _sync_certified(found: _Found, devs: list[Device], k: int | None, planner: WorkerPlanner, objective: str,
                    replication: bool, deadline: float) -> _Found:
    """Clusters of up to 16 GPUs under ``sync`` (beyond, listing every worker template costs more than the
    plan): :func:`solvers.cluster.bounds.sync.sync_bound`, the bound with the
    all-reduce in it, which also prices the groupings that could beat the plan (a better one
    replaces it). Its figures go to ``details["sync_bound"]``."""
    cost, sched = planner.cost, planner.schedule
    if (found.best is None or objective != "sync" or replication or len(devs) > 16 or not sched.spec.flushes
            or sched.spec.sync != "allreduce" or not planner.interchangeable(devs)
            or time.perf_counter() >= deadline):
        return found
    from solvers.cluster.bounds.sync import sync_bound
    from solvers.cluster.templates import node_classes

    planner.progress.note("bounding the plan with its all-reduce")

    def price(g: list[list[Device]]) -> float:
        try:
            plan = plan_of(g, planner, cost.profile, sched)[0]
        except WorkerUnfit:  # a grouping the bound explores may hold a worker that fits nowhere: no plan
            return 0.0
        return price_plan(cost, plan, objective)["samples_per_s"]

    current = price(found.best[1])  # the plan _finish builds: every worker mapped by the full search
    sb = sync_bound(cost, devs, node_classes(devs, planner.node_kind), sched, current, workers=k,
                    exact_limit=planner.exact_limit, deadline=deadline, price=price)
    details: SolveDetails = {**found.details, "sync_bound": {"samples_per_s": sb.samples_per_s, "complete": sb.complete,
                                               "templates": sb.templates, "refined": sb.refined,
                                               "allreduce_floor": sb.allreduce_floor, "workers": sb.workers}}
    better = sb.details.get("grouping")
    if better is not None:
        details["grouping"] = "bound search (above the planner's grouping)"
        return _Found((sb.details["samples_per_s"], better), planner, found.exact, details)
    return replace(found, best=(current, found.best[1]), used=planner, details=details)


def _plan_symmetric(devs: list[Device], k: int | None, planner: WorkerPlanner, objective: str, replication: bool,
                    time_limit_s: float, t0: float, largest: int) -> _Found | None:
    """:func:`solvers.cluster.templates.plan_counts`, with the baselines' groupings as competitors."""
    planner.progress.note("counts of worker templates over node classes")
    from solvers.cluster.bounds.fleet import effective_whole_s, largest_layer_s, worker_memory_bytes
    from solvers.cluster.templates import node_classes, plan_counts

    cost, m = planner.cost, planner.schedule.micro_batches
    classes = node_classes(devs, planner.node_kind)
    complete = n_small = len(devs) <= 32
    # Templates are mapped by the screening search: every order where there are few (as many as
    # the full search where a proof is possible: small clusters, a schedule whose throughput is
    # a function of the bottleneck), else a few; the chosen grouping is re-planned in full.
    provable = (n_small and not replication and not planner.schedule.spec.flushes
                and (planner.schedule.spec.sync == "wave" or not cost.options.sync))
    rater = WorkerPlanner(cost, planner.schedule, replication,
                          planner.exact_limit if provable else min(planner.exact_limit, 24), 3)
    rater.deadline = planner.deadline
    # The baselines, where they apply, compete. Small clusters: at every candidate K, valued
    # first (a time limit spent on the counts still leaves them); large ones: one worker per
    # node and the counts plan's K, valued after it while time is left (mapping their large
    # mixed workers over many layers is what the counts planner saves).
    speed = _speed_of(cost, devs)
    nodes = len(dict.fromkeys(d.node for d in devs))

    def compete(ks: Sequence[int], best: tuple[float, list[list[Device]]] | None
                ) -> tuple[float, list[list[Device]]] | None:
        for kk in dict.fromkeys(ks):
            for pol in ("np", "ed", "hd"):
                with contextlib.suppress(FormatError):
                    g = group(pol, devs, kk, speed)
                    if max(len(w) for w in g) <= largest and time.perf_counter() < t0 + time_limit_s:
                        val = _grouping_value(g, rater, objective, m)
                        if val > -math.inf and (best is None or val > best[0]):
                            best = (val, g)
        return best

    baseline = compete([k] if k is not None else _candidate_ks(len(devs), nodes), None) if n_small else None
    types = sorted({d.kind for d in devs})
    memory = {t: (next(d for d in devs if d.kind == t).memory_bytes - cost.options.reserved_bytes)
              / cost.shard_memory_ratio(t) for t in types}
    whole = effective_whole_s(cost, types)  # the templates' rate bounds hold for any profile
    res = plan_counts(devs, classes, rater.throughput, rater.exact, whole.__getitem__, memory.__getitem__,
                      worker_memory_bytes(cost, planner.schedule), m, cost.profile.micro_batch_size,
                      fill=planner.schedule.spec.flushes and not replication,
                      largest_layer_s=largest_layer_s(cost, types), virtual_workers=k,
                      max_worker_gpus=min(largest, cost.num_layers, len(devs) if complete else 16),
                      covers_all=complete, wave_s=_wave_s(cost, planner.schedule), deadline=t0 + time_limit_s)
    if res is None or (k is not None and len(res.grouping) != k):
        return None
    best = (_grouping_value(res.grouping, rater, objective, m), res.grouping)
    if not n_small:
        baseline = compete([len(res.grouping), nodes] if k is None else [k], None)
    if baseline is not None and baseline[0] > best[0] * (1 + 1e-9):
        best = baseline
    # identical workers: the counts program leaves the all-reduce between workers out, which
    # mixed workers pay across slow links where identical ones keep their replicas on a node
    # screened by the rater (its estimate has the all-reduce between workers), the best few kept
    screened = [(v, g) for v, g in ((_grouping_value(g, rater, objective, m), g) for g in res.alternatives
                                    if max(len(w) for w in g) <= largest and time.perf_counter() < t0 + time_limit_s)
                if v > -math.inf]  # -inf: a worker that fits no split
    alternatives = [g for _, g in sorted(screened, key=lambda x: -x[0])[:IDENTICAL_FINALISTS]]
    used = rater
    if n_small and time.perf_counter() < t0 + time_limit_s:
        # The finalists re-planned by the full mapping search and priced exactly (the all-reduce
        # included): the estimate that ranked them may not rank them as the cost model does.
        priced = []
        for g in [res.grouping] + ([baseline[1]] if baseline is not None else []) + alternatives:
            try:
                plan = plan_of(g, planner, cost.profile, planner.schedule)[0]
            except WorkerUnfit:  # past its deadline the full search may keep less than the screening one
                continue
            priced.append((price_plan(cost, plan, objective)["samples_per_s"], g))
        if priced:
            best, used = max(priced, key=lambda x: x[0]), planner
    elif time.perf_counter() < t0 + time_limit_s:  # large: the winner re-planned in full if that helps
        best = max([best, *screened], key=lambda x: x[0])
        full = _grouping_value(best[1], planner, objective, m)
        if full >= best[0]:
            best, used = (full, best[1]), planner
    details: SolveDetails = {"grouping": "counts", "template_set": res.details["template_set"],
                             "templates": res.templates, "idle_gpus": len(devs) - sum(len(w) for w in best[1]),
                             "templates_planned": res.planned, "rounds": res.rounds,
                             "workers_per_template": res.details["workers_per_template"]}
    return _Found(best, used, res.exact, details)


def _wave_s(cost: CostModel, schedule: Schedule) -> float:
    """WSP's push and pull of the whole model per micro-batch (0 for other schedules, or with a
    bandwidth curve, where the stages' shares need not add up to the whole)."""
    if schedule.spec.sync != "wave" or cost.cluster.inter_curve is not None:
        return 0.0
    return cost.wave_sync_s(0, cost.num_layers, schedule.micro_batches)


def _plan_search(devs: list[Device], k: int | None, planner: WorkerPlanner, objective: str, time_limit_s: float,
                 t0: float, simulate_top: int, sim: tuple[Profile, Cluster, CostOptions | None],
                 largest: int) -> _Found:
    """Exhaustive enumeration (small clusters) or local search over device identities."""
    planner.progress.note("exhaustive search" if len(devs) <= 8 else "local search over groupings")
    cost, n = planner.cost, len(devs)
    nodes = len(dict.fromkeys(d.node for d in devs))
    micro_batches = planner.schedule.micro_batches
    # Large clusters: the grouping search screens workers with a cheaper mapping search; the
    # finalists are then re-planned with the full one.
    screen = planner if n <= 8 else WorkerPlanner(cost, planner.schedule, planner.replication,
                                                  min(planner.exact_limit, 24), 3)
    screen.deadline = planner.deadline
    speed = _speed_of(cost, devs)
    exact = True
    best: tuple[float, list[list[Device]]] | None = None
    used = planner
    details: SolveDetails = {}
    ks = _candidate_ks(n, nodes) if k is None else [k]
    if k is None:
        ks = [x for x in ks if -(-n // x) <= largest] or [_check_worker_size(n, max(ks), cost.num_layers, largest)]
    if screen is not planner:
        ks.sort(reverse=True)  # smallest workers first: the cheapest to map, so a time limit still sees many K
    budget = time_limit_s / max(1, len(ks))
    finalists: list[list[list[Device]]] = []
    for kk in ks:
        if time.perf_counter() >= t0 + time_limit_s and any(
                combine([screen.throughput(w) for w in g], objective) > -math.inf for g in finalists):
            log.info("time limit reached: K = %d and above not searched", kk)
            exact = False
            break
        starts = []
        for pol in ("np", "ed", "hd"):
            with contextlib.suppress(FormatError):
                starts.append(group(pol, devs, kk, speed))
        g, val, ex = search_opt(devs, kk, screen.throughput, objective, starts,
                                bound=screen.throughput_bound, time_limit_s=budget, idle=len(devs) <= 8)
        exact = exact and ex
        finalists += starts
        if g is not None and val > -math.inf:
            finalists.append(g)
    seen: set[Any] = set()
    unique: list[list[list[Device]]] = []
    for g in finalists:
        sig = tuple(sorted(tuple(sorted(d.name for d in w)) for w in g))
        if sig not in seen:
            seen.add(sig)
            unique.append(g)
    # Re-plan the finalists with the full mapping search, the most promising first, while the
    # time limit allows; past it, a finalist keeps the screening search's plan (a real plan too).
    if screen is not planner:
        unique.sort(key=lambda g: -combine([screen.throughput(w) for w in g], objective))
    deadline = t0 + time_limit_s
    scored: list[tuple[float, list[list[Device]]]] = []
    for g in unique:
        full = screen is planner or time.perf_counter() < deadline
        val = _grouping_value(g, planner if full else screen, objective, micro_batches)
        if val > -math.inf:
            scored.append((val, g))
            if best is None or val > best[0]:
                best, used = (val, g), (planner if full else screen)
    if simulate_top > 0 and len(scored) > 1:
        profile, cluster, options = sim
        best, ranking = _best_simulated(sorted(scored, key=lambda x: -x[0])[:simulate_top], planner,
                                        profile, cluster, planner.schedule, options)
        used = planner
        details["ranking"] = ranking
    return _Found(best, used, exact, details)


def _finish(found: _Found, cost: CostModel, devs: list[Device], policy: str, objective: str, replication: bool,
            schedule: Schedule, options: CostOptions | None, k: int | None,
            t0: float, bounds: _Bounds) -> SolveResult:
    """Build, price, certify and validate the plan of the chosen grouping."""
    assert found.best is not None
    profile, cluster = cost.profile, cost.cluster
    _val, g = found.best
    plan, mapped_exactly = plan_of(g, found.used, profile, schedule)
    exact = found.exact and mapped_exactly
    predicted = price_plan(cost, plan, objective)
    bound, any_order = bounds.fleet, bounds.any_order
    upper = min(any_order, bound.samples_per_s)
    with_sync = found.details.get("sync_bound", {})
    if with_sync.get("complete"):  # the bound with the all-reduce in it (solvers.cluster.bounds.sync)
        upper = min(upper, with_sync["samples_per_s"])
    if upper < predicted["samples_per_s"] * (1 - 1e-9):  # a bound below a plan it was to bound: no certificate
        log.warning("cluster planner: a bound (%.6g samples/s) is below the plan's %.6g; the plan is returned "
                    "without a certificate", upper, predicted["samples_per_s"])
        upper = math.nan
    # Exact search proves optimality only where throughput is a function of the bottleneck alone.
    # (The search prices the all-reduce between workers by an estimate, so with it no proof.)
    closed_form = (not replication and not schedule.spec.flushes
                   and (schedule.spec.sync == "wave" or not cost.options.sync))
    # ... or the plan reaches the bound.
    searched = policy == "opt" and exact and closed_form
    proven = searched or (not math.isnan(upper) and predicted["samples_per_s"] >= upper * (1 - 1e-9))
    status = SolveStatus.OPTIMAL if proven else SolveStatus.FEASIBLE
    if searched:  # the exhaustive search is the certificate: its plan is the best any plan reaches
        upper = min(upper, predicted["samples_per_s"])
    result = SolveResult(status, None, 1.0 / predicted["samples_per_s"], 1.0 / upper if upper > 0 else math.nan,
                         time.perf_counter() - t0, f"hetero:{policy}",
                         details={"virtual_workers": len(g), "objective": objective,
                                  "worker_evaluations": found.used.evaluations, "exact_search": exact,
                                  "bound": {"samples_per_s": bound.samples_per_s,
                                            "perfect_speedup": bound.perfect_speedup,
                                            "memory_bytes_per_worker": bound.memory_bytes_per_worker,
                                            "pipeline_fill": bound.pipeline_fill, "workers": bound.workers,
                                  "any_order_samples_per_s": any_order},
                                  **found.details})
    meta = {"policy": policy, "objective": objective, "replication": replication,
            "worker_samples_per_s": [worker_throughput(cost, vw.stages, schedule)
                                     for vw in plan.virtual_workers]}
    plan = with_predictions(replace(plan, solver=result.solver_info()), profile, cluster, options, predicted,
                            extra_meta=meta)
    cost.validate_plan(plan)  # structure and memory
    return replace(result, plan=plan)


@dataclass(frozen=True)
class _Bounds:
    """What no plan of the problem beats, in samples/s: the fleet bound (fill, memory, K; it
    prices the closed form) and ``any_order``, the bounds that hold for any order of the cost
    model's actions, the simulator's included (busy time and dependency chains: perfect speed-up,
    per layer, paced)."""

    fleet: FleetBound
    any_order: float


def _bounds(cost: CostModel, devs: list[Device], schedule: Schedule, k: int | None, replication: bool,
            slices: int) -> _Bounds:
    from solvers.cluster.bounds.fleet import fleet_bound

    fleet = fleet_bound(cost, devs, schedule, replication=replication, virtual_workers=k)
    any_order = min(throughput_upper_bound(cost, devs), _layer_bound(cost, devs, schedule, k, replication, slices),
                    _paced_bound(cost, devs, schedule, k, replication, slices))
    return _Bounds(fleet, any_order)


def _layer_bound(cost: CostModel, devs: list[Device], schedule: Schedule, k: int | None, replication: bool,
                 slices: int = 1) -> float:
    """:func:`solvers.cluster.bounds.layers.layer_bound` at ``k`` workers; with ``k`` free, at one
    worker, which bounds every K alike (``K`` workers hold ``K`` copies and run ``K m`` micro-batches:
    their busy time is at least ``K`` times one worker's, all-reduces and memory aside)."""
    from solvers.cluster.bounds.layers import layer_bound

    return layer_bound(cost, devs, 1 if k is None else k, schedule, every_k=k is None, replication=replication,
                       slices=slices)


def _paced_bound(cost: CostModel, devs: list[Device], schedule: Schedule, k: int | None, replication: bool,
                 slices: int = 1) -> float:
    """:func:`solvers.cluster.bounds.paced.paced_bound` (memory caps each stage's share) at ``k``
    workers, or over every K."""
    from solvers.cluster.bounds.paced import paced_bound

    return paced_bound(cost, devs, schedule, virtual_workers=k, replication=replication, slices=slices)


def _grouping_value(g: list[list[Device]], planner: WorkerPlanner, objective: str, micro_batches: int) -> float:
    """Samples/s of a grouping: ``combine`` of its workers' rates; under ``sync`` the iteration
    of the slowest worker also pays the all-reduce between workers (:meth:`WorkerPlanner.sync_estimate_s`),
    which is what makes data parallelism lose to pipelines on slow links."""
    rates = [planner.throughput(w) for w in g]
    val = combine(rates, objective)
    if objective != "sync" or val == -math.inf or len(g) < 2 or planner.schedule.spec.sync != "allreduce":
        return val
    samples = micro_batches * planner.cost.profile.micro_batch_size
    iteration = samples / min(rates) + planner.sync_estimate_s(g)
    return len(g) * samples / iteration


class WorkerUnfit(PartitionerError):
    """A grouping holds a worker over which no split fits in memory."""


def plan_of(g: list[list[Device]], planner: WorkerPlanner, profile: Profile, schedule: Schedule) -> tuple[Plan, bool]:
    """The plan of a grouping, every worker mapped and split by ``planner``, and whether every
    mapping was exact."""
    workers, exact = [], True
    for w in g:
        r = planner.stages(w)
        if r.stages is None:
            raise WorkerUnfit(f"no split of the model over the worker {[d.name for d in w]} fits its memory")
        exact = exact and r.exact
        workers.append(VirtualWorker(r.stages))
    return Plan(profile.model, tuple(workers), schedule.name, profile.micro_batch_size, schedule.micro_batches), exact


def _best_simulated(top: list[tuple[float, list[list[Device]]]], planner: WorkerPlanner, profile: Profile,
                    cluster: Cluster, schedule: Schedule, options: CostOptions | None
                    ) -> tuple[tuple[float, list[list[Device]]], list[dict[str, Any]]]:
    """Of the closed form's best groupings, the one the simulator runs fastest (and the ranking)."""
    from solvers.pipeline.ranking import rank_plans

    plans = [plan_of(g, planner, profile, schedule)[0] for _, g in top]
    ranked = rank_plans(plans, profile, cluster, options)
    winner = [p.virtual_workers for p in plans].index(ranked[0].plan.virtual_workers)
    return top[winner], [r.to_dict() for r in ranked]


def solve(profile: Profile, cluster: Cluster, **options: Any) -> SolveResult:
    """Registry entry: :func:`plan_cluster` with the solver options as keywords."""
    return plan_cluster(profile, cluster, **options)
