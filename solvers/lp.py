"""Linear programs for the cluster planner, solved with OR-Tools' GLOP (already a dependency).

:func:`linprog` takes dense matrices, as the planner builds them::

    min c.x  s.t.  A_ub x <= b_ub,  A_eq x = b_eq,  lower <= x <= upper

and returns an :class:`LpResult`: ``ok`` when GLOP proved the optimum, then ``x``, the objective
``fun`` and the duals of the ``<=`` rows (``d fun / d b_ub``: non-positive in a minimisation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["LpResult", "linprog"]


@dataclass(frozen=True)
class LpResult:
    ok: bool
    x: np.ndarray
    fun: float
    ub_duals: np.ndarray


def linprog(c: np.ndarray, a_ub: np.ndarray | None = None, b_ub: np.ndarray | None = None,
            a_eq: np.ndarray | None = None, b_eq: np.ndarray | None = None,
            bounds: Sequence[tuple[float, float]] | tuple[float, float] = (0.0, math.inf)) -> LpResult:
    """Solve the LP above (``bounds``: one ``(lower, upper)`` for every variable, or per variable)."""
    from ortools.linear_solver import pywraplp

    c = np.asarray(c, dtype=float)
    n = len(c)
    solver = pywraplp.Solver.CreateSolver("GLOP")
    inf = solver.infinity()
    per = [bounds] * n if isinstance(bounds, tuple) else list(bounds)

    def clip(v: float) -> float:
        return inf if v == math.inf else -inf if v == -math.inf else float(v)

    # Variables: x_j in [lower_j, upper_j].
    x = [solver.NumVar(clip(lo), clip(hi), f"x{j}") for j, (lo, hi) in enumerate(per)]
    # Constraints: a_i . x <= b_i and a_i . x = b_i, row by row (dense rows, zeros skipped).
    rows = []
    for a, b, equal in ((a_ub, b_ub, False), (a_eq, b_eq, True)):
        if a is None or b is None:
            continue
        for row, rhs in zip(np.atleast_2d(np.asarray(a, dtype=float)), np.asarray(b, dtype=float), strict=True):
            ct = solver.Constraint(float(rhs) if equal else -inf, float(rhs))
            for j in np.flatnonzero(row):
                ct.SetCoefficient(x[j], float(row[j]))
            if not equal:
                rows.append(ct)
    # Objective: min c . x.
    obj = solver.Objective()
    for j in np.flatnonzero(c):
        obj.SetCoefficient(x[j], float(c[j]))
    obj.SetMinimization()
    # Solve, extract.
    ok = solver.Solve() == pywraplp.Solver.OPTIMAL
    if not ok:
        return LpResult(False, np.zeros(n), math.nan, np.zeros(len(rows)))
    return LpResult(True, np.array([v.solution_value() for v in x]), float(obj.Value()),
                    np.array([ct.dual_value() for ct in rows]))
