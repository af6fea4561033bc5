"""A transformers model by config (``partitioner profile model hf:TYPE?...``): its layers are the
model's own modules cut at its blocks, and chained they compute what the model computes."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

torch = pytest.importorskip("torch")

from partitioner.errors import PartitionerError  # noqa: E402
from runtime.hf import hf_layers, hf_spec, parse_hf_ref  # noqa: E402

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
needs_transformers = pytest.mark.skipif(not HAS_TRANSFORMERS, reason="the transformers package is not installed "
                                        "(optional: pip install transformers)")

GPT2 = "hf:gpt2?n_layer=2&n_embd=64&n_head=2&vocab_size=500&n_positions=64"
LLAMA = ("hf:llama?hidden_size=64&intermediate_size=128&num_hidden_layers=3&num_attention_heads=4"
         "&num_key_value_heads=2&vocab_size=500&max_position_embeddings=64")


def test_refs_parse_numbers_booleans_and_text():
    assert parse_hf_ref("hf:gpt2?n_layer=2&scale_attn_weights=false&activation_function=relu&x=0.5") == (
        "gpt2", {"n_layer": 2, "scale_attn_weights": False, "activation_function": "relu", "x": 0.5})
    assert parse_hf_ref("hf:llama") == ("llama", {})
    with pytest.raises(PartitionerError, match="give hf:TYPE"):
        parse_hf_ref("hf:")
    with pytest.raises(PartitionerError, match="given twice"):
        parse_hf_ref("hf:gpt2?n_layer=1&n_layer=2")


def test_without_transformers_the_refusal_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    with pytest.raises(PartitionerError, match=r"the transformers package is not installed \(pip install") as err:
        hf_layers(GPT2)
    assert "\n" not in str(err.value)


@needs_transformers
@pytest.mark.parametrize("ref, blocks", [(GPT2, 2), (LLAMA, 3)])
def test_layers_are_the_model_cut_at_its_blocks_and_compute_its_logits(ref, blocks):
    import transformers

    layers, config = hf_layers(ref)
    assert [n for n, _ in layers] == ["embed", *(f"block{i}" for i in range(blocks)), "head"]
    # the same modules as the model: rebuilt from the config with the same seed, the same logits
    torch.manual_seed(0)
    layers, config = hf_layers(ref)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(3))
    x = ids
    with torch.no_grad():
        for _, layer in layers:
            x = layer.eval()(x)
        want = model(ids).logits
    assert x.shape == (2, 12, 500)
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)


@needs_transformers
def test_batches_are_next_token_targets_within_the_vocabulary():
    spec = hf_spec(GPT2, seq_len=10)
    ids, targets = spec.batch(0, 3)
    assert ids.shape == targets.shape == (3, 10)
    assert torch.equal(ids[:, 1:], targets[:, :-1]) and int(ids.max()) < 500
    with pytest.raises(PartitionerError, match="seq_len = 65: GPT2Config takes at most 64 positions"):
        hf_spec(GPT2, seq_len=65)


@needs_transformers
@pytest.mark.parametrize("ref, match", [
    ("hf:gtp2", "'gtp2' is not a transformers model type; did you mean gpt2"),
    ("hf:openai-community/gpt2", "not Hub names"),
    ("hf:gpt2?n_layerz=2", "GPT2Config has no field 'n_layerz'"),
])
def test_unknown_names_and_fields_are_refused_in_one_line(ref, match):
    with pytest.raises(PartitionerError, match=match) as err:
        hf_layers(ref)
    assert "\n" not in str(err.value)


@needs_transformers
def test_cli_profiles_a_transformers_model_per_block(tmp_path, capsys):
    from partitioner_cli.main import main

    out = tmp_path / "p.json"
    assert main(["profile", "model", GPT2, "--micro-batch-size", "2", "--seq-len", "8", "--repeats", "1",
                 "--warmup", "0", "-o", str(out)]) == 0
    prof = json.loads(out.read_text())
    names = [layer["name"] for layer in prof["layers"]]
    assert names == ["embed", "block0", "block1", "head"]
    layers, _ = hf_layers(GPT2)
    block_params = sum(p.numel() for p in layers[1][1].parameters())
    assert prof["layers"][1]["param_bytes"] == 4 * block_params
    assert prof["layers"][0]["output_bytes"] == 2 * 8 * 64 * 4  # the hidden state, fp32
    assert "profiled hf:gpt2" in capsys.readouterr().out
    assert main(["profile", "model", "hf:gpt2?n_layerz=2", "--micro-batch-size", "2", "-o",
                 str(tmp_path / "q.json")]) == 2
    assert "GPT2Config has no field 'n_layerz'" in capsys.readouterr().err


def test_train_refuses_a_transformers_model_by_config_in_one_line():
    from runtime.model import load_model_spec

    with pytest.raises(PartitionerError, match=r"is profiled .*not trained by this runtime") as err:
        load_model_spec(GPT2)
    assert "\n" not in str(err.value)
