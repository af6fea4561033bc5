"""Baselines: their rules, their validity, and opt never losing to them."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from partitioner.cost import CostModel
from solvers import solve
from solvers.baselines import blockpartition_cuts, minmax_cuts, uniform_cuts
from solvers.cluster.planner import plan_cluster
from tests._hetero_fixtures import small_cluster, synthetic_profile


def all_cuts(n, p):
    for inner in itertools.combinations(range(1, n), p - 1):
        yield [0, *inner, n]


def max_block(w, cuts):
    return max(sum(w[a:b]) for a, b in itertools.pairwise(cuts))


@pytest.mark.parametrize("seed", range(4))
def test_minmax_cuts_is_exact(seed):
    w = list(np.random.default_rng(seed).uniform(0, 10, 9))
    for p in (2, 3, 4):
        got = minmax_cuts(w, p)
        assert len(got) == p + 1 and all(a < b for a, b in itertools.pairwise(got))
        assert max_block(w, got) == pytest.approx(min(max_block(w, c) for c in all_cuts(9, p)))


@pytest.mark.parametrize("seed", range(4))
def test_blockpartition_never_worse_than_uniform(seed):
    w = list(np.random.default_rng(seed).uniform(0, 10, 12))
    for p in (2, 3, 5):
        got = blockpartition_cuts(w, p)
        assert got[0] == 0 and got[-1] == 12 and all(a < b for a, b in itertools.pairwise(got))
        assert max_block(w, got) <= max_block(w, uniform_cuts(12, p)) + 1e-12


@pytest.mark.parametrize("name", ["uniform", "parameters", "blockpartition", "pipedream"])
def test_baselines_validate_and_opt_is_no_worse(name):
    prof = synthetic_profile(14, seed=1)
    cl = small_cluster([["TITAN-V", "RTX-2060"], ["Quadro-P4000", "TITAN-RTX"]], inter=0.5)
    base = solve(prof, cl, name, schedule="wsp", micro_batches=4)
    opt = plan_cluster(prof, cl, 1, "opt", schedule="wsp", micro_batches=4)
    assert opt.ok
    if base.ok:
        CostModel(prof, cl).validate_plan(base.plan)
        assert opt.plan.meta["closed_form"]["samples_per_s"] >= base.plan.meta["closed_form"]["samples_per_s"] * (1 - 1e-12)
    else:
        assert base.reason


def test_baseline_that_overflows_memory_is_infeasible_not_a_plan():
    prof = synthetic_profile(8, seed=2, param_mb=900)
    cl = small_cluster([["RTX-2060", "TITAN-RTX", "TITAN-RTX"]])
    res = solve(prof, cl, "uniform", schedule="1f1b", micro_batches=3)
    if not res.ok:
        assert "memory" in res.reason and "GiB" in res.reason
    else:
        CostModel(prof, cl).validate_plan(res.plan)
