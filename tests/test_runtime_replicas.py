"""Replicated stages in the runtime: every replica a rank, micro-batches shared as the simulator
shares them, gradients all-reduced over the replicas (and the virtual workers)."""

from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import yaml

from partitioner.errors import FormatError, PartitionerError
from partitioner.placement import replica_assignment, replica_shares, supports
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.schedule import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, B, F
from partitioner_cli import main as cli
from runtime.layout import plan_layout

if TYPE_CHECKING:
    from partitioner.cluster import Cluster

from runtime.launch import TrainConfig, train_local
from runtime.stage import build_stage, zoo_chain

from .test_runtime import (
    LR,
    assert_same,
    reference_weights,
    trained_weights,
    twobw_reference,
    wsp_reference,
)


def _stages(cuts: list[int], devices: list[tuple[str, ...]]) -> VirtualWorker:
    """Stage k holds layers [cuts[k], cuts[k + 1]) on devices[k] (the first, then its replicas)."""
    return VirtualWorker(tuple(Stage((a, b), devs[0], replicas=devs[1:])
                               for (a, b), devs in zip(itertools.pairwise(cuts), devices, strict=True)))


# -- the action lists ---------------------------------------------------------------------------


def _check_lists(plan: Plan, assignment: tuple[tuple[tuple[int, ...], ...], ...] | None = None,
                 iterations: int = 1) -> None:
    """Every (micro-batch, stage) computed once, on the replica the assignment names; every send
    matched by exactly one receive between the same two ranks."""
    layout = plan_layout(plan, plan.virtual_workers[0].stages[-1].stop, assignment=assignment)
    m = plan.micro_batches
    for w, vw in enumerate(plan.virtual_workers):
        computed: dict[tuple[str, int, int], int] = {}
        messages: dict[tuple[bool, int, int], list[tuple[int, int]]] = {}
        for r in (x for x in layout.ranks if x.worker == w):
            for a in layout.actions(r.rank, iterations):
                if a.kind in (F, B):
                    key = (a.kind, a.micro_batch, a.stage)
                    assert key not in computed
                    computed[key] = r.rank
                    assert layout.stage_ranks[w][a.stage][layout.assignment[w][a.stage][a.micro_batch % m]] == r.rank
                elif a.kind in (SEND_ACT, SEND_GRAD):
                    messages.setdefault((a.kind == SEND_ACT, a.micro_batch, a.stage), []).append(
                        (r.rank, layout.pipelines[w][a.peer]))
                elif a.kind in (RECV_ACT, RECV_GRAD):
                    sender = a.stage - 1 if a.kind == RECV_ACT else a.stage + 1
                    messages.setdefault((a.kind == RECV_ACT, a.micro_batch, sender), []).append(
                        (layout.pipelines[w][a.peer], r.rank))
        n = len(vw.stages)
        assert set(computed) == {(k, j, s) for k in (F, B) for j in range(m * iterations) for s in range(n)}
        assert len(messages) == 2 * m * iterations * (n - 1)
        assert all(len(pair) == 2 and pair[0] == pair[1] for pair in messages.values()), messages


@pytest.mark.parametrize("draw", range(12))
def test_replica_lists_cover_every_micro_batch_once_and_messages_match(draw: int) -> None:
    rng = random.Random(f"replicas-{draw}")
    n = rng.randint(1, 3)
    cuts = [0, *sorted(rng.sample(range(1, 6), n - 1)), 6]
    names = iter(f"n0:{d}" for d in range(20))
    devices = [tuple(next(names) for _ in range(rng.randint(1, 3))) for _ in range(n)]
    schedule = rng.choice(["gpipe", "1f1b", "2bw", "wsp"])
    plan = Plan("m", (_stages(cuts, devices),), schedule=schedule, micro_batches=rng.randint(1, 6),
                staleness=rng.randint(0, 2) if schedule == "wsp" else 0)
    times = {d: rng.uniform(1.0, 3.0) for devs in devices for d in devs}
    iterations = 1 if schedule in ("gpipe", "1f1b") else 3  # 2bw and wsp: one list across iterations
    _check_lists(plan, iterations=iterations)
    _check_lists(plan, replica_assignment(plan, lambda d, a, b: times[d] * (b - a)), iterations)
    # the lists run to the end (the simulator names the ranks of any wait cycle)
    from partitioner.cluster import Cluster
    from partitioner.simulate import simulate_plan

    from .test_simulate import uniform_profile

    tl = simulate_plan(replace(plan, micro_batch_size=4), uniform_profile(6), Cluster.homogeneous("V100-SXM2-16GB", 1, 20, 16, 7))
    assert tl.iteration_s > 0


