"""Linear programs for the cluster planner, solved with HiGHS (through SciPy).

:func:`linprog` takes dense matrices, as the planner builds them::

    min c.x  s.t.  A_ub x <= b_ub,  A_eq x = b_eq,  lower <= x <= upper

and returns an :class:`LpResult`: ``status`` ``optimal``, ``infeasible``, ``unbounded`` or
``failed`` (the solver gave up: a caller that needs a valid bound must not read it as
infeasible); when optimal, ``x``, the objective ``fun`` and the duals of the ``<=`` rows
(``d fun / d b_ub``: non-positive in a minimisation).

Why SciPy's HiGHS and not OR-Tools' GLOP, which the project has anyway: the planner's bound is
only valid at the LP's true optimum. On 300 random LPs of the planner's dual shape with rows
spread over 10 orders of magnitude (memory bytes beside GPU counts), of the 265 whose primal is
bounded GLOP (rows scaled) reported 47 as optimal at a wrong objective, down to a third of the
true one; HiGHS got all 265 right. On the fleet bound's own LP, GLOP without row scaling gave
up (ABNORMAL) where HiGHS solved it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["LpResult", "linprog"]


@dataclass(frozen=True)
class LpResult:
    status: str
    x: np.ndarray
    fun: float
    ub_duals: np.ndarray

    @property
    def ok(self) -> bool:
        return self.status == "optimal"


def linprog(c: np.ndarray, a_ub: Any = None, b_ub: np.ndarray | None = None,
            a_eq: Any = None, b_eq: np.ndarray | None = None,
            bounds: Sequence[tuple[float, float]] | tuple[float, float] = (0.0, math.inf),
            method: str = "highs") -> LpResult:
    """Solve the LP above (``a_ub``, ``a_eq``: dense arrays or SciPy sparse matrices; ``bounds``: one
    ``(lower, upper)`` for every variable, or per variable;
    ``method``: ``highs``, or ``highs-ds`` (dual simplex) for an LP with few rows)."""
    from scipy.optimize import linprog as highs

    c = np.asarray(c, dtype=float)
    res = highs(c, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=bounds, method=method)
    status = {0: "optimal", 2: "infeasible", 3: "unbounded"}.get(res.status, "failed")
    rows = 0 if a_ub is None else int(a_ub.shape[0] if hasattr(a_ub, "tocsr") else np.atleast_2d(a_ub).shape[0])
    if status != "optimal":
        return LpResult(status, np.zeros(len(c)), math.nan, np.zeros(rows))
    duals = np.asarray(res.ineqlin.marginals, dtype=float) if rows else np.zeros(0)
    return LpResult(status, np.asarray(res.x, dtype=float), float(res.fun), duals)
