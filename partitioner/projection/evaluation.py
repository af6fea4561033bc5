"""Judging the operator projection on measured data: Sailor's OPT-350M profiles.

:func:`sailor_configs` reads every (GPU type, micro-batch size, tensor-parallel degree) Sailor
measured, with the operators of its layers. :func:`evaluate` projects each configuration of a
*target* type from the same configuration measured on other types, with constants fitted by a
caller-supplied function on data that never includes the target (leave-one-type-out, or one
source type alone), and returns every layer's projected and measured time
(:class:`LayerResult`). :func:`class_errors` turns those residuals into the expected error of
each operator class that :class:`~partitioner.projection.operator_model.Calibration` carries.
``bench/projection_error.py`` prints the figures, ``tools/fit_projection.py`` writes the
package's calibration.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from ..cluster import DeviceType, resolve_gpu_type
from ..collectives import CollectiveModel, group_link
from ..errors import FormatError, check
from .collective_fit import CollectivePoint, fit_collectives
from .fit import Sample, fit_structure
from .operator_model import (
    ERROR_CLASSES,
    AllReduce,
    AllReduceModel,
    Calibration,
    Measured,
    Rates,
    anchored_s,
    comm_time_s,
    layer_time_s,
    op_mix,
)
from .operators import OperatorTable, TransformerShape, transformer_ops

__all__ = [
    "SAILOR_TYPES",
    "LayerResult",
    "SailorConfig",
    "TargetComm",
    "allreduce_from_embedding",
    "class_errors",
    "collective_points",
    "declared_choice",
    "evaluate",
    "loto_collectives",
    "loto_fits",
    "own_allreduce",
    "sailor_configs",
    "sailor_node_bytes_per_s",
    "sailor_samples",
    "single_source_fits",
    "structures",
]


@dataclass(frozen=True)
class SailorConfig:
    """One GPU type at one micro-batch size and tensor-parallel degree: every layer's measured
    forward and backward seconds, and the layers' operators."""

    sailor_name: str
    device: DeviceType
    micro_batch_size: int
    tensor_parallel: int
    names: tuple[str, ...]
    fwd_s: tuple[float, ...]
    bwd_s: tuple[float, ...]
    ops: OperatorTable
    message_bytes: float  # the all-reduce of a block: b s h elements

    @property
    def gpu_type(self) -> str:
        return self.device.name

    @property
    def key(self) -> str:
        return f"{self.gpu_type} mbs={self.micro_batch_size} tp={self.tensor_parallel}"


# Sailor's GPU names -> catalog types. Sailor's "RTX-2080" nodes have 11 GiB per GPU
# (basic_cluster_config.json: 11811160064 bytes): an RTX 2080 Ti (the RTX 2080 has 8 GiB).
SAILOR_TYPES = {"A100-40": "A100-SXM4-40GB", "A100-80": "A100-SXM4-80GB", "GH-96": "GH200-96GB",
                "V100-16": "V100-SXM2-16GB", "Titan-RTX": "TITAN-RTX", "RTX-2080": "RTX-2080-Ti",
                "RTX-3090": "RTX-3090"}


def _training_config(root: Path) -> dict[str, Any]:
    path = sorted(root.glob("training_config*.json"))
    if not path:
        raise FormatError("directory", str(root), "has no training_config*.json")
    with open(path[0], encoding="utf-8") as fh:
        cfg = json.load(fh)
    if not isinstance(cfg, dict):
        raise FormatError("training_config", cfg, "must be an object", file=str(path[0]))
    return cfg


def sailor_configs(directory: str | os.PathLike[str], *, types: Mapping[str, str] | None = None,
                   dtype: str = "float32", recompute: bool = False) -> list[SailorConfig]:
    """Every (GPU type, micro-batch size, tensor-parallel degree) Sailor measured, each layer's
    times as measured (no noise clipping), with the operators of its layers in ``dtype``.

    ``types`` maps Sailor's GPU names to catalog types (default :data:`SAILOR_TYPES`)."""
    from ..importers.sailor import import_sailor

    root = Path(directory)
    cfg = _training_config(root)
    shape = TransformerShape(int(cfg["hidden_size"]), int(cfg["heads"]), int(cfg["sequence_length"]),
                             int(cfg["vocab_size"]))
    types = dict(SAILOR_TYPES if types is None else types)
    out = []
    for sailor_name, type_name in types.items():
        path = root / f"{sailor_name}.json"
        if not path.exists():
            continue
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        device = resolve_gpu_type(type_name)
        for mbs in sorted(data, key=int):
            for tp in sorted(data[mbs], key=int):
                prof = import_sailor(root, micro_batch_size=int(mbs), tensor_parallel=int(tp),
                                     gpu_types=(sailor_name,), clip_noise=False)
                key = next(iter(prof.gpu_types))
                fwd, bwd = prof.times_for(key)
                names = tuple(x.name for x in prof.layers)
                table = transformer_ops(shape, int(mbs), names, tensor_parallel=int(tp), dtype=dtype,
                                        recompute=recompute)
                out.append(SailorConfig(sailor_name, device, int(mbs), int(tp), names, tuple(map(float, fwd)),
                                        tuple(map(float, bwd)), table,
                                        float(int(mbs) * shape.seq_len * shape.hidden)))
    return out


