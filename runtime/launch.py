"""Start the processes of a plan and train: locally (one process per plan device) or under torchrun.

A run is prepared once (:func:`prepare`: the model's chain, the plan's layout, what the runtime
refuses for the config's options) and the one :class:`runtime.run.RunSpec` is handed to every
rank. Rank ``r`` runs plan device ``Plan.devices[r]`` (see :mod:`runtime.layout`; every replica of a
replicated stage is a rank): :func:`runtime.rank.run_rank` builds its stages, runs its action
lists of ``partitioner.schedule.build_schedule`` with the executor its schedule names (gradients
averaged over the virtual workers and replicas, :mod:`runtime.dataparallel`) and returns its
figures, which rank 0 gathers into the run's metrics (:func:`_summary`). The data and the loss
come from :mod:`runtime.data`; checkpoints and resuming from :mod:`runtime.checkpoint`.

The reported iteration time is the median over the steps after ``warmup`` of each step's time
between two barriers of all ranks (under ``wsp``, between the ends of successive waves).
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import re
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from partitioner.emulation import Emulation
from partitioner.errors import PartitionerError
from partitioner.plan import Plan

from .data import make_data
from .layout import plan_layout
from .nodes import seat
from .rank import FAULT_ENV, check_time_bound, run_rank
from .recipe import training_recipe
from .run import RunSpec, TrainConfig, chain_for, check_checkpoints, check_world_size
from .stage import LayerChain
from .tensor_parallel import check_tensor_parallel

# (TrainConfig, RunSpec, the checks and run_rank are defined in runtime.run and runtime.rank, and named here too)
__all__ = ["FAULT_ENV", "GroupLost", "RankFailed", "RunSpec", "TrainConfig", "check_checkpoints", "check_world_size", "free_port", "gather_json",
           "lost_group", "prepare", "run_rank", "spawn_local", "train_distributed", "train_local"]

def prepare(plan: Plan, config: TrainConfig, chain: LayerChain | None = None) -> RunSpec:
    """The run every rank receives, computed once: the model's chain (``chain`` when the caller
    built it with :func:`runtime.run.chain_for`), the plan's layout for that chain with the
    config's replica assignment, and the refusal, in one line before any process starts, of what
    this runtime cannot do with the config's options (:func:`runtime.rank.check_time_bound`) or
    cannot shard (:func:`runtime.tensor_parallel.check_tensor_parallel`)."""
    chain = chain if chain is not None else chain_for(plan, config)
    layout = plan_layout(plan, chain.num_layers, model=chain.name, assignment=config.replica_assignment)
    run = RunSpec(plan, config, layout, chain)
    check_time_bound(run)
    training_recipe(plan, config.optimizer, config.precision)  # an optimizer the executor cannot run: refused
    check_tensor_parallel(run)
    return run


def _prepared(plan: Plan, config: TrainConfig, run: RunSpec | None) -> RunSpec:
    """``run`` (checked to be of ``plan`` and ``config``), or the run prepared from them."""
    if run is None:
        return prepare(plan, config)
    if run.plan != plan or run.config != config:
        raise ValueError("`run` was prepared from another plan or config than the ones given")
    return run


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
        "optimizer": per_rank[0].get("optimizer"), "precision": per_rank[0].get("precision"),
        "zero": per_rank[0].get("zero", 0),
        "config": {k: v for k, v in asdict(config).items() if k not in ("state_dir", "emulation")},
        "data": per_rank[0]["data"], "first_step": per_rank[0]["first_step"],
        "measured_iteration_s": iteration,
        "samples_per_s": workers * plan.micro_batches * plan.micro_batch_size / iteration,
        "step_s": steps, "loss": mean_loss,
        "worker_loss": {str(w): ls for w, ls in sorted(by_worker.items())},
        "iterations_per_worker": done,
        "samples": sum(done) * plan.micro_batches * plan.micro_batch_size,
        **_global_eval(config, per_rank),
        "ranks": [{k: r[k] for k in ("rank", "device", "gpu", "tp_rank", "tp_size", "worker", "pipe_rank", "stages",
                                          "layers", "threads", "seconds_per_step", "peak_memory_bytes",
                                          "model_state_bytes", "activation_peak_bytes", "loss_scale", "replica", "micro_batches",
                                          "start_time", "wave_end_s", "empty_wave_s", "pull_end_s",
                                          "core_recomputations")
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


def train_distributed(plan: Plan, config: TrainConfig, *, run: RunSpec | None = None) -> dict[str, Any] | None:
    """Train under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set).
    ``run``: the run :func:`prepare` made of ``plan`` and ``config`` (prepared here when not
    given). Returns the metrics on rank 0 and ``None`` on the other ranks."""
    run = _prepared(plan, config, run)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_world_size(run.layout, world)
    check_checkpoints(plan, config, world)
    me = seat(run.layout, os.environ, config.node or None)  # the plan device this process plays
    rank = me.rank
    backend = "nccl" if config.device == "cuda" else "gloo"
    torch.set_num_threads(_threads(config, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    timeout = datetime.timedelta(seconds=config.timeout_s)
    dist.init_process_group(backend, store=attempt_store(os.environ, timeout), rank=rank, world_size=world,
                            timeout=timeout)
    try:
        mine = run_rank(run, rank, me.gpu_index)
        gathered = gather_json(mine, world, _collective_device(config, me.gpu_index))
    except Exception as err:
        if world > 1 and lost_group(err):
            raise GroupLost(rank, _group_lost_line(run, rank, err)) from None
        raise
    finally:
        dist.destroy_process_group()
    if rank == 0:
        summary = _summary(plan, config, gathered, backend)
        summary["torchrun_restarts"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        return summary
    return None


# what a collective of gloo or NCCL says when a peer process is gone (its connection reset or closed)
_PEER_GONE = re.compile(r"gloo|nccl|connection (reset|closed|refused)|closed by peer|broken pipe|socket timeout",
                        re.IGNORECASE)


def lost_group(err: BaseException) -> bool:
    """Whether ``err``, raised by a rank's training, is its process group failing (a peer gone):
    torch.distributed's own errors, or a RuntimeError of gloo or NCCL about a connection."""
    if isinstance(err, PartitionerError):
        return False
    if isinstance(err, dist.DistError):
        return True
    return isinstance(err, RuntimeError) and _PEER_GONE.search(str(err)) is not None


