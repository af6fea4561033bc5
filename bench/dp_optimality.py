"""The DP's bottleneck against the true optimum on every PipeDream profile.

    python bench/dp_optimality.py

Identical devices, transfers and memory ignored: the setting in which an independent exact
method exists (parametric search, solvers/pipeline/bisection.py). Prints one row per profile and
pipeline depth; the two columns must agree.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from partitioner.cluster import GIB, Cluster, DeviceType, Node  # noqa: E402
from partitioner.importers.pipedream import import_pipedream  # noqa: E402
from solvers import solve  # noqa: E402
from solvers.pipeline.bisection import identical_optimum  # noqa: E402

PROFILES = ROOT / "tests" / "data" / "pipedream"


def main() -> None:
    print(f"machine: {machine_line()}\n")
    header = f"{'model':<14} {'layers':>6} {'stages':>6} {'dp_bottleneck_s':>16} {'optimum_s':>12} {'rel_diff':>9} {'dp_time_s':>9}"
    print(header)
    print("-" * len(header))
    unlimited = DeviceType("V100", 1e6 * GIB, 1e13, 1e12)
    for path in sorted(PROFILES.glob("*.txt")):
        mbs = 64 if path.stem == "gnmt" else None
        prof = import_pipedream(path, gpu_type="V100", micro_batch_size=mbs)
        prof = dataclasses.replace(prof, layers=tuple(dataclasses.replace(x, output_bytes=0.0) for x in prof.layers))
        fwd, bwd = prof.times_for("V100")
        for p in (2, 4, 8, 16):
            if p > prof.num_layers:
                continue
            cluster = Cluster("same", (Node("n0", ("V100",) * p, 10.0),), 1.0, {"V100": unlimited})
            t0 = time.perf_counter()
            result = solve(prof, cluster, schedule="gpipe", micro_batches=1, dag=False)  # the chain order
            elapsed = time.perf_counter() - t0
            best = identical_optimum(fwd + bwd, p)
            rel = abs(result.objective - best) / best
            print(f"{prof.model:<14} {prof.num_layers:>6} {p:>6} {result.objective:>16.6f} {best:>12.6f} "
                  f"{rel:>9.1e} {elapsed:>9.4f}")


if __name__ == "__main__":
    main()
