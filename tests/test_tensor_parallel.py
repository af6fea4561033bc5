"""Tensor parallelism in the data: profiles with shards per degree, clusters viewed as groups,
the cost model and the simulator pricing groups alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from partitioner.cluster import Cluster, Node, split_kind
from partitioner.cost import CostModel
from partitioner.errors import FormatError
from partitioner.importers.sailor import import_sailor_degrees
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions
from partitioner.profile import Profile
from partitioner.simulate import simulate_plan

SAILOR = Path(__file__).resolve().parents[2] / "shared" / "data" / "sailor_opt350"
needs_sailor = pytest.mark.skipif(not SAILOR.is_dir(), reason="shared Sailor profiles not present")
FP16 = CostOptions(precision="fp16")


@pytest.fixture(scope="module")
def opt350() -> Profile:
    if not SAILOR.is_dir():
        pytest.skip("shared Sailor profiles not present")
    return import_sailor_degrees(SAILOR, micro_batch_size=1)


def _cluster(gpus: dict[str, int], nodes: int = 2, **tp: int) -> Cluster:
    made = []
    for i in range(nodes):
        types: list[str] = []
        for t, c in gpus.items():
            types += [t] * c
        made.append(Node(f"n{i}", tuple(types), 100.0))
    return Cluster("c", tuple(made), 10.0).with_tensor_parallel(tp)


def _plan(profile: Profile, stages: list[tuple[str, int, int]], m: int = 8) -> Plan:
    return Plan(profile.model, (VirtualWorker(tuple(Stage((a, b), d) for d, a, b in stages)),), "1f1b", 1, m)


@needs_sailor
def test_sailor_import_keeps_every_degree_and_round_trips(opt350: Profile) -> None:
    assert opt350.tensor_parallel_degrees == (1, 2, 4, 8)
    assert Profile.from_dict(opt350.to_dict()) == opt350
    block = opt350.layers[5]
    for t in (2, 4):  # a block's weights are split t ways (layer norms and biases of the row-parallel
        # projections stay whole, so a shard is a little more than 1/t)
        assert block.param_bytes / t < block.shards[t].param_bytes < 1.01 * block.param_bytes / t
        assert block.shards[t].saved_bytes < block.saved_bytes
    assert "A100-SXM4-40GB" not in opt350.shard(8).gpu_types  # Sailor measured A100s up to degree 4
    assert opt350.shard(1) is opt350


def test_a_degree_no_layer_was_profiled_at_is_refused_naming_the_layer(opt350: Profile) -> None:
    with pytest.raises(FormatError, match=r"layers\[0\]\.tensor_parallel.*degree 16"):
        opt350.shard(16)


def test_groups_are_gpus_of_one_type_on_one_node() -> None:
    plain = _cluster({"V100-16": 4})
    assert [d.name for d in plain.with_tensor_parallel({}).devices] == [d.name for d in plain.devices]
    grouped = _cluster({"V100-16": 4, "A100-40": 2}, V100_16=2)
    assert [d.name for d in grouped.devices][:3] == ["n0:0-1", "n0:2-3", "n0:4"]
    assert split_kind(grouped.devices[0].kind) == ("V100-SXM2-16GB", 2)
    assert grouped.device("n1:4-5").gpus == 2  # any group of one type can be named
    with pytest.raises(FormatError, match="mixes GPU types"):
        grouped.device("n0:3-4")
    with pytest.raises(FormatError, match="never spans nodes or GPU types"):
        _cluster({"V100-16": 3}).with_tensor_parallel({"V100-16": 2})
    assert Cluster.from_dict(grouped.to_dict()).devices == grouped.devices


def test_a_gpu_in_two_devices_is_refused(opt350: Profile) -> None:
    cl = _cluster({"V100-16": 4})
    plan = Plan(opt350.model, (VirtualWorker((Stage((0, 13), "n0:0-1"), Stage((13, 26), "n1:0"))),
                               VirtualWorker((Stage((0, 13), "n0:1"), Stage((13, 26), "n1:1")))), "1f1b", 1, 8)
    with pytest.raises(FormatError, match="shares GPU n0:1"):
        plan.validate(opt350, cl)


@pytest.mark.parametrize("stages", [
    [("n0:0-1", 0, 13), ("n0:2-3", 13, 26)],  # two groups on a node
    [("n0:0-3", 0, 20), ("n1:0", 20, 26)],  # degrees 4 and 1 in one pipeline, across nodes
    [("n0:0-1", 0, 10), ("n0:2", 10, 16), ("n1:0-1", 16, 26)],
])
def test_closed_form_equals_the_simulator_on_tensor_parallel_plans(opt350: Profile, stages: list) -> None:
    cl = _cluster({"V100-16": 4})
    plan = _plan(opt350, stages)
    plan.validate(opt350, cl)
    cost = CostModel(opt350, cl, FP16)
    tl = simulate_plan(plan, opt350, cl, FP16)
    assert cost.plan_iteration_s(plan) == pytest.approx(tl.iteration_s, rel=1e-9)
    assert cost.plan_memory_bytes(plan) == pytest.approx(dict(tl.peak_memory_bytes), rel=1e-9)


def test_closed_form_is_conservative_when_the_first_stage_is_the_bottleneck(opt350: Profile) -> None:
    """1F1B's warm-up runs the first stage's second forward while the later stages do the first
    micro-batch's round trip; the closed form counts that round trip as exposed, so with a first
    stage slower than the rest's round trip it is above the simulator (by at most that trip)."""
    cl = _cluster({"V100-16": 4})
    plan = _plan(opt350, [("n0:0", 0, 17), ("n1:0-1", 17, 26)])
    cost = CostModel(opt350, cl, FP16)
    closed, simulated = cost.plan_iteration_s(plan), simulate_plan(plan, opt350, cl, FP16).iteration_s
    trip = sum(cost.fwd_bwd_s(cl.device("n1:0-1").kind, 17, 26))
    assert simulated < closed <= simulated + trip + 1e-9


