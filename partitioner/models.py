"""The built-in model zoo: models as ordered lists of ``(name, nn.Module)`` layers.

Every model is built in code from ``torch.nn`` (no downloads): VGG-19, ResNet-50 and
ResNet-152 (stem, one layer per bottleneck block, head), the GPT-2 family (embedding,
N transformer blocks, head) and BERT-large, plus ``-tiny`` variants for tests. A layer's
output is the next layer's input, so the list is a chain a pipeline can cut anywhere.

Build with ``device="meta"`` when only shapes, parameter counts or FLOPs are needed:
no memory is allocated, so even GPT-2 xl is cheap to construct.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .errors import PartitionerError
from .zoo import BERT, CNN_DEFAULTS, GPT2, MODEL_NAMES

__all__ = ["MODEL_NAMES", "ZooModel", "build_model", "model_names"]


@dataclass
class ZooModel:
    """A model of the zoo: its layers in execution order and a sample-input maker."""

    name: str
    layers: list[tuple[str, nn.Module]]
    make_input: Callable[[int, torch.device | str], torch.Tensor]
    batch_size: int
    config: dict[str, Any] = field(default_factory=dict)

    def sample_input(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """A deterministic input batch of ``batch_size`` samples on ``device``."""
        return self.make_input(self.batch_size, device)

    def sequential(self) -> nn.Sequential:
        """The layers as one ``nn.Sequential`` (sharing the same modules)."""
        return nn.Sequential(OrderedDict((name.replace(".", "_"), m) for name, m in self.layers))


# -- CNNs ------------------------------------------------------------------------------


class _HeConv2d(nn.Conv2d):
    """A convolution initialised for a ReLU after it (He, fan-out; zero bias), as VGG is
    usually initialised: with PyTorch's default the 16 convolutions of VGG-19, which has no
    normalisation, pass almost no signal and SGD does not start learning."""

    def reset_parameters(self) -> None:
        nn.init.kaiming_normal_(self.weight, mode="fan_out", nonlinearity="relu")
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class _HeLinear(nn.Linear):
    """A linear layer initialised for a ReLU after it (He, fan-in; zero bias)."""

    def reset_parameters(self) -> None:
        nn.init.kaiming_normal_(self.weight, nonlinearity="relu")
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class _ConvReLU(nn.Sequential):
    def __init__(self, cin: int, cout: int):
        super().__init__(_HeConv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=False))


class _Classifier(nn.Module):
    def __init__(self, fin: int, hidden: int, classes: int, pool: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(pool)
        self.fc1 = _HeLinear(fin, hidden)
        self.fc2 = _HeLinear(hidden, hidden)
        self.fc3 = _HeLinear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.pool(x), 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


_VGG19: tuple[int | str, ...] = (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
          512, 512, 512, 512, "M")


def _vgg19(width: float, image: int, classes: int, hidden: int) -> list[tuple[str, nn.Module]]:
    layers: list[tuple[str, nn.Module]] = []
    cin = 3
    for i, v in enumerate(_VGG19):
        if isinstance(v, str):  # "M": max-pool
            layers.append((f"pool{i}", nn.MaxPool2d(2)))
        else:
            cout = max(1, int(v * width))
            layers.append((f"conv{i}", _ConvReLU(cin, cout)))
            cin = cout
    pool = min(7, max(1, image // 32))
    layers.append(("classifier", _Classifier(cin * pool * pool, hidden, classes, pool)))
    return layers


class _Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        idt = x if self.down is None else self.down(x)
        return F.relu(out + idt)


class _Stem(nn.Sequential):
    def __init__(self, cout: int):
        super().__init__(nn.Conv2d(3, cout, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))


class _PoolFC(nn.Module):
    def __init__(self, fin: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(fin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _resnet(blocks: tuple[int, ...], width: float, classes: int) -> list[tuple[str, nn.Module]]:
    base = max(1, int(64 * width))
    layers: list[tuple[str, nn.Module]] = [("stem", _Stem(base))]
    cin = base
    for stage, n in enumerate(blocks):
        planes = base * 2**stage
        for b in range(n):
            stride = 2 if (b == 0 and stage > 0) else 1
            layers.append((f"layer{stage + 1}.{b}", _Bottleneck(cin, planes, stride)))
            cin = planes * _Bottleneck.expansion
    layers.append(("head", _PoolFC(cin, classes)))
    return layers


def _image_input(channels: int, image: int) -> Callable[[int, torch.device | str], torch.Tensor]:
    def make(batch: int, device: torch.device | str) -> torch.Tensor:
        if torch.device(device).type == "meta":
            return torch.empty(batch, channels, image, image, device="meta")
        g = torch.Generator().manual_seed(0)
        return torch.randn(batch, channels, image, image, generator=g).to(device)
    return make


# -- transformers ----------------------------------------------------------------------


class _Attention(nn.Module):
    """Multi-head self-attention written with explicit matmuls (so FLOP counters see it).

    The fused ``qkv`` projection's outputs are laid out head after head (``[q_0 k_0 v_0 q_1 k_1
    v_1 ...]``, each ``head_dim`` wide), as Megatron-LM fuses them: a tensor-parallel shard of
    ``qkv`` (rows ``[i * 3h / t, (i + 1) * 3h / t)``, ``ColwiseParallel``) is then exactly the
    ``q``, ``k`` and ``v`` of heads ``[i * heads / t, (i + 1) * heads / t)``, and ``forward`` runs
    whatever heads its ``qkv`` gives it (``runtime/tensor_parallel.py``). Built with
    ``tensor_parallel`` t, it is one GPU's shard from the start (``heads / t`` heads, the output
    projection's rows of those heads; its output that GPU's partial sum), what the profiler times
    (``partitioner/shard_profiler.py``).

    ``recompute_core`` (set by the runtime for a stage planned with selective recomputation):
    the attention core (scores, mask, soft-max, weighted sum) keeps nothing for backward and is
    run again there (``torch.utils.checkpoint``, or ``core_checkpoint`` when the runtime sets one:
    :mod:`runtime.recompute`); the numbers are the same."""

    recompute_core = False
    core_checkpoint: Any = None  # a callable (core, q, k, v) -> output run instead of torch.utils.checkpoint

    def __init__(self, hidden: int, heads: int, causal: bool, tensor_parallel: int = 1):
        super().__init__()
        self.heads, self.causal = heads // tensor_parallel, causal
        self.head_dim = hidden // heads
        local = self.heads * self.head_dim
        self.qkv = nn.Linear(hidden, 3 * local)
        self.proj = nn.Linear(local, hidden)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = q.shape[-2]
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if self.causal:
            mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
            att = att.masked_fill(mask, float("-inf"))
        att = torch.softmax(att, dim=-1)
        return torch.matmul(att, v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.qkv(x)
        b, s, width = fused.shape
        d = self.head_dim
        n = width // (3 * d)  # the heads here: all of them, or a tensor-parallel shard's
        q, k, v = fused.reshape(b, s, n, 3, d).permute(3, 0, 2, 1, 4).unbind(0)  # (b, n, s, d) each
        if self.recompute_core and torch.is_grad_enabled():
            if self.core_checkpoint is not None:  # the runtime's (runtime.recompute: once per micro-batch)
                y = self.core_checkpoint(self._core, q, k, v)
            else:
                from torch.utils.checkpoint import checkpoint

                y = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            y = self._core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, n * d))


class _Block(nn.Module):
    """A transformer block: pre-LN (GPT-2) or post-LN (BERT); with ``tensor_parallel`` t, one GPU's
    shard of it (the attention's heads and the MLP's hidden units split t ways, layer norms whole)."""

    def __init__(self, hidden: int, heads: int, causal: bool, pre_ln: bool, tensor_parallel: int = 1):
        super().__init__()
        self.pre_ln = pre_ln
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = _Attention(hidden, heads, causal, tensor_parallel)
        ffn = 4 * hidden // tensor_parallel
        self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_ln:
            x = x + self.attn(self.ln1(x))
            return x + self._mlp(self.ln2(x))
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self._mlp(x))


class _Embedding(nn.Module):
    """Token + position embeddings (and a LayerNorm for BERT). The input is token ids
    carried as floats so that the chain's input can require a gradient; they are rounded."""

    def __init__(self, vocab: int, hidden: int, positions: int, norm: bool):
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(positions, hidden)
        self.norm = nn.LayerNorm(hidden) if norm else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        idx = ids.detach().round().long()
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        return self.norm(x) if self.norm is not None else x


