import csv
import json
from importlib import resources

import pytest

from partitioner.cluster import GIB, Cluster, DeviceType, catalog, resolve_gpu_type
from partitioner.errors import FormatError


def test_catalog_has_every_csv_row_with_sources():
    cat = catalog()
    for name in ("V100-SXM2-16GB", "T4", "TITAN-V", "TITAN-RTX", "RTX-2060", "Quadro-P4000", "A100-SXM4-40GB",
                 "H100-SXM5-80GB", "RTX-3090", "L4", "A10"):
        assert name in cat
        assert cat[name].source
    v100 = cat["V100-SXM2-16GB"]
    assert v100.sm_count == 80 and v100.tf32_flops == 0
    assert v100.memory_bytes == 16 * GIB
    assert v100.peak_flops == pytest.approx(15.6672e12)
    assert v100.mem_bandwidth_bps == pytest.approx(900e9)


def test_catalog_tensor_rates_accumulate_in_fp32():
    """GeForce Turing and Ampere cards run FP16 tensor math at half rate with FP32 accumulation
    (Turing and GA102 whitepapers); the catalog's tensor rate is that one, and every row with a
    tensor rate or an SM count names where it comes from."""
    cat = catalog()
    assert cat["RTX-2080"].tensor_flops == pytest.approx(40.27392e12)
    assert cat["RTX-2080-Ti"].tensor_flops == pytest.approx(53.79072e12)
    assert cat["TITAN-RTX"].tensor_flops == pytest.approx(130.49856e12)  # full rate on the TITAN
    r3090 = cat["RTX-3090"]
    assert (r3090.tensor_flops, r3090.tf32_flops, r3090.bf16_flops, r3090.sm_count) == (71e12, 35.6e12, 71e12, 82)
    gh = cat["GH200-96GB"]
    assert gh.memory_bytes == 96 * GIB and gh.tf32_flops == pytest.approx(494.71488e12) and gh.sm_count == 132
    for t in cat.values():
        assert t.sm_count > 0


def test_device_type_new_fields_round_trip():
    t = catalog()["A100-SXM4-40GB"]
    from partitioner.cluster import DeviceType

    back = DeviceType.from_dict(t.name, t.to_dict())
    assert (back.tf32_flops, back.bf16_flops, back.sm_count) == (t.tf32_flops, t.bf16_flops, t.sm_count)
    old = DeviceType.from_dict("x", {"memory_GB": 8, "fp32_tflops": 10, "mem_GBps": 400})
    assert (old.tf32_flops, old.bf16_flops, old.sm_count) == (0.0, 0.0, 0)


@pytest.mark.parametrize(("alias", "name"), [("V100-16", "V100-SXM2-16GB"), ("titan v", "TITAN-V"),
                                             ("Titan-RTX", "TITAN-RTX"), ("A100-40", "A100-SXM4-40GB"),
                                             ("quadro p4000", "Quadro-P4000"), ("rtx_3090", "RTX-3090")])
def test_aliases(alias, name):
    assert resolve_gpu_type(alias).name == name


@pytest.mark.parametrize(("alias", "members"), [
    ("A100", "A100-SXM4-40GB, A100-SXM4-80GB, A100-PCIe-80GB"),
    ("v100", "V100-SXM2-16GB, V100-SXM2-32GB, V100-PCIe-16GB, V100-PCIe-32GB"),
    ("H 100", "H100-SXM5-80GB, H100-PCIe-80GB"),
    ("V100-32", "V100-SXM2-32GB, V100-PCIe-32GB"),
])
def test_a_family_name_is_refused_with_its_members(alias, members):
    """A100 may have 40 or 80 GB: the name is never taken as one of them."""
    with pytest.raises(FormatError, match=f"gpu type = '{alias}': ambiguous: it may be {members}; name one"):
        resolve_gpu_type(alias)
    with pytest.raises(FormatError, match=rf"nodes\[0\]\.gpus\[0\] = '{alias}': ambiguous: it may be {members}"):
        Cluster.from_dict({"inter_node_GBps": 7, "nodes": [{"intra_node_GBps": 16, "gpus": {alias: 1}}]})
    # a cluster may still define the name itself
    c = Cluster.from_dict({"inter_node_GBps": 7, "nodes": [{"intra_node_GBps": 16, "gpus": {alias: 1}}],
                           "device_types": {alias: {"memory_GB": 40, "fp32_tflops": 19.5, "mem_GBps": 1555}}})
    assert c.devices[0].memory_bytes == 40 * GIB