def test_a_group_is_priced_with_its_shard(opt350: Profile) -> None:
    cl = _cluster({"V100-16": 4})
    cost = CostModel(opt350, cl, FP16)
    one, two = cl.device("n0:0"), cl.device("n0:0-1")
    assert cost.compute_s(two.kind, 1, 25) < cost.compute_s(one.kind, 1, 25)
    assert cost.compute_s(two.kind, 1, 25) == pytest.approx(
        CostModel(opt350.shard(2), cl, FP16).compute_s(one.gpu_type, 1, 25))
    sched = _plan(opt350, [("n0:0", 0, 26)]).pipeline_schedule
    assert cost.stage_memory_bytes(0, 26, 1, sched, 2) < cost.stage_memory_bytes(0, 26, 1, sched)
    # data parallelism over groups all-reduces every shard: about the whole model's gradients
    assert cost.param_bytes(1, 25, 2) == pytest.approx(cost.param_bytes(1, 25), rel=0.01)


# -- the 3D search ------------------------------------------------------------------------------


def test_candidates_hold_the_global_batch_and_groups_stay_in_nodes(opt350: Profile) -> None:
    from solvers.cluster.tensor import candidates, type_degrees

    cl = _cluster({"V100-16": 4})
    assert type_degrees(opt350, cl) == {"V100-SXM2-16GB": (1, 2, 4)}  # 8 GPUs never share a node here
    cands = candidates({1: opt350, 2: opt350.at_size(2)}, cl, 64, FP16)
    assert {c.micro_batch_size for c in cands} == {1, 2}
    assert all(c.virtual_workers * c.micro_batches * c.micro_batch_size == 64 for c in cands)
    assert [c.bound_samples_per_s for c in cands] == sorted((c.bound_samples_per_s for c in cands), reverse=True)
    assert {c.micro_batch_size for c in candidates({1: opt350, 2: opt350.at_size(2)}, cl, 63, FP16)} == {1}


