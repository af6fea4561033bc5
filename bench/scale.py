"""How the cluster planner's cost grows: layers x GPUs x GPU types -> solve time, gap, peak memory.

    python bench/scale.py [--sizes 150x64,150x256,1000x1024] [--types 6] [--time-limit 10] [--repeat 1]
                          [--heap] [--write]

Clusters are nodes of 8 GPUs, one GPU type per node, the types in turn (``--types`` of
TITAN-V, TITAN-RTX, RTX-2060, Quadro-P4000, V100-SXM2-16GB, RTX-3090); the model is a random
chain (layer times 0.5-1.5x a mean, speeds per type fixed). ``llm`` is :func:`llm_instance`: 1,024
GPUs of six types and 1,000 layers with transformer-like memory and outputs. Each row is one run of
``plan_cluster(..., "auto", "opt", micro_batches=8, time_limit_s=...)``: wall time (the median of
``--repeat`` solves, after one warm-up solve of a small instance so that no row pays the first
import of SciPy's solvers), status, the certified gap (against the fleet bound,
:func:`solvers.cluster.bounds.fleet.fleet_bound`), the gap against the old perfect-speed-up bound
(``throughput_upper_bound``) and what the bound is made of (K at the bound, the bound as a share
of perfect speed-up), and the process's peak RSS. ``--heap`` adds the peak Python heap of one more
solve traced by tracemalloc (tracing slows Python down, so it is never timed). ``--write`` also
draws a log-log plot of time against GPUs to ``docs/img/scale.png`` (otherwise nothing is written).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from partitioner.cluster import Cluster, Node  # noqa: E402
from partitioner.cost import CostModel  # noqa: E402
from partitioner.profile import LayerProfile, LayerTime, Profile  # noqa: E402
from solvers.cluster.planner import plan_cluster, throughput_upper_bound  # noqa: E402

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


def llm_instance(seed: int = 0) -> tuple[Profile, Cluster]:
    """A large mixed cluster with a transformer-like profile, seeded: 1,024 GPUs as 128 nodes of 8
    (six types in turn, each type's speed factor drawn in [0.55, 2.6]), 1,000 layers of 1-3 ms
    (times the type's factor; a third forward, two thirds backward), 2.4-13.6 MB of parameters,
    1.2-6.8 MB saved and 1-50 MB of output per layer; 25 GB/s inside a node, 12.5 between."""
    rng = np.random.default_rng(seed)
    factors = rng.uniform(0.55, 2.6, len(TYPES))
    work = rng.uniform(1e-3, 3e-3, 1000)
    layers = tuple(
        LayerProfile(f"l{i}", 0.0, float(rng.uniform(2.4e6, 13.6e6)), float(rng.uniform(1.2e6, 6.8e6)),
                     float(rng.uniform(1e6, 50e6)),
                     {t: LayerTime(work[i] * f / 3, 2 * work[i] * f / 3) for (t, _), f in zip(TYPES, factors)})
        for i in range(1000))
    nodes = tuple(Node(f"n{i}", (TYPES[i % len(TYPES)][0],) * 8, 25.0) for i in range(128))
    return Profile("llm-like", 8, layers), Cluster("1024gpu-llm-like", nodes, 12.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="150x64,150x256,1000x1024,llm",
                    help="LAYERSxGPUS, comma-separated; 'llm' is llm_instance (1,000 layers, 1,024 GPUs)")
    ap.add_argument("--types", type=int, default=6, help="GPU types, 1-6 (default 6)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="time_limit_s of each solve (default 10)")
    ap.add_argument("--repeat", type=int, default=1, help="solves per row; the median time is shown (default 1)")
    ap.add_argument("--heap", action="store_true", help="also trace one solve per row for its peak Python heap")
    ap.add_argument("--write", action="store_true", help="write docs/img/scale.png")
    args = ap.parse_args()
    if not 1 <= args.types <= len(TYPES):
        ap.error(f"--types {args.types}: must be 1..{len(TYPES)}")
    if args.repeat < 1:
        ap.error(f"--repeat {args.repeat}: must be >= 1")
    try:
        sizes = [(0, 0) if s == "llm" else tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes {args.sizes}: write LAYERSxGPUS[,LAYERSxGPUS...], e.g. 150x256")
    print(f"machine: {machine_line()}")
    print(f"plan_cluster(auto, opt, 1f1b, 8 micro-batches, time_limit_s={args.time_limit:g}), {args.types} GPU types, "
          f"nodes of 8, one type per node; median of {args.repeat} solve(s)\n")
    warm_profile, warm_cluster = instance(20, 16, args.types)
    plan_cluster(warm_profile, warm_cluster, "auto", "opt", micro_batches=8, time_limit_s=args.time_limit)
    header = (f"{'layers':>7} {'gpus':>6} {'time_s':>8}  {'status':<10} {'gap':>7} {'old_gap':>8} {'K':>5} "
              f"{'K_bound':>8} {'bound/perfect':>14} {'rss_MiB':>8}" + (f" {'heap_MiB':>9}" if args.heap else ""))
    print(header)
    print("-" * len(header))
    rows = []
    for num_layers, num_gpus in sizes:
        profile, cluster = llm_instance() if num_layers == 0 else instance(num_layers, num_gpus, args.types)
        num_layers = profile.num_layers
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            res = plan_cluster(profile, cluster, "auto", "opt", micro_batches=8, time_limit_s=args.time_limit)
            times.append(time.perf_counter() - t0)
        elapsed = statistics.median(times)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        heap = ""
        if args.heap:
            tracemalloc.start()
            plan_cluster(profile, cluster, "auto", "opt", micro_batches=8, time_limit_s=args.time_limit)
            heap = f" {tracemalloc.get_traced_memory()[1] / 2**20:>9.0f}"
            tracemalloc.stop()
        k = res.details.get("virtual_workers", "-")
        bound = res.details.get("bound", {})
        perfect = throughput_upper_bound(CostModel(profile, cluster), cluster.devices)
        old_gap = 1 - (1 / res.objective) / perfect if res.objective else float("nan")
        share = bound.get("samples_per_s", float("nan")) / perfect
        k_bound = f"{bound['workers']:.0f}" if "workers" in bound else "-"
        print(f"{num_layers:>7} {len(cluster.devices):>6} {elapsed:>8.1f}  {res.status!s:<10} {res.gap:>7.1%} "
              f"{old_gap:>8.1%} {k!s:>5} {k_bound!s:>8} {share:>14.1%} {rss:>8.0f}{heap}", flush=True)
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
