"""Checkpoints that do not depend on the plan: written by any plan, loaded into any other.

Layout under the checkpoint directory ``D``::

    D/step-00000020/.metadata        torch.distributed.checkpoint's index of every tensor
    D/step-00000020/__0_0.distcp     the tensors rank 0 wrote, __1_0.distcp rank 1's, ...
    D/step-00000020/manifest.json    the plan, step, data position, and every file's size and SHA-256

Every rank saves its stages' state by name (:mod:`runtime.named_state`: ``model.layers.<l>.*``,
the optimizer's ``optim.layers.<l>.*``, its generator's ``rng.rank<r>``) in one collective
``torch.distributed.checkpoint.save``; a layer held by several ranks (virtual workers,
replicas: the same values) is written once. Loading reads, for each rank of any other plan, the
names of the layers it holds: the checkpoint is resharded by name, and another split (cuts,
stage count, virtual workers, replicas) resumes from it.

Atomic: the ranks write into ``D/.partial-step-00000020``; rank 0 then hashes every file,
writes the manifest (temporary file, rename) and renames the directory to
``step-00000020``, so a step directory is complete or absent. Before a run resumes, every file
the manifest names is checked (present, its size, its SHA-256): a missing, truncated or altered
shard is refused in one line naming it, never a silent restart.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partitioner._io import atomic_write_text, req_field, req_int
from partitioner.errors import FormatError, PartitionerError
from partitioner.plan import Plan

from .named_state import RNG, apply_state, rank_state, rng_key, wanted_state

__all__ = ["FORMAT", "Manifest", "check_resumable", "latest_complete", "load_state", "plan_sha256", "read_manifest", "restore",
           "resume_step", "save_checkpoint", "step_dir", "verify"]

FORMAT = "partitioner.checkpoint/2"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_DAMAGED = ("the checkpoint is damaged: remove its step directory to resume from the one before, or use another "
            "`checkpoint_dir`")


def plan_sha256(plan: Plan) -> str:
    """SHA-256 of the plan's canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(plan.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _partial_dir(root: str, step: int) -> str:
    return os.path.join(root, f".partial-step-{step:08d}")


def _num_layers(plan: Plan) -> int:
    return max(st.stop for vw in plan.virtual_workers for st in vw.stages)


@dataclass(frozen=True)
class Manifest:
    """What completes a checkpoint: the step (optimizer steps done), the plan that wrote it, the
    model, the data (kind and seed: step ``t``'s global batch is made from ``(seed, t)``, so the
    step is the data position), the device of every rank that wrote it, and every file with its
    size and SHA-256 (empty until rank 0 has hashed them)."""

    step: int
    plan: Plan
    model: str
    seed: int
    data: str
    devices: tuple[str, ...]
    files: Mapping[str, tuple[int, str]] = field(default_factory=dict)  # name -> (bytes, sha256)

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "files", dict(self.files))
        if not (isinstance(self.step, int) and self.step >= 0):
            raise FormatError("step", self.step, "must be an integer >= 0")
        if not self.devices:
            raise FormatError("devices", [], "must name the device of every rank that wrote the checkpoint")
        for name, entry in self.files.items():
            if not (isinstance(name, str) and name and "/" not in name and isinstance(entry, tuple) and len(entry) == 2
                    and isinstance(entry[0], int) and entry[0] >= 0 and isinstance(entry[1], str) and len(entry[1]) == 64):
                raise FormatError(f"files.{name}", entry, "must be [bytes, sha256] of a file of the step directory")

    @property
    def num_layers(self) -> int:
        return _num_layers(self.plan)

    @property
    def global_batch(self) -> int:
        """Samples per step: micro-batch size x micro-batches x virtual workers."""
        return self.plan.micro_batch_size * self.plan.micro_batches * len(self.plan.virtual_workers)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "step": self.step, "model": self.model, "num_layers": self.num_layers,
                "global_batch": self.global_batch, "data": {"kind": self.data, "seed": self.seed, "step": self.step},
                "rng": f"{RNG}<r>: each writing rank's torch CPU generator", "devices": list(self.devices),
                "plan_sha256": plan_sha256(self.plan), "plan": self.plan.to_dict(),
                "files": {k: list(v) for k, v in sorted(self.files.items())}}

    @classmethod
    def from_dict(cls, d: Any) -> Manifest:
        if not isinstance(d, dict):
            raise FormatError("", expected="must be a JSON object")
        fmt = d.get("format")
        if fmt != FORMAT:
            raise FormatError("format", fmt, f"must be {FORMAT} (a checkpoint of an earlier version cannot be "
                              f"resumed by this one; start again with another `checkpoint_dir`)")
        data = req_field(d, "data", dict)
        files = req_field(d, "files", dict)
        try:
            plan = Plan.from_dict(req_field(d, "plan", dict))
        except FormatError as err:
            raise err.under("plan.") from None
        return cls(step=req_int(d, "step", maximum=2**62), plan=plan, model=req_field(d, "model", str),
                   seed=req_int(data, "seed", "data.", maximum=2**63), data=req_field(data, "kind", str, "data."),
                   devices=tuple(req_field(d, "devices", list)),
                   files={k: tuple(v) if isinstance(v, list) else v for k, v in files.items()})


