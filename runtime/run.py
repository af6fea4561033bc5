"""One training run, said once: what to train (:class:`TrainConfig`) and the run every rank
receives (:class:`RunSpec`: the plan, the config, the model's chain and the plan's
:class:`runtime.layout.Layout`), with the checks that need nothing but them.

A run is prepared once, before any process starts (:func:`runtime.launch.prepare`), and the
one :class:`RunSpec` is handed to every rank: local processes receive it (pickled when
spawned, inherited when forked), and under torchrun every process prepares its own through the
same function. A chain holds the model's layers and its input maker (a user's functions,
closures included), which do not pickle: a pickled :class:`RunSpec` carries the plan, the
config and the layout, and the receiving process builds the chain again with
:func:`chain_for`, the function that built it.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from partitioner.emulation import Emulation
from partitioner.errors import PartitionerError
from partitioner.plan import Plan
from partitioner.pricing import PRECISIONS
from partitioner.schedule import spec

from .checkpoint import resume_step
from .data import DATA_KINDS
from .layout import Layout
from .model import is_model_ref, spec_chain
from .recipe import OPTIMIZERS
from .stage import LayerChain, zoo_chain

__all__ = ["RunSpec", "TrainConfig", "chain_for", "check_checkpoint_dir", "check_checkpoints", "check_world_size"]


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how: model (a zoo name or a user's ``module:function``, see
    :mod:`runtime.model`), data (:data:`runtime.data.DATA_KINDS`), steps, the optimizer's learning
    rate, seed, device, threads, checkpoints (:mod:`runtime.checkpoint`). ``optimizer`` (``sgd``,
    ``adam``, ``adamw``) and ``precision`` (``fp32``, ``fp16``, ``bf16``): ``""`` runs what the
    plan was priced with (:mod:`runtime.recipe`)."""

    model: str
    steps: int = 10
    warmup: int = 2
    lr: float = 0.01
    optimizer: str = ""  # "": as the plan was priced (runtime.recipe)
    precision: str = ""  # "": as the plan was priced
    seed: int = 0
    device: str = "cpu"
    threads: int = 0  # torch threads per process; 0 = the machine's cores / processes
    timeout_s: float = 300.0
    model_options: dict[str, Any] = field(default_factory=dict)
    state_dir: str = ""  # when set, every rank saves its stages' weights there (rank{r}.pt)
    pin_cpu: bool = False  # local processes: pin process r to the r-th available core (mod cores)
    data: str = "auto"  # auto: the model's real task (text, classes or the user's make_batch)
    checkpoint_dir: str = ""  # when set, checkpoints go there (every checkpoint_every steps and at the end)
    checkpoint_every: int = 0  # 0: only at the end of the run
    resume: bool = False  # start from the last complete checkpoint in checkpoint_dir (if any)
    progress: bool = True  # a progress bar with the loss, when stderr is a terminal
    node: str = ""  # under torchrun: the plan node this machine is (default: the GROUP_RANK-th, runtime.nodes)
    # heterogeneity emulation: every rank plays its device's GPU type (partitioner.emulation, runtime.emulation)
    emulation: Emulation | None = None
    # replicated stages: worker -> stage -> the replica of each micro-batch
    # (partitioner.placement.replica_assignment; empty: equal times, round-robin)
    replica_assignment: tuple[tuple[tuple[int, ...], ...], ...] = ()
    # a run that ends by time: the first step (wsp: wave) that would start after this many seconds
    # is not run (0: run every step); steps stays the most that are run
    max_seconds: float = 0.0
    # record the global weights after every step (wsp: pull) and report their held-out loss
    # (runtime.evaluate); needs virtual worker 0 on one device
    eval_global: bool = False
    # which start of the run this is: 0 the first, n the n-th restart (``train --elastic``, on a new plan)
    attempt: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise PartitionerError(f"steps = {self.steps!r}: must be an integer >= 1")
        if not (isinstance(self.warmup, int) and self.warmup >= 0):
            raise PartitionerError(f"warmup = {self.warmup!r}: must be an integer >= 0")
        if self.device not in ("cpu", "cuda"):
            raise PartitionerError(f"device = {self.device!r}: must be cpu or cuda")
        if not self.lr > 0:
            raise PartitionerError(f"lr = {self.lr!r}: must be > 0")
        if self.optimizer not in ("", *OPTIMIZERS):
            raise PartitionerError(f"optimizer = {self.optimizer!r}: must be one of {', '.join(OPTIMIZERS)} "
                                   "(or empty: as the plan was priced)")
        if self.precision not in ("", *PRECISIONS):
            raise PartitionerError(f"precision = {self.precision!r}: must be one of {', '.join(PRECISIONS)} "
                                   "(or empty: as the plan was priced)")
        if self.data not in DATA_KINDS:
            raise PartitionerError(f"data = {self.data!r}: must be one of {', '.join(DATA_KINDS)}")
        if not (isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0):
            raise PartitionerError(f"checkpoint_every = {self.checkpoint_every!r}: must be an integer >= 0")
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise PartitionerError("checkpoint_every / resume need a checkpoint directory (`checkpoint_dir`)")
        if not (isinstance(self.max_seconds, (int, float)) and 0 <= self.max_seconds < float("inf")):
            raise PartitionerError(f"max_seconds = {self.max_seconds!r}: must be a number of seconds >= 0 "
                                   "(0: run every step)")
        if self.max_seconds and self.checkpoint_dir:
            raise PartitionerError("`max_seconds`: a run that ends by time is not checkpointed; leave out "
                                   "`checkpoint_dir` or `max_seconds`")
        if not (isinstance(self.attempt, int) and self.attempt >= 0):
            raise PartitionerError(f"attempt = {self.attempt!r}: must be an integer >= 0 (0: the first start)")
        if self.emulation is not None and not isinstance(self.emulation, Emulation):
            raise PartitionerError(f"emulation = {self.emulation!r}: must be a partitioner.emulation.Emulation")


