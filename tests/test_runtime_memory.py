"""The activation meter (runtime/memory.py) against the profiler's saved bytes, and the
profiler's measured saving of selective recomputation (LayerProfile.selective_saved_bytes)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from partitioner.errors import FormatError  # noqa: E402
from partitioner.models import build_model  # noqa: E402
from partitioner.profile import LayerProfile, Profile  # noqa: E402
from partitioner.profiler import profile_model  # noqa: E402
from partitioner.recompute import selective_bytes  # noqa: E402
from runtime.memory import ActivationMeter  # noqa: E402
from runtime.stage import build_stage, zoo_chain  # noqa: E402


def _profile(name: str, batch: int) -> Profile:
    zoo = build_model(name, batch)
    return profile_model(zoo.layers, zoo.sample_input(), "cpu", model_name=name, threads=1, progress=False,
                         warmup=0, repeats=1, min_layer_time_s=0.0, layer_budget_s=0.01)


@pytest.mark.parametrize("name", ["gpt2-tiny", "vgg19-tiny"])
def test_the_meter_counts_what_the_profiler_says_a_stage_saves(name: str) -> None:
    prof = _profile(name, 4)
    chain = zoo_chain(name, 4)
    stage = build_stage(chain, 0, chain.num_layers, seed=0)
    meter = ActivationMeter()
    with meter.tracking([], stage.parameters()):
        y = stage(chain.make_input(4, "cpu"))
    want = sum(layer.saved_bytes for layer in prof.layers) - sum(layer.shared_saved_bytes for layer in prof.layers[1:])
    assert meter.saved_bytes == meter.peak_bytes == want
    y.float().mean().backward()  # the graph's saved tensors are released
    assert meter.saved_bytes == 0 and meter.peak_bytes == want


def test_the_meter_counts_what_a_selective_stage_keeps_as_the_profiler_measures_it() -> None:
    """A stage run with the runtime's selective recomputation keeps the attention cores' inputs
    outside autograd's saved tensors (so that a split backward can drop them); the meter still
    counts them: the stage's saved bytes less the profiler's measured selective saving."""
    from runtime.recompute import recompute_stage

    prof = _profile("gpt2-tiny", 4)
    chain = zoo_chain("gpt2-tiny", 4)
    stage = recompute_stage(build_stage(chain, 0, chain.num_layers, seed=0), "selective")
    meter = ActivationMeter()
    with meter.tracking([], stage.parameters()):
        y = stage(chain.make_input(4, "cpu"))
    whole = sum(layer.saved_bytes for layer in prof.layers) - sum(layer.shared_saved_bytes for layer in prof.layers[1:])
    assert meter.saved_bytes == whole - sum(selective_bytes(prof))
    y.float().mean().backward()
    assert meter.saved_bytes == 0


def test_a_held_tensor_that_is_also_saved_is_counted_once() -> None:
    layer = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256, requires_grad=True)
    meter = ActivationMeter()
    with meter.tracking([x], layer.parameters()):
        assert meter.held_bytes == x.numel() * 4
        y = layer(x)  # saves x (held already) and not the weight (model state)
    assert meter.peak_bytes == x.numel() * 4
    del y


def test_the_profiler_measures_what_selective_recomputation_keeps() -> None:
    prof = _profile("gpt2-tiny", 4)
    by_name = {layer.name: layer for layer in prof.layers}
    for name, layer in by_name.items():
        if name.startswith("block"):
            assert layer.selective_saved_bytes is not None and 0 < layer.selective_saved_bytes < layer.saved_bytes
        else:
            assert layer.selective_saved_bytes is None
    dropped = selective_bytes(prof)
    for k, layer in enumerate(prof.layers):
        want = layer.saved_bytes - layer.selective_saved_bytes if layer.selective_saved_bytes is not None else 0.0
        assert dropped[k] == pytest.approx(want)
    again = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert [x.selective_saved_bytes for x in again.layers] == [x.selective_saved_bytes for x in prof.layers]
    with pytest.raises(FormatError, match="selective_saved_bytes"):
        LayerProfile("b", saved_bytes=10.0, selective_saved_bytes=11.0)
