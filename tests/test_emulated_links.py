"""Link emulation (train --emulate-links), runs that end by time, and the global model's loss."""

from __future__ import annotations

import itertools
import random
import statistics
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from partitioner.cluster import Cluster, Node
from partitioner.cost import CostModel
from partitioner.emulated_links import collectives, dilated_cluster, time_scale
from partitioner.emulation import emulation_for, predict_emulated
from partitioner.errors import FormatError, PartitionerError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner_cli import main as cli
from runtime.emulation import LinkDelay
from runtime.launch import TrainConfig, spawn_local, train_local

# three types from the catalog, one per node: all-reduces between them cross the inter-node link
CLUSTER = Cluster("three", (Node("n0", ("A100-SXM4-40GB",), 16.0), Node("n1", ("V100-SXM2-16GB",), 16.0),
                            Node("n2", ("T4",), 16.0)), 1.0)
DEVICES = ("n0:0", "n1:0", "n2:0")


def _profile(n: int = 4) -> Profile:
    """cpu 100x the A100; V100 2x and T4 4x the A100; 1e5 gradient bytes per layer."""
    times = {"cpu": LayerTime(1e-3, 2e-3), "A100": LayerTime(1e-5, 2e-5), "V100": LayerTime(2e-5, 4e-5),
             "T4": LayerTime(4e-5, 8e-5)}
    return Profile("gpt2-tiny", 2, tuple(LayerProfile(f"l{i}", 1.0, 1e5, 4.0, 4.0, dict(times)) for i in range(n)))


def _plan(schedule: str = "1f1b", d: int = 0, devices: tuple[str, ...] = DEVICES) -> Plan:
    return Plan("gpt2-tiny", tuple(VirtualWorker((Stage((0, 4), dev),)) for dev in devices), schedule=schedule,
                micro_batch_size=2, micro_batches=2, staleness=d)


# -- the dilation and the emulated collectives --------------------------------------------------


def test_time_scale_is_the_local_time_over_the_reference() -> None:
    prof = _profile()
    local, ref = prof.times_for("cpu"), prof.times_for("A100")
    assert time_scale(local, ref) == pytest.approx(100.0)
    assert time_scale(local, (ref[0] * 0, ref[1] * 0)) == 1.0  # a reference that takes no time: no dilation


@pytest.mark.parametrize("scale", [1.0, 7.5, 300.0])
def test_a_dilated_cluster_prices_every_link_scale_times_longer(scale: float) -> None:
    cluster = Cluster.from_dict({"name": "c", "inter_node_GBps": {"GBps": 3, "latency_us": 20,
                                                                  "points": [[1e3, 0.5], [1e7, 3]]},
                                 "nodes": [{"name": "a", "intra_node_GBps": 16, "gpus": {"V100-SXM2-16GB": 2}},
                                           {"name": "b", "intra_node_GBps": {"GBps": 10, "log2_MB_poly": [0.1, 5]},
                                            "gpus": {"T4": 2}}]})
    slow = dilated_cluster(cluster, scale)
    prof = _profile()
    base, dil = CostModel(prof, cluster), CostModel(prof, slow)
    for nbytes in (1e2, 5e4, 3e6, 1e9):
        for a, b in (("a:0", "a:1"), ("a:0", "b:1"), ("b:0", "b:1")):
            assert dil.transfer_s(nbytes, a, b) == pytest.approx(scale * base.transfer_s(nbytes, a, b), rel=1e-12)
        devs = ["a:0", "a:1", "b:0", "b:1"]
        assert dil.allreduce_s(nbytes, devs) == pytest.approx(scale * base.allreduce_s(nbytes, devs), rel=1e-12)
    assert [d.gpu_type for d in slow.devices] == [d.gpu_type for d in cluster.devices]
    with pytest.raises(FormatError, match="time_scale"):
        dilated_cluster(cluster, 0.0)


