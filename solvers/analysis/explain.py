"""Why a plan is as fast as it is: its bottleneck, where the iteration goes, memory headroom,
the gap to the best bound known, and what one more GPU of each type would give.

Everything is priced with the cost model (:class:`partitioner.cost.CostModel`) and the
discrete-event simulator (:func:`partitioner.simulate.simulate_plan`) under the options the
plan was priced with, so the figures are the ones ``partitioner simulate`` prints; the
what-if re-plans use the same solver path as ``partitioner plan``. Torch-free.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from partitioner.cluster import GIB, Cluster, Node, catalog
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError, PartitionerError
from partitioner.plan import Plan, group_size
from partitioner.profile import Profile
from partitioner.projected import ProjectedTimes, format_projected, projected_times
from partitioner.schedule import check_schedule, spec
from solvers.analysis.levers import LeverCost, format_levers, lever_costs, zero_saved_bytes

__all__ = ["AddedGpu", "Explanation", "StageCost", "add_gpu", "explain_plan", "format_explanation"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageCost:
    """One stage's per-micro-batch time (:meth:`CostModel.plan_stage_times_s`) and its parts:
    compute on its (fastest) device, the activation it sends forward, the gradient it sends back
    (a replicated stage's at its replicas' combined pace), and the synchronisation spread over the
    micro-batches (a replicated stage's all-reduce, WSP's wave sync)."""

    worker: int
    stage: int
    devices: tuple[str, ...]
    layers: tuple[int, int]
    time_s: float
    compute_s: float
    activation_send_s: float
    gradient_send_s: float
    sync_share_s: float = 0.0  # a replicated stage's all-reduce, or WSP's wave sync, per micro-batch
    next_device: str | None = None
    prev_device: str | None = None

    def __post_init__(self) -> None:
        for name in ("time_s", "compute_s", "activation_send_s", "gradient_send_s", "sync_share_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise FormatError(name, v, "must be a finite number >= 0")

    @property
    def transfer_s(self) -> float:
        return self.activation_send_s + self.gradient_send_s

    @property
    def link_bound(self) -> bool:
        """Whether the stage spends longer sending than computing (its link is the bottleneck)."""
        return self.transfer_s > self.compute_s

    def to_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "stage": self.stage, "devices": list(self.devices),
                "layers": list(self.layers), "time_s": self.time_s, "compute_s": self.compute_s,
                "activation_send_s": self.activation_send_s, "gradient_send_s": self.gradient_send_s,
                "sync_share_s": self.sync_share_s,
                "next_device": self.next_device, "prev_device": self.prev_device, "link_bound": self.link_bound}


@dataclass(frozen=True)
class AddedGpu:
    """The plan re-made with one more GPU of ``gpu_type`` on ``node``. ``timed`` False: the profile
    has no times for the type, so nothing is claimed (``samples_per_s`` and ``gain`` are NaN)."""

    gpu_type: str
    timed: bool
    node: str = ""
    status: str = ""
    samples_per_s: float = math.nan
    baseline_samples_per_s: float = math.nan
    solve_s: float = 0.0
    reason: str = ""

    def __post_init__(self) -> None:
        if not self.timed and not math.isnan(self.samples_per_s):
            raise FormatError("samples_per_s", self.samples_per_s, f"must be NaN: {self.gpu_type} is not timed")

    @property
    def gain_samples_per_s(self) -> float:
        return self.samples_per_s - self.baseline_samples_per_s

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {"gpu_type": self.gpu_type, "timed": self.timed, "node": self.node, "status": self.status,
                "samples_per_s": num(self.samples_per_s), "baseline_samples_per_s": num(self.baseline_samples_per_s),
                "gain_samples_per_s": num(self.gain_samples_per_s), "solve_s": self.solve_s, "reason": self.reason}


@dataclass(frozen=True)
class Explanation:
    """The figures ``partitioner explain`` prints (and writes with ``--json``)."""

    model: str
    schedule: str
    stages: tuple[StageCost, ...]
    bottleneck: StageCost
    iteration_s: float
    samples_per_s: float
    bubble_fraction: Mapping[str, float]
    sync: tuple[dict[str, Any], ...]
    update_s: Mapping[str, float]
    peak_memory_bytes: Mapping[str, float]
    capacity_bytes: Mapping[str, float]
    bounds: Mapping[str, float]
    solver: Mapping[str, Any] | None
    added: tuple[AddedGpu, ...] = ()
    notes: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)
    levers: tuple[LeverCost, ...] = ()  # the stages that recompute: what each costs and saves
    zero: int = 0
    zero_saved_bytes: Mapping[str, float] = field(default_factory=dict)  # per device, under ZeRO
    projected: ProjectedTimes | None = None  # what of the prediction rests on projected times

    def __post_init__(self) -> None:
        if set(self.peak_memory_bytes) != set(self.capacity_bytes):
            raise FormatError("peak_memory_bytes", sorted(self.peak_memory_bytes),
                              "must name the same devices as capacity_bytes")

    @property
    def headroom_bytes(self) -> dict[str, float]:
        """Capacity minus the simulator's peak, per device (negative: does not fit)."""
        return {d: self.capacity_bytes[d] - self.peak_memory_bytes[d] for d in self.peak_memory_bytes}

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "schedule": self.schedule,
            "bottleneck": self.bottleneck.to_dict(),
            "stages": [s.to_dict() for s in self.stages],
            "iteration_s": self.iteration_s, "samples_per_s": self.samples_per_s,
            "bubble_fraction": dict(self.bubble_fraction),
            "sync": list(self.sync), "update_s": dict(self.update_s),
            "memory": {d: {"peak_bytes": self.peak_memory_bytes[d], "capacity_bytes": self.capacity_bytes[d],
                           "headroom_bytes": h} for d, h in self.headroom_bytes.items()},
            "bounds": {k: (None if math.isnan(v) else v) for k, v in self.bounds.items()},
            "solver": dict(self.solver) if self.solver is not None else None,
            "add_one_gpu": [a.to_dict() for a in self.added],
            "notes": list(self.notes),
            "levers": {"recompute": [lv.to_dict() for lv in self.levers], "zero": self.zero,
                       "zero_saved_bytes": dict(self.zero_saved_bytes)},
            "projected_times": self.projected.to_dict() if self.projected is not None else None,
        }


