"""Plans for the multi-chunk schedules (interleaved 1F1B, breadth-first): ``p`` devices each
holding ``V`` model chunks, ``p * V`` stages, stage ``c * p + d`` on device ``d``.

The split is the exact chain DP (:func:`solvers.pipeline.dp.chain_dp`) over the device list repeated
``V`` times (``d0 .. d(p-1), d0 .. d(p-1), ...``; for ``zbv``, ZB-V's two chunks in a V,
``d0 .. d(p-1), d(p-1) .. d0``, the turn on one device costing no transfer): it minimises the largest per-stage time,
each stage priced with its transfers to the stages beside it (the link from ``d(p-1)`` back
to ``d0`` between chunks included), then, among those splits, the least total stage time.

Memory: the DP's per-stage check assumes one-chunk in-flight counts, which do not hold here
(a device holds several chunks' activations at once, in a schedule-dependent pattern). The DP
pass therefore checks only what every stage needs on its own (its weights, optimizer state and
one micro-batch's activations: a necessary condition), and the simulator then measures each
device's peak over its ``V`` chunks together; a device that overflows makes the answer
INFEASIBLE with the numbers. Predictions come from the simulator
(:func:`solvers.predictions.with_predictions`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import replace

from partitioner.cluster import GIB, Cluster
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError, OptionError, PartitionerError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import Profile
from partitioner.schedule import MULTI_CHUNK, Schedule, check_schedule, spec, stage_rank
from solvers.pipeline.dp import chain_dp
from solvers.predictions import with_predictions
from solvers.result import SolveResult, SolveStatus

__all__ = ["AUTO_CHUNKS", "parse_chunks", "solve_chunked"]

log = logging.getLogger(__name__)

AUTO_CHUNKS = (2, 3, 4)


def parse_chunks(value: int | str, schedule: str, name: str = "chunks") -> tuple[int, ...]:
    """The chunk counts to try for ``value`` (an integer >= 1 or ``"auto"``) under ``schedule``;
    errors name the option ``name``."""
    if not spec(schedule).multi_chunk:
        raise OptionError(name, value, f"applies to the multi-chunk schedules ({', '.join(MULTI_CHUNK)}); "
                          f"{schedule} runs one chunk per device")
    fixed = spec(schedule).chunks
    if value == "auto":
        return AUTO_CHUNKS if fixed is None else (fixed,)
    try:
        v = int(value)
    except (TypeError, ValueError):
        v = 0
    if v < 1 or str(value).strip() != str(v):
        raise OptionError(name, value, "must be an integer >= 1 or 'auto'")
    return (v,)


def _one(profile: Profile, cluster: Cluster, cost: CostModel, devs: Sequence[str], schedule: str, chunks: int,
         micro_batches: int, options: CostOptions) -> SolveResult:
    from partitioner.simulate import simulate_plan

    t0 = time.perf_counter()
    p = len(devs)
    devices = cluster.subset(devs)
    check_schedule(schedule, p, micro_batches, chunks)
    if p * chunks > profile.num_layers:
        return SolveResult(SolveStatus.INFEASIBLE, None, runtime_s=time.perf_counter() - t0, method="dp:chunked",
                           reason=f"{p} devices x {chunks} chunks = {p * chunks} stages, more than the "
                                  f"{profile.num_layers} layers")
    # Relaxed memory for the split: 1f1b with one micro-batch in flight prices each stage alone
    # (one weight version, as interleaved and bfs keep); per-stage times do not depend on it.
    placement = spec(schedule).placement
    order = tuple(devices[stage_rank(s, p, placement)] for s in range(p * chunks))
    sol = chain_dp(cost, order, Schedule.of("1f1b", 1))
    if sol is None:
        return SolveResult(SolveStatus.INFEASIBLE, None, runtime_s=time.perf_counter() - t0, method="dp:chunked",
                           reason=f"no split into {p * chunks} stages over {', '.join(devs)} x {chunks} fits even "
                                  f"one micro-batch per stage in memory")
    stages = tuple(Stage((a, b), d.name, d.gpu_type) for (a, b), d in zip(sol.ranges, sol.devices, strict=True))
    plan = Plan(profile.model, (VirtualWorker(stages),), schedule, profile.micro_batch_size, micro_batches,
                chunks=chunks)
    tl = simulate_plan(plan, profile, cluster, options)
    over = [f"{d} needs {tl.peak_memory_bytes[d] / GIB:.2f} GiB of {cluster.device(d).memory_bytes / GIB:.2f}"
            for d in tl.devices if tl.peak_memory_bytes[d] > cluster.device(d).memory_bytes]
    elapsed = time.perf_counter() - t0
    if over:
        return SolveResult(SolveStatus.INFEASIBLE, None, sol.bottleneck_s, runtime_s=elapsed, method="dp:chunked",
                           reason=f"the bottleneck-optimal split into {chunks} chunks on {p} devices under "
                                  f"{schedule} with {micro_batches} micro-batches does not fit (simulated peak): "
                                  + "; ".join(over) + " (other splits were not searched)")
    times = cost.plan_stage_times_s(plan)
    closed = {"bottleneck_s": max(times)}
    plan = with_predictions(plan, profile, cluster, options, closed, extra_meta={"stage_times_s": times})
    result = SolveResult(SolveStatus.OPTIMAL, None, sol.bottleneck_s, sol.bottleneck_s, elapsed, "dp:chunked",
                         details={"chunks": chunks, "lower_bound_simple_s": cost.lower_bound_s(devices)})
    return replace(result, plan=replace(plan, solver=result.solver_info()))


def solve_chunked(profile: Profile, cluster: Cluster, devices: Sequence[str] | None = None, *,
                  schedule: str = "interleaved", chunks: int | str = "auto", micro_batches: int | None = None,
                  options: CostOptions | None = None) -> SolveResult:
    """A ``chunks``-chunk plan of ``profile`` over ``devices`` (default: every device, in order)
    under ``schedule`` (interleaved or bfs). ``chunks="auto"`` tries 2, 3 and 4 and keeps the
    plan with the most simulated samples/s. ``micro_batches`` defaults to the number of devices.
    """
    counts = parse_chunks(chunks, schedule)
    options = options or CostOptions()
    cost = CostModel(profile, cluster, options)
    devs = [d.name for d in (cluster.subset(devices) if devices is not None else cluster.devices)]
    if len(set(devs)) != len(devs):
        raise FormatError("devices", devs, "lists a device twice")
    cost.require_times(cluster.subset(devs))
    m = micro_batches if micro_batches is not None else len(devs)
    if not (isinstance(m, int) and not isinstance(m, bool) and m >= 1):
        raise FormatError("micro_batches", m, "must be an integer >= 1")
    t0 = time.perf_counter()
    best: SolveResult | None = None
    refused: list[str] = []
    for v in counts:
        try:
            r = _one(profile, cluster, cost, devs, schedule, v, m, options)
        except PartitionerError as err:
            if len(counts) == 1:
                raise
            refused.append(f"{v} chunks: {err}")
            continue
        if not r.ok or r.plan is None:
            refused.append(f"{v} chunks: {r.reason}")
            continue
        sps = r.plan.predicted.get("samples_per_s", -math.inf)
        if best is None or best.plan is None or sps > best.plan.predicted.get("samples_per_s", -math.inf):
            best = r
    if best is None:
        return SolveResult(SolveStatus.INFEASIBLE, None, runtime_s=time.perf_counter() - t0, method="dp:chunked",
                           reason="; ".join(refused))
    if len(counts) > 1:
        best = replace(best, runtime_s=time.perf_counter() - t0, details={**best.details, "refused": refused})
    return best
