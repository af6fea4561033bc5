"""The cluster planner: virtual workers, each worker's device order and split, replication
(:mod:`~solvers.cluster.planner`), built from the grouping policies (:mod:`~solvers.cluster.grouping`),
worker templates of interchangeable GPUs (:mod:`~solvers.cluster.templates`), replicated stages
(:mod:`~solvers.cluster.replication`), the micro-batch choice (:mod:`~solvers.cluster.microbatch`)
and the certificates in ``bounds/``."""

__all__: list[str] = []
