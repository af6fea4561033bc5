"""One rank's part of a prepared run (:class:`runtime.run.RunSpec`), from its stages to its figures.

:func:`run_rank` takes the steps in order, in a process group its caller set up
(:mod:`runtime.launch`): the rank's device; its stages, boundary shapes and data
(:func:`rank_context`); the run of its action lists by the executor kind the plan's schedule
names (:data:`EXECUTORS`: :class:`PipelineRun`, the step loop of the flushing schedules with
resuming and checkpoints; :class:`TwoBwRun`, 2bw's one action list; :class:`WspRun`, wsp's waves);
and the rank's figures (:func:`rank_metrics`). What an executor kind cannot do with a config's
options is said by its class and refused before any process starts (:func:`check_time_bound`).

A step is timed between two barriers of all ranks. A run ends after ``steps`` steps, or with
``max_seconds`` at the first step (wave, under ``wsp``) that would start after that many seconds
(at most ``steps``); ``eval_global`` records the global weights and evaluates them after the run
(:mod:`runtime.evaluate`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from partitioner.errors import PartitionerError
from partitioner.plan import Plan
from partitioner.schedule import Action, F, MicroBatching, spec

from .checkpoint import Manifest, latest_complete, restore, save_checkpoint
from .data import DataSource, make_data
from .dataparallel import GradientAverager
from .emulation import LinkDelay, Stretch
from .evaluate import evaluate_versions
from .executor import PipelineExecutor, StashingExecutor
from .layout import Layout, RankInfo
from .master import MasterStep, half_stages
from .memory import ActivationMeter
from .recipe import (
    LossScaler,
    Recipe,
    ScaledStep,
    boundary_dtype,
    make_optimizer,
    model_state_bytes,
    training_recipe,
)
from .recompute import RECOMPUTED, recompute_stage
from .run import RunSpec, TrainConfig
from .stage import boundary_shapes, build_stage
from .tensor_parallel import full_state, shard_rank
from .twobw import TwoBwExecutor
from .wsp import WspExecutor
from .zero import ShardedStep
from .zero_state import empty_view, gathered_view, load_view

__all__ = ["EXECUTORS", "FAULT_ENV", "Feed", "PipelineRun", "RankContext", "RankRun", "TwoBwRun", "WspRun",
           "check_time_bound", "executor_run", "rank_context", "rank_metrics", "run_rank"]

log = logging.getLogger(__name__)

Shape = tuple[torch.Size, torch.dtype]
E = TypeVar("E", bound=StashingExecutor)

# "RANK:STEP[@ATTEMPT][,...]": rank RANK kills itself (SIGKILL) as step STEP begins, in attempt ATTEMPT
# (default 0, the first start; torchrun's restart count, or train --elastic's restart)
FAULT_ENV = "PARTITIONER_FAULT_KILL"


class Feed:
    """The micro-batches of one virtual worker as its executor asks for them: micro-batch ``j``
    counted from the current step (2bw and wsp count on across iterations), rows
    ``[(w * m + j) * b, ...)`` of the step's global batch (a sliced first micro-batch by
    ``batching``), the global batch made once per step."""

    def __init__(self, data: DataSource, batching: MicroBatching, worker: int, device: torch.device):
        self.data, self.batching, self.device = data, batching, device
        self.offset = worker * batching.micro_batches * batching.size
        self.step = 0
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def load(self, step: int) -> None:
        """Number the micro-batches from ``step`` on and make its global batch now (before a timed window)."""
        self.step = step
        self._cache.clear()
        self._cache[step] = self.data.global_batch(step)

    def rows(self, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Micro-batch ``j``'s inputs and targets (on the CPU)."""
        step = self.step + j // self.batching.count  # flushing lists number j within the step; 2bw, wsp across
        if step not in self._cache:
            self._cache.clear()
            self._cache[step] = self.data.global_batch(step)
        x, y = self._cache[step]
        first, last = self.batching.rows(j)
        start, stop = self.offset + first, self.offset + last
        return x[start:stop], (y[start:stop] if y is not None else None)

    def micro_batch(self, j: int) -> torch.Tensor:
        """Micro-batch ``j``'s inputs on the rank's device (the executors' ``data``): a tensor of its
        own, on the CPU too (a view would keep the whole global batch alive in its graph)."""
        return self.rows(j)[0].to(self.device, copy=True)

    def loss(self, y: torch.Tensor, j: int) -> torch.Tensor:
        """The loss of the last stage's output ``y`` for micro-batch ``j`` (the executors' ``loss_fn``)."""
        target = self.rows(j)[1]
        return self.data.loss(y, target.to(self.device) if target is not None else None)