def allreduce_from_embedding(configs: Sequence[SailorConfig], element_bytes: int = 4) -> AllReduce:
    """One GPU type's all-reduce, read off its own embedding layer: at degree ``t`` the
    vocabulary-parallel embedding's forward is the lookup plus one all-reduce of ``b s h``
    elements, the same message as a block's. The lookup's time is the forward measured at
    degree 1 (interpolated linearly in the micro-batch size, extrapolated from the last two);
    each configuration gives one (message bytes, seconds) point."""
    ones = sorted((c.micro_batch_size, c.fwd_s[0]) for c in configs if c.tensor_parallel == 1)
    points: dict[int, list[tuple[float, float]]] = {}
    for c in configs:
        if c.tensor_parallel > 1:
            base = _lookup_s(ones, c.micro_batch_size)
            points.setdefault(c.tensor_parallel, []).append(
                (c.message_bytes * element_bytes, max(c.fwd_s[0] - base, 0.0)))
    return AllReduce({g: tuple(p) for g, p in points.items()})


def sailor_node_bytes_per_s(path: str | os.PathLike[str]) -> dict[str, float]:
    """Each Sailor GPU type's node figure for the bandwidth between two of its GPUs: the cap of
    Sailor's NCCL fit for 2 GPUs in ``intra_node_bandwidths.json`` (bytes/s), by catalog type.
    It says which nodes bridge their cards with NVLink (:func:`partitioner.collectives.group_link`)."""
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    curves = data.get("intra", data) if isinstance(data, dict) else {}
    out = {}
    for name, by_group in curves.items():
        if name in SAILOR_TYPES and isinstance(by_group, dict) and "2" in by_group:
            out[SAILOR_TYPES[name]] = float(by_group["2"][1])
    return out


def collective_points(configs: Sequence[SailorConfig], node_bytes_per_s: Mapping[str, float],
                      element_bytes: int = 4) -> list[CollectivePoint]:
    """Every type's measured all-reduces (:func:`allreduce_from_embedding`, the points of positive
    time) with the link each group rang over (:func:`partitioner.collectives.group_link`; a type's
    ``node_bytes_per_s`` is its node's GPU-to-GPU bandwidth, which tells a bridged pair)."""
    out = []
    for t in sorted({c.gpu_type for c in configs}):
        ar = allreduce_from_embedding([c for c in configs if c.gpu_type == t], element_bytes)
        for g, pts in sorted(ar.points.items()):
            link = group_link(t, g, node_bytes_per_s.get(t, 0.0))
            out += [CollectivePoint(t, link, g, b, s) for b, s in pts if s > 0]
    return out


def loto_collectives(points: Sequence[CollectivePoint]) -> dict[str, CollectiveModel]:
    """For each GPU type, the collective model fitted on every other type's points (never on its own)."""
    types = sorted({p.gpu_type for p in points})
    check(len(types) >= 2, "types", types, "need at least two GPU types to leave one out")
    return {t: fit_collectives([p for p in points if p.gpu_type != t], f"Sailor OPT-350M, all types but {t}")
            for t in types}


def _lookup_s(ones: list[tuple[int, float]], b: int) -> float:
    """The embedding's forward at degree 1 and micro-batch ``b``, interpolated (0 if never measured)."""
    if not ones:
        return 0.0
    xs, ys = [x for x, _ in ones], [y for _, y in ones]
    if len(xs) == 1:
        return ys[0] * b / xs[0]
    if b >= xs[-1]:  # extrapolate with the slope of the last two sizes
        return ys[-1] + (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) * (b - xs[-1])
    return float(np.interp(b, xs, ys))


def sailor_samples(configs: Sequence[SailorConfig], allreduce: Mapping[str, AllReduce],
                   element_bytes: int = 4) -> list[Sample]:
    """Fitting samples: per configuration, the embedding, the first block, the median of the
    other blocks (weighing as many layers as it stands for) and the head, forward and
    backward, each with its all-reduces priced by its own type's ``allreduce`` model."""
    out = []
    for c in configs:
        ar = allreduce.get(c.gpu_type)
        groups = _layer_groups(c.names)
        for idx, weight in groups:
            layer = c.ops.layers[idx[0]]
            for phase, times in (("fwd", c.fwd_s), ("bwd", c.bwd_s)):
                meas = float(np.median([times[i] for i in idx]))
                comm = sum(ar.time_s(op.comm_bytes, op.group) for op in layer.phase(phase)
                           if op.kind == "allreduce") if ar is not None else 0.0
                out.append(Sample(c.gpu_type, c.device, layer, phase, meas, weight, comm,
                                  f"{c.key} {layer.name} {phase}"))
    return out


