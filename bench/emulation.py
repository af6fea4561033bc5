"""Emulated heterogeneous cluster: measured iteration of `train --emulate` against the simulator.

On this machine, vgg19-tiny is profiled on the CPU (one torch thread) and projected to the GPU
types of examples/clusters/emulate3.yaml (one A100, two T4, links at this machine's 2 GB/s)
and to the reference type (default H100-SXM5-80GB, faster than both, so every emulated action has slack).
The emulated profile (``partitioner.emulation.emulated_profile``) is what the planner sees:
``partitioner plan`` makes the heterogeneity-aware plan (dp over the cluster, opt), and
``--solver uniform`` and ``--solver pipedream`` the baselines. Each plan is trained with
``train_local`` under the emulation (3 processes, gloo, one thread each) and its median
iteration compared with ``predict_emulated``; runs are interleaved (round r runs every plan and
rule once) and medians over rounds reported, with the ratio between plans measured and predicted.

With ``--wsp``, also WSP against synchronous data parallelism on the emulated cluster: two
virtual workers of one device each (the A100 and a T4), gpt2-tiny on the text task, synchronous
(1f1b, gradient all-reduce) and ``wsp`` with staleness D = 0, 1, 2; loss against time (``--png``).
Communication is this machine's and every run has the same wave count: bench/wsp.py measures WSP
with the cluster's links emulated and runs that end by time.

With ``--zero-bubble``, also ``zb-h1`` against ``1f1b`` on four GPUs (examples/clusters/emulate4.yaml:
two P100 and two T4, several times slower than the H100 reference, so every rank sleeps most of
each action): each schedule planned by ``partitioner plan --schedule`` on the emulated profile (a
4-stage plan), trained under the emulation (4 processes; a split backward's ``I`` and ``W`` each
take their part of the stage's backward as the model splits it, ``EmulatedStage.bwd_weight_share``)
and compared with ``predict_emulated``: whether zb-h1 is measured faster and within 10 % of its
prediction. With ``--overlap`` too, ``zb-h2`` flushed and planned with ``--overlap-iterations``
(its iterations overlap: the runtime runs every step's list as one, without a barrier between
steps; the prediction is the simulator's steady-state period) beside them. ``--no-plans`` skips the opt / uniform /
pipedream comparison.

    python bench/emulation.py [--rounds 3] [--steps 8] [--rules profiled,scaled] [--reference H100-SXM5-80GB]
                              [--no-plans] [--zero-bubble [--overlap] [--zb-micro-batches 4] [--zb-batch 64]]
                              [--wsp [--wsp-steps 30] [--png loss_vs_time.png]]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._machine import machine_line
from bench._results import emit
from partitioner.cluster import Cluster
from partitioner.emulation import emulated_profile, emulation_for, predict_emulated
from partitioner.models import build_model
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import Profile
from partitioner.profiler import profile_model
from partitioner.projection.roofline import project_profile
from runtime.launch import TrainConfig, train_local

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "emulate3.yaml"
PLANS = (("opt (partitioner plan)", ()), ("uniform", ("--solver", "uniform")), ("pipedream", ("--solver", "pipedream")))
# the zero-bubble part: four GPUs, zb-h1 against 1f1b, each planned by `partitioner plan --schedule`
CLUSTER4 = ROOT / "examples" / "clusters" / "emulate4.yaml"
ZB_SCHEDULES = ("1f1b", "zb-h1")
ZB_PLANS = tuple((s, ("--schedule", s)) for s in ZB_SCHEDULES)
# --overlap: zb-h2 flushed and with overlapping iterations (no barrier between steps) beside them
ZB_OVERLAP = (("zb-h2", ("--schedule", "zb-h2")),
              ("zb-h2 overlapped", ("--schedule", "zb-h2", "--overlap-iterations")))


def make_plans(emu_profile: Path, micro_batches: int, tmp: Path, cluster: Path = CLUSTER,
               cases: tuple[tuple[str, tuple[str, ...]], ...] = PLANS) -> dict[str, Plan]:
    """``partitioner plan`` on the emulated profile for each (label, extra options) of ``cases``."""
    plans = {}
    for label, extra in cases:
        out = tmp / f"plan_{len(plans)}.json"
        cmd = [sys.executable, "-m", "partitioner_cli", "plan", str(emu_profile), "--cluster", str(cluster),
               "--micro-batches", str(micro_batches), *extra, "-o", str(out)]
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if res.returncode != 0:
            print(f"{label}: partitioner plan failed: {res.stderr.strip().splitlines()[-1:]}", flush=True)
            continue
        plans[label] = Plan.load(out)
    return plans


def planned(profile: Profile, cluster_path: Path, args: argparse.Namespace, micro_batches: int,
            cases: tuple[tuple[str, tuple[str, ...]], ...]) -> dict[str, Plan]:
    """The plans ``partitioner plan`` makes for the emulated cluster of ``cluster_path``."""
    emu = emulated_profile(profile, Cluster.load(cluster_path), reference=args.reference)
    with tempfile.TemporaryDirectory(prefix="bench-emulation-") as tmp:
        emu_path = Path(tmp) / "emulated.json"
        emu.save(emu_path)
        return make_plans(emu_path, micro_batches, Path(tmp), cluster_path, cases)


def emulated_run(plan: Plan, profile: Profile, cluster: Cluster, args: argparse.Namespace,
                 rule: str = "profiled") -> tuple[float, int, int]:
    """One emulated training run of ``plan``: (median iteration s, overruns, stretched actions)."""
    emulation = emulation_for(plan, profile, cluster, reference=args.reference, rule=rule)
    m = train_local(plan, TrainConfig(args.model, steps=args.steps, warmup=args.warmup, threads=1,
                                      data="synthetic", progress=False, emulation=emulation),
                    start_method="fork")
    ranks = m["emulated"]["ranks"]
    return float(m["measured_iteration_s"]), sum(r["overruns"] for r in ranks), sum(r["actions"] for r in ranks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="vgg19-tiny")
    ap.add_argument("--batch", type=int, default=32, help="micro-batch size")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reference", default="H100-SXM5-80GB", help="the emulation's reference type (default H100-SXM5-80GB)")
    ap.add_argument("--rules", default="profiled,scaled", help="emulation rules to run (comma-separated)")
    ap.add_argument("--no-plans", action="store_true", help="skip the opt / uniform / pipedream comparison")
    ap.add_argument("--zero-bubble", action="store_true", help="also zb-h1 against 1f1b on a 4-stage plan")
    ap.add_argument("--overlap", action="store_true",
                    help="zero-bubble part: also zb-h2, flushed and with overlapping iterations (--overlap-iterations)")
    ap.add_argument("--zb-micro-batches", type=int, default=4, help="zero-bubble part: micro-batches")
    ap.add_argument("--zb-batch", type=int, default=64,
                    help="zero-bubble part: micro-batch size (longer actions than --batch: a wake-up or a message "
                         "costs a smaller share of each)")
    ap.add_argument("--wsp", action="store_true", help="also WSP against synchronous data parallelism")
    ap.add_argument("--wsp-steps", type=int, default=30)
    ap.add_argument("--wsp-rounds", type=int, default=2)
    ap.add_argument("--target-loss", type=float, default=3.5, help="WSP part: time to the first step at or below it")
    ap.add_argument("--png", help="WSP part: write the loss-against-time plot here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cluster = Cluster.load(CLUSTER)
    t_start = time.monotonic()
    load_before = os.getloadavg()[0]
    rows: list[dict[str, object]] = []
    if not args.no_plans:
        profile = measured_profile(args.model, args.batch, [*cluster.gpu_types, args.reference])
        rows += plans_against_each_other(args, profile, cluster, load_before, t_start)
    if args.zero_bubble:
        profile = measured_profile(args.model, args.zb_batch, [*Cluster.load(CLUSTER4).gpu_types, args.reference])
        rows += zero_bubble_against_1f1b(args, profile)
    if args.wsp:
        rows += wsp_against_sync(args, cluster)
    emit(rows, seeds={"weights_and_data": 0})
    return 0


def measured_profile(model: str, batch: int, gpu_types: list[str]) -> Profile:
    """``model`` at micro-batch ``batch`` profiled on this CPU (one thread), projected to ``gpu_types``."""
    zoo = build_model(model, batch)
    measured = profile_model(zoo.layers, zoo.sample_input(), "cpu", model_name=model, threads=1)
    return project_profile(measured, list(dict.fromkeys(gpu_types)), source="cpu")


def _cores() -> int | None:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def plans_against_each_other(args: argparse.Namespace, profile: Profile, cluster: Cluster, load_before: float,
                             t_start: float) -> list[dict[str, object]]:
    """opt, uniform and pipedream plans of the 3-GPU cluster, each rule: measured against predicted."""
    rules = [r for r in args.rules.split(",") if r]
    plans = planned(profile, CLUSTER, args, args.micro_batches, PLANS)
    predicted = {label: predict_emulated(plan, profile, cluster, reference=args.reference).iteration_s
                 for label, plan in plans.items()}
    runs: dict[tuple[str, str], list[tuple[float, int, int]]] = {(p, r): [] for p in plans for r in rules}
    for rnd in range(args.rounds):
        for label, plan in plans.items():
            for rule in rules:
                it, over, total = emulated_run(plan, profile, cluster, args, rule)
                runs[(label, rule)].append((it, over, total))
                print(f"round {rnd} {label:22s} {rule:8s} predicted {predicted[label] * 1e3:8.2f} ms  measured "
                      f"{it * 1e3:8.2f} ms ({(it / predicted[label] - 1) * 100:+.1f}%)"
                      f"  overruns {over}/{total}", flush=True)
    first = next(iter(plans))
    rows = []
    lines = [f"Machine: {machine_line()}; {_cores()} cores available. {args.model}, micro-batch {args.batch}, "
             f"{args.micro_batches} micro-batches, 1f1b; cluster {CLUSTER.name} (A100 + 2 x T4, links 2 GB/s) "
             f"emulated on this CPU, reference {args.reference}; 3 processes, gloo, one torch thread each; "
             f"{args.steps} steps, median of the last {args.steps - args.warmup}; {args.rounds} interleaved rounds, "
             f"medians over rounds. 1-minute load average before / after: {load_before:.2f} / "
             f"{os.getloadavg()[0]:.2f}. Wall time {time.monotonic() - t_start:.0f} s.",
             "",
             "| plan | rule | predicted ms | measured ms | measured/predicted - 1 | range over rounds "
             f"| predicted / {first} | measured / {first} | overruns |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rule in rules:
        base = statistics.median(x for x, _, _ in runs[(first, rule)]) if runs[(first, rule)] else float("nan")
        for label in plans:
            xs = runs[(label, rule)]
            med = statistics.median(x for x, _, _ in xs)
            errs = sorted(x / predicted[label] - 1 for x, _, _ in xs)
            over, total = sum(o for _, o, _ in xs), sum(t for _, _, t in xs)
            pr, mr = predicted[label] / predicted[first], med / base
            rows.append({"plan": label, "rule": rule, "predicted_ms": predicted[label] * 1e3, "measured_ms": med * 1e3,
                         "error": med / predicted[label] - 1, "predicted_ratio": pr, "measured_ratio": mr,
                         "overruns": over, "actions": total})
            lines.append(f"| {label} | {rule} | {predicted[label] * 1e3:.1f} | {med * 1e3:.1f} | "
                         f"{(med / predicted[label] - 1) * 100:+.1f}% | {errs[0] * 100:+.1f}% .. {errs[-1] * 100:+.1f}% "
                         f"| {pr:.3f} | {mr:.3f} | {over}/{total} |")
    print("\n".join(lines))
    return rows


def zero_bubble_against_1f1b(args: argparse.Namespace, profile: Profile) -> list[dict[str, object]]:
    """zb-h1 against 1f1b on the 4-GPU cluster (plans by ``partitioner plan --schedule``), rule
    profiled: measured against predicted, and which is faster."""
    cluster = Cluster.load(CLUSTER4)
    t_start, load_before = time.monotonic(), os.getloadavg()[0]
    plans = planned(profile, CLUSTER4, args, args.zb_micro_batches, ZB_PLANS + (ZB_OVERLAP if args.overlap else ()))
    predicted = {s: predict_emulated(plan, profile, cluster, reference=args.reference).iteration_s
                 for s, plan in plans.items()}
    runs: dict[str, list[tuple[float, int, int]]] = {s: [] for s in plans}
    for rnd in range(args.rounds):
        for s, plan in plans.items():
            it, over, total = emulated_run(plan, profile, cluster, args)
            runs[s].append((it, over, total))
            print(f"zero-bubble round {rnd} {s:6s} predicted {predicted[s] * 1e3:8.2f} ms  measured {it * 1e3:8.2f} ms "
                  f"({(it / predicted[s] - 1) * 100:+.1f}%)  overruns {over}/{total}", flush=True)
    med = {s: statistics.median(x for x, _, _ in xs) for s, xs in runs.items()}
    lines = ["", f"Zero bubble, emulated: {args.model}, micro-batch {args.zb_batch}, {args.zb_micro_batches} micro-batches; "
                 f"cluster {CLUSTER4.name} (2 x P100 + 2 x T4, links 2 GB/s) emulated on this CPU, reference "
                 f"{args.reference}, rule profiled (a split backward's I and W each take their part of the stage's "
                 f"backward as the model splits it); plans by `partitioner plan --schedule` on the emulated profile; "
                 f"4 processes, gloo, one torch thread each; {args.steps} steps, median of the last "
                 f"{args.steps - args.warmup}; {args.rounds} interleaved rounds, medians over rounds. Machine: "
                 f"{machine_line()}; {_cores()} cores available; 1-minute load average before / after: "
                 f"{load_before:.2f} / {os.getloadavg()[0]:.2f}. Wall time {time.monotonic() - t_start:.0f} s.",
             "", "| schedule | stages (layers) | predicted ms | measured ms | measured/predicted - 1 | range over rounds "
                 "| overruns |", "|---|---|---|---|---|---|---|"]
    rows: list[dict[str, object]] = []
    for s, plan in plans.items():
        errs = sorted(x / predicted[s] - 1 for x, _, _ in runs[s])
        over, total = sum(o for _, o, _ in runs[s]), sum(t for _, _, t in runs[s])
        cuts = " ".join(f"[{st.start},{st.stop})" for st in plan.virtual_workers[0].stages)
        rows.append({"plan": s, "rule": "profiled", "predicted_ms": predicted[s] * 1e3, "measured_ms": med[s] * 1e3,
                     "error": med[s] / predicted[s] - 1, "overruns": over, "actions": total})
        lines.append(f"| {s} | {cuts} | {predicted[s] * 1e3:.1f} | {med[s] * 1e3:.1f} | {(med[s] / predicted[s] - 1) * 100:+.1f}% "
                     f"| {errs[0] * 100:+.1f}% .. {errs[-1] * 100:+.1f}% | {over}/{total} |")
    a = ZB_SCHEDULES[0]
    lines.append("")
    for b in plans:
        if b == a or a not in plans:
            continue
        lines.append(f"{b} over {a}: predicted "
                     f"{predicted[a] / predicted[b]:.3f}x faster, measured {med[a] / med[b]:.3f}x; {b} measured faster: "
                     f"{'yes' if med[b] < med[a] else 'NO'}; {b} within 10 % of its prediction: "
                     f"{'yes' if abs(med[b] / predicted[b] - 1) <= 0.10 else 'NO'}")
    print("\n".join(lines))
    return rows


def wsp_against_sync(args: argparse.Namespace, cluster: Cluster) -> list[dict[str, object]]:
    """Two one-device virtual workers (A100, T4), gpt2-tiny on text: sync against wsp D = 0, 1, 2."""
    zoo = build_model("gpt2-tiny", 8)
    measured = profile_model(zoo.layers, zoo.sample_input(), "cpu", model_name="gpt2-tiny", threads=1,
                             meta={"config": zoo.config})
    profile = project_profile(measured, [*cluster.gpu_types, args.reference], source="cpu")
    n = profile.num_layers
    cases = [("sync (1f1b + all-reduce)", "1f1b", 0), ("wsp D=0", "wsp", 0), ("wsp D=1", "wsp", 1), ("wsp D=2", "wsp", 2)]
    runs: dict[str, list[dict[str, object]]] = {c[0]: [] for c in cases}
    predicted = {}
    for rnd in range(args.wsp_rounds):
        for label, schedule, d in cases:
            plan = Plan("gpt2-tiny", (VirtualWorker((Stage((0, n), "n0:0"),)), VirtualWorker((Stage((0, n), "n0:1"),))),
                        schedule=schedule, micro_batch_size=8, micro_batches=2, staleness=d)
            predicted[label] = predict_emulated(plan, profile, cluster, reference=args.reference).iteration_s
            m = train_local(plan, TrainConfig("gpt2-tiny", steps=args.wsp_steps, warmup=2, lr=0.3, threads=1, data="text",
                                              progress=False,
                                              emulation=emulation_for(plan, profile, cluster, reference=args.reference)),
                            start_method="fork")
            runs[label].append(m)
            print(f"wsp round {rnd} {label:26s} predicted {predicted[label] * 1e3:7.1f} ms  measured "
                  f"{m['measured_iteration_s'] * 1e3:7.1f} ms  loss {m['loss'][0]:.3f} -> {m['loss'][-1]:.3f}", flush=True)
    rows: list[dict[str, object]] = []
    lines = ["", f"WSP against synchronous data parallelism: gpt2-tiny (micro-batch 8, 2 micro-batches), text, lr 0.3, "
                 f"{args.wsp_steps} steps; virtual worker 0 = A100 (n0:0), 1 = T4 (n0:1), emulated, reference "
                 f"{args.reference}; {args.wsp_rounds} rounds, medians (losses: round 0, the same in every round).",
             "", "| run | predicted ms | measured ms | total s | time to loss <= "
                 f"{args.target_loss:g} s (step) | mean loss of the last 5 steps |", "|---|---|---|---|---|---|"]
    curves = {}
    for label, _, _ in cases:
        ms = runs[label]
        ends = [list(itertools.accumulate(m["step_s"])) for m in ms]  # type: ignore[arg-type]
        t_end = [statistics.median(e[k] for e in ends) for k in range(len(ends[0]))]
        loss = list(ms[0]["loss"])  # type: ignore[arg-type]
        curves[label] = (t_end, loss)
        hit = next((k for k, x in enumerate(loss) if x <= args.target_loss), None)
        meas = statistics.median(float(m["measured_iteration_s"]) for m in ms)  # type: ignore[arg-type]
        last5 = sum(loss[-5:]) / len(loss[-5:])
        rows.append({"plan": label, "rule": "profiled", "predicted_ms": predicted[label] * 1e3, "measured_ms": meas * 1e3,
                     "total_s": t_end[-1], "time_to_target_s": t_end[hit] if hit is not None else None,
                     "final_loss": last5})
        reach = f"{t_end[hit]:.2f} ({hit})" if hit is not None else "not reached"
        lines.append(f"| {label} | {predicted[label] * 1e3:.1f} | {meas * 1e3:.1f} | {t_end[-1]:.2f} | {reach} | {last5:.3f} |")
    print("\n".join(lines))
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for label, (t, loss) in curves.items():
            ax.plot(t, loss, marker=".", label=label)
        ax.axhline(args.target_loss, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("time (s, emulated A100 + T4 on this CPU)")
        ax.set_ylabel("training loss (gpt2-tiny, text)")
        ax.set_title("EMULATED: WSP against synchronous data parallelism")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)
        print(f"wrote {args.png}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
