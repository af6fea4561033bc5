"""Memory levers run under the emulation: measured peak memory per rank and iteration time against
the predictions, with each lever.

    python bench/levers_runtime.py [--rounds 2] [--steps 8] [--batch 32] [--micro-batches 4] [--precision bf16]

gpt2-tiny is profiled on this CPU (one torch thread) and projected to the GPU types of
examples/clusters/emulate4.yaml (two P100, two T4); one plan of two virtual workers x two stages
(a P100 and a T4 each; 4 processes, gloo, one thread each), 1f1b, Adam in fp32 (or `--precision`), is trained under
``train --emulate`` (reference H100-SXM5-80GB, rule ``profiled``) with each lever: none, selective
and full recomputation on both stages, ZeRO-1, ZeRO-2. Per rank, the measured peak is the rank's
model state (parameters, gradients, optimizer state) plus the most activations it held at once
(runtime/memory.py), against the simulator's peak of the device priced as the run trains (nothing
reserved); the iteration is the median over the steps after the warm-up, against
``predict_emulated`` (overruns: actions this machine computed for longer than their emulated
time). Runs are interleaved (each round runs every lever once); medians over rounds.
Targets: memory within 15 %, time within 10 %.

Writes nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from bench._results import emit  # noqa: E402
from partitioner.cluster import Cluster  # noqa: E402
from partitioner.emulation import emulation_for, predict_emulated  # noqa: E402
from partitioner.models import build_model  # noqa: E402
from partitioner.plan import Plan, Stage, VirtualWorker  # noqa: E402
from partitioner.pricing import CostOptions  # noqa: E402
from partitioner.profile import Profile  # noqa: E402
from partitioner.profiler import profile_model  # noqa: E402
from partitioner.projection.roofline import project_profile  # noqa: E402
from partitioner.simulate import simulate_plan  # noqa: E402
from runtime.launch import TrainConfig, train_local  # noqa: E402

CLUSTER = ROOT / "examples" / "clusters" / "emulate4.yaml"
REFERENCE = "H100-SXM5-80GB"
MODEL = "gpt2-tiny"
# lever -> (each stage's recompute mode, ZeRO stage)
LEVERS = {"none": ("none", 0), "selective": ("selective", 0), "full": ("full", 0), "zero-1": ("none", 1),
          "zero-2": ("none", 2)}


def lever_plan(lever: str, batch: int, micro_batches: int, precision: str = "fp32") -> Plan:
    """Two virtual workers (n0:0 P100 + n0:2 T4, n0:1 P100 + n0:3 T4) of two stages each, priced
    in ``precision``."""
    mode, zero = LEVERS[lever]
    workers = tuple(VirtualWorker((Stage((0, 2), f"n0:{w}", recompute=mode), Stage((2, 4), f"n0:{w + 2}",
                                                                                    recompute=mode)))
                    for w in range(2))
    return Plan(MODEL, workers, "1f1b", batch, micro_batches, pricing=CostOptions(zero=zero, precision=precision))


def measured_profile(batch: int, gpu_types: list[str], precision: str = "fp32") -> Profile:
    """gpt2-tiny at micro-batch ``batch`` profiled on this CPU (one thread; its layers cast to the
    half type under ``precision`` bf16/fp16, as ``partitioner profile --dtype`` does), with its
    shape in ``meta.config`` as ``partitioner profile`` records it (selective recomputation is
    priced from it), projected to ``gpu_types``."""
    zoo = build_model(MODEL, batch)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    measured = profile_model(zoo.layers, zoo.sample_input(), "cpu", model_name=MODEL, threads=1,
                             meta={"config": dict(zoo.config)}, dtype=dtype)
    return project_profile(measured, list(dict.fromkeys(gpu_types)), source="cpu")


def predicted(plan: Plan, profile: Profile, cluster: Cluster) -> tuple[float, dict[str, float]]:
    """(iteration s of the emulated run, peak bytes per device with nothing reserved)."""
    assert plan.pricing is not None
    options = replace(plan.pricing, reserved_bytes=0.0)
    it = predict_emulated(plan, profile, cluster, reference=REFERENCE, options=options).iteration_s
    return it, dict(simulate_plan(plan, profile, cluster, options).peak_memory_bytes)


def run(plan: Plan, profile: Profile, cluster: Cluster, args: argparse.Namespace
        ) -> tuple[float, dict[str, float], int, int]:
    """One emulated run: (median iteration s, measured peak bytes per device, actions that ran
    past their emulated time, stretched actions)."""
    emulation = emulation_for(plan, profile, cluster, reference=REFERENCE)
    m = train_local(plan, TrainConfig(MODEL, steps=args.steps, warmup=args.warmup, threads=1, optimizer="adam",
                                      data="synthetic", progress=False, emulation=emulation),
                    start_method="fork")
    peaks = {r["device"]: r["model_state_bytes"] + r["activation_peak_bytes"] for r in m["ranks"]}
    emulated = m["emulated"]["ranks"]
    return (float(m["measured_iteration_s"]), peaks, sum(r["overruns"] for r in emulated),
            sum(r["actions"] for r in emulated))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32, help="micro-batch size")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--levers", default=",".join(LEVERS), help="comma-separated, of " + ", ".join(LEVERS))
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                    help="the plans' precision (the profile measured in it)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0, load_before = time.monotonic(), os.getloadavg()[0]
    cluster = Cluster.load(CLUSTER)
    profile = measured_profile(args.batch, [*cluster.gpu_types, REFERENCE], args.precision)
    levers = [x for x in args.levers.split(",") if x]
    plans = {x: lever_plan(x, args.batch, args.micro_batches, args.precision) for x in levers}
    want = {x: predicted(p, profile, cluster) for x, p in plans.items()}
    got: dict[str, list[tuple[float, dict[str, float], int, int]]] = {x: [] for x in levers}
    for rnd in range(args.rounds):
        for x, p in plans.items():
            got[x].append(run(p, profile, cluster, args))
            it, _, over, total = got[x][-1]
            print(f"round {rnd} {x:9s} measured {it * 1e3:8.2f} ms  predicted {want[x][0] * 1e3:8.2f} ms  "
                  f"overruns {over}/{total}", flush=True)
    rows, lines = [], [
        f"Machine: {machine_line()}. {MODEL}, micro-batch {args.batch}, {args.micro_batches} micro-batches, 1f1b, "
        f"Adam {args.precision}; 2 virtual workers x 2 stages on {CLUSTER.name} (2 P100 + 2 T4) emulated on this CPU, reference "
        f"{REFERENCE}, rule profiled; 4 processes, gloo, one torch thread each; {args.steps} steps, median of the "
        f"last {args.steps - args.warmup}; {args.rounds} interleaved rounds, medians over rounds. 1-minute load "
        f"average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}. Wall time {time.monotonic() - t0:.0f} s.",
        "",
        "| lever | device | measured peak MiB | predicted MiB | measured/predicted - 1 | measured ms | predicted ms "
        "| measured/predicted - 1 | overruns |",
        "|---|---|---|---|---|---|---|---|---|"]
    for x in levers:
        it = statistics.median(r[0] for r in got[x])
        t_err = it / want[x][0] - 1
        overruns = f"{sum(r[2] for r in got[x])}/{sum(r[3] for r in got[x])}"
        for k, device in enumerate(sorted(want[x][1])):
            mem = statistics.median(r[1][device] for r in got[x])
            pred = want[x][1][device]
            m_err = mem / pred - 1
            rows.append({"lever": x, "device": device, "measured_bytes": mem, "predicted_bytes": pred,
                         "memory_error": m_err, "measured_ms": it * 1e3, "predicted_ms": want[x][0] * 1e3,
                         "time_error": t_err})
            time_cols = (f"{it * 1e3:.1f} | {want[x][0] * 1e3:.1f} | {t_err * 100:+.1f}% | {overruns}" if k == 0
                         else " | | | ")
            lines.append(f"| {x} | {device} | {mem / 2**20:.2f} | {pred / 2**20:.2f} | {m_err * 100:+.1f}% | {time_cols} |")
    print("\n".join(lines))
    worst_m = max(abs(r["memory_error"]) for r in rows)
    worst_t = max(abs(r["time_error"]) for r in rows)
    print(f"worst memory error {worst_m * 100:.1f}% (target 15%), worst time error {worst_t * 100:.1f}% (target 10%)")
    emit(rows, seeds={"weights_and_data": 0})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
