"""Device mapping: the order of a virtual worker's GPUs in its pipeline, chosen with the split.

For a fixed order, :func:`solvers.pipeline.dp.chain_dp` gives the exact minimum-bottleneck split. The
order matters because a stage's time includes sending its boundary tensor to the next
stage's GPU (fast inside a node, slow across the network) and because GPU types differ in
speed and memory. This module searches over orders.

**When the search is exact.** Two GPUs of the same type on the same node, neither named in
a device-level link override, are interchangeable: swapping them changes no stage time, no
transfer and no memory limit. So an order is fully described by its sequence of
*labels* ``(node, gpu type)``, and the number of distinct orders is the multinomial
coefficient ``p! / prod(c_g!)`` over the label counts ``c_g``. When that number is at most
``exact_limit`` (default 720: e.g. 6 distinct labels, or 8 GPUs of 2 labels with 4 each),
every label sequence is priced by the exact DP and the
best is returned: the result is **optimal** for the minimum-bottleneck objective.

**When it is a heuristic.** Beyond ``exact_limit``, the search starts from a few natural
orders (the cluster's listing order; nodes kept contiguous with faster GPU types first;
all GPUs by speed) and improves the best by swapping two positions with different labels
and by moving a whole node block, until no move helps or ``max_evaluations`` (default 200) is spent.
The answer is then ``exact=False`` and carries the simple lower bound of
:meth:`partitioner.cost.CostModel.lower_bound_s` as its certificate.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from partitioner.cluster import Device
from partitioner.cost import CostModel
from partitioner.schedule import Schedule
from solvers.pipeline.dp import ChainSolution, chain_dp

__all__ = ["MappingResult", "device_labels", "label_orders", "map_worker", "num_label_orders", "realise_order"]

log = logging.getLogger(__name__)

Label = tuple[str, str]


@dataclass(frozen=True)
class MappingResult:
    """The best order and split found for one virtual worker (``solution`` None: nothing fits)."""

    solution: ChainSolution | None
    exact: bool
    orders_evaluated: int
    lower_bound_s: float


def device_labels(cost: CostModel, devices: Sequence[Device]) -> list[Label]:
    """The interchangeability class of each device: ``(node, gpu type)``, or the device's
    own name when a device-level link override singles it out."""
    pinned = {end for link in cost.cluster.links for end in (link.a, link.b)}
    return [(d.node, d.name if d.name in pinned else d.kind) for d in devices]


def num_label_orders(labels: Sequence[Label]) -> int:
    """Distinct sequences of ``labels``: ``p! / prod(c!)``."""
    out = math.factorial(len(labels))
    for c in Counter(labels).values():
        out //= math.factorial(c)
    return out


def label_orders(labels: Sequence[Label]) -> Iterator[tuple[Label, ...]]:
    """Every distinct sequence of the multiset ``labels`` (each exactly once)."""
    counts = Counter(labels)
    keys = sorted(counts)
    p = len(labels)
    seq: list[Label] = []

    def rec() -> Iterator[tuple[Label, ...]]:
        if len(seq) == p:
            yield tuple(seq)
            return
        for k in keys:
            if counts[k]:
                counts[k] -= 1
                seq.append(k)
                yield from rec()
                seq.pop()
                counts[k] += 1

    yield from rec()


def realise_order(order: Sequence[Label], pools: dict[Label, list[Device]]) -> list[Device]:
    """Devices for a label sequence: each label's devices taken in their listed order."""
    used: Counter[Label] = Counter()
    out = []
    for lab in order:
        out.append(pools[lab][used[lab]])
        used[lab] += 1
    return out


