"""Start the processes of a plan and train: locally (one process per plan device) or under torchrun.

Rank ``r`` runs plan device ``Plan.devices[r]`` (see :mod:`runtime.layout`). Each process
builds its stages (:mod:`runtime.stage`), executes its rank's action list of
``partitioner.schedule.build_schedule`` once per step (:mod:`runtime.executor`) and
averages gradients over the virtual workers before each optimizer step
(:mod:`runtime.dataparallel`). The loss is the mean of the model's output over the global
batch (the zoo defines no loss; any scalar works for measuring and for the numerics check).

A step is timed between two barriers of all ranks; the reported iteration time is the median
over the steps after ``warmup``.
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partitioner.errors import PartitionerError
from partitioner.plan import Plan
from partitioner.schedule import build_schedule

from .data import SyntheticData
from .dataparallel import GradientAverager
from .executor import PipelineExecutor
from .layout import Layout, plan_layout
from .stage import LayerChain, boundary_shapes, build_stage, zoo_chain
from .wsp import WspExecutor

__all__ = ["TrainConfig", "check_world_size", "free_port", "gather_json", "run_rank", "spawn_local",
           "train_distributed", "train_local"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how: zoo model, steps, SGD learning rate, seed, device, threads."""

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

    def __post_init__(self) -> None:
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise PartitionerError(f"steps = {self.steps!r}: must be an integer >= 1")
        if not (isinstance(self.warmup, int) and self.warmup >= 0):
            raise PartitionerError(f"warmup = {self.warmup!r}: must be an integer >= 0")
        if self.device not in ("cpu", "cuda"):
            raise PartitionerError(f"device = {self.device!r}: must be cpu or cuda")
        if not self.lr > 0:
            raise PartitionerError(f"lr = {self.lr!r}: must be > 0")


def chain_for(plan: Plan, config: TrainConfig) -> LayerChain:
    if plan.model != config.model:
        raise PartitionerError(f"the plan is for model '{plan.model}', not '{config.model}'; "
                               f"train the plan's model or plan for {config.model}")
    return zoo_chain(config.model, plan.micro_batch_size, **config.model_options)


def check_world_size(layout: Layout, world_size: int) -> None:
    if world_size != layout.world_size:
        raise PartitionerError(
            f"the plan runs on {layout.world_size} devices ({', '.join(r.device for r in layout.ranks)}), "
            f"one process each, but WORLD_SIZE = {world_size}; start {layout.world_size} processes")