def test_collectives_are_the_holder_sets_priced_on_the_dilated_cluster() -> None:
    prof = _profile()
    # worker 0 on one device, worker 1 a pipeline of two: layers 0-1 and 2-3 have different holders
    plan = Plan("gpt2-tiny", (VirtualWorker((Stage((0, 4), "n0:0"),)),
                              VirtualWorker((Stage((0, 2), "n1:0"), Stage((2, 4), "n2:0")))),
                schedule="1f1b", micro_batch_size=2, micro_batches=2)
    got = collectives(plan, prof, CLUSTER)
    assert [(c.devices, c.layers) for c in got] == [(("n0:0", "n1:0"), (0, 1)), (("n0:0", "n2:0"), (2, 3))]
    cost = CostModel(prof, CLUSTER)
    for c in got:
        assert c.nbytes == cost.param_bytes(c.layers[0], c.layers[-1] + 1)
        assert c.seconds == pytest.approx(cost.allreduce_s(c.nbytes, c.devices))
    e = emulation_for(plan, prof, CLUSTER, reference="A100", links=True)
    assert e.links and e.time_scale == pytest.approx(100.0)
    assert e.collective_s(["n1:0", "n0:0"]) == pytest.approx(100.0 * cost.allreduce_s(got[0].nbytes, got[0].devices))
    assert e.collective_s(["n1:0", "n2:0"]) is None
    assert not emulation_for(plan, prof, CLUSTER, reference="A100").links


def test_prediction_with_links_prices_the_plan_cluster_dilated() -> None:
    prof, plan = _profile(), _plan()
    free = predict_emulated(plan, prof, CLUSTER, reference="A100", link_gbps=1e6).iteration_s
    linked = predict_emulated(plan, prof, CLUSTER, reference="A100", links=True).iteration_s
    e = emulation_for(plan, prof, CLUSTER, reference="A100", links=True)
    ar = e.collectives[0].seconds
    # the gradient all-reduce of 4e5 bytes over 3 devices across 1 GB/s, x 100: 2 * 2/3 * 4e5 / 1e9 * 100 s
    assert ar == pytest.approx(2 * 2 / 3 * 4e5 / 1e9 * 100)
    assert linked - free == pytest.approx(ar, rel=0.01)  # on the critical path after the last backward


def test_2bw_links_are_refused() -> None:
    with pytest.raises(FormatError, match="emulate_links = '2bw'"):
        emulation_for(_plan("2bw"), _profile(), CLUSTER, reference="A100", links=True)


# -- the delay on real collectives ------------------------------------------------------------


def _delay_rank(rank: int, world: int, out: str) -> None:
    delay, shorter = LinkDelay(lambda ranks: 0.05), LinkDelay(lambda ranks: 0.04)
    group = dist.new_group(list(range(world)))
    rows = []
    for _ in range(5):
        dist.barrier()
        if rank == 1:
            time.sleep(0.02)  # joins 20 ms late: the all-reduce starts then
        t0 = time.time()
        buf = torch.ones(1000)
        delay.wait(delay.start(buf, group, (0, 1)))
        t1 = time.time()
        assert buf[0].item() == world  # the data is all-reduced as without emulation
        dist.barrier()
        # a 40 ms push under 50 ms of compute
        t2 = time.time()
        pending = shorter.start(torch.ones(1000), group, (0, 1))
        time.sleep(0.05)
        t3 = time.time()
        shorter.wait(pending)
        rows.append((t0, t1, t2, t3, time.time()))
    Path(out, f"rank{rank}.txt").write_text("\n".join(" ".join(map(repr, r)) for r in rows))


