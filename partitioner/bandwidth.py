"""Link bandwidth as a function of message size, with a latency.

A flat ``GBps`` number is the simple default. Real networks are slower for small messages
(per-message latency, protocol switches), so a link may also carry a measured curve:

* ``points``: ``(bytes, GB/s)`` pairs from a benchmark (nccl-tests, a ping-pong), interpolated
  linearly in ``log2(bytes)`` and held constant beyond the first and last point;
* ``log2_mb_poly``: the polynomial fit Sailor publishes for its NCCL measurements,
  ``GB/s = c0 x^k + ... + ck`` with ``x = log2(bytes / 1e6)``, capped by the flat ``GBps``.

The time of a message of ``n`` bytes is ``latency_s + n / (gbps_at(n) * 1e9)``. A point-to-point
send (an activation or gradient between pipeline stages) also pays ``send_overhead_s``: the
framework's own cost per send (metadata exchange, synchronisation), which the steps of a
collective do not pay, and moves at ``p2p_scale`` times the curve's rate (a collective runs
every channel and NIC a node has; one send between two ranks may not):
:meth:`Bandwidth.send_seconds`. A curve whose
value is not positive at a size actually used is an error naming the link, the size and the
value (polynomial fits are only valid over the sizes they were fitted on).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._io import is_finite_number, opt_field, req_number
from .errors import PartitionerError, check

__all__ = ["Bandwidth", "parse_bandwidth"]


@dataclass(frozen=True)
class Bandwidth:
    """Bandwidth of one link (``gbps`` flat or as the cap of a curve) and its latency."""

    gbps: float
    latency_s: float = 0.0
    points: tuple[tuple[float, float], ...] = ()
    log2_mb_poly: tuple[float, ...] = ()
    name: str = ""  # for error messages: "inter_node", "nodes[2].intra_node", "links[0]"
    send_overhead_s: float = 0.0  # the framework's cost per point-to-point send
    p2p_scale: float = 1.0  # a point-to-point send's rate over the curve's

    def __post_init__(self) -> None:
        object.__setattr__(self, "points", tuple((float(a), float(b)) for a, b in self.points))
        object.__setattr__(self, "log2_mb_poly", tuple(float(c) for c in self.log2_mb_poly))
        where = f"{self.name}." if self.name else ""
        check(is_finite_number(self.gbps) and self.gbps > 0,
              f"{where}GBps", self.gbps, "must be a finite number > 0")
        check(math.isfinite(self.latency_s) and self.latency_s >= 0, f"{where}latency_us",
              self.latency_s * 1e6, "must be a finite number >= 0")
        check(math.isfinite(self.send_overhead_s) and self.send_overhead_s >= 0, f"{where}send_overhead_us",
              self.send_overhead_s * 1e6, "must be a finite number >= 0")
        check(math.isfinite(self.p2p_scale) and 0 < self.p2p_scale <= 1e6, f"{where}p2p_scale", self.p2p_scale,
              "must be a number > 0")
        check(not (self.points and self.log2_mb_poly), f"{where}points", "points and log2_MB_poly",
              "give one curve, not both")
        sizes = [p[0] for p in self.points]
        for k, (n, bw) in enumerate(self.points):
            check(math.isfinite(n) and n > 0, f"{where}points[{k}]", [n, bw], "size must be > 0 bytes")
            check(math.isfinite(bw) and bw > 0, f"{where}points[{k}]", [n, bw], "GB/s must be > 0")
        check(sizes == sorted(set(sizes)), f"{where}points", [list(p) for p in self.points],
              "sizes must be strictly increasing")
        for c in self.log2_mb_poly:
            check(math.isfinite(c), f"{where}log2_MB_poly", list(self.log2_mb_poly), "coefficients must be finite")

    @property
    def is_flat(self) -> bool:
        return (not self.points and not self.log2_mb_poly and self.latency_s == 0.0 and self.send_overhead_s == 0.0
                and self.p2p_scale == 1.0)

    def gbps_at(self, nbytes: float) -> float:
        """Bandwidth in GB/s for one message of ``nbytes``."""
        if self.points:
            pts = self.points
            if nbytes <= pts[0][0]:
                return pts[0][1]
            if nbytes >= pts[-1][0]:
                return pts[-1][1]
            x = math.log2(nbytes)
            for (n0, b0), (n1, b1) in itertools.pairwise(pts):
                if nbytes <= n1:
                    x0, x1 = math.log2(n0), math.log2(n1)
                    return b0 + (b1 - b0) * (x - x0) / (x1 - x0)
        if self.log2_mb_poly:
            x = math.log2(nbytes / 1e6)
            value = 0.0
            for c in self.log2_mb_poly:
                value = value * x + c
            if not value > 0:
                raise PartitionerError(f"{self.name or 'link'}: the bandwidth curve gives {value:.4g} GB/s for a "
                                       f"message of {nbytes:.6g} bytes; it must be > 0 at every size used (the fit "
                                       f"is valid only over the sizes it was measured on: give points instead)")
            return min(value, self.gbps)
        return self.gbps

    def seconds(self, nbytes: float) -> float:
        """Time of one message of ``nbytes`` (0 for an empty message)."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / (self.gbps_at(nbytes) * 1e9)

    def send_seconds(self, nbytes: float) -> float:
        """Time of one point-to-point send of ``nbytes``: the latency, the per-send overhead and the
        bytes at ``p2p_scale`` times the curve's rate."""
        if nbytes <= 0:
            return 0.0
        return self.latency_s + self.send_overhead_s + nbytes / (self.send_gbps_at(nbytes) * 1e9)

    def send_gbps_at(self, nbytes: float) -> float:
        """The rate of one point-to-point send of ``nbytes`` alone on the link, GB/s."""
        return self.gbps_at(nbytes) * self.p2p_scale

    def scaled(self, factor: float) -> Bandwidth:
        """The same link ``factor`` times as fast at every size (the cap and the curve scaled)."""
        check(math.isfinite(factor) and factor > 0, f"{self.name or 'link'}.scale", factor, "must be > 0")
        return Bandwidth(self.gbps * factor, self.latency_s, tuple((n, b * factor) for n, b in self.points),
                         tuple(c * factor for c in self.log2_mb_poly), self.name, self.send_overhead_s, self.p2p_scale)

    def to_value(self) -> float | dict[str, Any]:
        """The file form: the plain number when flat, else a mapping."""
        if self.is_flat:
            return self.gbps
        d: dict[str, Any] = {"GBps": self.gbps}
        if self.latency_s:
            d["latency_us"] = self.latency_s * 1e6
        if self.send_overhead_s:
            d["send_overhead_us"] = self.send_overhead_s * 1e6
        if self.p2p_scale != 1.0:
            d["p2p_scale"] = self.p2p_scale
        if self.points:
            d["points"] = [list(p) for p in self.points]
        if self.log2_mb_poly:
            d["log2_MB_poly"] = list(self.log2_mb_poly)
        return d


