"""Tensor parallelism: a stage's layers sharded over its device's group, with torch's own API.

A plan device ``NODE:FIRST-LAST`` is a tensor-parallel group of ``t`` GPUs, ``t`` consecutive
ranks (:mod:`runtime.layout`). Each rank builds its stages' layers whole, from the same per-layer
seeds as everywhere (:mod:`runtime.stage`), and then shards them over its group with
``torch.distributed.tensor.parallel.parallelize_module``: the group is a one-dimensional
``DeviceMesh`` (``DeviceMesh.from_group`` over the group's process group, a sub-mesh of the
job: every rank makes every group's process group, in rank order, since ``new_group`` is
collective), and each parameter that a layer's plan names becomes a ``DTensor`` holding this
rank's shard. Megatron-LM's scheme for a transformer block (``partitioner.models._Block``):

- attention: ``attn.qkv`` ``ColwiseParallel`` (its outputs are laid out head after head, so rank
  ``i`` holds the ``q``, ``k``, ``v`` of heads ``[i * heads / t, (i + 1) * heads / t)`` and the
  attention runs those heads alone), ``attn.proj`` ``RowwiseParallel`` (its partial sums
  all-reduced into the replicated output);
- MLP: ``fc1`` ``ColwiseParallel``, ``fc2`` ``RowwiseParallel``.

A block thus takes the replicated input and returns the replicated output, with one all-reduce
in the forward of each half and one in its backward (``ColwiseParallel``'s input gradient); the
LayerNorms, the embeddings and the LM head stay whole on every rank of the group (computing the
same values; no loss parallelism). A stage's output, and the gradient of its input, are the same
on every rank of its group, which is what the pipeline sends (:meth:`runtime.layout.Layout.peers`).
The gradient of a shard is averaged between data-parallel holders of the same shard only (same
layer, same tensor-parallel index, same degree: :meth:`runtime.layout.Layout.holder_sets`).

A user's model declares its plan with ``ModelSpec(..., tensor_parallel=fn)``: ``fn(index,
layer)`` returns the ``parallelize_module`` plan of chain layer ``index`` (a mapping of
submodule paths to ``ParallelStyle``) or ``None`` to keep the layer whole; every layer must still
take and return the whole tensor (pair a ``ColwiseParallel`` with a ``RowwiseParallel`` inside a
layer), since the pipeline sends a stage's replicated output.

Refused before any process starts, in one line (:func:`check_tensor_parallel`): heads or a
sharded dimension that the degree does not divide (naming the layer, the degree and the stage),
a plan that names a submodule the layer has not got, and ``eval_global`` (the global model is
evaluated on one process). gloo on the CPU runs every collective this needs (all-reduce, and the
all-gather of :func:`full_state`); NCCL on GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner.errors import PartitionerError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from .layout import Layout
    from .run import RunSpec
    from .stage import LayerChain

__all__ = ["check_layers", "check_tensor_parallel", "full_state", "group_mesh", "layer_plan", "local", "shard_layers",
           "shard_rank", "tp_mesh", "zoo_plan"]


def zoo_plan(layer: nn.Module) -> dict[str, Any] | None:
    """The ``parallelize_module`` plan of a zoo layer: Megatron's for a transformer block, None
    (kept whole) for any other layer."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from partitioner.models import _Block

    if isinstance(layer, _Block):
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    return None


def layer_plan(chain: LayerChain, index: int, layer: nn.Module) -> dict[str, Any] | None:
    """The plan of chain layer ``index`` (the module ``layer``): the user's
    ``ModelSpec.tensor_parallel(index, layer)`` for a user's model, :func:`zoo_plan` for the zoo's."""
    from torch.distributed.tensor.parallel import ParallelStyle

    spec = chain.spec
    if spec is None:
        return zoo_plan(layer)
    hook = getattr(spec, "tensor_parallel", None)
    if hook is None:
        return None
    try:
        plan = hook(index, layer)
    except PartitionerError:
        raise
    except Exception as err:  # the user's function failed: the user's error
        text = " ".join(str(err).split())[:200]
        raise PartitionerError(f"ModelSpec.tensor_parallel({index}, layer) raised {type(err).__name__}"
                               + (f": {text}" if text else "")) from None
    if plan is None:
        return None
    if not (isinstance(plan, Mapping) and all(isinstance(k, str) and isinstance(v, ParallelStyle)
                                              for k, v in plan.items())):
        raise PartitionerError(f"ModelSpec.tensor_parallel({index}, layer) returned {type(plan).__name__}: must "
                               "return a mapping of submodule paths to ParallelStyle (ColwiseParallel(), "
                               "RowwiseParallel(), ...) or None to keep the layer whole")
    return dict(plan) or None


def _degrees(layout: Layout) -> dict[int, tuple[int, str, str]]:
    """Layer -> (tensor-parallel degree, where in the plan, device) of its first holder of degree > 1."""
    out: dict[int, tuple[int, str, str]] = {}
    for w, stages in enumerate(layout.stage_layers):
        for s, (a, b) in enumerate(stages):
            for first in layout.stage_ranks[w][s]:
                r = layout.ranks[first]
                if r.tp_size > 1:
                    for layer in range(a, b):
                        out.setdefault(layer, (r.tp_size, f"virtual_workers[{w}].stages[{s}]", r.device))
    return out


