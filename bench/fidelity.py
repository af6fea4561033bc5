"""Predicted against measured: Sailor's 15 OPT-350M training runs on Clariden (GH200 nodes).

    python bench/fidelity.py [--fit] [--write] [--runs DIR --profiles DIR --network FILE]

Every run is read with the project's own importer (``partitioner.importers.sailor_runs``: the
run's layer cuts, replicas as virtual workers, 1F1B, its micro-batch size and global batch,
fp16 mixed precision with Adam, the measured NCCL curve on the inter-node links) and priced by
the simulator, exactly as ``partitioner simulate`` prices a plan. Figures: iteration time and
peak memory against the measured ``real`` and ``max_mem``; within every group of one node count
the predicted order against the measured order (Spearman); the closed form the solvers use
against the simulator.

``--fit`` refits the one calibrated constant, the framework's own memory per GPU, as the
median of (measured - modelled) peak memory with none reserved, and prints it; the table always
uses the documented ``MEGATRON_DEEPSPEED_RESERVED_GIB``. ``--write`` saves the scatter plot to
docs/img/fidelity.png and the figures to bench/results/fidelity.json.

``--loo PARAMS`` (comma separated, of ``partitioner.calibrate.FIT_PARAMETERS``; repeatable)
fits those parameters with ``partitioner.calibrate`` and predicts every run with the parameters
fitted on the *other* runs (leave one run out), so that no figure it prints comes from a constant
fitted on the run it judges. ``--lgo PARAMS`` leaves out every run of one node count at a time
instead: each run is predicted from runs on clusters of other sizes only. Per node count it prints
the Spearman rank correlation, the median and worst iteration-time error and the median and worst
memory error: before (the documented model, whose memory constant was fitted on these runs) and
after; with ``--write`` (``--loo`` only) also docs/img/calibration.png and
bench/results/calibration.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from partitioner._io import atomic_write_text  # noqa: E402
from partitioner.cluster import GIB  # noqa: E402
from partitioner.cost import CostModel  # noqa: E402
from partitioner.errors import PartitionerError  # noqa: E402
from partitioner.importers.sailor_runs import MEGATRON_DEEPSPEED_RESERVED_GIB, import_sailor_run  # noqa: E402
from partitioner.simulate import simulate_plan  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two equally long lists without ties (1.0 for one or two equal orders)."""
    n = len(a)
    if n < 2:
        return 1.0
    ra = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: a[i]))}
    rb = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: b[i]))}
    return 1.0 - 6.0 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def evaluate(runs_dir: Path, profiles: Path, network: Path, reserved_gib: float, sync: bool = True,
             activations: str = "megatron", clip_noise: bool = True, shared_nics: bool = True) -> list[dict]:
    rows = []
    for path in sorted(runs_dir.glob("*.json")):
        try:
            run = import_sailor_run(path, profiles, network, activations=activations, clip_noise=clip_noise,
                                    shared_nics=shared_nics)
        except PartitionerError as err:  # a run the profiles or curves cannot price: say so, go on
            print(f"skipped {path.name}: {err}")
            continue
        opts = replace(run.options, reserved_bytes=reserved_gib * GIB, sync=sync)
        tl = simulate_plan(run.plan, run.profile, run.cluster, opts)
        closed = CostModel(run.profile, run.cluster, opts).plan_iteration_s(run.plan)
        rows.append({
            "run": run.name.removeprefix("plan_config_"), "nodes": run.nodes,
            "stages": len(run.plan.virtual_workers[0].stages), "dp": len(run.plan.virtual_workers),
            "mbs": run.plan.micro_batch_size, "micro_batches": run.plan.micro_batches,
            "measured_s": run.measured_iteration_s, "predicted_s": tl.iteration_s, "closed_form_s": closed,
            "measured_peak_GiB": run.measured_peak_bytes / GIB,
            "predicted_peak_GiB": max(tl.peak_memory_bytes.values()) / GIB,
        })
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=SHARED / "sailor_validation" / "clariden_opt350")
    ap.add_argument("--profiles", type=Path, default=SHARED / "sailor_opt350")
    ap.add_argument("--network", type=Path,
                    default=SHARED / "sailor_validation" / "network" / "network_coeffs_all_homo.json")
    ap.add_argument("--fit", action="store_true", help="refit the framework memory constant on these runs")
    ap.add_argument("--ablate", action="store_true", help="also price the runs with parts of the model left out")
    ap.add_argument("--write", action="store_true", help="write docs/img/fidelity.png and bench/results/fidelity.json")
    ap.add_argument("--loo", action="append", default=[], metavar="PARAMS",
                    help="leave-one-run-out with these parameters fitted (e.g. p2p_bandwidth,reserved); repeatable")
    ap.add_argument("--lgo", action="append", default=[], metavar="PARAMS",
                    help="the same, leaving out every run of one node count at a time (a cluster size the fit "
                         "never saw); repeatable")
    ap.add_argument("--shared-nics", action=argparse.BooleanOptionalAction, default=True,
                    help="import the network with one flow at the one-GPU curve and each node's GPUs sharing one NIC "
                         "of the capacity measured with them all sending (the default, as import sailor-run); "
                         "--no-shared-nics: every flow at the curve of the node's GPU count")
    args = ap.parse_args()
    for p in (args.runs, args.profiles, args.network):
        if not p.exists():
            print(f"fidelity: {p} not found (it comes with the shared data; see --help)", file=sys.stderr)
            return 2
    if args.write and not args.shared_nics:
        print("fidelity: --write records the documented import; run it without --no-shared-nics", file=sys.stderr)
        return 2
    print(f"machine: {machine_line()}")
    if args.fit:
        raw = evaluate(args.runs, args.profiles, args.network, 0.0, shared_nics=args.shared_nics)
        fit = statistics.median(r["measured_peak_GiB"] - r["predicted_peak_GiB"] for r in raw)
        print(f"fitted framework memory per GPU: {fit:.2f} GiB (documented constant: "
              f"{MEGATRON_DEEPSPEED_RESERVED_GIB} GiB)")
    rows = evaluate(args.runs, args.profiles, args.network, MEGATRON_DEEPSPEED_RESERVED_GIB,
                    shared_nics=args.shared_nics)
    print(f"{'run':14s} {'N':>3s} {'pp':>3s} {'dp':>3s} {'mbs':>4s} {'m':>4s} {'measured':>9s} {'predicted':>9s} "
          f"{'error':>7s} {'closed':>8s} {'vs sim':>7s}  {'peak meas':>9s} {'predicted':>9s} {'error':>7s}")
    for r in rows:
        r["error"] = r["predicted_s"] / r["measured_s"] - 1
        r["closed_vs_sim"] = r["closed_form_s"] / r["predicted_s"] - 1
        r["mem_error"] = r["predicted_peak_GiB"] / r["measured_peak_GiB"] - 1
        print(f"{r['run']:14s} {r['nodes']:3d} {r['stages']:3d} {r['dp']:3d} {r['mbs']:4d} {r['micro_batches']:4d} "
              f"{r['measured_s']:8.3f}s {r['predicted_s']:8.3f}s {100 * r['error']:+6.1f}% "
              f"{r['closed_form_s']:7.3f}s {100 * r['closed_vs_sim']:+6.2f}%  {r['measured_peak_GiB']:8.2f}G "
              f"{r['predicted_peak_GiB']:8.2f}G {100 * r['mem_error']:+6.1f}%")
    groups: dict[int, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["nodes"], []).append(r)
    rhos = {n: spearman([r["measured_s"] for r in g], [r["predicted_s"] for r in g])
            for n, g in sorted(groups.items()) if len(g) >= 2}
    med = statistics.median(abs(r["error"]) for r in rows)
    worst_mem = max(abs(r["mem_error"]) for r in rows)
    worst_closed = max(abs(r["closed_vs_sim"]) for r in rows)
    print("\nSpearman of predicted vs measured iteration time, per node count: "
          + ", ".join(f"N={n}: {rho:.2f}" for n, rho in rhos.items()))
    print(f"median |iteration error| {100 * med:.1f}% (target 15%); worst {100 * max(abs(r['error']) for r in rows):.1f}%")
    print(f"worst |peak memory error| {100 * worst_mem:.1f}% (target 15% on every plan)")
    print(f"closed form vs simulator: worst {100 * worst_closed:.2f}% (target 2%)")
    if args.write:
        _plot(rows, ROOT / "docs" / "img" / "fidelity.png")
        out = ROOT / "bench" / "results" / "fidelity.json"
        atomic_write_text(out, json.dumps({"machine": machine_line(), "rows": rows, "spearman": rhos,
                                           "median_abs_error": med}, indent=1) + "\n")
        print(f"wrote docs/img/fidelity.png and {out.relative_to(ROOT)}")
    if args.ablate:
        print("\nwhat each part of the model contributes (all other parts as documented):")
        print(f"{'model':44s} {'median |it err|':>15s} {'worst |it err|':>14s} {'worst |mem err|':>15s} "
              f"{'order (groups at 1.0)':>21s}")
        variants = [("as documented", {}),
                    ("without the gradient all-reduce and step", {"sync": False}),
                    ("Sailor's activation counts", {"activations": "sailor"}),
                    ("small-batch timing noise kept", {"clip_noise": False}),
                    ("no framework memory (reserved 0)", {"reserved_gib": 0.0})]
        for name, knobs in variants:
            kw = {"reserved_gib": MEGATRON_DEEPSPEED_RESERVED_GIB, "shared_nics": args.shared_nics, **knobs}
            rs = evaluate(args.runs, args.profiles, args.network, **kw)  # type: ignore[arg-type]
            errs = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in rs]
            mems = [abs(r["predicted_peak_GiB"] / r["measured_peak_GiB"] - 1) for r in rs]
            gs: dict[int, list[dict]] = {}
            for r in rs:
                gs.setdefault(r["nodes"], []).append(r)
            good = sum(1 for g in gs.values() if len(g) >= 2 and abs(spearman(
                [r["measured_s"] for r in g], [r["predicted_s"] for r in g]) - 1) < 1e-9)
            print(f"{name:44s} {100 * statistics.median(errs):14.1f}% {100 * max(errs):13.1f}% "
                  f"{100 * max(mems):14.1f}% {good:>15d} of {sum(1 for g in gs.values() if len(g) >= 2)}")
    ok = all(abs(rho - 1.0) < 1e-9 for rho in rhos.values()) and med <= 0.15 and worst_mem <= 0.15
    for params in args.loo:
        _leave_one_out(args, rows, tuple(x.strip() for x in params.split(",") if x.strip()))
    for params in args.lgo:
        _leave_one_out(args, rows, tuple(x.strip() for x in params.split(",") if x.strip()), by_nodes=True)
    return 0 if ok else 1


