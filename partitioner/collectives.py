"""The collectives of a tensor-parallel group, priced from the link its GPUs really have.

A group of ``g`` GPUs of one node all-reduces ``n`` bytes as a ring: ``2 (g - 1)`` steps, each
sending ``n / g`` bytes to the next GPU. Each all-reduce costs

    fixed_s + 2 (g - 1) * (step_s + (n / g) / (fraction * peak_bytes_per_s))

``fixed_s`` is what every collective pays whatever its size (kernel launches and the wait for
the slowest GPU of the group, which is a barrier), ``step_s`` the latency of one ring step and
``fraction`` the share of the link's peak rate (per direction) a step achieves. The link and
its peak are facts about the GPU and the node, never fitted: the *link class*
(:data:`LINK_CLASSES`) and peak come from :func:`group_link`, which reads
``partitioner/data/gpu_links.csv`` (each GPU's NVLink, per direction, and PCIe link, with the
public source of every row):

* ``nvlink``: SXM parts on their baseboard (NVLink between every GPU of the node; the ring runs
  at the GPU's NVLink rate), and pairs of PCIe cards joined by a 2-way NVLink bridge (the
  bridge's rate; a bridge joins two cards only, so a larger group rings over PCIe);
* ``pcie``: everything else, at the PCIe generation and width of the GPU's slot.

The three constants of each class (:class:`LinkConstants`) are fitted on measured collectives
of other GPU types (``partitioner.projection.collective_fit``); the package's
(``partitioner/data/collectives.json``, :func:`default_collectives`) on all seven of Sailor's
types. docs/profiling.md gives the sources, the fits and how wrong the model is.
"""

from __future__ import annotations

import csv
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from .bandwidth import Bandwidth
from .errors import FormatError, PartitionerError, check

__all__ = [
    "COLLECTIVES_FORMAT",
    "LINK_CLASSES",
    "NVLINK_KINDS",
    "PCIE_LANE_BYTES_PER_S",
    "CollectiveModel",
    "GroupAllReduce",
    "GroupLink",
    "LinkConstants",
    "LinkFacts",
    "default_collectives",
    "group_link",
    "link_catalog",
    "link_facts",
    "node_allreduce_s",
]

LINK_CLASSES = ("nvlink", "pcie")
NVLINK_KINDS = ("none", "bridge", "board")  # no NVLink; a 2-way bridge between two cards; on the baseboard
# bytes/s one PCIe lane carries per direction after line coding (gen 1-2: 8b/10b, gen 3-5: 128b/130b)
PCIE_LANE_BYTES_PER_S = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9}
COLLECTIVES_FORMAT = "partitioner.collectives/1"


@dataclass(frozen=True)
class LinkFacts:
    """One GPU type's links to its peers: NVLink (how, and its rate per direction over all its
    links) and its PCIe slot (generation, lanes), with the source of the figures."""

    gpu: str
    nvlink: str
    nvlink_bytes_per_s: float
    pcie_gen: int
    pcie_lanes: int
    source: str = ""

    def __post_init__(self) -> None:
        where = f"gpu_links.{self.gpu}"
        check(self.nvlink in NVLINK_KINDS, f"{where}.nvlink", self.nvlink, f"must be one of {', '.join(NVLINK_KINDS)}")
        check(math.isfinite(self.nvlink_bytes_per_s) and self.nvlink_bytes_per_s >= 0, f"{where}.nvlink_GBps",
              self.nvlink_bytes_per_s / 1e9, "must be a finite number >= 0")
        check((self.nvlink == "none") == (self.nvlink_bytes_per_s == 0), f"{where}.nvlink_GBps",
              self.nvlink_bytes_per_s / 1e9, "must be 0 exactly when nvlink is none")
        check(self.pcie_gen in PCIE_LANE_BYTES_PER_S, f"{where}.pcie_gen", self.pcie_gen,
              f"must be one of {', '.join(map(str, PCIE_LANE_BYTES_PER_S))}")
        check(self.pcie_lanes in (1, 2, 4, 8, 16), f"{where}.pcie_lanes", self.pcie_lanes, "must be 1, 2, 4, 8 or 16")

    @property
    def pcie_bytes_per_s(self) -> float:
        """The PCIe slot's peak per direction."""
        return PCIE_LANE_BYTES_PER_S[self.pcie_gen] * self.pcie_lanes