def test_profile_times_keyed_by_a_family_serve_the_member_the_cluster_names():
    from partitioner.cost import CostModel
    from partitioner.profile import LayerProfile, LayerTime, Profile

    prof = Profile("m", 1, (LayerProfile("a", times={"A100": LayerTime(1.0, 2.0)}),))
    for member in ("A100-SXM4-40GB", "A100-SXM4-80GB"):
        cluster = Cluster.from_dict({"inter_node_GBps": 7, "nodes": [{"intra_node_GBps": 16, "gpus": {member: 1}}]})
        assert CostModel(prof, cluster).fwd_bwd_s(member, 0, 1) == (1.0, 2.0)


def test_example_clusters_load(tmp_path):
    het = Cluster.load("examples/clusters/hetpipe.yaml")
    assert len(het.devices) == 16
    assert [d.name for d in het.devices[:4]] == ["n0:0", "n0:1", "n0:2", "n0:3"]
    assert het.gpu_types == ("TITAN-V", "TITAN-RTX", "RTX-2060", "Quadro-P4000")
    assert het.bandwidth_gbps("n0:0", "n0:3") == 16
    assert het.bandwidth_gbps("n0:0", "n1:0") == 7
    for name in ("v100x8", "a100_t4"):
        c = Cluster.load(f"examples/clusters/{name}.yaml")
        path = tmp_path / f"{name}.json"
        c.save(path)
        assert Cluster.load(path) == c


def test_overrides_and_custom_types():
    c = Cluster.from_dict({
        "inter_node_GBps": 5,
        "nodes": [{"name": "a", "intra_node_GBps": 10, "gpus": {"my-gpu": 2}},
                  {"name": "b", "intra_node_GBps": 10, "gpus": ["T4", "my-gpu"]}],
        "device_types": {"my-gpu": {"memory_GB": 12, "fp32_tflops": 14.9, "mem_GBps": 652.8}},
        "links": [{"between": ["a", "b"], "GBps": 20}, {"between": ["a:0", "b:1"], "GBps": 40}],
    })
    assert c.device("a:0").memory_bytes == 12 * GIB
    assert c.bandwidth_gbps("a:1", "b:0") == 20  # node pair override
    assert c.bandwidth_gbps("b:1", "a:0") == 40  # device pair override wins, either direction
    assert c.bandwidth_gbps("a:0", "a:1") == 10
    assert Cluster.from_dict(c.to_dict()) == c


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"inter_node_GBps": 7, "nodes": [{"intra_node_GBps": 16, "gpus": {"V1000": 1}}]},
         r"nodes\[0\]\.gpus\[0\] = 'V1000': unknown; did you mean"),
        ({"nodes": [{"intra_node_GBps": 16, "gpus": {"T4": 1}}]}, "inter_node_GBps is missing"),
        ({"inter_node_GBps": -1, "nodes": [{"intra_node_GBps": 16, "gpus": {"T4": 1}}]}, "inter_node_GBps = -1: must be >= 1e-06"),
        ({"inter_node_GBps": 7, "nodes": [{"intra_node_GBps": 16, "gpus": {"T4": 0}}]}, r"nodes\[0\]\.gpus\.T4 = 0"),
        ({"inter_node_GBps": 7, "nodes": [{"name": "x", "intra_node_GBps": 1, "gpus": {"T4": 1}},
                                          {"name": "x", "intra_node_GBps": 1, "gpus": {"T4": 1}}]},
         r"nodes\[1\]\.name = 'x': duplicates"),
        ({"inter_node_GBps": 7, "nodes": [{"intra_node_GBps": 1, "gpus": {"T4": 1}}],
          "links": [{"between": ["n0", "zz"], "GBps": 3}]}, "'zz' is neither a node nor a device"),
    ],
)
def test_bad_clusters(tmp_path, doc, message):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=message) as info:
        Cluster.load(path)
    assert str(info.value).startswith(str(path))


def test_yaml_syntax_error_names_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("nodes: [\n")
    with pytest.raises(FormatError, match="not valid YAML"):
        Cluster.load(path)


