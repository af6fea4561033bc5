"""Fitting the operator model's constants on measured GPU types, and judging them on others.

A :class:`Sample` is one measured pass of one layer on one GPU type, with the layer's
operators. :func:`fit_params` finds the :class:`~partitioner.projection.operator_model.OpModelParams`
that minimise the (robust) squared log-ratio of predicted to measured times over the samples
it is given, each GPU type weighing the same, with a weak pull towards a priori values (so
that a constant the samples cannot tell apart, the tensor-core fraction from samples of a
GPU without tensor cores, stays at a plausible value instead of running off).
:func:`leave_one_type_out` fits once per GPU type on every *other* type's samples: the
held-out type is never seen by the fit that is used to predict it (tests check this).

The data the package's calibration was fitted on are Sailor's OPT-350M profiles
(``partitioner.projection.evaluation``; docs/profiling.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..cluster import DeviceType
from ..errors import OptionError, check
from .operator_model import Calibration, OpModelParams, Rates, wave_efficiency
from .operators import COMPUTE_KINDS, LayerOps

__all__ = [
    "MEASURED_FLOOR_S",
    "PRIOR",
    "Sample",
    "fit_loss",
    "fit_params",
    "fit_structure",
    "leave_one_type_out",
    "predict_samples",
]

# operator classes of the fit's sample rows
_MEMORY_BOUND, _GEMM, _BATCHED_GEMM, _SOFTMAX = 0, 1, 2, 3

MEASURED_FLOOR_S = 20e-6  # a pass measured shorter than this is a timer artefact (Sailor's embedding backward)
# a priori values and how far (a factor) each may move before the pull is felt
PRIOR = {"gemm_tensor_fraction": (0.6, 3.0), "gemm_cuda_fraction": (0.7, 3.0), "bgemm_factor": (1.0, 3.0),
         "memory_fraction": (0.8, 3.0), "softmax_factor": (1.0, 3.0), "launch_s": (5e-6, 10.0),
         "layer_fwd_s": (1e-4, 10.0), "layer_bwd_s": (1e-4, 10.0)}
PRIOR_WEIGHT = 0.05  # of one GPU type's data


@dataclass(frozen=True)
class Sample:
    """One measured pass of one layer on one GPU type (``comm_s``: its all-reduces, known
    from elsewhere and added to the prediction, never fitted)."""

    gpu_type: str
    device: DeviceType
    layer: LayerOps
    phase: str
    measured_s: float
    weight: float = 1.0
    comm_s: float = 0.0
    key: str = ""


class _Design:
    """The samples' operators as arrays, so a parameter vector is priced in one pass."""

    def __init__(self, samples: Sequence[Sample], math_mode: str, waves: bool):
        rows: list[tuple[int, float, float, float, int, int]] = []
        for i, s in enumerate(samples):
            rates = Rates.of(s.device, math_mode)
            for op in s.layer.phase(s.phase):
                if op.kind == "allreduce":
                    continue
                b_term = op.mem_bytes / rates.mem_bytes_per_s
                if op.kind in COMPUTE_KINDS:
                    eff = wave_efficiency(op.gemm, rates.sm_count) if waves else 1.0
                    tc = op.flops / (rates.tensor_flops_per_s * eff) if rates.tensor else np.inf
                    cu = op.flops / (rates.cuda_flops_per_s * eff)
                    op_class = _GEMM if op.kind == "gemm" else _BATCHED_GEMM
                else:
                    tc, cu, op_class = np.inf, 0.0, _SOFTMAX if op.kind == "softmax" else _MEMORY_BOUND
                rows.append((i, tc, cu, b_term, op.kernels, op_class))
        arr = np.array(rows, dtype=np.float64).reshape(-1, 6)
        self.sample = arr[:, 0].astype(np.int64)
        self.tc, self.cu, self.b_term, self.kernels = arr[:, 1], arr[:, 2], arr[:, 3], arr[:, 4]
        self.op_class = arr[:, 5].astype(np.int64)
        self.n = len(samples)
        self.fwd = np.array([s.phase == "fwd" for s in samples])
        self.comm = np.array([s.comm_s for s in samples], dtype=np.float64)

    def predict(self, p: np.ndarray) -> np.ndarray:
        tc, cuda, bg, mem, soft, launch, lf, lb = p
        compute = np.minimum(self.tc / tc, self.cu / cuda) / np.where(self.op_class == _BATCHED_GEMM, bg, 1.0)
        mfrac = mem * np.where(self.op_class == _SOFTMAX, soft, 1.0)
        work = np.maximum(compute, self.b_term / mfrac)
        t = np.maximum(work, self.kernels * launch)
        out = np.bincount(self.sample, weights=t, minlength=self.n)
        return out + np.where(self.fwd, lf, lb) + self.comm


