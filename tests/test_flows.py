"""Shared NICs: flows divide a resource's bandwidth (max-min fair), conserve bytes, never beat a
link's rate; the closed form charges what the simulator times on symmetric shared-link plans."""

from __future__ import annotations

import random

import numpy as np
import pytest

from partitioner.bandwidth import Bandwidth
from partitioner.cluster import Cluster, Node
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError
from partitioner.flows import FlowNet, FlowSpec, fair_rates, nic_sharers
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.simulate import simulate_plan
from tests.conftest import big_type


def test_fair_rates_are_max_min_fair_and_within_every_capacity():
    # three flows on one resource of 9: one capped at 1 leaves 8 to the other two
    assert fair_rates([1.0, 10.0, 10.0], [[0], [0], [0]], [9.0]) == pytest.approx([1.0, 4.0, 4.0])
    # flow 0 crosses both resources; resource 1 (capacity 2) binds it, resource 0 gives the rest to flow 1
    assert fair_rates([10.0, 10.0], [[0, 1], [0]], [6.0, 2.0]) == pytest.approx([2.0, 4.0])
    rng = random.Random(3)
    for _ in range(200):
        n_res = rng.randint(1, 4)
        cap = [rng.uniform(0.5, 10) for _ in range(n_res)]
        routes = [rng.sample(range(n_res), rng.randint(1, n_res)) for _ in range(rng.randint(1, 6))]
        caps = [rng.uniform(0.1, 12) for _ in routes]
        rates = fair_rates(caps, routes, cap)
        for f, r in enumerate(rates):
            assert 0 < r <= caps[f] + 1e-12
            # max-min: each flow is at its own cap or on a saturated resource
            saturated = [res for res in routes[f]
                         if sum(rates[g] for g in range(len(routes)) if res in routes[g]) >= cap[res] - 1e-9]
            assert r >= caps[f] - 1e-9 or saturated
        for res in range(n_res):
            assert sum(rates[g] for g in range(len(routes)) if res in routes[g]) <= cap[res] + 1e-9


def test_flow_net_conserves_bytes_and_never_beats_a_links_rate():
    rng = random.Random(7)
    specs = [FlowSpec((0,), 4e9, 2e9), FlowSpec((0, 1), 10e9, 5e9, latency_s=1e-3), FlowSpec((1,), 1e9, 1e9)]
    net = FlowNet([8e9, 6e9], specs)
    starts = sorted(rng.uniform(0, 3) for _ in range(12))
    kinds = [rng.randrange(len(specs)) for _ in starts]
    began: dict[int, tuple[float, int]] = {}
    ends: dict[int, float] = {}
    pending = list(zip(starts, kinds, strict=True))
    while pending or net.left:
        nxt_end = min(ends.values(), default=float("inf"))
        if pending and pending[0][0] <= nxt_end:
            t, k = pending.pop(0)
            f, changed = net.start(t, k)
            began[f] = (t, k)
            ends.update(changed)  # the flows whose rates it changed; the others keep their ends
        else:
            f = min(ends, key=lambda x: ends[x])
            t = ends.pop(f)
            spec = specs[began[f][1]]
            assert t - began[f][0] >= spec.nbytes / spec.rate_Bps - 1e-9  # never faster than alone
            ends.update(net.finish(t, f))
    for res in (0, 1):  # every byte of every flow crossed each of its resources once
        want = sum(specs[k].nbytes for _, k in began.values() if res in specs[k].resources)
        assert net.moved.get(res, 0.0) == pytest.approx(want, rel=1e-9)


def _profile(n: int = 4) -> Profile:
    return Profile("u", 1, tuple(LayerProfile(f"l{i}", param_bytes=4e8, saved_bytes=1e6, output_bytes=2e8,
                                              times={"G": LayerTime(0.1, 0.2, update_s=0.01)}) for i in range(n)))


def _cluster(nodes: int, nic: float, nics: int = 1, inter: Bandwidth | None = None) -> Cluster:
    return Cluster("c", tuple(Node(f"n{k}", ("G",) * 4, 100.0, nic_gbps=nic, nics=nics) for k in range(nodes)),
                   10.0, {"G": big_type("G")}, inter_curve=inter)


