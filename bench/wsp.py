"""WSP against synchronous data parallelism on an emulated heterogeneous cluster: time to a loss.

The cluster is examples/clusters/hetpipe3.yaml: three GPU types of the HetPipe paper's cluster
(TITAN V, TITAN RTX, RTX 2060), one per node, 56 Gb/s InfiniBand between nodes. Each GPU is one
virtual worker holding the whole model (3 processes, gloo, one torch thread each), played on
this CPU by ``train --emulate --emulate-links`` (reference H100-SXM5-80GB, faster than every type, so
every compute action has slack): compute is stretched to each type's projected time, and the
all-reduces between the workers (the gradient all-reduce of sync, WSP's push) take what the
cost model gives them on the cluster's links, times the emulation's time scale.

gpt2-tiny (micro-batch 8, 2 micro-batches) on the text task, SGD; synchronous data parallelism
(1f1b + gradient all-reduce) and ``wsp`` with staleness D in {0, 1, 2, 4}. Every run ends by
time (``--seconds``), so a fast worker's extra waves count; the global model's loss on a
held-out batch is evaluated after the run for every version it went through, the same way for
every schedule (runtime/evaluate.py), against the time that version existed. Reported: time to
``--target-loss`` (the first evaluated version at or below it; median over interleaved rounds),
the speed-up over sync, the waves each worker ran, the measured iteration (median interval
between wave ends) and the simulator's prediction of each (emulated times, the cluster's links
dilated; WSP's push is an asynchronous all-reduce over the holders that ``PULL(c - D)`` waits
for, as this runtime runs it), beside the closed form (``CostModel.plan_iteration_s`` with the
same emulated times), a loss-against-time plot (``--png``). ``--write`` writes docs/img/wsp.png and this
benchmark's section of docs/results.md; without it nothing in the tree is written.

    python bench/wsp.py [--rounds 3] [--seconds 30] [--target-loss 3.6] [--lr 0.1] [--png wsp.png] [--write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._machine import machine_line
from bench._page import write_between
from bench._results import emit
from partitioner.cluster import Cluster
from partitioner.emulation import emulated_cost, emulation_for, predict_emulated
from partitioner.models import build_model
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profiler import profile_model
from partitioner.projection.roofline import project_profile
from runtime.launch import TrainConfig, train_local

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "examples" / "clusters" / "hetpipe3.yaml"
CASES = (("sync (1f1b + all-reduce)", "1f1b", 0), ("wsp D=0", "wsp", 0), ("wsp D=1", "wsp", 1),
         ("wsp D=2", "wsp", 2), ("wsp D=4", "wsp", 4))
MODEL, BATCH, MICRO_BATCHES = "gpt2-tiny", 8, 2


def _plan(cluster: Cluster, layers: int, schedule: str, staleness: int) -> Plan:
    return Plan(MODEL, tuple(VirtualWorker((Stage((0, layers), d.name),)) for d in cluster.devices),
                schedule=schedule, micro_batch_size=BATCH, micro_batches=MICRO_BATCHES, staleness=staleness)


def _time_to(evals: list[dict[str, Any]], target: float) -> float | None:
    return next((float(g["t_s"]) for g in evals if g["loss"] <= target), None)


def _median(xs: list[float | None]) -> float | None:
    """Median over rounds; a round that never reached the target counts as infinitely late."""
    vals = sorted(float("inf") if x is None else x for x in xs)
    med = statistics.median(vals) if vals else float("inf")
    return None if med == float("inf") else med


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (every case once per round)")
    ap.add_argument("--seconds", type=float, default=30.0, help="each run ends by time after this many seconds")
    ap.add_argument("--target-loss", type=float, default=3.6, help="time to the global model's held-out loss <= this")
    ap.add_argument("--lr", type=float, default=0.1, help="SGD learning rate (at 0.3 the loss spikes, sync's too)")
    ap.add_argument("--reference", default="H100-SXM5-80GB", help="the emulation's reference type (default H100-SXM5-80GB)")
    ap.add_argument("--png", help="write the loss-against-time plot here")
    ap.add_argument("--write", action="store_true", help="write docs/img/wsp.png and the section of docs/results.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.monotonic()
    load_before = os.getloadavg()[0]
    cluster = Cluster.load(CLUSTER)
    zoo = build_model(MODEL, BATCH)
    measured = profile_model(zoo.layers, zoo.sample_input(), "cpu", model_name=MODEL, threads=1,
                             meta={"config": zoo.config})
    profile = project_profile(measured, [*cluster.gpu_types, args.reference], source="cpu")
    n = profile.num_layers
    plans = {label: _plan(cluster, n, schedule, d) for label, schedule, d in CASES}
    emulations = {label: emulation_for(plan, profile, cluster, reference=args.reference, links=True)
                  for label, plan in plans.items()}
    predicted = {label: predict_emulated(plan, profile, cluster, reference=args.reference, links=True).iteration_s
                 for label, plan in plans.items()}
    first = emulations[CASES[0][0]]
    allreduce_s = first.collectives[0].seconds
    # the closed form (CostModel.plan_iteration_s) with the emulated times and links: for wsp a
    # period per wave of max(C, (C + A) / (D + 1)), the push an asynchronous all-reduce pulled D waves later
    hidden = {label: emulated_cost(plan, profile, cluster, reference=args.reference, links=True).plan_iteration_s(plan)
              for label, plan in plans.items()}
    types = {d.name: d.gpu_type for d in cluster.devices}
    setting = [f"emulation: time scale x{first.time_scale:.4g} (this CPU's time of {MODEL} over {args.reference}'s); "
               f"all-reduce of the gradients {first.collectives[0].nbytes / 1e6:.3g} MB over {len(types)} workers: "
               f"{allreduce_s * 1e3:.1f} ms emulated"]
    setting += [f"  {s.device} plays {s.gpu_type}: forward {s.fwd_s * 1e3:.1f} ms, backward {s.bwd_s * 1e3:.1f} ms "
                f"per micro-batch (emulated)" for s in first.stages]
    print("\n".join(setting), flush=True)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in CASES}
    for rnd in range(args.rounds):
        order = CASES[rnd % len(CASES):] + CASES[:rnd % len(CASES)]  # rotate, so no case always runs first
        for label, _, _ in order:
            config = TrainConfig(MODEL, steps=100_000, warmup=1, lr=args.lr, threads=1, data="text", progress=False,
                                 emulation=emulations[label], max_seconds=args.seconds, eval_global=True,
                                 timeout_s=args.seconds * 4 + 120)
            m = train_local(plans[label], config, start_method="fork")
            runs[label].append(m)
            hit = _time_to(m["global_eval"], args.target_loss)
            print(f"round {rnd} {label:26s} waves {m['iterations_per_worker']}  iteration "
                  f"{m['measured_iteration_s'] * 1e3:6.1f} ms (predicted {predicted[label] * 1e3:6.1f})  "
                  f"to loss {args.target_loss:g}: {'not reached' if hit is None else f'{hit:.2f} s'}  "
                  f"last loss {m['global_eval'][-1]['loss']:.3f}", flush=True)
    base = _median([_time_to(m["global_eval"], args.target_loss) for m in runs[CASES[0][0]]])
    rows: list[dict[str, Any]] = []
    lines = [f"Machine: {machine_line()}. EMULATED: {cluster.name} ({', '.join(f'{d} = {t}' for d, t in types.items())}"
             f"; links: {CLUSTER.name}) played on this CPU, reference {args.reference}, time scale "
             f"x{first.time_scale:.4g}; {MODEL}, micro-batch {BATCH}, {MICRO_BATCHES} micro-batches, text, lr "
             f"{args.lr:g}; one virtual worker per GPU; runs of {args.seconds:g} s; {args.rounds} interleaved rounds, "
             f"medians. 1-minute load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}. "
             f"Wall time {time.monotonic() - t_start:.0f} s.", "", *setting, "",
             f"| run | time to loss <= {args.target_loss:g}, s | speed-up over sync | range over rounds, s | waves "
             "per worker | measured iteration, ms | predicted iteration (simulator), ms | closed form, ms | "
             "measured iteration speed-up | predicted speed-up (simulator / closed form) | last loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, _, _ in CASES:
        ms = runs[label]
        hits = [_time_to(m["global_eval"], args.target_loss) for m in ms]
        med = _median(hits)
        speed = base / med if base is not None and med is not None else None
        waves = [statistics.median(m["iterations_per_worker"][w] for m in ms) for w in range(len(types))]
        iteration = statistics.median(float(m["measured_iteration_s"]) for m in ms)
        last = statistics.median(float(m["global_eval"][-1]["loss"]) for m in ms)
        pred_speed = predicted[CASES[0][0]] / predicted[label]
        closed_speed = hidden[CASES[0][0]] / hidden[label]
        base_iter = statistics.median(float(m["measured_iteration_s"]) for m in runs[CASES[0][0]])
        rng = sorted(h for h in hits if h is not None)
        rows.append({"run": label, "time_to_target_s": med, "speedup": speed, "waves": waves,
                     "measured_iteration_ms": iteration * 1e3, "predicted_iteration_ms": predicted[label] * 1e3,
                     "predicted_speedup": pred_speed, "closed_form_ms": hidden[label] * 1e3,
                     "closed_form_speedup": closed_speed, "iteration_speedup": base_iter / iteration,
                     "last_loss": last, "reached": len(rng), "rounds": len(ms)})
        lines.append(f"| {label} | {'not reached' if med is None else f'{med:.2f}'} | "
                     f"{'-' if speed is None else f'{speed:.2f}x'} | "
                     f"{f'{rng[0]:.2f} .. {rng[-1]:.2f}' if rng else '-'} ({len(rng)}/{len(ms)} reached) | "
                     f"{' / '.join(f'{w:g}' for w in waves)} | {iteration * 1e3:.1f} | {predicted[label] * 1e3:.1f} | "
                     f"{hidden[label] * 1e3:.1f} | {base_iter / iteration:.2f}x | {pred_speed:.2f}x / "
                     f"{closed_speed:.2f}x | {last:.3f} |")
    print("\n".join(lines))
    png = str(ROOT / "docs" / "img" / "wsp.png") if args.write else args.png
    if png:
        _plot(runs, args.target_loss, png)
        print(f"wrote {png}")
    if args.write:
        when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        body = "\n".join([f"## wsp: {__doc__.splitlines()[0]}", "",
                          f"`python bench/wsp.py {' '.join(argv or sys.argv[1:])}` ({when}, torch {torch.__version__})",
                          "", "![wsp](img/wsp.png)", "", *lines])
        write_between(ROOT / "docs" / "results.md", "<!-- bench:wsp -->", "<!-- /bench:wsp -->", body)
        print("wrote docs/results.md (section wsp)")
    emit(rows, seeds={"weights_and_data": 0})
    return 0


def _plot(runs: dict[str, list[dict[str, Any]]], target: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for label, ms in runs.items():
        g = ms[0]["global_eval"]  # round 0 (the rounds' curves differ only by timing)
        ax.plot([x["t_s"] for x in g], [x["loss"] for x in g], marker=".", ms=3, lw=1, label=label)
    ax.axhline(target, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("time since the start of the run, s (emulated TITAN V + TITAN RTX + RTX 2060 on this CPU)")
    ax.set_ylabel("global model's held-out loss (gpt2-tiny, text)")
    ax.set_title("EMULATED: WSP against synchronous data parallelism (round 0)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