def parse_bandwidth(d: Mapping[str, Any], key: str, where: str = "", name: str = "",
                    minimum: float = 0.0, maximum: float | None = None) -> Bandwidth:
    """Read ``d[key]``: a number (GB/s) or ``{GBps, latency_us, points | log2_MB_poly}``; every
    GB/s figure must lie in ``(minimum, maximum]``."""
    field = f"{where}{key}"
    raw = d.get(key)
    bw = _parse(d, key, where, name, minimum, maximum)
    for k, (_, gbps) in enumerate(bw.points):
        check(minimum < gbps and (maximum is None or gbps <= maximum), f"{field}.points[{k}]", gbps,
              f"GB/s must lie in ({minimum:g}, {maximum:g}]" if maximum is not None else f"GB/s must be > {minimum:g}")
    del raw
    return bw


def _parse(d: Mapping[str, Any], key: str, where: str, name: str, minimum: float,
           maximum: float | None) -> Bandwidth:
    field = f"{where}{key}"
    raw = d.get(key)
    if isinstance(raw, Mapping):
        inner = f"{field}."
        pts_raw = opt_field(raw, "points", list, [], inner)
        pts = []
        for k, p in enumerate(pts_raw):
            ok = (isinstance(p, (list, tuple)) and len(p) == 2
                  and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in p))
            check(ok, f"{inner}points[{k}]", p, "must be [bytes, GBps]")
            pts.append((float(p[0]), float(p[1])))
        poly = opt_field(raw, "log2_MB_poly", list, [], inner)
        for c in poly:
            check(isinstance(c, (int, float)) and not isinstance(c, bool), f"{inner}log2_MB_poly", poly,
                  "must be a list of numbers")
        cap = (req_number(raw, "GBps", inner, minimum=minimum, strict=minimum <= 0, maximum=maximum)
               if "GBps" in raw or not pts else max(b for _, b in pts))
        return Bandwidth(cap, req_number(raw, "latency_us", inner, default=0.0, maximum=1e9) * 1e-6, tuple(pts),
                         tuple(float(c) for c in poly), name or field,
                         req_number(raw, "send_overhead_us", inner, default=0.0, maximum=1e9) * 1e-6,
                         req_number(raw, "p2p_scale", inner, default=1.0, minimum=0.0, strict=True, maximum=1e6))
    return Bandwidth(req_number(d, key, where, minimum=minimum, strict=minimum <= 0, maximum=maximum),
                     name=name or field)
