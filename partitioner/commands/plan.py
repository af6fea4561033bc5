"""``partitioner plan PROFILE --cluster CLUSTER``: solve, print the stage table, write the plan."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from .._io import check_outputs, finite_json
from ..cluster import GIB, MAX_GPUS, Cluster
from ..cost import PRECISIONS, CostOptions
from ..errors import FormatError
from ..plan import MAX_MICRO_BATCHES, SCHEDULES
from ..profile import MAX_MICRO_BATCH_SIZE, Profile
from ..schedule import spec
from ._args import Renamed, bounded_float, bounded_int

__all__ = ["add_cost_arguments", "cost_options_from_args", "register"]


def add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    """Cost-model flags shared by the commands that price plans (unset flags keep the defaults,
    or for a saved plan the options it was priced with)."""
    group = parser.add_argument_group("cost model")
    group.add_argument("--overlap-comm", action="store_true", default=None,
                       help="price a stage as max(compute, transfer in, transfer out) instead of compute + transfer out")
    group.add_argument("--precision", choices=PRECISIONS, default=None,
                       help="training precision: fp32, or fp16/bf16 mixed precision with fp32 master weights "
                            "(default fp32)")
    group.add_argument("--optimizer-state-factor", type=bounded_float(0.0, 1000.0), default=None,
                       help="optimizer state per parameter in 4-byte words (Adam 2, SGD+momentum 1, SGD 0; default 2)")
    group.add_argument("--reserved-gb", type=bounded_float(0.0, 1e6), default=None,
                       help="GiB the framework itself uses on every GPU: context, buffers, workspace (default 0.5)")
    group.add_argument("--no-sync", action="store_true", default=None,
                       help="do not price the data-parallel gradient all-reduce and optimizer step")


def cost_options_from_args(args: argparse.Namespace, base: CostOptions | None = None) -> CostOptions:
    """``base`` (default: the defaults) with every cost flag the user gave."""
    base = base or CostOptions()
    changes: dict[str, object] = {}
    if args.overlap_comm is not None:
        changes["overlap_comm"] = True
    if args.precision is not None:
        changes["precision"] = args.precision
    if args.optimizer_state_factor is not None:
        changes["optimizer_state_factor"] = args.optimizer_state_factor
    if args.reserved_gb is not None:
        changes["reserved_bytes"] = args.reserved_gb * GIB
    if args.no_sync is not None:
        changes["sync"] = False
    return replace(base, **changes) if changes else base  # type: ignore[arg-type]


def _run(args: argparse.Namespace) -> int:
    from solvers import solve

    from ..report import format_plan

    check_outputs({"-o": args.output}, (args.profile, args.cluster))
    profile = Profile.load(args.profile)
    cluster = Cluster.load(args.cluster)
    options = cost_options_from_args(args)
    kwargs: dict[str, object] = {"schedule": args.schedule, "options": options}
    if args.devices:
        kwargs["devices"] = [d.strip() for d in args.devices.split(",") if d.strip()]
    if args.allow_fewer:
        kwargs["allow_fewer"] = True
    if args.chunks is not None or spec(args.schedule).multi_chunk:
        from solvers.chunked import parse_chunks

        parse_chunks(args.chunks or "auto", args.schedule, "--chunks")
        if args.solver != "dp" or args.virtual_workers is not None or args.policy is not None or args.replication:
            raise FormatError("--schedule", args.schedule, "multi-chunk plans are made by the dp solver for one "
                              "virtual worker; leave --solver, --virtual-workers, --policy and --replication out")
        if args.micro_batches == "auto" or args.allow_fewer:
            raise FormatError("--microbatches auto" if args.micro_batches == "auto" else "--allow-fewer",
                              args.schedule, "not supported with multi-chunk schedules; give a count and the devices")
        kwargs["chunks"] = args.chunks or "auto"
    solver = args.solver
    hetero = args.virtual_workers is not None or args.policy is not None or args.replication
    if hetero or args.micro_batches == "auto":
        if solver not in ("dp", "hetero"):
            raise FormatError("--solver", solver, "--virtual-workers/--policy/--replication/--microbatches auto "
                              "plan with the hetero planner; leave --solver out or use --solver hetero")
        solver = "hetero"
        vw = args.virtual_workers or "auto"
        kwargs.update(virtual_workers=vw if vw == "auto" else _positive(vw, "--virtual-workers", MAX_GPUS),
                      policy=args.policy or "opt", replication=bool(args.replication), objective=args.objective)
        if args.simulate_top:
            kwargs["simulate_top"] = args.simulate_top
    if args.time_limit is not None:
        if not args.time_limit > 0:
            raise FormatError("--time-limit", args.time_limit, "must be > 0 seconds")
        if solver not in _TIME_LIMITED:
            raise FormatError("--time-limit", args.time_limit, f"applies to the {', '.join(_TIME_LIMITED)} "
                              f"solvers; {solver} needs none")
        kwargs["time_limit_s"] = args.time_limit
    for flag, value, key in (("--workers", args.workers, "threads"), ("--seed", args.seed, "seed")):
        if value is None:
            continue
        if solver not in _SEARCHED:
            raise FormatError(flag, value, f"applies to the {', '.join(_SEARCHED)} solvers, not {solver}")
        if value < (1 if flag == "--workers" else 0):
            raise FormatError(flag, value, "must be an integer >= 1" if flag == "--workers" else
                              "must be an integer >= 0")
        kwargs[key] = value
    if args.micro_batches == "auto":
        from solvers.hetero import plan_cluster
        from solvers.microbatch import choose_micro_batches

        if args.global_batch is None:
            raise FormatError("--microbatches", "auto", "needs --global-batch (samples per virtual worker "
                              "per iteration) to choose the micro-batch size and count")
        choice = choose_micro_batches(profile, cluster, args.global_batch, plan_cluster, **kwargs)  # type: ignore[arg-type]
        if choice is None:
            print(f"partitioner plan: infeasible: no micro-batch size dividing {args.global_batch} fits",
                  file=sys.stderr)
            return 1
        print(f"micro-batch size {choice.micro_batch_size} x {choice.micro_batches} micro-batches "
              f"(first micro-batch in {choice.first_slices} slice(s)): {choice.samples_per_s:.2f} samples/s")
        measured = profile.measured_sizes
        if choice.micro_batch_size != profile.micro_batch_size and len(measured) == 1:
            print(f"note: size {choice.micro_batch_size} is priced by scaling the profile measured at "
                  f"{profile.micro_batch_size} linearly, which ignores the fixed costs of a small batch "
                  f"(kernel launches, reading the weights) and favours small sizes; profile the model at "
                  f"the sizes you consider to choose among measured numbers")
        elif choice.micro_batch_size not in measured:
            print(f"note: size {choice.micro_batch_size} is priced by interpolating between the measured "
                  f"sizes {', '.join(map(str, measured))}")
        profile = profile.at_size(choice.micro_batch_size)
        result = choice.result
    else:
        if args.micro_batches is not None:
            kwargs["micro_batches"] = _positive(args.micro_batches, "--microbatches", MAX_MICRO_BATCHES)
        result = solve(profile, cluster, solver=solver, **kwargs)
    if not result.ok or result.plan is None:
        print(f"partitioner plan: {result.status}: {result.reason}", file=sys.stderr)
        return 1
    result.plan.validate(profile, cluster, options)
    finite_json(result.plan.to_dict(), "the plan")  # e.g. a profile of zero times: an infinite rate
    table = format_plan(result.plan, profile, cluster, options)
    if args.output:  # written before anything is printed: a closed pipe on stdout does not lose it
        result.plan.save(args.output)
    print(table)
    if args.output:
        print(f"\nwrote {args.output}")
    from ..placement import supports

    cannot = supports(result.plan, "runtime")
    if cannot:
        print(f"note: `partitioner train` cannot run this plan: {cannot}")
    return 0


_TIME_LIMITED = ("cpsat", "milp", "hetero")
_SEARCHED = ("cpsat", "milp")  # solvers with search workers and a random seed


def _positive(text: str, flag: str, most: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise FormatError(flag, text, f"must be an integer in [1, {most:,}] or 'auto'")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    from solvers import SOLVERS

    parser = sub.add_parser("plan", help="compute a partition plan for a profile on a cluster")
    parser.add_argument("profile", help="profile JSON (partitioner.profile/1)")
    parser.add_argument("--cluster", required=True, help="cluster file (YAML or JSON)")
    parser.add_argument("--solver", default="dp", choices=sorted(SOLVERS), help="solver (default: dp)")
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule (default: 1f1b)")
    parser.add_argument("--chunks", default=None, metavar="V|auto",
                        help="model chunks per device for --schedule interleaved|bfs (p devices, p*V stages; "
                             "default and auto: the best of 2, 3, 4 by simulated samples/s)")
    parser.add_argument("--micro-batches", "--microbatches", action=Renamed, dest="micro_batches", default=None,
                        metavar="auto|N", help="micro-batches per iteration (default: the solver's); auto chooses "
                                               "the micro-batch size and count for --global-batch")
    parser.add_argument("--global-batch", type=bounded_int(1, MAX_MICRO_BATCH_SIZE), default=None, metavar="B",
                        help="for --micro-batches auto: samples per virtual worker per iteration, B = micro-batch "
                             "size x micro-batches; K virtual workers train K x B samples an iteration (K is "
                             "--virtual-workers, chosen by the planner unless given)")
    parser.add_argument("--virtual-workers", default=None, metavar="K|auto",
                        help="split the cluster into K data-parallel pipelines (hetero planner)")
    parser.add_argument("--policy", default=None, choices=("np", "ed", "hd", "opt"),
                        help="virtual-worker grouping: HetPipe's np, ed, hd, or opt (default: opt)")
    parser.add_argument("--objective", default="sync", choices=("sync", "wsp"),
                        help="what opt maximises: K x the slowest virtual worker (sync, default: the long-run "
                             "rate under data parallelism, and under WSP's staleness bound) or the sum of the "
                             "workers' own rates (wsp: reached only while fast workers may run ahead)")
    parser.add_argument("--simulate-top", type=bounded_int(0, 1000), default=4, metavar="N",
                        help="opt: simulate the N best groupings by the closed form (any K) and keep the fastest "
                             "simulated one (default 4; 0: trust the closed form)")
    parser.add_argument("--replication", action=argparse.BooleanOptionalAction, default=False,
                        help="let a stage run data-parallel on several GPUs of one type")
    parser.add_argument("--time-limit", type=bounded_float(0.001, 7 * 86400.0), default=None, metavar="SECONDS",
                        help="stop cpsat / milp / the hetero search after this long and report the gap")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="cpsat / milp: search workers (CP-SAT workers, CBC threads; default 1)")
    parser.add_argument("--seed", type=int, default=None, metavar="K",
                        help="cpsat / milp: random seed; a fixed seed and --workers give the same plan "
                             "unless the time limit cuts the search (default 0)")
    parser.add_argument("--devices", default=None,
                        help="comma-separated device names in pipeline order (default: all, in file order)")
    parser.add_argument("--allow-fewer", action="store_true", help="let the solver use fewer devices than given")
    add_cost_arguments(parser)
    parser.add_argument("-o", "--output", default=None, help="write the plan JSON here")
    parser.set_defaults(func=_run)
