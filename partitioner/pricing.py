"""How plans are priced: :class:`CostOptions` (precision, optimizer state, the framework's reserved
memory, communication overlap, gradient sync and its precision).

The options are data, saved in every plan (``Plan.pricing``) so that a plan is re-priced as it
was planned; :mod:`partitioner.cost` applies them. They live apart from the cost model so that
``partitioner.plan`` can read and validate them without importing the cost model (which imports
plans): the import graph stays a tree (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._io import is_finite_number, opt_field, req_number
from .errors import FormatError, check

__all__ = ["DEFAULT_LR", "GIB", "OPTIMIZERS", "OPTIMIZER_STATE_FACTOR", "PRECISIONS", "RECOMPUTE_MODES",
           "RECOMPUTE_POLICIES", "ZERO_STAGES", "CostOptions", "priced_optimizer"]

GIB = 2**30
PRECISIONS = ("fp32", "fp16", "bf16")
# What a stage recomputes in its backward (Stage.recompute): nothing, the attention core of its
# transformer blocks (Megatron's selective recomputation), or everything but its input.
RECOMPUTE_MODES = ("none", "selective", "full")
# What a planner may choose per stage: one mode for every stage, or the cheapest that fits ("auto").
RECOMPUTE_POLICIES = (*RECOMPUTE_MODES, "auto")
ZERO_STAGES = (0, 1, 2)
# The optimizers the runtime and the exports run, the optimizer state each keeps per parameter in
# 4-byte words (CostOptions.optimizer_state_factor), and the learning rate used when none is given.
OPTIMIZERS = ("sgd", "adam", "adamw")
OPTIMIZER_STATE_FACTOR = {"sgd": 0.0, "adam": 2.0, "adamw": 2.0}
DEFAULT_LR = {"sgd": 0.01, "adam": 0.001, "adamw": 0.001}


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the cost model; saved in every plan (``Plan.pricing``) so it is re-priced alike.

    ``precision`` is how the model trains: ``fp32``, or ``fp16``/``bf16`` mixed precision (2-byte
    weights and gradients, a 4-byte fp32 master copy). ``optimizer_state_factor`` is optimizer
    state per parameter in 4-byte words: 2 for Adam (two moments), 1 for SGD with momentum, 0
    for plain SGD. ``reserved_bytes`` is the framework's own memory on every GPU (CUDA context,
    communication buffers, workspaces, allocator slack). ``sync`` prices the gradient all-reduce
    between data-parallel holders of the same layers and the optimizer step.
    ``allreduce_precision`` is the precision gradients are all-reduced in when it differs from
    the training precision (DeepSpeed's ``fp32_allreduce`` under fp16 training: ``"fp32"``, 4
    bytes per parameter on the wire); empty: the training precision.
    ``overlap_iterations``: a flushing schedule's iterations overlap: each device steps on its own
    stages' gradients (after their data-parallel all-reduce) and starts its next iteration's work at
    once, without waiting for the other stages (no flush; docs/schedules.md). Valid where nothing
    needs every stage's gradients before a step: no global gradient-norm clipping and no fp16 loss
    scale agreed over every rank (refused with ``precision`` fp16); 2BW and WSP overlap anyway.
    """

    overlap_comm: bool = False
    optimizer_state_factor: float = 2.0
    reserved_bytes: float = 0.5 * GIB
    precision: str = "fp32"
    sync: bool = True
    allreduce_precision: str = ""
    zero: int = 0
    recompute: str = "none"
    overlap_iterations: bool = False

    def __post_init__(self) -> None:
        for name in ("optimizer_state_factor", "reserved_bytes"):
            v = getattr(self, name)
            if not (is_finite_number(v) and v >= 0):
                raise FormatError(name, v, "must be a finite number >= 0")
        if self.precision not in PRECISIONS:
            raise FormatError("precision", self.precision, f"must be one of {', '.join(PRECISIONS)}")
        if self.allreduce_precision not in ("", *PRECISIONS):
            raise FormatError("allreduce_precision", self.allreduce_precision,
                              f"must be one of {', '.join(PRECISIONS)} (or empty: the training precision)")
        if self.zero not in ZERO_STAGES or isinstance(self.zero, bool):
            raise FormatError("zero", self.zero, "must be 0 (no sharding), 1 (optimizer state) or 2 (and gradients)")
        if self.recompute not in RECOMPUTE_POLICIES:
            raise FormatError("recompute", self.recompute, f"must be one of {', '.join(RECOMPUTE_POLICIES)}")
        if not isinstance(self.overlap_iterations, bool):
            raise FormatError("overlap_iterations", self.overlap_iterations, "must be true or false")
        if self.overlap_iterations and self.precision == "fp16":
            raise FormatError("overlap_iterations", True, "fp16 training agrees on its loss scale (an inf/NaN check "
                              "over every rank) before each step, which flushes the pipeline; train in bf16 or "
                              "fp32 to overlap iterations, or leave overlap_iterations off")

    @property
    def recompute_modes(self) -> tuple[str, ...]:
        """The recompute modes a planner may give a stage, cheapest first."""
        return RECOMPUTE_MODES if self.recompute == "auto" else (self.recompute,)

    @property
    def allreduce_element_bytes(self) -> int:
        """Bytes of one gradient element as data parallelism all-reduces it."""
        return 4 if (self.allreduce_precision or self.precision) == "fp32" else 2

    @property
    def element_bytes(self) -> int:
        """Bytes of one weight or gradient element in training."""
        return 4 if self.precision == "fp32" else 2

    def bytes_per_parameter(self, weight_versions: int = 1) -> float:
        """Weights (``weight_versions`` copies), gradient, fp32 master copy and optimizer state."""
        e = self.element_bytes
        master = 0 if self.precision == "fp32" else 4
        return weight_versions * e + e + master + 4.0 * self.optimizer_state_factor

    def sharded_bytes_per_parameter(self, weight_versions: int = 1, holders: int = 1) -> float:
        """:meth:`bytes_per_parameter` on one of ``holders`` data-parallel holders of a layer under
        ``zero``: the master copy and optimizer state divided by the holders (ZeRO-1), the gradient
        too (ZeRO-2). ``holders`` 1, or ``zero`` 0: every byte on every holder."""
        if self.zero == 0 or holders <= 1:
            return self.bytes_per_parameter(weight_versions)
        e = self.element_bytes
        master = 0 if self.precision == "fp32" else 4
        grad = e / holders if self.zero >= 2 else e
        return weight_versions * e + grad + (master + 4.0 * self.optimizer_state_factor) / holders

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"overlap_comm": self.overlap_comm, "optimizer_state_factor": self.optimizer_state_factor,
                             "reserved_GiB": self.reserved_bytes / GIB, "precision": self.precision, "sync": self.sync}
        if self.allreduce_precision:
            d["allreduce_precision"] = self.allreduce_precision
        if self.zero:
            d["zero"] = self.zero
        if self.recompute != "none":
            d["recompute"] = self.recompute
        if self.overlap_iterations:
            d["overlap_iterations"] = True
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "pricing.") -> CostOptions:
        if not isinstance(d, Mapping):
            raise FormatError(where.rstrip("."), d, "must be an object {precision, reserved_GiB, ...}")
        known = {"overlap_comm", "optimizer_state_factor", "reserved_GiB", "precision", "sync", "allreduce_precision", "zero",
                 "recompute", "overlap_iterations"}
        for k in d:
            check(k in known, f"{where}{k}", d[k], f"unknown option; known: {', '.join(sorted(known))}")
        try:
            return cls(overlap_comm=opt_field(d, "overlap_comm", bool, False, where),
                       optimizer_state_factor=req_number(d, "optimizer_state_factor", where, default=2.0),
                       reserved_bytes=req_number(d, "reserved_GiB", where, default=0.5) * GIB,
                       precision=opt_field(d, "precision", str, "fp32", where),
                       sync=opt_field(d, "sync", bool, True, where),
                       allreduce_precision=opt_field(d, "allreduce_precision", str, "", where),
                       zero=opt_field(d, "zero", int, 0, where),
                       recompute=opt_field(d, "recompute", str, "none", where),
                       overlap_iterations=opt_field(d, "overlap_iterations", bool, False, where))
        except FormatError as err:
            raise err if err.field.startswith(where) else err.under(where) from None


def priced_optimizer(options: CostOptions | None) -> str:
    """The optimizer a plan's pricing stands for: Adam for 2 (or more) words of state per
    parameter, plain SGD otherwise; plain SGD for a plan that records no pricing (made by hand)."""
    return "adam" if options is not None and options.optimizer_state_factor >= 2 else "sgd"