class GroupLost(PartitionerError):
    """Under torchrun: this rank's process group failed (another process died or cannot be
    reached); its ``rank`` and one line that says so and how torchrun's report names the others."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def _group_lost_line(run: RunSpec, rank: int, err: BaseException) -> str:
    """The one line of :class:`GroupLost`: this rank and device, the collective's own first line,
    and which device each torchrun ``local_rank`` of this node plays (torchrun's report names a
    dead process by its node and local rank)."""
    from .nodes import layout_nodes

    me = run.layout.ranks[rank]
    detail = " ".join(str(err).split())[:160]
    node = me.gpu.rpartition(":")[0]
    seats = next((n for n in layout_nodes(run.layout) if n.node == node), None)
    where = (f"; on node {node}, torchrun's local_rank " + ", ".join(
        f"{k} is {run.layout.ranks[r].gpu}" for k, r in enumerate(seats.ranks)) if seats is not None else "")
    return (f"rank {rank} (device {me.device}) lost its process group ({type(err).__name__}: {detail}): another "
            f"process of this job died or cannot be reached, which torchrun's report names by node and "
            f"local_rank{where}")


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
               timeout_s: float, pin: bool, args: tuple[Any, ...], inherit: tuple[dict[str, str], str] | None = None
               ) -> None:
    if inherit is not None:  # a fork server's child: the environment and directory of the process that asked
        env, cwd = inherit
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
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


class RankFailed(PartitionerError):
    """A local process died (killed, exited) or raised: its ``rank``, one line that names it, and
    ``died``: the process is gone (a signal or an exit code), not an exception it raised."""

    def __init__(self, rank: int, message: str, died: bool = True):
        super().__init__(message)
        self.rank = rank
        self.died = died


def spawn_local(fn: Callable[..., Any], nprocs: int, args: tuple[Any, ...] = (), *, backend: str = "gloo",
                threads: int = 1, timeout_s: float = 300.0, start_method: str = "forkserver", pin_cpu: bool = False,
                rank_names: list[str] | None = None) -> None:
    """Run ``fn(rank, world_size, *args)`` in ``nprocs`` processes on this machine, in one
    process group whose store this process serves on 127.0.0.1 (see :func:`_loopback_store`).
    Raises :class:`PartitionerError` if they have not finished after ``timeout_s`` (the
    processes are terminated), or, in one line naming the rank (and ``rank_names[rank]``), if a
    process dies (its signal or exit code) or raises (the exception's last line); the other
    processes are then stopped. ``pin_cpu`` keeps process ``r`` on the ``r``-th available core
    (modulo the cores). ``start_method``: ``forkserver`` (the default: forked from one
    single-threaded server that imports torch once, on first use, rather than each process
    importing it; the processes get this process's environment and working directory of the
    moment); ``spawn`` (a fresh interpreter per process); ``fork`` (quickest, but see
    :func:`_preload_forkserver`)."""

    def names(r: int) -> str:
        return f" ({rank_names[r]})" if rank_names and 0 <= r < len(rank_names) else ""

    if start_method == "forkserver":
        _preload_forkserver()
    store = _loopback_store(timeout_s + 30.0)
    # torch logs a warning per process it stops after a failure; the failure is reported in one line below
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    try:
        inherit = (dict(os.environ), os.getcwd()) if start_method == "forkserver" else None
        ctx = mp.start_processes(_bootstrap, args=(fn, nprocs, store.port, backend, threads, timeout_s, pin_cpu, args,
                                                   inherit), nprocs=nprocs, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s + 30.0
        while True:
            try:
                if ctx.join(timeout=0.5, grace_period=1.0):
                    break
            except mp.ProcessExitedException as err:
                how = (f"was killed by signal {err.signal_name}" if err.signal_name
                       else f"exited with code {err.exit_code}")
                raise RankFailed(err.error_index, f"rank {err.error_index}{names(err.error_index)} {how}; "
                                 f"the other processes were stopped") from None
            except mp.ProcessRaisedException as err:
                raise RankFailed(err.error_index, f"rank {err.error_index}{names(err.error_index)} failed: "
                                 f"{_exception_line(str(err))}", died=False) from None
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    if proc.is_alive():
                        proc.terminate()
                raise PartitionerError(f"the {nprocs} training processes did not finish within {timeout_s:.0f} s")
    finally:
        del store  # stops serving


# What the fork server imports before it forks ranks: torch, and what a rank would otherwise import
# on first use (constructing a torch optimizer imports torch._dynamo: seconds per rank).
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "runtime.launch", "partitioner.zoo"]


def _preload_forkserver() -> None:
    """Have the fork server (started once per process, on first use) import torch and this runtime
    before it forks the ranks: each rank then starts about as fast as under ``fork``, yet from a
    process with a single thread. Forking a process that runs other threads (the store's, torch's,
    a solver's) can leave a rank waiting for ever on a lock one of them held at that moment: a rank
    that never joins the process group."""
    import multiprocessing
    multiprocessing.set_forkserver_preload(_FORKSERVER_PRELOAD)


def _local_worker(rank: int, world: int, run: RunSpec, out_dir: str) -> None:
    mine = run_rank(run, rank, rank)
    gathered = gather_json(mine, world, _collective_device(run.config, rank))
    if rank == 0:
        with open(os.path.join(out_dir, "metrics.json"), "w", encoding="utf-8") as f:
            json.dump(_summary(run.plan, run.config, gathered, dist.get_backend()), f)


def train_local(plan: Plan, config: TrainConfig, start_method: str = "forkserver", *,
                run: RunSpec | None = None) -> dict[str, Any]:
    """Train ``plan`` with one process per plan device on this machine; returns the metrics.
    ``run``: the run :func:`prepare` made of ``plan`` and ``config`` (prepared here when not
    given), which every process receives."""
    run = _prepared(plan, config, run)
    n = run.layout.world_size
    if config.device == "cuda" and torch.cuda.device_count() < n:
        raise PartitionerError(f"the plan needs {n} GPUs on this machine; torch sees {torch.cuda.device_count()}")
    check_checkpoints(plan, config, n)
    # a data kind the model has no task for is refused here, before any process starts
    make_data(run.chain, config.data, plan.micro_batch_size, plan.micro_batches, run.layout.workers, config.seed)
    with tempfile.TemporaryDirectory(prefix="partitioner-train-") as tmp:
        spawn_local(_local_worker, n, (run, tmp),
                    backend="nccl" if config.device == "cuda" else "gloo", threads=_threads(config, n),
                    timeout_s=config.timeout_s, start_method=start_method, pin_cpu=config.pin_cpu,
                    rank_names=[f"device {r.device}" for r in run.layout.ranks])
        with open(os.path.join(tmp, "metrics.json"), encoding="utf-8") as f:
            return dict(json.load(f))
