"""A bound on any plan's iteration that knows each layer's speed on each GPU kind.

The fleet bound (:mod:`.fleet`) measures a GPU type's speed by one number (its best ratio to a
reference over all layers), which is loose where the ratio varies from layer to layer (an FP32
V100 is 3x slower than an A100 on a transformer block and close to it on an embedding). This
bound is a linear program over the layers instead. For ``K`` virtual workers of ``m``
micro-batches, devices of kind ``t`` (a GPU type at a tensor-parallel degree) ``n_t`` of them:

* ``x[l, t]`` in [0, 1]: the share of the ``K m`` micro-batches whose layer ``l`` runs on kind
  ``t``; ``sum_t x[l, t] = 1``;
* ``y[l, t]`` in [0, n_t]: how many kind-``t`` devices hold layer ``l``; every worker holds every
  layer, so ``sum_t y[l, t] >= K``;
* busy time: a device runs its forwards and backwards, its all-reduces and its optimizer step one
  after another within the iteration (the cost model's and the simulator's flushing schedules), so

      n_t T >= sum_l K m x[l, t] c_t(l) + y[l, t] (u_t(l) + r_t(l))

  with ``c`` forward + backward of one micro-batch, ``u`` the step and ``r`` the least time of its
  all-reduce among ``K`` holders: ``2 (K - 1) / K`` of its gradient bytes (per GPU of a group)
  over the fastest link of the cluster (a ring sends that much from every member, and the
  hierarchical algorithm more);
* memory: a holder keeps the layer's weights, gradients and optimizer state and at least one
  micro-batch of its activations, ``sum_l y[l, t] (w_t(l) + s_t(l)) <= n_t (C_t - reserved)``,
  ``s_t(l)`` the layer's saved bytes less what it shares with the layer before (a stage keeps a
  tensor two of its layers share once: at least its layers' ``s`` summed, not their own
  activations summed);

* coupling: a holder runs at most its own worker's ``m`` micro-batches of a layer, so
  ``K x[l, t] <= y[l, t]`` (a fast kind of little memory cannot run what it cannot hold).

``min T`` is a floor on the iteration, so ``K m b / T`` bounds samples/s. At ``K = 1`` it bounds
every ``K`` (``every_k``): with ``y = K y'`` a plan of ``K`` workers is busy at least ``K`` times a
feasible point of the one-worker LP (whose memory row is looser and whose all-reduce term is 0),
so ``K m b / T_K <= m b / T_1``. An infeasible LP (the kinds cannot hold ``K`` copies of the
model) is a bound of 0: no plan with ``K`` workers exists.

With ``K`` fixed (not ``every_k``) three more terms hold:

* *pace* (no replication): a device computes each of its layers ``m`` times, so ``T >= m l``
  with ``l`` the largest layer's least time on any kind;
* *all-reduce between nodes*: where ``K`` exceeds the devices of any node, a layer's ``K``
  holders span two nodes or more, so a ring has a hop between nodes and the hierarchical
  algorithm an inter-node phase of at least the whole message: at least ``bytes / R`` with
  ``R`` the fastest inter-node rate (curves at their peak, link overrides included);
* *fill* (1F1B and GPipe, no replication): with ``s_k`` a worker's stage computations, the
  iteration is at least ``m s_k + sum_{j < k} s_j`` for every ``k`` (stage ``k`` starts after
  the forwards before it and ends before their last backwards;
  :func:`solvers.cluster.bounds.paced.universal_fill_s`), whose least value for a given sum
  ``W`` over ``p`` stages is ``W / (1 - (1 - 1/m)^p)`` (every inequality tight: each stage's
  time ``1/m`` of what is left); and at least ``W + (m - 1) beta max_k s_k``
  (:mod:`.paced`). So a worker of ``p`` devices computes ``m W <= T h(p)`` with
  ``h(p) = min(m (1 - (1 - 1/m)^p), m p / (p + (m - 1) beta))``, concave and increasing in
  ``p``; over ``K`` workers of ``N`` devices at most, the busy time of all compute is at most
  ``T K h(N / K)``. Both forms hold for any order of the micro-batches, so for the simulator's
  1F1B, whose warm-up can beat the closed form's fill. Where the first micro-batch may run in
  ``S`` slices (its slices scale with their share of the samples), the chain before stage ``k``
  costs a slice's forwards and the last micro-batch's whole backwards, at least ``gamma`` of
  ``sum_{j < k} s_j`` with ``gamma = beta + (1 - beta) / S``, so ``h`` takes ``m (1 - (1 -
  gamma/m)^p) / gamma``; and the second form becomes ``T >= W / S + (m - 1/S) beta max_k s_k``
  (the first slice's round trip is ``1/S`` of a micro-batch's), ``h <= m p S / (p + (m S - 1)
  beta)``. Both grow with ``S``: the bound at the most slices holds for fewer.

Sends between stages are left out (they only add).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

from partitioner.cluster import Device, split_kind
from partitioner.cost import CostModel
from partitioner.schedule import Schedule

from ..lp import linprog

__all__ = ["FILL_SCHEDULES", "fastest_inter_node_gbps", "fastest_link_gbps", "fill_capacity", "layer_bound",
           "least_allreduce_per_byte_s",
           "least_backward_share", "sliced_lead_share"]

FILL_SCHEDULES = ("1f1b", "gpipe")  # one-chunk schedules whose every backward waits for the forward chain


def fastest_link_gbps(cost: CostModel) -> float:
    """The most GB/s any link of the cluster carries at any message size."""
    cl = cost.cluster
    curves = [cl.inter_curve] if cl.inter_curve is not None else []
    curves += [n.intra_curve for n in cl.nodes if n.intra_curve is not None]
    curves += [x.curve for x in cl.links if x.curve is not None]
    flat = [cl.inter_gbps, *(n.intra_gbps for n in cl.nodes), *(x.gbps for x in cl.links)]
    peaks = [max([c.gbps, *(p[1] for p in c.points)]) for c in curves]
    return max(flat + peaks)


def layer_bound(cost: CostModel, devices: Sequence[Device], virtual_workers: int, schedule: Schedule, *,
                every_k: bool = False, replication: bool = False, slices: int = 1) -> float:
    """The LP of the module docstring: an upper bound on samples/s of any plan of ``virtual_workers``
    workers over ``devices`` (``inf`` where the LP solver gives no answer: no bound). The all-reduce
    counts where the cost model prices it in the iteration (``options.sync`` and a schedule that
    all-reduces), the step where the schedule takes one (not WSP, whose push applies the update).
    ``every_k``: the bound at one worker that holds for every K (``virtual_workers`` must be 1), so
    without the fixed-K terms; ``replication``: plans may replicate stages (no fill term);
    ``slices``: plans may run their first micro-batch in up to this many slices (the fill term
    then holds for them too; ``micro_batches`` >= 2, so the last micro-batch is whole)."""
    if every_k and virtual_workers != 1:
        raise ValueError(f"layer_bound: every_k needs virtual_workers 1, not {virtual_workers}")
    k, m = virtual_workers, schedule.micro_batches
    allreduce = k > 1 and cost.options.sync and schedule.spec.sync == "allreduce"
    stepped = schedule.spec.sync != "wave"
    kinds = sorted({d.kind for d in devices})
    count = np.array([sum(d.kind == t for d in devices) for t in kinds], dtype=float)
    cap = np.array([next(d for d in devices if d.kind == t).memory_bytes for t in kinds]) - cost.options.reserved_bytes
    if np.any(cap <= 0):
        return 0.0
    n_layers, n_kinds = cost.num_layers, len(kinds)
    per_byte_s = least_allreduce_per_byte_s(cost, devices, k, spans_nodes=allreduce and not every_k)
    comp = np.empty((n_layers, n_kinds))
    hold = np.empty((n_layers, n_kinds))
    mem = np.empty((n_layers, n_kinds))
    for j, kind in enumerate(kinds):
        c, step, grads, m_j = _layer_columns(cost, kind, schedule.weight_versions)
        comp[:, j] = c
        hold[:, j] = step * stepped + (per_byte_s * grads if allreduce else 0.0)
        mem[:, j] = m_j
    floor_s, fill = 0.0, math.inf
    if not every_k and not replication:  # a replica runs a share of its worker's micro-batches
        floor_s = m * float(comp.min(axis=1).max())
        if schedule.name in FILL_SCHEDULES:
            fill = k * fill_capacity(m, len(devices) / k, least_backward_share(cost, kinds), slices)
    return _solve(comp, hold, mem, count, cap, k, m, cost.profile.micro_batch_size, floor_s, fill)


def least_allreduce_per_byte_s(cost: CostModel, devices: Sequence[Device], virtual_workers: int,
                               spans_nodes: bool = True) -> float:
    """``r`` per gradient byte: the least seconds an all-reduce among ``virtual_workers`` holders
    takes per byte of the message, ``2 (K - 1) / K`` over the fastest link of the cluster and, where
    ``spans_nodes`` and ``K`` exceeds the devices of any node, at least the whole message over the
    fastest link between nodes (see the module docstring)."""
    k = virtual_workers
    per_byte_s = 2.0 * (k - 1) / k / (fastest_link_gbps(cost) * 1e9)
    if spans_nodes and k > max(Counter(d.node for d in devices).values()):
        per_byte_s = max(per_byte_s, 1.0 / (fastest_inter_node_gbps(cost) * 1e9))
    return per_byte_s


def fastest_inter_node_gbps(cost: CostModel) -> float:
    """The most GB/s a link between two nodes carries at any message size (the inter-node link and
    any link override, which may join two nodes)."""
    cl = cost.cluster
    curves = [cl.inter_curve] if cl.inter_curve is not None else []
    curves += [x.curve for x in cl.links if x.curve is not None]
    flat = [cl.inter_gbps, *(x.gbps for x in cl.links)]
    return max(flat + [max([c.gbps, *(p[1] for p in c.points)]) for c in curves])


def least_backward_share(cost: CostModel, kinds: Sequence[str]) -> float:
    """``beta``: the least ``b / (f + b)`` of any layer on any of ``kinds`` (layers that compute)."""
    beta = 1.0
    for kind in kinds:
        gpu_type, t = split_kind(kind)
        shard = cost.at_degree(t)
        for layer in range(cost.num_layers):
            f, b = shard.fwd_bwd_s(gpu_type, layer, layer + 1)
            if f + b > 0:
                beta = min(beta, b / (f + b))
    return beta


def fill_capacity(micro_batches: int, stages: float, beta: float, slices: int = 1) -> float:
    """``h(p)`` of the module docstring: a worker of ``p`` stages computes at most ``h(p) T`` in an
    iteration ``T`` (``m`` micro-batches, backward shares at least ``beta``; the first micro-batch
    possibly cut into ``slices``, see :func:`sliced_lead_share`)."""
    m, p, s = micro_batches, stages, slices
    lead = sliced_lead_share(beta, s)
    chained = m * (1.0 - (1.0 - lead / m) ** p) / lead
    paced = m * p * s / (p + (m * s - 1) * beta) if p + (m * s - 1) * beta > 0 else math.inf
    return min(chained, paced)


def sliced_lead_share(beta: float, slices: int) -> float:
    """``gamma``: the least share of a stage's compute ``s_j`` that the chain before a later stage
    costs when the first micro-batch runs in ``slices`` (a slice's forward ``f_j / S``, the last
    micro-batch's whole backward ``b_j``): ``f_j / S + b_j >= gamma s_j`` with
    ``gamma = beta + (1 - beta) / S`` (1 when not sliced)."""
    if slices < 1:
        raise ValueError(f"sliced_lead_share: slices {slices} must be >= 1")
    return beta + (1.0 - beta) / slices


def _layer_columns(cost: CostModel, kind: str, versions: int) -> tuple[np.ndarray, ...]:
    """Per layer on ``kind``: forward + backward seconds, step seconds, one GPU's gradient bytes, and
    its weights (``versions`` copies, gradients, optimizer state) plus one micro-batch's saved
    activations net of what it shares with the layer before (the cost model's prefix sums,
    differenced), so that a stage's memory is at least its layers' summed."""
    gpu_type, t = split_kind(kind)
    shard = cost.at_degree(t)
    comp = shard.layer_compute_s(gpu_type)
    step = np.diff(shard.update_prefix(gpu_type))
    grads = np.diff(shard.param_prefix) / t  # one GPU's gradient bytes (the shards move side by side)
    # with memory levers, the least a layer takes in any plan (CostModel.least_stage_bytes: valid over
    # the planner's larger space): ZeRO's state over every GPU, the activations a recompute mode keeps
    holders = cost.cluster.num_gpus if cost.options.zero else 1
    weights = np.diff(shard.param_count_prefix) * shard.options.sharded_bytes_per_parameter(versions, holders)
    kept = shard.recomputing(shard.least_memory_mode)
    # each layer's saved bytes less what it shares with the layer before: a stage counts a tensor two
    # of its layers share once, so a stage keeps at least these summed over its layers (the
    # activation_bytes of a single layer, summed, can be more than the stage's)
    saved = np.diff(kept.saved_stop)
    return comp, step, grads, weights + saved


def _solve(comp: np.ndarray, hold: np.ndarray, mem: np.ndarray, count: np.ndarray, cap: np.ndarray, k: int,
           m: int, b: int, floor_s: float = 0.0, fill: float = math.inf) -> float:
    """Variables x (L x n), y (L x n), T; see the module docstring (``floor_s``: T's least value;
    ``fill``: all compute within ``fill T``). One kind: the LP's optimum in closed form (every
    layer there, ``K`` holders each)."""
    n_layers, n = comp.shape
    if n == 1:
        if k * float(mem[:, 0].sum()) > count[0] * cap[0]:
            return 0.0
        work = k * m * float(comp[:, 0].sum())
        busy = max((work + k * float(hold[:, 0].sum())) / count[0], floor_s, work / fill)
        return k * m * b / busy if busy > 0 else math.inf
    from scipy import sparse

    nx = n_layers * n
    t_col = 2 * nx
    # busy time per kind: K m sum_l x c + sum_l y h - n_t T <= 0
    rows, cols, vals = [], [], []
    for j in range(n):
        idx = np.arange(n_layers) * n + j
        rows += [j] * (2 * n_layers + 1)
        cols += [*idx, *(nx + idx), t_col]
        vals += [*(k * m * comp[:, j]), *hold[:, j], -count[j]]
    # memory per kind, in units of one device's capacity: sum_l y (w + s) / C_t <= n_t
    for j in range(n):
        idx = np.arange(n_layers) * n + j
        rows += [n + j] * n_layers
        cols += [*(nx + idx)]
        vals += [*(mem[:, j] / cap[j])]
    # every worker holds every layer: -sum_t y[l, t] <= -K
    for layer in range(n_layers):
        rows += [2 * n + layer] * n
        cols += [nx + layer * n + j for j in range(n)]
        vals += [-1.0] * n
    # a holder runs at most its own worker's m micro-batches of a layer: K x[l, t] - y[l, t] <= 0
    base = 2 * n + n_layers
    rows += [*(base + np.arange(nx)), *(base + np.arange(nx))]
    cols += [*np.arange(nx), *(nx + np.arange(nx))]
    vals += [float(k)] * nx + [-1.0] * nx
    n_rows = base + nx
    if math.isfinite(fill):  # all compute within fill T: sum K m x c - fill T <= 0
        rows += [n_rows] * (nx + 1)
        cols += [*np.arange(nx), t_col]
        vals += [*(k * m * comp.reshape(-1)), -fill]
        n_rows += 1
    a_ub = sparse.csr_matrix((vals, (rows, cols)), shape=(n_rows, t_col + 1))
    b_ub = np.concatenate([np.zeros(n), count, -k * np.ones(n_layers), np.zeros(nx), np.zeros(n_rows - base - nx)])
    # each layer's micro-batches all run somewhere: sum_t x[l, t] = 1
    eq_rows = np.repeat(np.arange(n_layers), n)
    a_eq = sparse.csr_matrix((np.ones(nx), (eq_rows, np.arange(nx))), shape=(n_layers, t_col + 1))
    c = np.zeros(t_col + 1)
    c[t_col] = 1.0
    bounds = [(0.0, 1.0)] * nx + [(0.0, float(count[j % n])) for j in range(nx)] + [(floor_s, math.inf)]
    res = linprog(c, a_ub, b_ub, a_eq, np.ones(n_layers), bounds)
    if res.status == "infeasible":
        return 0.0
    if not res.ok or res.fun <= 0:
        return math.inf
    return k * m * b / res.fun
