"""What activation recomputation saves and costs, per layer (the cost model prices stages with it).

A stage's backward can recompute activations its forward did not keep
(``Stage.recompute``, :data:`partitioner.pricing.RECOMPUTE_MODES`):

* ``none``: every layer keeps its saved tensors (``LayerProfile.saved_bytes``) for each
  micro-batch in flight;
* ``selective`` (Megatron-LM's selective recomputation, Korthikanti et al. 2022): the attention
  core of each transformer block (scores ``QK^T``, soft-max, its dropout mask) is dropped and
  recomputed. Of a block's ``s b h (34 + 5 a s / h)`` saved bytes that is the ``5 a s / h`` term,
  so a block keeps the fraction ``34 / (34 + 5 a s / h)`` of its measured saved bytes
  (:func:`selective_saved_fraction`; ``a`` heads, ``s`` tokens, ``h`` hidden: both ``a`` and
  ``h`` divide by a tensor-parallel degree, so the fraction is the same on a shard). Recomputing
  it costs the attention core's share of the block's forward, priced by FLOPs:
  ``4 b s^2 h / (24 b s h^2 + 4 b s^2 h) = s / (6 h + s)`` of the block's forward time
  (:func:`selective_time_fraction`; its soft-max is memory-bound, so this is a floor). Where the
  profiler measured what a block keeps with its core recomputed (``LayerProfile.selective_saved_bytes``:
  a model without dropout in fp32 drops the soft-max's output alone, the core's inputs ``q, k, v``
  staying saved for its recomputation, much less than the fraction), that measurement is used.
  Layers that are not transformer blocks (embedding, head, any layer of a profile without a
  transformer shape in ``meta``) save nothing and cost nothing;
* ``full``: the stage keeps only its input for each micro-batch in flight and recomputes its
  whole forward inside the backward of that micro-batch, which then holds the stage's
  activations of one micro-batch: ``saved(i, j) + (n - 1) input(i)`` with ``n`` micro-batches
  in flight, instead of ``n saved(i, j)``; its backward costs its forward time more.

This module gives the per-layer arrays; :class:`partitioner.cost.CostModel` (its ``recompute``
view) sums them over a stage.
"""

from __future__ import annotations

import numpy as np

from .profile import Profile
from .projection.operator_model import transformer_shape
from .projection.operators import layer_kind

__all__ = ["recompute_extra_fwd_fraction", "selective_bytes", "selective_saved_fraction", "selective_time_fraction"]


def _blocks(profile: Profile) -> np.ndarray:
    """Whether each layer is a transformer block (by its name: ``block7``, as the zoo and Sailor name them)."""
    return np.array([layer_kind(layer.name) == "block" for layer in profile.layers], dtype=bool)


def selective_saved_fraction(profile: Profile) -> float:
    """The fraction of a transformer block's saved bytes that selective recomputation drops:
    ``(5 a s / h) / (34 + 5 a s / h)``; 0 for a profile without a transformer shape."""
    shape = transformer_shape(profile)
    if shape is None:
        return 0.0
    attention = 5.0 * shape.heads * shape.seq_len / shape.hidden
    return attention / (34.0 + attention)


def selective_time_fraction(profile: Profile) -> float:
    """The share of a transformer block's forward that selective recomputation runs again: the
    attention core's FLOPs, ``s / (6 h + s)``; 0 for a profile without a transformer shape."""
    shape = transformer_shape(profile)
    if shape is None:
        return 0.0
    return shape.seq_len / (6.0 * shape.hidden + shape.seq_len)


def selective_bytes(profile: Profile) -> np.ndarray:
    """Per layer, the saved bytes selective recomputation drops (at most what the layer keeps
    apart from the tensor it shares with the layer before it): measured where the profile has
    it (``LayerProfile.selective_saved_bytes``), else Megatron's fraction of a block's bytes."""
    saved = profile.array("saved_bytes")
    own = saved - profile.array("shared_saved_bytes")
    estimate = np.where(_blocks(profile), saved * selective_saved_fraction(profile), 0.0)
    measured = np.array([np.nan if layer.selective_saved_bytes is None else layer.saved_bytes - layer.selective_saved_bytes
                         for layer in profile.layers], dtype=float)
    return np.minimum(np.where(np.isnan(measured), estimate, measured), own)


def recompute_extra_fwd_fraction(profile: Profile, mode: str) -> np.ndarray:
    """Per layer, the fraction of its forward time that ``mode`` runs again inside the backward."""
    n = profile.num_layers
    if mode == "full":
        return np.ones(n)
    if mode == "selective":
        return np.where(_blocks(profile), selective_time_fraction(profile), 0.0)
    return np.zeros(n)
