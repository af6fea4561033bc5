"""partitioner.export (torch-free): what each target gets, and what each refuses in one line."""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest

from partitioner.errors import PartitionerError
from partitioner.export import TARGETS, ExportError, deepspeed_uniform_parts, export_plan
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner_cli.main import main


def worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devices[k % len(devices)], gpu_type="T")
                               for k, (a, b) in enumerate(itertools.pairwise(cuts))))


def random_cuts(rng: random.Random, n_layers: int, n_stages: int) -> list[int]:
    return [0, *sorted(rng.sample(range(1, n_layers), n_stages - 1)), n_layers]


# -- torch.distributed.pipelining ------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_torch_export_maps_every_stage_to_one_rank_and_device(seed: int) -> None:
    rng = random.Random(seed)
    schedule = rng.choice(["gpipe", "1f1b", "interleaved", "bfs"])
    v = rng.choice([1, 2]) if schedule in ("interleaved", "bfs") else 1
    workers = []
    for w in range(rng.randint(1, 3)):
        p = rng.randint(1, 3)
        workers.append(worker(random_cuts(rng, 20, p * v), [f"n{w}:{d}" for d in range(p)]))
    plan = Plan("m", tuple(workers), schedule=schedule, micro_batch_size=2, micro_batches=6, chunks=v)
    e = export_plan(plan, "torch-pipelining", [f"l.{i}" for i in range(20)])
    assert e["world_size"] == len(plan.devices) == len(e["ranks"])
    assert [r["device"] for r in e["ranks"]] == list(plan.devices)
    for pipe, vw in zip(e["pipelines"], plan.virtual_workers, strict=True):
        p = len(pipe["ranks"])
        for s, (st, ex) in enumerate(zip(vw.stages, pipe["stages"], strict=True)):
            assert ex["layers"] == list(st.layers) and ex["device"] == st.device
            assert ex["rank"] == pipe["ranks"][s % p]  # torch's loop mapping: stage s on pipeline rank s % p
            assert e["ranks"][ex["rank"]]["device"] == st.device and s in e["ranks"][ex["rank"]]["stages"]
        # split points: each later stage begins at its first layer (module names use _ for .)
        assert pipe["split_spec"] == {f"l_{st.start}": "BEGINNING" for st in vw.stages[1:]}
        rows = pipe["batch_rows"]
        assert rows[1] - rows[0] == plan.micro_batches * plan.micro_batch_size
    # the pipelines' rows tile the global batch
    assert [p["batch_rows"] for p in e["pipelines"]] == [
        [w * 12, (w + 1) * 12] for w in range(len(plan.virtual_workers))]
    if len(workers) > 1:  # every layer averaged in exactly one set, over one rank per virtual worker
        layers = sorted(layer for g in e["grad_sync"] for layer in g["layers"])
        assert layers == list(range(20))
        for g in e["grad_sync"]:
            assert sorted(e["ranks"][r]["virtual_worker"] for r in g["ranks"]) == list(range(len(workers)))
    else:
        assert e["grad_sync"] == []


@pytest.mark.parametrize(("schedule", "cls"), [("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B"),
                                               ("interleaved", "ScheduleInterleaved1F1B"),
                                               ("bfs", "ScheduleLoopedBFS")])
def test_torch_schedule_class(schedule: str, cls: str) -> None:
    v = 2 if schedule in ("interleaved", "bfs") else 1
    plan = Plan("m", (worker([0, 1, 2, 3, 4][: 2 * v + 1], ["a:0", "a:1"]),), schedule=schedule, micro_batches=4,
                chunks=v)
    e = export_plan(plan, "torch-pipelining")
    assert e["schedule_class"] == cls and e["n_microbatches"] == 4 and e["stages_per_rank"] == v
    assert e["pipelines"][0]["split_spec"] is None  # no layer names given
    assert cls in e["snippet"]


