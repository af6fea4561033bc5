"""Training data and losses: a real task per model, or synthetic batches for throughput.

Every source makes step ``t``'s *global batch* ``(inputs, targets)`` from ``(seed, t)`` alone,
so every process computes the same batches, a resumed run sees the batches it would have
seen, and one process can train on the whole global batch for comparison. Virtual worker
``w`` trains on rows ``[(w * m + j) * b, (w * m + j + 1) * b)`` of the global batch as its
micro-batch ``j`` (``m`` micro-batches of ``b`` samples). The loss of a global batch equals the
mean over its micro-batches of their losses (every micro-batch has as many loss terms), which
is what the pipeline computes.

``text``
    Character-level language modelling on an offline corpus: the bytes of the Python standard
    library's own ``.py`` files (those directly in ``os.path.dirname(os.__file__)``, sorted
    by name), vocabulary bytes 0-255. A sample is ``seq_len`` consecutive bytes at an offset
    drawn from ``(seed, t)``. Causal models (gpt2-*) predict the next byte; bidirectional ones
    (bert-*) see ``seq_len * 15 // 100`` (at least 1) bytes per sample replaced by the mask id
    256 and predict them. Cross-entropy.
``classes``
    A generated image classification task: each of the model's ``classes`` has a fixed smooth
    random pattern (from ``seed``); a sample is its class's pattern plus Gaussian noise of
    standard deviation 1, its label drawn from ``(seed, t)``. Cross-entropy.
``synthetic``
    The zoo model's own input maker (random images or token ids), a pool of four global batches
    drawn from by a permutation of ``(seed, t)``; the loss is the mean of the model's output. It
    learns nothing: it is for measuring throughput.
``model``
    A user's :class:`runtime.model.ModelSpec`: its ``make_batch(step, batch_size)`` and its loss.
"""

from __future__ import annotations

import functools
import glob
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from partitioner.errors import PartitionerError

from .stage import LayerChain, layer_seed

__all__ = ["DATA_KINDS", "ClassesData", "DataSource", "ModelData", "SyntheticData", "TextData", "corpus_bytes",
           "make_data", "resolve_data_kind", "with_loss_memory"]

DATA_KINDS = ("auto", "text", "classes", "synthetic")
MASK_ID = 256  # the mask token of the bidirectional text task (vocabularies of the zoo have >= 512 ids)
_IGNORE = -100


def _step_generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(layer_seed(seed, 10_000 + step))


