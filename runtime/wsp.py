"""Wave Synchronous Parallel: the ``wsp`` schedule's PUSH / PULL with staleness ``D``.

A wave is one iteration of ``m`` micro-batches. The rule this executor implements (HetPipe's
WSP with plain SGD, learning rate ``lr``):

* Every micro-batch's forward uses the rank's current *local* weights, and its backward the
  same weights (weight stashing: an update makes new weight tensors; the autograd graph of a
  micro-batch in flight keeps the ones it used).
* The gradients of wave ``c`` (loss of each micro-batch divided by ``m``) are summed into the
  wave's update ``u_c``. A replicated stage's replicas each run a share of the wave's
  micro-batches (as under 1F1B, ``Layout.actions``): the worker's ``u_c`` is the sum of their
  partial updates, which ``PUSH(c)`` forms first with a (blocking) all-reduce over the replicas.
* ``PUSH(c)``: start an asynchronous all-reduce of ``u_c`` over the holders of the same layers
  in the other virtual workers (the parameter server of those layers; a replicated stage's
  replicas each push their partial update, so the sum over all holders is the sum over the
  workers of their ``u_c``), and apply it locally: ``w_local -= lr * u_c``.
* ``PULL(c')``: wait until that all-reduce of wave ``c'`` is complete (every virtual worker
  has pushed ``c'``), add ``-lr * mean_w u_c'`` to the global weights, and reset
  ``w_local = w_global - lr * (own updates of waves after c')``.

So a virtual worker that pushed wave ``c`` and pulled ``c - D`` has the global weights of
waves ``<= c - D`` plus its own later updates: it runs at most ``D`` waves ahead of the
slowest one. With ``D = 0`` and one pipeline position per virtual worker (one device, or one
stage over replicas), this is synchronous SGD on the global batch. At the end of a run every outstanding wave is pulled, so all virtual workers
finish with the same weights.

A run that ends by time (``train --max-seconds``, one device per virtual worker) lets a fast
virtual worker run more waves than a slow one: :meth:`WspExecutor.run_waves` stops before the
first wave that would start after the common deadline, and :meth:`WspExecutor.finish` makes
the wave counts agree as a parameter server would, by pushing empty (zero) updates for the
waves a worker did not run: the global weights are every worker's pushed updates, averaged
over the workers. A stopped worker first pushes one empty wave at once, which is every wave a
worker still running can wait for before it too reaches the deadline (it can only start a wave
``D`` ahead of the last one it pulled), then all agree on the last wave with a blocking maximum.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from partitioner.schedule import Action, F

from .emulation import LinkDelay
from .executor import StashingExecutor
from .layout import Layout

__all__ = ["WspExecutor"]


class WspExecutor(StashingExecutor):
    """Executes a rank's ``wsp`` action list (see the module docstring for the update rule)."""

    def _setup(self, layout: Layout, rank: int) -> None:
        # current weights of every stage: leaf tensors, replaced (never modified) by updates
        self.leaves: dict[int, dict[str, torch.Tensor]] = self._leaf_copies()
        # the replicas of this rank's stage in its virtual worker, when it is replicated
        self.replica_group: Any = None
        for held in layout.stage_ranks:
            for ranks in held:
                if len(ranks) > 1:
                    group = dist.new_group(list(ranks))
                    if rank in ranks:
                        self.replica_group = group
        self.delay: LinkDelay | None = None  # --emulate-links: pushes take the emulated links' time
        # a run that ends by time: the wave counts are agreed over this group (every rank)
        self.stop_group = dist.new_group(list(range(layout.world_size))) if self.workers > 1 else None
        self.zero_push_times: dict[int, float] = {}
        self.pull_times: dict[int, float] = {}  # wave -> when this rank had its global weights
        self.snapshots: dict[int, dict[int, dict[str, torch.Tensor]]] | None = None  # wave -> global weights
        self.global_flat = [self._flat(keys, lambda s, n: self.leaves[s][n].detach()) for _, keys in self.groups]
        self._own: dict[int, list[torch.Tensor]] = {}  # wave -> own update per group (pushed, not pulled)
        self._works: dict[int, list[tuple[Any, torch.Tensor]]] = {}  # wave -> (pending all-reduce, buffer)
        self._used: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    @staticmethod
    def _flat(keys: list[tuple[int, str]], get: Any) -> torch.Tensor:
        return torch.cat([get(s, n).reshape(-1) for s, n in keys])

    def _unflat(self, keys: list[tuple[int, str]], flat: torch.Tensor) -> Iterator[tuple[int, str, torch.Tensor]]:
        """``(stage, name, view)``: ``flat``'s part of each parameter in ``keys``, shaped like it."""
        offset = 0
        for s, n in keys:
            like = self.leaves[s][n]
            yield s, n, flat[offset:offset + like.numel()].view_as(like)
            offset += like.numel()

    def _set_from_flat(self, keys: list[tuple[int, str]], flat: torch.Tensor) -> None:
        for s, n, part in self._unflat(keys, flat):
            self.leaves[s][n] = part.clone().requires_grad_(True)

    # -- compute with stashed weights ------------------------------------------------------

    def _forward(self, j: int, s: int) -> None:
        used = dict(self.leaves[s])  # the tensors of now: an update replaces the entries of leaves[s]
        self._used[(j, s)] = used
        self._stashed_forward(j, s, used)

    def _weights(self) -> Iterator[torch.Tensor]:
        for ws in (*self.leaves.values(), *self._used.values()):
            yield from ws.values()

    def _stashed(self, key: tuple[int, int], s: int) -> dict[str, torch.Tensor]:
        """The weights micro-batch ``key``'s forward on stage ``s`` used (no longer kept here)."""
        return self._used.pop(key)

    # -- waves -----------------------------------------------------------------------------

    def push(self, wave: int) -> None:
        # sends still in flight may wait for a receiver that waits for another worker's push:
        # keep them, dropping only those already done (all are waited for in drain)
        self._pending = [(w, b) for w, b in self._pending if w is not None and not w.is_completed()]
        self.push_times[wave] = time.time()
        acc = self._grads.pop(wave, {})
        own, works = [], []
        for (group, keys), ranks in zip(self.groups, self.group_ranks, strict=True):
            part = self._flat(keys, lambda s, n, acc=acc: acc.get((s, n), torch.zeros_like(self.leaves[s][n])))
            u = part
            if self.replica_group is not None:  # the worker's update: the sum of its replicas' parts
                u = part.clone()
                dist.all_reduce(u, group=self.replica_group)
            own.append(u)
            works.append(self._start_push(part, group, ranks))
            local = self._flat(keys, lambda s, n: self.leaves[s][n].detach()) - self.lr * u
            self._set_from_flat(keys, local)
        self._own[wave] = own
        self._works[wave] = works
        if any(s == self.num_stages - 1 for s in self.stages):
            self.losses.append(float(self._loss_sum))
        self._loss_sum = 0.0

    def _push_zero(self, wave: int) -> None:
        """An empty update for ``wave``, which this worker did not run (a run ended by time)."""
        self.zero_push_times[wave] = time.time()
        own, works = [], []
        for (group, keys), ranks in zip(self.groups, self.group_ranks, strict=True):
            u = self._flat(keys, lambda s, n: torch.zeros_like(self.leaves[s][n]))
            own.append(u)
            works.append(self._start_push(u, group, ranks))
        self._own[wave] = own
        self._works[wave] = works

    def _start_push(self, part: torch.Tensor, group: Any, ranks: tuple[int, ...]) -> tuple[Any, torch.Tensor]:
        """The asynchronous all-reduce of this rank's ``part`` over a holder set (over the emulated
        links' time when they are emulated): (its handle or None without a group, the buffer)."""
        buf = part.clone()
        if group is None:
            return None, buf
        work = (self.delay.start(buf, group, ranks) if self.delay is not None
                else dist.all_reduce(buf, group=group, async_op=True))
        return work, buf

    def run_waves(self, actions: Sequence[Action], keep_going: Callable[[int], bool]) -> int:
        """Run ``actions`` (one device per virtual worker) wave by wave, asking ``keep_going(c)``
        before the first action of every wave ``c > 0``; returns the waves run."""
        waves: list[list[Action]] = []
        for a in actions:
            if a.kind == F and (not waves or a.micro_batch // self.m >= len(waves)):
                waves.append([])
            waves[-1].append(a)
        for c, part in enumerate(waves):
            if c > 0 and not keep_going(c):
                return c
            self.run(part)
        return len(waves)

    def finish(self, waves: int) -> int:
        """End a run in which this worker ran ``waves`` waves: push empty updates up to the last
        wave of any worker plus one (agreed by a blocking maximum; see the module docstring),
        then pull every outstanding wave. Returns that last wave."""
        if self.stop_group is None:
            self.drain()
            return waves - 1
        self._push_zero(waves)  # what a worker still running may wait for
        last = torch.tensor([waves], dtype=torch.int64, device=self.device)
        dist.all_reduce(last, op=dist.ReduceOp.MAX, group=self.stop_group)
        for c in range(waves + 1, int(last.item()) + 1):
            self._push_zero(c)
        self.drain()
        return int(last.item())

    def global_weights(self) -> dict[int, dict[str, torch.Tensor]]:
        """The global weights (every pull so far), stage -> parameter name -> tensor (copies)."""
        out: dict[int, dict[str, torch.Tensor]] = {s: {} for s in self.stages}
        for gi, (_, keys) in enumerate(self.groups):
            for s, n, part in self._unflat(keys, self.global_flat[gi]):
                out[s][n] = part.clone()
        return out

    def pull(self, wave: int) -> None:
        works = self._works.pop(wave)
        self._own.pop(wave)
        for gi, (_, keys) in enumerate(self.groups):
            work, buf = works[gi]
            if self.delay is not None and work is not None:
                self.delay.wait(work)
            elif work is not None:
                work.wait()
            self.global_flat[gi] = self.global_flat[gi] - self.lr * (buf / self.workers)
            local = self.global_flat[gi].clone()
            for later in sorted(self._own):
                local -= self.lr * self._own[later][gi]
            self._set_from_flat(keys, local)
        self.pull_times[wave] = time.time()
        if self.snapshots is not None:
            self.snapshots[wave] = self.global_weights()

    def drain(self) -> None:
        """Pull every wave pushed and not yet pulled (the end of a run)."""
        self.wait_sends()
        for wave in sorted(self._works):
            self.pull(wave)

    def load_into_modules(self) -> None:
        """Copy the current weights into the stage modules (for saving them)."""
        with torch.no_grad():
            for s, mod in self.stages.items():
                for n, p in mod.named_parameters():
                    p.copy_(self.leaves[s][n])
