"""Users' own models: ``partitioner train --model module:function``.

``function`` is called with no arguments and returns a :class:`ModelSpec`::

    # mymodels.py
    import torch
    from torch import nn
    from runtime.model import ModelSpec

    def mlp() -> ModelSpec:
        layers = [("fc1", nn.Linear(16, 64)), ("act", nn.ReLU()), ("fc2", nn.Linear(64, 4))]

        def make_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(step)           # depends on the step only
            x = torch.randn(batch_size, 16, generator=g)
            return x, (x[:, :4].sum(dim=1) > 0).long() + 2 * (x[:, 4] > 0).long()

        return ModelSpec(layers, make_batch)                     # loss: cross-entropy

    partitioner train plan.json --profile p.json --cluster c.yaml --model mymodels:mlp --local

The module is imported from ``sys.path`` (the current directory first). The layers form a
chain (each layer's output is the next layer's input, one tensor) and are re-initialised per
layer from the run's seed (every parameterised submodule needs ``reset_parameters``), so
every process that holds a layer starts from the same weights. ``make_batch(step, n)`` returns
``n`` samples ``(inputs, targets)``, the same for the same ``step`` in every process (it is
called for the whole global batch and sliced into micro-batches). ``loss(output, targets)``
returns the mean loss of a batch (default: ``torch.nn.functional.cross_entropy``); it must be
a mean over samples with as many terms per sample, so that micro-batches average to the
global batch.

Tensor parallelism (plans whose devices are groups ``NODE:FIRST-LAST``): ``tensor_parallel(index,
layer)`` returns chain layer ``index``'s plan for ``torch.distributed.tensor.parallel.
parallelize_module`` (submodule path -> ``ColwiseParallel()``, ``RowwiseParallel()``, ...) or
``None`` to keep the layer whole on every rank of the group. Each layer must take and return the
whole tensor (a ``ColwiseParallel`` followed by a ``RowwiseParallel`` inside the layer)::

    def tp(index, layer):
        return {"0": ColwiseParallel(), "2": RowwiseParallel()} if index == 1 else None

    ModelSpec(layers, make_batch, tensor_parallel=tp)   # layer 1 = nn.Sequential(Linear, ReLU, Linear)

Without it a user's model runs whole on every rank of a group (see :mod:`runtime.tensor_parallel`).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from partitioner.errors import PartitionerError

from .stage import LayerChain

__all__ = ["ModelSpec", "is_model_ref", "load_model_spec", "spec_chain"]


@dataclass(frozen=True)
class ModelSpec:
    """A user's model: ``layers`` (an ``nn.Sequential`` or a list of modules or of
    ``(name, module)``), ``make_batch(step, batch_size) -> (inputs, targets)``, an optional
    ``loss(output, targets) -> scalar`` (default cross-entropy) and an optional
    ``tensor_parallel(index, layer) -> {submodule path: ParallelStyle} | None``, each layer's
    plan for tensor-parallel groups (:mod:`runtime.tensor_parallel`)."""

    layers: Any
    make_batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    tensor_parallel: Callable[[int, nn.Module], Mapping[str, Any] | None] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.layers, nn.Sequential):
            named = list(self.layers.named_children())
        elif isinstance(self.layers, Sequence) and not isinstance(self.layers, str):
            named = []
            for k, item in enumerate(self.layers):
                if isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], nn.Module):
                    named.append((str(item[0]), item[1]))
                elif isinstance(item, nn.Module):
                    named.append((str(k), item))
                else:
                    raise PartitionerError(f"ModelSpec.layers[{k}] = {type(item).__name__}: must be an nn.Module "
                                           f"or a (name, nn.Module) pair")
        else:
            raise PartitionerError(f"ModelSpec.layers = {type(self.layers).__name__}: must be an nn.Sequential or "
                                   f"a list of modules or (name, module) pairs")
        if not named:
            raise PartitionerError("ModelSpec.layers is empty: the chain needs at least one layer")
        if not callable(self.make_batch):
            raise PartitionerError(f"ModelSpec.make_batch = {type(self.make_batch).__name__}: must be a function "
                                   f"(step, batch_size) -> (inputs, targets)")
        if self.loss is not None and not callable(self.loss):
            raise PartitionerError(f"ModelSpec.loss = {type(self.loss).__name__}: must be a function "
                                   f"(output, targets) -> scalar, or None for cross-entropy")
        if self.tensor_parallel is not None and not callable(self.tensor_parallel):
            raise PartitionerError(f"ModelSpec.tensor_parallel = {type(self.tensor_parallel).__name__}: must be a "
                                   f"function (index, layer) -> parallelize_module plan or None")
        object.__setattr__(self, "layers", named)

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``make_batch(step, batch_size)``, checked: two tensors of ``batch_size`` rows."""
        try:
            out = self.make_batch(step, batch_size)
        except PartitionerError:
            raise
        except Exception as err:  # the user's function failed: the user's error, not this library's
            raise PartitionerError(f"ModelSpec.make_batch({step}, {batch_size}) raised {_raised(err)}") from None
        if not (isinstance(out, tuple) and len(out) == 2 and all(isinstance(t, torch.Tensor) for t in out)):
            raise PartitionerError(f"ModelSpec.make_batch({step}, {batch_size}) returned {type(out).__name__}: "
                                   f"must return a tuple (inputs, targets) of tensors")
        if out[0].shape[0] != batch_size or out[1].shape[0] != batch_size:
            raise PartitionerError(f"ModelSpec.make_batch({step}, {batch_size}) returned {out[0].shape[0]} inputs "
                                   f"and {out[1].shape[0]} targets: must return {batch_size} of each")
        return out

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        assert target is not None
        if self.loss is None:
            return F.cross_entropy(output.float(), target)
        try:
            return self.loss(output, target)
        except PartitionerError:
            raise
        except Exception as err:  # the user's function failed: the user's error, not this library's
            raise PartitionerError(f"ModelSpec.loss raised {_raised(err)}") from None