class DataSource:
    """Step ``t``'s global batch and the loss of the model's output against its targets."""

    kind = ""
    global_size = 0

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def loss(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class SyntheticData(DataSource):
    """Seeded batches from the model's input maker; loss = mean of the output (no targets)."""

    kind = "synthetic"

    def __init__(self, make_input: Callable[[int, str], torch.Tensor], micro_batch_size: int, micro_batches: int,
                 workers: int, seed: int = 0, pool_batches: int = 4):
        self.b, self.m, self.workers, self.seed = micro_batch_size, micro_batches, workers, seed
        self.global_size = micro_batch_size * micro_batches * workers
        self.pool = make_input(self.global_size * pool_batches, "cpu")

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        idx = torch.randperm(self.pool.shape[0], generator=_step_generator(self.seed, step))[: self.global_size]
        return self.pool[idx], None

    def loss(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        return output.float().mean()

    def micro_batch(self, step: int, worker: int, j: int) -> torch.Tensor:
        start = (worker * self.m + j) * self.b
        return self.global_batch(step)[0][start:start + self.b]


@functools.lru_cache(maxsize=1)
def corpus_bytes(max_bytes: int = 8 << 20) -> torch.Tensor:
    """The text corpus: the standard library's top-level ``.py`` files, sorted by name and
    concatenated (at most ``max_bytes``), as a uint8 tensor."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total < 1 << 16:
        raise PartitionerError(f"the text corpus (the .py files of {root}) has only {total} bytes; "
                               f"use `data` classes or synthetic")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).clone()


class TextData(DataSource):
    """Character-level text of the standard library's sources (see the module docstring)."""

    kind = "text"

    def __init__(self, seq_len: int, vocab: int, global_size: int, seed: int = 0, causal: bool = True):
        if vocab < MASK_ID + (0 if causal else 1):
            raise PartitionerError(f"vocab = {vocab}: the text task needs {MASK_ID + (0 if causal else 1)} token ids "
                                   f"(bytes{'' if causal else ' and a mask id'}); use a larger vocab or `data` synthetic")
        self.seq, self.vocab, self.global_size, self.seed, self.causal = seq_len, vocab, global_size, seed, causal
        self.corpus = corpus_bytes()

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        g = _step_generator(self.seed, step)
        span = self.seq + 1 if self.causal else self.seq
        offsets = torch.randint(0, self.corpus.numel() - span, (self.global_size,), generator=g)
        rows = self.corpus[offsets[:, None] + torch.arange(span)].long()
        if self.causal:
            return rows[:, :-1].float(), rows[:, 1:]
        k = max(1, self.seq * 15 // 100)
        masked = torch.rand(self.global_size, self.seq, generator=g).argsort(dim=1)[:, :k]
        target = torch.full_like(rows, _IGNORE)
        target.scatter_(1, masked, rows.gather(1, masked))
        inputs = rows.scatter(1, masked, MASK_ID)
        return inputs.float(), target

    def loss(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        assert target is not None
        return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), target.reshape(-1),
                               ignore_index=_IGNORE)


class ClassesData(DataSource):
    """A generated classification task on images (see the module docstring)."""

    kind = "classes"

    def __init__(self, classes: int, channels: int, image: int, global_size: int, seed: int = 0):
        self.classes, self.global_size, self.seed = classes, global_size, seed
        g = torch.Generator().manual_seed(layer_seed(seed, 20_000))
        coarse = torch.randn(classes, channels, 4, 4, generator=g)
        self.patterns = F.interpolate(coarse, size=(image, image), mode="bilinear", align_corners=False)

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        g = _step_generator(self.seed, step)
        labels = torch.randint(0, self.classes, (self.global_size,), generator=g)
        noise = torch.randn(self.global_size, *self.patterns.shape[1:], generator=g)
        return self.patterns[labels] + noise, labels

    def loss(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        assert target is not None
        return F.cross_entropy(output.float(), target)


class ModelData(DataSource):
    """A user's :class:`runtime.model.ModelSpec`: its batches and its loss."""

    kind = "model"

    def __init__(self, spec: Any, global_size: int):
        self.spec, self.global_size = spec, global_size

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.spec.batch(step, self.global_size)

    def loss(self, output: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        return self.spec.compute_loss(output, target)


def resolve_data_kind(chain: LayerChain, kind: str) -> str:
    """The data ``kind`` (``auto`` resolved) for ``chain``, or one line saying why it cannot serve."""
    if kind not in DATA_KINDS:
        raise PartitionerError(f"data = {kind!r}: must be one of {', '.join(DATA_KINDS)}")
    if chain.spec is not None:
        if kind in ("auto", "synthetic"):
            return "model" if kind == "auto" else "synthetic"
        raise PartitionerError(f"data = {kind!r} with model {chain.name}: a user's model trains on its own "
                               f"make_batch (data auto) or on synthetic batches")
    natural = "text" if "vocab" in chain.config else "classes" if "classes" in chain.config else "synthetic"
    if kind == "auto":
        return natural
    if kind != "synthetic" and kind != natural:
        raise PartitionerError(f"data = {kind!r} does not fit model {chain.name}: it trains on {natural} "
                               f"or synthetic")
    return kind


def make_data(chain: LayerChain, kind: str, micro_batch_size: int, micro_batches: int, workers: int,
              seed: int = 0) -> DataSource:
    """The data source of ``kind`` (see :data:`DATA_KINDS`) for ``chain``."""
    kind = resolve_data_kind(chain, kind)
    size = micro_batch_size * micro_batches * workers
    cfg = chain.config
    if kind == "text":
        return TextData(int(cfg["seq_len"]), int(cfg["vocab"]), size, seed, causal=chain.name.startswith("gpt2"))
    if kind == "classes":
        return ClassesData(int(cfg["classes"]), 3, int(cfg["image_size"]), size, seed)
    if kind == "model":
        return ModelData(chain.spec, size)
    return SyntheticData(chain.make_input, micro_batch_size, micro_batches, workers, seed)


def with_loss_memory(profile: Any, chain: LayerChain, output: torch.Tensor) -> Any:
    """``profile`` (a :class:`partitioner.profile.Profile` of ``chain``) with the memory of the
    chain's training loss (its real task, as ``train`` runs it) on its last layer, measured on
    ``output``, one micro-batch's output of the chain (:mod:`partitioner.loss_memory`); unchanged
    where the task is synthetic (its loss keeps nothing worth counting)."""
    from dataclasses import replace

    from partitioner.loss_memory import measure_loss_memory

    data = make_data(chain, "auto", profile.micro_batch_size, 1, 1)
    if data.kind == "synthetic":
        return profile
    _, target = data.global_batch(0)
    target = None if target is None else target.to(output.device)
    saved, work = measure_loss_memory(lambda out: data.loss(out, target), output)
    last = replace(profile.layers[-1], loss_saved_bytes=saved, loss_work_bytes=work)
    meta = {**profile.meta, "loss": f"{data.kind}: measured on one micro-batch's output (partitioner/loss_memory.py)"}
    return replace(profile, layers=(*profile.layers[:-1], last), meta=meta)
