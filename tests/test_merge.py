"""Merging profiles of one model measured on different GPU types."""

from __future__ import annotations

import pytest

from partitioner.errors import PartitionerError
from partitioner.merge import merge_profiles
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner_cli import main as cli


def _p(gpu, t, model="m", names=("a", "b"), flops=(1.0, 2.0), projected=False, saved=(5.0, 6.0)):
    return Profile(model, 4, tuple(
        LayerProfile(n, f, 10.0, s, 3.0, {gpu: LayerTime(t, 2 * t, projected=projected, measured_on=gpu)})
        for n, f, s in zip(names, flops, saved, strict=True)), meta={"measured_on": {gpu: gpu}})


def test_union_of_types():
    m = merge_profiles([_p("T4", 1.0), _p("V100", 0.5), _p("A10", 0.7)])
    assert m.gpu_types == ("T4", "V100", "A10")
    assert m.layers[1].times["V100"] == LayerTime(0.5, 1.0, measured_on="V100")
    assert m.meta["measured_on"] == {"T4": "T4", "V100": "V100", "A10": "A10"}
    assert not any(m.is_projected(g) for g in m.gpu_types)


def test_measured_beats_projected_and_conflicts_are_refused():
    m = merge_profiles([_p("T4", 9.0, projected=True), _p("T4", 1.0)])
    assert m.layers[0].times["T4"].fwd_s == 1.0 and not m.is_projected("T4")
    with pytest.raises(PartitionerError, match="measured in two profiles"):
        merge_profiles([_p("T4", 1.0), _p("T4", 1.5)])


@pytest.mark.parametrize("other, message", [
    (_p("V100", 1.0, model="other"), "model 'other'"),
    (_p("V100", 1.0, names=("a", "c")), "layer 1 is 'c'"),
    (_p("V100", 1.0, flops=(1.0, 3.0)), "layer 1 'b' differs in flops"),
    (_p("V100", 1.0, names=("a",), flops=(1.0,), saved=(5.0,)), "1 layers"),
    (_p("V100", 1.0, saved=(5.0, 9.0)), "saved_bytes"),
])
def test_mismatches_name_the_first_bad_layer(other, message):
    with pytest.raises(PartitionerError, match=message):
        merge_profiles([_p("T4", 1.0), other])


def test_small_saved_bytes_difference_keeps_the_larger():
    m = merge_profiles([_p("T4", 1.0), _p("V100", 1.0, saved=(5.1, 6.0))])
    assert m.layers[0].saved_bytes == 5.1


def test_cli_merge(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "COMMAND_MODULES", ("partitioner_cli.profile",))
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "m.json"
    _p("T4", 1.0).save(a)
    _p("V100", 1.0, model="x").save(b)
    assert cli.main(["profile", "merge", str(a), str(b), "-o", str(out)]) == 2
    assert "model 'x'" in capsys.readouterr().err and not out.exists()
    _p("V100", 1.0).save(b)
    assert cli.main(["profile", "merge", str(a), str(b), "-o", str(out)]) == 0
    assert Profile.load(out).gpu_types == ("T4", "V100")