def map_worker(cost: CostModel, devices: Sequence[Device], schedule: Schedule,
               *, exact_limit: int = 720, max_evaluations: int = 200,
               deadline: float | None = None, holders: int = 1) -> MappingResult:
    """Best pipeline order and split of ``devices`` (all of them are used, one stage each).

    ``deadline`` (a ``time.perf_counter()`` value): past it, the search stops after the orders
    it has started with and keeps the best found (reported as not exact). ``holders``: of every
    layer, under ZeRO (:func:`solvers.pipeline.dp.chain_dp`)."""
    devices = list(devices)
    labels = device_labels(cost, devices)
    pools: dict[Label, list[Device]] = {}
    for lab, d in zip(labels, devices, strict=True):
        pools.setdefault(lab, []).append(d)
    bound = cost.lower_bound_s(devices) if devices else math.inf
    if len(devices) > cost.num_layers or not devices:
        return MappingResult(None, True, 0, bound)
    n_orders = num_label_orders(labels)
    best: ChainSolution | None = None
    evaluated = 0

    def consider(order: Sequence[Label]) -> ChainSolution | None:
        nonlocal best, evaluated
        # orders compete on the bottleneck; the winner's split is refined once, at the end
        sol = chain_dp(cost, realise_order(order, pools), schedule, refine=False, holders=holders)
        evaluated += 1
        if sol is not None and (best is None or sol.bottleneck_s < best.bottleneck_s):
            best = sol
        return sol

    def out_of_time() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    if n_orders <= exact_limit:
        complete = True
        for order in label_orders(labels):
            consider(order)
            if best is not None and best.bottleneck_s <= bound * (1 + 1e-12):
                break  # reached the bound: nothing can be better
            if best is not None and out_of_time():
                complete = False
                break
        result = MappingResult(best, complete, evaluated, bound)
    else:
        result = _local_search(cost, devices, labels, pools, consider, max_evaluations, bound, lambda: best,
                               lambda: evaluated, out_of_time)
    if result.solution is None:
        return result
    refined = chain_dp(cost, result.solution.devices, schedule, holders=holders)  # same order, same bottleneck
    return MappingResult(refined, result.exact, result.orders_evaluated, result.lower_bound_s)


def _speed_key(cost: CostModel, gpu_type: str) -> float:
    """Whole-model time on ``gpu_type``: smaller is faster."""
    return cost.compute_s(gpu_type, 0, cost.num_layers)


def _local_search(cost, devices, labels, pools, consider, max_evaluations, bound, get_best, get_count,
                  out_of_time=lambda: False):
    """Heuristic order search for large virtual workers (see the module docstring)."""
    listed = tuple(labels)
    node_rank = {n: k for k, n in enumerate(dict.fromkeys(d.node for d in devices))}
    by_node = tuple(sorted(labels, key=lambda lab: (node_rank[lab[0]], _speed_key(cost, pools[lab][0].kind))))
    by_speed = tuple(sorted(labels, key=lambda lab: (_speed_key(cost, pools[lab][0].kind), node_rank[lab[0]])))
    starts = list(dict.fromkeys([listed, by_node, by_speed]))
    scored = []
    for order in starts:
        sol = consider(order)
        scored.append((sol.bottleneck_s if sol is not None else math.inf, order))
    cur_val, cur = min(scored, key=lambda x: x[0])
    improved = True
    while improved and get_count() < max_evaluations and cur_val > bound * (1 + 1e-12) and not out_of_time():
        improved = False
        moves = _neighbours(cur)
        for cand in moves:
            if get_count() >= max_evaluations or out_of_time():
                break
            sol = consider(cand)
            if sol is not None and sol.bottleneck_s < cur_val * (1 - 1e-12):
                cur_val, cur, improved = sol.bottleneck_s, cand, True
                break
    log.debug("heuristic mapping of %d devices: %d orders evaluated", len(devices), get_count())
    return MappingResult(get_best(), False, get_count(), bound)


def _neighbours(order: tuple[Label, ...]) -> Iterator[tuple[Label, ...]]:
    """Orders one move away: swap two positions with different labels, or move a node block."""
    p = len(order)
    for i in range(p):
        for j in range(i + 1, p):
            if order[i] != order[j]:
                new = list(order)
                new[i], new[j] = new[j], new[i]
                yield tuple(new)
    nodes = list(dict.fromkeys(lab[0] for lab in order))
    for n in nodes:
        block = [lab for lab in order if lab[0] == n]
        rest = [lab for lab in order if lab[0] != n]
        for pos in range(len(rest) + 1):
            cand = tuple(rest[:pos] + block + rest[pos:])
            if cand != order:
                yield cand
