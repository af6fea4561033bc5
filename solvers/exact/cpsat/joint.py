"""Joint device mapping and split of one pipeline as a CP-SAT model (data: :mod:`solvers.exact.joint`).

Positions ``r`` count from the end (``r = 0``: the last stage). Variables:

    x[a]      arc a = (r, t, i, j) chosen: position r runs on GPU type t and holds [i, j)
              (its work in the first recompute mode the options allow that fits: joint.py)
    u[r, g]   position r runs on label g (a (node, gpu type) group of interchangeable GPUs)
    v[r, c]   the link between positions r + 1 and r is of class c (r + 1 exists)
    s[r]      ticks of the message at the cut where position r starts (its ``back``, and
              the ``out`` of position r + 1); T[r] stage r's ticks; B the bottleneck

Constraints (one line of maths per group):

    sum_{a: i=0} x[a] = 1                                              the pipeline starts at layer 0
    sum_{a in (r+1, *, *, c)} x[a] = sum_{a in (r, *, c, *)} x[a]     r < R-1, 0 < c < L (flow)
    sum_{a in (r, t)} x[a] = sum_{g of type t} u[r, g]                 the arc's type is the label's
    sum_r u[r, g] = n_g   (<= n_g with allow_fewer)                    every GPU used once
    sum_c v[r, c] = sum_g u[r+1, g]                                    one link class per adjacent pair
    v[r, c] >= u[r+1, g] + sum_{h: class(g, h) = c} u[r, h] - 1        the class the labels make
    s[r] >= sum_{a in (r, *, i>0, *)} tick(msg_c[i]) x[a]   if v[r, c]  the message on that link
    s[r] >= sum_{a in (r, *, i>0, *)} tick(min_c msg_c[i]) x[a]         (redundant: the cheapest link)
    T[r] >= sum_{a in r} tick(work[a]) x[a] + s[r] + s[r-1]            additive (overlap: one row each,
                                                                       the transfers plus the wave sync)
    B >= T[r];  first use of node N_k before N_{k+1} for interchangeable nodes
    B >= floor(LB / tick) - rounding        LB: the type-count DP relaxation (solvers/exact/joint_bound.py)
    minimise B;   then  B <= B*, minimise W * stages + sum_r T[r]   (tie-break, as the chain models)

Search: a decision strategy on the labels in pipeline order (first stage first, CP-SAT's
``add_decision_strategy``), which CP-SAT's workers follow where they use fixed strategies.

Every time is rounded **down** to ticks (``tick = largest arc time / resolution``), term by
term, so every real plan costs at least its model value: CP-SAT's bound times the tick (less a
hundredth of a tick) is a valid lower bound over every order and split. The model prices the
realised plan within ``details["rounding_ticks"]`` ticks below the cost model (one per rounded
term of a stage); the plan's objective is always the cost model's, recomputed.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from functools import partial
from typing import Any, NamedTuple

import numpy as np

from solvers.exact import joint
from solvers.exact.cpsat.run import bound_s, run_model, solve_again, solve_status
from solvers.exact.intervals import no_plan_reason, unsolved
from solvers.exact.joint import JointData, JointPlan, JointVars
from solvers.exact.joint_bound import before_model, relaxed_floor
from solvers.result import SolveDetails, SolveResult, SolveStatus

__all__ = ["solve_joint"]

log = logging.getLogger(__name__)


def _ticks(values: np.ndarray, tick_s: float) -> list[int]:
    """``values`` (seconds) in whole ticks, rounded down."""
    return [int(v) for v in np.floor(np.asarray(values) / tick_s).astype(np.int64)]


class _Ticks(NamedTuple):
    """The data's times in ticks, rounded down."""

    tick_s: float
    work: list[int]  # per arc: compute + wave sync
    wave: list[int]  # per arc: the wave sync
    msg: list[list[int]]  # per link class and cut
    cheapest: list[int]  # per cut: the cheapest class's message
    top: int  # no stage takes more (the integer variables' upper bound)
    rounding: int  # rounded terms in a stage's time


