"""CP-SAT and MILP chain solvers against the DP and an independent brute force."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solvers
from partitioner.cluster import Cluster, DeviceType, Node
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError, PartitionerError
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.schedule import Schedule
from solvers import SOLVERS, SolveStatus
from solvers import solve as front_door
from solvers.exact.cbc.chain import SCALE_MAX as CBC_SCALE_MAX
from solvers.exact.cbc.run import cbc_bound
from solvers.exact.router import DEFAULT_RESOLUTION, solve_cbc, solve_cpsat
from solvers.pipeline import dp

GIB = 2**30
TYPES = ("gA", "gB", "gC")


def brute_force(profile, cluster, devices, schedule, m, options, allow_fewer):
    """Minimum bottleneck over every placement of cuts, priced stage by stage; inf if none fits."""
    cost = CostModel(profile, cluster, options)
    n_layers = profile.num_layers
    lengths = range(1, min(len(devices), n_layers) + 1) if allow_fewer else [len(devices)]
    best = math.inf
    for q in lengths:
        if q > n_layers:
            continue
        devs = devices[:q]
        for inner in itertools.combinations(range(1, n_layers), q - 1):
            cuts = (0, *inner, n_layers)
            worst = 0.0
            for k in range(q):
                a, b = cuts[k], cuts[k + 1]
                need = cost.stage_memory_bytes(a, b, Schedule.of(schedule, m).activations_in_flight(q - k), Schedule.of(schedule, 1))
                if need > devs[k].memory_bytes:
                    worst = math.inf
                    break
                worst = max(worst, cost.pipeline_stage_time_s(a, b, devs[k], devs[k - 1] if k else None, devs[k + 1] if k + 1 < q else None, Schedule.of(schedule, m)))
            best = min(best, worst)
    return best


@st.composite
def instances(draw):
    n_layers = draw(st.integers(1, 8))
    n_dev = draw(st.integers(1, 4))
    mem = {t: draw(st.integers(2, 40)) * 0.1 * GIB for t in TYPES}
    types = {t: DeviceType(t, mem[t], 1e13, 1e11) for t in TYPES}
    # times on a 10 us grid (ties between splits are common) or off it (rounding to ticks matters)
    unit = 1e-5 * draw(st.sampled_from([1.0, 1.0000001234567, 0.7071067811865476]))
    layers = []
    for i in range(n_layers):
        times = {t: LayerTime(draw(st.integers(0, 1000)) * unit, draw(st.integers(0, 2000)) * unit)
                 for t in TYPES}
        layers.append(LayerProfile(f"l{i}", 0.0, draw(st.integers(0, 100)) * 1e6,
                                   draw(st.integers(0, 200)) * 1e6, draw(st.integers(0, 100)) * 1e6, times))
    gpus = [draw(st.sampled_from(TYPES)) for _ in range(n_dev)]
    split = draw(st.integers(1, n_dev))
    nodes = [Node("n0", tuple(gpus[:split]), draw(st.sampled_from([8.0, 16.0, 50.0])))]
    if split < n_dev:
        nodes.append(Node("n1", tuple(gpus[split:]), 16.0))
    cluster = Cluster("c", tuple(nodes), draw(st.sampled_from([1.0, 5.0])), types)
    profile = Profile("m", 1, tuple(layers))
    devices = list(cluster.devices)
    order = draw(st.permutations(range(n_dev)))
    devices = [devices[i] for i in order]
    schedule = draw(st.sampled_from(["1f1b", "gpipe", "2bw", "wsp"]))
    m = draw(st.integers(1, 6))
    options = CostOptions(overlap_comm=draw(st.booleans()), reserved_bytes=0.05 * GIB)
    allow_fewer = draw(st.booleans())
    resolution = draw(st.sampled_from([100, 1000, DEFAULT_RESOLUTION]))
    return profile, cluster, devices, schedule, m, options, allow_fewer, resolution


def _check_agreement(inst, hint):
    profile, cluster, devices, schedule, m, options, allow_fewer, resolution = inst
    names = [d.name for d in devices]
    kw = dict(schedule=schedule, micro_batches=m, options=options, allow_fewer=allow_fewer)
    kw_fixed = dict(kw, fixed_order=True)  # the chain models over this order (tests/test_joint.py: the mapping)
    truth = brute_force(profile, cluster, devices, schedule, m, options, allow_fewer)
    kw_cp = dict(kw_fixed, resolution=resolution)
    r_dp = dp.solve(profile, cluster, names, **kw)
    r_cp = solve_cpsat(profile, cluster, names, hint=hint, time_limit_s=20.0, **kw_cp)
    r_mi = solve_cbc(profile, cluster, names, hint=hint, time_limit_s=20.0, **kw_fixed)
    if math.isinf(truth):
        for r in (r_dp, r_cp, r_mi):
            assert r.status is SolveStatus.INFEASIBLE, (r.method, r.status, r.objective)
            assert r.reason and r.plan is None
        return
    assert r_dp.status is SolveStatus.OPTIMAL and r_dp.objective == pytest.approx(truth, rel=1e-12, abs=1e-15)
    # CP-SAT: optimal for tick-rounded times, so within one tick of the truth; bound sound.
    assert r_cp.status is SolveStatus.OPTIMAL
    tick = r_cp.details["tick_s"]
    assert truth - 1e-15 <= r_cp.objective <= truth + tick + 1e-15
    assert r_cp.details["bound_s"] <= truth * (1 + 1e-12)
    # MILP: CBC proves optimality (a stop at the time limit must still carry a sound bound).
    assert r_mi.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)
    slack = 2e-6 * r_mi.details["unit_s"] * CBC_SCALE_MAX
    assert truth - 1e-15 <= r_mi.objective <= truth + slack + 1e-15
    if not math.isnan(r_mi.details["bound_s"]):
        assert r_mi.details["bound_s"] <= truth * (1 + 1e-12)
    for r in (r_cp, r_mi):
        CostModel(profile, cluster, options).validate_plan(r.plan)
        assert r.plan.solver.name == r.method
        times = CostModel(profile, cluster, options).plan_stage_times_s(r.plan)
        assert max(times) == r.objective  # the reported objective is the cost model's figure


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_agree_with_brute_force(inst):
    _check_agreement(inst, hint=False)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_agree_with_hint_and_pruning(inst):
    _check_agreement(inst, hint=True)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_agree_with_brute_force_long(inst):
    _check_agreement(inst, hint=False)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_agree_with_hint_and_pruning_long(inst):
    _check_agreement(inst, hint=True)


def _chain(n_layers, gpus, mem_gib=16.0, seed=1):
    import random

    rng = random.Random(seed)
    types = {t: DeviceType(t, mem_gib * GIB, 1e13, 1e11) for t in set(gpus)}
    layers = tuple(LayerProfile(f"l{i}", 0.0, rng.uniform(0, 5e7), rng.uniform(0, 5e7), rng.uniform(0, 5e7),
                                {t: LayerTime(rng.uniform(1e-3, 1e-2), rng.uniform(1e-3, 2e-2)) for t in types})
                   for i in range(n_layers))
    half = len(gpus) // 2 or 1
    nodes = [Node("n0", tuple(gpus[:half]), 16.0)]
    if gpus[half:]:
        nodes.append(Node("n1", tuple(gpus[half:]), 16.0))
    return Profile("m", 1, layers), Cluster("c", tuple(nodes), 2.0, types)


def test_hint_is_at_least_as_good_as_dp():
    profile, cluster = _chain(40, ["gA", "gB", "gA", "gB"])
    ref = dp.solve(profile, cluster)
    for prune in (False, True):
        r = solve_cpsat(profile, cluster, hint=True, prune=prune, time_limit_s=60.0, fixed_order=True)  # load-proof
        assert r.details["hint"] is True
        assert r.ok
        assert r.objective <= ref.objective + r.details["tick_s"]
        assert r.lower_bound <= ref.objective
        w = solve_cbc(profile, cluster, hint=True, prune=prune, time_limit_s=60.0, fixed_order=True)
        assert w.ok and w.objective <= ref.objective * (1 + 2e-6)


def test_more_devices_than_layers():
    profile, cluster = _chain(2, ["gA", "gB", "gA"])
    for mod in (solve_cpsat, solve_cbc):
        r = mod(profile, cluster, hint=False)
        assert r.status is SolveStatus.INFEASIBLE and "3 devices but only 2 layers" in r.reason
        r = mod(profile, cluster, hint=False, allow_fewer=True)
        assert r.status is SolveStatus.OPTIMAL and r.plan.num_stages <= 2


def test_size_limit_refuses_clearly():
    profile, cluster = _chain(30, ["gA", "gB", "gA", "gB"])
    for mod in (solve_cpsat, solve_cbc):
        with pytest.raises(PartitionerError, match="candidate stages; use the dp solver"):
            mod(profile, cluster, hint=False, max_arcs=100)


def test_options_are_checked():
    profile, cluster = _chain(4, ["gA", "gB"])
    for name in ("cpsat", "milp"):
        with pytest.raises(FormatError, match=f"bogus.*not understood by the {name} solver"):
            solvers.solve(profile, cluster, solver=name, bogus=1)
        with pytest.raises(FormatError, match="time_limit_s"):
            solvers.solve(profile, cluster, solver=name, time_limit_s=0)
        with pytest.raises(FormatError, match="micro_batches"):
            solvers.solve(profile, cluster, solver=name, micro_batches=0)


def test_registered_in_front_door():
    assert SOLVERS["cpsat"] == "solvers.exact.router:solve_cpsat" and SOLVERS["milp"] == "solvers.exact.router:solve_cbc"
    profile, cluster = _chain(6, ["gA", "gB", "gA"])
    ref = dp.solve(profile, cluster)
    for name in ("cpsat", "milp"):
        r = front_door(profile, cluster, name, hint=False, fixed_order=True)
        assert r.method == name and r.objective == pytest.approx(ref.objective, rel=1e-6)


def test_cbc_bound_from_log():
    stopped = ("Result - Stopped on time limit\n\nObjective value:                12.50000000\n"
               "Lower bound:                    11.250\nGap:                            0.10\n")
    assert cbc_bound(stopped) == 11.25
    assert cbc_bound("Result - Optimal solution found\n\nObjective value:                3.25000000\n") == 3.25
    assert math.isnan(cbc_bound("Result - Stopped on time limit\n\nNo feasible solution found\n"))


def brute_force_tie_break(profile, cluster, devices, schedule, m, options, allow_fewer):
    """The DP's choice by enumeration: least bottleneck, then the fewest stages, then the least
    total stage time; (bottleneck, stages, total), or None when nothing fits."""
    cost = CostModel(profile, cluster, options)
    n_layers = profile.num_layers
    lengths = range(1, min(len(devices), n_layers) + 1) if allow_fewer else [len(devices)]
    found = []
    for q in lengths:
        if q > n_layers:
            continue
        devs = devices[:q]
        for inner in itertools.combinations(range(1, n_layers), q - 1):
            cuts = (0, *inner, n_layers)
            times = []
            for k in range(q):
                a, b = cuts[k], cuts[k + 1]
                need = cost.stage_memory_bytes(a, b, Schedule.of(schedule, m).activations_in_flight(q - k), Schedule.of(schedule, 1))
                if need > devs[k].memory_bytes:
                    break
                times.append(cost.pipeline_stage_time_s(a, b, devs[k], devs[k - 1] if k else None, devs[k + 1] if k + 1 < q else None, Schedule.of(schedule, m)))
            else:
                found.append((max(times), q, sum(times)))
    if not found:
        return None
    best = min(b for b, _, _ in found)
    exact = min(((b, q, total) for b, q, total in found if b == best), key=lambda r: (r[1], r[2]))
    # optima tied up to float rounding (one sum of layer times in another order), which a solver
    # working in ticks or with a tolerance cannot tell apart: the least total among them
    loose = min(total for b, q, total in found if q == exact[1] and b <= best + 1e-12 * best + 1e-15)
    return (*exact, loose, found)


@st.composite
def tied_instances(draw):
    """Chains where many splits reach the optimal bottleneck: one heavy layer, small integer times
    that differ by GPU type, no transfers, ample memory; sometimes a shorter pipeline allowed."""
    n_layers = draw(st.integers(3, 8))
    n_dev = draw(st.integers(2, 4))
    heavy = draw(st.integers(0, n_layers - 1))
    types = {t: DeviceType(t, 100 * GIB, 1e13, 1e11) for t in TYPES}
    layers = []
    for i in range(n_layers):
        times = {t: LayerTime(1e-3 * (20 if i == heavy else draw(st.integers(1, 4))), 0.0) for t in TYPES}
        layers.append(LayerProfile(f"l{i}", 0.0, 0.0, 0.0, 0.0, times))
    gpus = [draw(st.sampled_from(TYPES)) for _ in range(n_dev)]
    cluster = Cluster("c", (Node("n0", tuple(gpus), 16.0),), 1.0, types)
    return (Profile("m", 1, tuple(layers)), cluster, list(cluster.devices), "1f1b", 2,
            CostOptions(reserved_bytes=0.0), draw(st.booleans()), DEFAULT_RESOLUTION)


def _stage_total(result, profile, cluster, options):
    return len(result.plan.virtual_workers[0].stages), sum(
        CostModel(profile, cluster, options).plan_stage_times_s(result.plan))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(instances(), tied_instances()), st.booleans())
def test_tie_break_matches_the_dp_and_brute_force(inst, hint):
    """Among bottleneck-optimal splits CP-SAT and CBC return the DP's: fewest stages, then the
    least total stage time (CP-SAT within a tick per stage, CBC within its tolerance)."""
    profile, cluster, devices, schedule, m, options, allow_fewer, _ = inst
    names = [d.name for d in devices]
    kw = dict(schedule=schedule, micro_batches=m, options=options, allow_fewer=allow_fewer)
    truth = brute_force_tie_break(profile, cluster, devices, schedule, m, options, allow_fewer)
    if truth is None:
        return
    best, q_best, total_best, total_loose, found = truth
    r_dp = dp.solve(profile, cluster, names, **kw)
    assert r_dp.objective == pytest.approx(best, rel=1e-12, abs=1e-15)
    q_dp, total_dp = _stage_total(r_dp, profile, cluster, options)
    assert q_dp == q_best and total_dp == pytest.approx(total_best, rel=1e-9, abs=1e-15)
    for r, slack in ((solve_cpsat(profile, cluster, names, time_limit_s=20.0, hint=hint, fixed_order=True, **kw), None),
                     (solve_cbc(profile, cluster, names, time_limit_s=20.0, hint=hint, fixed_order=True, **kw), 2e-6)):
        assert r.status is SolveStatus.OPTIMAL, (r.method, r.details)
        per_stage = r.details["tick_s"] if slack is None else slack * r.details["unit_s"] * CBC_SCALE_MAX
        q_r, total_r = _stage_total(r, profile, cluster, options)
        assert r.objective == pytest.approx(best, rel=1e-9, abs=per_stage + 1e-15), r.method
        # the fewest stages among splits tied with the optimum up to the solver's resolution (a
        # tick per stage, or CBC's tolerance), which it cannot tell apart from the optimum
        q_tied = min(q for b, q, _ in found if b <= best + per_stage + 1e-15)
        assert q_tied <= q_r <= q_best, (r.method, q_r, q_tied, q_best)
        if q_r != q_best:
            continue  # a shorter pipeline within the resolution: its total is not the DP's to compare
        assert total_loose - 1e-12 <= total_r + 1e-15 and total_r <= total_best + q_r * per_stage + 1e-12, \
            (r.method, total_r, total_best)


@pytest.mark.parametrize("module", [solve_cpsat, solve_cbc])
def test_fixed_seed_and_workers_give_the_same_plan(module):
    profile, cluster = _chain(24, ["gA", "gB", "gA", "gB"], seed=5)
    runs = [module(profile, cluster, hint=False, threads=2, seed=11, time_limit_s=30.0, fixed_order=True)
            for _ in range(2)]
    assert all(r.status is SolveStatus.OPTIMAL for r in runs)
    assert runs[0].plan.virtual_workers == runs[1].plan.virtual_workers
    assert runs[0].objective == runs[1].objective


@pytest.mark.parametrize("argv, needle", [
    (["--seed", "3"], "--seed = 3: applies to the cpsat, milp solvers"),
    (["--solver", "cpsat", "--threads", "0"], "--threads = 0: must be an integer >= 1"),
    (["--solver", "milp", "--seed", "-1"], "--seed = -1: must be an integer >= 0"),
])
def test_workers_and_seed_bad_input_is_one_line(capsys, argv, needle):
    from partitioner_cli.main import main

    rc = main(["plan", "examples/profiles/vgg16_v100.json", "--cluster", "examples/clusters/v100x8.yaml", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and needle in err, err


def test_seed_out_of_range_is_refused():
    profile, cluster = _chain(4, ["gA", "gB"])
    with pytest.raises(FormatError, match="seed"):
        solve_cpsat(profile, cluster, seed=-2)


def test_a_long_solve_shows_its_incumbent_bound_and_gap_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    import io
    import time

    from solvers import progress

    stream = io.StringIO()
    with progress.shown(True):
        line = progress.Status("cpsat", file=stream, after_s=0.0)
        line.update(0.029688, 0.028989)
        time.sleep(0.6)
        line.close()
    assert "best 29.69 ms" in stream.getvalue() and "gap 2.4%" in stream.getvalue()
    quiet = progress.status("cpsat")  # outside shown(): nothing is made or written
    assert not quiet.active and quiet._bar is None
    quiet.update(1.0, 0.5)
    quiet.close()
    assert capsys.readouterr().err == ""


def test_a_cbc_crash_in_the_tie_break_keeps_the_proven_plan(monkeypatch):
    """CBC may crash on a warm-started solve cut short by its time limit; the first solve's proven
    plan then stands, and the tie-break says it failed."""
    import pulp

    from solvers.exact.cbc import run

    real = run.run_cbc

    def crash_second(prob, time_limit_s, threads, seed, warm_start, keep_log=True):
        if not keep_log:  # the tie-break's solve
            raise pulp.PulpSolverError("Pulp: Error while executing")
        return real(prob, time_limit_s, threads, seed, warm_start, keep_log)

    monkeypatch.setattr(run, "run_cbc", crash_second)
    profile, cluster = _chain(8, ["gA", "gB", "gA"])
    r = solve_cbc(profile, cluster, hint=True, time_limit_s=20.0, fixed_order=True)
    assert r.status is SolveStatus.OPTIMAL and r.details["tie_break"] == "CBC failed"
    assert r.objective == pytest.approx(solvers.solve(profile, cluster, solver="dp").objective, rel=1e-6)


@pytest.mark.parametrize("model", [dict(fixed_order=True), dict(fixed_order=False, relaxation=False), dict(dag=True)],
                         ids=["chain", "joint", "graph"])
@pytest.mark.parametrize("hint", [False, True])
def test_a_cbc_crash_in_the_first_solve_is_a_solve_without_a_plan(monkeypatch, model, hint):
    """CBC exiting with an error on a model's first solve (PuLP raises PulpSolverError) leaves the
    model unsolved, as a time limit with no plan would: UNKNOWN with the reason in one line, or
    the hint's plan where the model returns its hint, instead of PuLP's exception reaching the caller."""
    import pulp

    from solvers.exact.cbc import run

    calls = []

    def crash(prob, time_limit_s, threads, seed, warm_start, keep_log=True):
        calls.append(keep_log)
        raise pulp.PulpSolverError("Pulp: Error while trying to execute")

    monkeypatch.setattr(run, "run_cbc", crash)
    profile, cluster = _chain(8, ["gA", "gB", "gA"])
    r = solve_cbc(profile, cluster, hint=hint, time_limit_s=20.0, **model)
    assert calls == [True]  # the first solve only, and it failed
    assert r.details["cbc_failed"] == "Pulp: Error while trying to execute"
    assert r.details["cbc_status"] == "Not Solved"
    if r.details.get("from_hint"):  # the joint and graph models answer with their hint
        assert hint and r.status is SolveStatus.FEASIBLE
        CostModel(profile, cluster).validate_plan(r.plan)
    else:
        assert r.status is SolveStatus.UNKNOWN and r.plan is None and not r.ok
        assert r.reason == run.CBC_FAILED and "\n" not in r.reason
