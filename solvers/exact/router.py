"""The solvers named ``cpsat`` and ``milp``: one router over the three pipeline problems, for both
backends.

Both backends hold the same three models under the same file names (``chain``, ``graph``,
``joint`` in ``solvers/exact/cpsat/`` and ``solvers/exact/cbc/``); this module decides which
problem a request is, once:

* a profile with edges (or ``dag=True``): convex stages of its graph, over the devices in the
  given order (:mod:`solvers.exact.graph`);
* devices of more than one label (:func:`solvers.pipeline.mapping.device_labels`) and no
  ``fixed_order``: the device order is decided in the model with the split
  (:mod:`solvers.exact.joint`);
* otherwise the chain split over the devices in order (:mod:`solvers.exact.intervals`).

CP-SAT works on integers: every time is rounded **down** to a whole number of ticks
(``resolution`` ticks in the largest stage time), so its bound, converted back to seconds, is a
valid lower bound; CBC works in floating point with its own tolerances, and its bound is read
from its log (:mod:`solvers.exact.cbc.run`). In both, the plan's objective is recomputed exactly
from the chosen cuts with the cost model.

Activation recomputation (``CostOptions.recompute``: one mode, or ``auto``) is chosen per stage
in all three models, exactly as the chain DP chooses it: each stage in the first mode (cheapest
first) that fits its device, priced in that mode; their bounds are over every choice of mode
per stage. ZeRO (``CostOptions.zero``) shards state over data-parallel holders of a layer; one
pipeline has none, so it changes nothing here.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from partitioner.cluster import Cluster
from partitioner.cost import CostOptions
from partitioner.errors import FormatError
from partitioner.profile import Profile
from solvers.exact.intervals import DEFAULT_MAX_ARCS, check_limits, prepare
from solvers.exact.joint import HINT_SHARE, mapping_details, needs_mapping
from solvers.result import SolveResult

__all__ = ["BACKENDS", "DEFAULT_RESOLUTION", "solve", "solve_cbc", "solve_cpsat"]

# backend name -> the package holding its chain, graph and joint models
BACKENDS = {"cpsat": "solvers.exact.cpsat", "cbc": "solvers.exact.cbc"}
# the name the method carries in results and the CLI (``--solver cpsat|milp``)
_METHOD = {"cpsat": "cpsat", "cbc": "milp"}
DEFAULT_RESOLUTION = 10**7  # CP-SAT: ticks in the largest stage time of the model


def solve(profile: Profile, cluster: Cluster, devices: Sequence[str] | None = None, *, backend: str,
          schedule: str = "1f1b", micro_batches: int | None = None, options: CostOptions | None = None,
          allow_fewer: bool = False, time_limit_s: float = 10.0, threads: int = 1, hint: bool = True,
          prune: bool = True, max_arcs: int = DEFAULT_MAX_ARCS, tie_break: bool = True, seed: int = 0,
          dag: bool | None = None, fixed_order: bool = False, relaxation: bool = True,
          resolution: int | None = None) -> SolveResult:
    """Optimal single-pipeline plan over ``devices`` by ``backend`` (``cpsat`` or ``cbc``), with a
    lower bound.

    ``hint`` runs the DP first and gives its split to the model as a starting solution; with
    ``prune`` as well, stages slower than that split's bottleneck are left out of the model (they
    cannot be in an optimal split). ``threads`` and ``seed``: the backend's workers and random
    seed (a fixed pair gives the same plan unless the time limit cuts the search; for CBC, seed 0
    keeps its defaults). ``tie_break``: once the bottleneck is proven optimal, a second solve
    within the time left picks among the optimal splits the shortest pipeline, then the least
    total stage time, as the DP's second pass does (``details["tie_break"]``).
    ``dag``: plan convex stages of the profile's graph rather than ranges of its layer order; None
    (the default) does so when the profile has edges. ``fixed_order``: split over ``devices`` in
    the given order; without it, on devices of several labels the order is decided in the model
    (``details["mapping"] == "model"``), except on a graph profile, whose convex stages keep the
    given order. ``relaxation``: the joint model's bound from :mod:`solvers.exact.joint_bound`
    (off: the model alone, for an independent check). ``resolution``: CP-SAT's ticks in the
    largest stage time (default :data:`DEFAULT_RESOLUTION`; not a CBC option).
    Other arguments as :func:`solvers.pipeline.dp.solve`.
    """
    if backend not in BACKENDS:
        raise FormatError("backend", backend, f"must be one of {', '.join(BACKENDS)}")
    check_limits(time_limit_s, threads, seed)
    settings: dict[str, Any] = {"time_limit_s": time_limit_s, "threads": threads, "seed": seed,
                                "tie_break": tie_break}
    if backend == "cpsat":
        resolution = DEFAULT_RESOLUTION if resolution is None else resolution
        if not (isinstance(resolution, int) and 10 <= resolution <= 10**12):
            raise FormatError("resolution", resolution, "must be an integer tick count in [10, 1e12]")
        settings["resolution"] = resolution
    elif resolution is not None:
        raise FormatError("solver option", ["resolution"], f"not understood by the {_METHOD[backend]} solver")
    t0 = time.perf_counter()
    settings["t0"] = t0
    problem = prepare(profile, cluster, devices, schedule, micro_batches, options, allow_fewer)
    if dag is not None and not isinstance(dag, bool):
        raise FormatError("dag", dag, "must be true, false or None (None: the graph when the profile has edges)")
    if not isinstance(fixed_order, bool):
        raise FormatError("fixed_order", fixed_order, "must be true or false")
    package = BACKENDS[backend]
    if dag or (dag is None and profile.edges):
        from solvers.exact.graph import dag_data

        graph = importlib.import_module(f"{package}.graph")
        return graph.solve_dag(dag_data(problem, hint), prune=prune, details=mapping_details(problem, fixed_order),
                               **settings)
    if not fixed_order and needs_mapping(problem):
        from solvers.exact.joint import joint_data

        joint = importlib.import_module(f"{package}.joint")
        # the heuristic mapping (the hint) gets at most a quarter of the time limit
        data = joint_data(problem, hint, prune, max_arcs, deadline=t0 + HINT_SHARE * time_limit_s)
        return joint.solve_joint(data, bound_dp=relaxation, **settings)
    chain = importlib.import_module(f"{package}.chain")
    return chain.solve_chain(problem, hint=hint, prune=prune, max_arcs=max_arcs, **settings)


solve_cpsat = partial(solve, backend="cpsat")
solve_cbc = partial(solve, backend="cbc")