def test_assignment_follows_replica_shares_and_is_checked() -> None:
    plan = Plan("m", (_stages([0, 2, 4], [("a:0",), ("a:1", "a:2")]),), micro_batches=3)
    assert replica_assignment(plan) == (((0, 0, 0), (0, 1, 0)),)  # equal times: round-robin
    slow = replica_assignment(plan, lambda d, a, b: 2.0 if d == "a:2" else 1.0)
    assert slow == (((0, 0, 0), tuple(replica_shares([1.0, 2.0], 3))),) == (((0, 0, 0), (0, 0, 1)),)
    layout = plan_layout(plan, 4, assignment=slow)
    assert [(r.device, r.stages, r.replica) for r in layout.ranks] == [("a:0", (0,), 0), ("a:1", (1,), 0),
                                                                     ("a:2", (1,), 1)]
    assert layout.holder_sets() == [((0,), (0, 1)), ((1, 2), (2, 3))]
    with pytest.raises(FormatError, match=r"replica_assignment\[0\]\[1\].*replica in 0\.\.1"):
        plan_layout(plan, 4, assignment=(((0, 0, 0), (0, 2, 0)),))
    with pytest.raises(FormatError, match=r"replica_assignment\[0\].*one entry per stage \(2\)"):
        plan_layout(plan, 4, assignment=(((0, 0, 0),),))


# -- numerics against one process ---------------------------------------------------------------


@pytest.mark.parametrize(("schedule", "devices", "assignment"), [
    ("1f1b", [("n0:0",), ("n0:1", "n0:2")], None),  # last stage replicated, round-robin 0 1 0
    ("gpipe", [("n0:0", "n0:1"), ("n0:2",)], (((0, 0, 1), (0, 0, 0)),)),  # first stage, uneven 2 + 1
])
def test_replicated_stage_matches_one_process(schedule: str, devices: list[tuple[str, ...]],
                                              assignment: tuple[tuple[tuple[int, ...], ...], ...] | None,
                                              tmp_path: Path) -> None:
    plan = Plan("gpt2-tiny", (_stages([0, 2, 4], devices),), schedule=schedule, micro_batch_size=2,
                micro_batches=3)
    assert supports(plan, "runtime") is None
    assert_same(plan, tmp_path, replica_assignment=assignment or ())
    _assert_replicas_equal(plan, tmp_path)


def _assert_replicas_equal(plan: Plan, tmp_path: Path) -> None:
    """The replicas of every stage end with the same weights (each rank saved its own)."""
    layout = plan_layout(plan, plan.virtual_workers[0].stages[-1].stop)
    for stages in layout.stage_ranks:
        for s, ranks in enumerate(stages):
            states = [torch.load(tmp_path / f"rank{r}.pt")[s] for r in ranks]
            for other in states[1:]:
                assert other.keys() == states[0].keys()
                for k, v in states[0].items():
                    assert torch.equal(other[k], v), k


def test_two_workers_one_with_a_replicated_stage_match_one_process(tmp_path: Path) -> None:
    # worker 0: layers [0, 2) on n0:0, [2, 4) on n0:1 and n0:2; worker 1: the whole model on n0:3.
    # Layers 2-3 are averaged over three ranks (two replicas and worker 1), divided by 2 workers.
    plan = Plan("gpt2-tiny", (_stages([0, 2, 4], [("n0:0",), ("n0:1", "n0:2")]), _stages([0, 4], [("n0:3",)])),
                schedule="1f1b", micro_batch_size=2, micro_batches=3)
    assert plan_layout(plan, 4).holder_sets() == [((0, 3), (0, 1)), ((1, 2, 3), (2, 3))]
    assert_same(plan, tmp_path)
    _assert_replicas_equal(plan, tmp_path)


# -- mixed GPU types: the simulator's assignment ---------------------------------------------------

MIXED = {"name": "mixed", "inter_node_GBps": 1,
         "nodes": [{"name": "n0", "intra_node_GBps": 2, "gpus": {"fast": 2, "slow": 1}}],
         "device_types": {"fast": {"memory_GB": 8, "fp32_tflops": 0.2, "mem_GBps": 10},
                          "slow": {"memory_GB": 8, "fp32_tflops": 0.1, "mem_GBps": 10}}}


