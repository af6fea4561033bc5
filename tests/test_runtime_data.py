"""Training data, losses and users' own models (runtime/data.py, runtime/model.py)."""

from __future__ import annotations

import itertools
import json
import textwrap
from pathlib import Path

import pytest
import torch

from partitioner.errors import PartitionerError
from partitioner.plan import Plan, Stage, VirtualWorker
from partitioner.profile import LayerProfile, LayerTime, Profile
from partitioner_cli import main as cli
from runtime.data import MASK_ID, corpus_bytes, make_data
from runtime.launch import TrainConfig, train_local
from runtime.model import ModelSpec, load_model_spec
from runtime.stage import zoo_chain

ROOT = Path(__file__).resolve().parent.parent
CPU_CLUSTER = ROOT / "examples" / "clusters" / "cpu4.yaml"


def worker(cuts: list[int], devices: list[str]) -> VirtualWorker:
    return VirtualWorker(tuple(Stage((a, b), devices[k % len(devices)])
                               for k, (a, b) in enumerate(itertools.pairwise(cuts))))


# -- the data sources ---------------------------------------------------------------------------


def test_text_corpus_is_the_standard_library_and_targets_are_the_next_byte() -> None:
    corpus = corpus_bytes()
    assert corpus.dtype == torch.uint8 and corpus.numel() > 1 << 16
    assert b"def " in bytes(corpus[:200_000].tolist())  # Python source
    chain = zoo_chain("gpt2-tiny")
    data = make_data(chain, "auto", 2, 3, 2, seed=5)
    assert data.kind == "text"
    x, y = data.global_batch(7)
    assert x.shape == (12, chain.config["seq_len"]) and y is not None and y.shape == x.shape
    torch.testing.assert_close(x[:, 1:].long(), y[:, :-1])  # y is x shifted by one byte
    assert int(x.max()) < 256
    # the batch depends on (seed, step) only: another source, built later, gives the same one
    x2, y2 = make_data(chain, "text", 2, 3, 2, seed=5).global_batch(7)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, data.global_batch(8)[0])