# -- DeepSpeed ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "p"), [(7, 2), (22, 4), (5, 5), (3, 4), (48, 5)])
def test_deepspeed_uniform_parts(n: int, p: int) -> None:
    parts = deepspeed_uniform_parts(n, p)
    sizes = [b - a for a, b in itertools.pairwise(parts)]
    assert parts[0] == 0 and parts[-1] == n and len(parts) == p + 1
    assert sizes == sorted(sizes, reverse=True)  # the larger stages first
    if n >= p:
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_deepspeed_export_parts_ranks_and_config() -> None:
    cuts = [0, 3, 10, 22]
    plan = Plan("m", (worker(cuts, ["a:0", "a:1", "a:2"]), worker(cuts, ["b:0", "b:1", "b:2"])),
                micro_batch_size=4, micro_batches=8)
    e = export_plan(plan, "deepspeed")
    assert e["parts"] == cuts and e["num_stages"] == 3 and e["data_parallel"] == 2
    assert e["partition_method"] is None and "_partition_layers" in e["snippet"] and str(cuts) in e["snippet"]
    assert e["config"] == {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
                           "train_batch_size": 64, "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
                           "zero_optimization": {"stage": 0}, "gradient_clipping": 0.0}  # no pricing: plain SGD in fp32
    # each worker on a node of its own: pipe-major ranks (rank = stage * dp + replica) would alternate
    # between the nodes, so the ranks are data-major (rank = replica * pp + stage, DeepSpeed's
    # ProcessTopology(axes=['data', 'pipe']))
    assert e["rank_order"] == "data-major"
    assert [(r["rank"], r["device"]) for r in sorted(e["ranks"], key=lambda r: r["rank"])] == [
        (0, "a:0"), (1, "a:1"), (2, "a:2"), (3, "b:0"), (4, "b:1"), (5, "b:2")]
    # a stage per node: pipe-major, DeepSpeed's default topology
    across = Plan("m", (worker(cuts, ["a:0", "b:0", "c:0"]), worker(cuts, ["a:1", "b:1", "c:1"])),
                  micro_batch_size=4, micro_batches=8)
    e = export_plan(across, "deepspeed")
    assert e["rank_order"] == "pipe-major" and "num_stages=3" in e["snippet"]
    assert [(r["rank"], r["device"]) for r in sorted(e["ranks"], key=lambda r: r["rank"])] == [
        (0, "a:0"), (1, "a:1"), (2, "b:0"), (3, "b:1"), (4, "c:0"), (5, "c:1")]
    uniform = Plan("m", (worker(deepspeed_uniform_parts(22, 3), ["a:0", "a:1", "a:2"]),))
    assert export_plan(uniform, "deepspeed")["partition_method"] == "uniform"


# -- Megatron-LM -------------------------------------------------------------------------------


def parse_layout(layout: str) -> list[str]:
    """Megatron's layout grammar as documented: stages split by |, x*n repeats x."""
    return [re.sub(r"(.)\*(\d+)", lambda mt: mt.group(1) * int(mt.group(2)), s) for s in layout.split("|")]