def _layer_groups(names: Sequence[str]) -> list[tuple[list[int], float]]:
    """Layer indices of one sample each, and the weight: embedding, first block, other blocks, head."""
    n = len(names)
    if n <= 3:
        return [([i], 1.0) for i in range(n)]
    rest = list(range(2, n - 1))
    return [([0], 1.0), ([1], 1.0), (rest, float(len(rest))), ([n - 1], 1.0)]


# -- evaluation ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerResult:
    """One projected layer of one configuration of one target type."""

    target: str
    source: str  # the single source type, or "others" when every other type is a source
    micro_batch_size: int
    tensor_parallel: int
    layer: int
    name: str
    measured_s: float
    projected_s: float  # anchored on the sources' measurements
    alone_s: float  # the model alone, nothing measured
    mix: Mapping[str, float]  # the layer's op mix on the target (operator_model.op_mix)

    @property
    def error(self) -> float:
        return abs(self.projected_s / self.measured_s - 1)

    @property
    def error_alone(self) -> float:
        return abs(self.alone_s / self.measured_s - 1)


# the target's all-reduce model for one of its configurations (None: no all-reduces priced)
TargetComm = Callable[[SailorConfig], "AllReduceModel | None"]


def project_config(tgt: SailorConfig, sources: Sequence[SailorConfig], cal: Calibration,
                   own: Mapping[str, AllReduce], tgt_ar: AllReduceModel | None, label: str) -> list[LayerResult]:
    """Every layer of ``tgt`` projected from ``sources`` (the same configuration on other types;
    each source's all-reduces from ``own``)."""
    rates = {c.gpu_type: Rates.of(c.device, cal.math) for c in (tgt, *sources)}
    r_t = rates[tgt.gpu_type]
    out = []
    for i, layer in enumerate(tgt.ops.layers):
        total = alone = 0.0
        for phase in ("fwd", "bwd"):
            meas = [Measured((s.fwd_s if phase == "fwd" else s.bwd_s)[i], rates[s.gpu_type], own.get(s.gpu_type))
                    for s in sources]
            total += anchored_s(layer, phase, meas, r_t, tgt_ar, cal)
            alone += layer_time_s(layer.ops, r_t, cal.params, phase, waves=cal.waves) + comm_time_s(
                layer.ops, phase, tgt_ar)
        out.append(LayerResult(tgt.gpu_type, label, tgt.micro_batch_size, tgt.tensor_parallel, i, layer.name,
                               tgt.fwd_s[i] + tgt.bwd_s[i], total, alone,
                               op_mix(layer.ops, r_t, cal.params, waves=cal.waves)))
    return out


def structures(directory: str | os.PathLike[str], maths: Sequence[str] = ("fp32", "tf32", "fp16"),
               recompute: Sequence[bool] = (False, True)) -> dict[str, list[SailorConfig]]:
    """The candidate structures a fit chooses from: Sailor's configurations decomposed with each
    element type the math modes need, with and without recomputation (keys as
    :func:`~partitioner.projection.fit.fit_structure` reads them)."""
    out = {}
    for rc in recompute:
        for dtype in sorted({"float16" if m in ("fp16", "bf16") else "float32" for m in maths}):
            out[f"{dtype}{'+recompute' if rc else ''}"] = sailor_configs(directory, dtype=dtype, recompute=rc)
    return out


def own_allreduce(configs: Sequence[SailorConfig]) -> dict[str, AllReduce]:
    """Each type's all-reduce read off its own embedding layer (:func:`allreduce_from_embedding`)."""
    types = sorted({c.gpu_type for c in configs})
    return {t: allreduce_from_embedding([c for c in configs if c.gpu_type == t]) for t in types}


FitFn = Callable[[Mapping[str, Sequence[Sample]], str], tuple[Calibration, str]]


def _default_fit(candidates: Mapping[str, Sequence[Sample]], fitted_on: str, *, maths: Sequence[str],
                 waves: bool) -> tuple[Calibration, str]:
    return fit_structure(candidates, maths=maths, waves=waves, fitted_on=fitted_on)


