"""Pipeline schedules as per-rank ordered action lists: one definition for simulator and runtime.

A pipeline has ``p`` ranks (devices) and ``S = p * v`` stages: with ``v`` chunks per device
(``interleaved``, ``bfs``), stage ``s`` runs on rank ``s % p`` as chunk ``s // p``; under ``zbv``
(two chunks in a V) chunk 0 goes down the ranks and chunk 1 comes back up, stage ``s`` on rank
``s`` for ``s < p`` and ``2p - 1 - s`` after (:func:`stage_rank`); otherwise stage ``k`` runs on
rank ``k``. :func:`build_schedule` returns, for every rank, the actions it
executes, in order:

``F`` / ``B``
    forward / backward of one micro-batch on one stage.
``I`` / ``W``
    the backward split in two (zero-bubble schedules, Qi et al. 2024; the paper calls them B and
    W, torch.distributed.pipelining ``I`` and ``W``): ``I`` computes the gradient of the stage's
    input (on the critical path: its ``SEND_GRAD`` follows it), ``W`` the gradient of the stage's
    weights, later, where the rank would otherwise idle. ``I`` then ``W`` equals one ``B``.
``SEND_ACT`` / ``RECV_ACT``
    the activation leaving stage ``s`` for stage ``s + 1`` (placed right after the ``F`` that
    produces it / right before the ``F`` that consumes it).
``SEND_GRAD`` / ``RECV_GRAD``
    the gradient leaving stage ``s`` for stage ``s - 1`` (after / before the ``B``s).
``STEP``
    optimizer step; ``version`` is the weight version it creates (2BW double buffer).
``ALLREDUCE``
    data-parallel gradient all-reduce among the devices holding the same layers, before a
    ``STEP``; ``peer`` numbers the group. Schedules do not emit it: where it goes depends on the
    plan's placement, so the simulator inserts it (``CostModel.sync_groups``) and the runtime
    runs its gradient averaging at the same point.
``PUSH`` / ``PULL``
    WSP: push this rank's accumulated update for wave ``version`` to the parameter server /
    wait until every rank of every *other* virtual worker has pushed wave ``version``, then
    pull. A rank that has pushed wave ``c`` pulls ``c - D``: it goes on only while its virtual
    worker is at most ``D`` clocks (waves) ahead of the slowest one.

Matching rule (what a runtime must do): a send and a receive match when
:func:`match_key` is equal -- ``(direction, micro_batch, sending stage)``, usable as a
message tag. For every ordered pair of ranks the sends appear on the sender in the same
order as the receives on the receiver, so FIFO point-to-point channels also match by order --
except under ``zbv``, where both chunks' messages cross each pair of ranks in both directions
and a receiver may take them in another order than they were sent: its lists match by tag only
(``FIFO_MATCHED`` lists the schedules whose lists also match by order). A runtime on an
order-matching channel posts each pair's messages in the order :mod:`partitioner.channels`
derives from the lists, which works for every schedule.
Sends are *posted* without waiting for the receiver (``isend``; the buffer is released once
the transfer is done) and receives block. Under those semantics every list produced here is
deadlock-free when each rank runs its list in order (the simulator checks this and names the
ranks of any wait cycle). A runtime with rendezvous-blocking sends would deadlock on 1F1B
(two neighbours each sending first), so it must not execute sends synchronously.

Micro-batches are numbered globally across iterations: in a run of ``iterations``
iterations of ``m`` micro-batches, micro-batch ``j`` belongs to iteration ``j // m``.
Flushing schedules (``gpipe``, ``1f1b``, ``interleaved``, ``bfs``) simply repeat; ``2bw``
and ``wsp`` run the 1F1B steady state across iteration boundaries without a flush.
"""

from __future__ import annotations

import enum
import functools
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from .errors import FormatError

__all__ = [
    "ACTION_KINDS",
    "ALLREDUCE",
    "COMPUTE_KINDS",
    "DEFAULT_MICRO_BATCHES",
    "FIRST_SLICES",
    "PULL",
    "PUSH",
    "RECV_ACT",
    "RECV_GRAD",
    "SCHEDULES",
    "SCHEDULE_NAMES",
    "SEND_ACT",
    "SEND_GRAD",
    "STEP",
    "Action",
    "ActionKind",
    "B",
    "Columns",
    "F",
    "I",
    "MicroBatching",
    "Schedule",
    "ScheduleSpec",
    "W",
    "build_schedule",
    "check_schedule",
    "describe",
    "first_slice_counts",
    "match_key",
    "schedule_columns",
    "spec",
    "stage_rank",
    "to_actions",
]

class ActionKind(str, enum.Enum):
    """What an action does (the module docstring says each one's meaning): the one definition of
    the kinds, their codes and their names.

    A ``str`` enum: a kind equals its name (``ActionKind.F == "F"``), the token of the compact
    form of an :class:`Action` (``2F0``). :attr:`code` is its code in the ``kind`` column of
    :func:`schedule_columns` and of a timeline (its index in :data:`ACTION_KINDS`); :attr:`label`
    says it in words; :attr:`category` is the kind of work it is: ``forward``, ``backward``,
    ``send``, ``wait`` (a receive), ``step`` (the optimizer), ``allreduce`` (a collective among
    the devices holding the same layers) or ``wsp`` (WSP's push and pull).
    """

    _value_: str
    code: int
    label: str
    category: str

    def __new__(cls, name: str, code: int, label: str, category: str) -> ActionKind:
        member = str.__new__(cls, name)
        member._value_ = name
        member.code = code
        member.label = label
        member.category = category
        return member

    F = ("F", 0, "forward", "forward")
    B = ("B", 1, "backward", "backward")
    SEND_ACT = ("SEND_ACT", 2, "activation send", "send")
    RECV_ACT = ("RECV_ACT", 3, "activation receive", "wait")
    SEND_GRAD = ("SEND_GRAD", 4, "gradient send", "send")
    RECV_GRAD = ("RECV_GRAD", 5, "gradient receive", "wait")
    STEP = ("STEP", 6, "optimizer step", "step")
    PUSH = ("PUSH", 7, "WSP push", "wsp")
    PULL = ("PULL", 8, "WSP pull", "wsp")
    ALLREDUCE = ("ALLREDUCE", 9, "gradient all-reduce", "allreduce")
    I = ("I", 10, "input-gradient backward", "backward")  # noqa: E741 - torch's name for the paper's B
    W = ("W", 11, "weight-gradient backward", "backward")

    def __str__(self) -> str:
        return self.value

    def __format__(self, format_spec: str) -> str:
        return format(self.value, format_spec)

    @classmethod
    def from_code(cls, code: int) -> ActionKind:
        """The kind of a ``kind`` column entry."""
        return ACTION_KINDS[code]


