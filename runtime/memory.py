"""What a rank's activations hold, measured on any device, and the random-number state a
recomputed forward replays.

:class:`ActivationMeter` counts, while the executor computes (``F``, ``B``, ``I``, ``W``), the
bytes of

* every tensor autograd saves for backward (``torch.autograd.graph.saved_tensors_hooks``), from
  the moment it is saved until the graph that holds it is freed, and
* the tensors the executor holds between actions: stage inputs (received or made), stage outputs
  kept for sending and for their backward, gradients received or left for the stage before,
  receive buffers posted ahead, and what an ``I`` leaves for its ``W``,

each storage once (a view and its base, or a tensor both saved and held, are one storage, counted
at the storage's size). ``peak_bytes`` is the most held at once, sampled at every save and at the
start of every action. A recomputed forward's tensors are counted while its backward runs: the
executor recomputes a ``full`` stage's forward inside the backward action, under the same hooks;
a ``selective`` stage's attention core keeps its inputs outside autograd's saved tensors
(:mod:`runtime.recompute`, so that an ``I`` can drop them), counted all the same through
:func:`keep_for_backward`, and is recomputed inside its backward, whose few tensors stay outside
the hooks (not counted).

Not counted: the parameters, their gradients and the optimizer state (the rank's model state,
counted apart: :func:`runtime.recipe.model_state_bytes`), a weight version of 2bw or wsp beyond
the modules', an operation's temporaries that nothing keeps (an output freed by the next
operation, the gradients autograd passes between the operations of one backward), the data
batch, the communication library's own buffers, and the input gradients sent and not yet waited
(a gradient's send is waited at the step; an output's at the next compute or when its gradient
arrives, and the output then freed: :mod:`runtime.executor`; an output sent is counted while its
sends are pending). So ``model state + peak_bytes`` is what the
cost model prices as a device's peak (weights, gradients, optimizer state, activations in
flight), measured as the run holds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["ActivationMeter", "keep_for_backward", "kept", "rng_restored", "rng_state"]

Key = tuple[int, str]


class _Held:
    """A saved tensor as autograd keeps it (the pack hook's object): releasing it tells the meter."""

    __slots__ = ("keys", "meter", "tensor")

    def __init__(self, meter: ActivationMeter, keys: list[Key], tensor: torch.Tensor):
        self.meter, self.keys, self.tensor = meter, keys, tensor

    def __del__(self) -> None:
        for key in self.keys:
            self.meter.release(key)


def _storages(t: torch.Tensor) -> list[tuple[Key, int]]:
    """The storages ``t`` holds (``(key, bytes)``): its own, or a wrapper's inner tensors' (a
    tensor-parallel shard, a collective's result)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        attrs, _ = t.__tensor_flatten__()
        inner = [getattr(t, a) for a in attrs]
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    storage = t.untyped_storage()
    return [((storage.data_ptr(), str(t.device)), storage.nbytes())]


class ActivationMeter:
    """Bytes of activations held, and their peak (see the module docstring)."""

    def __init__(self) -> None:
        self._saved: dict[Key, list[int]] = {}  # storage -> [bytes, saved tensors holding it]
        self._extra: dict[Key, int] = {}  # storages the executor holds that nothing saved (this action)
        self._weights: set[Key] = set()  # the weights' storages (model state, not counted here)
        self.saved_bytes = 0
        self.extra_bytes = 0
        self.peak_bytes = 0
        self.enabled = True

    @property
    def held_bytes(self) -> int:
        return self.saved_bytes + self.extra_bytes

    def _sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.saved_bytes + self.extra_bytes)

    def pack(self, t: torch.Tensor) -> Any:
        if not self.enabled or t.device.type == "meta":
            return t
        keys = []
        for key, nbytes in _storages(t):
            if key in self._weights:
                continue
            keys.append(key)
            entry = self._saved.get(key)
            if entry is None:
                self._saved[key] = [nbytes, 1]
                self.saved_bytes += nbytes
                self.extra_bytes -= self._extra.pop(key, 0)  # held and now saved: one storage
            else:
                entry[1] += 1
        self._sample()
        return _Held(self, keys, t.detach()) if keys else t  # (detached: the same storage, no reference to the graph)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def release(self, key: Key) -> None:
        entry = self._saved.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._saved[key]
            self.saved_bytes -= entry[0]

    @contextlib.contextmanager
    def tracking(self, held: Iterable[torch.Tensor], weights: Iterable[torch.Tensor]) -> Iterator[None]:
        """Count while the block runs: ``held``, the tensors the executor holds now, and every
        tensor saved for backward but ``weights`` (the weights the block may save)."""
        self._weights = {key for w in weights for key, _ in _storages(w)}
        self._extra = {}
        for t in held:
            for key, nbytes in _storages(t):
                if key not in self._saved and key not in self._weights:
                    self._extra[key] = nbytes
        self.extra_bytes = sum(self._extra.values())
        self._sample()
        before = _ACTIVE[0]
        _ACTIVE[0] = self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            _ACTIVE[0] = before


_ACTIVE: list[ActivationMeter | None] = [None]  # the meter counting now, if any


def keep_for_backward(t: torch.Tensor) -> Any:
    """``t`` as a custom autograd function keeps it for its backward outside ``save_for_backward``
    (so that it can drop it early), counted as a saved tensor by the meter counting now, until
    the returned object is dropped; :func:`kept` gives the tensor back."""
    meter = _ACTIVE[0]
    return meter.pack(t) if meter is not None else t


def kept(held: Any) -> torch.Tensor:
    """The tensor :func:`keep_for_backward` kept."""
    return ActivationMeter.unpack(held)


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random-number state a forward runs under (the CPU's, and the device's on CUDA)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def rng_restored(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> Iterator[None]:
    """Run the block under ``state`` (:func:`rng_state`), the generators' state outside it unchanged."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield
