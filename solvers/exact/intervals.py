"""The interval formulation of the chain problem, shared by the CP-SAT and MILP solvers.

A pipeline of ``q`` stages over ``devices[:q]`` is a path through cut points
``0 = c_0 < c_1 < ... < c_q = L``. Every candidate stage is an *arc*: stage ``k`` of a
``q``-stage pipeline holds layers ``[i, j)``. An arc exists only when it can be part of a
split (enough layers left for the stages before and after it) and fits the memory of
``devices[k]``; its time is ``CostModel.stage_time_matrix`` at ``(i, j)``. Choosing exactly
one arc per stage with matching cut points is a unit flow from cut 0 to cut L through the
stages, so the models are

    sum_q y_q = 1                                                (one pipeline length)
    sum_j x[q, 0, 0, j] = y_q                                     (flow leaves cut 0)
    sum_i x[q, k-1, i, c] = sum_j x[q, k, c, j]   for 0 < k < q   (flow is conserved)
    B >= sum_{i,j} T[q, k, i, j] * x[q, k, i, j]  for every q, k  (B is the bottleneck)
    minimise B.

With activation recomputation allowed (``CostOptions.recompute``: ``auto`` or one mode), a
candidate stage ``[i, j)`` of stage ``k`` may be priced in any mode the options allow: an arc per
``(q, k, i, j, mode)`` whose stage fits in that mode. Of those arcs only the first mode that
fits (cheapest first, :func:`solvers.pipeline.levers.first_fitting_modes`) is kept: the others
join the same cuts in the same network, and a recompute only adds time (its forward again,
inside the backward), so any split using one of them is matched by the same split using the
kept arc, no slower at every stage. The model is the same with fewer arcs, and the optimum and
bound are those over every choice of mode per stage; with ``none`` alone it is the model above.

The last stage of each network has arcs ending at L only, so a unit of flow that leaves cut
0 reaches L. With ``allow_fewer`` every ``q <= min(len(devices), L)`` gets its own network
(stage ``k``'s memory depends on ``q - k``) and ``y_q`` chooses one; otherwise ``q`` is
``len(devices)``. The model has about ``sum_q q L^2 / 2`` arcs: 10^5 arcs is around ``L =
160, p = 8`` for one network; :func:`build_arcs` refuses more than ``max_arcs`` with the
size in the message (the DP solves any such size exactly and fast).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from partitioner.cluster import Cluster, Device
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError, PartitionerError
from partitioner.profile import Profile
from partitioner.schedule import Schedule
from solvers.pipeline import dp
from solvers.pipeline.dp import ChainSolution
from solvers.pipeline.levers import first_fitting_modes, pick_by_mode, stage_mode
from solvers.result import SolveDetails, SolveResult, SolveStatus

__all__ = [
    "DEFAULT_MAX_ARCS",
    "Arcs",
    "ChainHint",
    "ChainProblem",
    "ChainVars",
    "build_arcs",
    "check_arc_count",
    "check_limits",
    "dp_split",
    "finish",
    "model_arcs",
    "no_plan_reason",
    "pipeline_lengths",
    "prepare",
    "price_arcs",
    "priced_split",
    "setup_model",
    "unsolved",
]

DEFAULT_MAX_ARCS = 200_000


class ChainVars(NamedTuple):
    """A chain model's variables (either backend's objects)."""

    x: list[Any]  # x[a] = 1: arc a (stage k of the q-stage pipeline holds [i, j)) is chosen
    y: dict[int, Any]  # y[q] = 1: the pipeline has q stages
    bottleneck: Any  # B: the bottleneck (in the backend's time unit)


class ChainHint(NamedTuple):
    """A starting split in the model's variables: ``x[a] = a in arcs``, ``y[q] = q == length``."""

    arcs: frozenset[int]
    length: int


