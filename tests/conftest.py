"""Small builders shared by the tests: synthetic profiles and clusters."""

from __future__ import annotations

import os

# One torch (OpenMP) thread in each test process, set before torch or numpy loads: the ranks a
# test starts train with one thread each, and a pool of several threads beside other busy
# processes (the other test process, the ranks, whatever else runs) waits on its slowest thread
# at every operation: on 2 busy cores a reference computed in-process took 7x as long.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from partitioner.cluster import Cluster, DeviceType, Node
from partitioner.profile import LayerProfile, LayerTime, Profile

DATA = Path(__file__).parent / "data"
GIB = 2**30


def make_profile(times: Mapping[str, Sequence[float]], param_bytes: Sequence[float] | None = None,
                 saved_bytes: Sequence[float] | None = None, output_bytes: Sequence[float] | None = None,
                 micro_batch_size: int = 1, model: str = "toy") -> Profile:
    """A profile whose layer ``l`` takes ``times[type][l]`` seconds (split 1:2 fwd:bwd)."""
    n = len(next(iter(times.values())))
    zeros = [0.0] * n
    layers = []
    for i in range(n):
        t = {g: LayerTime(v[i] / 3.0, 2.0 * v[i] / 3.0) for g, v in times.items()}
        layers.append(LayerProfile(f"l{i}", 0.0, (param_bytes or zeros)[i], (saved_bytes or zeros)[i],
                                   (output_bytes or zeros)[i], t))
    return Profile(model, micro_batch_size, tuple(layers))


def big_type(name: str, memory_gb: float = 1e6) -> DeviceType:
    """A GPU type with plenty of memory (for tests that ignore memory)."""
    return DeviceType(name, memory_gb * GIB, 1e13, 1e12)


def flat_cluster(types: Sequence[str], memory_gb: Mapping[str, float] | None = None,
                 intra_gbps: float = 10.0, inter_gbps: float = 1.0, per_node: int = 1) -> Cluster:
    """Devices of the given (custom) types, ``per_node`` to a node, in order."""
    memory_gb = memory_gb or {}
    dtypes = {t: big_type(t, memory_gb.get(t, 1e6)) for t in dict.fromkeys(types)}
    nodes = [Node(f"n{k}", tuple(types[k * per_node:(k + 1) * per_node]), intra_gbps)
             for k in range((len(types) + per_node - 1) // per_node)]
    return Cluster("test", tuple(nodes), inter_gbps, dtypes)


@pytest.fixture
def pipedream_dir() -> Path:
    return DATA / "pipedream"


# Tests that start training processes talk over loopback sockets through gloo. On a shared
# 2-core machine a process occasionally misses gloo's 60 s rendezvous window (a store key that
# never arrives); such a test is run again, at most twice, when it fails with one of these
# messages, and only then (a wrong number still fails at once).
_PROCESS_MODULES = ("test_runtime.py", "test_runtime_data.py", "test_checkpoint.py", "test_export_torch.py",
                     "test_runtime_replicas.py", "test_runtime_slices.py", "test_emulation.py",
                     "test_emulated_links.py", "test_nodes.py", "test_reshard.py", "test_runtime_tensor_parallel.py",
                     "test_runtime_precision.py", "test_runtime_levers.py", "test_zero_bubble.py", "test_channels.py",
                     "test_export_launch.py", "test_export_tensor_parallel.py")
_TRANSIENT = ["wait timeout", "timed out", "Connection reset", "Connection refused", "did not finish within",
              "DistStoreError", "TimeoutExpired"]


# The modules of the longest tests (processes started, exhaustive references) run first: under
# pytest-xdist a long test taken last by one worker would run alone while the others wait.
_LONG_FIRST = ("test_nodes.py", "test_export_launch.py", "test_zero_checkpoint.py", "test_symmetric.py",
               "test_grouping.py", "test_sync_bound.py", "test_runtime_tensor_parallel.py", "test_checkpoint.py",
               "test_export_tensor_parallel.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in _LONG_FIRST)  # stable: each module keeps its order
    if not config.pluginmanager.hasplugin("rerunfailures"):
        return
    for item in items:
        if item.path.name in _PROCESS_MODULES:
            item.add_marker(pytest.mark.flaky(reruns=2, only_rerun=_TRANSIENT))
