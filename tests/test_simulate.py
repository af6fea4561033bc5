"""The simulator: closed forms on uniform stages, memory from the action order, WSP, 2BW."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.cluster import Cluster
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.schedule import B, F, Schedule
from partitioner.simulate import Timeline, predict, simulate_plan

NO_RESERVE = CostOptions(reserved_bytes=0.0)


def uniform_profile(n_layers: int, fwd_s: float = 1.0, bwd_s: float = 2.0, out_bytes: float = 0.0,
                    gpu: str = "V100") -> Profile:
    return Profile("toy", 4, tuple(
        LayerProfile(f"l{i}", param_bytes=1e6 * (i + 1), saved_bytes=1e7 * (i + 1), output_bytes=out_bytes,
                     times={gpu: LayerTime(fwd_s, bwd_s)}) for i in range(n_layers)))


def chain_plan(p: int, m: int, schedule: str, v: int = 1, workers: int = 1, staleness: int = 0,
               nodes: int = 1) -> tuple[Plan, Cluster]:
    per_node = p * workers // nodes
    cluster = Cluster.homogeneous("V100-SXM2-16GB", nodes, per_node, 16, 7)
    devs = [d.name for d in cluster.devices]
    vws = tuple(VirtualWorker(tuple(Stage((s, s + 1), devs[w * p + s % p]) for s in range(p * v)))
                for w in range(workers))
    return Plan("toy", vws, schedule, 4, m, staleness, chunks=v), cluster


@settings(max_examples=25, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 10), sched=st.sampled_from(["gpipe", "1f1b"]))
def test_flush_bubble_closed_form(p: int, m: int, sched: str) -> None:
    plan, cluster = chain_plan(p, m, sched)
    tl = simulate_plan(plan, uniform_profile(p), cluster)
    assert tl.iteration_s == pytest.approx((m + p - 1) * 3.0)
    for b in tl.bubble_fraction.values():
        assert b == pytest.approx((p - 1) / (m + p - 1))


@settings(max_examples=20, deadline=None)
@given(p=st.integers(2, 5), g=st.integers(1, 3), v=st.integers(2, 3), sched=st.sampled_from(["interleaved", "bfs"]))
def test_multi_chunk_idle_closed_form(p: int, g: int, v: int, sched: str) -> None:
    m = g * p
    plan, cluster = chain_plan(p, m, sched, v)
    tl = simulate_plan(plan, uniform_profile(p * v, 1.0 / v, 2.0 / v), cluster)
    compute = m * 3.0  # per device: v chunks of (1 + 2) / v each, m micro-batches
    assert (tl.iteration_s - compute) / compute == pytest.approx((p - 1) / (v * m))
    if sched == "bfs":
        assert set(tl.peak_activations.values()) == {v * m}


@pytest.mark.parametrize("sched", ["gpipe", "1f1b", "2bw", "wsp"])
@pytest.mark.parametrize(("p", "m"), [(4, 8), (5, 5), (3, 7)])
def test_peak_memory_agrees_with_cost_model(sched: str, p: int, m: int) -> None:
    plan, cluster = chain_plan(p, m, sched)
    profile = uniform_profile(p)
    tl = simulate_plan(plan, profile, cluster)
    cost = CostModel(profile, cluster)
    expect = cost.plan_memory_bytes(plan)
    for k, dev in enumerate(tl.devices):
        assert tl.peak_activations[dev] == Schedule.of(sched, m).activations_in_flight(p - k)
        if sched == "2bw" and k == p - 1:
            # the last stage runs F and B back to back: it never holds a second version at a
            # STEP, where the cost model conservatively charges two on every stage
            assert tl.weight_versions[dev] == 1
            params = plan.virtual_workers[0].stages[k]
            spare = cost.weight_bytes(params.start, params.stop, 2) - cost.weight_bytes(params.start, params.stop, 1)
            assert tl.peak_memory_bytes[dev] == pytest.approx(expect[dev] - spare, rel=1e-12)
        else:
            assert tl.peak_memory_bytes[dev] == pytest.approx(expect[dev], rel=1e-12)


def test_2bw_steady_state_and_two_versions() -> None:
    plan, cluster = chain_plan(4, 6, "2bw")
    tl = simulate_plan(plan, uniform_profile(4), cluster, NO_RESERVE)
    assert tl.iteration_s == pytest.approx(6 * 3.0)  # no flush: m * (fwd + bwd)
    assert max(tl.bubble_fraction.values()) == pytest.approx(0.0, abs=1e-12)
    assert max(tl.weight_versions.values()) == 2


def test_transfers_are_priced_additively_and_overlapped() -> None:
    p, m = 3, 6
    plan, cluster = chain_plan(p, m, "1f1b", nodes=3)  # every boundary crosses nodes at 7 GB/s
    out = 7e9 * 0.25  # a quarter second per transfer
    prof = uniform_profile(p, out_bytes=out)
    add = simulate_plan(plan, prof, cluster, NO_RESERVE)
    ovl = simulate_plan(plan, prof, cluster, CostOptions(overlap_comm=True, reserved_bytes=0.0))
    free = simulate_plan(plan, uniform_profile(p), cluster, NO_RESERVE)
    assert free.iteration_s < ovl.iteration_s < add.iteration_s
    # the additive model blocks each sender for its transfer: every one of the 2 * m * (p - 1)
    # transfers of a rank's sends is on that rank's busy time
    sent = sum(e[5] - e[4] for e in add.events(0) if e[1] == "SEND_ACT")
    assert sent == pytest.approx(m * 0.25)


def test_link_contention_serialises_transfers() -> None:
    # two virtual workers on node n0 both send to node n1 over the same inter-node link
    cluster = Cluster.homogeneous("V100-SXM2-16GB", 2, 2, 16, 7)
    plan = Plan("toy", (VirtualWorker((Stage((0, 1), "n0:0"), Stage((1, 2), "n1:0"))),
                        VirtualWorker((Stage((0, 1), "n0:1"), Stage((1, 2), "n1:1")))), "gpipe", 4, 1)
    prof = uniform_profile(2, out_bytes=7e9 * 1.0)  # one second per transfer
    tl = simulate_plan(plan, prof, cluster, NO_RESERVE)
    sends = [e for e in tl.events() if e[1] == "SEND_ACT"]
    assert sorted(e[5] for e in sends) == pytest.approx([2.0, 3.0])  # second waits for the first
    assert not tl.notes  # the all-reduce between virtual workers is priced now


@pytest.mark.parametrize("d", [0, 1, 2])
def test_wsp_bounds_clock_gap(d: int) -> None:
    # a fast and a slow virtual worker: the fast one must wait, never more than D clocks ahead
    cluster = Cluster.from_dict({"name": "het", "inter_node_GBps": 7, "nodes": [
        {"name": "n0", "intra_node_GBps": 16, "gpus": {"V100-SXM2-16GB": 2}},
        {"name": "n1", "intra_node_GBps": 16, "gpus": {"TITAN-V": 2}}]})
    gpu_fast, gpu_slow = (cluster.device("n0:0").gpu_type, cluster.device("n1:0").gpu_type)
    layers = tuple(LayerProfile(f"l{i}", param_bytes=1e6, saved_bytes=1e6,
                                times={gpu_fast: LayerTime(1.0, 2.0), gpu_slow: LayerTime(3.0, 6.0)})
                   for i in range(2))
    prof = Profile("toy", 4, layers)
    plan = Plan("toy", (VirtualWorker((Stage((0, 1), "n0:0"), Stage((1, 2), "n0:1"))),
                        VirtualWorker((Stage((0, 1), "n1:0"), Stage((1, 2), "n1:1")))), "wsp", 4, 4, d)
    tl = simulate_plan(plan, prof, cluster, NO_RESERVE, iterations=d + 6)
    assert tl.clock_gaps and tl.max_clock_gap <= d
    assert tl.max_clock_gap == d  # the bound binds: the fast worker runs ahead as far as allowed
    # in the long run both go at the slow worker's pace: 4 micro-batches x 9 s per wave
    assert tl.iteration_s == pytest.approx(36.0, rel=0.01)


def test_timeline_round_trip_and_predict() -> None:
    plan, cluster = chain_plan(3, 4, "1f1b")
    prof = uniform_profile(3)
    tl = simulate_plan(plan, prof, cluster)
    back = Timeline.from_dict(tl.to_dict())
    assert back.iteration_s == tl.iteration_s and back.events() == tl.events()
    other = {**tl.to_dict(), "kinds": ["B", "F"]}  # codes from another numbering are refused
    with pytest.raises(FormatError, match=r"^kinds = .*codes"):
        Timeline.from_dict(other)
    pred = predict(plan, prof, cluster, timeline=tl)
    assert pred["iteration_s"] == tl.iteration_s == pytest.approx(18.0)
    assert pred["bottleneck_s"] == pytest.approx(3.0)
    assert pred["samples_per_s"] == pytest.approx(4 * 4 / 18.0)
    assert all(math.isfinite(v) for v in pred.values())


def test_simulating_a_large_pipeline_counts_every_event() -> None:
    """(How fast it is: bench/simulator.py.)"""
    plan, cluster = chain_plan(16, 128, "1f1b")
    tl = simulate_plan(plan, uniform_profile(16), cluster)
    assert tl.num_events == 16 * 128 * 2 + 2 * 2 * 128 * 15 + 16


def test_bad_plans_are_refused() -> None:
    plan, cluster = chain_plan(4, 6, "interleaved", v=2)
    with pytest.raises(FormatError, match="nearest valid: 4 or 8"):
        simulate_plan(plan, uniform_profile(8), cluster)
    bad = Plan("toy", (VirtualWorker((Stage((0, 1), "n0:0"), Stage((1, 2), "n0:1"), Stage((2, 3), "n0:1"),
                                      Stage((3, 4), "n0:0"))),), "interleaved", 4, 2, chunks=2)
    with pytest.raises(FormatError, match="must be on n0:0"):
        simulate_plan(bad, uniform_profile(4), Cluster.homogeneous("V100-SXM2-16GB", 1, 2, 16, 7))
    rep = Plan("toy", (VirtualWorker((Stage((0, 1), "n0:0", replicas=("n0:1",)), Stage((1, 2), "n0:0"))),),
               "interleaved", 4, 2, chunks=2)
    with pytest.raises(FormatError, match="replicated stages run one chunk per device"):
        simulate_plan(rep, uniform_profile(2), Cluster.homogeneous("V100-SXM2-16GB", 1, 2, 16, 7))


@pytest.mark.parametrize("sched", ["gpipe", "1f1b"])
@pytest.mark.parametrize("slices", [2, 4])
def test_sliced_first_micro_batch_keeps_the_work(sched: str, slices: int) -> None:
    """AutoPipe's slicing: the first micro-batch runs as s slices of 1/s the work each."""
    from dataclasses import replace

    plan, cluster = chain_plan(4, 8, sched)
    prof = uniform_profile(4)
    whole = simulate_plan(plan, prof, cluster)
    sliced = simulate_plan(replace(plan, first_slices=slices), prof, cluster)
    busy = [float((tl.event_end_s - tl.event_start_s)[(tl.event_kind == F.code) | (tl.event_kind == B.code)].sum()) for tl in (whole, sliced)]
    assert busy[1] == pytest.approx(busy[0])  # the same forward and backward work in total
    assert sliced.iteration_s <= whole.iteration_s  # never slower here (docs/hetero.md: when it helps)
    assert sliced.samples_per_s * sliced.iteration_s == pytest.approx(whole.samples_per_s * whole.iteration_s)


def test_first_slices_rules() -> None:
    from dataclasses import replace

    plan, _ = chain_plan(2, 4, "1f1b")
    assert Plan.from_dict(replace(plan, first_slices=2).to_dict()).first_slices == 2
    with pytest.raises(FormatError, match="first_slices = 3: must divide micro_batch_size 4"):
        replace(plan, first_slices=3)
    with pytest.raises(FormatError, match="applies to gpipe and 1f1b, not 2bw"):
        replace(plan, schedule="2bw", first_slices=2)
