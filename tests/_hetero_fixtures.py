"""Synthetic profiles and small heterogeneous clusters for the planning tests."""

from __future__ import annotations

import numpy as np

from partitioner.cluster import Cluster, Node
from partitioner.profile import LayerProfile, LayerTime, Profile

__all__ = ["SPEED", "hetpipe_cluster", "small_cluster", "synthetic_profile"]

# Relative per-layer time of each GPU type (1.0 = fastest), roughly by peak FP32.
SPEED = {"TITAN-V": 1.0, "TITAN-RTX": 0.95, "RTX-2060": 2.3, "Quadro-P4000": 2.8, "V100-SXM2-16GB": 0.9,
         "RTX-3090": 0.5, "RTX-2080": 1.5}


def synthetic_profile(n_layers: int = 12, seed: int = 0, types: tuple[str, ...] = tuple(SPEED),
                      micro_batch_size: int = 8, act_mb: float = 40.0, param_mb: float = 60.0) -> Profile:
    """A chain with uneven layers: times, parameters and boundary tensors drawn at random."""
    rng = np.random.default_rng(seed)
    base = rng.uniform(0.002, 0.02, n_layers)
    params = rng.uniform(0.1, 1.0, n_layers) * param_mb * 1e6
    saved = rng.uniform(0.2, 1.0, n_layers) * act_mb * 1e6
    out = rng.uniform(0.05, 1.0, n_layers) * act_mb * 1e6
    layers = []
    for i in range(n_layers):
        times = {t: LayerTime(base[i] * SPEED[t] / 3, base[i] * SPEED[t] * 2 / 3) for t in types}
        layers.append(LayerProfile(f"l{i}", 1e9, float(params[i]), float(saved[i]), float(out[i]), times))
    return Profile("synthetic", micro_batch_size, tuple(layers))


def small_cluster(spec: list[list[str]], intra: float = 16.0, inter: float = 1.0) -> Cluster:
    """Nodes listed as lists of GPU type names."""
    return Cluster("small", tuple(Node(f"n{i}", tuple(g), intra) for i, g in enumerate(spec)), inter)


def hetpipe_cluster(mixed: bool = True) -> Cluster:
    """HetPipe's 16 GPUs: one of each type per node (``mixed``) or one type per node."""
    types = ["TITAN-V", "TITAN-RTX", "RTX-2060", "Quadro-P4000"]
    spec = [list(types) for _ in range(4)] if mixed else [[t] * 4 for t in types]
    return small_cluster(spec, intra=16.0, inter=7.0)