@dataclass(frozen=True)
class Arcs:
    """All candidate stages. Arc ``a`` is stage ``k[a]`` of the ``q[a]``-stage pipeline,
    holding layers ``[i[a], j[a])`` on ``devices[k[a]]`` in ``time_s[a]`` seconds, recomputing
    ``modes[mode[a]]`` (the first mode the options allow that fits)."""

    q: np.ndarray
    k: np.ndarray
    i: np.ndarray
    j: np.ndarray
    time_s: np.ndarray
    lengths: tuple[int, ...]  # pipeline lengths modelled
    num_layers: int
    mode: np.ndarray  # index into modes
    modes: tuple[str, ...] = ("none",)  # CostOptions.recompute_modes

    def __post_init__(self) -> None:
        n = len(self.q)
        if not all(len(a) == n for a in (self.k, self.i, self.j, self.time_s, self.mode)):
            raise PartitionerError("interval model: the arc arrays differ in length")
        if n and not (int(self.mode.min()) >= 0 and int(self.mode.max()) < len(self.modes)):
            raise PartitionerError(f"interval model: an arc's recompute mode is not one of {list(self.modes)}")

    def __len__(self) -> int:
        return len(self.q)

    def groups(self) -> dict[tuple[int, int], np.ndarray]:
        """Arc indices of each ``(q, k)`` stage."""
        out: dict[tuple[int, int], list[int]] = {(q, k): [] for q in self.lengths for k in range(q)}
        for a, (q, k) in enumerate(zip(self.q.tolist(), self.k.tolist(), strict=True)):
            out[(q, k)].append(a)
        return {key: np.array(v, dtype=np.intp) for key, v in out.items()}

    def incidence(self) -> tuple[dict[tuple[int, int, int], list[int]], dict[tuple[int, int, int], list[int]]]:
        """Arcs by ``(q, k, cut)``: those of stage ``k`` ending at ``cut``, and those starting there."""
        ending: dict[tuple[int, int, int], list[int]] = {}
        starting: dict[tuple[int, int, int], list[int]] = {}
        for a, (q, k, i, j) in enumerate(zip(self.q.tolist(), self.k.tolist(), self.i.tolist(), self.j.tolist(),
                                                     strict=True)):
            ending.setdefault((q, k, j), []).append(a)
            starting.setdefault((q, k, i), []).append(a)
        return ending, starting

    def index_of(self, sol: ChainSolution) -> list[int]:
        """The arcs making up a known split (a hint or a warm start)."""
        q = len(sol.devices)
        out = []
        for k, (a, b) in enumerate(sol.ranges):
            hit = np.flatnonzero((self.q == q) & (self.k == k) & (self.i == a) & (self.j == b))
            if len(hit) != 1:
                raise PartitionerError(f"split {list(sol.cuts)} is not a path of the interval model")
            out.append(int(hit[0]))
        return out

    def hint(self, sol: ChainSolution) -> ChainHint:
        """A known split (the DP's) as a starting point for a model: its arcs and length."""
        return ChainHint(frozenset(self.index_of(sol)), len(sol.devices))

    def slower_than(self, seconds: float) -> list[int]:
        """Arcs whose stage takes longer than ``seconds`` (the tie-break leaves them out)."""
        return np.flatnonzero(self.time_s > seconds).tolist()

    def solution(self, chosen: Sequence[int], cost: CostModel, devices: Sequence[Device], schedule: Schedule) -> ChainSolution:
        """The split made of the ``chosen`` arcs, priced exactly with the cost model."""
        by_stage = sorted((int(self.k[a]), int(self.i[a]), int(self.j[a]), self.modes[int(self.mode[a])])
                          for a in chosen)
        q = len(by_stage)
        cuts = [0] + [j for _, _, j, _ in by_stage]
        ok = (sorted({int(self.q[a]) for a in chosen}) == [q] and [k for k, _, _, _ in by_stage] == list(range(q))
              and all(by_stage[k][1] == cuts[k] for k in range(q)) and cuts[-1] == self.num_layers)
        if not ok:
            raise PartitionerError(f"the solver returned arcs that do not form a split: {by_stage}")
        return priced_split(cost, cuts, devices[:q], schedule, [m for _, _, _, m in by_stage])


def priced_split(cost: CostModel, cuts: Sequence[int], devices: Sequence[Device], schedule: Schedule,
                 modes: Sequence[str] | None = None) -> ChainSolution:
    """The split ``cuts`` over ``devices`` in order, each stage in its mode of ``modes``, by
    default the first recompute mode the options allow that fits its device
    (:func:`solvers.pipeline.levers.stage_mode`, as the DP and the models choose), priced exactly
    by the cost model of that mode."""
    q = len(devices)
    chosen: list[str] = []
    times: list[float] = []
    for k, (a, b) in enumerate(itertools.pairwise(cuts)):
        dev = devices[k]
        mode = stage_mode(cost, dev, schedule, schedule.activations_in_flight(q - k), a, b) if modes is None \
            else modes[k]
        chosen.append(mode)
        times.append(cost.recomputing(mode).pipeline_stage_time_s(a, b, dev, devices[k - 1] if k > 0 else None,
                                                                   devices[k + 1] if k + 1 < q else None, schedule))
    return ChainSolution(max(times), tuple(int(c) for c in cuts), tuple(devices),
                         () if set(chosen) == {"none"} else tuple(chosen))


def pipeline_lengths(num_devices: int, num_layers: int, allow_fewer: bool) -> tuple[int, ...]:
    """Pipeline lengths a solve considers (the same rule as the DP)."""
    if allow_fewer:
        return tuple(range(1, min(num_devices, num_layers) + 1))
    return (num_devices,) if num_devices <= num_layers else ()