@functools.cache
def link_catalog() -> dict[str, LinkFacts]:
    """Every GPU type's :class:`LinkFacts`, from ``partitioner/data/gpu_links.csv``."""
    text = resources.files("partitioner").joinpath("data/gpu_links.csv").read_text(encoding="utf-8")
    out = {}
    for row in csv.DictReader(text.splitlines()):
        out[row["gpu"]] = LinkFacts(row["gpu"], row["nvlink"], float(row["nvlink_GBps"]) * 1e9, int(row["pcie_gen"]),
                                    int(row["pcie_lanes"]), row["source"])
    return out


def link_facts(gpu_type: str) -> LinkFacts:
    """The links of ``gpu_type`` (a catalog name); a one-line error for a type the table lacks."""
    found = link_catalog().get(gpu_type)
    if found is None:
        raise FormatError("gpu_type", gpu_type, "has no interconnect facts (NVLink, PCIe generation) in "
                          "partitioner/data/gpu_links.csv, so its tensor-parallel collectives cannot be priced; "
                          f"types that have them: {', '.join(sorted(link_catalog()))}")
    return found


@dataclass(frozen=True)
class GroupLink:
    """What the ring of a tensor-parallel group runs over: its link class, the peak rate per
    direction one GPU can send at, and optionally a lower rate a cluster file states for it
    (``cap_bytes_per_s``: a ring step never moves faster than that)."""

    link_class: str
    peak_bytes_per_s: float
    cap_bytes_per_s: float = math.inf

    def __post_init__(self) -> None:
        check(self.link_class in LINK_CLASSES, "link_class", self.link_class, f"must be one of {', '.join(LINK_CLASSES)}")
        check(math.isfinite(self.peak_bytes_per_s) and self.peak_bytes_per_s > 0, "peak_GBps",
              self.peak_bytes_per_s / 1e9, "must be a finite number > 0")
        check(self.cap_bytes_per_s > 0, "cap_GBps", self.cap_bytes_per_s / 1e9, "must be > 0 (inf: none)")


def group_link(gpu_type: str, group: int, node_bytes_per_s: float = 0.0) -> GroupLink:
    """The link a ring of ``group`` GPUs of ``gpu_type`` inside one node runs over.

    SXM parts (``board``): NVLink at the GPU's rate. Cards that take a 2-way bridge: NVLink for a
    pair when the node has the bridges, which only the node can say: ``node_bytes_per_s``, the
    node's figure for its GPU-to-GPU bandwidth, above what the PCIe slot can carry means a
    bridge. Anything else: PCIe."""
    facts = link_facts(gpu_type)
    if facts.nvlink == "board" or (facts.nvlink == "bridge" and group == 2
                                   and node_bytes_per_s > facts.pcie_bytes_per_s):
        return GroupLink("nvlink", facts.nvlink_bytes_per_s)
    return GroupLink("pcie", facts.pcie_bytes_per_s)


@dataclass(frozen=True)
class LinkConstants:
    """The fitted constants of one link class: each collective's fixed cost, each ring step's
    latency, and the share of the link's peak a step's bytes move at."""

    fixed_s: float
    step_s: float
    fraction: float

    def __post_init__(self) -> None:
        for name in ("fixed_s", "step_s"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and math.isfinite(v) and 0 <= v < 1, name, v,
                  "must be a number of seconds in [0, 1)")
        check(isinstance(self.fraction, (int, float)) and 0 < self.fraction <= 1, "fraction", self.fraction,
              "must be in (0, 1]: the share of the link's peak a ring step achieves")