def test_degree_one_gives_the_cluster_planners_plan(opt350: Profile) -> None:
    from solvers.cluster.planner import plan_cluster
    from solvers.cluster.tensor import plan_tensor_parallel

    cl = _cluster({"V100-16": 2}, nodes=2)
    res = plan_tensor_parallel(opt350, cl, 32, options=FP16, tensor_parallel=1, virtual_workers=2)
    ref = plan_cluster(opt350, cl, 2, micro_batches=16, options=FP16)
    assert res.plan.virtual_workers == ref.plan.virtual_workers
    # the same closed form; the answer is priced by the simulator, as the cluster planner's prediction
    assert res.details["closed_form"]["samples_per_s"] == pytest.approx(1.0 / ref.objective)
    assert 1.0 / res.objective == pytest.approx(ref.plan.predicted["samples_per_s"])


def test_the_search_takes_the_best_candidate_and_its_bound_holds(opt350: Profile) -> None:
    from solvers.cluster.planner import plan_cluster
    from solvers.cluster.tensor import candidates, plan_tensor_parallel

    cl = _cluster({"V100-16": 2}, nodes=2)
    res = plan_tensor_parallel(opt350, cl, 16, options=FP16, time_limit_s=120, rel_tol=0.0)
    assert res.ok
    best, simulated = 0.0, 0.0
    for c in candidates({1: opt350}, cl, 16, FP16):  # every candidate planned on its own: none is better
        r = plan_cluster(opt350, cl.with_tensor_parallel(dict(c.degrees)), c.virtual_workers,
                         micro_batches=c.micro_batches, options=FP16)
        if r.ok:
            best = max(best, 1.0 / r.objective)
            simulated = max(simulated, r.plan.predicted["samples_per_s"])
    # ranked by the closed form, answered at the simulated figure, bounded for the simulator
    assert res.details["closed_form"]["samples_per_s"] == pytest.approx(best)
    assert 1.0 / res.objective == pytest.approx(res.plan.predicted["samples_per_s"])
    assert 1.0 / res.lower_bound >= simulated * (1 - 1e-9)
    assert res.details["closed_form"]["bound_samples_per_s"] >= best * (1 - 1e-9)
    for stage in (s for w in res.plan.virtual_workers for s in w.stages):
        for dev in stage.devices:
            assert len({g.split(":")[0] for g in cl.device(dev).gpu_names}) == 1


def test_the_search_with_replication_plans_replicated_stages_and_its_bound_holds(opt350: Profile) -> None:
    """`--micro-batches auto --replication`: the search hands replication to the cluster planner
    (a stage over several GPUs, of one type or several), drops the pace bounds (they take one
    device a stage), and its certificate still holds for the simulated answer; the answer is no
    worse than the search without replication."""
    from partitioner.cost import CostModel
    from solvers.cluster.tensor import plan_tensor_parallel

    cl = Cluster("mix", (Node("n0", ("V100-16",) * 2, 100.0), Node("n1", ("A100-40",) * 2, 100.0)), 10.0)
    pure = plan_tensor_parallel(opt350, cl, 16, options=FP16, time_limit_s=60, rel_tol=0.0)
    rep = plan_tensor_parallel(opt350, cl, 16, options=FP16, time_limit_s=60, rel_tol=0.0, replication=True)
    assert pure.ok and rep.ok
    CostModel(opt350.at_size(rep.plan.micro_batch_size), cl, FP16).validate_plan(rep.plan)
    simulated = rep.plan.predicted["samples_per_s"]
    assert 1.0 / rep.lower_bound >= simulated * (1 - 1e-9)
    assert rep.details["closed_form"]["samples_per_s"] >= pure.details["closed_form"]["samples_per_s"] * (1 - 1e-9)


# -- the per-layer bound ------------------------------------------------------------------------


def test_the_layer_bound_holds_for_the_planners_plans(opt350: Profile) -> None:
    from partitioner.schedule import Schedule
    from solvers.cluster.bounds.layers import layer_bound
    from solvers.cluster.planner import plan_cluster, price_plan

    cl = Cluster("c", (Node("n0", ("V100-16",) * 2, 100.0), Node("n1", ("A100-40",) * 2, 100.0)), 10.0)
    for k in (1, 2):
        res = plan_cluster(opt350, cl, k, micro_batches=8, options=FP16)
        assert res.ok and res.plan is not None
        rate = price_plan(CostModel(opt350, cl, FP16), res.plan)["samples_per_s"]
        bound = layer_bound(CostModel(opt350, cl, FP16), cl.devices, k, Schedule.of("1f1b", 8))
        assert rate <= bound * (1 + 1e-9)
        assert 1.0 / res.lower_bound <= bound * (1 + 1e-9)  # the planner's certificate takes it