def _group_table(label: str, rows: list[dict], time_key: str, mem_key: str) -> list[dict]:
    """Per node count and over all runs: Spearman, median and worst |error| of time and memory."""
    groups: dict[object, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["nodes"], []).append(r)
    groups["all"] = rows
    out = []
    for n, g in groups.items():
        te = [r[time_key] / r["measured_s"] - 1 for r in g]
        me = [r[mem_key] / r["measured_peak_GiB"] - 1 for r in g]
        rho = spearman([r["measured_s"] for r in g], [r[time_key] for r in g]) if n != "all" else float("nan")
        out.append({"model": label, "nodes": n, "runs": len(g), "spearman": rho,
                    "time_median": statistics.median(abs(x) for x in te), "time_worst": max(te, key=abs),
                    "mem_median": statistics.median(abs(x) for x in me), "mem_worst": max(me, key=abs)})
    return out


def _leave_one_out(args: argparse.Namespace, rows: list[dict], params: tuple[str, ...], by_nodes: bool = False) -> None:
    """Leave one run out, or with ``by_nodes`` every run of one node count (a cluster size the fit
    never saw), and print the table before and after."""
    from partitioner.calibrate import leave_one_out
    from partitioner.measured import load_run

    runs = [load_run(p, args.profiles, args.network, args.shared_nics) for p in sorted(args.runs.glob("*.json"))]
    nodes = {r["run"]: r["nodes"] for r in rows}
    groups = [nodes[r.name.removeprefix("plan_config_")] for r in runs] if by_nodes else None
    loo, folds = leave_one_out(runs, params, groups=groups)
    what = "every run of one node count" if by_nodes else "each run"
    by_name = {r.name.removeprefix("plan_config_"): (t, m / GIB, f) for r, t, m, f in
               zip(runs, loo.predicted_s, loo.predicted_peak_bytes, folds, strict=True)}
    for r in rows:
        r["loo_s"], r["loo_peak_GiB"], fold = by_name[r["run"]]
        r["loo_params"] = fold.to_dict()
    print(f"\nleave-{'one-node-count' if by_nodes else 'one-run'}-out with {', '.join(params)} fitted ({what} "
          f"predicted by a fit without it); "
          f"fitted on all runs: {', '.join(f'{k} {v:.4g}' for k, v in loo.params.to_dict().items())}")
    spread = {k: (min(f.to_dict()[k] for f in folds), max(f.to_dict()[k] for f in folds)) for k in folds[0].to_dict()}
    print("  across the folds: " + ", ".join(f"{k} {lo:.4g}..{hi:.4g}" for k, (lo, hi) in spread.items()))
    table = (_group_table("before (documented)", rows, "predicted_s", "predicted_peak_GiB")
             + _group_table("after (node count out)" if by_nodes else "after (leave-one-out)", rows, "loo_s",
                            "loo_peak_GiB"))
    print(f"{'model':22s} {'N':>4s} {'runs':>4s} {'Spearman':>8s} {'time med':>8s} {'worst':>7s} "
          f"{'mem med':>7s} {'worst':>7s}")
    for t in sorted(table, key=lambda t: (str(t["nodes"]) == "all", t["nodes"] if t["nodes"] != "all" else 0,
                                          t["model"] != "before (documented)")):
        rho = "-" if t["spearman"] != t["spearman"] else f"{t['spearman']:.2f}"
        print(f"{t['model']:22s} {t['nodes']!s:>4s} {t['runs']:4d} {rho:>8s} {100 * t['time_median']:7.1f}% "
              f"{100 * t['time_worst']:+6.1f}% {100 * t['mem_median']:6.1f}% {100 * t['mem_worst']:+6.1f}%")
    if args.write and not by_nodes:
        tag = "_".join(params)
        _plot_loo(rows, ROOT / "docs" / "img" / "calibration.png", params)
        out = ROOT / "bench" / "results" / "calibration.json"
        atomic_write_text(out, json.dumps({"machine": machine_line(), "parameters": list(params), "tag": tag,
                                           "fitted_on_all": loo.params.to_dict(), "groups": table, "rows": rows},
                                          indent=1) + "\n")
        print(f"wrote docs/img/calibration.png and {out.relative_to(ROOT)}")


