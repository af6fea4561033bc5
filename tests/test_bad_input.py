"""Bad input through the command line: one line naming the file, the field, the value and what
is valid, exit status 2, before any work; no input overwritten; nothing written that its reader
refuses (README.md, docs/formats.md). Damaged copies of the Sailor files are written to tmp_path."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from partitioner.cluster import Cluster
from partitioner.plan import Plan
from partitioner.profile import Profile
from partitioner_cli.main import main

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
SAILOR = DATA / "sailor_opt350"
RUN = DATA / "sailor_validation" / "clariden_opt350" / "plan_config_N16_D4.json"
NETWORK = DATA / "sailor_validation" / "network" / "network_coeffs_all_homo.json"
INTRA = DATA / "sailor_validation" / "network" / "intra_node_bandwidths.json"
VGG = ROOT / "examples" / "profiles" / "vgg16_v100.json"
V100X8 = ROOT / "examples" / "clusters" / "v100x8.yaml"


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *expect: str) -> str:
    """Run ``partitioner argv``: exit 2 and one line on stderr holding every ``expect``."""
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err and "internal error" not in err, err
    for text in expect:
        assert text in err, err
    return err


def damaged(tmp_path: Path, src: Path, change: Callable[[dict[str, Any]], None], name: str = "") -> Path:
    data = json.loads(src.read_text())
    change(data)
    out = tmp_path / (name or src.name)
    out.write_text(json.dumps(data))
    return out


def sailor_dir(tmp_path: Path, file: str, change: Callable[[dict[str, Any]], None]) -> Path:
    d = tmp_path / "sailor"
    shutil.copytree(SAILOR, d)
    damaged(d, SAILOR / file, change)
    return d


def sailor_run(tmp_path: Path, run: Path, out: Path | None = None, profiles: Path = SAILOR,
               network: Path = NETWORK) -> list[str]:
    return ["import", "sailor-run", str(run), "--profiles", str(profiles), "--network", str(network),
            "-o", str(out or tmp_path / "out")]


def stage(d: dict[str, Any]) -> dict[str, Any]:
    return d["pipeline_list"][0]  # type: ignore[no-any-return]


# -- inputs are never outputs ----------------------------------------------------------------


def test_sailor_network_does_not_replace_its_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    net, intra = tmp_path / "net.json", tmp_path / "intra.json"
    shutil.copy(NETWORK, net)
    shutil.copy(INTRA, intra)
    base = ["import", "sailor-network", str(net), "--gpu-type", "GH-96", "--nodes", "2", "--gpus-per-node", "4"]
    one_line_error(capsys, [*base, "-o", str(net)], f"-o {net} is one of the input files")
    one_line_error(capsys, [*base, "--intra", str(intra), "-o", str(intra)], f"-o {intra} is one of the input files")
    assert net.read_bytes() == NETWORK.read_bytes() and intra.read_bytes() == INTRA.read_bytes()
    assert main([*base, "--intra", str(intra), "-o", str(tmp_path / "c.json")]) == 0
    Cluster.load(tmp_path / "c.json")


def test_sailor_run_does_not_write_over_or_into_its_inputs(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    run = folder / "plan.json"  # an input named as one of the outputs, in the output folder
    shutil.copy(RUN, run)
    one_line_error(capsys, sailor_run(tmp_path, run, folder), f"-o {folder} would receive plan.json, which is one "
                                                             "of the input files")
    assert run.read_bytes() == RUN.read_bytes() and sorted(os.listdir(folder)) == ["plan.json"]
    profiles = tmp_path / "profiles"
    shutil.copytree(SAILOR, profiles)
    one_line_error(capsys, sailor_run(tmp_path, RUN, profiles, profiles=profiles), "is the input folder")
    assert sorted(os.listdir(profiles)) == sorted(os.listdir(SAILOR))
    # an input behind a hard link inside the output folder
    out = tmp_path / "out"
    out.mkdir()
    net = tmp_path / "net.json"
    shutil.copy(NETWORK, net)
    os.link(net, out / "cluster.json")
    one_line_error(capsys, sailor_run(tmp_path, RUN, out, network=net), "would receive cluster.json, which is one "
                                                                        "of the input files")
    assert net.read_bytes() == NETWORK.read_bytes()


def test_import_sailor_does_not_write_into_its_profile_folder(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    profiles = tmp_path / "profiles"
    shutil.copytree(SAILOR, profiles)
    one_line_error(capsys, ["import", "sailor", str(profiles), "-o", str(profiles / "p.json")],
                   "is inside the input folder")
    assert sorted(os.listdir(profiles)) == sorted(os.listdir(SAILOR))


@pytest.mark.parametrize("command", ["compare", "explain"])
def test_outputs_are_not_inputs_by_hard_link_nor_each_other(command: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "p.json"
    shutil.copy(VGG, profile)
    os.link(profile, tmp_path / "link.json")
    if command == "compare":
        argv = ["compare", str(profile), "--cluster", str(V100X8)]
        one_line_error(capsys, [*argv, "-o", str(tmp_path / "link.json")], "is one of the input files")
        one_line_error(capsys, [*argv, "-o", str(tmp_path / "x"), "--png", str(tmp_path / "x")],
                       f"--png {tmp_path / 'x'} is also the -o output")
        assert not (tmp_path / "x").exists()
    else:
        plan = tmp_path / "plan.json"
        assert main(["plan", str(profile), "--cluster", str(V100X8), "--allow-fewer", "-o", str(plan)]) == 0
        capsys.readouterr()
        one_line_error(capsys, ["explain", str(plan), "--profile", str(profile), "--cluster", str(V100X8),
                                "--json", str(tmp_path / "link.json")], "is one of the input files")
    assert profile.read_bytes() == VGG.read_bytes()


# -- damaged Sailor runs: one line, never an internal error, nothing the reader refuses ---------


@pytest.mark.parametrize(("change", "expect"), [
    (lambda d: d.update(mbs=0), "mbs = 0: must be an integer in [1, 1,048,576]"),
    (lambda d: d.update(real=10**400), "real = <an integer of about 401 digits>: must be a number of seconds > 0"),
    (lambda d: d.update(max_mem=10**400), "max_mem = <an integer of about 401 digits>: must be a number of bytes"),
    (lambda d: d.update(max_mem=-1), "max_mem = -1: must be a number of bytes > 0"),
    (lambda d: d.update(real=True), "real = True: must be a number of seconds > 0"),
    (lambda d: stage(d)["layers_per_stage"].__setitem__(1, [4, 5, 6]),
     "layers_per_stage[1] = [4, 5, 6]: overlaps stage 0, which ends at layer 4"),
    (lambda d: stage(d)["layers_per_stage"].__setitem__(1, [6, 7, 8, 9, 10, 11]),
     "layers_per_stage[1] = [6, 7, 8, 9, 10, 11]: skips layer 5"),
    (lambda d: stage(d)["layers_per_stage"].__setitem__(3, [19, 20, 21]),
     "layers_per_stage[3] = [19, 20, 21]: must end at the model's last layer, 25"),
    (lambda d: stage(d)["tmp_per_stage"][0][0][0][0].__setitem__(1, 0),
     "tmp_per_stage[0][0][0][0][1] = 0: gpus_per_node must be an integer in [1, 16,384]"),
    (lambda d: stage(d)["tmp_per_stage"][0][0][0][0].__setitem__(1, -4),
     "tmp_per_stage[0][0][0][0][1] = -4: gpus_per_node must be"),
    (lambda d: d.update(mbs=1, gbs=4 * 2**50),
     "gbs = 4503599627370496: gives gbs / (mbs x dp) = 1,125,899,906,842,624 micro-batches per pipeline; a plan "
     "holds at most 4,096"),
])
def test_a_damaged_sailor_run_is_one_line(change: Callable[[dict[str, Any]], None], expect: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    bad = damaged(tmp_path, RUN, change)
    one_line_error(capsys, sailor_run(tmp_path, bad), f"{bad}: ", expect)
    assert not (tmp_path / "out").exists()


def test_sailor_run_output_places_that_cannot_be_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "a_file"
    file.write_text("x")
    one_line_error(capsys, sailor_run(tmp_path, RUN, file), f"-o {file} is a file; name a folder")
    for place in ("/proc/partitioner-test", "/sys/partitioner-test"):
        if Path(place).parent.exists():
            one_line_error(capsys, sailor_run(tmp_path, RUN, Path(place)), f"-o {place}/plan.json")


def test_a_sailor_run_writes_three_files_their_readers_accept(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(sailor_run(tmp_path, RUN)) == 0
    out = tmp_path / "out"
    plan, profile, cluster = Plan.load(out / "plan.json"), Profile.load(out / "profile.json"), \
        Cluster.load(out / "cluster.json")
    plan.validate(profile, cluster)


# -- damaged Sailor profiles --------------------------------------------------------------------


def test_a_zero_hidden_size_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = sailor_dir(tmp_path, "training_config_opt_350.json", lambda c: c.update(hidden_size=0))
    one_line_error(capsys, ["import", "sailor", str(d), "-o", str(tmp_path / "p.json")],
                   "training_config_opt_350.json: hidden_size = 0: must be an integer in [1, 1,048,576]")
    d2 = tmp_path / "two"
    shutil.copytree(d, d2)
    damaged(d2, SAILOR / "training_config_opt_350.json", lambda c: c.update(hidden_size=1.5))
    one_line_error(capsys, ["import", "sailor", str(d2), "-o", str(tmp_path / "p.json")], "hidden_size = 1.5")


def test_booleans_are_not_times_even_in_a_larger_micro_batch(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The larger micro-batch's times bound the imported ones, so they are read and checked too."""
    d = sailor_dir(tmp_path, "GH-96.json", lambda g: g["2"]["1"].__setitem__("3", [False, False, 0.001]))
    one_line_error(capsys, ["import", "sailor", str(d), "-o", str(tmp_path / "p.json")],
                   "GH-96.json: 2.1.3 = [False, False, 0.001]: must be [fwd_s, bwd_s, update_s], numbers of seconds")