def predict_samples(samples: Sequence[Sample], params: OpModelParams, math_mode: str, *,
                    waves: bool = True) -> np.ndarray:
    """Predicted seconds of each sample (its all-reduces included as ``comm_s``)."""
    return _Design(samples, math_mode, waves).predict(params.vector())


def _weights(samples: Sequence[Sample]) -> np.ndarray:
    """Sample weights normalised so that every GPU type weighs the same."""
    w = np.array([s.weight for s in samples], dtype=np.float64)
    types = [s.gpu_type for s in samples]
    for t in set(types):
        idx = [i for i, x in enumerate(types) if x == t]
        w[idx] /= w[idx].sum()
    return w


def fit_params(samples: Sequence[Sample], math_mode: str, *, waves: bool = True,
               start: OpModelParams | None = None, prior_weight: float = PRIOR_WEIGHT) -> OpModelParams:
    """The constants that best predict ``samples`` (see the module docstring). Samples measured
    below :data:`MEASURED_FLOOR_S` are left out."""
    from scipy.optimize import least_squares

    used = [s for s in samples if s.measured_s >= MEASURED_FLOOR_S]
    check(len(used) > 0, "samples", len(samples), f"need at least one measured pass >= {MEASURED_FLOOR_S:g} s")
    design = _Design(used, math_mode, waves)
    meas = np.array([s.measured_s for s in used])
    w = np.sqrt(_weights(used))
    names = OpModelParams.names()
    prior = np.log([PRIOR[n][0] for n in names])
    width = np.log([PRIOR[n][1] for n in names])
    n_types = len({s.gpu_type for s in used})
    pw = math.sqrt(prior_weight * n_types)

    def resid(x: np.ndarray) -> np.ndarray:
        pred = design.predict(np.exp(x))
        return np.concatenate([w * np.log(pred / meas), pw * (x - prior) / width])

    x0 = np.log((start or OpModelParams(**{n: PRIOR[n][0] for n in names})).vector())
    lo, hi = np.log(1e-9) * np.ones(len(names)), np.log(1e3) * np.ones(len(names))
    res = least_squares(resid, np.clip(x0, lo + 1e-9, hi - 1e-9), bounds=(lo, hi), loss="soft_l1", f_scale=0.1,
                        x_scale=1.0, max_nfev=2000)
    return OpModelParams.from_vector(np.exp(res.x))


def fit_loss(samples: Sequence[Sample], params: OpModelParams, math_mode: str, *, waves: bool = True) -> float:
    """The fit's data term: the robust (soft-L1, scale 0.1) weighted sum of squared log-ratios,
    every GPU type weighing the same."""
    used = [s for s in samples if s.measured_s >= MEASURED_FLOOR_S]
    pred = predict_samples(used, params, math_mode, waves=waves)
    z = np.log(pred / np.array([s.measured_s for s in used])) / 0.1
    return float(np.sum(_weights(used) * 2 * (np.sqrt(1 + z * z) - 1)))


def maths_for(dtype_key: str, maths: Sequence[str]) -> list[str]:
    """The math modes that go with a structure's element type (half types: fp16/bf16)."""
    half = dtype_key.startswith(("float16", "bfloat16"))
    return [m for m in maths if (m in ("fp16", "bf16")) == half]


def fit_structure(candidates: Mapping[str, Sequence[Sample]], *, maths: Sequence[str] = ("fp32", "tf32", "fp16"),
                  waves: bool = True, fitted_on: str = "") -> tuple[Calibration, str]:
    """Fit every candidate structure (``{key: samples}``, key = element type, ``+recompute``
    when the blocks' backward re-runs their forward) under every math mode that goes with it,
    and keep the one with the lowest :func:`fit_loss` on its own samples. Returns the
    calibration and the chosen key."""
    best: tuple[float, Calibration, str] | None = None
    for key, samples in candidates.items():
        for m in maths_for(key, maths):
            params = fit_params(samples, m, waves=waves)
            loss = fit_loss(samples, params, m, waves=waves)
            if best is None or loss < best[0]:
                cal = Calibration(params, m, waves=waves, recompute=key.endswith("+recompute"),
                                  fitted_on=f"{fitted_on}; {key}")
                best = (loss, cal, key)
    if best is None:
        raise OptionError("maths", list(maths), "no math mode goes with the candidate structures' element types")
    return best[1], best[2]


def leave_one_type_out(samples: Sequence[Sample], math_mode: str, *, waves: bool = True,
                       fit: Callable[..., OpModelParams] = fit_params) -> dict[str, OpModelParams]:
    """For each GPU type, the constants fitted on the samples of every other type."""
    types = sorted({s.gpu_type for s in samples})
    check(len(types) >= 2, "samples", types, "need at least two GPU types to leave one out")
    return {t: fit([s for s in samples if s.gpu_type != t], math_mode, waves=waves) for t in types}
