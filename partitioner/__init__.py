"""Partition optimizer for pipeline + data parallel training on heterogeneous GPU clusters.

The torch-free core: profiles, clusters, plans and the cost model. ``partitioner.profiler``
and ``partitioner.models`` import torch and are loaded only when used.
"""

try:
    from .cluster import Cluster, Device, DeviceType, Node, catalog, resolve_gpu_type
    from .cost import CostModel, CostOptions
    from .errors import FormatError, PartitionerError
    from .plan import Plan, SolverInfo, Stage, VirtualWorker
    from .profile import LayerProfile, LayerTime, Profile
except KeyboardInterrupt:  # Ctrl-C while numpy and the modules load: one line, as the command reports it
    import sys as _sys

    print("partitioner: interrupted", file=_sys.stderr)
    raise SystemExit(130) from None

__version__ = "0.1.0"

__all__ = [
    "Cluster",
    "CostModel",
    "CostOptions",
    "Device",
    "DeviceType",
    "FormatError",
    "LayerProfile",
    "LayerTime",
    "Node",
    "PartitionerError",
    "Plan",
    "Profile",
    "SolverInfo",
    "Stage",
    "VirtualWorker",
    "__version__",
    "catalog",
    "resolve_gpu_type",
]
