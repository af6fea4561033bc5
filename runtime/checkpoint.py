"""Checkpoints of a training run: one file per rank and step, and a manifest that completes them.

Layout under the checkpoint directory ``D``::

    D/step-00000020/rank0.pt   rank 0's stages (weights, buffers) and optimizer state
    D/step-00000020/rank1.pt
    D/step-00000020/manifest.json   written by rank 0 after every rank has written its file

Every file is written to a temporary name in the same directory and renamed
(``os.replace``), so a reader sees a whole file or none. A rank file holds the plan's hash
(:func:`plan_sha256`: the SHA-256 of the plan's canonical JSON), the step (the number of
optimizer steps done), the rank, each stage's ``state_dict`` and the optimizer's
``state_dict``; it is read with ``torch.load(..., weights_only=True)``. A checkpoint is
*complete* when its manifest exists and names every rank's file; resuming picks the last
complete one, and a checkpoint of another plan is refused before any step. A damaged
checkpoint (a manifest whose ``files`` or ``step`` is wrong, a rank file that cannot be read or
does not hold this rank's stages and optimizer) is refused in one line naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Collection, Mapping
from typing import Any, NoReturn

import torch
from torch import nn

from partitioner.errors import FormatError, PartitionerError
from partitioner.plan import Plan

__all__ = ["latest_complete", "load_rank", "plan_sha256", "restore_rank", "resume_step", "save_rank", "step_dir",
           "write_manifest"]

_FORMAT = "partitioner.checkpoint/1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_DAMAGED = ("the checkpoint is damaged: remove its step directory to resume from the one before, or use another "
            "`checkpoint_dir`")


def plan_sha256(plan: Plan) -> str:
    """SHA-256 of the plan's canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(plan.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def _atomic(path: str, write: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_rank(root: str, step: int, rank: int, plan_hash: str, stages: dict[int, dict[str, torch.Tensor]],
              optimizer: dict[str, Any] | None) -> str:
    """Write rank ``rank``'s checkpoint of ``step`` atomically; returns its path."""
    state = {"format": _FORMAT, "plan_sha256": plan_hash, "step": step, "rank": rank,
             "stages": {int(s): {k: v.detach().cpu() for k, v in sd.items()} for s, sd in stages.items()},
             "optimizer": optimizer if optimizer is not None else {}}
    path = os.path.join(step_dir(root, step), f"rank{rank}.pt")
    _atomic(path, lambda f: torch.save(state, f))
    return path


def write_manifest(root: str, step: int, plan_hash: str, world_size: int) -> None:
    """Mark checkpoint ``step`` complete (call after every rank has saved, e.g. after a barrier)."""
    manifest = {"format": _FORMAT, "plan_sha256": plan_hash, "step": step, "world_size": world_size,
                "files": [f"rank{r}.pt" for r in range(world_size)]}
    _atomic(os.path.join(step_dir(root, step), "manifest.json"),
            lambda f: f.write(json.dumps(manifest, indent=1).encode("utf-8")))


def latest_complete(root: str) -> dict[str, Any] | None:
    """The manifest of the last complete checkpoint under ``root`` (``None`` if there is none).
    A manifest that cannot be read as a JSON object leaves its checkpoint incomplete; one whose
    ``files`` or ``step`` is damaged is refused (:func:`_manifest`)."""
    if not os.path.isdir(root):
        return None
    steps = sorted((int(m.group(1)) for name in os.listdir(root) if (m := _STEP_DIR.match(name))), reverse=True)
    for step in steps:
        d = step_dir(root, step)
        manifest = _manifest(d, step)
        if manifest is not None and all(os.path.isfile(os.path.join(d, name)) for name in manifest["files"]):
            return manifest
    return None


def _manifest(d: str, step: int) -> dict[str, Any] | None:
    """The manifest of checkpoint directory ``d`` (of step ``step``): ``None`` when it is missing
    or not a JSON object; one line naming it when its ``files`` are not a list of file names or
    its ``step`` is not the directory's."""
    path = os.path.join(d, "manifest.json")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    files = manifest.get("files")
    if not (isinstance(files, list) and files and all(isinstance(n, str) and n for n in files)):
        _refuse(manifest, "files", f"must list the checkpoint's rank files (rank0.pt, rank1.pt, ...); {_DAMAGED}", path)
    got = manifest.get("step")
    if not (isinstance(got, int) and not isinstance(got, bool) and got == step):
        _refuse(manifest, "step", f"must be {step}, the step of its directory; {_DAMAGED}", path)
    return manifest