def solve_joint(data: JointData, *, time_limit_s: float, threads: int, seed: int, resolution: int,
                tie_break: bool, t0: float, symmetry: bool = True, bound_dp: bool = True) -> SolveResult:
    """Order and split by CP-SAT; OPTIMAL means optimal over every order and split (to a tick)."""
    from ortools.sat.python import cp_model

    data, relaxed, done = before_model(data, "cpsat", bound_dp, time_limit_s, t0)
    if done is not None:
        return done
    tk = _in_ticks(data, resolution)
    details: SolveDetails = {"tick_s": tk.tick_s, "rounding_ticks": tk.rounding}

    model = cp_model.CpModel()
    var = _variables(model, data, tk.top)
    _constraints(model, data, var, tk)
    _cuts(model, data, var, tk, relaxed, symmetry)
    model.minimize(var.bottleneck)  # objective: minimise B
    # search the order first, from the first stage on (the split then follows by propagation):
    # on ResNet-152 over the HetPipe cluster this found the optimum, which the default search did not
    model.add_decision_strategy([var.u[r][g] for r in reversed(range(data.positions)) for g in range(len(data.labels))],
                                cp_model.CHOOSE_FIRST, cp_model.SELECT_MAX_VALUE)
    if data.start is not None:
        _hint(model, data, data.start, var)

    solver, code = run_model(model, "cpsat", tk.tick_s, joint.model_time_s(time_limit_s, t0), threads, seed, details)
    status = solve_status(code, model, "the joint model")
    # CP-SAT's bound, or the relaxation's where CP-SAT has not reached it yet (both are valid)
    bound = max(bound_s(solver, tk.tick_s), relaxed_floor(relaxed))
    answer = partial(joint.finish_joint, data, "cpsat")
    if (done := unsolved(answer, status, bound, t0, details, no_plan_reason(time_limit_s))) is not None:
        return done
    found = joint.read_plan(data, var, solver.boolean_value)
    details["model_objective_s"] = _model_value(data, found, tk) * tk.tick_s
    remaining = time_limit_s - (time.perf_counter() - t0)
    if status is SolveStatus.OPTIMAL and tie_break and remaining > 0:
        found = _tie_break(model, solver, data, var, tk, found, remaining, details)
    log.debug("joint cpsat: %s, %d arcs, objective %.6g s, bound %.6g s", status, len(data.r),
              found.solution.bottleneck_s, bound)
    return answer(status, found, bound, time.perf_counter() - t0, details)


def _in_ticks(data: JointData, resolution: int) -> _Ticks:
    """The tick (the largest time over ``resolution``) and the data's times in it."""
    largest = data.largest_time_s()
    tick_s = largest / resolution if largest > 0 else 1.0
    work = _ticks(data.work_s, tick_s)
    msg = [_ticks(row, tick_s) for row in data.class_s]
    top = max(work) + 2 * max((max(m) for m in msg), default=0) + 1
    return _Ticks(tick_s, work, _ticks(data.wave_s, tick_s), msg, _ticks(data.cheapest_s(), tick_s), top,
                  2 if data.overlap else 3)


def _variables(model: Any, data: JointData, top: int) -> JointVars:
    """x, u, v booleans; s, T and B integers in [0, ``top``] ticks."""
    positions, n_lab, n_cls = data.positions, len(data.labels), len(data.class_s)
    x = [model.new_bool_var(f"x{a}") for a in range(len(data.r))]
    u = [[model.new_bool_var(f"u{r}_{g}") for g in range(n_lab)] for r in range(positions)]
    v = [[model.new_bool_var(f"v{r}_{c}") for c in range(n_cls)] for r in range(positions - 1)]
    s = [model.new_int_var(0, top, f"s{r}") for r in range(positions - 1)]
    t_stage = [model.new_int_var(0, top, f"T{r}") for r in range(positions)]
    return JointVars(x, u, v, s, t_stage, model.new_int_var(0, top, "B"))


def _constraints(model: Any, data: JointData, var: JointVars, tk: _Ticks) -> None:
    """Flow, labels, link classes, messages and stage times (the module docstring's rows)."""
    by_r = data.by_position()
    _flow(model, data, var, by_r)
    _labels(model, data, var, by_r)
    _link_classes(model, data, var)
    _messages(model, data, var, tk, by_r)
    _stage_times(model, data, var, tk, by_r)


