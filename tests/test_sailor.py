"""The Sailor importer on a copy of Sailor's OPT-350 profiles (tests/data/sailor_opt350)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from partitioner.errors import FormatError
from partitioner.importers.sailor import import_sailor

DATA = Path(__file__).parent / "data" / "sailor_opt350"
CATALOG_NAMES = {"A100-40": "A100-SXM4-40GB", "A100-80": "A100-SXM4-80GB", "GH-96": "GH-96",
                 "RTX-2080": "RTX-2080-Ti", "RTX-3090": "RTX-3090", "Titan-RTX": "TITAN-RTX",
                 "V100-16": "V100-SXM2-16GB"}


def test_one_profile_with_seven_measured_types():
    p = import_sailor(DATA)
    assert p.model == "OPT-350" and p.num_layers == 26 and p.micro_batch_size == 1
    assert set(p.gpu_types) == set(CATALOG_NAMES.values())
    assert p.meta["sailor_gpu_names"] == CATALOG_NAMES
    assert [x.name for x in p.layers][:2] == ["embed", "block0"] and p.layers[-1].name == "head"
    clipped = 0
    for sailor, gpu in CATALOG_NAMES.items():
        data = json.loads((DATA / f"{sailor}.json").read_text())
        raw = data["1"]["1"]
        larger = [data[k]["1"] for k in data if int(k) > 1 and "1" in data[k]]
        assert not p.is_projected(gpu)
        for i, layer in enumerate(p.layers):
            t = layer.times[gpu]
            # the measured time, unless the same layer was measured faster on more samples
            for col, got in ((0, t.fwd_s), (1, t.bwd_s)):
                assert got == min([raw[str(i)][col]] + [x[str(i)][col] for x in larger])
                clipped += got != raw[str(i)][col]
            assert t.measured_on == sailor and t.update_s == raw[str(i)][2]
    assert 0 < clipped < 0.1 * 2 * 26 * len(CATALOG_NAMES)  # a few noisy entries, not the profile
    info = json.loads((DATA / "llm_info_OPT-350_only.json").read_text())["OPT-350"]["1"]
    assert p.layers[3].param_bytes == 2 * info["3"]["params_floats"]  # fp16: 2 bytes per parameter
    assert import_sailor(DATA, activations="sailor").layers[3].saved_bytes == info["3"]["act_mem_bytes"]
    # Megatron-LM's formula at t = 1: s h (34 + 5 a s / h) bytes per sample
    assert p.layers[3].saved_bytes == 2048 * 1024 * (34 + 5 * 16 * 2048 / 1024)
    assert p.layers[0].saved_bytes == info["0"]["act_mem_bytes"]  # embedding: Sailor's count


def test_micro_batch_scales_bytes_and_flops():
    one, two = import_sailor(DATA), import_sailor(DATA, micro_batch_size=2)
    for a, b in zip(one.layers, two.layers, strict=True):
        assert b.flops == 2 * a.flops and b.output_bytes == 2 * a.output_bytes
        assert b.saved_bytes == 2 * a.saved_bytes and b.param_bytes == a.param_bytes
    h, s = 1024, 2048
    assert one.layers[1].flops == 24 * s * h * h + 4 * s * s * h


def test_missing_micro_batch_names_what_exists():
    with pytest.raises(FormatError, match="micro-batch sizes with that degree: 1, 2"):
        import_sailor(DATA, micro_batch_size=64)
    with pytest.raises(FormatError, match="tensor parallel degree"):
        import_sailor(DATA, tensor_parallel=3)


def test_broken_file_is_named(tmp_path):
    d = tmp_path / "s"
    shutil.copytree(DATA, d)
    bad = json.loads((d / "V100-16.json").read_text())
    bad["1"]["1"]["5"] = "fast"
    (d / "V100-16.json").write_text(json.dumps(bad))
    with pytest.raises(FormatError) as err:
        import_sailor(d)
    assert "V100-16.json" in str(err.value) and "1.1.5" in str(err.value)


def test_cli_import_sailor(tmp_path, capsys):
    from partitioner.profile import Profile
    from partitioner_cli import main as cli

    out = tmp_path / "opt.json"
    assert cli.main(["import", "sailor", str(DATA), "--micro-batch-size", "2", "-o", str(out)]) == 0
    p = Profile.load(out)
    assert p.micro_batch_size == 2 and len(p.gpu_types) == 7
    assert cli.main(["import", "sailor", str(DATA), "--micro-batch-size", "3", "-o", str(tmp_path / "x.json")]) == 2
    assert "micro-batch sizes with that degree" in capsys.readouterr().err


def test_sailor_rtx_2080_is_the_11_gib_part_with_the_cluster_files_memory(tmp_path):
    from partitioner.importers.sailor import sailor_gpu_name
    from partitioner.importers.sailor_runs import import_sailor_run, sailor_device_types

    assert sailor_gpu_name("RTX-2080") == "RTX-2080-Ti"
    types = sailor_device_types(DATA, ["RTX-2080", "V100-16", "GH-96"])
    cfg = json.loads((DATA / "basic_cluster_config.json").read_text())
    assert types["RTX-2080-Ti"].memory_bytes == cfg["RTX-2080"]["mem_per_gpu"] == 11 * 2**30
    assert types["GH-96"].memory_bytes == cfg["GH-96"]["mem_per_gpu"]
    v100 = types["V100-SXM2-16GB"]  # Sailor's nominal 16 GiB; the driver's usable share kept
    assert v100.memory_bytes == 16 * 2**30 and v100.capacity_bytes / 2**30 == pytest.approx(15.78, abs=0.01)
    # a run on Sailor's RTX-2080 nodes (8 GPUs each) gets 11 GiB GPUs
    run = json.loads((DATA.parent / "sailor_validation" / "clariden_opt350" / "plan_config_N4_D1.json").read_text())
    for stage in run["pipeline_list"][0]["tmp_per_stage"]:
        stage[0] = [[["RTX-2080", 8, "zone"]], 1]
    run["mbs"], run["gbs"] = 1, 4
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    imported = import_sailor_run(path, DATA, DATA.parent / "sailor_validation" / "network" /
                                 "network_coeffs_all_homo.json")
    assert {d.gpu_type for d in imported.cluster.devices} == {"RTX-2080-Ti"}
    assert all(d.memory_bytes == 11 * 2**30 for d in imported.cluster.devices)
    bad = tmp_path / "bad"
    shutil.copytree(DATA, bad)
    cfg["RTX-2080"]["mem_per_gpu"] = -1
    (bad / "basic_cluster_config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=r"RTX-2080\.mem_per_gpu"):
        sailor_device_types(bad, ["RTX-2080"])
