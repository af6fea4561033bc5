"""Per-operator projection of layer times between GPU types.

A layer's time on a GPU type is the sum of its operators' times (``partitioner.projection.operators``),
each priced from its arithmetic intensity and the type's catalog peaks:

* a GEMM takes ``flops / (fraction x peak x waves)`` on the faster of the paths its math
  allows (:data:`MATH_MODES`: FP32 on CUDA cores always; TF32/FP16/BF16 on tensor cores where
  the type has them): ``fraction`` is the achievable share of that path's peak (one for tensor
  cores, one for CUDA cores; batched attention GEMMs get a factor of their own; a GeForce
  RTX 3090's TF32 tensor rate is no faster than its FP32 rate, so its GEMMs take the CUDA-core
  path), ``waves`` the tile/wave quantisation of the GEMM on the type's SMs (128 x 128 output
  tiles; a partly filled last wave or a ragged edge tile wastes its share). It is never faster
  than moving its bytes;
* an element-wise, normalisation, soft-max or embedding kernel takes
  ``bytes / (fraction x bandwidth)``;
* every kernel takes at least ``launch_s`` (the host issuing it), and each pass of a layer
  pays a fixed ``layer_fwd_s`` / ``layer_bwd_s``;
* an all-reduce (tensor parallelism) is priced by a model of the GPUs' interconnect
  (:class:`AllReduceModel`: measured points, :class:`AllReduce`, or the collective model of
  ``partitioner.collectives``), which is not a property of the GPU type: an input, never
  fitted here.

The fractions and overheads (:class:`OpModelParams`) are fitted on measured GPU types
(``partitioner.projection.fit``); :class:`Calibration` bundles them with the expected error
of each operator class measured leave-one-type-out. :func:`project_with_ops` projects a
profile: each layer's measured time on the source type is multiplied by the ratio of the
model's times on the target and on the source (the source's measurement carries what the
model does not know, such as a framework's extra kernels), and the target's all-reduces are
added. docs/profiling.md reports how wrong it is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from typing import Any, Protocol

import numpy as np

from ..cluster import DeviceType, resolve_gpu_type
from ..errors import FormatError, OptionError, PartitionerError, check
from ..profile import LayerTime, Profile
from .operators import (
    COMPUTE_KINDS,
    LayerOps,
    Op,
    OperatorTable,
    TransformerShape,
    layer_kind,
    transformer_ops,
)

__all__ = [
    "CALIBRATION_FORMAT",
    "DEFAULT_HEAD_DIM",
    "ERROR_CLASSES",
    "MATH_MODES",
    "MIN_COMPUTE_SHARE",
    "AllReduce",
    "AllReduceModel",
    "Calibration",
    "Measured",
    "OpModelParams",
    "Rates",
    "anchored_s",
    "comm_time_s",
    "default_calibration",
    "expected_error",
    "gemm_rate",
    "has_operators",
    "is_sailor",
    "layer_ops_for",
    "layer_time_s",
    "math_for",
    "op_mix",
    "op_time_s",
    "operators_for",
    "project_with_ops",
    "transformer_shape",
    "wave_efficiency",
]

MATH_MODES = ("fp32", "tf32", "fp16", "bf16")
CALIBRATION_FORMAT = "partitioner.op-calibration/1"
ERROR_CLASSES = ("gemm", "bgemm", "memory", "overhead")  # how a layer's predicted time splits
TILE = 128  # output tile side of the GEMM model (cuBLAS's common 128 x 128 tiles)


@dataclass(frozen=True)
class Rates:
    """What one GPU type offers an operator under one math mode: the tensor-core GEMM rate the
    mode allows (0 when the type has none for it), the FP32 CUDA-core rate, memory bandwidth."""

    tensor_flops_per_s: float
    cuda_flops_per_s: float
    mem_bytes_per_s: float
    sm_count: int = 0

    @classmethod
    def of(cls, t: DeviceType, math_mode: str) -> Rates:
        """The rates of ``t`` when GEMMs run in ``math_mode``."""
        check(math_mode in MATH_MODES, "math", math_mode, f"must be one of {', '.join(MATH_MODES)}",
              OptionError)
        tensor = {"fp32": 0.0, "tf32": t.tf32_flops, "fp16": t.tensor_flops, "bf16": t.bf16_flops}[math_mode]
        return cls(tensor, t.peak_flops, t.mem_bandwidth_bps, t.sm_count)

    @property
    def tensor(self) -> bool:
        return self.tensor_flops_per_s > 0


@dataclass(frozen=True)
class OpModelParams:
    """The fitted constants of the operator model (see the module docstring)."""

    gemm_tensor_fraction: float = 0.6
    gemm_cuda_fraction: float = 0.7
    bgemm_factor: float = 1.0  # batched GEMMs reach this times the dense GEMMs' fraction
    memory_fraction: float = 0.8
    softmax_factor: float = 1.0  # soft-max kernels reach this times the element-wise fraction
    launch_s: float = 5e-6
    layer_fwd_s: float = 0.0
    layer_bwd_s: float = 0.0

    def __post_init__(self) -> None:
        for name in self.names():
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
                  name, v, "must be a finite number >= 0")
        for name in ("gemm_tensor_fraction", "gemm_cuda_fraction", "bgemm_factor", "memory_fraction",
                     "softmax_factor"):
            check(getattr(self, name) > 0, name, getattr(self, name), "must be > 0")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def vector(self) -> np.ndarray:
        return np.array([getattr(self, n) for n in self.names()], dtype=np.float64)

    @classmethod
    def from_vector(cls, v: Sequence[float]) -> OpModelParams:
        return cls(*(float(x) for x in v))

    def to_dict(self) -> dict[str, float]:
        return {n: getattr(self, n) for n in self.names()}

    @classmethod
    def from_dict(cls, d: Any, where: str = "params.") -> OpModelParams:
        if not isinstance(d, Mapping):
            raise FormatError(where.rstrip("."), d, "must be an object of fitted constants")
        unknown = sorted(set(d) - set(cls.names()))
        if unknown:
            raise FormatError(f"{where}{unknown[0]}", d[unknown[0]], f"is not one of {', '.join(cls.names())}")
        try:
            return cls(**{k: float(v) for k, v in d.items()})
        except (TypeError, ValueError):
            raise FormatError(where.rstrip("."), d, "values must be numbers") from None
        except FormatError as err:
            raise err.under(where) from None


class AllReduceModel(Protocol):
    """Anything that prices an all-reduce of ``nbytes`` over a group of ``group`` GPUs."""

    def time_s(self, nbytes: float, group: int) -> float: ...


@dataclass(frozen=True)
class AllReduce:
    """All-reduce seconds over a group of GPUs, from ``(message bytes, seconds)`` points per group
    size: linear between points, through zero below the smallest, along the last segment (or
    the line through zero and the last point) above the largest."""

    points: Mapping[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clean: dict[int, tuple[tuple[float, float], ...]] = {}
        for g, pts in self.points.items():
            rows = tuple(sorted((float(b), float(t)) for b, t in pts))
            ok = int(g) >= 2 and len(rows) >= 1 and all(
                math.isfinite(b) and math.isfinite(t) and b > 0 and t >= 0 for b, t in rows)
            check(ok, f"allreduce[{g}]", rows, "needs a group >= 2 and (bytes > 0, seconds >= 0) points")
            clean[int(g)] = rows
        object.__setattr__(self, "points", clean)

    def time_s(self, nbytes: float, group: int) -> float:
        if group <= 1 or nbytes <= 0:
            return 0.0
        if group not in self.points:
            have = ", ".join(map(str, sorted(self.points))) or "none"
            raise PartitionerError(f"no all-reduce figures for a group of {group} GPUs (have: {have})")
        pts = [(0.0, 0.0), *self.points[group]]
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        if nbytes <= xs[-1]:
            return float(np.interp(nbytes, xs, ys))
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        if slope <= 0:
            slope = ys[-1] / xs[-1]
        return ys[-1] + slope * (nbytes - xs[-1])


def wave_efficiency(gemm: tuple[int, int, int, int] | None, sm_count: int) -> float:
    """Share of the GPU's SMs doing useful work on a GEMM of ``(batch, m, n, k)`` cut into
    128 x 128 output tiles: ragged edge tiles and a partly filled last wave are waste. With
    fewer tiles than SMs the reduction dimension is split (split-K) to fill them, in chunks of
    at least 512. 1 when the SM count is unknown."""
    if gemm is None or sm_count <= 0:
        return 1.0
    b, m, n, k = gemm
    tm, tn = math.ceil(m / TILE), math.ceil(n / TILE)
    edge = (m * n) / (tm * tn * TILE * TILE)
    tiles = b * tm * tn
    if tiles < sm_count:
        tiles *= max(1, min(sm_count // tiles, k // 512))
    waves = math.ceil(tiles / sm_count)
    return edge * tiles / (waves * sm_count)


def gemm_rate(rates: Rates, p: OpModelParams) -> float:
    """The FLOP/s a large GEMM reaches: the faster of the tensor-core path (where the math mode
    allows one) and the CUDA-core path, each at its fitted fraction of peak."""
    return max(p.gemm_tensor_fraction * rates.tensor_flops_per_s, p.gemm_cuda_fraction * rates.cuda_flops_per_s)


def _work_s(op: Op, rates: Rates, p: OpModelParams, waves: bool) -> tuple[float, str]:
    """Seconds of an operator's work, without the launch floor, and its error class."""
    if op.kind in COMPUTE_KINDS:
        rate = gemm_rate(rates, p) * (p.bgemm_factor if op.kind == "bgemm" else 1.0)
        eff = wave_efficiency(op.gemm, rates.sm_count) if waves else 1.0
        compute = op.flops / (rate * eff)
        return max(compute, op.mem_bytes / (p.memory_fraction * rates.mem_bytes_per_s)), op.kind
    frac = p.memory_fraction * (p.softmax_factor if op.kind == "softmax" else 1.0)
    return op.mem_bytes / (frac * rates.mem_bytes_per_s), "memory"


