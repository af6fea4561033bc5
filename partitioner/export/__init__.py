"""Plans in the form other training frameworks take them (torch-free).

Three targets, each a JSON-ready dict (``partitioner.export/1``) with a ready snippet, each in its
own module:

``torch-pipelining`` (:mod:`.torch_pipelining`)
    What ``torch.distributed.pipelining`` needs: per stage its layers, rank and device, the split
    points, torch's schedule class, each pipeline's batch rows and the gradient-averaging sets;
    ``runtime.torch_pipelining`` builds the per-rank stages and the schedule from it.
``deepspeed`` (:mod:`.deepspeed`)
    The ``parts`` of DeepSpeed's ``PipelineModule``, its pipe x data topology and a DeepSpeed
    config.
``megatron`` (:mod:`.megatron`)
    Megatron-LM arguments for a GPT-style chain: the pipeline layout, or uneven first/last stages.

Every target also gets the plan's training (``training``: precision, optimizer and learning
rate, ZeRO stage 0; in DeepSpeed's config and Megatron-LM's arguments too) and a launch order
(``launch``: the nodes in the order of their ranks, each with ``CUDA_VISIBLE_DEVICES`` and its
torchrun line with ``--node-rank``; DeepSpeed's hostfile), so that the plan's stage -> GPU mapping
holds (:mod:`partitioner.launch`; :func:`check_export_launch` checks a hostfile or rank order).
What the targets share, the plan checks, the recipe and the launch order, is :mod:`.common`.

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

from collections.abc import Sequence
from typing import Any

from ..errors import PartitionerError
from ..plan import Plan
from .common import EXPORT_FORMAT, TARGETS, ExportError, check_export_launch, training_of
from .deepspeed import _deepspeed, deepspeed_uniform_parts
from .megatron import _megatron, megatron_layer_kinds
from .torch_pipelining import MULTI_STAGE_CLASSES, TORCH_SCHEDULE_CLASSES, _torch_pipelining

__all__ = ["EXPORT_FORMAT", "MULTI_STAGE_CLASSES", "TARGETS", "TORCH_SCHEDULE_CLASSES", "ExportError",
           "check_export_launch", "deepspeed_uniform_parts", "export_plan", "megatron_layer_kinds",
           "training_of"]


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
