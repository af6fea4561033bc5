"""``partitioner train PLAN --profile P --cluster C --model NAME``: train with a plan, measured
against the simulator's prediction.

    partitioner train plan.json --profile p.json --cluster c.yaml --model gpt2-tiny --local
    partitioner train plan.json ... --model mymodels:mlp --local        (a user's model, runtime.model)
    torchrun --nnodes 2 --nproc-per-node 4 ... -m partitioner_cli train plan.json ...   (one rank per device)
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from partitioner._io import check_outputs
from partitioner.cluster import Cluster
from partitioner.errors import FormatError, PartitionerError
from partitioner.plan import Plan
from partitioner.profile import Profile
from partitioner_cli._args import (
    add_plan_inputs,
    as_flags,
    bounded_float,
    bounded_int,
    check_simulation_size,
)
from partitioner_cli.simulate import profile_for_plan

if TYPE_CHECKING:
    from runtime.layout import Layout

__all__ = ["Prepared", "continue_lines", "launch_lines", "prepare_plan", "register", "torchrun_continue_lines"]


@dataclass(frozen=True)
class Prepared:
    """A plan made ready to train: its file, the profile at its micro-batch size, the training
    config, the run every rank receives (``runtime.launch.prepare``) and the optimizer recipe."""

    plan: Plan
    plan_file: str
    profile: Profile
    config: Any  # runtime.run.TrainConfig
    run: Any  # runtime.run.RunSpec
    recipe: Any  # runtime.recipe.Recipe


def prepare_plan(args: argparse.Namespace, plan: Plan, plan_file: str, profile: Profile, cluster: Cluster,
                 attempt: int = 0) -> Prepared:
    """``plan`` (read from ``plan_file``) checked against the profile, the cluster and the model,
    and prepared to train with this command's options; everything refused in one line before any
    process starts. ``attempt`` > 0: a restart of ``--elastic``, which resumes."""
    from runtime.launch import TrainConfig, prepare
    from runtime.model import is_model_ref
    from runtime.recipe import DEFAULT_LR, training_recipe
    from runtime.run import chain_for

    check_simulation_size(plan, None, plan_file)
    profile = profile_for_plan(plan, profile, args.profile)
    try:
        plan.validate(profile, cluster)
    except FormatError as err:
        raise err.in_file(plan_file) from None
    emulation = _emulation(args, plan, profile, cluster)
    options = {} if is_model_ref(args.model) else zoo_options(profile)
    recipe = training_recipe(plan, args.optimizer or "")  # refused here (one line) when the executor cannot run it
    lr = args.lr if args.lr is not None else DEFAULT_LR[recipe.optimizer]
    config = TrainConfig(args.model, steps=args.steps, warmup=args.warmup, lr=lr, optimizer=args.optimizer or "",
                         seed=args.seed,
                         device=args.device, threads=args.threads, timeout_s=args.timeout, data=args.data,
                         model_options=options, node=args.plan_node or "",
                         checkpoint_dir=args.checkpoint_dir or "", checkpoint_every=args.checkpoint_every,
                         resume=args.resume or attempt > 0, emulation=emulation,
                         max_seconds=args.max_seconds or 0.0,
                         replica_assignment=_replica_assignment(plan, profile, cluster), attempt=attempt)
    chain = chain_for(plan, config)
    n_layers = chain.num_layers
    if n_layers != profile.num_layers:  # the plan was validated against the profile: name where it differs
        if n_layers < profile.num_layers:
            w, k = next((w, k) for w, vw in enumerate(plan.virtual_workers) for k, st in enumerate(vw.stages)
                        if st.stop > n_layers)
            where = f"virtual_workers[{w}].stages[{k}] holds layer {n_layers}, which the model does not have"
        else:
            where = f"no stage of the plan holds layers [{profile.num_layers}, {n_layers})"
        raise PartitionerError(f"model '{args.model}' has {n_layers} layers but the profile has "
                               f"{profile.num_layers}: {where}; profile the same model and plan again")
    try:
        run = prepare(plan, config, chain)  # the one run every rank receives; refusals before any process starts
    except FormatError as err:
        raise err.in_file(plan_file) from None
    return Prepared(plan, plan_file, profile, config, run, recipe)


def _predicted(args: argparse.Namespace, ready: Prepared, cluster: Cluster) -> float:
    """The simulator's iteration time of the plan trained (emulated: on the emulation's terms)."""
    from partitioner.emulation import predict_emulated
    from partitioner.simulate import simulate_plan

    emulation = ready.config.emulation
    if emulation is None:
        return simulate_plan(ready.plan, ready.profile, cluster).iteration_s
    return predict_emulated(ready.plan, ready.profile, cluster, local=emulation.local,
                            reference=args.emulate_reference, link_gbps=emulation.link_gbps,
                            links=emulation.links).iteration_s


def _run(args: argparse.Namespace) -> int:
    from runtime.model import is_model_ref

    check_outputs({"-o": args.output}, (args.plan, args.profile, args.cluster))
    plan = Plan.load(args.plan)
    if plan.model != args.model and not is_model_ref(args.model):
        raise PartitionerError(f"{args.plan}: the plan is for model '{plan.model}', not '{args.model}'")
    _check_elastic(args)
    full_profile = Profile.load(args.profile)
    cluster = Cluster.load(args.cluster)
    ready = prepare_plan(args, plan, args.plan, full_profile, cluster)
    if args.launch_lines:
        return _print_launch_lines(args, ready.run.layout, ready.config)
    if ready.config.emulation is not None:
        _print_emulation(ready.config.emulation, plan)
    trained = _train(args, ready, full_profile, cluster)
    if trained is None:  # a rank other than 0 under torchrun
        return 0
    metrics, ready = trained  # after --elastic restarts, the plan the run ended on
    plan, config, profile, recipe, emulation = ready.plan, ready.config, ready.profile, ready.recipe, ready.config.emulation
    predicted = _predicted(args, ready, cluster)
    metrics["predicted_iteration_s"] = predicted
    metrics["measured_over_predicted"] = metrics["measured_iteration_s"] / predicted if predicted > 0 else None
    ran = len(metrics["step_s"])
    resumed = f", resumed at step {metrics['first_step']}" if metrics.get("first_step") else ""
    print(f"{config.model} {plan.schedule}: {metrics['world_size']} processes, {ran} steps{resumed} "
          f"(median of the last {max(1, ran - config.warmup)}), data {metrics['data']}")
    emulated = " (emulated)" if emulation else ""
    print(f"  measured iteration  {metrics['measured_iteration_s'] * 1e3:9.2f} ms{emulated}")
    print(f"  predicted iteration {predicted * 1e3:9.2f} ms  (simulator"
          + ((f", emulated times of {emulation.local} and the plan's links x{emulation.time_scale:.3g})"
              if emulation.links else f", emulated times of {emulation.local} and links at {emulation.link_gbps:g} GB/s)")
             if emulation else ")"))
    if emulation is not None and emulation.rule == "profiled":
        ranks = metrics["emulated"]["ranks"]
        over, total = sum(r["overruns"] for r in ranks), sum(r["actions"] for r in ranks)
        print(f"  emulation overruns  {over} of {total} forward/backward actions computed longer than their "
              "emulated time" + (" (this machine is too slow for the reference: name a faster one)" if over else ""))
    _report_memory(metrics, plan, profile, cluster, recipe, config.lr)
    if metrics["loss"]:
        what = "mean of the output" if metrics["data"] == "synthetic" else "training loss"
        print(f"  loss {metrics['loss'][0]:.5g} -> {metrics['loss'][-1]:.5g}  ({what})")
    if config.checkpoint_dir:
        print(f"  checkpoints in {config.checkpoint_dir}")
    if metrics.get("torchrun_restarts"):
        print(f"  torchrun restarted the job {metrics['torchrun_restarts']} time(s) (TORCHELASTIC_RESTART_COUNT); "
              f"this attempt ran on the same plan")
    if metrics.get("restarts"):
        print(f"  elastic: {len(metrics['restarts'])} restart(s); the run ended on {ready.plan_file} "
              f"({len(plan.devices)} devices)")
    if args.output:
        from partitioner._io import write_json

        clean, lost = _finite_or_null(metrics)
        if lost:  # a diverged loss: the figures are still worth keeping, as strict JSON
            print(f"note: {lost} value(s) were not finite (a diverged loss?) and are written as null")
        write_json(args.output, clean)
        print(f"wrote {args.output}")
    return 0


def _train_args(args: argparse.Namespace, plan: str, resume: bool, lr: float | None = None) -> list[str]:
    """This command's plan and options (``plan`` for the plan; ``--resume`` when ``resume``; ``lr``
    the learning rate the run uses, else the one given)."""
    lr = lr if lr is not None else args.lr
    train = [plan, "--profile", args.profile, "--cluster", args.cluster, "--model", args.model,
             "--data", args.data, "--steps", str(args.steps), "--warmup", str(args.warmup),
             *(["--lr", repr(lr)] if lr is not None else []),
             "--seed", str(args.seed), "--device", args.device, "--timeout", repr(args.timeout)]
    if args.threads:
        train += ["--threads", str(args.threads)]
    if args.optimizer:
        train += ["--optimizer", args.optimizer]
    if args.checkpoint_dir:
        train += ["--checkpoint-dir", args.checkpoint_dir, "--checkpoint-every", str(args.checkpoint_every)]
    if resume:
        train.append("--resume")
    if args.output:
        train += ["-o", args.output]
    return train


def _print_launch_lines(args: argparse.Namespace, layout: Layout, config: Any) -> int:
    """The torchrun line of every node of the plan, this command's options carried over."""
    print("\n".join(launch_lines(layout, _train_args(args, args.plan, args.resume, config.lr), args.rdzv_endpoint)))
    return 0