def op_time_s(op: Op, rates: Rates, params: OpModelParams, allreduce: AllReduceModel | None = None, *,
              waves: bool = True) -> float:
    """Seconds one operator takes (an all-reduce only with an ``allreduce`` model, else 0)."""
    if op.kind == "allreduce":
        return allreduce.time_s(op.comm_bytes, op.group) if allreduce is not None else 0.0
    work, _ = _work_s(op, rates, params, waves)
    return max(work, op.kernels * params.launch_s)


def layer_time_s(ops: Iterable[Op], rates: Rates, params: OpModelParams, phase: str,
                 allreduce: AllReduceModel | None = None, *, waves: bool = True) -> float:
    """Seconds of one pass (``fwd``/``bwd``) of a layer: its operators and the fixed overhead."""
    own = [op for op in ops if op.phase == phase]
    fixed = params.layer_fwd_s if phase == "fwd" else params.layer_bwd_s
    return fixed + math.fsum(op_time_s(op, rates, params, allreduce, waves=waves) for op in own)


def op_mix(ops: Iterable[Op], rates: Rates, params: OpModelParams, *, waves: bool = True) -> dict[str, float]:
    """How a layer's predicted compute time (both passes, all-reduces left out) splits over
    :data:`ERROR_CLASSES`: GEMMs, batched GEMMs, memory-bound kernels, and overhead (launch
    floors and the fixed per-pass time). The shares add up to 1."""
    share = dict.fromkeys(ERROR_CLASSES, 0.0)
    share["overhead"] = params.layer_fwd_s + params.layer_bwd_s
    for op in ops:
        if op.kind == "allreduce":
            continue
        work, cls = _work_s(op, rates, params, waves)
        floor = op.kernels * params.launch_s
        share[cls if work >= floor else "overhead"] += max(work, floor)
    total = sum(share.values())
    return {k: (v / total if total > 0 else 0.0) for k, v in share.items()}


