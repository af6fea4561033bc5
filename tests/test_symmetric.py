"""Planning over counts: equals exhaustive search on small clusters; the fleet bound holds; relabelling
interchangeable GPUs changes nothing; bad options get one line."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner.cluster import Cluster, Node
from partitioner.cost import CostModel
from partitioner.errors import FormatError
from partitioner.schedule import Schedule
from solvers.cluster.bounds.fleet import (
    fleet_bound,
    largest_layer_s,
    worker_memory_bytes,
    worker_time_bound_s,
)
from solvers.cluster.grouping import combine, search_opt
from solvers.cluster.planner import WorkerPlanner, plan_cluster, price_plan
from solvers.cluster.templates import node_classes, plan_counts
from tests._hetero_fixtures import small_cluster, synthetic_profile

TYPES = ("TITAN-V", "RTX-2060", "RTX-3090", "Quadro-P4000")


def counts_plan(cost: CostModel, devs, planner: WorkerPlanner, objective: str, k: int | None = None):
    types = sorted({d.gpu_type for d in devs})
    memory = {t: next(d for d in devs if d.gpu_type == t).memory_bytes - cost.options.reserved_bytes for t in types}
    whole = {t: cost.compute_s(t, 0, cost.num_layers) for t in types}
    return plan_counts(devs, node_classes(devs, planner.node_kind), planner.throughput, planner.exact,
                       whole.__getitem__, memory.__getitem__, worker_memory_bytes(cost, planner.schedule),
                       planner.schedule.micro_batches, cost.profile.micro_batch_size,
                       fill=True, largest_layer_s=largest_layer_s(cost, types), virtual_workers=k,
                       max_worker_gpus=len(devs), covers_all=True)


def exhaustive(devs, planner: WorkerPlanner, objective: str, ks) -> float:
    best = -math.inf
    for k in ks:
        _g, val, exact = search_opt(devs, k, planner.throughput, objective, idle=True)
        assert exact
        best = max(best, val)
    return best


# nodes of at most 2 GPUs: 2-3 node classes, up to 8 GPUs
SPECS = [
    [["TITAN-V", "TITAN-V"], ["RTX-2060", "RTX-2060"], ["TITAN-V", "TITAN-V"]],
    [["TITAN-V", "RTX-2060"], ["TITAN-V", "RTX-2060"], ["RTX-3090"], ["RTX-3090"]],
    [["RTX-2060", "RTX-2060"], ["Quadro-P4000", "Quadro-P4000"], ["RTX-3090", "RTX-3090"], ["RTX-2060", "RTX-2060"]],
]


@pytest.mark.parametrize("spec,objective", [(s, o) if (i, o) != (2, "wsp") else pytest.param(s, o, marks=pytest.mark.slow)
                                            for i, s in enumerate(SPECS) for o in ("sync", "wsp")])
def test_counts_equal_exhaustive_search(spec, objective):
    profile = synthetic_profile(10, seed=3, types=TYPES)
    cluster = small_cluster(spec, inter=2.0)
    cost = CostModel(profile, cluster)
    planner = WorkerPlanner(cost, Schedule.of("1f1b", 4))
    devs = list(cluster.devices)
    res = counts_plan(cost, devs, planner, objective)
    want = exhaustive(devs, planner, objective, range(1, len(devs) + 1))
    assert res is not None
    assert res.value == pytest.approx(want, rel=1e-9)
    assert combine([planner.throughput(w) for w in res.grouping], objective) == pytest.approx(want, rel=1e-9)
    used = [d.name for w in res.grouping for d in w]  # each GPU at most once (a slow one may stay idle)
    assert len(used) == len(set(used)) and set(used) <= {d.name for d in devs}
    assert res.details["template_set"] == "complete"


@pytest.mark.parametrize("k", [2, 3])
def test_counts_equal_exhaustive_search_fixed_k(k):
    profile = synthetic_profile(10, seed=5, types=TYPES)
    cluster = small_cluster(SPECS[1], inter=2.0)
    cost = CostModel(profile, cluster)
    planner = WorkerPlanner(cost, Schedule.of("1f1b", 4))
    devs = list(cluster.devices)
    res = counts_plan(cost, devs, planner, "sync", k)
    assert res is not None and len(res.grouping) == k
    assert res.value == pytest.approx(exhaustive(devs, planner, "sync", [k]), rel=1e-9)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=st.lists(st.lists(st.sampled_from(TYPES), min_size=1, max_size=2), min_size=2, max_size=3),
       seed=st.integers(0, 50), m=st.integers(1, 6), objective=st.sampled_from(["sync", "wsp"]),
       param_mb=st.sampled_from([20.0, 400.0]))
def test_fleet_bound_is_never_below_the_best_grouping(spec, seed, m, objective, param_mb):
    """The bound against exhaustive search over every grouping (each worker mapped exactly),
    priced by the cost model's closed form (``price_plan``)."""
    profile = synthetic_profile(8, seed=seed, types=TYPES, param_mb=param_mb)
    cluster = small_cluster(spec, inter=2.0)
    cost = CostModel(profile, cluster)
    planner = WorkerPlanner(cost, Schedule.of("1f1b", m))
    devs = list(cluster.devices)
    per_k = {k: exhaustive(devs, planner, objective, [k]) for k in range(1, len(devs) + 1)}
    best = max(per_k.values())
    bound = fleet_bound(cost, devs, Schedule.of("1f1b", m))
    assert bound.samples_per_s <= bound.perfect_speedup * (1 + 1e-12)
    if best > -math.inf:
        assert bound.samples_per_s >= best * (1 - 1e-9)
    for k, at_k in per_k.items():  # with K fixed
        if at_k > -math.inf:
            assert fleet_bound(cost, devs, Schedule.of("1f1b", m), virtual_workers=k).samples_per_s >= at_k * (1 - 1e-9)
    res = plan_cluster(profile, cluster, "auto", "opt", objective=objective, micro_batches=m, time_limit_s=30)
    if res.plan is not None:  # the certified gap is never negative
        assert price_plan(cost, res.plan, objective)["samples_per_s"] <= bound.samples_per_s * (1 + 1e-9)


