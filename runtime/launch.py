"""Start the processes of a plan and train: locally (one process per plan device) or under torchrun.

Rank ``r`` runs plan device ``Plan.devices[r]`` (see :mod:`runtime.layout`; every replica of a
replicated stage is a rank). Each process builds its stages (:mod:`runtime.stage`), executes
its rank's action list of ``partitioner.schedule.build_schedule`` once per step
(:mod:`runtime.executor`; a replica its share of its position's list, ``Layout.actions``) and
averages gradients over the virtual workers and replicas before each optimizer step
(:mod:`runtime.dataparallel`). The data and the loss come from :mod:`runtime.data` (the
model's real task by default, cross-entropy on the last stage); checkpoints and resuming from
:mod:`runtime.checkpoint`.

A step is timed between two barriers of all ranks; the reported iteration time is the median
over the steps after ``warmup``. A run ends after ``steps`` steps, or with ``max_seconds`` at
the first step (wave, under ``wsp``) that would start after that many seconds (at most
``steps``); ``eval_global`` records the global weights and evaluates them after the run
(:mod:`runtime.evaluate`).
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import re
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from partitioner.emulation import Emulation
from partitioner.errors import PartitionerError
from partitioner.plan import Plan
from partitioner.schedule import F, spec

from .checkpoint import plan_sha256, restore_rank, resume_step, save_rank, write_manifest
from .data import DATA_KINDS, make_data
from .dataparallel import GradientAverager
from .emulate import LinkDelay, Stretch
from .evaluate import evaluate_versions
from .executor import PipelineExecutor
from .layout import Layout, plan_layout
from .model import is_model_ref, spec_chain
from .nodes import seat
from .stage import LayerChain, boundary_shapes, build_stage, zoo_chain
from .twobw import TwoBwExecutor
from .wsp import WspExecutor

__all__ = ["FAULT_ENV", "TrainConfig", "check_checkpoints", "check_world_size", "free_port", "gather_json",
           "run_rank", "spawn_local", "train_distributed", "train_local"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how: model (a zoo name or a user's ``module:function``, see
    :mod:`runtime.model`), data (:data:`runtime.data.DATA_KINDS`), steps, SGD learning rate,
    seed, device, threads, checkpoints (:mod:`runtime.checkpoint`)."""

    model: str
    steps: int = 10
    warmup: int = 2
    lr: float = 0.01
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
    # heterogeneity emulation: every rank plays its device's GPU type (partitioner.emulation, runtime.emulate)
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

    def __post_init__(self) -> None:
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise PartitionerError(f"steps = {self.steps!r}: must be an integer >= 1")
        if not (isinstance(self.warmup, int) and self.warmup >= 0):
            raise PartitionerError(f"warmup = {self.warmup!r}: must be an integer >= 0")
        if self.device not in ("cpu", "cuda"):
            raise PartitionerError(f"device = {self.device!r}: must be cpu or cuda")
        if not self.lr > 0:
            raise PartitionerError(f"lr = {self.lr!r}: must be > 0")
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
        if self.emulation is not None and not isinstance(self.emulation, Emulation):
            raise PartitionerError(f"emulation = {self.emulation!r}: must be a partitioner.emulation.Emulation")


def chain_for(plan: Plan, config: TrainConfig) -> LayerChain:
    if is_model_ref(config.model):
        return spec_chain(config.model)
    if plan.model != config.model:
        raise PartitionerError(f"the plan is for model '{plan.model}', not '{config.model}'; "
                               f"train the plan's model or plan for {config.model}")
    return zoo_chain(config.model, plan.micro_batch_size, **config.model_options)


def check_world_size(layout: Layout, world_size: int) -> None:
    if world_size != layout.world_size:
        raise PartitionerError(
            f"the plan runs on {layout.world_size} devices ({', '.join(r.device for r in layout.ranks)}), "
            f"one process each, but WORLD_SIZE = {world_size}; start {layout.world_size} processes")


