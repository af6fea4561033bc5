"""The cost model: the one place that prices a stage.

Every solver and the simulator call this module, so a plan is judged the same way
everywhere. Per micro-batch, a stage holding layers ``[i, j)`` on device ``d`` costs

* compute: ``sum_l fwd_l,t(d) + bwd_l,t(d)`` from the profile;
* transfers: the stage sends two messages per micro-batch, the boundary tensor after layer
  ``j-1`` (``output_bytes``) forward to the next stage's device and the gradient of its input
  (the tensor before layer ``i``) back to the previous stage's device, each priced on its link
  (:meth:`transfer_s`, message-size aware); where nodes share NICs (``Node.nic_gbps``) a
  message between nodes gets its share of each NIC it crosses (:meth:`link_s`; the plan's
  devices crossing one NIC at once divide it, as the simulator's flows do:
  :mod:`partitioner.flows`);
* combined either **additively** (``compute + activation out + gradient out``, the default:
  the sender waits for its sends) or, with ``CostOptions(overlap_comm=True)``, as
  ``max(compute, gradient out, activation out)``: each direction of a link carries one
  message per micro-batch while the stage computes.

This is exactly what the simulator charges (a send occupies its sender, or with overlap only
its link), so the closed form and the simulated steady state agree. The additive model is the
default because it is the conservative one: it matches a runtime whose sends block the sender
(gloo point-to-point does). Overlap is the better model for NCCL with asynchronous
point-to-point on separate streams.

Memory of a stage on its device, for ``n`` parameters (``param_bytes`` over the element size of
the profile's dtype) trained in ``CostOptions.precision``:
``n * (weight_versions * e + e gradient + master + 4 * optimizer_state_factor)
+ saved_bytes * activations_in_flight + reserved_bytes``, with ``e`` = 4 bytes (fp32) or 2
(fp16/bf16 mixed precision, which also keeps a 4-byte fp32 master copy), and a stage's saved
bytes counting a tensor kept by two adjacent layers of the stage once
(``LayerProfile.shared_saved_bytes``). ``reserved_bytes`` is the framework's own memory per GPU
(CUDA context, communication buffers, allocator slack). The stage that ends the model adds the
training loss: ``loss_saved_bytes * activations_in_flight + loss_work_bytes`` (the profile's
last layer; partitioner/loss_memory.py). Every stage adds the boundary tensors the pipeline
executor holds besides saved activations (:meth:`CostModel.boundary_held_bytes`, counted in
:mod:`partitioner.boundary`): where a next stage exists, ``2 * output`` under GPipe, 1F1B and the
one-chunk zero-bubble schedules (the gradient a backward takes and the next one's receive posted
ahead; a sent output is freed at the next compute), ``output * (activations_in_flight + 1)`` under
the others (an output kept until its gradient arrives, or that gradient, per micro-batch, and one
gradient posted ahead); the split schedules add ``output`` per micro-batch in flight (the
gradient an ``I`` leaves to its ``W``); and ``input`` where a previous stage exists (an activation
receive posted ahead).

Data-parallel gradient synchronisation: every set of devices that hold the same layers (virtual
workers, replicated stages) all-reduces those layers' gradients (``n * e`` bytes) once per
iteration, after their last backward, then each device runs its optimizer step
(``LayerTime.update_s``). The all-reduce is a ring inside a node and hierarchical across nodes
(reduce-scatter in each node, ring between nodes, all-gather), whichever is faster, priced on
the cluster's links (:mod:`partitioner.bandwidth`, message-size aware).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from .bandwidth import Bandwidth
from .boundary import boundary_held
from .cluster import GIB, Cluster, Device, gpu_family, resolve_gpu_type, split_kind
from .collectives import node_allreduce_s
from .errors import FormatError, PartitionerError
from .flows import collective_sharers, nic_sharers, shared_rate_gbps
from .pricing import PRECISIONS, RECOMPUTE_MODES, CostOptions
from .profile import Profile
from .recompute import recompute_extra_fwd_fraction, selective_bytes
from .schedule import Schedule, spec
from .tied import tied_parameters

if TYPE_CHECKING:
    from .plan import Plan, Stage

__all__ = [
    "PRECISIONS",
    "CostModel",
    "CostOptions",
    "SyncGroup",
    "ring_allreduce_s",
]

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float64": 8}


@dataclass(frozen=True)
class SyncGroup:
    """Layers ``[start, stop)`` held by ``devices`` (>= 2): their gradients are all-reduced; with
    ``nbytes`` >= 0, a tied tensor of that many bytes (on the wire) instead
    (:mod:`partitioner.tied`: ``start`` and ``stop - 1`` are the two layers that share it)."""

    start: int
    stop: int
    devices: tuple[str, ...]
    nbytes: float = -1.0


def ring_allreduce_s(nbytes: float, link_gbps: Sequence[float]) -> float:
    """Ring all-reduce of ``nbytes`` over ``n = len(link_gbps)`` members.

    ``link_gbps`` are the bandwidths of the ring's ``n`` hops (member ``i`` to ``i + 1``,
    the last back to the first). Each member sends and receives ``2 (n - 1) / n * nbytes``
    and the ring moves at the pace of its slowest hop. One member: no communication.
    """
    n = len(link_gbps)
    if n <= 1 or nbytes == 0:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / (min(link_gbps) * 1e9)


def hierarchical_allreduce_s(nbytes: float, per_node: Sequence[int], intra_s: Sequence[float],
                             inter_s: float) -> float:
    """Reduce-scatter inside each node, ring all-reduce between nodes, all-gather inside each node.

    ``per_node[i]`` holders on node ``i``; ``intra_s[i]`` is the seconds node ``i``'s links take
    for ``nbytes`` (one pass at the node's bandwidth), ``inter_s`` the same between nodes. The
    nodes' GPUs share their node's inter-node link, so the inter-node phase moves the whole
    buffer: ``2 (N - 1) / N`` passes. Each intra phase is ``(g - 1) / g`` passes.
    """
    n_nodes = len(per_node)
    intra = max(((g - 1) / g * t for g, t in zip(per_node, intra_s, strict=True)), default=0.0)
    inter = 2.0 * (n_nodes - 1) / n_nodes * inter_s if n_nodes > 1 else 0.0
    return 0.0 if nbytes == 0 else 2.0 * intra + inter


# -- the model ------------------------------------------------------------------------------

_M = TypeVar("_M", bound=Callable[..., Any])


def _by_kind(method: _M) -> _M:
    """A method keyed by a GPU type that also takes a device kind ``TYPE@tpT``
    (:attr:`partitioner.cluster.Device.kind`): the kind is priced by the model of one GPU of the
    group (:meth:`CostModel.at_degree`)."""
    @functools.wraps(method)
    def by_kind(self: CostModel, gpu_type: str, *args: Any) -> Any:
        base, t = split_kind(gpu_type)
        if t != 1:
            return getattr(self.at_degree(t), method.__name__)(base, *args)
        return method(self, gpu_type, *args)
    return cast(_M, by_kind)



@dataclass
class _FlowTerms:
    """A worker's per-stage terms of the flushing closed forms (:meth:`CostModel._flow_terms`)."""

    fwd: list[float]  # forward + activation send, one micro-batch
    bwd: list[float]  # backward + gradient send
    tf: list[float]  # forward steady time (send joined as the options say)
    tb: list[float]  # backward steady time
    rounds: list[float]  # compute and the round trip of the outgoing cut


class CostModel:
    """Prices stages of ``profile`` on the devices and links of ``cluster``.

    Scalar methods serve the simulator and plan checks; ``*_matrix`` methods give the same
    numbers for every ``(start, stop)`` pair at once, for the solvers.
    """

    def __init__(self, profile: Profile, cluster: Cluster, options: CostOptions | None = None,
                 nic_sharers: Mapping[tuple[str, int, str], int] | None = None, recompute: str = "none",
                 collective_sharers: Mapping[tuple[str, int, str], int] | None = None):
        if recompute not in RECOMPUTE_MODES:
            raise FormatError("recompute", recompute, f"must be one of {', '.join(RECOMPUTE_MODES)}")
        # What every stage this model prices recomputes (partitioner.recompute); a plan's stages
        # are priced by the view of their own mode (recomputing)
        self.recompute = recompute
        self.profile = profile
        self.cluster = cluster
        self.options = options or CostOptions()
        # Where nodes share NICs: how many of a plan's devices send (receive) across each NIC
        # direction at once (partitioner.flows.nic_sharers); None: no plan known, each message alone
        self.nic_sharers = nic_sharers
        # ... and how many of its all-reduce groups cross each (partitioner.flows.collective_sharers)
        self.collective_sharers = collective_sharers
        self.num_layers = profile.num_layers
        zero = np.zeros(1)
        dtype_bytes = _DTYPE_BYTES.get(profile.dtype, 4)
        # parameters (a count) of layers [0, i); gradient bytes in training precision
        self.param_count_prefix = np.concatenate([zero, np.cumsum(profile.array("param_bytes") / dtype_bytes)])
        # A profile of one shard of a t-way tensor-parallel group (Profile.meta["tensor_parallel"]) is
        # planned as one device of t GPUs: memory is per GPU, data-parallel traffic is t shards.
        self.shards = int(profile.meta.get("tensor_parallel", 1) or 1)
        self.param_prefix = self.param_count_prefix * (self.options.allreduce_element_bytes * self.shards)
        # Saved bytes of layers [i, j) are A[j] - B[i]: every layer's saved bytes, less what layer
        # l shares with layer l - 1 for the layers i < l < j (both in the stage).
        saved = np.concatenate([zero, np.cumsum(profile.array("saved_bytes"))])
        shared = np.concatenate([zero, np.cumsum(profile.array("shared_saved_bytes"))])
        self.saved_stop = saved - shared
        self.saved_start = saved - np.concatenate([shared[1:], shared[-1:]])
        if recompute == "selective":  # the attention cores' bytes are not kept
            dropped = np.concatenate([zero, np.cumsum(selective_bytes(profile))])
            self.saved_stop, self.saved_start = self.saved_stop - dropped, self.saved_start - dropped
        self.output_bytes = profile.array("output_bytes")
        # the training loss on the last stage: kept per micro-batch in flight, and held on top by its
        # backward while it runs (partitioner/loss_memory.py; 0 in profiles that do not measure it)
        self.loss_saved_bytes = float(profile.layers[-1].loss_saved_bytes)
        self.loss_work_bytes = float(profile.layers[-1].loss_work_bytes)
        # boundary_bytes[s]: tensor crossing a cut before layer s (0 at both ends of the chain)
        self.boundary = np.concatenate([zero, self.output_bytes[:-1], zero])

    def _like(self, *, profile: Profile | None = None, recompute: str | None = None,
              nic_sharers: Mapping[tuple[str, int, str], int] | None = None,
              collective_sharers: Mapping[tuple[str, int, str], int] | None = None) -> CostModel:
        """This model with some of its inputs changed (the sharers: these where given, else its own)."""
        return CostModel(profile or self.profile, self.cluster, self.options,
                         self.nic_sharers if nic_sharers is None else nic_sharers, recompute or self.recompute,
                         self.collective_sharers if collective_sharers is None else collective_sharers)

    def with_plan_sharers(self, plan: Plan, pipeline: bool = True) -> CostModel:
        """This model with ``plan``'s NIC sharers: its collective groups' (the all-reduces crossing
        each NIC, :func:`partitioner.flows.collective_sharers`) and, with ``pipeline``, its pipeline
        senders' (:func:`partitioner.flows.nic_sharers`; the simulator times those as flows)."""
        return self._like(nic_sharers=nic_sharers(plan, self.cluster) if pipeline else None,
                          collective_sharers=collective_sharers(self.sync_groups(plan), self.cluster))

    # -- tensor parallelism ----------------------------------------------------------------------

    def at_degree(self, tensor_parallel: int) -> CostModel:
        """The model of one GPU of a tensor-parallel group of ``tensor_parallel`` GPUs (the
        profile's shard at that degree, :meth:`partitioner.profile.Profile.shard`); itself at 1."""
        if tensor_parallel == 1:
            return self
        found = self._degrees.get(tensor_parallel)
        if found is None:
            found = self._degrees[tensor_parallel] = self._like(profile=self.profile.shard(tensor_parallel))
        return found

    def recomputing(self, mode: str) -> CostModel:
        """The model of stages that recompute ``mode`` (:data:`partitioner.pricing.RECOMPUTE_MODES`):
        their backward runs the recomputed forward again, their activations in flight are what the
        mode keeps (:mod:`partitioner.recompute`); itself for its own mode."""
        if mode == self.recompute:
            return self
        found = self._modes.get(mode)
        if found is None:
            found = self._modes[mode] = self._like(recompute=mode)
        return found

    @functools.cached_property
    def _modes(self) -> dict[str, CostModel]:
        return {}

    @functools.cached_property
    def _degrees(self) -> dict[int, CostModel]:
        return {}

    @functools.cache  # noqa: B019
    def shard_memory_ratio(self, kind: str) -> float:
        """``r``: any layers' memory on one GPU of a group of this kind's degree is at least ``r``
        times their memory on one GPU alone (the least ratio of any layer's shard to the layer, for
        weights and activations apart). So a group GPU of ``C`` bytes holds only layers whose memory
        alone is at most ``(C - reserved) / r``: the bounds' relaxation of a group's memory in the
        units of degree 1. 1 for a single GPU."""
        t = split_kind(kind)[1]
        if t == 1:
            return 1.0
        shard = self.at_degree(t)
        ratios = [1.0]
        for mine, theirs in ((np.diff(self.param_count_prefix), np.diff(shard.param_count_prefix)),
                             (self.profile.array("saved_bytes"), shard.profile.array("saved_bytes"))):
            held = mine > 0
            if held.any():
                ratios.append(float(np.min(theirs[held] / mine[held])))
        return max(min(ratios), 1e-12)

    # -- compute ---------------------------------------------------------------------------

    @functools.cached_property
    def _times_key(self) -> dict[str, str]:
        """Catalog name of each GPU type the profile was timed on -> the profile's key."""
        out: dict[str, str] = {}
        for key in self.profile.gpu_types:
            out.setdefault(key, key)
            with contextlib.suppress(FormatError):  # a type the catalog does not know keeps its own name
                out.setdefault(resolve_gpu_type(key, self.cluster.device_types).name, key)
        for key in self.profile.gpu_types:  # a family key (A100) serves the members no key names exactly
            for member in gpu_family(key):
                out.setdefault(member, key)
        return out

    @_by_kind
    def times_key(self, gpu_type: str) -> str:
        """The profile's key for the times of ``gpu_type`` (a one-line error when it has none)."""
        self._prefixes(gpu_type)
        return self._times_key[gpu_type]

    @_by_kind
    def has_times(self, gpu_type: str) -> bool:
        return gpu_type in self._times_key

    def require_times(self, devices: Sequence[Device]) -> None:
        """Raise unless the profile has times for every device's GPU type (checked before solving)."""
        for dev in devices:
            self._prefixes(dev.kind)

    @functools.cache  # noqa: B019 - one model per (profile, cluster), few types
    @_by_kind
    def _prefixes(self, gpu_type: str) -> tuple[np.ndarray, np.ndarray]:
        key = self._times_key.get(gpu_type)
        if key is None:
            have = ", ".join(self.profile.gpu_types) or "none"
            raise PartitionerError(
                f"profile '{self.profile.model}' has no times for GPU type {gpu_type} (it has: {have}); "
                f"measure it, merge a profile that has it, or project it from the catalog")
        fwd, bwd = self.profile.times_for(key)
        # the recomputed forward runs inside the backward (a full recompute re-runs its collectives too)
        extra = fwd * recompute_extra_fwd_fraction(self.profile, self.recompute) if self.recompute != "none" else 0.0
        if self.shards > 1:  # a shard's collectives its times leave out, on the group's node link
            comm = self.tensor_parallel_comm_s(gpu_type)
            fwd, bwd = fwd + comm, bwd + comm
            if self.recompute == "full":
                extra = extra + comm
        bwd = bwd + extra
        zero = np.zeros(1)
        return np.concatenate([zero, np.cumsum(fwd)]), np.concatenate([zero, np.cumsum(bwd)])

    def tensor_parallel_comm_s(self, gpu_type: str) -> np.ndarray:
        """Per layer, the seconds one direction's all-reduces of a tensor-parallel group of this
        model's degree take (``LayerProfile.allreduce_bytes`` of the shard: Megatron's two per
        transformer block, forward and backward alike, each of half the bytes), priced by
        :func:`partitioner.collectives.node_allreduce_s`: per all-reduce a fixed cost plus
        ``2 (t - 1)`` ring steps on the link the group really has (NVLink or PCIe, from the GPU's
        link facts; the node's stated bandwidth tells a bridged pair and caps a step), on the slowest
        node with ``t`` or more GPUs of ``gpu_type`` (a group never leaves its node). Zero where the
        times include them."""
        t = self.shards
        nbytes = self.profile.array("allreduce_bytes")
        if not nbytes.any():
            return np.zeros(self.num_layers)
        links = [self.cluster.link(f"{n.name}:0", f"{n.name}:1") for n in self.cluster.nodes
                 if sum(resolve_gpu_type(g, self.cluster.device_types).name == gpu_type for g in n.gpus) >= t]
        if not links:  # no node holds such a group: no plan can use one
            return np.where(nbytes > 0, np.inf, 0.0)
        return np.array([max(2 * node_allreduce_s(x / 2, t, gpu_type, link) for link in links) if x > 0 else 0.0
                         for x in nbytes])

    @functools.cache  # noqa: B019
    def _total_prefix(self, gpu_type: str) -> np.ndarray:
        f, b = self._prefixes(gpu_type)
        return np.concatenate([np.zeros(1), np.cumsum(np.diff(f) + np.diff(b))])

    @_by_kind
    def fwd_bwd_s(self, gpu_type: str, start: int, stop: int) -> tuple[float, float]:
        """Forward and backward seconds of layers ``[start, stop)`` on ``gpu_type``."""
        f, b = self._prefixes(gpu_type)
        return float(f[stop] - f[start]), float(b[stop] - b[start])

    @functools.cache  # noqa: B019
    def _split_prefix(self, gpu_type: str) -> tuple[np.ndarray, np.ndarray]:
        """Prefix sums of the backward's input-gradient and weight-gradient parts
        (:meth:`partitioner.profile.Profile.backward_split_for`): W as profiled, the input gradient the
        rest of the backward as :meth:`_prefixes` prices it, so the two add up to it (a recomputed
        forward and a tensor-parallel shard's collectives fall on the input gradient)."""
        _, b_w, _ = self.profile.backward_split_for(self.times_key(gpu_type))
        b_in = np.diff(self._prefixes(gpu_type)[1]) - b_w
        zero = np.zeros(1)
        return np.concatenate([zero, np.cumsum(b_in)]), np.concatenate([zero, np.cumsum(b_w)])

    @_by_kind
    def backward_split_s(self, gpu_type: str, start: int, stop: int) -> tuple[float, float]:
        """The backward of layers ``[start, stop)`` split for the zero-bubble schedules: input
        gradient (B, on the critical path) and weight gradient (W) seconds; they add up to the
        backward of :meth:`fwd_bwd_s`."""
        b_in, b_w = self._split_prefix(gpu_type)
        return float(b_in[stop] - b_in[start]), float(b_w[stop] - b_w[start])

    def weight_grad_bytes(self, start: int, stop: int, tensor_parallel: int = 1) -> float:
        """Activations of ``[start, stop)`` kept from a micro-batch's input-gradient pass to its
        weight-gradient pass (Qi et al.'s ``M_W``): the saved tensors of the layers with parameters
        (``dA = x^T dy`` needs their input), at most the stage's whole activations (``M_B``); per
        GPU of a group of ``tensor_parallel``."""
        if tensor_parallel != 1:
            return self.at_degree(tensor_parallel).weight_grad_bytes(start, stop)
        has = self._weight_grad_prefix
        return min(float(has[stop] - has[start]), self.activation_bytes(start, stop))

    @functools.cached_property
    def _weight_grad_prefix(self) -> np.ndarray:
        kept = self.profile.array("saved_bytes") * (self.profile.array("param_bytes") > 0)
        return np.concatenate([np.zeros(1), np.cumsum(kept)])

    @_by_kind
    def compute_s(self, gpu_type: str, start: int, stop: int) -> float:
        """Forward+backward seconds of layers ``[start, stop)`` (bit-equal to ``compute_matrix``)."""
        total = self._total_prefix(gpu_type)
        return float(total[stop] - total[start])

    @functools.cache  # noqa: B019
    @_by_kind
    def layer_compute_s(self, gpu_type: str) -> np.ndarray:
        """Forward+backward seconds of every layer on ``gpu_type`` (the differences of the prefix sums)."""
        return np.diff(self._total_prefix(gpu_type))

    @functools.cache  # noqa: B019
    @_by_kind
    def compute_matrix(self, gpu_type: str) -> np.ndarray:
        """``C[i, j]`` = forward+backward seconds of layers ``[i, j)`` (meaningful for i < j)."""
        total = self._total_prefix(gpu_type)
        return total[None, :] - total[:, None]

    @functools.cache  # noqa: B019
    @_by_kind
    def direction_matrices(self, gpu_type: str) -> tuple[np.ndarray, np.ndarray]:
        """``F[i, j]`` and ``B[i, j]``: forward and backward seconds of layers ``[i, j)`` apart
        (:meth:`fwd_bwd_s` for every range; meaningful for i < j)."""
        f, b = self._prefixes(gpu_type)
        return f[None, :] - f[:, None], b[None, :] - b[:, None]

    # -- transfers ---------------------------------------------------------------------------

    def transfer_s(self, nbytes: float, a: str | Device, b: str | Device) -> float:
        """Seconds to move ``nbytes`` one way between devices ``a`` and ``b``."""
        na = a if isinstance(a, str) else a.name
        nb = b if isinstance(b, str) else b.name
        return self.cluster.transfer_s(nbytes, na, nb)

    def boundary_bytes(self, cut: int) -> float:
        """Bytes of the tensor crossing a cut before layer ``cut`` (0 at the chain's ends)."""
        return float(self.boundary[cut])

    def boundary_s(self, cut: int, a: str | Device | None, b: str | Device | None) -> float:
        """One message across ``cut`` from ``a`` to ``b`` (an activation forward or a gradient back)."""
        if a is None or b is None:
            return 0.0
        return float(self.boundary_vector_s(a, b)[cut])

    def boundary_vector_s(self, a: str | Device | None, b: str | Device | None) -> np.ndarray:
        """``boundary_s(cut, a, b)`` for every cut 0..L, as one (read-only) array."""
        if a is None or b is None:
            return self._no_transfer
        return self._boundary_vector(a if isinstance(a, str) else a.name, b if isinstance(b, str) else b.name)

    @functools.cached_property
    def _no_transfer(self) -> np.ndarray:
        out = np.zeros(self.num_layers + 1)
        out.flags.writeable = False
        return out

    def link_s(self, nbytes: float, a: str, b: str, shared: bool = True) -> float:
        """One message of ``nbytes`` from device ``a`` to ``b`` on its link; where it crosses
        shared NICs, at the rate it gets there (:func:`partitioner.flows.shared_rate_gbps`: the
        NIC's bandwidth divided among the plan's devices that cross it at once when ``shared``
        and a plan is known, among its all-reduce groups that cross it for a collective's step,
        else the NIC's whole bandwidth at most). ``shared`` is a pipeline send (which pays the
        link's per-send overhead); False: a step of a collective."""
        route = self.cluster.nic_route(a, b) if self.cluster.has_nics else ()
        if a == b or nbytes <= 0:
            return 0.0
        link = self.cluster.link(a, b)
        if not route:
            return link.send_seconds(nbytes) if shared else link.seconds(nbytes)
        extra, alone = (link.send_overhead_s, link.send_gbps_at(nbytes)) if shared else (0.0, link.gbps_at(nbytes))
        load = (self.nic_sharers if shared else self.collective_sharers) or {}
        rate = shared_rate_gbps(alone, [r[3] for r in route], [max(1, load.get(r[:3], 1)) for r in route])
        return link.latency_s + extra + nbytes / (rate * 1e9)

    def _send_rates(self, link: Bandwidth, sizes: np.ndarray) -> np.ndarray:
        """``link.send_gbps_at`` of each of ``sizes`` (remembered per link and sizes: the planners
        ask for the same boundary sizes over many device pairs)."""
        key = (link, sizes.tobytes())
        found = self._rates_memo.get(key)
        if found is None:
            found = self._rates_memo[key] = np.array([link.send_gbps_at(float(x)) if x > 0 else 1.0 for x in sizes])
        return found

    @functools.cached_property
    def _rates_memo(self) -> dict[tuple[Bandwidth, bytes], np.ndarray]:
        return {}

    @functools.cache  # noqa: B019
    def _boundary_vector(self, a: str, b: str) -> np.ndarray:
        if a == b:
            return self._no_transfer
        out = self.messages_s(self.boundary, a, b)
        out.flags.writeable = False
        return out

    def messages_s(self, nbytes: np.ndarray, a: str, b: str) -> np.ndarray:
        """One pipeline send from ``a`` to ``b`` of each size in ``nbytes``, as a stage's
        boundary is priced (:meth:`boundary_s`; the same operations, so the same bits)."""
        if a == b:
            return np.zeros(len(nbytes))
        link = self.cluster.link(a, b)
        route = self.cluster.nic_route(a, b) if self.cluster.has_nics else ()
        if route:  # link_s's operations on every size at once: its rate alone, capped by each NIC's share
            sizes = np.asarray(nbytes, dtype=np.float64)
            rate = self._send_rates(link, sizes)
            load = self.nic_sharers if self.nic_sharers is not None else {}
            for node, nic, way, cap in route:
                if cap > 0:
                    rate = np.minimum(rate, cap / max(1, load.get((node, nic, way), 1)))
            return np.where(sizes > 0, link.latency_s + link.send_overhead_s + sizes / (rate * 1e9), 0.0)
        if link.is_flat:
            return np.asarray(nbytes, dtype=np.float64) / (link.gbps * 1e9)
        return np.array([link.send_seconds(float(x)) for x in nbytes])  # each message at its own size

    # -- stage time ----------------------------------------------------------------------------

    def combine(self, compute_s: float, back_s: float, out_s: float) -> float:
        """A stage's time per micro-batch from its compute, its gradient send back and its
        activation send forward."""
        if self.options.overlap_comm:
            return max(compute_s, back_s, out_s)
        return compute_s + back_s + out_s

    def stage_time_s(self, start: int, stop: int, device: str | Device,
                     prev: str | Device | None = None, nxt: str | Device | None = None) -> float:
        """Per-micro-batch time of layers ``[start, stop)`` on ``device`` between ``prev`` and ``nxt``."""
        dev = self.cluster.device(device) if isinstance(device, str) else device
        return self.combine(self.compute_s(dev.kind, start, stop),
                            self.boundary_s(start, dev, prev), self.boundary_s(stop, dev, nxt))

    def stage_time_matrix(self, device: Device, prev: Device | None, nxt: Device | None,
                          rows: slice = slice(None)) -> np.ndarray:
        """``stage_time_s(i, j, device, prev, nxt)`` for every ``i`` in ``rows`` and every ``j``."""
        comp = self.compute_matrix(device.kind)[rows]
        out_s = self.boundary_vector_s(device, nxt)
        back_s = self.boundary_vector_s(device, prev)[rows]
        if self.options.overlap_comm:
            return np.maximum(np.maximum(comp, back_s[:, None]), out_s[None, :])
        return (comp + back_s[:, None]) + out_s[None, :]

    def pipeline_stage_time_s(self, start: int, stop: int, device: str | Device, prev: str | Device | None,
                              nxt: str | Device | None, schedule: Schedule) -> float:
        """:meth:`stage_time_s` plus what the schedule adds per micro-batch (WSP's wave sync)."""
        t = self.stage_time_s(start, stop, device, prev, nxt)
        return t + self.wave_sync_s(start, stop, schedule.micro_batches) if schedule.wave_sync else t

    def pipeline_stage_time_matrix(self, device: Device, prev: Device | None, nxt: Device | None,
                                   schedule: Schedule, rows: slice = slice(None)) -> np.ndarray:
        """:meth:`pipeline_stage_time_s` for every ``i`` in ``rows`` and ``j`` (same operations)."""
        t = self.stage_time_matrix(device, prev, nxt, rows)
        return t + self.wave_sync_matrix(schedule.micro_batches, rows) if schedule.wave_sync else t

    # -- data parallelism inside a stage (replication) -------------------------------------------

    def allreduce_s(self, nbytes: float, devices: Sequence[str | Device]) -> float:
        """All-reduce of ``nbytes`` over ``devices``: the faster of a ring in the given order and
        the hierarchical algorithm (:func:`hierarchical_allreduce_s`), as NCCL picks one."""
        names = [d if isinstance(d, str) else d.name for d in devices]
        n = len(names)
        if n <= 1 or nbytes <= 0:
            return 0.0
        cl = self.cluster
        hops = list(zip(names, names[1:] + names[:1], strict=True))
        # ring: 2(n-1) steps of nbytes/n each, at the slowest hop's pace (each step pays its latency)
        ring = max(2.0 * (n - 1) * self.link_s(nbytes / n, a, b, shared=False) for a, b in hops)
        by_node: dict[str, list[str]] = {}
        for d in names:
            by_node.setdefault(cl.device(d).node, []).append(d)
        if len(by_node) == 1 or all(len(v) == 1 for v in by_node.values()):
            return ring
        intra = [cl.link(v[0], v[1]).seconds(nbytes) if len(v) > 1 else 0.0 for v in by_node.values()]
        heads = [v[0] for v in by_node.values()]
        inter = max(self.link_s(nbytes, a, b, shared=False) for a, b in zip(heads, heads[1:] + heads[:1], strict=True))
        hier = hierarchical_allreduce_s(nbytes, [len(v) for v in by_node.values()], intra, inter)
        return min(ring, hier)

    def param_bytes(self, start: int, stop: int, tensor_parallel: int = 1) -> float:
        """Gradient bytes of layers ``[start, stop)`` as data parallelism all-reduces them (the
        training precision, or ``CostOptions.allreduce_precision``); of all the shards of a group
        of ``tensor_parallel`` GPUs."""
        if tensor_parallel != 1:
            return self.at_degree(tensor_parallel).param_bytes(start, stop)
        return float(self.param_prefix[stop] - self.param_prefix[start])

    def sync_bytes(self, start: int, stop: int, devices: Sequence[str | Device]) -> float:
        """Bytes each replica all-reduces for layers ``[start, stop)`` over ``devices``: every shard
        of a tensor-parallel group (the GPUs of each group all-reduce their own shards side by
        side), the full gradients where the replicas' degrees differ."""
        degrees = {(self.cluster.device(d) if isinstance(d, str) else d).tensor_parallel for d in devices}
        return self.param_bytes(start, stop, degrees.pop() if len(degrees) == 1 else 1)

    @_by_kind
    def update_s(self, gpu_type: str, start: int, stop: int) -> float:
        """Optimizer step of layers ``[start, stop)`` on ``gpu_type`` (0 where the profile has none)."""
        return float(self.update_prefix(gpu_type)[stop] - self.update_prefix(gpu_type)[start])

    @functools.cache  # noqa: B019
    @_by_kind
    def update_prefix(self, gpu_type: str) -> np.ndarray:
        """Prefix sums of the optimizer step's seconds per layer on ``gpu_type``."""
        key = self._times_key.get(gpu_type, gpu_type)
        return np.concatenate([np.zeros(1), np.cumsum(self.profile.update_times_for(key))])

    # -- data-parallel synchronisation -----------------------------------------------------------

    def sync_groups(self, plan: Plan) -> tuple[SyncGroup, ...]:
        """The all-reduces of ``plan``: maximal layer ranges with one set of holders (>= 2 devices),
        ordered by first layer (every device runs its groups in this order, so no cycle forms).

        Under ``wsp`` there is none: WSP pushes and pulls instead (:meth:`wave_groups`).
        """
        self.check_order(plan)
        if spec(plan.schedule).sync != "allreduce" or not self.options.sync:
            return ()
        return self.holder_groups(plan) + self.tied_groups(plan)

    def tied_groups(self, plan: Plan) -> tuple[SyncGroup, ...]:
        """The all-reduces of tied tensors the profile declares (:mod:`partitioner.tied`), after the
        data-parallel ones: per virtual worker whose two layers of a tied tensor sit on different
        stages, the devices of those two stages."""
        out: list[SyncGroup] = []
        scale = self.options.allreduce_element_bytes * self.shards / _DTYPE_BYTES.get(self.profile.dtype, 4)
        for tie in tied_parameters(self.profile):
            a, b = tie.layers
            for vw in plan.virtual_workers:
                first = next(st for st in vw.stages if st.start <= a < st.stop)
                last = next(st for st in vw.stages if st.start <= b < st.stop)
                if first is not last:
                    devices = tuple(dict.fromkeys((*first.devices, *last.devices)))
                    out.append(SyncGroup(a, b + 1, devices, tie.param_bytes * scale))
        return tuple(out)

    def wave_groups(self, plan: Plan) -> tuple[SyncGroup, ...]:
        """WSP's asynchronous all-reduces: ``PUSH(c)`` starts one per holder set for wave ``c``
        (:meth:`holder_groups`, the sets ``runtime.layout.Layout.holder_sets`` makes); none for
        other schedules."""
        self.check_order(plan)
        return self.holder_groups(plan) if spec(plan.schedule).sync == "wave" else ()

    def holder_groups(self, plan: Plan) -> tuple[SyncGroup, ...]:
        """Maximal layer ranges with one set of holders (>= 2 devices, over every virtual worker
        and replica), ordered by first layer, whatever the schedule."""
        n = self.num_layers
        # the layers between two consecutive cuts of any stage have the same holders: one list per
        # such segment (a plan of many workers built from a few templates has few of them)
        cuts = sorted({0, n} | {min(x, n) for vw in plan.virtual_workers for st in vw.stages
                                for x in (st.start, st.stop)})
        index = {c: i for i, c in enumerate(cuts)}
        holders: list[list[str]] = [[] for _ in range(len(cuts) - 1)]
        for vw in plan.virtual_workers:
            for st in vw.stages:
                devices = st.devices
                for seg in range(index[min(st.start, n)], index[min(st.stop, n)]):
                    holders[seg].extend(devices)
        out: list[SyncGroup] = []
        first = 0  # the segment the current group starts at
        for seg in range(1, len(holders) + 1):
            if seg == len(holders) or holders[seg] != holders[first]:
                if len(holders[first]) > 1:
                    out.append(SyncGroup(cuts[first], cuts[seg], tuple(holders[first])))
                first = seg
        return tuple(out)

    def sync_s(self, group: SyncGroup) -> float:
        """All-reduce seconds of one :class:`SyncGroup`."""
        nbytes = group.nbytes if group.nbytes >= 0 else self.sync_bytes(group.start, group.stop, group.devices)
        return self.allreduce_s(nbytes, group.devices)

    def replicated_stage_time_s(self, start: int, stop: int, devices: Sequence[str | Device],
                                prev: str | Device | None, nxt: str | Device | None,
                                micro_batches: int, include_allreduce: bool = True) -> float:
        """Per-micro-batch time of layers ``[start, stop)`` replicated over ``devices``.

        Replicas share the micro-batches in proportion to their speed (each replica's own
        :meth:`stage_time_s`, with its transfers to ``prev`` and ``nxt``), so together they
        process one every ``1 / sum(1 / t_r)`` seconds; once per iteration the stage's
        gradients are all-reduced over the replicas, which adds ``allreduce_s / m`` per
        micro-batch. One device: exactly :meth:`stage_time_s`.
        """
        devs = [self.cluster.device(d) if isinstance(d, str) else d for d in devices]
        if len(devs) == 1:
            return self.stage_time_s(start, stop, devs[0], prev, nxt)
        rate = sum(1.0 / t if t > 0 else math.inf
                   for t in (self.stage_time_s(start, stop, d, prev, nxt) for d in devs))
        share = 0.0 if rate == math.inf else 1.0 / rate
        if not include_allreduce:
            return share
        return share + self.allreduce_s(self.sync_bytes(start, stop, devs), devs) / micro_batches

    # -- memory ----------------------------------------------------------------------------------

    def weight_factor(self, schedule: Schedule) -> float:
        """Bytes of weights + gradients + master copy + optimizer state per parameter."""
        return self.options.bytes_per_parameter(schedule.weight_versions)

    @property
    def least_memory_mode(self) -> str:
        """The recompute mode the options allow that keeps the fewest activations of one micro-batch
        in flight (full recomputation holds one micro-batch's during its backward, so not less
        than none): ``selective`` where allowed, else ``none``."""
        return "selective" if "selective" in self.options.recompute_modes else "none"

    def least_stage_bytes(self, start: int, stop: int, versions: int = 1, tensor_parallel: int = 1) -> float:
        """The least memory layers ``[start, stop)`` take on a device of any plan with the levers the
        options allow, with one micro-batch in flight and nothing reserved: weights with ZeRO's state
        divided over every GPU of the cluster, and one micro-batch's activations less what selective
        recomputation drops where it is allowed (full recomputation holds one micro-batch's
        activations during its backward). For bounds."""
        holders = self.cluster.num_gpus if self.options.zero else 1
        kept = self.recomputing(self.least_memory_mode)
        return self.weight_bytes(start, stop, versions, tensor_parallel, holders) + \
            kept.activation_bytes(start, stop, tensor_parallel)

    def least_memory_matrix(self, in_flight: int, schedule: Schedule, rows: slice = slice(None),
                            tensor_parallel: int = 1) -> np.ndarray:
        """The least :meth:`memory_matrix` any lever the options allow gives (every recompute mode
        of ``CostOptions.recompute``; ZeRO's state divided over every GPU of the cluster): what a
        bound may use, never above the memory of any plan a planner with levers makes."""
        holders = self.cluster.num_gpus if self.options.zero else 1
        return np.minimum.reduce([self.recomputing(mode).memory_matrix(in_flight, schedule, rows, tensor_parallel,
                                                                       holders)
                                  for mode in self.options.recompute_modes])

    def _memory_prefix(self, in_flight: int, schedule: Schedule, holders: int = 1) -> tuple[np.ndarray, np.ndarray]:
        return self._memory_prefix_of(in_flight, schedule.weight_versions, holders if self.options.zero else 1,
                                      schedule.name)

    @functools.cache  # noqa: B019
    def _memory_prefix_of(self, in_flight: int, weight_versions: int, holders: int, schedule: str
                          ) -> tuple[np.ndarray, np.ndarray]:
        """(at stop, at start): stage memory is ``q_stop[j] - q_start[i]`` + reserved. Under full
        recomputation a stage keeps its input per micro-batch in flight and, during one backward,
        its activations of that micro-batch: ``w + saved(i, j) + (n - 1) input(i)``. Either way plus
        :meth:`boundary_held_bytes` under ``schedule``: ``(n per + fixed) output(j) + input(i)``."""
        w = self.param_count_prefix * self.options.sharded_bytes_per_parameter(weight_versions, holders)
        if self.recompute == "full":
            q_stop, q_start = w + self.saved_stop, w + self.saved_start - self.boundary * max(in_flight - 1, 0)
        else:
            q_stop, q_start = w + self.saved_stop * in_flight, w + self.saved_start * in_flight
        # the stage that ends the model also holds the loss's tensors (outside any recomputation)
        q_stop[-1] += self.loss_saved_bytes * in_flight + self.loss_work_bytes
        # and what the executor holds besides (boundary_held_bytes; 0 at both ends of the chain)
        held = boundary_held(schedule)
        q_stop += self.boundary * (held.per_flight * in_flight + held.fixed_outputs)
        q_start -= self.boundary * held.fixed_inputs
        q_stop.flags.writeable = q_start.flags.writeable = False
        return q_stop, q_start

    def stage_memory_bytes(self, start: int, stop: int, in_flight: int, schedule: Schedule,
                           tensor_parallel: int = 1, holders: int = 1) -> float:
        """Peak memory of layers ``[start, stop)`` holding ``in_flight`` micro-batches' activations
        (on each GPU of a group of ``tensor_parallel``; one of ``holders`` data-parallel holders of
        these layers, which share their optimizer state under ``CostOptions.zero``)."""
        if tensor_parallel != 1:
            return self.at_degree(tensor_parallel).stage_memory_bytes(start, stop, in_flight, schedule, 1, holders)
        q_stop, q_start = self._memory_prefix(in_flight, schedule, holders)
        return float((q_stop[stop] - q_start[start]) + self.options.reserved_bytes)

    def max_stop(self, in_flight: int, schedule: Schedule, capacity_bytes: float,
                 rows: slice = slice(None), tensor_parallel: int = 1, holders: int = 1) -> np.ndarray:
        """For each start ``i`` in ``rows``, the largest ``stop`` with
        ``stage_memory_bytes(i, stop) <= capacity_bytes`` (``i`` itself when not even one layer fits).

        Stage memory grows with ``stop`` but for the boundary the stage holds
        (:meth:`boundary_held_bytes`), so a stop below the answer need not fit: the answer bounds the
        fitting stops (the solvers check each stage exactly, :meth:`memory_matrix`). A sorted search
        per row of the prefix's suffix minimum, and an exact check of the answer with the scalar
        formula settles any rounding, so it agrees with :meth:`stage_memory_bytes` to the bit.
        ``O(L log L)`` instead of an ``L x L`` matrix.
        """
        if tensor_parallel != 1:
            return self.at_degree(tensor_parallel).max_stop(in_flight, schedule, capacity_bytes, rows, 1, holders)
        q_stop, q_start = self._memory_prefix(in_flight, schedule, holders)
        reserved = self.options.reserved_bytes
        starts = np.arange(self.num_layers + 1)[rows]
        # the output a stage keeps (boundary_held_bytes) makes q_stop rise and fall: the largest stop
        # under a bound is the last place the suffix minimum (non-decreasing) is under it
        least_after = np.minimum.accumulate(q_stop[::-1])[::-1]
        top = np.searchsorted(least_after, capacity_bytes - reserved + q_start[starts], side="right") - 1
        top = np.clip(top, starts, self.num_layers)

        def fits(j: np.ndarray) -> np.ndarray:
            return (q_stop[j] - q_start[starts]) + reserved <= capacity_bytes

        for _ in range(3):  # rounding can only move the boundary by a step or two
            down = (top > starts) & ~fits(top)
            top = np.where(down, top - 1, top)
            nxt = np.minimum(top + 1, self.num_layers)
            up = (nxt > top) & fits(nxt)
            top = np.where(up, nxt, top)
        return top

    def activation_bytes(self, start: int, stop: int, tensor_parallel: int = 1) -> float:
        """Bytes of activations layers ``[start, stop)`` keep for backward, per micro-batch in
        flight (per GPU of a group of ``tensor_parallel``): under full recomputation the stage's
        input only (:meth:`recompute_peak_bytes` is what one backward adds)."""
        if tensor_parallel != 1:
            return self.at_degree(tensor_parallel).activation_bytes(start, stop)
        loss = self.loss_saved_bytes if stop == self.num_layers else 0.0
        if self.recompute == "full":
            return float(self.boundary[start]) + loss
        return float(self.saved_stop[stop] - self.saved_start[start]) + loss

    def recompute_peak_bytes(self, start: int, stop: int, tensor_parallel: int = 1) -> float:
        """Bytes a backward of layers ``[start, stop)`` holds beyond :meth:`activation_bytes` while
        it runs: under full recomputation the recomputed activations of its micro-batch less the
        input kept; 0 otherwise."""
        if tensor_parallel != 1:
            return self.at_degree(tensor_parallel).recompute_peak_bytes(start, stop)
        loss = self.loss_work_bytes if stop == self.num_layers else 0.0
        if self.recompute != "full":
            return loss
        return float(self.saved_stop[stop] - self.saved_start[start]) - float(self.boundary[start]) + loss

    def boundary_held_bytes(self, start: int, stop: int, tensor_parallel: int = 1,
                            schedule: str = "1f1b") -> tuple[float, float]:
        """``(per micro-batch in flight, fixed)``: the boundary tensors the pipeline executor
        (:mod:`runtime.executor`) holds for layers ``[start, stop)`` under ``schedule`` besides their
        saved activations, as the closed form prices them (:func:`partitioner.boundary.boundary_held`,
        whose docstring derives the counts from the executor).

        Under GPipe and 1F1B, where a next stage exists: no output per micro-batch in flight (the
        executor waits an output's sends at its next compute and frees it), and, fixed, the gradient
        its backward takes and the next gradient's receive posted ahead: ``(0, 2 output(stop))``; the
        one-chunk zero-bubble schedules add an output per micro-batch (the gradient an ``I`` leaves to
        its ``W``). Under the multi-chunk and no-flush schedules an output is held until its
        gradient arrives, then the gradient until the backward: ``(output(stop), output(stop))``.
        Fixed, where a previous stage exists: the activation receive posted ahead, at most one per
        peer beyond what the schedule holds: ``input(start)``. 0 at both ends of the chain, so a
        one-stage plan holds none."""
        if tensor_parallel != 1:
            return self.at_degree(tensor_parallel).boundary_held_bytes(start, stop, schedule=schedule)
        held = boundary_held(schedule)
        out = float(self.boundary[stop])
        return held.per_flight * out, held.fixed_outputs * out + held.fixed_inputs * float(self.boundary[start])

    def weight_bytes(self, start: int, stop: int, versions: int = 1, tensor_parallel: int = 1,
                     holders: int = 1) -> float:
        """Weights (``versions`` copies), gradients, master copy and optimizer state of ``[start, stop)``
        (per GPU of a group of ``tensor_parallel``; on one of ``holders`` holders under ZeRO)."""
        if tensor_parallel != 1:
            return self.at_degree(tensor_parallel).weight_bytes(start, stop, versions, 1, holders)
        params = float(self.param_count_prefix[stop] - self.param_count_prefix[start])
        return params * self.options.sharded_bytes_per_parameter(versions, holders if self.options.zero else 1)

    def parameter_sync_s(self, start: int, stop: int) -> float:
        """Seconds to push (or pull) the parameters of layers ``[start, stop)`` to (from) a
        parameter server across the inter-node network (WSP)."""
        inter = self.cluster.inter_curve
        if inter is not None:
            return inter.seconds(self.param_bytes(start, stop))
        return float(self._sync_prefix[stop] - self._sync_prefix[start])

    def wave_sync_s(self, start: int, stop: int, micro_batches: int) -> float:
        """WSP's charge per micro-batch for layers ``[start, stop)`` where the plan is not known
        (the solvers' stage times: :meth:`pipeline_stage_time_s` and its matrix).

        ``PUSH(c)`` starts an all-reduce of the wave's update over the holders of the same layers
        in the other virtual workers and ``PULL(c - D)`` waits for the one of wave ``c - D``
        (:meth:`wave_stage_s` prices that for a known plan). Without the plan neither the holders
        nor ``D`` are known, so this charges the most conservative case: ``D = 0`` (the whole
        all-reduce blocks, once per wave of ``m`` micro-batches) and a ring over any number of
        holders across the inter-node network, whose bandwidth term is below ``2 x`` the bytes
        over the inter-node bandwidth: ``2 * parameter_sync_s / m``.
        """
        return 2.0 * self.parameter_sync_s(start, stop) / micro_batches

    @staticmethod
    def wave_stage_s(stage_s: float, allreduce_s: float, micro_batches: int, staleness: int) -> float:
        """Steady-state time per micro-batch of a WSP rank whose stage takes ``stage_s`` per
        micro-batch and whose holder sets' all-reduce takes ``allreduce_s`` per wave.

        ``PUSH(c)`` starts the all-reduce as the wave's last backward ends (the all-reduces of
        successive waves run side by side); ``PULL(c - D)``, right after ``PUSH(c)``, waits for
        the one started ``D`` pushes earlier. With a period ``P`` per wave and ``C = m stage_s``
        of compute, that one started ``D P`` before, so the rank waits ``max(0, A - D P)`` and
        ``P = C + max(0, A - D P)``: ``P = max(C, (C + A) / (D + 1))``. With ``D = 0`` that is
        ``C + A``, the whole all-reduce every wave; with ``D >= 1`` the all-reduce is hidden while
        ``A <= D C``. (Where the all-reduce binds, waits alternate over ``D + 1`` waves: ``P``
        is their mean.)
        """
        return max(stage_s, (stage_s + allreduce_s / micro_batches) / (staleness + 1))

    def wave_allreduce_s(self, plan: Plan) -> dict[str, float]:
        """Per device of a WSP plan: the all-reduce time per wave of its holder sets
        (:meth:`wave_groups`, started together at ``PUSH``, so the longest counts); 0 where the
        device holds no layer with another holder (one virtual worker)."""
        out = {d: 0.0 for vw in plan.virtual_workers for st in vw.stages for d in st.devices}
        for g in self.wave_groups(plan):
            t = self.sync_s(g)
            for d in g.devices:
                out[d] = max(out[d], t)
        return out

    def wave_sync_matrix(self, micro_batches: int, rows: slice = slice(None)) -> np.ndarray:
        """``wave_sync_s(i, j, m)`` for every ``i`` in ``rows`` and every ``j`` (same operations)."""
        inter = self.cluster.inter_curve
        if inter is not None:
            q = self.param_prefix
            nbytes = q[None, :] - q[rows, None]
            secs = np.vectorize(lambda x: inter.seconds(float(x)) if x > 0 else 0.0, otypes=[float])(nbytes)
            return 2.0 * secs / micro_batches
        q = self._sync_prefix
        return 2.0 * (q[None, :] - q[rows, None]) / micro_batches

    @functools.cached_property
    def _sync_prefix(self) -> np.ndarray:
        """Cumulative seconds to move the parameters one way over the inter-node network."""
        return self.param_prefix / (self.cluster.inter_gbps * 1e9)

    def memory_matrix(self, in_flight: int, schedule: Schedule, rows: slice = slice(None),
                      tensor_parallel: int = 1, holders: int = 1) -> np.ndarray:
        """``stage_memory_bytes(i, j, in_flight, schedule)`` for every ``i`` in ``rows`` and every ``j``.

        Computed with the same operations as the scalar method, so both agree to the bit and a
        plan the solvers accept is never refused by :meth:`check_plan_memory`.
        """
        if tensor_parallel != 1:
            return self.at_degree(tensor_parallel).memory_matrix(in_flight, schedule, rows, 1, holders)
        q_stop, q_start = self._memory_prefix(in_flight, schedule, holders)
        return (q_stop[None, :] - q_start[rows, None]) + self.options.reserved_bytes

    # -- plans -----------------------------------------------------------------------------------

    def check_order(self, plan: Plan) -> None:
        """Refuse a plan whose stages count layers in another order than this model's profile
        (a plan with ``layer_order`` is priced with ``plan.profile_view(profile)``)."""
        if plan.layer_order != self.profile.layer_order:
            shown = None if plan.layer_order is None else f"{len(plan.layer_order)} entries"
            raise FormatError("layer_order", shown, "the plan counts layers in another order than the profile "
                              "this cost model prices; price it with plan.profile_view(profile)")

    def plan_stage_times_s(self, plan: Plan, worker: int = 0, allreduce_apart: bool = False) -> list[float]:
        """Per-micro-batch time of each stage of virtual worker ``worker``. A replicated stage
        includes its all-reduce spread over the micro-batches unless ``allreduce_apart`` (when the
        caller prices the all-reduce after the pipeline, as :meth:`plan_iteration_s` does).
        Under ``wsp`` each stage carries the solvers' conservative charge (:meth:`wave_sync_s`),
        so these are the times the solvers optimise; :meth:`worker_iteration_s` prices the
        plan's own push and pull."""
        self.check_order(plan)
        stages = plan.virtual_workers[worker].stages
        out = []
        for k, st in enumerate(stages):
            prev = stages[k - 1].device if k > 0 else None
            nxt = stages[k + 1].device if k + 1 < len(stages) else None
            cs = self.recomputing(st.recompute)
            if st.replicas:
                t = cs.replicated_stage_time_s(st.start, st.stop, st.devices, prev, nxt, plan.micro_batches,
                                               include_allreduce=not allreduce_apart)
                if spec(plan.schedule).sync == "wave":
                    t += cs.wave_sync_s(st.start, st.stop, plan.micro_batches)
            else:
                t = cs.pipeline_stage_time_s(st.start, st.stop, st.device, prev, nxt, plan.pipeline_schedule)
            out.append(t)
        return out

    def _wave_stage_times_s(self, plan: Plan, worker: int) -> list[float]:
        """Per-micro-batch time of each stage of a WSP worker with the plan's own holder sets and
        staleness (:meth:`wave_stage_s`); a replicated stage's blocking all-reduce over its
        replicas (the first thing its ``PUSH`` does) is spread over the micro-batches."""
        self.check_order(plan)
        stages = plan.virtual_workers[worker].stages
        ar = self.wave_allreduce_s(plan)
        out = []
        for k, st in enumerate(stages):
            prev = stages[k - 1].device if k > 0 else None
            nxt = stages[k + 1].device if k + 1 < len(stages) else None
            cs = self.recomputing(st.recompute)
            base = (cs.replicated_stage_time_s(st.start, st.stop, st.devices, prev, nxt, plan.micro_batches)
                    if st.replicas else cs.stage_time_s(st.start, st.stop, st.device, prev, nxt))
            out.append(self.wave_stage_s(base, max(ar[d] for d in st.devices), plan.micro_batches, plan.staleness))
        return out

    def worker_iteration_s(self, plan: Plan, worker: int = 0, holders_known: bool = True) -> float:
        """Closed-form time of one iteration of virtual worker ``worker``'s pipeline, before any
        all-reduce: with ``f, b`` a stage's forward and backward compute, ``a`` its activation
        send and ``g`` its gradient send (one micro-batch each), and ``t`` its steady-state time
        per micro-batch (:meth:`plan_stage_times_s`),

        * 1F1B (and the interleaved / breadth-first approximations): the first micro-batch crosses
          every stage and link forward and back, the others follow at the bottleneck's pace:
          ``sum(f + a + b + g) + (m - 1) max(t)``;
        * GPipe: a forward flow shop, then a backward one: ``sum(f + a) + (m - 1) max(t_f) +
          sum(b + g) + (m - 1) max(t_b)`` with ``t_f = f + a`` (``max(f, a)`` with overlap);
        * ZB-H1 / ZB-H2: the 1F1B form less ``(p - 1) min(k w, b_i + w)`` (``k`` 2 / 3, ``b_i`` and
          ``w`` the two parts of the bottleneck stage's backward): exact on equal stages without
          transfers (:meth:`partitioner.schedule.Schedule.uniform_bubble_s`); the simulator decides
          elsewhere (``schedule="auto"`` ranks candidates by it); with overlapping iterations
          (``CostOptions.overlap_iterations``) less ``(p - 1)(f + b_i + w - u)`` instead, ``u`` the
          steady state's idle per rank of :meth:`~partitioner.schedule.Schedule.overlapped_bubble_s`
          (exact on equal stages without transfers; ZB-H1 ``m >= p``, ZB-H2 ``m >= 2p - 1``);
        * 2BW (no flush): ``m max(t)``;
        * WSP: ``m max(t')`` with ``t'`` each stage's time with the plan's own push and pull
          (:meth:`wave_stage_s`: the holder sets' all-reduce and the staleness ``D``), not the
          solvers' conservative charge in :meth:`plan_stage_times_s`; ``holders_known`` False
          (a worker planned alone, to be one of several) keeps that conservative charge.

        A replicated stage's replicas each run whole micro-batches: the first crosses it on its
        fastest replica (the fill), and what it adds after that is its busiest replica's share
        (:meth:`_replica_extra_s`; the steady term is the most any stage adds), exact for a stage
        replicated alone; its steady time per micro-batch is its replicas' combined pace.
        """
        vw = plan.virtual_workers[worker]
        m = plan.micro_batches
        if spec(plan.schedule).sync == "wave" and holders_known:
            return m * max(self._wave_stage_times_s(plan, worker))
        times = self.plan_stage_times_s(plan, worker, allreduce_apart=True)
        if not spec(plan.schedule).flushes:
            return m * max(times)
        fl = self._flow_terms(plan, worker, times)
        fill_f, fill_b, tf, tb, rounds = sum(fl.fwd), sum(fl.bwd), fl.tf, fl.tb, fl.rounds

        extra = self._replica_extra_s(plan, worker, times)

        def steady(paces: Sequence[float]) -> float:
            """What the micro-batches after the first add: the most any stage adds past its first
            micro-batch (``extra``), in the part ``paces`` takes of its time."""
            return max(e * (t / full if full > 0 else 1.0) for e, t, full in zip(extra, paces, times, strict=True))

        if spec(plan.schedule).all_forwards_first:
            return fill_f + steady(tf) + fill_b + steady(tb)
        # 1F1B keeps at most p - k micro-batches past stage k: each of them spends at least the
        # round trip R_k (stages k.. forward and back, with their transfers) there, so by Little's
        # law the pace is at least R_k / (p - k); with overlapped transfers this can bind.
        p = len(vw.stages)
        pace, trip = max(times), 0.0
        for k in range(p - 1, -1, -1):
            trip += rounds[k]
            pace = max(pace, trip / (p - k))
        saving = 0.0
        if spec(plan.schedule).split_backward and not spec(plan.schedule).multi_chunk:  # the W fill the bubble (one-chunk ZB-H1 / ZB-H2)
            k = times.index(max(times))
            st = vw.stages[k]
            b_in, w = self.recomputing(st.recompute).backward_split_s(self.cluster.device(st.device).gpu_type,
                                                                      st.start, st.stop)
            saving = (p - 1) * min(spec(plan.schedule).weight_fill * w, b_in + w)
            if self.overlaps(plan):  # the steady state's idle in place of the flushing one
                f = self.recomputing(st.recompute).fwd_bwd_s(self.cluster.device(st.device).gpu_type,
                                                             st.start, st.stop)[0]
                idle = Schedule(spec(plan.schedule), m, True).overlapped_bubble_s(p, f, b_in, w)
                if idle is not None:  # (None: fewer micro-batches than its closed form needs)
                    saving = (p - 1) * (f + b_in + w) - idle
        return fill_f + fill_b + max(steady(times), (m - 1) * pace if pace > max(times) else 0.0) - saving

    def _replica_extra_s(self, plan: Plan, worker: int, times: Sequence[float]) -> list[float]:
        """Per stage, what it adds after its first micro-batch: ``(m - 1) t`` on one device; for a
        replicated stage, whose replicas each run whole micro-batches (as many as
        :func:`partitioner.placement.replica_shares` gives each, by speed, as the simulator does),
        the busiest replica's ``n_i t_i`` less the first micro-batch on the fastest replica (the
        one the fill counts). Equal replicas: ``(m - r) t / r``; one device: ``(m - 1) t``."""
        from .placement import replica_shares

        vw, m = plan.virtual_workers[worker], plan.micro_batches
        out = []
        for k, st in enumerate(vw.stages):
            if not st.replicas:
                out.append((m - 1) * times[k])
                continue
            prev = vw.stages[k - 1].device if k > 0 else None
            nxt = vw.stages[k + 1].device if k + 1 < len(vw.stages) else None
            cs = self.recomputing(st.recompute)
            kinds = [self.cluster.device(d).kind for d in st.devices]
            counts = np.bincount(replica_shares([cs.compute_s(t, st.start, st.stop) for t in kinds], m),
                                 minlength=len(kinds))
            each = [cs.stage_time_s(st.start, st.stop, d, prev, nxt) for d in st.devices]
            best = min(range(len(kinds)), key=lambda i: cs.compute_s(kinds[i], st.start, st.stop))
            out.append(max(n * t for n, t in zip(counts, each, strict=True)) - each[best])
        return out

    def _flow_terms(self, plan: Plan, worker: int, times: Sequence[float]) -> _FlowTerms:
        """Per stage of a worker (one micro-batch): forward + activation send and backward +
        gradient send (their fills: a replicated stage's on its fastest replica, which runs the
        micro-batch whole), the forward and backward steady times (joined as the options say),
        and the round trip of the outgoing cut; the last three of a replicated stage at its
        replicas' pace (``times``: :meth:`plan_stage_times_s`)."""
        vw = plan.virtual_workers[worker]
        out = _FlowTerms([], [], [], [], [])
        join = max if self.options.overlap_comm else (lambda x, y: x + y)
        for k, st in enumerate(vw.stages):
            prev = vw.stages[k - 1].device if k > 0 else None
            nxt = vw.stages[k + 1].device if k + 1 < len(vw.stages) else None
            cs = self.recomputing(st.recompute)
            best = min(st.devices, key=lambda d: cs.compute_s(self.cluster.device(d).kind, st.start, st.stop))
            f, b = cs.fwd_bwd_s(self.cluster.device(best).kind, st.start, st.stop)
            a = self.boundary_s(st.stop, best, nxt)
            g = self.boundary_s(st.start, best, prev)
            share = times[k] / cs.stage_time_s(st.start, st.stop, best, prev, nxt) if st.replicas else 1.0
            out.fwd.append(f + a)  # one micro-batch crosses a replicated stage on one replica
            out.bwd.append(b + g)
            out.rounds.append((f + b) * share + (a + self.boundary_s(st.stop, nxt, best) if nxt is not None else 0.0))
            out.tf.append(join(f, a) * share)
            out.tb.append(join(b, g) * share)
        return out

    def _gpipe_stage_done_s(self, plan: Plan, worker: int) -> list[float]:
        """When each stage of a GPipe worker ends its last backward (its last gradient send
        included): the backward flow shop from the last stage down reaches stage ``k`` with its
        last micro-batch at ``sum_{j >= k} (b + g)_j + (m - 1) max_{j >= k} t_b`` after the
        forward one ends (identical jobs in a flow shop: the slowest machine so far paces them)."""
        m = plan.micro_batches
        fl = self._flow_terms(plan, worker, self.plan_stage_times_s(plan, worker, allreduce_apart=True))
        start = sum(fl.fwd) + (m - 1) * max(fl.tf)
        out, fill, pace = [0.0] * len(fl.bwd), 0.0, 0.0
        for k in range(len(fl.bwd) - 1, -1, -1):
            fill += fl.bwd[k]
            pace = max(pace, fl.tb[k])
            out[k] = start + fill + (m - 1) * pace
        return out

    def overlaps(self, plan: Plan) -> bool:
        """Whether ``plan``'s iterations overlap as priced here: a flushing schedule under these
        options' ``overlap_iterations`` or the plan's own (``Plan.overlaps_iterations``: the runtime
        runs a plan as its pricing says)."""
        return spec(plan.schedule).flushes and (self.options.overlap_iterations or plan.overlaps_iterations)

    def plan_iteration_s(self, plan: Plan) -> float:
        """Closed-form iteration time of ``plan``: each pipeline's fill, steady state and drain
        (:meth:`worker_iteration_s`), then the gradient all-reduces and the optimizer step.

        Under a flushing schedule stage ``k`` finishes its last backward earlier than stage 0 by
        the backward work and gradient transfers of stages ``0..k-1``; without overlapped
        transfers its own last gradient send back holds it until stage ``k - 1`` starts its last
        backward. Each all-reduce starts when its last holder is done (groups run in :meth:`sync_groups` order on every device), and each
        device then steps. Without a flush (2bw) the all-reduce and step follow the steady state.
        One-chunk schedules; the simulator is the reference for the others. Where nodes share
        NICs, a message between nodes gets the share of each NIC it crosses that the plan's
        devices crossing it at once leave (:func:`partitioner.flows.nic_sharers`).
        """
        if self.cluster.has_nics and self.nic_sharers is None:
            return self.with_plan_sharers(plan).plan_iteration_s(plan)
        finish: dict[str, float] = {}
        layers_of: dict[str, list[tuple[int, int]]] = {}
        for w, vw in enumerate(plan.virtual_workers):
            total = self.worker_iteration_s(plan, w)
            gpipe = self._gpipe_stage_done_s(plan, w) if spec(plan.schedule).all_forwards_first else None
            back = 0.0
            for k, st in enumerate(vw.stages):
                prev = vw.stages[k - 1].device if k > 0 else None
                # without overlapped transfers the stage's last gradient send back holds it: its
                # all-reduce starts when that send ends, as stage k - 1's last backward starts
                held = 0.0 if self.options.overlap_comm else self.boundary_s(st.start, st.device, prev)
                for d in st.devices:
                    layers_of.setdefault(d, []).append((st.start, st.stop))
                    done = total if not spec(plan.schedule).flushes else total - back + held
                    if gpipe is not None:  # GPipe's backward flow shop says when each stage ends (its
                        # last gradient send included, which an overlapped send does not hold it for)
                        done = gpipe[k] - (self.boundary_s(st.start, st.device, prev) if self.options.overlap_comm
                                           else 0.0)
                    finish[d] = max(finish.get(d, 0.0), done)
                gpu = self.cluster.device(st.device).kind
                nxt = vw.stages[k + 1].device if k + 1 < len(vw.stages) else None
                back += self.recomputing(st.recompute).fwd_bwd_s(gpu, st.start, st.stop)[1] + \
                    self.boundary_s(st.stop, nxt, st.device)
        for g in self.sync_groups(plan):
            end = max(finish[d] for d in g.devices) + self.sync_s(g)
            for d in g.devices:
                finish[d] = end
        if spec(plan.schedule).sync == "wave":  # WSP applies its update inside PUSH (plain SGD): no step
            return max(finish.values())
        holders = self.layer_holders(plan)
        return max(t + sum(self.update_shard_s(self.cluster.device(d).kind, a, b, holders) for a, b in layers_of[d])
                   for d, t in finish.items())

    def layer_holders(self, plan: Plan, at_least: int = 1) -> np.ndarray:
        """How many devices hold each layer (over every virtual worker and replica): the
        data-parallel holders that share the layer's optimizer state under ZeRO; ``at_least``
        where a worker is priced before the others are known (each holds every layer)."""
        out = np.full(self.num_layers, max(at_least - 1, 0), dtype=np.int64)
        for vw in plan.virtual_workers:
            for st in vw.stages:
                out[st.start:min(st.stop, self.num_layers)] += len(st.devices)
        return out

    @staticmethod
    def holder_runs(start: int, stop: int, holders: np.ndarray) -> list[tuple[int, int, int]]:
        """``[start, stop)`` as runs ``(a, b, d)`` of layers with ``d`` holders each."""
        out: list[tuple[int, int, int]] = []
        a = start
        for layer in range(start + 1, stop + 1):
            if layer == stop or holders[layer] != holders[a]:
                out.append((a, layer, max(int(holders[a]), 1)))
                a = layer
        return out

    def update_shard_s(self, gpu_type: str, start: int, stop: int, holders: np.ndarray) -> float:
        """The optimizer step one device runs for layers ``[start, stop)``: all of it, or under ZeRO
        its shard of each layer (the step divided by the layer's ``holders``)."""
        if not self.options.zero:
            return self.update_s(gpu_type, start, stop)
        return sum(self.update_s(gpu_type, a, b) / d for a, b, d in self.holder_runs(start, stop, holders))

    def plan_stage_memory_bytes(self, st: Stage, device: str, in_flight: int, schedule: Schedule,
                                holders: np.ndarray) -> float:
        """Memory of stage ``st`` on ``device`` (one of its devices) in a plan whose layers have
        ``holders`` (:meth:`layer_holders`): priced in the stage's recompute mode, its optimizer state
        shared by each layer's holders under ZeRO (one prefix difference where they are the same
        for all its layers, as the solvers price it)."""
        cs = self.recomputing(st.recompute)
        t = self.cluster.device(device).tensor_parallel
        runs = self.holder_runs(st.start, st.stop, holders) if self.options.zero else [(st.start, st.stop, 1)]
        total = cs.stage_memory_bytes(st.start, st.stop, in_flight, schedule, t, runs[0][2] if len(runs) == 1 else 1)
        if len(runs) > 1:
            versions = schedule.weight_versions
            total += sum(cs.weight_bytes(a, b, versions, t, d) - cs.weight_bytes(a, b, versions, t) for a, b, d in runs)
        return total

    def plan_memory_bytes(self, plan: Plan) -> dict[str, float]:
        """Peak memory per device under the plan's schedule (one-chunk schedules)."""
        self.check_order(plan)
        sched = plan.pipeline_schedule
        holders = self.layer_holders(plan)
        used: dict[str, float] = {}
        for vw in plan.virtual_workers:
            p = len(vw.stages)
            for k, st in enumerate(vw.stages):
                in_flight = sched.activations_in_flight(p - k)
                for d in st.devices:
                    used[d] = used.get(d, 0.0) + self.plan_stage_memory_bytes(st, d, in_flight, sched, holders)
        return used

    def check_plan_memory(self, plan: Plan, holders_at_least: int = 1) -> None:
        """Raise :class:`FormatError` naming the first device whose stages do not fit (a plan of one
        worker among ``holders_at_least`` under ZeRO: :meth:`layer_holders`)."""
        self.check_order(plan)
        sched = plan.pipeline_schedule
        if sched.spec.multi_chunk or sched.spec.split_backward:
            return  # multi-chunk and zero-bubble schedules: the simulator measures their peak
        holders = self.layer_holders(plan, holders_at_least)
        for w, vw in enumerate(plan.virtual_workers):
            p = len(vw.stages)
            for k, st in enumerate(vw.stages):
                in_flight = sched.activations_in_flight(p - k)
                for d in st.devices:
                    need = self.plan_stage_memory_bytes(st, d, in_flight, sched, holders)
                    cap = self.cluster.device(d).memory_bytes
                    if need > cap:
                        how = f", recompute {st.recompute}" if st.recompute != "none" else ""
                        raise FormatError(
                            f"virtual_workers[{w}].stages[{k}]", f"{st.device} layers [{st.start}, {st.stop})",
                            f"needs {need / GIB:.2f} GiB ({in_flight} micro-batches in flight under "
                            f"{plan.schedule}{how}); device {d} has {cap / GIB:.2f} GiB")

    def validate_plan(self, plan: Plan) -> None:
        """Raise :class:`FormatError` unless ``plan`` is executable on this model's cluster: its
        structure (:meth:`partitioner.plan.Plan.validate`) and every device's memory
        (:meth:`check_plan_memory`)."""
        self.check_order(plan)
        plan.validate(self.profile, self.cluster)
        self.check_plan_memory(plan)

    # -- bounds ----------------------------------------------------------------------------------

    def lower_bound_s(self, devices: Sequence[Device]) -> float:
        """A bound no split over ``devices`` can beat, ignoring memory and transfers.

        The larger of: the slowest layer on the fastest type available, and the total work
        spread over the devices' combined speed. Per-layer speed ratios between GPU types need
        not be one number (a projected profile's compute-bound and memory-bound layers scale
        differently), so speeds are measured against a reference type ``r`` at each type's best
        ratio ``rho_t = min_l c_t(l) / c_r(l)``: a device of type ``t`` holding reference work
        ``w`` computes at least ``rho_t w``, so the bottleneck is at least ``W_r / sum_d 1 / rho_d``
        (``W_r`` the whole model on ``r``). The best reference of the types present is taken;
        where the ratios are one number this is the whole-model balance ``1 / sum_d 1 / T_d``.
        """
        types = list(dict.fromkeys(d.kind for d in devices))
        per_layer = np.stack([self.layer_compute_s(t) for t in types])
        largest_layer = float(per_layer.min(axis=0).max())
        counts = np.array([sum(d.kind == t for d in devices) for t in types], dtype=float)
        balanced = 0.0
        for r in range(len(types)):
            ref = per_layer[r]
            work = float(ref.sum())
            if work <= 0:
                continue
            held = ref > 0
            rho = np.min(per_layer[:, held] / ref[held], axis=1)
            if np.any(rho <= 0):
                continue  # a type does some of this reference's work for free: no bound from it
            balanced = max(balanced, work / float(np.sum(counts / rho)))
        return max(largest_layer, balanced)
