"""Joint device mapping + split (CP-SAT and CBC) against every label order priced by the exact DP."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner.cluster import Cluster, DeviceType, Node
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.schedule import Schedule
from solvers import SolveStatus
from solvers.exact.intervals import prepare
from solvers.exact.joint import joint_data
from solvers.exact.joint_bound import relaxed_plan
from solvers.exact.router import solve_cbc, solve_cpsat
from solvers.pipeline.dp import chain_dp
from solvers.pipeline.mapping import device_labels

GIB = 2**30
TYPES = ("gA", "gB", "gC")


def brute_force(profile, cluster, schedule, m, options, allow_fewer):
    """Least bottleneck over every order of every usable set of devices (each distinct label
    sequence once), split by the exact DP; inf if nothing fits."""
    cost = CostModel(profile, cluster, options)
    devices = list(cluster.devices)
    labels = device_labels(cost, devices)
    lengths = range(1, min(len(devices), profile.num_layers) + 1) if allow_fewer else [len(devices)]
    best, seen = math.inf, set()
    for q in lengths:
        if q > profile.num_layers:
            continue
        for perm in itertools.permutations(range(len(devices)), q):
            key = tuple(labels[i] for i in perm)
            if key in seen:
                continue
            seen.add(key)
            sol = chain_dp(cost, [devices[i] for i in perm], Schedule.of(schedule, m), refine=False)
            if sol is not None:
                best = min(best, sol.bottleneck_s)
    return best


@st.composite
def instances(draw):
    n_layers = draw(st.integers(1, 8))
    n_dev = draw(st.integers(2, 5))
    mem = {t: draw(st.integers(2, 40)) * 0.1 * GIB for t in TYPES}
    types = {t: DeviceType(t, mem[t], 1e13, 1e11) for t in TYPES}
    unit = 1e-5 * draw(st.sampled_from([1.0, 0.7071067811865476]))
    layers = []
    for i in range(n_layers):
        times = {t: LayerTime(draw(st.integers(0, 1000)) * unit, draw(st.integers(0, 2000)) * unit) for t in TYPES}
        layers.append(LayerProfile(f"l{i}", 0.0, draw(st.integers(0, 100)) * 1e6, draw(st.integers(0, 200)) * 1e6,
                                   draw(st.integers(0, 400)) * 1e6, times))
    gpus = [draw(st.sampled_from(TYPES[:draw(st.integers(2, 3))])) for _ in range(n_dev)]
    split = draw(st.integers(1, n_dev))
    nodes = [Node("n0", tuple(gpus[:split]), draw(st.sampled_from([8.0, 16.0, 50.0])))]
    if split < n_dev:
        nodes.append(Node("n1", tuple(gpus[split:]), draw(st.sampled_from([16.0, 2.0]))))
    cluster = Cluster("c", tuple(nodes), draw(st.sampled_from([1.0, 5.0])), types)
    schedule = draw(st.sampled_from(["1f1b", "gpipe", "2bw", "wsp"]))
    m = draw(st.integers(1, 6))
    options = CostOptions(overlap_comm=draw(st.booleans()), reserved_bytes=0.05 * GIB)
    return (Profile("m", 1, tuple(layers)), cluster, schedule, m, options, draw(st.booleans()), draw(st.booleans()),
            draw(st.booleans()))


def _check(inst):
    profile, cluster, schedule, m, options, allow_fewer, hint, relax = inst
    want = brute_force(profile, cluster, schedule, m, options, allow_fewer)
    kw = dict(schedule=schedule, micro_batches=m, options=options, allow_fewer=allow_fewer, hint=hint,
              time_limit_s=30.0, relaxation=relax)
    cost = CostModel(profile, cluster, options)
    results = [solve_cpsat(profile, cluster, **kw), solve_cbc(profile, cluster, **kw)]
    for r in results:
        if len(set(device_labels(cost, cluster.devices))) > 1:
            assert r.details["mapping"] == "model"
        if math.isinf(want):
            assert r.status is SolveStatus.INFEASIBLE, (r.method, r.objective)
            continue
        assert r.status is SolveStatus.OPTIMAL, (r.method, r.status, r.reason)
        assert r.lower_bound <= want * (1 + 1e-9) + 1e-12
        cost.validate_plan(r.plan)
        assert max(cost.plan_stage_times_s(r.plan)) == pytest.approx(r.objective, rel=1e-12, abs=1e-15)
        if r.details.get("proof") == "bound":  # a plan that meets the relaxation's bound: no model solved
            assert r.objective == pytest.approx(want, rel=1e-9, abs=1e-15)
        elif r.method == "cpsat":
            assert "tick_s" in r.details or not relax
            tick, rounding = r.details["tick_s"], r.details.get("rounding_ticks", 1)
            assert r.objective == pytest.approx(want, rel=0, abs=rounding * tick + 1e-15)
            if r.details["mapping"] == "model":  # the model prices the realised plan within its rounding, never above
                assert -1e-15 <= r.objective - r.details["model_objective_s"] <= rounding * tick
        else:
            assert r.objective == pytest.approx(want, rel=1e-6, abs=1e-12)
    if math.isinf(want):
        assert results[0].reason == results[1].reason
    # the type-count relaxation is a valid bound, and its pipeline (when made real) a real plan
    problem = prepare(profile, cluster, None, schedule, m, options, allow_fewer)
    if len(problem.devices) <= profile.num_layers or allow_fewer:
        data = joint_data(problem, hint=False, prune=False, max_arcs=10**6)
        value, plan = relaxed_plan(data)
        assert value <= want * (1 + 1e-12) + 1e-15
        if plan is not None:
            assert plan.solution.bottleneck_s >= want * (1 - 1e-12) - 1e-15


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_joint_models_equal_every_order_by_the_dp(inst):
    _check(inst)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_joint_models_equal_every_order_by_the_dp_long(inst):
    _check(inst)


def _two_node_cluster(mem_gib=8.0):
    types = {"fast": DeviceType("fast", mem_gib * GIB, 1e13, 1e11), "slow": DeviceType("slow", mem_gib * GIB, 1e13, 1e11)}
    nodes = (Node("n0", ("slow", "fast"), 16.0), Node("n1", ("slow", "fast"), 16.0))
    return Cluster("two", nodes, 1.0, types)


def _profile(n_layers=6):
    times = {"fast": LayerTime(1e-3, 2e-3), "slow": LayerTime(3e-3, 6e-3)}
    return Profile("m", 1, tuple(LayerProfile(f"l{i}", 0.0, 1e8, 1e8, 5e7, times) for i in range(n_layers)))


def test_order_of_the_device_list_does_not_matter_and_fixed_order_keeps_it():
    prof, cl = _profile(), _two_node_cluster()
    names = [d.name for d in cl.devices]
    a = solve_cpsat(prof, cl, names, time_limit_s=20.0)
    b = solve_cpsat(prof, cl, list(reversed(names)), time_limit_s=20.0)
    assert a.status is b.status is SolveStatus.OPTIMAL
    assert a.objective == pytest.approx(b.objective, rel=1e-9)
    assert a.details["mapping"] == "model" and a.details["symmetric_nodes"] == [["n0", "n1"]]
    given_order = solve_cpsat(prof, cl, names, time_limit_s=20.0, fixed_order=True)
    assert given_order.details["mapping"] == "given"
    assert [st.device for st in given_order.plan.virtual_workers[0].stages] == names
    assert a.objective <= given_order.objective


def test_infeasible_memory_gives_the_same_reason_in_both():
    prof, cl = _profile(), _two_node_cluster(mem_gib=0.5)
    reasons = []
    for module in (solve_cpsat, solve_cbc):
        r = module(prof, cl, time_limit_s=10.0)
        assert r.status is SolveStatus.INFEASIBLE and r.plan is None
        reasons.append(r.reason)
    assert reasons[0] == reasons[1] and "GiB" in reasons[0]


@pytest.mark.parametrize("module", [solve_cpsat, solve_cbc])
@pytest.mark.parametrize("kw, needle", [
    ({"time_limit_s": 0.0}, "time_limit_s = 0.0: must be > 0 seconds"),
    ({"time_limit_s": -1.0}, "time_limit_s = -1.0"),
    ({"threads": 0}, "threads = 0: must be an integer >= 1"),
    ({"fixed_order": "yes"}, "fixed_order = 'yes': must be true or false"),
])
def test_bad_options_are_one_line(module, kw, needle):
    with pytest.raises(FormatError) as err:
        module(_profile(), _two_node_cluster(), **kw)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_symmetric_nodes_and_link_classes():
    prof, cl = _profile(), _two_node_cluster()
    data = joint_data(prepare(prof, cl, None, "1f1b", None, None, False), hint=True, prune=True, max_arcs=10**5)
    assert data.symmetric_nodes == (("n0", "n1"),)
    assert len(data.class_s) == 2  # inside a node, between nodes
    # the hint obeys the symmetry rule: n0 is used before n1
    first = [lab[0] for lab in data.start.labels]
    assert first.index("n0") < first.index("n1")
    # a faster link into n1 makes the nodes different
    asym = Cluster("two", (cl.nodes[0], Node("n1", ("slow", "fast"), 50.0)), 1.0, cl.device_types)
    data2 = joint_data(prepare(prof, asym, None, "1f1b", None, None, False), hint=True, prune=True, max_arcs=10**5)
    assert data2.symmetric_nodes == (("n0",), ("n1",))


def test_planner_request_fixed_order_flag():
    from solvers.planning import PlanRequest

    assert PlanRequest(solver="cpsat", fixed_order=True).solver_options()["fixed_order"] is True
    with pytest.raises(FormatError, match="fixed_order"):
        PlanRequest(solver="dp", fixed_order=True)


def test_cli_decides_the_order_unless_fixed(tmp_path, capsys):
    from partitioner.plan import Plan
    from partitioner_cli.main import main

    prof, cl = _profile(), _two_node_cluster()
    prof.save(tmp_path / "p.json")
    cl.save(tmp_path / "c.json")
    names = ",".join(reversed([d.name for d in cl.devices]))
    base = ["plan", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json"), "--solver", "cpsat",
            "--devices", names, "--time-limit", "20"]
    assert main([*base, "-o", str(tmp_path / "joint.json")]) == 0
    assert main([*base, "--fixed-order", "-o", str(tmp_path / "fixed.json")]) == 0
    joint, fixed = Plan.load(tmp_path / "joint.json"), Plan.load(tmp_path / "fixed.json")
    assert [st.device for st in fixed.virtual_workers[0].stages] == names.split(",")
    assert joint.solver.objective <= fixed.solver.objective * (1 + 1e-9)
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json"), "--fixed-order"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--fixed-order = True: applies to the cpsat, milp solvers" in err


def test_graph_profile_keeps_the_given_order_and_says_so():
    import dataclasses

    prof = _profile()
    layers = tuple(dataclasses.replace(x, own_output_bytes=x.output_bytes) for x in prof.layers)
    graph = dataclasses.replace(prof, layers=layers,
                                edges=(*tuple((i, i + 1) for i in range(prof.num_layers - 1)), (0, 2)))
    cl = _two_node_cluster()
    for module in (solve_cpsat, solve_cbc):
        r = module(graph, cl, time_limit_s=20.0)
        assert r.ok and r.details["mapping"] == "given"
        assert any("given order" in line for line in r.details["messages"])
        assert [st.device for st in r.plan.virtual_workers[0].stages] == [d.name for d in cl.devices]
        chain = module(graph, cl, time_limit_s=20.0, dag=False)
        assert chain.details["mapping"] == "model" and "messages" not in chain.details


def test_wsp_over_a_size_dependent_network_is_refused_in_one_line():
    import dataclasses

    from partitioner.bandwidth import Bandwidth

    cl = dataclasses.replace(_two_node_cluster(), inter_curve=Bandwidth(1.0, latency_s=1e-5, name="inter_node"))
    with pytest.raises(FormatError) as err:
        solve_cpsat(_profile(), cl, schedule="wsp", time_limit_s=5.0)
    assert "schedule = 'wsp'" in str(err.value) and "\n" not in str(err.value)
    assert solve_cpsat(_profile(), cl, schedule="wsp", time_limit_s=5.0, fixed_order=True).ok