def test_the_layer_bound_of_one_kind_is_the_lp_of_two_identical_halves() -> None:
    import numpy as np

    from solvers.cluster.bounds.layers import _solve

    rng = np.random.default_rng(0)
    for _ in range(20):
        layers = int(rng.integers(2, 8))
        comp, hold, mem = (rng.uniform(0.1, 1.0, (layers, 1)) for _ in range(3))
        count, cap = np.array([4.0]), np.array([float(rng.uniform(1.0, 6.0))])
        k, m = int(rng.integers(1, 5)), int(rng.integers(1, 9))
        one = _solve(comp, hold, mem, count, cap, k, m, 1)
        two = _solve(np.hstack([comp, comp]), np.hstack([hold, hold]), np.hstack([mem, mem]),
                     np.array([2.0, 2.0]), np.array([cap[0], cap[0]]), k, m, 1)
        assert one == pytest.approx(two, rel=1e-6) or (one == 0.0 and two == 0.0)


def test_the_layer_bound_at_one_worker_bounds_every_worker_count(opt350: Profile) -> None:
    from partitioner.schedule import Schedule
    from solvers.cluster.bounds.layers import layer_bound

    cl = Cluster("c", (Node("n0", ("V100-16",) * 4, 100.0), Node("n1", ("A100-40",) * 4, 100.0)), 10.0)
    for view in (cl, cl.with_tensor_parallel({"V100-16": 2})):
        cost = CostModel(opt350, view, FP16)
        one = layer_bound(cost, view.devices, 1, Schedule.of("1f1b", 8), every_k=True)
        for k in range(2, len(view.devices) + 1):
            assert layer_bound(cost, view.devices, k, Schedule.of("1f1b", 8)) <= one * (1 + 1e-9)


# -- the 3D search against exhaustive enumeration ------------------------------------------------


def _tiny(seed: int) -> tuple[Profile, Cluster]:
    """Three or four layers with a degree-2 shard, on one node of two A GPUs and one of two B; the
    layers' weights (2-3.2 GB each, 10-16 GB with a second version, gradients and Adam) make memory
    bind: no GPU holds the model, a V100 holds at most one layer, groups of two hold more."""
    import random

    from partitioner.profile import LayerProfile, LayerShard, LayerTime

    rnd = random.Random(seed)
    layers = []
    for i in range(rnd.choice((3, 4))):
        a, b = rnd.uniform(1, 3) * 1e-3, rnd.uniform(1, 3) * 1e-3
        speedup = rnd.uniform(1.1, 1.9)
        params = rnd.uniform(2e9, 3.2e9)
        shard = LayerShard(params / 2, 1e8, {t: LayerTime(x / speedup / 3, 2 * x / speedup / 3)
                                             for t, x in (("A100-40", a), ("V100-16", b))})
        layers.append(LayerProfile(f"l{i}", param_bytes=params, saved_bytes=2e8,
                                   output_bytes=rnd.uniform(1e6, 5e7),
                                   times={"A100-40": LayerTime(a / 3, 2 * a / 3), "V100-16": LayerTime(b / 3, 2 * b / 3)},
                                   shards={2: shard}))
    cl = Cluster("tiny", (Node("n0", ("A100-40",) * 2, 50.0), Node("n1", ("V100-16",) * 2, 50.0)), 5.0)
    return Profile("tiny", 1, tuple(layers)), cl


