"""bench/hetero.py's cases (also bench/closed_form.py's): every cluster's GPU types are timed in its profile."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.hetero import cases, sailor_cluster  # noqa: E402
from partitioner.cluster import resolve_gpu_type  # noqa: E402


def test_every_case_cluster_type_has_times_in_its_profile() -> None:
    for name, profile, cluster in cases():
        types = {g for node in cluster.nodes for g in node.gpus}
        missing = types - set(profile.gpu_types)
        assert not missing, f"{name}: cluster types without times in the profile: {sorted(missing)}"


def test_sailor_rtx_2080_is_the_11_gib_part() -> None:
    types = [g for node in sailor_cluster().nodes for g in node.gpus]
    assert types.count("RTX-3090") == 8 and types.count("TITAN-RTX") == 4
    assert types.count("RTX-2080-Ti") == 4 and "RTX-2080" not in types
    assert resolve_gpu_type("RTX-2080-Ti").memory_bytes == 11 * 2**30