def _stage_costs(cost: CostModel, plan: Plan) -> list[StageCost]:
    out = []
    for w, vw in enumerate(plan.virtual_workers):
        times = cost.plan_stage_times_s(plan, w)
        for k, st in enumerate(vw.stages):
            prev = vw.stages[k - 1].device if k > 0 else None
            nxt = vw.stages[k + 1].device if k + 1 < len(vw.stages) else None
            cs = cost.recomputing(st.recompute)  # its compute includes what it recomputes
            speed = {d: cs.compute_s(cost.cluster.device(d).kind, st.start, st.stop) for d in st.devices}
            best = min(st.devices, key=speed.__getitem__)
            c, a, g = speed[best], cost.boundary_s(st.stop, best, nxt), cost.boundary_s(st.start, best, prev)
            # replicas share the micro-batches: each part at the replicas' combined pace
            single = cs.stage_time_s(st.start, st.stop, best, prev, nxt)
            share = (cs.replicated_stage_time_s(st.start, st.stop, st.devices, prev, nxt, plan.micro_batches,
                                                  include_allreduce=False) / single
                     if st.replicas and single > 0 else 1.0)
            rest = max(0.0, times[k] - share * cost.combine(c, g, a))
            out.append(StageCost(w, k, st.devices, st.layers, times[k], share * c, share * a, share * g, rest,
                                 nxt, prev))
    return out


def add_gpu(cluster: Cluster, gpu_type: str, node: str | None = None) -> tuple[Cluster, str]:
    """``cluster`` with one more ``gpu_type`` GPU on ``node``; returns the new cluster and the new
    device's name. By default the GPU joins the node of its type with the fewest GPUs (the first on
    ties), or, where no node holds that type, a new node of its own (a GPU of another type is not
    put into a machine of different GPUs), with the intra-node bandwidth of the cluster's first node."""
    if node is None:
        same = [n for n in cluster.nodes if gpu_type in n.gpus]
        if not same:
            taken = {n.name for n in cluster.nodes}
            name = next(f"new{i}" for i in range(len(taken) + 1) if f"new{i}" not in taken)
            first = cluster.nodes[0]
            added = Node(name, (gpu_type,), first.intra_gbps, first.intra_curve)
            return replace(cluster, nodes=(*cluster.nodes, added)), f"{name}:0"
        node = min(same, key=lambda n: len(n.gpus)).name
    nodes: list[Node] = []
    name = ""
    for n in cluster.nodes:
        if n.name == node:
            name = f"{n.name}:{len(n.gpus)}"
            n = replace(n, gpus=(*n.gpus, gpu_type))
        nodes.append(n)
    if not name:
        raise FormatError("node", node, f"not in cluster '{cluster.name}'")
    return replace(cluster, nodes=tuple(nodes)), name


