"""Run a plan exported with ``partitioner export --to torch-pipelining`` on torch's own pipelining.

:func:`build_rank` turns the export (``partitioner.export/1``, target ``torch-pipelining``) into
this rank's ``torch.distributed.pipelining.PipelineStage`` objects -- one per stage the rank
holds, each an ``nn.Sequential`` of the model's layers (a zoo model, or a user's
``module:function``, :mod:`runtime.model`) built by :func:`runtime.stage.build_stage`
(so every layer starts from the same per-layer seed as in this project's runtime) -- and the
torch schedule named by the export (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B`` or ``ScheduleLoopedBFS``) over the rank's pipeline process group.

The process group must be initialised, with one process per rank of the export. Every rank
calls :func:`build_rank` (process groups are created collectively). Each step, every rank
calls :meth:`TorchPipelineRank.step` with the same global batch (each pipeline trains on its
``batch_rows``), then :meth:`TorchPipelineRank.sync_gradients` (averages the gradients of the
layers several virtual workers hold, over the export's ``grad_sync`` rank sets), then its
optimizer (:meth:`TorchPipelineRank.make_optimizer`: the export's optimizer, through fp32 master
weights under mixed precision; under fp16, unscaled and skipped on an overflow). Give ``loss_fn`` the model's task loss (``runtime.data.make_data(...).loss``: the
cross-entropy on its targets); without one the loss is the mean of the model's output (synthetic
data, throughput only). The stages run in the export's precision as the project's runtime does
(:mod:`runtime.recipe`, :mod:`runtime.master`: the stage modules cast to the half type, half
gradients averaged in the half type, fp32 master weights the optimizer steps, the boundaries
sent in the half type, fp16 loss scaling). Under torchrun, :func:`export_seat` gives a process its rank from its node
(``GROUP_RANK``, the ``--node-rank`` of the export's launch lines) and ``LOCAL_RANK``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.errors import PartitionerError
from partitioner.export import EXPORT_FORMAT, MULTI_STAGE_CLASSES, TORCH_SCHEDULE_CLASSES
from partitioner.launch import NodeLaunch, seat

from .master import MasterStep, half_stages
from .model import is_model_ref, spec_chain
from .recipe import LossScaler, ScaledStep, make_optimizer
from .stage import LayerChain, build_stage, zoo_chain
from .tensor_parallel import check_layers, group_mesh, local, shard_layers

__all__ = ["TorchPipelineRank", "build_rank", "export_seat", "mean_output_loss"]


def mean_output_loss(output: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
    """The runtime's loss (``runtime.launch``): the mean of the model's output; ``target`` unused."""
    return output.float().mean()


@dataclass
class TorchPipelineRank:
    """One rank of an exported plan on ``torch.distributed.pipelining``."""

    rank: int
    worker: int
    pipe_rank: int
    modules: dict[int, nn.Sequential]  # global stage index -> module
    stages: list[Any]  # torch PipelineStage objects, in stage order
    schedule: Any  # the torch schedule object
    batch_rows: tuple[int, int]
    is_first: bool
    is_last: bool
    grad_groups: list[tuple[Any, list[nn.Parameter]]] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    precision: str = "fp32"
    scaler: LossScaler | None = None  # fp16: the loss's gradient is scaled, the step unscales it
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_rank: int = 0  # this rank's index in its stage's tensor-parallel group
    tp_mesh: Any = None  # the group's DeviceMesh (None at degree 1)

    def make_optimizer(self, name: str, lr: float) -> Any:
        """The optimizer ``name`` (``sgd``, ``adam``, ``adamw``: :func:`runtime.recipe.make_optimizer`)
        of this rank's parameters as the runtime steps it (``step``, ``zero_grad``): in fp32 on the
        parameters; under bf16/fp16 on fp32 masters copied back into the half parameters
        (:class:`runtime.master.MasterStep`); under fp16 the gradients unscaled and the step
        skipped on every rank when one has an overflow (:class:`runtime.recipe.ScaledStep`)."""
        params = list(self.parameters())
        if self.precision == "fp32":
            return make_optimizer(params, name, lr)
        master = MasterStep(params, name, lr)
        return master if self.scaler is None else ScaledStep(master, self.scaler, self.device)

    def parameters(self) -> Iterator[nn.Parameter]:
        for s in sorted(self.modules):
            yield from self.modules[s].parameters()

    def step(self, global_batch: torch.Tensor, target: torch.Tensor | None = None) -> list[float] | None:
        """One forward/backward over this pipeline's rows of ``global_batch`` with torch's
        schedule. Returns the micro-batch losses on the ranks holding the last stage (every rank of its
        tensor-parallel group: the same values), else None."""
        a, b = self.batch_rows
        kwargs: dict[str, Any] = {}
        losses: list[torch.Tensor] = []
        if self.is_last:
            rows = global_batch[a:b]
            kwargs["target"] = (target[a:b] if target is not None else torch.zeros(rows.shape[0])).to(self.device)
            kwargs["losses"] = losses
        args = (global_batch[a:b].to(self.device),) if self.is_first else ()
        self.schedule.step(*args, **kwargs)
        return [float(x.detach()) for x in losses] if self.is_last else None

    def sync_gradients(self) -> None:
        """Average the gradients of layers held in several virtual workers (one all-reduce per
        rank set of the export's ``grad_sync``; every rank walks the sets in the same order)."""
        for (group, params), size in zip(self.grad_groups, self.group_sizes):
            if group is None or not params:
                continue
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(local(p.grad))  # a tensor-parallel shard: this rank's part
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            flat /= size
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset:offset + n].view_as(g))
                offset += n


