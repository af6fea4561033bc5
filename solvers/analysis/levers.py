"""What a plan's memory levers cost and save, per stage and device (``partitioner explain``).

A stage that recomputes (``Stage.recompute``) pays its recomputed forward inside every backward
and keeps fewer activations; ZeRO (``CostOptions.zero``) divides each layer's optimizer state
(and gradients under ZeRO-2) over the devices that hold the layer, and each of them steps its
shard. Each figure is the plan priced with the lever against the same plan without it, by the
cost model (:class:`partitioner.cost.CostModel`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from partitioner.cluster import GIB
from partitioner.cost import CostModel
from partitioner.plan import Plan

__all__ = ["LeverCost", "format_levers", "lever_costs", "zero_saved_bytes"]


@dataclass(frozen=True)
class LeverCost:
    """Stage ``stage`` of worker ``worker`` recomputes ``mode``: ``extra_s`` more compute per
    micro-batch on its fastest device, ``saved_bytes`` less memory on its device (one-chunk
    schedules; NaN otherwise)."""

    worker: int
    stage: int
    device: str
    mode: str
    extra_s: float
    saved_bytes: float

    def to_dict(self) -> dict[str, Any]:
        return {"worker": self.worker, "stage": self.stage, "device": self.device, "recompute": self.mode,
                "extra_compute_s": self.extra_s, "saved_bytes": self.saved_bytes}


def lever_costs(cost: CostModel, plan: Plan) -> tuple[LeverCost, ...]:
    """Every stage of ``plan`` that recomputes, with what it costs and saves."""
    sched = plan.pipeline_schedule
    one_chunk = not (sched.spec.multi_chunk or sched.spec.split_backward)
    holders = cost.layer_holders(plan)
    out = []
    for w, vw in enumerate(plan.virtual_workers):
        for k, st in enumerate(vw.stages):
            if st.recompute == "none":
                continue
            kind = min((cost.cluster.device(d).kind for d in st.devices),
                       key=lambda t: cost.compute_s(t, st.start, st.stop))
            extra = cost.recomputing(st.recompute).compute_s(kind, st.start, st.stop) - \
                cost.compute_s(kind, st.start, st.stop)
            saved = float("nan")
            if one_chunk:
                in_flight = sched.activations_in_flight(len(vw.stages) - k)
                plain = cost.plan_stage_memory_bytes(replace(st, recompute="none"), st.device, in_flight, sched, holders)
                saved = plain - cost.plan_stage_memory_bytes(st, st.device, in_flight, sched, holders)
            out.append(LeverCost(w, k, st.device, st.recompute, extra, saved))
    return tuple(out)


def zero_saved_bytes(cost: CostModel, plan: Plan) -> dict[str, float]:
    """Per device, the memory ZeRO saves under the plan's options (empty without ZeRO, or under a
    multi-chunk or split-backward schedule, whose memory the simulator measures)."""
    sched = plan.pipeline_schedule
    if not cost.options.zero or sched.spec.multi_chunk or sched.spec.split_backward:
        return {}
    plain = CostModel(cost.profile, cost.cluster, replace(cost.options, zero=0)).plan_memory_bytes(plan)
    sharded = cost.plan_memory_bytes(plan)
    return {d: plain[d] - sharded[d] for d in sharded}


def format_levers(levers: tuple[LeverCost, ...], zero: int, zero_saved: Mapping[str, float]) -> list[str]:
    """The lines ``partitioner explain`` prints about the memory levers (none when none is used)."""
    lines: list[str] = []
    if not levers and not zero:
        return lines
    lines.append("memory levers:")
    for lv in levers:
        what = "the attention core of its blocks" if lv.mode == "selective" else "its forward"
        saved = "" if lv.saved_bytes != lv.saved_bytes else f", {lv.saved_bytes / GIB:.2f} GiB less memory"
        lines.append(f"  worker {lv.worker} stage {lv.stage} on {lv.device}: recompute {lv.mode} ({what} again in "
                     f"each backward): +{1e3 * lv.extra_s:.3f} ms per micro-batch{saved}")
    if zero:
        parts = "optimizer state and gradients" if zero >= 2 else "optimizer state"
        if zero_saved:
            d = max(zero_saved, key=lambda x: zero_saved[x])
            lines.append(f"  ZeRO-{zero}: {parts} divided over each layer's holders: up to {zero_saved[d] / GIB:.2f} "
                         f"GiB less ({d}); the all-reduce is a reduce-scatter and an all-gather of the same volume")
        else:
            lines.append(f"  ZeRO-{zero}: {parts} divided over each layer's holders (no layer has two holders here, "
                         "or the schedule's memory is the simulator's)")
    return lines