def _flow(model: Any, data: JointData, var: JointVars, by_r: list[list[int]]) -> None:
    """sum_{a: i=0} x[a] = 1 (the pipeline starts at layer 0);
    sum_{a in (r+1, *, *, c)} x[a] = sum_{a in (r, *, c, *)} x[a] (flow through the positions)."""
    from ortools.sat.python import cp_model

    lin, x = cp_model.LinearExpr, var.x
    model.add_exactly_one([x[a] for a in range(len(x)) if data.i[a] == 0])
    for r in range(data.positions - 1):
        for c in range(1, data.num_layers):
            ins = [x[a] for a in by_r[r + 1] if data.j[a] == c]
            outs = [x[a] for a in by_r[r] if data.i[a] == c]
            if ins or outs:
                model.add(lin.sum(ins) == lin.sum(outs))


def _labels(model: Any, data: JointData, var: JointVars, by_r: list[list[int]]) -> None:
    """sum_{a in (r, t)} x[a] = sum_{g of type t} u[r, g] (the arc's type is the position's label's);
    sum_r u[r, g] = n_g, or <= n_g with allow_fewer (every label used as often as it has GPUs)."""
    from ortools.sat.python import cp_model

    lin, x, u, n_lab = cp_model.LinearExpr, var.x, var.u, len(data.labels)
    for r in range(data.positions):
        for t in range(len(data.type_names)):
            arcs_t = [x[a] for a in by_r[r] if data.gpu[a] == t]
            labs = [u[r][g] for g in range(n_lab) if data.types[g] == data.type_names[t]]
            model.add(lin.sum(arcs_t) == lin.sum(labs))
    for g in range(n_lab):
        used = lin.sum([u[r][g] for r in range(data.positions)])
        if data.problem.allow_fewer:
            model.add(used <= data.counts[g])
        else:
            model.add(used == data.counts[g])


def _link_classes(model: Any, data: JointData, var: JointVars) -> None:
    """sum_c v[r, c] = sum_g u[r+1, g] (one link class per adjacent pair);
    v[r, c] >= u[r+1, g] + sum_{h: class(g, h) = c} u[r, h] - 1 (the class its labels make)."""
    from ortools.sat.python import cp_model

    lin, u, v, n_lab = cp_model.LinearExpr, var.u, var.v, len(data.labels)
    for r in range(data.positions - 1):
        model.add(lin.sum(v[r]) == lin.sum(u[r + 1]))
        for g in range(n_lab):
            for c in range(len(data.class_s)):
                hs = [u[r][h] for h in range(n_lab) if data.pair_class[g, h] == c]
                if hs:
                    model.add(v[r][c] >= u[r + 1][g] + lin.sum(hs) - 1)


def _messages(model: Any, data: JointData, var: JointVars, tk: _Ticks, by_r: list[list[int]]) -> None:
    """s[r] >= sum_{a in (r, *, i>0, *)} tick(msg_c[i]) x[a] if v[r, c] (the message on its link);
    s[r] >= sum_{a in (r, *, i>0, *)} tick(min_c msg_c[i]) x[a] (redundant: the cheapest link)."""
    from ortools.sat.python import cp_model

    lin, s = cp_model.LinearExpr, var.s
    for r in range(data.positions - 1):
        inner = [a for a in by_r[r] if data.i[a] > 0]
        xs = [var.x[a] for a in inner]
        for c in range(len(data.class_s)):
            model.add(s[r] >= lin.weighted_sum(xs, [tk.msg[c][data.i[a]] for a in inner])).only_enforce_if(var.v[r][c])
        model.add(s[r] >= lin.weighted_sum(xs, [tk.cheapest[data.i[a]] for a in inner]))


def _stage_times(model: Any, data: JointData, var: JointVars, tk: _Ticks, by_r: list[list[int]]) -> None:
    """T[r] >= sum_{a in r} tick(work[a]) x[a] + s[r] + s[r-1] (additive; overlapped: one row
    each, the transfers plus the wave sync); B >= T[r]."""
    from ortools.sat.python import cp_model

    lin, s, t_stage, positions = cp_model.LinearExpr, var.s, var.t_stage, data.positions
    for r in range(positions):
        xs = [var.x[a] for a in by_r[r]]
        links = ([s[r]] if r < positions - 1 else []) + ([s[r - 1]] if r > 0 else [])
        if data.overlap:
            model.add(t_stage[r] >= lin.weighted_sum(xs, [tk.work[a] for a in by_r[r]]))
            waves = lin.weighted_sum(xs, [tk.wave[a] for a in by_r[r]])
            for link in links:
                model.add(t_stage[r] >= waves + link)
        else:
            model.add(t_stage[r] >= lin.weighted_sum(xs, [tk.work[a] for a in by_r[r]]) + lin.sum(links))
        model.add(var.bottleneck >= t_stage[r])


