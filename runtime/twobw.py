"""PipeDream-2BW: the ``2bw`` schedule's double-buffered weight updates.

The ``2bw`` action list runs the 1F1B steady state across iterations without a flush (at most
``min(p - r, m)`` micro-batches in flight on rank ``r``, so they belong to at most two
consecutive iterations). The rule this executor implements, with plain SGD of learning rate
``lr`` (``W(-1) = W(0)``):

* every micro-batch of iteration ``c`` runs its forward **and** its backward on weight version
  ``W(c - 1)`` (weight stashing: versions are separate tensors, and a micro-batch keeps the one
  its forward used);
* the gradients of iteration ``c`` (loss of each micro-batch divided by ``m``) are summed and
  averaged over the virtual workers (an asynchronous all-reduce over the holders of the same
  layers, started at iteration ``c``'s ``STEP``; the replicas of a replicated stage each run a
  share of the iteration's micro-batches, ``Layout.actions``, and are holders too, so their
  parts add up to their worker's gradient);
* ``STEP`` of iteration ``c`` creates version ``W(c + 1) = W(c) - lr * g_c``: the update applies
  the gradient computed on the previous version, ``W(t + 1) = W(t) - lr * grad f(W(t - 1))``,
  as PipeDream-2BW specifies. It is made when first needed (the forwards of iteration ``c + 2``
  or the end of the run), after the all-reduce has completed.

Version ``W(c - 1)`` exists on every rank when iteration ``c``'s first forward runs (it was made
after iteration ``c - 2``'s last backward, which precedes it), so at most two versions are in
use at a time, plus the newest. At the end every outstanding version is made and the last one,
``W(steps)``, is loaded into the stage modules.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .executor import StashingExecutor
from .layout import Layout

__all__ = ["TwoBwExecutor"]


class TwoBwExecutor(StashingExecutor):
    """Executes a rank's ``2bw`` action list (see the module docstring for the rule)."""

    def _setup(self, layout: Layout, rank: int) -> None:
        # version -> stage -> parameter name -> leaf tensor (never modified in place)
        self.versions: dict[int, dict[int, dict[str, torch.Tensor]]] = {0: self._leaf_copies()}
        self._updates: dict[int, list[tuple[Any, torch.Tensor]]] = {}  # version -> (all-reduce, flat g) per group
        self._used: dict[tuple[int, int], int] = {}  # (micro-batch, stage) -> version its forward used

    # -- versions ---------------------------------------------------------------------------

    def version(self, v: int) -> dict[int, dict[str, torch.Tensor]]:
        """Weight version ``v``, made from ``v - 1`` and iteration ``v - 1``'s averaged gradient
        when first asked for."""
        if v not in self.versions:
            prev = self.version(v - 1)
            new = {s: dict(ws) for s, ws in prev.items()}
            for (work, flat), (_, keys) in zip(self._updates.pop(v), self.groups, strict=True):
                if work is not None:
                    work.wait()
                g = flat / self.workers
                offset = 0
                for s, n in keys:
                    old = prev[s][n]
                    k = old.numel()
                    new[s][n] = (old.detach() - self.lr * g[offset:offset + k].view_as(old)).requires_grad_(True)
                    offset += k
            self.versions[v] = new
            keep = {v, v - 1, *self._used.values()}
            for old_v in [k for k in self.versions if k not in keep]:
                del self.versions[old_v]
        return self.versions[v]

    # -- compute on a stashed version -------------------------------------------------------

    def _forward(self, j: int, s: int) -> None:
        key = (j, s)
        v = max(j // self.m - 1, 0)
        weights = self.version(v)[s]
        self._used[key] = v
        self._stashed_forward(j, s, weights)

    def _weights(self) -> Iterator[torch.Tensor]:
        for version in self.versions.values():
            for ws in version.values():
                yield from ws.values()

    def _stashed(self, key: tuple[int, int], s: int) -> dict[str, torch.Tensor]:
        """The weights micro-batch ``key``'s forward on stage ``s`` used (no longer kept here)."""
        return self.versions[self._used.pop(key)][s]

    # -- updates ----------------------------------------------------------------------------

    def step(self, version: int = -1) -> None:
        """``STEP`` creating ``version``: start averaging iteration ``version - 1``'s gradient."""
        c = version - 1
        # sends in flight may wait for a receiver that is still busy: drop only finished ones
        self._pending = [(w, b) for w, b in self._pending if w is not None and not w.is_completed()]
        self.push_times[c] = time.perf_counter()
        acc = self._grads.pop(c, {})
        latest = self.versions[max(self.versions)]
        updates = []
        for group, keys in self.groups:
            flat = torch.cat([acc[(s, n)].reshape(-1) if (s, n) in acc else torch.zeros_like(latest[s][n]).reshape(-1)
                              for s, n in keys])
            work = dist.all_reduce(flat, group=group, async_op=True) if group is not None else None
            updates.append((work, flat))
        self._updates[version] = updates
        if any(s == self.num_stages - 1 for s in self.stages):
            self.losses.append(float(self._loss_sum))
        self._loss_sum = 0.0

    def drain(self, steps: int) -> None:
        """The end of a run: wait for the sends and make the last version, ``W(steps)``."""
        self.wait_sends()
        self.version(steps)

    def load_into_modules(self, steps: int) -> None:
        """Copy version ``W(steps)`` into the stage modules (for saving them)."""
        last = self.version(steps)
        with torch.no_grad():
            for s, mod in self.stages.items():
                for n, p in mod.named_parameters():
                    p.copy_(last[s][n])
