"""Runtime fidelity: the simulator's predicted iteration time against the runtime's measured one.

The model is profiled on this machine's CPU with ``partitioner.profiler`` (one torch thread, as
each training process uses), the cluster is one node of 'cpu' devices
(examples/clusters/cpu4.yaml), and every plan is simulated with ``simulate_plan`` and then
trained with ``runtime.launch.train_local`` (one process per device, gloo, one thread each).
Stage cuts balance the profiled compute (exhaustive over cut points).

    python bench/runtime_fidelity.py [--model vgg19-tiny] [--batch 32] [--steps 10] [--rounds 3]
                                     [--out bench/results/runtime_fidelity.md]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._machine import machine_line
from partitioner._io import atomic_write_text
from partitioner.cluster import Cluster
from partitioner.cost import CostModel
from partitioner.models import build_model
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import Profile
from partitioner.profiler import profile_model
from partitioner.simulate import simulate_plan
from runtime.launch import TrainConfig, train_local

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "cpu4.yaml"

# (label, schedule, stages per virtual worker, virtual workers, micro-batches[, staleness])
CASES = [
    ("1 stage", "1f1b", 1, 1, 4),
    ("2 stages 1f1b", "1f1b", 2, 1, 4),
    ("2 stages gpipe", "gpipe", 2, 1, 4),
    ("2 stages 1f1b m=8", "1f1b", 2, 1, 8),
    ("3 stages 1f1b", "1f1b", 3, 1, 6),
    ("2 workers x 1 stage", "1f1b", 1, 2, 4),
    ("2 workers x 2 stages", "1f1b", 2, 2, 4),
    ("2 workers x 1 stage wsp D=1", "wsp", 1, 2, 4),
    ("1 worker x 2 stages wsp D=0", "wsp", 2, 1, 4),
]


def balanced_cuts(cost: CostModel, stages: int) -> list[int]:
    n = cost.num_layers
    best: tuple[float, list[int]] | None = None
    for inner in itertools.combinations(range(1, n), stages - 1):
        cuts = [0, *inner, n]
        worst = max(cost.compute_s("cpu", a, b) for a, b in itertools.pairwise(cuts))
        if best is None or worst < best[0]:
            best = (worst, cuts)
    assert best is not None
    return best[1]


def make_plan(model: str, batch: int, cost: CostModel, schedule: str, stages: int, workers: int, m: int) -> Plan:
    cuts = balanced_cuts(cost, stages)
    vws = []
    for w in range(workers):
        vws.append(VirtualWorker(tuple(Stage((a, b), f"n0:{w * stages + k}", "cpu")
                                       for k, (a, b) in enumerate(itertools.pairwise(cuts)))))
    return Plan(model, tuple(vws), schedule=schedule, micro_batch_size=batch, micro_batches=m,
                staleness=1 if schedule == "wsp" and workers > 1 else 0)


def keep_freed_memory() -> bool:
    """Tell glibc to keep freed memory instead of returning large blocks to the system (as the
    profiler bench does with MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_): otherwise every new
    large tensor pays fresh page faults, more so in a pipeline stage than in the profiler's
    re-runs of one layer. Forked training processes inherit the setting."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return False
    libc = ctypes.CDLL(name)
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, 32 * 2**20)) and bool(libc.mallopt(m_trim_threshold, 2**32 - 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vgg19-tiny")
    ap.add_argument("--batch", type=int, default=32, help="micro-batch size")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="repeat profile + runs (default 3)")
    ap.add_argument("--profile", help="reuse this profile instead of measuring one")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "runtime_fidelity.md"))
    ap.add_argument("--pin", action="store_true", help="pin training process r to core r (mod cores)")
    ap.add_argument("--no-mallopt", action="store_true", help="leave glibc's malloc thresholds alone")
    args = ap.parse_args(argv)
    kept = False if args.no_mallopt else keep_freed_memory()

    torch.set_num_threads(1)
    cluster = Cluster.load(CLUSTER)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load_before = os.getloadavg()[0]
    results: dict[str, list[tuple[float, float, float]]] = {c[0]: [] for c in CASES}
    # the gradient all-reduce between virtual workers, per step: (predicted, measured) seconds
    allreduce: dict[str, list[tuple[float, float]]] = {c[0]: [] for c in CASES}
    for rnd in range(args.rounds):
        # a fresh profile each round: the shared cores make any one measurement drift
        if args.profile:
            profile = Profile.load(args.profile)
        else:
            zoo = build_model(args.model, args.batch)
            profile = profile_model(zoo.layers, zoo.sample_input(), "cpu", model_name=args.model, threads=1)
        cost = CostModel(profile, cluster)
        for label, schedule, stages, workers, m in CASES:
            plan = make_plan(args.model, args.batch, cost, schedule, stages, workers, m)
            predicted = simulate_plan(plan, profile, cluster).iteration_s
            metrics = train_local(plan, TrainConfig(args.model, steps=args.steps, warmup=args.warmup, threads=1,
                                                          pin_cpu=args.pin, data="synthetic"),
                                  start_method="fork")
            measured = metrics["measured_iteration_s"]
            # per rank: measured F+B seconds per step against the profile's sum for its layers
            comp = []
            for r in metrics["ranks"]:
                (a, b), = r["layers"]
                comp.append(r["seconds_per_step"]["compute"] / (m * cost.compute_s("cpu", a, b)) - 1.0)
            results[label].append((predicted, measured, max(comp, key=abs)))
            groups = cost.sync_groups(plan)
            if groups:  # the slowest rank's all-reduces: predicted by the cost model, measured around gloo's calls
                pred_ar = max(sum(cost.sync_s(g) for g in groups if d in g.devices) for d in plan.devices)
                meas_ar = max(r["seconds_per_step"].get("allreduce", 0.0) for r in metrics["ranks"])
                allreduce[label].append((pred_ar, meas_ar))
                print(f"        all-reduce per step: predicted {pred_ar * 1e3:.3f} ms, measured {meas_ar * 1e3:.3f} ms "
                      f"(gloo, waiting for the other holders included)", flush=True)
            print(f"round {rnd} {label:24s} predicted {predicted * 1e3:8.2f} ms  measured "
                  f"{measured * 1e3:8.2f} ms  ({(measured / predicted - 1) * 100:+.1f}%)  F+B vs profile "
                  f"{' '.join(f'{c * 100:+.0f}%' for c in comp)}", flush=True)
    rows = []
    for label, _, stages, workers, m in CASES:
        runs = results[label]
        errs = sorted(meas / pred - 1.0 for pred, meas, _ in runs)
        procs = stages * workers
        rows.append((label, procs, m, statistics.median(p for p, _, _ in runs),
                     statistics.median(x for _, x, _ in runs), statistics.median(errs), errs[0], errs[-1],
                     statistics.median(c for _, _, c in runs),
                     "more processes than cores" if procs > (cores or 1) else ""))
    lines = [
        f"# Runtime fidelity: {args.model}, micro-batch {args.batch}, CPU (torch {torch.__version__})",
        "",
        f"Machine: {machine_line()}; {cores} cores available to this process. One torch thread per "
        f"process; gloo over loopback; {args.steps} steps, median of the last {args.steps - args.warmup}; "
        f"{args.rounds} rounds (each: profile, then every plan), medians over rounds. "
        f"1-minute load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} (the cores are "
        f"shared with other work, which is invisible to this process).",
        f"glibc keeps freed memory (mallopt, see keep_freed_memory): {kept}. Process r pinned to core "
        f"r mod {cores}: {args.pin}.",
        "Predicted: `simulate_plan` with the profile measured on this CPU (one thread) and "
        "examples/clusters/cpu4.yaml.",
        "",
        "| plan | processes | micro-batches | predicted ms | measured ms | measured/predicted - 1 "
        "| range over rounds | F+B time vs profile (worst rank) | all-reduce per step, predicted / measured ms "
        "| note |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, procs, m, pred, meas, err, lo, hi, comp_err, note in rows:
        ar = allreduce[label]
        ar_cell = (f"{statistics.median(p for p, _ in ar) * 1e3:.3f} / {statistics.median(x for _, x in ar) * 1e3:.3f}"
                   if ar else "-")
        lines.append(f"| {label} | {procs} | {m} | {pred * 1e3:.2f} | {meas * 1e3:.2f} | {err * 100:+.1f}% "
                     f"| {lo * 100:+.1f}% .. {hi * 100:+.1f}% | {comp_err * 100:+.1f}% | {ar_cell} | {note} |")
    atomic_write_text(args.out, "\n".join(lines) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
