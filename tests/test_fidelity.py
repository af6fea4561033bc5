"""The cost model's pieces against hand counts, the closed form against the simulator with
gradient synchronisation, bandwidth curves, and Sailor's measured runs."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from partitioner.bandwidth import Bandwidth
from partitioner.cluster import Cluster, Node
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError, PartitionerError
from partitioner.importers.sailor_runs import import_sailor_run, sailor_bandwidth
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.schedule import Schedule
from partitioner.simulate import simulate_plan
from tests.conftest import big_type

DATA = Path(__file__).parent / "data"
RUNS = DATA / "sailor_validation" / "clariden_opt350"
NETWORK = DATA / "sailor_validation" / "network" / "network_coeffs_all_homo.json"
GIB = 2**30


def uniform(n: int, fwd: float = 1.0, bwd: float = 2.0, params: float = 4e9, update: float = 0.0,
            dtype: str = "float32") -> Profile:
    layers = tuple(LayerProfile(f"l{i}", param_bytes=params, saved_bytes=1e6, output_bytes=0.0,
                                times={"G": LayerTime(fwd, bwd, update_s=update)}) for i in range(n))
    return Profile("u", 1, layers, dtype=dtype)


def cluster(nodes: int, per_node: int, intra: float = 100.0, inter: float = 10.0) -> Cluster:
    return Cluster("c", tuple(Node(f"n{k}", ("G",) * per_node, intra) for k in range(nodes)), inter,
                   {"G": big_type("G")})


# -- memory ------------------------------------------------------------------------------------

def test_memory_per_parameter_fp32_and_mixed_precision():
    prof = uniform(2, params=4e9)  # fp32 profile: 1e9 parameters per layer
    one = cluster(1, 1)
    fp32 = CostModel(prof, one, CostOptions(reserved_bytes=0.0))
    # weights 4 + gradient 4 + Adam 2 x 4 bytes = 16 per parameter; 2bw keeps a second 4-byte copy
    assert fp32.weight_bytes(0, 1) == 16e9 and fp32.weight_bytes(0, 1, versions=2) == 20e9
    mixed = CostModel(prof, one, CostOptions(precision="bf16", reserved_bytes=0.0))
    # fp16 weights 2 + fp16 gradient 2 + fp32 master 4 + Adam 8 = 16; a second version adds 2
    assert mixed.weight_bytes(0, 1) == 16e9 and mixed.weight_bytes(0, 1, versions=2) == 18e9
    assert mixed.param_bytes(0, 2) == 2 * 2e9  # what data parallelism all-reduces: fp16 gradients
    sgd = CostModel(prof, one, CostOptions(precision="fp16", optimizer_state_factor=0.0, reserved_bytes=GIB))
    # a stage: 2 layers x 1e9 x (2 + 2 + 4) + 3 micro-batches x 2 x 1e6 saved + 1 GiB reserved
    assert sgd.stage_memory_bytes(0, 2, 3, Schedule.of("1f1b", 1)) == pytest.approx(2 * 8e9 + 3 * 2e6 + GIB)
    fp16_profile = uniform(1, params=2e9, dtype="float16")  # 1e9 parameters counted at 2 bytes each
    assert CostModel(fp16_profile, one, CostOptions(reserved_bytes=0.0)).weight_bytes(0, 1) == 16e9


def test_unknown_precision_lists_the_valid_ones():
    with pytest.raises(FormatError, match="precision = 'fp8': must be one of fp32, fp16, bf16"):
        CostOptions(precision="fp8")
    with pytest.raises(FormatError, match=r"pricing\.precision"):
        CostOptions.from_dict({"precision": "int4"})


# -- bandwidth curves ------------------------------------------------------------------------------

def test_curve_interpolates_in_log_size_and_adds_latency():
    bw = Bandwidth(10.0, latency_s=1e-5, points=((1e6, 2.0), (4e6, 8.0)))
    assert bw.gbps_at(5e5) == 2.0 and bw.gbps_at(1e9) == 8.0
    assert bw.gbps_at(2e6) == pytest.approx(5.0)  # halfway in log2 between 1 MB and 4 MB
    assert bw.seconds(2e6) == pytest.approx(1e-5 + 2e6 / 5e9)
    assert bw.seconds(0) == 0.0


def test_cluster_curve_round_trip_and_use(tmp_path):
    data = {"name": "x", "inter_node_GBps": {"GBps": 20, "latency_us": 3, "points": [[1e5, 1.0], [1e8, 20.0]]},
            "nodes": [{"name": "a", "intra_node_GBps": 50, "gpus": {"V100-SXM2-16GB": 2}},
                      {"name": "b", "intra_node_GBps": {"GBps": 80, "log2_MB_poly": [1.0, 40.0]}, "gpus": {"V100-SXM2-16GB": 2}}]}
    cl = Cluster.from_dict(data)
    again = Cluster.from_dict(json.loads(json.dumps(cl.to_dict())))
    assert again == cl and cl.has_curves
    assert cl.transfer_s(1e8, "a:0", "b:0") == pytest.approx(3e-6 + 1e8 / 20e9)
    assert cl.transfer_s(8e6, "b:0", "b:1") == pytest.approx(8e6 / (min(80.0, 3 + 40) * 1e9))  # x = log2(8) = 3
    assert cl.transfer_s(1e6, "a:0", "a:1") == pytest.approx(1e6 / 50e9)  # flat stays flat


def test_non_positive_curve_names_link_size_and_value():
    cl = Cluster.from_dict({"inter_node_GBps": {"GBps": 90, "log2_MB_poly": [-1.0, 0.0, 10.0]},
                            "nodes": [{"intra_node_GBps": 50, "gpus": {"V100-SXM2-16GB": 1}}] * 1
                            + [{"name": "m", "intra_node_GBps": 50, "gpus": {"V100-SXM2-16GB": 1}}]})
    assert cl.transfer_s(1e6, "n0:0", "m:0") == pytest.approx(1e6 / 10e9)
    with pytest.raises(PartitionerError, match=r"inter_node_GBps: the bandwidth curve gives -6 GB/s for a "
                                               r"message of 1.6e\+07 bytes"):
        cl.transfer_s(16e6, "n0:0", "m:0")  # x = 4: 10 - 4^2
    with pytest.raises(FormatError, match=r"points\[1\] = \[2000000.0, 0.0\]: GB/s must be > 0"):
        Cluster.from_dict({"inter_node_GBps": {"points": [[1e6, 1.0], [2e6, 0.0]]},
                           "nodes": [{"intra_node_GBps": 5, "gpus": {"V100-SXM2-16GB": 1}}]})


def test_sailor_network_curve():
    bw = sailor_bandwidth(NETWORK, "inter", "GH-96", 4)
    a, b, c = json.loads(NETWORK.read_text())["inter"]["GH-96"]["4"][0]
    x = math.log2(33.5e6 / 1e6)
    assert bw.gbps_at(33.5e6) == pytest.approx(a * x * x + b * x + c)
    assert bw.gbps_at(1e9) == pytest.approx(92.551901043989)  # capped by the measured maximum
    with pytest.raises(FormatError, match=r"inter\.GH-96\.3"):
        sailor_bandwidth(NETWORK, "inter", "GH-96", 3)


# -- all-reduce and synchronisation ------------------------------------------------------------------

def test_allreduce_ring_in_a_node_and_hierarchical_across_nodes():
    cl = cluster(2, 2, intra=100.0, inter=10.0)
    cost = CostModel(uniform(1), cl)
    assert cost.allreduce_s(8e9, ["n0:0", "n0:1"]) == pytest.approx(2 * 1 / 2 * 8e9 / 100e9)
    ring = 2 * 3 / 4 * 8e9 / 10e9  # every hop of a 4-ring across nodes moves 3/2 of the buffer
    hier = 2 * (1 / 2 * 8e9 / 100e9) + 2 * 1 / 2 * 8e9 / 10e9
    assert cost.allreduce_s(8e9, ["n0:0", "n0:1", "n1:0", "n1:1"]) == pytest.approx(min(ring, hier))


def test_sync_groups_follow_the_holders_of_each_layer():
    cl = cluster(4, 1)
    cost = CostModel(uniform(4), cl)
    plan = Plan("u", (VirtualWorker((Stage((0, 1), "n0:0"), Stage((1, 4), "n1:0"))),
                      VirtualWorker((Stage((0, 3), "n2:0"), Stage((3, 4), "n3:0")))), "1f1b", 1, 2)
    groups = cost.sync_groups(plan)
    assert [(g.start, g.stop, set(g.devices)) for g in groups] == [
        (0, 1, {"n0:0", "n2:0"}), (1, 3, {"n1:0", "n2:0"}), (3, 4, {"n1:0", "n3:0"})]
    assert cost.sync_groups(replace(plan, schedule="wsp")) == ()  # WSP pushes and pulls instead


def _holders_per_layer(cost: CostModel, plan: Plan) -> list[tuple[int, int, tuple[str, ...]]]:
    """The holder groups found layer by layer (the definition, slowly)."""
    holders: list[list[str]] = [[] for _ in range(cost.num_layers)]
    for vw in plan.virtual_workers:
        for st_ in vw.stages:
            for layer in range(st_.start, min(st_.stop, cost.num_layers)):
                holders[layer].extend(st_.devices)
    out, start = [], 0
    for layer in range(1, cost.num_layers + 1):
        if layer == cost.num_layers or holders[layer] != holders[start]:
            if len(holders[start]) > 1:
                out.append((start, layer, tuple(holders[start])))
            start = layer
    return out


@pytest.mark.parametrize("seed", range(20))
def test_holder_groups_equal_the_layer_by_layer_definition(seed: int) -> None:
    """Random workers (cuts, replicas) over 12 layers: the groups found segment by segment are
    the layer-by-layer ones, devices in the same order."""
    import itertools
    import random

    rng = random.Random(seed)
    n_layers, free = 12, [f"n{i}:{j}" for i in range(8) for j in range(2)]
    rng.shuffle(free)
    workers = []
    for _ in range(rng.randint(1, 4)):
        cuts = sorted(rng.sample(range(1, n_layers), rng.randint(0, 2)))
        edges = [0, *cuts, n_layers]
        stages = []
        for a, b in itertools.pairwise(edges):
            replicas = tuple(free.pop() for _ in range(rng.randint(0, 1)))
            stages.append(Stage((a, b), free.pop(), replicas=replicas))
        workers.append(VirtualWorker(tuple(stages)))
    plan = Plan("u", tuple(workers), "1f1b", 1, 2)
    cost = CostModel(uniform(n_layers), cluster(8, 2))
    got = [(g.start, g.stop, g.devices) for g in cost.holder_groups(plan)]
    assert got == _holders_per_layer(cost, plan)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("workers,stages,m", [(2, 2, 4), (3, 3, 6), (2, 4, 8), (4, 1, 3)])
def test_closed_form_equals_simulator_on_uniform_stages_with_sync(schedule, workers, stages, m):
    n = stages
    cl = cluster(workers * stages, 1, inter=5.0)
    prof = uniform(n, params=2e9, update=0.25)
    plan = Plan("u", tuple(VirtualWorker(tuple(Stage((k, k + 1), f"n{w * stages + k}:0") for k in range(stages)))
                           for w in range(workers)), schedule, 1, m)
    opts = CostOptions(reserved_bytes=0.0)
    cost = CostModel(prof, cl, opts)
    tl = simulate_plan(plan, prof, cl, opts)
    ar = cost.allreduce_s(2e9, [f"n{w * stages}:0" for w in range(workers)])
    # pipeline fill + steady state + drain, then the all-reduce of the first stage (it finishes last), then the step
    expect = (stages + m - 1) * 3.0 + ar + 0.25
    assert tl.iteration_s == pytest.approx(expect, rel=1e-9)
    assert cost.plan_iteration_s(plan) == pytest.approx(tl.iteration_s, rel=1e-9)
    events = [e for e in tl.events() if e[1] == "ALLREDUCE"]
    assert len(events) == (workers * stages if workers > 1 else 0)


# -- plans keep their pricing -------------------------------------------------------------------------

def test_a_saved_plan_is_priced_as_it_was_planned(tmp_path):
    from solvers import solve

    cl = cluster(2, 2)
    prof = uniform(6, params=1e8)
    opts = CostOptions(precision="bf16", reserved_bytes=2 * GIB, optimizer_state_factor=1.0)
    res = solve(prof, cl, solver="dp", options=opts, micro_batches=4)
    assert res.ok and res.plan.cost_options() == opts
    res.plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again.cost_options() == opts
    tl = simulate_plan(again, prof, cl, again.cost_options())
    assert tl.iteration_s == res.plan.predicted["iteration_s"]
    assert max(tl.peak_memory_bytes.values()) == res.plan.predicted["peak_memory_bytes"]


def test_simulate_command_uses_the_plans_pricing_and_says_when_there_is_none(tmp_path, capsys):
    from partitioner_cli.main import main
    from solvers import solve

    cl = cluster(1, 2)
    prof = uniform(4, params=1e8)
    prof.save(tmp_path / "prof.json")
    cl.save(tmp_path / "c.json")
    res = solve(prof, cl, solver="dp", options=CostOptions(reserved_bytes=3 * GIB), micro_batches=2)
    res.plan.save(tmp_path / "plan.json")
    assert main(["simulate", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "prof.json"),
                 "--cluster", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and f"{res.plan.predicted['peak_memory_bytes'] / GIB:.2f} GiB" in out
    replace(res.plan, pricing=None).save(tmp_path / "old.json")
    main(["simulate", str(tmp_path / "old.json"), "--profile", str(tmp_path / "prof.json"),
          "--cluster", str(tmp_path / "c.json")])
    assert "does not record the options" in capsys.readouterr().out


# -- Sailor's measured runs ----------------------------------------------------------------------------

def _run(name: str):
    return import_sailor_run(RUNS / f"plan_config_{name}.json", DATA / "sailor_opt350", NETWORK)


def test_measured_runs_become_plans_of_tensor_parallel_groups():
    run = _run("N16_D4")
    plan = run.plan
    assert len(plan.virtual_workers) == 4 and [s.layers for s in plan.virtual_workers[0].stages] == [
        (0, 5), (5, 12), (12, 19), (19, 26)]
    assert plan.micro_batch_size == 8 and plan.micro_batches == 1024 // (8 * 4) and plan.schedule == "1f1b"
    assert run.profile.meta["tensor_parallel"] == 4 and len(run.cluster.devices) == 16
    assert run.options.precision == "fp16"
    CostModel(run.profile, run.cluster, run.options).validate_plan(plan)


def test_measured_runs_are_predicted_in_their_measured_order_and_memory():
    """Three 4-node plans of OPT-350M (pipeline 4 x 1, 2 x 2; data parallel 1 x 4 at another batch
    size): predicted iteration times in the measured order, peaks within 15%."""
    runs = [_run(n) for n in ("N4_D1", "N4_D2", "N2_D2")]
    for run in runs:
        tl = simulate_plan(run.plan, run.profile, run.cluster, run.options)
        assert abs(max(tl.peak_memory_bytes.values()) / run.measured_peak_bytes - 1) < 0.15
        assert abs(tl.iteration_s / run.measured_iteration_s - 1) < 0.2
    four = runs[:2]
    pred = [simulate_plan(r.plan, r.profile, r.cluster, r.options).iteration_s for r in four]
    assert (pred[0] > pred[1]) == (four[0].measured_iteration_s > four[1].measured_iteration_s)


# -- replicated stages -------------------------------------------------------------------------------

@pytest.mark.parametrize("replicas,m", [(2, 8), (4, 8), (3, 9)])
def test_replicated_stage_simulated_equals_its_closed_form(replicas, m):
    """One stage over r identical GPUs: each runs m / r micro-batches, then the all-reduce and the step."""
    cl = cluster(1, replicas, intra=20.0)
    prof = uniform(2, params=1e9, update=0.125)
    devs = [f"n0:{i}" for i in range(replicas)]
    plan = Plan("u", (VirtualWorker((Stage((0, 2), devs[0], replicas=tuple(devs[1:])),)),), "1f1b", 1, m)
    opts = CostOptions(reserved_bytes=0.0)
    cost = CostModel(prof, cl, opts)
    tl = simulate_plan(plan, prof, cl, opts)
    expect = m // replicas * 6.0 + cost.allreduce_s(2e9, devs) + 0.25
    assert tl.iteration_s == pytest.approx(expect, rel=1e-9)
    assert cost.plan_iteration_s(plan) == pytest.approx(expect, rel=1e-9)
    per_device = {d: sum(1 for e in tl.events() if e[0] == tl.devices.index(d) and e[1] == "F") for d in devs}
    assert set(per_device.values()) == {m // replicas}


@pytest.mark.parametrize("replicas", [(2, 1), (1, 2), (2, 2), (3, 1), (1, 3), (2, 2, 2), (1, 2, 1)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pipelines_of_replicated_stages_are_priced_from_whole_micro_batches(replicas, schedule):
    """Each replica runs whole micro-batches: the closed form takes the first across a replicated
    stage at one replica's time and what the stage adds after it from its busiest replica. On equal
    replicas it is exact where the replicas sit before every single stage (and under 1F1B on
    replicated stages throughout), elsewhere above the simulator by at most a quarter, never below
    (it took the stage's latency at the replicas' combined pace, 4-25 % below the simulator here)."""
    opts = CostOptions(reserved_bytes=0.0)
    devs = [f"n0:{i}" for i in range(sum(replicas))]
    cl = cluster(1, len(devs), intra=50.0)
    prof = uniform(2 * len(replicas), params=1e8)
    stages, i = [], 0
    for k, r in enumerate(replicas):
        stages.append(Stage((2 * k, 2 * k + 2), devs[i], replicas=tuple(devs[i + 1:i + r])))
        i += r
    cost = CostModel(prof, cl, opts)
    for m in (4, 8, 12):
        plan = Plan("u", (VirtualWorker(tuple(stages)),), schedule, 1, m)
        sim, closed = simulate_plan(plan, prof, cl, opts).iteration_s, cost.plan_iteration_s(plan)
        assert sim * (1 - 1e-9) <= closed <= 1.25 * sim
        if replicas in ((2, 1), (3, 1), (1, 2, 1)) or (schedule == "1f1b" and 1 not in replicas):
            assert closed == pytest.approx(sim, rel=1e-9)


def test_mixed_replicas_share_micro_batches_by_speed_and_pipelines_do_not_deadlock():
    layers = tuple(LayerProfile(f"l{i}", param_bytes=1e8, saved_bytes=1e6, output_bytes=1e6,
                                times={"fast": LayerTime(1.0, 2.0), "slow": LayerTime(2.0, 4.0)}) for i in range(3))
    prof = Profile("u", 1, layers)
    cl = Cluster("c", (Node("n0", ("fast", "slow", "fast"), 50.0), Node("n1", ("fast",), 50.0)), 5.0,
                 {"fast": big_type("fast"), "slow": big_type("slow")})
    for schedule in ("1f1b", "gpipe"):
        plan = Plan("u", (VirtualWorker((Stage((0, 1), "n0:0", replicas=("n0:1",)), Stage((1, 2), "n0:2"),
                                         Stage((2, 3), "n1:0"))),), schedule, 1, 9)
        tl = simulate_plan(plan, prof, cl)
        forwards = {d: sum(1 for e in tl.events() if tl.devices[e[0]] == d and e[1] == "F") for d in tl.devices}
        assert forwards == {"n0:0": 6, "n0:1": 3, "n0:2": 9, "n1:0": 9}  # twice as fast, twice the share
        assert any(e[1] == "ALLREDUCE" for e in tl.events())
        assert CostModel(prof, cl).plan_iteration_s(plan) == pytest.approx(tl.iteration_s, rel=0.25)


# -- profiles at several micro-batch sizes -------------------------------------------------------------

def test_profile_at_measured_and_interpolated_sizes_never_extrapolated(tmp_path):
    from partitioner.importers.sailor import import_sailor

    prof = import_sailor(DATA / "sailor_opt350", micro_batch_size=2, tensor_parallel=4, gpu_types=("GH-96",),
                         all_sizes=True)
    assert prof.measured_sizes == (1, 2, 4, 8, 16, 32, 64, 128)
    prof.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == prof  # times_at round-trips
    eight = prof.at_size(8)
    direct = import_sailor(DATA / "sailor_opt350", micro_batch_size=8, tensor_parallel=4, gpu_types=("GH-96",))
    for a, b in zip(eight.layers, direct.layers, strict=True):
        assert a.times["GH-96"].fwd_s == b.times["GH-96"].fwd_s and a.saved_bytes == pytest.approx(b.saved_bytes)
    six = prof.at_size(6)  # halfway between 4 and 8
    four, eight_ = prof.at_size(4), prof.at_size(8)
    t = [x.layers[5].times["GH-96"].bwd_s for x in (four, six, eight_)]
    assert t[1] == pytest.approx((t[0] + t[2]) / 2) and six.meta["times_at_size"] == "interpolated between 4 and 8"
    with pytest.raises(FormatError, match="within the measured sizes 1, 2, 4, 8, 16, 32, 64, 128"):
        prof.at_size(256)
    single = import_sailor(DATA / "sailor_opt350", micro_batch_size=2, tensor_parallel=4, gpu_types=("GH-96",))
    assert single.measured_sizes == (2,) and single.at_size(4).meta["rescaled_from"] == 2  # linear, as before


def test_micro_batch_choice_tries_only_measured_ranges():
    from partitioner.importers.sailor import import_sailor
    from solvers.cluster.microbatch import choose_micro_batches
    from solvers.cluster.planner import plan_cluster

    prof = import_sailor(DATA / "sailor_opt350", micro_batch_size=2, tensor_parallel=4, gpu_types=("GH-96",),
                         all_sizes=True)
    prof = Profile(prof.model, prof.micro_batch_size,
                   tuple(replace(x, times_at={k: v for k, v in x.times_at.items() if k <= 8}) for x in prof.layers),
                   prof.dtype, prof.source, prof.edges, prof.meta)
    cl = Cluster("c", (Node("n0", ("GH-96",) * 2, 100.0),), 25.0,
                 {"GH-96": big_type("GH-96")})
    choice = choose_micro_batches(prof, cl, 32, plan_cluster, virtual_workers=1)
    assert choice is not None
    assert {b for b, _, _ in choice.tried} == {1, 2, 4, 8}  # 16 and 32 divide 32 but were never measured


def test_placement_says_what_each_target_runs():
    from partitioner.placement import place, supports

    cl = cluster(1, 4)
    plain = Plan("u", (VirtualWorker((Stage((0, 1), "n0:0"), Stage((1, 2), "n0:1"))),), "1f1b", 1, 4)
    assert [p.devices for p in place(plain)] == [("n0:0", "n0:1")]
    assert supports(plain, "simulator") is None and supports(plain, "runtime") is None
    rep = Plan("u", (VirtualWorker((Stage((0, 1), "n0:0", replicas=("n0:2",)), Stage((1, 2), "n0:1"))),),
               "1f1b", 1, 4)
    assert supports(rep, "simulator") is None and supports(rep, "runtime") is None  # 1f1b: executed
    assert supports(replace(rep, schedule="2bw"), "runtime") is None  # replicas under 2bw and wsp: executed
    assert "replicated stages with schedule gpipe, 1f1b, 2bw or wsp" in supports(replace(rep, schedule="bfs"), "runtime")
    assert supports(replace(plain, schedule="2bw"), "runtime") is None  # the runtime runs PipeDream-2BW
    assert supports(replace(plain, first_slices=2, micro_batch_size=2), "runtime") is None  # executed in slices
    bad = Plan("u", (VirtualWorker((Stage((0, 1), "n0:0"), Stage((1, 2), "n0:1"), Stage((2, 3), "n0:1"),
                                    Stage((3, 4), "n0:0"))),), "interleaved", 1, 2, chunks=2)
    assert "must be on n0:0" in supports(bad, "simulator")
    simulate_plan(rep, uniform(2), cl)  # what the simulator supports it runs
    with pytest.raises(FormatError, match="target = 'gpu': must be one of simulator, runtime"):
        supports(plain, "gpu")


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(counts=st.lists(st.integers(1, 3), min_size=1, max_size=4), m=st.integers(1, 9),
       schedule=st.sampled_from(["1f1b", "gpipe", "2bw"]))
def test_replicated_pipelines_run_every_micro_batch_once_without_deadlock(counts, m, schedule):
    n = sum(counts)
    cl = cluster(1, n)
    prof = uniform(len(counts), params=1e6)
    names = iter(f"n0:{i}" for i in range(n))
    stages = []
    for k, c in enumerate(counts):
        devs = [next(names) for _ in range(c)]
        stages.append(Stage((k, k + 1), devs[0], replicas=tuple(devs[1:])))
    plan = Plan("u", (VirtualWorker(tuple(stages)),), schedule, 1, m)
    tl = simulate_plan(plan, prof, cl, iterations=2 if schedule == "2bw" else 1)
    for k in range(len(counts)):
        forwards = sorted(e[2] for e in tl.events() if e[1] == "F" and e[3] == k)
        assert forwards == sorted(range(m * (2 if schedule == "2bw" else 1)))


def test_schedule_depths_are_checked():
    from partitioner.schedule import schedule_columns

    assert len(schedule_columns("1f1b", 3, 4, depths=[4, 1, 0])) == 3
    with pytest.raises(FormatError, match="each at least one more than the next"):
        schedule_columns("1f1b", 3, 4, depths=[1, 1, 0])


def _mixed_config(tmp_path, dp):
    def rep(gpu):
        return [[[gpu, 4, "zone"]], 1]

    cfg = {"pipeline_list": [{"num_stages": 2, "layers_per_stage": [list(range(0, 12)), list(range(12, 26))],
                              "tmp_per_stage": [[rep("A100-40")] * dp[0], [rep("V100-16")] * dp[1]], "dp": dp}],
           "mbs": 1, "gbs": 8, "real": 1.0, "max_mem": 8e9, "N": 2}
    path = tmp_path / "plan_config_mixed.json"
    path.write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("dp", [[2, 2], [3, 1]])
def test_heterogeneous_runs_import_and_simulate(tmp_path, dp):
    run = import_sailor_run(_mixed_config(tmp_path, dp), DATA / "sailor_opt350", NETWORK)
    types = {d.gpu_type for d in run.cluster.devices}
    assert types == {"A100-SXM4-40GB", "V100-SXM2-16GB"} and len(run.cluster.devices) == sum(dp)
    # tensor parallelism 1 on 4-GPU nodes: the replicas of a type share a node
    assert len(run.cluster.nodes) == 2
    if dp[0] == dp[1]:
        assert len(run.plan.virtual_workers) == 2 and run.plan.micro_batches == 4
    else:  # replica counts differ: one pipeline with replicated stages
        assert [len(s.devices) for s in run.plan.virtual_workers[0].stages] == dp and run.plan.micro_batches == 8
    run.plan.validate(run.profile, run.cluster)
    tl = simulate_plan(run.plan, run.profile, run.cluster, run.options)
    assert tl.iteration_s > 0 and any(e[1] == "ALLREDUCE" for e in tl.events())


def test_shared_nics_import_gives_one_flow_the_one_gpu_curve_and_each_node_its_measured_capacity():
    """Sailor measured GH200's inter-node curve with 1, 2 and 4 GPUs of a node sending at once:
    with ``shared_nics`` (the default) each node gets one NIC of the 4-GPU curve's cap that its
    flows share, and a flow of one GPU runs at the 1-GPU curve; a device that is a tensor-parallel
    group of 4 runs its collectives as 4 rings (the 4-GPU curve) and sends at one GPU's rate.
    Without, every flow at the 4-GPU curve."""
    import json

    from partitioner.importers.sailor_runs import sailor_cluster

    name = RUNS / "plan_config_N16_D4.json"
    plain = import_sailor_run(name, DATA / "sailor_opt350", NETWORK, shared_nics=False)
    shared = import_sailor_run(name, DATA / "sailor_opt350", NETWORK)
    one, four = (sailor_bandwidth(NETWORK, "inter", "GH-96", k) for k in (1, 4))
    assert not plain.cluster.has_nics and plain.cluster.inter_curve.gbps == four.gbps
    assert {n.nic_gbps for n in shared.cluster.nodes} == {four.gbps}
    link = shared.cluster.inter_curve
    assert link.gbps == four.gbps and link.p2p_scale == pytest.approx(one.gbps / four.gbps, rel=1e-12)
    assert shared.plan == plain.plan and shared.profile == plain.profile
    per_node = {k: v["gpus_per_node"] for k, v in json.loads(
        (DATA / "sailor_opt350" / "basic_cluster_config.json").read_text()).items() if isinstance(v, dict)}
    single = sailor_cluster(NETWORK, {"GH-96": 8}, per_node, profile_dir=DATA / "sailor_opt350", shared_nics=True)
    assert single.inter_curve.gbps == one.gbps and single.inter_curve.p2p_scale == 1.0


def test_cli_import_sailor_run_writes_the_nics_unless_told_not_to(tmp_path):
    from partitioner_cli.main import main

    run = RUNS / "plan_config_N16_D4.json"
    argv = ["import", "sailor-run", str(run), "--profiles", str(DATA / "sailor_opt350"), "--network", str(NETWORK)]
    assert main([*argv, "--no-shared-nics", "-o", str(tmp_path / "plain")]) == 0
    assert main([*argv, "-o", str(tmp_path / "shared")]) == 0
    plain, shared = (Cluster.load(tmp_path / d / "cluster.json") for d in ("plain", "shared"))
    assert not plain.has_nics and shared.has_nics
    assert {n.nic_gbps for n in shared.nodes} == {sailor_bandwidth(NETWORK, "inter", "GH-96", 4).gbps}


def test_nodes_of_one_type_in_a_mixed_cluster_keep_their_own_curve():
    """Between two A100 nodes of an A100 + V100 cluster, the A100 curve; between an A100 and a V100
    node, and between V100 nodes, the slower V100 one (before, every pair of one type fell back
    to the slowest type's curve)."""
    from partitioner.importers.sailor_runs import sailor_cluster

    cl = sailor_cluster(NETWORK, {"A100-40": 8, "V100-16": 8}, {"A100-40": 4, "V100-16": 4},
                        profile_dir=DATA / "sailor_opt350")
    a100, v100 = (sailor_bandwidth(NETWORK, "inter", g, 4) for g in ("A100-40", "V100-16"))
    assert a100.gbps_at(1e8) > v100.gbps_at(1e8)
    assert cl.link("n0:0", "n1:0").gbps == a100.gbps
    assert cl.link("n0:0", "n2:0").gbps == v100.gbps and cl.link("n2:0", "n3:0").gbps == v100.gbps


def test_cli_import_sailor_network_with_shared_nics(tmp_path):
    from partitioner_cli.main import main

    base = ["import", "sailor-network", str(NETWORK), "--gpu-type", "GH-96", "--nodes", "2", "--gpus-per-node", "4"]
    assert main([*base, "-o", str(tmp_path / "plain.json")]) == 0
    assert main([*base, "--shared-nics", "-o", str(tmp_path / "shared.json")]) == 0
    plain, shared = (Cluster.load(tmp_path / f) for f in ("plain.json", "shared.json"))
    one, four = (sailor_bandwidth(NETWORK, "inter", "GH-96", k) for k in (1, 4))
    assert not plain.has_nics and plain.inter_curve.gbps == four.gbps
    assert shared.inter_curve.gbps == one.gbps and {n.nic_gbps for n in shared.nodes} == {four.gbps}
