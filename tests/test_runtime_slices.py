"""A sliced first micro-batch (AutoPipe) in the runtime: the lists the simulator times, the rows of
every slice, and the same weights as one process and as the unsliced plan."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from partitioner.errors import FormatError
from partitioner.placement import supports
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.schedule import B, F, MicroBatching
from runtime.launch import TrainConfig, train_local
from runtime.layout import plan_layout

from .test_runtime import reference_weights, worker
from .test_runtime_replicas import _assert_replicas_equal, _mixed, _one_process_losses


def _replicated(cuts: list[int], devices: list[tuple[str, ...]]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devs[0], replicas=devs[1:])
                               for (a, b), devs in zip(itertools.pairwise(cuts), devices, strict=True)))


# -- the micro-batches of an iteration -------------------------------------------------------------


@pytest.mark.parametrize(("m", "b", "s"), [(1, 1, 1), (3, 4, 1), (3, 4, 2), (1, 4, 4), (5, 8, 4), (2, 6, 3)])
def test_slices_partition_the_samples_and_weigh_by_share(m: int, b: int, s: int) -> None:
    mb = MicroBatching(m, b, s)
    assert mb.count == m - 1 + s
    for it in range(2):  # numbered across iterations, the same rows every iteration
        rows = [mb.rows(it * mb.count + j) for j in range(mb.count)]
        assert rows[0][0] == 0 and rows[-1][1] == m * b
        assert all(a[1] == c[0] for a, c in itertools.pairwise(rows))  # in order, no gap, no overlap
        for j, (start, stop) in enumerate(rows):
            assert mb.is_slice(it * mb.count + j) == (s > 1 and j < s)
            assert stop - start == (b // s if mb.is_slice(j) else b)
            # the loss of a mean over the samples, divided so, weighs by the share of the samples
            assert (stop - start) * mb.loss_divisor(j) == m * b


def test_micro_batching_refuses_what_cannot_be_sliced() -> None:
    with pytest.raises(FormatError, match="first_slices = 3: must divide the micro-batch size 4"):
        MicroBatching(2, 4, 3)
    with pytest.raises(FormatError, match="micro_batches = 0: must be an integer >= 1"):
        MicroBatching(0, 4)


# -- the lists the simulator times ------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("slices", [2, 4])
@pytest.mark.parametrize("replicated", [False, True])
def test_ranks_run_the_sliced_lists_the_simulator_times(schedule: str, slices: int, replicated: bool,
                                                        tmp_path: Path) -> None:
    from partitioner.simulate import simulate_plan
    from partitioner_cli.train import _replica_assignment

    profile, cluster = _mixed(tmp_path)  # n0:0 and n0:1 fast, n0:2 slow
    vw = (_replicated([0, 1, 4], [("n0:1", "n0:2"), ("n0:0",)]) if replicated
          else worker([0, 1, 2, 4], ["n0:0", "n0:1", "n0:2"]))
    plan = Plan("gpt2-tiny", (vw,), schedule=schedule, micro_batch_size=4, micro_batches=3, first_slices=slices)
    assert supports(plan, "runtime") is None
    layout = plan_layout(plan, 4, assignment=_replica_assignment(plan, profile, cluster))
    tl = simulate_plan(plan, profile, cluster)
    ran_all = set()
    for r in layout.ranks:
        ran = [(a.kind, a.micro_batch, a.stage) for a in layout.actions(r.rank) if a.kind in (F, B)]
        timed = [(k, j, s) for d, k, j, s, _, _ in tl.events() if tl.devices[d] == r.device and k in (F, B)]
        assert ran == timed, r.device
        ran_all |= set(ran)
    # every slice and every whole micro-batch through every stage, forward and backward
    assert ran_all == {(k, j, s) for k in (F, B) for j in range(3 - 1 + slices) for s in range(len(vw.stages))}


def test_sliced_plans_hold_their_slices_share_of_activations_in_the_simulator() -> None:
    """GPipe holds every micro-batch's activations at its peak: m whole ones, sliced or not."""
    from partitioner.simulate import simulate_plan

    from .test_simulate import chain_plan, uniform_profile

    plan, cluster = chain_plan(2, 3, "gpipe")
    whole = simulate_plan(plan, uniform_profile(2), cluster)
    for s in (2, 4):
        sliced = simulate_plan(replace(plan, first_slices=s), uniform_profile(2), cluster)
        assert sliced.peak_memory_bytes == pytest.approx(whole.peak_memory_bytes)
        assert sliced.peak_activations == {d: 3 - 1 + s for d in sliced.peak_activations}  # counted in list items