def check_arc_count(total: int, max_arcs: int, model: str, advice: str) -> None:
    """Refuse a model of more than ``max_arcs`` candidate stages, in one line with ``advice``."""
    if total > max_arcs:
        raise PartitionerError(f"the {model} has more than {max_arcs} candidate stages; {advice}, fewer layers "
                               f"(coarsen the profile) or raise max_arcs")


def _time_matrix(cm: CostModel, dev: Device, prev: Device | None, nxt: Device | None, schedule: Schedule,
                 rows: slice) -> np.ndarray:
    return cm.pipeline_stage_time_matrix(dev, prev, nxt, schedule, rows)


def build_arcs(cost: CostModel, devices: Sequence[Device], schedule: Schedule,
               allow_fewer: bool = False, max_arcs: int = DEFAULT_MAX_ARCS,
               max_time_s: float = math.inf) -> Arcs:
    """Every stage that fits its device's memory, for each pipeline length considered.

    Arcs slower than ``max_time_s`` (an upper bound on the optimum, such as a known plan's
    bottleneck) are left out: no optimal split uses them, so the optimum is unchanged.
    """
    n_layers = cost.num_layers
    lengths = pipeline_lengths(len(devices), n_layers, allow_fewer)
    cols = np.arange(n_layers + 1)
    parts: list[tuple[np.ndarray, ...]] = []
    total = 0
    for q in lengths:
        for k in range(q):
            dev = devices[k]
            prev = devices[k - 1] if k > 0 else None
            nxt = devices[k + 1] if k + 1 < q else None
            # stage k starts at i in [lo, hi] and ends at j in [i + 1, L - (q - k - 1)]
            lo, hi = (0, 0) if k == 0 else (k, n_layers - (q - k))
            last_j = n_layers - (q - k - 1)
            rows = slice(lo, hi + 1)
            in_flight = schedule.activations_in_flight(q - k)
            # each stage in the first mode that fits (-1: none does), timed in that mode
            mode = first_fitting_modes(cost, in_flight, schedule, dev.memory_bytes, rows, dev.tensor_parallel)
            t = pick_by_mode(cost, mode, partial(_time_matrix, dev=dev, prev=prev, nxt=nxt, schedule=schedule,
                                                 rows=rows))
            ok = (cols[None, :] > cols[rows, None]) & (cols[None, :] <= last_j)
            if k == q - 1:
                ok &= cols[None, :] == n_layers
            ok &= mode >= 0
            ok &= t <= max_time_s
            ii, jj = np.nonzero(ok)
            total += len(ii)
            check_arc_count(total, max_arcs, f"interval model of {n_layers} layers over {len(devices)} devices",
                            "use the dp solver (exact at any size)")
            parts.append((np.full(len(ii), q), np.full(len(ii), k), ii + lo, jj, t[ii, jj], mode[ii, jj]))
    modes = cost.options.recompute_modes
    if not parts:
        empty = np.zeros(0, dtype=np.intp)
        return Arcs(empty, empty, empty, empty, np.zeros(0), lengths, n_layers, empty, modes)
    q_a, k_a, i_a, j_a, t_a, m_a = (np.concatenate(x) for x in zip(*parts, strict=True))
    return Arcs(q_a.astype(np.intp), k_a.astype(np.intp), i_a.astype(np.intp), j_a.astype(np.intp),
                t_a.astype(np.float64), lengths, n_layers, m_a.astype(np.intp), modes)


# -- the problem and the result, as the DP states and reports them ---------------------------


@dataclass(frozen=True)
class ChainProblem:
    """One pipeline over ordered ``devices``: what every chain solver is given."""

    profile: Profile
    cost: CostModel
    devices: tuple[Device, ...]
    schedule: Schedule
    allow_fewer: bool

    @property
    def tried_devices(self) -> tuple[Device, ...]:
        """The devices an infeasibility diagnosis speaks about (as the DP reports it)."""
        return self.devices[: self.profile.num_layers] if self.allow_fewer else self.devices


def prepare(profile: Profile, cluster: Cluster, devices: Sequence[str] | None, schedule: str,
            micro_batches: int | None, options: CostOptions | None, allow_fewer: bool) -> ChainProblem:
    """Check the common arguments exactly as ``solvers.pipeline.dp.solve`` does and bundle them."""
    cost, devs, sched = dp.chain_arguments(profile, cluster, devices, schedule, micro_batches, options)
    return ChainProblem(profile, cost, devs, sched, allow_fewer)


def check_limits(time_limit_s: float, threads: int, seed: int = 0) -> None:
    """Refuse a non-positive time limit or thread count (CP-SAT and CBC take both)."""
    if not (time_limit_s > 0):
        raise FormatError("time_limit_s", time_limit_s, "must be > 0 seconds")
    if not (isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1):
        raise FormatError("threads", threads, "must be an integer >= 1")
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**31):
        raise FormatError("seed", seed, "must be an integer in [0, 2^31)")