def _check_elastic(args: argparse.Namespace) -> None:
    """``--elastic`` and ``--max-restarts``: refused in one line where they cannot work."""
    if not args.elastic:
        if args.max_restarts is not None:
            raise PartitionerError("--max-restarts: only with --elastic")
        return
    if not args.local:
        raise PartitionerError("--elastic: only with --local (under torchrun, a lost rank ends the job with the "
                               "commands that continue it on a new plan; docs/runtime.md)")
    if not args.checkpoint_dir:
        raise PartitionerError("--elastic: needs --checkpoint-dir (a restart resumes from the last complete "
                               "checkpoint there)")


def _train(args: argparse.Namespace, ready: Prepared, profile: Profile, cluster: Cluster
           ) -> tuple[dict[str, Any], Prepared] | None:
    """Train locally or under torchrun; returns the metrics and the plan the run ended on (rank 0),
    or None (the other ranks under torchrun). A lost rank under ``--local`` also prints (on
    stdout) the commands that continue the run without its device, before the one-line error;
    with ``--elastic`` those steps are taken here (:mod:`partitioner_cli.elastic`)."""
    from runtime.launch import GroupLost, RankFailed, train_distributed, train_local

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.local and under_torchrun:
        raise PartitionerError("--local starts its own processes; do not combine it with torchrun")
    if not args.local and not under_torchrun:
        raise PartitionerError("run under torchrun (RANK and WORLD_SIZE set) or pass --local to start one "
                               "process per plan device on this machine")
    if not args.local:
        try:
            metrics = train_distributed(ready.plan, ready.config, run=ready.run)
        except GroupLost:
            print("\n".join(torchrun_continue_lines(args)), flush=True)
            raise
        return None if metrics is None else (metrics, ready)
    if args.elastic:
        from partitioner_cli.elastic import train_elastic

        return train_elastic(args, ready, profile, cluster,
                             lambda plan, plan_file, attempt: prepare_plan(args, plan, plan_file, profile, cluster,
                                                                           attempt),
                             lambda device, plan_file: continue_lines(args, device, plan_file))
    try:
        return train_local(ready.plan, ready.config, run=ready.run), ready
    except RankFailed as err:
        print("\n".join(continue_lines(args, ready.run.layout.ranks[err.rank].gpu)), flush=True)
        raise


