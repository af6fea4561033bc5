import dataclasses
from pathlib import Path

import pytest

from partitioner.cluster import Cluster, Node
from partitioner.errors import FormatError
from partitioner.importers.pipedream import import_pipedream, parse_graph
from partitioner.profile import Profile
from solvers import solve
from solvers.pipeline.bisection import identical_optimum

from .conftest import big_type

MODELS = {"vgg16": 128, "alexnet": 256, "resnet18": 256, "resnet50": 128, "squeezenet1_0": 256, "gnmt": None}


def load(pipedream_dir: Path, name: str) -> Profile:
    return import_pipedream(pipedream_dir / f"{name}.txt", gpu_type="V100",
                            micro_batch_size=None if MODELS[name] else 64)


@pytest.mark.parametrize("name", MODELS)
def test_import_is_a_valid_chain(pipedream_dir, name):
    text = (pipedream_dir / f"{name}.txt").read_text()
    nodes, edges = parse_graph(text)
    prof = load(pipedream_dir, name)
    assert prof.num_layers == len(nodes)
    if MODELS[name]:
        assert prof.micro_batch_size == MODELS[name]
    order = [layer.name.split(".")[0] for layer in prof.layers]
    pos = {n: i for i, n in enumerate(order)}
    assert all(pos[a] < pos[b] for a, b in edges)  # topological
    fwd, bwd = prof.times_for("V100")
    for i, n in enumerate(order):
        if nodes[n].is_input:
            assert fwd[i] == bwd[i] == 0.0  # zeroed like PipeDream's optimizer
        else:
            assert fwd[i] == pytest.approx(nodes[n].fwd_s) and bwd[i] == pytest.approx(nodes[n].bwd_s)
    # boundary at every cut = every tensor produced before it and consumed after it
    for t in range(len(order) - 1):
        crossing = {a for a, b in edges if pos[a] <= t < pos[b]}
        assert prof.layers[t].output_bytes == pytest.approx(sum(nodes[a].activation_bytes for a in crossing))


def test_gnmt_needs_a_micro_batch_size(pipedream_dir):
    with pytest.raises(FormatError, match=r"gnmt.txt: micro_batch_size = None: cannot be derived"):
        import_pipedream(pipedream_dir / "gnmt.txt")


def test_malformed_lines_name_the_line(tmp_path):
    bad = tmp_path / "graph.txt"
    bad.write_text("node1 -- Input -- forward_compute_time=1.0, backward_compute_time=0.0, activation_size=602112.0\n")
    with pytest.raises(FormatError, match=r"graph.txt: line 1: parameter_size .* is missing"):
        import_pipedream(bad, micro_batch_size=1)
    bad.write_text("node1 -- A -- forward_compute_time=-1, backward_compute_time=0, activation_size=1, parameter_size=0\n")
    with pytest.raises(FormatError, match="line 1: forward_compute_time = '-1': must be >= 0"):
        import_pipedream(bad, micro_batch_size=1)
    bad.write_text("node1 -- A -- forward_compute_time=1, backward_compute_time=0, activation_size=1, parameter_size=0\n"
                   "\tnode1 -- node7\n")
    with pytest.raises(FormatError, match="node7 is not a node"):
        import_pipedream(bad, micro_batch_size=1)


# gnmt (a graph: the down-set DP, seconds a solve) at 8 GPUs by default; at 2 and 4 under -m slow
@pytest.mark.parametrize(("p", "name"), [pytest.param(p, name, marks=pytest.mark.slow) if name == "gnmt" and p < 8
                                         else (p, name) for p in (2, 4, 8) for name in MODELS])
def test_dp_matches_true_optimum_on_identical_devices(pipedream_dir, name, p):
    """Identical GPUs, transfers and memory ignored: the DP's bottleneck is the true optimum."""
    prof = load(pipedream_dir, name)
    prof = dataclasses.replace(prof, layers=tuple(dataclasses.replace(x, output_bytes=0.0) for x in prof.layers))
    cluster = Cluster("same", (Node("n0", ("V100",) * p, 10.0),), 1.0, {"V100": big_type("V100")})
    result = solve(prof, cluster, schedule="gpipe", micro_batches=1)
    fwd, bwd = prof.times_for("V100")
    assert result.objective == pytest.approx(identical_optimum(fwd + bwd, p), rel=1e-9)