ACTION_KINDS: tuple[ActionKind, ...] = tuple(sorted(ActionKind, key=lambda k: k.code))
"""Every kind, indexed by its :attr:`ActionKind.code`."""
F, B = ActionKind.F, ActionKind.B
SEND_ACT, RECV_ACT = ActionKind.SEND_ACT, ActionKind.RECV_ACT
SEND_GRAD, RECV_GRAD = ActionKind.SEND_GRAD, ActionKind.RECV_GRAD
STEP, PUSH, PULL, ALLREDUCE = ActionKind.STEP, ActionKind.PUSH, ActionKind.PULL, ActionKind.ALLREDUCE
I, W = ActionKind.I, ActionKind.W  # noqa: E741
COMPUTE_KINDS = (F, B, I, W)
# the ``kind`` column's codes, for the vectorised builders below
_F, _B, _STEP, _PUSH, _PULL = F.code, B.code, STEP.code, PUSH.code, PULL.code
_I, _W = I.code, W.code
_SEND_ACT, _RECV_ACT, _SEND_GRAD, _RECV_GRAD = SEND_ACT.code, RECV_ACT.code, SEND_GRAD.code, RECV_GRAD.code


@dataclass(frozen=True)
class ScheduleSpec:
    """What the rest of the library needs to know about a schedule, said once.

    ``flushes``: an iteration ends with every micro-batch's backward done (GPipe, 1F1B,
    interleaved, breadth-first); 2BW and WSP run the steady state across iterations.
    ``multi_chunk``: a device may hold several stages (``chunks`` > 1). ``weight_versions``:
    copies of the weights a stage keeps. ``all_forwards_first``: every micro-batch's forward
    precedes the first backward (GPipe), so a stage holds all ``m`` micro-batches' activations;
    otherwise 1F1B-style, ``min(p - k, m)`` on stage ``k`` of ``p`` (one-chunk schedules).
    ``sync``: how virtual workers synchronise, ``allreduce`` of gradients before every step or
    ``wave`` (WSP's push and pull with staleness). ``sliceable``: the first micro-batch may be
    sliced (AutoPipe) to shorten the fill. ``breadth_first``: a device runs every micro-batch
    through one chunk before the next (multi-chunk schedules). ``executor``: which runtime
    executor runs its action lists (``pipeline``, ``2bw`` or ``wsp``, see :mod:`runtime`).
    ``split_backward``: the backward runs as ``I`` then ``W`` (the zero-bubble schedules).
    ``weight_fill``: on equal stages, the weight-gradient passes per bubble slot the schedule moves
    into 1F1B's bubble (ZB-H1 2, ZB-H2 3: :meth:`Schedule.uniform_bubble_s`); 0 for the others.
    ``placement``: how stages are dealt to ranks, ``loop`` (stage ``s`` on rank ``s % p``) or
    ``v`` (ZB-V's V shape, :func:`stage_rank`); ``chunks``: the chunk count the schedule requires
    (``zbv``: 2), None for any.
    """

    name: str
    flushes: bool
    multi_chunk: bool = False
    weight_versions: int = 1
    all_forwards_first: bool = False
    sync: str = "allreduce"
    sliceable: bool = False
    breadth_first: bool = False
    executor: str = "pipeline"
    split_backward: bool = False
    weight_fill: int = 0
    placement: str = "loop"
    chunks: int | None = None

    def activations_in_flight(self, stages_from_end: int, micro_batches: int) -> int:
        """Micro-batches whose activations stage ``p - stages_from_end`` holds at its peak
        (one-chunk schedules; the simulator measures the multi-chunk ones).

        Zero-bubble schedules: the micro-batches whose whole activations (Qi et al.'s ``M_B``) the
        stage holds before their ``I`` (ZB-H1 as 1F1B, ZB-H2 ``2 (p - k) - 1``); those between their
        ``I`` and ``W`` hold ``M_W`` more each (:meth:`partitioner.cost.CostModel.weight_grad_bytes`),
        which the simulator counts (its peak memory decides whether a zero-bubble plan fits)."""
        if self.multi_chunk:
            raise FormatError("schedule", self.name, "activations in flight per stage are defined here for "
                              "one-chunk schedules; interleaved, bfs and zbv are priced by the simulator")
        if self.all_forwards_first:
            return micro_batches
        return min(self.warmup(stages_from_end) + 1, micro_batches)

    def warmup(self, stages_from_end: int) -> int:
        """Forwards a one-chunk 1F1B-style rank runs before its first backward (uncapped): 1F1B and
        ZB-H1 ``p - k - 1``, ZB-H2 ``2 (p - k - 1)`` (Qi et al.'s extra warm-up forwards)."""
        return (2 if self.weight_fill == 3 else 1) * (stages_from_end - 1)

    def rank_of(self, stage: int, ranks: int) -> int:
        """The pipeline rank of ``stage`` among ``ranks`` devices under this schedule's placement."""
        return stage_rank(stage, ranks, self.placement)