def _exhaustive(profile: Profile, cluster: Cluster, global_batch: int, options: CostOptions) -> float:
    """The best samples/s of every plan of the search's space: each GPU type idle or at degree 1 or
    2, every GPU of the used types in a worker; K, grouping, device order and split; priced by the
    cluster planner's closed form."""
    import itertools

    from solvers.cluster.planner import price_plan

    best = 0.0
    for da, dv in itertools.product((0, 1, 2), (0, 1, 2)):
        if da == dv == 0:
            continue
        view = cluster.with_tensor_parallel({t: d for t, d in (("A100-40", da), ("V100-16", dv)) if d})
        cost = CostModel(profile, view, options)
        idle = {name for name, d in (("A100-SXM4-40GB", da), ("V100-SXM2-16GB", dv)) if d == 0}
        devs = [d.name for d in view.devices if d.gpu_type not in idle]
        n_layers = profile.num_layers
        for k in (1, 2, 4, 8):
            if k > len(devs):
                continue
            m = global_batch // k
            for owner in itertools.product(range(k), repeat=len(devs)):
                groups = [[d for d, o in zip(devs, owner) if o == w] for w in range(k)]
                if any(not g or len(g) > n_layers for g in groups):
                    continue
                if [owner.index(w) for w in range(k)] != sorted(owner.index(w) for w in range(k)):
                    continue  # workers numbered by their first device: each grouping once
                for workers in itertools.product(*(_pipelines(g, n_layers) for g in groups)):
                    plan = Plan(profile.model, tuple(workers), "2bw", 1, m)
                    try:
                        cost.check_plan_memory(plan)
                    except FormatError:
                        continue
                    best = max(best, price_plan(cost, plan)["samples_per_s"])
    return best


def _pipelines(devices: list[str], n_layers: int) -> list[VirtualWorker]:
    import itertools

    out = []
    for order in itertools.permutations(devices):
        for cuts in itertools.combinations(range(1, n_layers), len(order) - 1):
            edges = (0, *cuts, n_layers)
            out.append(VirtualWorker(tuple(Stage((edges[i], edges[i + 1]), d) for i, d in enumerate(order))))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_the_3d_search_equals_exhaustive_enumeration_on_tiny_instances(seed: int) -> None:
    """Degree per type (or idle) x K x grouping x order x split, every one priced: the search finds
    the best (no all-reduce priced and a no-flush schedule, where the cluster planner is exact)."""
    from solvers.cluster.tensor import plan_tensor_parallel

    profile, cluster = _tiny(seed)
    options = CostOptions(sync=False, reserved_bytes=0.0)
    res = plan_tensor_parallel(profile, cluster, 8, options=options, schedule="2bw", rel_tol=0.0,
                               time_limit_s=300)
    assert res.ok
    assert 1.0 / res.objective == pytest.approx(_exhaustive(profile, cluster, 8, options), rel=1e-9)
    assert 1.0 / res.lower_bound >= 1.0 / res.objective * (1 - 1e-9)


# -- shards measured on one device ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_shards() -> Profile:
    torch = pytest.importorskip("torch")
    from partitioner.models import build_model
    from partitioner.profiler import profile_model
    from partitioner.shard_profiler import profile_shards

    torch.set_num_threads(1)
    m = build_model("gpt2-tiny", 2)
    prof = profile_model(m.layers, m.sample_input("cpu"), model_name="gpt2-tiny", warmup=0, repeats=1,
                         min_layer_time_s=0.0, progress=False)
    shards = {t: build_model("gpt2-tiny", 2, tensor_parallel=t).layers for t in (2, 4)}
    return profile_shards(prof, m.layers, shards, m.sample_input("cpu"), sharded=["block0", "block1"], warmup=0,
                          repeats=1, min_layer_time_s=0.0)


