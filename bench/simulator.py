"""Simulator benchmark: closed forms on uniform stages, and the speed of a large simulation.

Run from the repository root: ``python bench/simulator.py [--out bench/results/simulator.md]``.
Prints a table and writes it (atomically) as Markdown.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partitioner._io import atomic_write_text
from partitioner.cluster import Cluster
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.simulate import simulate_plan

FWD, BWD = 1.0, 2.0


def uniform(p: int, v: int = 1, nodes: int = 1) -> tuple[Profile, Cluster]:
    prof = Profile("uniform", 1, tuple(LayerProfile(f"l{i}", param_bytes=1e6, saved_bytes=1e6,
                                                    times={"V100": LayerTime(FWD / v, BWD / v)})
                                       for i in range(p * v)))
    return prof, Cluster.homogeneous("V100-SXM2-16GB", nodes, p // nodes, 16, 7)


def plan(p: int, m: int, schedule: str, v: int = 1, nodes: int = 1) -> Plan:
    per = p // nodes
    stages = tuple(Stage((s, s + 1), f"n{(s % p) // per}:{(s % p) % per}") for s in range(p * v))
    return Plan("uniform", (VirtualWorker(stages),), schedule, 1, m, chunks=v)


def closed_form_rows() -> list[tuple[str, str, str, str, str]]:
    rows = []
    for sched in ("gpipe", "1f1b"):
        for p, m in ((4, 8), (8, 32), (16, 16)):
            prof, cl = uniform(p)
            tl = simulate_plan(plan(p, m, sched), prof, cl)
            got = max(tl.bubble_fraction.values())
            rows.append((sched, f"p={p} m={m}", "bubble (p-1)/(m+p-1)", f"{(p - 1) / (m + p - 1):.6f}", f"{got:.6f}"))
    for p, m in ((4, 8), (8, 5)):
        prof, cl = uniform(p)
        tl = simulate_plan(plan(p, m, "1f1b"), prof, cl)
        want = [min(p - k, m) for k in range(p)]
        got_l = [tl.peak_activations[d] for d in tl.devices]
        rows.append(("1f1b", f"p={p} m={m}", "in flight on stage k: min(p-k, m)", str(want), str(got_l)))
    for sched in ("interleaved", "bfs"):
        for p, m, v in ((4, 8, 2), (4, 16, 4), (8, 16, 2)):
            prof, cl = uniform(p, v)
            tl = simulate_plan(plan(p, m, sched, v), prof, cl)
            compute = m * (FWD + BWD)
            rows.append((sched, f"p={p} m={m} v={v}", "idle / compute (p-1)/(v m)",
                         f"{(p - 1) / (v * m):.6f}", f"{(tl.iteration_s - compute) / compute:.6f}"))
    for p, m, v in ((4, 8, 2), (4, 6, 3)):
        prof, cl = uniform(p, v)
        tl = simulate_plan(plan(p, m, "bfs", v), prof, cl)
        rows.append(("bfs", f"p={p} m={m} v={v}", "chunks held: v m", str(v * m), str(max(tl.peak_activations.values()))))
    for p, m in ((4, 8), (8, 8)):
        prof, cl = uniform(p)
        tl = simulate_plan(plan(p, m, "2bw"), prof, cl)
        rows.append(("2bw", f"p={p} m={m}", "steady iteration m (f+b); versions <= 2",
                     f"{m * (FWD + BWD):g}; 2", f"{tl.iteration_s:g}; {max(tl.weight_versions.values())}"))
    return rows


def timing(p: int = 64, m: int = 1024, runs: int = 5) -> tuple[float, list[float], int]:
    prof, cl = uniform(p, nodes=8)
    pl = plan(p, m, "1f1b", nodes=8)
    times, n = [], 0
    for _ in range(runs):
        t0 = time.perf_counter()
        tl = simulate_plan(pl, prof, cl)
        times.append(time.perf_counter() - t0)
        n = tl.num_events
    return statistics.median(times), times, n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/simulator.md")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    rows = closed_form_rows()
    lines = ["| schedule | case | closed form | expected | simulated |", "|---|---|---|---|---|"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    med, all_t, n = timing(runs=args.runs)
    lines += ["", f"64 stages x 1,024 micro-batches, 1f1b, 8 nodes (build + simulate + summarise): "
                  f"{n:,} actions, median {med:.3f} s over {len(all_t)} runs "
                  f"({', '.join(f'{t:.3f}' for t in all_t)})"]
    text = "\n".join(lines)
    print(text)
    atomic_write_text(args.out, "# Simulator benchmark\n\n" + text + "\n")
    mismatches = [r for r in rows if r[3] != r[4]]
    return 1 if mismatches or med >= 2.0 else 0


if __name__ == "__main__":
    sys.exit(main())
