"""``partitioner plan PROFILE --cluster CLUSTER``: solve, print the stage table, write the plan."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import TYPE_CHECKING

from partitioner._io import check_outputs, finite_json
from partitioner.cluster import GIB, Cluster
from partitioner.cost import PRECISIONS, CostModel, CostOptions
from partitioner.errors import FormatError
from partitioner.placement import supports
from partitioner.plan import SCHEDULES, Plan
from partitioner.pricing import RECOMPUTE_POLICIES, ZERO_STAGES
from partitioner.profile import MAX_MICRO_BATCH_SIZE, Profile
from partitioner_cli._args import (
    Renamed,
    as_flags,
    bounded_float,
    bounded_int,
    count_or_auto,
    device_list,
)

if TYPE_CHECKING:
    from solvers.planning import PlanRequest
    from solvers.result import SolveResult

__all__ = ["add_cost_arguments", "cost_options_from_args", "plan_cost_options", "register"]


def add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    """Cost-model flags shared by the commands that price plans (unset flags keep the defaults,
    or for a saved plan the options it was priced with)."""
    group = parser.add_argument_group("cost model")
    group.add_argument("--overlap-comm", action="store_true", default=None,
                       help="price a stage as max(compute, transfer in, transfer out) instead of compute + transfer out")
    group.add_argument("--overlap-iterations", action="store_true", default=None,
                       help="let a flushing schedule's iterations overlap: each device steps on its own stages' "
                            "gradients and starts the next iteration at once (no flush; zero bubble for zb-h2 and "
                            "zbv); needs no global gradient clipping and no fp16 loss scaling")
    group.add_argument("--precision", choices=PRECISIONS, default=None,
                       help="training precision: fp32, or fp16/bf16 mixed precision with fp32 master weights "
                            "(default fp32)")
    group.add_argument("--allreduce-precision", choices=PRECISIONS, default=None,
                       help="precision the data-parallel gradients are all-reduced in, when not the training "
                            "precision (fp32 for DeepSpeed's fp32_allreduce under fp16)")
    group.add_argument("--optimizer-state-factor", type=bounded_float(0.0, 1000.0), default=None,
                       help="optimizer state per parameter in 4-byte words (Adam 2, SGD+momentum 1, SGD 0; default 2)")
    group.add_argument("--reserved-gb", type=bounded_float(0.0, 1e6), default=None,
                       help="GiB the framework itself uses on every GPU: context, buffers, workspace (default 0.5)")
    group.add_argument("--no-sync", action="store_true", default=None,
                       help="do not price the data-parallel gradient all-reduce and optimizer step")
    group.add_argument("--zero", type=int, choices=ZERO_STAGES, default=None,
                       help="shard optimizer state over each layer's data-parallel holders: 1 the fp32 master copy "
                            "and moments (ZeRO-1), 2 the gradients too (ZeRO-2); 0 none (default)")
    levers = group.add_mutually_exclusive_group()
    levers.add_argument("--recompute", choices=RECOMPUTE_POLICIES, default=None,
                        help="activation recomputation: auto (plan: the default where the dp, cpsat or milp solver "
                             "or the cluster planner plans) gives each stage the fastest mode that fits, none/selective/full one "
                             "mode for every stage (selective: the attention core, full: all but the stage input)")
    levers.add_argument("--no-recompute", dest="recompute", action="store_const", const="none",
                        help="plan without activation recomputation (same as --recompute none)")


def cost_options_from_args(args: argparse.Namespace, base: CostOptions | None = None) -> CostOptions:
    """``base`` (default: the defaults) with every cost flag the user gave."""
    base = base or CostOptions()
    changes: dict[str, object] = {}
    if args.overlap_comm is not None:
        changes["overlap_comm"] = True
    if args.overlap_iterations is not None:
        changes["overlap_iterations"] = True
    if args.precision is not None:
        changes["precision"] = args.precision
    if args.allreduce_precision is not None:
        changes["allreduce_precision"] = args.allreduce_precision
    if args.optimizer_state_factor is not None:
        changes["optimizer_state_factor"] = args.optimizer_state_factor
    if args.reserved_gb is not None:
        changes["reserved_bytes"] = args.reserved_gb * GIB
    if args.no_sync is not None:
        changes["sync"] = False
    if args.zero is not None:
        changes["zero"] = args.zero
    if args.recompute is not None:
        changes["recompute"] = args.recompute
    return replace(base, **changes) if changes else base  # type: ignore[arg-type]


def plan_cost_options(args: argparse.Namespace, plan: Plan, profile: Profile, cluster: Cluster) -> CostOptions:
    """The options a saved plan is priced with: those it records, with every cost flag given over
    them (a note says when the plan records none or a flag overrides them); the plan checked
    against the profile and cluster (an error names ``args.plan``)."""
    saved = plan.cost_options()
    options = cost_options_from_args(args, saved)
    if saved is None:
        print("note: the plan does not record the options it was priced with (an older plan); "
              "priced with the defaults and the flags given")
    elif options != saved:
        print("note: the flags given override the options the plan was priced with")
    try:
        plan.validate(profile, cluster)
    except FormatError as err:
        raise err.in_file(args.plan) from None
    return options


def _run(args: argparse.Namespace) -> int:
    from partitioner.report import format_plan
    from solvers.planning import plan, shown

    check_outputs({"-o": args.output}, (args.profile, args.cluster))
    profile = Profile.load(args.profile)
    cluster = Cluster.load(args.cluster)
    options = cost_options_from_args(args)
    request = _request(args, options)
    if args.recompute is None and request.levers_planned:  # recompute where memory binds, by default
        request = replace(request, options=replace(options, recompute="auto"))
    options = request.options
    with shown():  # a status line (incumbent, bound, gap) for solves past two seconds, on a terminal
        result = plan(profile, cluster, request)
    if not result.ok or result.plan is None:
        print(f"partitioner plan: {result.status}: {as_flags(result.reason or '')}", file=sys.stderr)
        return 1
    for line in result.details.get("messages", ()):
        print(as_flags(line))
    cost = CostModel(result.plan.profile_view(profile.at_size(result.plan.micro_batch_size)), cluster, options)
    cost.validate_plan(result.plan)
    finite_json(result.plan.to_dict(), "the plan")  # e.g. a profile of zero times: an infinite rate
    table = format_plan(result.plan, cost)
    if args.output:  # written before anything is printed: a closed pipe on stdout does not lose it
        result.plan.save(args.output)
    print(table)
    if args.output:
        print(f"\nwrote {args.output}")
    return _after(args, result)


def _request(args: argparse.Namespace, options: CostOptions) -> PlanRequest:
    from solvers.planning import PlanRequest

    return PlanRequest(
        solver=args.solver, schedule=args.schedule, options=options,
        devices=None if args.devices is None else tuple(device_list(args.devices) or ()),
        allow_fewer=bool(args.allow_fewer), chunks=args.chunks,
        micro_batches=count_or_auto(args.micro_batches),
        global_batch=args.global_batch,
        virtual_workers=count_or_auto(args.virtual_workers),
        tensor_parallel=count_or_auto(args.tensor_parallel), pipeline_parallel=args.pipeline_parallel_size,
        policy=args.policy, replication=bool(args.replication), objective=args.objective,
        simulate_top=args.simulate_top, time_limit_s=args.time_limit, threads=args.threads, seed=args.seed,
        chain_order=bool(args.chain_order), fixed_order=bool(args.fixed_order))


def _after(args: argparse.Namespace, result: SolveResult) -> int:
    """What the command says after the plan: what the runtime cannot run."""
    assert result.plan is not None
    cannot = supports(result.plan, "runtime")
    if cannot:
        print(f"note: `partitioner train` cannot run this plan: {cannot}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from solvers import SOLVERS

    parser = sub.add_parser("plan", help="compute a partition plan for a profile on a cluster")
    parser.add_argument("profile", help="profile JSON (partitioner.profile/1)")
    parser.add_argument("--cluster", required=True, help="cluster file (YAML or JSON)")
    parser.add_argument("--solver", default="dp", choices=sorted(SOLVERS), help="solver (default: dp)")
    parser.add_argument("--schedule", default="1f1b", choices=(*SCHEDULES, "auto"),
                        help="pipeline schedule (default: 1f1b); zb-h1, zb-h2 and zbv split the backward into input "
                             "and weight gradients (Qi et al.'s zero-bubble schedules); auto plans gpipe, 1f1b, 2bw, "
                             "zb-h1, zb-h2 and zbv and keeps the fastest simulated plan that fits")
    parser.add_argument("--chunks", default=None, metavar="V|auto",
                        help="model chunks per device for --schedule interleaved|bfs (p devices, p*V stages; "
                             "default and auto: the best of 2, 3, 4 by simulated samples/s)")
    parser.add_argument("--micro-batches", "--microbatches", action=Renamed, dest="micro_batches", default=None,
                        metavar="auto|N", help="micro-batches per iteration (default: the solver's); auto chooses "
                                               "the micro-batch size and count for --global-batch")
    parser.add_argument("--global-batch", "--global-batch-size", type=bounded_int(1, MAX_MICRO_BATCH_SIZE),
                        default=None, metavar="B",
                        help="for --micro-batches auto: samples per iteration, all virtual workers together: "
                             "B = K workers x m micro-batches x micro-batch size, the three chosen together "
                             "(K fixed by --virtual-workers)")
    parser.add_argument("--virtual-workers", "--data-parallel-size", default=None, metavar="K|auto",
                        help="split the cluster into K data-parallel pipelines (hetero planner)")
    parser.add_argument("--pipeline-parallel-size", type=bounded_int(1, 16_384), default=None, metavar="P",
                        help="with --micro-batches auto: every virtual worker a pipeline of P stages, one device "
                             "(GPU or tensor-parallel group) each; default: chosen")
    parser.add_argument("--tensor-parallel", "--tensor-parallel-size", default=None, metavar="T|auto",
                        help="tensor-parallel degree of every stage: GPUs of one type on one node run a stage's "
                             "shards (the profile must hold that degree); auto (with --micro-batches auto) chooses "
                             "one per GPU type; default: auto when the profile holds tensor-parallel shards, else 1")
    parser.add_argument("--policy", default=None, choices=("np", "ed", "hd", "opt"),
                        help="virtual-worker grouping: HetPipe's np, ed, hd, or opt (default: opt)")
    parser.add_argument("--objective", default="sync", choices=("sync", "wsp"),
                        help="what opt maximises: K x the slowest virtual worker's rate, the long-run rate under "
                             "data parallelism and under WSP's staleness bound alike; sync (default) adds the "
                             "gradient all-reduce and optimizer step as synchronous training pays them, wsp leaves "
                             "them out (WSP hides its all-reduce behind the next waves)")
    parser.add_argument("--simulate-top", type=bounded_int(0, 1000), default=4, metavar="N",
                        help="opt: simulate the N best groupings by the closed form (any K) and keep the fastest "
                             "simulated one (default 4; 0: trust the closed form)")
    parser.add_argument("--replication", action=argparse.BooleanOptionalAction, default=False,
                        help="let a stage run data-parallel on several GPUs of one type")
    parser.add_argument("--time-limit", type=bounded_float(0.001, 7 * 86400.0), default=None, metavar="SECONDS",
                        help="stop cpsat / milp / the hetero search after this long and report the gap")
    parser.add_argument("--threads", "--workers", action=Renamed, type=int, dest="threads", default=None, metavar="N",
                        help="cpsat / milp: search threads (CP-SAT workers, CBC threads; default 1)")
    parser.add_argument("--seed", type=int, default=None, metavar="K",
                        help="cpsat / milp: random seed; a fixed seed and --threads give the same plan "
                             "unless the time limit cuts the search (default 0)")
    parser.add_argument("--chain-order", action="store_true",
                        help="on a profile with edges: stages as ranges of its layer order, any solver (default: "
                             "dp, cpsat and milp plan convex stages of the graph; the others split the layer order "
                             "with a note)")
    parser.add_argument("--fixed-order", action="store_true",
                        help="cpsat / milp: split over --devices in the given order (default: on GPUs of several "
                             "(node, type) groups the order is decided in the model with the split)")
    parser.add_argument("--devices", default=None,
                        help="comma-separated device names in pipeline order (default: all, in file order; "
                             "cpsat / milp choose the order unless --fixed-order)")
    parser.add_argument("--allow-fewer", action="store_true", help="let the solver use fewer devices than given")
    add_cost_arguments(parser)
    parser.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    parser.set_defaults(func=_run)
