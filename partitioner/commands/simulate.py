"""``partitioner simulate PLAN --profile P --cluster C``: time a plan, write a trace and a PNG."""

from __future__ import annotations

import argparse
import math

from .._io import check_outputs
from ..cluster import GIB, Cluster
from ..cost import CostOptions
from ..errors import FormatError, PartitionerError
from ..plan import Plan
from ..profile import Profile
from ._args import bounded_float, bounded_int, check_simulation_size

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    from ..simulate import simulate_plan
    from ..trace import render_png, summary_text, write_trace

    check_outputs({"--trace": args.trace, "--png": args.png}, (args.plan, args.profile, args.cluster))
    plan = Plan.load(args.plan)
    profile = Profile.load(args.profile)
    cluster = Cluster.load(args.cluster)
    check_simulation_size(plan, args.iterations, args.plan, traced=bool(args.trace or args.png))
    profile = profile_for_plan(plan, profile, args.profile)
    options = CostOptions(overlap_comm=args.overlap_comm, optimizer_state_factor=args.optimizer_state_factor,
                          reserved_bytes=args.reserved_gb * GIB)
    try:
        plan.validate(profile, cluster, options, check_memory=False)
    except FormatError as err:
        raise err.in_file(args.plan) from None
    tl = simulate_plan(plan, profile, cluster, options, iterations=args.iterations)
    if not (math.isfinite(tl.iteration_s) and tl.iteration_s > 0 and math.isfinite(tl.samples_per_s)):
        raise PartitionerError(f"{args.profile}: the plan's iteration takes {tl.iteration_s:g} s: every layer it "
                               "runs has zero time and nothing crosses a cut, so there is no rate to report")
    print(summary_text(tl))
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
    """``profile`` at the plan's micro-batch size: rescaled linearly, with a note, when they differ."""
    if plan.micro_batch_size == profile.micro_batch_size:
        return profile
    print(f"note: the plan's micro-batch size is {plan.micro_batch_size} but {profile_path} was measured at "
          f"{profile.micro_batch_size}; its times and activation sizes are scaled linearly by "
          f"{plan.micro_batch_size}/{profile.micro_batch_size} (an approximation: profile at "
          f"{plan.micro_batch_size} for measured numbers)")
    return profile.rescaled(plan.micro_batch_size)


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
    p.add_argument("--iterations", type=bounded_int(1, 1000), default=None,
                   help="iterations to simulate (default: 1; 2bw 4; wsp staleness + 4)")
    g = p.add_argument_group("cost model")
    g.add_argument("--overlap-comm", action="store_true",
                   help="senders do not wait for their transfers (asynchronous communication)")
    g.add_argument("--optimizer-state-factor", type=bounded_float(0.0, 1000.0), default=2.0,
                   help="optimizer state bytes per parameter byte (Adam 2, SGD+momentum 1, SGD 0; default 2)")
    g.add_argument("--reserved-gb", type=bounded_float(0.0, 1e6), default=0.5, help="GiB kept free on every GPU (default 0.5)")
    p.set_defaults(func=_run)