def _cuts(model: Any, data: JointData, var: JointVars, tk: _Ticks, relaxed: float, symmetry: bool) -> None:
    """Rows no plan violates, for the relaxation: the stages of type t do at most n_t * B of work,
    all stage times add up to at most p * B (additive), B >= floor(LB / tick) - rounding (LB: the
    type-count DP of solvers/exact/joint_bound.py); and first use of node N_k before N_{k+1} for
    interchangeable nodes (positions from the end: a later node used at r needs the earlier one
    used at some r' > r)."""
    from ortools.sat.python import cp_model

    lin, x, u = cp_model.LinearExpr, var.x, var.u
    for t, name in enumerate(data.type_names):
        sel = [a for a in range(len(x)) if data.gpu[a] == t]
        model.add(lin.weighted_sum([x[a] for a in sel], [tk.work[a] for a in sel])
                  <= data.gpus_of_type(name) * var.bottleneck)
    if not data.overlap:
        model.add(lin.sum(var.t_stage) <= sum(data.counts) * var.bottleneck)
    if math.isfinite(relaxed) and relaxed > 0:
        model.add(var.bottleneck >= max(0, math.floor(relaxed / tk.tick_s) - tk.rounding - 1))
    if symmetry:
        for _late, e_labs, l_labs in joint.symmetric_pairs(data):
            for r in range(data.positions):
                before = [u[rr][g] for rr in range(r + 1, data.positions) for g in e_labs]
                model.add(lin.sum([u[r][g] for g in l_labs]) <= lin.sum(before))


def _hint(model: Any, data: JointData, plan: JointPlan, var: JointVars) -> None:
    """``plan`` as CP-SAT's solution hint (arcs, labels, link classes)."""
    for v, value in joint.start_values(data, plan, var):
        model.add_hint(v, value)


def _tie_break(model: Any, solver: Any, data: JointData, var: JointVars, tk: _Ticks, found: JointPlan,
               time_limit_s: float, details: SolveDetails) -> JointPlan:
    """Second solve: stages within the optimum's ticks (B <= B*), the shortest pipeline, then the
    least total stage time (minimise W * sum u + sum T); its answer where its bottleneck is no worse."""
    from ortools.sat.python import cp_model

    lin = cp_model.LinearExpr
    model.add(var.bottleneck <= int(solver.objective_value))
    weight = data.positions * (tk.top + 1) + 1
    model.minimize(weight * lin.sum([var.u[r][g] for r in range(data.positions) for g in range(len(data.labels))])
                   + lin.sum(var.t_stage))
    model.clear_hints()
    _hint(model, data, found, var)
    if not solve_again(solver, model, time_limit_s, details):
        return found
    again = joint.read_plan(data, var, solver.boolean_value)
    if again.solution.bottleneck_s > found.solution.bottleneck_s:
        return found
    details["model_objective_s"] = _model_value(data, again, tk) * tk.tick_s
    return again


def _model_value(data: JointData, plan: JointPlan, tk: _Ticks) -> int:
    """The model's bottleneck (ticks) for ``plan``: the rounded terms, added as the model does."""
    labs = data.label_index(plan)
    q = len(labs)
    worst = 0
    for k, ((a, b), hit) in enumerate(zip(itertools.pairwise(plan.cuts), data.plan_arcs(plan), strict=True)):
        arc = int(hit[0])
        back = tk.msg[data.pair_class[labs[k - 1], labs[k]]][a] if k else 0
        out = tk.msg[data.pair_class[labs[k], labs[k + 1]]][b] if k + 1 < q else 0
        stage = max(tk.work[arc], tk.wave[arc] + back, tk.wave[arc] + out) if data.overlap \
            else tk.work[arc] + back + out
        worst = max(worst, stage)
    return worst
