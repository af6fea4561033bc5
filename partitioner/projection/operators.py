"""Layers as operators: the GEMMs, element-wise kernels and collectives a layer runs.

A projection between GPU types (``partitioner.projection.operator_model``) prices each operator on the
target from its FLOPs, its memory traffic and the target's peaks, then sums them: a layer
whose time is mostly attention soft-max moves with memory bandwidth, one that is mostly
GEMMs with the tensor-core rate. This module says what the operators are.

:class:`Op` is one kernel (or a few fused into one) of one pass: ``kind`` (:data:`OP_KINDS`)
decides how it is priced, ``flops``, ``act_bytes`` (activations read and written; they grow
with the micro-batch), ``weight_bytes`` (parameters read or gradients written; they do not),
``kernels`` (launches), ``gemm`` (``(batch, m, n, k)`` of a GEMM, for tile quantisation;
``batch_dim`` names the one of the four that grows with the micro-batch: ``m`` of a forward or
input-gradient GEMM, ``k`` of a weight gradient, ``batch`` of a batched GEMM) and, for an
all-reduce, ``comm_bytes`` over a group of ``group`` GPUs.

:func:`transformer_ops` decomposes a GPT-style decoder analytically from its shape, forward
and backward, under ``t``-way Megatron tensor parallelism: QKV and the first FFN GEMM are
column-parallel (their output divided by ``t``), the attention output and second FFN GEMM
row-parallel (their input divided by ``t``, followed by an all-reduce in forward; the
column-parallel ones all-reduce the input gradient in backward), heads are divided by ``t``,
the embedding and the output layer are vocabulary-parallel. Backward GEMMs are the input
gradient and the weight gradient, each with the forward GEMM's FLOPs. The forward GEMM FLOPs
of a block add up to ``(24 b s h^2 + 4 b s^2 h) / t`` (checked by tests against this formula
and against fvcore on the zoo's blocks). Element-wise traffic counts each tensor read and
written once per kernel, at the element size of ``dtype`` (dropout masks one byte); the
cross-entropy runs in float32 whatever the training type, as Megatron-LM does.

An :class:`OperatorTable` holds the operators of every layer of a profile, at the profile's
micro-batch size; it is stored in ``Profile.meta["operators"]`` (docs/formats.md) and read
without torch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import FormatError, OptionError, check

__all__ = [
    "COMPUTE_KINDS",
    "LAYER_KINDS",
    "LAYOUTS",
    "MEMORY_KINDS",
    "OPERATORS_FORMAT",
    "OP_KINDS",
    "LayerOps",
    "Op",
    "OperatorTable",
    "TransformerShape",
    "block_ops",
    "element_bytes",
    "embedding_ops",
    "head_ops",
    "layer_kind",
    "module_ops",
    "transformer_ops",
    "zoo_ops",
]

OPERATORS_FORMAT = "partitioner.projection.operators/1"
COMPUTE_KINDS = ("gemm", "bgemm")  # priced by FLOPs (dense GEMMs; batched attention GEMMs)
MEMORY_KINDS = ("elementwise", "norm", "softmax", "embedding")  # priced by bytes moved
OP_KINDS = (*COMPUTE_KINDS, *MEMORY_KINDS, "allreduce")
PHASES = ("fwd", "bwd")
_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "half": 2, "mixed-fp16": 2, "mixed-bf16": 2}
_MASK_BYTES = 1  # a dropout mask: one bool per element


def element_bytes(dtype: str) -> int:
    """Bytes of one activation element in a profile of ``dtype`` (``float32``: 4, half types: 2)."""
    check(dtype in _ELEMENT_BYTES, "dtype", dtype, f"must be one of {', '.join(_ELEMENT_BYTES)}")
    return _ELEMENT_BYTES[dtype]


def _nonneg(v: Any, name: str) -> None:
    check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
          name, v, "must be a finite number >= 0")


@dataclass(frozen=True)
class Op:
    """One operator of one pass of a layer (see the module docstring)."""

    name: str
    kind: str
    phase: str
    flops: float = 0.0
    act_bytes: float = 0.0
    weight_bytes: float = 0.0
    kernels: int = 1
    gemm: tuple[int, int, int, int] | None = None  # (batch, m, n, k); m carries the micro-batch
    comm_bytes: float = 0.0
    group: int = 1
    batch_dim: int = 1  # index into gemm of the dimension that carries the micro-batch

    def __post_init__(self) -> None:
        check(isinstance(self.name, str) and self.name != "", "op.name", self.name, "must be a non-empty string")
        check(self.kind in OP_KINDS, f"op.{self.name}.kind", self.kind, f"must be one of {', '.join(OP_KINDS)}")
        check(self.phase in PHASES, f"op.{self.name}.phase", self.phase, "must be fwd or bwd")
        for f in ("flops", "act_bytes", "weight_bytes", "comm_bytes"):
            _nonneg(getattr(self, f), f"op.{self.name}.{f}")
        check(isinstance(self.kernels, int) and not isinstance(self.kernels, bool) and self.kernels >= 0,
              f"op.{self.name}.kernels", self.kernels, "must be an integer >= 0")
        check(isinstance(self.group, int) and not isinstance(self.group, bool) and self.group >= 1,
              f"op.{self.name}.group", self.group, "must be an integer >= 1")
        check(self.batch_dim in (0, 1, 2, 3), f"op.{self.name}.batch_dim", self.batch_dim,
              "must be 0, 1, 2 or 3 (batch, m, n, k)")
        if self.gemm is not None:
            dims = tuple(self.gemm)
            ok = len(dims) == 4 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in dims)
            check(ok, f"op.{self.name}.gemm", self.gemm, "must be (batch, m, n, k), integers >= 1")
            object.__setattr__(self, "gemm", dims)

    @property
    def mem_bytes(self) -> float:
        """Bytes moved to and from memory: activations and parameters."""
        return self.act_bytes + self.weight_bytes

    def scaled(self, f: float) -> Op:
        """The operator at ``f`` times the micro-batch: FLOPs, activation and message bytes and
        the GEMM's ``batch_dim`` scale; parameter bytes do not."""
        gemm = self.gemm
        if gemm is not None:
            dims = list(gemm)
            dims[self.batch_dim] = max(1, round(dims[self.batch_dim] * f))
            gemm = (dims[0], dims[1], dims[2], dims[3])
        return replace(self, flops=self.flops * f, act_bytes=self.act_bytes * f, gemm=gemm,
                       comm_bytes=self.comm_bytes * f)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "kind": self.kind, "phase": self.phase}
        for f in ("flops", "act_bytes", "weight_bytes", "comm_bytes"):
            if getattr(self, f):
                d[f] = getattr(self, f)
        if self.kernels != 1:
            d["kernels"] = self.kernels
        if self.gemm is not None:
            d["gemm"] = list(self.gemm)
        if self.group != 1:
            d["group"] = self.group
        if self.batch_dim != 1:
            d["batch_dim"] = self.batch_dim
        return d

    @classmethod
    def from_dict(cls, d: Any, where: str = "") -> Op:
        if not isinstance(d, Mapping):
            raise FormatError(where.rstrip(".") or "op", d, "must be an object {name, kind, phase, ...}")
        unknown = sorted(set(d) - {"name", "kind", "phase", "flops", "act_bytes", "weight_bytes", "kernels",
                                   "gemm", "comm_bytes", "group", "batch_dim"})
        if unknown:
            raise FormatError(f"{where}{unknown[0]}", d[unknown[0]], "is not an operator field")
        gemm = d.get("gemm")
        try:
            return cls(name=d.get("name", ""), kind=d.get("kind", ""), phase=d.get("phase", ""),
                       flops=d.get("flops", 0.0), act_bytes=d.get("act_bytes", 0.0),
                       weight_bytes=d.get("weight_bytes", 0.0), kernels=d.get("kernels", 1),
                       gemm=None if gemm is None else tuple(gemm) if isinstance(gemm, list) else gemm,
                       comm_bytes=d.get("comm_bytes", 0.0), group=d.get("group", 1), batch_dim=d.get("batch_dim", 1))
        except FormatError as err:
            raise err.under(where) from None


