"""How the cluster planner's cost grows: layers x GPUs x GPU types -> solve time, gap, peak memory.

    python bench/scale.py [--sizes 150x64,150x256,1000x1024] [--types 6] [--time-limit 20] [--write]

Clusters are nodes of 8 GPUs, one GPU type per node, the types in turn (``--types`` of
TITAN-V, TITAN-RTX, RTX-2060, Quadro-P4000, V100-SXM2-16GB, RTX-3090); the model is a random
chain (layer times 0.5-1.5x a mean, speeds per type fixed). Each row is one run of
``plan_cluster(..., "auto", "opt", micro_batches=8, time_limit_s=...)``: wall time, status, the
certified gap (against ``throughput_upper_bound``), K, and the peak Python heap of the solve
(tracemalloc) and the process's peak RSS. ``--write`` also draws a log-log plot of time against
GPUs to ``docs/img/scale.png`` (otherwise nothing is written).
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from partitioner.cluster import Cluster, Node  # noqa: E402
from partitioner.profile import LayerProfile, LayerTime, Profile  # noqa: E402
from solvers.hetero import plan_cluster  # noqa: E402

TYPES = (("TITAN-V", 1.0), ("TITAN-RTX", 0.9), ("RTX-2060", 2.2), ("Quadro-P4000", 3.0),
         ("V100-SXM2-16GB", 0.8), ("RTX-3090", 0.6))


def instance(num_layers: int, num_gpus: int, num_types: int, seed: int = 0) -> tuple[Profile, Cluster]:
    rng = np.random.default_rng(seed)
    types = TYPES[:num_types]
    work = rng.uniform(0.5, 1.5, num_layers) * 2e-3
    layers = tuple(
        LayerProfile(f"l{i}", 0.0, float(rng.uniform(1e5, 4e6)), float(rng.uniform(1e5, 4e6)),
                     float(rng.uniform(1e5, 4e6)), {t: LayerTime(work[i] * s / 3, 2 * work[i] * s / 3) for t, s in types})
        for i in range(num_layers))
    nodes = tuple(Node(f"n{i}", (types[i % num_types][0],) * 8, 16.0) for i in range(max(1, num_gpus // 8)))
    return Profile("synthetic", 8, layers), Cluster(f"{num_gpus}gpu-{num_types}types", nodes, 12.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="150x64,150x256,1000x1024", help="LAYERSxGPUS, comma-separated")
    ap.add_argument("--types", type=int, default=6, help="GPU types, 1-6 (default 6)")
    ap.add_argument("--time-limit", type=float, default=20.0, help="time_limit_s of each solve (default 20)")
    ap.add_argument("--write", action="store_true", help="write docs/img/scale.png")
    args = ap.parse_args()
    if not 1 <= args.types <= len(TYPES):
        ap.error(f"--types {args.types}: must be 1..{len(TYPES)}")
    try:
        sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes {args.sizes}: write LAYERSxGPUS[,LAYERSxGPUS...], e.g. 150x256")
    print(f"machine: {machine_line()}")
    print(f"plan_cluster(auto, opt, 1f1b, 8 micro-batches, time_limit_s={args.time_limit:g}), {args.types} GPU types, "
          "nodes of 8, one type per node\n")
    header = f"{'layers':>7} {'gpus':>6} {'time_s':>8}  {'status':<10} {'gap':>7} {'K':>5} {'heap_MiB':>9} {'rss_MiB':>8}"
    print(header)
    print("-" * len(header))
    rows = []
    for num_layers, num_gpus in sizes:
        profile, cluster = instance(num_layers, num_gpus, args.types)
        tracemalloc.start()
        t0 = time.perf_counter()
        res = plan_cluster(profile, cluster, "auto", "opt", micro_batches=8, time_limit_s=args.time_limit)
        elapsed = time.perf_counter() - t0
        heap = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        k = res.details.get("virtual_workers", "-")
        print(f"{num_layers:>7} {len(cluster.devices):>6} {elapsed:>8.1f}  {res.status!s:<10} {res.gap:>7.1%} {k!s:>5} "
              f"{heap:>9.0f} {rss:>8.0f}", flush=True)
        rows.append((num_layers, len(cluster.devices), elapsed))
    if args.write:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        for layers in sorted({r[0] for r in rows}):
            pts = sorted((g, t) for n, g, t in rows if n == layers)
            ax.loglog([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{layers} layers")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("plan time (s)")
        ax.set_title(f"cluster planner, {args.types} GPU types, time limit {args.time_limit:g} s")
        ax.legend()
        out = ROOT / "docs" / "img" / "scale.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(out, dpi=120)
        print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