@dataclass(frozen=True)
class Calibration:
    """Fitted operator-model constants, the math mode they were fitted for, the expected
    relative error of each error class (from leave-one-type-out residuals) and what they were
    fitted on."""

    params: OpModelParams
    math: str = "fp32"
    class_error: Mapping[str, float] = field(default_factory=dict)  # anchored on a measured type
    waves: bool = True
    fitted_on: str = ""
    recompute: bool = False  # the blocks' backward re-runs their forward (activation checkpointing)
    class_error_alone: Mapping[str, float] = field(default_factory=dict)  # the model alone, nothing measured

    def __post_init__(self) -> None:
        check(self.math in MATH_MODES, "math", self.math, f"must be one of {', '.join(MATH_MODES)}")
        for name in ("class_error", "class_error_alone"):
            table = dict(getattr(self, name))
            object.__setattr__(self, name, table)
            for k, v in table.items():
                check(k in ERROR_CLASSES and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0,
                      f"{name}.{k}", v, f"must name one of {', '.join(ERROR_CLASSES)} with a number >= 0")

    def to_dict(self) -> dict[str, Any]:
        return {"format": CALIBRATION_FORMAT, "params": self.params.to_dict(), "math": self.math,
                "recompute": self.recompute, "waves": self.waves, "class_error": dict(self.class_error),
                "class_error_alone": dict(self.class_error_alone), "fitted_on": self.fitted_on}

    @classmethod
    def from_dict(cls, d: Any) -> Calibration:
        if not isinstance(d, Mapping):
            raise FormatError("calibration", d, "must be an object {params, math, class_error, ...}")
        fmt = d.get("format", CALIBRATION_FORMAT)
        check(fmt == CALIBRATION_FORMAT, "calibration.format", fmt, f"expected '{CALIBRATION_FORMAT}'")

        def table(key: str) -> dict[str, float]:
            raw = d.get(key, {})
            check(isinstance(raw, Mapping), f"calibration.{key}", raw, "must map error classes to numbers")
            return {str(k): float(v) for k, v in raw.items()}

        return cls(OpModelParams.from_dict(d.get("params", {})), str(d.get("math", "fp32")), table("class_error"),
                   bool(d.get("waves", True)), str(d.get("fitted_on", "")), bool(d.get("recompute", False)),
                   table("class_error_alone"))

    def with_math(self, math_mode: str) -> Calibration:
        return replace(self, math=math_mode)


