"""Human-readable summaries of plans: one table a person can check at a glance."""

from __future__ import annotations

import math

from .cluster import Cluster
from .cost import CostModel
from .plan import Plan
from .schedule import spec

__all__ = ["format_plan"]

GIB = 2**30


def _fmt_s(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.3f} s"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _alike_workers(plan: Plan, cluster: Cluster) -> list[list[int]]:
    """Virtual workers grouped by layout: same layer ranges on the same GPU types over links of
    the same bandwidth (so they price the same), in first-seen order."""
    groups: dict[tuple[object, ...], list[int]] = {}
    for w, vw in enumerate(plan.virtual_workers):
        st = vw.stages
        key = tuple((s.layers, cluster.device(s.device).kind, len(s.replicas),
                     cluster.bandwidth_gbps(s.device, st[k + 1].device) if k + 1 < len(st) else 0.0)
                    for k, s in enumerate(st))
        groups.setdefault(key, []).append(w)
    return list(groups.values())


def format_plan(plan: Plan, cost: CostModel) -> str:
    """The plan as a stage table (per virtual worker) under a header with its certificate, priced
    by ``cost`` (the profile, cluster and options the plan was made with)."""
    cluster = cost.cluster
    used = sum(cluster.device(d).gpus for d in plan.devices)
    groups = sum(cluster.device(d).gpus > 1 for d in plan.devices)
    out = [f"plan for {plan.model} on {cluster.name}: {len(plan.virtual_workers)} virtual worker(s), "
           f"{used} of {cluster.num_gpus} GPUs" + (f" ({groups} tensor-parallel group(s))" if groups else "")
           + f", schedule {plan.schedule}, {plan.micro_batches} micro-batches of {plan.micro_batch_size}"]
    if plan.solver is not None:
        s = plan.solver
        gap = "n/a" if math.isnan(s.gap) else f"{100 * s.gap:.2f}%"
        objective = plan.meta.get("objective")
        if objective in ("sync", "wsp"):  # cluster planners minimise seconds per sample
            value = f"{1 / s.objective:.1f} samples/s ({objective})" if s.objective > 0 else "n/a"
            bound = f"{1 / s.lower_bound:.1f} samples/s" if s.lower_bound > 0 else "n/a"
            out.append(f"solver {s.name}: {s.status}, objective {value}, upper bound {bound}, gap {gap}, "
                       f"solved in {s.time_s:.3f} s")
        else:
            out.append(f"solver {s.name}: {s.status}, objective {_fmt_s(s.objective)}, lower bound "
                       f"{_fmt_s(s.lower_bound)}, gap {gap}, solved in {s.time_s:.3f} s")
    pred = plan.predicted
    if pred:
        shown = []
        for key, label in (("bottleneck_s", "bottleneck"), ("iteration_s", "iteration")):
            if key in pred:
                shown.append(f"{label} {_fmt_s(pred[key])}")
        if "samples_per_s" in pred:
            shown.append(f"{pred['samples_per_s']:.1f} samples/s")
        line = "predicted: " + ", ".join(shown)
        closed = plan.meta.get("closed_form", {}).get("samples_per_s") if isinstance(plan.meta.get("closed_form"),
                                                                                     dict) else None
        if plan.meta.get("objective") in ("sync", "wsp") and "samples_per_s" in pred \
                and isinstance(closed, (int, float)) and closed > 0 \
                and f"{closed:.1f}" != f"{pred['samples_per_s']:.1f}":
            # a cluster planner ranks by the closed form; the prediction is the simulator's (say so)
            line += (f" (simulated; the closed form the planner ranks by gives {closed:.1f} samples/s: the "
                     f"simulator also times what it leaves out, docs/fidelity.md)")
        out.append(line)
    if plan.layer_order is not None:
        moved = sum(1 for i, v in enumerate(plan.layer_order) if i != v)
        out.append(f"stages are convex sets of the graph: layer ranges count the plan's layer_order "
                   f"({moved} of {len(plan.layer_order)} layers placed differently from the profile's order)")
    one_chunk = not spec(plan.schedule).multi_chunk
    holders = cost.layer_holders(plan)
    levers = any(st.recompute != "none" for vw in plan.virtual_workers for st in vw.stages)
    for workers in _alike_workers(plan, cluster):
        w = workers[0]
        vw = plan.virtual_workers[w]
        stages = vw.stages
        times = cost.plan_stage_times_s(plan, w)
        bottleneck = max(times)
        rows = []
        for k, st in enumerate(stages):
            dev = cluster.device(st.device)
            nxt = stages[k + 1].device if k + 1 < len(stages) else None
            comp = cost.recomputing(st.recompute).compute_s(dev.kind, st.start, st.stop)
            prev = stages[k - 1].device if k > 0 else None
            xfer = cost.boundary_s(st.stop, dev, nxt) + cost.boundary_s(st.start, dev, prev)
            if one_chunk:
                in_flight = plan.pipeline_schedule.activations_in_flight(len(stages) - k)
                mem = cost.plan_stage_memory_bytes(st, st.device, in_flight, plan.pipeline_schedule, holders)
                mem_s = f"{mem / GIB:.2f} / {dev.memory_bytes / GIB:.1f} GiB ({100 * mem / dev.memory_bytes:.0f}%)"
            else:
                mem_s = "see simulate"
            share = f"{100 * times[k] / bottleneck:.1f}%" if bottleneck > 0 else "-"
            devs = st.device + (f" +{len(st.replicas)}" if st.replicas else "")
            rows.append([str(k), devs, dev.gpu_type + (f" x{dev.tensor_parallel} TP" if dev.tensor_parallel > 1 else ""),
                         f"[{st.start}, {st.stop})", _fmt_s(comp), _fmt_s(xfer),
                         mem_s, share] + ([st.recompute] if levers else []))
        if len(workers) > 1:
            others = ", ".join("+".join(plan.virtual_workers[o].devices) for o in workers[1:])
            out.append(f"\nvirtual workers {', '.join(map(str, workers))} (the same layout; worker {w} shown; "
                       f"the others on {others}):")
        elif len(plan.virtual_workers) > 1:
            out.append(f"\nvirtual worker {w}:")
        else:
            out.append("")
        out.append(_table(["stage", "device", "gpu type", "layers", "compute", "transfer out",
                           "memory used / capacity", "share of bottleneck"] + (["recompute"] if levers else []), rows))
    return "\n".join(out)
