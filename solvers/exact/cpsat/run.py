"""Running CP-SAT for the chain, graph and joint models: the solver, its status in
:class:`~solvers.result.SolveStatus` words, its bound in seconds, and the tie-break's second solve.

Every model counts time in whole *ticks* of ``tick_s`` seconds, rounded down, so CP-SAT's bound
times the tick is a valid lower bound; a hundredth of a tick (:data:`FLOAT_SAFETY_TICKS`) is
taken off it for floating point.
"""

from __future__ import annotations

from typing import Any

from partitioner.errors import PartitionerError
from solvers.progress import solve_cpsat
from solvers.result import SolveDetails, SolveStatus

__all__ = ["FLOAT_SAFETY_TICKS", "bound_s", "cpsat_solver", "run_model", "solve_again", "solve_status"]

FLOAT_SAFETY_TICKS = 0.01


def cpsat_solver(time_limit_s: float, threads: int, seed: int) -> Any:
    """A CP-SAT solver with the limits checked by :func:`solvers.exact.intervals.check_limits`.
    Several workers run in a fixed interleaved order: the same seed and workers give the same
    search, so the same plan (for a run that ends before its time limit)."""
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.num_workers = threads
    solver.parameters.random_seed = seed
    solver.parameters.interleave_search = threads > 1
    return solver


def run_model(model: Any, label: str, tick_s: float, time_limit_s: float, threads: int, seed: int,
              details: SolveDetails) -> tuple[Any, int]:
    """Solve ``model`` (its progress shown under ``label``); the solver and its status code, with
    CP-SAT's status, wall time and branches recorded in ``details``."""
    solver = cpsat_solver(time_limit_s, threads, seed)
    code = solve_cpsat(solver, model, label, tick_s)
    details.update({"cpsat_status": solver.status_name(code), "cpsat_wall_s": solver.wall_time,
                    "branches": solver.num_branches})
    return solver, code


def solve_status(code: int, model: Any, refuse_invalid: str | None) -> SolveStatus:
    """CP-SAT's status code as a :class:`SolveStatus` (UNKNOWN: no plan within the time limit).
    An invalid model raises, naming ``refuse_invalid`` (``None``: it counts as UNKNOWN)."""
    from ortools.sat.python import cp_model

    if code == cp_model.MODEL_INVALID and refuse_invalid is not None:
        raise PartitionerError(f"CP-SAT rejected {refuse_invalid}: {model.validate()}")
    if code == cp_model.INFEASIBLE:
        return SolveStatus.INFEASIBLE
    if code == cp_model.OPTIMAL:
        return SolveStatus.OPTIMAL
    return SolveStatus.FEASIBLE if code == cp_model.FEASIBLE else SolveStatus.UNKNOWN


def bound_s(solver: Any, tick_s: float) -> float:
    """CP-SAT's bound in seconds: ticks less :data:`FLOAT_SAFETY_TICKS`, times the tick, at least 0."""
    return max(0.0, (solver.best_objective_bound - FLOAT_SAFETY_TICKS) * tick_s)


def solve_again(solver: Any, model: Any, time_limit_s: float, details: SolveDetails) -> bool:
    """The tie-break's second solve of the changed ``model`` within ``time_limit_s`` (its status
    in ``details["tie_break"]``); whether it found a plan."""
    from ortools.sat.python import cp_model

    solver.parameters.max_time_in_seconds = float(time_limit_s)
    code = solver.solve(model)
    details["tie_break"] = solver.status_name(code)
    return code in (cp_model.OPTIMAL, cp_model.FEASIBLE)