def test_a_measured_shard_holds_its_part_and_the_cost_model_adds_its_all_reduces(tiny_shards: Profile) -> None:
    from partitioner.cluster import DeviceType

    p = tiny_shards
    assert p.tensor_parallel_degrees == (1, 2, 4) and Profile.from_dict(p.to_dict()) == p
    block, embed = p.layers[1], p.layers[0]
    for t in (2, 4):  # weights split t ways, layer norms and the row-parallel biases whole
        assert block.param_bytes / t < block.shards[t].param_bytes < 1.05 * block.param_bytes / t
        assert block.shards[t].allreduce_bytes == 2 * 2 * 32 * 64 * 4  # 2 x b s h fp32 elements
        assert embed.shards[t].param_bytes == embed.param_bytes and embed.shards[t].allreduce_bytes == 0
    cpu = DeviceType("cpu", 64 * 2**30, 1e12, 1e11)
    for gbps in (1.0, 100.0):
        cl = Cluster("c", (Node("n0", ("cpu",) * 4, gbps),), 1.0, {"cpu": cpu})
        cost = CostModel(p, cl, CostOptions())
        comm = cost.at_degree(2).tensor_parallel_comm_s("cpu")
        # two all-reduces of b s h elements each way: a ring of 2 sends 2 x 1/2 of each
        assert comm[1] == pytest.approx(2 * 2 * 1 * (2 * 32 * 64 * 4 / 2) / (gbps * 1e9))
        f, b = cost.fwd_bwd_s(cl.device("n0:0-1").kind, 1, 2)
        assert f == pytest.approx(block.shards[2].times["cpu"].fwd_s + comm[1])
        assert b == pytest.approx(block.shards[2].times["cpu"].bwd_s + comm[1])
        b_in, b_w = cost.backward_split_s(cl.device("n0:0-1").kind, 1, 2)  # the zero-bubble split adds up
        assert b_in + b_w == pytest.approx(b) and b_in >= comm[1]
        plan = _plan(p, [("n0:0-1", 0, 2), ("n0:2-3", 2, 4)])
        tl = simulate_plan(plan, p, cl, CostOptions())
        # exact, or above by at most the later stage's round trip and one message between the stages
        # (1F1B's warm-up can hide them when the first stage is the slower: the measured times decide
        # which; on 300 random draws of the times the excess was that message's time exactly, at most)
        trip = sum(cost.fwd_bwd_s(cl.device("n0:2-3").kind, 2, 4)) + cost.boundary_s(2, cl.device("n0:0-1"), "n0:2-3")
        assert tl.iteration_s * (1 - 1e-9) <= cost.plan_iteration_s(plan) <= tl.iteration_s + trip + 1e-9


def test_a_half_precision_profile_measures_its_shards_in_half_precision() -> None:
    torch = pytest.importorskip("torch")
    from partitioner.models import build_model
    from partitioner.profiler import profile_model
    from partitioner.shard_profiler import profile_shards

    m = build_model("gpt2-tiny", 1)
    prof = profile_model(m.layers, m.sample_input("cpu"), model_name="gpt2-tiny", warmup=0, repeats=1,
                         min_layer_time_s=0.0, progress=False, dtype=torch.bfloat16)
    shards = {2: build_model("gpt2-tiny", 1, tensor_parallel=2).layers}
    p = profile_shards(prof, m.layers, shards, m.sample_input("cpu"), sharded=["block0"], warmup=0, repeats=1,
                       min_layer_time_s=0.0)
    block = p.layers[1]
    assert p.dtype == "bfloat16"
    assert block.param_bytes / 2 < block.shards[2].param_bytes < 1.05 * block.param_bytes / 2
    assert block.shards[2].allreduce_bytes == 2 * 1 * 32 * 64 * 2  # 2 x b s h elements of 2 bytes


def test_a_degree_that_does_not_divide_the_heads_is_refused_naming_it() -> None:
    pytest.importorskip("torch")
    from partitioner.errors import PartitionerError
    from partitioner.models import build_model

    with pytest.raises(PartitionerError, match="degree 3 for gpt2-tiny: its blocks have 4 attention heads"):
        build_model("gpt2-tiny", 1, tensor_parallel=3)


def test_a_fixed_pipeline_size_gives_workers_of_that_many_stages(opt350: Profile) -> None:
    from solvers.planning import PlanRequest, plan

    cl = Cluster("c", (Node("n0", ("V100-16",) * 4, 100.0), Node("n1", ("A100-40",) * 4, 100.0)), 10.0)
    for p in (1, 2, 4):
        res = plan(opt350, cl, PlanRequest(micro_batches="auto", global_batch=64, options=FP16, pipeline_parallel=p,
                                           time_limit_s=30))
        assert res.ok and res.plan is not None
        assert {len(w.stages) for w in res.plan.virtual_workers} == {p}


