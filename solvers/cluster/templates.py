"""Grouping a cluster into virtual workers by counts: templates of interchangeable GPUs.

GPUs of one type on nodes of one *class* (the same :attr:`~partitioner.cluster.Node.kind`: GPU mix,
intra-node link and NICs, no link override: what :meth:`solvers.cluster.planner.WorkerPlanner.key`
treats as equivalent) are
interchangeable, so a virtual worker is described by a **template**: the node *parts* it
takes, each part a sub-vector of one node's GPUs (e.g. 2 of a node's 8 GPUs, or the whole
node), every part on its own node. Its rate depends on the template alone, so it is planned
once (the real mapping DP and cost model) and reused by every worker of that template.

Choosing how many workers of each template is an integer program over counts:

maximise ``K * R`` with ``R`` the least rate of a template in use (the long-run rate under
``sync`` and under ``wsp`` alike: :func:`solvers.cluster.grouping.combine`).

Small clusters (up to 32 GPUs) solve it exactly, each GPU used at most once (a GPU that only
slows its worker stays idle), by a DP over (GPUs used of each class and type, workers):
templates join in falling rate order and each prefix's most workers over any subset of the
cluster, times the last rate, is a candidate. Large clusters solve the LP
of "most workers of rate >= R" for rate levels R (intervals of levels refined while their
bound could beat the best), round the best level's LP down and fill greedily; GPUs may stay
idle (``details["idle_gpus"]``), and templates that use more of every kind for no more rate are
dropped first. The all-reduce between workers is not in the program; the plan is priced by the
cost model afterwards.

Rates are found lazily: a template not yet planned enters at an upper bound on its rate
(:func:`solvers.cluster.bounds.fleet.worker_time_bound_s` with its memory), the chosen templates are
planned and the program solved again, until the chosen ones are all planned (or time is up).
Where every template was planned exactly or bounded, the answer is optimal over the
template set.

**Template sets.** *Complete* (small clusters): every part is any non-empty sub-vector of a
node, so every worker of any grouping is a template and the answer is optimal over all
groupings (a DP solution whose parts do not fit the nodes, which counts alone cannot rule
out, sends the search on by LP, unproven).
*Chains* (large clusters): a part is a whole node or a chunk of one GPU type whose size is in
the chain of powers of two dividing that type's count on the node (and the count itself), at
most one chunk per (class, type) in a template (at most one per class for mixed nodes). Sizes
in a divisor chain pack exactly: whole nodes first, then each type's chunks largest first.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from partitioner.cluster import Device
from solvers.cluster.bounds.fleet import worker_time_bound_s

__all__ = ["NodeClass", "SymmetricResult", "add_template", "complete_templates", "node_classes", "plan_counts",
           "realise", "template_usage"]

log = logging.getLogger(__name__)

Vec = tuple[tuple[str, int], ...]  # sorted (gpu type, count) pairs
Part = tuple[int, Vec]  # (class index, GPUs taken from one node of that class)
Template = tuple[Part, ...]  # sorted


@dataclass(frozen=True)
class NodeClass:
    """Interchangeable nodes: their names and the GPUs of each that the plan may use."""

    nodes: tuple[str, ...]
    gpus: Vec

    def __post_init__(self) -> None:
        if not self.nodes or not self.gpus or any(c < 1 for _, c in self.gpus):
            raise ValueError(f"NodeClass: empty or invalid ({self.nodes}, {self.gpus})")


@dataclass(frozen=True)
class SymmetricResult:
    """The grouping found, its value by the planner's rates, and what was proven."""

    grouping: list[list[Device]]
    value: float
    exact: bool  # optimal over every grouping (complete template set, exact rates, solved to the end)
    templates: int
    planned: int
    rounds: int
    details: dict[str, Any] = field(default_factory=dict)  # template_set, workers_per_template
    # groupings of identical workers (copies of one planned template), best K x rate first: the
    # program's value leaves the all-reduce between workers out, and identical workers share their
    # cuts, so their stages' replicas often sit on one node where mixed workers' cross a slow link
    alternatives: tuple[list[list[Device]], ...] = ()


