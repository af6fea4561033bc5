"""Merge profiles of one model measured on different GPU types into one profile.

The layers must match: same count, names, FLOPs, parameter and output bytes (to a
relative tolerance of 1e-6) and saved bytes (to ``saved_rtol``, default 5%, since
autograd may keep slightly different buffers on different devices; the merged profile
keeps the largest). Times are united per GPU type; a measured entry wins over a projected
one, and two different measurements of the same type are refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from .errors import PartitionerError
from .profile import LayerTime, Profile

__all__ = ["merge_profiles"]


def _close(a: float, b: float, rtol: float) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0) or a == b


def _check_same(base: Profile, other: Profile, k: int, saved_rtol: float) -> None:
    tag = f"profile {k + 1}"
    if other.model != base.model:
        raise PartitionerError(f"{tag} is of model '{other.model}', profile 1 of '{base.model}'; "
                               "only profiles of the same model can be merged")
    if other.micro_batch_size != base.micro_batch_size:
        raise PartitionerError(f"{tag} has micro_batch_size {other.micro_batch_size}, profile 1 has "
                               f"{base.micro_batch_size}; profile both at the same micro-batch size")
    if other.dtype != base.dtype:
        raise PartitionerError(f"{tag} has dtype {other.dtype}, profile 1 has {base.dtype}")
    for i in range(max(base.num_layers, other.num_layers)):
        if i >= base.num_layers or i >= other.num_layers:
            raise PartitionerError(f"{tag} has {other.num_layers} layers, profile 1 has {base.num_layers}; "
                                   f"first unmatched layer index {i}")
        a, b = base.layers[i], other.layers[i]
        if a.name != b.name:
            raise PartitionerError(f"layer {i} is '{b.name}' in {tag} but '{a.name}' in profile 1")
        for fld, rtol in (("flops", 1e-6), ("param_bytes", 1e-6), ("output_bytes", 1e-6),
                          ("saved_bytes", saved_rtol)):
            va, vb = getattr(a, fld), getattr(b, fld)
            if not _close(va, vb, rtol):
                raise PartitionerError(f"layer {i} '{a.name}' differs in {fld}: {vb:g} in {tag}, {va:g} in "
                                       f"profile 1 (tolerance {rtol:g}); these are not the same model")
    if base.edges != other.edges:
        raise PartitionerError(f"{tag} has different edges than profile 1")


def _pick(gpu: str, layer: str, old: LayerTime, new: LayerTime) -> LayerTime:
    if old.projected and not new.projected:
        return new
    if new.projected or old == new:
        return old
    raise PartitionerError(f"'{gpu}' is measured in two profiles with different times (layer '{layer}': "
                           f"{old.fwd_s:.3g}+{old.bwd_s:.3g} s vs {new.fwd_s:.3g}+{new.bwd_s:.3g} s); "
                           "merge only one measurement per GPU type")


def merge_profiles(profiles: Sequence[Profile], *, saved_rtol: float = 0.05) -> Profile:
    """One profile holding every GPU type's times from ``profiles`` (same model)."""
    if not profiles:
        raise PartitionerError("nothing to merge: give at least one profile")
    base = profiles[0]
    for k, other in enumerate(profiles[1:], start=1):
        _check_same(base, other, k, saved_rtol)
    layers = []
    for i, first in enumerate(base.layers):
        times: dict[str, LayerTime] = {}
        widest = first  # the measurement that saw the most saved bytes (within saved_rtol of the others)
        for p in profiles:
            layer = p.layers[i]
            if layer.saved_bytes > widest.saved_bytes:
                widest = layer
            for gpu, t in layer.times.items():
                times[gpu] = _pick(gpu, layer.name, times[gpu], t) if gpu in times else t
        layers.append(replace(first, saved_bytes=widest.saved_bytes,
                              shared_saved_bytes=widest.shared_saved_bytes,
                              selective_saved_bytes=widest.selective_saved_bytes, times=times))
    measured_on: dict[str, str] = {}
    projections: dict[str, object] = {}
    for p in profiles:
        measured_on.update(p.meta.get("measured_on", {}))
        projections.update(p.meta.get("projections", {}))
    merged = [layer_times for layer_times in layers[0].times]
    projections = {g: v for g, v in projections.items() if g in merged and any(
        layer.times[g].projected for layer in layers if g in layer.times)}
    meta = {**base.meta, "measured_on": measured_on, "merged_from": [p.source for p in profiles]}
    if projections:
        meta["projections"] = projections
    else:
        meta.pop("projections", None)
    return Profile(base.model, base.micro_batch_size, tuple(layers), base.dtype,
                   f"merge of {len(profiles)} profiles", base.edges, meta)
