"""Project per-layer times to GPU types nobody measured, with a calibrated roofline.

For a layer with forward FLOPs ``F`` and memory traffic ``Q`` bytes, a device with peak
``P`` FLOP/s and bandwidth ``W`` bytes/s has the roofline time ``max(F / P, Q / W)``.
Real layers reach only a fraction of it: the *efficiency* ``e = roofline / measured``.

* **From a measured GPU type in the catalog**: ``e`` is calibrated per layer (forward and
  backward separately) on the measured type and carried over, so
  ``t_target = t_source * roof_target / roof_source``. Half-precision profiles use the
  tensor-core peak; if only one of the two types has a tensor-core figure in the catalog,
  both use FP32 peaks so that like is compared with like.
* **From a device not in the catalog** (the CPU): its effective roofs are estimated from
  the measurements themselves (the best FLOP/s and best bytes/s any layer reached), which
  gives each layer a relative efficiency ``r <= 1`` (how close it came to the best layer);
  the target's efficiency is then ``r * base_efficiency`` (default 0.5, an assumption).
* **Analytic** (nothing measured): ``t = roof_target / base_efficiency``; backward is
  taken as twice the forward work.

``Q`` is estimated as parameters + input + saved activations + output of the layer.
Projected entries are marked ``projected=True``; ``measured_on`` keeps the device whose
measurements they were derived from (empty for analytic ones). docs/profiling.md reports
how wrong this is on real data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..cluster import DeviceType, gpu_family, resolve_gpu_type
from ..errors import FormatError, PartitionerError
from ..profile import LayerTime, Profile

__all__ = [
    "DEFAULT_EFFICIENCY",
    "Roofs",
    "analytic_profile_times",
    "is_catalog_type",
    "layer_traffic_bytes",
    "project_profile",
    "project_times",
    "roofline_s",
]

DEFAULT_EFFICIENCY = 0.5
BACKWARD_WORK = 2.0  # backward does about twice the forward FLOPs and memory traffic


@dataclass(frozen=True)
class Roofs:
    """The two roofs of a device: FLOP/s and memory bytes/s."""

    flops_per_s: float
    bytes_per_s: float

    @classmethod
    def of(cls, t: DeviceType, dtype: str = "float32", precision: str = "auto") -> Roofs:
        """Roofs of a catalog type; ``precision`` "fp32", "tensor" or "auto" (tensor cores
        for half-precision dtypes when the type has them)."""
        if precision not in ("auto", "fp32", "tensor"):
            raise PartitionerError(f"precision must be auto, fp32 or tensor, not '{precision}'")
        half = dtype in ("float16", "bfloat16", "half", "mixed-fp16", "mixed-bf16")
        use_tensor = precision == "tensor" or (precision == "auto" and half)
        peak = t.tensor_flops if use_tensor and t.tensor_flops > 0 else t.peak_flops
        return cls(peak, t.mem_bandwidth_bps)


def layer_traffic_bytes(profile: Profile) -> np.ndarray:
    """Estimated bytes each layer moves in its forward pass: parameters, input (the previous
    layer's output; the layer's own output for the first), saved activations, output."""
    out = profile.array("output_bytes")
    inp = np.concatenate([out[:1], out[:-1]])
    return profile.array("param_bytes") + inp + profile.array("saved_bytes") + out


def roofline_s(flops: np.ndarray, nbytes: np.ndarray, roofs: Roofs) -> np.ndarray:
    """Per-layer roofline time ``max(F / peak, Q / bandwidth)``."""
    return np.maximum(flops / roofs.flops_per_s, nbytes / roofs.bytes_per_s)


def _source_roofs(profile: Profile, source: str, extra: Mapping[str, DeviceType] | None,
                  precision: str) -> tuple[Roofs, bool]:
    """Roofs of the measured type and whether they came from the catalog."""
    try:
        return Roofs.of(resolve_gpu_type(source, extra), profile.dtype, precision), True
    except FormatError:
        if gpu_family(source):  # measured on "an A100": which one's peaks to calibrate with is unknown
            raise FormatError("source", source, f"names several GPU types ({', '.join(gpu_family(source))}); key the "
                              "measured times by the exact type (partitioner profile merge, or edit the "
                              "profile's times keys)") from None
    return _estimated_roofs(profile, source), False


def _estimated_roofs(profile: Profile, source: str) -> Roofs:
    """Effective roofs of a device outside the catalog: the best any layer reached."""
    fwd, _ = profile.times_for(source)
    flops, nbytes = profile.array("flops"), layer_traffic_bytes(profile)
    ok = fwd > 0
    if not ok.any():
        raise PartitionerError(f"profile has no positive forward time on '{source}' to calibrate from")
    with np.errstate(over="ignore"):  # a time near 0 gives an unbounded roof: inf, handled below
        peak = float(np.max(flops[ok] / fwd[ok]))
        bw = float(np.max(nbytes[ok] / fwd[ok]))
    return Roofs(peak if peak > 0 else float("inf"), bw if bw > 0 else float("inf"))


def project_times(profile: Profile, source: str, target: DeviceType, *, efficiency: float = DEFAULT_EFFICIENCY,
                  precision: str = "auto", extra: Mapping[str, DeviceType] | None = None) -> list[LayerTime]:
    """Per-layer times on ``target`` projected from the times measured on ``source``."""
    fwd_src, bwd_src = profile.times_for(source)
    flops, nbytes = profile.array("flops"), layer_traffic_bytes(profile)
    src_roofs, from_catalog = _source_roofs(profile, source, extra, precision)
    dst_roofs = Roofs.of(target, profile.dtype, precision)
    if from_catalog and precision != "fp32":
        src_type = resolve_gpu_type(source, extra)
        if (src_roofs.flops_per_s != src_type.peak_flops) != (dst_roofs.flops_per_s != target.peak_flops):
            # One side has a tensor-core figure and the other not: compare like with like.
            src_roofs = Roofs.of(src_type, profile.dtype, "fp32")
            dst_roofs = Roofs.of(target, profile.dtype, "fp32")
    dst = roofline_s(flops, nbytes, dst_roofs)
    src = roofline_s(flops, nbytes, src_roofs)
    scale = 1.0 if from_catalog else efficiency
    # Where the source roofline is zero (a layer with no counted work), keep the ratio of
    # the whole model so the layer's measured overhead still scales sensibly.
    total_ratio = float(dst.sum() / src.sum()) if src.sum() > 0 else 1.0
    ratio = np.where(src > 0, dst / np.where(src > 0, src, 1.0), total_ratio)
    if not from_catalog:
        ratio = ratio / scale
    measured = [layer.times[source].measured_on or source for layer in profile.layers]
    return [LayerTime(float(f * r), float(b * r), projected=True, measured_on=m)
            for f, b, r, m in zip(fwd_src, bwd_src, ratio, measured, strict=False)]


def analytic_profile_times(profile: Profile, target: DeviceType, *, efficiency: float = DEFAULT_EFFICIENCY,
                           precision: str = "auto") -> list[LayerTime]:
    """Per-layer times on ``target`` from FLOPs and bytes alone (nothing measured)."""
    if not 0 < efficiency <= 1:
        raise PartitionerError(f"efficiency must be in (0, 1], not {efficiency}")
    fwd = roofline_s(profile.array("flops"), layer_traffic_bytes(profile),
                     Roofs.of(target, profile.dtype, precision)) / efficiency
    return [LayerTime(float(f), float(f * BACKWARD_WORK), projected=True, measured_on="") for f in fwd]


def _pick_source(profile: Profile, source: str | None) -> str:
    measured = [g for g in profile.gpu_types if not profile.is_projected(g)]
    if source is not None:
        if source not in profile.gpu_types:
            raise PartitionerError(f"profile has no times on '{source}' for every layer; it has: "
                                   f"{', '.join(profile.gpu_types) or 'none'}")
        return source
    if not measured:
        raise PartitionerError("profile has no measured times to project from (types: "
                               f"{', '.join(profile.gpu_types) or 'none'}, all projected); measure one type, or "
                               "make an analytic profile again with every GPU type wanted")
    return measured[0]


def project_profile(profile: Profile, targets: Sequence[str], *, source: str | None = None,
                    efficiency: float = DEFAULT_EFFICIENCY, precision: str = "auto",
                    extra: Mapping[str, DeviceType] | None = None, analytic: bool = False) -> Profile:
    """A copy of ``profile`` with projected times added for every type in ``targets``.

    ``source`` (default: the first measured type) is the measurement projected from; with
    ``analytic`` nothing measured is used. A target that already has measured times is
    refused (projection never replaces a measurement).
    """
    if not 0 < efficiency <= 1:
        raise PartitionerError(f"efficiency must be in (0, 1], not {efficiency}")
    src = None if analytic else _pick_source(profile, source)
    out = profile
    notes = dict(profile.meta.get("projections", {}))
    for name in targets:
        t = resolve_gpu_type(name, extra)
        if t.name in profile.gpu_types and not profile.is_projected(t.name):
            raise PartitionerError(f"'{t.name}' already has measured times in this profile; not projecting over them")
        if src is None:
            times = analytic_profile_times(out, t, efficiency=efficiency, precision=precision)
            notes[t.name] = {"method": "analytic roofline", "efficiency": efficiency, "precision": precision}
        else:
            times = project_times(out, src, t, efficiency=efficiency, precision=precision, extra=extra)
            notes[t.name] = {"method": "calibrated roofline", "from": src, "precision": precision,
                             **({} if is_catalog_type(src, extra) else {"efficiency": efficiency})}
        out = out.with_times(t.name, times)
    return Profile(out.model, out.micro_batch_size, out.layers, out.dtype, out.source, out.edges,
                   {**out.meta, "projections": notes})


def is_catalog_type(name: str, extra: Mapping[str, DeviceType] | None = None) -> bool:
    """Whether ``name`` resolves to a catalog (or ``extra``) GPU type."""
    try:
        resolve_gpu_type(name, extra)
    except FormatError:
        return False
    return True