def _replicated(workers: int, stages: int, schedule: str = "1f1b") -> Plan:
    per = 6 // stages  # layers per stage of a 6-layer chain
    return Plan("u", tuple(VirtualWorker(tuple(Stage((k * per, (k + 1) * per), f"n{k}:{w}", "G")
                                               for k in range(stages))) for w in range(workers)),
                schedule, 1, 8)


@pytest.mark.parametrize("workers,nic,nics,latency,schedule", [
    (4, 20.0, 1, 0.0, "1f1b"), (4, 10.0, 1, 0.0, "1f1b"), (4, 10.0, 1, 0.01, "1f1b"), (4, 10.0, 2, 0.0, "1f1b"),
    (2, 5.0, 1, 0.0, "1f1b"), (4, 10.0, 1, 0.0, "gpipe"), (4, 5.0, 2, 0.01, "gpipe")])
@pytest.mark.parametrize("sync", [False, True])
def test_closed_form_equals_the_simulator_on_shared_nics(workers, nic, nics, latency, schedule, sync):
    """Replicas of a pipeline over three nodes share each node's NIC; the simulator divides it
    among the flows that overlap, the closed form among the devices that cross it (in step).
    Both equal the same plan on a cluster whose links are as slow as the shared share, and the
    closed form is within 2% of the simulator (its 1F1B fill/drain formula's own error)."""
    prof = _profile(6)
    plan = _replicated(workers, 3, schedule)
    inter = Bandwidth(10.0, latency_s=latency) if latency else None
    shared = _cluster(3, nic, nics, inter)
    opts = CostOptions(sync=sync)
    sim = simulate_plan(plan, prof, shared, opts).iteration_s
    closed = CostModel(prof, shared, opts).plan_iteration_s(plan)
    assert closed == pytest.approx(sim, rel=0.02)
    # in step, the replicas' flows each get the NIC's share: exactly one pipeline alone on links
    # at that rate (10 GB/s, or the NIC divided among the devices behind it)
    rate = min(10.0, nic / (workers // nics))
    flat = Cluster("f", tuple(Node(n.name, n.gpus, n.intra_gbps) for n in shared.nodes), rate, shared.device_types,
                   inter_curve=Bandwidth(rate, latency_s=latency) if latency else None)
    one = Plan("u", plan.virtual_workers[:1], schedule, 1, 8)
    no_sync = CostOptions(sync=False)
    assert simulate_plan(plan, prof, shared, no_sync).iteration_s == pytest.approx(
        simulate_plan(one, prof, flat, no_sync).iteration_s, rel=1e-9)


def test_a_fast_nic_changes_nothing_and_none_keeps_todays_links():
    prof = _profile(6)
    plan = _replicated(1, 3)
    plain = _cluster(3, 0.0)
    assert not plain.has_nics
    fast = _cluster(3, 1000.0)
    for opts in (CostOptions(), CostOptions(overlap_comm=True)):
        assert simulate_plan(plan, prof, fast, opts).iteration_s == pytest.approx(
            simulate_plan(plan, prof, plain, opts).iteration_s, rel=1e-12)
        assert CostModel(prof, fast, opts).plan_iteration_s(plan) == pytest.approx(
            CostModel(prof, plain, opts).plan_iteration_s(plan), rel=1e-12)


def test_nic_sharers_count_the_devices_behind_each_nic():
    plan = _replicated(4, 3)
    load = nic_sharers(plan, _cluster(3, 10.0))
    assert load[("n0", 0, "out")] == 4 and load[("n1", 0, "out")] == 4 and load[("n1", 0, "in")] == 4
    two = nic_sharers(plan, _cluster(3, 10.0, nics=2))
    assert two[("n0", 0, "out")] == 2 and two[("n0", 1, "out")] == 2


def test_cluster_file_nics_round_trip_and_bad_values():
    doc = {"inter_node_GBps": 10, "nodes": [{"name": "a", "intra_node_GBps": 100, "gpus": {"T4": 4},
                                             "nic_GBps": 3.125, "nics": 2},
                                            {"name": "b", "intra_node_GBps": 100, "gpus": {"T4": 4}}]}
    cl = Cluster.from_dict(doc)
    assert cl.nodes[0].nic_gbps == 3.125 and cl.nodes[0].nics == 2 and cl.nodes[1].nic_gbps == 0
    assert Cluster.from_dict(cl.to_dict()) == cl
    assert cl.nic_route("a:3", "b:0") == (("a", 1, "out", 3.125),)
    assert cl.nic_route("a:0", "a:1") == ()
    for field, value, message in (("nic_GBps", -1, "nic_GBps"), ("nics", 5, "nics"), ("nics", 0, "nics")):
        bad = {**doc, "nodes": [{**doc["nodes"][0], field: value}, doc["nodes"][1]]}
        with pytest.raises(FormatError, match=message):
            Cluster.from_dict(bad)


@pytest.mark.parametrize("sharers", [None, {("n0", 0, "out"): 3, ("n1", 0, "in"): 2}, {("n1", 1, "in"): 4}])
def test_a_boundary_vector_over_nics_is_each_send_priced_alone(sharers):
    """The solvers' vectors of pipeline sends across NICs are :meth:`CostModel.link_s` of each
    size bit for bit (measured curve, latency, per-send overhead, NIC shares)."""
    curve = Bandwidth(12.0, latency_s=2e-5, points=((1e3, 0.5), (1e6, 4.0), (1e8, 11.0)), send_overhead_s=3e-5)
    cost = CostModel(_profile(6), _cluster(3, 6.0, nics=2, inter=curve), nic_sharers=sharers)
    sizes = np.array([0.0, 1.0, 5e2, 2e4, 3e6, 7e8])
    for a, b in (("n0:0", "n1:3"), ("n1:2", "n0:1"), ("n0:0", "n0:1")):
        want = [cost.link_s(float(x), a, b) for x in sizes]
        assert cost.messages_s(sizes, a, b).tolist() == want


def test_a_flow_shares_out_only_what_it_is_connected_to_and_rates_stay_max_min_fair():
    """Starting or finishing a flow shares out again only the resources connected to it (through
    flows that share them): every active flow's rate then equals the max-min fair rates of all
    active flows computed afresh."""
    rng = random.Random(11)
    n_res = 6
    specs = [FlowSpec(tuple(rng.sample(range(n_res), rng.randint(1, 2))), rng.uniform(1e9, 9e9), rng.uniform(1e8, 1e9))
             for _ in range(8)]
    net = FlowNet([rng.uniform(2e9, 8e9) for _ in range(n_res)], specs)
    ends: dict[int, float] = {}
    t = 0.0
    for _ in range(60):
        if ends and rng.random() < 0.45:
            f = min(ends, key=lambda x: ends[x])
            t = ends.pop(f)
            ends.update(net.finish(t, f))
        else:
            t += rng.uniform(0, 0.05)
            if ends and t > min(ends.values()):
                continue
            _, changed = net.start(t, rng.randrange(len(specs)))
            ends.update(changed)
        ids = sorted(net.left)
        fresh = fair_rates([specs[net.spec_of[f]].rate_Bps for f in ids],
                           [specs[net.spec_of[f]].resources for f in ids], net.capacity)
        assert [net.rate[f] for f in ids] == pytest.approx(fresh, rel=1e-12)
        assert all(ends[f] == pytest.approx(net.now + net.left[f] / net.rate[f], rel=1e-12) for f in ids)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_all_reduces_that_cross_one_nic_share_it(schedule):
    """Two workers on two nodes, each a pipeline inside its node: the all-reduce groups of both
    stages cross both nodes' NICs, so each gets half a NIC. The closed form and the simulator
    then both equal the same plan on nodes without NICs whose link is that half."""
    prof = _profile(6)
    plan = Plan("u", tuple(VirtualWorker((Stage((0, 3), f"n{w}:0", "G"), Stage((3, 6), f"n{w}:1", "G")))
                           for w in range(2)), schedule, 1, 8)
    shared = _cluster(2, 4.0)
    half = Cluster("f", tuple(Node(n.name, n.gpus, n.intra_gbps) for n in shared.nodes), 2.0, shared.device_types)
    alone = Cluster("a", half.nodes, 4.0, shared.device_types)
    opts = CostOptions(sync=True)
    got = [simulate_plan(plan, prof, shared, opts).iteration_s, CostModel(prof, shared, opts).plan_iteration_s(plan)]
    want = simulate_plan(plan, prof, half, opts).iteration_s
    assert got == pytest.approx([want, CostModel(prof, half, opts).plan_iteration_s(plan)], rel=1e-9)
    assert want > simulate_plan(plan, prof, alone, opts).iteration_s  # sharing costs time here