def test_a_measured_time_is_never_lowered_to_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 0 at a larger micro-batch is below the timer's resolution: it bounds nothing. A measured 0 stays 0."""
    raw = json.loads((SAILOR / "GH-96.json").read_text())
    assert raw["1"]["1"]["0"][1] > 0

    def change(g: dict[str, Any]) -> None:
        for size in g:
            if size != "1" and "1" in g[size]:
                g[size]["1"]["0"][1] = 0.0  # the embedding's backward measured as 0 at every larger size
        g["1"]["1"]["1"][1] = 0.0  # and a block's backward measured as 0 at this size

    d = sailor_dir(tmp_path, "GH-96.json", change)
    assert main(["import", "sailor", str(d), "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    p = Profile.load(tmp_path / "p.json")
    assert p.layers[0].times["GH-96"].bwd_s == raw["1"]["1"]["0"][1]
    assert p.layers[1].times["GH-96"].bwd_s == 0.0
    assert "note: layer times above the same layer's time at a larger measured micro-batch were lowered" in out
    for layer in p.layers:  # never below a positive measurement at a larger size, never 0 unless measured 0
        for gpu, t in layer.times.items():
            assert t.fwd_s > 0 or gpu == "A100-SXM4-80GB"


# -- values a reader would refuse are refused before writing -------------------------------------


def test_sailor_network_flags_and_curves_within_the_cluster_limits(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import partitioner.cluster as cluster_mod

    base = ["import", "sailor-network", str(NETWORK), "--gpu-type", "GH-96", "-o", str(tmp_path / "c.json")]
    one_line_error(capsys, [*base, "--nodes", "2", "--gpus-per-node", "4", "--intra-gbps", "1e308"],
                   "--intra-gbps: 1e308 is out of range")
    for nodes, per_node in (("0", "4"), ("2", "0"), ("2", "-1")):
        one_line_error(capsys, [*base, "--nodes", nodes, "--gpus-per-node", per_node], "is out of range")

    class NoCluster:  # the limit is checked before any node is built
        def __init__(self, *a: Any, **k: Any) -> None:
            raise AssertionError("a cluster was built")

    monkeypatch.setattr(cluster_mod, "Cluster", NoCluster)
    monkeypatch.setattr(cluster_mod, "Node", NoCluster)
    one_line_error(capsys, [*base, "--nodes", "100000", "--gpus-per-node", "4"], "--nodes: 100000 is out of range",
                   "16,384")
    one_line_error(capsys, [*base, "--nodes", "1000", "--gpus-per-node", "40"], "= 40,000 GPUs; at most 16,384")
    monkeypatch.undo()
    net = damaged(tmp_path, NETWORK, lambda d: d["inter"]["GH-96"]["4"].__setitem__(1, 1e308), "net.json")
    one_line_error(capsys, ["import", "sailor-network", str(net), "--gpu-type", "GH-96", "--nodes", "2",
                            "--gpus-per-node", "4", "-o", str(tmp_path / "c.json")],
                   "net.json: inter.GH-96.4 = ", "the cap in [1000, 1e+15] bytes/s")
    assert not (tmp_path / "c.json").exists()


def test_a_projection_past_the_profile_limits_is_not_written(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    def change(p: dict[str, Any]) -> None:
        for layer in p["layers"]:
            layer["times"] = {"cpu": layer["times"]["V100-SXM2-16GB"]}
        p["layers"][2]["flops"] = 1e21

    src = damaged(tmp_path, VGG, change, "cpu.json")
    out = tmp_path / "proj.json"
    one_line_error(capsys, ["profile", "project", str(src), "--gpu-type", "T4", "-o", str(out)],
                   f"{out}: not written: the profile would have layers[2].times.T4.fwd_s = ", "must be <= 1e+06")
    assert not out.exists()


def test_every_save_checks_its_reader() -> None:
    from partitioner.errors import PartitionerError
    from partitioner.plan import Stage, VirtualWorker

    plan = Plan("m", (VirtualWorker((Stage((0, 1), "n0:0"),)),), micro_batches=5000)
    with pytest.raises(PartitionerError, match=r"not written: the plan would have micro_batches = 5000: must be an "
                                               r"integer in \[1, 4,096\]"):
        plan.save("/nonexistent-dir-never-created/plan.json")


# -- compare's options ---------------------------------------------------------------------------


@pytest.mark.parametrize(("flags", "expect"), [
    (["--time-limit", "0"], "--time-limit: 0 is out of range"),
    (["--time-limit", "-1"], "--time-limit: -1 is out of range"),
    (["--time-limit", "nan"], "--time-limit: nan is out of range"),
    (["--micro-batches", "100000"], "--micro-batches: 100000 is out of range: use an integer in [1, 4,096]"),
    (["--devices", ","], "--devices = ',': must be comma-separated device names"),
    (["--devices", "n0:0,,n0:1"], "--devices = 'n0:0,,n0:1'"),
])
def test_compare_refuses_bad_options_before_work(flags: list[str], expect: str, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import solvers.analysis.compare as compare_mod

    def no_work(*a: Any, **k: Any) -> None:
        raise AssertionError("compare ran")

    monkeypatch.setattr(compare_mod, "compare", no_work)
    one_line_error(capsys, ["compare", str(VGG), "--cluster", str(V100X8), *flags], expect)


@pytest.mark.parametrize("devices", [",", "n0:0,,n0:1", ""])
def test_plan_refuses_an_empty_device_name(devices: str, capsys: pytest.CaptureFixture[str]) -> None:
    one_line_error(capsys, ["plan", str(VGG), "--cluster", str(V100X8), "--devices", devices],
                   f"--devices = {devices!r}: must be comma-separated device names (NODE:INDEX), none empty")


def test_explain_refuses_a_time_limit_that_is_not_positive(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    for value in ("0", "-1", "nan"):
        one_line_error(capsys, ["explain", "plan.json", "--profile", str(VGG), "--cluster", str(V100X8),
                                "--time-limit", value], f"--time-limit: {value} is out of range")


# -- GPU names and option names ----------------------------------------------------------------


def test_a_family_gpu_name_is_refused_with_its_members(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one_line_error(capsys, ["profile", "project", str(VGG), "--gpu-type", "A100", "-o", str(tmp_path / "p.json")],
                   "'A100': ambiguous: it may be A100-SXM4-40GB, A100-SXM4-80GB, A100-PCIe-80GB; name one")
    assert not (tmp_path / "p.json").exists()
    assert main(["profile", "project", str(VGG), "--gpu-type", "A100-SXM4-80GB", "-o", str(tmp_path / "p.json")]) == 0


def test_options_are_never_abbreviated(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from partitioner_cli.main import build_parser

    one_line_error(capsys, ["plan", str(VGG), "--cluster", str(V100X8), "--micro-batch", "4"],
                   "unrecognized arguments: --micro-batch 4")
    one_line_error(capsys, ["import", "sailor-network", str(NETWORK), "--gpu-type", "GH-96", "--node", "2",
                            "--gpus-per-node", "4", "-o", "c.json"], "--nodes")

    def parsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        return [p, *(q for s in subs for child in s.choices.values() for q in parsers(child))]

    every = parsers(build_parser())
    assert len(every) > 15 and all(p.allow_abbrev is False for p in every)
