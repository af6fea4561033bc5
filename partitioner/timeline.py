"""The simulator's result: when every action ran, and the figures derived from it.

A :class:`Timeline` is what :func:`partitioner.simulate.simulate_plan` returns and what
:mod:`partitioner.trace` draws; it round-trips through JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import FormatError
from .schedule import ACTION_KINDS, ActionKind

__all__ = ["Timeline"]


@dataclass(frozen=True, eq=False)
class Timeline:
    """What the simulator saw: every action's start and end, and the figures derived from them.

    Events are columns (numpy arrays, one entry per action): ``event_rank`` indexes
    ``devices``, ``event_kind`` is the :attr:`~partitioner.schedule.ActionKind.code`. For a send
    the end is when the transfer arrives. ``iteration_s`` is the makespan of one iteration
    for flushing schedules, and the steady-state period for ``2bw`` and ``wsp`` (between
    iteration ends, leaving out the final drain and, under WSP, the first ``D + 1`` waves);
    with several virtual workers it is the slowest one's. Bubble fractions are measured over
    the same window. ``clock_gaps`` (WSP) is, at every ``PULL`` that lets a rank go on, its
    clock (waves it has pushed) minus the least clock of the holders of its layers in every
    virtual worker (the ranks its all-reduces wait for). Under ``overlap_iterations`` (a flushing
    schedule's iterations overlapping, ``CostOptions.overlap_iterations``) ``iteration_s`` is the
    steady state's period and ``first_iteration_s`` the end of the first iteration (its fill
    included: ``first_iteration_s - iteration_s`` is what the first iteration costs more); 0 where
    not measured apart.
    """

    schedule: str
    micro_batches: int
    micro_batch_size: int
    iterations: int
    devices: tuple[str, ...]
    rank_worker: tuple[int, ...]
    event_rank: np.ndarray
    event_kind: np.ndarray
    event_micro_batch: np.ndarray
    event_stage: np.ndarray
    event_start_s: np.ndarray
    event_end_s: np.ndarray
    makespan_s: float
    iteration_s: float
    samples_per_s: float
    bubble_fraction: Mapping[str, float] = field(default_factory=dict)
    peak_memory_bytes: Mapping[str, float] = field(default_factory=dict)
    peak_activations: Mapping[str, int] = field(default_factory=dict)
    weight_versions: Mapping[str, int] = field(default_factory=dict)
    clock_gaps: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    first_iteration_s: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.event_rank)
        for name in ("event_kind", "event_micro_batch", "event_stage", "event_start_s", "event_end_s"):
            if len(getattr(self, name)) != n:
                raise FormatError(name, len(getattr(self, name)), f"must have one entry per event ({n})")
        if len(self.rank_worker) != len(self.devices):
            raise FormatError("rank_worker", list(self.rank_worker), "must name a virtual worker per device")
        if self.iteration_s < 0 or self.makespan_s < 0 or self.first_iteration_s < 0:
            raise FormatError("iteration_s", self.iteration_s, "times must be >= 0")

    @property
    def num_events(self) -> int:
        return len(self.event_rank)

    @property
    def max_clock_gap(self) -> int:
        return max(self.clock_gaps, default=0)

    def events(self, rank: int | None = None) -> list[tuple[int, ActionKind, int, int, float, float]]:
        """``(rank, kind, micro_batch, stage, start_s, end_s)`` tuples, optionally of one rank."""
        sel = np.arange(self.num_events) if rank is None else np.flatnonzero(self.event_rank == rank)
        return [(int(self.event_rank[i]), ActionKind.from_code(int(self.event_kind[i])), int(self.event_micro_batch[i]),
                 int(self.event_stage[i]), float(self.event_start_s[i]), float(self.event_end_s[i]))
                for i in sel]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "partitioner.timeline/1",
            "schedule": self.schedule, "micro_batches": self.micro_batches,
            "micro_batch_size": self.micro_batch_size, "iterations": self.iterations,
            "devices": list(self.devices), "rank_worker": list(self.rank_worker),
            "makespan_s": self.makespan_s, "iteration_s": self.iteration_s,
            "samples_per_s": self.samples_per_s,
            "bubble_fraction": dict(self.bubble_fraction),
            "peak_memory_bytes": dict(self.peak_memory_bytes),
            "peak_activations": dict(self.peak_activations),
            "weight_versions": dict(self.weight_versions),
            "clock_gaps": list(self.clock_gaps), "notes": list(self.notes),
            **({"first_iteration_s": self.first_iteration_s} if self.first_iteration_s else {}),
            "kinds": [k.value for k in ACTION_KINDS],
            "events": {"rank": self.event_rank.tolist(), "kind": self.event_kind.tolist(),
                       "micro_batch": self.event_micro_batch.tolist(), "stage": self.event_stage.tolist(),
                       "start_s": self.event_start_s.tolist(), "end_s": self.event_end_s.tolist()},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Timeline:
        if d.get("format") != "partitioner.timeline/1":
            raise FormatError("format", d.get("format"), "expected 'partitioner.timeline/1'")
        kinds = [k.value for k in ACTION_KINDS]
        if d.get("kinds", kinds) != kinds:
            raise FormatError("kinds", d["kinds"], f"the event kind codes this version reads are {kinds}")
        ev = d["events"]
        return cls(
            d["schedule"], int(d["micro_batches"]), int(d["micro_batch_size"]), int(d["iterations"]),
            tuple(d["devices"]), tuple(d["rank_worker"]),
            np.asarray(ev["rank"], dtype=np.int32), np.asarray(ev["kind"], dtype=np.int8),
            np.asarray(ev["micro_batch"], dtype=np.int64), np.asarray(ev["stage"], dtype=np.int32),
            np.asarray(ev["start_s"], dtype=np.float64), np.asarray(ev["end_s"], dtype=np.float64),
            float(d["makespan_s"]), float(d["iteration_s"]), float(d["samples_per_s"]),
            dict(d["bubble_fraction"]), dict(d["peak_memory_bytes"]),
            {k: int(v) for k, v in d["peak_activations"].items()},
            {k: int(v) for k, v in d["weight_versions"].items()},
            tuple(d["clock_gaps"]), tuple(d["notes"]), float(d.get("first_iteration_s", 0.0)),
        )
