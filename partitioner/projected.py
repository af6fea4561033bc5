"""How much of a plan's prediction rests on projected layer times, and whether its choices would
survive them being off by their expected error.

A profile holds measured times for the GPU types someone ran it on and projected ones for the
others (``LayerTime.projected``; the per-operator projection gives each its ``expected_error``,
the per-layer roofline none). A plan balanced on projected times is only as good as they are.
:func:`projected_times` sums, per device kind of a plan, the share of its compute seconds that
are projected and their time-weighted expected error, then prices the plan again (closed form)
with every projected time moved by its expected error, all of them down and all of them up: the
range of the iteration time that follows, and whether the bottleneck stage moves (the split
then rests on projected numbers). A projected time without an expected error is taken at
:data:`UNKNOWN_PROJECTION_ERROR`, the per-layer roofline's median error between Sailor's seven
measured GPU types (docs/profiling.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .cluster import Cluster
from .cost import CostModel
from .errors import FormatError
from .plan import Plan
from .pricing import CostOptions
from .profile import LayerProfile, LayerTime, Profile

__all__ = ["UNKNOWN_PROJECTION_ERROR", "ProjectedTimes", "format_projected", "projected_times"]

UNKNOWN_PROJECTION_ERROR = 0.356  # the per-layer roofline's median error, leave one type out (docs/profiling.md)


@dataclass(frozen=True)
class ProjectedTimes:
    """Per device kind of a plan (``TYPE`` or ``TYPE@tpT``): ``share`` of its compute seconds that
    are projected, and their time-weighted ``expected_error``; the closed form's iteration now and
    with every projected time ``(1 - e)`` and ``(1 + e)`` times itself; the bottleneck stage
    (worker, stage) now and in those two cases."""

    share: Mapping[str, float] = field(default_factory=dict)
    expected_error: Mapping[str, float] = field(default_factory=dict)
    iteration_s: float = 0.0
    low_s: float = 0.0
    high_s: float = 0.0
    bottleneck: tuple[int, int] = (0, 0)
    bottleneck_low: tuple[int, int] = (0, 0)
    bottleneck_high: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        for name in ("share", "expected_error"):
            for k, v in getattr(self, name).items():
                if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                    raise FormatError(f"{name}.{k}", v, "must be a finite number >= 0")
        if not 0 <= self.low_s <= self.iteration_s <= self.high_s:
            raise FormatError("iteration_s", self.iteration_s, f"must lie in [low_s, high_s] = [{self.low_s}, "
                              f"{self.high_s}]")

    @property
    def any(self) -> bool:
        """Whether any of the plan's compute rests on projected times."""
        return any(v > 0 for v in self.share.values())

    @property
    def bottleneck_moves(self) -> bool:
        """Whether the bottleneck stage would be another one with the projected times off."""
        return self.bottleneck_low != self.bottleneck or self.bottleneck_high != self.bottleneck

    def to_dict(self) -> dict[str, Any]:
        return {"share": {k: round(v, 4) for k, v in self.share.items()},
                "expected_error": {k: round(v, 4) for k, v in self.expected_error.items()},
                "iteration_s": self.iteration_s, "low_s": self.low_s, "high_s": self.high_s,
                "bottleneck": list(self.bottleneck), "bottleneck_low": list(self.bottleneck_low),
                "bottleneck_high": list(self.bottleneck_high)}

    @classmethod
    def from_dict(cls, d: Any) -> ProjectedTimes:
        if not isinstance(d, Mapping):
            raise FormatError("projected_times", d, "must be an object")
        try:
            return cls(dict(d.get("share", {})), dict(d.get("expected_error", {})), float(d["iteration_s"]),
                       float(d["low_s"]), float(d["high_s"]), _pair(d["bottleneck"]), _pair(d["bottleneck_low"]),
                       _pair(d["bottleneck_high"]))
        except (KeyError, TypeError, ValueError) as err:
            raise FormatError("projected_times", str(err)[:60], "must hold share, expected_error, iteration_s, "
                              "low_s, high_s and the three bottlenecks") from None


def _pair(v: Any) -> tuple[int, int]:
    a, b = v
    return int(a), int(b)


def _error(t: LayerTime) -> float:
    return t.expected_error if t.expected_error is not None else UNKNOWN_PROJECTION_ERROR


