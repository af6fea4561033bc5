"""DP, CP-SAT and MILP (CBC) on the same chain problems: objectives, bounds, gaps, times.

    python bench/solver_agreement.py [--time-limit 10] [--hint] [--quick]

Instances: every PipeDream profile (tests/data/pipedream) on two heterogeneous clusters,
and seeded random chains. CP-SAT and MILP run without the DP's hint unless ``--hint`` is
given, so their answers are independent checks of the DP. Prints the table and writes it
into docs/solvers.md between the markers of its mode (with or without hints).

PipeDream profiles are timed on one V100 at micro-batch 128 or 256. To plan them on other
GPU types, times are projected by the ratio of peak FP32 FLOP/s from the catalog (marked
projected), and times and activation sizes are scaled linearly to micro-batch 32 so that
1F1B fits in memory. Both are approximations of the inputs, applied equally to all solvers.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from bench._page import write_between  # noqa: E402
from partitioner.cluster import GIB, Cluster, DeviceType, Node, resolve_gpu_type  # noqa: E402
from partitioner.errors import PartitionerError  # noqa: E402
from partitioner.importers.pipedream import import_pipedream  # noqa: E402
from partitioner.profile import LayerProfile, LayerTime, Profile  # noqa: E402
from solvers import SolveResult, solve  # noqa: E402

__all__ = ["main"]

PROFILES = ROOT / "tests" / "data" / "pipedream"
DOC = ROOT / "docs" / "solvers.md"
MARKERS = {False: ("<!-- agreement-table:start -->", "<!-- agreement-table:end -->"),
           True: ("<!-- agreement-table-hint:start -->", "<!-- agreement-table-hint:end -->")}
MICRO_BATCH = 32

CLUSTERS = {
    "2xA100+2xT4": Cluster("a100-t4", (Node("a0", ("A100-SXM4-40GB",) * 2, 150.0),
                                       Node("t0", ("T4",) * 2, 16.0)), 3.125),
    "hetpipe-2x4": Cluster("hetpipe-2x4", tuple(
        Node(f"n{i}", ("TITAN-V", "TITAN-RTX", "RTX-2060", "Quadro-P4000"), 16.0) for i in range(2)), 7.0),
}


def pipedream_profile(path: Path, gpu_types: tuple[str, ...]) -> Profile:
    """A PipeDream profile at micro-batch 32 with FLOP/s-projected times for ``gpu_types``."""
    prof = import_pipedream(path, gpu_type="V100", micro_batch_size=64 if path.stem == "gnmt" else None)
    shrink = MICRO_BATCH / prof.micro_batch_size
    v100 = resolve_gpu_type("V100-SXM2-16GB").peak_flops
    layers = []
    for layer in prof.layers:
        t = layer.times["V100"]
        times = {g: LayerTime(t.fwd_s * shrink * v100 / resolve_gpu_type(g).peak_flops,
                              t.bwd_s * shrink * v100 / resolve_gpu_type(g).peak_flops, projected=True)
                 for g in gpu_types}
        layers.append(dataclasses.replace(layer, saved_bytes=layer.saved_bytes * shrink,
                                          output_bytes=layer.output_bytes * shrink, times=times))
    return dataclasses.replace(prof, micro_batch_size=MICRO_BATCH, layers=tuple(layers))


def random_instance(seed: int, n_layers: int, n_dev: int) -> tuple[Profile, Cluster]:
    rng = random.Random(seed)
    types = {f"r{c}": DeviceType(f"r{c}", rng.uniform(4, 16) * GIB, 1e13, 1e11) for c in "ABC"}
    speed = {t: rng.uniform(0.5, 2.0) for t in types}
    layers = []
    for i in range(n_layers):
        f, b = rng.uniform(1e-3, 1e-2), rng.uniform(1e-3, 2e-2)
        layers.append(LayerProfile(f"l{i}", 0.0, rng.uniform(0, 2e8), rng.uniform(0, 2e8), rng.uniform(0, 1e8),
                                   {t: LayerTime(f * s, b * s) for t, s in speed.items()}))
    gpus = [rng.choice(list(types)) for _ in range(n_dev)]
    half = n_dev // 2
    nodes = (Node("n0", tuple(gpus[:half]), 16.0), Node("n1", tuple(gpus[half:]), 16.0))
    return Profile(f"random-{seed}", 1, tuple(layers)), Cluster(f"random-{seed}", nodes, 3.0, types)


def instances(quick: bool) -> list[tuple[str, Profile, Cluster]]:
    out = []
    paths = sorted(PROFILES.glob("*.txt"))
    if quick:
        paths = [p for p in paths if p.stem in ("alexnet", "vgg16")]
    for path in paths:
        for cname, cluster in CLUSTERS.items():
            out.append((f"{path.stem} on {cname}", pipedream_profile(path, cluster.gpu_types), cluster))
    shapes = [(1, 12, 3), (2, 24, 4), (3, 40, 6)] + ([] if quick else [(4, 60, 8)])
    for seed, n_layers, n_dev in shapes:
        profile, cluster = random_instance(seed, n_layers, n_dev)
        out.append((f"random seed {seed}", profile, cluster))
    return out


def _cells(r: SolveResult | None, with_bound: bool) -> list[str]:
    if r is None:
        return ["refused", "", "", ""] if with_bound else ["refused", ""]
    obj = f"{r.objective:.7g}" if r.ok else r.status.value
    cells = [obj]
    if with_bound:
        lb = r.lower_bound
        cells += [f"{lb:.7g}" if not math.isnan(lb) else "nan",
                  f"{r.gap:.1e}" if not math.isnan(r.gap) else "nan"]
    cells.append(f"{r.runtime_s:.2f}")
    return cells


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0, help="per solve, seconds (default 10)")
    ap.add_argument("--hint", action="store_true", help="give CP-SAT and CBC the DP's split")
    ap.add_argument("--quick", action="store_true", help="a few instances only")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/solvers.md alone")
    args = ap.parse_args(argv)

    header = ["instance", "L", "devices", "DP obj s", "DP t s", "CP-SAT obj s", "CP-SAT bound s", "CP-SAT gap",
              "CP-SAT t s", "MILP obj s", "MILP bound s", "MILP gap", "MILP t s", "max rel diff vs DP", "status dp/cp/milp"]
    rows = []
    for name, profile, cluster in instances(args.quick):
        ref = solve(profile, cluster, "dp", dag=False)  # the chain problem, as the models below
        got: dict[str, SolveResult | None] = {}
        for solver in ("cpsat", "milp"):
            try:
                got[solver] = solve(profile, cluster, solver, time_limit_s=args.time_limit, hint=args.hint,
                                    dag=False, fixed_order=True)  # the chain problem the DP solves
            except PartitionerError as err:  # the interval model refuses sizes it cannot hold
                print(f"{name}: {solver}: {err}", file=sys.stderr)
                got[solver] = None
        statuses = "/".join(r.status.value if r else "refused" for r in (ref, got["cpsat"], got["milp"]))
        diffs = [abs(r.objective - ref.objective) / ref.objective
                 for r in got.values() if r is not None and r.ok and ref.ok and ref.objective > 0]
        row = [name, str(profile.num_layers), str(len(cluster.devices)),
               f"{ref.objective:.7g}" if ref.ok else ref.status.value, f"{ref.runtime_s:.3f}",
               *_cells(got["cpsat"], True), *_cells(got["milp"], True),
               f"{max(diffs):.1e}" if diffs else "-", statuses]
        rows.append(row)
        print(" | ".join(row), flush=True)

    mode = "with the DP's split as hint / warm start" if args.hint else "without hints (independent of the DP)"
    lines = [f"Machine: {machine_line()}. CP-SAT (OR-Tools) and CBC (PuLP's bundled binary) single-threaded, "
             f"time limit {args.time_limit:g} s per solve, {mode}. Objective: bottleneck stage time per "
             f"micro-batch (s), 1F1B, micro-batches = devices, additive communication.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    table = "\n".join(lines)
    print("\n" + table)
    if args.no_write:
        return
    write_between(DOC, *MARKERS[args.hint], table, "# Solvers\n")
    print(f"\nwrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