def chain_for(plan: Plan, config: TrainConfig) -> LayerChain:
    """The model ``config`` names as a chain of layers: a user's ``module:function``, or the zoo
    model of the plan (refused in one line when the plan is for another model)."""
    if is_model_ref(config.model):
        return spec_chain(config.model)
    if plan.model != config.model:
        raise PartitionerError(f"the plan is for model '{plan.model}', not '{config.model}'; "
                               f"train the plan's model or plan for {config.model}")
    return zoo_chain(config.model, plan.micro_batch_size, **config.model_options)


@dataclass(frozen=True)
class RunSpec:
    """One run as every rank receives it: the plan, the config, the model's chain and the
    plan's layout (built for that chain, with the config's replica assignment). Made by
    :func:`runtime.launch.prepare`; pickled without its chain, which the receiving process
    builds again (:func:`chain_for`)."""

    plan: Plan
    config: TrainConfig
    layout: Layout
    chain: LayerChain = field(compare=False, repr=False)

    def __reduce__(self) -> tuple[Any, tuple[Plan, TrainConfig, Layout]]:
        return _received, (self.plan, self.config, self.layout)


def _received(plan: Plan, config: TrainConfig, layout: Layout) -> RunSpec:
    """A :class:`RunSpec` unpickled in another process: its chain built there."""
    return RunSpec(plan, config, layout, chain_for(plan, config))


def check_world_size(layout: Layout, world_size: int) -> None:
    """Refuse, in one line, a process group of another size than the plan's devices."""
    if world_size != layout.world_size:
        raise PartitionerError(
            f"the plan runs on {layout.world_size} devices ({', '.join(r.gpu for r in layout.ranks)}), "
            f"one process each, but WORLD_SIZE = {world_size}; start {layout.world_size} processes")


def check_checkpoints(plan: Plan, config: TrainConfig, world_size: int) -> int:
    """Refuse what cannot be checkpointed or resumed (before any step); returns the step to start at."""
    if not config.checkpoint_dir:
        return 0
    if not spec(plan.schedule).flushes:
        raise PartitionerError(f"checkpoints need a flushing schedule (gpipe, 1f1b, interleaved, bfs): "
                               f"{plan.schedule} runs its iterations as one action list without a point where all "
                               f"ranks agree on the weights")
    check_checkpoint_dir(config.checkpoint_dir)
    start = resume_step(config.checkpoint_dir, plan, config.model, config.seed, config.data) if config.resume else 0
    if start >= config.steps:
        raise PartitionerError(f"{config.checkpoint_dir}: the last complete checkpoint is of step {start}, "
                               f"not before `steps` {config.steps}; ask for more steps")
    return start


def check_checkpoint_dir(path: str) -> None:
    """Refuse, in one line, a ``checkpoint_dir`` that checkpoints cannot be written into (a file,
    a place where no directory can be made or no file written); the directory is made when
    missing, as the first checkpoint would make it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise PartitionerError(f"`checkpoint_dir` {path}: is a file, not a directory; name a directory "
                               f"(made when missing)")
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise PartitionerError(f"`checkpoint_dir` {path}: checkpoints cannot be written there "
                               f"({err.strerror or type(err).__name__}); name a writable directory") from None