@pytest.mark.parametrize("seed", range(6))
def test_megatron_layout_holds_each_stages_layers(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(5, 30)  # gpt2 chain: embedding, n - 2 blocks, head
    v = rng.choice([1, 2])
    p = rng.randint(1, min(4, (n - 1) // v))
    cuts = random_cuts(rng, n, p * v)
    plan = Plan("gpt2-test", (worker(cuts, [f"a:{d}" for d in range(p)]),),
                schedule="interleaved" if v > 1 else "1f1b", micro_batches=2 * p, chunks=v)
    e = export_plan(plan, "megatron")
    stages = parse_layout(e["layout"])
    assert len(stages) == p * v
    assert "".join(stages) == "E" + "t" * (n - 2) + "L"
    assert [s.count("t") for s in stages] == e["transformer_layers_per_stage"]
    assert [len(s) for s in stages] == [b - a for a, b in itertools.pairwise(cuts)]
    assert e["layout_args"][-2:] == ["--pipeline-model-parallel-layout", e["layout"]]


def test_megatron_uneven_first_and_last() -> None:
    # 20 layers = embedding + 18 blocks + head; stages hold 4, 5, 5, 4 blocks
    plan = Plan("gpt2-test", (worker([0, 5, 10, 15, 20], ["a:0", "a:1", "a:2", "a:3"]),), micro_batches=4)
    e = export_plan(plan, "megatron")
    assert e["transformer_layers_per_stage"] == [4, 5, 5, 4]
    assert e["uneven_args"][-4:] == ["--decoder-first-pipeline-num-layers", "4",
                                     "--decoder-last-pipeline-num-layers", "4"]
    even = export_plan(Plan("gpt2-test", (worker([0, 7, 13, 20], ["a:0", "a:1", "a:2"]),)), "megatron")
    assert even["transformer_layers_per_stage"] == [6, 6, 6] and even["uneven_args"] == even["args"]
    # middle stages uneven: only the layout expresses it
    mid = export_plan(Plan("gpt2-test", (worker([0, 5, 9, 15, 20], ["a:0", "a:1", "a:2", "a:3"]),)), "megatron")
    assert mid["uneven_args"] is None and "middle stages hold [4, 6]" in mid["uneven_args_unavailable"]
    assert "--pipeline-model-parallel-layout" in mid["snippet"]


# -- refusals: one line naming what the target lacks ------------------------------------------


TWO = ["a:0", "a:1"]


@pytest.mark.parametrize(("target", "plan", "expect"), [
    ("deepspeed", Plan("m", (worker([0, 2, 6], TWO), worker([0, 3, 6], ["b:0", "b:1"]))),
     "virtual workers 0 and 1 cut the model differently ([0, 2, 6] vs [0, 3, 6]); DeepSpeed's data-parallel"),
    ("megatron", Plan("gpt2-x", (worker([0, 2, 6], TWO), worker([0, 3, 6], ["b:0", "b:1"]))),
     "cut the model differently"),
    ("deepspeed", Plan("m", (worker([0, 1, 2, 3, 6], TWO),), schedule="interleaved", micro_batches=2, chunks=2),
     "deepspeed holds one stage per rank"),
    ("megatron", Plan("gpt2-x", (worker([0, 1, 2, 3, 6], TWO),), schedule="bfs", micro_batches=2, chunks=2),
     "no breadth-first order"),
    ("megatron", Plan("vgg19", (worker([0, 3, 6], TWO),)), "model 'vgg19' is not a GPT-style chain"),
    ("torch-pipelining", Plan("m", (worker([0, 3, 6], TWO),), schedule="wsp"),
     "schedule wsp needs bounded staleness"),
    ("deepspeed", Plan("m", (worker([0, 3, 6], TWO),), schedule="2bw"), "double-buffered weights"),
    ("torch-pipelining", Plan("m", (VirtualWorker((Stage((0, 3), "a:0", replicas=("a:2",)), Stage((3, 6), "a:1"))),)),
     "replicated on ['a:2']; torch-pipelining has no per-stage replication"),
    ("megatron", Plan("gpt2-x", (worker([0, 3, 6], TWO),), micro_batch_size=4, first_slices=2),
     "first_slices = 2"),
    ("torch-pipelining", Plan("m", (worker([0, 1, 2, 3, 6], TWO),), schedule="1f1b", chunks=2),
     "torch's Schedule1F1B runs one stage per rank"),
])
def test_refusals(target: str, plan: Plan, expect: str) -> None:
    with pytest.raises(ExportError) as info:
        export_plan(plan, target)
    msg = str(info.value)
    assert msg.startswith(f"{target} cannot run this plan: ") and expect in msg and "\n" not in msg


def test_unknown_target_lists_the_valid_ones() -> None:
    plan = Plan("m", (worker([0, 3, 6], TWO),))
    with pytest.raises(PartitionerError, match="valid targets: torch-pipelining, deepspeed, megatron"):
        export_plan(plan, "colossalai")


# -- the command -------------------------------------------------------------------------------


def test_cli_writes_export_and_snippet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = Plan("gpt2-tiny", (worker([0, 1, 4], TWO),), micro_batch_size=2, micro_batches=4)
    plan.save(tmp_path / "plan.json")
    out, snip = tmp_path / "e.json", tmp_path / "e.py"
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torch-pipelining", "-o", str(out),
                 "--snippet", str(snip)]) == 0
    e = json.loads(out.read_text())
    assert e["target"] == "torch-pipelining" and e["pipelines"][0]["split_spec"] == {"block0": "BEGINNING"}
    assert snip.read_text() == e["snippet"]
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "expect"), [
    (["--to", "nope"], "unknown target 'nope'; valid targets: " + ", ".join(TARGETS)),
    (["--to", "megatron"], "plan.json: megatron cannot run this plan: model 'm' is not a GPT-style chain"),
])
def test_cli_errors_are_one_line(args: list[str], expect: str, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    Plan("m", (worker([0, 3, 6], TWO),)).save(tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), *args, "-o", str(tmp_path / "e.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err
    assert not (tmp_path / "e.json").exists()


# -- untrusted input ---------------------------------------------------------------------------

# runs print(1) if spliced between quotes (no dot in it: module names map '.' to '_')
HOSTILE = "blk': 1}); exec(bytes((112, 114, 105, 110, 116, 40, 49, 41))); ({'x"


def _calls(tree: object) -> list[str]:
    import ast

    return sorted(ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call))  # type: ignore[arg-type]


def test_a_hostile_layer_name_stays_a_string_in_the_snippet(tmp_path: Path) -> None:
    """Layer names come from the user's profile: the generated Python holds them as string
    constants, verbatim, and gains no call whatever they contain."""
    import ast

    plan = Plan("m", (worker([0, 2, 4], TWO),), micro_batch_size=2, micro_batches=4)
    plain = export_plan(plan, "torch-pipelining", ["l0", "l1", "l2", "l3"])["snippet"]
    for name in (HOSTILE, 'a"b\'c\\\n#', "x'''; import os; '''", "\u2028é'"):
        snippet = export_plan(plan, "torch-pipelining", ["l0", "l1", name, "l3"])["snippet"]
        tree = ast.parse(snippet)
        constants = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        assert name.replace(".", "_") in constants
        assert _calls(tree) == _calls(ast.parse(plain))
    # the command writes the same snippet from a profile with that name
    from partitioner.profile import LayerProfile, LayerTime, Profile

    Profile("m", 2, tuple(LayerProfile(n, times={"T": LayerTime(1.0, 2.0)}) for n in ["l0", "l1", HOSTILE, "l3"])
            ).save(tmp_path / "p.json")
    plan.save(tmp_path / "plan.json")
    snip = tmp_path / "s.py"
    assert main(["export", str(tmp_path / "plan.json"), "--to", "torch-pipelining", "--profile",
                 str(tmp_path / "p.json"), "-o", str(tmp_path / "e.json"), "--snippet", str(snip)]) == 0
    tree = ast.parse(snip.read_text())
    assert HOSTILE in [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    assert _calls(tree) == _calls(ast.parse(plain))


@pytest.mark.parametrize("target", TARGETS)
def test_a_device_in_two_virtual_workers_is_refused_by_every_target(target: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    plan = Plan("gpt2-tiny", (worker([0, 2, 4], TWO), worker([0, 2, 4], ["b:0", "a:1"])), micro_batch_size=2,
                micro_batches=4)
    with pytest.raises(PartitionerError, match=r"virtual_workers\[1\]\.stages\[1\]\.device = 'a:1': already used "
                                               r"by virtual_workers\[0\]"):
        export_plan(plan, target)
    plan.save(tmp_path / "plan.json")
    assert main(["export", str(tmp_path / "plan.json"), "--to", target, "-o", str(tmp_path / "e.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already used by virtual_workers[0]" in err
    assert not (tmp_path / "e.json").exists()


def test_a_stage_past_any_profile_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan file with a stage [2, 10**18] (megatron would list one letter per layer)."""
    data = Plan("gpt2-tiny", (worker([0, 2, 4], TWO),)).to_dict()
    data["virtual_workers"][0]["stages"][1]["layers"] = [2, 10**18]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    assert main(["export", str(tmp_path / "plan.json"), "--to", "megatron", "-o", str(tmp_path / "e.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "stages[1].layers = [2, 1000000000000000000]: must be [start, stop) with 0 <= start < stop <= 10,000" in err


@pytest.mark.parametrize("same", ["name", "hard link"])
def test_export_outputs_are_not_inputs_nor_each_other(same: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import os

    plan_path = tmp_path / "plan.json"
    Plan("gpt2-tiny", (worker([0, 2, 4], TWO),)).save(plan_path)
    before = plan_path.read_bytes()
    if same == "name":
        argv = ["-o", str(tmp_path / "x"), "--snippet", str(tmp_path / "x")]
        expect = "--snippet " + str(tmp_path / "x") + " is also the -o output"
    else:
        os.link(plan_path, tmp_path / "other.json")
        argv = ["-o", str(tmp_path / "other.json")]
        expect = "is one of the input files"
    assert main(["export", str(plan_path), "--to", "deepspeed", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expect in err
    assert plan_path.read_bytes() == before and not (tmp_path / "x").exists()
    if same == "hard link":
        assert os.path.samefile(plan_path, tmp_path / "other.json")