def continue_lines(args: argparse.Namespace, device: str, plan_file: str = "") -> list[str]:
    """What to run to continue without ``device``: ``partitioner replan`` of the plan (``plan_file``,
    default this command's) without it, then this training on the new plan with ``--resume``
    (from the last complete checkpoint)."""
    from partitioner_cli.elastic import plan_without

    plan_file = plan_file or args.plan
    new_plan = plan_without(plan_file, device)
    replan = ["partitioner", "replan", plan_file, "--profile", args.profile, "--cluster", args.cluster,
              "--without", device, "-o", new_plan]
    train = ["partitioner", "train", *_train_args(args, new_plan, bool(args.checkpoint_dir)), "--local"]
    where = (f"from the last complete checkpoint in {args.checkpoint_dir}" if args.checkpoint_dir else
             "from step 0: this run wrote no checkpoints (no --checkpoint-dir)")
    return [f"device {device} is lost; to continue without it, re-plan and resume {where}:",
            f"  {shlex.join(replan)}", f"  {shlex.join(train)}"]


def torchrun_continue_lines(args: argparse.Namespace) -> list[str]:
    """Under torchrun, when the process group failed: what continues the run. torchrun's
    ``--max-restarts`` starts every process again with the same world size, so on the same plan
    (resuming with ``--resume``); a device gone for good needs a plan without it, whose torchrun
    lines ``--launch-lines`` prints (``DEVICE``: the one torchrun's report names)."""
    from partitioner_cli.elastic import plan_without

    device = "DEVICE"
    new_plan = plan_without(args.plan, device)
    replan = ["partitioner", "replan", args.plan, "--profile", args.profile, "--cluster", args.cluster,
              "--without", device, "-o", new_plan]
    train = ["partitioner", "train", *_train_args(args, new_plan, bool(args.checkpoint_dir)), "--launch-lines",
             "--rdzv-endpoint", args.rdzv_endpoint]
    where = (f"from the last complete checkpoint in {args.checkpoint_dir}" if args.checkpoint_dir else
             "from step 0: this run wrote no checkpoints (no --checkpoint-dir)")
    return [f"a process of this job is lost: torchrun --max-restarts starts every process again on this plan (the "
            f"same world size; with --resume, {where}); to continue without a device gone for good (DEVICE: "
            f"the one torchrun's report names), re-plan and start the new plan's torchrun lines:",
            f"  {shlex.join(replan)}", f"  {shlex.join(train)}"]