@dataclass(frozen=True)
class LayerOps:
    """The operators of one layer, forward and backward."""

    name: str
    ops: tuple[Op, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        check(isinstance(self.name, str) and self.name != "", "name", self.name, "must be a non-empty string")
        for op in self.ops:
            check(isinstance(op, Op), f"{self.name}.ops", op, "must be Op objects")

    def phase(self, phase: str) -> tuple[Op, ...]:
        """The operators of the ``fwd`` or ``bwd`` pass."""
        check(phase in PHASES, "phase", phase, "must be fwd or bwd")
        return tuple(op for op in self.ops if op.phase == phase)

    def flops(self, phase: str = "fwd", kinds: Sequence[str] = OP_KINDS) -> float:
        """FLOPs of one pass, over the operators of ``kinds``."""
        return math.fsum(op.flops for op in self.phase(phase) if op.kind in kinds)

    def scaled(self, f: float) -> LayerOps:
        return LayerOps(self.name, tuple(op.scaled(f) for op in self.ops))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ops": [op.to_dict() for op in self.ops]}

    @classmethod
    def from_dict(cls, d: Any, where: str = "") -> LayerOps:
        if not isinstance(d, Mapping) or not isinstance(d.get("ops"), list):
            raise FormatError(where.rstrip(".") or "layer", d, "must be an object {name, ops: [...]}")
        ops = tuple(Op.from_dict(x, f"{where}ops[{i}].") for i, x in enumerate(d["ops"]))
        return cls(str(d.get("name", "")), ops)


@dataclass(frozen=True)
class OperatorTable:
    """The operators of every layer of a profile, at ``micro_batch_size`` and ``tensor_parallel``."""

    micro_batch_size: int
    layers: tuple[LayerOps, ...]
    tensor_parallel: int = 1
    dtype: str = "float32"
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        for f in ("micro_batch_size", "tensor_parallel"):
            v = getattr(self, f)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f, v, "must be an integer >= 1")
        element_bytes(self.dtype)
        check(len(self.layers) >= 1, "layers", [], "must list at least one layer")
        names = [x.name for x in self.layers]
        dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
        check(dup is None, "layers", dup, "layer names must be unique")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(x.name for x in self.layers)

    def at_size(self, micro_batch_size: int) -> OperatorTable:
        """The table at another micro-batch size (operators scaled linearly, see :meth:`Op.scaled`)."""
        if micro_batch_size == self.micro_batch_size:
            return self
        f = micro_batch_size / self.micro_batch_size
        scaled: dict[tuple[Op, ...], tuple[Op, ...]] = {}
        layers = []
        for x in self.layers:
            if x.ops not in scaled:
                scaled[x.ops] = tuple(op.scaled(f) for op in x.ops)
            layers.append(LayerOps(x.name, scaled[x.ops]))
        return OperatorTable(micro_batch_size, tuple(layers), self.tensor_parallel, self.dtype, self.source)

    def to_dict(self) -> dict[str, Any]:
        """JSON form; layers with the same operators (the blocks) share one list in ``ops``."""
        groups: dict[tuple[Op, ...], str] = {}
        ops: dict[str, list[dict[str, Any]]] = {}
        layers = []
        for x in self.layers:
            if x.ops not in groups:
                groups[x.ops] = x.name
                ops[x.name] = [op.to_dict() for op in x.ops]
            layers.append([x.name, groups[x.ops]])
        return {"format": OPERATORS_FORMAT, "micro_batch_size": self.micro_batch_size,
                "tensor_parallel": self.tensor_parallel, "dtype": self.dtype, "source": self.source,
                "ops": ops, "layers": layers}

    @classmethod
    def from_dict(cls, d: Any, where: str = "meta.operators.") -> OperatorTable:
        if not isinstance(d, Mapping):
            raise FormatError(where.rstrip("."), d, "must be an object {format, micro_batch_size, ops, layers}")
        fmt = d.get("format", OPERATORS_FORMAT)
        check(fmt == OPERATORS_FORMAT, f"{where}format", fmt, f"expected '{OPERATORS_FORMAT}'")
        raw_ops, raw_layers = d.get("ops"), d.get("layers")
        if not isinstance(raw_ops, Mapping):
            raise FormatError(f"{where}ops", raw_ops, "must map a group name to a list of operators")
        if not isinstance(raw_layers, list):
            raise FormatError(f"{where}layers", raw_layers, "must list [layer name, group name] pairs")
        groups: dict[str, tuple[Op, ...]] = {}
        for g, lst in raw_ops.items():
            check(isinstance(lst, list), f"{where}ops.{g}", lst, "must be a list of operators")
            groups[str(g)] = tuple(Op.from_dict(x, f"{where}ops.{g}[{i}].") for i, x in enumerate(lst))
        layers = []
        for i, pair in enumerate(raw_layers):
            ok = isinstance(pair, list) and len(pair) == 2 and all(isinstance(v, str) for v in pair)
            check(ok, f"{where}layers[{i}]", pair, "must be [layer name, group name]")
            check(pair[1] in groups, f"{where}layers[{i}]", pair, "names a group that ops does not have")
            layers.append(LayerOps(pair[0], groups[pair[1]]))
        try:
            return cls(micro_batch_size=d.get("micro_batch_size", 0), layers=tuple(layers),
                       tensor_parallel=d.get("tensor_parallel", 1), dtype=d.get("dtype", "float32"),
                       source=str(d.get("source", "")))
        except FormatError as err:
            raise err if err.field.startswith(where) else err.under(where) from None


