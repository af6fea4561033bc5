"""How fast the exact chain DP is: L layers x D devices of 4 GPU types with memory limits.

    python bench/dp_scaling.py [--repeats 5] [--sizes 100x8,300x16,...]

Prints a table of median solve times (and the spread) over repeated solves of the same
instance, and the median with ``allow_fewer`` (every prefix of the device list a candidate)
against the plain solve. Targets: 1,000 layers x 64 devices under 1 s median; ``allow_fewer``
at most 2x the plain solve.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._machine import machine_line
from bench._results import emit
from partitioner.cluster import Cluster, Node
from partitioner.profile import LayerProfile, LayerTime, Profile
from solvers import solve

TYPES = (("V100-SXM2-16GB", 1.0), ("T4", 2.6), ("A100-SXM4-40GB", 0.55), ("TITAN-RTX", 1.1))


def instance(num_layers: int, num_devices: int, seed: int = 0) -> tuple[Profile, Cluster]:
    """A random transformer-like chain and a cluster of 4 types, 8 GPUs per node.

    Layer sizes are scaled so the whole model needs about half the cluster's memory:
    the memory limits bind for some splits without making the problem infeasible.
    """
    rng = np.random.default_rng(seed)
    work = rng.uniform(0.5, 1.5, num_layers) * 2e-3
    gpus_per_node = 8
    nodes = []
    for k in range((num_devices + gpus_per_node - 1) // gpus_per_node):
        n = min(gpus_per_node, num_devices - k * gpus_per_node)
        nodes.append(Node(f"n{k}", (TYPES[k % len(TYPES)][0],) * n, 25.0))
    cluster = Cluster(f"{num_devices}gpu", tuple(nodes), 12.5)
    capacity = sum(d.memory_bytes for d in cluster.devices)
    per_layer = 0.5 * capacity / num_layers
    params = rng.uniform(0.3, 1.7, num_layers) * per_layer / 8  # x4 for weights, grads, Adam
    # 1F1B keeps up to p micro-batches on the first stage: size activations for that depth
    saved = rng.uniform(0.3, 1.7, num_layers) * per_layer / (2 * num_devices)
    out = rng.uniform(1e6, 5e7, num_layers)
    layers = tuple(
        LayerProfile(f"layer{i}", 0.0, float(params[i]), float(saved[i]), float(out[i]),
                     {t: LayerTime(work[i] * s / 3, 2 * work[i] * s / 3) for t, s in TYPES})
        for i in range(num_layers))
    return Profile("synthetic", 8, layers), cluster


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", default=",".join(f"{n}x{d}" for n in (100, 300, 1000) for d in (8, 16, 64)),
                    help="LAYERSxDEVICES, comma-separated (default: 100, 300, 1000 layers x 8, 16, 64 devices)")
    args = ap.parse_args()
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    print(f"machine: {machine_line()}")
    print(f"median of {args.repeats} solves; schedule 1f1b, micro-batches = devices, 4 GPU types, memory limits\n")
    header = (f"{'layers':>7} {'devices':>8} {'median_s':>10} {'min_s':>8} {'max_s':>8}  status     bottleneck_s"
              f" {'fewer_s':>9} {'x plain':>7}  fewer_bottleneck_s")
    print(header)
    print("-" * len(header))
    rows = []
    for num_layers, num_devices in sizes:
        profile, cluster = instance(num_layers, num_devices)
        medians, results = [], []
        for allow_fewer in (False, True):
            times, result = [], None
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                result = solve(profile, cluster, allow_fewer=allow_fewer)
                times.append(time.perf_counter() - t0)
            assert result is not None
            medians.append(statistics.median(times))
            results.append(result)
            if not allow_fewer:
                spread = (min(times), max(times))
        plain, fewer = results
        print(f"{num_layers:>7} {num_devices:>8} {medians[0]:>10.4f} {spread[0]:>8.4f} {spread[1]:>8.4f}  "
              f"{plain.status!s:<10} {plain.objective:.6f}     {medians[1]:>9.4f} {medians[1] / medians[0]:>7.2f}"
              f"  {fewer.objective:.6f}")
        rows.append({"layers": num_layers, "devices": num_devices, "median_s": medians[0], "min_s": spread[0],
                     "max_s": spread[1], "status": str(plain.status), "bottleneck_s": plain.objective,
                     "fewer_median_s": medians[1], "fewer_bottleneck_s": fewer.objective})
    emit(rows, seeds={"instance": 0}, repeats=args.repeats)


if __name__ == "__main__":
    main()