def check_tensor_parallel(run: RunSpec) -> None:
    """Refuse, in one line before any process starts, what this runtime cannot shard: a layer whose
    heads or sharded dimension its degree does not divide, a plan naming a submodule the layer has
    not got, ``eval_global`` with tensor parallelism."""
    layout = run.layout
    if not layout.tensor_parallel:
        return
    if run.config.eval_global:
        raise PartitionerError("eval_global: the global model is evaluated on one process; this plan shards "
                               "stages over tensor-parallel groups")
    check_layers(run.chain, _degrees(layout))


def check_layers(chain: LayerChain, degrees: Mapping[int, tuple[int, str, str]]) -> None:
    """Refuse (one line) a layer that its degree cannot shard: ``degrees`` maps a layer to (its
    tensor-parallel degree > 1, where in the plan, the device) -- heads or a sharded dimension
    the degree does not divide, a plan naming a submodule the layer has not got."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from partitioner.models import _Attention

    for layer, (t, where, device) in sorted(degrees.items()):
        name, module = chain.layers[layer]
        at = f"layer {layer} ({name}) at tensor-parallel degree {t} ({where} on {device})"
        for sub in module.modules():
            if isinstance(sub, _Attention) and sub.heads % t:
                raise PartitionerError(f"{at}: its {sub.heads} attention heads do not split {t} ways; plan a degree "
                                       f"that divides {sub.heads}")
        plan = layer_plan(chain, layer, module) or {}
        for path, style in plan.items():
            try:
                target = module.get_submodule(path)
            except AttributeError:
                raise PartitionerError(f"{at}: its tensor-parallel plan names '{path}', which the layer has "
                                       "not got") from None
            dim = 0 if isinstance(style, ColwiseParallel) else 1 if isinstance(style, RowwiseParallel) else None
            weight = getattr(target, "weight", None)
            if dim is None or not isinstance(target, nn.Linear) or weight is None:
                continue
            if weight.shape[dim] % t:
                what = "output features" if dim == 0 else "input features"
                raise PartitionerError(f"{at}: '{path}' has {weight.shape[dim]} {what}, which "
                                       f"{type(style).__name__} does not split {t} ways; plan a degree that divides "
                                       f"{weight.shape[dim]}")


def group_mesh(groups: Sequence[Sequence[int]], rank: int, device: torch.device) -> DeviceMesh | None:
    """This rank's tensor-parallel group of ``groups`` (every group of more than one rank, each a
    list of ranks) as a one-dimensional ``DeviceMesh`` (``"tp"``, ``DeviceMesh.from_group``), or
    None when the rank is in none. Every rank must call it with the same ``groups``: it makes their
    process groups in that order (``new_group`` is collective)."""
    from torch.distributed.device_mesh import DeviceMesh

    mine = None
    for ranks in groups:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = DeviceMesh.from_group(group, device.type, mesh_dim_names=("tp",))
    return mine


def tp_mesh(layout: Layout, rank: int, device: torch.device) -> DeviceMesh | None:
    """This rank's tensor-parallel group as a one-dimensional ``DeviceMesh`` (``"tp"``), or None
    at degree 1. Every rank must call it: it makes the process group of every group of more
    than one rank, in rank order (``new_group`` is collective)."""
    firsts = sorted({r.rank - r.tp_rank for r in layout.ranks if r.tp_size > 1})
    return group_mesh([layout.ranks[first].tp_group for first in firsts], rank, device)


def shard_layers(chain: LayerChain, modules: Mapping[int, nn.Sequential], starts: Mapping[int, int],
                 mesh: DeviceMesh) -> None:
    """Shard every layer of ``modules`` (stage -> its layers, built whole; ``starts``: stage -> the
    chain index of its first layer) over ``mesh`` with ``parallelize_module`` and the layer's plan
    (:func:`layer_plan`); a layer without a plan stays whole."""
    from torch.distributed.tensor.parallel import parallelize_module

    for s, mod in modules.items():
        for k, layer in enumerate(mod):
            plan = layer_plan(chain, starts[s] + k, layer)
            if plan:
                parallelize_module(layer, mesh, plan)


def shard_rank(run: RunSpec, rank: int, device: torch.device, modules: Mapping[int, nn.Sequential]
               ) -> DeviceMesh | None:
    """Shard this rank's stages (``modules``: stage -> its layers, built whole) over its
    tensor-parallel group, layer by layer (:func:`shard_layers`); every rank calls it (collective,
    :func:`tp_mesh`). Returns the group's mesh, None at degree 1."""
    layout = run.layout
    if not layout.tensor_parallel:
        return None
    mesh = tp_mesh(layout, rank, device)
    if mesh is None:
        return None
    stages = layout.stage_layers[layout.ranks[rank].worker]
    shard_layers(run.chain, modules, {s: stages[s][0] for s in modules}, mesh)
    return mesh


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a ``DTensor``'s local shard, any other tensor itself."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():  # the local tensor itself, not a view made by an autograd function
        return t.to_local()


def full_state(module: nn.Module, masters: Mapping[int, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``module``'s state dict with every ``DTensor`` gathered whole, on the CPU (collective over
    the tensor-parallel group: its ranks call it for the same modules in the same order); a
    parameter with a master copy in ``masters`` (``id(parameter) -> master``: mixed precision's
    fp32 copy, :mod:`runtime.master`) as its master."""
    from torch.distributed.tensor import DTensor

    state = module.state_dict()
    for name, p in module.named_parameters():
        if masters and id(p) in masters and name in state:
            state[name] = masters[id(p)]
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()}