def _check_export(export: Mapping[str, Any]) -> None:
    if export.get("format") != EXPORT_FORMAT or export.get("target") != "torch-pipelining":
        raise PartitionerError(f"not a torch-pipelining export (format {export.get('format')!r}, target "
                               f"{export.get('target')!r}); make one with `partitioner export` "
                               f"(target torch-pipelining)")
    if export.get("schedule_class") not in TORCH_SCHEDULE_CLASSES.values():
        raise PartitionerError(f"schedule_class = {export.get('schedule_class')!r}: must be one of "
                               f"{', '.join(TORCH_SCHEDULE_CLASSES.values())}")


def export_seat(export: Mapping[str, Any], env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(rank, local GPU index)`` of this torchrun process in the export: its node is the
    ``GROUP_RANK``-th of ``export['launch']['nodes']`` (started with ``--node-rank``), its rank the
    node's ``LOCAL_RANK``-th, its GPU ``cuda:LOCAL_RANK`` (``CUDA_VISIBLE_DEVICES`` lists the
    node's GPUs in that order). The same seating as the project's runtime (:mod:`partitioner.launch`)."""
    env = os.environ if env is None else env
    nodes = [NodeLaunch(n["node"], tuple(n["ranks"]), tuple(int(x) for x in n["cuda_visible_devices"].split(",")))
             for n in export["launch"]["nodes"]]
    rank, _ = seat(nodes, env)
    return rank, int(env.get("LOCAL_RANK", "0"))


def build_rank(export: Mapping[str, Any], rank: int, *, seed: int = 0, device: torch.device | str = "cpu",
               loss_fn: Callable[..., torch.Tensor] = mean_output_loss,
               model_options: Mapping[str, Any] | None = None, precision: str | None = None) -> TorchPipelineRank:
    """This rank's stages of the exported plan and torch's schedule over them (collective:
    every rank of the export calls it). ``precision``: the export's (``training.precision``)
    unless given."""
    from torch.distributed import pipelining

    _check_export(export)
    world = dist.get_world_size()
    if world != export["world_size"]:
        raise PartitionerError(f"the export runs on {export['world_size']} ranks, the process group has {world}")
    device = torch.device(device)
    me = export["ranks"][rank]
    pipe = export["pipelines"][me["virtual_worker"]]
    model = export["model"]  # a zoo name, or a user's module:function (runtime.model)
    chain = (spec_chain(model) if is_model_ref(model)
             else zoo_chain(model, export["micro_batch_size"], **dict(model_options or {})))
    if chain.num_layers != export["num_layers"]:
        raise PartitionerError(f"model '{export['model']}' has {chain.num_layers} layers, the export "
                               f"{export['num_layers']}")
    group, mesh = _process_groups(export, rank, device)
    n_stages = len(pipe["stages"])
    precision = precision or export.get("training", {}).get("precision", "fp32")
    half = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = LossScaler() if precision == "fp16" else None
    if scaler is not None:
        loss_fn = scaler.wrap_loss(loss_fn)
    m = export["n_microbatches"]
    loss_fn = _gradient_over(loss_fn, m)  # (torch's own division of the gradients off: scale_grads=False)
    modules: dict[int, nn.Sequential] = {}
    stages = []
    for s in me["stages"]:
        a, b = pipe["stages"][s]["layers"]
        modules[s] = build_stage(chain, a, b, seed=seed, device=device)
    if mesh is not None:  # the stage's blocks sharded over its group, as the runtime shards them
        _check_degree(export, chain, me)
        shard_layers(chain, modules, {s: pipe["stages"][s]["layers"][0] for s in modules}, mesh)
    if half is not None:  # half weights and gradients (runtime.master), as the runtime trains
        half_stages(modules.values(), half)
    for s in me["stages"]:
        stages.append(pipelining.PipelineStage(modules[s], s, n_stages, device, group=group))
    cls = getattr(pipelining, export["schedule_class"])
    if export["schedule_class"] in MULTI_STAGE_CLASSES:
        schedule = cls(stages, m, loss_fn=loss_fn, scale_grads=False)
    else:
        schedule = cls(stages[0], m, loss_fn=loss_fn, scale_grads=False)
    # gradient averaging between virtual workers: the layers this rank holds, per rank set
    by_layer: dict[int, nn.Module] = {pipe["stages"][s]["layers"][0] + k: layer for s, mod in modules.items()
                for k, layer in enumerate(mod)}
    grad_groups: list[tuple[Any, list[nn.Parameter]]] = []
    sizes: list[int] = []
    for held in export.get("grad_sync", []):
        g = dist.new_group(held["ranks"]) if len(held["ranks"]) > 1 else None
        params = ([q for layer in held["layers"] for q in by_layer[layer].parameters()]
                  if rank in held["ranks"] else [])
        grad_groups.append((g if rank in held["ranks"] else None, params))
        sizes.append(len(held["ranks"]))
    return TorchPipelineRank(rank=rank, worker=me["virtual_worker"], pipe_rank=me["pipe_rank"], modules=modules,
                             stages=stages, schedule=schedule, batch_rows=tuple(pipe["batch_rows"]),
                             is_first=0 in me["stages"], is_last=n_stages - 1 in me["stages"],
                             grad_groups=grad_groups, group_sizes=sizes, precision=precision, scaler=scaler,
                             device=device, tp_rank=me.get("tp_rank", 0), tp_mesh=mesh)


class _DivideGradient(torch.autograd.Function):
    """Identity forward; the backward divides the gradient by ``m``, as ``loss / m`` does."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, m: int) -> torch.Tensor:
        ctx.m = m
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.m, None


def _gradient_over(loss_fn: Callable[..., torch.Tensor], m: int) -> Callable[..., torch.Tensor]:
    """``loss_fn`` whose value is unchanged (the reported loss) and whose gradient is divided by the
    ``m`` micro-batches before the backward, as the project's runtime divides each micro-batch's
    loss: the gradients that cross the pipeline are those of the mean, not ``m`` times larger (torch's
    ``scale_grads`` divides only the accumulated weight gradients, at the end), so that in fp16 they
    overflow, and the loss scale backs off, on the same steps as in the runtime."""

    def divided(*args: Any, **kwargs: Any) -> torch.Tensor:
        return _DivideGradient.apply(loss_fn(*args, **kwargs), m)

    return divided


def _process_groups(export: Mapping[str, Any], rank: int, device: torch.device) -> tuple[Any, Any]:
    """This rank's pipeline process group (None: the whole job) and tensor-parallel mesh (None at
    degree 1). Every rank makes every group in the same order (``new_group`` is collective): the
    pipeline groups (per pipeline, one per tensor-parallel index: the ranks of that index, one
    per stage), then every device's tensor-parallel group (:func:`runtime.tensor_parallel.group_mesh`)."""
    world = export["world_size"]
    mine = None
    for p in export["pipelines"]:
        for ranks in p.get("pipe_groups", [p["ranks"]]):
            group = None if len(ranks) == world else dist.new_group(list(ranks))
            if rank in ranks:
                mine = group
    tp_groups = [g for p in export["pipelines"] for g in p.get("tp_groups", [])]
    return mine, (group_mesh(tp_groups, rank, device) if tp_groups else None)


def _check_degree(export: Mapping[str, Any], chain: LayerChain, me: Mapping[str, Any]) -> None:
    """Refuse (one line) a layer of this rank's stages that the export's degree cannot shard
    (heads or features it does not divide: :func:`runtime.tensor_parallel.check_layers`)."""
    pipe = export["pipelines"][me["virtual_worker"]]
    degrees = {}
    for s in me["stages"]:
        st = pipe["stages"][s]
        where = f"pipelines[{me['virtual_worker']}].stages[{s}]"
        for layer in range(*st["layers"]):
            degrees[layer] = (int(me["tp_size"]), where, st["device"])
    check_layers(chain, degrees)
