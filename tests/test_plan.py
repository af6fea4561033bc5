import json

import pytest

from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError
from partitioner.plan import Plan, SolverInfo, Stage, VirtualWorker

from .conftest import GIB, flat_cluster, make_profile


@pytest.fixture
def setting():
    prof = make_profile({"A": [1.0] * 6, "B": [2.0] * 6}, param_bytes=[GIB] * 6)
    cluster = flat_cluster(["A", "B", "A", "B"], memory_gb={"A": 100, "B": 100})
    return prof, cluster


def plan_of(*ranges_and_devices, schedule="1f1b", workers=None):
    stages = tuple(Stage(r, d) for r, d in ranges_and_devices)
    return Plan("toy", workers or (VirtualWorker(stages),), schedule, 1, 4)


def test_round_trip(tmp_path):
    plan = Plan("toy", (VirtualWorker((Stage((0, 3), "n0:0", "A"), Stage((3, 6), "n1:0", "B", ("n2:0",)))),),
                "2bw", 8, 4, 1, predicted={"iteration_s": 1.5},
                solver=SolverInfo("dp", "optimal", 1.0, 1.0, 0.0, 0.01))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    d = json.loads(path.read_text())
    assert d["virtual_workers"][0]["stages"][0] == {"layers": [0, 3], "device": "n0:0", "gpu_type": "A"}


def test_valid_plan_passes(setting):
    prof, cluster = setting
    plan_of(((0, 2), "n0:0"), ((2, 6), "n1:0")).validate(prof, cluster)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (plan_of(((0, 3), "n0:0"), ((2, 6), "n1:0")), r"stages\[1\]\.layers = \[2, 6\]: overlaps the previous stage"),
        (plan_of(((0, 2), "n0:0"), ((3, 6), "n1:0")), r"stages\[1\]\.layers = \[3, 6\]: skips layers \[2, 3\)"),
        (plan_of(((0, 2), "n0:0"), ((2, 5), "n1:0")), r"must cover all 6 layers"),
        (plan_of(((0, 2), "n0:0"), ((2, 9), "n1:0")), r"goes past the last layer; the profile has 6 layers"),
        (plan_of(((0, 2), "n0:0"), ((2, 6), "n9:0")), r"device = 'n9:0': not in cluster"),
        (plan_of(((0, 2), "n0:0"), ((2, 6), "n0:0")), r"holds two stages"),
        (Plan("toy", (VirtualWorker((Stage((0, 6), "n0:0"),)), VirtualWorker((Stage((0, 6), "n0:0"),))), "1f1b", 1, 1),
         r"already used by virtual_workers\[0\]"),
        (Plan("other", (VirtualWorker((Stage((0, 6), "n0:0"),)),), "1f1b", 1, 1), "the profile is of model 'toy'"),
    ],
)
def test_invalid_plans(setting, plan, message):
    prof, cluster = setting
    with pytest.raises(FormatError, match=message):
        plan.validate(prof, cluster)


def test_wrong_gpu_type_and_memory(setting):
    prof, cluster = setting
    bad_type = Plan("toy", (VirtualWorker((Stage((0, 6), "n0:0", "B"),)),), "1f1b", 1, 1)
    with pytest.raises(FormatError, match="device n0:0 is a A"):
        bad_type.validate(prof, cluster)
    small = flat_cluster(["A", "B"], memory_gb={"A": 3, "B": 100})
    # 6 layers of 1 GiB params x (1 weights + 1 grads + 2 Adam) = 24 GiB on a 3 GiB GPU
    with pytest.raises(FormatError, match=r"needs 2\d\.\d\d GiB .* device n0:0 has 3\.00 GiB"):
        CostModel(prof, small).validate_plan(plan_of(((0, 6), "n0:0")))
    plan_of(((0, 6), "n0:0")).validate(prof, small)  # the structure alone: memory is the cost model's
    CostModel(prof, small, CostOptions(optimizer_state_factor=0)).validate_plan(plan_of(((0, 6), "n1:0")))


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"model": "m", "micro_batch_size": 1, "virtual_workers": []}, "virtual_workers = \\[\\]: must list"),
        ({"model": "m", "micro_batch_size": 1, "schedule": "zigzag",
          "virtual_workers": [{"stages": [{"layers": [0, 1], "device": "n0:0"}]}]}, "schedule = 'zigzag': must be one of"),
        ({"model": "m", "micro_batch_size": 1,
          "virtual_workers": [{"stages": [{"layers": [3, 1], "device": "n0:0"}]}]},
         r"virtual_workers\[0\]\.stages\[0\]\.layers = \[3, 1\]: must be \[start, stop\)"),
        ({"model": "m", "micro_batch_size": 1, "virtual_workers": [{"stages": [{"layers": [0, 1]}]}]},
         r"virtual_workers\[0\]\.stages\[0\]\.device is missing"),
    ],
)
def test_bad_plan_files(tmp_path, doc, message):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=message) as info:
        Plan.load(path)
    assert str(info.value).startswith(str(path))