def test_bidirectional_text_masks_a_fixed_count_per_sample() -> None:
    chain = zoo_chain("bert-tiny")
    data = make_data(chain, "auto", 2, 2, 1, seed=0)
    x, y = data.global_batch(0)
    assert y is not None
    seq = chain.config["seq_len"]
    k = max(1, seq * 15 // 100)
    masked = x == MASK_ID
    assert masked.sum(dim=1).tolist() == [k] * x.shape[0]
    assert torch.equal(masked, y != -100)  # targets exactly where the input is masked


def test_classes_data_labels_and_images() -> None:
    chain = zoo_chain("vgg19-tiny")
    data = make_data(chain, "auto", 4, 2, 1, seed=0)
    assert data.kind == "classes"
    x, y = data.global_batch(3)
    assert x.shape == (8, 3, 32, 32) and y is not None and y.dtype == torch.long
    assert int(y.min()) >= 0 and int(y.max()) < chain.config["classes"]


@pytest.mark.parametrize("model", ["gpt2-tiny", "bert-tiny", "vgg19-tiny"])
def test_micro_batch_losses_average_to_the_global_loss(model: str) -> None:
    # what the pipeline computes (mean over micro-batches of their losses) is the global loss
    chain = zoo_chain(model)
    b, m = 2, 3
    data = make_data(chain, "auto", b, m, 1, seed=1)
    _, y = data.global_batch(0)
    assert y is not None
    out = torch.randn(*y.shape, 512) if model != "vgg19-tiny" else torch.randn(b * m, 10)
    whole = data.loss(out, y)
    parts = sum(data.loss(out[j * b:(j + 1) * b], y[j * b:(j + 1) * b]) for j in range(m)) / m
    torch.testing.assert_close(whole, parts)


def test_data_that_does_not_fit_the_model_is_refused() -> None:
    with pytest.raises(PartitionerError, match="data = 'text' does not fit model vgg19-tiny: it trains on classes"):
        make_data(zoo_chain("vgg19-tiny"), "text", 2, 1, 1)
    with pytest.raises(PartitionerError, match="data = 'pictures': must be one of auto, text, classes, synthetic"):
        TrainConfig("gpt2-tiny", data="pictures")


def test_training_on_text_lowers_the_loss() -> None:
    plan = Plan("gpt2-tiny", (worker([0, 2, 4], ["n0:0", "n0:1"]),), micro_batch_size=8, micro_batches=2)
    m = train_local(plan, TrainConfig("gpt2-tiny", steps=16, warmup=1, lr=0.5, threads=1, timeout_s=120),
                    start_method="forkserver")
    loss = m["loss"]
    assert m["data"] == "text" and len(loss) == 16
    # a byte-level model starts near ln(512) = 6.2 and learns the bytes' frequencies quickly
    assert loss[0] > 5.5
    assert sum(loss[-4:]) / 4 < loss[0] - 1.5


# -- users' own models --------------------------------------------------------------------------

USER_MODULE = '''
import torch
from torch import nn
from runtime.model import ModelSpec


def make_batch(step, n):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def mlp():
    return ModelSpec([("fc1", nn.Linear(8, 32)), ("act", nn.Tanh()), ("fc2", nn.Linear(32, 2))], make_batch)


def five():
    return ModelSpec([nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)], make_batch)


def bare():
    return nn.Sequential(nn.Linear(8, 2))
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"usermodels_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _user_files(tmp_path: Path, model: str, cuts: list[int], n_layers: int) -> list[str]:
    plan = Plan(model, (worker(cuts, ["n0:0", "n0:1"]),), micro_batch_size=4, micro_batches=2)
    layers = tuple(LayerProfile(f"l{i}", 1.0, 4.0, 4.0, 4.0, {"cpu": LayerTime(1e-3, 2e-3)}) for i in range(n_layers))
    plan.save(tmp_path / "plan.json")
    Profile(model, 4, layers).save(tmp_path / "profile.json")
    return [str(tmp_path / "plan.json"), "--profile", str(tmp_path / "profile.json"), "--cluster", str(CPU_CLUSTER)]


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_user_model_trains_from_the_cli(user_module: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.launch as launch

    real = launch.train_local
    monkeypatch.setattr(launch, "train_local", lambda plan, cfg, **kw: real(plan, cfg, start_method="forkserver", **kw))
    ref = f"{user_module}:mlp"
    out = tmp_path / "m.json"
    rc = cli.main(["train", *_user_files(tmp_path, ref, [0, 2, 3], 3), "--model", ref, "--local", "--steps", "12",
                   "--warmup", "1", "--threads", "1", "--lr", "0.5", "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    m = json.loads(out.read_text())
    assert m["data"] == "model" and len(m["loss"]) == 12
    assert m["loss"][0] > 0.5 and sum(m["loss"][-3:]) / 3 < 0.75 * m["loss"][0]  # the task is learnt


@pytest.mark.parametrize(("which", "expect"), [
    ("nosuchmodule_xyz:mlp", "module 'nosuchmodule_xyz' not found"),
    ("{mod}:missing", "has no function 'missing'"),
    ("{mod}:bare", "bare() returned Sequential; it must return runtime.model.ModelSpec(layers, make_batch, loss)"),
    ("{mod}:five", "model '{mod}:five' has 5 layers but the profile has 3: no stage of the plan holds layers [3, 5)"),
])
def test_user_model_errors_are_one_line(which: str, expect: str, user_module: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    ref = which.format(mod=user_module)
    rc = cli.main(["train", *_user_files(tmp_path, ref, [0, 2, 3], 3), "--model", ref, "--local"])
    assert rc == 2
    assert expect.format(mod=user_module) in _one_line(capsys)


def test_model_spec_validation(user_module: str) -> None:
    with pytest.raises(PartitionerError, match=r"ModelSpec.layers\[1\] = int: must be an nn.Module"):
        ModelSpec([torch.nn.Linear(2, 2), 3], lambda s, n: (torch.zeros(n, 2), torch.zeros(n)))
    spec = load_model_spec(f"{user_module}:mlp")
    assert [name for name, _ in spec.layers] == ["fc1", "act", "fc2"]
    with pytest.raises(PartitionerError, match=r"returned 4 inputs and 4 targets: must return 6"):
        ModelSpec(spec.layers, lambda s, n: (torch.zeros(4, 8), torch.zeros(4))).batch(0, 6)


def test_plan_with_fewer_layers_than_the_model_names_the_stage(user_module: str) -> None:
    from runtime.layout import plan_layout

    plan = Plan("x", (worker([0, 2, 4], ["n0:0", "n0:1"]),), micro_batch_size=4, micro_batches=2)
    with pytest.raises(PartitionerError, match=r"virtual_workers\[0\].stages\[1\].layers = \[2, 4\]: the last stage "
                                               r"ends before layer 4, but model m has 5 layers: layers \[4, 5\) are in no stage"):
        plan_layout(plan, 5, model="m")
    with pytest.raises(PartitionerError, match=r"stages\[1\].layers = \[2, 4\]: layer 3 does not exist: model m has "
                                               r"3 layers \[0, 3\)"):
        plan_layout(plan, 3, model="m")


BROKEN_MODULE = '''
import torch
from torch import nn
from runtime.model import ModelSpec


def broken():
    raise ValueError("weights file\\nnot found")


def bad_batch():
    return ModelSpec([nn.Linear(8, 2)], lambda step, n: 1 / 0)
'''


@pytest.mark.parametrize(("module", "function", "expect"), [
    (BROKEN_MODULE, "broken", "model '{ref}': broken() raised ValueError: weights file not found"),
    ("raise RuntimeError('no GPU here')\n", "mlp", "model '{ref}': importing module '{mod}' raised RuntimeError: no GPU here"),
    ("import nosuchdependency_xyz\n", "mlp", "model '{ref}': importing module '{mod}' raised ModuleNotFoundError: "
                                           "No module named 'nosuchdependency_xyz'"),
], ids=["function", "module", "dependency"])
def test_user_model_code_that_raises_is_the_users_error(module: str, function: str, expect: str, user_module: str,
                                                        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mod = f"{user_module}_broken"
    (tmp_path / f"{mod}.py").write_text(module)
    ref = f"{mod}:{function}"
    rc = cli.main(["train", *_user_files(tmp_path, ref, [0, 1, 2], 2), "--model", ref, "--local"])
    assert rc == 2  # the user's error (2), not an internal one (3)
    line = _one_line(capsys)
    assert expect.format(ref=ref, mod=mod) in line, line
    assert "internal error" not in line


def test_user_batches_that_raise_are_the_users_error(user_module: str, tmp_path: Path) -> None:
    (tmp_path / f"{user_module}_broken.py").write_text(BROKEN_MODULE)
    spec = load_model_spec(f"{user_module}_broken:bad_batch")
    with pytest.raises(PartitionerError, match=r"^ModelSpec.make_batch\(0, 4\) raised ZeroDivisionError: division by zero$"):
        spec.batch(0, 4)
