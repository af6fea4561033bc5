"""The model zoo: every model builds as a chain, with the published parameter counts."""

from __future__ import annotations

import pytest
import torch

from partitioner.errors import PartitionerError
from partitioner.models import MODEL_NAMES, build_model


def _params(m) -> int:
    return sum(p.numel() for _, layer in m.layers for p in layer.parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_is_a_chain_on_meta(name):
    m = build_model(name, 2, device="meta")
    x = m.sample_input("meta")
    assert x.shape[0] == 2
    for _, layer in m.layers:
        x = layer(x)
    assert x.shape[0] == 2
    assert len({n for n, _ in m.layers}) == len(m.layers)


@pytest.mark.parametrize("name, millions", [
    ("vgg19", 143.667240),      # torchvision vgg19
    ("resnet50", 25.557032),    # torchvision resnet50
    ("resnet152", 60.192808),   # torchvision resnet152
])
def test_cnn_parameter_counts_match_published(name, millions):
    assert _params(build_model(name, device="meta")) == round(millions * 1e6)


def test_transformer_shapes():
    for name, blocks, hidden in [("gpt2-small", 12, 768), ("gpt2-medium", 24, 1024), ("gpt2-large", 36, 1280),
                                 ("gpt2-xl", 48, 1600), ("bert-large", 24, 1024)]:
        m = build_model(name, device="meta")
        assert len(m.layers) == blocks + 2 and m.config["hidden"] == hidden
        assert [n for n, _ in m.layers][:2] == ["embed", "block0"] and m.layers[-1][0] == "head"
    # A GPT-2 block has 12 h^2 + 13 h parameters.
    block = build_model("gpt2-xl", device="meta").layers[1][1]
    h = 1600
    assert sum(p.numel() for p in block.parameters()) == 12 * h * h + 13 * h


def test_sizes_are_configurable_and_builds_deterministic():
    a = build_model("gpt2-tiny", 3, seq_len=16, num_blocks=5)
    assert len(a.layers) == 7 and a.sample_input().shape == (3, 16)
    b = build_model("gpt2-tiny", 3, seq_len=16, num_blocks=5)
    for (_, la), (_, lb) in zip(a.layers, b.layers, strict=True):
        for pa, pb in zip(la.parameters(), lb.parameters(), strict=True):
            assert torch.equal(pa, pb)
    assert torch.equal(a.sample_input(), b.sample_input())
    c = build_model("resnet50-tiny", 1, image_size=64)
    y = c.sequential()(c.sample_input())
    assert y.shape == (1, 10)


def test_unknown_name_lists_the_zoo():
    with pytest.raises(PartitionerError) as err:
        build_model("vgg42")
    assert "vgg19" in str(err.value) and "gpt2-xl" in str(err.value)


def test_bad_sequence_length():
    for bad in (0, 2**20 + 1):
        with pytest.raises(PartitionerError, match="seq_len"):
            build_model("gpt2-tiny", seq_len=bad, device="meta")


def test_a_longer_sequence_grows_the_position_table():
    # OPT-350M's shape: gpt2-medium with 2,048 positions and a vocabulary of 50,272
    m = build_model("gpt2-medium", seq_len=2048, vocab=50272, device="meta")
    embed = m.layers[0][1]
    assert embed.pos.num_embeddings == 2048 and embed.tok.num_embeddings == 50272
    assert build_model("gpt2-medium", seq_len=512, device="meta").layers[0][1].pos.num_embeddings == 1024