def _mixed(tmp_path: Path) -> tuple[Profile, Cluster]:
    """Types fast and slow (twice the time) on one node: n0:0 and n0:1 fast, n0:2 slow."""
    from partitioner.cluster import Cluster

    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(MIXED))
    profile = Profile("gpt2-tiny", 2, tuple(
        LayerProfile(f"l{i}", 1.0, 4.0, 4.0, 4.0, {"fast": LayerTime(1e-3, 2e-3), "slow": LayerTime(2e-3, 4e-3)})
        for i in range(4)))
    profile.save(tmp_path / "profile.json")
    return profile, Cluster.load(tmp_path / "cluster.yaml")


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_ranks_run_what_the_simulator_times(schedule: str, tmp_path: Path) -> None:
    from partitioner.simulate import simulate_plan
    from partitioner_cli.train import _replica_assignment

    profile, cluster = _mixed(tmp_path)
    plan = Plan("gpt2-tiny", (_stages([0, 1, 4], [("n0:1", "n0:2"), ("n0:0",)]),), schedule=schedule,
                micro_batch_size=2, micro_batches=5)
    layout = plan_layout(plan, 4, assignment=_replica_assignment(plan, profile, cluster))
    tl = simulate_plan(plan, profile, cluster)
    for r in layout.ranks:
        ran = [(a.kind, a.micro_batch, a.stage) for a in layout.actions(r.rank) if a.kind in (F, B)]
        timed = [(k, j, s) for d, k, j, s, _, _ in tl.events() if tl.devices[d] == r.device and k in (F, B)]
        assert ran == timed, r.device
    # each next micro-batch to the replica that would finish it first (ties to the first): 4 fast, 1 slow
    assert layout.assignment[0][0] == (0, 0, 1, 0, 0)


