"""The fixed cost of a micro-batch, from a profile measured at several micro-batch sizes.

A layer's time on a GPU grows with the micro-batch's samples ``b``, but not from zero: kernel
launches, the framework's per-call work and small-batch inefficiency cost about the same at any
size. Scaling a profile measured at one size linearly (``Profile.rescaled``) charges that fixed
part ``b / b0`` times: too much on larger micro-batches, too little on smaller ones. Where the
profile has times at several sizes (``LayerProfile.times_at``), each layer's forward and backward
time per GPU type is fitted as ``c + s b`` (least squares over the measured sizes); ``c`` is the
layer's fixed cost per micro-batch and their sum the model's (:func:`micro_batch_overhead_s`).
:func:`at_size_affine` prices any size with the fitted lines, beyond the measured range too
(``Profile.at_size`` interpolates between measured sizes only). Nothing here is fitted to
measured runs: the fit is of the profile's own measurements.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from .errors import check
from .profile import LayerTime, Profile

__all__ = ["AffineTimes", "affine_times", "at_size_affine", "micro_batch_overhead_s"]


@dataclass(frozen=True)
class AffineTimes:
    """Per layer, forward and backward seconds as ``fixed + per_sample * b`` on one GPU type."""

    gpu_type: str
    sizes: tuple[int, ...]
    fwd_fixed_s: tuple[float, ...]
    fwd_per_sample_s: tuple[float, ...]
    bwd_fixed_s: tuple[float, ...]
    bwd_per_sample_s: tuple[float, ...]

    @property
    def fixed_s(self) -> float:
        """Forward plus backward fixed seconds of one micro-batch through every layer."""
        return float(sum(self.fwd_fixed_s) + sum(self.bwd_fixed_s))


def _measured(profile: Profile, gpu_type: str) -> dict[int, list[LayerTime]]:
    out: dict[int, list[LayerTime]] = {}
    for size in profile.measured_sizes:
        rows = []
        for layer in profile.layers:
            times: Mapping[str, LayerTime] = layer.times if size == profile.micro_batch_size else layer.times_at[size]
            if gpu_type not in times:
                break
            rows.append(times[gpu_type])
        if len(rows) == profile.num_layers:
            out[size] = rows
    return out


def affine_times(profile: Profile, gpu_type: str) -> AffineTimes:
    """Least-squares ``c + s b`` per layer and direction from the sizes ``gpu_type`` was measured at
    (at least two); ``c`` is kept >= 0 (a line through the origin where the fit's intercept is
    negative) and ``s`` >= 0."""
    measured = _measured(profile, gpu_type)
    sizes = tuple(sorted(measured))
    check(len(sizes) >= 2, "times_at", f"{gpu_type}: sizes {list(sizes)}",
          "a fixed cost per micro-batch needs times measured at two or more micro-batch sizes")
    b = np.array(sizes, dtype=float)
    fits = {}
    for name in ("fwd_s", "bwd_s"):
        y = np.array([[getattr(t, name) for t in measured[s]] for s in sizes])  # sizes x layers
        design = np.stack([np.ones_like(b), b], axis=1)
        coef, *_ = np.linalg.lstsq(design, y, rcond=None)
        fixed, slope = coef[0], coef[1]
        through_zero = (b @ y) / (b @ b)  # where an intercept would be negative: c = 0
        slope = np.where(fixed < 0, through_zero, slope)
        fixed = np.maximum(fixed, 0.0)
        fits[name] = (tuple(float(x) for x in fixed), tuple(float(x) for x in np.maximum(slope, 0.0)))
    return AffineTimes(gpu_type, sizes, fits["fwd_s"][0], fits["fwd_s"][1], fits["bwd_s"][0], fits["bwd_s"][1])


def micro_batch_overhead_s(profile: Profile) -> dict[str, float]:
    """Per GPU type measured at two or more sizes: the fixed seconds of one micro-batch (forward
    and backward through every layer)."""
    out = {}
    for gpu in profile.gpu_types:
        if len(_measured(profile, gpu)) >= 2:
            out[gpu] = affine_times(profile, gpu).fixed_s
    return out


def at_size_affine(profile: Profile, micro_batch_size: int) -> Profile:
    """The profile at ``micro_batch_size`` with every GPU type measured at two or more sizes priced
    by its fitted lines (others scaled linearly, as ``Profile.rescaled`` does); bytes and FLOPs
    scale with the size, parameters and optimizer steps do not."""
    check(isinstance(micro_batch_size, int) and not isinstance(micro_batch_size, bool) and micro_batch_size >= 1,
          "micro_batch_size", micro_batch_size, "must be an integer >= 1")
    scaled = profile.rescaled(micro_batch_size)
    fits = {g: affine_times(profile, g) for g in profile.gpu_types if len(_measured(profile, g)) >= 2}
    layers = []
    for i, layer in enumerate(scaled.layers):
        times = dict(layer.times)
        for g, fit in fits.items():
            times[g] = replace(times[g], fwd_s=fit.fwd_fixed_s[i] + fit.fwd_per_sample_s[i] * micro_batch_size,
                               bwd_s=fit.bwd_fixed_s[i] + fit.bwd_per_sample_s[i] * micro_batch_size)
        layers.append(replace(layer, times=times, times_at={}))
    meta = {**scaled.meta, "affine_times": {g: list(f.sizes) for g, f in fits.items()}}
    return Profile(scaled.model, micro_batch_size, tuple(layers), scaled.dtype, scaled.source, scaled.edges, meta)
