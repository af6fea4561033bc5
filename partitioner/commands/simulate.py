"""``partitioner simulate PLAN --profile P --cluster C``: time a plan, write a trace and a PNG."""

from __future__ import annotations

import argparse
import os

from ..cluster import GIB, Cluster
from ..errors import FormatError, PartitionerError
from ..plan import Plan
from ..profile import Profile
from .plan import add_cost_arguments, cost_options_from_args

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    from ..simulate import simulate_plan
    from ..trace import render_png, summary_text, write_trace

    inputs = {os.path.realpath(p) for p in (args.plan, args.profile, args.cluster)}
    for flag, out in (("--trace", args.trace), ("--png", args.png)):
        if out and os.path.realpath(out) in inputs:
            raise PartitionerError(f"{flag} {out} is one of the input files; name a new output file")
    plan = Plan.load(args.plan)
    profile = Profile.load(args.profile)
    cluster = Cluster.load(args.cluster)
    saved = plan.cost_options()
    options = cost_options_from_args(args, saved)
    if saved is None:
        print("note: the plan does not record the options it was priced with (an older plan); "
              "priced with the defaults and the flags given")
    elif options != saved:
        print("note: the flags given override the options the plan was priced with")
    try:
        plan.validate(profile, cluster, options, check_memory=False)
    except FormatError as err:
        raise err.in_file(args.plan) from None
    tl = simulate_plan(plan, profile, cluster, options, iterations=args.iterations)
    print(summary_text(tl))
    measured = plan.meta.get("measured")
    if isinstance(measured, dict) and isinstance(measured.get("iteration_s"), (int, float)):
        peak = max(tl.peak_memory_bytes.values())
        line = (f"measured iteration {measured['iteration_s']:.5g} s: predicted "
                f"{100 * (tl.iteration_s / measured['iteration_s'] - 1):+.1f}%")
        if isinstance(measured.get("peak_memory_bytes"), (int, float)) and measured["peak_memory_bytes"] > 0:
            line += (f"; measured peak {measured['peak_memory_bytes'] / GIB:.2f} GiB: predicted "
                     f"{100 * (peak / measured['peak_memory_bytes'] - 1):+.1f}%")
        print(line)
    over = [f"{d} needs {tl.peak_memory_bytes[d] / GIB:.2f} GiB of {cluster.device(d).memory_bytes / GIB:.2f}"
            for d in tl.devices if tl.peak_memory_bytes[d] > cluster.device(d).memory_bytes]
    if over:
        print("does not fit: " + "; ".join(over))
    if args.trace:
        write_trace(tl, args.trace, include_waits=args.waits)
        print(f"wrote {args.trace} (open in https://ui.perfetto.dev)")
    if args.png:
        render_png(tl, args.png)
        print(f"wrote {args.png}")
    return 1 if over else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="time a plan with the discrete-event simulator",
                       description="Simulate PLAN's schedule with the cost model: iteration time, throughput, "
                                   "bubble and peak memory per device; optionally a Perfetto trace and a PNG.")
    p.add_argument("plan", help="plan JSON (from `partitioner plan`)")
    p.add_argument("--profile", required=True, help="the profile the plan was made for")
    p.add_argument("--cluster", required=True, help="the cluster file (YAML or JSON)")
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace here")
    p.add_argument("--png", metavar="OUT.png", help="write a timeline image here")
    p.add_argument("--waits", action="store_true", help="show receive waits in the trace")
    p.add_argument("--iterations", type=int, default=None,
                   help="iterations to simulate (default: 1; 2bw 4; wsp staleness + 4)")
    add_cost_arguments(p)
    p.set_defaults(func=_run)
