import dataclasses
import json
import os

import pytest

from partitioner.errors import FormatError
from partitioner.profile import PROFILE_FORMAT, LayerProfile, LayerTime, Profile

from .conftest import make_profile


def test_round_trip_is_identity(tmp_path):
    prof = make_profile({"V100-SXM2-16GB": [0.1, 0.2], "T4": [0.3, 0.5]}, [1.0, 2.0], [3.0, 4.0], [5.0, 6.0])
    prof = dataclasses.replace(prof, layers=(prof.layers[0], dataclasses.replace(prof.layers[1], shared_saved_bytes=2.5)))
    path = tmp_path / "p.json"
    prof.save(path)
    assert json.loads(path.read_text())["format"] == PROFILE_FORMAT
    assert Profile.load(path) == prof
    assert Profile.from_dict(prof.to_dict()) == prof


def test_gpu_types_are_those_on_every_layer():
    a = LayerProfile("a", times={"X": LayerTime(1, 1), "Y": LayerTime(1, 1)})
    b = LayerProfile("b", times={"X": LayerTime(1, 1)})
    prof = Profile("m", 1, (a, b))
    assert prof.gpu_types == ("X",)
    with pytest.raises(FormatError, match=r"layers\[1\]\.times = 'Y'"):
        prof.times_for("Y")


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        ({"name": "x", "times": {"V100": {"fwd_s": -1, "bwd_s": 0}}}, r"layers\[0\]\.times\.V100\.fwd_s = -1: must be >= 0"),
        ({"name": "x", "flops": -3}, r"layers\[0\]\.flops = -3"),
        ({"name": "x", "saved_bytes": 4, "shared_saved_bytes": 5}, r"shared_saved_bytes = 5: must not exceed saved_bytes \(4\)"),
        ({"name": "x", "saved_bytes": "big"}, r"layers\[0\]\.saved_bytes = 'big': must be of type"),
        ({"flops": 1}, r"layers\[0\]\.name is missing"),
        ({"name": "x", "times": {"V100": {"fwd_s": 1}}}, r"layers\[0\]\.times\.V100\.bwd_s is missing"),
    ],
)
def test_bad_layer_names_file_field_and_value(tmp_path, layer, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"model": "m", "micro_batch_size": 2, "layers": [layer]}))
    with pytest.raises(FormatError, match=message) as info:
        Profile.load(path)
    assert str(info.value).startswith(str(path))
    assert "\n" not in str(info.value)


def test_other_bad_files(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FormatError, match="no such file"):
        Profile.load(missing)
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        Profile.load(broken)
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps({"model": "m", "micro_batch_size": 1, "layers": [{"name": "a"}, {"name": "a"}]}))
    with pytest.raises(FormatError, match=r"layers\[1\]\.name = 'a': duplicates layers\[0\]"):
        Profile.load(dup)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"format": "partitioner.plan/1", "model": "m", "micro_batch_size": 1, "layers": []}))
    with pytest.raises(FormatError, match=r"format = 'partitioner\.plan/1': expected 'partitioner\.profile/1'"):
        Profile.load(wrong)
    zero = tmp_path / "zero.json"
    zero.write_text(json.dumps({"model": "m", "micro_batch_size": 0, "layers": [{"name": "a"}]}))
    with pytest.raises(FormatError, match="micro_batch_size = 0"):
        Profile.load(zero)


def test_saved_files_have_ordinary_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        path = tmp_path / "p.json"
        make_profile({"X": [1.0]}).save(path)
        assert path.stat().st_mode & 0o777 == 0o644
        path.chmod(0o640)
        make_profile({"X": [2.0]}).save(path)  # replacing keeps the file's mode
        assert path.stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)


def test_save_is_atomic(tmp_path, monkeypatch):
    """An interrupted write leaves the previous file whole and no temporary behind."""
    path = tmp_path / "p.json"
    old = make_profile({"X": [1.0]})
    old.save(path)
    before = path.read_text()

    def boom(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        make_profile({"X": [2.0, 3.0]}).save(path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]
