import json

import pytest

from partitioner.cluster import Cluster
from partitioner.cost import CostModel
from partitioner.plan import Plan
from partitioner.profile import Profile
from partitioner_cli.main import main

from .conftest import DATA


def test_import_then_plan(tmp_path, capsys):
    prof_path = tmp_path / "vgg16.json"
    assert main(["import", "pipedream", str(DATA / "pipedream" / "vgg16.txt"), "--gpu-type", "V100-SXM2-16GB",
                 "-o", str(prof_path)]) == 0
    prof = Profile.load(prof_path)
    assert prof.num_layers == 41 and prof.micro_batch_size == 128
    plan_path = tmp_path / "plan.json"
    assert main(["plan", str(prof_path), "--cluster", "examples/clusters/v100x8.yaml", "--allow-fewer",
                 "--micro-batches", "16", "-o", str(plan_path)]) == 0
    out = capsys.readouterr().out
    assert "solver dp: optimal" in out and "share of bottleneck" in out
    plan = Plan.load(plan_path)
    assert plan.solver is not None and plan.solver.status == "optimal"
    CostModel(prof, Cluster.load("examples/clusters/v100x8.yaml")).validate_plan(plan)


def test_infeasible_exits_nonzero_with_the_reason(tmp_path, capsys):
    cluster = tmp_path / "tiny.yaml"
    cluster.write_text("inter_node_GBps: 1\nnodes:\n  - {name: a, intra_node_GBps: 10, gpus: {V100-SXM2-16GB: 2}}\n"
                       "device_types:\n  V100-SXM2-16GB: {memory_GB: 2, fp32_tflops: 15.7, mem_GBps: 900}\n")
    rc = main(["plan", "examples/profiles/vgg16_v100.json", "--cluster", str(cluster), "--schedule", "gpipe",
               "--micro-batches", "8"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("partitioner plan: infeasible: layer ") and "GiB" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"model": "m", "micro_batch_size": 1, "layers": [{"name": "a", "param_bytes": -5}]}',
         "layers[0].param_bytes = -5: must be >= 0"),
        ('{"model": "m", "micro_batch_size": 1, "layers": [{"name": "a", "times": {"Nope-GPU": {"fwd_s": 1, "bwd_s": 1}}}]}',
         "has no times for GPU type V100-SXM2-16GB"),
    ],
)
def test_bad_profile_is_one_line(tmp_path, capsys, content, expected):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    rc = main(["plan", str(bad), "--cluster", "examples/clusters/v100x8.yaml"])
    err = capsys.readouterr().err
    assert rc == 2
    assert expected in err and len(err.strip().splitlines()) == 1


def test_bad_cluster_names_file(tmp_path, capsys):
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"inter_node_GBps": 7, "nodes": [{"intra_node_GBps": 16, "gpus": {"V1000": 2}}]}))
    assert main(["plan", "examples/profiles/vgg16_v100.json", "--cluster", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: nodes[0].gpus[0] = 'V1000': unknown" in err


def test_module_entry_point():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "partitioner_cli", "--help"], capture_output=True, text=True, check=True)
    assert "plan" in out.stdout and "import" in out.stdout


def test_version(capsys):
    from partitioner import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"partitioner {__version__}"


@pytest.mark.parametrize(("argv", "count"), [
    (["plan", "p.json", "--cluster", "c.yaml"], 0),
    (["-v", "plan", "p.json", "--cluster", "c.yaml"], 1),
    (["plan", "p.json", "--cluster", "c.yaml", "-vv"], 2),
    (["-v", "export", "p.json", "--to", "deepspeed", "-v", "-o", "e.json"], 2),
    (["import", "pipedream", "g.txt", "-o", "p.json", "--verbose"], 1),
    (["profile", "project", "p.json", "--gpu-type", "T4", "-o", "q.json", "-v"], 1),
])
def test_verbose_before_or_after_the_subcommand(argv, count):
    from partitioner_cli.main import build_parser, verbosity

    assert verbosity(build_parser().parse_args(argv)) == count


_NO_HEAVY_IMPORTS = r"""
import sys
from partitioner_cli.main import build_parser, main

parser = build_parser()
for argv in (["plan", "p.json", "--cluster", "c.yaml"], ["simulate", "plan.json", "--profile", "p.json",
             "--cluster", "c.yaml"], ["import", "pipedream", "g.txt", "-o", "x.json"]):
    parser.parse_args(argv)
out = sys.argv[1]
assert main(["import", "pipedream", sys.argv[2], "--gpu-type", "V100-SXM2-16GB", "-o", out + "/p.json"]) == 0
assert main(["plan", out + "/p.json", "--cluster", "examples/clusters/v100x8.yaml", "--allow-fewer",
             "--micro-batches", "8", "-o", out + "/plan.json"]) == 0
assert main(["simulate", out + "/plan.json", "--profile", out + "/p.json", "--cluster",
             "examples/clusters/v100x8.yaml", "--trace", out + "/trace.json"]) == 0
assert main(["explain", out + "/plan.json", "--profile", out + "/p.json", "--cluster",
             "examples/clusters/v100x8.yaml", "--json", out + "/explain.json"]) == 0
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "matplotlib", "ortools", "pulp", "scipy", "fvcore"})
print("HEAVY", heavy)
# the cluster planner solves linear programs (HiGHS, through scipy) for its bounds: nothing heavier
assert main(["plan", out + "/p.json", "--cluster", "examples/clusters/v100x8.yaml", "--virtual-workers", "2",
             "--micro-batches", "8"]) == 0
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"torch", "matplotlib", "ortools", "pulp", "fvcore"})
print("HEAVY-CLUSTER", heavy)
"""


def test_planning_commands_do_not_import_torch(tmp_path):
    """--help, import, plan, simulate and explain never load torch (nor the plotting, MILP and LP packages they
    do not use; the cluster planner's bounds solve linear programs with scipy's HiGHS)."""
    import subprocess
    import sys
    from pathlib import Path

    res = subprocess.run([sys.executable, "-c", _NO_HEAVY_IMPORTS, str(tmp_path), str(DATA / "pipedream" / "vgg16.txt")],
                         capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
    assert "HEAVY []" in res.stdout.splitlines()
    assert "HEAVY-CLUSTER []" in res.stdout.splitlines()


@pytest.mark.parametrize("limit", ["0", "-2", "nan"])
def test_time_limit_not_positive_is_one_line(capsys, limit):
    rc = main(["plan", "examples/profiles/vgg19_hetpipe.json", "--cluster", "examples/clusters/hetpipe.yaml",
               "--virtual-workers", "2", "--time-limit", limit])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "--time-limit" in err and ("must be > 0 seconds" in err or "out of range" in err)
