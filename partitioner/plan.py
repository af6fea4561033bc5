"""Plans: virtual workers, each a pipeline of stages (a contiguous layer range on a device)."""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ._io import (
    is_finite_number,
    load_mapping,
    opt_field,
    req_field,
    req_int,
    req_number,
    write_loadable,
)
from .errors import FormatError, check
from .pricing import RECOMPUTE_MODES, CostOptions
from .profile import MAX_LAYERS, MAX_MICRO_BATCH_SIZE
from .schedule import MULTI_CHUNK, SCHEDULE_NAMES, MicroBatching, Schedule, spec

if TYPE_CHECKING:
    from .cluster import Cluster
    from .profile import Profile

__all__ = ["MAX_CHUNKS", "MAX_MICRO_BATCHES", "MAX_STALENESS", "PLAN_FORMAT", "SCHEDULES", "Plan", "SolveStatus",
           "SolverInfo", "Stage", "VirtualWorker", "group_size"]

PLAN_FORMAT = "partitioner.plan/1"
SCHEDULES = SCHEDULE_NAMES
# Schedules under which one device may hold several (non-adjacent) stages of a pipeline.
MULTI_CHUNK_SCHEDULES = MULTI_CHUNK
# What a plan file may ask for (docs/formats.md): the simulator and the runtime keep every
# micro-batch of an iteration (and, under WSP, of staleness + 1 waves) in their schedules.
MAX_MICRO_BATCHES = 4096
MAX_STALENESS = 64
MAX_CHUNKS = 64


def group_size(device: str) -> int:
    """The GPUs a device name stands for: ``NODE:FIRST-LAST`` a group of ``LAST - FIRST + 1``."""
    first, dash, last = device.rpartition(":")[2].partition("-")
    return int(last) - int(first) + 1 if dash and first.isdigit() and last.isdigit() and int(last) > int(first) else 1


@dataclass(frozen=True)
class Stage:
    """Layers ``[start, stop)`` on ``device``; ``replicas`` run the same stage data-parallel.
    ``recompute`` is what the stage recomputes in its backward instead of keeping it
    (:data:`partitioner.pricing.RECOMPUTE_MODES`: ``none``, ``selective``: the attention core of
    its transformer blocks, ``full``: everything but the stage's input)."""

    layers: tuple[int, int]
    device: str
    gpu_type: str = ""
    replicas: tuple[str, ...] = ()
    recompute: str = "none"

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "replicas", tuple(self.replicas))
        ok = (len(self.layers) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in self.layers)
              and 0 <= self.layers[0] < self.layers[1] <= MAX_LAYERS)
        check(ok, "layers", list(self.layers), f"must be [start, stop) with 0 <= start < stop <= {MAX_LAYERS:,} "
              "(a profile has at most that many layers)")
        check(isinstance(self.device, str) and self.device != "", "device", self.device, "must name a device (NODE:INDEX)")
        for k, r in enumerate(self.replicas):
            check(isinstance(r, str) and r != "", f"replicas[{k}]", r, "must name a device (NODE:INDEX)")
        check(self.device not in self.replicas, "replicas", list(self.replicas), "must not repeat the stage's device")
        check(len(set(self.replicas)) == len(self.replicas), "replicas", list(self.replicas),
              "must not name a device twice")
        check(self.recompute in RECOMPUTE_MODES, "recompute", self.recompute,
              f"must be one of {', '.join(RECOMPUTE_MODES)}")

    @property
    def start(self) -> int:
        return self.layers[0]

    @property
    def stop(self) -> int:
        return self.layers[1]

    @property
    def devices(self) -> tuple[str, ...]:
        """The stage's device followed by its replicas."""
        return (self.device, *self.replicas)

    @property
    def tensor_parallel(self) -> tuple[int, ...]:
        """The tensor-parallel degree of each of :attr:`devices` (a device ``NODE:FIRST-LAST`` is a
        group of ``LAST - FIRST + 1`` GPUs, ``NODE:INDEX`` one GPU)."""
        return tuple(group_size(d) for d in self.devices)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"layers": list(self.layers), "device": self.device, "gpu_type": self.gpu_type}
        if self.replicas:
            d["replicas"] = list(self.replicas)
        if self.recompute != "none":
            d["recompute"] = self.recompute
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "") -> Stage:
        if not isinstance(d, Mapping):
            raise FormatError(where.rstrip("."), d, "must be an object {layers, device, gpu_type}")
        try:
            return cls(
                layers=tuple(req_field(d, "layers", list, where)),
                device=req_field(d, "device", str, where),
                gpu_type=opt_field(d, "gpu_type", str, "", where),
                replicas=tuple(opt_field(d, "replicas", list, [], where)),
                recompute=opt_field(d, "recompute", str, "none", where),
            )
        except FormatError as err:
            raise err if err.field.startswith(where) else err.under(where) from None


