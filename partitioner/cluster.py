"""Clusters: GPU types (with a built-in catalog), nodes, devices and the links between them.

Units: memory in bytes internally; cluster files give memory in GB as GPUs are marketed
(binary: ``memory_GB: 16`` is 16 * 2**30 bytes) and bandwidth in GB/s (10**9 bytes/s).
"""

from __future__ import annotations

import csv
import difflib
import functools
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from typing import Any

from ._io import load_mapping, opt_field, req_field, req_int, req_number
from .bandwidth import Bandwidth, parse_bandwidth
from .errors import FormatError, check

__all__ = [
    "BANDWIDTH_GBPS_RANGE",
    "CLUSTER_FORMAT",
    "GIB",
    "KIND_SEP",
    "MAX_GPUS",
    "Cluster",
    "Device",
    "DeviceType",
    "Link",
    "Node",
    "catalog",
    "device_kind",
    "device_name",
    "gpu_family",
    "resolve_gpu_type",
    "split_kind",
]

CLUSTER_FORMAT = "partitioner.cluster/1"
GIB = 2**30
GB = 1e9
KIND_SEP = "@tp"  # Device.kind: "A100-SXM4-40GB@tp4" is a tensor-parallel group of 4 such GPUs

# What a cluster file may hold (docs/formats.md): ranges far beyond real hardware that keep
# every transfer time and memory sum of the cost model finite, and a GPU count the solvers
# handle in seconds.
MAX_GPUS = 16_384  # GPUs in one cluster, all nodes together (bench/scale.py plans 4,096 in about 30 s)
BANDWIDTH_GBPS_RANGE = (1e-6, 1e6)  # GB/s of a link: 1 kB/s .. 1 PB/s
_DEVICE_RANGES = {  # field: (least, most), the least excluded
    "memory_GB": (0.0, 1e6), "fp32_tflops": (0.0, 1e6), "mem_GBps": (0.0, 1e7), "fp16_tensor_tflops": (0.0, 1e6),
    "tf32_tensor_tflops": (0.0, 1e6), "bf16_tensor_tflops": (0.0, 1e6), "usable_memory_GB": (0.0, 1e6),
}