@dataclass(frozen=True)
class RankContext:
    """What one rank has built before its first step: its stages' modules (and every layer of
    them by its global index), the shapes of their inputs (whole micro-batches and slices), its
    data and its feed of micro-batches."""

    run: RunSpec
    rank: int
    me: RankInfo
    device: torch.device
    modules: dict[int, nn.Sequential]
    by_layer: dict[int, nn.Module]
    input_shapes: dict[int, Shape]
    slice_shapes: dict[int, Shape]
    data: DataSource
    feed: Feed

    @property
    def config(self) -> TrainConfig:
        return self.run.config

    @property
    def layout(self) -> Layout:
        return self.run.layout

    @property
    def num_stages(self) -> int:
        return len(self.layout.stage_layers[self.me.worker])

    @property
    def peers(self) -> tuple[int, ...]:
        return self.layout.peers(self.rank)  # (a tensor-parallel rank's peers: runtime.layout)


def rank_context(run: RunSpec, rank: int, device: torch.device) -> RankContext:
    """Rank ``rank``'s stages on ``device`` (every layer seeded on its own), the input shapes of
    its stages (a dry pass on the meta device), its data source and feed."""
    plan, chain, config, layout = run.plan, run.chain, run.config, run.layout
    me = layout.ranks[rank]
    stages_layers = layout.stage_layers[me.worker]
    modules = {s: build_stage(chain, *stages_layers[s], seed=config.seed, device=device) for s in me.stages}
    for s, module in modules.items():  # selective recomputation (runtime.recompute); full: the executor's
        if plan.virtual_workers[me.worker].stages[s].recompute == "selective":
            recompute_stage(module, "selective")
    shard_rank(run, rank, device, modules)  # a tensor-parallel group's shards (runtime.tensor_parallel)
    half = training_recipe(plan, config.optimizer, config.precision).half
    if half is not None:  # mixed precision: half weights and gradients (runtime.master)
        half_stages(modules.values(), half)
    by_layer = {stages_layers[s][0] + k: layer for s, mod in modules.items() for k, layer in enumerate(mod)}
    shapes = boundary_shapes(chain, plan.micro_batch_size)
    input_shapes = {s: shapes[stages_layers[s][0] - 1] for s in me.stages if stages_layers[s][0] > 0}
    batching = plan.micro_batching  # the lists' micro-batches: a sliced first one is first_slices of them
    slice_shapes = {}
    if batching.first_slices > 1:
        small = boundary_shapes(chain, plan.micro_batch_size // batching.first_slices)
        slice_shapes = {s: small[stages_layers[s][0] - 1] for s in input_shapes}
    data = make_data(chain, config.data, plan.micro_batch_size, plan.micro_batches, layout.workers, config.seed)
    feed = Feed(data, batching, me.worker, device)
    return RankContext(run, rank, me, device, modules, by_layer, input_shapes, slice_shapes, data, feed)


# -- the executor kinds -----------------------------------------------------------------------


class RankRun:
    """How one executor kind runs a whole run on one rank (:meth:`train`), and what it can do:
    end by time (``ends_by_time``; ``by_time_one_device``: only with one device per virtual
    worker), record the global weights (``records_global``), emulate the links
    (``emulates_links``). Its figures for the metrics collect in ``figures``."""

    kind: ClassVar[str] = ""
    ends_by_time: ClassVar[bool] = True
    by_time_one_device: ClassVar[bool] = False
    records_global: ClassVar[bool] = True
    emulates_links: ClassVar[bool] = True

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.first = 0  # the first step run (after resuming)
        self.step_s: list[float] = []
        self.averager: GradientAverager | ShardedStep | None = None
        self.optimizer: torch.optim.Optimizer | ShardedStep | MasterStep | None = None
        self.figures: dict[str, Any] = {"replica": ctx.me.replica, "optimizer": "sgd", "precision": "fp32"}

    def train(self) -> PipelineExecutor:
        """Run every step of this rank; returns the executor that ran them."""
        raise NotImplementedError

    def timed_steps(self) -> int:
        """The steps the executor's seconds were summed over."""
        raise NotImplementedError


class PipelineRun(RankRun):
    """The flushing schedules (gpipe, 1f1b, interleaved, bfs and the zero-bubble ones): one action
    list per step between barriers, the gradients averaged over the virtual workers and replicas
    before every optimizer step; resumes from and writes checkpoints. A plan whose iterations
    overlap (``pricing.overlap_iterations``) runs every step's list as one, without the barriers
    (:meth:`_overlapped`)."""

    kind = "pipeline"

    def train(self) -> PipelineExecutor:
        ctx, config = self.ctx, self.ctx.config
        params = [q for mod in ctx.modules.values() for q in mod.parameters()]
        recipe = training_recipe(ctx.run.plan, config.optimizer, config.precision)
        zero = ctx.run.plan.pricing.zero if ctx.run.plan.pricing is not None else 0
        averager: GradientAverager | ShardedStep
        optimizer: Any
        if zero:  # ZeRO-1/2 (runtime.zero): the sync reduce-scatters, the step steps this rank's shards
            averager = optimizer = ShardedStep(ctx.layout, ctx.rank, ctx.by_layer, zero, recipe.optimizer, config.lr,
                                               recipe.reduce_dtype)
            self.figures["zero"] = zero
        else:
            averager = GradientAverager(ctx.layout, ctx.rank, ctx.by_layer, recipe.reduce_dtype)
            if recipe.half is not None:  # an fp32 master copy the optimizer steps (runtime.master)
                optimizer = MasterStep(params, recipe.optimizer, config.lr)
            else:
                optimizer = make_optimizer(params, recipe.optimizer, config.lr) if params else None
        self.optimizer = optimizer
        self.first = self._resume(optimizer)
        averager.delay = _link_delay(config, ctx.layout)
        self.averager = averager
        stages, loss_fn, stepper, input_shapes, slice_shapes = _with_precision(ctx, recipe, optimizer)
        self.figures.update(optimizer=recipe.optimizer, precision=recipe.precision)
        executor = PipelineExecutor(stages, ctx.num_stages, ctx.peers, input_shapes, ctx.run.plan.micro_batches,
                                    ctx.feed.micro_batch, loss_fn, stepper, ctx.device, averager,
                                    batching=ctx.run.plan.micro_batching, slice_shapes=slice_shapes)
        executor.send_to = ctx.layout.send_to(ctx.rank)
        _emulate(executor, ctx)
        actions = ctx.layout.actions(ctx.rank)
        self.figures["micro_batches"] = sorted({a.micro_batch for a in actions if a.kind == F})
        if ctx.run.plan.overlaps_iterations:
            self._overlapped(executor)
            self.figures["link_slept_s"] = averager.delay.slept_s if averager.delay is not None else 0.0
            return executor
        executor.order_channels(ctx.layout.channels(ctx.rank))
        versions: list[dict[int, dict[str, torch.Tensor]]] | None = [] if config.eval_global else None
        self.figures["end_s"] = self._steps(executor, averager, actions, optimizer, versions)
        self.figures["link_slept_s"] = averager.delay.slept_s if averager.delay is not None else 0.0
        if isinstance(stepper, ScaledStep):
            self.figures["loss_scale"] = {"final": stepper.scaler.scale, "skipped_steps": stepper.scaler.skipped}
        if versions is not None and len(ctx.me.stages) == ctx.num_stages:
            self.figures["global_eval"] = [[self.first + k, x] for k, x in enumerate(
                evaluate_versions(ctx.modules, versions, ctx.data, ctx.run.plan.micro_batch_size, ctx.device))]
        return executor

    def timed_steps(self) -> int:
        if "wave_end_s" in self.figures:  # overlapping iterations: seconds summed over the whole run
            return max(len(self.figures["wave_end_s"]), 1)
        ran, warmup = len(self.step_s), self.ctx.config.warmup
        return ran - warmup if ran > warmup else max(ran, 1)

    def _overlapped(self, executor: PipelineExecutor) -> None:
        """Overlapping iterations (``pricing.overlap_iterations``): every step's list run as one,
        each rank stepping on its own stages' gradients and going on to its next iteration at once,
        without a barrier between steps (the lists are those the simulator times over several
        iterations). Records when each of this rank's steps ended (``wave_end_s``, from the start)."""
        ctx, steps = self.ctx, self.ctx.config.steps
        actions = ctx.layout.actions(ctx.rank, iterations=steps)
        executor.order_channels(ctx.layout.channels(ctx.rank, iterations=steps))
        ctx.feed.load(0)
        executor.step_ends = []
        dist.barrier()
        t0 = time.perf_counter()
        executor.run(actions)
        _synchronize(ctx.device)
        dist.barrier()
        self.figures["wave_end_s"] = [t - t0 for t in executor.step_ends]

    def _resume(self, optimizer: Any) -> int:
        """The step this run starts at, agreed by every rank (rank 0's last complete checkpoint
        with ``resume``, checked before any process started), with this rank's layers and
        optimizer state loaded from it by name, whatever plan wrote it (its generator state too
        when the checkpoint's ranks were on this run's devices)."""
        ctx, config = self.ctx, self.ctx.config
        if not (config.checkpoint_dir and config.resume):
            return 0
        manifest = latest_complete(config.checkpoint_dir) if ctx.rank == 0 else None
        agreed = torch.tensor([manifest.step if manifest is not None else 0], device=ctx.device)
        dist.broadcast(agreed, 0)
        first = int(agreed.item())
        if first:
            manifest = latest_complete(config.checkpoint_dir) if manifest is None else manifest
            same = manifest is not None and manifest.devices == tuple(r.device for r in ctx.layout.ranks)
            if isinstance(optimizer, ShardedStep):  # read whole by name, keep this holder's pieces
                view = empty_view(optimizer)
                restore(config.checkpoint_dir, first, ctx.rank, ctx.by_layer, view, same_ranks=same)  # type: ignore[arg-type]
                load_view(optimizer, view)
            else:
                restore(config.checkpoint_dir, first, ctx.rank, ctx.by_layer, optimizer, same_ranks=same)
            log.info("rank %d resumes from step %d", ctx.rank, first)
        return first

    def _steps(self, executor: PipelineExecutor, averager: GradientAverager | ShardedStep, actions: list[Action],
               optimizer: torch.optim.Optimizer | None,
               versions: list[dict[int, dict[str, torch.Tensor]]] | None) -> list[float]:
        """The step loop: every step timed between two barriers, its weights recorded when asked,
        a checkpoint when one is due. Returns the seconds from the run's start to every step's end."""
        ctx, config = self.ctx, self.ctx.config
        bar = self._progress_bar()
        dist.barrier()
        deadline = _deadline(config, ctx.device)
        run_start = time.time()
        end_s: list[float] = []
        for step in range(self.first, config.steps):
            if step > self.first and config.max_seconds and not _before(deadline, ctx.device):
                break
            _fault(ctx.rank, step, config.attempt)
            if step - self.first == config.warmup:
                executor.seconds = dict.fromkeys(executor.seconds, 0.0)
                averager.seconds = 0.0
            ctx.feed.load(step)  # made before the timed window
            dist.barrier()
            t0 = time.perf_counter()
            executor.run(actions)
            _synchronize(ctx.device)
            dist.barrier()
            self.step_s.append(time.perf_counter() - t0)
            if executor.meter is not None:  # the activations are measured in the run's first step
                executor.meter.enabled = False
            end_s.append(time.time() - run_start)
            if versions is not None:
                versions.append({s: {n: q.detach().clone() for n, q in mod.named_parameters()}
                                 for s, mod in ctx.modules.items()})
            self._tick(bar, executor)
            self._checkpoint(step + 1, optimizer)
        if bar is not None:
            bar.close()
        return end_s

    def _progress_bar(self) -> tqdm | None:
        """A progress bar on a terminal, on the rank that computes virtual worker 0's loss (the
        first replica of its last stage); made only when shown (tqdm creates a multiprocessing
        lock, which a killed rank would leak)."""
        ctx, config, me = self.ctx, self.ctx.config, self.ctx.me
        show = (config.progress and sys.stderr.isatty() and me.worker == 0 and ctx.num_stages - 1 in me.stages
                and me.replica == 0 and me.tp_rank == 0)
        if not show:
            return None
        return tqdm(total=config.steps, initial=self.first, unit="step",
                    desc=f"train {ctx.run.chain.name}" + (" (emulated)" if config.emulation else ""),
                    dynamic_ncols=True)

    def _tick(self, bar: tqdm | None, executor: PipelineExecutor) -> None:
        """One step more on the bar, with its loss (none when the last stage is replicated: the
        loss is then the sum over its replicas)."""
        if bar is None:
            return
        if executor.losses and len(self.ctx.layout.stage_ranks[0][-1]) == 1:
            bar.set_postfix(loss=f"{executor.losses[-1]:.4f}", refresh=False)
        bar.update(1)

    def _checkpoint(self, done: int, optimizer: torch.optim.Optimizer | None) -> None:
        """After step ``done``, when a checkpoint is due (every ``checkpoint_every`` steps and at
        the end): every rank's layers and optimizer state by name, in one collective checkpoint
        (:func:`runtime.checkpoint.save_checkpoint`)."""
        ctx, config = self.ctx, self.ctx.config
        every = config.checkpoint_every
        if not (config.checkpoint_dir and ((every and done % every == 0) or done == config.steps)):
            return
        manifest = Manifest(done, ctx.run.plan, config.model, config.seed, config.data,
                            tuple(r.device for r in ctx.layout.ranks))
        # ZeRO: the pieces gathered, so the checkpoint holds whole tensors by name (runtime.zero_state)
        state = gathered_view(optimizer) if isinstance(optimizer, ShardedStep) else optimizer
        save_checkpoint(config.checkpoint_dir, manifest, ctx.rank, ctx.by_layer, state)


class _OneListRun(RankRun):
    """2bw and wsp: the whole run is one action list (:meth:`runtime.layout.Layout.actions` over
    every iteration), run by a :class:`runtime.executor.StashingExecutor`; its seconds are summed
    over the whole run."""

    def _executor(self, cls: type[E]) -> E:
        """This rank's executor of class ``cls``, with the emulation's stretch when emulated."""
        ctx = self.ctx
        executor = cls(ctx.modules, ctx.num_stages, ctx.peers, ctx.input_shapes, ctx.run.plan.micro_batches,
                       ctx.feed.micro_batch, ctx.feed.loss, ctx.device, layout=ctx.layout, rank=ctx.rank, lr=ctx.config.lr)
        _emulate(executor, ctx)
        return executor

    def timed_steps(self) -> int:
        return max(len(self.figures["wave_end_s"]), 1)


class TwoBwRun(_OneListRun):
    """PipeDream-2BW (:mod:`runtime.twobw`): runs ``steps`` iterations, then loads the last weight
    version into the modules. Ends after ``steps`` only; its all-reduce is not emulated."""

    kind = "2bw"
    ends_by_time = False
    records_global = False
    emulates_links = False

    def train(self) -> PipelineExecutor:
        ctx, steps = self.ctx, self.ctx.config.steps
        two = self._executor(TwoBwExecutor)
        actions = ctx.layout.actions(ctx.rank, iterations=steps)
        two.order_channels(ctx.layout.channels(ctx.rank, iterations=steps))
        dist.barrier()
        t0 = time.perf_counter()
        two.run(actions)
        two.drain(steps)
        _synchronize(ctx.device)
        dist.barrier()
        self.figures["wave_end_s"] = [two.push_times[c] - t0 for c in range(steps)]
        two.load_into_modules(steps)
        return two


class WspRun(_OneListRun):
    """Wave Synchronous Parallel (:mod:`runtime.wsp`): runs ``steps`` waves, or the waves that
    start before ``max_seconds`` (one device per virtual worker), pulls every outstanding wave,
    then loads the weights into the modules."""

    kind = "wsp"
    by_time_one_device = True

    def train(self) -> PipelineExecutor:
        ctx, config = self.ctx, self.ctx.config
        wsp = self._executor(WspExecutor)
        wsp.delay = _link_delay(config, ctx.layout)
        if config.eval_global:
            wsp.snapshots = {}
        actions = ctx.layout.actions(ctx.rank, iterations=config.steps)
        wsp.order_channels(ctx.layout.channels(ctx.rank, iterations=config.steps))
        dist.barrier()
        deadline = _deadline(config, ctx.device)
        t0 = time.time()
        if config.max_seconds:
            waves = wsp.run_waves(actions, lambda c: time.time() < deadline)
            last = wsp.finish(waves)
        else:
            wsp.run(actions)
            wsp.drain()
            waves, last = config.steps, config.steps - 1
        _synchronize(ctx.device)
        dist.barrier()
        self.figures.update({
            "wave_end_s": [wsp.push_times[c] - t0 for c in range(waves)],
            "empty_wave_s": {str(c): t - t0 for c, t in wsp.zero_push_times.items()},
            "pull_end_s": {str(c): t - t0 for c, t in wsp.pull_times.items()},
            "start_time": t0,  # time.time() of this rank's start (the clock of every process of a machine)
            "last_wave": last,
            "link_slept_s": wsp.delay.slept_s if wsp.delay is not None else 0.0})
        if wsp.snapshots is not None and len(ctx.me.stages) == ctx.num_stages:
            order = sorted(wsp.snapshots)
            self.figures["global_eval"] = [[c, x] for c, x in zip(order, evaluate_versions(
                ctx.modules, [wsp.snapshots[c] for c in order], ctx.data, ctx.run.plan.micro_batch_size,
                ctx.device), strict=True)]
        wsp.load_into_modules()
        return wsp


# the executor kind a schedule names (ScheduleSpec.executor) -> how a rank runs it
EXECUTORS: dict[str, type[RankRun]] = {c.kind: c for c in (PipelineRun, TwoBwRun, WspRun)}


def executor_run(plan: Plan) -> type[RankRun]:
    """The :class:`RankRun` of the executor kind ``plan``'s schedule names."""
    kind = spec(plan.schedule).executor
    if kind not in EXECUTORS:
        raise PartitionerError(f"schedule {plan.schedule}: executor {kind!r} is not one of this runtime's "
                               f"({', '.join(EXECUTORS)})")
    return EXECUTORS[kind]


def check_time_bound(run: RunSpec) -> None:
    """Refuse, in one line, a run ending by time, evaluating the global model or emulating the
    links that this runtime cannot do for the run's plan."""
    plan, config, layout = run.plan, run.config, run.layout
    kind = executor_run(plan)
    if config.max_seconds and not kind.ends_by_time:
        raise PartitionerError(f"`max_seconds`: a {kind.kind} run ends after `steps`; time-bounded runs are for "
                               "flushing schedules and wsp")
    if config.max_seconds and kind.by_time_one_device and any(len(p) > 1 for p in layout.pipelines):
        raise PartitionerError(f"`max_seconds` with schedule {plan.schedule} needs one device per virtual worker (a "
                               "pipeline's ranks would have to agree on the wave they stop at); this plan's "
                               f"virtual workers have {', '.join(str(len(p)) for p in layout.pipelines)} devices")
    if config.eval_global and (len(layout.pipelines[0]) > 1 or layout.replicated(0)):
        raise PartitionerError("eval_global: the global model is evaluated on virtual worker 0's device, which "
                               "must hold every layer (one device, not replicated)")
    if config.eval_global and not kind.records_global:
        raise PartitionerError(f"eval_global: not recorded for {kind.kind}; use a flushing schedule or wsp")
    if plan.overlaps_iterations:
        _check_overlap(run)
    emulation = config.emulation
    if emulation is not None and emulation.links and not kind.emulates_links:
        raise PartitionerError(f"`emulate_links`: the {kind.kind} all-reduce is not emulated; use a flushing "
                               "schedule or wsp")


def _check_overlap(run: RunSpec) -> None:
    """Refuse, in one line, what overlapping iterations cannot do: stop by time, checkpoint or
    record the global model (no point where every rank has stepped the same number of times but
    the end), or scale an fp16 loss (every rank agrees on inf/NaN before each step: a flush)."""
    config = run.config
    what = ("`max_seconds`" if config.max_seconds else "`checkpoint_dir`" if config.checkpoint_dir
            else "`eval_global`" if config.eval_global else "")
    if what:
        raise PartitionerError(f"{what}: the plan's iterations overlap (pricing.overlap_iterations), so its ranks "
                               "never stand at one step together before the end; run without it, or with a plan "
                               "whose pricing does not overlap iterations")
    if training_recipe(run.plan, config.optimizer, config.precision).scales_loss:
        raise PartitionerError("`precision` fp16: its loss scaling agrees on inf/NaN over every rank before each "
                               "step, which would flush the overlapping iterations (pricing.overlap_iterations); "
                               "train in bf16 or fp32, or with a plan whose pricing does not overlap iterations")


# -- one rank, step by step -----------------------------------------------------------------


def run_rank(run: RunSpec, rank: int, local_rank: int = 0) -> dict[str, Any]:
    """Train on this rank (the process group is initialised); returns this rank's figures."""
    device = _rank_device(run.config, local_rank)
    ctx = rank_context(run, rank, device)
    runner = executor_run(run.plan)(ctx)
    executor = runner.train()
    return rank_metrics(ctx, runner, executor)


def rank_metrics(ctx: RankContext, runner: RankRun, executor: PipelineExecutor) -> dict[str, Any]:
    """This rank's figures after its run (and its stages saved to ``state_dir`` when set)."""
    config, me = ctx.config, ctx.me
    # seconds are summed after the warm-up steps (flushing schedules) or over the whole run (2bw, wsp);
    # "allreduce" (part of "step") is the time in the gradient all-reduces between virtual workers
    seconds = dict(executor.seconds)
    if runner.averager is not None:
        seconds["allreduce"] = runner.averager.seconds
    timed_steps = runner.timed_steps()
    if config.state_dir:  # the fp32 masters of a mixed-precision run (runtime.master), not its half weights
        masters = _masters(runner.optimizer)
        torch.save({s: full_state(m, masters) for s, m in ctx.modules.items()},
                   os.path.join(config.state_dir, f"rank{ctx.rank}.pt"))
    # CUDA: the most memory the caching allocator handed out over the run (tensors alive at
    # once: weights, gradients, optimizer state, activations in flight, buffers); the CUDA
    # context and the allocator's cached-but-free blocks are not in it. Any device:
    # model_state_bytes is the bytes of the stages' parameters, their gradients and the optimizer
    # state after the run (runtime.recipe.model_state_bytes), activation_peak_bytes the most
    # activations held at once in the run's first step (every step under 2bw and wsp; runtime.memory;
    # on the CPU only).
    peak = float(torch.cuda.max_memory_allocated(ctx.device)) if ctx.device.type == "cuda" else None
    state = model_state_bytes(ctx.modules.values(), runner.optimizer)
    stages_layers = ctx.layout.stage_layers[me.worker]
    return {"rank": ctx.rank, "device": me.device, "gpu": me.gpu, "tp_rank": me.tp_rank, "tp_size": me.tp_size,
            "worker": me.worker, "pipe_rank": me.pipe_rank,
            "peak_memory_bytes": peak, "model_state_bytes": state, "stages": list(me.stages),
            "activation_peak_bytes": executor.meter.peak_bytes if executor.meter is not None else None,
            "layers": [list(stages_layers[s]) for s in me.stages],
            "step_s": runner.step_s, "losses": executor.losses if me.tp_rank == 0 else [],  # (one per group)
            "threads": torch.get_num_threads(),
            "first_step": runner.first, "data": ctx.data.kind,
            "seconds_per_step": {k: v / timed_steps for k, v in seconds.items()},
            "emulated_actions": [executor.stretch.actions, executor.stretch.overruns] if executor.stretch else None,
            # selective attention cores recomputed by this process (only when some were)
            **({"core_recomputations": RECOMPUTED[0]} if RECOMPUTED[0] else {}),
            **runner.figures}


def _masters(optimizer: Any) -> dict[int, torch.Tensor]:
    """``id(parameter) -> its fp32 master`` of a mixed-precision rank (whole: a ZeRO rank gathers
    its holders' pieces, collectively); empty in fp32."""
    if isinstance(optimizer, ShardedStep):
        return optimizer.gathered_masters()
    if isinstance(optimizer, MasterStep):
        return dict(optimizer.master_of())
    return {}


def _with_precision(ctx: RankContext, recipe: Recipe, optimizer: Any) -> tuple[
        dict[int, nn.Module], Any, Any, dict[int, Shape], dict[int, Shape]]:
    """What the executor runs under ``recipe``'s precision (:mod:`runtime.recipe`): the stages
    (already half under mixed precision, :func:`runtime.master.half_stages`), the loss (its
    gradient scaled under fp16), the optimizer (its step skipped on an overflow under fp16) and
    the boundaries' types."""
    if recipe.half is None:
        return dict(ctx.modules), ctx.feed.loss, optimizer, dict(ctx.input_shapes), dict(ctx.slice_shapes)

    def typed(shapes: dict[int, Shape]) -> dict[int, Shape]:
        return {s: (shape, boundary_dtype(dtype, recipe)) for s, (shape, dtype) in shapes.items()}

    loss_fn: Any = ctx.feed.loss
    stepper: Any = optimizer
    if recipe.scales_loss:
        scaler = LossScaler()
        loss_fn, stepper = scaler.wrap_loss(ctx.feed.loss), ScaledStep(optimizer, scaler, ctx.device)
    return dict(ctx.modules), loss_fn, stepper, typed(ctx.input_shapes), typed(ctx.slice_shapes)


def _rank_device(config: TrainConfig, local_rank: int) -> torch.device:
    """This process's device: its GPU (made the current one) under ``cuda``, else the CPU."""
    device = torch.device(f"cuda:{local_rank}" if config.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a barrier after it ends a timed window."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _deadline(config: TrainConfig, device: torch.device) -> float:
    """The common end of a run by time: rank 0's clock now plus ``max_seconds`` (every process
    of a machine reads the same ``time.time``); infinite without ``max_seconds``."""
    if not config.max_seconds:
        return float("inf")
    t = torch.tensor([time.time() + config.max_seconds], dtype=torch.float64, device=device)
    dist.broadcast(t, 0)
    return float(t.item())


def _before(deadline: float, device: torch.device) -> bool:
    """Whether the next step starts: rank 0's clock before ``deadline``, every rank taking its decision."""
    go = torch.tensor([1 if time.time() < deadline else 0], dtype=torch.int64, device=device)
    dist.broadcast(go, 0)
    return bool(go.item())


def _fault(rank: int, step: int, attempt: int) -> None:
    """A test hook: the failure of a rank in the middle of a run (see :data:`FAULT_ENV`), in the
    attempt it names (``attempt``: ``train --elastic``'s restart; under torchrun its restart
    count), so that a restarted group can go on or lose another rank."""
    attempt = attempt or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    for entry in os.environ.get(FAULT_ENV, "").split(","):
        where, _, when = entry.strip().partition("@")
        if where == f"{rank}:{step}" and int(when or 0) == attempt:
            os.kill(os.getpid(), signal.SIGKILL)


def _emulate(executor: PipelineExecutor, ctx: RankContext) -> None:
    """Set the executor's full recomputation (the plan's stages of mode ``full``), its activation
    meter (:mod:`runtime.memory`) and, under ``emulate``, the emulation's stretch of its stages."""
    stages = ctx.run.plan.virtual_workers[ctx.me.worker].stages
    executor.recompute_full = {s for s in ctx.me.stages if stages[s].recompute == "full"}
    # the CPU has no allocator peak to read: there the meter counts the activations (its hooks cost
    # time in the steps it watches); on CUDA torch.cuda.max_memory_allocated gives the peak
    executor.meter = ActivationMeter() if ctx.device.type != "cuda" else None
    emulation = ctx.config.emulation
    if emulation is None:
        return
    device = ctx.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    executor.emulate(Stretch.for_device(emulation, ctx.me.device, sync))


def _link_delay(config: TrainConfig, layout: Layout) -> LinkDelay | None:
    """The emulated links' delays (``emulate_links``), or None."""
    if config.emulation is None or not config.emulation.links:
        return None
    return LinkDelay.for_ranks(config.emulation, {r.rank: r.device for r in layout.ranks})