@pytest.mark.slow
def test_a_tensor_parallel_plan_trains_with_the_memory_it_was_priced_at(tmp_path: Path) -> None:
    """Profile gpt2-tiny with its degree-2 shards, plan the global batch with groups of two, train it
    on four gloo ranks: each rank holds the model state the cost model priced for its shard."""
    import json

    from partitioner_cli.main import main

    prof, plan, metrics = tmp_path / "g.json", tmp_path / "p.json", tmp_path / "m.json"
    cluster = str(Path(__file__).resolve().parents[1] / "examples" / "clusters" / "cpu4.yaml")
    assert main(["profile", "gpt2-tiny", "--micro-batch-size", "1", "--threads", "1", "--tensor-parallel", "2",
                 "--repeats", "1", "--warmup", "0", "-o", str(prof)]) == 0
    assert main(["plan", str(prof), "--cluster", cluster, "--micro-batches", "auto", "--global-batch", "8",
                 "--tensor-parallel", "2", "--time-limit", "10", "-o", str(plan)]) == 0
    assert main(["train", str(plan), "--profile", str(prof), "--cluster", cluster, "--model", "gpt2-tiny", "--local",
                 "--steps", "2", "--warmup", "0", "-o", str(metrics)]) == 0
    rows = json.loads(metrics.read_text())["memory"]["ranks"]
    assert len(rows) == 4 and all(r["device"].count("-") == 1 for r in rows)
    for r in rows:
        assert r["model_state_bytes"] == pytest.approx(r["predicted_model_state_bytes"], rel=1e-6)
        assert r["measured_bytes"] > r["model_state_bytes"]


def test_a_degree_or_size_key_of_thousands_of_digits_is_one_line_not_a_crash(tmp_path: Path) -> None:
    """(Python refuses to read integers of over 4,300 digits: such keys are refused before.)"""
    import json

    from partitioner.importers.sailor import sailor_degrees

    huge = "9" * 5000
    for key in ("tensor_parallel", "times_at"):
        with pytest.raises(FormatError, match=r"= '99999999999999999999\.\.\.'"):
            Profile.from_dict({"model": "m", "micro_batch_size": 1,
                               "layers": [{"name": "a", "times": {}, key: {huge: {}}}]})
    (tmp_path / "X.json").write_text(json.dumps({"1": {huge: {"0": [1, 1, 0]}, "1": {"0": [1, 1, 0]}}}))
    assert sailor_degrees(tmp_path, 1) == {1: ("X",)}


@pytest.mark.parametrize("seed", range(3))
def test_the_lazy_queue_yields_every_bound_in_order_and_its_rest_bounds_the_others(seed: int) -> None:
    """Candidates leave the queue with their per-layer LP and pace bound, the latter with each
    stage's edges at the candidate's own K and m (at most the view's perfect speed-up), best first; the bounds are solved only for those taken or above them;
    what is left stays bounded."""
    from partitioner.schedule import Schedule
    from solvers.cluster.bounds.layers import layer_bound
    from solvers.cluster.bounds.pace import pace_bound, pace_table
    from solvers.cluster.planner import throughput_upper_bound
    from solvers.cluster.tensor import _most_slices, _Queue, candidate_view

    profile, cluster = _tiny(seed)
    options = CostOptions(reserved_bytes=0.0)
    queue = _Queue({1: profile}, cluster, 8, options, "1f1b", None, None, None, {})
    taken = [c for _, c in zip(range(3), queue.ordered(), strict=False)]
    assert queue.bounded < len(queue._views) + queue.entries  # some were never priced by the LP
    rest = queue.rest(len(taken))
    every = list(queue.ordered())
    assert every[:len(taken)] == taken and len(queue.done) == len(every)
    bounds = [c.bound_samples_per_s for c in every]
    assert bounds == sorted(bounds, reverse=True)
    assert all(rest >= b * (1 - 1e-12) for b in bounds[len(taken):])
    for c in every:
        view, devices = candidate_view(cluster, c.degrees)
        cost = CostModel(profile, view, options)
        sched = Schedule.of("1f1b", c.micro_batches)
        lp = layer_bound(cost, devices, c.virtual_workers, sched)
        pace = pace_bound(cost, devices, c.virtual_workers, sched)
        edged = pace_table(cost, devices, sched, fill_slices=_most_slices("1f1b", c), virtual_workers=c.virtual_workers)
        pace = min(pace, pace_bound(cost, devices, c.virtual_workers, sched, edged))
        assert c.bound_samples_per_s == pytest.approx(min(lp, pace, throughput_upper_bound(cost, devices)), rel=1e-7)