@dataclass(frozen=True)
class DeviceType:
    """A GPU model: memory, peak dense FP32 and tensor-core FLOP/s, memory bandwidth.

    ``tensor_flops`` is the dense FP16 tensor-core rate with FP32 accumulation (what
    mixed-precision training gets; GeForce cards run it at half their FP16-accumulate rate),
    ``tf32_flops`` and ``bf16_flops`` the dense TF32 and BF16 tensor-core rates (0 when the
    GPU has none), ``sm_count`` its streaming multiprocessors (0 when unknown).

    ``memory_bytes`` is the nominal size (what the GPU is sold as); ``usable_memory_bytes`` what
    the driver hands the framework (``nvidia-smi``'s total: ECC bits on GDDR parts and the
    driver's own reservation taken out), 0 when not known. Plans must fit in
    :attr:`capacity_bytes`, the usable size where known, else the nominal one.
    """

    name: str
    memory_bytes: float
    peak_flops: float  # dense FP32, FLOP/s
    mem_bandwidth_bps: float  # bytes/s
    tensor_flops: float = 0.0  # dense FP16 tensor-core FLOP/s (FP32 accumulate), 0 when the GPU has none
    source: str = ""
    tf32_flops: float = 0.0  # dense TF32 tensor-core FLOP/s, 0 when the GPU has none
    bf16_flops: float = 0.0  # dense BF16 tensor-core FLOP/s, 0 when the GPU has none
    sm_count: int = 0
    usable_memory_bytes: float = 0.0  # what the driver reports (0: unknown, the nominal size counts)

    def __post_init__(self) -> None:
        check(bool(self.name) and ":" not in self.name and KIND_SEP not in self.name, "name", self.name,
              f"must be non-empty, without ':' or '{KIND_SEP}'")
        for f in ("memory_bytes", "peak_flops", "mem_bandwidth_bps"):
            v = getattr(self, f)
            check(isinstance(v, (int, float)) and v > 0, f"device_types.{self.name}.{f}", v, "must be > 0")
        for f in ("tensor_flops", "tf32_flops", "bf16_flops", "sm_count"):
            check(getattr(self, f) >= 0, f"device_types.{self.name}.{f}", getattr(self, f), "must be >= 0")
        check(0 <= self.usable_memory_bytes <= self.memory_bytes, f"device_types.{self.name}.usable_memory_GB",
              self.usable_memory_bytes / GIB, f"must be >= 0 and at most memory_GB ({self.memory_bytes / GIB:g})")

    @property
    def capacity_bytes(self) -> float:
        """The memory a plan may use: the usable size where known, else the nominal one."""
        return self.usable_memory_bytes or self.memory_bytes

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"memory_GB": self.memory_bytes / GIB, "fp32_tflops": self.peak_flops / 1e12,
             "mem_GBps": self.mem_bandwidth_bps / GB}
        for key, value in (("fp16_tensor_tflops", self.tensor_flops), ("tf32_tensor_tflops", self.tf32_flops),
                           ("bf16_tensor_tflops", self.bf16_flops)):
            if value:
                d[key] = value / 1e12
        if self.sm_count:
            d["sm_count"] = self.sm_count
        if self.usable_memory_bytes:
            d["usable_memory_GB"] = self.usable_memory_bytes / GIB
        if self.source:
            d["source"] = self.source
        return d

    @classmethod
    def from_dict(cls, name: str, d: Any, where: str = "") -> DeviceType:
        if not isinstance(d, Mapping):
            raise FormatError(where.rstrip("."), d, "must be an object {memory_GB, fp32_tflops, mem_GBps}")
        def num(key: str, **kw: Any) -> float:
            least, most = _DEVICE_RANGES[key]
            return req_number(d, key, where, minimum=least, maximum=most, **kw)

        return cls(
            name=name,
            memory_bytes=num("memory_GB", strict=True) * GIB,
            peak_flops=num("fp32_tflops", strict=True) * 1e12,
            mem_bandwidth_bps=num("mem_GBps", strict=True) * GB,
            tensor_flops=num("fp16_tensor_tflops", default=0.0) * 1e12,
            source=opt_field(d, "source", str, "", where),
            tf32_flops=num("tf32_tensor_tflops", default=0.0) * 1e12,
            bf16_flops=num("bf16_tensor_tflops", default=0.0) * 1e12,
            sm_count=int(req_int(d, "sm_count", where, default=0, minimum=0, maximum=1_000_000)),
            usable_memory_bytes=num("usable_memory_GB", default=0.0) * GIB,
        )


@functools.cache
def catalog() -> dict[str, DeviceType]:
    """The built-in GPU catalog, read from ``partitioner/data/gpu_catalog.csv``.

    Every row carries its public source in the ``source`` column (vendor datasheet figures
    collected by satyaog/IGUANE, winston-zhang-orz/gpu-specs, xiaozheyao/triteia and spec
    pages) and the source of its tensor-core rates and SM count in ``tensor_source`` (NVIDIA's
    architecture whitepapers); see docs/formats.md. ``tensor_flops`` is the FP16 rate with FP32
    accumulation where the catalog gives it, else the FP16 (or BF16) column.
    """
    out: dict[str, DeviceType] = {}
    text = resources.files("partitioner").joinpath("data/gpu_catalog.csv").read_text(encoding="utf-8")
    for row in csv.DictReader(text.splitlines()):
        tensor = (row.get("fp16_fp32acc_tensor_tflops_dense") or row.get("fp16_tensor_tflops_dense")
                  or row.get("bf16_tensor_tflops_dense") or "0")
        out[row["gpu"]] = DeviceType(
            name=row["gpu"],
            memory_bytes=float(row["mem_gb"]) * GIB,
            peak_flops=float(row["fp32_tflops"]) * 1e12,
            mem_bandwidth_bps=float(row["mem_bw_GBps"]) * GB,
            tensor_flops=float(tensor) * 1e12,
            source=row["source"],
            tf32_flops=float(row.get("tf32_tensor_tflops_dense") or 0) * 1e12,
            bf16_flops=float(row.get("bf16_tensor_tflops_dense") or 0) * 1e12,
            sm_count=int(row.get("sm_count") or 0),
            usable_memory_bytes=float(row.get("usable_mem_gib") or 0) * GIB,
        )
    return out