def default_calibration() -> Calibration:
    """The calibration shipped with the package (``partitioner/data/op_calibration.json``,
    written by ``tools/fit_projection.py``; docs/profiling.md names its data)."""
    text = resources.files("partitioner").joinpath("data/op_calibration.json").read_text(encoding="utf-8")
    return Calibration.from_dict(json.loads(text))


def expected_error(layer: LayerOps, rates: Rates, calibration: Calibration, *, anchored: bool = True) -> float:
    """Expected relative error of a projected layer: the error of each class (measured
    leave-one-type-out, anchored on a measured type or the model alone), weighted by the
    class's share of the layer's predicted time on the target. All-reduces are not covered."""
    mix = op_mix(layer.ops, rates, calibration.params, waves=calibration.waves)
    table = calibration.class_error if anchored else calibration.class_error_alone
    return math.fsum(mix[k] * table.get(k, 0.0) for k in ERROR_CLASSES)


def layer_ops_for(table: OperatorTable, names: Sequence[str]) -> list[LayerOps]:
    """The table's layers in the order of ``names`` (a profile's layers), by name."""
    by_name = {x.name: x for x in table.layers}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise FormatError("meta.operators.layers", missing[0],
                          f"the operator table has no layer of this name ({len(missing)} of the profile's "
                          "layers are missing)")
    return [by_name[n] for n in names]


def comm_time_s(ops: Iterable[Op], phase: str, allreduce: AllReduceModel | None) -> float:
    """Seconds of the all-reduces of one pass (0 without a model)."""
    if allreduce is None:
        return 0.0
    return math.fsum(allreduce.time_s(op.comm_bytes, op.group) for op in ops
                     if op.kind == "allreduce" and op.phase == phase)


@dataclass(frozen=True)
class Measured:
    """One source of a projection: a layer's measured pass on a GPU type, with that type's rates
    and all-reduce model."""

    seconds: float
    rates: Rates
    allreduce: AllReduceModel | None = None


MIN_COMPUTE_SHARE = 0.1  # a measured pass keeps at least this share as compute when its all-reduces are removed


