"""The Megatron-LM export checked by Megatron-Core itself (tools/megatron_check.py): its
TransformerConfig takes the arguments, its layer placement builds the plan's layers on every
pipeline rank, its RankGenerator gives the plan's pipelines, its OptimizerConfig takes the
optimizer and precision, and GPTModel is built on gloo ranks. Slow; skipped (with the reason)
where megatron-core does not import (docs/export.md: a side venv with `pip install megatron-core`)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from partitioner.export import export_plan
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.pricing import CostOptions

pytestmark = pytest.mark.slow

try:  # megatron-core imports torch and prints warnings; a failure of any kind means "not usable here"
    import megatron.core  # noqa: F401

    MEGATRON = ""
except Exception as err:  # pragma: no cover - depends on the environment
    MEGATRON = f"megatron-core is not importable here ({type(err).__name__}: {err}); see docs/export.md"


def worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devices[k % len(devices)])
                               for k, (a, b) in enumerate(itertools.pairwise(cuts))))


CASES = {
    # 2 T4 + 2 A100 as two workers across two nodes, fp16: pipe-major ranks, uneven and layout forms
    "fp16-two-workers": Plan("gpt2-tiny", (worker([0, 2, 4], ["t0:0", "a0:0"]), worker([0, 2, 4], ["t0:1", "a0:1"])),
                             micro_batch_size=2, micro_batches=4, pricing=CostOptions(precision="fp16")),
    # a worker per node, bf16: data-major ranks (--use-tp-pp-dp-mapping), middle stages uneven
    "bf16-worker-per-node": Plan("gpt2-small", (worker([0, 5, 9, 12, 14], ["n0:0", "n0:1", "n0:2", "n0:3"]),
                                                worker([0, 5, 9, 12, 14], ["n1:0", "n1:1", "n1:2", "n1:3"])),
                                 micro_batch_size=2, micro_batches=4, pricing=CostOptions(precision="bf16")),
    # interleaved: two virtual stages per pipeline rank, uneven
    "interleaved": Plan("gpt2-small", (worker([0, 3, 6, 10, 14], ["n0:0", "n1:0"]),), schedule="interleaved",
                        chunks=2, micro_batch_size=2, micro_batches=4, pricing=CostOptions()),
    # tensor parallel 2 x pipeline 2 x data 2 in fp16: --tensor-model-parallel-size 2, the index fastest
    "tp2-pp2-dp2": Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0-1", "n0:2-3"]), worker([0, 2, 4], ["n0:4-5", "n0:6-7"])),
                        micro_batch_size=2, micro_batches=4, pricing=CostOptions(precision="fp16")),
}


@pytest.mark.skipif(bool(MEGATRON), reason=MEGATRON or "megatron-core importable")
@pytest.mark.parametrize("case", list(CASES))
def test_megatron_core_builds_the_exported_plan(case: str, tmp_path: Path) -> None:
    import tools.megatron_check as mc

    export = json.loads(json.dumps(export_plan(CASES[case], "megatron")))
    lines = mc.check(export)
    assert sum("= the plan's" in ln for ln in lines) >= 2
    built = mc.build(export)
    assert len(built) == export["world_size"]
