"""Tensor-parallel shards measured on one device: what one GPU of a group of t computes.

A transformer block run tensor-parallel over t GPUs (Megatron-style) computes, on each GPU, the
attention of ``heads / t`` heads and ``4 h / t`` of the MLP's units, then the group all-reduces
the partial outputs: twice in the forward (after the attention's and the MLP's row-parallel
projections) and twice in the backward (the inputs' gradients of the column-parallel ones). One
device can time the shard (:func:`partitioner.models.build_model` with ``tensor_parallel``) but
not the all-reduces, whose time depends on the group's link: the shard's
``LayerShard.allreduce_bytes`` records their bytes (``2 b s h`` elements forward, as many
backward) and the cost model prices them on the link the group's GPUs have
(:meth:`partitioner.cost.CostModel.tensor_parallel_comm_s`, :mod:`partitioner.collectives`). The embedding and the head stay
whole on every GPU of the group (their shard is the layer, no collective).

Each shard is timed on the same inputs as the whole layer (the chain's activations, recomputed
with the whole layers), with the profiler's timing rule (:func:`partitioner.profiler._time_layer`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from .profile import LayerShard, LayerTime, Profile
from .profiler import (
    _as_layer_list,
    _grad_input,
    _nbytes,
    _out_tensor,
    _time_layer,
    _Timer,
    device_label,
    half_input,
    saved_storages,
)

__all__ = ["profile_shards"]

log = logging.getLogger(__name__)


def profile_shards(profile: Profile, layers: nn.Sequential | Iterable[Any], shards: Mapping[int, Sequence[Any]],
                   sample_input: torch.Tensor, device: torch.device | str = "cpu", *, sharded: Sequence[str] = (),
                   warmup: int = 2, repeats: int = 7, layer_budget_s: float = 2.0,
                   min_layer_time_s: float = 0.05) -> Profile:
    """``profile`` (measured on ``layers``, the whole chain) with ``LayerProfile.shards[t]`` for every
    degree of ``shards`` (t -> the chain of one GPU's shards, layer for layer): the layers named in
    ``sharded`` are timed as shards and all-reduce ``2 b s h`` elements each way; the others are
    whole on every GPU (the layer's own figures, no collective)."""
    whole = _as_layer_list(layers)
    dev = torch.device(device)
    label = device_label(dev)
    key = next(iter(profile.meta.get("measured_on") or {}), label)  # the type the profile measured
    timer = _Timer(dev)
    half = profile.dtype in ("float16", "bfloat16")  # the whole layers ran in it: the shards do too
    dtype = getattr(torch, profile.dtype) if half else None
    for _, module in whole:
        module.to(device=dev, dtype=dtype)
    inputs = _inputs(whole, half_input(sample_input.to(dev), dtype))
    elem = 2 if half else 4
    out = [dict(layer.shards) for layer in profile.layers]
    for t, chain in shards.items():
        parts = _as_layer_list(chain)
        if [n for n, _ in parts] != [n for n, _ in whole]:
            raise ValueError(f"the degree-{t} chain's layers differ from the model's")
        for i, ((name, part), layer) in enumerate(zip(parts, profile.layers, strict=True)):
            if name not in sharded:
                out[i][t] = LayerShard(layer.param_bytes, layer.saved_bytes, dict(layer.times), layer.shared_saved_bytes)
                continue
            part.to(device=dev, dtype=dtype).train()
            x = _grad_input(inputs[i])
            y, storages = saved_storages(part, x, name)
            act = _out_tensor(y, name)
            del y
            f_s, b_s, _, share = _time_layer(part, x, name, timer, warmup, repeats, layer_budget_s, min_layer_time_s)
            out[i][t] = LayerShard(
                param_bytes=float(sum(_nbytes(p) for p in part.parameters())), saved_bytes=float(sum(storages.values())),
                times={key: LayerTime(f_s, b_s, measured_on=label, bwd_weight_share=share)},
                allreduce_bytes=float(2 * act.numel() * elem))
            log.debug("%s at degree %d: fwd %.3g s, bwd %.3g s", name, t, f_s, b_s)
    layers_out = tuple(replace(layer, shards=s) for layer, s in zip(profile.layers, out, strict=True))
    meta = {**profile.meta, "tensor_parallel_shards": {str(t): list(sharded) for t in shards},
            "tensor_parallel_comm": "projected: 2 all-reduces of b s h elements forward and 2 backward per sharded "
                                    "layer, priced by the cost model on the link the group has (partitioner/collectives.py)"}
    return replace(profile, layers=layers_out, meta=meta)


@torch.no_grad()
def _inputs(chain: list[tuple[str, nn.Module]], x: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's input on ``x``, through the whole layers."""
    out = []
    for _, layer in chain:
        out.append(x)
        x = _out_tensor(layer(x), "layer").detach()
    return out
