"""Calibration: the link and overhead parameters the model exposes, fitted to measured runs.

Runs are :class:`partitioner.measured.MeasuredRun` (a plan with the profile and cluster it ran
on, its options and what was measured: seconds per iteration, the peak memory of the fullest
GPU where known). The parameters (:class:`LinkParams`) are

* ``send_overhead_s``: the framework's cost per point-to-point send, on every link
  (``Bandwidth.send_overhead_s``; not paid by the steps of a collective);
* ``inter_scale``: the inter-node links' bandwidth as a multiple of what the cluster file says
  (its curves scaled alike, ``Bandwidth.scaled``);
* ``p2p_scale``: the rate of a point-to-point send between nodes as a multiple of what the
  inter-node link gives a send (it multiplies the link's own ``Bandwidth.p2p_scale``; collectives
  keep the link's rate: they use every NIC and channel of a node, one send between two ranks may
  use one);
* ``reserved_bytes``: the framework's own memory per GPU (``CostOptions.reserved_bytes``).

The time parameters are fitted by minimising the mean squared log ratio of simulated to
measured iteration time (:func:`partitioner.simulate.simulate_plan`, as ``partitioner simulate``
prices a plan): one parameter at a time by golden-section search over a bounded interval, then
all together by bounded least squares from there; the memory one is the median of measured minus modelled peak with nothing reserved
(never below 0). :func:`leave_one_out` predicts each run with the parameters fitted on the
others: the error to expect on a run the fit has not seen.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .bandwidth import Bandwidth
from .cluster import GIB, Cluster, Link, Node
from .errors import OptionError
from .measured import MeasuredRun
from .simulate import simulate_plan

__all__ = ["FIT_PARAMETERS", "Calibration", "LinkParams", "apply_params", "fit", "leave_one_out", "predict"]

log = logging.getLogger(__name__)

FIT_PARAMETERS = ("send_overhead", "inter_bandwidth", "p2p_bandwidth", "reserved")
_BOUNDS = {"send_overhead": (0.0, 0.05), "inter_bandwidth": (math.log(0.05), math.log(4.0)),  # s; log of a scale
           "p2p_bandwidth": (math.log(0.02), math.log(1.0))}


@dataclass(frozen=True)
class LinkParams:
    """What calibration sets: a per-send overhead on every link, a scale on the inter-node
    bandwidth, and the framework's memory per GPU (``None``: the run's own options)."""

    send_overhead_s: float = 0.0
    inter_scale: float = 1.0
    reserved_bytes: float | None = None
    p2p_scale: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"send_overhead_us": self.send_overhead_s * 1e6, "inter_bandwidth_scale": self.inter_scale,
                             "p2p_scale": self.p2p_scale}
        if self.reserved_bytes is not None:
            d["reserved_GiB"] = self.reserved_bytes / GIB
        return d


def _link(bw: Bandwidth, params: LinkParams, inter: bool) -> Bandwidth:
    out = bw.scaled(params.inter_scale) if inter and params.inter_scale != 1.0 else bw
    # the fitted scale multiplies the send rate the link already has (an import may set one)
    return replace(out, send_overhead_s=params.send_overhead_s,
                   p2p_scale=out.p2p_scale * params.p2p_scale if inter else out.p2p_scale)


def apply_params(cluster: Cluster, params: LinkParams) -> Cluster:
    """``cluster`` with ``params`` on its links: every link's per-send overhead, the inter-node
    ones (``inter_node_GBps`` and node-pair ``links``) scaled."""
    nodes = []
    for n in cluster.nodes:
        intra = _link(n.intra_curve or Bandwidth(n.intra_gbps, name=f"nodes.{n.name}.intra_node_GBps"), params, False)
        nic = n.nic_gbps * params.inter_scale
        nodes.append(Node(n.name, n.gpus, intra.gbps, intra, nic, n.nics))
    names = {n.name for n in cluster.nodes}
    links = []
    for k, x in enumerate(cluster.links):
        between_nodes = x.a in names or cluster.device(x.a).node != cluster.device(x.b).node
        bw = _link(x.curve or Bandwidth(x.gbps, name=f"links[{k}]"), params, between_nodes)
        links.append(Link(x.a, x.b, bw.gbps, bw))
    inter = _link(cluster.inter_curve or Bandwidth(cluster.inter_gbps, name="inter_node_GBps"), params, True)
    return Cluster(cluster.name, tuple(nodes), inter.gbps, cluster.device_types, tuple(links), inter)


def predict(run: MeasuredRun, params: LinkParams) -> tuple[float, float]:
    """Simulated seconds per iteration and peak bytes of the fullest GPU of ``run`` under ``params``."""
    opts = run.options if params.reserved_bytes is None else replace(run.options, reserved_bytes=params.reserved_bytes)
    tl = simulate_plan(run.plan, run.profile, apply_params(run.cluster, params), opts)
    return tl.iteration_s, max(tl.peak_memory_bytes.values())


@dataclass(frozen=True)
class Calibration:
    """Fitted parameters, which of them were fitted, and each run's prediction with them."""

    params: LinkParams
    fitted: tuple[str, ...]
    runs: tuple[str, ...]
    predicted_s: tuple[float, ...]
    measured_s: tuple[float, ...]
    predicted_peak_bytes: tuple[float, ...] = field(default=())
    measured_peak_bytes: tuple[float | None, ...] = field(default=())

    @property
    def time_errors(self) -> list[float]:
        return [p / m - 1 for p, m in zip(self.predicted_s, self.measured_s, strict=True)]

    @property
    def memory_errors(self) -> list[float]:
        return [p / m - 1 for p, m in zip(self.predicted_peak_bytes, self.measured_peak_bytes, strict=True)
                if m is not None]


