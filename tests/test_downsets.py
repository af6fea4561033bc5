"""The default planning of a graph profile (the solver named dp): convex stages of the graph by
the DP over its down-sets, against exhaustive enumeration of convex partitions, the chain order
on request, and PipeDream's ResNet-50 at its known optimum."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings

from partitioner.cluster import Cluster, Node
from partitioner.cost import CostModel
from partitioner.plan import Plan
from solvers import SolveStatus, solve
from solvers.pipeline import dp
from solvers.pipeline.downsets import MAX_DOWN_SETS, down_sets
from solvers.planning import PlanRequest, plan

from .conftest import big_type
from .test_dag import dags, enumerate_best, graph_profile, stage_time_s


def _stages_of(plan_: Plan, n: int) -> list[int]:
    stages = [0] * n
    order = plan_.layer_order or tuple(range(n))
    for k, s in enumerate(plan_.virtual_workers[0].stages):
        for pos in range(s.start, s.stop):
            stages[order[pos]] = k
    return stages


def _check_plan(r, profile, cluster, options, truth: float, optimal) -> None:
    assert r.status is SolveStatus.OPTIMAL, r.reason
    assert r.objective == pytest.approx(truth, rel=1e-9, abs=1e-15)
    assert r.lower_bound == r.objective
    view = r.plan.profile_view(profile)
    cost = CostModel(view, cluster, options)
    r.plan.validate(profile, cluster)
    cost.check_plan_memory(r.plan)
    assert max(cost.plan_stage_times_s(r.plan)) == pytest.approx(r.objective, rel=1e-12, abs=1e-15)
    stages = _stages_of(r.plan, profile.num_layers)
    assert all(stages[a] <= stages[b] for a, b in profile.edges)
    devices = [cluster.device(s.device) for s in r.plan.virtual_workers[0].stages]
    least = min(math.fsum(stage_time_s(profile, cluster, list(s), k, devices, options) for k in range(len(devices)))
                for s in optimal)
    assert math.fsum(cost.plan_stage_times_s(r.plan)) <= least * (1 + 1e-9) + 1e-15


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_default_plan_of_a_graph_equals_exhaustive_enumeration(inst):
    """The default solver's bottleneck is the least over every convex partition that fits (and its
    total stage time the least among those optima); infeasible exactly when none fits."""
    profile, cluster, schedule, m, options = inst
    devices = list(cluster.devices)
    truth, optimal = enumerate_best(profile, cluster, devices, schedule, m, options)
    r = solve(profile, cluster, solver="dp", schedule=schedule, micro_batches=m, options=options)
    if math.isinf(truth):
        assert r.status is SolveStatus.INFEASIBLE and r.plan is None and r.reason
        return
    _check_plan(r, profile, cluster, options, truth, optimal)
    # never worse than the chain order, which stays available
    chain = solve(profile, cluster, solver="dp", schedule=schedule, micro_batches=m, options=options, dag=False)
    plain = dp.solve(profile, cluster, schedule=schedule, micro_batches=m, options=options)
    assert chain.status == plain.status
    if chain.ok:
        assert chain.objective == plain.objective and chain.plan.layer_order is None
        assert r.objective <= chain.objective * (1 + 1e-12)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_allow_fewer_on_a_graph_is_the_best_prefix(inst):
    profile, cluster, schedule, m, options = inst
    devices = list(cluster.devices)
    found = [(q, *enumerate_best(profile, cluster, devices[:q], schedule, m, options))
             for q in range(1, len(devices) + 1)]
    _q, truth, optimal = min(found, key=lambda x: (x[1], x[0]))
    r = solve(profile, cluster, solver="dp", schedule=schedule, micro_batches=m, options=options, allow_fewer=True)
    if math.isinf(truth):
        assert r.status is SolveStatus.INFEASIBLE
        return
    _check_plan(r, profile, cluster, options, truth, [s for qq, t, opt in found if t == truth for s in opt
                                                       if qq == len(r.plan.virtual_workers[0].stages)] or optimal)


def test_resnet50_over_16_gpus_reaches_the_down_set_optimum(pipedream_dir):
    """PipeDream's ResNet-50 over 16 identical GPUs with transfers free (its straight-pipeline
    setting): the chain order's best is 29.688 ms, convex stages reach 29.642 ms, the optimum of
    the down-set DP of bench/ilp.py."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench.ilp import cluster_of, downset_optimum, load

    prof, cluster = load("resnet50", True), cluster_of(16, True)
    r = solve(prof, cluster, solver="dp", micro_batches=16)
    chain = solve(prof, cluster, solver="dp", micro_batches=16, dag=False)
    assert r.objective == pytest.approx(downset_optimum(prof, 16), rel=1e-9)
    assert r.objective * 1e3 == pytest.approx(29.642, abs=5e-4)
    assert chain.objective * 1e3 == pytest.approx(29.688, abs=5e-4)
    assert r.details["order"] == "graph" and r.plan.layer_order is not None
    assert chain.plan.layer_order is None