def anchored_s(layer: LayerOps, phase: str, sources: Sequence[Measured], target: Rates,
               target_allreduce: AllReduceModel | None, calibration: Calibration) -> float:
    """A pass of ``layer`` on the target, from measurements on ``sources``: each source's
    measured compute (its measured time less its all-reduces) times the model's ratio of target
    to source compute; the geometric mean over sources; plus the target's all-reduces."""
    check(len(sources) >= 1, "sources", [], "need at least one measured source")
    p, waves = calibration.params, calibration.waves
    tgt = layer_time_s(layer.ops, target, p, phase, waves=waves)
    logs = []
    for src in sources:
        comm = comm_time_s(layer.ops, phase, src.allreduce)
        compute = max(src.seconds - comm, MIN_COMPUTE_SHARE * src.seconds)
        model = layer_time_s(layer.ops, src.rates, p, phase, waves=waves)
        ratio = tgt / model if model > 0 else 1.0  # a pass with no work carries over as measured
        logs.append(math.log(max(compute, 1e-12) * max(ratio, 1e-12)))
    return math.exp(math.fsum(logs) / len(logs)) + comm_time_s(layer.ops, phase, target_allreduce)


# -- projecting a profile ---------------------------------------------------------------------

_MATH_OF_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16",
                  "mixed-fp16": "fp16", "mixed-bf16": "bf16"}
_DTYPE_OF_MATH = {"fp32": "float32", "tf32": "float32", "fp16": "float16", "bf16": "bfloat16"}
DEFAULT_HEAD_DIM = 64  # heads = hidden / 64 when a profile does not say (GPT-2, OPT, BERT)


def is_sailor(profile: Profile) -> bool:
    """Whether the profile was imported from Sailor (Megatron-LM layout, measured in FP32 with
    TF32 GEMMs on Ampere and Hopper whatever its ``dtype`` says: docs/profiling.md)."""
    return profile.source.startswith("sailor:")


def math_for(profile: Profile, calibration: Calibration, math_mode: str | None = None) -> str:
    """The math mode a profile's GEMMs ran in: ``math_mode`` when given; Sailor's profiles the
    calibration's; otherwise the profile's ``dtype`` (``float32``: FP32, PyTorch's default since
    1.12; half types: their tensor cores)."""
    if math_mode is not None:
        check(math_mode in MATH_MODES, "math", math_mode, f"must be one of {', '.join(MATH_MODES)}", OptionError)
        return math_mode
    if is_sailor(profile):
        return calibration.math
    return _MATH_OF_DTYPE.get(profile.dtype, "fp32")


