"""Micro-batch size and count, rescaled profiles, and first-micro-batch slicing."""

from __future__ import annotations

import pytest

from partitioner.cost import CostModel
from partitioner.errors import FormatError
from partitioner.schedule import Schedule
from solvers.cluster.microbatch import choose_micro_batches
from solvers.cluster.planner import plan_cluster
from tests._hetero_fixtures import small_cluster, synthetic_profile


def test_rescaled_scales_times_and_activations_not_parameters():
    prof = synthetic_profile(5, micro_batch_size=8)
    half = prof.rescaled(4)
    a, b = prof.layers[2], half.layers[2]
    assert b.param_bytes == a.param_bytes
    assert b.saved_bytes == pytest.approx(a.saved_bytes / 2)
    assert b.times["TITAN-V"].fwd_s == pytest.approx(a.times["TITAN-V"].fwd_s / 2)
    assert half.meta["rescaled_from"] == 8 and prof.rescaled(8) is prof
    with pytest.raises(FormatError):
        prof.rescaled(0)


@pytest.mark.parametrize(("sched", "p", "m", "slices", "expected"), [
    ("gpipe", 4, 8, 2, 33.0),  # GPipe: later micro-batches still cross the whole pipeline, no gain
    ("gpipe", 8, 4, 4, 33.0),
    ("1f1b", 4, 8, 1, 33.0),   # (m + p - 1)(f + b) with f = 1, b = 2
    ("1f1b", 4, 8, 2, 32.0),   # 1F1B: the first backward starts earlier
    ("1f1b", 8, 4, 2, 31.0),
])
def test_slicing_the_first_micro_batch_as_simulated(sched, p, m, slices, expected):
    from dataclasses import replace

    from partitioner.simulate import simulate_plan
    from tests.test_simulate import chain_plan, uniform_profile

    plan, cluster = chain_plan(p, m, sched)
    assert simulate_plan(replace(plan, first_slices=slices), uniform_profile(p), cluster).iteration_s == expected
    assert Schedule.of(sched, m).iteration_s([3.0] * p) == (m + p - 1) * 3.0  # the closed form knows no slicing


def test_choice_is_the_best_candidate_and_covers_the_batch():
    prof = synthetic_profile(8, micro_batch_size=8, param_mb=5, act_mb=50)
    cl = small_cluster([["TITAN-V", "RTX-2060"], ["TITAN-V"]])
    choice = choose_micro_batches(prof, cl, 32, plan_cluster, virtual_workers=1, policy="opt")
    assert choice is not None
    assert choice.micro_batch_size * choice.micro_batches == 32
    assert choice.samples_per_s == pytest.approx(max(s for _, _, s in choice.tried))
    CostModel(prof.rescaled(choice.micro_batch_size), cl).validate_plan(choice.result.plan)
    with pytest.raises(FormatError, match="divide"):
        choose_micro_batches(prof, cl, 32, plan_cluster, sizes=[3])


def test_candidates_are_priced_by_the_simulator():
    from partitioner.simulate import simulate_plan

    prof = synthetic_profile(8, micro_batch_size=8, param_mb=5, act_mb=50)
    cl = small_cluster([["TITAN-V", "RTX-2060"], ["TITAN-V"]])
    choice = choose_micro_batches(prof, cl, 32, plan_cluster, virtual_workers=1, policy="opt", slices=(1, 2))
    assert choice is not None
    plan = choice.result.plan
    assert plan.first_slices == choice.first_slices
    simulated = simulate_plan(plan, prof.rescaled(choice.micro_batch_size), cl)
    assert choice.samples_per_s == pytest.approx(simulated.samples_per_s)
