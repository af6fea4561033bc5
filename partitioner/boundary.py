"""What the pipeline executor holds at a stage boundary besides saved activations, in tensors.

One definition, read by the closed form (:meth:`partitioner.cost.CostModel.boundary_held_bytes`),
the simulator, the chain DP's memory check and the graph models: how many copies of a stage's
output (the tensor crossing the cut after it) and of its input it holds, derived from
:mod:`runtime.executor`:

* Per micro-batch in flight, from its forward to its backward (to its ``I`` where the backward is
  split): where the executor waits an output's sends at its next compute (every pipeline rank
  holds one stage of a flushing schedule: ``lean``), the output is freed before anything else
  runs, so none; otherwise it is held until its gradient arrives, and that gradient then until
  the backward: one output-sized tensor (never both at once).
* Per micro-batch between its ``I`` and its ``W`` (a split backward): the gradient the ``W``
  starts from, one output-sized tensor.
* Fixed, where a next stage exists: the gradient receive posted ahead (at most one per peer) and,
  on a lean rank, the gradient taken by the backward that runs (priced per micro-batch
  otherwise): two outputs lean, one otherwise. Where a previous stage exists: the activation
  receive posted ahead (at most one per peer): one input. A stage's input once taken is the input
  its first layer saves (priced in its saved bytes).

The closed form holds ``max(until_backward, until_weight)`` outputs per micro-batch in flight
(an upper bound of the split schedules' ``I``-to-``W`` gradients, exact for the others).
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedule import spec

__all__ = ["BoundaryHeld", "boundary_held"]


@dataclass(frozen=True)
class BoundaryHeld:
    """Copies of a stage's output and input the executor holds (module docstring)."""

    lean: bool  # an output's sends are waited at the next compute, and the output freed
    until_backward: int  # outputs per micro-batch, from its forward to its backward (its I)
    until_weight: int  # outputs per micro-batch, from its I to its W (split backward)
    fixed_outputs: int  # where a next stage exists
    fixed_inputs: int  # where a previous stage exists

    def __post_init__(self) -> None:
        for name in ("until_backward", "until_weight", "fixed_outputs", "fixed_inputs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"BoundaryHeld.{name} must be a count >= 0, not {value!r}")

    @property
    def per_flight(self) -> int:
        """Outputs per micro-batch in flight in the closed form."""
        return max(self.until_backward, self.until_weight)


def boundary_held(schedule: str) -> BoundaryHeld:
    """The boundary tensors the executor holds under ``schedule`` (a schedule name)."""
    s = spec(schedule)
    lean = s.flushes and not s.multi_chunk
    split = 1 if s.split_backward else 0
    if lean:
        return BoundaryHeld(True, 0, split, 2, 1)
    return BoundaryHeld(False, 1, split, 1, 1)