def test_one_worker_at_the_most_micro_batches_bounds_every_k_and_m(opt350: Profile) -> None:
    """The 3D search's bound of a whole view: one worker's LP at the view's most micro-batches is
    at least every (K, m = batch / K) candidate's own LP."""
    from partitioner.schedule import Schedule
    from solvers.cluster.bounds.layers import layer_bound

    cl = Cluster("c", (Node("n0", ("V100-16",) * 4, 100.0), Node("n1", ("A100-40",) * 4, 100.0)), 10.0)
    for view in (cl, cl.with_tensor_parallel({"A100-40": 2})):
        cost = CostModel(opt350, view, FP16)
        top = layer_bound(cost, view.devices, 1, Schedule.of("1f1b", 64), every_k=True)
        bounds = [layer_bound(cost, view.devices, k, Schedule.of("1f1b", 64 // k))
                  for k in (1, 2, 4, 8) if k <= len(view.devices)]
        assert max(bounds) > 0 and all(bound <= top * (1 + 1e-9) for bound in bounds)


def test_the_layer_bound_counts_a_tensor_two_layers_share_once() -> None:
    """Two layers of 10 GB saved each, 9 GB of it shared: one stage of both keeps 11 GB and fits a
    12 GB GPU, so the bound must not call the model unplaceable (their own 20 GB summed would)."""
    from partitioner.cluster import DeviceType
    from partitioner.profile import LayerProfile, LayerTime
    from partitioner.schedule import Schedule
    from solvers.cluster.bounds.layers import layer_bound
    from solvers.cluster.bounds.paced import paced_bound
    from solvers.cluster.planner import price_plan

    gb = 1e9
    times = {"G12": LayerTime(1e-3, 2e-3)}
    layers = (LayerProfile("a", param_bytes=1e6, saved_bytes=10 * gb, output_bytes=1e6, times=times),
              LayerProfile("b", param_bytes=1e6, saved_bytes=10 * gb, output_bytes=1e6, times=times,
                           shared_saved_bytes=9 * gb))
    profile = Profile("shared", 1, layers)
    cluster = Cluster("one", (Node("n0", ("G12",), 100.0),), 10.0,
                      device_types={"G12": DeviceType("G12", 12 * gb, 1e13, 1e12)})
    options = CostOptions(reserved_bytes=0.0)
    cost = CostModel(profile, cluster, options)
    plan = Plan("shared", (VirtualWorker((Stage((0, 2), "n0:0"),)),), "1f1b", 1, 4)
    cost.check_plan_memory(plan)  # 11 GB in 12: the plan fits
    rate = price_plan(cost, plan)["samples_per_s"]
    assert rate <= layer_bound(cost, cluster.devices, 1, Schedule.of("1f1b", 4)) * (1 + 1e-9)
    assert rate <= paced_bound(cost, cluster.devices, Schedule.of("1f1b", 4), virtual_workers=1) * (1 + 1e-9)


def test_groups_whose_sends_share_a_nic_are_priced_as_the_simulator_runs_them(opt350: Profile) -> None:
    """Two pipelines of tensor-parallel pairs, each crossing from node 0 to node 1 behind one NIC per
    node: their sends share the NICs in the closed form (at the pair's degree) as in the simulator."""
    from dataclasses import replace

    base = _cluster({"V100-16": 4})
    plan = Plan(opt350.model, tuple(VirtualWorker((Stage((0, 13), f"n0:{a}-{a + 1}"), Stage((13, 26), f"n1:{a}-{a + 1}")))
                                    for a in (0, 2)), "1f1b", 1, 8)
    times = []
    for nic in (2.0, 1000.0):  # a NIC the two pipelines must share, and one that never binds
        cl = Cluster("c", tuple(replace(n, nic_gbps=nic) for n in base.nodes), 10.0).with_tensor_parallel(
            {"V100-16": 2})
        plan.validate(opt350, cl)
        tl = simulate_plan(plan, opt350, cl, FP16)
        assert CostModel(opt350, cl, FP16).plan_iteration_s(plan) == pytest.approx(tl.iteration_s, rel=1e-9)
        times.append(tl.iteration_s)
    assert times[0] > times[1]
