"""Plans in the form other training frameworks take them (torch-free).

Three targets, each a JSON-ready dict (``partitioner.export/1``) with a ready snippet:

``torch-pipelining``
    What ``torch.distributed.pipelining`` needs: per pipeline and stage the layer range, the
    rank that runs it and its device; the split points of ``pipeline(..., split_spec=...)``
    as module names (``SplitPoint.BEGINNING`` of each stage's first layer, for a model built
    as an ``nn.Sequential`` of the profile's layers); torch's schedule class and
    ``n_microbatches``; the rows of the global batch each pipeline trains on; and, with several
    virtual workers, the sets of ranks whose gradients are averaged (one set per group of
    layers with the same holders). ``runtime.torch_pipelining`` builds the per-rank
    ``PipelineStage`` objects of a zoo model and the schedule from it.
``deepspeed``
    The layer boundaries of DeepSpeed's ``PipelineModule`` (its ``parts``: stage ``s`` holds
    layers ``[parts[s], parts[s + 1])``), the pipeline and data-parallel degrees, the rank ->
    device order of DeepSpeed's pipe x data topology and a DeepSpeed config. DeepSpeed's
    ``partition_method`` accepts only ``'parameters'``, ``'uniform'`` and ``'type:REGEX'``; a
    partition that is none of these needs ``PipelineModule._partition_layers`` overridden, which
    the snippet does.
``megatron``
    Megatron-LM arguments for a GPT-style chain (embedding, transformer layers, output head):
    the pipeline layout string of ``--pipeline-model-parallel-layout`` (any contiguous split),
    and, where the split has equal middle stages, the older
    ``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` form.

Every target also gets the plan's training (``training``: precision, optimizer and learning
rate, ZeRO stage 0; in DeepSpeed's config and Megatron-LM's arguments too) and a launch order
(``launch``: the nodes in the order of their ranks, each with ``CUDA_VISIBLE_DEVICES`` and its
torchrun line with ``--node-rank``; DeepSpeed's hostfile), so that the plan's stage -> GPU mapping
holds (:mod:`partitioner.launch`; :func:`check_export_launch` checks a hostfile or rank order).

Tensor parallelism (a plan device ``NODE:FIRST-LAST``, a group of ``t`` GPUs): every rank of an
export is one GPU (``ranks[r]['gpu']``; ``device`` the plan's group), the launch order puts each on
its GPU. torch-pipelining numbers a group's GPUs as ``t`` consecutive ranks (the project runtime's
order), lists each device's group (``tp_groups``: a ``DeviceMesh`` sub-mesh that
``runtime.torch_pipelining`` shards the stage's blocks over with the runtime's own plans) and one
pipeline group per tensor-parallel index (``pipe_groups``); Megatron-LM gets
``--tensor-model-parallel-size t`` and its rank order with the index fastest. One degree per
plan: torch's ``PipelineStage`` sends to one rank of one group, and Megatron-LM has one size per
job, so mixed degrees are refused; DeepSpeed's pipeline engine has no tensor parallelism of its
own and refuses any group.

A plan a target cannot run raises :class:`ExportError`, one line naming what the target lacks.
"""

from __future__ import annotations

import itertools
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import FormatError, PartitionerError
from .launch import (
    NodeLaunch,
    check_launch,
    contiguity_problem,
    deepspeed_launcher_problem,
    group_gpus,
    hostfile,
    node_launches,
    torchrun_command,
)
from .plan import Plan, VirtualWorker, group_size
from .pricing import DEFAULT_LR, priced_optimizer
from .schedule import spec, stage_rank

__all__ = ["EXPORT_FORMAT", "TARGETS", "TORCH_SCHEDULE_CLASSES", "ExportError", "check_export_launch",
           "deepspeed_uniform_parts", "export_plan", "megatron_layer_kinds", "training_of"]

EXPORT_FORMAT = "partitioner.export/1"
TARGETS = ("torch-pipelining", "deepspeed", "megatron")
# The plan's flushing schedules and the torch.distributed.pipelining class that runs each.
# zb-h1 is torch's ZB1P (ScheduleInterleavedZeroBubble over one stage per rank builds the same
# lists); zbv its ScheduleZBVZeroBubble (two stages per rank in a V); zb-h2 has no torch class.
TORCH_SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
                          "interleaved": "ScheduleInterleaved1F1B", "bfs": "ScheduleLoopedBFS",
                          "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}
# the classes that take a list of stages (PipelineScheduleMulti), and of them those with several per rank
MULTI_STAGE_CLASSES = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
                       "ScheduleZBVZeroBubble")
_MULTI_STAGE_CLASSES = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleZBVZeroBubble")


class ExportError(PartitionerError):
    """The target cannot run the plan; the message says what it lacks (one line)."""

    def __init__(self, target: str, what: str):
        super().__init__(f"{target} cannot run this plan: {what}")


# -- shared checks and tables ---------------------------------------------------------------


def _cuts(vw: VirtualWorker) -> list[int]:
    return [*(s.start for s in vw.stages), vw.stages[-1].stop]