def _refuse(manifest: dict[str, Any], key: str, expected: str, path: str) -> NoReturn:
    """One line naming the manifest ``path``, its field ``key`` (its value, or that it is missing) and ``expected``."""
    if key in manifest:
        raise FormatError(key, manifest[key], expected, file=path)
    raise FormatError(key, expected=expected, file=path)


def resume_step(root: str, plan: Plan, world_size: int) -> int:
    """The step to resume from (0 when ``root`` holds no complete checkpoint); refuses, in one
    line, a checkpoint of another plan or of another number of processes."""
    manifest = latest_complete(root)
    if manifest is None:
        return 0
    where = os.path.join(step_dir(root, manifest["step"]), "manifest.json")
    if manifest.get("plan_sha256") != plan_sha256(plan):
        raise PartitionerError(f"{where}: plan_sha256 = {str(manifest.get('plan_sha256'))[:12]}...: the checkpoint "
                               f"is of another plan (this plan's is {plan_sha256(plan)[:12]}...); resume with the "
                               f"plan it was trained with, or use another `checkpoint_dir`")
    if manifest.get("world_size") != world_size:
        raise PartitionerError(f"{where}: world_size = {manifest.get('world_size')}: this run has {world_size} "
                               f"processes")
    return int(manifest["step"])


def load_rank(root: str, step: int, rank: int, plan_hash: str, stages: Collection[int] = ()) -> dict[str, Any]:
    """Rank ``rank``'s checkpoint of ``step`` (``weights_only``), checked against ``plan_hash``
    and, when ``stages`` are named, holding the weights of each and an optimizer state."""
    path = os.path.join(step_dir(root, step), f"rank{rank}.pt")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # whatever the loader raises, the file is not a checkpoint it can read
        why = "the file is empty" if os.path.isfile(path) and os.path.getsize(path) == 0 else _detail(err)
        raise PartitionerError(f"{path}: cannot be read ({why}); {_DAMAGED}") from None
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise PartitionerError(f"{path}: format = {state.get('format') if isinstance(state, dict) else None!r}: "
                               f"not a {_FORMAT} file")
    if state.get("plan_sha256") != plan_hash or state.get("step") != step or state.get("rank") != rank:
        raise PartitionerError(f"{path}: plan_sha256/step/rank = {str(state.get('plan_sha256'))[:12]}.../"
                               f"{state.get('step')}/{state.get('rank')}: expected {plan_hash[:12]}.../{step}/{rank}")
    if stages:
        _check_held(path, state, rank, stages)
    return state


def _check_held(path: str, state: dict[str, Any], rank: int, stages: Collection[int]) -> None:
    """Refuse, in one line naming the file, a rank checkpoint without the weights of every stage
    in ``stages`` or without an optimizer state."""
    held = state.get("stages")
    if not isinstance(held, dict) or any(not isinstance(held.get(s), dict) for s in stages):
        shown = sorted(held) if isinstance(held, dict) else held
        raise FormatError("stages", shown, f"must hold the weights of stage(s) {', '.join(map(str, sorted(stages)))} "
                          f"(rank {rank}'s); {_DAMAGED}", file=path)
    if not isinstance(state.get("optimizer"), dict):
        raise FormatError("optimizer", state.get("optimizer"), f"must be the optimizer's state (a dict); {_DAMAGED}",
                          file=path)


def restore_rank(root: str, step: int, rank: int, plan_hash: str, modules: Mapping[int, nn.Module],
                 optimizer: torch.optim.Optimizer | None) -> None:
    """Load rank ``rank``'s checkpoint of ``step`` into its stage ``modules`` and ``optimizer``;
    one line naming the file for a checkpoint that does not fit them."""
    path = os.path.join(step_dir(root, step), f"rank{rank}.pt")
    state = load_rank(root, step, rank, plan_hash, stages=modules.keys())
    for s, mod in modules.items():
        try:
            mod.load_state_dict(state["stages"][s])
        except (RuntimeError, ValueError, KeyError, TypeError) as err:
            raise PartitionerError(f"{path}: stages[{s}] does not fit stage {s} of this plan "
                                   f"({_detail(err)}); {_DAMAGED}") from None
    if optimizer is not None:
        try:
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as err:
            raise PartitionerError(f"{path}: optimizer does not fit this rank's optimizer ({_detail(err)}); "
                                   f"{_DAMAGED}") from None


def _detail(err: BaseException) -> str:
    """``Type: message`` of ``err`` on one line (at most 200 characters of the message)."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__
