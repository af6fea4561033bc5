"""Times for GPU types nobody measured (docs/profiling.md): per layer on a calibrated roofline
(:mod:`~partitioner.projection.roofline`), or per operator (:mod:`~partitioner.projection.operators`
decomposes a layer, :mod:`~partitioner.projection.operator_model` prices each operator on a type's
peaks with constants fitted leave-one-type-out by :mod:`~partitioner.projection.fit` on the data
of :mod:`~partitioner.projection.evaluation`)."""

__all__: list[str] = []
