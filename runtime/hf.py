"""A Hugging Face ``transformers`` language model as a chain of layers, built from its config.

``hf:TYPE?key=value&key=value`` names a model type of ``transformers`` (``gpt2``, ``llama``,
``mistral``, ``qwen2``, ...: the keys of its ``CONFIG_MAPPING``), built from that config class's
defaults with the given fields overridden, e.g. ``hf:gpt2?n_layer=2&n_embd=64&n_head=2``. Names
resolve offline: nothing is read from the Hub (no checkpoint name such as ``openai-community/gpt2``,
no weights; the weights are random, which is all per-layer timing needs). The layers are the
model's own modules, cut at its blocks: the embeddings (tokens, plus learned positions where the
model has them), each decoder block, and the final norm with the LM head.

The package is imported here only, and only when such a model is asked for: the project does not
depend on it.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any
from urllib.parse import parse_qsl

import torch
from torch import nn

from partitioner.errors import PartitionerError

from .model import ModelSpec

__all__ = ["HF_PREFIX", "hf_layers", "hf_spec", "is_hf_ref", "parse_hf_ref"]

HF_PREFIX = "hf:"
_BLOCKS = ("h", "layers", "blocks", "layer")  # where a base model keeps its decoder blocks
_NORMS = ("ln_f", "norm", "final_layer_norm", "final_layernorm")


def is_hf_ref(name: str) -> bool:
    """Whether ``name`` names a ``transformers`` model by config (``hf:TYPE?...``)."""
    return name.startswith(HF_PREFIX)


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_hf_ref(ref: str) -> tuple[str, dict[str, Any]]:
    """``hf:TYPE?k=v&k=v`` -> (TYPE, {k: v}) with numbers and booleans read as such."""
    body = ref[len(HF_PREFIX):]
    name, _, query = body.partition("?")
    if not name:
        raise PartitionerError(f"model {ref!r}: give hf:TYPE, a transformers model type such as hf:gpt2, "
                               f"optionally with config fields: hf:gpt2?n_layer=2&n_embd=64")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise PartitionerError(f"model {ref!r}: config fields are key=value pairs joined by '&' "
                               f"(hf:gpt2?n_layer=2&n_embd=64)") from None
    fields: dict[str, Any] = {}
    for key, text in pairs:
        if key in fields:
            raise PartitionerError(f"model {ref!r}: config field {key!r} given twice")
        fields[key] = _value(text)
    return name, fields


def _transformers(ref: str) -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise PartitionerError(f"model {ref!r}: the transformers package is not installed (pip install "
                               f"transformers); the zoo's gpt2-* and bert-* models need no package") from None


def _config(ref: str) -> Any:
    """The config of ``ref``: its type's config class, defaults overridden by the given fields."""
    name, fields = parse_hf_ref(ref)
    tf = _transformers(ref)
    mapping = tf.CONFIG_MAPPING
    known = sorted(mapping.keys())
    if name not in known:
        near = difflib.get_close_matches(name, known, n=3)
        hint = f"did you mean {', '.join(near)}? " if near else ""
        raise PartitionerError(f"model {ref!r}: {name!r} is not a transformers model type; {hint}names resolve "
                               f"offline to transformers' model types (gpt2, llama, mistral, ...), not Hub names")
    cls = mapping[name]
    defaults = cls()
    for key in fields:
        if not hasattr(defaults, key):
            raise PartitionerError(f"model {ref!r}: {cls.__name__} has no field {key!r}")
    try:
        return cls(**fields)
    except Exception as err:  # the config class refused a value: the user's input
        raise PartitionerError(f"model {ref!r}: {cls.__name__} refused the fields: {' '.join(str(err).split())[:200]}"
                               ) from None


class _Embed(nn.Module):
    """Token embeddings, plus learned position embeddings where the model has them."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None, drop: nn.Module | None):
        super().__init__()
        self.tokens, self.positions, self.drop = tokens, positions, drop

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids)
        if self.positions is not None:
            h = h + self.positions(torch.arange(ids.shape[1], device=ids.device))[None]
        return self.drop(h) if self.drop is not None else h


class _Block(nn.Module):
    """One decoder block; where the model computes rotary position embeddings once for all its
    blocks, this block computes them for itself."""

    def __init__(self, block: nn.Module, rotary: nn.Module | None):
        super().__init__()
        self.block, self.rotary = block, rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {}
        if self.rotary is not None:
            positions = torch.arange(h.shape[1], device=h.device)[None]
            kwargs = {"position_embeddings": self.rotary(h, positions), "position_ids": positions}
        out = self.block(h, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class _Head(nn.Module):
    """The final norm and the LM head."""

    def __init__(self, norm: nn.Module | None, head: nn.Module):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h) if self.norm is not None else h)


def _first(module: nn.Module, names: tuple[str, ...], kind: type) -> Any:
    for name in names:
        found = getattr(module, name, None)
        if isinstance(found, kind):
            return found
    return None


def hf_layers(ref: str) -> tuple[list[tuple[str, nn.Module]], Any]:
    """The model of ``ref`` as ``(name, module)`` layers (embed, block0.., head) and its config."""
    config = _config(ref)
    tf = _transformers(ref)
    try:
        model = tf.AutoModelForCausalLM.from_config(config)
    except Exception as err:  # not a causal LM, or the config's sizes contradict each other
        raise PartitionerError(f"model {ref!r}: transformers could not build a causal language model from "
                               f"{type(config).__name__}: {' '.join(str(err).split())[:200]}") from None
    base = model.base_model
    blocks = _first(base, _BLOCKS, nn.ModuleList)
    head = model.get_output_embeddings()
    if blocks is None or head is None or not len(blocks):
        raise PartitionerError(f"model {ref!r}: {type(model).__name__} has no list of decoder blocks and LM head "
                               f"this chain knows how to cut (a decoder-only model such as gpt2 or llama)")
    positions = _first(base, ("wpe", "embed_positions"), nn.Embedding)
    drop = _first(base, ("drop", "dropout"), nn.Dropout)
    rotary = getattr(base, "rotary_emb", None)
    layers: list[tuple[str, nn.Module]] = [("embed", _Embed(base.get_input_embeddings(), positions, drop))]
    layers += [(f"block{i}", _Block(b, rotary)) for i, b in enumerate(blocks)]
    layers.append(("head", _Head(_first(base, _NORMS, nn.Module), head)))
    return layers, config


def hf_spec(ref: str, seq_len: int | None = None) -> ModelSpec:
    """``ref`` as a :class:`~runtime.model.ModelSpec`: its layers and batches of random token ids
    (``seq_len`` tokens, default 128 or the model's largest context if smaller) whose targets
    are the next tokens."""
    layers, config = hf_layers(ref)
    most = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    n = seq_len or (min(128, most) if most else 128)
    if most and n > most:
        raise PartitionerError(f"seq_len = {n}: {type(config).__name__} takes at most {most} positions")
    vocab = int(config.vocab_size)

    def make_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (batch_size, n + 1), generator=g)
        return ids[:, :-1], ids[:, 1:]

    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.float().reshape(-1, output.shape[-1]), targets.reshape(-1))

    return ModelSpec(layers, make_batch, loss)
