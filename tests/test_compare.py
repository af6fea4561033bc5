"""partitioner compare / solvers.analysis.compare: every solver on the same inputs, one table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partitioner.cost import CostModel
from partitioner_cli.main import main
from solvers.analysis.compare import BASELINE_NAMES, CHAIN_SOLVERS, POLICIES, compare

from .conftest import flat_cluster, make_profile


def _inputs():
    times = [1, 2, 3, 1, 2, 3, 1, 2, 3, 4]
    prof = make_profile({"A": times, "B": [2 * t for t in times]}, param_bytes=[1e6] * 10, saved_bytes=[1e6] * 10,
                        output_bytes=[1e5] * 10)
    return prof, flat_cluster(["A", "B", "A", "B"], per_node=2)


def test_one_pipeline_exact_solvers_agree_and_beat_every_baseline() -> None:
    prof, cluster = _inputs()
    rows = compare(prof, cluster, micro_batches=4)
    assert [r.name for r in rows] == [*CHAIN_SOLVERS, *BASELINE_NAMES]
    assert all(r.ok and r.plan is not None for r in rows)
    cost = CostModel(prof, cluster)
    bottleneck = {r.name: max(cost.plan_stage_times_s(r.plan)) for r in rows}
    exact = [r for r in rows if r.kind == "solver"]
    for r in exact:  # the same optimum, certified
        assert r.status == "optimal" and r.gap == 0.0
        assert r.objective == pytest.approx(bottleneck["dp"], rel=1e-9)
    for name in BASELINE_NAMES:  # no baseline split has a smaller bottleneck than the optimum
        assert bottleneck[name] >= bottleneck["dp"] * (1 - 1e-12)
    for r in rows:  # every plan carries both throughputs, and the objective respects its bound
        assert r.model_samples_per_s > 0 and r.simulated_samples_per_s > 0
        assert r.objective >= r.lower_bound * (1 - 1e-12)
    # the baselines are judged against the exact bottleneck per sample (m x it bounds an iteration
    # of m micro-batches of b samples), tighter than perfect speed-up and below every split's rate
    per_sample = max(r.lower_bound for r in exact) / prof.micro_batch_size
    for r in rows:
        if r.kind == "baseline":
            assert r.lower_bound == pytest.approx(per_sample, rel=1e-12)
            assert 1 / r.model_samples_per_s >= per_sample * (1 - 1e-9)
    dp_rate = next(r.model_samples_per_s for r in exact if r.name == "dp")
    assert 1 / dp_rate >= per_sample * (1 - 1e-9)  # the dp's own plan respects it too


def test_virtual_workers_opt_is_at_least_every_policy_and_baseline() -> None:
    prof, cluster = _inputs()
    rows = compare(prof, cluster, virtual_workers=2, micro_batches=4, time_limit_s=5)
    assert [r.name for r in rows] == [*POLICIES, *BASELINE_NAMES]
    opt = next(r for r in rows if r.name == "opt")
    for r in rows:
        if r.ok:
            assert opt.model_samples_per_s >= r.model_samples_per_s * (1 - 1e-9), r.name
            assert len(r.plan.virtual_workers) == r.virtual_workers == 2


def test_a_policy_that_does_not_apply_is_a_row_not_an_error() -> None:
    prof, _ = _inputs()
    rows = compare(prof, flat_cluster(["A"] * 4, per_node=2), virtual_workers=2, micro_batches=4, time_limit_s=5)
    hd = next(r for r in rows if r.name == "hd")
    assert hd.status == "n/a" and "only 1 type" in hd.reason
    assert sum(r.ok for r in rows) == len(rows) - 1


def test_cli_table_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof, cluster = _inputs()
    prof.save(tmp_path / "p.json")
    (tmp_path / "c.json").write_text(json.dumps(cluster.to_dict()))
    out, png = tmp_path / "cmp.json", tmp_path / "cmp.png"
    assert main(["compare", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json"), "--micro-batches", "4",
                 "-o", str(out), "--png", str(png)]) == 0
    text = capsys.readouterr().out
    for name in (*CHAIN_SOLVERS, *BASELINE_NAMES):
        assert f"\n{name} " in text
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["rows"]] == [*CHAIN_SOLVERS, *BASELINE_NAMES]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bad_virtual_workers_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof, cluster = _inputs()
    prof.save(tmp_path / "p.json")
    (tmp_path / "c.json").write_text(json.dumps(cluster.to_dict()))
    assert main(["compare", str(tmp_path / "p.json"), "--cluster", str(tmp_path / "c.json"),
                 "--virtual-workers", "zero"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--virtual-workers = 'zero': must be an integer >= 1 or 'auto'" in err


def test_every_row_of_one_problem_is_judged_by_one_certificate() -> None:
    """The rows plan the same problem, so each gap is measured against the best bound any row
    proved, never past a plan it bounds; a row is optimal only where it reaches that bound."""
    prof, cluster = _inputs()
    for k in (2, "auto"):
        rows = [r for r in compare(prof, cluster, virtual_workers=k, micro_batches=4, time_limit_s=5) if r.ok]
        bounds = {r.lower_bound for r in rows}
        assert len(bounds) == 1, (k, bounds)
        (bound,) = bounds
        for r in rows:
            assert r.objective >= bound * (1 - 1e-9), r.name  # s per sample: no plan beats the bound
            assert r.gap == pytest.approx(max(0.0, (r.objective - bound) / r.objective), abs=1e-12)
            assert (r.status == "optimal") == (r.objective <= bound * (1 + 1e-9)), r.name


def test_shared_certificate_takes_the_tightest_bound() -> None:
    from solvers.analysis.compare import Comparison, shared_certificate

    rows = [Comparison("a", "policy", "optimal", 2, 1.0, 0.9, 0.0, "s/sample"),
            Comparison("b", "policy", "feasible", 2, 1.2, 0.95, 0.2, "s/sample"),
            Comparison("c", "baseline", "feasible", 2, 1.5, 0.5, 0.6, "s/sample"),
            Comparison("d", "policy", "n/a")]
    out = shared_certificate(rows)
    assert [r.lower_bound for r in out[:3]] == [0.95, 0.95, 0.95]
    assert [r.status for r in out] == ["feasible", "feasible", "feasible", "n/a"]
    assert out[0].gap == pytest.approx(0.05) and out[2].gap == pytest.approx(1 - 0.95 / 1.5)
