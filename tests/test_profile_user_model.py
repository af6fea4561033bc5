"""partitioner profile model MODULE:FUNCTION: a user's own model, as train --model takes it."""

from __future__ import annotations

import pytest

from partitioner.profile import Profile
from partitioner_cli.main import main
from runtime.model import load_model_spec

REF = "tests._user_models:mlp"


def test_a_users_model_is_profiled_per_layer_and_planned(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "model", REF, "--micro-batch-size", "8", "--repeats", "1", "--warmup", "0",
                 "-o", str(out)]) == 0
    prof = Profile.load(out)
    spec = load_model_spec(REF)
    assert prof.model == REF and prof.micro_batch_size == 8
    assert [layer.name for layer in prof.layers] == [name for name, _ in spec.layers]
    assert prof.gpu_types == ("cpu",) and all(layer.times["cpu"].total_s > 0 for layer in prof.layers)
    assert sum(layer.param_bytes for layer in prof.layers) == pytest.approx(
        4 * sum(p.numel() for _, m in spec.layers for p in m.parameters()))
    assert prof.meta["model_ref"] == REF
    assert f"profiled {REF}: {len(spec.layers)} layers" in capsys.readouterr().out
    assert main(["plan", str(out), "--cluster", "examples/clusters/cpu4.yaml", "--devices", "n0:0,n0:1",
                 "--micro-batches", "4"]) == 0


@pytest.mark.parametrize(("argv", "needle"), [
    (["no_colon_here"], "give MODULE:FUNCTION"),
    ([REF, "--analytic", "--gpu-type", "T4"], "--analytic: applies to the zoo's models"),
    ([REF, "--seq-len", "64"], "--seq-len: applies to the zoo's models"),
    (["tests._user_models:missing"], "tests._user_models:missing"),
])
def test_bad_references_and_zoo_only_options_are_one_line(tmp_path, capsys, argv, needle):
    assert main(["profile", "model", *argv, "--micro-batch-size", "8", "-o", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "p.json").exists()
