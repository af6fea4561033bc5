"""The cluster planner's certificates: the throughput no plan of the cluster can beat.
:mod:`~solvers.cluster.bounds.fleet` holds for any cluster; :mod:`~solvers.cluster.bounds.sync`
adds the gradient all-reduce on clusters of up to 16 GPUs, with the per-worker floors of
:mod:`~solvers.cluster.bounds.tail`."""

__all__: list[str] = []
