"""Joint device mapping and split of one pipeline: the data both models (CP-SAT, CBC) are built from.

The chain models (:mod:`solvers.exact.intervals`) split the layers over an *ordered* device list.
Here the order is a decision too. Devices are grouped into *labels* (:func:`solvers.pipeline.mapping.
device_labels`: ``(node, gpu type)``; GPUs of one label are interchangeable, so the model has
one label variable per position, never a copy per GPU). Positions are counted **from the end
of the pipeline**: position ``r`` is the stage with ``r`` stages after it, so its activations in
flight (``q - k = r + 1``) and hence its memory do not depend on the pipeline's length ``q``;
one network of positions then serves every length ``allow_fewer`` admits (the first stage is
the position whose stage starts at layer 0).

Numbers (seconds and bytes, before either solver scales them):

* an *arc* ``(r, t, i, j)``: position ``r`` on GPU type ``t`` holds layers ``[i, j)``; it exists
  when the split can be completed around it and the stage fits ``t``'s memory with
  ``activations_in_flight(r + 1)`` (the cost model's ``memory_matrix``, so the same test to the
  bit); its ``work_s`` is the compute on ``t`` plus WSP's wave sync, ``wave_s`` the latter alone.
  With activation recomputation allowed (``CostOptions.recompute``), the arc is priced in the
  first mode (cheapest first) whose stage fits ``t``'s memory (``mode``): its compute includes
  the forward it runs again. An arc of the same ``(r, t, i, j)`` in a later mode would take
  the same place in any plan with no less time (a recompute only adds time), so leaving it out
  changes neither the optimum nor any bound: both are over every choice of mode per stage;
* a *link class* per pair of labels: the cost model's boundary vector between two devices of
  those labels (``boundary_vector_s``: every cut's message on that link, size-dependent curves
  and latencies included). Pairs with the same vector share a class (HetPipe's cluster: two,
  inside a node and between nodes);
* stage ``r``'s time is ``work + back + out`` (or ``max(compute, back, out) + wave`` with
  ``overlap_comm``), where ``back`` is the message at its first cut on the link to the
  position before it and ``out`` the one at its last cut to the position after it: exactly
  :meth:`partitioner.cost.CostModel.pipeline_stage_time_s` for the realised order.

Nodes whose GPUs, links and bandwidths are the same (HetPipe's four nodes) are interchangeable:
any plan can be relabelled so that they are first used in the cluster's order, which the
models require (``symmetric_nodes``), cutting ``n!`` copies of every plan to one.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from partitioner.cluster import Device
from partitioner.cost import CostModel
from partitioner.errors import FormatError, PartitionerError
from solvers.exact.intervals import (
    ChainProblem,
    check_arc_count,
    dp_split,
    pipeline_lengths,
    priced_split,
)
from solvers.pipeline import dp
from solvers.pipeline.dp import ChainSolution
from solvers.pipeline.levers import first_fitting_modes, pick_by_mode
from solvers.pipeline.mapping import Label, device_labels, map_worker
from solvers.result import SolveDetails, SolveResult, SolveStatus

__all__ = ["HINT_SHARE", "PROVEN_REL", "JointData", "JointPlan", "JointVars", "canonical", "diagnose", "finish_joint",
           "joint_data", "mapping_details", "model_time_s", "needs_mapping", "read_plan", "start_values",
           "symmetric_pairs"]


PROVEN_REL = 1e-9  # a plan within this of a valid bound is optimal
HINT_SHARE = 0.25  # of a solve's time limit, at most, for the heuristic mapping that gives the hint
HINT_EVALUATIONS = 2000  # orders the heuristic mapping may price for the hint (HetPipe's 16 GPUs: ~560, 1.5 s)


def needs_mapping(problem: ChainProblem) -> bool:
    """Whether the device order matters: more than one label among the devices."""
    return len(set(device_labels(problem.cost, problem.devices))) > 1


def mapping_details(problem: ChainProblem, fixed_order: bool) -> SolveDetails:
    """The details of a graph-profile solve, whose convex stages keep the given device order:
    with devices of several labels and the order not asked to be kept, a note saying so."""
    if fixed_order or not needs_mapping(problem):
        return {"mapping": "given"}
    return {"mapping": "given", "messages": [
        "note: convex stages of a graph are planned over the devices in the given order (the graph model does "
        "not decide the mapping); `chain_order` decides the order and split together over the layer order"]}


@dataclass(frozen=True)
class JointPlan:
    """A model's answer: ``labels[r]`` and ``cuts`` (stage ``k`` holds ``cuts[k]:cuts[k+1]``,
    in pipeline order), with the plan it makes, priced by the cost model."""

    labels: tuple[Label, ...]  # pipeline order (first stage first)
    cuts: tuple[int, ...]
    solution: ChainSolution


@dataclass(frozen=True)
class JointData:
    """Everything the joint models are built from (see the module docstring)."""

    problem: ChainProblem
    labels: tuple[Label, ...]  # distinct labels, in the devices' order
    counts: tuple[int, ...]  # GPUs of each label
    pools: dict[Label, tuple[Device, ...]]
    types: tuple[str, ...]  # GPU type of each label
    positions: int  # R: positions 0..R-1 (0 = the last stage)
    lengths: tuple[int, ...]  # pipeline lengths allowed
    # arcs
    r: np.ndarray
    gpu: np.ndarray  # index into type_names
    i: np.ndarray
    j: np.ndarray
    work_s: np.ndarray  # compute + wave sync
    wave_s: np.ndarray
    mode: np.ndarray  # index into the options' recompute modes: the first that fits
    type_names: tuple[str, ...]
    # links: pair_class[g, h] (-1: the pair cannot be adjacent), class_s[c, cut]
    pair_class: np.ndarray
    class_s: np.ndarray
    symmetric_nodes: tuple[tuple[str, ...], ...]  # groups of interchangeable nodes, in cluster order
    start: JointPlan | None  # the heuristic mapping's plan (hint, upper bound)
    details: SolveDetails = field(default_factory=lambda: SolveDetails())

    def __post_init__(self) -> None:
        n_arcs, n_lab = len(self.r), len(self.labels)
        if not all(len(a) == n_arcs for a in (self.gpu, self.i, self.j, self.work_s, self.wave_s, self.mode)):
            raise PartitionerError("joint model data: the arc arrays differ in length")
        if len(self.counts) != n_lab or len(self.types) != n_lab or self.pair_class.shape != (n_lab, n_lab):
            raise PartitionerError("joint model data: labels, counts, types and link classes do not match")
        if n_arcs and not (self.i.min() >= 0 and (self.j > self.i).all() and self.j.max() <= self.num_layers):
            raise PartitionerError("joint model data: an arc is not a layer range")

    @property
    def num_layers(self) -> int:
        return self.problem.cost.num_layers

    @property
    def overlap(self) -> bool:
        return self.problem.cost.options.overlap_comm

    def node_of(self, g: int) -> str:
        return self.labels[g][0]

    def arcs_of(self, r: int) -> np.ndarray:
        return np.flatnonzero(self.r == r)

    def realise(self, plan_labels: Sequence[int], cuts: Sequence[int]) -> JointPlan:
        """The plan for labels (indices, pipeline order) and cuts: each label's devices in their
        listed order, each stage in the first recompute mode that fits (as the arcs have it),
        priced exactly by the cost model. Refuses what is not a plan."""
        q = len(plan_labels)
        n = self.num_layers
        ok = (len(cuts) == q + 1 and cuts[0] == 0 and cuts[-1] == n and all(a < b for a, b in itertools.pairwise(cuts))
              and q in self.lengths and all(c <= self.counts[g] for g, c in Counter(plan_labels).items()))
        if not ok:
            raise PartitionerError(f"the solver returned labels {list(plan_labels)} and cuts {list(cuts)}, "
                                   f"which are not a plan")
        used: Counter[int] = Counter()
        devs = []
        for g in plan_labels:
            devs.append(self.pools[self.labels[g]][used[g]])
            used[g] += 1
        p = self.problem
        return JointPlan(tuple(self.labels[g] for g in plan_labels), tuple(cuts),
                         priced_split(p.cost, cuts, devs, p.schedule))

    def label_index(self, plan: JointPlan) -> list[int]:
        return [self.labels.index(lab) for lab in plan.labels]

    def largest_time_s(self) -> float:
        """The largest arc time or message: what the models scale their times by."""
        return float(max(self.work_s.max(), self.class_s.max(initial=0.0)))

    def cheapest_s(self) -> np.ndarray:
        """Per cut, the cheapest message of any link class (0 without a class)."""
        return self.class_s.min(axis=0) if len(self.class_s) else np.zeros(self.num_layers + 1)

    def by_position(self) -> list[list[int]]:
        """The arcs of every position ``r``."""
        return [self.arcs_of(r).tolist() for r in range(self.positions)]

    def gpus_of_type(self, name: str) -> int:
        """GPUs of type ``name`` among the devices."""
        return sum(c for g, c in enumerate(self.counts) if self.types[g] == name)

    def labels_on(self, node: str) -> list[int]:
        """The labels (indices) of ``node``'s GPUs."""
        return [g for g in range(len(self.labels)) if self.node_of(g) == node]

    def plan_arcs(self, plan: JointPlan) -> list[np.ndarray]:
        """For every stage of ``plan`` (pipeline order), the arcs that make it (one where the plan's
        stage is a candidate stage of the model)."""
        labs = self.label_index(plan)
        q = len(labs)
        out = []
        for k, (a, b) in enumerate(itertools.pairwise(plan.cuts)):
            t = self.type_names.index(self.types[labs[k]])
            out.append(np.flatnonzero((self.r == q - 1 - k) & (self.gpu == t) & (self.i == a) & (self.j == b)))
        return out


