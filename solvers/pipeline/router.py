"""The solver named ``dp``: one pipeline over ordered devices, whatever the schedule asks.

A one-chunk schedule and one micro-batch count is the exact chain DP (:func:`solvers.pipeline.dp.solve`);
a multi-chunk schedule (interleaved, bfs) or ``chunks`` plans ``chunks`` model chunks per device
(:func:`solvers.pipeline.chunked.solve_chunked`); ``schedule="auto"`` or a list of counts solves every
combination with the DP and keeps the plan with the most simulated samples/s
(:func:`solvers.pipeline.ranking.solve_ranked`). The routing lives here, above the three, so that the DP
imports neither of the modules built on it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

from partitioner.cluster import GIB, Cluster
from partitioner.cost import CostOptions
from partitioner.errors import FormatError
from partitioner.profile import Profile
from partitioner.schedule import spec
from solvers.pipeline import dp
from solvers.pipeline.chunked import solve_chunked
from solvers.pipeline.downsets import solve_graph
from solvers.pipeline.ranking import AUTO_SCHEDULES, solve_ranked
from solvers.result import SolveResult, SolveStatus

__all__ = ["solve"]


def solve(profile: Profile, cluster: Cluster, devices: Sequence[str] | None = None, *,
          schedule: str = "1f1b", micro_batches: int | Sequence[int] | None = None, options: CostOptions | None = None,
          allow_fewer: bool = False, chunks: int | str | None = None, dag: bool | None = None) -> SolveResult:
    """Optimal single-pipeline plan over ``devices`` (default: every device of the cluster, in order).

    On a profile with ``edges`` (a DAG) the stages are convex stages of the graph, planned
    exactly by the DP over its down-sets (:mod:`solvers.pipeline.downsets`); ``dag=False`` plans
    ranges of the profile's layer order instead (the chain), as multi-chunk schedules always do
    (with a note). ``dag=None`` (the default): the graph wherever the profile has edges.

    ``micro_batches`` defaults to the number of devices. With ``allow_fewer``, the first ``q``
    devices for every ``q <= len(devices)`` are tried and the best pipeline wins (the shortest
    one on ties). ``schedule="auto"`` (gpipe, 1f1b, 2bw) and/or a list of ``micro_batches``
    solve every combination and keep the plan with the most simulated samples/s
    (:func:`solvers.pipeline.ranking.solve_ranked`; the candidates are in ``details["ranking"]``).
    A multi-chunk schedule (interleaved, bfs) or ``chunks`` (an integer or ``"auto"``) plans
    ``chunks`` model chunks per device (:func:`solvers.pipeline.chunked.solve_chunked`).
    """
    if chunks is not None or (schedule != "auto" and spec(schedule).multi_chunk):
        if allow_fewer:
            raise FormatError("allow_fewer", True, f"not supported with the multi-chunk schedule {schedule}; "
                              f"name the devices to use instead")
        if not (micro_batches is None or isinstance(micro_batches, int)):
            raise FormatError("micro_batches", micro_batches, f"one count under {schedule}")
        return _chain_noted(solve_chunked(profile, cluster, devices, schedule=schedule, chunks=chunks or "auto",
                                          micro_batches=micro_batches, options=options), profile, dag)
    _check_dag(dag)
    if schedule == "auto" or not (micro_batches is None or isinstance(micro_batches, int)):
        n_devs = len(devices) if devices is not None else len(cluster.devices)
        counts = [micro_batches or n_devs] if micro_batches is None or isinstance(micro_batches, int) \
            else list(micro_batches)
        return solve_ranked(
            partial(_solve_one, dag=dag), profile, cluster, AUTO_SCHEDULES if schedule == "auto" else (schedule,), counts,
            devices=devices, options=options, allow_fewer=allow_fewer)
    return _solve_one(profile, cluster, devices, schedule=schedule, micro_batches=micro_batches, options=options,
                      allow_fewer=allow_fewer, dag=dag)


def _check_dag(dag: bool | None) -> None:
    if dag is not None and not isinstance(dag, bool):
        raise FormatError("dag", dag, "must be true, false or None (None: the graph when the profile has edges)")


def _chain_noted(res: SolveResult, profile: Profile, dag: bool | None) -> SolveResult:
    """A multi-chunk plan of a graph profile splits its layer order: said in a note."""
    if not profile.edges or dag is False:
        return res
    note = ("note: multi-chunk schedules split the profile's layer order (its chain), not convex stages of its "
            "graph; `chain_order` says so and silences this note")
    return replace(res, details={**res.details, "messages": [*res.details.get("messages", ()), note]})


def _solve_one(profile: Profile, cluster: Cluster, devices: Sequence[str] | None = None, *, schedule: str,
               micro_batches: int | None, options: CostOptions | None, allow_fewer: bool,
               dag: bool | None = None) -> SolveResult:
    """One schedule and count: the chain DP, or for ZB-V (fixed chunks) the multi-chunk DP. A
    zero-bubble plan's memory is checked on its simulated peak: the DP counts the activations
    held before each ``I`` (``ScheduleSpec.activations_in_flight``), not the ``M_W`` of the
    micro-batches waiting for their ``W``."""
    if spec(schedule).multi_chunk:
        if allow_fewer:
            raise FormatError("allow_fewer", True, f"not supported with the multi-chunk schedule {schedule}")
        return _chain_noted(solve_chunked(profile, cluster, devices, schedule=schedule, chunks="auto",
                                          micro_batches=micro_batches, options=options), profile, dag)
    t0 = time.perf_counter()
    res = dp.solve(profile, cluster, devices, schedule=schedule, micro_batches=micro_batches, options=options,
                   allow_fewer=allow_fewer)
    if profile.edges and dag is not False:
        cost, devs, sched = dp.chain_arguments(profile, cluster, devices, schedule, micro_batches, options)
        res = solve_graph(profile, cost, devs, sched, allow_fewer, res, t0)
    if not (spec(schedule).split_backward and res.ok and res.plan is not None):
        return res
    peaks = res.plan.meta.get("peak_memory_bytes", {})
    over = [f"{d} needs {peaks[d] / GIB:.2f} GiB of {cluster.device(d).memory_bytes / GIB:.2f}"
            for d in peaks if peaks[d] > cluster.device(d).memory_bytes]
    if not over:
        return res
    return replace(res, status=SolveStatus.INFEASIBLE, plan=None,
                   reason=f"the bottleneck-optimal split under {schedule} does not fit (simulated peak, the "
                          f"weight-gradient memory of the micro-batches waiting for W included): " + "; ".join(over))