def launch_lines(layout: Layout, train_args: Sequence[str], rdzv_endpoint: str, rdzv_id: str = "partitioner"
                 ) -> list[str]:
    """One torchrun command line per node of the plan (run each on its machine): this command with
    ``train_args`` and the node's name (``--plan-node``). The runtime seats every process itself
    from its node's name (runtime/nodes.py), so the nodes join c10d's rendezvous in any order; the
    node list and the command are the ones the exports write (:mod:`partitioner.launch`)."""
    from partitioner.launch import torchrun_command
    from runtime.nodes import layout_nodes

    nodes = layout_nodes(layout)
    lines = []
    for k, n in enumerate(nodes):
        cmd = torchrun_command(nodes, k, ["-m", "partitioner_cli", "train", *train_args, "--plan-node", n.node],
                               rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id, visible_devices=False)
        lines.append(f"# node {n.node}: {', '.join(layout.ranks[r].gpu for r in n.ranks)}\n" + cmd)
    return lines


# build_model's keyword for each field of a zoo profile's ``meta.config``
_ZOO_OPTIONS = {"seq_len": "seq_len", "image_size": "image_size", "width": "width", "vocab": "vocab",
                "blocks": "num_blocks"}


def zoo_options(profile: Profile) -> dict[str, Any]:
    """The shape a zoo model was profiled with (sequence length, image size, width, vocabulary,
    blocks), so that training builds the model that was measured and planned, not the zoo's
    default (a profile at ``--seq-len 512`` trained at GPT-2's default 1,024 would run a
    different model from the one the plan was priced for)."""
    config = profile.meta.get("config") or {}
    return {_ZOO_OPTIONS[k]: v for k, v in config.items() if k in _ZOO_OPTIONS}


