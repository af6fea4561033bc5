"""Memory levers on memory-mixed clusters: the best plan without levers, with every stage fully
recomputed, and with per-stage levers (each stage's recompute mode chosen with the split; then
ZeRO-1 over the same number of virtual workers).

    python bench/memory_levers.py [--sailor DIR] [--gpt2-medium FILE] [--time-limit S]

OPT-350M from Sailor's measured profiles (fp16 mixed precision, Adam, 8 micro-batches per
virtual worker, the cluster planner choosing the workers, their mapping and split). Clusters of
the GPU types Sailor measured: an 80 GB A100 node, a node of 16 GB V100s and one of 11 GB RTX
2080 Ti. Micro-batches of 4 sequences are priced from Sailor's size-1 profile scaled linearly
(``Profile.at_size``). Samples/s are the simulator's (``plan.predicted``). The claim checked:
per-stage levers reach at least 1.2x uniform full recomputation where memory binds, and are
never below no levers where it does not.

GPT-2 medium as well: this profiler's fp16 profile of it at 2,048 positions with OPT's 50,272-word
vocabulary, measured on an H100 (bench/results/h100-2026-11-27/opt350_fp16_b1.json, docs/gpu.md),
its times projected per operator to the clusters' GPU types (``project_with_ops``: times marked
projected, each with its expected error), on the same clusters.

Reads files only; writes nothing.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from bench._results import emit  # noqa: E402
from partitioner.cluster import Cluster, Node  # noqa: E402
from partitioner.importers.sailor import import_sailor  # noqa: E402
from partitioner.pricing import CostOptions  # noqa: E402
from partitioner.profile import Profile  # noqa: E402
from partitioner.projection.operator_model import project_with_ops  # noqa: E402
from solvers.planning import PlanRequest, plan  # noqa: E402
from solvers.result import SolveResult  # noqa: E402

A100, V100, RTX = "A100-SXM4-80GB", "V100-SXM2-16GB", "RTX-2080-Ti"


def clusters() -> dict[str, Cluster]:
    return {
        "2 A100-80 + 4 V100-16 + 2 2080Ti-11": Cluster("mixed", (Node("a", (A100,) * 2, 300.0),
                                                                 Node("b", (V100,) * 4, 150.0),
                                                                 Node("c", (RTX,) * 2, 16.0)), 12.5),
        "4 V100-16 + 4 2080Ti-11": Cluster("small", (Node("b", (V100,) * 4, 150.0), Node("c", (RTX,) * 4, 16.0)), 12.5),
    }


def solve(profile: Profile, cluster: Cluster, recompute: str, zero: int, workers: int | str,
          limit_s: float) -> SolveResult:
    opts = CostOptions(precision="fp16", recompute=recompute, zero=zero)
    return plan(profile, cluster, PlanRequest(virtual_workers=workers, micro_batches=8, options=opts,
                                              time_limit_s=limit_s))


def rate(res: SolveResult) -> float:
    return float(res.plan.predicted["samples_per_s"]) if res.ok and res.plan is not None else math.nan


def modes(res: SolveResult) -> str:
    if res.plan is None:
        return "-"
    counts: dict[str, int] = {}
    for vw in res.plan.virtual_workers:
        for st in vw.stages:
            counts[st.recompute] = counts.get(st.recompute, 0) + 1
    return ", ".join(f"{n} {m}" for m, n in sorted(counts.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sailor", default=str(ROOT.parent / "shared" / "data" / "sailor_opt350"))
    ap.add_argument("--gpt2-medium", default=str(ROOT / "bench" / "results" / "h100-2026-11-27" / "opt350_fp16_b1.json"),
                    help="a measured fp16 profile of GPT-2 medium (empty: leave it out)")
    ap.add_argument("--time-limit", type=float, default=20.0, help="seconds per cluster-planner run")
    args = ap.parse_args()
    print(f"machine: {machine_line()}")
    models = {"OPT-350M (Sailor)": import_sailor(args.sailor)}
    if args.gpt2_medium:
        measured = Profile.load(args.gpt2_medium)
        models["GPT-2 medium (H100, projected)"] = project_with_ops(measured, [A100, V100, RTX])
    rows, ok = [], True
    print(f"{'model':31s} {'cluster':36s} {'b':>2s} {'no levers':>10s} {'full':>8s} {'per-stage':>10s} "
          f"{'+ZeRO-1':>8s} {'vs full':>8s} {'vs none':>8s}  per-stage modes")
    for (model, base), size, (name, cl) in ((m, s, c) for m in models.items() for s in (1, 4)
                                            for c in clusters().items()):
        profile = base.at_size(size)
        none = solve(profile, cl, "none", 0, "auto", args.time_limit)
        full = solve(profile, cl, "full", 0, "auto", args.time_limit)
        auto = solve(profile, cl, "auto", 0, "auto", args.time_limit)
        k = len(auto.plan.virtual_workers) if auto.plan is not None else "auto"
        zero = solve(profile, cl, "auto", 1, k, args.time_limit)
        r = {"model": model, "cluster": name, "micro_batch_size": size, "none": rate(none), "full": rate(full),
             "per_stage": rate(auto), "per_stage_zero1": rate(zero), "modes": modes(auto),
             "memory_binds": not none.ok or modes(auto) != modes(none)}
        r["vs_full"] = r["per_stage"] / r["full"]
        r["vs_none"] = r["per_stage"] / r["none"]
        rows.append(r)
        claim = (r["vs_full"] >= 1.2 if r["memory_binds"] else True) and not r["vs_none"] < 1 - 1e-9
        ok &= claim

        def cell(x: float) -> str:
            return "infeasible" if math.isnan(x) else f"{x:.2f}"

        print(f"{model:31s} {name:36s} {size:2d} {cell(r['none']):>10s} {cell(r['full']):>8s} {cell(r['per_stage']):>10s} "
              f"{cell(r['per_stage_zero1']):>8s} {cell(r['vs_full']):>8s} {cell(r['vs_none']):>8s}  "
              f"{r['modes']}{'' if claim else '  (claim not met)'}")
    print("samples/s simulated; vs full / vs none: per-stage levers over uniform full recomputation / no levers")
    print(f"claim (>= 1.2x full where memory binds, never below no levers): {'met' if ok else 'NOT met'}")
    emit([{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