@dataclass(frozen=True)
class CollectiveModel:
    """:class:`LinkConstants` per link class, and what they were fitted on."""

    constants: Mapping[str, LinkConstants] = field(default_factory=dict)
    fitted_on: str = ""

    def __post_init__(self) -> None:
        table = dict(self.constants)
        for k, v in table.items():
            check(k in LINK_CLASSES, "constants", k, f"link classes are {', '.join(LINK_CLASSES)}")
            check(isinstance(v, LinkConstants), f"constants.{k}", v, "must be LinkConstants(fixed_s, step_s, fraction)")
        object.__setattr__(self, "constants", table)

    def constants_for(self, link_class: str) -> LinkConstants:
        found = self.constants.get(link_class)
        if found is None:
            have = ", ".join(sorted(self.constants)) or "none"
            raise PartitionerError(f"no collective constants for link class '{link_class}' (fitted: {have}); "
                                   "fit them on GPUs measured over such links")
        return found

    def allreduce_s(self, nbytes: float, group: int, link: GroupLink) -> float:
        """Seconds of one ring all-reduce of ``nbytes`` over ``group`` GPUs on ``link`` (0 for one GPU)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        c = self.constants_for(link.link_class)
        rate = min(c.fraction * link.peak_bytes_per_s, link.cap_bytes_per_s)
        return c.fixed_s + 2 * (group - 1) * (c.step_s + nbytes / group / rate)

    def to_dict(self) -> dict[str, Any]:
        return {"format": COLLECTIVES_FORMAT, "fitted_on": self.fitted_on,
                "constants": {k: {"fixed_s": c.fixed_s, "step_s": c.step_s, "fraction": c.fraction}
                              for k, c in self.constants.items()}}

    @classmethod
    def from_dict(cls, d: Any) -> CollectiveModel:
        if not isinstance(d, Mapping):
            raise FormatError("collectives", d, "must be an object {format, constants, fitted_on}")
        fmt = d.get("format", COLLECTIVES_FORMAT)
        check(fmt == COLLECTIVES_FORMAT, "collectives.format", fmt, f"expected '{COLLECTIVES_FORMAT}'")
        raw = d.get("constants", {})
        check(isinstance(raw, Mapping), "collectives.constants", raw, "must map link classes to constants")
        out = {}
        for k, v in raw.items():
            check(isinstance(v, Mapping) and set(v) == {"fixed_s", "step_s", "fraction"}, f"collectives.constants.{k}",
                  v, "must be an object {fixed_s, step_s, fraction}")
            try:
                out[str(k)] = LinkConstants(float(v["fixed_s"]), float(v["step_s"]), float(v["fraction"]))
            except (TypeError, ValueError):
                raise FormatError(f"collectives.constants.{k}", v, "values must be numbers") from None
            except FormatError as err:
                raise err.under(f"collectives.constants.{k}.") from None
        return cls(out, str(d.get("fitted_on", "")))


@functools.cache
def default_collectives() -> CollectiveModel:
    """The constants shipped with the package (``partitioner/data/collectives.json``, written by
    ``tools/fit_projection.py``; docs/profiling.md names its data)."""
    text = resources.files("partitioner").joinpath("data/collectives.json").read_text(encoding="utf-8")
    return CollectiveModel.from_dict(json.loads(text))


@dataclass(frozen=True)
class GroupAllReduce:
    """The all-reduces of groups of one GPU type in one kind of node, as the operator projection
    asks for them (``time_s(nbytes, group)``)."""

    model: CollectiveModel
    gpu_type: str
    node_bytes_per_s: float = 0.0

    def time_s(self, nbytes: float, group: int) -> float:
        if group <= 1 or nbytes <= 0:
            return 0.0
        return self.model.allreduce_s(nbytes, group, group_link(self.gpu_type, group, self.node_bytes_per_s))


def node_allreduce_s(nbytes: float, group: int, gpu_type: str, link: Bandwidth,
                     model: CollectiveModel | None = None) -> float:
    """Seconds of one all-reduce of ``nbytes`` by a group of ``group`` GPUs of ``gpu_type`` on a
    node whose GPU-to-GPU link a cluster file describes as ``link``.

    A GPU type with link facts (:func:`link_facts`) is priced by the collective model
    (``model``, default :func:`default_collectives`) on the link its group has
    (:func:`group_link`; the node's figure tells a bridged pair and caps a ring step's rate).
    Any other device (the CPU, a type a cluster file defines) has no facts to price it by: a ring
    of ``2 (group - 1)`` steps of ``nbytes / group`` on ``link`` as stated, nothing else."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    step = nbytes / group
    if gpu_type not in link_catalog():
        return 2 * (group - 1) * link.seconds(step)
    found = group_link(gpu_type, group, link.gbps * 1e9)
    capped = GroupLink(found.link_class, found.peak_bytes_per_s, link.gbps_at(step) * 1e9)
    return (model or default_collectives()).allreduce_s(nbytes, group, capped)
