"""Exact min-max split of a chain over identical devices (no memory limits, no transfers).

The classic parametric search: the optimum is one of the contiguous sums, and for a limit
``T`` a greedy pass that closes a part only when the next layer would exceed ``T`` uses the
fewest parts possible. Binary search over the sorted candidate sums finds the smallest
feasible ``T``. It shares no code with the DP, which makes it an independent check of it
in the special case both solve.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["identical_optimum"]


def _parts_needed(work: np.ndarray, limit: float) -> float:
    limit *= 1 + 1e-12  # candidates are prefix differences; the greedy adds in another order
    parts, acc = 1, 0.0
    for w in work:
        if w > limit:
            return np.inf
        if acc + w > limit:
            parts, acc = parts + 1, float(w)
        else:
            acc += float(w)
    return parts


def identical_optimum(work: Sequence[float], parts: int) -> float:
    """Smallest bottleneck of ``work`` split into at most ``parts`` contiguous non-empty parts."""
    w = np.asarray(work, dtype=np.float64)
    if parts < 1 or len(w) == 0:
        raise ValueError(f"need at least one part and one layer (parts={parts}, layers={len(w)})")
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    candidates = np.unique((prefix[None, :] - prefix[:, None])[np.triu_indices(len(prefix), 1)])
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _parts_needed(w, candidates[mid]) <= parts:
            hi = mid
        else:
            lo = mid + 1
    return float(candidates[lo])