# -- saving (collective) -----------------------------------------------------------------------


def save_checkpoint(root: str, manifest: Manifest, rank: int, by_layer: Mapping[int, nn.Module],
                    optimizer: torch.optim.Optimizer | None) -> None:
    """Every rank of the process group calls this after the same step: this rank's state by name
    goes into the step's checkpoint; rank 0 completes it (hashes, manifest, rename). Returns when
    the checkpoint is complete."""
    import torch.distributed.checkpoint as dcp

    partial = _partial_dir(root, manifest.step)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # a step begun by an earlier run that died
        os.makedirs(partial)
    dist.barrier()
    state = rank_state(by_layer, optimizer, rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(partial, sync_files=True, overwrite=True))
    if rank == 0:
        _complete(root, partial, manifest)
    dist.barrier()


def _complete(root: str, partial: str, manifest: Manifest) -> None:
    """Rank 0, after every rank has written: the manifest, then the directory under its step's name."""
    files = {name: _fingerprint(os.path.join(partial, name)) for name in sorted(os.listdir(partial))
             if os.path.isfile(os.path.join(partial, name))}
    done = Manifest(manifest.step, manifest.plan, manifest.model, manifest.seed, manifest.data, manifest.devices, files)
    atomic_write_text(os.path.join(partial, MANIFEST), json.dumps(done.to_dict(), indent=1))
    final = step_dir(root, manifest.step)
    if os.path.exists(final):  # the same step written again (a run resumed before it): the new one replaces it
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(partial, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(partial, final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fingerprint(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return os.path.getsize(path), h.hexdigest()


# -- finding, checking -------------------------------------------------------------------------


def latest_complete(root: str) -> Manifest | None:
    """The manifest of the last complete checkpoint under ``root`` (``None`` if there is none).
    A step directory without a readable manifest is skipped; one whose manifest is damaged is
    refused in one line naming it."""
    if not os.path.isdir(root):
        return None
    steps = sorted((int(m.group(1)) for name in os.listdir(root) if (m := _STEP_DIR.match(name))), reverse=True)
    for step in steps:
        manifest = read_manifest(step_dir(root, step), step)
        if manifest is not None:
            return manifest
    return None


def read_manifest(d: str, step: int) -> Manifest | None:
    """The manifest of step directory ``d`` (of step ``step``): ``None`` when it is missing or not
    JSON; one line naming it when it is damaged (a field missing or wrong, its step not the
    directory's, no files)."""
    path = os.path.join(d, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    try:
        manifest = Manifest.from_dict(raw)
    except FormatError as err:
        why = err.expected if err.field == "format" else f"{err.expected}; {_DAMAGED}" if err.expected else _DAMAGED
        raise FormatError(err.field, err.value, why, file=path) from None
    if manifest.step != step:
        raise FormatError("step", manifest.step, f"must be {step}, the step of its directory; {_DAMAGED}", file=path)
    if not manifest.files:
        raise FormatError("files", {}, f"must list the checkpoint's files; {_DAMAGED}", file=path)
    return manifest


def verify(root: str, manifest: Manifest) -> None:
    """Refuse, in one line naming the file, a checkpoint whose files are not those its manifest
    lists: missing, of another size (truncated), or of other bytes."""
    d = step_dir(root, manifest.step)
    for name, (size, digest) in sorted(manifest.files.items()):
        path = os.path.join(d, name)
        if not os.path.isfile(path):
            raise PartitionerError(f"{path}: missing (the manifest lists it); {_DAMAGED}")
        got = os.path.getsize(path)
        if got != size:
            raise PartitionerError(f"{path}: {got} bytes, the manifest says {size} (a truncated or damaged shard); "
                                   f"{_DAMAGED}")
        if _fingerprint(path)[1] != digest:
            raise PartitionerError(f"{path}: its SHA-256 is not the manifest's (the shard was altered); {_DAMAGED}")


def check_resumable(root: str, manifest: Manifest, plan: Plan, model: str, seed: int, data: str) -> None:
    """Refuse, in one line naming the manifest, resuming ``plan`` from ``manifest``: another
    model or layer count, or another data order (kind, seed or global batch)."""
    where = os.path.join(step_dir(root, manifest.step), MANIFEST)
    layers = _num_layers(plan)
    if manifest.model != model or manifest.num_layers != layers:
        raise PartitionerError(f"{where}: model = {manifest.model!r} ({manifest.num_layers} layers): this run "
                               f"trains {model!r} ({layers} layers); resume the model it was trained on")
    new_batch = plan.micro_batch_size * plan.micro_batches * len(plan.virtual_workers)
    if manifest.global_batch != new_batch:
        p = manifest.plan
        raise PartitionerError(
            f"{where}: global_batch = {manifest.global_batch} ({len(p.virtual_workers)} virtual worker(s) x "
            f"{p.micro_batches} micro-batches x {p.micro_batch_size}): this plan's is {new_batch} "
            f"({len(plan.virtual_workers)} x {plan.micro_batches} x {plan.micro_batch_size}); the data order "
            f"needs the same global batch (plan with `micro_batches` = global batch / (micro-batch size x virtual "
            f"workers))")
    if (manifest.data, manifest.seed) != (data, seed):
        raise PartitionerError(f"{where}: data = {manifest.data}, seed {manifest.seed}: this run's are {data}, seed "
                               f"{seed}; resume with the same data and `seed`")


def resume_step(root: str, plan: Plan, model: str, seed: int, data: str) -> int:
    """The step to resume from (0 when ``root`` holds no complete checkpoint), its files verified
    and its model and data order those of this run (:func:`check_resumable`); the plan may differ."""
    manifest = latest_complete(root)
    if manifest is None:
        return 0
    check_resumable(root, manifest, plan, model, seed, data)
    verify(root, manifest)
    return manifest.step


# -- loading -----------------------------------------------------------------------------------


def _stored(d: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor of checkpoint directory ``d``: name -> (shape, dtype)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        meta = dcp.FileSystemReader(d).read_metadata()
    except Exception as err:  # whatever the reader raises, the index cannot be read
        raise PartitionerError(f"{os.path.join(d, '.metadata')}: cannot be read ({_detail(err)}); {_DAMAGED}") from None
    return {k: (tuple(v.size), v.properties.dtype) for k, v in meta.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}


def _read(d: str, state: dict[str, torch.Tensor]) -> None:
    """Read ``state``'s tensors (by name) from checkpoint directory ``d``, in this process alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(d), no_dist=True)
    except (Exception, CheckpointException) as err:  # a shard that cannot be read as its index says
        raise PartitionerError(f"{d}: cannot be read ({_detail(err)}); {_DAMAGED}") from None


def restore(root: str, step: int, rank: int, by_layer: Mapping[int, nn.Module],
            optimizer: torch.optim.Optimizer | None, *, same_ranks: bool = False) -> None:
    """Load checkpoint ``step`` into this rank's layers (``by_layer``: global layer index ->
    module) and ``optimizer``, by name, whatever plan wrote it; with ``same_ranks`` (the
    checkpoint was written by ranks on these same devices) this rank's generator state too."""
    d = step_dir(root, step)
    stored = _stored(d)
    try:
        state = wanted_state(by_layer, optimizer, stored)
    except PartitionerError as err:
        raise PartitionerError(f"{d}: {err}") from None
    if same_ranks and rng_key(rank) in stored:
        state[rng_key(rank)] = torch.empty(stored[rng_key(rank)][0], dtype=stored[rng_key(rank)][1])
    _read(d, state)
    try:
        apply_state(by_layer, optimizer, state)
    except (RuntimeError, ValueError, KeyError, TypeError) as err:
        raise PartitionerError(f"{d}: does not fit rank {rank}'s layers ({_detail(err)}); {_DAMAGED}") from None
    if rng_key(rank) in state:
        torch.set_rng_state(state[rng_key(rank)])


def load_state(root: str, step: int) -> dict[str, torch.Tensor]:
    """Every tensor of checkpoint ``step``, by name (for comparisons and inspection)."""
    d = step_dir(root, step)
    state = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in _stored(d).items()}
    _read(d, state)
    return state


def _detail(err: BaseException) -> str:
    """``Type: message`` of ``err`` on one line (at most 200 characters of the message); of a
    checkpoint exception, the last line of the first rank's failure."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        err = first[0] if isinstance(first, tuple) and first and isinstance(first[0], BaseException) else first
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__