def _moved(t: LayerTime, sign: int) -> LayerTime:
    if not t.projected:
        return t
    f = max(0.0, 1.0 + sign * _error(t))
    return replace(t, fwd_s=t.fwd_s * f, bwd_s=t.bwd_s * f)


def _moved_layer(layer: LayerProfile, sign: int) -> LayerProfile:
    shards = {k: replace(sh, times={g: _moved(t, sign) for g, t in sh.times.items()}) for k, sh in layer.shards.items()}
    return replace(layer, times={g: _moved(t, sign) for g, t in layer.times.items()}, shards=shards)


def _bottleneck(cost: CostModel, plan: Plan) -> tuple[tuple[int, int], float]:
    best, worst = (0, 0), -1.0
    for w in range(len(plan.virtual_workers)):
        for k, t in enumerate(cost.plan_stage_times_s(plan, w)):
            if t > worst:
                best, worst = (w, k), t
    return best, cost.plan_iteration_s(plan)


def _shares(profile: Profile, cost: CostModel, plan: Plan) -> tuple[dict[str, float], dict[str, float]]:
    total: dict[str, float] = {}
    projected: dict[str, float] = {}
    weighted: dict[str, float] = {}
    for vw in plan.virtual_workers:
        for st in vw.stages:
            for d in st.devices:
                dev = cost.cluster.device(d)
                view = profile.shard(dev.tensor_parallel) if dev.tensor_parallel > 1 else profile
                key = cost.times_key(dev.gpu_type)
                for layer in view.layers[st.start:st.stop]:
                    t = layer.times.get(key)
                    if t is None:
                        continue
                    s = t.fwd_s + t.bwd_s
                    total[dev.kind] = total.get(dev.kind, 0.0) + s
                    if t.projected:
                        projected[dev.kind] = projected.get(dev.kind, 0.0) + s
                        weighted[dev.kind] = weighted.get(dev.kind, 0.0) + s * _error(t)
    share = {k: projected.get(k, 0.0) / v if v > 0 else 0.0 for k, v in total.items()}
    error = {k: weighted[k] / projected[k] for k in projected if projected[k] > 0}
    return share, error


def projected_times(plan: Plan, profile: Profile, cluster: Cluster, options: CostOptions | None = None
                    ) -> ProjectedTimes:
    """What of ``plan``'s prediction rests on projected times (see the module docstring);
    ``profile`` is the one the plan was made from (at the plan's micro-batch size)."""
    options = options or plan.cost_options() or CostOptions()
    profile = plan.profile_view(profile)
    cost = CostModel(profile, cluster, options)
    share, error = _shares(profile, cost, plan)
    now, it = _bottleneck(cost, plan)
    if not any(v > 0 for v in share.values()):
        return ProjectedTimes(share, error, it, it, it, now, now, now)
    out = []
    for sign in (-1, 1):
        moved = replace(profile, layers=tuple(_moved_layer(layer, sign) for layer in profile.layers))
        out.append(_bottleneck(CostModel(moved, cluster, options), plan))
    (b_low, low), (b_high, high) = out
    return ProjectedTimes(share, error, it, min(low, it), max(high, it), now, b_low, b_high)


def format_projected(p: ProjectedTimes) -> list[str]:
    """The lines ``plan`` and ``explain`` print about a plan's projected times (none when every
    time it uses was measured)."""
    if not p.any:
        return []
    kinds = sorted(k for k, v in p.share.items() if v > 0)
    parts = ", ".join(f"{k} {100 * p.share[k]:.0f} % (+-{100 * p.expected_error.get(k, 0):.0f} %)" for k in kinds)
    lines = [f"projected times (share of each type's compute, expected error): {parts}; with every projected "
             f"time off by its error the iteration is {p.low_s:.3g}-{p.high_s:.3g} s ({p.iteration_s:.3g} s as "
             "projected)"]
    if p.bottleneck_moves:
        moved = sorted({b for b in (p.bottleneck_low, p.bottleneck_high) if b != p.bottleneck})
        where = ", ".join(f"worker {w} stage {k}" for w, k in moved)
        lines.append(f"warning: the split rests on projected times: off by their expected error, they move the "
                     f"bottleneck from worker {p.bottleneck[0]} stage {p.bottleneck[1]} to {where}; profile "
                     f"{', '.join(kinds)} to plan on measured times")
    return lines