def _plot_loo(rows: list[dict], path: Path, params: tuple[str, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, (key_m, before, after, unit, title) in zip(axes, (
            ("measured_s", "predicted_s", "loo_s", "s", "iteration time"),
            ("measured_peak_GiB", "predicted_peak_GiB", "loo_peak_GiB", "GiB", "peak memory")), strict=True):
        xs = [r[key_m] for r in rows]
        hi = max(xs + [r[before] for r in rows] + [r[after] for r in rows]) * 1.1
        ax.plot([0, hi], [0, hi], color="grey", lw=1)
        ax.fill_between([0, hi], [0, 0.9 * hi], [0, 1.1 * hi], color="grey", alpha=0.12, label="±10%")
        ax.scatter(xs, [r[before] for r in rows], marker="x", color="tab:red", label="before (documented)", zorder=3)
        ax.scatter(xs, [r[after] for r in rows], marker="o", facecolors="none", edgecolors="tab:blue",
                   label="leave-one-run-out", zorder=3)
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.set_title(f"Clariden OPT-350M: {title}")
        ax.legend(loc="upper left", fontsize=8)
    fig.suptitle(f"fitted without the run judged: {', '.join(params)}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, key_m, key_p, unit, title in ((a, "measured_s", "predicted_s", "s", "iteration time"),
                                          (b, "measured_peak_GiB", "predicted_peak_GiB", "GiB", "peak memory")):
        xs, ys = [r[key_m] for r in rows], [r[key_p] for r in rows]
        hi = max(xs + ys) * 1.1
        ax.plot([0, hi], [0, hi], color="grey", lw=1)
        ax.fill_between([0, hi], [0, 0.85 * hi], [0, 1.15 * hi], color="grey", alpha=0.12, label="±15%")
        sc = ax.scatter(xs, ys, c=[r["nodes"] for r in rows], cmap="viridis", s=36, zorder=3)
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.set_title(f"OPT-350M on Clariden GH200: {title}")
        ax.legend(loc="upper left")
    fig.colorbar(sc, ax=b, label="nodes")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