# Short names people type, and the names other tools' profiles use (Sailor, PipeDream), each
# for one catalog type. Sailor's ``A100-40``, ``A100-80`` and ``V100-16`` name the parts of its
# published clusters (SXM boards).
_ALIASES = {
    "V10016": "V100-SXM2-16GB", "P100": "P100-PCIe-16GB", "A10040": "A100-SXM4-40GB",
    "A10080": "A100-SXM4-80GB", "H100SXM": "H100-SXM5-80GB",
    "H100PCIE": "H100-PCIe-80GB", "TITANV": "TITAN-V", "TITANRTX": "TITAN-RTX",
    "RTX2060": "RTX-2060", "RTX2080": "RTX-2080", "RTX2080TI": "RTX-2080-Ti", "RTX3090": "RTX-3090",
    "P4000": "Quadro-P4000", "QUADROP4000": "Quadro-P4000",
}
# Names of a family whose members differ in memory or speed: refused with the members, never
# taken as one of them (an A100 may have 40 or 80 GB).
_AMBIGUOUS = {
    "V100": ("V100-SXM2-16GB", "V100-SXM2-32GB", "V100-PCIe-16GB", "V100-PCIe-32GB"),
    "V10032": ("V100-SXM2-32GB", "V100-PCIe-32GB"),
    "A100": ("A100-SXM4-40GB", "A100-SXM4-80GB", "A100-PCIe-80GB"),
    "H100": ("H100-SXM5-80GB", "H100-PCIe-80GB"),
}


def _key(name: str) -> str:
    return "".join(ch for ch in name.upper() if ch.isalnum())


def gpu_family(name: str) -> tuple[str, ...]:
    """The catalog types a family name stands for (``A100``: the 40 and 80 GB parts), ``()`` for
    any other name. :func:`resolve_gpu_type` refuses such a name; a profile's times keyed by one
    serve every member the cluster names (the cluster, not the key, says which part it is)."""
    return _AMBIGUOUS.get(_key(name), ())


def resolve_gpu_type(name: str, extra: Mapping[str, DeviceType] | None = None) -> DeviceType:
    """Look a GPU type up by name or alias (case, spaces and dashes ignored). A name that stands
    for several catalog types (``A100``: 40 or 80 GB) is refused with them, as is an unknown one."""
    extra = extra or {}
    if name in extra:
        return extra[name]
    cat = catalog()
    if name in cat:
        return cat[name]
    k = _key(name)
    for table in (extra, cat):
        for real in table:
            if _key(real) == k:
                return table[real]
    if k in _ALIASES:
        return cat[_ALIASES[k]]
    if k in _AMBIGUOUS:
        raise FormatError("gpu type", name, f"ambiguous: it may be {', '.join(_AMBIGUOUS[k])}; name one "
                          "(they differ in memory or speed)")
    known = sorted({*cat, *extra})
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.4)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise FormatError("gpu type", name, f"unknown; {hint}known types: {', '.join(known)} "
                      "(or add it under device_types)")


@dataclass(frozen=True)
class Device:
    """One GPU of the cluster, named ``NODE:INDEX``, or a tensor-parallel group of ``gpus`` GPUs of
    one type on one node, GPUs ``INDEX .. INDEX + gpus - 1``, named ``NODE:FIRST-LAST``.

    A group runs one shard of a stage on each of its GPUs (Megatron-style tensor parallelism):
    ``memory_bytes`` is what each of its GPUs has, and ``kind`` (the GPU type and the degree)
    is what the profile's times are looked up by."""

    name: str
    node: str
    index: int
    type: DeviceType
    gpus: int = 1

    def __post_init__(self) -> None:
        check(isinstance(self.index, int) and not isinstance(self.index, bool) and self.index >= 0,
              "device.index", self.index, "must be an integer >= 0")
        check(isinstance(self.gpus, int) and not isinstance(self.gpus, bool) and self.gpus >= 1,
              "device.gpus", self.gpus, "must be an integer >= 1")
        want = device_name(self.node, self.index, self.gpus)
        check(self.name == want, "device.name", self.name, f"must be {'NODE:INDEX' if self.gpus == 1 else 'NODE:FIRST-LAST'}"
              f", here {want}")
        check(isinstance(self.type, DeviceType), "device.type", self.type, "must be a DeviceType")

    @property
    def gpu_type(self) -> str:
        return self.type.name

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel degree: the GPUs of the group (1 for one GPU)."""
        return self.gpus

    @property
    def kind(self) -> str:
        """What the device's times are looked up by: the GPU type, with ``@tpT`` for a group of T."""
        return device_kind(self.type.name, self.gpus)

    @property
    def memory_bytes(self) -> float:
        """What a plan may use on this GPU (:attr:`DeviceType.capacity_bytes`)."""
        return self.type.capacity_bytes

    @property
    def gpu_names(self) -> tuple[str, ...]:
        """The GPUs of the device (itself for one GPU), ``NODE:INDEX`` each."""
        return tuple(f"{self.node}:{i}" for i in range(self.index, self.index + self.gpus))