def _replan(plan: Plan, profile: Profile, cluster: Cluster, options: CostOptions, devices: Sequence[str],
            time_limit_s: float) -> tuple[str, float, str]:
    """(status, simulated samples/s, reason) of the plan the same solver path makes over ``devices``:
    the chain DP over them in order (allowing a prefix; for a multi-chunk plan all of them, with
    the plan's chunk count, and the micro-batch count rounded up to a multiple of the devices
    where the schedule needs one) for one virtual worker, the cluster planner
    (policy opt, the plan's number of virtual workers) for several."""
    if len(plan.virtual_workers) == 1:
        from solvers.pipeline.router import solve

        if spec(plan.schedule).multi_chunk:  # the chunked DP over all of them, the plan's chunk count
            m = plan.micro_batches
            try:
                check_schedule(plan.schedule, len(devices), m, plan.chunks)
            except FormatError:  # a count the schedule refuses on this many devices: the next multiple
                m = -(-m // len(devices)) * len(devices)
            result = solve(profile, cluster, list(devices), schedule=plan.schedule, micro_batches=m,
                           options=options, chunks=plan.chunks)
        else:
            result = solve(profile, cluster, list(devices), schedule=plan.schedule,
                           micro_batches=plan.micro_batches, options=options, allow_fewer=True)
    else:
        from solvers.cluster.planner import plan_cluster
        result = plan_cluster(profile, cluster, len(plan.virtual_workers), "opt", schedule=plan.schedule,
                              micro_batches=plan.micro_batches, options=options, devices=list(devices),
                              time_limit_s=time_limit_s)
    if not result.ok or result.plan is None:
        return result.status.value, math.nan, result.reason
    return result.status.value, float(result.plan.predicted.get("samples_per_s", math.nan)), ""


def _what_if(plan: Plan, profile: Profile, cluster: Cluster, options: CostOptions, cost: CostModel,
             time_limit_s: float) -> tuple[AddedGpu, ...]:
    types = list(dict.fromkeys([*cluster.gpu_types, *cluster.device_types, *catalog()]))
    timed = [t for t in types if cost.has_times(t)]
    out = [AddedGpu(t, False, reason="the profile has no times for this type") for t in types if t not in timed]
    if not timed:
        return tuple(out)
    used = set(plan.devices)
    order = [d.name for d in cluster.devices if d.name in used] if len(plan.virtual_workers) > 1 \
        else list(plan.virtual_workers[0].devices)
    t0 = time.perf_counter()
    try:
        status, base, reason = _replan(plan, profile, cluster, options, order, time_limit_s)
    except PartitionerError as err:
        status, base, reason = "error", math.nan, str(err)
    log.info("re-planned the plan's own devices in %.2f s: %s", time.perf_counter() - t0, status)
    for t in timed:
        bigger, new = add_gpu(cluster, t)
        if len(plan.virtual_workers) > 1:
            devs = [d.name for d in bigger.devices if d.name in used or d.name == new]
        else:  # the new GPU joins the pipeline next to the plan's last device on its node, else at the end
            devs = list(order)
            node = new.split(":")[0]
            same = [i for i, d in enumerate(devs) if d.split(":")[0] == node]
            devs.insert(same[-1] + 1 if same else len(devs), new)
        t1 = time.perf_counter()
        try:
            st, sps, why = _replan(plan, profile, bigger, options, devs, time_limit_s)
        except PartitionerError as err:
            st, sps, why = "error", math.nan, str(err)
        out.append(AddedGpu(t, True, new.split(":")[0], st, sps, base, time.perf_counter() - t1,
                            why or (reason and f"baseline: {reason}")))
    return tuple(sorted(out, key=lambda a: (not a.timed, -(a.gain_samples_per_s if a.timed and not
                                                              math.isnan(a.gain_samples_per_s) else -math.inf))))


def explain_plan(plan: Plan, profile: Profile, cluster: Cluster, options: CostOptions | None = None,
                 *, what_if: bool = True, time_limit_s: float = 10.0) -> Explanation:
    """Explain ``plan`` (see the module docstring). ``options`` default to the plan's own
    (:meth:`Plan.cost_options`). ``what_if`` re-plans with one more GPU of each timed type,
    each cluster-planner run limited to ``time_limit_s``."""
    from partitioner.simulate import simulate_plan

    if not time_limit_s > 0:
        raise FormatError("time_limit_s", time_limit_s, "must be > 0 seconds")
    options = options or plan.cost_options() or CostOptions()
    plan.validate(profile, cluster)
    # in the plan's order (convex stages of a graph) and at its micro-batch size (a plan of
    # micro-batches "auto" may have another than the profile's)
    profile = plan.profile_view(profile).at_size(plan.micro_batch_size)
    cost = CostModel(profile, cluster, options)
    stages = _stage_costs(cost, plan)
    bottleneck = max(stages, key=lambda s: s.time_s)
    tl = simulate_plan(plan, profile, cluster, options)
    groups = cost.sync_groups(plan)
    sync = tuple({"layers": [g.start, g.stop], "devices": list(g.devices), "seconds": cost.sync_s(g)}
                 for g in groups)
    update: dict[str, float] = {}
    if spec(plan.schedule).sync == "allreduce" and options.sync:
        holders = cost.layer_holders(plan)  # under ZeRO each device steps its shard
        for vw in plan.virtual_workers:
            for st in vw.stages:
                for d in st.devices:
                    update[d] = update.get(d, 0.0) + cost.update_shard_s(cluster.device(d).kind, st.start, st.stop,
                                                                         holders)
    peak = {d: float(tl.peak_memory_bytes[d]) for d in tl.devices}
    capacity = {d: float(cluster.device(d).memory_bytes) for d in tl.devices}
    bounds: dict[str, float] = {"bottleneck_s": bottleneck.time_s}
    notes: list[str] = []
    if plan.chunks > 1:  # a device runs all its chunks: its load is what the bound limits
        load: dict[str, float] = {}
        for s in stages:
            if s.worker == bottleneck.worker:
                load[s.devices[0]] = load.get(s.devices[0], 0.0) + s.time_s
        bounds["device_load_s"] = max(load.values())
    if len(plan.virtual_workers) == 1:
        devs = cluster.subset(plan.virtual_workers[0].devices)
        bounds["lower_bound_s"] = cost.lower_bound_s(devs)
        if plan.chunks == 1 and not any(st.replicas for st in plan.virtual_workers[0].stages):
            from solvers.pipeline.dp import chain_dp

            try:
                sol = chain_dp(cost, devs, plan.pipeline_schedule)
            except PartitionerError as err:
                notes.append(f"no exact DP bound: {err}")
            else:
                bounds["dp_same_order_s"] = sol.bottleneck_s if sol is not None else math.nan
    else:
        worker = plan.virtual_workers[bottleneck.worker]
        bounds["lower_bound_s"] = cost.lower_bound_s(cluster.subset(worker.devices))
        notes.append(f"several virtual workers: the combinatorial bound is that of worker {bottleneck.worker}'s "
                     f"GPUs, which hold the bottleneck stage")
    solver = plan.solver.to_dict() if plan.solver is not None else None
    added = _what_if(plan, profile, cluster, options, cost, time_limit_s) if what_if else ()
    return Explanation(plan.model, plan.schedule, tuple(stages), bottleneck, tl.iteration_s, tl.samples_per_s,
                       dict(tl.bubble_fraction), sync, update, peak, capacity, bounds, solver, added, tuple(notes),
                       {"overlap_comm": options.overlap_comm}, lever_costs(cost, plan), options.zero,
                       zero_saved_bytes(cost, plan), projected_times(plan, profile, cluster, options))


def _ms(x: float) -> str:
    return f"{1e3 * x:.3f} ms"


def format_explanation(e: Explanation, max_untimed: int = 8) -> str:
    """The text ``partitioner explain`` prints."""
    b = e.bottleneck
    overlap = bool(e.extra.get("overlap_comm"))
    lines = [f"{e.model} under {e.schedule}"]
    where = "+".join(b.devices)
    degrees = sorted({group_size(d) for d in b.devices})
    if degrees != [1]:  # tensor-parallel groups: each GPU of the group runs one shard
        where += f" (tensor parallel {'/'.join(map(str, degrees))})"
    lines.append(f"bottleneck: worker {b.worker} stage {b.stage} on {where}, layers [{b.layers[0]}, "
                 f"{b.layers[1]}): {_ms(b.time_s)} per micro-batch = compute {_ms(b.compute_s)} + activation "
                 f"send {_ms(b.activation_send_s)} + gradient send {_ms(b.gradient_send_s)}"
                 + (f" + synchronisation {_ms(b.sync_share_s)}" if b.sync_share_s > 0 else "")
                 + (f" ({len(b.devices)} replicas sharing the micro-batches)" if len(b.devices) > 1 else "")
                 + (" (overlapped: the stage takes the largest part)" if overlap else ""))
    if b.link_bound:
        link = (f"{b.devices[0]} -> {b.next_device}" if b.activation_send_s >= b.gradient_send_s
                else f"{b.devices[0]} -> {b.prev_device}")
        lines.append(f"  the stage sends longer than it computes: the link {link} is the bottleneck")
    lines.append(f"simulated iteration {e.iteration_s:.6g} s, {e.samples_per_s:.2f} samples/s")
    lines.append("  bubble: " + ", ".join(f"{d} {100 * f:.1f}%" for d, f in e.bubble_fraction.items()))
    if e.sync:
        for g in e.sync:
            lines.append(f"  all-reduce layers [{g['layers'][0]}, {g['layers'][1]}) over "
                         f"{len(g['devices'])} GPUs: {_ms(g['seconds'])}")
    else:
        lines.append("  all-reduce: none (no layer is held by two devices, or sync is not priced)")
    if e.update_s and max(e.update_s.values()) <= 0:
        lines.append("  optimizer step: 0 (the profile has no update times)")
    elif e.update_s:
        d_max = max(e.update_s, key=lambda d: e.update_s[d])
        lines.append(f"  optimizer step: up to {_ms(e.update_s[d_max])} ({d_max})")
    lines.extend(format_levers(e.levers, e.zero, e.zero_saved_bytes))
    lines.append("memory (peak simulated / capacity, headroom):")
    for d, h in e.headroom_bytes.items():
        flag = "  DOES NOT FIT" if h < 0 else ""
        lines.append(f"  {d}: {e.peak_memory_bytes[d] / GIB:.2f} / {e.capacity_bytes[d] / GIB:.2f} GiB, "
                     f"{h / GIB:+.2f} GiB{flag}")
    gap = []
    bnd = e.bounds
    if e.solver:
        obj, lb = e.solver.get("objective"), e.solver.get("lower_bound")
        txt = f"solver {e.solver.get('name')} {e.solver.get('status')}"
        if isinstance(obj, (int, float)) and isinstance(lb, (int, float)):
            gap_pct = 100 * max(0.0, (obj - lb) / obj) if obj > 0 and math.isfinite(lb) else math.nan
            if str(e.solver.get("name", "")).startswith(("hetero", "tensor")) and obj > 0 and lb > 0:
                # in the units `partitioner plan` prints: samples/s, the bound an upper one
                txt += f", objective {1 / obj:.1f} samples/s, upper bound {1 / lb:.1f} samples/s"
            else:
                txt += f", objective {_ms(obj)}, lower bound {_ms(lb)} (bottleneck)"
            txt += f", gap {gap_pct:.2f}%"
        gap.append(txt)
    if "dp_same_order_s" in bnd and not math.isnan(bnd["dp_same_order_s"]):
        gap.append(f"exact DP on the same device order {_ms(bnd['dp_same_order_s'])} "
                   f"({100 * (b.time_s / bnd['dp_same_order_s'] - 1):+.2f}% over it)"
                   if bnd["dp_same_order_s"] > 0 else "exact DP on the same device order 0")
    if "lower_bound_s" in bnd and bnd["lower_bound_s"] > 0:
        worst, what = (bnd["device_load_s"], "busiest device's chunks together") if "device_load_s" in bnd \
            else (b.time_s, "bottleneck")
        gap.append(f"combinatorial bound {_ms(bnd['lower_bound_s'])} "
                   f"({what} {_ms(worst)}, {100 * (worst / bnd['lower_bound_s'] - 1):+.1f}% over it)")
    lines.append("gap: " + "; ".join(gap))
    if e.added:
        timed = [a for a in e.added if a.timed]
        untimed = [a.gpu_type for a in e.added if not a.timed]
        if timed:
            lines.append("one more GPU (same solver path, simulated samples/s):")
            for a in timed:
                if math.isnan(a.samples_per_s):
                    lines.append(f"  + {a.gpu_type} on {a.node}: {a.status} {a.reason}".rstrip())
                else:
                    lines.append(f"  + {a.gpu_type} on {a.node}: {a.samples_per_s:.2f} samples/s "
                                 f"({a.gain_samples_per_s:+.2f} vs {a.baseline_samples_per_s:.2f} re-planned "
                                 f"without it)")
        if any(a.gain_samples_per_s < 0 for a in timed):
            lines.append("  (a negative figure: the planner found no better plan with the extra GPU, as it ranks "
                         "plans by the closed form or, one pipeline, places every GPU it is given; leaving the "
                         "GPU idle keeps the figure without it)")
        if untimed:
            shown = ", ".join(untimed[:max_untimed]) + (f" and {len(untimed) - max_untimed} more"
                                                       if len(untimed) > max_untimed else "")
            lines.append(f"  not timed in the profile (no gain claimed): {shown}")
    if e.projected is not None:
        lines += format_projected(e.projected)
    lines += [f"note: {n}" for n in e.notes]
    return "\n".join(lines)