SCHEDULES: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("gpipe", flushes=True, all_forwards_first=True, sliceable=True),
    ScheduleSpec("1f1b", flushes=True, sliceable=True),
    ScheduleSpec("interleaved", flushes=True, multi_chunk=True),
    ScheduleSpec("bfs", flushes=True, multi_chunk=True, breadth_first=True),
    ScheduleSpec("2bw", flushes=False, weight_versions=2, executor="2bw"),
    ScheduleSpec("wsp", flushes=False, sync="wave", executor="wsp"),
    ScheduleSpec("zb-h1", flushes=True, split_backward=True, weight_fill=2),
    ScheduleSpec("zb-h2", flushes=True, split_backward=True, weight_fill=3),
    ScheduleSpec("zbv", flushes=True, multi_chunk=True, split_backward=True, placement="v", chunks=2),
)}
SCHEDULE_NAMES = tuple(SCHEDULES)
FIFO_MATCHED = tuple(n for n, s in SCHEDULES.items() if s.placement == "loop")
NO_FLUSH = tuple(n for n, s in SCHEDULES.items() if not s.flushes)
MULTI_CHUNK = tuple(n for n, s in SCHEDULES.items() if s.multi_chunk)


def spec(schedule: str) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of a schedule name (a one-line error for an unknown one)."""
    try:
        return SCHEDULES[schedule]
    except (KeyError, TypeError):
        raise FormatError("schedule", schedule, f"must be one of {', '.join(SCHEDULES)}") from None


FIRST_SLICES = (1, 2, 4)  # the slice counts the planners try for a plan's first micro-batch


def first_slice_counts(schedule: str, micro_batch_size: int, micro_batches: int) -> tuple[int, ...]:
    """The slice counts of :data:`FIRST_SLICES` a plan may cut its first micro-batch into: those
    that divide its size, on a sliceable schedule, where the worker runs two micro-batches or more
    (so its last one is whole, which the planners' bounds use; one micro-batch in slices is a
    smaller size, which they try as such)."""
    if not spec(schedule).sliceable or micro_batches < 2:
        return (1,)
    return tuple(s for s in FIRST_SLICES if micro_batch_size % s == 0)


# The micro-batches per iteration when a caller gives none: a cluster of virtual workers (the
# cluster planner, its baselines, compare) runs 8; one pipeline over p devices (the dp, cpsat and
# milp solvers) runs p, which fills it once.
DEFAULT_MICRO_BATCHES = 8


@dataclass(frozen=True)
class Schedule:
    """A schedule as an iteration runs it: its :class:`ScheduleSpec` and the ``micro_batches`` it
    runs per iteration. What pricing a pipeline asks of the pair is said here, once; the solvers,
    the cost model and the bounds pass this object down instead of a name and a count.

    ``overlap``: a flushing schedule's iterations overlap (``CostOptions.overlap_iterations``:
    each rank starts its next iteration right after its own step), so an iteration costs the
    steady state's period (:meth:`overlapped_bubble_s`) rather than a fill and a drain.

    ``Schedule.of("1f1b", 8)`` (an unknown name is a one-line error).
    """

    spec: ScheduleSpec
    micro_batches: int
    overlap: bool = False

    def __post_init__(self) -> None:
        m = self.micro_batches
        if not (isinstance(m, int) and not isinstance(m, bool) and m >= 1):
            raise FormatError("micro_batches", m, "must be an integer >= 1")
        if not isinstance(self.overlap, bool):
            raise FormatError("overlap", self.overlap, "must be true or false")

    @classmethod
    def of(cls, name: str, micro_batches: int, overlap: bool = False) -> Schedule:
        return cls(spec(name), micro_batches, overlap)

    @property
    def name(self) -> str:
        return self.spec.name

    def __str__(self) -> str:
        return self.name

    @property
    def weight_versions(self) -> int:
        """Copies of the weights a stage keeps: 2 for PipeDream-2BW's double buffer, else 1."""
        return self.spec.weight_versions

    @property
    def wave_sync(self) -> bool:
        """Workers synchronise by WSP's waves (push and pull), not by an all-reduce per step."""
        return self.spec.sync == "wave"

    def activations_in_flight(self, stages_from_end: int) -> int:
        """Micro-batches whose activations a stage holds at its peak (one-chunk schedules):
        ``stages_from_end`` counts the stage itself, so the last stage has 1."""
        return self.spec.activations_in_flight(stages_from_end, self.micro_batches)

    def iteration_s(self, stage_times_s: Sequence[float]) -> float:
        """The closed form of one iteration of a pipeline whose stages take ``stage_times_s`` per
        micro-batch, with no transfers: flushing schedules (GPipe, 1F1B) pay a fill and a drain,
        ``sum(t) + (m - 1) * max(t)``; 2BW and WSP do not flush, ``m * max(t)`` in steady state.
        The simulator times every schedule exactly (docs/schedules.md checks one against the other
        on uniform stages); the solvers price plans with :meth:`partitioner.cost.CostModel.plan_iteration_s`.
        """
        if not stage_times_s:
            return 0.0
        bottleneck = max(stage_times_s)
        if not self.spec.flushes:
            return self.micro_batches * bottleneck
        return float(sum(stage_times_s) + (self.micro_batches - 1) * bottleneck)

    def with_micro_batches(self, micro_batches: int) -> Schedule:
        return Schedule(self.spec, micro_batches, self.overlap)

    def uniform_bubble_s(self, ranks: int, fwd_s: float, input_s: float, weight_s: float,
                         chunks: int = 1) -> float | None:
        """Idle seconds of every rank in one iteration of ``ranks`` equal stages (per device, no
        transfers; ``input_s + weight_s`` is the backward, ``chunks`` the stages per device, each
        taking its share), where a closed form is exact; None where the simulator decides. With
        :attr:`overlap` (iterations overlap, :meth:`overlapped_bubble_s`) the idle time of one period
        of the steady state.

        With ``p`` ranks and ``F, B, W`` a device's forward, input-gradient and weight-gradient
        seconds (``m >= p``; interleaved: ``m`` a multiple of ``p``): GPipe and 1F1B ``(p - 1)(F + B
        + W)``, interleaved ``(p - 1)(F + B + W) / v`` (Narayanan et al.), ZB-H1 ``(p - 1) max(F + B
        - W, F)`` and ZB-H2 ``(p - 1) max(F + B - 2W, F)``: Qi et al.'s ``(p - 1)(F + B - W)`` and
        ``(p - 1)(F + B - 2W)`` where ``W`` is small enough, and otherwise the last rank's forward
        fill ``(p - 1) F``, which an iteration that ends with a flush (every rank's ``STEP`` after its
        last ``W``) cannot hide (the paper reaches zero for ZB-H2 by overlapping iterations, its
        post-validation); ZB-V at ``F = B = W``, the case Qi et al. call zero bubble, ``(p - 1) F / 2``
        (the same fill, one chunk's forward), and at any ratio (``p >= 2``, ``m >= 2p - 1``; 0 for
        ``p = 1``) the largest of ``(p - 1)(B - W)``, ``(p - 1) B / 2``, ``(p - 2) W / 2 + max(F, B)
        / 2``, ``(p - 1)(F - B / 2) - d`` and ``(p - 1)(F - W) - d`` with ``d = min(W, max(F - B,
        0)) / 2``: fitted to the simulator's idle time of the V order (linear in ``p`` at every
        ratio, the same for every ``m >= 2p - 1``), not derived; below ``m = 2p - 1`` (the order is
        built for ``2p - 1`` micro-batches and cut) the simulator decides. tests/test_zero_bubble.py
        checks each against the simulator (ZB-V at random ratios, ``p`` and ``m``)."""
        if self.overlap and self.spec.flushes:
            return self.overlapped_bubble_s(ranks, fwd_s, input_s, weight_s, chunks)
        p, f, b, w = ranks, fwd_s, input_s, weight_s
        name = self.name
        if name in ("gpipe", "1f1b"):
            return (p - 1) * (f + b + w)
        if name == "interleaved":
            return (p - 1) * (f + b + w) / chunks
        if self.spec.weight_fill:  # ZB-H1, ZB-H2: 1F1B's bubble less the W moved into it, down to the fill
            return (p - 1) * max(f + b + w - self.spec.weight_fill * w, f)
        if name == "zbv":
            return self._zbv_bubble_s(p, f, b, w)
        return None

    def overlapped_bubble_s(self, ranks: int, fwd_s: float, input_s: float, weight_s: float,
                            chunks: int = 1) -> float | None:
        """Idle seconds of every rank per period when iterations overlap (``CostOptions.
        overlap_iterations``: each rank starts its next iteration's forwards right after its own
        step), on ``ranks`` equal stages as :meth:`uniform_bubble_s`; the period is ``m (F + B + W)``
        plus this. None where the simulator decides.

        GPipe, 1F1B and interleaved: their flushing idle time (the first rank ends each iteration
        with the last backward, which the next iteration's forwards wait for: overlap gains
        nothing). ZB-H1 (``m >= p``): ``(p - 1) max(F + B - W, B)``, Qi et al.'s ``(p - 1)(F + B - W)``
        where ``W <= F``. ZB-H2 (``m >= 2p - 1``): ``(p - 1) max(F + B - 2W, B - F, 0)``, the paper's
        ``(p - 1)(F + B - 2W)``, zero bubble at ``F = B = W``. ZB-V (``m >= 2p - 1``; 0 for ``p = 1``):
        the largest of 0, ``(p - 1)(B - W)``, ``(p - 1)(B - F) / 2``, ``(p - 2)(W - F) / 2``, ``(p -
        2)(F - B) / 2``, ``((p - 2) W + B - (p - 1) F) / 2``, ``((2p - 3) F + B) / 2 - (p - 1) W``,
        ``(p - 1)(2F - B - W) / 2`` and ``(p - 1) F - (2p - 1) W / 2``: zero at ``F = B = W``. The
        period of a fixed order is the largest cycle mean of its dependency graph, so it is the
        largest of linear forms in ``F, B, W``; for ZB-H1, ZB-H2 and ZB-V these forms are the
        gradients the simulator showed on random ratios for ``p`` = 2 to 6, not derived, then
        checked on 300 random ratios (0.05 to 5), ``p`` 1 to 7 and ``m`` from the bound to twice
        it each (tests/test_zero_bubble.py checks them with hypothesis). ZB-H1 and ZB-H2 run
        their order built for ``T_F = T_B = T_W``; the ``B - F`` and ``B`` terms are what that fixed
        order loses elsewhere, where the paper's solver would reorder."""
        p, f, b, w, m = ranks, fwd_s, input_s, weight_s, self.micro_batches
        name = self.name
        if name in ("gpipe", "1f1b", "interleaved"):
            return replace(self, overlap=False).uniform_bubble_s(p, f, b, w, chunks)
        if name == "zb-h1":
            return (p - 1) * max(f + b - w, b) if m >= p else None
        if name == "zb-h2":
            return (p - 1) * max(f + b - 2 * w, b - f, 0.0) if m >= 2 * p - 1 else None
        if name == "zbv":
            if p == 1:
                return 0.0
            if m < 2 * p - 1:
                return None
            return max(0.0, (p - 1) * (b - w), (p - 1) * (b - f) / 2, (p - 2) * (w - f) / 2, (p - 2) * (f - b) / 2,
                       ((p - 2) * w + b - (p - 1) * f) / 2, ((2 * p - 3) * f + b) / 2 - (p - 1) * w,
                       (p - 1) * (2 * f - b - w) / 2, (p - 1) * f - (2 * p - 1) * w / 2)
        return None

    def _zbv_bubble_s(self, p: int, f: float, b: float, w: float) -> float | None:
        """ZB-V's idle time per device on equal stages (:meth:`uniform_bubble_s`)."""
        if p == 1:
            return 0.0
        if self.micro_batches < 2 * p - 1:
            return None
        d = min(w, max(f - b, 0.0)) / 2
        return max((p - 1) * (b - w), (p - 1) * b / 2, (p - 2) * w / 2 + max(f, b) / 2,
                   (p - 1) * (f - b / 2) - d, (p - 1) * (f - w) - d)