def _report_memory(metrics: dict[str, Any], plan: Plan, profile: Profile, cluster: Cluster, recipe: Any,
                   lr: float) -> None:
    """The run's optimizer and precision (and what differs from the plan's pricing), then each rank's measured memory beside the cost model's, priced as the run trained (its
    precision and optimizer, no reserved memory: neither measure counts the framework's own), into
    ``metrics`` (``memory``) and printed. CUDA: the peak of torch.cuda.max_memory_allocated
    against the simulator's peak. CPU: each rank's model state (parameters, gradients, optimizer
    state) plus the most activations it held at once (:mod:`runtime.memory`) against the
    simulator's peak; the model state alone against the cost model's where no activations were
    counted."""
    from dataclasses import replace


    how = "as the plan was priced" if plan.pricing is not None and not recipe.notes else "see the note"
    print(f"  optimizer {recipe.optimizer} (lr {lr:g}), precision {recipe.precision}  ({how})")
    for note in recipe.notes:
        print(f"  note: {as_flags(note)}")
    ranks = metrics.get("ranks", [])
    if not ranks:
        return
    options = replace(recipe.pricing(plan.pricing), reserved_bytes=0.0)
    cuda = all(r.get("peak_memory_bytes") for r in ranks)
    counted = all(r.get("activation_peak_bytes") is not None for r in ranks)
    state = _model_state_predicted(plan, profile, cluster, options, ranks)
    if cuda or counted:
        from partitioner.simulate import simulate_plan

        predicted = dict(simulate_plan(plan, profile, cluster, options).peak_memory_bytes)
    if cuda:
        what = ("peak: torch.cuda.max_memory_allocated (weights, gradients, optimizer state, activations; no "
                "CUDA context) against the simulator's peak")
        measured = {r["device"]: r["peak_memory_bytes"] for r in ranks}
    elif counted:
        what = ("peak: model state (parameters, gradients, optimizer state) + the most activations held at once "
                "(tensors saved for backward and held between actions, runtime.memory) against the simulator's peak")
        measured = {r["device"]: r["model_state_bytes"] + r["activation_peak_bytes"] for r in ranks}
    else:
        predicted = state
        what = ("model state: bytes of the parameters, gradients and optimizer state held (no activations "
                "measured) against the cost model's for the rank's layers")
        measured = {r["device"]: r.get("model_state_bytes") for r in ranks}
    kind = "peak_memory_bytes" if cuda else "model_state_bytes + activation_peak_bytes" if counted else \
        "model_state_bytes"
    metrics["memory"] = {"measured": kind, "what": what,
                         "priced_as": options.to_dict(),
                         "ranks": [{"rank": r["rank"], "device": r["device"], "measured_bytes": measured[r["device"]],
                                    "predicted_bytes": predicted.get(r["device"]),
                                    "model_state_bytes": r.get("model_state_bytes"),
                                    "predicted_model_state_bytes": state.get(r["device"])} for r in ranks]}
    metrics["predicted_peak_memory_bytes"] = {d: predicted.get(d) for d in measured}
    print(f"  memory per rank ({what}; priced for {recipe.optimizer} in {recipe.precision}, nothing reserved)")
    for row in metrics["memory"]["ranks"]:
        got, want = row["measured_bytes"], row["predicted_bytes"]
        ratio = f"  ({got / want:.2f}x)" if got and want else ""
        print(f"    rank {row['rank']}  {row['device']:<8} measured {_size(got):>10}  predicted {_size(want):>10}{ratio}")