def test_a_grouping_with_a_worker_that_fits_nowhere_is_no_plan_not_a_crash() -> None:
    """The bound search of the cluster planner prices groupings it explores; one may hold a worker
    over which no split fits (it once hit an assertion): that grouping is refused by name."""
    from partitioner.cluster import DeviceType, Node
    from partitioner.cost import CostModel
    from partitioner.pricing import CostOptions
    from partitioner.profile import LayerProfile, LayerTime, Profile
    from partitioner.schedule import Schedule
    from solvers.cluster.planner import WorkerPlanner, WorkerUnfit, plan_of

    types = {"BIG": DeviceType("BIG", 8 * GIB, 10e12, 1e12), "TINY": DeviceType("TINY", 1.2 * GIB, 30e12, 1e12)}
    layers = tuple(LayerProfile(f"l{i}", param_bytes=40e6, saved_bytes=20e6, output_bytes=1e6,
                                times={"BIG": LayerTime(0.01, 0.02), "TINY": LayerTime(0.003, 0.006)})
                   for i in range(12))
    prof = Profile("m", 1, layers)
    cl = Cluster("c", (Node("a", ("BIG",), 50.0), Node("b", ("TINY",), 50.0)), 5.0, types)
    sched = Schedule.of("1f1b", 8)
    planner = WorkerPlanner(CostModel(prof, cl, CostOptions(reserved_bytes=0.1 * GIB)), sched, False, 720)
    big, tiny = cl.devices
    assert plan_of([[big, tiny]], planner, prof, sched)[0].virtual_workers
    with pytest.raises(WorkerUnfit, match=r"b:0"):
        plan_of([[big], [tiny]], planner, prof, sched)


def test_usable_memory_is_sourced_and_what_plans_may_use():
    cat = catalog()
    with_usable = {k: t for k, t in cat.items() if t.usable_memory_bytes}
    assert {"V100-SXM2-16GB", "V100-PCIe-16GB", "T4"} <= set(with_usable)
    for t in with_usable.values():
        assert 0 < t.usable_memory_bytes < t.memory_bytes and t.capacity_bytes == t.usable_memory_bytes
    # what frameworks see on these parts (nvidia-smi / deviceQuery totals with ECC on)
    assert cat["V100-SXM2-16GB"].capacity_bytes / 2**30 == pytest.approx(15.78, abs=0.01)
    assert cat["T4"].capacity_bytes / 2**30 == pytest.approx(14.76, abs=0.01)
    assert cat["TITAN-RTX"].capacity_bytes == cat["TITAN-RTX"].memory_bytes  # unknown: the nominal size
    # the RTX 2080 and the 2080 Ti are two parts
    assert cat["RTX-2080"].memory_bytes == 8 * 2**30 and cat["RTX-2080-Ti"].memory_bytes == 11 * 2**30
    cl = Cluster.homogeneous("T4", 1, 2, 16, 3)
    assert cl.devices[0].memory_bytes == cat["T4"].usable_memory_bytes
    text = resources.files("partitioner").joinpath("data/gpu_catalog.csv").read_text(encoding="utf-8")
    for row in csv.DictReader(text.splitlines()):
        assert bool(row["usable_mem_gib"]) == bool(row["usable_source"]), row["gpu"]


def test_usable_memory_round_trips_and_is_checked():
    t = DeviceType("X", 16 * 2**30, 1e13, 1e12, usable_memory_bytes=15 * 2**30)
    back = DeviceType.from_dict("X", t.to_dict())
    assert back == t and back.capacity_bytes == 15 * 2**30
    with pytest.raises(FormatError, match="usable_memory_GB"):
        DeviceType.from_dict("X", {"memory_GB": 16, "fp32_tflops": 10, "mem_GBps": 900, "usable_memory_GB": 17})


def test_a_cluster_with_plenty_of_memory_gets_a_certificate_not_a_crash() -> None:
    """Memory a million times the model's once made the fleet bound's linear program numerically
    infeasible (a bound of 0 samples/s, then a division by zero)."""
    from solvers.cluster.bounds.fleet import fleet_bound
    from solvers.cluster.planner import plan_cluster

    from .conftest import flat_cluster, make_profile

    prof = make_profile({"A": [0.01] * 12, "B": [0.02] * 12}, param_bytes=[5e7] * 12, saved_bytes=[1e7] * 12,
                        output_bytes=[1e6] * 12)
    cl = flat_cluster(["A", "A", "B", "B", "A", "B"] * 3, per_node=2)  # 1e6 GiB per GPU
    from partitioner.cost import CostModel
    from partitioner.schedule import Schedule

    assert fleet_bound(CostModel(prof, cl), cl.devices, Schedule.of("1f1b", 8)).samples_per_s > 0
    res = plan_cluster(prof, cl, "auto", micro_batches=8, time_limit_s=20)
    assert res.ok and 0 < res.lower_bound <= res.objective
