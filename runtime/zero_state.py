"""The state of a ZeRO run (:mod:`runtime.zero`) as a checkpoint names it: whole, by parameter.

A ZeRO holder owns a contiguous piece of each holder set's flattened fp32 values (the masters under
mixed precision, the parameters' own values in fp32) and of the optimizer's state of them. A
checkpoint holds neither pieces nor offsets: :func:`gathered_view` all-gathers every piece's
optimizer state (each elementwise tensor of it: ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``)
and, under mixed precision, its masters, and cuts them back into one tensor per parameter, which
:mod:`runtime.named_state` names as it names a plain run's state. Every holder of a layer then
writes the same values under the same names, which ``torch.distributed.checkpoint`` writes once.
So a ZeRO checkpoint is a plain checkpoint: it loads into a plan of any holder count, with or
without ZeRO, and a plain one loads into a ZeRO plan. Loading (:func:`empty_view`, then
:func:`runtime.checkpoint.restore` into the view, then :func:`load_view`) reads the whole tensors
of this rank's layers and keeps this holder's piece of them.

Saving and loading hold, for a moment, the whole fp32 master and optimizer state of the rank's
layers (what a plain run holds throughout); between them the run holds its pieces alone, as priced.
The values are moved, never computed: a resumed run continues bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .tensor_parallel import local
from .zero import ShardedStep, _like, _Piece

__all__ = ["StateView", "empty_view", "gathered_view", "load_view"]


class StateView:
    """What :mod:`runtime.named_state` reads of an optimizer, for a ZeRO run: ``param_groups``
    (one group of the tensors the state is of: each parameter's fp32 master under mixed precision,
    the parameter itself in fp32), ``state`` (tensor -> its optimizer state, whole) and
    :meth:`master_of`."""

    def __init__(self, params: list[nn.Parameter], masters: dict[int, torch.Tensor]):
        self.params = params
        self.masters = masters  # id(half parameter) -> its whole fp32 master (mixed precision)
        self.stepped = [masters.get(id(p), p) for p in params]
        self.param_groups: list[dict[str, Any]] = [{"params": self.stepped}]
        self.state: dict[torch.Tensor, dict[str, Any]] = {}

    def master_of(self) -> dict[int, torch.Tensor]:
        return self.masters


def _params(zero: ShardedStep) -> list[nn.Parameter]:
    whole = zero.whole.params if zero.whole is not None else zero.whole_fp32
    return [p for piece in zero.pieces for p in piece.params] + list(whole)


def _gather(piece: _Piece, value: torch.Tensor) -> torch.Tensor:
    """``value`` (this holder's piece of the set's flat buffer) all-gathered: the whole flat buffer."""
    mine = value.new_zeros(piece.size)
    mine[:max(piece.hi - piece.lo, 0)] = value
    full = mine.new_empty(piece.size * len(piece.ranks))
    dist.all_gather_single(full, mine, group=piece.group)
    return full


def _cut(piece: _Piece, flat: torch.Tensor) -> list[torch.Tensor]:
    """The whole flat buffer of ``piece``'s set cut into one tensor per parameter (their shapes)."""
    out, offset = [], 0
    for p in piece.params:
        t = local(p)
        out.append(_like(p, flat[offset:offset + t.numel()].view(t.shape).clone()))
        offset += t.numel()
    return out


def gathered_view(zero: ShardedStep) -> StateView:
    """The whole state of ``zero``'s layers, by parameter (collective over every holder set, in the
    order of :meth:`runtime.zero.ShardedStep.step`; every rank calls it)."""
    masters: dict[int, torch.Tensor] = dict(zero.whole.master_of()) if zero.whole is not None else {}
    per_piece_state: list[tuple[_Piece, dict[str, Any]]] = []
    for piece in zero.pieces:
        if zero.mixed:
            for p, m in zip(piece.params, _cut(piece, _gather(piece, piece.shard.detach())), strict=True):
                masters[id(p)] = m
        own = zero.optimizer.state.get(piece.shard, {}) if zero.optimizer is not None else {}
        per_piece_state.append((piece, own))
    view = StateView(_params(zero), masters)
    for piece, own in per_piece_state:
        cut: dict[str, list[Any]] = {}
        for key in sorted(own):
            value = own[key]
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == piece.shard.numel():
                cut[key] = _cut(piece, _gather(piece, value.detach()))  # elementwise: whole again
            else:
                cut[key] = [value] * len(piece.params)  # a counter ("step"): the same on every holder
        for i, p in enumerate(piece.params):
            view.state[masters.get(id(p), p)] = {key: values[i] for key, values in cut.items()}
    if zero.whole is not None:
        for m in zero.whole.masters:
            view.state[m] = dict(zero.whole.state.get(m, {}))
    elif zero.optimizer is not None:
        for p in zero.whole_fp32:
            view.state[p] = dict(zero.optimizer.state.get(p, {}))
    return view


def empty_view(zero: ShardedStep) -> StateView:
    """A view of ``zero``'s layers to load a checkpoint into (whole masters allocated under mixed
    precision, no optimizer state yet); :func:`load_view` then keeps this holder's pieces."""
    masters: dict[int, torch.Tensor] = dict(zero.whole.master_of()) if zero.whole is not None else {}
    if zero.mixed:
        for piece in zero.pieces:
            for p in piece.params:
                with torch.no_grad():
                    masters[id(p)] = p.detach().to(torch.float32, copy=True)
    return StateView(_params(zero), masters)


def load_view(zero: ShardedStep, view: StateView) -> None:
    """Keep this holder's piece of ``view`` (filled by :func:`runtime.checkpoint.restore`): each
    piece's shard and its optimizer state are the slice ``[lo, hi)`` of the whole values laid end
    to end; the layers held alone take their state whole."""
    for piece in zero.pieces:
        stepped = [view.masters.get(id(p), p) for p in piece.params]
        with torch.no_grad():
            flat = piece.padded([local(t).detach().float() for t in stepped])
            piece.shard.copy_(flat[piece.lo:max(piece.hi, piece.lo)])
        if zero.optimizer is None:
            continue
        states = [view.state.get(t, {}) for t in stepped]
        keys = set(states[0]).intersection(*states[1:]) if states else set()
        own: dict[str, Any] = {}
        for key in sorted(keys):
            values = [s[key] for s in states]
            if all(isinstance(v, torch.Tensor) and local(v).shape == local(t).shape and (v.dim() > 0 or key != "step")
                   for v, t in zip(values, stepped, strict=True)):  # elementwise (a shard's local part)
                own[key] = piece.padded([local(v) for v in values])[piece.lo:max(piece.hi, piece.lo)].clone()
            else:
                own[key] = values[0]
        zero.optimizer.state.pop(piece.shard, None)
        if own:
            zero.optimizer.state[piece.shard] = own
    if zero.whole is not None:
        if zero.whole.optimizer is not None:  # the masters were loaded in place (they are the view's)
            for m in zero.whole.masters:
                zero.whole.optimizer.state.pop(m, None)
                if view.state.get(m):
                    zero.whole.optimizer.state[m] = view.state[m]
    elif zero.optimizer is not None:
        for p in zero.whole_fp32:
            zero.optimizer.state.pop(p, None)
            if view.state.get(p):
                zero.optimizer.state[p] = view.state[p]
