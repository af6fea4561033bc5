"""bench/projection_plans.py: the plumbing that swaps projected times into a measured profile."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.projection_plans import (  # noqa: E402
    MICRO_BATCH,
    measured_profile,
    plan_on,
    projected_times,
    with_times,
)
from partitioner.cluster import Cluster, Node  # noqa: E402
from partitioner.projection.evaluation import sailor_configs  # noqa: E402
from partitioner.projection.operator_model import default_calibration  # noqa: E402

SAILOR = ROOT / "tests" / "data" / "sailor_opt350"


def test_measured_times_put_back_give_the_measured_plan() -> None:
    measured, names = measured_profile(SAILOR)
    assert "RTX-2080-Ti" in measured.gpu_types and "RTX-2080" not in measured.gpu_types
    key = names["Titan-RTX"]
    same = with_times(measured, key, [(x.times[key].fwd_s, x.times[key].bwd_s) for x in measured.layers], "x")
    assert all(x.times[key].projected for x in same.layers)
    # the bench's cluster with two GPUs a node rather than four: the same three types, one of
    # them the one whose times are put back
    spec = [["RTX-3090"] * 2, ["RTX-2080-Ti"] * 2, [key] * 2]
    cl = Cluster("sailor-mixed-small", tuple(Node(f"n{i}", tuple(g), 12.0) for i, g in enumerate(spec)), 3.0)
    ref, got = plan_on(measured, measured, cl, 4), plan_on(same, measured, cl, 4)
    assert got.cuts == ref.cuts and got.samples_per_s == ref.samples_per_s == got.believed


def test_projection_never_reads_the_target() -> None:
    configs = [c for c in sailor_configs(SAILOR) if (c.micro_batch_size, c.tensor_parallel) == (MICRO_BATCH, 1)]
    tgt = next(c for c in configs if c.sailor_name == "RTX-3090")
    others = [c.sailor_name for c in configs if c is not tgt]
    a = projected_times(configs, default_calibration(), "RTX-3090", others)
    doubled = [replace(c, fwd_s=tuple(2 * t for t in c.fwd_s), bwd_s=tuple(2 * t for t in c.bwd_s))
               if c is tgt else c for c in configs]
    assert projected_times(doubled, default_calibration(), "RTX-3090", others) == a
    assert len(a) == len(tgt.fwd_s) and all(f > 0 and b > 0 for f, b in a)
