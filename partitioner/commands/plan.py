"""``partitioner plan PROFILE --cluster CLUSTER``: solve, print the stage table, write the plan."""

from __future__ import annotations

import argparse
import sys

from ..cluster import GIB, Cluster
from ..cost import CostOptions
from ..plan import SCHEDULES
from ..profile import Profile

__all__ = ["add_cost_arguments", "cost_options_from_args", "register"]


def add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    """Cost-model flags shared by the commands that price plans."""
    group = parser.add_argument_group("cost model")
    group.add_argument("--overlap-comm", action="store_true",
                       help="price a stage as max(compute, transfer in, transfer out) instead of compute + transfer out")
    group.add_argument("--optimizer-state-factor", type=float, default=2.0,
                       help="optimizer state bytes per parameter byte (Adam 2, SGD+momentum 1, SGD 0; default 2)")
    group.add_argument("--reserved-gb", type=float, default=0.5,
                       help="GiB kept free on every GPU for context and workspace (default 0.5)")


def cost_options_from_args(args: argparse.Namespace) -> CostOptions:
    return CostOptions(overlap_comm=args.overlap_comm, optimizer_state_factor=args.optimizer_state_factor,
                       reserved_bytes=args.reserved_gb * GIB)


def _run(args: argparse.Namespace) -> int:
    from solvers import solve

    from ..report import format_plan

    profile = Profile.load(args.profile)
    cluster = Cluster.load(args.cluster)
    options = cost_options_from_args(args)
    kwargs: dict[str, object] = {"schedule": args.schedule, "options": options}
    if args.micro_batches is not None:
        kwargs["micro_batches"] = args.micro_batches
    if args.devices:
        kwargs["devices"] = [d.strip() for d in args.devices.split(",") if d.strip()]
    if args.allow_fewer:
        kwargs["allow_fewer"] = True
    result = solve(profile, cluster, solver=args.solver, **kwargs)
    if not result.ok or result.plan is None:
        print(f"partitioner plan: {result.status}: {result.reason}", file=sys.stderr)
        return 1
    result.plan.validate(profile, cluster, options)
    print(format_plan(result.plan, profile, cluster, options))
    if args.output:
        result.plan.save(args.output)
        print(f"\nwrote {args.output}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from solvers import SOLVERS

    parser = sub.add_parser("plan", help="compute a partition plan for a profile on a cluster")
    parser.add_argument("profile", help="profile JSON (partitioner.profile/1)")
    parser.add_argument("--cluster", required=True, help="cluster file (YAML or JSON)")
    parser.add_argument("--solver", default="dp", choices=sorted(SOLVERS), help="solver (default: dp)")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule (default: 1f1b)")
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="micro-batches per iteration (default: the number of pipeline stages)")
    parser.add_argument("--devices", default=None,
                        help="comma-separated device names in pipeline order (default: all, in file order)")
    parser.add_argument("--allow-fewer", action="store_true", help="let the solver use fewer devices than given")
    add_cost_arguments(parser)
    parser.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    parser.set_defaults(func=_run)