def _model_state_predicted(plan: Plan, profile: Profile, cluster: Cluster, options: Any,
                           ranks: list[dict[str, Any]]) -> dict[str, float]:
    """The cost model's model state (weights, gradients, optimizer state) of each rank's layers:
    per GPU of a tensor-parallel group its shard's, under ZeRO each layer's state shared by its holders."""
    from partitioner.cost import CostModel

    cost = CostModel(plan.profile_view(profile), cluster, options)
    holders = cost.layer_holders(plan)
    out = {}
    for r in ranks:
        t = cluster.device(r["device"]).tensor_parallel
        runs = [run for a, b in r["layers"] for run in
                (cost.holder_runs(a, b, holders) if options.zero else [(a, b, 1)])]
        out[r["device"]] = sum(cost.weight_bytes(a, b, tensor_parallel=t, holders=d) for a, b, d in runs)
    return out


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _replica_assignment(plan: Plan, profile: Profile, cluster: Cluster) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Which replica of a replicated stage runs each micro-batch: the simulator's rule, on the
    cost model's forward + backward time of the stage on each replica's GPU type."""
    if not any(st.replicas for vw in plan.virtual_workers for st in vw.stages):
        return ()
    from partitioner.cost import CostModel
    from partitioner.placement import replica_assignment

    cost = CostModel(plan.profile_view(profile), cluster)
    return replica_assignment(plan, lambda d, a, b: cost.compute_s(cluster.device(d).gpu_type, a, b))


def _emulation(args: argparse.Namespace, plan: Plan, profile: Profile, cluster: Cluster) -> Any:
    """The plan's emulation (``--emulate``), refused in one line before any process starts."""
    if not args.emulate:
        given = [o for o, v in (("--emulate-reference", args.emulate_reference), ("--emulate-local", args.emulate_local),
                                ("--emulate-link-GBps", args.emulate_link_gbps),
                                ("--emulate-rule", args.emulate_rule),
                                ("--emulate-links", args.emulate_links or None)) if v is not None]
        if given:
            raise PartitionerError(f"{', '.join(given)}: only with --emulate")
        return None
    from partitioner.emulation import LOCAL_DEVICE, LOCAL_LINK_GBPS, emulation_for

    try:
        return emulation_for(plan, profile, cluster, local=args.emulate_local or LOCAL_DEVICE,
                             reference=args.emulate_reference,
                             link_gbps=args.emulate_link_gbps if args.emulate_link_gbps is not None else LOCAL_LINK_GBPS,
                             rule=args.emulate_rule or "profiled", links=args.emulate_links)
    except FormatError as err:
        raise err.in_file(args.profile) from None