@dataclass(frozen=True)
class MicroBatching:
    """An iteration's micro-batches as the action lists number them.

    ``micro_batches`` micro-batches of ``size`` samples, the first split into ``first_slices``
    slices of ``size / first_slices`` samples (AutoPipe's slicing, which shortens the fill). The
    lists run :attr:`count` ``= micro_batches - 1 + first_slices`` micro-batches per iteration:
    index ``i < first_slices`` (modulo :attr:`count`) is slice ``i`` of the first micro-batch,
    index ``first_slices + k`` is whole micro-batch ``k + 1``. The simulator prices a slice at
    ``1 / first_slices`` of a micro-batch; the runtime feeds it its rows (:meth:`rows`) and
    weights its loss by its share of the samples (:meth:`loss_divisor`).
    """

    micro_batches: int
    size: int
    first_slices: int = 1

    def __post_init__(self) -> None:
        for name in ("micro_batches", "size", "first_slices"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise FormatError(name, v, "must be an integer >= 1")
        if self.size % self.first_slices:
            raise FormatError("first_slices", self.first_slices, f"must divide the micro-batch size {self.size}")

    @property
    def count(self) -> int:
        """Micro-batches the action lists run per iteration (a slice counts as one)."""
        return self.micro_batches - 1 + self.first_slices

    def is_slice(self, j: int) -> bool:
        """Whether list micro-batch ``j`` (numbered across iterations) is a slice."""
        return self.first_slices > 1 and j % self.count < self.first_slices

    def rows(self, j: int) -> tuple[int, int]:
        """``[start, stop)``: the samples of list micro-batch ``j`` among its iteration's
        ``micro_batches * size`` samples of one virtual worker."""
        i, s = j % self.count, self.first_slices
        if i < s:
            return i * (self.size // s), (i + 1) * (self.size // s)
        start = (i - s + 1) * self.size
        return start, start + self.size

    def loss_divisor(self, j: int) -> int:
        """What the loss of list micro-batch ``j`` (a mean over its samples) is divided by so that
        the iteration's losses add up to the mean over all its samples: ``micro_batches``, times
        ``first_slices`` for a slice."""
        return self.micro_batches * (self.first_slices if self.is_slice(j) else 1)


class Action(NamedTuple):
    """One step of a rank's program. Immutable; a tuple so that 10^5 of them stay cheap.

    ``stage`` is the pipeline stage the action belongs to (for sends and receives: the stage
    of the rank executing it); ``peer`` is the other rank of a send or receive (-1 otherwise);
    ``version`` is the weight version (``STEP``) or the WSP clock (``PUSH``/``PULL``).
    """

    kind: ActionKind
    micro_batch: int = -1
    stage: int = -1
    peer: int = -1
    version: int = -1

    def __repr__(self) -> str:
        """The compact form ``[stage]KIND[micro_batch][(version)][@peer]``, fields at -1 left
        out: ``2F0`` (stage 2's forward of micro-batch 0), ``1SEND_ACT3@2``, ``STEP(1)``,
        ``ALLREDUCE(1)@0`` (sync group 0). :meth:`from_str` reads it back."""
        return "".join((str(self.stage) if self.stage >= 0 else "", str(self.kind),
                        str(self.micro_batch) if self.micro_batch >= 0 else "",
                        f"({self.version})" if self.version >= 0 else "",
                        f"@{self.peer}" if self.peer >= 0 else ""))

    def __str__(self) -> str:
        return self.__repr__()

    @classmethod
    def from_str(cls, text: str) -> Action:
        """The action whose compact form (:meth:`__repr__`) is ``text``."""
        m = _COMPACT.fullmatch(text.strip())
        if m is None or m["kind"] not in ActionKind.__members__:
            raise FormatError("action", text, f"must read [stage]KIND[micro_batch][(version)][@peer] with KIND "
                              f"one of {', '.join(ActionKind.__members__)}, e.g. 2F0, STEP(1)")

        def number(group: str) -> int:
            return int(m[group]) if m[group] is not None else -1

        return cls(ActionKind[m["kind"]], number("micro_batch"), number("stage"), number("peer"), number("version"))


_COMPACT = re.compile(r"(?P<stage>\d+)?(?P<kind>[A-Z_]+)(?P<micro_batch>\d+)?(?:\((?P<version>\d+)\))?(?:@(?P<peer>\d+))?")


def stage_rank(stage: int, ranks: int, placement: str = "loop") -> int:
    """The rank holding ``stage`` when stages are dealt over ``ranks`` devices: round-robin
    (``loop``: chunk ``c = stage // ranks`` of every rank in rank order), or in a V (``v``, ZB-V:
    even chunks go down the ranks, odd ones come back up, so stage ``p - 1`` and stage ``p`` share
    the last rank and stage ``2p - 1``, the loss, is on rank 0 beside stage 0)."""
    c, d = divmod(stage, ranks)
    return ranks - 1 - d if placement == "v" and c % 2 else d


def match_key(action: Action) -> tuple[str, int, int]:
    """``(direction, micro_batch, sending stage)``: equal for a send and its receive."""
    k = action.kind
    if k == SEND_ACT:
        return ("act", action.micro_batch, action.stage)
    if k == RECV_ACT:
        return ("act", action.micro_batch, action.stage - 1)
    if k == SEND_GRAD:
        return ("grad", action.micro_batch, action.stage)
    if k == RECV_GRAD:
        return ("grad", action.micro_batch, action.stage + 1)
    raise ValueError(f"{k} is not a send or a receive")


# -- validation -----------------------------------------------------------------------------


def _nearest_multiples(m: int, p: int) -> str:
    lo, hi = (m // p) * p, (m // p + 1) * p
    return f"{lo} or {hi}" if lo >= p else f"{hi}"


def check_schedule(schedule: str, ranks: int, micro_batches: int, chunks: int = 1,
                   iterations: int = 1, staleness: int = 0) -> None:
    """Raise :class:`FormatError` naming the broken rule and the nearest valid values."""
    if schedule not in SCHEDULE_NAMES:
        raise FormatError("schedule", schedule, f"must be one of {', '.join(SCHEDULE_NAMES)}")
    for name, v in (("ranks", ranks), ("micro_batches", micro_batches), ("chunks", chunks),
                    ("iterations", iterations)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise FormatError(name, v, "must be an integer >= 1")
    if not (isinstance(staleness, int) and staleness >= 0):
        raise FormatError("staleness", staleness, "must be an integer >= 0")
    if schedule not in MULTI_CHUNK and chunks != 1:
        raise FormatError("chunks", chunks, f"{schedule} runs one chunk per device; use chunks=1, or "
                          f"the interleaved / bfs schedule for {chunks} chunks")
    fixed = SCHEDULES[schedule].chunks
    if fixed is not None and chunks != fixed:
        raise FormatError("chunks", chunks, f"{schedule} runs exactly {fixed} chunks per device (its V: down "
                          f"the devices and back); use chunks={fixed}")
    if schedule == "interleaved" and micro_batches % ranks != 0:
        raise FormatError("micro_batches", micro_batches,
                          f"the interleaved schedule sends micro-batches in groups of one per device, so "
                          f"micro_batches must be a multiple of the {ranks} devices; nearest valid: "
                          f"{_nearest_multiples(micro_batches, ranks)}")


# -- compute orders --------------------------------------------------------------------------

# A compute order is a list of (kind, micro_batch, stage, version) with kind in F, B, STEP,
# PUSH, PULL; communication is inserted afterwards by ``_with_comm``.
_Order = list[tuple[int, int, int, int]]


def _gpipe(r: int, m: int, iterations: int) -> _Order:
    out: _Order = []
    for it in range(iterations):
        mbs = range(it * m, (it + 1) * m)
        out += [(_F, j, r, -1) for j in mbs]
        out += [(_B, j, r, -1) for j in mbs]
        out.append((_STEP, -1, -1, it + 1))
    return out


def _one_f_one_b(r: int, p: int, m: int, iterations: int, depth: int | None = None) -> _Order:
    """PipeDream-Flush: warm up with ``min(depth, m)`` forwards (``depth`` = ``p - r - 1``,
    the ranks downstream), alternate, drain."""
    out: _Order = []
    for it in range(iterations):
        base = it * m
        warm = min(p - r - 1 if depth is None else depth, m)
        out += [(_F, base + j, r, -1) for j in range(warm)]
        for i in range(m - warm):
            out.append((_F, base + warm + i, r, -1))
            out.append((_B, base + i, r, -1))
        out += [(_B, base + j, r, -1) for j in range(m - warm, m)]
        out.append((_STEP, -1, -1, it + 1))
    return out


def _no_flush(r: int, p: int, m: int, iterations: int, wsp: bool, staleness: int,
              depth: int | None = None) -> _Order:
    """1F1B steady state across iteration (wave) boundaries; at most ``min(p - r, m)`` in flight.

    Capping what is in flight at ``m`` keeps the micro-batches in flight within two
    consecutive iterations, so 2BW never needs a third weight version, even when ``m < p``.

    2BW: ``STEP`` after the last backward of each iteration creates the next weight version.
    WSP: ``PUSH(c)`` after the last backward of wave ``c``, then ``PULL(c - staleness)``, which
    waits until the other virtual workers have pushed wave ``c - staleness``.
    """
    total = m * iterations
    cap = min((p - r - 1 if depth is None else depth) + 1, m)
    out: _Order = []

    def forward(j: int) -> None:
        out.append((_F, j, r, -1))

    def backward(j: int) -> None:
        out.append((_B, j, r, -1))
        if (j + 1) % m == 0:
            wave = j // m
            if not wsp:
                out.append((_STEP, -1, -1, wave + 1))
                return
            out.append((_PUSH, -1, -1, wave))
            if wave - staleness >= 0:
                out.append((_PULL, -1, -1, wave - staleness))

    for j in range(cap - 1):
        forward(j)
    for i in range(total - (cap - 1)):
        forward(cap - 1 + i)
        backward(i)
    for j in range(total - (cap - 1), total):
        backward(j)
    return out


def _interleaved(r: int, p: int, m: int, v: int, iterations: int) -> _Order:
    """Megatron's depth-first interleaved 1F1B: micro-batches go through chunks in groups of p."""
    if v == 1:
        return _one_f_one_b(r, p, m, iterations)
    total = m * v
    warm = min((p - r - 1) * 2 + (v - 1) * p, total)
    out: _Order = []
    for it in range(iterations):
        base = it * m

        def fwd(i: int, base: int = base) -> tuple[int, int, int, int]:
            chunk = (i // p) % v
            return (_F, base + (i // (p * v)) * p + i % p, chunk * p + r, -1)

        def bwd(i: int, base: int = base) -> tuple[int, int, int, int]:
            chunk = v - 1 - (i // p) % v
            return (_B, base + (i // (p * v)) * p + i % p, chunk * p + r, -1)

        out += [fwd(i) for i in range(warm)]
        for i in range(total - warm):
            out.append(fwd(warm + i))
            out.append(bwd(i))
        out += [bwd(i) for i in range(total - warm, total)]
        out.append((_STEP, -1, -1, it + 1))
    return out


def _bfs(r: int, p: int, m: int, v: int, iterations: int) -> _Order:
    """Breadth-first looping: every micro-batch through chunk 0, then chunk 1, ...; backward mirrored."""
    out: _Order = []
    for it in range(iterations):
        mbs = range(it * m, (it + 1) * m)
        for c in range(v):
            out += [(_F, j, c * p + r, -1) for j in mbs]
        for c in reversed(range(v)):
            out += [(_B, j, c * p + r, -1) for j in mbs]
        out.append((_STEP, -1, -1, it + 1))
    return out


def _zb_h1(r: int, p: int, m: int, iterations: int, warm: int) -> _Order:
    """ZB-H1 (Qi et al., section 2.1) on rank ``r``: ``warm`` warm-up forwards (1F1B's ``p - r - 1``),
    then one forward and one input-gradient backward ``I`` at a time (1F1B with ``B`` replaced by
    ``I``), each ``I`` followed by the ``W`` of the oldest micro-batch still waiting for one once
    ``r`` ``I`` have run; the ``W`` left over fill the drain. Every rank then holds at most ``p``
    micro-batches' activations, as 1F1B's first rank does (torch's ZB1P builds the same order)."""
    delay = r
    out: _Order = []
    for it in range(iterations):
        base = it * m
        warm_r = min(warm, m)
        waiting: list[int] = []
        out += [(_F, base + j, r, -1) for j in range(warm_r)]
        for j in range(m):  # the j-th I, after the forward of micro-batch warm_r + j while there is one
            if j < m - warm_r:
                out.append((_F, base + warm_r + j, r, -1))
            out.append((_I, base + j, r, -1))
            waiting.append(base + j)
            if j >= delay:
                out.append((_W, waiting.pop(0), r, -1))
        out += [(_W, j, r, -1) for j in waiting]
        out.append((_STEP, -1, -1, it + 1))
    return out


@functools.lru_cache(maxsize=64)
def _zb_h2_iteration(p: int, m: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """One iteration of ZB-H2 (Qi et al., section 2.2), every rank's ``(kind, micro_batch)`` in
    order: the list scheduler the paper's handcrafted schedule follows, run once with unit times
    (``T_F = T_B = T_W``). Whenever a rank is free it runs, of what it may run now, an ``I`` (the
    critical path) before an ``F`` before a ``W``, and an ``F`` only while fewer than ``2p - 1``
    micro-batches hold activations on it (forward run, ``W`` not yet: the paper's ``(2p - 1) M_B``);
    the earliest start goes first, ties to the lower rank. The lists are an order that ran, so they
    are deadlock-free whatever the real times."""
    cap = 2 * p - 1
    f_end = [[-1] * m for _ in range(p)]
    i_end = [[-1] * m for _ in range(p)]
    clock, nf, ni, nw = [0] * p, [0] * p, [0] * p, [0] * p
    out: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    for _ in range(3 * p * m):
        best: tuple[int, int, int, int] | None = None  # (start, priority, rank, kind)
        for r in range(p):
            t = clock[r]
            options = []
            if ni[r] < nf[r]:
                ready = f_end[r][ni[r]] if r == p - 1 else i_end[r + 1][ni[r]]
                if ready >= 0:
                    options.append((max(t, ready), 0, _I))
            if nf[r] < m and nf[r] - nw[r] < cap:
                ready = 0 if r == 0 else f_end[r - 1][nf[r]]
                if ready >= 0:
                    options.append((max(t, ready), 1, _F))
            if nw[r] < ni[r]:
                options.append((t, 2, _W))
            if not options:
                continue
            now = [o for o in options if o[0] <= t]
            start, prio, kind = min(now, key=lambda o: o[1]) if now else min(options)
            if best is None or (start, r) < (best[0], best[2]):
                best = (start, prio, r, kind)
        assert best is not None
        start, _, r, kind = best
        clock[r] = start + 1
        if kind == _I:
            j, ni[r] = ni[r], ni[r] + 1
            i_end[r][j] = clock[r]
        elif kind == _F:
            j, nf[r] = nf[r], nf[r] + 1
            f_end[r][j] = clock[r]
        else:
            j, nw[r] = nw[r], nw[r] + 1
        out[r].append((kind, j))
    return tuple(tuple(o) for o in out)


def _zb_h2(r: int, p: int, m: int, iterations: int) -> _Order:
    one = _zb_h2_iteration(p, m)[r]
    out: _Order = []
    for it in range(iterations):
        out += [(k, it * m + j, r, -1) for k, j in one]
        out.append((_STEP, -1, -1, it + 1))
    return out


def _zbv(r: int, p: int, m: int, iterations: int) -> _Order:
    """ZB-V (Qi et al., section 6) on rank ``r``: chunk 0 is stage ``r``, chunk 1 stage
    ``2p - 1 - r`` (the V). The order of torch's ``ScheduleZBVZeroBubble``: ``2 (p - r) - 1``
    forwards of chunk 0, ``r`` pairs of forwards (chunk 1, chunk 0), ``p - r`` rounds of chunk 1's
    F, I, W; then chunk 0's F, I, W and chunk 1's F, I, W per micro-batch; the drain's ``I`` of
    both chunks with chunk 0's ``W`` after ``p - r`` of them, and the remaining ``W``. Built for
    ``max(m, 2p - 1)`` micro-batches and kept to the first ``m`` (as torch does)."""
    n = max(m, 2 * p - 1)
    s0, s1 = r, 2 * p - 1 - r
    seq: list[tuple[int, int, int]] = []  # (kind, micro-batch of the iteration, stage)
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - r) - 1):
        seq.append((_F, f0, s0))
        f0 += 1
    for _ in range(r):
        seq += [(_F, f1, s1), (_F, f0, s0)]
        f0, f1 = f0 + 1, f1 + 1
    for _ in range(p - r):
        seq += [(_F, f1, s1), (_I, b1, s1), (_W, b1, s1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            seq.append((_F, f0, s0))
            f0 += 1
        seq += [(_I, b0, s0), (_W, b0, s0), (_F, f1, s1), (_I, b1, s1), (_W, b1, s1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(r):
        seq += [(_I, b0, s0), (_I, b1, s1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - r):
        seq += [(_I, b0, s0), (_W, w0, s0)]
        b0, w0 = b0 + 1, w0 + 1
    seq += [(_W, j, s1) for j in range(w1, b1)] + [(_W, j, s0) for j in range(w0, b0)]
    kept = [a for a in seq if a[1] < m]
    out: _Order = []
    for it in range(iterations):
        out += [(k, it * m + j, s, -1) for k, j, s in kept]
        out.append((_STEP, -1, -1, it + 1))
    return out


Columns = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def _with_comm(order: _Order, p: int, n_stages: int, placement: str = "loop") -> Columns:
    """Insert the sends and receives around every F and B (or I) whose neighbouring stage is on
    another rank (vectorised): returns the columns ``(kind, micro_batch, stage, peer, version)`` of
    the rank's actions. A neighbour on the same rank (ZB-V's turn, every stage when ``p = 1``)
    takes the tensor from memory."""
    arr = np.asarray(order, dtype=np.int64).reshape(-1, 4)
    k, j, s, ver = arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3]
    is_f, is_b = k == _F, (k == _B) | (k == _I)
    last = n_stages - 1
    rank_of = np.array([stage_rank(x, p, placement) for x in range(n_stages)] + [-1, -1], dtype=np.int64)
    sc = np.clip(s, 0, None)
    up = rank_of[sc + 1] != rank_of[sc]  # stage s + 1 on another rank (index -1 past the last)
    down = rank_of[sc - 1] != rank_of[sc]
    recv = (is_f & (s > 0) & down) | (is_b & (s < last) & up)
    send = (is_f & (s < last) & up) | (is_b & (s > 0) & down)
    count = 1 + recv.astype(np.int64) + send
    start = np.cumsum(count) - count
    total = int(count.sum())
    kind = np.empty(total, dtype=np.int8)
    mb = np.full(total, -1, dtype=np.int64)
    stage = np.full(total, -1, dtype=np.int64)
    peer = np.full(total, -1, dtype=np.int64)
    version = np.full(total, -1, dtype=np.int64)
    main = start + recv
    kind[main], mb[main], stage[main], version[main] = k, j, s, ver
    ri, f_r = start[recv], is_f[recv]
    kind[ri] = np.where(f_r, _RECV_ACT, _RECV_GRAD)
    mb[ri], stage[ri] = j[recv], s[recv]
    peer[ri] = rank_of[np.where(f_r, s[recv] - 1, s[recv] + 1)]
    si, f_s = main[send] + 1, is_f[send]
    kind[si] = np.where(f_s, _SEND_ACT, _SEND_GRAD)
    mb[si], stage[si] = j[send], s[send]
    peer[si] = rank_of[np.where(f_s, s[send] + 1, s[send] - 1)]
    return kind, mb, stage, peer, version


def to_actions(columns: Columns) -> list[Action]:
    """The :class:`Action` list of one rank from its columns."""
    kind, mb, stage, peer, version = columns
    names = [ACTION_KINDS[c] for c in kind.tolist()]
    return list(map(tuple.__new__, itertools.repeat(Action),
                    zip(names, mb.tolist(), stage.tolist(), peer.tolist(), version.tolist(), strict=True)))


def schedule_columns(schedule: str, ranks: int, micro_batches: int, chunks: int = 1,
                     iterations: int = 1, staleness: int = 0, depths: Sequence[int] | None = None
                     ) -> list[Columns]:
    """:func:`build_schedule` as numpy columns ``(kind, micro_batch, stage, peer, version)`` per
    rank, ``kind`` indexing :data:`ACTION_KINDS` (the simulator's fast path; same lists).

    ``depths[r]`` (1F1B-style schedules) replaces ``p - r - 1``, the forwards rank ``r`` runs
    ahead of its first backward: a pipeline whose positions are replicated keeps more micro-batches
    in flight (one per replica downstream). Deadlock-free when ``depths[r] >= depths[r + 1] + 1``
    and ``depths[p - 1] >= 0``, as for the default.
    """
    check_schedule(schedule, ranks, micro_batches, chunks, iterations, staleness)
    p, m, v = ranks, micro_batches, chunks
    if depths is not None:
        ok = (len(depths) == p and depths[-1] >= 0
              and all(a >= b + 1 for a, b in itertools.pairwise(depths)))
        if not ok:
            raise FormatError("depths", list(depths), f"must give {p} values, each at least one more than the "
                              f"next, the last >= 0")
    depth = list(depths) if depths is not None else [None] * p
    orders: list[_Order]
    if schedule == "gpipe":
        orders = [_gpipe(r, m, iterations) for r in range(p)]
    elif schedule == "1f1b":
        orders = [_one_f_one_b(r, p, m, iterations, depth[r]) for r in range(p)]
    elif schedule in NO_FLUSH:
        orders = [_no_flush(r, p, m, iterations, schedule == "wsp", staleness, depth[r]) for r in range(p)]
    elif schedule == "interleaved":
        orders = [_interleaved(r, p, m, v, iterations) for r in range(p)]
    elif schedule == "bfs":
        orders = [_bfs(r, p, m, v, iterations) for r in range(p)]
    elif schedule == "zbv":
        orders = [_zbv(r, p, m, iterations) for r in range(p)]
    elif schedule == "zb-h1":
        warm = [p - r - 1 if d is None else d for r, d in enumerate(depth)]
        orders = [_zb_h1(r, p, m, iterations, warm[r]) for r in range(p)]
    else:
        orders = [_zb_h2(r, p, m, iterations) for r in range(p)]
    return [_with_comm(o, p, p * v, SCHEDULES[schedule].placement) for o in orders]


def build_schedule(schedule: str, ranks: int, micro_batches: int, chunks: int = 1,
                   iterations: int = 1, staleness: int = 0) -> list[list[Action]]:
    """Every rank's ordered actions for ``iterations`` iterations of ``micro_batches`` each.

    ``ranks`` is the number of devices of the pipeline (``p``), ``chunks`` the stages per
    device (``v``; interleaved and bfs only), ``staleness`` the WSP bound ``D``.
    """
    return [to_actions(c) for c in schedule_columns(schedule, ranks, micro_batches, chunks,
                                                     iterations, staleness)]


def describe(actions: Sequence[Action]) -> str:
    """A compact one-line rendering of a rank's program (``F0 F1 B0 ...``), for docs and errors."""
    parts = []
    for a in actions:
        if a.kind in COMPUTE_KINDS:
            parts.append(f"{a.kind}{a.micro_batch}" + (f".{a.stage}" if a.stage >= 0 else ""))
        elif a.kind in (STEP, PUSH, PULL):
            parts.append(f"{a.kind}({a.version})")
    return " ".join(parts)
