"""A rank's training state under names that do not depend on the plan.

Every tensor is named by the layer that holds it, by its index in the model's chain, so any
split of the chain (other cuts, other stage count, other virtual workers or replicas) finds it:

    model.layers.<l>.<name>          a parameter or buffer of layer l (its own state_dict key)
    optim.layers.<l>.<name>.<key>    the optimizer's state of that parameter (momentum_buffer, exp_avg, step, ...)
    rng.rank<r>                      the torch CPU generator's state of the rank r that wrote it

A stage holds layers ``[start, stop)`` of the chain (:mod:`runtime.stage`), and a rank knows its
layers by global index (``by_layer``). The optimizer's state is named through its parameters:
a parameter of ``by_layer[l]`` named ``n`` is ``optim.layers.<l>.<n>``, whatever optimizer made
the state; a value that is ``None`` is left out, a Python number is kept as a 0-d tensor. The
optimizer's hyperparameters are not state: the run's configuration gives them.

Under mixed precision (:mod:`runtime.master`) a parameter's name holds its fp32 master copy, not
its half weights, and the optimizer's state is that of the master: resuming restores the masters
exactly (the half weights are the masters rounded), and the checkpoint loads into a plan of any
precision (an fp32 run's weights into a mixed run's masters, and back).

A tensor-parallel shard (a ``DTensor``, :mod:`runtime.tensor_parallel`) has the same name as the
whole tensor: ``torch.distributed.checkpoint`` writes each shard at its offset in the whole, and a
rank reads by name the part it holds, whatever degree wrote the checkpoint (whole into shards,
shards into whole, or into shards of another degree).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from partitioner.errors import PartitionerError

__all__ = ["MODEL", "OPTIM", "RNG", "apply_state", "model_key", "named_parameters", "optim_key", "rank_state",
           "rng_key", "wanted_state"]

MODEL, OPTIM, RNG = "model.layers.", "optim.layers.", "rng.rank"


def model_key(layer: int, name: str) -> str:
    """The name of layer ``layer``'s parameter or buffer ``name``."""
    return f"{MODEL}{int(layer)}.{name}"


def optim_key(layer: int, name: str, key: str) -> str:
    """The name of the optimizer's state ``key`` of layer ``layer``'s parameter ``name``."""
    return f"{OPTIM}{int(layer)}.{name}.{key}"


def rng_key(rank: int) -> str:
    return f"{RNG}{int(rank)}"


def named_parameters(by_layer: Mapping[int, nn.Module]) -> dict[int, tuple[int, str]]:
    """``id(parameter) -> (layer, name)`` for every parameter of ``by_layer``."""
    return {id(p): (layer, name) for layer, mod in by_layer.items() for name, p in mod.named_parameters()}


def _masters(optimizer: Any) -> Mapping[int, torch.Tensor]:
    """``id(parameter) -> its fp32 master`` of a mixed-precision optimizer (``master_of``), else empty."""
    master_of = getattr(optimizer, "master_of", None)
    return master_of() if master_of is not None else {}


def _optimizer_params(optimizer: Any, names: dict[int, tuple[int, str]]) -> list[tuple[torch.Tensor, int, str]]:
    """Every parameter the optimizer steps with its layer and name (a master under its parameter's)."""
    masters = _masters(optimizer)
    names = {**names, **{id(masters[k]): v for k, v in names.items() if k in masters}}
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in names:
                raise PartitionerError("the optimizer holds a parameter of no layer of this rank; build it on the "
                                       "parameters of the rank's stages")
            out.append((p, *names[id(p)]))
    return out


def rank_state(by_layer: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer | None,
               rank: int | None = None) -> dict[str, torch.Tensor]:
    """This rank's state by name: its layers' weights and buffers, the optimizer's state of their
    parameters, and (``rank`` given) the torch CPU generator's state."""
    masters = _masters(optimizer)
    state = {model_key(layer, name): t.detach() for layer, mod in by_layer.items()
             for name, t in _with_masters(mod, masters).items()}
    if optimizer is not None:
        for p, layer, name in _optimizer_params(optimizer, named_parameters(by_layer)):
            for key, value in optimizer.state.get(p, {}).items():
                if value is None:
                    continue
                state[optim_key(layer, name, key)] = (value.detach() if isinstance(value, torch.Tensor)
                                                      else torch.tensor(value))
    if rank is not None:
        state[rng_key(rank)] = torch.get_rng_state()
    return state


