"""The memory levers at run time (runtime/recompute.py): recomputation leaves the numbers exactly
as they are and keeps fewer tensors for backward (ZeRO: tests/test_runtime_zero.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from partitioner.errors import FormatError  # noqa: E402
from partitioner.placement import supports  # noqa: E402
from partitioner.plan import Plan, Stage, VirtualWorker  # noqa: E402
from partitioner.pricing import CostOptions  # noqa: E402
from runtime.recompute import recompute_stage  # noqa: E402
from runtime.stage import build_stage, zoo_chain  # noqa: E402


def _run(mode: str) -> tuple[list[torch.Tensor], float, int]:
    chain = zoo_chain("gpt2-tiny", 2)
    stage = recompute_stage(build_stage(chain, 1, 3, seed=3), mode)  # the two blocks
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(x)
        kept = saved
    loss = (out * out).mean()
    loss.backward()
    return [p.grad.clone() for p in stage.parameters()] + [x.grad.clone()], float(loss), kept


def test_recomputation_changes_no_number_and_keeps_fewer_tensors() -> None:
    plain, loss, kept = _run("none")
    for mode in ("selective", "full"):
        grads, loss_m, kept_m = _run(mode)
        assert loss_m == loss
        assert all(torch.equal(a, b) for a, b in zip(plain, grads, strict=True)), mode
        assert kept_m < kept, mode
    assert _run("full")[2] < _run("selective")[2]
    with pytest.raises(FormatError, match="recompute"):
        recompute_stage(torch.nn.Linear(2, 2), "half")


def test_the_runtime_says_which_levers_it_does_not_run_yet() -> None:
    stages = (Stage((0, 2), "n0:0", recompute="full"), Stage((2, 4), "n0:1"))
    plan = Plan("m", (VirtualWorker(stages),), "1f1b", 1, 4)
    assert supports(plan, "runtime") is None  # recomputation runs under 1f1b
    grouped = Plan("m", (VirtualWorker((Stage((0, 2), "n0:0-1", recompute="full"), Stage((2, 4), "n0:2"))),),
                   "1f1b", 1, 4)
    assert supports(grouped, "runtime") is None  # and on a tensor-parallel group
    zero = Plan("m", (VirtualWorker((Stage((0, 4), "n0:0", recompute="full"),)),), "wsp", 1, 4,
                pricing=CostOptions(zero=1))
    assert "zero = 1 with schedule 'wsp'" in (supports(zero, "runtime") or "")
    assert supports(plan, "simulator") is None


def test_a_plan_that_recomputes_trains_what_a_plain_plan_trains(tmp_path) -> None:
    """The runtime runs the plan's recomputation (full on one stage, selective on the other):
    losses and weights equal a run without it, bit for bit; refused where it does not run it."""
    import dataclasses
    import itertools

    import torch

    from partitioner.placement import supports
    from partitioner.plan import Plan, Stage, VirtualWorker
    from runtime.launch import TrainConfig, train_local

    def plan(modes: tuple[str, str], schedule: str = "1f1b") -> Plan:
        stages = tuple(Stage((a, b), f"n0:{k}", recompute=m)
                       for k, ((a, b), m) in enumerate(zip(itertools.pairwise([0, 2, 4]), modes, strict=True)))
        return Plan("gpt2-tiny", (VirtualWorker(stages),), schedule, 2, 2)

    def weights(p: Plan, name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
        root = tmp_path / name
        root.mkdir()
        cfg = TrainConfig("gpt2-tiny", steps=3, warmup=1, lr=0.3, seed=1, threads=1, timeout_s=60,
                          state_dir=str(root), progress=False)
        metrics = train_local(p, cfg, start_method="forkserver")
        out: dict[str, torch.Tensor] = {}
        for r in range(metrics["world_size"]):
            for state in torch.load(root / f"rank{r}.pt").values():
                out.update({f"{r}.{k}": v for k, v in state.items()})
        return metrics["loss"], out

    plain_loss, plain = weights(plan(("none", "none")), "plain")
    loss, got = weights(plan(("full", "selective")), "recomputed")
    assert loss == plain_loss and set(got) == set(plain)
    assert all(torch.equal(got[k], plain[k]) for k in plain)
    assert supports(plan(("full", "none"), "zb-h1"), "runtime") is None
    assert supports(dataclasses.replace(plan(("full", "none")), schedule="2bw"), "runtime") is None
