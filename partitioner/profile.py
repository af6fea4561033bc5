"""Per-layer profiles: compute time per GPU type and memory per layer, in execution order.

A :class:`Profile` is a chain of :class:`LayerProfile` objects. Times are per micro-batch
of ``Profile.micro_batch_size`` samples; sizes are bytes for that micro-batch.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ._io import (
    is_finite_number,
    load_mapping,
    opt_field,
    req_field,
    req_int,
    req_number,
    write_loadable,
)
from .errors import FormatError, check

__all__ = [
    "MAX_BYTES",
    "MAX_EXPECTED_ERROR",
    "MAX_FLOPS",
    "MAX_LAYERS",
    "MAX_LAYER_S",
    "MAX_MICRO_BATCH_SIZE",
    "MAX_TENSOR_PARALLEL",
    "PROFILE_FORMAT",
    "LayerProfile",
    "LayerShard",
    "LayerTime",
    "Profile",
    "crossing_bytes",
]

PROFILE_FORMAT = "partitioner.profile/1"

# What a profile file may hold (docs/formats.md). The bounds are far beyond any real model and
# keep every sum and product of the cost model finite.
MAX_LAYER_S = 1e6  # seconds per layer and micro-batch (11.6 days)
MAX_FLOPS = 1e21  # forward FLOPs per layer and micro-batch
MAX_BYTES = float(2**60)  # bytes of one layer's parameters or tensors (1 EiB)
MAX_MICRO_BATCH_SIZE = 2**20
MAX_LAYERS = 10_000
MAX_EXPECTED_ERROR = 1e3  # a projected time's expected relative error (100,000 %)


@dataclass(frozen=True)
class LayerTime:
    """Forward and backward time of one layer on one GPU type, per micro-batch.

    ``update_s`` is the optimizer step of the layer's parameters, once per iteration (it does
    not depend on the micro-batch size); 0 when the profile did not time it.
    ``expected_error`` is, for a projected time, its expected relative error (0.12: 12 %,
    either way) as the projection estimates it; None when not known (and for measurements).
    ``bwd_weight_share`` splits the backward for the zero-bubble schedules: the weight-gradient
    part (W) is ``bwd_s * bwd_weight_share``, the input-gradient part (B) the rest, as the
    profiler measured them (``torch.autograd.grad`` w.r.t. the input, then w.r.t. the weights);
    None when not measured (:meth:`Profile.backward_split_for` then applies its estimate rule).
    A share survives rescaling and interpolation of ``bwd_s`` unchanged.
    """

    fwd_s: float
    bwd_s: float
    projected: bool = False
    measured_on: str = ""  # the device that really took the numbers ("cpu", "cuda:NVIDIA H100 ...")
    update_s: float = 0.0
    expected_error: float | None = None
    bwd_weight_share: float | None = None

    def __post_init__(self) -> None:
        for name in ("fwd_s", "bwd_s", "update_s"):
            v = getattr(self, name)
            check(is_finite_number(v) and v >= 0, name, v,
                  "must be a finite number of seconds >= 0")
        if self.bwd_weight_share is not None:
            check(is_finite_number(self.bwd_weight_share) and 0 <= self.bwd_weight_share <= 1,
                  "bwd_weight_share", self.bwd_weight_share, "must be a number in [0, 1] (W's share of bwd_s)")
        if self.expected_error is not None:
            check(is_finite_number(self.expected_error) and 0 <= self.expected_error <= MAX_EXPECTED_ERROR,
                  "expected_error", self.expected_error, f"must be a number in [0, {MAX_EXPECTED_ERROR:g}]")

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"fwd_s": self.fwd_s, "bwd_s": self.bwd_s, "projected": self.projected}
        if self.measured_on:
            d["measured_on"] = self.measured_on
        if self.update_s:
            d["update_s"] = self.update_s
        if self.expected_error is not None:
            d["expected_error"] = self.expected_error
        if self.bwd_weight_share is not None:
            d["bwd_weight_share"] = self.bwd_weight_share
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "") -> LayerTime:
        if not isinstance(d, Mapping):
            raise FormatError(where.rstrip("."), d, "must be an object {fwd_s, bwd_s, projected}")
        return cls(
            fwd_s=req_number(d, "fwd_s", where, maximum=MAX_LAYER_S),
            bwd_s=req_number(d, "bwd_s", where, maximum=MAX_LAYER_S),
            projected=opt_field(d, "projected", bool, False, where),
            measured_on=opt_field(d, "measured_on", str, "", where),
            update_s=req_number(d, "update_s", where, default=0.0),
            expected_error=(None if d.get("expected_error") is None
                            else req_number(d, "expected_error", where, maximum=MAX_EXPECTED_ERROR)),
            bwd_weight_share=(None if d.get("bwd_weight_share") is None
                              else req_number(d, "bwd_weight_share", where, maximum=1.0)),
        )


MAX_TENSOR_PARALLEL = 64


@dataclass(frozen=True)
class LayerShard:
    """One layer run tensor-parallel over ``t`` GPUs (Megatron-style): what ONE GPU of the group
    holds and takes. ``param_bytes`` and ``saved_bytes`` are per GPU (the shard's weights and what
    autograd keeps for it); ``times`` are per micro-batch on each GPU type with the group's
    collectives (the forward and backward all-reduces) included, as a measurement of the group
    gives them. The layer's output is the full tensor on every GPU of the group (the pipeline sends
    it as without tensor parallelism)."""

    param_bytes: float
    saved_bytes: float
    times: Mapping[str, LayerTime] = field(default_factory=dict)
    shared_saved_bytes: float = 0.0
    times_at: Mapping[int, Mapping[str, LayerTime]] = field(default_factory=dict)
    # bytes the group all-reduces in the layer's forward (the backward all-reduces as many), per
    # micro-batch, that ``times`` leave out: the cost model prices them on the group's node link
    # (0: the times include every collective, as a measurement of the whole group does)
    allreduce_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("param_bytes", "saved_bytes", "shared_saved_bytes", "allreduce_bytes"):
            v = getattr(self, name)
            check(is_finite_number(v) and 0 <= v <= MAX_BYTES, name, v, f"must be a number of bytes in [0, {MAX_BYTES:g}]")
        check(self.shared_saved_bytes <= self.saved_bytes, "shared_saved_bytes", self.shared_saved_bytes,
              f"must not exceed saved_bytes ({self.saved_bytes:g})")
        for gpu, t in self.times.items():
            check(isinstance(t, LayerTime), f"times.{gpu}", t, "must be a LayerTime")
        object.__setattr__(self, "times", dict(self.times))
        object.__setattr__(self, "times_at", {k: dict(v) for k, v in sorted(self.times_at.items())})

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"param_bytes": self.param_bytes, "saved_bytes": self.saved_bytes,
                             "times": {g: t.to_dict() for g, t in self.times.items()}}
        if self.shared_saved_bytes:
            d["shared_saved_bytes"] = self.shared_saved_bytes
        if self.times_at:
            d["times_at"] = {str(b): {g: t.to_dict() for g, t in v.items()} for b, v in self.times_at.items()}
        if self.allreduce_bytes:
            d["allreduce_bytes"] = self.allreduce_bytes
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "") -> LayerShard:
        if not isinstance(d, Mapping):
            raise FormatError(where.rstrip("."), d, "must be an object {param_bytes, saved_bytes, times}")
        try:
            return cls(
                param_bytes=req_number(d, "param_bytes", where, maximum=MAX_BYTES),
                saved_bytes=req_number(d, "saved_bytes", where, maximum=MAX_BYTES),
                times=_times_of(opt_field(d, "times", Mapping, {}, where), f"{where}times."),
                shared_saved_bytes=req_number(d, "shared_saved_bytes", where, default=0.0, maximum=MAX_BYTES),
                times_at=_times_at_of(opt_field(d, "times_at", Mapping, {}, where), f"{where}times_at"),
                allreduce_bytes=req_number(d, "allreduce_bytes", where, default=0.0, maximum=MAX_BYTES),
            )
        except FormatError as err:
            raise err if err.field.startswith(where) else err.under(where) from None


def _times_of(raw: Mapping[str, Any], where: str) -> dict[str, LayerTime]:
    return {str(g): LayerTime.from_dict(t, f"{where}{g}.") for g, t in raw.items()}


def _times_at_of(raw: Mapping[str, Any], where: str) -> dict[int, dict[str, LayerTime]]:
    out: dict[int, dict[str, LayerTime]] = {}
    for size, by_gpu in raw.items():
        check(str(size).isdigit() and len(str(size)) < 19 and int(size) >= 1, where,
              size if len(str(size)) < 40 else f"{str(size)[:20]}...", "keys must be micro-batch sizes >= 1")
        check(isinstance(by_gpu, Mapping), f"{where}.{size}", by_gpu, "must map GPU types to times")
        out[int(size)] = _times_of(by_gpu, f"{where}.{size}.")
    return out


@dataclass(frozen=True)
class LayerProfile:
    """One layer: its work, its memory, and its time on each GPU type it was timed on.

    ``saved_bytes`` is what autograd keeps for backward per micro-batch; ``output_bytes``
    is the boundary tensor sent to the next stage if a cut is made after this layer.
    ``own_output_bytes`` is the layer's own output, what each consumer along an edge of a graph
    profile receives (None: the same as ``output_bytes``, as in a chain); with it a graph
    profile can be put in another topological order and its cuts priced again
    (:meth:`Profile.reordered`).
    ``shared_saved_bytes`` is the part of ``saved_bytes`` that the previous layer keeps too
    (typically this layer's input, which a ReLU before it saved as its output): one tensor,
    counted once when both layers are in the same stage, twice when a cut separates them.
    ``selective_saved_bytes`` is what the layer keeps for backward with its attention core
    recomputed (selective recomputation), as the profiler measures it for a transformer block;
    None: estimated from the model's transformer shape (:mod:`partitioner.recompute`).
    """

    name: str
    flops: float = 0.0
    param_bytes: float = 0.0
    saved_bytes: float = 0.0
    output_bytes: float = 0.0
    times: Mapping[str, LayerTime] = field(default_factory=dict)
    shared_saved_bytes: float = 0.0
    # times measured at other micro-batch sizes: size -> GPU type -> time (per micro-batch of that size)
    times_at: Mapping[int, Mapping[str, LayerTime]] = field(default_factory=dict)
    own_output_bytes: float | None = None
    # tensor-parallel degree t >= 2 -> what one GPU of a group of t holds and takes
    shards: Mapping[int, LayerShard] = field(default_factory=dict)
    # in the profile of one shard (Profile.shard): LayerShard.allreduce_bytes
    allreduce_bytes: float = 0.0
    # the model's last layer only: what the training loss on its output keeps per micro-batch,
    # and what the loss's backward holds on top while it runs (partitioner/loss_memory.py)
    loss_saved_bytes: float = 0.0
    loss_work_bytes: float = 0.0
    selective_saved_bytes: float | None = None

    def __post_init__(self) -> None:
        check(isinstance(self.name, str) and self.name != "", "name", self.name, "must be a non-empty string")
        if self.selective_saved_bytes is not None:
            v = self.selective_saved_bytes
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v
                  <= self.saved_bytes, "selective_saved_bytes", v,
                  f"must be a finite number >= 0 and not above saved_bytes ({self.saved_bytes:g})")
        for degree, sh in self.shards.items():
            check(isinstance(degree, int) and not isinstance(degree, bool) and 2 <= degree <= MAX_TENSOR_PARALLEL,
                  "tensor_parallel", degree, f"keys must be tensor-parallel degrees in [2, {MAX_TENSOR_PARALLEL}]")
            check(isinstance(sh, LayerShard), f"tensor_parallel.{degree}", sh, "must be a LayerShard")
        object.__setattr__(self, "shards", dict(sorted(self.shards.items())))
        if self.own_output_bytes is not None:
            v = self.own_output_bytes
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
                  "own_output_bytes", v, "must be a finite number >= 0")
        for name in ("flops", "param_bytes", "saved_bytes", "output_bytes", "shared_saved_bytes", "allreduce_bytes",
                     "loss_saved_bytes", "loss_work_bytes"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
                  name, v, "must be a finite number >= 0")
        check(self.shared_saved_bytes <= self.saved_bytes, "shared_saved_bytes", self.shared_saved_bytes,
              f"must not exceed saved_bytes ({self.saved_bytes:g})")
        for gpu, t in self.times.items():
            check(isinstance(t, LayerTime), f"times.{gpu}", t, "must be a LayerTime")
        object.__setattr__(self, "times", dict(self.times))
        for size, by_gpu in self.times_at.items():
            check(isinstance(size, int) and not isinstance(size, bool) and size >= 1, "times_at", size,
                  "keys must be micro-batch sizes >= 1")
            for gpu, t in by_gpu.items():
                check(isinstance(t, LayerTime), f"times_at.{size}.{gpu}", t, "must be a LayerTime")
        object.__setattr__(self, "times_at", {k: dict(v) for k, v in sorted(self.times_at.items())})

    @property
    def own_bytes(self) -> float:
        """The layer's own output (``own_output_bytes``, else ``output_bytes``)."""
        return self.output_bytes if self.own_output_bytes is None else self.own_output_bytes

    def scaled_bytes(self, f: float) -> dict[str, Any]:
        """The activation byte fields multiplied by ``f`` (for ``dataclasses.replace``)."""
        return {"saved_bytes": self.saved_bytes * f, "output_bytes": self.output_bytes * f,
                "shared_saved_bytes": self.shared_saved_bytes * f, "allreduce_bytes": self.allreduce_bytes * f,
                "own_output_bytes": None if self.own_output_bytes is None else self.own_output_bytes * f,
                "loss_saved_bytes": self.loss_saved_bytes * f, "loss_work_bytes": self.loss_work_bytes * f,
                "selective_saved_bytes": None if self.selective_saved_bytes is None else self.selective_saved_bytes * f}

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "flops": self.flops,
            "param_bytes": self.param_bytes,
            "saved_bytes": self.saved_bytes,
            "output_bytes": self.output_bytes,
            **({"own_output_bytes": self.own_output_bytes} if self.own_output_bytes is not None else {}),
            "times": {gpu: t.to_dict() for gpu, t in self.times.items()},
            **({"shared_saved_bytes": self.shared_saved_bytes} if self.shared_saved_bytes else {}),
            **({"times_at": {str(b): {g: t.to_dict() for g, t in v.items()} for b, v in self.times_at.items()}}
               if self.times_at else {}),
            **({"tensor_parallel": {str(t): sh.to_dict() for t, sh in self.shards.items()}} if self.shards else {}),
            **({"allreduce_bytes": self.allreduce_bytes} if self.allreduce_bytes else {}),
            **({"loss_saved_bytes": self.loss_saved_bytes, "loss_work_bytes": self.loss_work_bytes}
               if self.loss_saved_bytes or self.loss_work_bytes else {}),
            **({"selective_saved_bytes": self.selective_saved_bytes} if self.selective_saved_bytes is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "") -> LayerProfile:
        if not isinstance(d, Mapping):
            raise FormatError(where.rstrip("."), d, "must be an object")
        times = _times_of(opt_field(d, "times", Mapping, {}, where), f"{where}times.")
        times_at = _times_at_of(opt_field(d, "times_at", Mapping, {}, where), f"{where}times_at")
        shards_raw = opt_field(d, "tensor_parallel", Mapping, {}, where)
        shards: dict[int, LayerShard] = {}
        for t, raw in shards_raw.items():
            ok = str(t).isdigit() and len(str(t)) <= 3 and 2 <= int(t) <= MAX_TENSOR_PARALLEL
            check(ok, f"{where}tensor_parallel", t if len(str(t)) < 40 else f"{str(t)[:20]}...",
                  f"keys must be tensor-parallel degrees in [2, {MAX_TENSOR_PARALLEL}]")
            shards[int(t)] = LayerShard.from_dict(raw, f"{where}tensor_parallel.{t}.")
        try:
            return cls(
                name=req_field(d, "name", str, where),
                flops=req_number(d, "flops", where, default=0.0, maximum=MAX_FLOPS),
                param_bytes=req_number(d, "param_bytes", where, default=0.0, maximum=MAX_BYTES),
                saved_bytes=req_number(d, "saved_bytes", where, default=0.0, maximum=MAX_BYTES),
                output_bytes=req_number(d, "output_bytes", where, default=0.0, maximum=MAX_BYTES),
                times=times,
                shared_saved_bytes=req_number(d, "shared_saved_bytes", where, default=0.0, maximum=MAX_BYTES),
                times_at=times_at,
                own_output_bytes=(None if d.get("own_output_bytes") is None
                                  else req_number(d, "own_output_bytes", where, maximum=MAX_BYTES)),
                shards=shards,
                allreduce_bytes=req_number(d, "allreduce_bytes", where, default=0.0, maximum=MAX_BYTES),
                loss_saved_bytes=req_number(d, "loss_saved_bytes", where, default=0.0, maximum=MAX_BYTES),
                loss_work_bytes=req_number(d, "loss_work_bytes", where, default=0.0, maximum=MAX_BYTES),
                selective_saved_bytes=(None if d.get("selective_saved_bytes") is None
                                       else req_number(d, "selective_saved_bytes", where, maximum=MAX_BYTES)),
            )
        except FormatError as err:
            raise err if err.field.startswith(where) else err.under(where) from None


@dataclass(frozen=True)
class Profile:
    """A model as a chain of layers, measured at ``micro_batch_size`` samples per micro-batch."""

    model: str
    micro_batch_size: int
    layers: tuple[LayerProfile, ...]
    dtype: str = "float32"
    source: str = ""
    edges: tuple[tuple[int, int], ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "edges", tuple((int(a), int(b)) for a, b in self.edges))
        object.__setattr__(self, "meta", dict(self.meta))
        check(isinstance(self.model, str) and self.model != "", "model", self.model, "must be a non-empty string")
        check(isinstance(self.micro_batch_size, int) and not isinstance(self.micro_batch_size, bool)
              and self.micro_batch_size >= 1, "micro_batch_size", self.micro_batch_size, "must be an integer >= 1")
        check(len(self.layers) >= 1, "layers", [], "must list at least one layer")
        seen: dict[str, int] = {}
        for i, layer in enumerate(self.layers):
            check(isinstance(layer, LayerProfile), f"layers[{i}]", layer, "must be a LayerProfile")
            if layer.name in seen:
                raise FormatError(f"layers[{i}].name", layer.name,
                                  f"duplicates layers[{seen[layer.name]}].name; layer names must be unique")
            seen[layer.name] = i
            if i + 1 < len(self.layers) and (layer.loss_saved_bytes or layer.loss_work_bytes):
                raise FormatError(f"layers[{i}].loss_saved_bytes", layer.loss_saved_bytes or layer.loss_work_bytes,
                                  "the loss's memory belongs to the model's last layer (the one whose output "
                                  "the loss takes)")
        n = len(self.layers)
        order = self.meta.get("layer_order")
        if order is not None:
            ok = (isinstance(order, (list, tuple)) and all(isinstance(x, int) and not isinstance(x, bool) for x in order)
                  and sorted(order) == list(range(n)))
            check(ok, "meta.layer_order", order if not isinstance(order, list) or len(order) <= 12 else "[...]",
                  f"must list each of the {n} layer indices once (the original's layers in this order)")
        for k, (a, b) in enumerate(self.edges):
            check(0 <= a < n and 0 <= b < n and a != b, f"edges[{k}]", [a, b],
                  f"must name two different layer indices in [0, {n})")
            # the layers are in execution order, a topological order of the graph: an edge that
            # goes back would close a cycle
            check(a < b, f"edges[{k}]", [a, b], f"goes back from layer {a} ({self.layers[a].name}) to layer {b} "
                  f"({self.layers[b].name}); edges must follow the layer order (from < to), so the graph "
                  "is acyclic")

    # -- views -------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def gpu_types(self) -> tuple[str, ...]:
        """GPU types with a time for every layer, in first-seen order."""
        if not self.layers:
            return ()
        common = [g for g in self.layers[0].times if all(g in layer.times for layer in self.layers)]
        return tuple(common)

    @property
    def graph_edges(self) -> tuple[tuple[int, int], ...]:
        """The graph's edges: ``edges``, or the chain ``i -> i + 1`` when the profile has none."""
        return self.edges or tuple((i, i + 1) for i in range(self.num_layers - 1))

    @property
    def layer_order(self) -> tuple[int, ...] | None:
        """For a profile made by :meth:`reordered`: the layers of the original in this profile's
        order (``meta["layer_order"]``); None for a profile in its own order."""
        order = self.meta.get("layer_order")
        return None if order is None else tuple(order)

    def reordered(self, order: Sequence[int]) -> Profile:
        """The same graph with its layers in another topological ``order``.

        ``order[i]`` is the layer that comes ``i``-th. Every edge must still go forward, and the
        cut after each position is priced again with every tensor crossing it: the own output
        (``own_output_bytes``) of each layer at or before the cut that feeds a layer after it.
        Edges are renumbered; ``shared_saved_bytes`` is kept where a layer's predecessor in the
        list stays the same and dropped elsewhere (the tensor is then counted twice, never
        once too few); ``meta["layer_order"]`` records the order relative to the profile the
        first reordering started from (absent when that is the identity).
        """
        n = self.num_layers
        order = list(order)
        ok = (len(order) == n and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in order)
              and sorted(int(x) for x in order) == list(range(n)))
        shown = order if len(order) <= 12 else [*order[:12], "..."]
        check(ok, "layer_order", shown, f"must list each of the {n} layer indices 0..{n - 1} once")
        order = [int(x) for x in order]
        if order == list(range(n)):
            return self
        pos = [0] * n
        for i, v in enumerate(order):
            pos[v] = i
        for a, b in self.graph_edges:
            if pos[a] > pos[b]:
                raise FormatError("layer_order", shown, f"puts layer {b} ({self.layers[b].name}) before layer {a} "
                                  f"({self.layers[a].name}), which feeds it (edge [{a}, {b}]); the order must "
                                  "be topological")
        if self.edges:
            missing = [i for i, layer in enumerate(self.layers) if layer.own_output_bytes is None
                       and any(a == i for a, _ in self.edges)]
            if missing:
                raise FormatError(f"layers[{missing[0]}].own_output_bytes", None,
                                  "is needed to price the cuts of a graph profile in another order; import the "
                                  "graph again (partitioner import pipedream)")
        edges = tuple(sorted((pos[a], pos[b]) for a, b in self.edges))
        own = [self.layers[v].own_bytes for v in order]
        cuts = crossing_bytes(own, edges, n)
        layers = []
        for i, v in enumerate(order):
            layer = self.layers[v]
            same_before = i > 0 and order[i - 1] == v - 1
            layers.append(replace(layer, output_bytes=cuts[i] if i + 1 < n else own[i],
                                  shared_saved_bytes=layer.shared_saved_bytes if same_before else 0.0))
        base = self.layer_order or tuple(range(n))
        composed = [base[v] for v in order]
        meta = {k: v for k, v in self.meta.items() if k != "layer_order"}
        descriptions = meta.get("descriptions")
        if isinstance(descriptions, list) and len(descriptions) == n:
            meta["descriptions"] = [descriptions[v] for v in order]
        if composed != list(range(n)):
            meta["layer_order"] = composed
        return Profile(self.model, self.micro_batch_size, tuple(layers), self.dtype, self.source, edges, meta)

    @property
    def tensor_parallel_degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degrees every layer was profiled at (1: the layers themselves; a
        profile of one shard, ``meta.tensor_parallel``, describes only that shard: its layers)."""
        common = set(self.layers[0].shards)
        for layer in self.layers[1:]:
            common &= set(layer.shards)
        return (1, *sorted(common))

    def shard(self, tensor_parallel: int) -> Profile:
        """The profile of ONE GPU of a tensor-parallel group of ``tensor_parallel`` GPUs: every layer
        with its shard's bytes and times (``meta.tensor_parallel`` says the degree). Degree 1, or the
        profile's own degree, is the profile itself."""
        if tensor_parallel in (1, self.meta.get("tensor_parallel", 1)):
            return self
        return self._shards.get(tensor_parallel) or self._make_shard(tensor_parallel)

    @functools.cached_property
    def _shards(self) -> dict[int, Profile]:
        return {}

    def _make_shard(self, t: int) -> Profile:
        missing = [i for i, layer in enumerate(self.layers) if t not in layer.shards]
        if missing:
            i = missing[0]
            raise FormatError(f"layers[{i}].tensor_parallel", t, f"layer '{self.layers[i].name}' was not profiled at "
                              f"tensor-parallel degree {t} ({len(missing)} layer(s) lack it); degrees every layer "
                              f"has: {', '.join(map(str, self.tensor_parallel_degrees))}")
        layers = tuple(replace(layer, param_bytes=layer.shards[t].param_bytes, saved_bytes=layer.shards[t].saved_bytes,
                               shared_saved_bytes=layer.shards[t].shared_saved_bytes, times=layer.shards[t].times,
                               times_at=layer.shards[t].times_at, allreduce_bytes=layer.shards[t].allreduce_bytes,
                               shards={}, selective_saved_bytes=None) for layer in self.layers)
        out = Profile(self.model, self.micro_batch_size, layers, self.dtype, self.source, self.edges,
                      {**self.meta, "tensor_parallel": t})
        self._shards[t] = out
        return out

    def _with_shards_like(self, f: Callable[[Profile], Profile], made: Profile) -> Profile:
        """``made`` (``f`` of this profile) with every tensor-parallel degree's shards made by ``f``
        of that degree's :meth:`shard` too."""
        if self.tensor_parallel_degrees == (1,):
            return made
        per_t = {t: f(self.shard(t)) for t in self.tensor_parallel_degrees[1:]}
        layers = tuple(replace(layer, shards={t: LayerShard(p.layers[i].param_bytes, p.layers[i].saved_bytes,
                                                            p.layers[i].times, p.layers[i].shared_saved_bytes,
                                                            p.layers[i].times_at, p.layers[i].allreduce_bytes)
                                              for t, p in per_t.items()})
                       for i, layer in enumerate(made.layers))
        return replace(made, layers=layers)

    def is_projected(self, gpu_type: str) -> bool:
        """Whether any layer's time on ``gpu_type`` is projected rather than measured."""
        return any(layer.times[gpu_type].projected for layer in self.layers if gpu_type in layer.times)

    def array(self, name: str) -> np.ndarray:
        """One numeric layer field (``flops``, ``param_bytes``, ...) as a float64 array."""
        return np.array([getattr(layer, name) for layer in self.layers], dtype=np.float64)

    def update_times_for(self, gpu_type: str) -> np.ndarray:
        """Optimizer-step seconds per layer on ``gpu_type`` (0 where not timed)."""
        return np.array([layer.times[gpu_type].update_s if gpu_type in layer.times else 0.0
                         for layer in self.layers], dtype=np.float64)

    def times_for(self, gpu_type: str) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds per layer on ``gpu_type``; every layer must have it."""
        missing = [i for i, layer in enumerate(self.layers) if gpu_type not in layer.times]
        if missing:
            have = ", ".join(self.gpu_types) or "none"
            raise FormatError(f"layers[{missing[0]}].times", gpu_type,
                              f"profile '{self.model}' has no time for this GPU type on {len(missing)} "
                              f"layer(s); types timed on every layer: {have} (project or merge a profile)")
        fwd = np.array([layer.times[gpu_type].fwd_s for layer in self.layers], dtype=np.float64)
        bwd = np.array([layer.times[gpu_type].bwd_s for layer in self.layers], dtype=np.float64)
        return fwd, bwd

    def backward_split_for(self, gpu_type: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(input_s, weight_s, estimated)`` per layer on ``gpu_type``: the backward split into its
        input-gradient part (B of the zero-bubble schedules) and weight-gradient part (W), which add
        up to ``bwd_s``. A layer with ``bwd_weight_share`` is split by it; a layer without one is
        split by the estimate rule (``estimated`` True): no parameters, no W (``W = 0``);
        otherwise ``B = W = bwd_s / 2``, Qi et al.'s assumption for matmul-dominated layers (for
        ``y = x A`` the two backward GEMMs ``dx = dy A^T`` and ``dA = x^T dy`` each take the
        forward's FLOPs, so ``T_B = T_W = T_F``)."""
        _, bwd = self.times_for(gpu_type)
        share = np.array([layer.times[gpu_type].bwd_weight_share for layer in self.layers], dtype=object)
        estimated = np.array([s is None for s in share], dtype=bool)
        rule = np.where(self.array("param_bytes") > 0, 0.5, 0.0)
        frac = np.where(estimated, rule, np.where(estimated, 0.0, share).astype(np.float64))
        weight = bwd * frac
        return bwd - weight, weight, estimated

    def with_times(self, gpu_type: str, times: Sequence[LayerTime]) -> Profile:
        """A copy with ``times`` (one per layer) recorded under ``gpu_type``."""
        if len(times) != self.num_layers:
            raise FormatError("times", len(times), f"need one entry per layer ({self.num_layers})")
        layers = tuple(replace(layer, times={**layer.times, gpu_type: t}) for layer, t in zip(self.layers, times))
        return Profile(self.model, self.micro_batch_size, layers, self.dtype, self.source, self.edges, self.meta)

    @property
    def measured_sizes(self) -> tuple[int, ...]:
        """Micro-batch sizes with times on every layer: the profile's own and those of ``times_at``."""
        extra = set(self.layers[0].times_at)
        for layer in self.layers[1:]:
            extra &= set(layer.times_at)
        return tuple(sorted({self.micro_batch_size, *extra}))

    def at_size(self, micro_batch_size: int) -> Profile:
        """The profile at another micro-batch size.

        With times measured at several sizes (``times_at``) a measured size is used as is and a
        size between two measured ones is interpolated linearly between them, per layer and GPU
        type; a size outside the measured range is an error. With one measured size, this is
        :meth:`rescaled` (linear scaling). Byte counts and FLOPs scale with the size; parameters
        and optimizer-step times do not.
        """
        sizes = self.measured_sizes
        if micro_batch_size == self.micro_batch_size:
            return self
        if len(sizes) == 1:
            return self.rescaled(micro_batch_size)
        check(isinstance(micro_batch_size, int) and not isinstance(micro_batch_size, bool)
              and sizes[0] <= micro_batch_size <= sizes[-1], "micro_batch_size", micro_batch_size,
              f"must lie within the measured sizes {', '.join(map(str, sizes))}: times are interpolated "
              f"between measured sizes, never extrapolated")
        lo = max(x for x in sizes if x <= micro_batch_size)
        hi = min(x for x in sizes if x >= micro_batch_size)
        w = 0.0 if hi == lo else (micro_batch_size - lo) / (hi - lo)
        f = micro_batch_size / self.micro_batch_size

        def at(layer: LayerProfile, size: int) -> Mapping[str, LayerTime]:
            return layer.times if size == self.micro_batch_size else layer.times_at[size]

        layers = []
        for layer in self.layers:
            a, b = at(layer, lo), at(layer, hi)
            times = {g: replace(a[g], fwd_s=(1 - w) * a[g].fwd_s + w * b[g].fwd_s,
                                bwd_s=(1 - w) * a[g].bwd_s + w * b[g].bwd_s,
                                update_s=layer.times[g].update_s if g in layer.times else a[g].update_s)
                     for g in a if g in b}
            others = {**layer.times_at, self.micro_batch_size: layer.times}
            others.pop(micro_batch_size, None)
            layers.append(replace(layer, flops=layer.flops * f, **layer.scaled_bytes(f), times=times,
                                  times_at=others))
        how = "measured" if lo == hi else f"interpolated between {lo} and {hi}"
        made = Profile(self.model, micro_batch_size, tuple(layers), self.dtype, self.source, self.edges,
                       {**self.meta, "times_at_size": how})
        return self._with_shards_like(lambda p: p.at_size(micro_batch_size), made)

    def rescaled(self, micro_batch_size: int) -> Profile:
        """The profile at another micro-batch size, scaled linearly (an approximation).

        Per-layer times, FLOPs, saved activations and boundary tensors are multiplied by
        ``micro_batch_size / self.micro_batch_size``; parameter bytes do not change. Real GPUs
        are less efficient on small batches than this predicts, so prefer a profile measured
        at the size you plan for. ``meta["rescaled_from"]`` records the measured size.
        """
        check(isinstance(micro_batch_size, int) and not isinstance(micro_batch_size, bool)
              and micro_batch_size >= 1, "micro_batch_size", micro_batch_size, "must be an integer >= 1")
        if micro_batch_size == self.micro_batch_size:
            return self
        f = micro_batch_size / self.micro_batch_size
        layers = tuple(
            replace(layer, flops=layer.flops * f, **layer.scaled_bytes(f),
                    times={g: replace(t, fwd_s=t.fwd_s * f, bwd_s=t.bwd_s * f) for g, t in layer.times.items()})
            for layer in self.layers
        )
        meta = {**self.meta, "rescaled_from": self.meta.get("rescaled_from", self.micro_batch_size)}
        made = Profile(self.model, micro_batch_size, layers, self.dtype, self.source, self.edges, meta)
        return self._with_shards_like(lambda p: p.rescaled(micro_batch_size), made)

    # -- JSON ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "micro_batch_size": self.micro_batch_size,
            "dtype": self.dtype,
            "source": self.source,
            "layers": [layer.to_dict() for layer in self.layers],
        }
        if self.edges:
            d["edges"] = [list(e) for e in self.edges]
        if self.meta:
            d["meta"] = dict(self.meta)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Profile:
        fmt = opt_field(d, "format", str, PROFILE_FORMAT)
        if fmt != PROFILE_FORMAT:
            raise FormatError("format", fmt, f"expected '{PROFILE_FORMAT}'")
        layers_raw = req_field(d, "layers", list)
        check(len(layers_raw) <= MAX_LAYERS, "layers", f"{len(layers_raw)} layers", f"at most {MAX_LAYERS:,} are supported")
        layers = tuple(LayerProfile.from_dict(x, f"layers[{i}].") for i, x in enumerate(layers_raw))
        edges_raw = opt_field(d, "edges", list, [])
        check(len(edges_raw) <= 100 * len(layers_raw), "edges", f"{len(edges_raw)} edges",
              f"at most 100 per layer ({100 * len(layers_raw):,}) are supported")
        edges: list[tuple[int, int]] = []
        for k, e in enumerate(edges_raw):
            ok = isinstance(e, (list, tuple)) and len(e) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in e)
            check(ok, f"edges[{k}]", e, "must be a pair of layer indices [from, to]")
            edges.append((e[0], e[1]))
        return cls(
            model=req_field(d, "model", str),
            micro_batch_size=req_int(d, "micro_batch_size", minimum=1, maximum=MAX_MICRO_BATCH_SIZE),
            layers=layers,
            dtype=opt_field(d, "dtype", str, "float32"),
            source=opt_field(d, "source", str, ""),
            edges=tuple(edges),
            meta=opt_field(d, "meta", Mapping, {}),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile atomically as JSON."""
        write_loadable(path, self.to_dict(), Profile.from_dict, "profile")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Read and validate a profile file; errors name the file, field and value."""
        data = load_mapping(path)
        try:
            return cls.from_dict(data)
        except FormatError as err:
            raise err.in_file(str(path)) from None



def crossing_bytes(own_bytes: Sequence[float], edges: Sequence[tuple[int, int]], num_layers: int) -> list[float]:
    """Bytes crossing the cut after each position of a topologically ordered graph.

    ``out[t]`` is the sum of ``own_bytes[u]`` over the layers ``u <= t`` that feed a layer after
    ``t`` (each tensor once, however many consumers it has), for ``t`` in ``0..num_layers - 1``
    (``out[num_layers - 1]`` is 0: nothing comes after the last layer). Summed exactly
    (``math.fsum``) over the tensors alive at each cut.
    """
    last_use = list(range(num_layers))
    for a, b in edges:
        last_use[a] = max(last_use[a], b)
    starts: list[list[int]] = [[] for _ in range(num_layers)]
    for u in range(num_layers):
        if last_use[u] > u:
            starts[u].append(u)
    alive: set[int] = set()
    out = []
    for t in range(num_layers):
        alive.update(starts[t])
        alive = {u for u in alive if last_use[u] > t}
        out.append(math.fsum(own_bytes[u] for u in sorted(alive)))
    return out