def _check_plan(plan: Plan, target: str) -> int:
    """Refuse what no target runs; check the stages cover ``[0, L)`` in order. Returns ``L``."""
    if plan.layer_order is not None:
        raise ExportError(target, "layer_order: the stages are convex sets of the model's graph, not ranges of its "
                                  f"layer list, which {target} splits; plan the chain order (the dp solver, or "
                                  "`chain_order`)")
    sp = spec(plan.schedule)
    if not sp.flushes:
        what = ("bounded staleness between virtual workers (Wave Synchronous Parallel)" if sp.sync == "wave"
                else "double-buffered weights (PipeDream-2BW)")
        raise ExportError(target, f"schedule {plan.schedule} needs {what}, which {target} does not implement; "
                                  f"re-plan with gpipe, 1f1b, interleaved or bfs")
    if plan.overlaps_iterations:
        raise ExportError(target, f"pricing.overlap_iterations: {target} ends every step with a flush, so it would "
                                  "not run the overlapping iterations this plan is priced with; re-plan without "
                                  "overlapping iterations")
    if plan.first_slices != 1:
        raise ExportError(target, f"first_slices = {plan.first_slices}: {target} runs micro-batches of one size; "
                                  f"re-plan without slicing the first micro-batch")
    n_layers = plan.virtual_workers[0].stages[-1].stop
    _check_devices(plan)
    for w, vw in enumerate(plan.virtual_workers):
        for k, st in enumerate(vw.stages):
            if st.replicas:
                raise ExportError(target, f"virtual_workers[{w}].stages[{k}] is replicated on {list(st.replicas)}; "
                                          f"{target} has no per-stage replication (express it as virtual workers)")
        cuts = _cuts(vw)
        if cuts[0] != 0 or cuts[-1] != n_layers or any(a.stop != b.start for a, b in itertools.pairwise(vw.stages)):
            raise PartitionerError(f"virtual_workers[{w}].stages: layers {[list(s.layers) for s in vw.stages]} do "
                                   f"not cover [0, {n_layers}) contiguously; check the plan with "
                                   f"`partitioner simulate`")
    return n_layers


def _check_devices(plan: Plan) -> None:
    """What :meth:`Plan.validate` checks of devices without a profile or a cluster: a device serves
    one virtual worker (where a device holds several stages of one is each target's question,
    :func:`_pipeline_shape`)."""
    owner: dict[str, int] = {}
    for w, vw in enumerate(plan.virtual_workers):
        for k, st in enumerate(vw.stages):
            for dev in st.devices:
                if owner.get(dev, w) != w:
                    raise FormatError(f"virtual_workers[{w}].stages[{k}].device", dev,
                                      f"already used by virtual_workers[{owner[dev]}]: a device runs one virtual "
                                      "worker (one rank of the exported job)")
                owner[dev] = w


def _pipeline_shape(plan: Plan, target: str) -> list[int]:
    """Pipeline ranks per virtual worker; stage ``c * p + d`` must run on the device of stage ``d``
    (under zbv, of :func:`partitioner.schedule.stage_rank`'s V)."""
    v = plan.chunks
    rule = spec(plan.schedule).placement
    sizes = []
    for w, vw in enumerate(plan.virtual_workers):
        n = len(vw.stages)
        if n % v:
            raise ExportError(target, f"virtual_workers[{w}] has {n} stages, not a multiple of chunks = {v}")
        p = n // v
        devs = [vw.stages[d].device for d in range(p)]
        if len(set(devs)) != p or any(st.device != devs[stage_rank(s, p, rule)] for s, st in enumerate(vw.stages)):
            raise ExportError(target, f"virtual_workers[{w}] places its {n} stages on {[s.device for s in vw.stages]}; "
                                      f"{target} runs stage c*p + d on pipeline rank d ({p} distinct devices, "
                                      f"chunks = {v}; under zbv in a V)")
        sizes.append(p)
    return sizes


def _identical_cuts(plan: Plan, target: str, lacks: str) -> list[int]:
    first = _cuts(plan.virtual_workers[0])
    for w, vw in enumerate(plan.virtual_workers[1:], start=1):
        if _cuts(vw) != first:
            raise ExportError(target, f"virtual workers 0 and {w} cut the model differently ({first} vs "
                                      f"{_cuts(vw)}); {lacks}")
    return first


def _one_stage_per_rank(plan: Plan, target: str, schedules: str) -> None:
    if plan.chunks != 1 or spec(plan.schedule).multi_chunk:
        raise ExportError(target, f"schedule {plan.schedule} with chunks = {plan.chunks} puts several stages on one "
                                  f"rank; {target} holds one stage per rank ({schedules}); re-plan with 1f1b or gpipe")


def _tp_degree(plan: Plan, target: str, lacks: str) -> int:
    """The plan's one tensor-parallel degree (a device ``NODE:FIRST-LAST`` is a group of that many
    GPUs; 1 without groups); a plan whose stages have several is refused naming two of them."""
    seen: dict[int, str] = {}
    for w, vw in enumerate(plan.virtual_workers):
        for k, st in enumerate(vw.stages):
            seen.setdefault(group_size(st.device), f"virtual_workers[{w}].stages[{k}] on {st.device}")
    if len(seen) > 1:
        (a, where_a), (b, where_b) = list(seen.items())[:2]
        raise ExportError(target, f"its stages have tensor-parallel degrees {a} ({where_a}) and {b} ({where_b}); "
                                  f"{lacks}")
    return next(iter(seen))


def _rank_roles(ranks: Sequence[Mapping[str, Any]]) -> list[str]:
    """What each rank of an export is, for a refused launch order: its place in its device's
    tensor-parallel group (empty at degree 1)."""
    return [f"tensor-parallel index {r['tp_rank']} of {r['device']}" if r.get("tp_size", 1) > 1 else ""
            for r in ranks]