def _fit_on(structs: Mapping[str, Sequence[SailorConfig]], keep: Callable[[SailorConfig], bool],
            train_tp: Sequence[int], fit: FitFn, fitted_on: str) -> tuple[Calibration, str]:
    """Fit on the configurations ``keep`` accepts at the training degrees (each type's all-reduces
    from its own embedding)."""
    cands = {}
    for key, configs in structs.items():
        chosen = [c for c in configs if keep(c) and c.tensor_parallel in train_tp]
        cands[key] = sailor_samples(chosen, own_allreduce(chosen))
    return fit(cands, fitted_on)


def loto_fits(structs: Mapping[str, Sequence[SailorConfig]], *, fit: FitFn | None = None,
              train_tp: Sequence[int] = (1,), maths: Sequence[str] = ("fp32", "tf32", "fp16"),
              waves: bool = True) -> dict[str, tuple[Calibration, str]]:
    """For each GPU type, the calibration fitted on every other type (never on it)."""
    fit_fn: FitFn = fit or partial(_default_fit, maths=maths, waves=waves)
    types = sorted({c.gpu_type for c in next(iter(structs.values()))})
    check(len(types) >= 2, "types", types, "need at least two GPU types to leave one out")
    return {t: _fit_on(structs, partial(_other_type, t), train_tp, fit_fn, f"Sailor OPT-350M, all types but {t}")
            for t in types}


def single_source_fits(structs: Mapping[str, Sequence[SailorConfig]], *, fit: FitFn | None = None,
                       train_tp: Sequence[int] = (1,), maths: Sequence[str] = ("fp32", "tf32", "fp16"),
                       waves: bool = True) -> dict[str, tuple[Calibration, str]]:
    """For each GPU type, the calibration fitted on that type alone."""
    fit_fn: FitFn = fit or partial(_default_fit, maths=maths, waves=waves)
    types = sorted({c.gpu_type for c in next(iter(structs.values()))})
    return {t: _fit_on(structs, partial(_same_type, t), train_tp, fit_fn, f"Sailor OPT-350M, {t} only")
            for t in types}


def _other_type(t: str, c: SailorConfig) -> bool:
    return c.gpu_type != t


def _same_type(t: str, c: SailorConfig) -> bool:
    return c.gpu_type == t


def evaluate(structs: Mapping[str, Sequence[SailorConfig]], fits: Mapping[str, tuple[Calibration, str]],
             target_comm: TargetComm, *, by: str = "target") -> list[LayerResult]:
    """Project every configuration of every type and compare with its measurement.

    ``by="target"``: ``fits`` holds each target's calibration (leave-one-type-out) and every
    other type measured at the same configuration is a source. ``by="pair"``: the same
    calibrations, but each other type is a source on its own (one result per source).
    ``by="source"``: ``fits`` holds each source's calibration (fitted on it alone) and each
    other type is projected from it."""
    check(by in ("target", "pair", "source"), "by", by, "must be target, pair or source")
    out: list[LayerResult] = []
    for key_type, (cal, key) in fits.items():
        configs = structs[key]
        own = own_allreduce(configs)
        table = {(c.gpu_type, c.micro_batch_size, c.tensor_parallel): c for c in configs}
        for (g, b, t), tgt in table.items():
            if by in ("target", "pair"):
                if g != key_type:
                    continue
                srcs = [c for (g2, b2, t2), c in table.items() if g2 != g and (b2, t2) == (b, t)]
                if by == "pair":
                    for src in srcs:
                        out += project_config(tgt, [src], cal, own, target_comm(tgt), src.gpu_type)
                    continue
                label = "others"
            else:
                one = table.get((key_type, b, t))
                if g == key_type or one is None:
                    continue
                srcs, label = [one], key_type
            if srcs:
                out += project_config(tgt, srcs, cal, own, target_comm(tgt), label)
    return out


def declared_choice(fits: Mapping[str, tuple[Calibration, str]]) -> tuple[str, str]:
    """The (math mode, structure key) most of the leave-one-type-out ``fits`` chose."""
    votes: dict[tuple[str, str], int] = {}
    for cal, key in fits.values():
        votes[(cal.math, key)] = votes.get((cal.math, key), 0) + 1
    return max(votes, key=lambda k: votes[k])


def class_errors(results: Sequence[LayerResult], *, alone: bool = False) -> dict[str, float]:
    """Expected relative error of each class of a layer's predicted time (:data:`ERROR_CLASSES`):
    the non-negative least-squares fit of each layer's error on its op mix."""
    from scipy.optimize import nnls

    check(len(results) > 0, "results", 0, "need at least one projected layer")
    a = np.array([[r.mix[k] for k in ERROR_CLASSES] for r in results])
    e = np.array([r.error_alone if alone else r.error for r in results])
    w, _ = nnls(a, e)
    return {k: round(float(v), 4) for k, v in zip(ERROR_CLASSES, w, strict=True)}
