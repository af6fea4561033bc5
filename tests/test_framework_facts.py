"""What the cost model is told about the framework: the all-reduce's precision, tied parameters,
and the fixed cost of a micro-batch from profiles measured at several sizes."""

from __future__ import annotations

import pytest

from partitioner.cluster import Cluster, Node
from partitioner.cost import CostModel, CostOptions
from partitioner.errors import FormatError
from partitioner.overhead import affine_times, at_size_affine, micro_batch_overhead_s
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner.simulate import simulate_plan
from partitioner.tied import tied_parameters
from tests.conftest import big_type


def _profile(n: int = 4, meta: dict | None = None, dtype: str = "float16") -> Profile:
    return Profile("m", 1, tuple(LayerProfile(f"l{i}", param_bytes=2e8, saved_bytes=1e6, output_bytes=1e7,
                                              times={"G": LayerTime(0.01, 0.02, update_s=0.001)})
                                 for i in range(n)), dtype=dtype, meta=meta or {})


def _cluster() -> Cluster:
    return Cluster("c", tuple(Node(f"n{k}", ("G",) * 2, 50.0) for k in range(2)), 5.0, {"G": big_type("G")})


def _data_parallel(workers: int = 4) -> Plan:
    devs = ["n0:0", "n0:1", "n1:0", "n1:1"][:workers]
    return Plan("m", tuple(VirtualWorker((Stage((0, 4), d, "G"),)) for d in devs), "1f1b", 1, 4)


def test_fp32_allreduce_under_fp16_doubles_the_bytes_on_the_wire():
    prof, cl, plan = _profile(), _cluster(), _data_parallel()
    fp16 = CostOptions(precision="fp16")
    fp32 = CostOptions(precision="fp16", allreduce_precision="fp32")
    a, b = CostModel(prof, cl, fp16), CostModel(prof, cl, fp32)
    assert b.param_bytes(0, 4) == 2 * a.param_bytes(0, 4) == 2 * 4 * 2e8
    assert b.weight_bytes(0, 4) == a.weight_bytes(0, 4)  # memory is the training precision's
    (g,) = b.sync_groups(plan)
    assert b.sync_s(g) > 1.9 * a.sync_s(g)
    for opts, model in ((fp16, a), (fp32, b)):
        assert model.plan_iteration_s(plan) == pytest.approx(simulate_plan(plan, prof, cl, opts).iteration_s, rel=1e-9)
    assert CostOptions.from_dict(fp32.to_dict()) == fp32
    assert "allreduce_precision" not in fp16.to_dict()  # plans priced without it read and write as before
    with pytest.raises(FormatError, match="allreduce_precision"):
        CostOptions(allreduce_precision="fp8")


def test_tied_layers_on_two_stages_all_reduce_the_tied_gradient():
    tied = {"tied": [{"layers": [0, 3], "param_bytes": 1e8}]}
    prof, plain, cl = _profile(meta=tied), _profile(), _cluster()
    opts = CostOptions(precision="fp16")
    two = Plan("m", (VirtualWorker((Stage((0, 2), "n0:0", "G"), Stage((2, 4), "n1:0", "G"))),), "1f1b", 1, 4)
    model = CostModel(prof, cl, opts)
    (g,) = model.sync_groups(two)
    assert g.devices == ("n0:0", "n1:0") and g.nbytes == 1e8  # fp16 on the wire, as the profile counts it
    assert model.sync_s(g) == pytest.approx(CostModel(prof, cl, opts).allreduce_s(1e8, ["n0:0", "n1:0"]))
    with_tie = simulate_plan(two, prof, cl, opts).iteration_s
    without = simulate_plan(two, plain, cl, opts).iteration_s
    assert with_tie == pytest.approx(without + model.sync_s(g), rel=1e-9)
    assert model.plan_iteration_s(two) == pytest.approx(with_tie, rel=1e-9)
    # fp32 all-reduce doubles the tied bytes too; one stage holding both layers: no tied all-reduce
    assert CostModel(prof, cl, CostOptions(precision="fp16", allreduce_precision="fp32")).sync_groups(two)[0].nbytes == 2e8
    one = Plan("m", (VirtualWorker((Stage((0, 4), "n0:0", "G"),)),), "1f1b", 1, 4)
    assert model.sync_groups(one) == ()
    # with data parallelism, each pipeline's ends all-reduce their tie after the layers' groups
    dp = Plan("m", (two.virtual_workers[0], VirtualWorker((Stage((0, 2), "n0:1", "G"), Stage((2, 4), "n1:1", "G")))),
              "1f1b", 1, 4)
    groups = model.sync_groups(dp)
    assert [x.nbytes >= 0 for x in groups] == [False, False, True, True]
    # (the two pipelines' sends share the n0-n1 link in the simulator, first come first served)
    assert model.plan_iteration_s(dp) == pytest.approx(simulate_plan(dp, prof, cl, opts).iteration_s, rel=0.02)


@pytest.mark.parametrize("tied,field", [
    ({"layers": [0, 0], "param_bytes": 1}, "layers"), ({"layers": [0, 9], "param_bytes": 1}, "layers"),
    ({"layers": [0, 3], "param_bytes": -1}, "param_bytes"), ("x", "0")])
def test_bad_tied_declarations_are_named(tied, field):
    with pytest.raises(FormatError, match=f"meta.tied.*{field}"):
        tied_parameters(_profile(meta={"tied": [tied]}))


def _measured_at_sizes(fixed: float, per_sample: float, sizes=(1, 2, 4)) -> Profile:
    """Every layer takes fixed + per_sample * b forward and twice that backward, measured at ``sizes``."""
    def t(b: int) -> LayerTime:
        return LayerTime(fixed + per_sample * b, 2 * (fixed + per_sample * b))
    layers = tuple(LayerProfile(f"l{i}", param_bytes=1e6, saved_bytes=1e6 * sizes[0], output_bytes=1e5 * sizes[0],
                                times={"G": t(sizes[0])}, times_at={b: {"G": t(b)} for b in sizes[1:]})
                   for i in range(3))
    return Profile("m", sizes[0], layers)


def test_fixed_cost_per_micro_batch_from_several_sizes():
    prof = _measured_at_sizes(fixed=0.004, per_sample=0.001)
    fit = affine_times(prof, "G")
    assert fit.sizes == (1, 2, 4)
    assert fit.fwd_fixed_s == pytest.approx((0.004,) * 3) and fit.bwd_per_sample_s == pytest.approx((0.002,) * 3)
    assert micro_batch_overhead_s(prof) == pytest.approx({"G": 3 * (0.004 + 0.008)})
    # at 8 samples (beyond the measured sizes) the lines give the truth; linear scaling from 1 does not
    at8 = at_size_affine(prof, 8)
    assert at8.layers[0].times["G"].fwd_s == pytest.approx(0.004 + 0.008)
    assert prof.rescaled(8).layers[0].times["G"].fwd_s == pytest.approx(8 * 0.005)  # +233% here
    assert at8.layers[0].saved_bytes == 8e6 and at8.micro_batch_size == 8
    # no fixed cost: the lines go through zero and agree with linear scaling
    lin = _measured_at_sizes(fixed=0.0, per_sample=0.001)
    assert at_size_affine(lin, 8).layers[1].times["G"].bwd_s == pytest.approx(lin.rescaled(8).layers[1].times["G"].bwd_s)
    with pytest.raises(FormatError, match="two or more"):
        affine_times(_measured_at_sizes(0.0, 0.001, sizes=(1,)), "G")