def joint_data(problem: ChainProblem, hint: bool, prune: bool, max_arcs: int,
               deadline: float | None = None) -> JointData:
    """The arcs, link classes, symmetric nodes and the heuristic mapping's plan of ``problem``
    (its search stops at ``deadline``, a ``time.perf_counter()`` value, keeping the best found)."""
    cost, devices = problem.cost, problem.devices
    if problem.schedule.spec.sync == "wave" and cost.cluster.inter_curve is not None:
        raise FormatError("schedule", problem.schedule.name, "WSP's wave sync over a size-dependent inter-node "
                          "bandwidth is not priced by the joint mapping model; keep the device order "
                          "(`fixed_order`) or give inter_node_GBps as a number")
    dev_labels = device_labels(cost, devices)
    pools: dict[Label, list[Device]] = {}
    for lab, d in zip(dev_labels, devices, strict=True):
        pools.setdefault(lab, []).append(d)
    labels = tuple(pools)
    types = tuple(pools[lab][0].kind for lab in labels)
    type_names = tuple(dict.fromkeys(types))
    n, p = cost.num_layers, len(devices)
    lengths = pipeline_lengths(p, n, problem.allow_fewer)
    positions = max(lengths, default=0)
    start = _start(problem, labels, pools, hint, deadline)
    upper = start.solution.bottleneck_s * (1 + 1e-9) if (start is not None and prune) else math.inf

    pair_class, class_s = _link_classes(cost, labels, pools)
    cheapest = class_s.min(axis=0) if len(class_s) else np.zeros(n + 1)  # 0 at both ends of the chain
    cols = np.arange(n + 1)
    wave = problem.schedule.spec.sync == "wave"
    parts: list[tuple[np.ndarray, ...]] = []
    total = 0
    for r in range(positions):
        hi = n - (r + 1)  # the r stages after this one need a layer each
        later = [q for q in lengths if q > r + 1]  # lengths in which a stage comes before this one
        lo = (min(later) - 1 - r) if later else hi + 1  # first start after a stage before it
        row_ok = np.zeros(hi + 1, dtype=bool)
        row_ok[max(lo, 1):] = True
        row_ok[0] = (r + 1) in lengths  # this position may be the first stage
        rows = slice(0, hi + 1)
        in_flight = problem.schedule.activations_in_flight(r + 1)
        sync = cost.wave_sync_matrix(problem.schedule.micro_batches, rows) if wave else np.zeros((hi + 1, n + 1))
        shape = (cols[None, :] > cols[rows, None]) & (cols[None, :] <= n - r) & row_ok[:, None]
        if r == 0:
            shape &= cols[None, :] == n
        # an additive stage pays at least the cheapest link's message at each inner cut
        least = np.zeros((hi + 1, n + 1)) if cost.options.overlap_comm else cheapest[rows, None] + cheapest[None, :]
        for t, name in enumerate(type_names):
            head = pools[labels[types.index(name)]][0]
            # each stage in the first recompute mode that fits (-1: none does), its compute in that mode
            mode = first_fitting_modes(cost, in_flight, problem.schedule, head.memory_bytes, rows,
                                       head.tensor_parallel)
            work = pick_by_mode(cost, mode, partial(_compute_rows, gpu=name, rows=rows)) + sync
            ok = shape & (mode >= 0) & (work + least <= upper)
            ii, jj = np.nonzero(ok)
            total += len(ii)
            check_arc_count(total, max_arcs, f"joint mapping model of {n} layers over {p} devices ({len(labels)} "
                            f"labels)", "use the dp solver or keep the device order (`fixed_order`)")
            parts.append((np.full(len(ii), r), np.full(len(ii), t), ii, jj, work[ii, jj], sync[ii, jj],
                          mode[ii, jj]))
    cat = [np.concatenate(x) for x in zip(*parts, strict=True)] if parts else [np.zeros(0)] * 7
    r_a, t_a, i_a, j_a, w_a, s_a, m_a = cat
    data = JointData(problem, labels, tuple(len(pools[lab]) for lab in labels),
                     {lab: tuple(v) for lab, v in pools.items()}, types, positions, lengths,
                     r_a.astype(np.intp), t_a.astype(np.intp), i_a.astype(np.intp), j_a.astype(np.intp),
                     w_a.astype(np.float64), s_a.astype(np.float64), m_a.astype(np.intp), type_names, pair_class,
                     class_s,
                     _symmetric_nodes(cost, labels, pools, pair_class), None)
    data.details.update({"mapping": "model", "arcs": len(r_a), "labels": len(labels), "link_classes": len(class_s),
                         "symmetric_nodes": [list(g) for g in data.symmetric_nodes if len(g) > 1],
                         "hint": start is not None, "pruned": math.isfinite(upper)})
    if start is None:
        return data
    start = canonical(data, start)
    data.details["hint_s"] = start.solution.bottleneck_s
    return replace(data, start=start)