def training_of(plan: Plan, lr: float | None = None) -> dict[str, Any]:
    """How the plan was priced to train, as every export writes it: ``precision`` (``fp32``, or
    ``fp16`` / ``bf16`` mixed precision with fp32 master weights), ``optimizer`` (``adam`` for 2
    words of optimizer state per parameter, ``sgd`` for none; a plan without pricing: ``sgd`` in
    fp32, as the runtime trains it), its ``lr`` (``lr``, else the runtime's default for it) and
    the ``zero_stage`` (0: the pricing keeps every parameter's state on its stage's devices)."""
    pricing = plan.pricing
    optimizer = priced_optimizer(pricing)
    out: dict[str, Any] = {"precision": pricing.precision if pricing is not None else "fp32", "optimizer": optimizer,
                           "lr": float(lr) if lr is not None else DEFAULT_LR[optimizer], "zero_stage": 0,
                           "pricing": pricing.to_dict() if pricing is not None else None}
    if pricing is None:
        out["note"] = "the plan records no pricing (made by hand): fp32 and plain SGD, as the runtime trains it"
    elif pricing.optimizer_state_factor not in (0.0, 2.0):
        out["note"] = (f"the pricing counts {pricing.optimizer_state_factor:g} word(s) of optimizer state per "
                       "parameter; exported as plain SGD, as the runtime trains it")
    return out


def _launch(devices: Sequence[str], program: Sequence[str]) -> tuple[list[NodeLaunch], dict[str, Any]]:
    """The launch order of a job whose rank ``r`` runs on ``devices[r]``: its nodes in the order of
    their ranks (node ``k`` started with ``--node-rank k``), each node's GPUs in local-rank order
    (``CUDA_VISIBLE_DEVICES``) and the torchrun command of every node (:mod:`partitioner.launch`)."""
    nodes = node_launches(devices, "rank")
    return nodes, {"nodes": [n.to_dict(k, devices) for k, n in enumerate(nodes)],
                   "master_node": nodes[0].node,
                   "torchrun": [torchrun_command(nodes, k, program) for k in range(len(nodes))]}


def _rank_order(plan: Plan, target: str, orders: Mapping[str, Sequence[str]]) -> str:
    """The first of ``orders`` (name -> the device of each rank) whose ranks a launcher can start
    node after node; refuses (one line) when none can."""
    why = {}
    for name, devices in orders.items():
        problem = contiguity_problem(node_launches(devices, "rank"))
        if problem is None:
            return name
        why[name] = problem
    raise ExportError(target, "no launch order holds the plan's stage -> GPU mapping: a launcher (torchrun "
                              "--node-rank, a hostfile) starts each node's processes as consecutive ranks, but "
                              + "; ".join(f"{name}: {w}" for name, w in why.items()))


def check_export_launch(exported: Mapping[str, Any], given: str) -> str:
    """Check a launch order (a DeepSpeed hostfile, the devices of ranks 0, 1, ..., or the nodes in
    launch order; :func:`partitioner.launch.read_launch_order`) against an export's rank -> device
    mapping. Returns the line saying it holds; raises :class:`PartitionerError` (one line)."""
    from .launch import read_launch_order

    launch = exported["launch"]
    ranks = sorted(exported["ranks"], key=lambda r: r["rank"])
    devices = [r.get("gpu", r["device"]) for r in ranks]  # a tensor-parallel rank: its one GPU
    nodes = [NodeLaunch(n["node"], tuple(n["ranks"]), tuple(int(x) for x in n["cuda_visible_devices"].split(",")))
             for n in launch["nodes"]]
    own = dict(read_launch_order(launch["hostfile"])[1]) if launch.get("hostfile") else {}
    return check_launch(nodes, devices, given, slots=own, roles=_rank_roles(ranks))


# -- torch.distributed.pipelining -----------------------------------------------------------


def _holder_sets(plan: Plan, pipelines: Sequence[Sequence[int]], n_layers: int, tp: int = 1) -> list[dict[str, Any]]:
    """Every distinct set of ranks holding the same layers (one rank per virtual worker;
    ``pipelines``: worker -> pipeline rank -> its group's first rank): at tensor-parallel degree
    ``tp`` one set per index ``i``, the ranks holding shard ``i``."""
    holders: dict[tuple[int, ...], list[int]] = {}
    for layer in range(n_layers):
        key = []
        for w, vw in enumerate(plan.virtual_workers):
            s = next(k for k, st in enumerate(vw.stages) if st.start <= layer < st.stop)
            key.append(pipelines[w][stage_rank(s, len(pipelines[w]), spec(plan.schedule).placement)])
        for i in range(tp):
            holders.setdefault(tuple(sorted(r + i for r in key)), []).append(layer)
    return [{"ranks": list(ranks), "layers": layers} for ranks, layers in holders.items()]