@pytest.mark.slow  # wall-clock intervals of 15-50 ms: a loaded machine moves them
def test_a_modelled_allreduce_takes_its_time_and_an_overlapped_one_adds_nothing(tmp_path: Path) -> None:
    spawn_local(_delay_rank, 2, (str(tmp_path),), timeout_s=60, start_method="forkserver")
    rows = [[tuple(map(float, line.split())) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines()]
            for r in (0, 1)]
    blocking, added = [], []
    for k in range(5):
        (a0, a1, a2, a3, a4), (b0, b1, b2, b3, b4) = rows[0][k], rows[1][k]
        start = max(a0, b0)  # the all-reduce starts when its last member does
        assert b0 - a0 > 0.015  # (rank 1 joined late, so rank 0 waited for it)
        blocking += [a1 - start, b1 - start]
        # the 40 ms all-reduce began with the later rank; beyond the compute it overlapped, the
        # wait adds only what the links had left (0 unless the ranks started > 10 ms apart)
        link_end = max(a2, b2) + 0.04
        added += [a4 - a3 - max(0.0, link_end - a3), b4 - b3 - max(0.0, link_end - b3)]
    # the modelled 50 ms (the median: sleeps overshoot on a loaded machine)
    assert statistics.median(blocking) == pytest.approx(0.05, rel=0.1)
    assert all(0.05 - 1e-3 <= t < 0.05 * 1.5 for t in blocking)  # never early
    # an asynchronous all-reduce shorter than the compute it overlaps adds ~0 when waited for
    assert statistics.median(added) < 0.003 and max(added) < 0.02


# -- runs that end by time, the global model's loss ----------------------------------------------


def test_sync_and_wsp_d0_global_models_agree_and_time_bounds_stop_early() -> None:
    prof = _profile()
    out = {}
    for schedule in ("1f1b", "wsp"):
        plan = _plan(schedule, 0, DEVICES[:2])
        cfg = TrainConfig("gpt2-tiny", steps=4, warmup=0, lr=0.5, threads=1, timeout_s=60, data="text",
                          eval_global=True)
        out[schedule] = train_local(plan, cfg, start_method="forkserver")
    sync, wsp = out["1f1b"]["global_eval"], out["wsp"]["global_eval"]
    assert [g["iteration"] for g in sync] == [g["iteration"] for g in wsp] == [0, 1, 2, 3]
    # WSP with D = 0 and one device per worker is synchronous SGD: the same global models
    torch.testing.assert_close([g["loss"] for g in wsp], [g["loss"] for g in sync], rtol=1e-4, atol=1e-6)
    assert all(a["t_s"] < b["t_s"] for a, b in itertools.pairwise(sync))
    # a run by time stops long before its step cap (an emulated step: 48 ms of compute + a 40 ms all-reduce)
    plan = _plan("1f1b", 0, DEVICES[:2])
    emu = emulation_for(plan, prof, CLUSTER, reference="A100", links=True)
    m = train_local(plan, TrainConfig("gpt2-tiny", steps=10_000, warmup=0, threads=1, timeout_s=60, data="text",
                                      max_seconds=0.5, emulation=emu), start_method="forkserver")
    n = len(m["step_s"])
    assert 1 <= n < 10_000 and m["iterations_per_worker"] == [n, n]
    assert sum(m["step_s"]) < 0.5 + 2 * max(m["step_s"])


