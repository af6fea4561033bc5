"""Micro-batch size and count, rescaled profiles, and first-micro-batch slicing."""

from __future__ import annotations

import pytest

from partitioner.cost import pipeline_iteration_s
from partitioner.errors import FormatError
from solvers.hetero import plan_cluster
from solvers.microbatch import choose_micro_batches
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


def test_slicing_formula():
    t = [1.0, 3.0, 2.0]
    assert pipeline_iteration_s(t, 4, "1f1b", first_slices=1) == pipeline_iteration_s(t, 4, "1f1b")
    assert pipeline_iteration_s(t, 4, "1f1b", first_slices=2) == pytest.approx(6 / 2 + 3.5 * 3)
    assert pipeline_iteration_s(t, 4, "1f1b", first_slices=2) < pipeline_iteration_s(t, 4, "1f1b")
    assert pipeline_iteration_s(t, 4, "wsp", first_slices=2) == pipeline_iteration_s(t, 4, "wsp")


def test_choice_is_the_best_candidate_and_covers_the_batch():
    prof = synthetic_profile(8, micro_batch_size=8, param_mb=5, act_mb=50)
    cl = small_cluster([["TITAN-V", "RTX-2060"], ["TITAN-V"]])
    choice = choose_micro_batches(prof, cl, 32, plan_cluster, virtual_workers=1, policy="opt")
    assert choice is not None
    assert choice.micro_batch_size * choice.micro_batches == 32
    assert choice.samples_per_s == pytest.approx(max(s for _, _, s in choice.tried))
    choice.result.plan.validate(prof.rescaled(choice.micro_batch_size), cl)
    with pytest.raises(FormatError, match="divide"):
        choose_micro_batches(prof, cl, 32, plan_cluster, sizes=[3])
