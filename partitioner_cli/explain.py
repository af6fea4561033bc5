"""``partitioner explain PLAN --profile P --cluster C``: why a plan is as fast as it is."""

from __future__ import annotations

import argparse

from partitioner.cluster import Cluster
from partitioner.plan import Plan
from partitioner.profile import Profile
from partitioner_cli._args import add_plan_inputs, bounded_float
from partitioner_cli.plan import add_cost_arguments, plan_cost_options

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    from partitioner._io import check_outputs, write_json
    from solvers.analysis.explain import explain_plan, format_explanation

    check_outputs({"--json": args.json}, (args.plan, args.profile, args.cluster))
    plan = Plan.load(args.plan)
    profile = Profile.load(args.profile)
    cluster = Cluster.load(args.cluster)
    options = plan_cost_options(args, plan, profile, cluster)
    e = explain_plan(plan, profile, cluster, options, what_if=not args.no_what_if, time_limit_s=args.time_limit)
    print(format_explanation(e))
    if args.json:
        write_json(args.json, e.to_dict())
        print(f"wrote {args.json}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="bottleneck, time, memory headroom, gap and one-more-GPU gains of a plan",
                       description="Explain PLAN: its bottleneck stage (compute / activation send / gradient "
                                   "send) or link, where the simulated iteration goes (bubble, all-reduce, "
                                   "optimizer step), memory headroom per GPU, the gap to the best bound known, "
                                   "and the samples/s one more GPU of each timed type would give.")
    add_plan_inputs(p)
    p.add_argument("--json", metavar="OUT.json", default=None, help="write the same figures as JSON here")
    p.add_argument("--no-what-if", action="store_true", help="skip re-planning with one more GPU of each type")
    p.add_argument("--time-limit", type=bounded_float(0.001, 7 * 86400.0), default=10.0, metavar="SECONDS",
                   help="limit of each cluster-planner re-plan for several virtual workers (default 10)")
    add_cost_arguments(p)
    p.set_defaults(func=_run)