def transformer_shape(profile: Profile) -> TransformerShape | None:
    """A transformer shape from a profile's ``meta`` (the zoo profiler's ``config``, or a Sailor
    import's ``hidden_size``, ``seq_len``, ``vocab_size``), or None."""
    meta = profile.meta
    raw = meta.get("config")
    cfg: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}

    def positive(*keys: str) -> int | None:
        for where, key in zip((cfg, meta), keys, strict=False):
            v = where.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
                return v
        return None

    hidden, seq, vocab = positive("hidden", "hidden_size"), positive("seq_len", "seq_len"), positive("vocab", "vocab_size")
    if hidden is None or seq is None or vocab is None:
        return None
    heads = positive("heads", "heads") or max(1, hidden // DEFAULT_HEAD_DIM)
    sailor = is_sailor(profile)
    bert = str(profile.model).startswith("bert")
    return TransformerShape(hidden, heads, seq, vocab, layout="megatron" if sailor else "torch",
                            causal=not bert, post_ln=bert)


def operators_for(profile: Profile, calibration: Calibration, math_mode: str) -> OperatorTable:
    """The profile's operators at its micro-batch size: ``meta.operators`` when the profiler
    recorded them, else decomposed from the transformer shape in ``meta``; an error naming what
    is missing otherwise."""
    raw = profile.meta.get("operators")
    if raw is not None:
        return OperatorTable.from_dict(raw).at_size(profile.micro_batch_size)
    shape = transformer_shape(profile)
    names = [x.name for x in profile.layers]
    if shape is None or any(layer_kind(n) is None for n in names):
        raise PartitionerError(
            f"profile '{profile.model}' has no operators (meta.operators) and is not a transformer chain of "
            "embed/block/head layers with its shape in meta; project it with the per-layer roofline "
            "(`method` roofline)")
    tp = profile.meta.get("tensor_parallel", 1)
    return transformer_ops(shape, profile.micro_batch_size, names, tensor_parallel=int(tp) if isinstance(tp, int) else 1,
                           dtype=_DTYPE_OF_MATH[math_mode], recompute=calibration.recompute and is_sailor(profile))


def _source_rates(profile: Profile, source: str, math_mode: str,
                  extra: Mapping[str, DeviceType] | None) -> Rates | None:
    """The measured type's rates, or None when it is not a GPU type of the catalog (the CPU)."""
    try:
        return Rates.of(resolve_gpu_type(source, extra), math_mode)
    except FormatError:
        return None


def project_with_ops(profile: Profile, targets: Sequence[str], *, source: str | None = None,
                     calibration: Calibration | None = None, math_mode: str | None = None,
                     extra: Mapping[str, DeviceType] | None = None,
                     allreduce: Mapping[str, AllReduceModel] | None = None) -> Profile:
    """A copy of ``profile`` with times on every type of ``targets`` projected per operator.

    From a measured catalog type (``source``, default the first measured one) each layer's
    measured time is carried over by the model's ratio (:func:`anchored_s`); from a device not
    in the catalog (the CPU) the model's own times are used. Every projected time records its
    expected relative error (:func:`expected_error`). ``allreduce`` gives the all-reduce model
    of types (source and targets) of a tensor-parallel profile; a type without one has its
    all-reduces priced like compute (the measured time carried over whole). A target that has
    measured times is refused.
    """
    cal = calibration or default_calibration()
    m = math_for(profile, cal, math_mode)
    table = operators_for(profile, cal, m)
    layers = layer_ops_for(table, [x.name for x in profile.layers])
    src = _measured_source(profile, source)
    src_rates = _source_rates(profile, src, m, extra)
    fwd_src, bwd_src = profile.times_for(src)
    ar = dict(allreduce or {})
    out, notes = profile, dict(profile.meta.get("projections", {}))
    for name in targets:
        t = resolve_gpu_type(name, extra)
        if t.name in profile.gpu_types and not profile.is_projected(t.name):
            raise PartitionerError(f"'{t.name}' already has measured times in this profile; not projecting over them")
        rates = Rates.of(t, m)
        times = []
        for i, layer in enumerate(layers):
            measured_on = profile.layers[i].times[src].measured_on or src
            err = expected_error(layer, rates, cal, anchored=src_rates is not None)
            if src_rates is None:
                f = layer_time_s(layer.ops, rates, cal.params, "fwd", ar.get(t.name), waves=cal.waves)
                b = layer_time_s(layer.ops, rates, cal.params, "bwd", ar.get(t.name), waves=cal.waves)
                measured_on = ""
            else:
                f, b = (anchored_s(layer, phase, [Measured(float(x[i]), src_rates, ar.get(src))], rates,
                                   ar.get(t.name), cal) for phase, x in (("fwd", fwd_src), ("bwd", bwd_src)))
            times.append(LayerTime(f, b, projected=True, measured_on=measured_on, expected_error=round(err, 4)))
        out = out.with_times(t.name, times)
        notes[t.name] = {"method": "operators" if src_rates is not None else "operators, model alone",
                         "from": src, "math": m, "calibration": cal.fitted_on}
    return Profile(out.model, out.micro_batch_size, out.layers, out.dtype, out.source, out.edges,
                   {**out.meta, "projections": notes})


def _measured_source(profile: Profile, source: str | None) -> str:
    if source is not None:
        if source not in profile.gpu_types:
            raise PartitionerError(f"profile has no times on '{source}' for every layer; it has: "
                                   f"{', '.join(profile.gpu_types) or 'none'}")
        return source
    measured = [g for g in profile.gpu_types if not profile.is_projected(g)]
    if not measured:
        raise PartitionerError("profile has no measured times to project from (types: "
                               f"{', '.join(profile.gpu_types) or 'none'}, all projected); measure one type, or "
                               "make an analytic profile again with every GPU type wanted")
    return measured[0]


def has_operators(profile: Profile) -> bool:
    """Whether :func:`project_with_ops` can decompose ``profile``: it carries ``meta.operators``,
    or it is a chain of embed/block/head layers with a transformer's shape in ``meta``."""
    if profile.meta.get("operators") is not None:
        return True
    return transformer_shape(profile) is not None and all(layer_kind(x.name) is not None for x in profile.layers)
