"""What the export targets share (torch-free): the plan checks every target runs, the
training recipe each writes (:func:`training_of`), the launch order (:func:`_launch`,
:func:`_rank_order`) and the check of a given one (:func:`check_export_launch`).

A plan a target cannot run raises :class:`ExportError`, one line naming what the target lacks.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import FormatError, PartitionerError
from ..launch import NodeLaunch, check_launch, contiguity_problem, node_launches, torchrun_command
from ..plan import Plan, VirtualWorker, group_size
from ..pricing import DEFAULT_LR, priced_optimizer
from ..schedule import spec, stage_rank

__all__ = ["EXPORT_FORMAT", "TARGETS", "ExportError", "check_export_launch", "training_of"]

EXPORT_FORMAT = "partitioner.export/1"
TARGETS = ("torch-pipelining", "deepspeed", "megatron")


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
    from ..launch import read_launch_order

    launch = exported["launch"]
    ranks = sorted(exported["ranks"], key=lambda r: r["rank"])
    devices = [r.get("gpu", r["device"]) for r in ranks]  # a tensor-parallel rank: its one GPU
    nodes = [NodeLaunch(n["node"], tuple(n["ranks"]), tuple(int(x) for x in n["cuda_visible_devices"].split(",")))
             for n in launch["nodes"]]
    own = dict(read_launch_order(launch["hostfile"])[1]) if launch.get("hostfile") else {}
    return check_launch(nodes, devices, given, slots=own, roles=_rank_roles(ranks))