def _with_masters(mod: nn.Module, masters: Mapping[int, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``mod``'s state dict with each parameter that has a master as its master."""
    state = mod.state_dict()
    if masters:
        for name, p in mod.named_parameters():
            if id(p) in masters and name in state:
                state[name] = masters[id(p)]
    return state


def wanted_state(by_layer: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer | None,
                 stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """The tensors to read for ``by_layer`` and ``optimizer`` from a checkpoint that holds
    ``stored`` (name -> shape, dtype), as empty tensors to read into: every weight and buffer of
    the layers (refused in one line when the checkpoint has not got it, or not in that shape),
    and whatever optimizer state the checkpoint has for their parameters."""
    out: dict[str, torch.Tensor] = {}
    masters = _masters(optimizer)
    for layer, mod in sorted(by_layer.items()):
        for name, t in _with_masters(mod, masters).items():
            key = model_key(layer, name)
            if key not in stored:
                raise PartitionerError(f"holds no {key} (layer {layer}'s {name}): the checkpoint is of another model")
            shape, dtype = stored[key]
            if tuple(shape) != tuple(t.shape):
                raise PartitionerError(f"{key} has shape {list(shape)}, layer {layer}'s {name} here "
                                       f"{list(t.shape)}: the checkpoint is of another model")
            out[key] = _empty_as(t, shape, dtype)
    if optimizer is not None:
        prefixes = {optim_key(layer, name, ""): p for p, layer, name in
                    _optimizer_params(optimizer, named_parameters(by_layer))}
        for key, (shape, dtype) in stored.items():
            if key.startswith(OPTIM) and key[:key.rindex(".") + 1] in prefixes:
                out[key] = _empty_as(prefixes[key[:key.rindex(".") + 1]], shape, dtype)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _empty_as(live: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An empty tensor to read a stored tensor of ``shape`` into, for the live tensor ``live``: a
    ``DTensor`` of ``live``'s mesh and placements when ``live`` is a shard of that shape (the
    checkpoint then reads this rank's part alone), else a whole tensor on the CPU."""
    from torch.distributed.tensor import DTensor

    if isinstance(live, DTensor) and tuple(shape) == tuple(live.shape):
        with torch.no_grad():
            part = torch.empty_like(live.to_local(), dtype=dtype)
        return DTensor.from_local(part, live.device_mesh, live.placements, run_check=False, shape=live.shape,
                                  stride=live.stride())
    return torch.empty(shape, dtype=dtype)


def apply_state(by_layer: Mapping[int, nn.Module], optimizer: torch.optim.Optimizer | None,
                loaded: Mapping[str, torch.Tensor]) -> None:
    """Load what :func:`wanted_state` asked for into the layers and the optimizer (its state of
    every parameter replaced; the tensors on each parameter's device)."""
    masters = _masters(optimizer)
    for layer, mod in by_layer.items():
        own = mod.state_dict()
        mod.load_state_dict({name: loaded[model_key(layer, name)] for name in own}, strict=True)
        with torch.no_grad():  # a mixed-precision parameter's master: the stored value itself, not its rounding
            for name, q in mod.named_parameters():
                if id(q) in masters:
                    _local(masters[id(q)]).copy_(_local(loaded[model_key(layer, name)]))
    if optimizer is None:
        return
    for p, layer, name in _optimizer_params(optimizer, named_parameters(by_layer)):
        prefix = optim_key(layer, name, "")
        state: dict[str, Any] = {key[len(prefix):]: t for key, t in loaded.items() if key.startswith(prefix)}
        for key, t in state.items():
            # Adam-like "step" counters stay on the CPU in float32, as Optimizer.load_state_dict keeps them
            state[key] = t if key == "step" else t.to(device=p.device, dtype=p.dtype if t.is_floating_point() else t.dtype)
        optimizer.state.pop(p, None)
        if state:
            optimizer.state[p] = state