class _LMHead(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.ln = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def _transformer(blocks: int, hidden: int, heads: int, vocab: int, positions: int,
                 bert: bool, tensor_parallel: int = 1) -> list[tuple[str, nn.Module]]:
    layers: list[tuple[str, nn.Module]] = [("embed", _Embedding(vocab, hidden, positions, norm=bert))]
    for i in range(blocks):
        layers.append((f"block{i}", _Block(hidden, heads, causal=not bert, pre_ln=not bert,
                                          tensor_parallel=tensor_parallel)))
    layers.append(("head", _LMHead(hidden, vocab)))
    return layers


def _token_input(vocab: int, seq: int) -> Callable[[int, torch.device | str], torch.Tensor]:
    def make(batch: int, device: torch.device | str) -> torch.Tensor:
        if torch.device(device).type == "meta":
            return torch.empty(batch, seq, device="meta")
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab, (batch, seq), generator=g).float().to(device)
    return make


# -- the zoo ---------------------------------------------------------------------------

def model_names() -> tuple[str, ...]:
    """Every zoo name, in the order ``--help`` lists them."""
    return MODEL_NAMES


def build_model(name: str, batch_size: int = 1, *, seq_len: int | None = None, image_size: int | None = None,
                width: float | None = None, num_blocks: int | None = None, vocab: int | None = None,
                device: torch.device | str = "cpu", seed: int = 0, tensor_parallel: int = 1) -> ZooModel:
    """Build zoo model ``name`` (see :data:`MODEL_NAMES`) as a layer chain.

    ``seq_len`` (transformers), ``image_size`` and ``width`` (CNNs, channel multiplier),
    ``num_blocks`` (transformers) and ``vocab`` override the defaults. ``device="meta"``
    builds without allocating memory. Parameters are seeded, so two builds are identical.
    ``tensor_parallel`` t (transformers): every block is one GPU's shard of it (``heads / t`` heads,
    ``4 h / t`` MLP units; embedding and head whole), what one GPU of a group of t computes; a head
    count t does not divide is refused naming the model and the degree.
    """
    if name not in MODEL_NAMES:
        raise PartitionerError(f"unknown model '{name}'; the zoo has: {', '.join(MODEL_NAMES)}")
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise PartitionerError(f"batch size must be an integer >= 1, got {batch_size!r}")
    torch.manual_seed(seed)
    cfg: dict[str, Any] = {}
    with torch.device(device):
        if name in CNN_DEFAULTS:
            if tensor_parallel != 1:
                raise PartitionerError(f"tensor-parallel degree {tensor_parallel} for {name}: the zoo shards "
                                       "transformers only")
            kind, blocks, w0, image, classes, hidden = CNN_DEFAULTS[name]
            w = width if width is not None else w0
            image = image_size if image_size is not None else image
            cfg = {"width": w, "image_size": image, "classes": classes}
            if kind == "vgg":
                # the default width keeps the model's own hidden size, whether or not it was named
                # (train passes the profile's width back: it must build the model that was profiled)
                layers = _vgg19(w, image, classes, hidden if w == w0 else max(16, int(4096 * w)))
            else:
                layers = _resnet(blocks, w, classes)
            make = _image_input(3, image)
        else:
            n, hidden, heads = GPT2[name] if name in GPT2 else BERT[name]
            bert = name in BERT
            tiny = name.endswith("-tiny")
            n = num_blocks if num_blocks is not None else n
            v = vocab if vocab is not None else (512 if tiny else (30522 if bert else 50257))
            seq = seq_len if seq_len is not None else (32 if tiny else (512 if bert else 1024))
            if not 1 <= seq <= 2**20:
                raise PartitionerError(f"seq_len {seq} out of range for {name}: must be in [1, {2**20}]")
            # the published position tables (BERT 512, GPT-2 1,024), grown for longer sequences
            # (OPT-350M's shape is gpt2-medium with 2,048 positions and a vocabulary of 50,272)
            positions = max(seq, 512 if bert else 1024)
            cfg = {"blocks": n, "hidden": hidden, "heads": heads, "vocab": v, "seq_len": seq, "positions": positions}
            if not (isinstance(tensor_parallel, int) and tensor_parallel >= 1 and heads % tensor_parallel == 0):
                raise PartitionerError(f"tensor-parallel degree {tensor_parallel} for {name}: its blocks have {heads} "
                                       f"attention heads, which the degree must divide (the heads are split among "
                                       f"the GPUs of a group)")
            layers = _transformer(n, hidden, heads, v, positions, bert, tensor_parallel)
            make = _token_input(v, seq)
    for _, m in layers:
        m.train()
    return ZooModel(name, layers, make, batch_size, cfg)
