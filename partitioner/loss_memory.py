"""What the training loss holds in memory, measured: the bytes it saves for its backward (per
micro-batch in flight, on the stage that computes it) and what its backward holds on top while
it runs.

A language model's cross-entropy over a vocabulary of ``V`` words keeps the log-probabilities,
``b s V`` elements in fp32 (the runtime computes the loss in fp32), for every micro-batch
whose backward has not run: on GPT-2 small at micro-batch 4 and 512 positions that is 0.38 GiB
per micro-batch, as much as three transformer blocks' activations. Its backward then makes the
gradient of the log-probabilities and of the logits, two more tensors of that size, while the
saved ones are still held. Neither is part of any layer, so a per-layer profile misses them;
:func:`measure_loss_memory` measures both for a given loss on a given output, on any device,
by watching the tensors that are made (no allocator statistics needed), and the profile keeps
them on its last layer (``LayerProfile.loss_saved_bytes``, ``loss_work_bytes``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes", "measure_loss_memory"]


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage made while the mode is on, until it is freed;
    ``peak_bytes`` is the most held at once (storages made before the mode are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._held: set[int] = set()

    def _track(self, t: Any) -> None:
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return
        storage = t.untyped_storage()
        key, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or key in self._held:
            return
        self._held.add(key)
        self.live_bytes += n
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        if key in self._held:
            self._held.discard(key)
            self.live_bytes -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self._track(t)
        return out


def measure_loss_memory(loss_fn: Callable[[torch.Tensor], torch.Tensor], output: torch.Tensor) -> tuple[float, float]:
    """``(saved_bytes, work_bytes)`` of ``loss_fn`` on the model's ``output`` (one micro-batch):
    the distinct storages the loss's graph saves for backward (``output`` itself included when
    the loss keeps it: the pipeline would otherwise free it), and the most its backward holds at
    once beyond them (the gradients it makes, the one of ``output`` included, less the saved
    tensors it has freed by then)."""
    y = output.detach().requires_grad_(True)
    saved: dict[int, torch.Tensor] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(y)
    saved_bytes = float(sum(t.untyped_storage().nbytes() for t in saved.values()))
    meter = LiveBytes()
    for t in saved.values():  # held when the backward starts: freed by it as it goes
        meter._track(t)
    saved.clear()
    with meter:
        loss.backward()
    del loss
    return saved_bytes, max(float(meter.peak_bytes) - saved_bytes, 0.0)
