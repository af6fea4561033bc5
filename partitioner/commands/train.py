"""``partitioner train PLAN --profile P --cluster C --model NAME``: train with a plan, measured
against the simulator's prediction.

    partitioner train plan.json --profile p.json --cluster c.yaml --model gpt2-tiny --local
    torchrun --nnodes 2 --nproc-per-node 4 ... -m partitioner train plan.json ...   (one rank per device)
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

from .._io import check_outputs
from ..cluster import Cluster
from ..errors import FormatError, PartitionerError
from ..plan import Plan
from ..profile import Profile
from ._args import bounded_float, bounded_int, check_simulation_size
from .simulate import profile_for_plan

__all__ = ["register"]


def _run(args: argparse.Namespace) -> int:
    from runtime.launch import TrainConfig, train_distributed, train_local

    from ..simulate import simulate_plan

    check_outputs({"-o": args.output}, (args.plan, args.profile, args.cluster))
    plan = Plan.load(args.plan)
    if plan.model != args.model:
        raise PartitionerError(f"{args.plan}: the plan is for model '{plan.model}', not '{args.model}'")
    profile = Profile.load(args.profile)
    cluster = Cluster.load(args.cluster)
    check_simulation_size(plan, None, args.plan)
    profile = profile_for_plan(plan, profile, args.profile)
    try:
        plan.validate(profile, cluster, check_memory=False)
    except FormatError as err:
        raise err.in_file(args.plan) from None
    config = TrainConfig(args.model, steps=args.steps, warmup=args.warmup, lr=args.lr, seed=args.seed,
                         device=args.device, threads=args.threads, timeout_s=args.timeout)
    from runtime.stage import zoo_chain

    n_layers = zoo_chain(args.model, plan.micro_batch_size).num_layers
    if n_layers != profile.num_layers:
        raise PartitionerError(f"model '{args.model}' has {n_layers} layers but the profile has "
                               f"{profile.num_layers}; profile the same model")
    predicted = simulate_plan(plan, profile, cluster).iteration_s
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.local and under_torchrun:
        raise PartitionerError("--local starts its own processes; do not combine it with torchrun")
    if not args.local and not under_torchrun:
        raise PartitionerError("run under torchrun (RANK and WORLD_SIZE set) or pass --local to start one "
                               "process per plan device on this machine")
    metrics = train_local(plan, config) if args.local else train_distributed(plan, config)
    if metrics is None:  # a rank other than 0 under torchrun
        return 0
    metrics["predicted_iteration_s"] = predicted
    metrics["measured_over_predicted"] = metrics["measured_iteration_s"] / predicted if predicted > 0 else None
    print(f"{plan.model} {plan.schedule}: {metrics['world_size']} processes, {config.steps} steps "
          f"(median of the last {max(1, config.steps - config.warmup)})")
    print(f"  measured iteration  {metrics['measured_iteration_s'] * 1e3:9.2f} ms")
    print(f"  predicted iteration {predicted * 1e3:9.2f} ms  (simulator)")
    if metrics["loss"]:
        print(f"  loss {metrics['loss'][0]:.5g} -> {metrics['loss'][-1]:.5g}")
    if args.output:
        from .._io import write_json

        clean, lost = _finite_or_null(metrics)
        if lost:  # a diverged loss: the figures are still worth keeping, as strict JSON
            print(f"note: {lost} value(s) were not finite (a diverged loss?) and are written as null")
        write_json(args.output, clean)
        print(f"wrote {args.output}")
    return 0


def _finite_or_null(x: Any) -> tuple[Any, int]:
    """``x`` with every NaN or infinite float replaced by ``None``, and how many were."""
    if isinstance(x, float):
        return (x, 0) if math.isfinite(x) else (None, 1)
    if isinstance(x, dict):
        pairs = {k: _finite_or_null(v) for k, v in x.items()}
        return {k: v for k, (v, _) in pairs.items()}, sum(n for _, n in pairs.values())
    if isinstance(x, (list, tuple)):
        items = [_finite_or_null(v) for v in x]
        return [v for v, _ in items], sum(n for _, n in items)
    return x, 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a zoo model with a plan (torch.distributed)",
                       description="Execute PLAN's schedule on torch.distributed (gloo on CPU, NCCL on GPU): "
                                   "one process per plan device; synchronous data parallelism between virtual "
                                   "workers (gpipe, 1f1b, interleaved, bfs) or WSP with the plan's staleness "
                                   "(wsp). Reports the measured iteration time against the simulator's.")
    p.add_argument("plan", help="plan JSON")
    p.add_argument("--profile", required=True, help="the profile the plan was made for")
    p.add_argument("--cluster", required=True, help="the cluster file (YAML or JSON)")
    p.add_argument("--model", required=True, help="zoo model to train (must be the plan's model)")
    p.add_argument("--steps", type=bounded_int(1, 1_000_000), default=10, help="training steps (default 10)")
    p.add_argument("--warmup", type=bounded_int(0, 1_000_000), default=2, help="steps left out of the timing (default 2)")
    p.add_argument("--lr", type=bounded_float(1e-12, 1e6), default=0.01, help="SGD learning rate (default 0.01)")
    p.add_argument("--seed", type=bounded_int(0, 2**63 - 1), default=0, help="seed of the initial weights and the data (default 0)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--threads", type=bounded_int(0, 4096), default=0,
                   help="torch threads per process (default: this machine's cores / processes)")
    p.add_argument("--timeout", type=bounded_float(1.0, 7 * 86400.0), default=300.0, help="seconds before a stuck run is stopped")
    p.add_argument("--local", action="store_true", help="start one process per plan device on this machine")
    p.add_argument("-o", "--output", metavar="METRICS.json", help="write the metrics here")
    p.set_defaults(func=_run)