def test_worker_time_bound_homogeneous_and_below_the_dp():
    # p equal GPUs: the familiar (m - 1 + p) T / p
    assert worker_time_bound_s([2.0] * 4, 8) == pytest.approx((8 - 1 + 4) * 2.0 / 4)
    # no flush: m / S
    assert worker_time_bound_s([2.0, 2.0], 8, fill=False) == pytest.approx(8 * 1.0)
    # a slow GPU never makes the bound larger (it may be left a small share)
    assert worker_time_bound_s([1.0, 9.0], 8) <= worker_time_bound_s([1.0], 8)


def relabelled(cluster: Cluster, order: list[int]) -> Cluster:
    nodes = [cluster.nodes[i] for i in order]
    return Cluster(cluster.name, tuple(Node(f"x{j}", n.gpus, n.intra_gbps) for j, n in enumerate(nodes)),
                   cluster.inter_gbps)


@pytest.mark.parametrize("objective", ["sync", pytest.param("wsp", marks=pytest.mark.slow)])
def test_relabelling_gpus_changes_nothing(objective):
    # small enough that every search ends long before its time limit (a search cut by the clock
    # could stop at different points for two labellings)
    profile = synthetic_profile(12, seed=2, types=TYPES)
    spec = [["TITAN-V"] * 2, ["RTX-2060"] * 2, ["TITAN-V"], ["RTX-3090"]]
    cluster = small_cluster(spec, inter=4.0)
    base = plan_cluster(profile, cluster, "auto", "opt", objective=objective, time_limit_s=30)
    for order in ([3, 2, 1, 0], [2, 0, 3, 1]):
        other = plan_cluster(profile, relabelled(cluster, order), "auto", "opt", objective=objective,
                             time_limit_s=30)
        assert other.objective == pytest.approx(base.objective, rel=1e-9)
        assert other.lower_bound == pytest.approx(base.lower_bound, rel=1e-9)


