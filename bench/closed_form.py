"""The closed form the solvers optimise against the discrete-event simulator, plan by plan.

    python bench/closed_form.py

Plans: PipeDream's six profiles on 4 and 16 V100s (exact DP, ``allow_fewer``), under 1F1B and
GPipe, additive and overlapped communication; and the heterogeneous cases of
``bench/hetero.py`` (VGG-19 and ResNet-152 on the HetPipe cluster, OPT-350M on a mixed
RTX cluster) with every HetPipe policy and ``opt``, which have several virtual workers and so
the gradient all-reduce between them. For each plan the closed form
(``CostModel.plan_iteration_s``: fill and drain, steady state, all-reduce, optimizer step)
is compared with the simulated iteration. Target: within 2%, or the difference explained.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from bench.hetero import POLICIES, cases  # noqa: E402
from partitioner.cluster import Cluster  # noqa: E402
from partitioner.cost import CostModel, CostOptions  # noqa: E402
from partitioner.importers.pipedream import import_pipedream  # noqa: E402
from partitioner.simulate import simulate_plan  # noqa: E402
from solvers import solve  # noqa: E402
from solvers.cluster.planner import plan_cluster  # noqa: E402

PIPEDREAM = ROOT.parent / "shared" / "data" / "pipedream"
if not PIPEDREAM.exists():
    PIPEDREAM = ROOT / "tests" / "data" / "pipedream"
BATCH = {"gnmt": 64}  # PipeDream's GNMT profile is not an image batch: its size is given


def compare(plan, profile, cluster, options) -> tuple[float, float]:
    closed = CostModel(profile, cluster, options).plan_iteration_s(plan)
    return closed, simulate_plan(plan, profile, cluster, options).iteration_s


def main() -> int:
    print(f"machine: {machine_line()}")
    print(f"{'case':34s} {'stages':>6s} {'closed':>9s} {'simulated':>9s} {'diff':>7s}")
    diffs: dict[str, list[float]] = {}

    def row(name: str, key: str, plan, profile, cluster, options) -> None:
        closed, sim = compare(plan, profile, cluster, options)
        d = closed / sim - 1
        diffs.setdefault(key, []).append(d)
        print(f"{name:34s} {len(plan.virtual_workers[0].stages):6d} {closed:8.4f}s {sim:8.4f}s {100 * d:+6.2f}%")

    for path in sorted(PIPEDREAM.glob("*.txt")):
        prof = import_pipedream(path, gpu_type="V100-SXM2-16GB", micro_batch_size=BATCH.get(path.stem))
        for n in (4, 16):
            cl = Cluster.homogeneous("V100-SXM2-16GB", n // 4, 4, 25.0, 10.0)
            for overlap in (False, True):
                for sched in ("1f1b", "gpipe"):
                    opts = CostOptions(overlap_comm=overlap)
                    res = solve(prof, cl, solver="dp", options=opts, micro_batches=16, schedule=sched,
                                allow_fewer=True, dag=False)  # the chain order, as docs/fidelity.md measured
                    if res.ok:
                        row(f"{path.stem} {n} GPUs {sched} {'overlap' if overlap else 'additive'}",
                            f"{sched} {'overlap' if overlap else 'additive'}", res.plan, prof, cl, opts)
    for name, prof, cl in cases():
        for policy in POLICIES:
            res = plan_cluster(prof, cl, "auto", policy, micro_batches=8)
            if res.ok:
                row(f"{name} {policy} K={len(res.plan.virtual_workers)}", "hetero 1f1b additive",
                    res.plan, prof, cl, None)
    print()
    for key, ds in diffs.items():
        print(f"{key:24s} {len(ds):3d} plans: median {100 * statistics.median(ds):+.2f}%, "
              f"worst {100 * max(ds, key=abs):+.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