def is_model_ref(name: str) -> bool:
    """Whether ``name`` names a user's model (``module:function``) rather than a zoo model."""
    return ":" in name


def load_model_spec(ref: str) -> ModelSpec:
    """Import ``module:function`` and call it; one line for every way this can fail."""
    module_name, _, func_name = ref.partition(":")
    if module_name == "hf":  # runtime/hf.py's names: built for profiling, not re-initialised per layer
        raise PartitionerError(f"model '{ref}': a transformers model by config is profiled (partitioner profile "
                               f"model {ref}), not trained by this runtime; wrap it as module:function returning a "
                               f"ModelSpec whose layers have reset_parameters")
    if not module_name or not func_name:
        raise PartitionerError(f"model '{ref}': a user's model is named module:function (e.g. mymodels:mlp)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if not _is_module_or_parent(err.name, module_name):  # the user's module imports what is not there
            raise PartitionerError(f"model '{ref}': importing module '{module_name}' raised {_raised(err)}") from None
        raise PartitionerError(f"model '{ref}': module '{module_name}' not found ({err}); "
                               f"run from its directory or add it to PYTHONPATH") from None
    except Exception as err:  # the module's own code failed: the user's error, not this library's
        raise PartitionerError(f"model '{ref}': importing module '{module_name}' raised {_raised(err)}") from None
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        raise PartitionerError(f"model '{ref}': module '{module_name}' ({getattr(module, '__file__', '?')}) has no "
                               f"function '{func_name}'")
    try:
        spec = func()
    except PartitionerError:  # a ModelSpec refused its fields (one line already)
        raise
    except Exception as err:  # the user's function failed: the user's error, not this library's
        raise PartitionerError(f"model '{ref}': {func_name}() raised {_raised(err)}") from None
    if not isinstance(spec, ModelSpec):
        raise PartitionerError(f"model '{ref}': {func_name}() returned {type(spec).__name__}; it must return "
                               f"runtime.model.ModelSpec(layers, make_batch, loss)")
    return spec


def _is_module_or_parent(missing: str | None, module_name: str) -> bool:
    """Whether the module import found missing is ``module_name`` itself or a package above it."""
    return missing is None or module_name == missing or module_name.startswith(missing + ".")


def _raised(err: BaseException) -> str:
    """``Type: message`` of an exception the user's code raised, on one line (at most 200
    characters of the message)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


def spec_chain(ref: str, spec: ModelSpec | None = None) -> LayerChain:
    """The user's model ``ref`` as a :class:`LayerChain` (its input maker is ``make_batch(0, n)``)."""
    spec = spec if spec is not None else load_model_spec(ref)

    def make_input(n: int, device: torch.device | str) -> torch.Tensor:
        return spec.batch(0, n)[0].to(device)

    return LayerChain(ref, list(spec.layers), make_input, {}, spec)