def _print_emulation(emulation: Any, plan: Plan) -> None:
    print(f"EMULATION: every rank plays its device's GPU type on this machine ({emulation.local}); "
          f"reference {emulation.reference} runs at this machine's speed; rule {emulation.rule}; "
          + (f"all-reduces between virtual workers take the plan's links x{emulation.time_scale:.3g} (the emulation's "
             "time scale), sends between stages are real (gloo)" if emulation.links else "communication is real (gloo)"))
    for d in plan.devices:
        factors = "; ".join(f"stage {s}: forward x{f:.3g}, backward x{b:.3g}"
                            for s, (f, b) in sorted(emulation.factors(d).items()))
        print(f"  {d} plays {emulation.gpu_type(d)}: {factors}")


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
    p = sub.add_parser("train", help="train a zoo model (or your own) with a plan (torch.distributed)",
                       description="Execute PLAN's schedule on torch.distributed (gloo on CPU, NCCL on GPU): "
                                   "one process per plan device; synchronous data parallelism between virtual "
                                   "workers (gpipe, 1f1b, interleaved, bfs), PipeDream-2BW (2bw) or WSP with the "
                                   "plan's staleness (wsp). Reports the measured iteration time against the simulator's.")
    add_plan_inputs(p)
    p.add_argument("--model", required=True,
                   help="zoo model to train (must be the plan's model), or module:function returning a "
                        "runtime.model.ModelSpec (docs/runtime.md)")
    p.add_argument("--data", choices=("auto", "text", "classes", "synthetic"), default="auto",
                   help="training data: auto (default) is the model's real task -- text (the Python standard "
                        "library's sources, bytes) for gpt2/bert, classes (a generated image classification "
                        "task) for CNNs, make_batch for a user's model; synthetic: random inputs, loss = mean "
                        "of the output (throughput only)")
    p.add_argument("--steps", type=bounded_int(1, 1_000_000), default=10,
                   help="training steps (default 10); with --max-seconds, the most that are run")
    p.add_argument("--max-seconds", type=bounded_float(1e-3, 7 * 86400.0), default=None, metavar="SECONDS",
                   help="end the run by time: no step (wsp: no wave of a virtual worker) starts after SECONDS, so "
                        "a fast virtual worker runs more wsp waves than a slow one (wsp: one device per virtual "
                        "worker; not 2bw, not with checkpoints)")
    p.add_argument("--warmup", type=bounded_int(0, 1_000_000), default=2, help="steps left out of the timing (default 2)")
    p.add_argument("--lr", type=bounded_float(1e-12, 1e6), default=None,
                   help="the optimizer's learning rate (default 0.01 for sgd, 0.001 for adam and adamw)")
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default=None,
                   help="default: as the plan was priced (its optimizer state: 2 words per parameter is adam, 0 "
                        "sgd; a plan made by hand without pricing: sgd); a mismatch with the pricing is said in "
                        "one line. The plan's precision (fp32, or bf16/fp16 mixed precision with fp32 master "
                        "weights; fp16 with loss scaling) is always run")
    p.add_argument("--seed", type=bounded_int(0, 2**63 - 1), default=0, help="seed of the initial weights and the data (default 0)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (NCCL)")
    p.add_argument("--threads", type=bounded_int(0, 4096), default=0,
                   help="torch threads per process (default: this machine's cores / processes)")
    p.add_argument("--timeout", type=bounded_float(1.0, 7 * 86400.0), default=300.0, metavar="SECONDS",
                   help="wall-clock limit of the training job, not a solver's time limit: every collective "
                        "waits at most this long, and with --local the processes still running this long "
                        "(+30 s to start) are stopped (default 300)")
    p.add_argument("--local", action="store_true", help="start one process per plan device on this machine")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="write checkpoints here (per rank, atomic; at the end "
                                                          "and every --checkpoint-every steps)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="checkpoint every N steps (default 0: only at the end)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the last complete checkpoint in --checkpoint-dir (a fresh start if none)")
    p.add_argument("--elastic", action="store_true",
                   help="with --local and --checkpoint-dir: when a rank dies, re-plan over the devices left (as "
                        "`partitioner replan --without DEVICE`, the new plan written beside the plan as "
                        "PLAN-without-DEVICE.json) and resume from the last complete checkpoint, up to "
                        "--max-restarts times; each restart is one line and is recorded in the metrics (restarts)")
    p.add_argument("--max-restarts", type=bounded_int(0, 1000), default=None, metavar="N",
                   help="with --elastic: at most N restarts (default 3); the next lost rank ends the run with the "
                        "commands that continue it")
    emu = p.add_argument_group("heterogeneity emulation (docs/runtime.md)")
    emu.add_argument("--emulate", action="store_true",
                     help="every rank plays the GPU type the plan gives its device: its forward and backward are "
                          "stretched by that type's profiled time relative to the reference (communication is real)")
    emu.add_argument("--emulate-reference", metavar="TYPE", default=None,
                     help="the GPU type that runs at this machine's speed (default: the fastest of the cluster's "
                          "types, per layer); must have times in the profile")
    emu.add_argument("--emulate-local", metavar="KEY", default=None,
                     help="the profile's key of this machine's own times (default cpu: partitioner profile --device cpu)")
    emu.add_argument("--emulate-link-GBps", dest="emulate_link_gbps", type=bounded_float(1e-6, 1e6), default=None,
                     metavar="GBPS", help="link speed the emulated prediction assumes for every link (default 2: "
                                          "gloo over loopback, as examples/clusters/cpu4.yaml)")
    emu.add_argument("--emulate-rule", choices=("profiled", "scaled"), default=None,
                     help="profiled (default): a forward or backward takes its stage's emulated time, or its compute "
                          "time when longer (an overrun); scaled: its measured compute time x its stage's factor")
    emu.add_argument("--emulate-links", action="store_true",
                     help="the all-reduces between virtual workers (and wsp's pushes) take the time the cost model "
                          "gives them on the plan's cluster, times the emulation's time scale (this machine's time "
                          "of the model over the reference's); sends between stages stay real")
    p.add_argument("-o", "--output", metavar="METRICS.json", help="write the metrics here")
    p.add_argument("--plan-node", metavar="NAME", help="under torchrun: the plan node this machine is (default: "
                                                        "the GROUP_RANK-th node the plan uses); see --launch-lines")
    p.add_argument("--launch-lines", action="store_true",
                   help="print the torchrun command of every node of the plan (run each on its machine) "
                        "and exit")
    p.add_argument("--rdzv-endpoint", default="HOST0:29500", metavar="HOST:PORT",
                   help="the rendezvous address written into --launch-lines (default HOST0:29500: replace "
                        "HOST0 with the first node's address)")
    p.set_defaults(func=_run)