def device_name(node: str, index: int, gpus: int = 1) -> str:
    """``NODE:INDEX`` for one GPU, ``NODE:FIRST-LAST`` for a tensor-parallel group."""
    return f"{node}:{index}" if gpus == 1 else f"{node}:{index}-{index + gpus - 1}"


def device_kind(gpu_type: str, tensor_parallel: int = 1) -> str:
    """A GPU type at a tensor-parallel degree, as :attr:`Device.kind` names it."""
    return gpu_type if tensor_parallel == 1 else f"{gpu_type}{KIND_SEP}{tensor_parallel}"


def split_kind(kind: str) -> tuple[str, int]:
    """(GPU type, tensor-parallel degree) of a :attr:`Device.kind` (a plain type name: degree 1)."""
    base, sep, t = kind.rpartition(KIND_SEP)
    if sep and t.isdigit() and int(t) >= 1:
        return base, int(t)
    return kind, 1


@dataclass(frozen=True)
class Node:
    """A machine: its GPUs in order (type name per GPU), the bandwidth between them and, when
    ``nic_gbps`` > 0, the NICs its GPUs share for traffic to other nodes: ``nics`` of
    ``nic_gbps`` GB/s each way, GPU ``g`` of ``n`` behind NIC ``g * nics // n``. Transfers that
    cross a NIC at the same time divide its bandwidth (:mod:`partitioner.flows`); 0 (the
    default) models no NIC: each node pair is one link, as ``inter_node_GBps`` says."""

    name: str
    gpus: tuple[str, ...]
    intra_gbps: float
    intra_curve: Bandwidth | None = None  # message-size-aware bandwidth; its cap is intra_gbps
    nic_gbps: float = 0.0
    nics: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus", tuple(self.gpus))
        check(bool(self.name) and ":" not in self.name, "nodes[].name", self.name, "must be non-empty, without ':'")
        check(len(self.gpus) >= 1, f"nodes.{self.name}.gpus", list(self.gpus), "must list at least one GPU")
        check(self.intra_gbps > 0, f"nodes.{self.name}.intra_node_GBps", self.intra_gbps, "must be > 0")
        check(math.isfinite(self.nic_gbps) and self.nic_gbps >= 0, f"nodes.{self.name}.nic_GBps", self.nic_gbps,
              "must be a finite number >= 0 (0: no shared NIC modelled)")
        check(isinstance(self.nics, int) and not isinstance(self.nics, bool) and 1 <= self.nics <= len(self.gpus),
              f"nodes.{self.name}.nics", self.nics, f"must be an integer in [1, {len(self.gpus)}] (the node's GPUs)")

    def nic_of(self, index: int) -> int:
        """The NIC GPU ``index`` of this node sends and receives through."""
        return index * self.nics // len(self.gpus)

    @property
    def kind(self) -> tuple[Any, ...]:
        """What prices the node's GPUs alike wherever it sits: its GPU mix (in order where several
        NICs split it), its intra-node link and its NICs. Nodes of one kind are interchangeable
        for a worker priced alone (the planners' memo)."""
        curve = replace(self.intra_curve, name="") if self.intra_curve is not None else None
        gpus = tuple(sorted(self.gpus)) if self.nics == 1 or not self.nic_gbps else self.gpus
        return gpus, self.intra_gbps, curve, self.nic_gbps, self.nics


@dataclass(frozen=True)
class Link:
    """A bandwidth override between two nodes or two devices (either direction)."""

    a: str
    b: str
    gbps: float
    curve: Bandwidth | None = None

    def __post_init__(self) -> None:
        check(self.gbps > 0, "links[].GBps", self.gbps, "must be > 0")


