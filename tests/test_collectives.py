"""The collective model of tensor-parallel all-reduces: link facts, pricing, fitting, and the cost
model pricing a group's all-reduces with it."""

from __future__ import annotations

import csv
import itertools
import math
from importlib import resources
from pathlib import Path

import pytest

from partitioner.cluster import Cluster, Node, catalog
from partitioner.collectives import (
    LINK_CLASSES,
    CollectiveModel,
    GroupAllReduce,
    GroupLink,
    LinkConstants,
    default_collectives,
    group_link,
    link_catalog,
    link_facts,
    node_allreduce_s,
)
from partitioner.cost import CostModel
from partitioner.errors import FormatError, PartitionerError
from partitioner.pricing import CostOptions
from partitioner.profile import LayerProfile, LayerShard, LayerTime, Profile
from partitioner.projection.collective_fit import CollectivePoint, fit_link_constants

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
MODEL = CollectiveModel({"nvlink": LinkConstants(300e-6, 8e-6, 0.55), "pcie": LinkConstants(500e-6, 0.0, 0.3)})
LINKS = (GroupLink("nvlink", 300e9), GroupLink("pcie", 15.76e9))


def _one_line(err: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text
    return text


@pytest.mark.parametrize("link", LINKS, ids=lambda x: x.link_class)
def test_an_all_reduce_grows_with_its_bytes_and_its_group(link: GroupLink) -> None:
    sizes = [2**k for k in range(10, 31, 2)]
    for g in (2, 3, 4, 8, 16):
        times = [MODEL.allreduce_s(n, g, link) for n in sizes]
        assert all(a < b for a, b in itertools.pairwise(times)), (g, times)
    for n in sizes:
        times = [MODEL.allreduce_s(n, g, link) for g in range(2, 17)]
        assert all(a < b for a, b in itertools.pairwise(times)), (n, times)
    # the ring: fixed + 2 (g - 1) (step + n / g / rate)
    c = MODEL.constants[link.link_class]
    assert MODEL.allreduce_s(2**26, 4, link) == pytest.approx(
        c.fixed_s + 6 * (c.step_s + 2**26 / 4 / (c.fraction * link.peak_bytes_per_s)))


def test_one_gpu_or_no_bytes_costs_nothing() -> None:
    for link in LINKS:
        assert MODEL.allreduce_s(2**26, 1, link) == 0.0
        assert MODEL.allreduce_s(0.0, 8, link) == 0.0
    assert GroupAllReduce(MODEL, "A100-SXM4-80GB").time_s(2**26, 1) == 0.0
    from partitioner.bandwidth import Bandwidth
    assert node_allreduce_s(2**26, 1, "A100-SXM4-80GB", Bandwidth(300.0), MODEL) == 0.0


def test_a_link_class_without_constants_or_facts_is_refused_in_one_line() -> None:
    nvlink_only = CollectiveModel({"nvlink": MODEL.constants["nvlink"]})
    with pytest.raises(PartitionerError) as err:
        nvlink_only.allreduce_s(2**20, 4, GroupLink("pcie", 15.76e9))
    assert "link class 'pcie'" in _one_line(err) and "fitted: nvlink" in str(err.value)
    with pytest.raises(FormatError) as err:
        GroupLink("infiniband", 25e9)
    assert "link_class = 'infiniband'" in _one_line(err)
    with pytest.raises(FormatError) as err:
        link_facts("Voodoo-5500")
    assert "gpu_type = 'Voodoo-5500'" in _one_line(err) and "gpu_links.csv" in str(err.value)
    with pytest.raises(FormatError) as err:
        CollectiveModel.from_dict({"constants": {"nvswitch": {"fixed_s": 0, "step_s": 0, "fraction": 0.5}}})
    assert "nvswitch" in _one_line(err)
    with pytest.raises(FormatError) as err:
        LinkConstants(1e-4, 0.0, 1.5)
    assert "fraction = 1.5" in _one_line(err)


def test_every_catalog_gpu_has_link_facts_with_a_source() -> None:
    assert set(link_catalog()) == set(catalog())
    text = resources.files("partitioner").joinpath("data/gpu_links.csv").read_text(encoding="utf-8")
    for row in csv.DictReader(text.splitlines()):
        assert row["source"].strip(), row["gpu"]


def test_the_group_link_follows_the_facts_of_the_gpu_and_its_node() -> None:
    for g in (2, 4, 8):  # SXM parts: NVLink at the GPU's rate whatever the group
        assert group_link("A100-SXM4-80GB", g) == GroupLink("nvlink", 300e9)
        assert group_link("H100-SXM5-80GB", g) == GroupLink("nvlink", 450e9)
    # a bridge joins two cards: only a node faster than PCIe has it, and only for a pair
    assert group_link("RTX-3090", 2, 49.8e9) == GroupLink("nvlink", 56.25e9)
    assert group_link("RTX-3090", 2, 10e9) == GroupLink("pcie", 16 * 1.969e9)
    assert group_link("RTX-3090", 4, 49.8e9) == GroupLink("pcie", 16 * 1.969e9)
    assert group_link("TITAN-RTX", 2, 10.8e9) == GroupLink("pcie", 16 * 0.985e9)
    assert group_link("T4", 2, 1e12) == GroupLink("pcie", 16 * 0.985e9)  # no NVLink at all


def test_the_packaged_constants_cover_every_link_class() -> None:
    model = default_collectives()
    assert set(model.constants) == set(LINK_CLASSES) and "Sailor" in model.fitted_on
    assert CollectiveModel.from_dict(model.to_dict()) == model
    for c in model.constants.values():  # physical: microseconds to a millisecond, a share of the peak
        assert 0 < c.fixed_s < 2e-3 and 0 <= c.step_s <= 1e-4 and 0.05 < c.fraction <= 1


def test_the_fit_recovers_the_constants_that_made_the_points() -> None:
    truth = {"nvlink": LinkConstants(3.0e-4, 1.0e-5, 0.5), "pcie": LinkConstants(6.0e-4, 0.0, 0.3)}
    made = CollectiveModel(truth)
    points = []
    for t, link in (("A", LINKS[0]), ("B", GroupLink("nvlink", 150e9)), ("C", LINKS[1]), ("D", GroupLink("pcie", 31.5e9))):
        for g in (2, 4, 8):
            points += [CollectivePoint(t, link, g, n, made.allreduce_s(n, g, link)) for n in (2**23, 2**25, 2**27, 2**29)]
    fitted = fit_link_constants(points)
    for cls, c in truth.items():  # within the grid's spacing
        got = fitted[cls]
        assert got.fixed_s == pytest.approx(c.fixed_s, rel=0.1)
        assert got.fraction == pytest.approx(c.fraction, rel=0.05)
        assert got.step_s == pytest.approx(c.step_s, rel=0.25, abs=3e-6)
    again = CollectiveModel(fitted)
    assert all(again.allreduce_s(p.nbytes, p.group, p.link) == pytest.approx(p.seconds, rel=0.05) for p in points)


def test_a_held_out_types_all_reduces_never_reach_its_fit() -> None:
    from partitioner.projection.evaluation import loto_collectives

    link = GroupLink("pcie", 15.76e9)
    base = [CollectivePoint(t, link, g, n, MODEL.allreduce_s(n, g, link) * f)
            for t, f in (("A", 1.0), ("B", 1.1), ("C", 0.9)) for g in (2, 4) for n in (2**23, 2**26)]
    before = loto_collectives(base)
    changed = [CollectivePoint(p.gpu_type, p.link, p.group, p.nbytes, p.seconds * (5.0 if p.gpu_type == "A" else 1.0))
               for p in base]
    after = loto_collectives(changed)
    assert after["A"] == before["A"]
    assert after["B"] != before["B"]  # A is in B's fit


def _profile(types: tuple[str, ...], nbytes: float) -> Profile:
    """Embedding, one block whose shards leave ``nbytes`` of all-reduces out of their times, head."""
    t = {g: LayerTime(1e-3, 2e-3) for g in types}
    whole = {d: LayerShard(4e6, 1e6, t) for d in (2, 4)}
    block = {d: LayerShard(1e6, 1e6, t, allreduce_bytes=nbytes) for d in (2, 4)}
    return Profile("m", 1, (LayerProfile("embed", 1e9, 4e6, 1e6, 1e6, t, shards=whole),
                            LayerProfile("block0", 1e9, 4e6, 1e6, 1e6, t, shards=block),
                            LayerProfile("head", 1e9, 4e6, 1e6, 1e6, t, shards=whole)))


@pytest.mark.parametrize(("gpu", "node_gbps", "cls"), [("A100-SXM4-80GB", 300.0, "nvlink"),
                                                        ("RTX-3090", 50.0, "nvlink"), ("RTX-3090", 16.0, "pcie"),
                                                        ("TITAN-RTX", 10.0, "pcie")])
def test_the_cost_model_prices_a_groups_all_reduces_with_the_collective_model(gpu: str, node_gbps: float,
                                                                               cls: str) -> None:
    nbytes = 2 * 2 * 1024 * 1024 * 4.0  # two all-reduces of b s h fp32 elements
    prof = _profile((gpu,), nbytes)
    cl = Cluster("c", (Node("n0", (gpu,) * 4, node_gbps),), 10.0)
    cost = CostModel(prof, cl, CostOptions())
    model = default_collectives()
    for t in (2, 4):
        comm = cost.at_degree(t).tensor_parallel_comm_s(gpu)
        link = group_link(gpu, t, node_gbps * 1e9)
        assert link.link_class == (cls if t == 2 else ("nvlink" if gpu.startswith("A100") else "pcie"))
        capped = GroupLink(link.link_class, link.peak_bytes_per_s, node_gbps * 1e9)
        want = 2 * model.allreduce_s(nbytes / 2, t, capped)
        assert comm[1] == pytest.approx(want)
        assert comm[0] == 0.0 and comm[2] == 0.0
        # at least the two fixed costs, and more than the bytes at the node's own figure alone
        c = model.constants[link.link_class]
        assert comm[1] >= 2 * c.fixed_s
        assert comm[1] > 2 * 2 * (t - 1) * (nbytes / 2 / t) / (node_gbps * 1e9)


def test_a_node_figure_below_what_the_link_achieves_caps_a_ring_step() -> None:
    nbytes = 2.0**27
    fast = Cluster("c", (Node("n0", ("A100-SXM4-80GB",) * 4, 300.0),), 10.0)
    slow = Cluster("c", (Node("n0", ("A100-SXM4-80GB",) * 4, 20.0),), 10.0)
    prof = _profile(("A100-SXM4-80GB",), nbytes)
    a = CostModel(prof, fast, CostOptions()).at_degree(4).tensor_parallel_comm_s("A100-SXM4-80GB")[1]
    b = CostModel(prof, slow, CostOptions()).at_degree(4).tensor_parallel_comm_s("A100-SXM4-80GB")[1]
    assert b > a
    c = default_collectives().constants["nvlink"]
    assert b == pytest.approx(2 * (c.fixed_s + 6 * (c.step_s + nbytes / 2 / 4 / 20e9)))
    assert math.isfinite(a)


@pytest.mark.skipif(not (SHARED / "sailor_opt350").is_dir(), reason="shared Sailor profiles not present")
def test_leave_one_type_out_on_sailor_predicts_the_all_reduces_a_layer_pays() -> None:
    import numpy as np

    from partitioner.projection.evaluation import (
        collective_points,
        loto_collectives,
        sailor_configs,
        sailor_node_bytes_per_s,
    )

    node = sailor_node_bytes_per_s(SHARED / "sailor_validation" / "network" / "intra_node_bandwidths.json")
    assert node["RTX-3090"] > group_link("RTX-3090", 4).peak_bytes_per_s  # its pairs are bridged
    assert node["TITAN-RTX"] < group_link("TITAN-RTX", 2).peak_bytes_per_s  # its are not
    points = collective_points(sailor_configs(SHARED / "sailor_opt350"), node)
    models = loto_collectives(points)
    ratios: dict[tuple[str, int], list[float]] = {}
    for p in points:
        ratios.setdefault((p.gpu_type, p.group), []).append(models[p.gpu_type].allreduce_s(p.nbytes, p.group, p.link)
                                                            / p.seconds)
    medians = {k: float(np.median(v)) for k, v in ratios.items()}
    # every type and group size within a factor 1.7 of its measured all-reduces, but the RTX 3090's
    # groups of 4 and 8 (docs/profiling.md: 2-6x slower than its PCIe 4.0 link and the other PCIe
    # types say; nothing known of its node tells why)
    odd = {("RTX-3090", 4), ("RTX-3090", 8)}
    assert all(1 / 1.7 < m < 1.7 for k, m in medians.items() if k not in odd), medians


def test_the_operator_projection_adds_the_collective_models_all_reduces() -> None:
    from partitioner.importers.sailor import import_sailor
    from partitioner.projection.operator_model import project_with_ops

    data = Path(__file__).parent / "data" / "sailor_opt350"
    prof = import_sailor(data, micro_batch_size=2, tensor_parallel=2, gpu_types=("GH-96",))
    src = prof.gpu_types[0]
    ar = GroupAllReduce(default_collectives(), "A100-SXM4-80GB")
    own = {src: GroupAllReduce(default_collectives(), "GH200-96GB")}
    bare = project_with_ops(prof, ["A100-SXM4-80GB"], allreduce=own)
    priced = project_with_ops(prof, ["A100-SXM4-80GB"], allreduce={**own, "A100-SXM4-80GB": ar})
    message = 2 * 2048 * 1024 * 4  # b s h fp32 elements
    one = ar.time_s(message, 2)
    assert one > default_collectives().constants["nvlink"].fixed_s
    for i in range(1, len(prof.layers) - 1):  # a block: two all-reduces forward, two backward
        a, b = bare.layers[i].times["A100-SXM4-80GB"], priced.layers[i].times["A100-SXM4-80GB"]
        assert b.fwd_s - a.fwd_s == pytest.approx(2 * one)
        assert b.bwd_s - a.bwd_s == pytest.approx(2 * one)
