"""PipeDream profiles (``graph.txt`` from PipeDream's profiler) -> a chain :class:`Profile`.

The file lists graph nodes and edges::

    node4 -- Conv2d(3, 64, ...) -- forward_compute_time=22.307, backward_compute_time=24.613, activation_size=1644167168.0, parameter_size=7168.0
    \tnode1 -- node4

Times are milliseconds, sizes bytes for the whole profiled minibatch. Nodes are not in
execution order and the graph may be a DAG (ResNet skips, GNMT's multiple inputs).

Linearisation: nodes are put in a topological order (Kahn's algorithm, ties broken by node
number, so the result is deterministic) and each becomes one layer of the chain. A cut
after position ``t`` is valid for a pipeline because every node before it is done; the
boundary tensor at that cut is the sum of the outputs of nodes at or before ``t`` that feed
a node after ``t`` (every tensor that crosses the cut). That sum is the layer's
``output_bytes``; the node's own activation is kept as ``own_output_bytes``, so that
:meth:`Profile.reordered` can price the cuts of another topological order. A layer's ``saved_bytes`` is its own activation, which is what PipeDream's
optimizer counts as stashed memory. Like PipeDream's optimizer, the compute time of input
nodes is zeroed: their "forward time" is data loading, not model compute.
"""

from __future__ import annotations

import heapq
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .._io import read_text
from ..errors import FormatError
from ..profile import (
    MAX_BYTES,
    MAX_LAYER_S,
    MAX_LAYERS,
    MAX_MICRO_BATCH_SIZE,
    LayerProfile,
    LayerTime,
    Profile,
    crossing_bytes,
)

__all__ = ["PipeDreamNode", "import_pipedream", "parse_graph"]

_NODE_ID = re.compile(r"^node(\d{1,18})$")
_METRIC = re.compile(r"(forward_compute_time|backward_compute_time|activation_size|parameter_size)=(\[[^\]]*\]|[^,\s]+)")
_IMAGE_SAMPLE_BYTES = 3 * 224 * 224 * 4  # one fp32 ImageNet image
_MAX_MS = MAX_LAYER_S * 1e3


@dataclass(frozen=True)
class PipeDreamNode:
    """One node of a PipeDream graph, units converted (seconds, bytes)."""

    node_id: str
    description: str
    fwd_s: float
    bwd_s: float
    activation_bytes: float
    param_bytes: float

    @property
    def is_input(self) -> bool:
        return self.description.startswith("Input")

    @property
    def op(self) -> str:
        return re.split(r"[(\s]", self.description, maxsplit=1)[0] or "op"


def _number(text: str, field: str, line_no: int, most: float) -> float:
    """A metric value: a number, or a list ``[a; b; c]`` of tensor sizes (summed), in ``[0, most]``."""
    parts = text.strip("[]").split(";") if text.startswith("[") else [text]
    try:
        values = [float(p) for p in parts if p.strip()]
    except ValueError:
        raise FormatError(f"line {line_no}: {field}", text, "must be a number or a list [a; b; ...]") from None
    total = sum(values)
    if any(not 0 <= v <= most for v in values) or not total <= most:
        raise FormatError(f"line {line_no}: {field}", text, f"must be >= 0 and <= {most:g} (finite)")
    return total


def parse_graph(text: str) -> tuple[dict[str, PipeDreamNode], list[tuple[str, str]]]:
    """Nodes (by id) and edges (from, to) of a PipeDream ``graph.txt``."""
    nodes: dict[str, PipeDreamNode] = {}
    edges: list[tuple[str, str]] = []
    for line_no, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        parts = [p.strip() for p in raw.split(" -- ")]
        if raw.startswith(("\t", " ")):
            if len(parts) != 2 or not all(_NODE_ID.match(p) for p in parts):
                raise FormatError(f"line {line_no}", raw.strip(), "an edge line must read 'nodeA -- nodeB'")
            edges.append((parts[0], parts[1]))
            continue
        if len(parts) < 3 or not _NODE_ID.match(parts[0]):
            raise FormatError(f"line {line_no}", raw[:60],
                              "a node line must read 'nodeN -- <layer> -- forward_compute_time=..., ...'")
        metrics = dict(_METRIC.findall(parts[-1]))
        for key in ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size"):
            if key not in metrics:
                raise FormatError(f"line {line_no}: {key}", parts[-1][:60], "is missing from the node line")
        node = PipeDreamNode(
            node_id=parts[0],
            description=" -- ".join(parts[1:-1]),
            fwd_s=_number(metrics["forward_compute_time"], "forward_compute_time", line_no, _MAX_MS) / 1e3,
            bwd_s=_number(metrics["backward_compute_time"], "backward_compute_time", line_no, _MAX_MS) / 1e3,
            activation_bytes=_number(metrics["activation_size"], "activation_size", line_no, MAX_BYTES),
            param_bytes=_number(metrics["parameter_size"], "parameter_size", line_no, MAX_BYTES),
        )
        if node.node_id in nodes:
            raise FormatError(f"line {line_no}", node.node_id, "node listed twice")
        nodes[node.node_id] = node
        if len(nodes) > MAX_LAYERS:
            raise FormatError(f"line {line_no}", node.node_id, f"more than {MAX_LAYERS:,} nodes; that many "
                              "layers are not supported")
    if not nodes:
        raise FormatError("nodes", 0, "the file lists no 'nodeN -- ...' lines")
    for a, b in edges:
        for end in (a, b):
            if end not in nodes:
                raise FormatError("edge", f"{a} -- {b}", f"{end} is not a node of the graph")
    return nodes, edges