@dataclass(frozen=True)
class Cluster:
    """Nodes of GPUs, the network between nodes, and optional per-pair bandwidths."""

    name: str
    nodes: tuple[Node, ...]
    inter_gbps: float
    device_types: Mapping[str, DeviceType] = field(default_factory=dict)
    links: tuple[Link, ...] = ()
    inter_curve: Bandwidth | None = None  # message-size-aware inter-node bandwidth; its cap is inter_gbps
    # GPU type -> tensor-parallel degree: the devices are groups of that many GPUs of the type on one
    # node (a view the planner takes; types not named are single GPUs)
    tensor_parallel: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "device_types", dict(self.device_types))
        check(len(self.nodes) >= 1, "nodes", [], "must list at least one node")
        check(self.inter_gbps > 0, "inter_node_GBps", self.inter_gbps, "must be > 0")
        names = [n.name for n in self.nodes]
        seen: set[str] = set()
        for i, name in enumerate(names):
            check(name not in seen, f"nodes[{i}].name", name, "duplicates an earlier node name")
            seen.add(name)
        resolved: set[str] = set()
        for i, node in enumerate(self.nodes):
            for k, t in enumerate(node.gpus):
                if t in resolved:
                    continue
                try:
                    resolve_gpu_type(t, self.device_types)
                except FormatError as err:
                    raise FormatError(f"nodes[{i}].gpus[{k}]", t, err.expected) from None
                resolved.add(t)
        self._check_tensor_parallel()
        total = sum(len(n.gpus) for n in self.nodes)
        check(total <= MAX_GPUS, "nodes", f"{total:,} GPUs", f"at most {MAX_GPUS:,} GPUs in a cluster are supported")
        devs = {d.name for d in self.gpus}
        for k, link in enumerate(self.links):
            for end in (link.a, link.b):
                check(end in devs or end in names, f"links[{k}].between", [link.a, link.b],
                      f"'{end}' is neither a node nor a device of this cluster")
            check((link.a in devs) == (link.b in devs), f"links[{k}].between", [link.a, link.b],
                  "must be two node names or two device names, not a node and a device")
            check(link.a != link.b, f"links[{k}].between", [link.a, link.b], "must name two different ends")

    def _check_tensor_parallel(self) -> None:
        degrees: dict[str, int] = {}
        for key, t in self.tensor_parallel.items():
            check(isinstance(t, int) and not isinstance(t, bool) and 1 <= t <= 64, f"tensor_parallel.{key}", t,
                  "must be a tensor-parallel degree in [1, 64]")
            try:
                name = resolve_gpu_type(str(key), self.device_types).name
            except FormatError as err:
                raise FormatError(f"tensor_parallel.{key}", key, err.expected) from None
            if t > 1:
                degrees[name] = t
        object.__setattr__(self, "tensor_parallel", degrees)
        for node in self.nodes:
            for gpu_type, first, count in self._runs(node):
                t = degrees.get(gpu_type, 1)
                check(count % t == 0, f"tensor_parallel.{gpu_type}", t,
                      f"must divide the {count} {gpu_type} GPU(s) of node {node.name} (GPUs {first}-"
                      f"{first + count - 1}): a tensor-parallel group never spans nodes or GPU types")

    def _runs(self, node: Node) -> list[tuple[str, int, int]]:
        """(type name, first GPU, count) of each run of GPUs of one type in ``node``."""
        out: list[tuple[str, int, int]] = []
        for i, t in enumerate(node.gpus):
            name = resolve_gpu_type(t, self.device_types).name
            if out and out[-1][0] == name:
                out[-1] = (name, out[-1][1], out[-1][2] + 1)
            else:
                out.append((name, i, 1))
        return out

    # -- derived views -------------------------------------------------------------------

    @functools.cached_property
    def devices(self) -> tuple[Device, ...]:
        """The devices plans use: each GPU, or each tensor-parallel group where ``tensor_parallel``
        says so (GPUs of a type in a node grouped in order)."""
        out = []
        for node in self.nodes:
            for gpu_type, first, count in self._runs(node):
                dtype = resolve_gpu_type(gpu_type, self.device_types)
                t = self.tensor_parallel.get(gpu_type, 1)
                out += [Device(device_name(node.name, i, t), node.name, i, dtype, t) for i in range(first, first + count, t)]
        return tuple(out)

    @functools.cached_property
    def gpus(self) -> tuple[Device, ...]:
        """Every GPU as a device of its own, whatever the view."""
        return tuple(Device(f"{n.name}:{i}", n.name, i, resolve_gpu_type(t, self.device_types))
                     for n in self.nodes for i, t in enumerate(n.gpus))

    @property
    def num_gpus(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)

    def with_tensor_parallel(self, degrees: Mapping[str, int]) -> Cluster:
        """The same cluster viewed with tensor-parallel groups of ``degrees`` (GPU type -> degree)."""
        return replace(self, tensor_parallel=dict(degrees))

    def node_of(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise FormatError("node", name, f"not in cluster '{self.name}'")

    def _group(self, name: str) -> Device | None:
        """The tensor-parallel group a device name ``NODE:FIRST-LAST`` names, or None."""
        node_name, _, rng = name.rpartition(":")
        first, dash, last = rng.partition("-")
        if not (dash and first.isdigit() and last.isdigit()) or node_name not in self._node_bw:
            return None
        a, b = int(first), int(last)
        node = self.node_of(node_name)
        if not (a < b < len(node.gpus)) or rng != f"{a}-{b}":
            raise FormatError("device", name, f"a tensor-parallel group NODE:FIRST-LAST needs FIRST < LAST < "
                              f"{len(node.gpus)} (node {node_name} has {len(node.gpus)} GPUs)")
        types = {resolve_gpu_type(t, self.device_types).name for t in node.gpus[a:b + 1]}
        if len(types) != 1:
            raise FormatError("device", name, f"mixes GPU types {sorted(types)}: a tensor-parallel group is GPUs "
                              "of one type on one node")
        return Device(name, node_name, a, resolve_gpu_type(node.gpus[a], self.device_types), b - a + 1)

    @functools.cached_property
    def _by_name(self) -> dict[str, Device]:
        return {d.name: d for d in self.devices}

    @functools.cached_property
    def _node_bw(self) -> dict[str, float]:
        return {n.name: n.intra_gbps for n in self.nodes}

    @functools.cached_property
    def _overrides(self) -> dict[frozenset[str], float]:
        return {frozenset((link.a, link.b)): link.gbps for link in self.links}

    @functools.cached_property
    def _groups(self) -> dict[str, Device]:
        """Groups named so far that the view's devices do not list (resolved on first use)."""
        return {}

    @functools.cached_property
    def _single(self) -> dict[str, Device]:
        return {d.name: d for d in self.gpus}

    def device(self, name: str) -> Device:
        """A device by name: one of :attr:`devices`, any single GPU ``NODE:INDEX``, or any
        tensor-parallel group ``NODE:FIRST-LAST`` of GPUs of one type on one node."""
        found = self._by_name.get(name) or self._single.get(name) or self._groups.get(name)
        if found is None and isinstance(name, str):
            found = self._group(name)
            if found is not None:
                self._groups[name] = found
        if found is None:
            shown = list(self._by_name)
            listed = ", ".join(shown[:16]) + (f", ... ({len(shown)} in all)" if len(shown) > 16 else "")
            raise FormatError("device", name, f"not in cluster '{self.name}' (devices: {listed})")
        return found

    @property
    def gpu_types(self) -> tuple[str, ...]:
        """Distinct GPU type names, in first-seen order."""
        return tuple(dict.fromkeys(d.gpu_type for d in self.devices))

    @functools.cached_property
    def _curves(self) -> dict[frozenset[str], Bandwidth]:
        return {frozenset((x.a, x.b)): x.curve or Bandwidth(x.gbps, name=f"links[{k}]")
                for k, x in enumerate(self.links)}

    @functools.cached_property
    def _flat_inter(self) -> Bandwidth:
        return self.inter_curve or Bandwidth(self.inter_gbps, name="inter_node_GBps")

    @functools.cached_property
    def _node_curve(self) -> dict[str, Bandwidth]:
        return {n.name: n.intra_curve or Bandwidth(n.intra_gbps, name=f"nodes.{n.name}.intra_node_GBps")
                for n in self.nodes}

    def link(self, a: str, b: str) -> Bandwidth:
        """The :class:`Bandwidth` between two different devices (same precedence as :meth:`bandwidth_gbps`)."""
        da, db = self.device(a), self.device(b)
        ov = self._curves
        for key in (frozenset((a, b)), frozenset((da.node, db.node))):
            if key in ov:
                return ov[key]
        return self._node_curve[da.node] if da.node == db.node else self._flat_inter

    def transfer_s(self, nbytes: float, a: str, b: str) -> float:
        """Seconds of one point-to-point send of ``nbytes`` from device ``a`` to device ``b`` (0 if
        a == b), its link's per-send overhead included (:meth:`Bandwidth.send_seconds`)."""
        if a == b or nbytes <= 0:
            return 0.0
        return self.link(a, b).send_seconds(nbytes)

    @functools.cached_property
    def has_nics(self) -> bool:
        """Whether any node shares NICs between its GPUs (``nic_GBps``)."""
        return any(n.nic_gbps > 0 for n in self.nodes)

    @functools.cached_property
    def _node_of(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    def nic_route(self, a: str, b: str) -> tuple[tuple[str, int, str, float], ...]:
        """The shared NIC directions a transfer from device ``a`` to ``b`` crosses, as
        ``(node, nic, "out" | "in", GB/s)``: the sender's NIC out and the receiver's NIC in where
        those nodes have NICs; none inside a node."""
        da, db = self.device(a), self.device(b)
        if da.node == db.node:
            return ()
        out = []
        for dev, way in ((da, "out"), (db, "in")):
            node = self._node_of[dev.node]
            if node.nic_gbps > 0:
                out.append((node.name, node.nic_of(dev.index), way, node.nic_gbps))
        return tuple(out)

    @property
    def has_curves(self) -> bool:
        """Whether any link's time depends on the message size (or has a latency)."""
        return any(not bw.is_flat for bw in (*self._curves.values(), *self._node_curve.values(), self._flat_inter))

    def bandwidth_gbps(self, a: str, b: str) -> float:
        """Bandwidth of the link between devices ``a`` and ``b`` in GB/s (inf for a == b).

        A device-pair override wins over a node-pair override, which wins over the node's
        intra-node bandwidth or the cluster's inter-node bandwidth.
        """
        if a == b:
            return float("inf")
        da, db = self.device(a), self.device(b)
        ov = self._overrides
        for key in (frozenset((a, b)), frozenset((da.node, db.node))):
            if key in ov:
                return ov[key]
        if da.node == db.node:
            return self._node_bw[da.node]
        return self.inter_gbps

    # -- construction and JSON -----------------------------------------------------------

    @classmethod
    def homogeneous(cls, gpu_type: str, nodes: int, gpus_per_node: int, intra_gbps: float,
                    inter_gbps: float, name: str = "") -> Cluster:
        """``nodes`` identical nodes of ``gpus_per_node`` GPUs of one type."""
        return cls(name or f"{nodes}x{gpus_per_node}-{gpu_type}",
                   tuple(Node(f"n{i}", (gpu_type,) * gpus_per_node, intra_gbps) for i in range(nodes)),
                   inter_gbps)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"format": CLUSTER_FORMAT, "name": self.name,
                             "inter_node_GBps": self.inter_curve.to_value() if self.inter_curve else self.inter_gbps,
                             "nodes": []}
        for n in self.nodes:
            counts: dict[str, int] = {}
            contiguous = True
            for t in n.gpus:
                if t in counts and list(counts)[-1] != t:
                    contiguous = False
                counts[t] = counts.get(t, 0) + 1
            gpus: Any = counts if contiguous else list(n.gpus)
            d["nodes"].append({"name": n.name, "intra_node_GBps": n.intra_curve.to_value() if n.intra_curve
                               else n.intra_gbps, "gpus": gpus})
            if n.nic_gbps:
                d["nodes"][-1].update({"nic_GBps": n.nic_gbps, "nics": n.nics})
        if self.device_types:
            d["device_types"] = {k: v.to_dict() for k, v in self.device_types.items()}
        if self.tensor_parallel:
            d["tensor_parallel"] = dict(self.tensor_parallel)
        if self.links:
            d["links"] = [{"between": [x.a, x.b], "GBps": x.curve.to_value() if x.curve else x.gbps}
                          for x in self.links]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Cluster:
        fmt = opt_field(d, "format", str, CLUSTER_FORMAT)
        if fmt != CLUSTER_FORMAT:
            raise FormatError("format", fmt, f"expected '{CLUSTER_FORMAT}'")
        types_raw = opt_field(d, "device_types", Mapping, {})
        types = {str(k): DeviceType.from_dict(str(k), v, f"device_types.{k}.") for k, v in types_raw.items()}
        nodes = []
        total_gpus = 0
        lo, hi = BANDWIDTH_GBPS_RANGE
        nodes_raw = req_field(d, "nodes", list)
        check(len(nodes_raw) <= MAX_GPUS, "nodes", f"{len(nodes_raw):,} nodes",
              f"at most {MAX_GPUS:,} GPUs in a cluster are supported")
        for i, raw in enumerate(nodes_raw):
            where = f"nodes[{i}]."
            if not isinstance(raw, Mapping):
                raise FormatError(f"nodes[{i}]", raw, "must be an object {name, intra_node_GBps, gpus}")
            gpus_raw = req_field(raw, "gpus", (Mapping, list), where)
            gpus: list[str] = []
            if isinstance(gpus_raw, Mapping):
                for t, c in gpus_raw.items():
                    check(isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= MAX_GPUS - total_gpus,
                          f"{where}gpus.{t}", c, f"must be a GPU count >= 1; at most {MAX_GPUS:,} GPUs in a "
                          f"cluster are supported ({total_gpus:,} listed before)")
                    gpus += [str(t)] * c
                    total_gpus += c
            else:
                for k, t in enumerate(gpus_raw):
                    check(isinstance(t, str), f"{where}gpus[{k}]", t, "must be a GPU type name")
                gpus = list(gpus_raw)
                total_gpus += len(gpus)
                check(total_gpus <= MAX_GPUS, f"{where}gpus", f"{len(gpus):,} GPUs",
                      f"at most {MAX_GPUS:,} GPUs in a cluster are supported")
            intra = parse_bandwidth(raw, "intra_node_GBps", where, minimum=lo, maximum=hi)
            nic = req_number(raw, "nic_GBps", where, default=0.0, minimum=0.0, maximum=hi)
            check(nic == 0 or nic > lo, f"{where}nic_GBps", nic, f"must be 0 (no shared NIC) or in ({lo:g}, {hi:g}]")
            nodes.append(Node(
                name=str(opt_field(raw, "name", (str, int), f"n{i}", where)),
                gpus=tuple(gpus),
                intra_gbps=intra.gbps,
                intra_curve=None if intra.is_flat else intra,
                nic_gbps=nic,
                nics=int(req_int(raw, "nics", where, default=1, minimum=1, maximum=max(1, len(gpus)))),
            ))
        links = []
        links_raw = opt_field(d, "links", list, [])
        check(len(links_raw) <= 10 * MAX_GPUS, "links", f"{len(links_raw):,} links",
              f"at most {10 * MAX_GPUS:,} are supported")
        for k, raw in enumerate(links_raw):
            where = f"links[{k}]."
            if not isinstance(raw, Mapping):
                raise FormatError(f"links[{k}]", raw, "must be an object {between: [a, b], GBps}")
            ends = req_field(raw, "between", list, where)
            check(len(ends) == 2 and all(isinstance(e, str) for e in ends), f"{where}between", ends,
                  "must be two node or device names")
            bw = parse_bandwidth(raw, "GBps", where, minimum=lo, maximum=hi)
            links.append(Link(ends[0], ends[1], bw.gbps, None if bw.is_flat else bw))
        inter = parse_bandwidth(d, "inter_node_GBps", minimum=lo, maximum=hi)
        return cls(
            name=str(opt_field(d, "name", (str, int), "cluster")),
            nodes=tuple(nodes),
            inter_gbps=inter.gbps,
            device_types=types,
            links=tuple(links),
            inter_curve=None if inter.is_flat else inter,
            tensor_parallel=opt_field(d, "tensor_parallel", Mapping, {}),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        from ._io import write_loadable

        write_loadable(path, self.to_dict(), Cluster.from_dict, "cluster")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Cluster:
        data = load_mapping(path)
        try:
            return cls.from_dict(data)
        except FormatError as err:
            raise err.in_file(str(path)) from None

    def subset(self, device_names: Sequence[str]) -> tuple[Device, ...]:
        """The named devices, in the given order."""
        return tuple(self.device(n) for n in device_names)