def _golden(f: Callable[[float], float], lo: float, hi: float, steps: int = 24) -> float:
    g = (math.sqrt(5) - 1) / 2
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(steps):
        if fc <= fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    best = min((fc, c), (fd, d), (f(lo), lo), key=lambda x: x[0])  # the bound itself may be best (no overhead)
    return best[1]


def _time_loss(runs: Sequence[MeasuredRun], params: LinkParams) -> float:
    return statistics.fmean(math.log(predict(r, params)[0] / r.measured_iteration_s) ** 2 for r in runs)


def _with(params: LinkParams, parameter: str, x: float) -> LinkParams:
    """``params`` with one time parameter at search coordinate ``x`` (seconds; log of the scale)."""
    if parameter == "send_overhead":
        return replace(params, send_overhead_s=x)
    if parameter == "p2p_bandwidth":
        return replace(params, p2p_scale=math.exp(x))
    return replace(params, inter_scale=math.exp(x))


def _fit_one(runs: Sequence[MeasuredRun], params: LinkParams, parameter: str) -> LinkParams:
    lo, hi = _BOUNDS[parameter]
    best = _golden(lambda x: _time_loss(runs, _with(params, parameter, x)), lo, hi)
    return _with(params, parameter, best)


def _coordinate(params: LinkParams, parameter: str) -> float:
    if parameter == "send_overhead":
        return params.send_overhead_s
    return math.log(params.p2p_scale if parameter == "p2p_bandwidth" else params.inter_scale)


def _refine(runs: Sequence[MeasuredRun], params: LinkParams, timed: Sequence[str], rounds: int) -> LinkParams:
    """Every time parameter together: least squares of the runs' log errors (SciPy's trust-region
    reflective method within the bounds), from ``params``."""
    from scipy.optimize import least_squares

    unit = {"send_overhead": 1e-3, "inter_bandwidth": 1.0, "p2p_bandwidth": 1.0}  # in ms, in log of the scales

    def at(x: Sequence[float]) -> LinkParams:
        out = params
        for p, v in zip(timed, x, strict=True):
            out = _with(out, p, float(v) * unit[p])
        return out

    def residuals(x: Sequence[float]) -> list[float]:
        q = at(x)
        return [math.log(predict(r, q)[0] / r.measured_iteration_s) for r in runs]

    lo = [_BOUNDS[p][0] / unit[p] for p in timed]
    hi = [_BOUNDS[p][1] / unit[p] for p in timed]
    x0 = [min(max(_coordinate(params, p) / unit[p], a), b) for p, a, b in zip(timed, lo, hi, strict=True)]
    res = least_squares(residuals, x0, bounds=(lo, hi), diff_step=1e-4, max_nfev=20 * rounds * len(timed))
    return at(res.x)