def test_large_cluster_plans_by_counts_within_the_bound():
    profile = synthetic_profile(40, seed=1, types=TYPES, param_mb=20.0)
    spec = [[TYPES[i % 4]] * 8 for i in range(8)]
    cluster = small_cluster(spec, inter=8.0)
    res = plan_cluster(profile, cluster, "auto", "opt", time_limit_s=20)
    assert res.details["template_set"] == "chains"
    assert 0.0 <= res.gap < 0.25
    assert res.plan is not None and len(res.plan.virtual_workers) == res.details["virtual_workers"]


@pytest.mark.parametrize(("kwargs", "field"), [({"time_limit_s": 0}, "time_limit_s"),
                                               ({"time_limit_s": -1.0}, "time_limit_s"),
                                               ({"virtual_workers": 17}, "virtual_workers")])
def test_bad_options_are_one_line(kwargs, field):
    profile = synthetic_profile(12)
    cluster = small_cluster([["TITAN-V"] * 4] * 4)
    args = {"virtual_workers": "auto", **kwargs}
    with pytest.raises(FormatError) as err:
        plan_cluster(profile, cluster, args.pop("virtual_workers"), "opt", **args)
    assert err.value.field == field and "\n" not in str(err.value)


@pytest.mark.parametrize("objective", ["sync", "wsp"])
@pytest.mark.parametrize("param_mb", [20.0, 900.0])
def test_one_type_bound_in_closed_form_holds(objective, param_mb):
    profile = synthetic_profile(8, seed=4, types=TYPES, param_mb=param_mb)
    cluster = small_cluster([["RTX-2060"] * 2, ["RTX-2060"] * 2, ["RTX-2060"] * 2])
    cost = CostModel(profile, cluster)
    planner = WorkerPlanner(cost, Schedule.of("1f1b", 4))
    devs = list(cluster.devices)
    for k in range(1, len(devs) + 1):
        at_k = exhaustive(devs, planner, objective, [k])
        bound = fleet_bound(cost, devs, Schedule.of("1f1b", 4), virtual_workers=k).samples_per_s
        assert bound >= at_k * (1 - 1e-9) if at_k > -math.inf else bound >= 0
    best = exhaustive(devs, planner, objective, range(1, len(devs) + 1))
    assert fleet_bound(cost, devs, Schedule.of("1f1b", 4)).samples_per_s >= best * (1 - 1e-9)


def test_the_planner_linear_programs_give_optimal_primal_and_dual_solutions() -> None:
    """solvers.cluster.lp (GLOP): max w.x s.t. a x <= cap, x >= 0, against its dual min cap.y s.t. a^T y >= w:
    equal objectives (strong duality), and the dual's row duals a primal optimum."""
    import numpy as np

    from solvers.cluster.lp import linprog

    rng = np.random.default_rng(3)
    for _ in range(30):
        m, n = int(rng.integers(2, 6)), int(rng.integers(2, 12))
        a = rng.integers(0, 4, (m, n)).astype(float)
        a[:, a.sum(axis=0) == 0] = 1.0  # every column uses something: the primal is bounded
        cap, w = rng.integers(3, 20, m).astype(float), rng.uniform(0.1, 2.0, n)
        primal = linprog(-w, a, cap)
        dual = linprog(cap, -a.T, -w)
        assert primal.ok and dual.ok
        assert -primal.fun == pytest.approx(dual.fun, rel=1e-9, abs=1e-9)
        x = np.maximum(-dual.ub_duals, 0.0)
        assert np.all(a @ x <= cap + 1e-9) and w @ x == pytest.approx(dual.fun, rel=1e-9, abs=1e-9)
    assert not linprog(np.array([1.0]), np.array([[1.0]]), np.array([-1.0])).ok  # x >= 0, x <= -1


def test_a_linear_program_without_an_answer_leaves_a_valid_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """The solver giving up is not infeasibility: the bound falls back to the perfect speed-up."""
    import numpy as np

    import solvers.cluster.lp as lp

    profile = synthetic_profile(8, seed=1, types=TYPES, param_mb=20.0)
    cluster = small_cluster([["TITAN-V"], ["TITAN-V", "RTX-2060"]], inter=2.0)
    cost = CostModel(profile, cluster)
    devs = list(cluster.devices)
    real = fleet_bound(cost, devs, Schedule.of("1f1b", 2))
    monkeypatch.setattr(lp, "linprog", lambda c, *a, **k: lp.LpResult("failed", np.zeros(len(c)), math.nan,
                                                                      np.zeros(0)))
    fallback = fleet_bound(cost, devs, Schedule.of("1f1b", 2))
    assert fallback.samples_per_s == fallback.perfect_speedup >= real.samples_per_s


