"""``partitioner compare PROFILE --cluster C``: every solver, policy and baseline on the same
inputs, one table (and optionally a bar chart and JSON).

    partitioner compare p.json --cluster c.yaml --micro-batches 8
    partitioner compare p.json --cluster c.yaml --virtual-workers auto --png compare.png -o compare.json
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Any

from partitioner.cluster import Cluster
from partitioner.errors import FormatError
from partitioner.plan import MAX_MICRO_BATCHES, SCHEDULES
from partitioner.profile import Profile
from partitioner.schedule import DEFAULT_MICRO_BATCHES, spec
from partitioner_cli._args import Renamed, as_flags, bounded_float, bounded_int, device_list
from partitioner_cli.plan import add_cost_arguments, cost_options_from_args

__all__ = ["format_comparison", "register"]


def _objective(c: Any) -> tuple[str, str]:
    if not c.ok:
        return "-", "-"
    if c.unit == "s/sample":  # cluster planner and baselines: seconds per sample, shown as samples/s
        obj = f"{1 / c.objective:.1f} samples/s" if c.objective > 0 else "n/a"
        bound = f"<= {1 / c.lower_bound:.1f} samples/s" if c.lower_bound > 0 else "-"
        return obj, bound
    obj = f"{c.objective * 1e3:.2f} ms"
    bound = "-" if math.isnan(c.lower_bound) else f">= {c.lower_bound * 1e3:.2f} ms"
    return obj, bound


def format_comparison(rows: Sequence[Any]) -> str:
    header = ["solver", "kind", "status", "vw", "tp", "objective", "bound", "gap", "model samples/s",
              "simulated samples/s", "solve time"]
    table = []
    for c in rows:
        obj, bound = _objective(c)
        gap = "-" if math.isnan(c.gap) else f"{c.gap * 100:.2f}%"
        model = "-" if math.isnan(c.model_samples_per_s) else f"{c.model_samples_per_s:.1f}"
        sim = "-" if math.isnan(c.simulated_samples_per_s) else f"{c.simulated_samples_per_s:.1f}"
        table.append([c.name, c.kind, c.status, str(c.virtual_workers) if c.ok else "-",
                      c.tensor_parallel if c.ok else "-", obj, bound, gap, model, sim,
                      f"{c.solve_s:.3f} s" if c.status != "n/a" else "-"])
    widths = [max(len(h), *(len(r[i]) for r in table)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in table]
    notes = [f"  {c.name}: {c.reason}" for c in rows if not c.ok and c.reason]
    if notes:
        lines += ["", "without a plan:", *notes]
    return "\n".join(lines)


def _png(rows: Sequence[Any], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [c for c in rows if c.ok]
    fig, ax = plt.subplots(figsize=(7.5, 0.45 * len(done) + 1.4))
    ys = range(len(done))
    h = 0.38
    ax.barh([y - h / 2 for y in ys], [c.model_samples_per_s for c in done], h, label="model (closed form)")
    ax.barh([y + h / 2 for y in ys], [c.simulated_samples_per_s for c in done], h, label="simulated")
    ax.set_yticks(list(ys), [f"{c.name} ({c.kind})" for c in done])
    ax.invert_yaxis()
    ax.set_xlabel("samples/s")
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    import io

    from partitioner._io import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _run(args: argparse.Namespace) -> int:
    from partitioner._io import check_outputs
    from solvers.analysis.compare import compare

    check_outputs({"-o": args.output, "--png": args.png}, (args.profile, args.cluster))
    profile = Profile.load(args.profile)
    cluster = Cluster.load(args.cluster)
    vw: int | str | None = args.virtual_workers
    if vw is not None and vw != "auto":
        try:
            vw = int(vw)
        except ValueError:
            vw = 0
        if vw < 1:
            raise FormatError("--virtual-workers", args.virtual_workers, "must be an integer >= 1 or 'auto'")
    devices = device_list(args.devices)
    rows = compare(profile, cluster, virtual_workers=vw, schedule=args.schedule, micro_batches=args.micro_batches,
                   options=cost_options_from_args(args), devices=devices, time_limit_s=args.time_limit)
    what = "one pipeline" if vw is None else f"virtual workers {vw}"
    title = (f"{profile.model} on {cluster.name}: {what}, {args.schedule}, {args.micro_batches} micro-batches "
             f"of {profile.micro_batch_size}")
    print(title)
    print(as_flags(format_comparison(rows)))
    if args.output:
        from partitioner._io import write_json

        write_json(args.output, {"format": "partitioner.compare/1", "model": profile.model, "cluster": cluster.name,
                                 "virtual_workers": vw, "schedule": args.schedule,
                                 "micro_batches": args.micro_batches, "micro_batch_size": profile.micro_batch_size,
                                 "rows": [c.to_dict() for c in rows]})
        print(f"wrote {args.output}")
    if args.png:
        if not any(c.ok for c in rows):
            print(f"no plan to chart; {args.png} not written", file=sys.stderr)
        else:
            _png(rows, args.png, title)
            print(f"wrote {args.png}")
    return 0 if any(c.ok for c in rows) else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="every solver, policy and baseline on the same inputs, in one table",
                       description="Plan PROFILE on CLUSTER with every solver on the same devices, schedule and "
                                   "micro-batches: dp, cpsat, milp and the baselines uniform, parameters, "
                                   "blockpartition, pipedream for one pipeline; with --virtual-workers the cluster "
                                   "planner's policies np, ed, hd, opt and the baselines on np-grouped virtual "
                                   "workers. Prints objective, bound, gap, the closed-form and simulated "
                                   "throughput and the solve time of each.")
    p.add_argument("profile", help="profile JSON (partitioner.profile/1)")
    p.add_argument("--cluster", required=True, help="cluster file (YAML or JSON)")
    p.add_argument("--virtual-workers", default=None, metavar="K|auto",
                   help="compare the cluster planner's policies and baselines on K data-parallel pipelines "
                        "(baselines: K np-grouped workers; auto: one per node)")
    p.add_argument("--schedule", default="1f1b", choices=[s for s in SCHEDULES if not spec(s).multi_chunk],
                   help="pipeline schedule (default: 1f1b)")
    p.add_argument("--micro-batches", "--microbatches", action=Renamed, dest="micro_batches",
                   type=bounded_int(1, MAX_MICRO_BATCHES), default=DEFAULT_MICRO_BATCHES,
                   metavar="N",
                   help="micro-batches per iteration, the same for every solver (default 8)")
    p.add_argument("--devices", default=None,
                   help="comma-separated device names in pipeline order (default: all, in file order)")
    p.add_argument("--time-limit", type=bounded_float(0.001, 7 * 86400.0), default=10.0, metavar="SECONDS",
                   help="limit of cpsat, milp and the cluster planner, each (default 10)")
    add_cost_arguments(p)
    p.add_argument("--png", metavar="OUT.png", help="bar chart of the throughputs")
    p.add_argument("-o", "--output", metavar="OUT.json", help="write the rows as JSON")
    p.set_defaults(func=_run)
