"""The graph problem: one pipeline of convex stages of a DAG, shared by the CP-SAT and CBC models.

A profile with ``edges`` is a DAG in one topological order. A stage need not be a range of
that order: any assignment ``s(v)`` of layers to stages ``0..p-1`` with ``s(u) <= s(v)`` for
every edge ``u -> v`` is a pipeline, since sorting the layers by ``(s(v), v)`` gives another
topological order in which every stage is a range (:meth:`Profile.reordered`). Stage ``k``
runs on ``devices[k]``; the tensor crossing the boundary between stages ``c - 1`` and ``c``
is every output ``u`` with ``s(u) < c`` that feeds some ``w`` with ``s(w) >= c``.

Both models use the order encoding ``y[v, c] = 1`` iff ``s(v) < c`` (for ``c = 1..p-1``;
``y[v, 0] = 0`` and ``y[v, p] = 1``), so that layer ``v`` is in stage ``k`` when
``x[v, k] = y[v, k+1] - y[v, k] = 1``:

    y[v, c] <= y[v, c+1]                                   (stages in order)
    y[w, c] <= y[u, c]           for every edge u -> w     (precedence)
    sum_v x[v, k] >= 1                                     (no empty stage)
    z[u, c] >= y[u, c] - y[w, c] for every edge u -> w     (u's output crosses cut c)
    X_c = sum_u own_u z[u, c]                              (bytes at cut c)
    C_k = sum_v (t_k(v) + w(v)) x[v, k]                    (compute, WSP's wave sync)
    T_k >= C_k + X_k / bw(k, k-1) + X_{k+1} / bw(k, k+1)   (additive; overlapped: one row each)
    M_k = sum_v (wf par_v + f_k sav_v) x[v, k] - f_k sum_v sh_v b[v, k] + R <= cap_k
    b[v, k] <= x[v, k],  b[v, k] <= x[v-1, k]              (v shares its input with v - 1)
    B >= T_k;   minimise B;   then B <= B*, minimise sum_k T_k.

With activation recomputation allowed (``CostOptions.recompute``: ``auto``, several modes), stage
``k`` also chooses its mode ``m`` (``r[k, m]`` binary, ``sum_m r[k, m] = 1``), and its time and
memory are that mode's, as the cost model prices them (:mod:`partitioner.recompute`):

    T_k >= C^m_k + X_k / bw + X_{k+1} / bw    if r[k, m]   (C^m: the layers' compute in mode m)
    T_k >= C^0_k + X_k / bw + X_{k+1} / bw                (C^0: the least over the modes, always)
    M^m_k <= cap_k                            if r[k, m]

where ``M^m`` keeps ``f_k (sav_v - sel_v)`` per layer under selective recomputation (``sel_v``:
the attention core's bytes), and under full recomputation one micro-batch's ``sav_v`` and the
stage's input ``f_k`` times (``(f_k - 1)`` kept inputs and the receive posted ahead; the other
modes: once). With one mode there is no ``r``: its terms hold unconditionally (``none``: the
model above, no variable added). Every real plan (an assignment and a mode per stage that fits)
is a solution of the model with ``r`` its modes, at a modelled time no greater than its true
time (the chosen mode's compute is C^m; C^0 <= C^m), so the model's optimum and its bound are
lower bounds over every assignment and every choice of mode per stage. The assignment found is
priced with each stage in the first mode (cheapest first) that fits its device, as the DP
chooses (:func:`solvers.pipeline.levers.stage_mode`): no slower than the model's own choice.

``t_k(v)`` is the layer's forward+backward on ``devices[k]``'s type, ``w(v)`` WSP's per-layer
wave sync, ``f_k`` the activations in flight at stage ``k``, ``wf`` the bytes per parameter.
The transfer terms are exact for flat links (a constant GB/s, no latency): a message's time
is then linear in its bytes. Links with a latency or a measured curve are refused in one line
(plan the chain order: ``dag=False``). The chosen assignment is priced exactly by the cost
model on the reordered profile; the DP's plan of the profile's own order is always feasible
here, so it is the hint, an upper bound, and the answer when the solver finds nothing better.

The memory rows are a relaxation of the cost model's check, never a restriction: their
capacity is raised by :func:`memory_margin_bytes` (a trillionth of the row, for floating
point) and CP-SAT rounds their coefficients towards acceptance, so a stage that needs exactly
its device's memory is a solution (a restriction would lose it, and with it the optimum and the
bound's validity). A stage the model accepts and the cost model refuses (a few bytes over, or a
solver's tolerance) is found by :func:`overflowing_stages` once the model is solved: that
assignment with that stage in that mode is excluded and the model solved again, at most
:data:`MAX_OVERFLOW_ROUNDS` times, so the final optimum and bound are those of a model that
still holds every real plan.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from partitioner.boundary import boundary_held
from partitioner.cost import CostModel
from partitioner.errors import FormatError, PartitionerError
from partitioner.profile import Profile
from partitioner.recompute import selective_bytes
from solvers.exact.intervals import ChainProblem, dp_split, priced_split
from solvers.pipeline import dp
from solvers.pipeline.dp import ChainSolution
from solvers.result import SolveDetails, SolveResult, SolveStatus

__all__ = ["MAX_OVERFLOW_ROUNDS", "DagData", "DagPlan", "DagVars", "dag_data", "finish_dag", "memory_margin_bytes",
           "order_values", "overflowing_stages", "price_assignment", "price_order", "single_stage",
           "tie_break_winner"]

MAX_OVERFLOW_ROUNDS = 20  # solves again after excluding a stage the cost model refuses, at most
MEMORY_MARGIN = 1e-12  # of a memory row's largest figure: what it allows past the capacity


@dataclass(frozen=True)
class DagData:
    """The numbers both models are built from (seconds and bytes, before any scaling); arrays
    with a leading axis of ``len(modes)``: per recompute mode the options allow, cheapest first."""

    problem: ChainProblem
    edges: tuple[tuple[int, int], ...]
    succ: tuple[tuple[int, ...], ...]  # successors of each layer
    time_s: np.ndarray  # [M, p, n]: t_k(v) in mode m + w(v)
    wave_s: np.ndarray  # [n]: w(v) (0 unless the schedule is wsp)
    own_bytes: np.ndarray  # [n]
    back_s_per_byte: tuple[float, ...]  # stage k's gradient send to devices[k - 1] (0 for k = 0)
    out_s_per_byte: tuple[float, ...]  # stage k's activation send to devices[k + 1] (0 for the last)
    mem_bytes: np.ndarray  # [M, p, n]: weights + activations in flight of layer v on stage k in mode m
    shared_bytes: np.ndarray  # [M, p, n]: what stage k saves in mode m when v - 1 is in it too
    capacity_bytes: tuple[float, ...]  # device memory less the reserved bytes
    start: ChainSolution | None  # the DP's split of the profile's own order
    flight: tuple[float, ...] = ()  # micro-batches in flight on each stage
    modes: tuple[str, ...] = ("none",)  # CostOptions.recompute_modes

    def __post_init__(self) -> None:
        shape = (len(self.modes), self.num_stages, self.num_layers)
        if not all(a.shape == shape for a in (self.time_s, self.mem_bytes, self.shared_bytes)):
            raise PartitionerError(f"graph model data: times and memory must be arrays of shape {shape}")

    def boundary_terms(self, k: int, m: int = 0) -> list[tuple[float, int, int]]:
        """Stage ``k``'s boundary tensors in mode ``modes[m]`` (:meth:`partitioner.cost.CostModel.
        boundary_held_bytes`, and under full recomputation the inputs it keeps) as ``(bytes, sender,
        cut)``: each output crossing cut ``k + 1`` as many times as the schedule's executor holds a
        stage's output (:func:`partitioner.boundary.boundary_held`: per micro-batch in flight and
        fixed), each crossing cut ``k`` as many times as it holds a stage's input (full: ``f_k - 1``
        more, the inputs kept for the recomputation); the bytes count where the sender's crossing
        variable of that cut is 1."""
        held = boundary_held(self.problem.schedule.name)
        copies = held.fixed_inputs + (self.flight[k] - 1.0 if self.modes[m] == "full" else 0.0)
        out = []
        for u in self.senders():
            if k + 1 < self.num_stages:
                times = held.per_flight * self.flight[k] + held.fixed_outputs
                out.append((times * float(self.own_bytes[u]), u, k + 1))
            if k > 0:
                out.append((copies * float(self.own_bytes[u]), u, k))
        return out

    def most_boundary_bytes(self, k: int, m: int = 0) -> float:
        """The most :meth:`boundary_terms` can add to stage ``k`` in mode ``modes[m]``."""
        return sum(b for b, _, _ in self.boundary_terms(k, m))

    def most_memory_bytes(self, k: int, m: int) -> float:
        """The most stage ``k``'s memory row in mode ``m`` can reach (every layer, every crossing)."""
        return float(self.mem_bytes[m, k].sum()) + self.most_boundary_bytes(k, m)

    @property
    def least_time_s(self) -> np.ndarray:
        """[p, n]: per stage and layer the least time over the modes (C^0, the row every mode obeys)."""
        return self.time_s.min(axis=0)

    def mode_indices(self, sol: ChainSolution) -> list[int]:
        """The mode (an index in ``modes``) of every stage of ``sol``."""
        return [self.modes.index(mode) for mode in (sol.recompute or ("none",) * self.num_stages)]

    def hint_modes(self) -> list[int] | None:
        """The mode of every stage of the DP's split (None without one)."""
        return None if self.start is None else self.mode_indices(self.start)

    @property
    def num_stages(self) -> int:
        return len(self.problem.devices)

    @property
    def num_layers(self) -> int:
        return self.problem.profile.num_layers

    def hint_stages(self) -> list[int] | None:
        """The stage of every layer in the DP's split (None without one)."""
        if self.start is None:
            return None
        out = []
        for k, (a, b) in enumerate(self.start.ranges):
            out.extend([k] * (b - a))
        return out

    def senders(self) -> list[int]:
        """Layers whose output may cross a cut: those with successors and bytes to send."""
        return [u for u in range(self.num_layers) if self.succ[u] and self.own_bytes[u] > 0]

    def hint_plan(self) -> DagPlan | None:
        """The DP's split, priced as an assignment (None without one)."""
        start = self.hint_stages()
        return price_assignment(self, start) if start is not None else None

    def stage_time_bound_s(self) -> float:
        """No stage of any assignment takes longer than this (for scaling times)."""
        sends = float(self.own_bytes.sum()) * (max(self.back_s_per_byte, default=0.0)
                                               + max(self.out_s_per_byte, default=0.0))
        return float(self.time_s.max(axis=0).sum(axis=1).max()) + float(self.wave_s.sum()) + sends


def dag_data(problem: ChainProblem, hint: bool) -> DagData:
    """Check that the graph model can price ``problem`` exactly and gather its numbers."""
    profile, cost, devs = problem.profile, problem.cost, problem.devices
    if problem.allow_fewer:
        raise FormatError("allow_fewer", True, "the graph model plans exactly one stage per device; name the "
                          "devices to use (`devices`) or plan the chain order (`chain_order`)")
    n, p = profile.num_layers, len(devs)
    for i, layer in enumerate(profile.layers):
        if profile.edges and layer.own_output_bytes is None and any(a == i for a, _ in profile.edges):
            raise FormatError(f"layers[{i}].own_output_bytes", None, "is needed to price the cuts of a graph; "
                              "import the graph again (partitioner import pipedream)")
    for k in range(p - 1):
        link = cost.cluster.link(devs[k].name, devs[k + 1].name)
        if not link.is_flat:
            raise FormatError("devices", f"{devs[k].name} -> {devs[k + 1].name}",
                              "the graph model prices transfers on flat links (constant GB/s, no latency); this "
                              "link has a latency or a measured curve; plan the chain order (`chain_order`)")
    wsp = problem.schedule.spec.sync == "wave"
    if wsp and cost.cluster.inter_curve is not None:
        raise FormatError("schedule", problem.schedule.name, "the graph model prices WSP's wave sync on a flat inter-node "
                          "link; this cluster has a measured curve; plan the chain order (dag=False)")
    edges = profile.graph_edges
    succ: list[list[int]] = [[] for _ in range(n)]
    for a, b in edges:
        succ[a].append(b)
    wave = np.zeros(n)
    if wsp:
        sync = cost._sync_prefix  # the cost model's own per-layer figures
        wave = 2.0 * np.diff(sync) / problem.schedule.micro_batches
    modes = cost.options.recompute_modes
    time_s = np.array([[cost.recomputing(mode).layer_compute_s(d.kind) for d in devs] for mode in modes]) \
        + wave[None, None, :]
    per_byte = [0.0] * p
    out_per_byte = [0.0] * p
    for k in range(p):
        if k > 0:
            per_byte[k] = 1.0 / (cost.cluster.link(devs[k].name, devs[k - 1].name).gbps * 1e9)
        if k + 1 < p:
            out_per_byte[k] = 1.0 / (cost.cluster.link(devs[k].name, devs[k + 1].name).gbps * 1e9)
    weights = np.diff(cost.param_count_prefix) * cost.weight_factor(problem.schedule)
    saved, shared = profile.array("saved_bytes"), profile.array("shared_saved_bytes")
    shared[0] = 0.0  # the first layer has no predecessor to share with
    flight = np.array([problem.schedule.activations_in_flight(p - k) for k in range(p)],
                      dtype=np.float64)
    # per mode: what each layer keeps per micro-batch in flight (selective: less the attention
    # core's bytes), and how many micro-batches' worth (full: one, its input kept f_k times instead)
    mem, shared_of = [], []
    for mode in modes:
        kept = saved - selective_bytes(profile) if mode == "selective" else saved
        times = np.ones(p) if mode == "full" else flight
        mem.append(weights[None, :] + times[:, None] * kept[None, :])
        shared_of.append(times[:, None] * shared[None, :])
    reserved = cost.options.reserved_bytes
    return DagData(problem, tuple(edges), tuple(tuple(s) for s in succ), time_s, wave,
                   np.array([layer.own_bytes for layer in profile.layers], dtype=np.float64),
                   tuple(per_byte), tuple(out_per_byte), np.array(mem), np.array(shared_of),
                   tuple(d.memory_bytes - reserved for d in devs), dp_split(problem) if hint else None,
                   tuple(flight.tolist()), modes)


@dataclass(frozen=True)
class DagPlan:
    """An assignment, priced exactly: the profile in its order, the split, and its total time."""

    stages: tuple[int, ...]  # stage of each layer of the problem's profile
    profile: Profile  # the problem's profile reordered by (stage, layer)
    cost: CostModel
    solution: ChainSolution
    total_s: float  # sum of the stage times (the tie-break)
    fits: bool  # every stage fits its device's memory (the cost model's check)


def price_assignment(data: DagData, stages: Sequence[int]) -> DagPlan:
    """Price a precedence-respecting assignment with the cost model on the reordered profile."""
    problem = data.problem
    n, p = data.num_layers, data.num_stages
    st = [int(s) for s in stages]
    if len(st) != n or any(not 0 <= s < p for s in st) or any(st[a] > st[b] for a, b in data.edges) \
            or sorted(set(st)) != list(range(p)):
        raise FormatError("stages", st, "the solver returned an assignment that is not a pipeline of convex stages")
    order = sorted(range(n), key=lambda v: (st[v], v))
    profile = problem.profile.reordered(order)
    cost = CostModel(profile, problem.cost.cluster, problem.cost.options)
    sizes = np.bincount(np.array(st), minlength=p)
    cuts = tuple(int(c) for c in np.concatenate([[0], np.cumsum(sizes)]))
    devs = problem.devices
    # each stage in the first recompute mode that fits (the options' last where none does)
    sol = priced_split(cost, cuts, devs, problem.schedule)
    modes = sol.recompute or ("none",) * p
    times = [cost.recomputing(modes[k]).pipeline_stage_time_s(a, b, devs[k], devs[k - 1] if k > 0 else None,
                                                              devs[k + 1] if k + 1 < p else None, problem.schedule)
             for k, (a, b) in enumerate(itertools.pairwise(cuts))]
    fits = all(cost.recomputing(modes[k]).stage_memory_bytes(a, b, problem.schedule.activations_in_flight(p - k),
                                                             problem.schedule, devs[k].tensor_parallel)
               <= devs[k].memory_bytes for k, (a, b) in enumerate(itertools.pairwise(cuts)))
    return DagPlan(tuple(st), profile, cost, sol, math.fsum(times), fits)


def memory_margin_bytes(data: DagData, k: int, m: int) -> float:
    """What stage ``k``'s memory row in mode ``modes[m]`` allows past its capacity: far more than
    the floating-point error of the cost model's sums and of the model's (a trillionth of the
    row's largest figure), far less than a byte on any real device."""
    return MEMORY_MARGIN * max(data.most_memory_bytes(k, m), abs(data.capacity_bytes[k]), 1.0)


def overflowing_stages(data: DagData, plan: DagPlan, modes: Sequence[int]) -> list[int]:
    """The stages of ``plan`` that overflow their device in the mode a model chose for them
    (``modes[k]``: an index in ``data.modes``), by the cost model's own check: those the model's
    relaxed memory rows accepted within their margin (or a solver's tolerance) but no real plan has."""
    problem = data.problem
    p, devs, sched = data.num_stages, problem.devices, problem.schedule
    cuts = plan.solution.cuts
    return [k for k in range(p)
            if plan.cost.recomputing(data.modes[modes[k]]).stage_memory_bytes(
                cuts[k], cuts[k + 1], sched.activations_in_flight(p - k), sched, devs[k].tensor_parallel)
            > devs[k].memory_bytes]


class DagVars(NamedTuple):
    """A graph model's variables (either backend's objects), and the order encoding's terms."""

    y: list[list[Any]]  # y[v][c - 1] = 1 iff layer v is in a stage before cut c (c = 1..p-1)
    z: dict[tuple[int, int], Any]  # z[u, c]: u's output crosses cut c
    t: list[Any]  # t[k]: stage k's time
    bottleneck: Any  # B
    senders: list[int]  # the layers u that have a z[u, c]
    r: Sequence[Sequence[Any]] = ()  # r[k][m]: stage k recomputes modes[m] (none with one mode: it holds everywhere)

    def before(self, v: int, c: int) -> Any:
        """y[v, c] with y[v, 0] = 0 and y[v, p] = 1."""
        p = len(self.t)
        return 0 if c == 0 else 1 if c == p else self.y[v][c - 1]

    def x(self, v: int, k: int) -> Any:
        """Layer v in stage k: y[v, k+1] - y[v, k]."""
        return self.before(v, k + 1) - self.before(v, k)


def order_values(stages: Sequence[int], num_stages: int) -> list[list[bool]]:
    """An assignment in the order encoding: ``y[v][c - 1] = stages[v] < c`` for ``c = 1..p-1``
    (a model's hint or warm start)."""
    return [[s < c for c in range(1, num_stages)] for s in stages]


def price_order(data: DagData, before: Sequence[Sequence[int]]) -> DagPlan:
    """The assignment a model's order encoding gives (``before[v][c - 1]``: 1 when layer ``v``
    is before cut ``c``; layer ``v`` is in stage ``p - 1 - sum_c before[v]``), priced exactly."""
    p = data.num_stages
    return price_assignment(data, [p - 1 - sum(row) for row in before])


def tie_break_winner(found: DagPlan, again: DagPlan, slack_s: float) -> DagPlan:
    """The tie-break's answer ``again`` where it fits, has the smaller total and a bottleneck
    within ``slack_s`` of ``found``'s (what the second model's rounding allows), else ``found``.
    (An exact comparison of bottlenecks would let float noise pick the worse total.)"""
    if again.fits and again.total_s < found.total_s and \
            again.solution.bottleneck_s <= found.solution.bottleneck_s + slack_s:
        return again
    return found


def better(a: DagPlan | None, b: DagPlan | None) -> DagPlan | None:
    """The better of two priced plans: fits, then least bottleneck, then least total time.
    Bottlenecks equal up to float rounding (the same stage times summed in another order) tie,
    so that the total decides (``a`` on a full tie)."""
    cands = [x for x in (a, b) if x is not None and x.fits]
    if len(cands) < 2:
        return cands[0] if cands else None
    x, y = cands
    bx, by = x.solution.bottleneck_s, y.solution.bottleneck_s
    if abs(bx - by) <= 1e-9 * max(bx, by):
        return x if x.total_s <= y.total_s else y
    return x if bx < by else y


def finish_dag(data: DagData, method: str, status: SolveStatus, found: DagPlan | None, lower_bound: float,
               runtime_s: float, details: SolveDetails, reason: str = "") -> SolveResult:
    """A :class:`SolveResult` for the graph model: the better of ``found`` and the DP's split
    (both priced exactly), its plan with ``layer_order`` where it is not the profile's own."""
    problem = data.problem
    if status is SolveStatus.INFEASIBLE:
        reason = reason or _diagnose(data)
        return SolveResult(status, None, runtime_s=runtime_s, method=method, reason=reason, details=details)
    hint = price_assignment(data, data.hint_stages() or []) if data.start is not None else None
    best = better(found, hint)
    if best is None:  # (a plan the cost model refuses is no plan)
        return SolveResult(SolveStatus.UNKNOWN, None, lower_bound=lower_bound, runtime_s=runtime_s, method=method,
                           reason=reason or "no plan found within the time limit", details=details)
    details = {**details, "order": "graph", "reordered": best.profile.layer_order is not None,
               "from_hint": best is hint and found is not hint}
    if status is SolveStatus.UNKNOWN:
        status = SolveStatus.FEASIBLE  # the hint is a plan
    plan = dp.plan_from_cuts(best.profile, best.cost, best.solution, problem.schedule,
                             solver_name=method)
    objective = best.solution.bottleneck_s
    result = SolveResult(status, None, objective, min(lower_bound, objective), runtime_s, method, reason=reason,
                         details=details)
    return replace(result, plan=replace(plan, solver=result.solver_info()))


def single_stage(data: DagData, method: str, t0: float, details: SolveDetails) -> SolveResult | None:
    """The answer without a model when there is nothing to choose: more devices than layers
    (infeasible) or one device (the whole graph on it); None otherwise."""
    n, p = data.num_layers, data.num_stages
    if p > n:
        return finish_dag(data, method, SolveStatus.INFEASIBLE, None, math.nan, time.perf_counter() - t0, details)
    if p == 1:
        whole = price_assignment(data, [0] * n)
        if not whole.fits:
            return finish_dag(data, method, SolveStatus.INFEASIBLE, None, math.nan, time.perf_counter() - t0,
                              details)
        return finish_dag(data, method, SolveStatus.OPTIMAL, whole, whole.solution.bottleneck_s,
                          time.perf_counter() - t0, details)
    return None


def _diagnose(data: DagData) -> str:
    """Why no convex split fits: the chain's reasons where they apply, else in the graph's words."""
    problem = data.problem
    n, p = data.num_layers, data.num_stages
    if p > n:
        return f"{p} devices but only {n} layers: every stage needs at least one layer; give at most {n} devices"
    chain = dp.diagnose_infeasible(problem.cost, problem.devices, problem.schedule)
    if not chain.startswith("no contiguous split"):
        return chain
    return (f"no assignment of the {n} layers to {p} stages that respects the graph's edges fits every device's "
            f"memory under {problem.schedule} with {problem.schedule.micro_batches} micro-batches; use more or larger "
            f"devices or fewer micro-batches in flight")