def test_links_priced_by_node_kinds_leave_nodes_interchangeable():
    """Overrides per pair of GPU types (as a cluster measured per type pair) single out no node, so
    equivalent workers share one mapping; one override that breaks the pattern pins every end."""
    from partitioner.cluster import Link
    from solvers.cluster.planner import pinned_link_ends

    spec = [["TITAN-V"] * 2, ["TITAN-V"] * 2, ["RTX-2060"] * 2, ["RTX-2060"] * 2]
    base = small_cluster(spec, inter=4.0)
    by_kinds = tuple(Link(a, b, 2.0) for a in ("n0", "n1") for b in ("n2", "n3"))
    cluster = Cluster(base.name, base.nodes, base.inter_gbps, links=by_kinds)
    assert pinned_link_ends(cluster) == frozenset()
    planner = WorkerPlanner(CostModel(synthetic_profile(8, types=TYPES), cluster), Schedule.of("1f1b", 4))
    dev = {d.name: d for d in cluster.devices}
    a = [dev["n0:0"], dev["n2:0"]]
    b = [dev["n1:1"], dev["n3:1"]]
    assert planner.key(a) == planner.key(b) and planner.interchangeable(a)
    # one pair priced apart: n0 and n2 are no longer like n1 and n3
    odd = Cluster(base.name, base.nodes, base.inter_gbps, links=(*by_kinds[:-1], Link("n1", "n3", 3.0)))
    assert pinned_link_ends(odd) == frozenset({"n0", "n1", "n2", "n3"})
    apart = WorkerPlanner(CostModel(synthetic_profile(8, types=TYPES), odd), Schedule.of("1f1b", 4))
    assert apart.key(a) != apart.key(b)
    # and the same mapping, relabelled, prices the same on both sets
    ra, rb = planner.stages(a), planner.stages(b)
    assert ra.throughput == rb.throughput and {s.device for s in rb.stages} <= {d.name for d in b}


def test_nodes_behind_like_nics_stay_interchangeable():
    """Shared NICs price a worker alone as they price it on any node of the same kind (its NICs
    included), so overrides per type pair still single out no node; a node with another NIC is a
    kind of its own."""
    from dataclasses import replace as _replace

    from partitioner.cluster import Link
    from solvers.cluster.planner import pinned_link_ends

    spec = [["TITAN-V"] * 2, ["TITAN-V"] * 2, ["RTX-2060"] * 2, ["RTX-2060"] * 2]
    base = small_cluster(spec, inter=4.0)
    nics = tuple(_replace(n, nic_gbps=3.0) for n in base.nodes)
    by_kinds = tuple(Link(a, b, 2.0) for a in ("n0", "n1") for b in ("n2", "n3"))
    cluster = Cluster(base.name, nics, base.inter_gbps, links=by_kinds)
    assert cluster.has_nics and pinned_link_ends(cluster) == frozenset()
    planner = WorkerPlanner(CostModel(synthetic_profile(8, types=TYPES), cluster), Schedule.of("1f1b", 4))
    dev = {d.name: d for d in cluster.devices}
    a, b = [dev["n0:0"], dev["n2:0"]], [dev["n1:1"], dev["n3:1"]]
    assert planner.key(a) == planner.key(b)
    ra, rb = planner.stages(a), planner.stages(b)
    assert ra.throughput == rb.throughput and {s.device for s in rb.stages} <= {d.name for d in b}
    odd = Cluster(base.name, (*nics[:3], _replace(nics[3], nic_gbps=1.0)), base.inter_gbps, links=by_kinds)
    assert pinned_link_ends(odd) == frozenset()  # the links still go by kinds: n3 is a kind of its own
    apart = WorkerPlanner(CostModel(synthetic_profile(8, types=TYPES), odd), Schedule.of("1f1b", 4))
    assert apart.key(a) != apart.key(b)