def _compute_rows(cm: CostModel, gpu: str, rows: slice) -> np.ndarray:
    return cm.compute_matrix(gpu)[rows]


def _start(problem: ChainProblem, labels: tuple[Label, ...], pools: dict[Label, list[Device]],
           hint: bool, deadline: float | None) -> JointPlan | None:
    """The heuristic mapping's plan (``map_worker``: exact over orders up to its limit, a local
    search of up to :data:`HINT_EVALUATIONS` orders beyond), or with ``allow_fewer`` and nothing fitting, the DP's prefix of the given order."""
    if not hint:
        return None
    cost = problem.cost
    sol = None
    if len(problem.devices) <= cost.num_layers:
        sol = map_worker(cost, problem.devices, problem.schedule,
                         max_evaluations=HINT_EVALUATIONS, deadline=deadline).solution
    if sol is None and problem.allow_fewer:
        sol = dp_split(problem)
    if sol is None:
        return None
    by_name = {d.name: lab for lab, ds in pools.items() for d in ds}
    return JointPlan(tuple(by_name[d.name] for d in sol.devices), sol.cuts, sol)


def _link_classes(cost: CostModel, labels: tuple[Label, ...], pools: dict[Label, list[Device]]
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Class of every label pair (-1: cannot be adjacent) and each class's message time per cut."""
    n_lab = len(labels)
    pair = np.full((n_lab, n_lab), -1, dtype=np.intp)
    vectors: dict[bytes, int] = {}
    rows: list[np.ndarray] = []
    for g, a in enumerate(labels):
        for h, b in enumerate(labels):
            if g == h and len(pools[a]) < 2:
                continue
            da, db = pools[a][0], pools[b][1] if g == h else pools[b][0]
            vec = np.asarray(cost.boundary_vector_s(da, db), dtype=np.float64)
            if not np.array_equal(vec, cost.boundary_vector_s(db, da)):
                raise PartitionerError(f"the link between {da.name} and {db.name} is not the same both ways")
            key = vec.tobytes()
            if key not in vectors:
                vectors[key] = len(rows)
                rows.append(vec)
            pair[g, h] = vectors[key]
    class_s = np.stack(rows) if rows else np.zeros((0, cost.num_layers + 1))
    return pair, class_s


def _symmetric_nodes(cost: CostModel, labels: tuple[Label, ...], pools: dict[Label, list[Device]],
                     pair: np.ndarray) -> tuple[tuple[str, ...], ...]:
    """Groups of nodes that can be swapped without changing any price: the same GPU types and
    counts, no device-level link, and every link class unchanged by the swap."""
    pinned = {end for link in cost.cluster.links for end in (link.a, link.b)}
    nodes = list(dict.fromkeys(lab[0] for lab in labels))
    sig: dict[str, tuple[tuple[str, int], ...] | None] = {}
    for node in nodes:
        mine = [lab for lab in labels if lab[0] == node]
        plain = all(d.name not in pinned for lab in mine for d in pools[lab])
        sig[node] = tuple(sorted((lab[1], len(pools[lab])) for lab in mine)) if plain else None
    index = {lab: g for g, lab in enumerate(labels)}

    def swappable(a: str, b: str) -> bool:
        perm = list(range(len(labels)))
        for g, lab in enumerate(labels):
            if lab[0] in (a, b):
                perm[g] = index[(b if lab[0] == a else a, lab[1])]
        return bool(np.array_equal(pair, pair[np.ix_(perm, perm)]))

    groups: list[list[str]] = []
    for node in nodes:
        for grp in groups:
            if sig[node] is not None and sig[grp[0]] == sig[node] and swappable(grp[0], node):
                grp.append(node)
                break
        else:
            groups.append([node])
    return tuple(tuple(g) for g in groups)


def canonical(data: JointData, plan: JointPlan) -> JointPlan:
    """``plan`` with interchangeable nodes renamed so that they are first used in the cluster's
    order (the models' symmetry-breaking rule), priced again."""
    rename: dict[str, str] = {}
    first_use = list(dict.fromkeys(lab[0] for lab in plan.labels))
    for group in data.symmetric_nodes:
        used = [n for n in first_use if n in group] + [n for n in group if n not in first_use]
        rename.update(zip(used, group, strict=True))
    labs = [data.labels.index((rename.get(lab[0], lab[0]), lab[1])) for lab in plan.labels]
    return data.realise(labs, plan.cuts)


def diagnose(data: JointData) -> str:
    """Why no order and split fits: the chain's reasons where they hold for every order."""
    problem = data.problem
    reason = chain = dp.diagnose_infeasible(problem.cost, problem.tried_devices, problem.schedule)
    if reason.startswith("no contiguous split"):
        q = max(data.lengths, default=len(problem.devices))
        first = problem.schedule.activations_in_flight(q)
        reason = (f"no contiguous split of {data.num_layers} layers over these {len(problem.devices)} devices in "
                  f"any order fits every device's memory under {problem.schedule} with {problem.schedule.micro_batches} "
                  f"micro-batches (the first stage keeps {first} in flight); use more or larger devices, fewer "
                  f"micro-batches in flight (1f1b instead of gpipe), or allow fewer devices")
        if "; it would fit with " in chain:  # levers checked on the given order hold there
            reason += "; in the given order it would fit with " + chain.split("; it would fit with ", 1)[1]
    return reason


def finish_joint(data: JointData, method: str, status: SolveStatus, found: JointPlan | None, lower_bound: float,
                 runtime_s: float, details: SolveDetails, reason: str = "") -> SolveResult:
    """A :class:`SolveResult` from the model's plan (or the hint's, when the model has none)."""
    problem = data.problem
    details = {**data.details, **details}
    if status is SolveStatus.INFEASIBLE:
        return SolveResult(status, None, runtime_s=runtime_s, method=method, reason=reason or diagnose(data),
                           details=details)
    best = found
    if data.start is not None and (best is None or data.start.solution.bottleneck_s < best.solution.bottleneck_s):
        best = data.start
        details["from_hint"] = True
        if status is SolveStatus.UNKNOWN:
            status = SolveStatus.FEASIBLE
    if best is None:
        return SolveResult(status, None, lower_bound=lower_bound, runtime_s=runtime_s, method=method,
                           reason=reason or "no plan found within the time limit", details=details)
    details["order"] = [d.name for d in best.solution.devices]
    if status is SolveStatus.FEASIBLE and best.solution.bottleneck_s <= lower_bound * (1 + PROVEN_REL):
        status = SolveStatus.OPTIMAL  # the plan meets a valid bound (the relaxation's, usually)
        details["proof"] = "bound"
    plan = dp.plan_from_cuts(problem.profile, problem.cost, best.solution, problem.schedule,
                             solver_name=method)
    objective = best.solution.bottleneck_s
    result = SolveResult(status, None, objective, min(lower_bound, objective), runtime_s, method, reason=reason,
                         details=details)
    return dp._with_plan(result, plan)


# -- what both models do around their own variables -------------------------------------------


class JointVars(NamedTuple):
    """A joint model's variables (either backend's objects; positions ``r`` count from the end)."""

    x: list[Any]  # x[a]: arc a = (r, t, i, j) chosen
    u: list[list[Any]]  # u[r][g]: position r runs on label g
    v: list[list[Any]]  # v[r][c]: the link between positions r + 1 and r is of class c
    s: list[Any]  # s[r]: the message at the cut where position r starts
    t_stage: list[Any]  # T[r]: position r's time
    bottleneck: Any  # B


def start_values(data: JointData, plan: JointPlan, var: JointVars) -> Iterator[tuple[Any, bool]]:
    """``plan`` in the models' variables (a hint or a warm start), as (variable, value) pairs:
    the arcs ``x[a]``, then the labels ``u[r][g]``, then the link classes ``v[r][c]``."""
    x, u, v = var.x, var.u, var.v
    labs = data.label_index(plan)
    q = len(labs)
    chosen: set[int] = set()
    for hit in data.plan_arcs(plan):
        chosen.update(hit.tolist())
    for a, var in enumerate(x):
        yield var, a in chosen
    at = {q - 1 - k: g for k, g in enumerate(labs)}
    for r, row in enumerate(u):
        for g, var in enumerate(row):
            yield var, at.get(r) == g
    for r, row in enumerate(v):
        cls = data.pair_class[at[r + 1], at[r]] if (r + 1) in at else -1
        for c, var in enumerate(row):
            yield var, c == cls


def read_plan(data: JointData, var: JointVars, on: Callable[[Any], bool]) -> JointPlan:
    """The plan of a model's answer (``on(variable)``: it is 1), priced by the cost model;
    refuses arcs that do not form a split or a position without exactly one label."""
    x, u = var.x, var.u
    picked = sorted(((int(data.r[a]), int(data.i[a]), int(data.j[a])) for a, var in enumerate(x) if on(var)),
                    reverse=True)
    q = len(picked)
    cuts = [0] + [j for _, _, j in picked]
    labs = []
    for r, _, _ in picked:
        got = [g for g in range(len(data.labels)) if on(u[r][g])]
        if len(got) != 1:
            raise PartitionerError(f"the joint model gave position {r} the labels {got}")
        labs.append(got[0])
    if [r for r, _, _ in picked] != list(range(q - 1, -1, -1)) or any(picked[k][1] != cuts[k] for k in range(q)):
        raise PartitionerError(f"the joint model returned arcs that do not form a split: {picked}")
    return data.realise(labs, cuts)


def symmetric_pairs(data: JointData) -> Iterator[tuple[str, list[int], list[int]]]:
    """Interchangeable nodes in cluster order, by neighbouring pairs: (the later node, the
    earlier node's labels, the later node's labels)."""
    for group in data.symmetric_nodes:
        for early, late in itertools.pairwise(group):
            yield late, data.labels_on(early), data.labels_on(late)


def model_time_s(time_limit_s: float, t0: float) -> float:
    """The time a model may take: what the hint and the relaxation left, at least a tenth of the limit."""
    return max(time_limit_s - (time.perf_counter() - t0), 0.1 * time_limit_s)