def _topological_order(nodes: dict[str, PipeDreamNode], edges: list[tuple[str, str]]) -> list[str]:
    def num(n: str) -> int:
        return int(n[4:])

    indeg = {n: 0 for n in nodes}
    succ: dict[str, list[str]] = {n: [] for n in nodes}
    for a, b in set(edges):
        succ[a].append(b)
        indeg[b] += 1
    ready = [(num(n), n) for n, d in indeg.items() if d == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for m in succ[n]:
            indeg[m] -= 1
            if indeg[m] == 0:
                heapq.heappush(ready, (num(m), m))
    if len(order) != len(nodes):
        stuck = sorted((n for n in nodes if indeg[n] > 0), key=num)
        raise FormatError("edges", stuck[:5], "form a cycle; a PipeDream graph must be acyclic")
    return order


def import_pipedream(path: str | os.PathLike[str], gpu_type: str = "V100",
                     micro_batch_size: int | None = None, model: str | None = None) -> Profile:
    """Read a PipeDream ``graph.txt`` into a chain profile timed on ``gpu_type``.

    ``micro_batch_size`` defaults to the one implied by an ImageNet-sized input node
    (3x224x224 fp32 per sample); other models must pass it.
    """
    p = Path(path)
    text = read_text(p)
    try:
        nodes, edges = parse_graph(text)
        order = _topological_order(nodes, edges)
        if micro_batch_size is None:
            inputs = [nodes[n] for n in order if nodes[n].is_input and nodes[n].activation_bytes > 0]
            size = inputs[0].activation_bytes / _IMAGE_SAMPLE_BYTES if inputs else 0.0
            if not inputs or not 1 <= size <= MAX_MICRO_BATCH_SIZE or size != int(size):
                raise FormatError("micro_batch_size", None, "cannot be derived from the input node (not a "
                                  "3x224x224 fp32 image batch); pass it explicitly (`micro_batch_size`)")
            micro_batch_size = int(size)
    except FormatError as err:
        raise err.in_file(str(p)) from None

    position = {n: i for i, n in enumerate(order)}
    chain_edges = tuple(sorted({(position[a], position[b]) for a, b in edges}))
    # boundary after position t: outputs produced at <= t and consumed after t
    crossing = crossing_bytes([nodes[n].activation_bytes for n in order], chain_edges, len(order))
    is_chain = all(b == a + 1 for a, b in chain_edges) and len(chain_edges) == len(order) - 1
    layers = []
    for t, n in enumerate(order):
        node = nodes[n]
        fwd, bwd = (0.0, 0.0) if node.is_input else (node.fwd_s, node.bwd_s)
        layers.append(LayerProfile(
            name=f"{n}.{node.op}",
            flops=0.0,
            param_bytes=node.param_bytes,
            saved_bytes=node.activation_bytes,
            output_bytes=crossing[t] if t + 1 < len(order) else node.activation_bytes,
            times={gpu_type: LayerTime(fwd, bwd, projected=False, measured_on=f"{gpu_type} (PipeDream profiler)")},
            own_output_bytes=None if is_chain else node.activation_bytes,
        ))
    default_name = p.parent.name if p.stem == "graph" else p.stem
    return Profile(
        model=model or default_name,
        micro_batch_size=micro_batch_size,
        layers=tuple(layers),
        dtype="float32",
        source=f"pipedream:{p.name}",
        edges=() if is_chain else chain_edges,
        meta={"descriptions": [nodes[n].description for n in order]},
    )
