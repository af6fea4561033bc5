"""``partitioner export PLAN --to TARGET -o OUT``: a plan as torch.distributed.pipelining,
DeepSpeed or Megatron-LM take it (docs/export.md).

    partitioner export plan.json --to torch-pipelining -o plan.torch.json
    partitioner export plan.json --to deepspeed -o plan.ds.json --snippet ds_module.py --hostfile hostfile
    partitioner export plan.json --to megatron --check t0,a0     (a launch order, checked against the plan)
"""

from __future__ import annotations

import argparse

from partitioner.errors import PartitionerError
from partitioner.export import TARGETS, export_plan
from partitioner.plan import Plan

__all__ = ["register"]


def _layer_names(plan: Plan, profile_path: str | None, n_layers: int) -> list[str] | None:
    """Module names of the plan's layers: the profile's, else the zoo model's (None if neither)."""
    if profile_path:
        from partitioner.profile import Profile

        profile = Profile.load(profile_path)
        if profile.num_layers != n_layers:
            raise PartitionerError(f"{profile_path}: the profile has {profile.num_layers} layers, the plan "
                                   f"{n_layers}; give the profile the plan was made for")
        return [layer.name for layer in profile.layers]
    from partitioner.models import MODEL_NAMES, build_model

    if plan.model not in MODEL_NAMES:
        return None
    zoo = build_model(plan.model, plan.micro_batch_size, device="meta")
    if len(zoo.layers) != n_layers:
        return None
    return [name for name, _ in zoo.layers]


def _summary(e: dict) -> list[str]:
    t = e["target"]
    if t == "torch-pipelining":
        tp = e.get("tensor_parallel", 1)
        lines = [f"{e['model']} for torch.distributed.pipelining: {e['world_size']} ranks, {e['schedule_class']}, "
                 f"n_microbatches {e['n_microbatches']}, {e['stages_per_rank']} stage(s) per rank"
                 + (f", tensor parallel {tp} (each stage's group a DeviceMesh; pipeline group i: the ranks of index "
                    "i)" if tp > 1 else "")]
        for p in e["pipelines"]:
            lines.append(f"  pipeline {p['virtual_worker']} (ranks {p['ranks'][0]}-{p['ranks'][-1]}, batch rows "
                         f"[{p['batch_rows'][0]}, {p['batch_rows'][1]})): "
                         + ", ".join(f"stage {s['stage']} layers [{s['layers'][0]}, {s['layers'][1]}) on "
                                     + (f"rank {s['rank']} ({s['device']})" if tp == 1 else
                                        f"ranks {s['ranks'][0]}-{s['ranks'][-1]} ({s['device']})") for s in p["stages"]))
            if p["split_spec"] is not None:
                lines.append(f"    split_spec: {', '.join(f'{k}: BEGINNING' for k in p['split_spec'])}")
        if e["grad_sync"]:
            lines.append(f"  gradients averaged over {len(e['grad_sync'])} rank set(s) (grad_sync)")
        return lines
    if t == "deepspeed":
        how = ("partition_method='uniform'" if e["partition_method"] == "uniform"
               else "PipelineModule._partition_layers overridden (see snippet)")
        return [f"{e['model']} for DeepSpeed PipelineModule: num_stages {e['num_stages']}, data parallel "
                f"{e['data_parallel']}, parts {e['parts']} ({how})",
                f"  ranks ({e['rank_order']}): " + ", ".join(f"{r['rank']}={r['device']}" for r in e["ranks"])]
    tp = f" x tensor {e['tensor_parallel']}" if e.get("tensor_parallel", 1) > 1 else ""
    lines = [f"{e['model']} for Megatron-LM: pipeline {e['pipeline_parallel']} x data {e['data_parallel']}{tp}, "
             f"transformer layers per stage {e['transformer_layers_per_stage']}",
             f"  --pipeline-model-parallel-layout '{e['layout']}'"]
    if e["uneven_args"] is not None:
        lines.append("  or: " + " ".join(e["uneven_args"]))
    else:
        lines.append(f"  (no --decoder-first/last-pipeline-num-layers form: {e['uneven_args_unavailable']})")
    return lines