@pytest.mark.parametrize("draw", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_wsp_by_time_keeps_the_staleness_bound_under_random_delays(draw: int, monkeypatch: pytest.MonkeyPatch
                                                                    ) -> None:
    """Random sleeps after every forward (each worker its own pace and jitter), a run that ends
    by time: it finishes, every worker ends with the same global weights, and when a worker has
    its global weights of wave c - D (after pushing c), no worker has pushed fewer than c - D + 1
    waves, i.e. the clock gap never exceeds D."""
    import runtime.wsp as wsp_mod

    rng = random.Random(f"wsp-gap-{draw}")
    d, workers = rng.randint(0, 2), rng.choice([2, 3])
    paces = [rng.uniform(0.001, 0.012) for _ in range(workers)]
    forward = wsp_mod.WspExecutor._forward

    def slow_forward(self: wsp_mod.WspExecutor, j: int, s: int) -> None:
        forward(self, j, s)
        me = dist.get_rank()
        time.sleep(paces[me] * random.Random(f"{draw}-{me}-{j}").uniform(0.2, 3.0))

    monkeypatch.setattr(wsp_mod.WspExecutor, "_forward", slow_forward)  # inherited by the forked ranks
    plan = _plan("wsp", d, DEVICES[:workers])
    m = train_local(plan, TrainConfig("gpt2-tiny", steps=10_000, warmup=0, threads=1, timeout_s=60, data="synthetic",
                                      max_seconds=0.6, eval_global=True), start_method="fork")  # (fork: the patch above)
    done = m["iterations_per_worker"]
    assert min(done) >= 1 and max(done) - min(done) <= d + 1
    ranks = m["ranks"]
    pushed = [{**{c: r["start_time"] + t for c, t in enumerate(r["wave_end_s"])},
               **{int(c): r["start_time"] + t for c, t in r["empty_wave_s"].items()}} for r in ranks]
    checked = 0
    for r, mine in zip(ranks, pushed, strict=True):
        for c, t in ((int(c), r["start_time"] + t) for c, t in r["pull_end_s"].items()):
            # every worker had pushed wave c when this one got it
            assert all(q[c] <= t + 1e-6 for q in pushed)
            clock = max(k for k, x in mine.items() if x <= t)
            slowest = min(max(k for k, x in q.items() if x <= t) for q in pushed)
            assert clock - slowest <= d
            checked += 1
    assert checked >= sum(done)
    assert m["global_eval"] and all(g["loss"] == g["loss"] for g in m["global_eval"])


def test_time_bounds_and_links_are_refused_where_the_runtime_cannot(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    prof = _profile()
    for name, obj in (("p.json", prof), ("c.json", CLUSTER)):
        obj.save(tmp_path / name)
    pipe = Plan("gpt2-tiny", (VirtualWorker((Stage((0, 2), "n0:0"), Stage((2, 4), "n1:0"))),), schedule="wsp",
                micro_batch_size=2, micro_batches=2, staleness=1)
    pipe.save(tmp_path / "pipe.json")
    _plan("2bw", 0, DEVICES[:2]).save(tmp_path / "twobw.json")
    common = ["--profile", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json"), "--model", "gpt2-tiny",
              "--local"]
    cases = [(["pipe.json", "--max-seconds", "5"], "--max-seconds with schedule wsp needs one device per virtual "
                                                    "worker"),
             (["twobw.json", "--max-seconds", "5"], "--max-seconds: a 2bw run ends after --steps"),
             (["twobw.json", "--emulate", "--emulate-links", "--emulate-reference", "A100"],
              "--emulate-links = '2bw'"),
             (["twobw.json", "--emulate-links"], "--emulate-links: only with --emulate")]
    for args, expect in cases:
        assert cli.main(["train", str(tmp_path / args[0]), *common, *args[1:]]) == 2
        err = capsys.readouterr().err
        assert expect in err and "Traceback" not in err
    with pytest.raises(PartitionerError, match="max_seconds = -1"):
        TrainConfig("gpt2-tiny", max_seconds=-1)


def test_cli_says_links_are_emulated_and_ends_by_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    _profile().save(tmp_path / "p.json")
    CLUSTER.save(tmp_path / "c.json")
    _plan("wsp", 1, DEVICES[:2]).save(tmp_path / "plan.json")
    out = tmp_path / "m.json"
    code = cli.main(["train", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "p.json"), "--cluster",
                     str(tmp_path / "c.json"), "--model", "gpt2-tiny", "--local", "--emulate", "--emulate-links",
                     "--emulate-reference", "A100", "--steps", "1000", "--max-seconds", "1", "--threads", "1",
                     "-o", str(out)])
    text = capsys.readouterr().out
    assert code == 0
    assert "all-reduces between virtual workers take the plan's links x100" in text
    assert "the plan's links x100)" in text  # the prediction's line
    m = json.loads(out.read_text())
    assert m["emulated"]["links"]["time_scale"] == pytest.approx(100.0)
    assert m["emulated"]["links"]["collectives"][0]["devices"] == ["n0:0", "n1:0"]
    assert min(m["iterations_per_worker"]) >= 1 and max(m["iterations_per_worker"]) < 1000
