"""A stage's memory levers for the chain solvers: per candidate stage ``[i, j)`` the fastest
recompute mode that fits its device (``CostOptions.recompute``: one mode for every stage, or
``auto``: any of none, selective, full), its optimizer state shared by ``holders`` data-parallel
holders of its layers under ``CostOptions.zero``.

A recompute only adds time (its forward again, inside the backward), so a stage recomputes only
where its memory forces it: the stage's time is the least over the modes that fit. The matrix
form (:func:`stage_candidates`) and the scalar one (:func:`stage_mode`) compute the same numbers
with the cost model's matrix and scalar methods, which agree to the bit.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from partitioner.cluster import Device
from partitioner.cost import CostModel
from partitioner.schedule import Schedule

__all__ = ["first_fitting_modes", "fitting_stops", "pick_by_mode", "stage_candidates", "stage_mode"]


def fitting_stops(cost: CostModel, in_flight: int, schedule: Schedule, capacity_bytes: float, rows: slice,
                  tensor_parallel: int, holders: int = 1) -> list[np.ndarray]:
    """Per mode the options allow (cheapest first), the largest stop that fits from each start in
    ``rows`` (:meth:`CostModel.max_stop` of that mode's model)."""
    return [cost.recomputing(mode).max_stop(in_flight, schedule, capacity_bytes, rows, tensor_parallel, holders)
            for mode in cost.options.recompute_modes]


def stage_candidates(cost: CostModel, dev: Device, prev: Device | None, nxt: Device | None, schedule: Schedule,
                     in_flight: int, rows: slice, holders: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """``(top, times)``: for each start ``i`` in ``rows`` the largest stop any mode fits, and
    ``times[i, j]``, the stage time in the first mode (cheapest first) whose stage ``[i, j)`` fits
    ``dev`` (``inf`` where none does: each stage checked with :meth:`CostModel.memory_matrix`, as a
    stop below ``top`` need not fit; ``j <= i`` is the caller's to mask). A mode that fits no stage a
    cheaper one does not is never priced."""
    modes = cost.options.recompute_modes
    tops = fitting_stops(cost, in_flight, schedule, dev.memory_bytes, rows, dev.tensor_parallel, holders)
    times: np.ndarray | None = None
    placed: np.ndarray | None = None  # stages a cheaper mode fits
    for mode in modes:
        cm = cost.recomputing(mode)
        fit = cm.memory_matrix(in_flight, schedule, rows, dev.tensor_parallel, holders) <= dev.memory_bytes
        if placed is not None:
            fit &= ~placed
            if not fit.any():
                continue  # it fits no stage a cheaper mode does not
        t = cm.pipeline_stage_time_matrix(dev, prev, nxt, schedule, rows)
        if times is None:
            times, placed = t, fit
            times[~fit] = np.inf
        else:
            assert placed is not None
            times[fit] = t[fit]
            placed |= fit
    assert times is not None
    return np.max(tops, axis=0), times


def first_fitting_modes(cost: CostModel, in_flight: int, schedule: Schedule, capacity_bytes: float, rows: slice,
                        tensor_parallel: int = 1, holders: int = 1) -> np.ndarray:
    """For each stage ``[i, j)`` (``i`` in ``rows``, every ``j``), the index in
    ``cost.options.recompute_modes`` of the first mode (cheapest first) whose stage fits
    ``capacity_bytes`` (:meth:`CostModel.memory_matrix` of that mode's model, so the same test as
    :func:`stage_mode` to the bit), or -1 where none does. A recompute only adds time (its
    forward again, inside the backward), so that mode is the fastest that fits."""
    choice: np.ndarray | None = None
    for m, mode in enumerate(cost.options.recompute_modes):
        fit = cost.recomputing(mode).memory_matrix(in_flight, schedule, rows, tensor_parallel, holders) \
            <= capacity_bytes
        if choice is None:
            choice = np.where(fit, m, -1)
        else:
            choice[(choice < 0) & fit] = m
    assert choice is not None
    return choice


def pick_by_mode(cost: CostModel, choice: np.ndarray, matrix: Callable[[CostModel], np.ndarray]) -> np.ndarray:
    """``matrix(cost.recomputing(mode))[i, j]`` where ``choice[i, j]`` is that mode's index
    (:func:`first_fitting_modes`), and the first mode's where it is -1 (no mode fits); only the
    modes some stage takes are computed."""
    modes = cost.options.recompute_modes
    out = matrix(cost.recomputing(modes[0]))
    for m in range(1, len(modes)):
        where = choice == m
        if where.any():
            out = np.where(where, matrix(cost.recomputing(modes[m])), out)
    return out


def stage_mode(cost: CostModel, dev: Device, schedule: Schedule, in_flight: int, start: int, stop: int,
               holders: int = 1) -> str:
    """The recompute mode of stage ``[start, stop)`` on ``dev`` the solvers chose: the first mode
    (cheapest first) that fits; the options' last mode when none fits."""
    for mode in cost.options.recompute_modes:
        need = cost.recomputing(mode).stage_memory_bytes(start, stop, in_flight, schedule, dev.tensor_parallel,
                                                         holders)
        if need <= dev.memory_bytes:
            return mode
    return cost.options.recompute_modes[-1]
