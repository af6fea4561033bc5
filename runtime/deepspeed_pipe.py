"""DeepSpeed's ``PipelineModule`` with the stage boundaries of a plan exported with
``partitioner export --to deepspeed``.

DeepSpeed's ``partition_method`` accepts ``'parameters'``, ``'uniform'`` and ``'type:REGEX'``
only; a plan's split is set by overriding ``PipelineModule._partition_layers`` (DeepSpeed calls
it from its constructor), which assigns ``parts`` and this rank's layer bounds. DeepSpeed is an
optional dependency (``pip install hetpartition[deepspeed]``, with ``DS_BUILD_OPS=0`` on a machine
without CUDA); it is imported when this function is called.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from partitioner.errors import PartitionerError
from partitioner.export import EXPORT_FORMAT

__all__ = ["planned_pipeline_module"]


def planned_pipeline_module(layers: Sequence[Any], export: Mapping[str, Any], **kwargs: Any) -> Any:
    """``PipelineModule(layers, num_stages=...)`` whose stage ``s`` holds layers
    ``[parts[s], parts[s + 1])`` of the export (``kwargs`` go to ``PipelineModule``); with the
    export's data-major ranks (``rank_order``), over ``ProcessTopology(axes=['data', 'pipe'])``."""
    if export.get("format") != EXPORT_FORMAT or export.get("target") != "deepspeed":
        raise PartitionerError(f"not a deepspeed export (format {export.get('format')!r}, target "
                               f"{export.get('target')!r}); make one with `partitioner export` (target deepspeed)")
    parts = [int(x) for x in export["parts"]]
    if len(layers) != parts[-1]:
        raise PartitionerError(f"{len(layers)} layers given; the export partitions {parts[-1]}")
    from deepspeed.pipe import PipelineModule

    class PlannedPipelineModule(PipelineModule):
        def _partition_layers(self, method: str = "parameters") -> None:
            self.parts = list(parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    if export.get("rank_order", "pipe-major") == "pipe-major":
        return PlannedPipelineModule(layers=list(layers), num_stages=export["num_stages"], **kwargs)
    # data-major ranks (a virtual worker per node): DeepSpeed's topology with the data axis outermost
    from deepspeed.runtime.pipe.topology import ProcessTopology

    topology = ProcessTopology(axes=list(export["topology"]["axes"]), dims=list(export["topology"]["dims"]))
    return PlannedPipelineModule(layers=list(layers), topology=topology, **kwargs)
