"""Running CBC through PuLP with its log kept, and reading CBC's bound from that log.

PuLP returns CBC's status and variable values but no bound, and reports a run stopped at its
time limit with a plan as ``LpStatusOptimal`` (only ``sol_status`` tells it apart). The bound
is read from CBC's own log: ``Lower bound`` of a stopped run, else ``Objective value`` of a
finished one, else NaN.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import warnings
from typing import Any

from solvers.progress import status

__all__ = ["cbc_bound", "run_cbc", "seed_options"]

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