def check_checkpoints(plan: Plan, config: TrainConfig, world_size: int) -> int:
    """Refuse what cannot be checkpointed or resumed (before any step); returns the step to start at."""
    if not config.checkpoint_dir:
        return 0
    if not spec(plan.schedule).flushes:
        raise PartitionerError(f"checkpoints need a flushing schedule (gpipe, 1f1b, interleaved, bfs): "
                               f"{plan.schedule} runs its iterations as one action list without a point where all "
                               f"ranks agree on the weights")
    start = resume_step(config.checkpoint_dir, plan, world_size) if config.resume else 0
    if start >= config.steps:
        raise PartitionerError(f"{config.checkpoint_dir}: the last complete checkpoint is of step {start}, "
                               f"not before `steps` {config.steps}; ask for more steps")
    return start


def check_time_bound(plan: Plan, config: TrainConfig, layout: Layout) -> None:
    """Refuse, in one line, a run ending by time or evaluating the global model that this
    runtime cannot do for ``plan``."""
    kind = spec(plan.schedule).executor
    if config.max_seconds and kind == "2bw":
        raise PartitionerError("`max_seconds`: a 2bw run ends after `steps`; time-bounded runs are for "
                               "flushing schedules and wsp")
    if config.max_seconds and kind == "wsp" and any(len(p) > 1 for p in layout.pipelines):
        raise PartitionerError("`max_seconds` with schedule wsp needs one device per virtual worker (a "
                               "pipeline's ranks would have to agree on the wave they stop at); this plan's "
                               f"virtual workers have {', '.join(str(len(p)) for p in layout.pipelines)} devices")
    if config.eval_global and (len(layout.pipelines[0]) > 1 or layout.replicated(0)):
        raise PartitionerError("eval_global: the global model is evaluated on virtual worker 0's device, which "
                               "must hold every layer (one device, not replicated)")
    if config.eval_global and kind == "2bw":
        raise PartitionerError("eval_global: not recorded for 2bw; use a flushing schedule or wsp")
    emulation = config.emulation
    if emulation is not None and emulation.links and kind == "2bw":
        raise PartitionerError("`emulate_links`: the 2bw all-reduce is not emulated; use a flushing schedule or wsp")


def _deadline(config: TrainConfig, device: torch.device) -> float:
    """The common end of a run by time: rank 0's clock now plus ``max_seconds`` (every process
    of a machine reads the same ``time.time``); infinite without ``max_seconds``."""
    if not config.max_seconds:
        return float("inf")
    t = torch.tensor([time.time() + config.max_seconds], dtype=torch.float64, device=device)
    dist.broadcast(t, 0)
    return float(t.item())


FAULT_ENV = "PARTITIONER_FAULT_KILL"  # "RANK:STEP": rank RANK kills itself (SIGKILL) as step STEP begins


def _fault(rank: int, step: int) -> None:
    """A test hook: the failure of a rank in the middle of a run (see :data:`FAULT_ENV`); under
    torchrun only in the first attempt, so that a restarted group can go on."""
    spec = os.environ.get(FAULT_ENV, "")
    if spec and spec == f"{rank}:{step}" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)