@pytest.mark.parametrize("p", [2, 3, 4])
def test_sliced_1f1b_never_holds_more_than_unsliced(p: int) -> None:
    """1F1B keeps at most min(p - r, m - 1 + s) list micro-batches in flight, never worth more than
    the unsliced min(p - r, m) whole ones; fewer while the slices are in flight."""
    from partitioner.simulate import simulate_plan

    from .test_simulate import chain_plan, uniform_profile

    for m in range(1, 6):
        plan, cluster = chain_plan(p, m, "1f1b")
        whole = simulate_plan(plan, uniform_profile(p), cluster)
        for s in (2, 4):
            sliced = simulate_plan(replace(plan, first_slices=s), uniform_profile(p), cluster)
            for d, peak in sliced.peak_memory_bytes.items():
                assert peak <= whole.peak_memory_bytes[d] * (1 + 1e-12), (m, s, d)
            if m == 1:  # one micro-batch: its slices run one after the other on the last stage
                last = plan.virtual_workers[0].stages[-1].device
                assert sliced.peak_memory_bytes[last] < whole.peak_memory_bytes[last]


# -- numerics against one process and the unsliced plan -----------------------------------------------


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{what}: {k}")


def _train(plan: Plan, out: Path, steps: int, lr: float, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Train one virtual worker with the runtime: its weights and the run's metrics."""
    out.mkdir()
    cfg = TrainConfig(plan.model, steps=steps, warmup=0, lr=lr, seed=seed, threads=1, timeout_s=120,
                      state_dir=str(out))  # (a loaded machine can take a minute to connect the processes)
    metrics = train_local(plan, cfg, start_method="forkserver")
    weights: dict[str, torch.Tensor] = {}
    for r in plan_layout(plan, 4).ranks:
        for state in torch.load(out / f"rank{r.rank}.pt").values():
            weights.update(state)
    return weights, metrics


@pytest.mark.parametrize(("schedule", "vw", "slices"), [
    ("gpipe", worker([0, 2, 4], ["n0:0", "n0:1"]), 2),
    pytest.param("gpipe", worker([0, 1, 3, 4], ["n0:0", "n0:1", "n0:2"]), 4, marks=pytest.mark.slow),
    pytest.param("1f1b", worker([0, 1, 3, 4], ["n0:0", "n0:1", "n0:2"]), 2, marks=pytest.mark.slow),
    ("1f1b", worker([0, 3, 4], ["n0:0", "n0:1"]), 4),
    ("1f1b", _replicated([0, 2, 4], [("n0:0",), ("n0:1", "n0:2")]), 2),  # last stage replicated
    ("gpipe", _replicated([0, 1, 4], [("n0:0", "n0:1"), ("n0:2",)]), 4),  # first stage replicated
])
def test_sliced_first_micro_batch_trains_as_one_process(schedule: str, vw: VirtualWorker, slices: int,
                                                        tmp_path: Path) -> None:
    plan = Plan("gpt2-tiny", (vw,), schedule=schedule, micro_batch_size=4, micro_batches=3, first_slices=slices)
    steps, lr, seed = 3, 0.05, 1
    ref = reference_weights(plan, steps, lr, seed)
    sliced, metrics = _train(plan, tmp_path / "sliced", steps, lr, seed)
    whole, _ = _train(replace(plan, first_slices=1), tmp_path / "whole", steps, lr, seed)
    _assert_close(sliced, ref, "sliced against one process")
    _assert_close(sliced, whole, "sliced against unsliced")
    # every stage ran the slices and the whole micro-batches: m - 1 + s of them, shared by a stage's replicas
    layout = plan_layout(plan, 4)
    for k, ranks in enumerate(layout.stage_ranks[0]):
        ran = sorted(j for r in ranks for j in metrics["ranks"][r]["micro_batches"])
        assert ran == list(range(3 - 1 + slices)), k
    # the loss is the iteration's mean over its samples, as one process computes it
    assert metrics["loss"] == pytest.approx(_one_process_losses(plan, steps, lr, seed), rel=1e-5)
    if any(st.replicas for st in vw.stages):
        _assert_replicas_equal(plan, tmp_path / "sliced")
