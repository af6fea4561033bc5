"""``partitioner replan OLD_PLAN --profile P --cluster C``: a new plan after GPUs are lost or
added, warm-started from the old one, the global batch kept; prints what moved.

    partitioner replan plan.json --profile p.json --cluster c.yaml --without n0:1 -o plan2.json
    partitioner replan plan.json --profile p.json --cluster bigger.yaml --add n2:0,n2:1 -o plan2.json
"""

from __future__ import annotations

import argparse
import sys

from partitioner._io import check_outputs
from partitioner.cluster import Cluster
from partitioner.errors import FormatError, PartitionerError
from partitioner.plan import Plan, group_size
from partitioner.profile import Profile
from partitioner_cli._args import add_plan_inputs, as_flags, device_list

__all__ = ["new_devices", "register"]


def _gpus(device: str, known: set[str]) -> list[str]:
    """``device`` as names the cluster knows: itself, or a tensor-parallel group ``NODE:FIRST-LAST``
    the cluster does not list as one device as its GPUs ``NODE:FIRST`` .. ``NODE:LAST``."""
    if device in known or group_size(device) == 1:
        return [device]
    node, _, span = device.rpartition(":")
    first = int(span.partition("-")[0])
    return [f"{node}:{first + k}" for k in range(group_size(device))]


def new_devices(plan: Plan, cluster: Cluster, without: list[str] | None, add: str | None) -> list[str]:
    """The devices to plan over: the old plan's that ``cluster`` still has, less ``without``,
    plus ``add`` (names, or ``all``: every device of the cluster). A tensor-parallel group of the
    plan counts as its GPUs, so that losing one GPU of it leaves the others to plan over."""
    known = {d.name for d in cluster.devices}
    for flag, names in (("--without", without or []), ("--add", [] if add == "all" else device_list(add) or [])):
        unknown = [d for d in names if not set(_gpus(d, known)) <= known]
        if unknown:
            raise FormatError(flag, ",".join(unknown), f"not a device of cluster {cluster.name} (its devices: "
                              f"{', '.join(sorted(known)[:8])}{', ...' if len(known) > 8 else ''})")
    used = [g for d in plan.devices for g in _gpus(d, known)]
    gone = {g for d in without or [] for g in _gpus(d, known)}
    if gone and not gone & set(used):
        raise FormatError("--without", ",".join(without or []), f"the plan uses none of them (it uses "
                          f"{', '.join(plan.devices)})")
    chosen = {d for d in used if d in known} - gone
    chosen |= known - gone if add == "all" else set(device_list(add) or [])
    if not chosen:
        raise PartitionerError("replan: no device left to plan over; name the devices with --add")
    return [d.name for d in cluster.devices if d.name in chosen]


def _run(args: argparse.Namespace) -> int:
    from partitioner.cost import CostModel
    from partitioner.report import format_plan
    from solvers.analysis.replan import replan

    check_outputs({"-o": args.output}, (args.plan, args.profile, args.cluster))
    old = Plan.load(args.plan)
    profile = Profile.load(args.profile)
    cluster = Cluster.load(args.cluster)
    if old.model != profile.model:
        raise FormatError("model", old.model, f"the profile is of {profile.model!r}", file=args.plan)
    devices = new_devices(old, cluster, device_list(args.without), args.add)
    done = replan(old, profile, cluster, devices, full=args.full)
    if not done.result.ok:
        print(f"partitioner replan: {done.result.status}: {as_flags(done.result.reason or '')}", file=sys.stderr)
        return 1
    new = done.plan
    cost = CostModel(profile.at_size(new.micro_batch_size), cluster, new.pricing)
    table = format_plan(new, cost)
    if args.output:
        new.save(args.output)
    how = {"kept": "the old plan kept (nothing better on these devices)",
           "warm": "warm start: workers that lost no device kept, the others planned again",
           "full": "planned afresh over every device (better than the warm start)"}[done.how]
    print(f"replanned in {done.time_s:.3f} s: {how}")
    for line in done.moves:
        print(f"  {line}")
    print(table)
    if args.output:
        print(f"\nwrote {args.output}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replan", help="a new plan after GPUs are lost or added, from the old plan",
                       description="Plan OLD_PLAN's model again over the devices now available: the old plan's "
                                   "devices in CLUSTER, less --without, plus --add. The global batch (micro-batch "
                                   "size x micro-batches x virtual workers) is kept, so `train --resume` continues "
                                   "the run on the new plan. Virtual workers that lost no device keep their "
                                   "stages; the others are planned again (--full: the whole cluster too).")
    add_plan_inputs(p)
    p.add_argument("--without", default=None, metavar="DEVICES", help="comma-separated devices lost (NODE:INDEX)")
    p.add_argument("--add", default=None, metavar="DEVICES|all",
                   help="comma-separated devices gained, or all: every device of the cluster")
    p.add_argument("--full", action="store_true",
                   help="also plan the whole cluster afresh (every virtual-worker count the global batch allows) "
                        "and keep the faster plan; slower")
    p.add_argument("-o", "--output", default=None, help="write the new plan JSON here")
    p.set_defaults(func=_run)
