"""Virtual-worker formation: split a cluster's GPUs into K pipelines that train data-parallel.

HetPipe's policies, as named baselines:

* ``np`` (node partition): one virtual worker per node; K must equal the number of nodes.
* ``ed`` (equal distribution): every virtual worker gets the same mix of GPU types, so the
  count of every type must divide by K. Each type's GPUs, in cluster order, are dealt out in
  contiguous runs, which keeps a virtual worker's GPUs on as few nodes as the mix allows.
* ``hd`` (hybrid distribution): GPU types sorted by speed are paired fastest with slowest
  (the middle type alone when their number is odd); each pair gets an equal share of the K
  virtual workers and is dealt out evenly over them. K must divide by the number of pairs and
  every type's count by its pair's share.

``opt`` searches groupings for the best long-run throughput, K times the slowest virtual
worker's, under either objective: ``sync`` (synchronous data parallelism; the planner adds the
gradient all-reduce when it prices the plan) and ``wsp`` (wave synchronous parallel: a worker
runs at most D waves ahead of the slowest, so in the long run every worker keeps the slowest's
pace, and the all-reduce is hidden behind the next waves). It is **exact** when the cluster is
small (every partition of the GPUs into K groups is enumerated, up to relabelling
interchangeable GPUs); otherwise it is a local search that starts from every baseline
grouping that applies (so it is never worse than them) and moves or swaps single GPUs
between virtual workers while that helps, within a time budget.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence

from partitioner.cluster import Device
from partitioner.errors import FormatError

__all__ = ["OBJECTIVES", "POLICIES", "combine", "count_set_partitions", "group", "group_ed", "group_hd",
           "group_np", "search_opt", "set_partitions"]

log = logging.getLogger(__name__)

POLICIES = ("np", "ed", "hd", "opt")
OBJECTIVES = ("wsp", "sync")

Grouping = list[list[Device]]
Value = Callable[[Sequence[Device]], float]  # throughput of one virtual worker, -inf if it cannot run


def combine(values: Sequence[float], objective: str) -> float:
    """Long-run throughput of virtual workers with these throughputs under ``objective``: K
    times the slowest under both (synchronous steps wait for it; WSP's staleness bound keeps
    every worker within D waves of it, so a faster worker's own rate is not sustained)."""
    if objective not in OBJECTIVES:
        raise FormatError("objective", objective, f"must be one of {', '.join(OBJECTIVES)}")
    if not values or any(not math.isfinite(v) for v in values):
        return -math.inf
    return len(values) * float(min(values))


def _check_k(k: int, n: int) -> None:
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise FormatError("virtual_workers", k, "must be an integer >= 1 or 'auto'")
    if k > n:
        raise FormatError("virtual_workers", k, f"the cluster has only {n} GPUs; each virtual worker "
                          f"needs at least one, so K <= {n}")


def group_np(devices: Sequence[Device], k: int) -> Grouping:
    nodes = list(dict.fromkeys(d.node for d in devices))
    _check_k(k, len(devices))
    if k != len(nodes):
        raise FormatError("virtual_workers", k, f"policy np makes one virtual worker per node and the "
                          f"cluster has {len(nodes)} nodes; use K={len(nodes)} or another policy")
    return [[d for d in devices if d.node == n] for n in nodes]


def _by_type(devices: Sequence[Device]) -> dict[str, list[Device]]:
    out: dict[str, list[Device]] = {}
    for d in devices:
        out.setdefault(d.kind, []).append(d)
    return out


def group_ed(devices: Sequence[Device], k: int) -> Grouping:
    _check_k(k, len(devices))
    types = _by_type(devices)
    bad = {t: len(v) for t, v in types.items() if len(v) % k}
    if bad:
        counts = ", ".join(f"{t}: {len(v)}" for t, v in types.items())
        raise FormatError("virtual_workers", k, f"policy ed gives every virtual worker the same mix, "
                          f"so every GPU type's count must divide by K; counts are {counts}")
    out: Grouping = [[] for _ in range(k)]
    for devs in types.values():
        share = len(devs) // k
        for w in range(k):
            out[w].extend(devs[w * share:(w + 1) * share])
    return out


def group_hd(devices: Sequence[Device], k: int, speed: Callable[[str], float]) -> Grouping:
    """``speed(gpu_type)``: whole-model seconds on that type (smaller is faster)."""
    _check_k(k, len(devices))
    types = _by_type(devices)
    order = sorted(types, key=speed)
    if len(order) < 2:
        raise FormatError("policy", "hd", f"hybrid distribution pairs GPU types; the cluster has only "
                          f"{len(order)} type")
    pairs = [[order[i], order[-1 - i]] for i in range(len(order) // 2)]
    if len(order) % 2:
        pairs.append([order[len(order) // 2]])
    if k % len(pairs):
        raise FormatError("virtual_workers", k, f"policy hd splits K evenly over {len(pairs)} type "
                          f"pair(s) {pairs}; K must be a multiple of {len(pairs)}")
    share = k // len(pairs)
    out: Grouping = []
    for pair in pairs:
        bad = {t: len(types[t]) for t in pair if len(types[t]) % share}
        if bad:
            raise FormatError("virtual_workers", k, f"policy hd gives each of the {len(pairs)} type pairs "
                              f"{share} virtual workers, but these counts do not divide by {share}: {bad}")
        groups: Grouping = [[] for _ in range(share)]
        for t in pair:
            per = len(types[t]) // share
            for w in range(share):
                groups[w].extend(types[t][w * per:(w + 1) * per])
        out.extend(groups)
    return out


def group(policy: str, devices: Sequence[Device], k: int, speed: Callable[[str], float]) -> Grouping:
    """The baseline grouping ``policy`` (np, ed or hd) of ``devices`` into ``k`` workers."""
    if policy == "np":
        return group_np(devices, k)
    if policy == "ed":
        return group_ed(devices, k)
    if policy == "hd":
        return group_hd(devices, k, speed)
    raise FormatError("policy", policy, "a fixed grouping is one of np, ed, hd (opt searches)")


# -- opt ------------------------------------------------------------------------------------------


def set_partitions(n: int, k: int) -> Iterator[list[int]]:
    """Every partition of ``range(n)`` into exactly ``k`` non-empty blocks, as block indices
    (restricted growth strings: each partition exactly once, in lexicographic order).

    Iterative, so ``n`` may be any size (one partition each for ``k = 1`` and ``k = n``).
    """
    if not 1 <= k <= n:
        return
    # a[i]: block of element i; top[i]: blocks used by a[0..i] (max + 1). The first string puts
    # elements 0..n-k in block 0 and the last k - 1 elements in blocks 1..k-1.
    a = [0] * (n - k + 1) + list(range(1, k))
    top = [1] * (n - k + 1) + list(range(2, k + 1))
    while True:
        yield list(a)
        # Advance the rightmost element that can grow while the rest can still reach k blocks.
        i = n - 1
        while i > 0:
            grown = a[i] + 1
            used = max(top[i - 1], grown + 1)
            if grown < k and grown <= top[i - 1] and used + (n - 1 - i) >= k:
                break
            i -= 1
        if i == 0:
            return
        a[i] += 1
        top[i] = max(top[i - 1], a[i] + 1)
        # Fill the rest with the smallest string that still uses all k blocks.
        for j in range(i + 1, n):
            need = k - top[j - 1]  # blocks still to open
            if need >= n - j:  # every remaining element must open a new block
                a[j] = top[j - 1]
            else:
                a[j] = 0
            top[j] = max(top[j - 1], a[j] + 1)


def count_set_partitions(n: int, k: int, cap: int) -> int:
    """The Stirling number S(n, k) (partitions of n elements into k blocks), or ``cap + 1``
    when it exceeds ``cap``: cheap at any ``n`` (S is unimodal in ``k``, so when both
    S(n, 2) = 2^(n-1) - 1 and S(n, n-1) = n(n-1)/2 exceed ``cap``, so does every 1 < k < n)."""
    if not 1 <= k <= n:
        return 0
    if k in (1, n):
        return 1
    if n > 64 and math.comb(n, 2) > cap:  # 2^(n-1) - 1 > cap as well
        return cap + 1
    return min(_stirling2(n, k), cap + 1)


def _stirling2(n: int, k: int) -> int:
    return sum((-1) ** i * math.comb(k, i) * (k - i) ** n for i in range(k + 1)) // math.factorial(k)


def search_opt(devices: Sequence[Device], k: int, value: Value, objective: str,
               starts: Sequence[Grouping] = (), *, bound: Value | None = None, exact_limit: int = 20000,
               time_limit_s: float = 30.0, idle: bool = False) -> tuple[Grouping | None, float, bool]:
    """Best grouping of ``devices`` into ``k`` workers: (grouping, total throughput, exact).

    ``bound(worker)``, if given, is an upper bound on ``value(worker)``; the local search
    skips moves that cannot beat the incumbent even at the bound. ``idle``: GPUs may be left
    out (a GPU that only slows its worker); the exhaustive search then partitions the devices
    and one phantom element into ``k + 1`` blocks, the phantom's block (less the phantom) idle.
    """
    _check_k(k, len(devices))
    n = len(devices)
    t0 = time.perf_counter()
    best: Grouping | None = None
    best_val = -math.inf
    elements, blocks_k = (n + 1, k + 1) if idle else (n, k)
    if count_set_partitions(elements, blocks_k, exact_limit) <= exact_limit:
        for blocks in set_partitions(elements, blocks_k):
            g: Grouping = [[] for _ in range(blocks_k)]
            for d, b in zip(devices, blocks, strict=False):  # the phantom (idle) element has no device
                g[b].append(d)
            if idle:
                del g[blocks[n]]
            val = combine([value(w) for w in g], objective)
            if val > best_val:
                best, best_val = g, val
        return best, best_val, True
    cands = [s for s in starts if len(s) == k] or [_contiguous(devices, k)]
    for s in cands:
        val = combine([value(w) for w in s], objective)
        if best is None or val > best_val:
            best, best_val = [list(w) for w in s], val
    assert best is not None
    improved = True
    while improved and time.perf_counter() - t0 < time_limit_s:
        improved = False
        for cand in _moves(best):
            if time.perf_counter() - t0 >= time_limit_s:
                log.info("opt grouping stopped at its %.0f s budget", time_limit_s)
                break
            if bound is not None and best_val > -math.inf:
                ub = combine([bound(w) for w in cand], objective)
                if ub <= best_val * (1 + 1e-9):
                    continue
            val = combine([value(w) for w in cand], objective)
            if val > best_val * (1 + 1e-9) or (best_val == -math.inf and val > -math.inf):
                best, best_val, improved = cand, val, True
                break
    return best, best_val, False


def _contiguous(devices: Sequence[Device], k: int) -> Grouping:
    n = len(devices)
    return [list(devices[w * n // k:(w + 1) * n // k]) for w in range(k)]


def _moves(g: Grouping) -> Iterator[Grouping]:
    """Groupings one step away: swap two GPUs of different type or node between two workers,
    or move one GPU to another worker (never emptying one)."""
    k = len(g)
    for a in range(k):
        for b in range(a + 1, k):
            seen: set[tuple[tuple[str, str], tuple[str, str]]] = set()
            for i, da in enumerate(g[a]):
                for j, db in enumerate(g[b]):
                    key = ((da.node, da.kind), (db.node, db.kind))
                    if key[0] == key[1] or key in seen:
                        continue
                    seen.add(key)
                    new = [list(w) for w in g]
                    new[a][i], new[b][j] = db, da
                    yield new
    for a in range(k):
        if len(g[a]) < 2:
            continue
        for i, _d in enumerate(g[a]):
            for b in range(k):
                if b != a:
                    new = [list(w) for w in g]
                    new[b].append(new[a].pop(i))
                    yield new