def run_rank(plan: Plan, config: TrainConfig, rank: int, local_rank: int = 0) -> dict[str, Any]:
    """Train on this rank (the process group is initialised); returns this rank's figures."""
    chain = chain_for(plan, config)
    layout = plan_layout(plan, chain.num_layers, model=chain.name, assignment=config.replica_assignment)
    me = layout.ranks[rank]
    check_time_bound(plan, config, layout)
    device = torch.device(f"cuda:{local_rank}" if config.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    stages_layers = layout.stage_layers[me.worker]
    modules = {s: build_stage(chain, *stages_layers[s], seed=config.seed, device=device) for s in me.stages}
    by_layer = {a + k: layer for s, mod in modules.items() for k, layer in enumerate(mod)
                for a in [stages_layers[s][0]]}
    shapes = boundary_shapes(chain, plan.micro_batch_size)
    input_shapes = {s: shapes[stages_layers[s][0] - 1] for s in me.stages if stages_layers[s][0] > 0}
    batching = plan.micro_batching  # the lists' micro-batches: a sliced first one is first_slices of them
    slice_shapes = {}
    if batching.first_slices > 1:
        small = boundary_shapes(chain, plan.micro_batch_size // batching.first_slices)
        slice_shapes = {s: small[stages_layers[s][0] - 1] for s in input_shapes}
    data = make_data(chain, config.data, plan.micro_batch_size, plan.micro_batches, layout.workers, config.seed)
    m, b, m_run = plan.micro_batches, plan.micro_batch_size, batching.count
    current = {"step": 0}
    cache: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def rows(j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        step = current["step"] + j // m_run  # flushing lists number j within the step; wsp across waves
        if step not in cache:
            cache.clear()
            cache[step] = data.global_batch(step)
        x, y = cache[step]
        first, last = batching.rows(j)
        start, stop = me.worker * m * b + first, me.worker * m * b + last
        return x[start:stop], (y[start:stop] if y is not None else None)

    def micro_batch(j: int) -> torch.Tensor:
        return rows(j)[0].to(device)

    def loss_fn(y: torch.Tensor, j: int) -> torch.Tensor:
        target = rows(j)[1]
        return data.loss(y, target.to(device) if target is not None else None)

    peers, n_stages = layout.pipelines[me.worker], len(stages_layers)
    executor: PipelineExecutor
    averager: GradientAverager | None = None
    step_s: list[float] = []
    extra: dict[str, Any] = {}
    extra_rank: dict[str, Any] = {"replica": me.replica}
    first = 0
    kind = spec(plan.schedule).executor
    if kind == "wsp":
        wsp = WspExecutor(modules, n_stages, peers, input_shapes, m, micro_batch, loss_fn, device,
                          layout=layout, rank=rank, lr=config.lr)
        executor = wsp
        _emulate(wsp, config, me.device, device)
        wsp.delay = _link_delay(config, layout)
        if config.eval_global:
            wsp.snapshots = {}
        actions = layout.actions(rank, iterations=config.steps)
        dist.barrier()
        deadline = _deadline(config, device)
        t0 = time.time()
        if config.max_seconds:
            waves = wsp.run_waves(actions, lambda c: time.time() < deadline)
            last = wsp.finish(waves)
        else:
            wsp.run(actions)
            wsp.drain()
            waves, last = config.steps, config.steps - 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        extra["wave_end_s"] = [wsp.push_times[c] - t0 for c in range(waves)]
        extra["empty_wave_s"] = {str(c): t - t0 for c, t in wsp.zero_push_times.items()}
        extra["pull_end_s"] = {str(c): t - t0 for c, t in wsp.pull_times.items()}
        extra["start_time"] = t0  # time.time() of this rank's start (the clock of every process of a machine)
        extra["last_wave"] = last
        extra["link_slept_s"] = wsp.delay.slept_s if wsp.delay is not None else 0.0
        if wsp.snapshots is not None and len(me.stages) == n_stages:
            order = sorted(wsp.snapshots)
            extra["global_eval"] = [[c, x] for c, x in zip(order, evaluate_versions(
                modules, [wsp.snapshots[c] for c in order], data, b, device), strict=True)]
        wsp.load_into_modules()
    elif kind == "2bw":
        two = TwoBwExecutor(modules, n_stages, peers, input_shapes, m, micro_batch, loss_fn, device,
                            layout=layout, rank=rank, lr=config.lr)
        executor = two
        _emulate(two, config, me.device, device)
        actions = layout.actions(rank, iterations=config.steps)
        dist.barrier()
        t0 = time.perf_counter()
        two.run(actions)
        two.drain(config.steps)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        extra["wave_end_s"] = [two.push_times[c] - t0 for c in range(config.steps)]
        two.load_into_modules(config.steps)
    else:
        params = [q for mod in modules.values() for q in mod.parameters()]
        optimizer = torch.optim.SGD(params, lr=config.lr) if params else None
        plan_hash = plan_sha256(plan)
        if config.checkpoint_dir and config.resume:
            agreed = torch.tensor([resume_step(config.checkpoint_dir, plan, layout.world_size) if rank == 0 else 0],
                                  device=device)
            dist.broadcast(agreed, 0)
            first = int(agreed.item())
            if first:
                restore_rank(config.checkpoint_dir, first, rank, plan_hash, modules, optimizer)
                log.info("rank %d resumes from step %d", rank, first)
        averager = GradientAverager(layout, rank, by_layer)
        averager.delay = _link_delay(config, layout)
        versions: list[dict[int, dict[str, torch.Tensor]]] | None = [] if config.eval_global else None
        end_s: list[float] = []
        executor = PipelineExecutor(modules, n_stages, peers, input_shapes, m, micro_batch, loss_fn, optimizer,
                                    device, averager, batching=batching, slice_shapes=slice_shapes)
        _emulate(executor, config, me.device, device)
        actions = layout.actions(rank)
        extra_rank["micro_batches"] = sorted({a.micro_batch for a in actions if a.kind == F})
        # the bar on the rank that computes virtual worker 0's loss (the first replica of its last stage:
        # a replicated last stage's loss is the sum over its replicas, so the bar shows none then)
        show = (config.progress and sys.stderr.isatty() and me.worker == 0 and n_stages - 1 in me.stages
                and me.replica == 0)
        last_replicated = len(layout.stage_ranks[0][-1]) > 1
        # (made only when shown: tqdm creates a multiprocessing lock, which a killed rank would leak)
        bar = tqdm(total=config.steps, initial=first, unit="step",
                   desc=f"train {chain.name}" + (" (emulated)" if config.emulation else ""),
                   dynamic_ncols=True) if show else None
        dist.barrier()
        deadline = _deadline(config, device)
        run_start = time.time()
        for step in range(first, config.steps):
            if step > first and config.max_seconds:  # every rank takes rank 0's decision
                go = torch.tensor([1 if time.time() < deadline else 0], dtype=torch.int64, device=device)
                dist.broadcast(go, 0)
                if not go.item():
                    break
            _fault(rank, step)
            if step - first == config.warmup:
                executor.seconds = dict.fromkeys(executor.seconds, 0.0)
                averager.seconds = 0.0
            current["step"] = step
            cache.clear()
            cache[step] = data.global_batch(step)  # made before the timed window
            dist.barrier()
            t0 = time.perf_counter()
            executor.run(actions)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            step_s.append(time.perf_counter() - t0)
            end_s.append(time.time() - run_start)
            if versions is not None:
                versions.append({s: {n: q.detach().clone() for n, q in mod.named_parameters()}
                                 for s, mod in modules.items()})
            if bar is not None:
                if executor.losses and not last_replicated:
                    bar.set_postfix(loss=f"{executor.losses[-1]:.4f}", refresh=False)
                bar.update(1)
            done = step + 1
            every = config.checkpoint_every
            if config.checkpoint_dir and ((every and done % every == 0) or done == config.steps):
                save_rank(config.checkpoint_dir, done, rank, plan_hash,
                          {s: mod.state_dict() for s, mod in modules.items()},
                          optimizer.state_dict() if optimizer is not None else None)
                dist.barrier()
                if rank == 0:
                    write_manifest(config.checkpoint_dir, done, plan_hash, layout.world_size)
        if bar is not None:
            bar.close()
        extra_rank["end_s"] = end_s
        extra_rank["link_slept_s"] = averager.delay.slept_s if averager.delay is not None else 0.0
        if versions is not None and len(me.stages) == n_stages:
            extra_rank["global_eval"] = [[first + k, x] for k, x in enumerate(
                evaluate_versions(modules, versions, data, b, device))]
    # seconds are summed after the warm-up steps (flushing schedules) or over the whole run (wsp);
    # "allreduce" (part of "step") is the time in the gradient all-reduces between virtual workers
    seconds = dict(executor.seconds)
    if averager is not None:
        seconds["allreduce"] = averager.seconds
    ran = len(step_s) if not extra else len(extra["wave_end_s"])
    timed_steps = ran - config.warmup if ran > config.warmup and not extra else max(ran, 1)
    if config.state_dir:
        torch.save({s: {k: v.cpu() for k, v in m.state_dict().items()} for s, m in modules.items()},
                   os.path.join(config.state_dir, f"rank{rank}.pt"))
    # CUDA: the most memory the caching allocator handed out over the run (tensors alive at
    # once: weights, gradients, optimizer state, activations in flight, buffers); the CUDA
    # context and the allocator's cached-but-free blocks are not in it. CPU: not measured.
    peak = float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    return {"rank": rank, "device": me.device, "worker": me.worker, "pipe_rank": me.pipe_rank,
            "peak_memory_bytes": peak, "stages": list(me.stages), "layers": [list(stages_layers[s]) for s in me.stages],
            "step_s": step_s, "losses": executor.losses, "threads": torch.get_num_threads(), "first_step": first,
            "data": data.kind, "seconds_per_step": {k: v / timed_steps for k, v in seconds.items()},
            "emulated_actions": [executor.stretch.actions, executor.stretch.overruns] if executor.stretch else None,
            **extra_rank, **extra}


def _emulate(executor: PipelineExecutor, config: TrainConfig, plan_device: str, device: torch.device) -> None:
    """Hook the emulation's stretch of this rank's stages into its executor (``--emulate``)."""
    if config.emulation is None:
        return
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    executor.emulate(Stretch.for_device(config.emulation, plan_device, sync))


def _link_delay(config: TrainConfig, layout: Layout) -> LinkDelay | None:
    """The emulated links' delays (``--emulate-links``), or None."""
    if config.emulation is None or not config.emulation.links:
        return None
    return LinkDelay.for_ranks(config.emulation, {r.rank: r.device for r in layout.ranks})


def _summary(plan: Plan, config: TrainConfig, per_rank: list[dict[str, Any]], backend: str) -> dict[str, Any]:
    if "wave_end_s" in per_rank[0]:  # wsp: the time between the ends (pushes) of successive waves
        common = min(len(r["wave_end_s"]) for r in per_rank)  # waves every worker ran
        ends = [max(r["wave_end_s"][c] for r in per_rank) for c in range(common)]
        steps = [ends[0], *(b - a for a, b in itertools.pairwise(ends))] if ends else []
    else:
        steps = [max(r["step_s"][k] for r in per_rank) for k in range(len(per_rank[0]["step_s"]))]
    timed = steps[config.warmup:] or steps
    iteration = statistics.median(timed) if timed else float("nan")
    workers = len(plan.virtual_workers)
    # a worker's loss is the sum over the ranks that compute it (the replicas of a replicated last
    # stage each hold their micro-batches' share); the reported loss is the mean over workers
    by_worker: dict[int, list[float]] = {}
    for r in per_rank:
        if r["losses"]:
            have = by_worker.setdefault(r["worker"], [0.0] * len(r["losses"]))
            by_worker[r["worker"]] = [a + b for a, b in zip(have, r["losses"], strict=True)]
    losses = list(by_worker.values())
    # (a run ended by time: the waves every worker ran; a worker's own losses are in "worker_loss")
    mean_loss = [sum(ls[k] for ls in losses) / len(losses) for k in range(min(len(ls) for ls in losses))] if losses else []
    waves = {str(r["worker"]): len(r["wave_end_s"]) for r in per_rank if "wave_end_s" in r}
    done = ([waves[str(w)] for w in range(workers)] if waves else [len(steps)] * workers)
    return {
        "format": "partitioner.train-metrics/1",
        "model": plan.model, "schedule": plan.schedule, "micro_batch_size": plan.micro_batch_size,
        "micro_batches": plan.micro_batches, "virtual_workers": workers, "world_size": len(per_rank),
        "backend": backend,
        "config": {k: v for k, v in asdict(config).items() if k not in ("state_dir", "emulation")},
        "data": per_rank[0]["data"], "first_step": per_rank[0]["first_step"],
        "measured_iteration_s": iteration,
        "samples_per_s": workers * plan.micro_batches * plan.micro_batch_size / iteration,
        "step_s": steps, "loss": mean_loss,
        "worker_loss": {str(w): ls for w, ls in sorted(by_worker.items())},
        "iterations_per_worker": done,
        "samples": sum(done) * plan.micro_batches * plan.micro_batch_size,
        **_global_eval(config, per_rank),
        "ranks": [{k: r[k] for k in ("rank", "device", "worker", "pipe_rank", "stages", "layers", "threads",
                                          "seconds_per_step", "peak_memory_bytes", "replica", "micro_batches",
                                          "start_time", "wave_end_s", "empty_wave_s", "pull_end_s")
                   if k in r}
                  for r in per_rank],
        **({"emulated": _emulated(config.emulation, per_rank)} if config.emulation else {}),
    }


def _global_eval(config: TrainConfig, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The metrics' ``global_eval``: the held-out loss of the global model against the time it
    existed, from the start of the run. A flushing schedule's step ``k`` model exists at the end
    of step ``k``; a WSP wave ``c`` model when the last virtual worker has pushed ``c`` (or its
    empty update, in a run ended by time) and, under link emulation, the all-reduce's emulated
    seconds later (the longest collective's)."""
    if not config.eval_global or "global_eval" not in per_rank[0]:
        return {}
    evals = per_rank[0]["global_eval"]
    if "wave_end_s" not in per_rank[0]:
        ends = per_rank[0]["end_s"]
        first = per_rank[0]["first_step"]
        return {"global_eval": [{"iteration": k, "t_s": ends[k - first], "loss": x} for k, x in evals]}
    emulation = config.emulation
    link_s = max((c.seconds for c in emulation.collectives), default=0.0) if emulation is not None else 0.0
    out = []
    for c, x in evals:
        pushed = [r["wave_end_s"][c] if c < len(r["wave_end_s"]) else r["empty_wave_s"].get(str(c))
                  for r in per_rank]
        if any(t is None for t in pushed):
            continue
        out.append({"iteration": c, "t_s": max(pushed) + link_s, "loss": x})
    return {"global_eval": out}


def _emulated(emulation: Emulation, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The metrics' ``emulated`` entry: the reference, the rule, and every rank's GPU type,
    factors and seconds slept per step."""
    return {**emulation.to_dict(),
            "ranks": [{"rank": r["rank"], "device": r["device"], "gpu_type": emulation.gpu_type(r["device"]),
                       "factors": {str(s): list(f) for s, f in emulation.factors(r["device"]).items()},
                       "slept_s_per_step": r["seconds_per_step"].get("emulation", 0.0),
                       "link_slept_s": r.get("link_slept_s", 0.0),
                       "actions": r["emulated_actions"][0], "overruns": r["emulated_actions"][1]}
                      for r in per_rank]}


def _threads(config: TrainConfig, nprocs: int) -> int:
    if config.threads:
        return config.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // nprocs)


def train_distributed(plan: Plan, config: TrainConfig) -> dict[str, Any] | None:
    """Train under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set).
    Returns the metrics on rank 0 and ``None`` on the other ranks."""
    chain = chain_for(plan, config)
    layout = plan_layout(plan, chain.num_layers, model=chain.name, assignment=config.replica_assignment)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_world_size(layout, world)
    check_checkpoints(plan, config, world)
    me = seat(layout, os.environ, config.node or None)  # the plan device this process plays
    rank = me.rank
    backend = "nccl" if config.device == "cuda" else "gloo"
    torch.set_num_threads(_threads(config, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    timeout = datetime.timedelta(seconds=config.timeout_s)
    dist.init_process_group(backend, store=attempt_store(os.environ, timeout), rank=rank, world_size=world,
                            timeout=timeout)
    try:
        mine = run_rank(plan, config, rank, me.gpu_index)
        gathered = gather_json(mine, world, _collective_device(config, me.gpu_index))
    finally:
        dist.destroy_process_group()
    return _summary(plan, config, gathered, backend) if rank == 0 else None


def attempt_store(env: Mapping[str, str], timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store of this torchrun attempt: torchrun's store, under a prefix of its own.

    torchrun keeps one store for every attempt of a job (the agent's, or the one rank 0 serves),
    and the process group's keys carry no attempt: after a restart, a process could read the
    address the previous attempt's rank 0 published before the new rank 0 replaced it, and dial
    a process that is gone, or pass a barrier counted by the dead attempt. The attempt number
    (``TORCHELASTIC_RESTART_COUNT``) in the prefix keeps each attempt's keys apart.
    """
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    host = env.get("RANK", "0") == "0" and not agent  # without the agent's store, torchrun's rank 0 serves it
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, host, timeout,
                          wait_for_workers=False)
    return dist.PrefixStore(f"partitioner/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def _collective_device(config: TrainConfig, local_rank: int) -> torch.device:
    return torch.device(f"cuda:{local_rank}" if config.device == "cuda" else "cpu")


def gather_json(obj: Any, world: int, device: torch.device) -> list[Any]:
    """Every rank's ``obj`` (JSON-serialisable), on every rank, as JSON bytes in tensors.

    No rank unpickles what another process sent: each receives UTF-8 JSON text and parses
    it. Two all-gathers: the lengths, then the bytes padded to the longest.
    """
    data = json.dumps(obj, allow_nan=True).encode("utf-8")
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    longest = max(int(x.item()) for x in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    bufs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(bufs, buf)
    return [json.loads(b[:int(n.item())].cpu().numpy().tobytes().decode("utf-8")) for b, n in zip(bufs, sizes)]


# -- local processes ------------------------------------------------------------------------


def free_port() -> int:
    """A port that was free a moment ago (for tests that start torchrun). The runtime itself does
    not use it: a port released and bound again later can be taken in between."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _loopback_store(timeout_s: float) -> dist.TCPStore:
    """The rendezvous store of a local run, served by this (the parent) process on 127.0.0.1 only.

    The listening socket is bound here, to loopback and an ephemeral port, and handed to the
    store; the port is then passed to the children, so no port is released and re-bound (no
    race) and nothing listens beyond this machine.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        store = dist.TCPStore("127.0.0.1", int(sock.getsockname()[1]), None, True,
                              datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
                              master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns (and closes) the descriptor now
    return store


def _loopback_interface() -> str:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    for _, name in socket.if_nameindex() if hasattr(socket, "if_nameindex") else []:
        if name.startswith("lo"):
            return name
    return "lo"


def _pin(local_rank: int) -> None:
    """Keep process ``local_rank`` on one core, so the scheduler does not move a receiver onto
    its sender's core when the sender wakes it."""
    if hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[local_rank % len(cores)]})


def _bootstrap(local_rank: int, fn: Callable[..., Any], world: int, port: int, backend: str, threads: int,
               timeout_s: float, pin: bool, args: tuple[Any, ...]) -> None:
    if pin:
        _pin(local_rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
    # gloo's and NCCL's own sockets on the loopback interface too (the default follows the hostname)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    os.environ.setdefault("NCCL_SOCKET_IFNAME", _loopback_interface())
    torch.set_num_threads(threads)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout)
    dist.init_process_group(backend, store=store, rank=local_rank, world_size=world, timeout=timeout)
    try:
        fn(local_rank, world, *args)
    finally:
        dist.destroy_process_group()


def _exception_line(trace: str) -> str:
    """The line of a formatted traceback that names the exception (``Type: message``), with
    this library's own errors shown by their message alone."""
    lines = [ln for ln in trace.splitlines() if ln.strip()]
    named = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)(: |$)", ln)]
    line = (named or lines or ["no message"])[-1].strip()
    for prefix in ("partitioner.errors.PartitionerError: ", "partitioner.errors.FormatError: "):
        line = line.removeprefix(prefix)
    return line


def spawn_local(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), *, backend: str = "gloo",
                threads: int = 1, timeout_s: float = 300.0, start_method: str = "spawn", pin_cpu: bool = False,
                rank_names: list[str] | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``nprocs`` processes on this machine, in one
    process group whose store this process serves on 127.0.0.1 (see :func:`_loopback_store`).
    Raises :class:`PartitionerError` if they have not finished after ``timeout_s`` (the
    processes are terminated), or, in one line naming the rank (and ``rank_names[rank]``), if a
    process dies (its signal or exit code) or raises (the exception's last line); the other
    processes are then stopped. ``pin_cpu`` keeps process ``r`` on the ``r``-th available core
    (modulo the cores)."""

    def names(r: int) -> str:
        return f" ({rank_names[r]})" if rank_names and 0 <= r < len(rank_names) else ""

    store = _loopback_store(timeout_s + 30.0)
    # torch logs a warning per process it stops after a failure; the failure is reported in one line below
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        ctx = mp.start_processes(_bootstrap, args=(fn, nprocs, store.port, backend, threads, timeout_s, pin_cpu, args),
                                 nprocs=nprocs, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s + 30.0
        while True:
            try:
                if ctx.join(timeout=0.5, grace_period=1.0):
                    break
            except mp.ProcessExitedException as err:
                how = (f"was killed by signal {err.signal_name}" if err.signal_name
                       else f"exited with code {err.exit_code}")
                raise PartitionerError(f"rank {err.error_index}{names(err.error_index)} {how}; "
                                       f"the other processes were stopped") from None
            except mp.ProcessRaisedException as err:
                raise PartitionerError(f"rank {err.error_index}{names(err.error_index)} failed: "
                                       f"{_exception_line(str(err))}") from None
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.terminate()
                raise PartitionerError(f"the {nprocs} training processes did not finish within {timeout_s:.0f} s")
    finally:
        del store  # stops serving


def _local_worker(rank: int, world: int, plan_dict: dict[str, Any], config: TrainConfig, out_dir: str) -> None:
    plan = Plan.from_dict(plan_dict)
    mine = run_rank(plan, config, rank, rank)
    gathered = gather_json(mine, world, _collective_device(config, rank))
    if rank == 0:
        with open(os.path.join(out_dir, "metrics.json"), "w", encoding="utf-8") as f:
            json.dump(_summary(plan, config, gathered, dist.get_backend()), f)


def train_local(plan: Plan, config: TrainConfig, start_method: str = "spawn") -> dict[str, Any]:
    """Train ``plan`` with one process per plan device on this machine; returns the metrics."""
    import json

    chain = chain_for(plan, config)
    layout = plan_layout(plan, chain.num_layers, model=chain.name, assignment=config.replica_assignment)
    n = layout.world_size
    if config.device == "cuda" and torch.cuda.device_count() < n:
        raise PartitionerError(f"the plan needs {n} GPUs on this machine; torch sees {torch.cuda.device_count()}")
    check_checkpoints(plan, config, n)
    check_time_bound(plan, config, layout)
    make_data(chain, config.data, plan.micro_batch_size, plan.micro_batches, layout.workers, config.seed)
    with tempfile.TemporaryDirectory(prefix="partitioner-train-") as tmp:
        spawn_local(_local_worker, n, (plan.to_dict(), config, tmp),
                    backend="nccl" if config.device == "cuda" else "gloo", threads=_threads(config, n),
                    timeout_s=config.timeout_s, start_method=start_method, pin_cpu=config.pin_cpu,
                    rank_names=[f"device {r.device}" for r in layout.ranks])
        with open(os.path.join(tmp, "metrics.json"), encoding="utf-8") as f:
            return dict(json.load(f))