def _training_lines(e: dict) -> list[str]:
    t = e["training"]
    lines = [f"  training: {t['precision']}, {t['optimizer']} (lr {t['lr']:g}), ZeRO stage {t['zero_stage']}"
             + (f"  ({t['note']})" if t.get("note") else "  (as the plan was priced)")]
    launch = e["launch"]
    order = f", ranks {e['rank_order']}" if e.get("rank_order") else ""
    lines.append(f"  launch{order}: start the nodes in the order {', '.join(n['node'] for n in launch['nodes'])} "
                 f"(node k with --node-rank k; {launch['master_node']} is the master address)")
    for n, cmd in zip(launch["nodes"], launch["torchrun"]):
        lines.append(f"    # node {n['node']}: ranks {n['ranks']} on {', '.join(n['devices'])}")
        lines.append(f"    {cmd}")
    if e["target"] == "deepspeed":
        if launch["deepspeed"]:
            lines.append("    or, with the hostfile (nodes in rank order): " + launch["deepspeed"])
        else:
            lines.append(f"    (not deepspeed's launcher: {launch['deepspeed_unavailable']})")
    return lines


def _run(args: argparse.Namespace) -> int:
    from partitioner._io import atomic_write_text, check_outputs, write_json
    from partitioner.export import check_export_launch

    if args.to not in TARGETS:
        raise PartitionerError(f"unknown target '{args.to}'; valid targets: {', '.join(TARGETS)}")
    if not args.output and not args.check:
        raise PartitionerError("give -o OUT.json (where to write the export), or --check a launch order")
    if args.hostfile and args.to != "deepspeed":
        raise PartitionerError(f"--hostfile is DeepSpeed's launcher's; target {args.to} starts with the torchrun lines")
    check_outputs({"-o": args.output, "--snippet": args.snippet, "--hostfile": args.hostfile},
                  [p for p in (args.plan, args.profile, args.check) if p])
    plan = Plan.load(args.plan)
    n_layers = plan.virtual_workers[0].stages[-1].stop
    names = _layer_names(plan, args.profile, n_layers) if args.to == "torch-pipelining" else None
    try:
        exported = export_plan(plan, args.to, names, lr=args.lr)
    except PartitionerError as err:
        raise PartitionerError(f"{args.plan}: {err}") from None
    if args.check:
        try:
            print(check_export_launch(exported, args.check))
        except PartitionerError as err:
            raise PartitionerError(f"{args.check}: {err}") from None
    if not args.output:
        return 0
    write_json(args.output, exported)
    for line in [*_summary(exported), *_training_lines(exported)]:
        print(line)
    print(f"wrote {args.output}")
    if args.snippet:
        atomic_write_text(args.snippet, exported["snippet"])
        print(f"wrote {args.snippet}")
    if args.hostfile:
        atomic_write_text(args.hostfile, exported["launch"]["hostfile"])
        print(f"wrote {args.hostfile}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write a plan as torch.distributed.pipelining, DeepSpeed or Megatron-LM take it",
                       description="Turn PLAN into what another framework needs to run it: stage layer ranges, "
                                   "split points and schedule for torch.distributed.pipelining; PipelineModule "
                                   "parts for DeepSpeed; pipeline layout and uneven-stage arguments for "
                                   "Megatron-LM; the plan's precision, optimizer and launch order (torchrun lines per node, a "
                                   "DeepSpeed hostfile) for every target. A plan the target cannot run is refused with "
                                   "the reason.")
    p.add_argument("plan", help="plan JSON (from `partitioner plan`)")
    p.add_argument("--to", required=True, metavar="TARGET", help=f"one of: {', '.join(TARGETS)}")
    p.add_argument("-o", "--output", metavar="OUT.json", help="write the export here (required unless --check)")
    p.add_argument("--check", metavar="HOSTFILE_OR_RANKS",
                   help="verify a launch order against the plan's stage -> GPU mapping and refuse (one line) one that "
                        "breaks it: a DeepSpeed hostfile (HOST slots=N lines, in launch order), the devices of "
                        "ranks 0, 1, ... (n1:0,n1:1,n0:0) or the nodes in launch order (n1,n0)")
    p.add_argument("--lr", type=float, default=None,
                   help="the learning rate written into the export (default: the runtime's for the plan's optimizer: "
                        "0.001 for adam, 0.01 for sgd)")
    p.add_argument("--hostfile", metavar="FILE", help="deepspeed: also write the hostfile (nodes in rank order) here")
    p.add_argument("--profile", help="profile whose layer names give torch's split_spec (default: the zoo "
                                     "model's layer names, when the plan's model is in the zoo)")
    p.add_argument("--snippet", metavar="FILE", help="also write the ready code snippet here")
    p.set_defaults(func=_run)
