"""Measured runs as the cost model is judged on them: a plan, the profile and cluster it ran on,
its pricing options, and the measured seconds per iteration and peak memory.

:func:`load_run` reads one run from

* a folder with ``plan.json``, ``profile.json`` and ``cluster.json`` (what ``partitioner import
  sailor-run -o DIR`` writes): the measured figures are the plan's ``meta.measured``
  (``iteration_s``, ``peak_memory_bytes``), or a ``metrics.json`` beside them (what ``partitioner
  train -o`` writes: ``measured_iteration_s`` and the ranks' ``peak_memory_bytes``);
* one of Sailor's ``plan_config`` files, read with its profiles and network file
  (:func:`partitioner.importers.sailor_runs.import_sailor_run`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._io import is_finite_number, load_mapping
from .cluster import Cluster
from .errors import FormatError, OptionError
from .plan import Plan
from .pricing import CostOptions
from .profile import Profile

__all__ = ["MeasuredRun", "load_run"]


@dataclass(frozen=True)
class MeasuredRun:
    """A plan as it ran: its profile, cluster and pricing options, and what was measured."""

    name: str
    plan: Plan
    profile: Profile
    cluster: Cluster
    options: CostOptions
    measured_iteration_s: float
    measured_peak_bytes: float | None = None


def _measured(plan: Plan, folder: Path) -> tuple[float, float | None]:
    meta: Any = plan.meta.get("measured")
    if isinstance(meta, dict) and is_finite_number(meta.get("iteration_s")) and float(meta["iteration_s"]) > 0:
        peak: Any = meta.get("peak_memory_bytes")
        return float(meta["iteration_s"]), float(peak) if is_finite_number(peak) and peak > 0 else None
    metrics_path = folder / "metrics.json"
    if not metrics_path.exists():
        raise FormatError("meta.measured", meta, "a measured run's plan.json needs meta.measured.iteration_s, or a "
                          "metrics.json (partitioner train -o) beside it", file=str(folder / "plan.json"))
    metrics = load_mapping(metrics_path)
    it: Any = metrics.get("measured_iteration_s")
    if not (is_finite_number(it) and it > 0):
        raise FormatError("measured_iteration_s", it, "must be a number of seconds > 0", file=str(metrics_path))
    ranks = metrics.get("ranks")
    peaks: list[Any] = [r.get("peak_memory_bytes") for r in ranks if isinstance(r, dict)] if isinstance(ranks, list) else []
    good = [float(p) for p in peaks if is_finite_number(p) and p > 0]
    return float(it), max(good) if good else None


def load_run(path: str | os.PathLike[str], profiles: str | os.PathLike[str] | None = None,
             network: str | os.PathLike[str] | None = None, shared_nics: bool = True) -> MeasuredRun:
    """One measured run from a folder or a Sailor ``plan_config`` file (see the module docstring;
    ``shared_nics``: a Sailor run's network as
    :func:`partitioner.importers.sailor_runs.import_sailor_run` takes it)."""
    p = Path(path)
    if p.is_dir():
        plan = Plan.load(p / "plan.json")
        profile = Profile.load(p / "profile.json")
        cluster = Cluster.load(p / "cluster.json")
        it, peak = _measured(plan, p)
        return MeasuredRun(p.name, plan, profile, cluster, plan.cost_options() or CostOptions(), it, peak)
    if profiles is None or network is None:
        raise OptionError("profiles", None, f"{p} is a Sailor run file: name its profile folder (`profiles`) and "
                          f"network file (`network`)")
    from .importers.sailor_runs import import_sailor_run

    run = import_sailor_run(p, profiles, network, shared_nics=shared_nics)
    return MeasuredRun(run.name, run.plan, run.profile, run.cluster, run.options, run.measured_iteration_s,
                       run.measured_peak_bytes)