def test_cli_shares_micro_batches_by_the_replicas_speeds(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.launch as launch

    real = launch.train_local
    monkeypatch.setattr(launch, "train_local", lambda plan, cfg, **kw: real(plan, cfg, start_method="forkserver", **kw))
    _mixed(tmp_path)  # the slow type takes twice as long: of 3 micro-batches the fast replica runs 2, the slow 1
    plan = Plan("gpt2-tiny", (_stages([0, 2, 4], [("n0:0",), ("n0:1", "n0:2")]),), micro_batch_size=2,
                micro_batches=3)
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "metrics.json"
    rc = cli.main(["train", str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json"),
                   "--cluster", str(tmp_path / "cluster.yaml"), "--model", "gpt2-tiny", "--local", "--steps", "2",
                   "--warmup", "0", "--threads", "1", "--lr", "0.05", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    m = json.loads(out.read_text())
    ranks = {r["device"]: r for r in m["ranks"]}
    assert [ranks[d]["micro_batches"] for d in ("n0:0", "n0:1", "n0:2")] == [[0, 1, 2], [0, 1], [2]]
    assert [ranks[d]["replica"] for d in ("n0:0", "n0:1", "n0:2")] == [0, 0, 1]
    # the loss is the worker's, summed over the replicas of the last stage: one process's loss
    chain_loss = _one_process_losses(plan, 2, 0.05, 0)
    assert m["loss"] == pytest.approx(chain_loss, rel=1e-4)


def _one_process_losses(plan: Plan, steps: int, lr: float, seed: int) -> list[float]:
    from runtime.data import make_data
    from runtime.stage import build_stage, zoo_chain

    chain = zoo_chain(plan.model, plan.micro_batch_size)
    model = build_stage(chain, 0, chain.num_layers, seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    source = make_data(chain, "auto", plan.micro_batch_size, plan.micro_batches, len(plan.virtual_workers), seed)
    out = []
    for step in range(steps):
        opt.zero_grad()
        x, y = source.global_batch(step)
        loss = source.loss(model(x), y)
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


# -- no flush: wsp and 2bw ----------------------------------------------------------------------


@pytest.mark.parametrize(("staleness", "two_workers"), [(0, False), (1, True), pytest.param(0, True, marks=pytest.mark.slow),
                                                         pytest.param(2, True, marks=pytest.mark.slow)])
def test_wsp_replicated_position_follows_its_update_rule(staleness: int, two_workers: bool, tmp_path: Path) -> None:
    # worker 0 is one position, the whole model over two replicas: each wave's micro-batches run one after the
    # other (no wave overlaps the next), so the rule of a one-device worker holds, its update summed over replicas
    workers = (_stages([0, 4], [("n0:0", "n0:1")]),) + ((_stages([0, 4], [("n0:2",)]),) if two_workers else ())
    plan = Plan("gpt2-tiny", workers, schedule="wsp", micro_batch_size=2, micro_batches=3, staleness=staleness)
    assert supports(plan, "runtime") is None
    ref = wsp_reference(plan, 4, LR, 1)
    for got in trained_weights(plan, tmp_path, 4, LR, 1, "synthetic"):
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6, msg=k)
    _assert_replicas_equal(plan, tmp_path)
    if staleness == 0:  # synchronous SGD on the global batch
        sync = reference_weights(plan, 4, LR, 1, "synthetic")
        for k, v in sync.items():
            torch.testing.assert_close(ref[k], v, rtol=1e-4, atol=1e-6)


def test_wsp_replicated_first_stage_runs_as_the_unreplicated_pipeline(tmp_path: Path) -> None:
    # replicating the first stage keeps every position's list (depths p - k - 1) and the point of every PUSH and
    # PULL in it, so the weights each micro-batch sees are those of the unreplicated pipeline
    other = _stages([0, 1, 4], [("n0:3",), ("n0:4",)])
    plan = Plan("gpt2-tiny", (_stages([0, 2, 4], [("n0:0", "n0:1"), ("n0:2",)]), other), schedule="wsp",
                micro_batch_size=2, micro_batches=3, staleness=1)
    plain = replace(plan, virtual_workers=(_stages([0, 2, 4], [("n0:0",), ("n0:2",)]), other))
    (tmp_path / "replicated").mkdir()
    (tmp_path / "plain").mkdir()
    got = trained_weights(plan, tmp_path / "replicated", 4, LR, 1, "synthetic")
    want = trained_weights(plain, tmp_path / "plain", 4, LR, 1, "synthetic")
    init = build_stage(zoo_chain(plan.model), 0, 4, seed=1).state_dict()
    for a, b in zip(got, want, strict=True):
        for k in init:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)
            torch.testing.assert_close(a[k], got[0][k], rtol=1e-5, atol=1e-7, msg=k)  # the workers end equal
    assert any(not torch.equal(init[k], got[0][k]) for k in init)
    _assert_replicas_equal(plan, tmp_path / "replicated")


@pytest.mark.parametrize("devices", [[("n0:0",), ("n0:1", "n0:2")], [("n0:0", "n0:1", "n0:2"), ("n0:3",)]])
@pytest.mark.parametrize("two_workers", [False, True])
def test_2bw_replicated_stage_follows_its_update_rule(devices: list[tuple[str, ...]], two_workers: bool,
                                                      tmp_path: Path) -> None:
    workers = (_stages([0, 2, 4], devices),) + ((_stages([0, 1, 4], [("n0:7",), ("n0:8",)]),) if two_workers else ())
    plan = Plan("gpt2-tiny", workers, schedule="2bw", micro_batch_size=2, micro_batches=3)
    steps, lr = 4, 0.5
    ref, ref_losses = twobw_reference(plan, steps, lr, 1)
    cfg = TrainConfig(plan.model, steps=steps, warmup=0, lr=lr, seed=1, threads=1, timeout_s=60,
                      state_dir=str(tmp_path))
    metrics = train_local(plan, cfg, start_method="forkserver")
    assert metrics["loss"] == pytest.approx(ref_losses, rel=1e-4)  # summed over a replicated last stage
    got: list[dict[str, torch.Tensor]] = [{} for _ in plan.virtual_workers]
    for r in plan_layout(plan, 4).ranks:
        for state in torch.load(tmp_path / f"rank{r.rank}.pt").values():
            got[r.worker].update(state)
    for weights in got:
        for k, v in ref.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-4, atol=1e-6, msg=k)
    _assert_replicas_equal(plan, tmp_path)


# -- what is still refused -----------------------------------------------------------------------


@pytest.mark.parametrize(("change", "expect"), [
    ({"schedule": "interleaved"}, "executes replicated stages with schedule gpipe, 1f1b, 2bw or wsp, not "
                                  "'interleaved'"),
    ({"schedule": "bfs"}, "executes replicated stages with schedule gpipe, 1f1b, 2bw or wsp, not 'bfs'"),
    ({"schedule": "interleaved", "chunks": 2, "micro_batches": 4}, "replicated stages run one chunk per device"),
])
def test_replicas_refused_where_not_executed(change: dict[str, object], expect: str) -> None:
    plan = Plan("gpt2-tiny", (_stages([0, 2, 4], [("n0:0",), ("n0:1", "n0:2")]),), micro_batch_size=2,
                micro_batches=3)
    assert supports(plan, "runtime") is None
    bad = replace(plan, **change)  # type: ignore[arg-type]
    assert expect in (supports(bad, "runtime") or "")
    with pytest.raises(PartitionerError, match=re.escape(expect)):
        plan_layout(bad, 4)


def test_a_device_twice_in_a_replicated_pipeline_is_refused() -> None:
    plan = Plan("gpt2-tiny", (_stages([0, 2, 4], [("n0:0",), ("n0:1", "n0:0")]),), micro_batches=2)
    with pytest.raises(FormatError, match="a device is named twice"):
        plan_layout(plan, 4)