def dp_split(problem: ChainProblem) -> ChainSolution | None:
    """The DP's optimal split of ``problem`` (for hints and warm starts), or None if infeasible."""
    res = dp.solve(problem.profile, problem.cost.cluster, [d.name for d in problem.devices],
                   schedule=problem.schedule.name, micro_batches=problem.schedule.micro_batches,
                   options=problem.cost.options, allow_fewer=problem.allow_fewer)
    if not res.ok or res.plan is None:
        return None
    stages = res.plan.virtual_workers[0].stages
    cuts = (0, *(st.stop for st in stages))
    devs = tuple(problem.cost.cluster.device(st.device) for st in stages)
    modes = tuple(st.recompute for st in stages)
    return ChainSolution(res.objective, cuts, devs, () if set(modes) == {"none"} else modes)


def model_arcs(problem: ChainProblem, hint: bool, prune: bool, max_arcs: int
               ) -> tuple[ChainSolution | None, Arcs, SolveDetails]:
    """What CP-SAT and CBC both build on: the DP's split (with ``hint``), the candidate stages
    (with ``prune``, none slower than that split's bottleneck), and the details to report."""
    start = dp_split(problem) if hint else None
    upper = start.bottleneck_s * (1 + 1e-9) if (start is not None and prune) else math.inf
    arcs = build_arcs(problem.cost, problem.devices, problem.schedule,
                      problem.allow_fewer, max_arcs, upper)
    return start, arcs, {"arcs": len(arcs), "hint": start is not None, "pruned": math.isfinite(upper)}


def setup_model(problem: ChainProblem, method: str, hint: bool, prune: bool, max_arcs: int, t0: float
                ) -> tuple[ChainSolution | None, Arcs, SolveDetails, SolveResult | None]:
    """What both chain models start from (:func:`model_arcs`, the devices' order given), and the
    answer when there is no model to solve: no pipeline length to model (more devices than
    layers, and no shorter pipeline allowed)."""
    start, arcs, details = model_arcs(problem, hint, prune, max_arcs)
    details["mapping"] = "given"
    if arcs.lengths:
        return start, arcs, details, None
    return start, arcs, details, finish(problem, method, SolveStatus.INFEASIBLE, None, math.nan,
                                        time.perf_counter() - t0, details)


def price_arcs(problem: ChainProblem, arcs: Arcs, chosen: Sequence[int]) -> ChainSolution:
    """The split a model chose (its arcs), priced exactly with the cost model."""
    return arcs.solution(chosen, problem.cost, problem.devices, problem.schedule)


def no_plan_reason(time_limit_s: float, n_arcs: int | None = None) -> str:
    """Why a model ended without a plan: the time limit (and the model's size, where known)."""
    size = "" if n_arcs is None else f" ({n_arcs} candidate stages)"
    return f"no plan found within the time limit of {time_limit_s:g} s{size}"


def unsolved(answer: Callable[..., SolveResult], status: SolveStatus, bound_s: float, t0: float,
             details: SolveDetails, reason: str) -> SolveResult | None:
    """The answer when a model's first solve has no plan (INFEASIBLE, or UNKNOWN at the time
    limit, with ``reason``), or None when it has one; the bound goes to ``details["bound_s"]``
    unless infeasible. ``answer(status, plan, lower_bound, runtime_s, details, reason=...)``
    builds a result: the problem's ``finish`` for this problem and method."""
    if status is SolveStatus.INFEASIBLE:
        return answer(SolveStatus.INFEASIBLE, None, math.nan, time.perf_counter() - t0, details)
    details["bound_s"] = bound_s  # as converted, before capping at the plan's objective
    if status is SolveStatus.UNKNOWN:
        return answer(SolveStatus.UNKNOWN, None, bound_s, time.perf_counter() - t0, details, reason=reason)
    return None


def finish(problem: ChainProblem, method: str, status: SolveStatus, sol: ChainSolution | None,
           lower_bound: float, runtime_s: float, details: SolveDetails, reason: str = "") -> SolveResult:
    """A :class:`SolveResult` with the plan built exactly as the DP builds it."""
    if status is SolveStatus.INFEASIBLE:
        reason = reason or dp.diagnose_infeasible(problem.cost, problem.tried_devices, problem.schedule)
        return SolveResult(status, None, runtime_s=runtime_s, method=method, reason=reason, details=details)
    if sol is None:
        return SolveResult(status, None, lower_bound=lower_bound, runtime_s=runtime_s, method=method,
                           reason=reason, details=details)
    plan = dp.plan_from_cuts(problem.profile, problem.cost, sol, problem.schedule,
                             solver_name=method)
    result = SolveResult(status, None, sol.bottleneck_s, min(lower_bound, sol.bottleneck_s), runtime_s,
                         method, reason=reason, details=details)
    return dp._with_plan(result, plan)
