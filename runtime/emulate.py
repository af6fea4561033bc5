"""The executors' one hook for heterogeneity emulation (``train --emulate``).

:class:`Stretch` holds one rank's factors from :class:`partitioner.emulation.Emulation` (the
rule is documented there). Every executor (:class:`runtime.executor.PipelineExecutor` and its
WSP and 2BW subclasses) calls :meth:`Stretch.hold` right after each forward or backward
action: the rank sleeps until the action's wall time, measured from its start, is its target:
the stage's emulated time when it computed faster than that (rule ``profiled``), or its measured
compute time times the stage's factor (rule ``scaled``). Only this module sleeps; the
executors stay unaware of GPU types.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from partitioner.emulation import EMULATION_RULES, Emulation

__all__ = ["Stretch"]


class Stretch:
    """Stretch the compute of the stages of one rank: ``factors[stage] = (forward, backward)``
    (rule ``scaled``) or ``targets_s[stage] = (forward, backward)`` seconds (rule ``profiled``).

    ``sync`` is called before the compute time is read (``torch.cuda.synchronize`` on a GPU,
    whose kernels run asynchronously; nothing on the CPU). ``overruns`` counts the actions that
    computed for longer than their target under ``profiled``.
    """

    def __init__(self, factors: Mapping[int, tuple[float, float]],
                 targets_s: Mapping[int, tuple[float, float]] | None = None, rule: str = "profiled",
                 sync: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        if rule not in EMULATION_RULES:
            raise ValueError(f"rule {rule!r}: must be one of {', '.join(EMULATION_RULES)}")
        for stage, pair in factors.items():
            if len(pair) != 2 or not all(f >= 1.0 for f in pair):
                raise ValueError(f"stage {stage}: factors {pair!r} must be two numbers >= 1")
        if rule == "profiled" and (targets_s is None or set(targets_s) != set(factors)):
            raise ValueError("rule profiled needs the target seconds of every stage")
        self.factors = dict(factors)
        self.targets = dict(targets_s or {})
        self.rule = rule
        self.sync = sync
        self.clock = clock
        self.sleep = sleep
        self.overruns = 0
        self.actions = 0

    @classmethod
    def for_device(cls, emulation: Emulation, device: str, sync: Callable[[], None] | None = None) -> Stretch:
        return cls(emulation.factors(device), emulation.targets_s(device), emulation.rule, sync)

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
