"""What of a plan's prediction rests on projected layer times (partitioner/projected.py)."""

from __future__ import annotations

import pytest

from partitioner.cluster import Cluster, DeviceType, Node
from partitioner.cost import CostModel
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.projected import (
    UNKNOWN_PROJECTION_ERROR,
    ProjectedTimes,
    format_projected,
    projected_times,
)

GIB = 2**30
OPTS = CostOptions(reserved_bytes=0.0, sync=False)


def _profile(fast: float, err: float | None) -> Profile:
    """Four layers: 'meas' measured at 1 s each, 'proj' projected at ``fast`` s (error ``err``)."""
    layers = tuple(LayerProfile(f"l{i}", param_bytes=1e6, saved_bytes=1e6, output_bytes=1e3,
                                times={"meas": LayerTime(0.5, 0.5),
                                       "proj": LayerTime(fast / 2, fast / 2, projected=True, expected_error=err)})
                   for i in range(4))
    return Profile("m", 1, layers)


def _cluster() -> Cluster:
    types = {t: DeviceType(t, 16 * GIB, 1e14, 1e12) for t in ("meas", "proj")}
    return Cluster("c", (Node("n0", ("meas", "proj"), 100.0),), 10.0, types)


def _plan(cut: int) -> Plan:
    return Plan("m", (VirtualWorker((Stage((0, cut), "n0:0"), Stage((cut, 4), "n0:1"))),), "1f1b", 1, 4)


def test_shares_errors_and_the_range_follow_the_projected_times() -> None:
    cl, plan = _cluster(), _plan(2)
    p = projected_times(plan, _profile(1.0, 0.1), cl, OPTS)
    assert p.share == {"meas": 0.0, "proj": 1.0} and p.expected_error == pytest.approx({"proj": 0.1})
    # the projected stage moved by +-10 %: the closed form's iteration at those times, exactly
    for sign, got in ((-1, p.low_s), (1, p.high_s)):
        moved = _profile(1.0 * (1 + sign * 0.1), 0.1)
        assert got == pytest.approx(max(CostModel(moved, cl, OPTS).plan_iteration_s(plan),
                                        p.iteration_s) if sign > 0 else
                                    min(CostModel(moved, cl, OPTS).plan_iteration_s(plan), p.iteration_s))
    assert p.low_s <= p.iteration_s <= p.high_s
    assert ProjectedTimes.from_dict(p.to_dict()) == ProjectedTimes.from_dict(p.to_dict())
    unknown = projected_times(plan, _profile(1.0, None), cl, OPTS)
    assert unknown.expected_error == pytest.approx({"proj": UNKNOWN_PROJECTION_ERROR})


def test_a_balance_within_the_error_warns_that_the_split_rests_on_projected_times() -> None:
    cl, plan = _cluster(), _plan(2)
    # both stages equal as projected: +-20 % on the projected type moves the bottleneck
    p = projected_times(plan, _profile(1.0, 0.2), cl, OPTS)
    assert p.bottleneck_moves
    assert any(line.startswith("warning: the split rests on projected times") for line in format_projected(p))
    # the measured stage far slower: a 20 % error on the projected one changes nothing
    q = projected_times(_plan(3), _profile(0.5, 0.2), cl, OPTS)
    assert not q.bottleneck_moves
    # the projected stage (0.5 s per micro-batch) is only in the pipeline's fill: +-20 % of it once
    assert q.high_s - q.low_s == pytest.approx(2 * 0.2 * 0.5)
    assert not any(line.startswith("warning") for line in format_projected(q))


def test_a_plan_on_measured_times_says_nothing() -> None:
    cl = _cluster()
    plan = Plan("m", (VirtualWorker((Stage((0, 4), "n0:0"),)),), "1f1b", 1, 4)
    p = projected_times(plan, _profile(1.0, 0.1), cl, OPTS)
    assert not p.any and format_projected(p) == []


def test_plan_records_and_explain_prints_the_projected_share() -> None:
    from solvers.analysis.explain import explain_plan, format_explanation
    from solvers.planning import PlanRequest, plan

    cl, prof = _cluster(), _profile(1.0, 0.2)
    res = plan(prof, cl, PlanRequest(solver="dp", options=OPTS, micro_batches=4))
    assert res.ok and res.plan is not None
    rec = ProjectedTimes.from_dict(res.plan.meta["projected_times"])
    assert rec.share["proj"] == 1.0
    assert any(m.startswith("projected times") for m in res.details["messages"])
    text = format_explanation(explain_plan(res.plan, prof, cl, OPTS, what_if=False))
    assert "projected times (" in text
