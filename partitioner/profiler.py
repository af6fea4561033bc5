"""Measure a layer chain with torch: per-layer time, FLOPs and memory -> :class:`Profile`.

For every layer, on the local device (CPU, or CUDA when asked):

* forward and backward time: warm-up runs, then repeated runs, the median kept (CUDA
  events on GPU, ``time.perf_counter`` on CPU). The layer's input requires a gradient,
  so backward is real (it computes the input gradient as a pipeline stage must). For the
  zero-bubble schedules each timed pass also runs the backward split in two after a second
  forward: ``torch.autograd.grad`` w.r.t. the input (keeping the graph: ``I``), then
  ``torch.autograd.backward`` with ``inputs=`` the parameters (``W``); the weight-gradient share
  ``W / (I + W)`` of the medians is recorded as ``LayerTime.bwd_weight_share`` (0 for a layer
  without parameters);
* FLOPs: one fvcore trace of the whole chain, split per layer with ``by_module()``.
  fvcore counts one per multiply-add; the profile records ``2 x`` that (FLOPs of the
  forward pass). Operators fvcore cannot count are counted per layer and reported in
  ``Profile.meta["unsupported_ops"]``; they do not stop the profile;
* ``param_bytes``: bytes of the layer's parameters;
* ``saved_bytes``: the bytes autograd really keeps for backward, caught with
  ``torch.autograd.graph.saved_tensors_hooks``; storages are de-duplicated (a view and
  its base count once) and parameters are left out (they are in ``param_bytes``);
* ``output_bytes``: the boundary tensor sent to the next stage.

:func:`analyze_layers` does the same except timing and works on the ``meta`` device,
so shapes, FLOPs and memory of big models are known without allocating them.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .errors import PartitionerError
from .profile import LayerProfile, LayerTime, Profile
from .progress import Progress, duration, is_silenced, note

__all__ = ["LayerStats", "analyze_layers", "available_memory_bytes", "device_label", "half_input", "profile_model", "saved_tensor_bytes"]

log = logging.getLogger(__name__)

LayerList = Sequence[tuple[str, nn.Module]]


@dataclass(frozen=True)
class LayerStats:
    """What is known about one layer without timing it."""

    name: str
    flops: float
    param_bytes: float
    saved_bytes: float
    output_bytes: float
    unsupported_ops: dict[str, int]
    shared_saved_bytes: float = 0.0


def _as_layer_list(layers: nn.Sequential | Iterable[Any]) -> list[tuple[str, nn.Module]]:
    if isinstance(layers, nn.Sequential):
        return list(layers.named_children())
    out: list[tuple[str, nn.Module]] = []
    for i, item in enumerate(layers):
        if isinstance(item, nn.Module):
            out.append((str(i), item))
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], nn.Module):
            out.append((str(item[0]), item[1]))
        else:
            raise PartitionerError(f"layer {i} is {type(item).__name__}; expected an nn.Module or (name, nn.Module)")
    if not out:
        raise PartitionerError("the model has no layers")
    names = [n for n, _ in out]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise PartitionerError(f"layer name '{dup}' appears twice; layer names must be unique")
    return out


def device_label(device: torch.device | str) -> str:
    """A readable name of the device that took a measurement ("cpu", "cuda:NVIDIA H100 ...")."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    return dev.type


