"""Outputs never replace inputs, are written atomically as strict JSON, and the command line ends
in one line on a closed pipe; the local runtime's store listens on loopback only."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from partitioner._io import atomic_write_text, check_outputs, load_mapping, write_json
from partitioner.errors import FormatError, PartitionerError
from partitioner.plan import Stage, VirtualWorker

ROOT = Path(__file__).resolve().parents[1]


def test_an_output_may_not_be_an_input_by_name_symlink_or_hard_link(tmp_path: Path) -> None:
    src = tmp_path / "in.json"
    src.write_text("{}")
    (tmp_path / "sym.json").symlink_to(src)
    os.link(src, tmp_path / "hard.json")
    for name in ("in.json", "sym.json", "hard.json"):
        with pytest.raises(PartitionerError, match="is one of the input files"):
            check_outputs({"-o": tmp_path / name}, [src])
    check_outputs({"-o": tmp_path / "new.json"}, [src])  # a new file is fine
    with pytest.raises(PartitionerError, match="also the -o output"):
        check_outputs({"-o": tmp_path / "a.json", "--trace": tmp_path / "a.json"}, [src])


def test_two_outputs_on_one_file_by_name_or_hard_link_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("{}")
    os.link(tmp_path / "a.json", tmp_path / "b.json")
    with pytest.raises(PartitionerError, match=r"--png .*b\.json is also the -o output"):
        check_outputs({"-o": tmp_path / "a.json", "--png": tmp_path / "b.json"}, [])
    with pytest.raises(PartitionerError, match="is also the -o output"):
        check_outputs({"-o": tmp_path / "x", "--snippet": tmp_path / "sub" / ".." / "x"}, [])


def test_an_output_folder_is_checked_with_the_files_it_will_receive(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    src = out / "plan.json"
    src.write_text("{}")
    names = ("plan.json", "profile.json")
    with pytest.raises(PartitionerError, match=r"-o .*out would receive plan.json, which is one of the input files"):
        check_outputs({}, [src], folders={"-o": (out, names)})
    other = tmp_path / "in.json"
    other.write_text("{}")
    os.link(other, out / "profile.json")  # an input under another name inside the folder
    with pytest.raises(PartitionerError, match=r"would receive profile\.json"):
        check_outputs({}, [other], folders={"-o": (out, ("profile.json",))})
    with pytest.raises(PartitionerError, match="is a file; name a folder"):
        check_outputs({}, [], folders={"-o": (other, names)})
    with pytest.raises(PartitionerError, match="is the input folder"):
        check_outputs({}, [], folders={"-o": (tmp_path / "x" / "..", names)}, input_dirs=[tmp_path])
    with pytest.raises(PartitionerError, match="is inside the input folder"):
        check_outputs({"-o": tmp_path / "p.json"}, [], input_dirs=[tmp_path])
    check_outputs({}, [other], folders={"-o": (tmp_path / "new" / "deeper", names)})  # created by the writer
    assert not (tmp_path / "new").exists()
    if Path("/proc/self").exists():
        with pytest.raises(PartitionerError, match="cannot write in /proc"):
            check_outputs({}, [], folders={"-o": ("/proc/partitioner-test", names)})


def test_an_output_path_that_cannot_be_written_is_refused_first(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(PartitionerError, match="is a directory"):
        check_outputs({"-o": tmp_path}, [])
    with pytest.raises(PartitionerError, match="is not a directory"):
        check_outputs({"-o": tmp_path / "file" / "out.json"}, [])
    check_outputs({"-o": tmp_path / "new" / "dir" / "out.json"}, [])  # created by the writer
    assert not (tmp_path / "new").exists()


def test_plan_refuses_to_overwrite_its_profile_before_solving(tmp_path: Path) -> None:
    prof = tmp_path / "p.json"
    prof.write_bytes((ROOT / "examples/profiles/vgg16_v100.json").read_bytes())
    before = prof.read_bytes()
    from partitioner_cli.main import main

    assert main(["plan", str(prof), "--cluster", str(ROOT / "examples/clusters/v100x8.yaml"), "-o", str(prof)]) == 2
    assert prof.read_bytes() == before


def test_write_json_refuses_non_finite_numbers_naming_the_field(tmp_path: Path) -> None:
    out = tmp_path / "o.json"
    with pytest.raises(PartitionerError, match=r"predicted\.iteration_s = inf"):
        write_json(out, {"predicted": {"iteration_s": float("inf")}})
    with pytest.raises(PartitionerError, match=r"a\[1\] = nan"):
        write_json(out, {"a": [1.0, float("nan")]})
    assert not out.exists()
    write_json(out, {"a": [1.0, 2]})
    assert json.loads(out.read_text()) == {"a": [1.0, 2]}


def test_atomic_writes_get_the_umask_mode_and_keep_a_replaced_files_mode(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        atomic_write_text(tmp_path / "new.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o640
    (tmp_path / "kept.txt").write_text("old")
    os.chmod(tmp_path / "kept.txt", 0o604)
    atomic_write_text(tmp_path / "kept.txt", "new")
    assert stat.S_IMODE((tmp_path / "kept.txt").stat().st_mode) == 0o604
    assert (tmp_path / "kept.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt", "new.txt"]  # no temporary left


def test_json_input_with_nan_or_a_huge_integer_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "x.json"
    p.write_text('{"a": NaN}')
    with pytest.raises(FormatError, match="NaN is not a number"):
        load_mapping(p)
    p.write_text('{"a": ' + "9" * 5000 + "}")
    with pytest.raises(FormatError, match="not valid JSON"):
        load_mapping(p)
    p.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FormatError):
        load_mapping(p)


def test_plan_piped_into_head_writes_the_plan_and_prints_no_traceback(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    cmd = (f"{sys.executable} -m partitioner_cli plan examples/profiles/vgg16_v100.json "
           f"--cluster examples/clusters/v100x8.yaml --allow-fewer -o {out} | head -1")
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
    assert proc.stdout.startswith("plan for vgg16")
    assert proc.returncode in (0, 141)
    assert json.loads(out.read_text())["model"] == "vgg16"


def _outward_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent for a UDP connect
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_local_store_listens_on_loopback_only() -> None:
    from runtime.launch import _loopback_store

    store = _loopback_store(10.0)
    try:
        with socket.create_connection(("127.0.0.1", store.port), timeout=5):
            pass
        outward = _outward_address()
        if outward is None:
            pytest.skip("this machine has no address besides loopback")
        with pytest.raises(OSError), socket.create_connection((outward, store.port), timeout=5):
            pass
    finally:
        del store


def test_ranks_exchange_json_not_pickles() -> None:
    import torch
    import torch.distributed as dist

    from runtime.launch import gather_json

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        got = gather_json({"rank": 0, "step_s": [0.5, 0.25], "name": "n0:0 é"}, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert got == [{"rank": 0, "step_s": [0.5, 0.25], "name": "n0:0 é"}]
    source = (ROOT / "runtime/launch.py").read_text()
    assert "_object" not in source.replace("object.__setattr__", "")



def test_integers_too_large_for_a_float_are_refused_in_one_line(tmp_path: Path) -> None:
    from partitioner.plan import Plan

    good = Plan("m", (VirtualWorker((Stage((0, 2), "n0:0"),)),), "1f1b", 1, 2).to_dict()
    good["predicted"] = {"iteration_s": 10**400}
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(good))
    with pytest.raises(FormatError, match=r"predicted\.iteration_s .* must be a finite number"):
        Plan.load(p)