def run_rank(plan: Plan, config: TrainConfig, rank: int, local_rank: int = 0) -> dict[str, Any]:
    """Train on this rank (the process group is initialised); returns this rank's figures."""
    chain = chain_for(plan, config)
    layout = plan_layout(plan, chain.num_layers)
    me = layout.ranks[rank]
    device = torch.device(f"cuda:{local_rank}" if config.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    stages_layers = layout.stage_layers[me.worker]
    modules = {s: build_stage(chain, *stages_layers[s], seed=config.seed, device=device) for s in me.stages}
    by_layer = {a + k: layer for s, mod in modules.items() for k, layer in enumerate(mod)
                for a in [stages_layers[s][0]]}
    shapes = boundary_shapes(chain, plan.micro_batch_size)
    input_shapes = {s: shapes[stages_layers[s][0] - 1] for s in me.stages if stages_layers[s][0] > 0}
    data = SyntheticData(chain.make_input, plan.micro_batch_size, plan.micro_batches, layout.workers, config.seed)
    m = plan.micro_batches
    current = {"step": 0}
    cache: dict[int, torch.Tensor] = {}

    def micro_batch(j: int) -> torch.Tensor:
        step = current["step"] + j // m  # flushing lists number j within the step; wsp across waves
        if step not in cache:
            cache.clear()
            cache[step] = data.global_batch(step)
        start = (me.worker * m + j % m) * plan.micro_batch_size
        return cache[step][start:start + plan.micro_batch_size].to(device)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.float().mean()

    p = len(layout.pipelines[me.worker])
    peers, n_stages = layout.pipelines[me.worker], len(stages_layers)
    executor: PipelineExecutor
    step_s: list[float] = []
    extra: dict[str, Any] = {}
    if plan.schedule == "wsp":
        wsp = WspExecutor(modules, n_stages, peers, input_shapes, m, micro_batch, loss_fn, device,
                          layout=layout, rank=rank, lr=config.lr)
        executor = wsp
        actions = build_schedule("wsp", p, m, plan.chunks, iterations=config.steps,
                                 staleness=plan.staleness)[me.pipe_rank]
        dist.barrier()
        t0 = time.perf_counter()
        wsp.run(actions)
        wsp.drain()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()
        extra["wave_end_s"] = [wsp.push_times[c] - t0 for c in range(config.steps)]
        wsp.load_into_modules()
    else:
        params = [q for mod in modules.values() for q in mod.parameters()]
        optimizer = torch.optim.SGD(params, lr=config.lr) if params else None
        averager = GradientAverager(layout, rank, by_layer)
        executor = PipelineExecutor(modules, n_stages, peers, input_shapes, m, micro_batch, loss_fn, optimizer,
                                    device, averager)
        actions = build_schedule(plan.schedule, p, m, plan.chunks)[me.pipe_rank]
        for step in range(config.steps):
            if step == config.warmup:
                executor.seconds = dict.fromkeys(executor.seconds, 0.0)
            current["step"] = step
            cache.clear()
            cache[step] = data.global_batch(step)
            dist.barrier()
            t0 = time.perf_counter()
            executor.run(actions)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()
            step_s.append(time.perf_counter() - t0)
    # seconds are summed after the warm-up steps (flushing schedules) or over the whole run (wsp)
    timed_steps = config.steps - config.warmup if config.steps > config.warmup and not extra else config.steps
    if config.state_dir:
        torch.save({s: {k: v.cpu() for k, v in m.state_dict().items()} for s, m in modules.items()},
                   os.path.join(config.state_dir, f"rank{rank}.pt"))
    return {"rank": rank, "device": me.device, "worker": me.worker, "pipe_rank": me.pipe_rank,
            "stages": list(me.stages), "layers": [list(stages_layers[s]) for s in me.stages],
            "step_s": step_s, "losses": executor.losses, "threads": torch.get_num_threads(),
            "seconds_per_step": {k: v / timed_steps for k, v in executor.seconds.items()}, **extra}


def _summary(plan: Plan, config: TrainConfig, per_rank: list[dict[str, Any]], backend: str) -> dict[str, Any]:
    if "wave_end_s" in per_rank[0]:  # wsp: the time between the ends (pushes) of successive waves
        ends = [max(r["wave_end_s"][c] for r in per_rank) for c in range(config.steps)]
        steps = [ends[0], *(b - a for a, b in itertools.pairwise(ends))]
    else:
        steps = [max(r["step_s"][k] for r in per_rank) for k in range(config.steps)]
    timed = steps[config.warmup:] or steps
    iteration = statistics.median(timed)
    workers = len(plan.virtual_workers)
    losses = [r["losses"] for r in per_rank if r["losses"]]
    mean_loss = [sum(ls[k] for ls in losses) / len(losses) for k in range(config.steps)] if losses else []
    return {
        "format": "partitioner.train-metrics/1",
        "model": plan.model, "schedule": plan.schedule, "micro_batch_size": plan.micro_batch_size,
        "micro_batches": plan.micro_batches, "virtual_workers": workers, "world_size": len(per_rank),
        "backend": backend, "config": {k: v for k, v in asdict(config).items() if k != "state_dir"},
        "measured_iteration_s": iteration,
        "samples_per_s": workers * plan.micro_batches * plan.micro_batch_size / iteration,
        "step_s": steps, "loss": mean_loss,
        "ranks": [{k: r[k] for k in ("rank", "device", "worker", "pipe_rank", "stages", "layers", "threads",
                                          "seconds_per_step")}
                  for r in per_rank],
    }


def _threads(config: TrainConfig, nprocs: int) -> int:
    if config.threads:
        return config.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // nprocs)


def train_distributed(plan: Plan, config: TrainConfig) -> dict[str, Any] | None:
    """Train under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set).
    Returns the metrics on rank 0 and ``None`` on the other ranks."""
    layout = plan_layout(plan, chain_for(plan, config).num_layers)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_world_size(layout, world)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if config.device == "cuda" else "gloo"
    torch.set_num_threads(_threads(config, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=config.timeout_s))
    try:
        mine = run_rank(plan, config, rank, local_rank)
        gathered = gather_json(mine, world, _collective_device(config, local_rank))
    finally:
        dist.destroy_process_group()
    return _summary(plan, config, gathered, backend) if rank == 0 else None


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


def spawn_local(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), *, backend: str = "gloo",
                threads: int = 1, timeout_s: float = 300.0, start_method: str = "spawn", pin_cpu: bool = False) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``nprocs`` processes on this machine, in one
    process group whose store this process serves on 127.0.0.1 (see :func:`_loopback_store`).
    Raises :class:`PartitionerError` if they have not finished after ``timeout_s`` (the
    processes are terminated). ``pin_cpu`` keeps process ``r`` on the ``r``-th available core
    (modulo the cores)."""
    store = _loopback_store(timeout_s + 30.0)
    try:
        ctx = mp.start_processes(_bootstrap, args=(fn, nprocs, store.port, backend, threads, timeout_s, pin_cpu, args),
                                 nprocs=nprocs, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s + 30.0
        while not ctx.join(timeout=0.5):
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
    layout = plan_layout(plan, chain_for(plan, config).num_layers)
    n = layout.world_size
    if config.device == "cuda" and torch.cuda.device_count() < n:
        raise PartitionerError(f"the plan needs {n} GPUs on this machine; torch sees {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory(prefix="partitioner-train-") as tmp:
        spawn_local(_local_worker, n, (plan.to_dict(), config, tmp),
                    backend="nccl" if config.device == "cuda" else "gloo", threads=_threads(config, n),
                    timeout_s=config.timeout_s, start_method=start_method, pin_cpu=config.pin_cpu)
        with open(os.path.join(tmp, "metrics.json"), encoding="utf-8") as f:
            return dict(json.load(f))