def node_classes(devices: Sequence[Device], node_kind: Callable[[str], Any]) -> list[NodeClass]:
    """The classes of the nodes holding ``devices`` (``node_kind(node)``: its kind)."""
    per_node: dict[str, Counter[str]] = {}
    for d in devices:
        per_node.setdefault(d.node, Counter())[d.kind] += 1
    by_kind: dict[Any, list[str]] = {}
    for node, c in per_node.items():
        by_kind.setdefault((node_kind(node), tuple(sorted(c.items()))), []).append(node)
    return [NodeClass(tuple(nodes), key[1]) for key, nodes in by_kind.items()]


def _chain(n: int) -> list[int]:
    out, s = [], 1
    while s < n and n % s == 0:
        out.append(s)
        s *= 2
    return [*[x for x in out if n % x == 0], n]


def _sub_vectors(vec: Vec) -> list[Vec]:
    ranges = [range(c + 1) for _, c in vec]
    out = []
    for counts in itertools.product(*ranges):
        if any(counts):
            out.append(tuple((t, c) for (t, _), c in zip(vec, counts, strict=True) if c))
    return out


def _class_options(ci: int, cls: NodeClass, complete: bool, max_gpus: int) -> list[tuple[Part, ...]]:
    """What one template may take from class ``ci``: a multiset of parts, one per node at most."""
    size = sum(c for _, c in cls.gpus)
    whole: Part = (ci, cls.gpus)
    nodes = len(cls.nodes)
    if complete:
        parts = [(ci, v) for v in _sub_vectors(cls.gpus)]
        out: list[tuple[Part, ...]] = []
        for k in range(1, min(nodes, max_gpus) + 1):
            for combo in itertools.combinations_with_replacement(parts, k):
                if sum(c for _, v in combo for _, c in v) <= max_gpus:
                    out.append(tuple(sorted(combo)))
        return out
    chunks = [(ci, ((t, s),)) for t, n in cls.gpus for s in _chain(n) if (len(cls.gpus) > 1 or s < n)]
    out = []
    for w in range(0, min(nodes, max_gpus // size) + 1):
        base = (whole,) * w
        if w:
            out.append(base)
        if w == nodes:
            continue
        if len(cls.gpus) == 1:
            out.extend((*base, ch) for ch in chunks if w * size + ch[1][0][1] <= max_gpus)
        else:
            out.extend((*base, ch) for ch in chunks if w * size + ch[1][0][1] <= max_gpus)
    return out


def _templates(classes: Sequence[NodeClass], complete: bool, max_gpus: int, max_classes: int,
               limit: int) -> list[Template] | None:
    """Every template (``None`` past ``limit``)."""
    options = [_class_options(ci, c, complete, max_gpus) for ci, c in enumerate(classes)]
    sizes = [[sum(c for _, v in opt for _, c in v) for opt in opts] for opts in options]
    out: list[Template] = []
    for k in range(1, min(max_classes, len(classes)) + 1):
        for cis in itertools.combinations(range(len(classes)), k):
            for picks in itertools.product(*[range(len(options[ci])) for ci in cis]):
                if sum(sizes[ci][p] for ci, p in zip(cis, picks, strict=True)) > max_gpus:
                    continue
                out.append(tuple(sorted(part for ci, p in zip(cis, picks, strict=True) for part in options[ci][p])))
                if len(out) > limit:
                    return None
    return out


def complete_templates(classes: Sequence[NodeClass], max_gpus: int, limit: int = 20_000) -> list[Template] | None:
    """Every worker of at most ``max_gpus`` GPUs as a template (``None`` past ``limit`` templates)."""
    return _templates(classes, True, max_gpus, len(classes), limit)


def template_usage(t: Template) -> Counter[tuple[int, str]]:
    """GPUs of each (class, type) a template takes."""
    out: Counter[tuple[int, str]] = Counter()
    for ci, vec in t:
        for typ, c in vec:
            out[(ci, typ)] += c
    return out


def realise(t: Template, classes: Sequence[NodeClass], pools: dict[str, dict[str, list[Device]]]) -> list[Device]:
    """Devices of one worker of template ``t`` on the first nodes of each class."""
    used: Counter[int] = Counter()
    out: list[Device] = []
    for ci, vec in t:
        node = classes[ci].nodes[used[ci]]
        used[ci] += 1
        for typ, c in vec:
            out.extend(pools[node][typ][:c])
    return out


def _pack(solution: dict[Template, int], classes: Sequence[NodeClass],
          pools: dict[str, dict[str, list[Device]]], budget: int = 200_000) -> list[list[Device]] | None:
    """Concrete devices for every worker: each part on a node of its class, a worker's parts of
    one class on distinct nodes, no GPU twice (``None`` when they do not fit)."""
    workers = [t for t, x in sorted(solution.items()) for _ in range(x)]
    greedy = _pack_greedy(workers, classes, pools)
    if greedy is not None or len(workers) > 64:
        return greedy
    free = {node: {typ: list(devs) for typ, devs in pools[node].items()} for node in pools}
    out: list[list[Device]] = [[] for _ in workers]
    for ci, cls in enumerate(classes):
        items = [(w, vec) for w, t in enumerate(workers) for c2, vec in t if c2 == ci]
        # largest parts first; whole nodes first among equals
        items.sort(key=lambda it: -sum(c for _, c in it[1]))
        left = {node: Counter({typ: len(free[node][typ]) for typ in free[node]}) for node in cls.nodes}
        placed: dict[int, str] = {}
        steps = [0]

        def place(i: int, left: dict[str, Counter[str]] = left, items: list = items,
                  placed: dict[int, str] = placed, steps: list[int] = steps, cls: NodeClass = cls) -> bool:
            if i == len(items):
                return True
            steps[0] += 1
            if steps[0] > budget:
                return False
            w, vec = items[i]
            taken = {placed[j] for j in range(i) if items[j][0] == w}
            tried: set[tuple[tuple[str, int], ...]] = set()
            for node in cls.nodes:
                if node in taken or any(left[node][typ] < c for typ, c in vec):
                    continue
                state = tuple(sorted(left[node].items()))
                if state in tried:
                    continue  # an identical node already failed
                tried.add(state)
                for typ, c in vec:
                    left[node][typ] -= c
                placed[i] = node
                if place(i + 1):
                    return True
                for typ, c in vec:
                    left[node][typ] += c
                del placed[i]
            return False

        if not place(0):
            return None
        for i, (w, vec) in enumerate(items):
            node = placed[i]
            for typ, c in vec:
                out[w].extend(free[node][typ][:c])
                del free[node][typ][:c]
    return out


def _pack_greedy(workers: Sequence[Template], classes: Sequence[NodeClass],
                 pools: dict[str, dict[str, list[Device]]]) -> list[list[Device]] | None:
    """First fit, largest parts first, a worker's parts on distinct nodes: exact for chain sizes."""
    out: list[list[Device]] = [[] for _ in workers]
    for ci, cls in enumerate(classes):
        free = {node: {typ: list(devs) for typ, devs in pools[node].items()} for node in cls.nodes}
        items = sorted(((w, vec) for w, t in enumerate(workers) for c2, vec in t if c2 == ci),
                       key=lambda it: -sum(c for _, c in it[1]))
        on: dict[int, set[str]] = {}
        for w, vec in items:
            node = next((nd for nd in cls.nodes if nd not in on.get(w, set())
                         and all(len(free[nd].get(typ, [])) >= c for typ, c in vec)), None)
            if node is None:
                return None
            on.setdefault(w, set()).add(node)
            for typ, c in vec:
                out[w].extend(free[node][typ][:c])
                del free[node][typ][:c]
    return out


@dataclass
class _Rates:
    """Upper bounds for templates not yet planned, planned rates (and exactness) for the rest."""

    bound: dict[Template, float]
    planned: dict[Template, float] = field(default_factory=dict)
    exact: dict[Template, bool] = field(default_factory=dict)

    def est(self, t: Template) -> float:
        return self.planned.get(t, self.bound[t])


def _cell(state: tuple[int, ...], workers: int) -> tuple[int, ...]:
    """The DP table's index of ``state`` (GPUs used of each kind) with ``workers`` workers."""
    return (*state, workers)


def _shift(arr: np.ndarray, vec: Sequence[int], j: int) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Slices (target, source) moving ``arr`` by ``j`` copies of ``vec`` (and ``j`` workers on the last axis)."""
    tgt, src = [], []
    for size, v in zip(arr.shape, [*vec, 1], strict=True):
        step = j * v
        if step >= size:
            return None
        tgt.append(slice(step, None))
        src.append(slice(0, size - step))
    return tuple(tgt), tuple(src)


def add_template(table: np.ndarray, vec: Sequence[int]) -> np.ndarray:
    """The reachability table after allowing any number of copies of one more template, over
    (GPU counts used, workers)."""
    new = table.copy()
    j = 1
    while (sl := _shift(table, vec, j)) is not None:
        tgt, src = sl
        new[tgt] |= table[src]
        j += 1
    return new


def _solve_dp(templates: Sequence[Template], rates: Sequence[float], supply: dict[tuple[int, str], int],
              k: int | None, max_cells: int = 2_000_000) -> dict[int, int] | None:
    """Exact over the counts, each GPU used at most once, by dynamic programming over (GPUs used
    of each kind, workers); ``None`` when the table would exceed ``max_cells`` or nothing fits.

    Templates join in falling rate order; after each, the most workers that templates of at
    least its rate form on any subset of the GPUs, times that rate, is a candidate (the best
    candidate is the optimum of ``K * least rate``); of the subsets reaching it, one using the
    most GPUs is taken."""
    keys = sorted(supply)
    n = sum(supply.values())
    shape = (*[supply[key] + 1 for key in keys], n + 1)
    if math.prod(shape) > max_cells:
        return None
    cols = [i for i, r in enumerate(rates) if r > 0 and math.isfinite(r)]
    vecs = {i: [template_usage(templates[i]).get(key, 0) for key in keys] for i in cols}
    cols = [i for i in cols if all(v <= supply[key] for v, key in zip(vecs[i], keys, strict=True))]
    ks = range(1, n + 1) if k is None else [k]
    reach = np.zeros(shape, bool)
    reach[(0,) * len(shape)] = True
    best: tuple[float, int, np.ndarray, float] | None = None
    for i in sorted(cols, key=lambda i: -rates[i]):
        reach = add_template(reach, vecs[i])
        formed: np.ndarray = np.asarray(reach.reshape(-1, n + 1).any(axis=0))  # per worker count: on some subset
        got = [x for x in ks if formed[x]]
        if got and (best is None or max(got) * rates[i] > best[0]):
            best = (max(got) * rates[i], max(got), reach, rates[i])
    if best is None:
        return None
    _v, kk, reach, level = best
    usable = [i for i in cols if rates[i] >= level]
    used = max((tuple(int(v) for v in cell) for cell in np.argwhere(reach[..., kk])), key=sum)
    return _backtrack(reach, used, kk, usable, vecs, lambda i, s, x: 1.0 if reach[_cell(s, x)] else -np.inf)


def _backtrack(table: np.ndarray, full: tuple[int, ...], k: int, cols: Sequence[int], vecs: dict[int, list[int]],
               value_via: Callable[[int, tuple[int, ...], int], float]) -> dict[int, int]:
    """Templates that reach ``table[full, k]``: one whose removal leaves a state that reaches
    the rest (``value_via(i, state, workers)`` matches the table's value), repeatedly."""
    out: Counter[int] = Counter()
    state, x = full, k
    target = table[_cell(full, k)]
    while x > 0:
        for i in cols:
            prev = tuple(a - b for a, b in zip(state, vecs[i], strict=True))
            if min(prev) < 0:
                continue
            via = value_via(i, prev, x - 1)
            ok = via > -np.inf if table.dtype == bool else abs(via - target) <= 1e-9 * max(1.0, abs(target))
            if ok:
                out[i] += 1
                if table.dtype != bool:
                    target = table[_cell(prev, x - 1)]
                state, x = prev, x - 1
                break
        else:
            raise AssertionError("DP backtrack found no template")
    return dict(out)


def _undominated(a: np.ndarray, rate: np.ndarray) -> list[int]:
    """Columns of ``a`` (GPUs used per template) not dominated by another using no more of any
    kind at a rate at least as high (ties: the first kept)."""
    keep = []
    order = np.lexsort((a.sum(axis=0), -rate))  # fastest first, then smallest
    kept = np.zeros((a.shape[0], 0))
    for j in order:
        if kept.shape[1] and np.any(np.all(kept <= a[:, j:j + 1], axis=0)):
            continue
        keep.append(int(j))
        kept = np.concatenate([kept, a[:, j:j + 1]], axis=1)
    return sorted(keep)


def _solve_large(templates: Sequence[Template], rates: Sequence[float], supply: dict[tuple[int, str], int],
                 k: int | None, rel_tol: float = 3e-3, near: float | None = None,
                 floor_value: float = 0.0) -> dict[int, int] | None:
    """Counts for a large cluster, GPUs used at most once, by linear programming.

    For a rate level ``R`` the LP gives ``K_LP(R)``, at least the most workers of rate ``>= R`` (it grows as
    ``R`` falls); intervals of levels are refined while ``R_hi * floor(K_LP(R_lo))`` could beat the
    best rounded solution, and the best level's LP is rounded down and filled greedily. Rounding
    loses at most as many workers as the LP has constraints. ``near``: a rate whose level is
    tried first; ``floor_value``: a value already reached (intervals below it are not refined)."""
    lp = _counts_lp(templates, rates, supply, k)
    if lp is None:
        return None
    best = _best_level(lp, rel_tol, near, floor_value)
    log.info("counts LP: %d templates, %d levels, %d LPs", len(lp.cols), len(lp.levels), len(lp.memo))
    if best is None:
        return None
    _v, x, _li = best
    if k is None:  # fill what rounding left with templates of rate >= the level's least in use
        x = lp.rounded(x, lp.rate >= lp.rate[x > 0].min(), lp.rate)
    return {lp.cols[j]: int(x[j]) for j in np.flatnonzero(x)}


@dataclass
class _CountsLp:
    """The counts LP of :func:`_solve_large` over its usable templates (columns ``cols``):
    ``max sum x`` s.t. ``a x <= cap`` (``sum x = k`` where K is fixed) over the templates of rate
    at least a level; each level's answer is kept in ``memo`` (``K_LP`` and ``x``)."""

    cols: list[int]  # template indices
    a: np.ndarray  # GPUs of each kind per column
    cap: np.ndarray  # GPUs of each kind
    rate: np.ndarray  # per column
    k: int | None
    levels: np.ndarray  # the distinct rates, falling
    memo: dict[int, tuple[float, np.ndarray | None]] = field(default_factory=dict)

    def rounded(self, xs: np.ndarray, allowed: np.ndarray, weight: np.ndarray) -> np.ndarray:
        """``xs`` rounded down, then filled greedily with the ``allowed`` columns, heaviest first."""
        a, k = self.a, self.k
        safe = np.where(a > 0, a, 1.0)
        x = np.floor(xs + 1e-9)
        left = self.cap - a @ x
        for j in sorted(np.flatnonzero(allowed), key=lambda j: -weight[j]):  # fill greedily
            if k is not None and x.sum() >= k:
                break
            fit = float(np.min(np.where(a[:, j] > 0, left // safe[:, j], np.inf)))
            if k is not None:
                fit = min(fit, k - x.sum())
            if fit > 0:
                x[j] += fit
                left -= a[:, j] * fit
        return x

    def solve(self, allowed: np.ndarray, weight: np.ndarray) -> np.ndarray | None:
        """The LP over the allowed columns only (the others are 0), by its dual when K is free
        (``min cap.y`` s.t. ``a_t.y >= weight_t``: few variables, solved faster; HiGHS gives the
        primal solution as the constraints' duals)."""
        from solvers.cluster.lp import linprog

        on = np.flatnonzero(allowed)
        if not len(on):
            return None
        out = np.zeros(len(self.cols))
        if self.k is None:
            res = linprog(self.cap, -self.a[:, on].T, -weight[on], method="highs-ds")
            if not res.ok:
                return None
            out[on] = -res.ub_duals
            return np.maximum(out, 0.0)
        res = linprog(-weight[on], self.a[:, on], self.cap, np.ones((1, len(on))), np.array([float(self.k)]))
        if not res.ok:
            return None
        out[on] = res.x
        return out

    def at(self, li: int) -> tuple[float, np.ndarray | None]:
        """``K_LP`` at level ``li`` and the LP's answer there (solved once)."""
        if li not in self.memo:
            xs = self.solve(self.rate >= self.levels[li], np.ones(len(self.cols)))
            self.memo[li] = (0.0, None) if xs is None else (float(xs.sum()), xs)
        return self.memo[li]

    def candidate(self, li: int) -> tuple[float, np.ndarray] | None:
        """The LP at level ``li`` rounded down: a real solution (filled greedily only at the end
        where K is free), and its value ``K * least rate``; None when it has no worker."""
        _k, xs = self.at(li)
        if xs is None:
            return None
        x = np.floor(xs + 1e-9)
        if self.k is not None and x.sum() != self.k:
            x = self.rounded(xs, self.rate >= self.levels[li], self.rate)
        if x.sum() == 0:
            return None
        return x.sum() * self.rate[x > 0].min(), x


def _counts_lp(templates: Sequence[Template], rates: Sequence[float], supply: dict[tuple[int, str], int],
               k: int | None) -> _CountsLp | None:
    """The LP's columns: templates of a positive finite rate (without ``k``, only those no other
    template dominates); None when there are none."""
    cols = [i for i, r in enumerate(rates) if r > 0 and math.isfinite(r)]
    if not cols:
        return None
    keys = sorted(supply)
    use = {i: template_usage(templates[i]) for i in cols}
    a = np.array([[use[i].get(key, 0) for i in cols] for key in keys], dtype=float)
    if k is None:  # GPUs may stay idle: a template using more of every kind for no more rate never helps
        keep = _undominated(a, np.array([rates[i] for i in cols]))
        cols, a = [cols[j] for j in keep], a[:, keep]
    cap = np.array([supply[key] for key in keys], dtype=float)
    rate = np.array([rates[i] for i in cols])
    levels = rate[np.argsort(-rate)]
    levels = levels[np.r_[True, np.diff(levels) < 0]]  # distinct, falling
    return _CountsLp(cols, a, cap, rate, k, levels)


def _best_level(lp: _CountsLp, rel_tol: float, near: float | None, floor_value: float
                ) -> tuple[float, np.ndarray, int] | None:
    """The best rounded solution over the levels: nine spread levels (and those around ``near``)
    first, then intervals of levels ``li..lj`` refined at their middle while
    ``levels[li] * floor(K_LP(lj))`` could beat the best by ``rel_tol``; (value, counts, level)."""
    best: tuple[float, np.ndarray, int] | None = None

    def consider(li: int) -> None:
        nonlocal best
        got = lp.candidate(li)
        if got is not None and (best is None or got[0] > best[0]):
            best = (got[0], got[1], li)

    levels = lp.levels
    last = len(levels) - 1
    start = set(np.linspace(0, last, min(len(levels), 9)).astype(int).tolist())
    if near is not None:
        mid = int(np.searchsorted(-levels, -near))
        start |= {x for x in (mid - 1, mid, mid + 1) if 0 <= x <= last}
    for li in sorted(start):
        consider(li)
    for _ in range(200):
        pts = sorted(lp.memo)
        # levels li..lj (falling rates): K <= floor(K_LP(lj)), R <= levels[li]
        gaps = [(levels[li] * math.floor(lp.memo[lj][0] + 1e-6), li, lj) for li, lj in itertools.pairwise(pts)
                if lj > li + 1]
        reached = max(floor_value, best[0] if best is not None else 0.0)
        gaps = [g for g in gaps if g[0] > reached * (1 + rel_tol)]
        if not gaps:
            break
        for _u, li, lj in sorted(gaps, reverse=True)[:4]:
            consider((li + lj) // 2)
    return best


def plan_counts(devices: Sequence[Device], classes: Sequence[NodeClass], rate: Callable[[Sequence[Device]], float],
                rate_exact: Callable[[Sequence[Device]], bool], whole_s: Callable[[str], float],
                capacity: Callable[[str], float], need_bytes: float, micro_batches: int, micro_batch_size: int,
                *, fill: bool = True, largest_layer_s: float = 0.0, virtual_workers: int | None = None,
                max_worker_gpus: int = 16, max_classes: int = 3, complete_limit: int = 20_000,
                covers_all: bool = False, batch: int = 16, wave_s: float = 0.0, max_stale: int = 3, deadline: float | None = None) -> SymmetricResult | None:
    """Best grouping over counts (see the module docstring); ``None`` when no template fits.

    ``rate(devices)``: samples/s of one worker (-inf if it cannot run); ``rate_exact``: whether
    that rate is optimal for the worker; ``whole_s(type)``: whole-model seconds per micro-batch;
    ``capacity(type)``: bytes a GPU of that type offers the model (memory less the reserve);
    ``need_bytes``: what every worker must hold between its GPUs. ``covers_all``: no worker
    can have more than ``max_worker_gpus`` GPUs (so a complete template set is every worker).
    ``batch`` (small clusters): besides the chosen templates, up to this many more not yet
    planned, the most promising first, are planned in each round; after ``max_stale`` rounds without a better
    plan the search stops (unproven)."""
    t0 = time.perf_counter()
    pools: dict[str, dict[str, list[Device]]] = {}
    for d in devices:
        pools.setdefault(d.node, {}).setdefault(d.kind, []).append(d)
    n = len(devices)
    templates, small, complete = _template_set(classes, n, max_worker_gpus, max_classes, complete_limit, covers_all)

    def bound(t: Template) -> float:
        """An upper bound on the template's rate: 0 where its GPUs cannot hold the model, else
        ``m b / G`` (:func:`~solvers.cluster.bounds.fleet.worker_time_bound_s`)."""
        ts = [whole_s(typ) for _, vec in t for typ, c in vec for _ in range(c)]
        if sum(capacity(typ) * c for _, vec in t for typ, c in vec) < need_bytes:
            return 0.0
        g = worker_time_bound_s(ts, micro_batches, fill, largest_layer_s, wave_s)
        return micro_batches * micro_batch_size / g if g > 0 else math.inf

    rates = _Rates({t: bound(t) for t in templates})
    templates = [t for t in templates if rates.bound[t] > 0]
    if not templates:
        return None
    log.info("symmetric planner: %d templates (%s) in %.2f s", len(templates), "complete" if complete else "chains",
             time.perf_counter() - t0)
    search = _CountSearch(templates, classes, pools, _supply(classes), rates, rate, rate_exact, virtual_workers,
                          batch, max_stale, exact_counts=small, complete=complete)
    search.run(deadline)
    if search.best is None:
        return None
    value, grouping, chosen = search.best
    exact = search.complete and search.proven and all(rates.exact.get(t, True) for t in rates.planned)
    return SymmetricResult(grouping, value, exact, len(templates), len(rates.planned), search.rounds,
                           {"template_set": "complete" if search.complete else "chains",
                            "workers_per_template": {_describe(t, classes): c for t, c in chosen.items()}},
                           _identical_workers({t: rates.est(t) for t in templates}, _supply(classes), classes,
                                              pools, virtual_workers, 8 if small else 3))


def _identical_workers(rated: Mapping[Template, float], supply: Counter[tuple[int, str]],
                       classes: Sequence[NodeClass], pools: dict[str, dict[str, list[Device]]],
                       virtual_workers: int | None, keep: int = 3) -> tuple[list[list[Device]], ...]:
    """Up to ``keep`` groupings of copies of one template (as many copies as the supply holds, or
    ``virtual_workers``), best ``copies x rate`` first (``rated``: each template's rate as known,
    planned or bounded), that fit the nodes."""
    ranked = []
    for t, rate in rated.items():
        use = template_usage(t)
        copies = min(supply[key] // c for key, c in use.items() if c > 0)
        if virtual_workers is not None:
            copies = virtual_workers if copies >= virtual_workers else 0
        if copies > 0 and rate > 0:
            ranked.append((copies * rate, copies, t))
    out = []
    for _value, copies, t in sorted(ranked, key=lambda x: -x[0]):
        grouping = _pack({t: copies}, classes, pools)
        if grouping is not None:
            out.append(grouping)
        if len(out) == keep:
            break
    return tuple(out)


def _template_set(classes: Sequence[NodeClass], n: int, max_worker_gpus: int, max_classes: int,
                  complete_limit: int, covers_all: bool) -> tuple[list[Template], bool, bool]:
    """The templates to plan over: the complete set on up to 32 GPUs (within ``complete_limit``),
    else chains; whether the set is the small one, and whether it holds every worker."""
    templates = _templates(classes, True, min(n, max_worker_gpus), len(classes), complete_limit) \
        if n <= 32 else None
    small = templates is not None
    complete = small and (covers_all or max_worker_gpus >= n)
    if templates is None:
        templates = _templates(classes, False, max_worker_gpus, max_classes, 10**7) or []
    return templates, small, complete


def _supply(classes: Sequence[NodeClass]) -> Counter[tuple[int, str]]:
    """GPUs of each (class, type)."""
    supply: Counter[tuple[int, str]] = Counter()
    for ci, cls in enumerate(classes):
        for typ, c in cls.gpus:
            supply[(ci, typ)] += c * len(cls.nodes)
    return supply


@dataclass
class _CountSearch:
    """The rounds of :func:`plan_counts`: solve the counts at the rates known (bounds for the
    templates not yet planned), plan the chosen templates, keep the best grouping that fits the
    nodes, until the chosen ones were all planned at their bounds, nothing fits, or it goes stale."""

    templates: list[Template]
    classes: Sequence[NodeClass]
    pools: dict[str, dict[str, list[Device]]]
    supply: Counter[tuple[int, str]]
    rates: _Rates
    rate: Callable[[Sequence[Device]], float]
    rate_exact: Callable[[Sequence[Device]], bool]
    virtual_workers: int | None
    batch: int
    max_stale: int
    exact_counts: bool  # the counts are still solved exactly (the DP), not by linear programming
    complete: bool  # the answer can still be proven over every grouping
    best: tuple[float, list[list[Device]], dict[Template, int]] | None = None
    rounds: int = 0
    proven: bool = False
    stale: int = 0
    best_level: float | None = None

    def run(self, deadline: float | None) -> None:
        """Rounds until one says stop or ``deadline`` (a ``time.perf_counter()`` value) passes."""
        while (math.inf if deadline is None else deadline - time.perf_counter()) > 0:
            if not self.round():
                break

    def round(self) -> bool:
        """One round; whether to go on."""
        self.rounds += 1
        sol, optimal = self._solve()
        if sol is None:  # nothing (else) fits: what was found is the best there is
            self.proven = optimal
            return False
        chosen = {self.templates[i]: c for i, c in sol.items()}
        new, level = self._plan(chosen)
        rates = self.rates
        settled = all(rates.planned[t] >= rates.bound[t] * (1 - 1e-12) for t in new)
        vals = [rates.planned[t] for t in chosen for _ in range(chosen[t])]
        self.best_level = level
        value = len(vals) * min(vals) if vals and min(vals) > 0 else 0.0
        improved = False
        if value > 0 and (settled or self.best is None or value > self.best[0]):
            grouping = _pack(chosen, self.classes, self.pools)
            if grouping is None:  # the parts do not fit the nodes: go on without the proof
                log.info("counts solution does not fit the nodes; continuing by linear programming")
                self.exact_counts = self.complete = False
                return True
            if self.best is None or value > self.best[0]:
                self.best, improved = (value, grouping, chosen), True
        if settled:  # the program's optimum is a real plan: nothing else can beat it
            self.proven = optimal
            return False
        self.stale = 0 if improved else self.stale + 1
        # rates keep falling below their bounds without a better plan: stop unproven
        return self.stale < (2 if not self.exact_counts else self.max_stale)

    def _solve(self) -> tuple[dict[int, int] | None, bool]:
        """The counts at the rates known: exactly by DP while it can, else by LP; whether exact."""
        est = [self.rates.est(t) for t in self.templates]
        sol = _solve_dp(self.templates, est, dict(self.supply), self.virtual_workers) if self.exact_counts else None
        optimal = sol is not None
        if sol is None:
            self.exact_counts = False
            sol = _solve_large(self.templates, est, dict(self.supply), self.virtual_workers, near=self.best_level,
                               floor_value=self.best[0] if self.best is not None else 0.0)
        return sol, optimal

    def _plan(self, chosen: dict[Template, int]) -> tuple[list[Template], float]:
        """Plan the chosen templates not yet planned and (while solving exactly) up to ``batch``
        more as promising; those new ones and the least rate in use."""
        rates = self.rates
        new = [t for t in chosen if t not in rates.planned]
        level = min(rates.est(t) for t in chosen)
        more = sorted((t for t in self.templates if t not in rates.planned and t not in chosen
                       and rates.est(t) >= level), key=lambda t: -rates.est(t))
        for t in new + more[:self.batch if new and self.exact_counts else 0]:
            devs = realise(t, self.classes, self.pools)
            rates.planned[t] = max(self.rate(devs), 0.0)
            rates.exact[t] = self.rate_exact(devs)
        return new, level


def _describe(t: Template, classes: Sequence[NodeClass]) -> str:
    return " + ".join(f"{'+'.join(f'{c}x{typ}' for typ, c in vec)}@class{ci}" for ci, vec in t)