@dataclass(frozen=True)
class VirtualWorker:
    """One pipeline: stages in pipeline order (for interleaved schedules, chunk order)."""

    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        check(len(self.stages) >= 1, "stages", [], "must list at least one stage")

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device the pipeline uses, in first-use order."""
        return tuple(dict.fromkeys(d for s in self.stages for d in s.devices))

    def to_dict(self) -> dict[str, Any]:
        return {"stages": [s.to_dict() for s in self.stages]}

    @classmethod
    def from_dict(cls, d: Any, where: str = "") -> VirtualWorker:
        if not isinstance(d, Mapping):
            raise FormatError(where.rstrip("."), d, "must be an object {stages: [...]}")
        stages = req_field(d, "stages", list, where)
        return cls(tuple(Stage.from_dict(s, f"{where}stages[{k}].") for k, s in enumerate(stages)))


class SolveStatus(str, enum.Enum):
    """How a solve ended. ``INFEASIBLE`` carries a reason; it is an answer, not a crash."""

    OPTIMAL = "optimal"  # proven optimal for the problem as modelled (gap 0)
    FEASIBLE = "feasible"  # a valid plan with a lower bound; the gap says how far it may be
    INFEASIBLE = "infeasible"  # proven: no plan satisfies the constraints (see ``reason``)
    UNKNOWN = "unknown"  # stopped (time limit) before finding a plan or proving infeasibility

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SolverInfo:
    """How a plan was found, with its certificate: objective, lower bound and gap."""

    name: str
    status: SolveStatus
    objective: float = math.nan
    lower_bound: float = math.nan
    gap: float = math.nan
    time_s: float = 0.0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "status", SolveStatus(self.status))
        except ValueError:
            raise FormatError("solver.status", self.status,
                              f"must be one of {', '.join(s.value for s in SolveStatus)}") from None

    def to_dict(self) -> dict[str, Any]:
        def num(x: float) -> float | None:
            return None if math.isnan(x) else x

        return {"name": self.name, "status": self.status.value, "objective": num(self.objective),
                "lower_bound": num(self.lower_bound), "gap": num(self.gap), "time_s": self.time_s}

    @classmethod
    def from_dict(cls, d: Any) -> SolverInfo:
        if not isinstance(d, Mapping):
            raise FormatError("solver", d, "must be an object {name, status, ...}")

        def num(k: str) -> float:
            v = d.get(k)
            return math.nan if v is None else req_number(d, k, "solver.", minimum=None)

        return cls(req_field(d, "name", str, "solver."), req_field(d, "status", str, "solver."),
                   num("objective"), num("lower_bound"), num("gap"),
                   req_number(d, "time_s", "solver.", default=0.0))


@dataclass(frozen=True)
class Plan:
    """Everything needed to train: who runs which layers, the schedule, and its batching."""

    model: str
    virtual_workers: tuple[VirtualWorker, ...]
    schedule: str = "1f1b"
    micro_batch_size: int = 1
    micro_batches: int = 1
    staleness: int = 0
    chunks: int = 1  # model chunks per device (interleaved / bfs)
    first_slices: int = 1  # the first micro-batch split into this many slices (AutoPipe), flushing schedules
    predicted: Mapping[str, float] = field(default_factory=dict)
    solver: SolverInfo | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)
    pricing: CostOptions | None = None  # the options it was priced with; None: a plan that does not say
    # the profile's layers in the order the stages' ranges count them (a graph planned as convex
    # stages); None: the profile's own order
    layer_order: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "virtual_workers", tuple(self.virtual_workers))
        if self.layer_order is not None:
            order = list(self.layer_order)
            ok = all(isinstance(x, int) and not isinstance(x, bool) for x in order) and sorted(order) == list(
                range(len(order))) and len(order) >= 1
            check(ok, "layer_order", order if len(order) <= 12 else [*order[:12], "..."],
                  "must list each layer index 0..L-1 once (a permutation of the profile's layers)")
            object.__setattr__(self, "layer_order", None if order == list(range(len(order))) else tuple(order))
        check(self.pricing is None or isinstance(self.pricing, CostOptions), "pricing", self.pricing,
              "must be a partitioner.pricing.CostOptions or None")
        object.__setattr__(self, "predicted", dict(self.predicted))
        object.__setattr__(self, "meta", dict(self.meta))
        check(len(self.virtual_workers) >= 1, "virtual_workers", [], "must list at least one virtual worker")
        check(self.schedule in SCHEDULES, "schedule", self.schedule, f"must be one of {', '.join(SCHEDULES)}")
        for name in ("micro_batch_size", "micro_batches", "chunks", "first_slices"):
            v = getattr(self, name)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, name, v, "must be an integer >= 1")
        check(isinstance(self.staleness, int) and self.staleness >= 0, "staleness", self.staleness,
              "must be an integer >= 0")
        if self.first_slices > 1:
            check(spec(self.schedule).sliceable, "first_slices", self.first_slices,
                  f"slicing the first micro-batch shortens a pipeline's fill; it applies to gpipe and 1f1b, "
                  f"not {self.schedule} (use 1)")
            check(self.micro_batch_size % self.first_slices == 0, "first_slices", self.first_slices,
                  f"must divide micro_batch_size {self.micro_batch_size}")

    @property
    def num_stages(self) -> int:
        return max(len(vw.stages) for vw in self.virtual_workers)

    @property
    def pipeline_schedule(self) -> Schedule:
        """The plan's schedule with its micro-batch count, as pricing takes them."""
        return Schedule(spec(self.schedule), self.micro_batches, self.overlaps_iterations)

    @property
    def overlaps_iterations(self) -> bool:
        """Whether the plan's iterations overlap (``pricing.overlap_iterations`` under a flushing
        schedule; 2bw and wsp never flush, so this stays False for them)."""
        return bool(self.pricing is not None and self.pricing.overlap_iterations and spec(self.schedule).flushes)

    @property
    def micro_batching(self) -> MicroBatching:
        """The micro-batches an iteration's action lists run (the first sliced when
        ``first_slices`` > 1)."""
        return MicroBatching(self.micro_batches, self.micro_batch_size, self.first_slices)

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for vw in self.virtual_workers for d in vw.devices)

    # -- validation against a profile and a cluster ----------------------------------------

    def validate(self, profile: Profile, cluster: Cluster, options: object = None) -> None:
        """Raise :class:`FormatError` unless the plan's structure fits ``profile`` and ``cluster``.

        Checks: ``layer_order`` is a topological order of ``profile`` (see :meth:`profile_view`);
        every virtual worker's stages cover the profile's layers contiguously, without
        overlap or gap; devices exist, carry the stated GPU type and belong to one virtual
        worker; a device holds several stages only under a multi-chunk schedule. Whether the
        stages fit in memory is a question for the cost model
        (:meth:`partitioner.cost.CostModel.check_plan_memory`); ``options`` is accepted for
        callers that pass their cost options here and is not used.
        """
        if self.model != profile.model:
            raise FormatError("model", self.model, f"the profile is of model '{profile.model}'")
        profile = self.profile_view(profile)
        n_layers = profile.num_layers
        owner: dict[str, str] = {}
        gpu_of: dict[str, str] = {}
        for w, vw in enumerate(self.virtual_workers):
            expect = 0
            seen_here: set[str] = set()
            for k, st in enumerate(vw.stages):
                where = f"virtual_workers[{w}].stages[{k}]"
                if st.start != expect:
                    what = (f"overlaps the previous stage, which ends at layer {expect}" if st.start < expect
                            else f"skips layers [{expect}, {st.start})")
                    raise FormatError(f"{where}.layers", list(st.layers), what)
                if st.stop > n_layers:
                    raise FormatError(f"{where}.layers", list(st.layers),
                                      f"goes past the last layer; the profile has {n_layers} layers")
                expect = st.stop
                for dev_name in st.devices:
                    dev = cluster.device(dev_name)
                    if dev_name is st.device and st.gpu_type and dev.gpu_type != st.gpu_type:
                        raise FormatError(f"{where}.gpu_type", st.gpu_type,
                                          f"device {dev_name} is a {dev.gpu_type}")
                    if dev_name in owner and owner[dev_name] != f"{w}":
                        raise FormatError(f"{where}.device", dev_name,
                                          f"already used by virtual_workers[{owner[dev_name]}]")
                    if dev_name in seen_here and self.schedule not in MULTI_CHUNK_SCHEDULES:
                        raise FormatError(f"{where}.device", dev_name,
                                          f"holds two stages, which only {', '.join(MULTI_CHUNK_SCHEDULES)} allow")
                    owner[dev_name] = f"{w}"
                    seen_here.add(dev_name)
                    for gpu in dev.gpu_names:  # a GPU in one device only (a group or itself)
                        if gpu_of.setdefault(gpu, dev_name) != dev_name:
                            raise FormatError(f"{where}.device", dev_name, f"shares GPU {gpu} with device "
                                              f"{gpu_of[gpu]}: a GPU belongs to one device (or one "
                                              "tensor-parallel group)")
            if expect != n_layers:
                raise FormatError(f"virtual_workers[{w}].stages", f"ends at layer {expect}",
                                  f"must cover all {n_layers} layers of the profile")

    def profile_view(self, profile: Profile) -> Profile:
        """``profile`` with its layers in the order the plan's stages count them.

        A plan of a graph profile may hold convex stages that are not contiguous in the
        profile's own order; ``layer_order`` is then the order they are contiguous in, and this
        is :meth:`Profile.reordered` with it (cut bytes priced again from the edges). ``profile``
        may already be reordered (its :attr:`Profile.layer_order`): it is brought to the plan's
        order from there. Refuses, naming ``layer_order``, an order that is not a permutation of
        the profile's layers or puts a layer before one that feeds it.
        """
        have = profile.layer_order
        want = self.layer_order
        if have == want:
            return profile
        n = profile.num_layers
        if want is not None and len(want) != n:
            raise FormatError("layer_order", f"{len(want)} entries", f"the profile has {n} layers")
        want_list = list(want) if want is not None else list(range(n))
        if have is None:
            return profile.reordered(want_list)
        where = {v: i for i, v in enumerate(have)}
        return profile.reordered([where[v] for v in want_list])

    # -- JSON ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "model": self.model,
            "schedule": self.schedule,
            "micro_batch_size": self.micro_batch_size,
            "micro_batches": self.micro_batches,
            "staleness": self.staleness,
        }
        if self.chunks != 1:
            d["chunks"] = self.chunks
        if self.first_slices != 1:
            d["first_slices"] = self.first_slices
        if self.layer_order is not None:
            d["layer_order"] = list(self.layer_order)
        d["virtual_workers"] = [vw.to_dict() for vw in self.virtual_workers]
        d["predicted"] = dict(self.predicted)
        if self.pricing is not None:
            d["pricing"] = self.pricing.to_dict()
        if self.solver is not None:
            d["solver"] = self.solver.to_dict()
        if self.meta:
            d["meta"] = dict(self.meta)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Plan:
        fmt = opt_field(d, "format", str, PLAN_FORMAT)
        if fmt != PLAN_FORMAT:
            raise FormatError("format", fmt, f"expected '{PLAN_FORMAT}'")
        vws = req_field(d, "virtual_workers", list)
        predicted = opt_field(d, "predicted", Mapping, {})
        for k, v in predicted.items():
            check(is_finite_number(v), f"predicted.{k}", v,
                  "must be a finite number")
        solver = d.get("solver")
        order = d.get("layer_order")
        if order is not None:
            check(isinstance(order, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in order),
                  "layer_order", order if not isinstance(order, list) or len(order) <= 12 else [*order[:12], "..."],
                  "must be a list of layer indices (a permutation of the profile's layers)")
            check(len(order) <= MAX_LAYERS, "layer_order", f"{len(order)} entries", f"at most {MAX_LAYERS:,}")
        return cls(
            model=req_field(d, "model", str),
            virtual_workers=tuple(VirtualWorker.from_dict(v, f"virtual_workers[{w}].") for w, v in enumerate(vws)),
            schedule=opt_field(d, "schedule", str, "1f1b"),
            micro_batch_size=req_int(d, "micro_batch_size", minimum=1, maximum=MAX_MICRO_BATCH_SIZE),
            micro_batches=req_int(d, "micro_batches", minimum=1, maximum=MAX_MICRO_BATCHES, default=1),
            staleness=req_int(d, "staleness", minimum=0, maximum=MAX_STALENESS, default=0),
            chunks=req_int(d, "chunks", minimum=1, maximum=MAX_CHUNKS, default=1),
            first_slices=req_int(d, "first_slices", minimum=1, maximum=MAX_MICRO_BATCH_SIZE, default=1),
            predicted=predicted,
            solver=None if solver is None else SolverInfo.from_dict(solver),
            meta=opt_field(d, "meta", Mapping, {}),
            pricing=None if d.get("pricing") is None else CostOptions.from_dict(d["pricing"]),
            layer_order=None if order is None else tuple(order),
        )

    def save(self, path: str | os.PathLike[str]) -> None:
        write_loadable(path, self.to_dict(), Plan.from_dict, "plan")

    def cost_options(self) -> CostOptions | None:
        """The :class:`CostOptions` the plan was priced with, or None for a plan that does not say."""
        return self.pricing

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        data = load_mapping(path)
        try:
            return cls.from_dict(data)
        except FormatError as err:
            raise err.in_file(str(path)) from None