# -- transformer decomposition ---------------------------------------------------------------

LAYOUTS = ("megatron", "torch")


@dataclass(frozen=True)
class TransformerShape:
    """A transformer: hidden size, heads, sequence length, vocabulary, FFN width (4 h), and how
    it is written. ``layout`` ``megatron``: Megatron-LM's GPT (dropout, a vocabulary-parallel
    cross-entropy in the head, the soft-max scale folded into the score GEMM); ``torch``: this
    project's zoo models (``partitioner.models``: no dropout, the head ends at the logits,
    ``q``, ``k``, ``v`` copied to contiguous heads, the scale a kernel of its own). ``causal``
    masks future positions (GPT); ``post_ln`` puts the LayerNorms after the residual sums and one
    in the embedding (BERT)."""

    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn: int = 0  # 0: 4 * hidden
    layout: str = "megatron"
    causal: bool = True
    post_ln: bool = False

    def __post_init__(self) -> None:
        for f in ("hidden", "heads", "seq_len", "vocab"):
            v = getattr(self, f)
            check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f, v, "must be an integer >= 1")
        check(self.hidden % self.heads == 0, "heads", self.heads, f"must divide hidden ({self.hidden})")
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        check(isinstance(self.ffn, int) and self.ffn >= 1, "ffn", self.ffn, "must be an integer >= 1")
        check(self.layout in LAYOUTS, "layout", self.layout, f"must be one of {', '.join(LAYOUTS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def dropout(self) -> bool:
        return self.layout == "megatron"

    def check_tensor_parallel(self, t: int) -> None:
        check(isinstance(t, int) and not isinstance(t, bool) and t >= 1, "tensor_parallel", t,
              "must be an integer >= 1")
        check(self.heads % t == 0 and self.ffn % t == 0, "tensor_parallel", t,
              f"must divide the heads ({self.heads}) and the FFN width ({self.ffn})")
        check(t == 1 or self.layout == "megatron", "tensor_parallel", t,
              "must be 1 for the torch layout (the zoo's models are not sharded)")

    def to_dict(self) -> dict[str, Any]:
        return {"hidden": self.hidden, "heads": self.heads, "seq_len": self.seq_len, "vocab": self.vocab,
                "ffn": self.ffn, "layout": self.layout, "causal": self.causal, "post_ln": self.post_ln}


@dataclass(frozen=True)
class _Builder:
    """Makes the operators of one layer: tokens ``n`` (= b s), element bytes ``e``, phase lists."""

    n: int
    e: int
    t: int
    with_dropout: bool
    ops: list[Op] = field(default_factory=list)

    def linear(self, name: str, k: int, out: int, *, bias: bool = True) -> None:
        """Forward ``Y[n, out] = X[n, k] W[k, out]`` and its backward GEMMs (input gradient,
        then the weight gradient, accumulated into ``.grad``: read and written once)."""
        n, e = self.n, self.e
        w = k * out * e + (out * e if bias else 0)
        act = float((n * k + n * out) * e)
        self.ops.append(Op(name, "gemm", "fwd", 2.0 * n * k * out, act, float(w), gemm=(1, n, out, k)))
        self.ops.append(Op(f"{name}.dgrad", "gemm", "bwd", 2.0 * n * k * out, act, float(k * out * e),
                           gemm=(1, n, k, out)))
        self.ops.append(Op(f"{name}.wgrad", "gemm", "bwd", 2.0 * n * k * out, act, float(2 * w),
                           gemm=(1, k, out, n), batch_dim=3))

    def bgemm(self, name: str, phase: str, batch: int, m: int, n: int, k: int) -> None:
        """A batched GEMM ``batch x [m, k] x [k, n]``: every operand and the result move once."""
        self.ops.append(Op(name, "bgemm", phase, 2.0 * batch * m * n * k,
                           float(batch * (m * k + k * n + m * n) * self.e), gemm=(batch, m, n, k), batch_dim=0))

    def stream(self, name: str, phase: str, elems: float, reads: float, writes: float, *, kind: str = "elementwise",
               masks: float = 0.0, kernels: int = 1, flops_per_elem: float = 0.0) -> None:
        """A memory-bound kernel over ``elems`` elements: ``reads`` and ``writes`` tensors of that
        size, ``masks`` one-byte masks read or written."""
        self.ops.append(Op(name, kind, phase, flops_per_elem * elems,
                           float(elems * ((reads + writes) * self.e + masks * _MASK_BYTES)), kernels=kernels))

    def allreduce(self, name: str, phase: str, elems: float, e: int | None = None) -> None:
        if self.t > 1:
            self.ops.append(Op(name, "allreduce", phase, comm_bytes=float(elems * (e or self.e)), group=self.t))

    def dropout(self, name: str, phase: str, elems: float) -> None:
        """Dropout: forward reads x, writes y and the mask; backward reads dy and the mask, writes dx."""
        if self.with_dropout:
            self.stream(name, phase, elems, 1, 1, masks=1)

    def move_bwd(self, name: str) -> None:
        """Move the backward GEMMs of ``name`` (made with its forward) to this point of the list."""
        moved = [op for op in self.ops if op.name in (f"{name}.dgrad", f"{name}.wgrad")]
        for op in moved:
            self.ops.remove(op)
        self.ops.extend(moved)

    def ordered(self) -> tuple[Op, ...]:
        """Forward operators first, then backward, each in the order they were made."""
        return tuple([op for op in self.ops if op.phase == "fwd"] + [op for op in self.ops if op.phase == "bwd"])


def _builder(shape: TransformerShape, micro_batch_size: int, tensor_parallel: int, dtype: str) -> _Builder:
    shape.check_tensor_parallel(tensor_parallel)
    check(isinstance(micro_batch_size, int) and micro_batch_size >= 1, "micro_batch_size", micro_batch_size,
          "must be an integer >= 1")
    return _Builder(micro_batch_size * shape.seq_len, element_bytes(dtype), tensor_parallel, shape.dropout)


def embedding_ops(shape: TransformerShape, micro_batch_size: int, tensor_parallel: int = 1,
                  dtype: str = "float32", recompute: bool = False) -> tuple[Op, ...]:
    """Token and position embeddings, their sum and dropout (vocabulary-parallel over ``t``;
    ``post_ln``: a LayerNorm after the sum). ``recompute`` does not apply (blocks only)."""
    bld = _builder(shape, micro_batch_size, tensor_parallel, dtype)
    n, e, t, h = bld.n, bld.e, bld.t, shape.hidden
    vocab_t = math.ceil(shape.vocab / t)
    if shape.layout == "torch":  # ids carried as floats: round, then convert to integers
        bld.stream("ids", "fwd", n, 2, 2, kernels=2)
    bld.ops.append(Op("token_lookup", "embedding", "fwd", 0.0, float(n * h * 2 * e + n * 8)))
    if t > 1:  # ids outside this rank's vocabulary range are masked: index arithmetic, then a masked fill
        bld.stream("vocab_mask", "fwd", n * h, 1, 1, kernels=6)
    bld.allreduce("embedding_allreduce", "fwd", n * h)
    bld.ops.append(Op("position_lookup", "embedding", "fwd", 0.0, float(n * h * 2 * e)))
    bld.stream("add", "fwd", n * h, 2, 1, flops_per_elem=1.0)
    if shape.post_ln:
        bld.stream("ln", "fwd", n * h, 1, 1, kind="norm", flops_per_elem=8.0)
        bld.stream("ln.bwd", "bwd", n * h, 3, 2, kind="norm", kernels=2, flops_per_elem=10.0)
    bld.dropout("dropout", "fwd", n * h)
    bld.dropout("dropout.bwd", "bwd", n * h)
    # dense embedding gradients: zero the table, then scatter-add the rows used
    bld.ops.append(Op("token_lookup.wgrad", "embedding", "bwd", 0.0, float(n * h * 2 * e + n * 8),
                      float(vocab_t * h * e), kernels=4))
    bld.ops.append(Op("position_lookup.wgrad", "embedding", "bwd", 0.0, float(n * h * 2 * e),
                      float(shape.seq_len * h * e), kernels=4))
    return bld.ordered()


def block_ops(shape: TransformerShape, micro_batch_size: int, tensor_parallel: int = 1,
              dtype: str = "float32", recompute: bool = False) -> tuple[Op, ...]:
    """A transformer block, forward then backward. With ``recompute`` (activation
    checkpointing) the backward first runs the forward's compute again, without its
    all-reduces (Sailor's measured backward times at tensor-parallel degree > 1 hold two
    all-reduces, not four)."""
    bld = _builder(shape, micro_batch_size, tensor_parallel, dtype)
    n, t, h, s = bld.n, bld.t, shape.hidden, shape.seq_len
    b, a_t, d, f_t, h_t = micro_batch_size, shape.heads // t, shape.head_dim, shape.ffn // t, h // t
    scores = float(b * a_t * s * s)  # attention-score elements on this rank
    torch_layout = shape.layout == "torch"
    masks = 1 if shape.dropout else 0
    # forward
    if not shape.post_ln:
        bld.stream("ln1", "fwd", n * h, 1, 1, kind="norm", flops_per_elem=8.0)
    bld.linear("qkv", h, 3 * h_t)
    if torch_layout:  # q, k and v reshaped to (b * heads, s, d): one copy each
        bld.stream("qkv_layout", "fwd", 3 * n * h_t, 1, 1, kernels=3)
    bld.bgemm("scores", "fwd", b * a_t, s, s, d)
    if torch_layout:
        bld.stream("scale", "fwd", scores, 1, 1, kind="softmax")
    if shape.causal:
        bld.stream("mask", "fwd", scores, 1, 1, kind="softmax")
    bld.stream("softmax", "fwd", scores, 1, 1, kind="softmax", flops_per_elem=5.0)
    bld.dropout("attn_dropout", "fwd", scores)
    bld.bgemm("context", "fwd", b * a_t, s, d, s)
    bld.stream("context_layout", "fwd", n * h_t, 1, 1)
    bld.linear("attn_out", h_t, h)
    bld.allreduce("attn_allreduce", "fwd", n * h)
    bld.stream("residual1", "fwd", n * h, 2, 1, masks=masks, flops_per_elem=2.0)
    bld.stream("ln2" if not shape.post_ln else "ln1", "fwd", n * h, 1, 1, kind="norm", flops_per_elem=8.0)
    bld.linear("fc1", h, f_t)
    bld.stream("gelu", "fwd", n * f_t, 1, 1, flops_per_elem=8.0)
    bld.linear("fc2", f_t, h)
    bld.allreduce("mlp_allreduce", "fwd", n * h)
    bld.stream("residual2", "fwd", n * h, 2, 1, masks=masks, flops_per_elem=2.0)
    if shape.post_ln:
        bld.stream("ln2", "fwd", n * h, 1, 1, kind="norm", flops_per_elem=8.0)
    # backward, in reverse order
    if shape.post_ln:
        bld.stream("ln2.bwd", "bwd", n * h, 3, 2, kind="norm", kernels=2, flops_per_elem=10.0)
    bld.stream("residual2.bwd", "bwd", n * h, 2, 1, masks=masks, kernels=2)
    bld.move_bwd("fc2")
    bld.stream("gelu.bwd", "bwd", n * f_t, 2, 1, flops_per_elem=12.0)
    bld.move_bwd("fc1")
    bld.allreduce("fc1_dgrad_allreduce", "bwd", n * h)
    bld.stream("ln2.bwd" if not shape.post_ln else "ln1.bwd", "bwd", n * h, 3, 2, kind="norm", kernels=2,
               flops_per_elem=10.0)
    bld.stream("residual1.bwd", "bwd", n * h, 2, 1, masks=masks, kernels=2)
    bld.move_bwd("attn_out")
    bld.stream("context_layout.bwd", "bwd", n * h_t, 1, 1)
    bld.bgemm("context.dgrad", "bwd", b * a_t, s, s, d)
    bld.bgemm("context.vgrad", "bwd", b * a_t, s, d, s)
    bld.dropout("attn_dropout.bwd", "bwd", scores)
    bld.stream("softmax.bwd", "bwd", scores, 2, 1, kind="softmax", flops_per_elem=4.0)
    if shape.causal:
        bld.stream("mask.bwd", "bwd", scores, 1, 1, kind="softmax")
    if torch_layout:
        bld.stream("scale.bwd", "bwd", scores, 1, 1, kind="softmax")
    bld.bgemm("scores.qgrad", "bwd", b * a_t, s, d, s)
    bld.bgemm("scores.kgrad", "bwd", b * a_t, s, d, s)
    if torch_layout:  # the head copies and the q/k/v split, backwards
        bld.stream("qkv_layout.bwd", "bwd", 3 * n * h_t, 2, 1, kernels=4)
    bld.move_bwd("qkv")
    bld.allreduce("qkv_dgrad_allreduce", "bwd", n * h)
    if not shape.post_ln:
        bld.stream("ln1.bwd", "bwd", n * h, 3, 2, kind="norm", kernels=2, flops_per_elem=10.0)
    bld.stream("residual_grad_add", "bwd", n * h, 2, 1, flops_per_elem=1.0)
    ops = bld.ordered()
    if recompute:
        fwd = [op for op in ops if op.phase == "fwd"]
        again = [replace(op, name=f"recompute.{op.name}", phase="bwd") for op in fwd if op.kind != "allreduce"]
        ops = (*fwd, *again, *(op for op in ops if op.phase == "bwd"))
    return ops


def head_ops(shape: TransformerShape, micro_batch_size: int, tensor_parallel: int = 1,
             dtype: str = "float32", recompute: bool = False) -> tuple[Op, ...]:
    """Final LayerNorm and the vocabulary-parallel output GEMM; in the ``megatron`` layout also
    the cross-entropy, in float32 (max, subtract, exp, sum, divide; the soft-max kept for
    backward; the per-token maxima, target logits and sums all-reduced)."""
    bld = _builder(shape, micro_batch_size, tensor_parallel, dtype)
    n, t, h = bld.n, bld.t, shape.hidden
    logits = float(n * math.ceil(shape.vocab / t))
    bld.stream("ln_f", "fwd", n * h, 1, 1, kind="norm", flops_per_elem=8.0)
    bld.linear("logits", h, math.ceil(shape.vocab / t), bias=False)
    if shape.layout == "megatron":
        ce = _Builder(n, 4, t, False)
        ce.stream("ce_max", "fwd", logits, 1, 0, kind="softmax")
        ce.stream("ce_sub_exp", "fwd", logits, 2, 2, kind="softmax", kernels=2)
        ce.stream("ce_sum_div", "fwd", logits, 2, 1, kind="softmax", kernels=2)
        ce.stream("ce_target", "fwd", n, 4, 4, kernels=8)
        for what in ("max", "target", "sum"):
            ce.allreduce(f"ce_allreduce_{what}", "fwd", n, 4)
        ce.stream("ce.bwd", "bwd", logits, 2, 1, kind="softmax", kernels=3)
        bld.ops.extend(ce.ops)
    bld.move_bwd("logits")
    bld.allreduce("logits_dgrad_allreduce", "bwd", n * h)
    bld.stream("ln_f.bwd", "bwd", n * h, 3, 2, kind="norm", kernels=2, flops_per_elem=10.0)
    return bld.ordered()


_MAKERS = {"embedding": embedding_ops, "block": block_ops, "head": head_ops}
LAYER_KINDS = tuple(_MAKERS)


def layer_kind(name: str) -> str | None:
    """The kind of a transformer layer from its name in a profile (``embed``, ``block7``,
    ``head``), or None."""
    if name.startswith("embed"):
        return "embedding"
    if name.startswith("block"):
        return "block"
    if name.startswith("head"):
        return "head"
    return None


def transformer_ops(shape: TransformerShape, micro_batch_size: int, names: Sequence[str],
                    kinds: Sequence[str] | None = None, *, tensor_parallel: int = 1,
                    dtype: str = "float32", recompute: bool = False) -> OperatorTable:
    """The operator table of a transformer chain: ``names`` are the profile's layer names,
    ``kinds`` (``embedding``, ``block`` or ``head`` per layer) default to what the names say
    (:func:`layer_kind`). With ``recompute`` the blocks' backward re-runs their forward
    (Megatron-LM's activation checkpointing covers the blocks only)."""
    names = list(names)
    check(len(names) >= 1, "names", names, "must list at least one layer")
    if kinds is None:
        guessed = [layer_kind(n) for n in names]
        unknown = next((n for n, k in zip(names, guessed, strict=True) if k is None), None)
        check(unknown is None, "names", unknown, "is not an embed, block or head layer; give `kinds`",
              OptionError)
        kinds = [k for k in guessed if k is not None]
    kinds = list(kinds)
    check(len(kinds) == len(names), "kinds", len(kinds), f"must give one kind per layer ({len(names)})",
          OptionError)
    made: dict[str, tuple[Op, ...]] = {}
    layers = []
    for name, kind in zip(names, kinds, strict=True):
        check(kind in _MAKERS, f"kinds[{name}]", kind, f"must be one of {', '.join(_MAKERS)}", OptionError)
        if kind not in made:
            made[kind] = _MAKERS[kind](shape, micro_batch_size, tensor_parallel, dtype, recompute)
        layers.append(LayerOps(name, made[kind]))
    how = " with recomputation" if recompute else ""
    return OperatorTable(micro_batch_size, tuple(layers), tensor_parallel, dtype,
                         f"analytic transformer{how} {shape.to_dict()}")


def zoo_ops(model: str, config: Mapping[str, Any], micro_batch_size: int, names: Sequence[str],
            dtype: str = "float32") -> OperatorTable | None:
    """The operator table of a transformer of the zoo (``partitioner.models``; its ``config``
    as the profiler records it), or None for a model that is not one (the CNNs)."""
    keys = ("hidden", "heads", "seq_len", "vocab")
    if not all(isinstance(config.get(k), int) for k in keys) or any(layer_kind(n) is None for n in names):
        return None
    bert = model.startswith("bert")
    shape = TransformerShape(int(config["hidden"]), int(config["heads"]), int(config["seq_len"]),
                             int(config["vocab"]), layout="torch", causal=not bert, post_ln=bert)
    return transformer_ops(shape, micro_batch_size, names, dtype=dtype)


# -- layers described by their torch module ------------------------------------------------------

_INT = r"(\d+)"


def _pair(text: str, key: str, default: int) -> tuple[int, int]:
    """``key=(a, b)`` or ``key=a`` of a module's repr, as a pair."""
    m = re.search(rf"{key}=\(?\s*(\d+)(?:\s*,\s*(\d+))?", text)
    if not m:
        return default, default
    a = int(m.group(1))
    return a, int(m.group(2)) if m.group(2) else a


def _feature(text: str, key: str) -> int:
    m = re.search(rf"{key}=(\d+)", text)
    return int(m.group(1)) if m else 1


def module_ops(description: str, in_elems: float, out_elems: float, micro_batch_size: int,
               dtype: str = "float32") -> tuple[Op, ...]:
    """The operators of one torch module from its ``repr`` (``Conv2d(64, 128, kernel_size=(3, 3),
    ...)``, ``Linear(in_features=..., out_features=...)``, ``ReLU``, ``MaxPool2d``, ``AvgPool2d``,
    ``BatchNorm2d``, ``Dropout``, ``Add``, ``Concat``; others: none), given its input and output
    elements for the whole micro-batch. A convolution is priced as its implicit GEMM
    (``m`` = output pixels of the batch, ``n`` = output channels, ``k`` = input channels x kernel
    area); backward as the input-gradient and weight-gradient GEMMs of the same size."""
    e = element_bytes(dtype)
    kind = re.split(r"[(\s]", description.strip(), maxsplit=1)[0]
    bld = _Builder(1, e, 1, True)
    if kind == "Conv2d":
        args = description.split("(", 1)[-1].split("kernel_size")[0]
        nums = [int(x) for x in re.findall(_INT, args)][:2]
        cin, cout = nums if len(nums) == 2 else (1, 1)
        kh, kw = _pair(description, "kernel_size", 1)
        groups = _pair(description, "groups", 1)[0]
        pixels = max(1, round(out_elems / max(cout, 1)))
        k = max(1, cin // groups * kh * kw)
        w = float(cout * k * e)
        act = float((in_elems + out_elems) * e)
        flops = 2.0 * pixels * cout * k
        bld.ops.append(Op("conv", "gemm", "fwd", flops, act, w, gemm=(1, pixels, cout, k)))
        bld.ops.append(Op("conv.dgrad", "gemm", "bwd", flops, act, w, gemm=(1, pixels, k, cout)))
        bld.ops.append(Op("conv.wgrad", "gemm", "bwd", flops, act, 2 * w, gemm=(1, cout, k, pixels), batch_dim=3))
    elif kind == "Linear":
        fin, fout = _feature(description, "in_features"), _feature(description, "out_features")
        lin = _Builder(micro_batch_size, e, 1, True)
        lin.linear("linear", fin, fout)
        bld.ops.extend(lin.ops)
    elif kind == "ReLU":
        bld.stream("relu", "fwd", out_elems, 1, 1)
        bld.stream("relu.bwd", "bwd", out_elems, 2, 1)
    elif kind in ("MaxPool2d", "AvgPool2d", "AdaptiveAvgPool2d"):
        idx = 2 if kind == "MaxPool2d" else 0  # max pooling keeps int64 indices: two elements' worth
        bld.stream("pool", "fwd", in_elems, 1, 0)
        bld.stream("pool.out", "fwd", out_elems, 0, 1 + idx)
        bld.stream("pool.bwd", "bwd", in_elems, 0, 1, kernels=2)
        bld.stream("pool.bwd.grads", "bwd", out_elems, 1 + idx, 0)
    elif kind == "BatchNorm2d":
        bld.stream("batchnorm", "fwd", out_elems, 2, 1, kind="norm", kernels=2)
        bld.stream("batchnorm.bwd", "bwd", out_elems, 4, 1, kind="norm", kernels=2)
    elif kind == "Dropout":
        bld.dropout("dropout", "fwd", out_elems)
        bld.dropout("dropout.bwd", "bwd", out_elems)
    elif kind == "Add":
        bld.stream("add", "fwd", out_elems, 2, 1)
    elif kind == "Concat":
        bld.stream("concat", "fwd", out_elems, 1, 1)
        bld.stream("concat.bwd", "bwd", out_elems, 1, 1)
    return bld.ordered()
