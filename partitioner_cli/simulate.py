"""``partitioner simulate PLAN --profile P --cluster C``: time a plan, write a trace and a PNG."""

from __future__ import annotations

import argparse
import math

from partitioner._io import check_outputs
from partitioner.cluster import GIB, Cluster
from partitioner.errors import PartitionerError
from partitioner.plan import Plan
from partitioner.profile import Profile
from partitioner_cli._args import add_plan_inputs, bounded_int, check_simulation_size
from partitioner_cli.plan import add_cost_arguments, plan_cost_options

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    from partitioner.simulate import simulate_plan
    from partitioner.trace import render_png, summary_text, write_trace

    check_outputs({"--trace": args.trace, "--png": args.png}, (args.plan, args.profile, args.cluster))
    plan = Plan.load(args.plan)
    profile = Profile.load(args.profile)
    cluster = Cluster.load(args.cluster)
    check_simulation_size(plan, args.iterations, args.plan, traced=bool(args.trace or args.png))
    profile = profile_for_plan(plan, profile, args.profile)
    options = plan_cost_options(args, plan, profile, cluster)
    tl = simulate_plan(plan, profile, cluster, options, iterations=args.iterations)
    if not (math.isfinite(tl.iteration_s) and tl.iteration_s > 0 and math.isfinite(tl.samples_per_s)):
        raise PartitionerError(f"{args.profile}: the plan's iteration takes {tl.iteration_s:g} s: every layer it "
                               "runs has zero time and nothing crosses a cut, so there is no rate to report")
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


def profile_for_plan(plan: Plan, profile: Profile, profile_path: str) -> Profile:
    """``profile`` in the plan's layer order (:meth:`Plan.profile_view`) at the plan's micro-batch
    size: rescaled linearly, with a note, when they differ."""
    profile = plan.profile_view(profile)
    if plan.micro_batch_size == profile.micro_batch_size:
        return profile
    sizes = profile.measured_sizes
    if len(sizes) > 1 and sizes[0] <= plan.micro_batch_size <= sizes[-1]:
        if plan.micro_batch_size not in sizes:
            print(f"note: {profile_path} has times at micro-batch sizes {', '.join(map(str, sizes))}; the plan's "
                  f"{plan.micro_batch_size} is priced by interpolating between them")
        return profile.at_size(plan.micro_batch_size)
    print(f"note: the plan's micro-batch size is {plan.micro_batch_size} but {profile_path} was measured at "
          f"{profile.micro_batch_size}; its times and activation sizes are scaled linearly by "
          f"{plan.micro_batch_size}/{profile.micro_batch_size} (an approximation: profile at "
          f"{plan.micro_batch_size} for measured numbers)")
    return profile.rescaled(plan.micro_batch_size)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="time a plan with the discrete-event simulator",
                       description="Simulate PLAN's schedule with the cost model: iteration time, throughput, "
                                   "bubble and peak memory per device; optionally a Perfetto trace and a PNG.")
    add_plan_inputs(p)
    p.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace here")
    p.add_argument("--png", metavar="OUT.png", help="write a timeline image here")
    p.add_argument("--waits", action="store_true", help="show receive waits in the trace")
    p.add_argument("--iterations", type=bounded_int(1, 1000), default=None,
                   help="iterations to simulate (default: 1; 2bw 4; wsp 2 x staleness + 4)")
    add_cost_arguments(p)
    p.set_defaults(func=_run)