def test_down_sets_of_small_graphs():
    assert down_sets(3, [(0, 1), (1, 2)]) == [0, 1, 3, 7]
    assert down_sets(3, [(0, 1), (0, 2)]) == [0, 1, 3, 5, 7]
    assert down_sets(4, [(0, 1), (0, 2), (0, 3)], limit=5) is None


def test_a_graph_with_too_many_down_sets_is_planned_on_its_chain_with_a_note():
    n = 24  # a source, 22 parallel layers, a sink: 2**22 down-sets
    edges = [(0, v) for v in range(1, n - 1)] + [(v, n - 1) for v in range(1, n - 1)]
    prof = graph_profile(n, edges, [1e6] * n, {"gA": [1e-3] * n})
    cluster = Cluster("c", (Node("n0", ("gA",) * 4, 10.0),), 1.0, {"gA": big_type("gA")})
    assert MAX_DOWN_SETS < 2**22
    r = solve(prof, cluster, solver="dp")
    assert r.ok and r.plan.layer_order is None and r.details["order"] == "chain"
    assert "down-sets" in r.details["messages"][0]


def test_chain_order_is_accepted_by_every_planner_and_other_planners_say_they_split_the_chain():
    prof = graph_profile(6, [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (4, 5)], [1e6] * 6,
                         {"gA": [1e-3, 2e-3, 5e-3, 1e-3, 1e-3, 2e-3]})
    cluster = Cluster("c", (Node("n0", ("gA",) * 4, 10.0),), 1.0, {"gA": big_type("gA")})
    for solver in ("dp", "uniform"):
        quiet = plan(prof, cluster, PlanRequest(solver=solver, chain_order=True))
        assert quiet.ok and quiet.plan.layer_order is None and not quiet.details.get("messages")
    noted = plan(prof, cluster, PlanRequest(solver="uniform"))
    assert "splits the profile's layer order" in noted.details["messages"][0]
    graph = plan(prof, cluster, PlanRequest(solver="dp", devices=("n0:0", "n0:1")))
    chain = plan(prof, cluster, PlanRequest(solver="dp", devices=("n0:0", "n0:1"), chain_order=True))
    assert graph.objective <= chain.objective and not graph.details.get("messages")


def test_a_chain_shaped_graph_plans_as_the_chain(pipedream_dir):
    """VGG-16 (every edge from one layer to the next): the same plan as the chain DP."""
    from partitioner.importers.pipedream import import_pipedream

    prof = import_pipedream(pipedream_dir / "vgg16.txt", gpu_type="V100")
    prof = dataclasses.replace(prof)
    cluster = Cluster("same", (Node("n0", ("V100",) * 4, 10.0),), 1.0, {"V100": big_type("V100")})
    r = solve(prof, cluster, solver="dp", micro_batches=4)
    chain = dp.solve(prof, cluster, micro_batches=4)
    assert r.objective == chain.objective and r.plan.layer_order is None
    assert [s.layers for s in r.plan.virtual_workers[0].stages] == [s.layers for s in chain.plan.virtual_workers[0].stages]


def test_a_graph_without_own_output_bytes_is_planned_on_its_chain_with_a_note():
    """An older import (no own_output_bytes) plans as before, and says why."""
    prof = graph_profile(6, [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (4, 5)], [1e6] * 6, {"gA": [1e-3] * 6})
    old = dataclasses.replace(prof, layers=tuple(dataclasses.replace(x, own_output_bytes=None) for x in prof.layers))
    cluster = Cluster("c", (Node("n0", ("gA",) * 3, 10.0),), 1.0, {"gA": big_type("gA")})
    r = solve(old, cluster, solver="dp")
    assert r.ok and r.plan.layer_order is None and r.objective == dp.solve(old, cluster).objective
    assert "own_output_bytes" in r.details["messages"][0]
