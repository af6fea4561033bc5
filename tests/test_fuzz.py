"""Mutated input files through the command line: a clean error or a valid result, never a
traceback, never a hang, never NaN or Infinity in an output (bench/fuzz.py runs thousands)."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz import (
    ROLES,
    Base,
    Corpus,
    build_corpus,
    check_outputs_finite,
    check_outputs_valid,
    command_lines,
    mutate,
    output_paths,
    run_in_process,
)

CALL_LIMIT_S = 10.0


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Corpus:
    import runtime.launch as launch

    corpus = build_corpus(tmp_path_factory.mktemp("fuzz-base"))
    real = launch.train_local

    def fake_train_local(plan, config, start_method="spawn", *, run=None):  # type: ignore[no-untyped-def]
        return {"format": "partitioner.train-metrics/1", "world_size": len(plan.devices),
                "measured_iteration_s": 0.01, "loss": [1.0], "step_s": [0.01], "data": "synthetic", "first_step": 0}

    launch.train_local = fake_train_local  # nothing trains: train's validation is what is fuzzed
    yield corpus
    launch.train_local = real


def _source(corpus: Corpus, role: str, pick: int) -> tuple[Base | None, Path, str]:
    if role == "graph":
        return None, corpus.graphs[pick % len(corpus.graphs)], "graph"
    if role in ("sailor", "sailor-run", "network", "intra"):
        return None, {"sailor": corpus.sailor, "sailor-run": corpus.sailor_run, "network": corpus.network,
                      "intra": corpus.intra}[role], "json"
    base = corpus.bases[pick % len(corpus.bases)]
    path = {"profile": base.profile, "cluster": base.cluster, "plan": base.plan}[role]
    return base, path, "yaml" if path.suffix == ".yaml" else "json"


def _check_one(corpus: Corpus, tmp: Path, role: str, pick: int, seed: int) -> None:
    import shutil
    import tempfile

    tmp = Path(tempfile.mkdtemp(dir=tmp))  # hypothesis runs many examples in one tmp_path
    base, src, kind = _source(corpus, role, pick)
    rng = random.Random(seed)
    if role == "sailor":  # one file of the profile folder mutated
        mutated = tmp / "sailor"
        shutil.copytree(src, mutated)
        victim = rng.choice(sorted(mutated.glob("*.json")))
        victim.write_bytes(mutate(victim.read_bytes(), "json", rng))
        inputs = sorted(mutated.glob("*"))
    else:
        mutated = tmp / f"in{'.txt' if kind == 'graph' else src.suffix}"
        mutated.write_bytes(mutate(src.read_bytes(), kind, rng))
        inputs = [mutated]
    out = tmp / "out.json"
    for argv in command_lines(corpus, role, base, mutated, out, pick=pick):
        for p in output_paths(out):
            p.unlink(missing_ok=True)
        shutil.rmtree(out.with_suffix(""), ignore_errors=True)
        before = [p.read_bytes() for p in inputs]
        rc, _, stderr, seconds = run_in_process(argv)
        context = f"{' '.join(argv)} (seed {seed})\nstderr: {stderr[-1500:]}"
        assert rc in (0, 1, 2), context
        assert "Traceback" not in stderr and "internal error" not in stderr, context
        assert seconds < CALL_LIMIT_S, context
        assert [p.read_bytes() for p in inputs] == before, f"an input was changed: {context}"
        if rc == 0:
            assert check_outputs_valid(output_paths(out)) == "", context
        else:  # an error is one line
            assert len(stderr.strip().splitlines()) <= 1 or stderr.lstrip().startswith("usage:"), context


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(role=st.sampled_from(ROLES), pick=st.integers(0, 3), seed=st.integers(0, 2**32 - 1))
def test_mutated_files_end_cleanly(corpus: Corpus, tmp_path: Path, role: str, pick: int, seed: int) -> None:
    logging.disable(logging.WARNING)
    try:
        _check_one(corpus, tmp_path, role, pick, seed)
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.slow
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(role=st.sampled_from(ROLES), pick=st.integers(0, 3), seed=st.integers(0, 2**32 - 1))
def test_mutated_files_end_cleanly_long(corpus: Corpus, tmp_path: Path, role: str, pick: int, seed: int) -> None:
    logging.disable(logging.WARNING)
    try:
        _check_one(corpus, tmp_path, role, pick, seed)
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("kind", ["json", "yaml", "graph"])
def test_mutations_change_the_file(corpus: Corpus, kind: str) -> None:
    """The fuzzer really mutates: most draws give a different file."""
    src = {"json": corpus.bases[0].profile, "yaml": corpus.bases[0].cluster, "graph": corpus.graphs[0]}[kind]
    data = src.read_bytes()
    changed = sum(mutate(data, kind, random.Random(s)) != data for s in range(50))
    assert changed >= 40


def test_a_nan_output_is_detected(tmp_path: Path) -> None:
    p = tmp_path / "o.json"
    p.write_text('{"a": [1, NaN]}')
    assert "NaN" in check_outputs_finite([p])
    p.write_text('{"a": [1, 2.5]}')
    assert check_outputs_finite([p]) == ""


def test_cases_the_issue_lists(tmp_path: Path, corpus: Corpus) -> None:
    """The inputs the hardening issue reported, each refused in one line naming the problem."""
    base = corpus.bases[0]
    prof_text = base.profile.read_text()
    cases = {
        "utf16.json": (prof_text.encode("utf-16"), "UTF-16"),
        "latin1.json": (prof_text.replace('"vgg16"', '"vgg\u00e9"').encode("latin-1"), "not UTF-8"),
        "big.json": (prof_text.replace('"micro_batch_size": 128', '"micro_batch_size": ' + "9" * 400).encode(),
                     "digits"),
        "e308.json": (prof_text.replace('"bwd_s": ', '"bwd_s": 1e308, "x": ', 1).encode(), "must be <= 1e\\+06"),
    }
    for name, (data, message) in cases.items():
        p = tmp_path / name
        p.write_bytes(data)
        rc, _, err, _ = run_in_process(["plan", str(p), "--cluster", str(base.cluster), "-o", str(tmp_path / "o.json")])
        assert rc == 2, err
        assert len(err.strip().splitlines()) == 1
        assert pytest.importorskip("re").search(message, err), err
    bomb = tmp_path / "bomb.yaml"
    from bench.fuzz import _alias_bomb

    bomb.write_bytes(_alias_bomb(9))
    rc, _, err, seconds = run_in_process(["plan", str(base.profile), "--cluster", str(bomb)])
    assert rc == 2 and "aliases" in err and seconds < 5
    gpus = tmp_path / "many.yaml"
    gpus.write_text("inter_node_GBps: 10\nnodes:\n - {name: n0, intra_node_GBps: 16, gpus: {V100-SXM2-16GB: 1000000000}}\n")
    rc, _, err, _ = run_in_process(["plan", str(base.profile), "--cluster", str(gpus)])
    assert rc == 2 and "at most 16,384 GPUs" in err
    link = tmp_path / "link.yaml"
    link.write_text("inter_node_GBps: 10\nnodes:\n - {name: n0, intra_node_GBps: 16, gpus: {V100-SXM2-16GB: 2}}\n"
                    " - {name: n1, intra_node_GBps: 16, gpus: {V100-SXM2-16GB: 2}}\nlinks:\n - {between: [n0, 'n1:0'], GBps: 3}\n")
    rc, _, err, _ = run_in_process(["plan", str(base.profile), "--cluster", str(link)])
    assert rc == 2 and "not a node and a device" in err


def test_train_metrics_with_a_diverged_loss_are_written_as_strict_json(tmp_path: Path, corpus: Corpus,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import runtime.launch as launch

    def diverged(plan, config, start_method="spawn", *, run=None):  # type: ignore[no-untyped-def]
        return {"world_size": len(plan.devices), "measured_iteration_s": 0.01, "loss": [1.0, float("nan")],
                "step_s": [0.01, 0.01], "data": "synthetic", "first_step": 0}

    monkeypatch.setattr(launch, "train_local", diverged)
    base = next(b for b in corpus.bases if b.model)
    out = tmp_path / "m.json"
    rc, stdout, err, _ = run_in_process(["train", str(base.plan), "--profile", str(base.profile), "--cluster",
                                         str(base.cluster), "--model", base.model, "--local", "-o", str(out)])
    assert rc == 0, err
    assert "not finite" in stdout
    assert check_outputs_finite([out]) == ""
    assert json.loads(out.read_text())["loss"] == [1.0, None]


def test_a_plan_at_another_micro_batch_size_is_priced_by_rescaling_with_a_note(tmp_path: Path,
                                                                                 corpus: Corpus) -> None:
    from partitioner.profile import Profile

    base = corpus.bases[0]
    half = tmp_path / "half.json"
    prof = Profile.load(base.profile)
    prof.rescaled(prof.micro_batch_size // 2).save(half)
    same = ["simulate", str(base.plan), "--cluster", str(base.cluster), "--profile"]
    rc0, out0, err0, _ = run_in_process([*same, str(base.profile)])
    rc1, out1, err1, _ = run_in_process([*same, str(half)])
    assert rc0 == rc1 == 0, err0 + err1
    assert "note:" not in out0
    assert "note: the plan's micro-batch size is" in out1
    iteration = [line for line in out0.splitlines() if line.startswith("iteration")]
    assert iteration and iteration == [line for line in out1.splitlines() if line.startswith("iteration")]


def test_outputs_are_checked_with_their_readers(tmp_path: Path) -> None:
    """What the fuzzer counts as silent wrong: a plan its reader refuses, a snippet that does not parse."""
    import json

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"format": "partitioner.plan/1", "model": "m", "micro_batch_size": 1,
                                "micro_batches": 5000, "virtual_workers": [{"stages": [
                                    {"layers": [0, 1], "device": "n0:0"}]}]}))
    assert "reader refuses it" in check_outputs_valid([plan])
    snippet = tmp_path / "s.py"
    snippet.write_text("split_spec={'a': 1}); exec(1); ({'b': 2}\n")
    assert "does not parse" in check_outputs_valid([snippet])
    shell = tmp_path / "s.sh"
    shell.write_text("torchrun x --layout 'E|t\n")
    assert "does not split" in check_outputs_valid([shell])
    snippet.write_text("x = {'a': 1}\n")
    shell.write_text("# comment\ntorchrun x --layout 'E|t'\n")
    assert check_outputs_valid([snippet, shell, tmp_path / "absent.json"]) == ""


def test_every_role_has_command_lines(corpus: Corpus, tmp_path: Path) -> None:
    commands = set()
    for role in ROLES:
        base = None if role in ("graph", "sailor", "sailor-run", "network", "intra") else corpus.bases[0]
        for pick in range(3):
            for argv in command_lines(corpus, role, base, tmp_path / "in.json", tmp_path / "out.json", pick=pick):
                commands.add(" ".join(argv[:2]) if argv[0] in ("import", "profile") else argv[0])
    assert commands >= {"plan", "simulate", "compare", "explain", "export", "import pipedream", "import sailor",
                        "import sailor-run", "import sailor-network", "profile project", "profile merge"}
