"""Tied parameters: one tensor used by two layers (GPT-style models tie the input embedding to the
output head), declared by the profile, and the all-reduce their stages run.

A profile declares them in its meta (docs/formats.md)::

    "meta": {"tied": [{"layers": [0, 25], "param_bytes": 102957056}]}

``param_bytes`` is the tied tensor's size in the profile's dtype (each layer's own
``param_bytes`` already counts its copy: a stage holding either layer holds the tensor). When the
two layers sit on different devices of a pipeline, each keeps a copy and, after the last backward
of the iteration, the two stages all-reduce the tied tensor's gradient so that the copies stay
equal (Megatron-LM's embedding group; DeepSpeed's ``TiedLayerSpec``): one more all-reduce,
between the holders of the two layers, before the optimizer step. Where one device holds both
layers there is none. :meth:`partitioner.cost.CostModel.sync_groups` adds these groups after
the data-parallel ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import FormatError, check
from .profile import MAX_BYTES, Profile

__all__ = ["TiedParameter", "tied_parameters"]


@dataclass(frozen=True)
class TiedParameter:
    """A tensor shared by ``layers`` (two layer indices of the profile), ``param_bytes`` in the
    profile's dtype."""

    layers: tuple[int, int]
    param_bytes: float

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "param_bytes": self.param_bytes}


def tied_parameters(profile: Profile) -> tuple[TiedParameter, ...]:
    """The tied tensors ``profile.meta["tied"]`` declares (none when absent), each checked: two
    different layer indices of the profile and a size in bytes."""
    raw: Any = profile.meta.get("tied", [])
    if not isinstance(raw, list):
        raise FormatError("meta.tied", raw, "must be a list of {layers: [i, j], param_bytes}")
    out = []
    for k, entry in enumerate(raw):
        where = f"meta.tied[{k}]"
        if not isinstance(entry, Mapping):
            raise FormatError(where, entry, "must be an object {layers: [i, j], param_bytes}")
        layers: Any = entry.get("layers")
        ok = (isinstance(layers, list) and len(layers) == 2
              and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < profile.num_layers for x in layers)
              and layers[0] != layers[1])
        check(ok, f"{where}.layers", layers, f"must be two different layer indices in [0, {profile.num_layers - 1}]")
        size: Any = entry.get("param_bytes")
        check(isinstance(size, (int, float)) and not isinstance(size, bool) and 0 <= size <= MAX_BYTES,
              f"{where}.param_bytes", size, f"must be a number of bytes in [0, {MAX_BYTES:g}]")
        out.append(TiedParameter((min(layers), max(layers)), float(size)))
    return tuple(out)
