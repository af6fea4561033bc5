"""``partitioner bench``: the list, an unknown name, a benchmark run end to end on a tiny
setting, its results JSON and its section of docs/results.md."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from partitioner_cli import bench as bench_cmd
from partitioner_cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def test_list_names_every_benchmark_without_importing_torch():
    code = ("import sys\nfrom partitioner_cli.main import main\nrc = main(['bench', '--list'])\n"
            "print('HEAVY', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'matplotlib'}))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[-1] == "HEAVY []"
    listed = [line.split()[0] for line in lines[:-1]]
    assert listed == [b.name for b in bench_cmd.BENCHMARKS]
    # every benchmark's script exists, and every script of bench/ is listed (the helpers start with _)
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py") if not p.name.startswith("_")}
    named = {b.quick[0].removeprefix("bench/").removesuffix(".py") for b in bench_cmd.BENCHMARKS
             if b.quick[0].startswith("bench/")}
    assert named == scripts


def test_unknown_name_lists_the_valid_names_in_one_line(capsys):
    assert main(["bench", "dp_scaling", "no_such_bench"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("partitioner bench: error: unknown benchmark 'no_such_bench'; valid names: ")
    assert all(b.name in err[0] for b in bench_cmd.BENCHMARKS)


def test_a_benchmark_needing_a_gpu_is_skipped_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setattr(bench_cmd, "_has_gpu", lambda: (False, "no CUDA GPU on this machine"))
    gpu = replace(bench_cmd._by_name()["dp_optimality"], needs=("gpu",))
    rec = bench_cmd.run_benchmark(gpu, write=True, out_root=tmp_path)
    assert rec["status"] == "skipped" and rec["reason"] == "needs a GPU: no CUDA GPU on this machine"
    assert not (tmp_path / "bench").exists() and not (tmp_path / "docs").exists()


def test_tiny_dp_scaling_end_to_end(tmp_path):
    tiny = replace(bench_cmd._by_name()["dp_scaling"], quick=("bench/dp_scaling.py", "--repeats", "1",
                                                             "--sizes", "12x2,24x2,24x4"))
    dry = bench_cmd.run_benchmark(tiny, out_root=tmp_path)  # without --write: nothing is written
    assert dry["status"] == "ok" and not any(tmp_path.iterdir())
    assert [(r["layers"], r["devices"]) for r in dry["rows"]] == [(12, 2), (24, 2), (24, 4)]

    rec = bench_cmd.run_benchmark(tiny, write=True, out_root=tmp_path)
    assert rec["status"] == "ok", rec.get("reason")
    saved = json.loads((tmp_path / "bench" / "results" / "runs" / "dp_scaling.json").read_text())
    assert saved["machine"] and saved["versions"]["python"] and saved["seeds"] == {"instance": 0}
    assert saved["setting"] == "quick" and saved["command"].startswith("python bench/dp_scaling.py")
    # the rows are the printed table's
    for row in saved["rows"]:
        assert row["status"] == "optimal" and row["fewer_bottleneck_s"] <= row["bottleneck_s"]
        assert any(line.split()[:2] == [str(row["layers"]), str(row["devices"])] for line in saved["output"])
    page = (tmp_path / "docs" / "results.md").read_text()
    assert page.count("<!-- bench:dp_scaling -->") == 1 and "![dp_scaling](img/dp_scaling.png)" in page
    png = (tmp_path / "docs" / "img" / "dp_scaling.png").read_bytes()
    assert png.startswith(b"\x89PNG")

    # a second run rewrites its own section and leaves another one alone
    (tmp_path / "docs" / "results.md").write_text(page + "\n<!-- bench:other -->\nkept\n<!-- /bench:other -->\n")
    bench_cmd.run_benchmark(tiny, write=True, out_root=tmp_path)
    page2 = (tmp_path / "docs" / "results.md").read_text()
    assert page2.count("<!-- bench:dp_scaling -->") == 1 and "kept" in page2
