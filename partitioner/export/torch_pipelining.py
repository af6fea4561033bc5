"""Plans as ``torch.distributed.pipelining`` takes them (target ``torch-pipelining``, torch-free).

The export writes, per pipeline and stage, the layer range, the rank that runs it and its device;
the split points of ``pipeline(..., split_spec=...)`` as module names (``SplitPoint.BEGINNING`` of
each stage's first layer, for a model built as an ``nn.Sequential`` of the profile's layers);
torch's schedule class and ``n_microbatches``; the rows of the global batch each pipeline trains
on; and, with several virtual workers, the sets of ranks whose gradients are averaged (one set per
group of layers with the same holders). A device of tensor-parallel degree ``t`` is ``t``
consecutive ranks (the project runtime's order), with its group (``tp_groups``: a ``DeviceMesh``
sub-mesh) and one pipeline group per tensor-parallel index (``pipe_groups``); one degree per plan.
``runtime.torch_pipelining`` builds the per-rank ``PipelineStage`` objects of a zoo model and the
schedule from it; the snippet shows how.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import PartitionerError
from ..launch import group_gpus
from ..plan import Plan
from ..schedule import spec, stage_rank
from .common import (
    EXPORT_FORMAT,
    ExportError,
    _check_plan,
    _launch,
    _pipeline_shape,
    _tp_degree,
    training_of,
)

__all__ = ["MULTI_STAGE_CLASSES", "TORCH_SCHEDULE_CLASSES"]

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