def available_memory_bytes(device: torch.device | str) -> float:
    """Free memory on ``device`` (CUDA: free device memory; CPU: available RAM)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return float(free)
    if dev.type == "meta":
        return float("inf")
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return float("inf")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _out_tensor(y: Any, name: str) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise PartitionerError(f"layer '{name}' returned {type(y).__name__}; a chain layer must return one tensor")
    return y


def saved_tensor_bytes(layer: nn.Module, x: torch.Tensor, name: str = "layer") -> tuple[torch.Tensor, int]:
    """Forward ``layer`` on ``x`` with grad, returning the output and the bytes autograd
    keeps for backward (storages de-duplicated, the module's parameters left out)."""
    y, storages = saved_storages(layer, x, name)
    return y, sum(storages.values())


class _SharedSaved:
    """Tells, layer after layer of a chain, how many of a layer's saved bytes the previous layer
    saved too: its input's storage, when the previous layer kept that tensor as its output."""

    def __init__(self) -> None:
        self._prev_out: int | None = None  # storage of the previous output, if it was saved

    def step(self, x: torch.Tensor, y: torch.Tensor, storages: dict[int, int]) -> int:
        key = _storage_key(x)
        shared = storages.get(key, 0) if key == self._prev_out else 0
        out = _storage_key(y)
        self._prev_out = out if out in storages else None
        return shared


def saved_storages(layer: nn.Module, x: torch.Tensor, name: str = "layer") -> tuple[torch.Tensor, dict[int, int]]:
    """Like :func:`saved_tensor_bytes`, with the saved storages themselves: ``{storage: bytes}``."""
    params = {_storage_key(p) for p in layer.parameters()}
    seen: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # keep storages alive so their keys are not reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key not in params and key not in seen:
            seen[key] = t.untyped_storage().nbytes()
            keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = _out_tensor(layer(x), name)
    return y, seen


def _selective_saved(layer: nn.Module, x: torch.Tensor, name: str, saved: int) -> float | None:
    """What ``layer`` saves for backward with its attention core recomputed (its modules with a
    ``recompute_core`` switch set for one forward, as the runtime sets them for selective
    recomputation; at most ``saved``, what it saves without), or None for a layer without one."""
    cores = [m for m in layer.modules() if hasattr(m, "recompute_core")]
    if not cores:
        return None
    before = [m.recompute_core for m in cores]
    try:
        for m in cores:
            setattr(m, "recompute_core", True)  # noqa: B010 - any module with the switch
        y, storages = saved_storages(layer, x, name)
        del y
    finally:
        for m, b in zip(cores, before, strict=True):
            setattr(m, "recompute_core", b)  # noqa: B010
    return float(min(sum(storages.values()), saved))


def _grad_input(x: torch.Tensor) -> torch.Tensor:
    x = x.detach()
    if x.is_floating_point():
        x.requires_grad_(True)
    return x


def _flops_by_layer(layers: LayerList, x: torch.Tensor) -> tuple[dict[str, float], dict[str, dict[str, int]]]:
    from fvcore.nn import FlopCountAnalysis

    keys = [f"layer{i}" for i in range(len(layers))]  # module names may not contain dots
    seq = nn.Sequential(OrderedDict(zip(keys, (m for _, m in layers), strict=False)))
    with torch.no_grad():
        fa = FlopCountAnalysis(seq, (x.detach(),))
        fa.unsupported_ops_warnings(False)
        fa.uncalled_modules_warnings(False)
        fa.tracer_warnings("none")
        by_module = fa.by_module()
        unsupported = {name: dict(fa.unsupported_ops(k)) for k, (name, _) in zip(keys, layers, strict=False)}
    return {name: 2.0 * float(by_module.get(k, 0)) for k, (name, _) in zip(keys, layers, strict=False)}, unsupported


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _estimate(chain: LayerList, x: torch.Tensor, timer: _Timer, warmup: int, repeats: int, budget_s: float,
              min_time_s: float) -> tuple[float, float, float]:
    """Seconds profiling ``chain`` will take, its parameter bytes, and the largest bytes one layer
    adds while it is timed (its gradients, input, saved tensors, output and output gradient).

    From one forward pass with grad, layer by layer (backward taken as twice the forward), and
    the run counts :func:`_time_layer` would choose for such times: an estimate."""
    total_s = 0.0
    params = 0.0
    work = 0.0
    for name, layer in chain:
        xi = _grad_input(x)
        tf, (y, storages) = timer.time(saved_storages, layer, xi, name)
        p = float(sum(_nbytes(q) for q in layer.parameters()))
        params += p
        work = max(work, p + _nbytes(xi) + sum(storages.values()) + 2 * _nbytes(y))
        x = y.detach()
        del y, xi, storages
        t = max(3 * tf, 1e-6)
        w = min(warmup, 1) if t > budget_s / 4 else warmup
        n = repeats if t * repeats >= min_time_s else min(20 * repeats, max(repeats, math.ceil(min_time_s / t)))
        n = min(n, 1 if t > budget_s else max(3, math.ceil(budget_s / t)))
        total_s += (w + n + 0.5) * t
    return total_s, params, work


def analyze_layers(layers: nn.Sequential | Iterable[Any], sample_input: torch.Tensor, *,
                   count_flops: bool = True) -> list[LayerStats]:
    """FLOPs, parameter, saved and output bytes of every layer, without timing.

    Works on any device, including ``meta`` (nothing is allocated there); fvcore's trace
    of convolutions fails on ``meta`` in current torch, so for CNNs count FLOPs on a real
    device (or pass ``count_flops=False`` for memory only: FLOPs are then 0).
    """
    chain = _as_layer_list(layers)
    if count_flops:
        flops, unsupported = _flops_by_layer(chain, sample_input)
    else:
        flops, unsupported = {n: 0.0 for n, _ in chain}, {n: {} for n, _ in chain}
    out = []
    x = sample_input
    shared = _SharedSaved()
    for name, layer in chain:
        xi = _grad_input(x)
        y, storages = saved_storages(layer, xi, name)
        out.append(LayerStats(name, flops[name], float(sum(_nbytes(p) for p in layer.parameters())),
                              float(sum(storages.values())), float(_nbytes(y)), unsupported[name],
                              float(shared.step(xi, y, storages))))
        x = y.detach()
        del y, xi
    return out


def half_input(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``x`` converted to ``dtype`` for a half-precision profile, unless it carries integers that
    ``dtype`` cannot hold exactly (token ids as floats: float16 is exact only up to 2,048)."""
    if dtype is None or not x.is_floating_point():
        return x
    y = x.to(dtype)
    if torch.equal(x, x.round()) and not torch.equal(y.to(x.dtype), x):
        return x
    return y


def _is_oom(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text or "can't allocate" in text


class _Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def time(self, fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
        """Seconds ``fn(*args)`` takes on the device, and its result."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn(*args)
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end) / 1e3, result
        t0 = time.perf_counter()
        result = fn(*args)
        return time.perf_counter() - t0, result


def _time_layer(layer: nn.Module, x: torch.Tensor, name: str, timer: _Timer, warmup: int, repeats: int,
                budget_s: float, min_time_s: float = 0.0) -> tuple[float, float, int, float | None]:
    """Median forward and backward seconds of ``layer`` on input ``x``, the runs used, and the
    weight-gradient share of the split backward (``W / (I + W)`` of their medians; None when the
    output takes no gradient).

    Runs ``warmup`` untimed then ``repeats`` timed forward+backward passes, and more (up to
    ``20 * repeats``) until the timed passes add up to ``min_time_s``, so that a layer of a
    fraction of a millisecond gets enough samples for a stable median. A slow layer spends
    at most about ``budget_s``: warm-up stops after one pass that took longer than
    ``budget_s / 4``, and timing stops after 3 passes (or 1 pass that alone took longer
    than ``budget_s``) once the timed passes add up to ``budget_s``.
    """
    fwd: list[float] = []
    bwd: list[float] = []
    b_in: list[float] = []
    b_w: list[float] = []
    params = [p for p in layer.parameters() if p.requires_grad]
    grad_out: torch.Tensor | None = None
    done_warmup = 0
    while True:
        tf, y = timer.time(layer, x)
        y = _out_tensor(y, name)
        tb = 0.0
        if y.requires_grad:
            if grad_out is None:
                g = torch.Generator().manual_seed(1)
                grad_out = torch.randn(y.shape, generator=g, dtype=y.dtype).to(y.device)
            tb, _ = timer.time(torch.autograd.backward, y, grad_out)
            y = _out_tensor(layer(x), name)  # again, for the split: I, then W
            ti = (timer.time(functools.partial(torch.autograd.grad, retain_graph=True, allow_unused=True),
                             y, x, grad_out)[0] if x.requires_grad else 0.0)  # integer input (token ids): no I
            tw = (timer.time(functools.partial(torch.autograd.backward, inputs=params), y, grad_out)[0]
                  if params else 0.0)
            b_in.append(ti)
            b_w.append(tw)
        del y
        x.grad = None
        for p in params:
            p.grad = None
        if done_warmup < warmup:
            done_warmup = warmup if tf + tb > budget_s / 4 else done_warmup + 1
            continue
        fwd.append(tf)
        bwd.append(tb)
        total = sum(fwd) + sum(bwd)
        if total > budget_s and (len(fwd) >= 3 or tf + tb > budget_s):
            break
        if len(fwd) >= repeats and (total >= min_time_s or len(fwd) >= 20 * repeats):
            break
    share = None
    if b_in:
        i_s, w_s = statistics.median(b_in), statistics.median(b_w)
        share = w_s / (i_s + w_s) if i_s + w_s > 0 else 0.0
    return statistics.median(fwd), statistics.median(bwd), len(fwd), share


def profile_model(layers: nn.Sequential | Iterable[Any], sample_input: torch.Tensor,
                  device: torch.device | str = "cpu", *, model_name: str = "model", gpu_type: str | None = None,
                  warmup: int = 2, repeats: int = 7, layer_budget_s: float = 2.0, min_layer_time_s: float = 0.05,
                  progress: bool | None = None, seed: int = 0, threads: int | None = None,
                  meta: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> Profile:
    """Measure every layer of a chain on ``device`` and return a :class:`Profile`.

    The micro-batch size is ``sample_input.shape[0]``. Times are stored under
    ``gpu_type`` (default: the device label, e.g. ``cpu``) and marked measured, with
    ``measured_on`` naming the device that took them. Each layer runs ``warmup`` untimed
    passes, then ``repeats`` timed ones (more for a fast layer, until they add up to
    ``min_layer_time_s``), keeping the median; a slow layer stops early after about
    ``layer_budget_s`` seconds (see ``_time_layer``; the fewest and most timed runs any
    layer got are ``meta.repeats_min_used`` and ``meta.repeats_max_used``). ``dtype`` (e.g.
    ``torch.bfloat16``) converts the parameters and a floating-point input first, so the profile
    holds half-precision times and bytes (``Profile.dtype`` records it). Running out of memory
    raises :class:`PartitionerError` naming the batch size.
    """
    chain = _as_layer_list(layers)
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PartitionerError("device 'cuda' requested but torch sees no CUDA device (use `device` cpu)")
    if dev.type == "meta":
        raise PartitionerError("the meta device cannot be timed; use analyze_layers or the analytic mode")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    label = device_label(dev)
    key = gpu_type or label
    batch = int(sample_input.shape[0]) if sample_input.dim() > 0 else 1
    timer = _Timer(dev)
    try:
        for _, layer in chain:
            layer.to(device=dev, dtype=dtype)
            layer.train()
        x = half_input(sample_input.to(dev), dtype)
        flops, unsupported = _flops_by_layer(chain, x)
        out: list[LayerProfile] = []
        runs: list[int] = []
        shared = _SharedSaved()
        show = (not is_silenced()) if progress is None else (progress and not is_silenced())
        expected_s = None
        if show:
            expected_s, param_bytes, work = _estimate(chain, x, timer, warmup, repeats, layer_budget_s, min_layer_time_s)
            note(f"profile {model_name}: {len(chain)} layers on {label}, micro-batch {batch}; estimate: about "
                 f"{duration(expected_s)} and {_size(param_bytes + work)} of memory (parameters {_size(param_bytes)}, the "
                 f"largest layer's gradients and activations {_size(work)})")
        with Progress(f"profile {model_name}", len(chain), unit="layer", show=show, ticking=True,
                      expected_s=expected_s) as line:
            for i, (name, layer) in enumerate(chain):
                line.update(i, f"timing {name}: forward and backward")
                xi = _grad_input(x)
                y, storages = saved_storages(layer, xi, name)
                saved, shared_bytes = sum(storages.values()), shared.step(xi, y, storages)
                out_bytes = _nbytes(y)
                nxt = y.detach()  # the next layer's input
                del y
                f_s, b_s, n, w_share = _time_layer(layer, xi, name, timer, warmup, repeats, layer_budget_s,
                                                   min_layer_time_s)
                runs.append(n)
                out.append(LayerProfile(
                    name=name, flops=flops[name],
                    param_bytes=float(sum(_nbytes(p) for p in layer.parameters())),
                    saved_bytes=float(saved), output_bytes=float(out_bytes), shared_saved_bytes=float(shared_bytes),
                    times={key: LayerTime(f_s, b_s, projected=False, measured_on=label, bwd_weight_share=w_share)},
                    selective_saved_bytes=_selective_saved(layer, xi, name, saved)))
                x = nxt
                for p in layer.parameters():
                    p.grad = None
                log.debug("%s: fwd %.3g s, bwd %.3g s (%d runs)", name, f_s, b_s, n)
            line.update(len(chain), "done")
    except RuntimeError as exc:
        if _is_oom(exc):
            raise PartitionerError(f"micro-batch size {batch} does not fit in memory on {label} while profiling "
                                   f"'{model_name}' ({str(exc).splitlines()[0][:120]}); use a smaller batch size "
                                   "or the analytic mode") from None
        raise
    bad = {name: ops for name, ops in unsupported.items() if ops}
    if bad:
        log.warning("fvcore could not count %d operator kind(s) in %d layer(s) of %s; their FLOPs are left out "
                    "(see meta.unsupported_ops)", len({o for ops in bad.values() for o in ops}), len(bad), model_name)
    info: dict[str, Any] = {
        "measured_on": {key: label},
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "warmup": warmup,
        "repeats_max": repeats,
        "repeats_min_used": min(runs),
        "repeats_max_used": max(runs),
        "timing": "cuda events" if dev.type == "cuda" else "time.perf_counter",
        "flops": "fvcore FlopCountAnalysis.by_module, x2 (one multiply-add = 2 FLOPs), forward pass",
        "unsupported_ops": bad,
        **(meta or {}),
    }
    first = dtype or (sample_input.dtype if sample_input.is_floating_point() else torch.float32)
    kind = str(first).replace("torch.", "")
    params = [p for _, layer in chain for p in layer.parameters()]
    if params:
        kind = str(params[0].dtype).replace("torch.", "")
    return Profile(model_name, batch, tuple(out), dtype=kind, source=f"partitioner.profiler on {label}", meta=info)
