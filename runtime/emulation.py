"""The executors' one hook for heterogeneity emulation (``train --emulate``).

:class:`Stretch` holds one rank's factors from :class:`partitioner.emulation.Emulation` (the
rule is documented there). Every executor (:class:`runtime.executor.PipelineExecutor` and its
WSP and 2BW subclasses) calls :meth:`Stretch.hold` right after each forward or backward
action: the rank sleeps until the action's wall time, measured from its start, is its target:
the stage's emulated time when it computed faster than that (rule ``profiled``), or its measured
compute time times the stage's factor (rule ``scaled``). Only this module sleeps; the
executors stay unaware of GPU types.

:class:`LinkDelay` emulates the links (``train --emulate-links``): a collective between virtual
workers (the gradient all-reduce of synchronous data parallelism, WSP's push) that this machine
completed faster than its emulated seconds completes, when its result is waited for, at the
latest member's start plus those seconds. The members' starts are all-reduced (maximum) beside
the data, stamped with ``time.time`` (one clock for every process of a machine). An
asynchronous collective keeps overlapping the compute that runs until it is waited for, as on
the real links.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from partitioner.emulation import EMULATION_RULES, Emulation

__all__ = ["LinkDelay", "PendingCollective", "Stretch"]


class Stretch:
    """Stretch the compute of the stages of one rank: ``factors[stage] = (forward, backward)``
    (rule ``scaled``) or ``targets_s[stage] = (forward, backward)`` seconds (rule ``profiled``).
    ``weight_shares[stage]``: the weight-gradient part of the stage's backward, which divides the
    backward's target between a split backward's ``I`` and ``W`` (:meth:`split_share`).

    ``sync`` is called before the compute time is read (``torch.cuda.synchronize`` on a GPU,
    whose kernels run asynchronously; nothing on the CPU). ``overruns`` counts the actions that
    computed for longer than their target under ``profiled``.
    """

    def __init__(self, factors: Mapping[int, tuple[float, float]],
                 targets_s: Mapping[int, tuple[float, float]] | None = None, rule: str = "profiled",
                 sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                 weight_shares: Mapping[int, float] | None = None):
        if rule not in EMULATION_RULES:
            raise ValueError(f"rule {rule!r}: must be one of {', '.join(EMULATION_RULES)}")
        for stage, pair in factors.items():
            if len(pair) != 2 or not all(f >= 1.0 for f in pair):
                raise ValueError(f"stage {stage}: factors {pair!r} must be two numbers >= 1")
        if rule == "profiled" and (targets_s is None or set(targets_s) != set(factors)):
            raise ValueError("rule profiled needs the target seconds of every stage")
        for stage, w in (weight_shares or {}).items():
            if not 0.0 <= w <= 1.0:
                raise ValueError(f"stage {stage}: weight share {w!r} must be in [0, 1]")
        self.factors = dict(factors)
        self.weight_shares = dict(weight_shares or {})
        self.targets = dict(targets_s or {})
        self.rule = rule
        self.sync = sync
        self.clock = clock
        self.sleep = sleep
        self.overruns = 0
        self.actions = 0

    @classmethod
    def for_device(cls, emulation: Emulation, device: str, sync: Callable[[], None] | None = None) -> Stretch:
        return cls(emulation.factors(device), emulation.targets_s(device), emulation.rule, sync,
                   weight_shares=emulation.weight_shares(device))

    def split_share(self, stage: int, weight: bool) -> float:
        """The part of ``stage``'s backward target that a split backward's ``W`` (``weight``) or
        ``I`` takes: the stage's weight share as the model splits it (half when not given)."""
        w = self.weight_shares.get(stage, 0.5)
        return w if weight else 1.0 - w

    def target_s(self, stage: int, backward: bool, compute_s: float, share: float = 1.0) -> float:
        """The wall time an action of ``stage`` that computed for ``compute_s`` seconds must take;
        ``share``: the part of a micro-batch it computes (``1 / s`` for a slice of a sliced first
        micro-batch, which the simulator prices at ``1 / s`` of the stage's time)."""
        k = 1 if backward else 0
        if self.rule == "scaled":
            return compute_s * self.factors[stage][k]
        return max(compute_s, self.targets[stage][k] * share)

    def hold(self, stage: int, backward: bool, started: float, share: float = 1.0) -> tuple[float, float]:
        """Called when a forward (``backward`` False) or backward action of ``stage``, started at
        ``started`` (this object's clock), has computed (``share`` of a micro-batch, see
        :meth:`target_s`): sleeps until its wall time is its target. Returns (compute seconds,
        seconds slept)."""
        if self.sync is not None:
            self.sync()
        now = self.clock()
        compute = now - started
        target = self.target_s(stage, backward, compute, share)
        self.actions += 1
        if self.rule == "profiled" and compute > self.targets[stage][1 if backward else 0] * share:
            self.overruns += 1
        deadline = started + target
        # sleep in one call, then top up what an early wake-up left (sleep may return early on signals)
        while (left := deadline - now) > 0:
            self.sleep(left)
            now = self.clock()
        return compute, now - started - compute


@dataclass
class PendingCollective:
    """An all-reduce started by :meth:`LinkDelay.start`: its work, the work of the members'
    latest start, and its emulated seconds (``None``: not emulated, this machine's time)."""

    work: Any
    stamp_work: Any
    stamp: torch.Tensor | None
    seconds: float | None


class LinkDelay:
    """Start all-reduces and wait for them as the emulated links would take them.

    ``seconds_of(ranks)`` gives the emulated seconds of the all-reduce over those ranks (None
    when it is not emulated). ``slept_s`` sums the seconds slept.
    """

    def __init__(self, seconds_of: Callable[[tuple[int, ...]], float | None],
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep):
        self.seconds_of = seconds_of
        self.clock = clock
        self.sleep = sleep
        self.slept_s = 0.0

    def start(self, buf: torch.Tensor, group: Any, ranks: tuple[int, ...],
              op: Callable[[], Any] | None = None) -> PendingCollective:
        """Start the sum all-reduce of ``buf`` over ``group`` (``ranks``), or the collective ``op``
        starts (asynchronous, returning its work; ZeRO's reduce-scatter), and beside it the maximum
        of the members' start times when it is emulated (the all-reduce's seconds either way)."""
        seconds = self.seconds_of(ranks)
        stamp = stamp_work = None
        if seconds is not None:
            stamp = torch.tensor([self.clock()], dtype=torch.float64, device=buf.device)
            stamp_work = dist.all_reduce(stamp, op=dist.ReduceOp.MAX, group=group, async_op=True)
        work = dist.all_reduce(buf, group=group, async_op=True) if op is None else op()
        return PendingCollective(work, stamp_work, stamp, seconds)

    def wait(self, pending: PendingCollective) -> float:
        """Wait for ``pending``; when emulated, sleep until the latest member's start plus its
        seconds. Returns the seconds slept."""
        if pending.work is not None:
            pending.work.wait()
        if pending.seconds is None or pending.stamp is None:
            return 0.0
        pending.stamp_work.wait()
        deadline = float(pending.stamp.item()) + pending.seconds
        slept = 0.0
        while (left := deadline - self.clock()) > 0:
            self.sleep(left)
            slept += left
        self.slept_s += slept
        return slept

    @classmethod
    def for_ranks(cls, emulation: Emulation, devices: Mapping[int, str]) -> LinkDelay:
        """The delays of ``emulation`` for a run whose rank ``r`` plays ``devices[r]``."""
        return cls(lambda ranks: emulation.collective_s(devices[r] for r in ranks))
