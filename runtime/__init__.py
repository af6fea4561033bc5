"""Training runtime on torch.distributed that executes plans (pipelines inside virtual workers,
Wave Synchronous Parallel between them). It consumes ``partitioner.schedule`` action lists
and never imports ``solvers``."""

__all__: list[str] = []
