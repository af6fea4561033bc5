"""Running CBC through PuLP with its log kept, reading CBC's bound from that log, and CBC's
status in :class:`~solvers.result.SolveStatus` words.

PuLP returns CBC's status and variable values but no bound, and reports a run stopped at its
time limit with a plan as ``LpStatusOptimal`` (only ``sol_status`` tells it apart). The bound
is read from CBC's own log: ``Lower bound`` of a stopped run, else ``Objective value`` of a
finished one, else NaN. It is CBC's, in floating point with CBC's tolerances, so it is reported
less :data:`TOLERANCE_SLACK` of the largest time the model holds.
"""

from __future__ import annotations

import logging
import math
import os
import re
import tempfile
import warnings
from typing import Any

from partitioner.errors import PartitionerError
from solvers.progress import status
from solvers.result import SolveDetails, SolveStatus

__all__ = ["CBC_FAILED", "TOLERANCE_SLACK", "bound_s", "cbc_bound", "cbc_failed_or", "has_plan", "run_cbc",
           "run_first", "seed_options", "solve_again", "solve_status"]

log = logging.getLogger(__name__)

TOLERANCE_SLACK = 1e-6  # of the largest time a model holds, taken off CBC's bound

CBC_FAILED = ("CBC exited with an error before giving a plan (it can when its time limit cuts a warm-started "
              "search short); try another time limit or the cpsat solver")

_BOUND = re.compile(r"^(Objective value|Lower bound):\s+(\S+)", re.MULTILINE)


def cbc_bound(log_text: str) -> float:
    """CBC's lower bound from its log: the ``Lower bound`` line of a stopped run, else the
    ``Objective value`` of a finished one, else NaN."""
    found = dict(_BOUND.findall(log_text))
    for key in ("Lower bound", "Objective value"):
        try:
            return float(found[key])
        except (KeyError, ValueError):
            continue
    return math.nan


def seed_options(seed: int) -> list[str]:
    """CBC's seeds (its own and the LP solver's) from one number."""
    return [f"randomCbcSeed {seed}", f"randomSeed {seed}"] if seed else []


def run_cbc(prob: Any, time_limit_s: float, threads: int, seed: int, warm_start: bool, keep_log: bool = True) -> str:
    """Solve ``prob`` (a PuLP problem) with CBC; return CBC's log (empty without ``keep_log``)."""
    import pulp

    log_path = None
    if keep_log:
        fd, log_path = tempfile.mkstemp(prefix="cbc-", suffix=".log")
        os.close(fd)
    try:
        with warnings.catch_warnings():  # PuLP 3 flags the CBC it bundles as going away in PuLP 4
            warnings.simplefilter("ignore", DeprecationWarning)
            cmd = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, threads=threads, warmStart=warm_start,
                                    logPath=log_path, options=seed_options(seed))
        with status("cbc"):
            prob.solve(cmd)
        if log_path is None:
            return ""
        with open(log_path, encoding="utf-8", errors="replace") as f:
            return f.read()
    finally:
        if log_path is not None:
            os.unlink(log_path)


def run_first(prob: Any, time_limit_s: float, threads: int, seed: int, warm_start: bool,
              details: SolveDetails) -> str:
    """A model's first solve (:func:`run_cbc`). Where CBC itself fails (PuLP raises
    ``PulpSolverError`` when CBC exits with an error) the model is left unsolved, as a time limit
    with no plan leaves it: the solve answers UNKNOWN, or its hint where the model returns one
    (joint, graph); ``details["cbc_failed"]`` keeps PuLP's message and :func:`cbc_failed_or`
    gives :data:`CBC_FAILED` as the reason. Returns CBC's log ("" if it failed)."""
    import pulp

    try:
        return run_cbc(prob, time_limit_s, threads, seed, warm_start)
    except pulp.PulpSolverError as err:
        log.warning("CBC failed (%s); the model is left unsolved", err)
        details["cbc_failed"] = str(err)
        prob.assignStatus(pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound)
        return ""


def cbc_failed_or(details: SolveDetails, otherwise: str) -> str:
    """Why a first solve has no plan: :data:`CBC_FAILED` where CBC failed, else ``otherwise``."""
    return CBC_FAILED if "cbc_failed" in details else otherwise


def solve_again(prob: Any, time_limit_s: float, threads: int, seed: int, details: SolveDetails) -> bool:
    """The tie-break's second solve, warm-started from the first solve's plan: whether CBC gave a
    plan (its status in ``details["tie_break"]``). CBC itself may crash on a warm-started solve
    cut short by its time limit; the first solve's proven plan then stands."""
    import pulp

    try:
        run_cbc(prob, time_limit_s, threads, seed, warm_start=True, keep_log=False)
    except pulp.PulpSolverError as err:
        log.warning("CBC failed in the tie-break (%s); the first solve's plan stands", err)
        details["tie_break"] = "CBC failed"
        return False
    details["tie_break"] = pulp.LpStatus[prob.status]
    return has_plan(prob)


def bound_s(log_text: str, unit_s: float, largest_s: float) -> float:
    """CBC's bound from its log, converted from model units of ``unit_s`` seconds to seconds, less
    :data:`TOLERANCE_SLACK` of ``largest_s`` (at least 0; NaN where the log has none)."""
    raw = cbc_bound(log_text)
    return max(0.0, raw * unit_s - TOLERANCE_SLACK * largest_s) if math.isfinite(raw) else math.nan


def solve_status(prob: Any, bound: float, refuse_odd: str | None) -> SolveStatus:
    """CBC's answer to ``prob`` as a :class:`SolveStatus`: OPTIMAL only with a proof and a bound,
    UNKNOWN without a plan. A run without a plan that neither stopped nor finished raises,
    naming ``refuse_odd`` (``None``: it counts as UNKNOWN)."""
    import pulp

    if prob.status == pulp.LpStatusInfeasible:
        return SolveStatus.INFEASIBLE
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        if refuse_odd is not None and prob.status not in (pulp.LpStatusNotSolved, pulp.LpStatusOptimal):
            raise PartitionerError(f"CBC ended with status {pulp.LpStatus[prob.status]} on {refuse_odd}")
        return SolveStatus.UNKNOWN
    proven = prob.sol_status == pulp.LpSolutionOptimal and math.isfinite(bound)
    return SolveStatus.OPTIMAL if proven else SolveStatus.FEASIBLE


def has_plan(prob: Any) -> bool:
    """Whether CBC's last run of ``prob`` left a plan (proven or not)."""
    import pulp

    return prob.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
