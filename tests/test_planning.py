"""The planning front door: one request, one SolveResult, INFEASIBLE with a reason (never None)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from partitioner.errors import OptionError
from partitioner.schedule import first_slice_counts
from partitioner.simulate import simulate_plan
from partitioner_cli._args import OPTION_FLAGS, cli_message
from solvers import SolveStatus, solve
from solvers.cluster.microbatch import choose_micro_batches
from solvers.cluster.planner import plan_cluster
from solvers.planning import PlanRequest, plan
from tests._hetero_fixtures import small_cluster, synthetic_profile


@pytest.fixture(scope="module")
def inputs():
    return synthetic_profile(8, micro_batch_size=8, param_mb=5, act_mb=50), \
        small_cluster([["TITAN-V", "RTX-2060"], ["TITAN-V"]])


def _stages(result):
    return [[(s.layers, s.device) for s in vw.stages] for vw in result.plan.virtual_workers]


@pytest.mark.parametrize(("request_", "planner"), [
    (PlanRequest(), "dp"),
    (PlanRequest(solver="cpsat"), "cpsat"),
    (PlanRequest(schedule="interleaved", micro_batches=4), "dp"),
    (PlanRequest(virtual_workers=2), "hetero"),
    (PlanRequest(policy="np"), "hetero"),
    (PlanRequest(replication=True), "hetero"),
    (PlanRequest(micro_batches="auto", global_batch=8), "hetero"),
    (PlanRequest(solver="hetero"), "hetero"),
])
def test_each_request_has_one_planner(request_, planner):
    assert request_.planner == planner


def test_the_front_door_gives_what_each_path_gives(inputs):
    prof, cl = inputs
    for request, direct in [
        (PlanRequest(micro_batches=4), solve(prof, cl, solver="dp", schedule="1f1b", micro_batches=4)),
        (PlanRequest(virtual_workers=2, micro_batches=4, simulate_top=0),
         plan_cluster(prof, cl, 2, "opt", micro_batches=4)),
    ]:
        got = plan(prof, cl, request)
        assert got.status is direct.status and _stages(got) == _stages(direct)
        assert got.objective == direct.objective


def test_micro_batch_choice_through_the_front_door(inputs):
    """The global batch is the samples of an iteration, all workers together: K x m x b = B, and
    the certificate covers every size and worker count (the cluster planner's own choice at one K
    never beats it)."""
    prof, cl = inputs
    for k in (1, 2, None):
        got = plan(prof, cl, PlanRequest(micro_batches="auto", global_batch=32, virtual_workers=k))
        assert got.ok and got.plan is not None
        chosen = got.details["micro_batch_choice"]
        workers = len(got.plan.virtual_workers)
        assert workers == (k or workers) and chosen["virtual_workers"] == workers
        assert workers * chosen["micro_batch_size"] * chosen["micro_batches"] == 32
        assert got.details["messages"][0].startswith(f"global batch 32: {workers} virtual worker(s) x ")
        assert got.plan.predicted["samples_per_s"] == pytest.approx(chosen["samples_per_s"])
        direct = choose_micro_batches(prof, cl, 32 // (k or 1), plan_cluster, virtual_workers=k or 1, policy="opt")
        assert direct.ok
        assert 1.0 / got.lower_bound >= direct.samples_per_s * (1 - 1e-6)
        # a certificate always, and it holds for the answer with its first micro-batch in any slices
        assert math.isfinite(got.lower_bound) and got.lower_bound > 0
        for s in first_slice_counts(got.plan.schedule, got.plan.micro_batch_size, got.plan.micro_batches):
            sliced = replace(got.plan, first_slices=s)
            rate = 32 / simulate_plan(sliced, prof.at_size(sliced.micro_batch_size), cl).iteration_s
            assert rate <= (1.0 / got.lower_bound) * (1 + 1e-9)


def test_nothing_fits_is_infeasible_with_a_reason_not_none():
    prof = synthetic_profile(4, micro_batch_size=4, param_mb=4000)  # GBs of weights per layer
    cl = small_cluster([["RTX-2060"]])
    choice = choose_micro_batches(prof, cl, 4, plan_cluster, virtual_workers=1)
    assert not choice.ok and choice.result.status is SolveStatus.INFEASIBLE
    assert choice.result.reason == "no micro-batch size dividing 4 fits"
    assert [r.split(":")[0] for r in choice.result.details["refused"]] == ["size 1 (4 micro-batches)",
                                                                         "size 2 (2 micro-batches)",
                                                                         "size 4 (1 micro-batches)"]
    got = plan(prof, cl, PlanRequest(micro_batches="auto", global_batch=4))
    assert got.status is SolveStatus.INFEASIBLE and got.plan is None and "global batch 4" in got.reason


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"schedule": "bfs", "solver": "cpsat"}, "schedule"),
    ({"schedule": "interleaved", "allow_fewer": True}, "allow_fewer"),
    ({"chunks": "2"}, "chunks"),
    ({"virtual_workers": 2, "solver": "milp"}, "solver"),
    ({"virtual_workers": 2, "allow_fewer": True}, "allow_fewer"),
    ({"time_limit_s": 5.0}, "time_limit_s"),
    ({"seed": 3}, "seed"),
    ({"solver": "cpsat", "threads": 0}, "threads"),
    ({"micro_batches": "auto"}, "micro_batches"),
    ({"micro_batches": 0}, "micro_batches"),
    ({"virtual_workers": "two"}, "virtual_workers"),
])
def test_a_contradictory_request_is_one_line_naming_the_option(kwargs, flag):
    with pytest.raises(OptionError) as err:
        PlanRequest(**kwargs)
    assert err.value.field == flag and "\n" not in str(err.value)
    # the command line names the option by its flag
    shown = cli_message(err.value)
    assert shown.startswith(OPTION_FLAGS[flag] + " = ") and "`" not in shown
