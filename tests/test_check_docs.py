"""tools/check_docs.py: the README's quoted commands against what they print."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("check_docs", ROOT / "tools" / "check_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_docs"] = module
    spec.loader.exec_module(module)
    return module


def test_commands_and_their_lines_are_read_from_console_blocks_only():
    cd = _tool()
    text = ("intro\n```bash\n$ partitioner not-this\n```\n```console\n$ partitioner plan a\nline 1\n\nline 2\n"
            "$ partitioner simulate b | tail -1\nlast\n$ ls\nnot compared\n```\n$ partitioner outside\n")
    steps = cd.parse_steps(text)
    assert [(s.command, s.expected, s.line_no) for s in steps] == [
        ("partitioner plan a", ["line 1", "", "line 2"], 6), ("partitioner simulate b | tail -1", ["last"], 10)]


def test_lines_compare_words_and_figures_with_timings_and_measurements_free():
    cd = _tool()
    same = "solver dp: optimal, objective 260.88 ms, gap 0.00%, solved in 0.017 s"
    assert cd.compare_lines("partitioner plan x", same, same.replace("0.017", "1.250")) is None
    assert cd.compare_lines("partitioner plan x", same, same.replace("260.88", "260.89")) == \
        "the figure 260.88 is 260.89 here"
    assert cd.compare_lines("partitioner plan x", same, same.replace("optimal", "feasible")) == "the words differ"
    assert cd.compare_lines("partitioner plan x", "a  b   1.0", "a b 1.0") is None  # re-padded columns
    # every figure of a command that measures on this machine is a measurement
    assert cd.compare_lines("partitioner train p.json --local", "measured iteration 76.69 ms",
                            "measured iteration 82.25 ms") is None
    assert cd.compare_lines("partitioner plan out/vgg19_tiny32.json", "objective 13.49 ms", "objective 8.05 ms") is None
    assert cd.compare_lines("partitioner train p.json", "loss 2.2 -> 0.8", "loss 2.2 -> 0.8 -> 0.7") == "the words differ"
    # a shortened line: its start must match
    assert cd.compare_lines("partitioner plan x", "known types: A10, A100, ...", "known types: A10, A100, B, C") is None
    assert cd.compare_lines("partitioner plan x", "known types: A10, A100, ...", "known types: A10, T4, B") is not None


@pytest.mark.slow
def test_the_readme_tour_prints_what_the_readme_shows():
    """Every `$ partitioner ...` of README.md's tour, run in a fresh copy of the tree, prints the
    lines the README shows under it (timings and this machine's measurements aside)."""
    cd = _tool()
    if not (cd.SHARED_DATA / "sailor_validation").is_dir():
        pytest.skip(f"the shared data folder ({cd.SHARED_DATA}) is not here; set SHARED_DATA")
    problems = cd.check(ROOT / "README.md")
    assert not problems, "\n".join(map(str, problems))