def fit(runs: Sequence[MeasuredRun], parameters: Sequence[str] = ("p2p_bandwidth", "reserved"),
        rounds: int = 2) -> Calibration:
    """Fit ``parameters`` (of :data:`FIT_PARAMETERS`) to ``runs``; the others keep their neutral
    values (no overhead, the cluster's bandwidth, the runs' own reserved memory)."""
    for p in parameters:
        if p not in FIT_PARAMETERS:
            raise OptionError("fit", p, f"unknown parameter; known: {', '.join(FIT_PARAMETERS)}")
    if not runs:
        raise OptionError("runs", 0, "give at least one measured run")
    params = LinkParams()
    timed = [p for p in parameters if p in _BOUNDS]
    for p in timed:  # one pass, a parameter at a time, as the start
        params = _fit_one(runs, params, p)
    if len(timed) > 1:
        params = _refine(runs, params, timed, rounds)
    if "reserved" in parameters:
        with_peaks = [r for r in runs if r.measured_peak_bytes is not None]
        if with_peaks:
            bare = replace(params, reserved_bytes=0.0)
            gaps = [(r.measured_peak_bytes or 0.0) - predict(r, bare)[1] for r in with_peaks]
            params = replace(params, reserved_bytes=max(0.0, statistics.median(gaps)))
    log.info("fitted %s on %d runs: %s", ", ".join(parameters), len(runs), params.to_dict())
    return _judged(runs, params, tuple(parameters))


def _judged(runs: Sequence[MeasuredRun], params: LinkParams, fitted: tuple[str, ...]) -> Calibration:
    preds = [predict(r, params) for r in runs]
    return Calibration(params, fitted, tuple(r.name for r in runs), tuple(p[0] for p in preds),
                       tuple(r.measured_iteration_s for r in runs), tuple(p[1] for p in preds),
                       tuple(r.measured_peak_bytes for r in runs))


def leave_one_out(runs: Sequence[MeasuredRun], parameters: Sequence[str] = ("p2p_bandwidth", "reserved"),
                  rounds: int = 2, groups: Sequence[Hashable] | None = None) -> tuple[Calibration, list[LinkParams]]:
    """Each run predicted with the parameters fitted on all the others: one :class:`Calibration`
    of those predictions (its ``params`` the fit on every run) and the parameters of each fold.
    ``groups`` (one key per run, say its cluster or node count): each run is predicted from the runs
    of the other groups only (leave one group out: a cluster the fit never saw)."""
    if len(runs) < 2:
        raise OptionError("runs", len(runs), "leave-one-out needs at least two measured runs")
    keys: list[Hashable] = list(range(len(runs))) if groups is None else list(groups)
    if len(keys) != len(runs):
        raise OptionError("groups", len(keys), f"needs one key per run ({len(runs)})")
    if len(set(keys)) < 2:
        raise OptionError("groups", sorted(map(str, set(keys))), "leaving a group out needs at least two groups")
    folds = []
    preds: list[tuple[float, float]] = []
    by_key: dict[Hashable, LinkParams] = {}  # one fit per group left out
    for i, run in enumerate(runs):
        if keys[i] not in by_key:
            by_key[keys[i]] = fit([r for j, r in enumerate(runs) if keys[j] != keys[i]], parameters, rounds).params
        params = by_key[keys[i]]
        folds.append(params)
        preds.append(predict(run, params))
    whole = fit(runs, parameters, rounds).params
    return (Calibration(whole, tuple(parameters), tuple(r.name for r in runs), tuple(p[0] for p in preds),
                        tuple(r.measured_iteration_s for r in runs), tuple(p[1] for p in preds),
                        tuple(r.measured_peak_bytes for r in runs)), folds)
