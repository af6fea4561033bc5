"""Solvers: one front door, :func:`solve`, returning one result type, :class:`SolveResult`.

Backends are imported only when asked for, so using the DP never loads OR-Tools or PuLP.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from partitioner.cluster import Cluster
from partitioner.errors import FormatError
from partitioner.profile import Profile
from solvers.result import SolveResult, SolveStatus

__all__ = ["SOLVERS", "SolveResult", "SolveStatus", "solve"]

# name the user types -> "module:function"; every function takes (profile, cluster, **options)
SOLVERS: dict[str, str] = {
    "dp": "solvers.pipeline.router:solve",
    "hetero": "solvers.cluster.planner:solve",
    "uniform": "solvers.baselines:solve_uniform",
    "parameters": "solvers.baselines:solve_parameters",
    "blockpartition": "solvers.baselines:solve_blockpartition",
    "pipedream": "solvers.baselines:solve_pipedream",
    "cpsat": "solvers.exact.router:solve_cpsat",
    "milp": "solvers.exact.router:solve_cbc",
}


def solve(profile: Profile, cluster: Cluster, solver: str = "dp", **options: Any) -> SolveResult:
    """Plan ``profile`` on ``cluster`` with the named solver.

    Common options: ``devices`` (ordered device names), ``schedule``, ``micro_batches``,
    ``options`` (:class:`partitioner.cost.CostOptions`). An infeasible problem is returned
    as ``SolveStatus.INFEASIBLE`` with ``reason``; it does not raise.
    """
    if solver not in SOLVERS:
        raise FormatError("solver", solver, f"must be one of {', '.join(SOLVERS)}")
    module_name, func_name = SOLVERS[solver].split(":")
    backend = getattr(importlib.import_module(module_name), func_name)
    params = inspect.signature(backend).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - {n for n, p in params.items() if p.kind is not inspect.Parameter.POSITIONAL_ONLY})
        if unknown:
            raise FormatError("solver option", unknown, f"not understood by the {solver} solver")
    result: SolveResult = backend(profile, cluster, **options)
    return result