def _torch_pipelining(plan: Plan, layer_names: Sequence[str] | None, lr: float | None = None) -> dict[str, Any]:
    target = "torch-pipelining"
    n_layers = _check_plan(plan, target)
    if plan.schedule not in TORCH_SCHEDULE_CLASSES:
        raise ExportError(target, f"schedule {plan.schedule} has no torch.distributed.pipelining class (torch 2.13 "
                                  f"ships {', '.join(sorted(set(TORCH_SCHEDULE_CLASSES.values())))}); re-plan with "
                                  f"{', '.join(TORCH_SCHEDULE_CLASSES)}")
    cls = TORCH_SCHEDULE_CLASSES[plan.schedule]
    rule = spec(plan.schedule).placement
    if plan.chunks != 1 and cls not in _MULTI_STAGE_CLASSES:
        raise ExportError(target, f"chunks = {plan.chunks} under {plan.schedule}: torch's {cls} runs one stage per "
                                  f"rank; several stages per rank need {', '.join(_MULTI_STAGE_CLASSES)}")
    sizes = _pipeline_shape(plan, target)
    m, b = plan.micro_batches, plan.micro_batch_size
    if cls in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        for w, p in enumerate(sizes):
            rounds = max(1, m // p)
            if m % rounds:
                raise ExportError(target, f"virtual_workers[{w}]: torch's {cls} needs "
                                          f"n_microbatches ({m}) to be a multiple of its rounds max(1, {m} // {p}) "
                                          f"= {rounds}")
    names = None
    if layer_names is not None:
        if len(layer_names) != n_layers:
            raise PartitionerError(f"{len(layer_names)} layer names for a plan of {n_layers} layers")
        names = [str(n).replace(".", "_") for n in layer_names]
    t = _tp_degree(plan, target, "torch's PipelineStage sends a stage's output to one rank of its pipeline group (the "
                                 "ranks of one tensor-parallel index), so an exported pipeline runs at one degree; "
                                 "re-plan with one degree, or train with `partitioner train`, whose runtime sends "
                                 "between groups of different degrees")
    ranks, pipelines, firsts = _torch_ranks(plan, sizes, t)
    for w, (vw, p) in enumerate(zip(plan.virtual_workers, sizes)):
        pipe = pipelines[w]
        pipe["batch_rows"] = [w * m * b, (w + 1) * m * b]
        pipe["stages"] = [{"stage": s, "layers": list(st.layers), "rank": firsts[w][stage_rank(s, p, rule)],
                           "ranks": [firsts[w][stage_rank(s, p, rule)] + i for i in range(t)], "device": st.device,
                           "gpu_type": st.gpu_type} for s, st in enumerate(vw.stages)]
        pipe["split_spec"] = (None if names is None
                              else {names[st.start]: "BEGINNING" for st in vw.stages[1:]})
    out: dict[str, Any] = {
        "format": EXPORT_FORMAT, "target": target, "model": plan.model, "num_layers": n_layers,
        "schedule": plan.schedule, "schedule_class": cls, "n_microbatches": m, "micro_batch_size": b,
        "stages_per_rank": plan.chunks, "tensor_parallel": t, "world_size": len(ranks),
        "ranks": ranks, "pipelines": pipelines,
        "grad_sync": _holder_sets(plan, firsts, n_layers, t) if len(pipelines) > 1 else [],
        "training": training_of(plan, lr),
    }
    # the script seats itself from its node (GROUP_RANK = --node-rank) and LOCAL_RANK, so any rank
    # order launches; node k is the k-th in the order of the ranks
    _, out["launch"] = _launch([r["gpu"] for r in ranks], ["examples/torch_pipelining_train.py", "EXPORT.json"])
    out["snippet"] = _torch_snippet(out)
    return out


def _torch_ranks(plan: Plan, sizes: Sequence[int], t: int
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[list[int]]]:
    """The ranks of a torch export in the project runtime's order (:mod:`runtime.layout`): worker
    0's devices in pipeline order, then worker 1's, a device of tensor-parallel degree ``t`` as
    ``t`` consecutive ranks in GPU order; each pipeline's process groups (``pipe_groups[i]``: the
    ranks of tensor-parallel index ``i``, one per stage, torch's pipeline group; ``tp_groups``: each
    device's ranks, a ``DeviceMesh`` sub-mesh); worker -> pipeline rank -> its group's first rank."""
    rule = spec(plan.schedule).placement
    ranks: list[dict[str, Any]] = []
    pipelines: list[dict[str, Any]] = []
    firsts: list[list[int]] = []
    for w, (vw, p) in enumerate(zip(plan.virtual_workers, sizes)):
        base = len(ranks)
        for d in range(p):
            st = vw.stages[d]
            held = [s for s in range(len(vw.stages)) if stage_rank(s, p, rule) == d]
            for i, gpu in enumerate(group_gpus(st.device)):
                ranks.append({"rank": len(ranks), "device": st.device, "gpu": gpu, "gpu_type": st.gpu_type,
                              "virtual_worker": w, "pipe_rank": d, "tp_rank": i, "tp_size": t, "stages": held})
        firsts.append([base + d * t for d in range(p)])
        pipelines.append({"virtual_worker": w, "ranks": list(range(base, len(ranks))), "tensor_parallel": t,
                          "pipe_groups": [[f + i for f in firsts[-1]] for i in range(t)],
                          "tp_groups": [[f + i for i in range(t)] for f in firsts[-1]] if t > 1 else []})
    return ranks, pipelines, firsts


def _torch_snippet(e: Mapping[str, Any]) -> str:
    multi = e["schedule_class"] in MULTI_STAGE_CLASSES
    t = e["training"]
    lines = [
        "# launch: every node's line of export['launch']['torchrun'] on that node (node k: --node-rank k,",
        "#  CUDA_VISIBLE_DEVICES in its ranks' order); examples/torch_pipelining_train.py is a complete script",
        "import json, torch, torch.distributed as dist",
        "from runtime.data import make_data",
        "from runtime.torch_pipelining import build_rank, export_seat",
        "",
        "export = json.load(open('EXPORT.json'))",
        "rank, gpu = export_seat(export)              # this process's rank: its node's LOCAL_RANK-th",
        "dist.init_process_group(rank=rank, world_size=export['world_size'])",
        "data = make_data(chain, 'auto', ...)          # the model's task: cross-entropy on its targets",
        f"me = build_rank(export, rank, seed=0, loss_fn=data.loss)   # precision {t['precision']} from the plan; "
        f"PipelineStage(s) + torch.{e['schedule_class']}({'stages' if multi else 'stage'}, "
        f"n_microbatches={e['n_microbatches']}, ...)",
        f"opt = me.make_optimizer({t['optimizer']!r}, lr={t['lr']!r})   # fp32 master weights under bf16/fp16",
        "for step in range(steps):                   # the global batch; each pipeline takes its batch_rows",
        "    x, y = data.global_batch(step)",
        "    losses = me.step(x, y)                  # torch's schedule.step on this rank's rows",
        "    me.sync_gradients()                     # average over virtual workers (grad_sync)",
        "    opt.step(); opt.zero_grad()",
    ]
    tp = e.get("tensor_parallel", 1)
    if tp > 1:
        lines += ["", f"# tensor parallel {tp}: build_rank makes every device's group (pipelines[w]['tp_groups']) a "
                      "DeviceMesh.from_group sub-mesh",
                  "# and shards the stage's blocks over it as the project's runtime does (runtime.tensor_parallel):",
                  "#   parallelize_module(block, mesh, {'attn.qkv': ColwiseParallel(), 'attn.proj': RowwiseParallel(),",
                  "#                                    'fc1': ColwiseParallel(), 'fc2': RowwiseParallel()})",
                  "# torch's PipelineStage of tensor-parallel index i runs over pipelines[w]['pipe_groups'][i]: each "
                  "index pipelines its",
                  "# own copy of the stage's replicated output"]
    spec = e["pipelines"][0]["split_spec"]
    if spec is not None:
        # layer names come from the user's profile: embedded as Python literals (repr), never
        # spliced between quotes, so no name can end the string and add code
        shown = ", ".join(f"{str(k)!r}: SplitPoint.BEGINNING" for k in spec)
        lines += ["", "# or trace the model with torch's frontend (pipeline 0's split points):",
                  "from torch.distributed.pipelining import pipeline, SplitPoint",
                  f"pipe = pipeline(model_as_sequential, mb_args=(micro_batch,), split_spec={{{shown}}})"]
    return "\n".join(lines) + "\n"


# -- DeepSpeed ------------------------------------------------------------------------------


def deepspeed_uniform_parts(num_layers: int, num_stages: int) -> list[int]:
    """The boundaries DeepSpeed's ``partition_method='uniform'`` gives: ``num_layers // num_stages``
    layers per stage, one more for each of the first ``num_layers % num_stages`` stages (one
    layer per stage, and empty stages after them, when there are fewer layers than stages)."""
    if num_layers <= num_stages:
        return [min(p, num_layers) for p in range(num_stages + 1)]
    size, extra = divmod(num_layers, num_stages)
    return [p * size + min(p, extra) for p in range(num_stages + 1)]


def _deepspeed(plan: Plan, lr: float | None = None) -> dict[str, Any]:
    target = "deepspeed"
    n_layers = _check_plan(plan, target)
    t = _tp_degree(plan, target, "DeepSpeed's PipelineModule has no tensor parallelism of its own")
    if t > 1:
        st = plan.virtual_workers[0].stages[0]
        raise ExportError(target, f"its stages run on tensor-parallel groups ({st.device}: degree {t}); DeepSpeed's "
                                  "pipeline engine has no tensor parallelism of its own (its topology's model axis "
                                  "takes layers the model shards itself, as Megatron-DeepSpeed's); export to "
                                  "torch-pipelining or megatron, or re-plan without --tensor-parallel")
    _one_stage_per_rank(plan, target, "its TrainSchedule, a 1F1B order")
    _pipeline_shape(plan, target)
    parts = _identical_cuts(plan, target, "DeepSpeed's data-parallel replicas all run one partition (PipelineModule "
                                          "parts)")
    pp, dp = len(parts) - 1, len(plan.virtual_workers)
    m, b = plan.micro_batches, plan.micro_batch_size
    vws = plan.virtual_workers
    # DeepSpeed's PipeDataParallelTopology orders ranks pipe-major (rank = stage * dp + replica); a
    # ProcessTopology(axes=['data', 'pipe']) data-major (rank = replica * pp + stage): the first whose
    # ranks a launcher can start node after node
    orders = {"pipe-major": [vws[r % dp].stages[r // dp].device for r in range(pp * dp)],
              "data-major": [vws[r // pp].stages[r % pp].device for r in range(pp * dp)]}
    order = _rank_order(plan, target, orders)
    rank_of = ((lambda s, w: s * dp + w) if order == "pipe-major" else (lambda s, w: w * pp + s))
    ranks = sorted(({"rank": rank_of(s, w), "device": vw.stages[s].device, "gpu_type": vw.stages[s].gpu_type,
                     "stage": s, "data_parallel_rank": w}
                    for s in range(pp) for w, vw in enumerate(vws)), key=lambda r: r["rank"])
    uniform = parts == deepspeed_uniform_parts(n_layers, pp)
    training = training_of(plan, lr)
    out: dict[str, Any] = {
        "format": EXPORT_FORMAT, "target": target, "model": plan.model, "num_layers": n_layers,
        "num_stages": pp, "data_parallel": dp, "parts": parts,
        "partition_method": "uniform" if uniform else None,
        "schedule": plan.schedule, "rank_order": order,
        "topology": {"axes": ["pipe", "data"] if order == "pipe-major" else ["data", "pipe"],
                     "dims": [pp, dp] if order == "pipe-major" else [dp, pp]},
        "config": _deepspeed_config(training, b, m, dp),
        "training": training,
        "world_size": pp * dp, "ranks": ranks,
    }
    nodes, out["launch"] = _launch(orders[order], ["TRAIN.py", "--deepspeed_config", "ds_config.json"])
    out["launch"].update(_deepspeed_launcher(nodes))
    out["snippet"] = _deepspeed_snippet(out)
    return out


def _deepspeed_config(t: Mapping[str, Any], b: int, m: int, dp: int) -> dict[str, Any]:
    """The DeepSpeed config of a plan's training: batch, precision (fp16 with dynamic loss scaling
    as torch.amp.GradScaler scales: from 2**16, doubled after 2000 good steps, halved at once on an
    overflow; bf16, its gradients accumulated in bf16 unless the pricing's ``allreduce_precision``
    is fp32), torch's own optimizer (Adam without weight decay, AdamW with torch's 0.01, SGD),
    ZeRO stage 0 (the pricing keeps every parameter's optimizer state on its stage) and no
    gradient clipping."""
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": m,
                              "train_batch_size": b * m * dp}
    if t["precision"] == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 2000,
                          "hysteresis": 1, "min_loss_scale": 1}
    elif t["precision"] == "bf16":
        config["bf16"] = {"enabled": True}
        if (t.get("pricing") or {}).get("allreduce_precision") != "fp32":
            # DeepSpeed's bf16 optimizer accumulates gradients in fp32 unless told otherwise; the
            # pricing counts 2-byte gradients, as the runtime holds them
            config["data_types"] = {"grad_accum_dtype": "bf16"}
    lr = t["lr"]
    config["optimizer"] = {
        "adam": {"type": "Adam", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                                            "torch_adam": True, "adam_w_mode": False}},
        "adamw": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01,
                                              "torch_adam": True}},
        "sgd": {"type": "SGD", "params": {"lr": lr}},
    }[t["optimizer"]]
    config["zero_optimization"] = {"stage": t["zero_stage"]}
    # the plan trains without clipping; DeepSpeed clips the gradients' global norm to 1.0 unless
    # told otherwise (GRADIENT_CLIPPING_DEFAULT 1.0 in DeepSpeed 0.19.8)
    config["gradient_clipping"] = 0.0
    return config


def _deepspeed_launcher(nodes: Sequence[NodeLaunch]) -> dict[str, Any]:
    """The hostfile (nodes in rank order) and ``deepspeed``'s command, or why its launcher cannot
    hold the mapping (the torchrun lines then start the job; DeepSpeed reads their environment)."""
    problem = deepspeed_launcher_problem(nodes)
    plain = all(list(n.gpus) == list(range(n.nproc)) for n in nodes)
    slots = "".join(f"{n.node} slots={n.nproc if plain else max(n.gpus) + 1}\n" for n in nodes)
    cmd = ["deepspeed", "--hostfile", "hostfile", "--master_addr", nodes[0].node]
    if not plain:
        cmd += ["--include", "@".join(f"{n.node}:{n.cuda_visible_devices}" for n in nodes)]
    return {"hostfile": slots if problem is None else hostfile(nodes),
            "deepspeed": shlex.join([*cmd, "TRAIN.py", "--deepspeed_config", "ds_config.json"]) if problem is None
            else None,
            "deepspeed_unavailable": problem}


def _ds_stages(e: Mapping[str, Any]) -> str:
    if e["rank_order"] == "pipe-major":
        return f"num_stages={e['num_stages']}"
    return f"topology=ProcessTopology(axes=['data', 'pipe'], dims=[{e['data_parallel']}, {e['num_stages']}])"


def _deepspeed_snippet(e: Mapping[str, Any]) -> str:
    lines = [
        "import deepspeed",
        "from deepspeed.pipe import PipelineModule" + (", ProcessTopology" if e["rank_order"] != "pipe-major" else ""),
        "",
        f"# layers: the model's {e['num_layers']} layers in order (nn.Module or LayerSpec), as the plan's profile lists them",
    ]
    if e["partition_method"] == "uniform":
        lines += [f"# the plan's split is DeepSpeed's own uniform split: {e['parts']}",
                  f"net = PipelineModule(layers=layers, {_ds_stages(e)}, partition_method='uniform')"]
    else:
        lines += [
            "class PlannedPipelineModule(PipelineModule):",
            "    \"\"\"PipelineModule with the plan's stage boundaries (stage s: layers [PARTS[s], PARTS[s+1])).\"\"\"",
            "",
            f"    PARTS = {e['parts']}",
            "",
            "    def _partition_layers(self, method='parameters'):",
            "        self.parts = list(self.PARTS)",
            "        stage = self._topo.get_coord(self.global_rank).pipe",
            "        self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])",
            "",
            f"net = PlannedPipelineModule(layers=layers, {_ds_stages(e)})",
        ]
    lines += ["engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),",
              f"                                       config={e['config']!r})",
              "loss = engine.train_batch(data_iter)   # one plan iteration: gradient_accumulation_steps micro-batches",
              "",
              f"# launch (ranks {e['rank_order']}): the hostfile in rank order, then",
              f"#   {e['launch']['deepspeed']}" if e["launch"]["deepspeed"] else
              f"#   not deepspeed's launcher: {e['launch']['deepspeed_unavailable']}; instead, on each node:",
              *(f"#   {c}" for c in e["launch"]["torchrun"])]
    return "\n".join(lines) + "\n"


# -- Megatron-LM ----------------------------------------------------------------------------


def megatron_layer_kinds(model: str, num_layers: int) -> list[str] | None:
    """Megatron's layer letters for the chain of ``model`` (``E`` embedding, ``t`` transformer
    layer, ``L`` output head and loss), or ``None`` when the model is not a GPT-style chain.
    The zoo's GPT-2 models are: embedding, ``num_layers - 2`` blocks, head."""
    if model.startswith("gpt2") and num_layers >= 3:
        return ["E", *["t"] * (num_layers - 2), "L"]
    return None


def _layout_stage(kinds: Sequence[str]) -> str:
    t = kinds.count("t")
    body = "" if t == 0 else ("t" if t == 1 else f"t*{t}")
    return ("E" if "E" in kinds else "") + body + ("L" if "L" in kinds else "")


def _megatron(plan: Plan, lr: float | None = None) -> dict[str, Any]:
    target = "megatron"
    n_layers = _check_plan(plan, target)
    kinds = megatron_layer_kinds(plan.model, n_layers)
    if kinds is None:
        raise ExportError(target, f"model '{plan.model}' is not a GPT-style chain (embedding, transformer layers, "
                                  f"output head), the only model Megatron-LM's pipeline builds; the zoo's gpt2-* are")
    if spec(plan.schedule).breadth_first:
        raise ExportError(target, f"schedule {plan.schedule}: Megatron-LM's interleaved schedule runs micro-batches depth-first "
                                  "and has no breadth-first order; re-plan with interleaved")
    sizes = _pipeline_shape(plan, target)
    cuts = _identical_cuts(plan, target, "Megatron-LM's data-parallel replicas all run one pipeline split")
    tp = _tp_degree(plan, target, "Megatron-LM has one --tensor-model-parallel-size for the whole job; re-plan with "
                                  "one degree (`partitioner plan --tensor-parallel T`)")
    pp, v, dp = sizes[0], plan.chunks, len(plan.virtual_workers)
    m, b = plan.micro_batches, plan.micro_batch_size
    vws = plan.virtual_workers
    stage_kinds = [kinds[a:c] for a, c in itertools.pairwise(cuts)]
    counts = [k.count("t") for k in stage_kinds]
    layout = "|".join(_layout_stage(k) for k in stage_kinds)
    n_t = n_layers - 2
    # Megatron-LM's rank order: tp-cp-ep-dp-pp (tensor-parallel index fastest, then data-parallel rank,
    # pipeline rank slowest: rank = (pipeline rank * dp + data-parallel rank) * tp + index), or with
    # --use-tp-pp-dp-mapping tp-cp-ep-pp-dp (rank = (data-parallel rank * pp + pipeline rank) * tp + index)
    coords = {"pipe-major": [((r // tp) // dp, (r // tp) % dp, r % tp) for r in range(pp * dp * tp)],
              "data-major": [((r // tp) % pp, (r // tp) // pp, r % tp) for r in range(pp * dp * tp)]}
    orders = {name: [group_gpus(vws[w].stages[d].device)[i] for d, w, i in c] for name, c in coords.items()}
    order = _rank_order(plan, target, orders)
    training = training_of(plan, lr)
    args: list[str] = ["--num-layers", str(n_t), "--pipeline-model-parallel-size", str(pp)]
    if tp > 1:
        args += ["--tensor-model-parallel-size", str(tp)]
    if v > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(v)]
    args += ["--micro-batch-size", str(b), "--global-batch-size", str(b * m * dp), *_megatron_training(training)]
    if order == "data-major":
        args.append("--use-tp-pp-dp-mapping")
    uneven, why = _megatron_uneven(counts, pp, v)
    ranks = [{"rank": r, "device": vws[w].stages[d].device, "gpu": orders[order][r],
              "gpu_type": vws[w].stages[d].gpu_type, "pipeline_rank": d, "data_parallel_rank": w, "tp_rank": i,
              "tp_size": tp, "stages": list(range(d, pp * v, pp))} for r, (d, w, i) in enumerate(coords[order])]
    out: dict[str, Any] = {
        "format": EXPORT_FORMAT, "target": target, "model": plan.model, "num_layers": n_layers,
        "transformer_layers_per_stage": counts, "pipeline_parallel": pp, "virtual_stages_per_rank": v,
        "data_parallel": dp, "tensor_parallel": tp, "schedule": plan.schedule, "layout": layout, "rank_order": order,
        "training": training,
        "args": args, "layout_args": [*args, "--pipeline-model-parallel-layout", layout],
        "uneven_args": None if uneven is None else [*args, *uneven],
        "uneven_args_unavailable": why, "world_size": pp * dp * tp, "ranks": ranks,
    }
    chosen = out["layout_args"]
    _, out["launch"] = _launch(orders[order], ["pretrain_gpt.py", *chosen])
    out["snippet"] = _megatron_snippet(out)
    return out


def _megatron_training(t: Mapping[str, Any]) -> list[str]:
    """Megatron-LM's arguments for a plan's training: precision (``--fp16`` with dynamic loss
    scaling as torch.amp.GradScaler does it, ``--bf16``; both keep fp32 main weights; under bf16
    Megatron-LM accumulates and all-reduces the gradients in fp32 unless ``--grad-reduce-in-bf16``,
    which the export adds where the pricing counts bf16 gradients, as the runtime runs them: its
    ``allreduce_precision`` is not fp32), the optimizer
    (Megatron's ``adam`` is decoupled weight decay, 0.01 by default: 0 for Adam, 0.01 for AdamW;
    its ``sgd`` has momentum 0.9 by default: 0 for plain SGD) and the learning rate."""
    args: list[str] = []
    if t["precision"] == "fp16":
        args += ["--fp16", "--initial-loss-scale", "65536", "--loss-scale-window", "2000", "--hysteresis", "1"]
    elif t["precision"] == "bf16":
        fp32_grads = (t.get("pricing") or {}).get("allreduce_precision") == "fp32"
        args += ["--bf16"] if fp32_grads else ["--bf16", "--grad-reduce-in-bf16"]
    lr = repr(float(t["lr"]))
    if t["optimizer"] == "sgd":
        return [*args, "--optimizer", "sgd", "--sgd-momentum", "0", "--weight-decay", "0", "--lr", lr]
    decay = "0.01" if t["optimizer"] == "adamw" else "0"
    return [*args, "--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.999", "--adam-eps", "1e-08",
            "--weight-decay", decay, "--lr", lr]


def _megatron_uneven(counts: Sequence[int], pp: int, v: int) -> tuple[list[str] | None, str | None]:
    """``--decoder-first/last-pipeline-num-layers`` for ``counts`` (transformer layers per stage),
    or ``None`` and the reason they cannot express it."""
    if len(set(counts)) == 1:
        return [], None
    if v > 1:
        return None, ("the virtual stages hold different numbers of transformer layers; without a layout "
                      "Megatron-LM gives every virtual stage the same count")
    mid = counts[1:-1]
    if len(set(mid)) > 1:
        return None, (f"middle stages hold {mid} transformer layers; without a layout Megatron-LM gives every "
                      f"stage but the first and the last the same count")
    if 0 in counts:
        return None, "a stage holds no transformer layer (only the embedding or the head)"
    extra: list[str] = []
    if pp == 2:
        return ["--decoder-first-pipeline-num-layers", str(counts[0])], None
    if counts[0] != mid[0]:
        extra += ["--decoder-first-pipeline-num-layers", str(counts[0])]
    if counts[-1] != mid[0]:
        extra += ["--decoder-last-pipeline-num-layers", str(counts[-1])]
    return extra, None


def _megatron_snippet(e: Mapping[str, Any]) -> str:
    tp = e.get("tensor_parallel", 1)
    lines = [f"# {e['pipeline_parallel']} pipeline x {e['data_parallel']} data-parallel"
             + (f" x {tp} tensor-parallel" if tp > 1 else "") + " ranks; "
             f"transformer layers per stage {e['transformer_layers_per_stage']}"]
    if e["uneven_args"] is not None:
        lines += ["# Megatron-LM with --decoder-first/last-pipeline-num-layers:",
                  "torchrun ... pretrain_gpt.py " + " ".join(e["uneven_args"])]
    else:
        lines += [f"# --decoder-first/last-pipeline-num-layers cannot express it: {e['uneven_args_unavailable']}"]
    lines += ["# Megatron-LM with --pipeline-model-parallel-layout:",
              "torchrun ... pretrain_gpt.py " + " ".join(e["args"]) + " --pipeline-model-parallel-layout "
              + shlex.quote(e["layout"]),
              f"# launch (ranks {e['rank_order']}), each line on its node, node k first with --node-rank k:",
              *e["launch"]["torchrun"]]
    return "\n".join(lines) + "\n"


# -- entry point ----------------------------------------------------------------------------


def export_plan(plan: Plan, target: str, layer_names: Sequence[str] | None = None,
                lr: float | None = None) -> dict[str, Any]:
    """``plan`` as ``target`` (one of :data:`TARGETS`) takes it; raises :class:`ExportError`
    when the target cannot run it. ``layer_names`` (the module names of the model's layers as
    an ``nn.Sequential``) give torch's ``split_spec``; without them it is ``None``. Every export
    carries the plan's training (:func:`training_of`: precision, optimizer, ``lr`` or the
    runtime's default for it) and its launch order (``launch``: the nodes in rank order, each
    node's ``CUDA_VISIBLE_DEVICES``, its torchrun line; a DeepSpeed hostfile)."""
    if target == "torch-pipelining":
        return _torch_pipelining(plan, layer_names, lr)
    if target == "deepspeed":
        return _deepspeed(plan, lr)
    if target == "megatron":
        return _megatron(plan, lr)
    raise PartitionerError(f"unknown export target '{target}'; valid targets: {', '.join(TARGETS)}")
