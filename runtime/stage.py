"""The modules of a pipeline stage: layers ``[start, stop)`` of a chain, initialised per layer.

Every layer ``l`` is initialised from its own seed ``(seed, l)``, independently of which
other layers a process builds, so two processes that hold layer ``l`` (the same stage
in two virtual workers, even when the virtual workers cut the chain differently) start
from identical weights, and so does a single process that builds the whole chain.

Zoo models are built on the meta device (no memory) and only the stage's layers are
materialised. Any ``nn.Sequential`` (or list of ``(name, module)``) works too: its layers
are copied and re-initialised the same way.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from partitioner.errors import PartitionerError

__all__ = ["LayerChain", "boundary_shapes", "build_stage", "init_layer", "layer_seed", "zoo_chain"]


@dataclass
class LayerChain:
    """A chain of layers (possibly on the meta device) and a maker of real input batches.

    ``config`` is the zoo model's configuration (``vocab``/``seq_len`` for transformers,
    ``classes``/``image_size`` for CNNs; see :func:`partitioner.models.build_model`), which
    :mod:`runtime.data` reads to make the model's training task; ``spec`` is the user's
    :class:`runtime.model.ModelSpec` when the chain is not from the zoo."""

    name: str
    layers: list[tuple[str, nn.Module]]
    make_input: Any  # Callable[[int, device], Tensor]
    config: dict[str, Any] = field(default_factory=dict)
    spec: Any = None  # runtime.model.ModelSpec | None

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def zoo_chain(model: str, micro_batch_size: int = 1, **options: Any) -> LayerChain:
    """Zoo model ``model`` as a :class:`LayerChain` built on the meta device (no weights yet)."""
    from partitioner.models import build_model

    zoo = build_model(model, micro_batch_size, device="meta", **options)
    return LayerChain(model, list(zoo.layers), zoo.make_input, dict(zoo.config))


def layer_seed(seed: int, layer: int) -> int:
    """The seed of layer ``layer``'s initial weights (a fixed mix of the run seed and the index)."""
    return (int(seed) * 1_000_003 + int(layer) * 7919 + 17) % (2**63 - 1)


def init_layer(module: nn.Module, index: int, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """A copy of ``module`` on ``device`` with every parameter and buffer re-initialised from
    :func:`layer_seed` ``(seed, index)`` (each submodule's ``reset_parameters``, in module order).

    The values are drawn on the CPU and then moved, so a seed gives the same weights on every
    device (CUDA's generator draws other numbers than the CPU's for the same seed)."""
    layer = copy.deepcopy(module)
    layer = layer.to_empty(device="cpu")
    torch.manual_seed(layer_seed(seed, index))
    covered: set[int] = set()
    for sub in layer.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
            covered.update(id(p) for p in sub.parameters())
            covered.update(id(b) for b in sub.buffers())
    missing = [n for n, p in layer.named_parameters() if id(p) not in covered]
    if missing:
        raise PartitionerError(f"layer {index} has parameters no submodule can re-initialise "
                               f"({', '.join(missing[:3])}): give their module a reset_parameters()")
    for name, buf in layer.named_buffers():
        if id(buf) not in covered:  # plain buffers (masks, constants): copy the original values
            src = dict(module.named_buffers())[name]
            if src.device.type == "meta":
                raise PartitionerError(f"layer {index} buffer {name} has no values on the meta device")
            buf.copy_(src)
    layer.train()
    return layer.to(device)


def _layers_of(chain: LayerChain | nn.Sequential | Iterable[Any]) -> list[tuple[str, nn.Module]]:
    if isinstance(chain, LayerChain):
        return chain.layers
    if isinstance(chain, nn.Sequential):
        return list(chain.named_children())
    out = []
    for k, item in enumerate(chain):
        out.append((str(item[0]), item[1]) if isinstance(item, tuple) else (str(k), item))
    return out


def build_stage(chain: LayerChain | nn.Sequential | Iterable[Any], start: int, stop: int, seed: int = 0,
                device: torch.device | str = "cpu") -> nn.Sequential:
    """Layers ``[start, stop)`` of ``chain`` as one ``nn.Sequential`` on ``device``, each layer
    initialised by :func:`init_layer` (so identical in every process that builds it)."""
    layers = _layers_of(chain)
    if not (0 <= start < stop <= len(layers)):
        raise PartitionerError(f"stage layers [{start}, {stop}) out of range: the chain has {len(layers)} layers")
    return nn.Sequential(OrderedDict(
        (f"{i}_{layers[i][0].replace('.', '_')}", init_layer(layers[i][1], i, seed, device))
        for i in range(start, stop)))


def boundary_shapes(chain: LayerChain, micro_batch_size: int) -> list[tuple[torch.Size, torch.dtype]]:
    """Shape and dtype of every layer's output for one micro-batch (a dry pass on the meta
    device: ``out[l]`` is what crosses a cut after layer ``l``)."""
    x = chain.make_input(micro_batch_size, "meta")
    out: list[tuple[torch.Size, torch.dtype]] = []
    with torch.no_grad():
        for _, layer in chain.layers:
            on_meta = all(t.device.type == "meta" for t in (*layer.parameters(), *layer.buffers()))
            x = (layer if on_meta else copy.deepcopy(layer).to("meta"))(x)
            if not isinstance(x, torch.Tensor):
                raise PartitionerError("a layer returned a non-tensor; the runtime sends one tensor per boundary")
            out.append((x.shape, x.dtype))
    return out

