"""How wrong is the projection between GPU types? Leave-one-type-out on Sailor's OPT-350M.

Data: Sailor's per-layer profiles of OPT-350M (26 layers) on seven GPU types, at every
micro-batch size and tensor-parallel degree Sailor measured (130 configurations).

For each GPU type T (the *target*), the operator model's constants are fitted on the six
other types only (``partitioner.projection.fit.leave_one_type_out``; the structure too: math
mode and activation recomputation are chosen by the fit's loss on those six types), then
every layer of every configuration of T is projected from each other type that measured the
same configuration (``partitioner.projection.operator_model.anchored_s``, geometric mean over the
sources) and compared with T's measurement. Nothing of T is seen by the fit. The same is done
from each single type: constants fitted on that type alone, projected to every other type.

All-reduces of tensor parallelism are priced from the interconnect, which is not a GPU
property: a source's (and a training type's) all-reduce is read off its own embedding layer
(``allreduce_from_embedding``); the target's comes from the collective model
(``partitioner.collectives``: a fixed cost per collective plus ``2 (t - 1)`` ring steps on the
link the target's GPUs have, NVLink or PCIe from their link facts, with constants fitted on the
other six types' all-reduces, ``loto_collectives``), from Sailor's NCCL bandwidth fits (the
old way, independent of the layer times), or, as an upper bound of what the method can do when
the target's all-reduce is known, from the target's own embedding layer (the embedding is then
left out of the figures).

Error of a layer: |projected / measured - 1| of its forward + backward time; whole model:
the same of the sum over the 26 layers. The old per-layer roofline projection
(``partitioner.projection.roofline``) is shown for comparison.

    python bench/projection_error.py [--sailor DIR] [--out results.md] [--png plot.png]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._machine import machine_line  # noqa: E402
from partitioner._io import atomic_write_text  # noqa: E402
from partitioner.collectives import CollectiveModel, GroupAllReduce  # noqa: E402
from partitioner.projection.collective_fit import CollectivePoint  # noqa: E402
from partitioner.projection.evaluation import (  # noqa: E402
    SAILOR_TYPES,
    LayerResult,
    SailorConfig,
    allreduce_from_embedding,
    class_errors,
    collective_points,
    declared_choice,
    evaluate,
    loto_collectives,
    loto_fits,
    sailor_node_bytes_per_s,
    single_source_fits,
    structures,
)
from partitioner.projection.operator_model import AllReduce  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"


def nccl_s(curves: dict[str, Any], sailor_name: str, g: int, nbytes: float) -> float | None:
    """An all-reduce of ``nbytes`` over ``g`` GPUs from Sailor's intra-node NCCL fits: bus bandwidth
    ``a x^2 + b x + c`` GB/s at x = log2(MB), capped; it moves ``2 (g - 1) / g n`` bytes at it (no
    latency term). None where Sailor has no fit for the type and group."""
    curve = curves.get(sailor_name)
    if not curve or str(g) not in curve:
        return None
    (a, b, k), cap = curve[str(g)]
    x = math.log2(nbytes / 1e6)
    bus = max(min((a * x * x + b * x + k) * 1e9, float(cap)), 1e6)
    return nbytes * 2 * (g - 1) / g / bus


def nccl_comm(curves: dict[str, Any]) -> Callable[[SailorConfig], AllReduce | None]:
    """The target's all-reduce from Sailor's intra-node NCCL fits (:func:`nccl_s`), at the
    configuration's message size."""
    def comm(c: SailorConfig) -> AllReduce | None:
        nbytes = c.message_bytes * 4
        seconds = nccl_s(curves, c.sailor_name, c.tensor_parallel, nbytes) if c.tensor_parallel > 1 else None
        return None if seconds is None else AllReduce({c.tensor_parallel: ((nbytes, seconds),)})
    return comm


def model_comm(models: dict[str, CollectiveModel],
               node: dict[str, float]) -> Callable[[SailorConfig], GroupAllReduce | None]:
    """The target's all-reduce from the collective model fitted without it (``models[target]``),
    on the link its node has."""
    def comm(c: SailorConfig) -> GroupAllReduce | None:
        if c.tensor_parallel == 1:
            return None
        return GroupAllReduce(models[c.gpu_type], c.gpu_type, node.get(c.gpu_type, 0.0))
    return comm


def collective_rows(points: Sequence[CollectivePoint], models: dict[str, CollectiveModel],
                    curves: dict[str, Any]) -> list[str]:
    """The all-reduces alone: per held-out type and group size, the link, the measured all-reduces
    (read off the embedding) against the collective model fitted without the type, and against
    the NCCL fits."""
    rows = ["", "**Tensor-parallel all-reduces alone, read off each type's embedding layer, against the collective "
            "model fitted on the six other types and against Sailor's NCCL fits (predicted / measured, median and "
            "range over the message sizes)**", "",
            "| target | GPUs | link (peak per direction) | messages | collective model | NCCL fits |", "|---|---|---|---|---|---|"]
    names = {v: k for k, v in SAILOR_TYPES.items()}
    for t in sorted({p.gpu_type for p in points}):
        for g in sorted({p.group for p in points if p.gpu_type == t}):
            mine = [p for p in points if p.gpu_type == t and p.group == g]
            link = mine[0].link
            ours = [models[t].allreduce_s(p.nbytes, g, p.link) / p.seconds for p in mine]
            old = [x / p.seconds for p in mine if (x := nccl_s(curves, names.get(t, t), g, p.nbytes)) is not None]
            rows.append(f"| {t} | {g} | {link.link_class} ({link.peak_bytes_per_s / 1e9:g} GB/s) | "
                        f"{min(p.nbytes for p in mine) / 2**20:.0f}-{max(p.nbytes for p in mine) / 2**20:.0f} MiB | "
                        f"{_ratios(ours)} | {_ratios(old)} |")
    return rows


def _ratios(x: Sequence[float]) -> str:
    return f"{np.median(x):.2f} ({min(x):.2f}-{max(x):.2f})" if x else "-"


def collective_tables(colls: dict[str, CollectiveModel], points: Sequence[CollectivePoint],
                      res_new: Sequence[LayerResult], res: Sequence[LayerResult], curves: dict[str, Any]) -> list[str]:
    """The collective model's constants per fold, tensor parallel 2-8 with it and with the NCCL fits,
    every configuration by degree with each, and the all-reduces alone."""
    lines = ["", "Collective model per held-out type (fitted on the six other types' all-reduces; per link class: "
             "fixed cost per all-reduce, latency per ring step, share of the link's peak):", ""]
    for t, m in colls.items():
        lines.append(f"- {t}: " + "; ".join(f"{k} {c.fixed_s * 1e6:.0f} us + {c.step_s * 1e6:.1f} us/step, "
                                            f"{c.fraction:.3f} of peak" for k, c in sorted(m.constants.items())))
    lines += table("Leave-one-type-out, tensor parallel 2-8, target all-reduce from the collective model (fitted on "
                   "the six other types)", [r for r in res_new if r.tensor_parallel > 1], "target")
    lines += table("Leave-one-type-out, tensor parallel 2-8, target all-reduce from Sailor's NCCL fits (the old way)",
                   [r for r in res if r.tensor_parallel > 1], "target")
    lines += table("Leave-one-type-out, every configuration (collective model for tensor parallel > 1)", res_new,
                   "target")
    lines += table("Leave-one-type-out, every configuration (NCCL fits for tensor parallel > 1, the old way)", res,
                   "target")
    lines += table("Leave-one-type-out, every configuration, by tensor-parallel degree (collective model)", res_new,
                   "tensor_parallel")
    lines += table("Leave-one-type-out, every configuration, by tensor-parallel degree (NCCL fits, the old way)", res,
                   "tensor_parallel")
    return lines + collective_rows(points, colls, curves)


def own_comm(configs: Sequence[SailorConfig]) -> Callable[[SailorConfig], AllReduce | None]:
    """The target's all-reduce read off its own embedding layer (an upper bound: target data)."""
    own = {t: allreduce_from_embedding([c for c in configs if c.gpu_type == t])
           for t in {c.gpu_type for c in configs}}
    return lambda c: own[c.gpu_type] if c.tensor_parallel > 1 else None


def old_method(configs: Sequence[SailorConfig], sailor: Path) -> list[tuple[str, int, float]]:
    """The per-layer roofline projection (partitioner.projection.roofline) on the same configurations:
    (target, tensor-parallel degree, per-layer error) from every other type."""
    from partitioner.importers.sailor import import_sailor
    from partitioner.profile import LayerProfile, Profile
    from partitioner.projection.roofline import project_profile

    out: list[tuple[str, int, float]] = []
    by = {(c.gpu_type, c.micro_batch_size, c.tensor_parallel): c for c in configs}
    names = {c.gpu_type: c.sailor_name for c in configs}
    for (g, b, t), tgt in by.items():
        srcs = [c for (g2, b2, t2), c in by.items() if g2 != g and (b2, t2) == (b, t)]
        for src in srcs:
            prof = import_sailor(sailor, micro_batch_size=b, tensor_parallel=t, gpu_types=(names[src.gpu_type],),
                                 clip_noise=False)
            key = prof.gpu_types[0]
            one = Profile(prof.model, b, tuple(LayerProfile(x.name, x.flops, x.param_bytes, x.saved_bytes,
                                                            x.output_bytes, {src.gpu_type: x.times[key]})
                                               for x in prof.layers), prof.dtype)
            proj = project_profile(one, [g], extra={src.gpu_type: src.device, g: tgt.device})
            got = np.array([x.times[g].total_s for x in proj.layers])
            real = np.array(tgt.fwd_s) + np.array(tgt.bwd_s)
            out += [(g, t, float(e)) for e in np.abs(got / real - 1)]
    return out


# -- tables ------------------------------------------------------------------------------------


def _pct(x: Sequence[float], q: float) -> str:
    return f"{100 * np.percentile(x, q):.1f}" if len(x) else "-"


def _whole(results: Sequence[LayerResult]) -> list[float]:
    groups: dict[tuple[str, str, int, int], list[LayerResult]] = {}
    for r in results:
        groups.setdefault((r.target, r.source, r.micro_batch_size, r.tensor_parallel), []).append(r)
    return [abs(sum(r.projected_s for r in g) / sum(r.measured_s for r in g) - 1) for g in groups.values()]


def summary_rows(results: Sequence[LayerResult], key: str, skip_embedding: bool) -> list[str]:
    rows = []
    labels = sorted({getattr(r, key) for r in results})
    for label in [*labels, "all"]:
        sel = [r for r in results if label == "all" or getattr(r, key) == label]
        lay = [r.error for r in sel if not (skip_embedding and r.layer == 0)]
        pure = [r.error_alone for r in sel if not (skip_embedding and r.layer == 0)]
        whole = _whole(sel)
        rows.append(f"| {label} | {len(lay)} | {_pct(lay, 50)} | {_pct(lay, 90)} | {_pct(whole, 50)} | "
                    f"{_pct(whole, 100)} | {_pct(pure, 50)} |")
    return rows


HEAD = ("| {k} | layers | layer median % | layer p90 % | whole-model median % | whole-model worst % | "
        "model alone, layer median % |\n|---|---|---|---|---|---|---|")


def table(title: str, results: Sequence[LayerResult], key: str, skip_embedding: bool = False) -> list[str]:
    return ["", f"**{title}**", "", HEAD.format(k=key.replace("_", " ")),
            *summary_rows(results, key, skip_embedding)]


def old_rows(old: Sequence[tuple[str, int, float]], types: Sequence[str]) -> list[str]:
    """The old per-layer roofline's errors (:func:`old_method`) per target."""
    lines = ["", "**Old per-layer roofline projection (partitioner.projection.roofline), same configurations, from each "
             "other type**", "", "| target | TP 1 layer median % | TP 1 layer p90 % | all layer median % |",
             "|---|---|---|---|"]
    for t in [*types, "all"]:
        e1 = [e for g, tp, e in old if (t == "all" or g == t) and tp == 1]
        ea = [e for g, tp, e in old if t == "all" or g == t]
        lines.append(f"| {t} | {_pct(e1, 50)} | {_pct(e1, 90)} | {_pct(ea, 50)} |")
    return lines


def pipedream_check(directory: Path, cal: Any) -> list[str]:
    """PipeDream's per-layer V100 profiles (one GPU type, so nothing to project between): the
    operator model alone, with constants fitted on Sailor's other six types, against the measured
    forward + backward time of every node it can decompose (convolutions, linear layers,
    pooling, batch norm, ReLU, dropout)."""
    from partitioner.cluster import resolve_gpu_type
    from partitioner.importers.pipedream import parse_graph
    from partitioner.projection.operator_model import Rates, layer_time_s
    from partitioner.projection.operators import module_ops

    rates = Rates.of(resolve_gpu_type("V100-SXM2-16GB"), "fp32")
    rows = ["", "**PipeDream's V100 profiles: the operator model alone (constants fitted on Sailor's six other "
            "types, FP32), per node forward + backward**", "",
            "| model | batch | nodes | node median % | node p90 % | sum of those nodes % | of the measured total |",
            "|---|---|---|---|---|---|---|"]
    for path in sorted(directory.glob("*.txt")):
        nodes, edges = parse_graph(path.read_text())
        inputs = [n for n in nodes.values() if n.is_input]
        batch = max(1, round(inputs[0].activation_bytes / (3 * 224 * 224 * 4))) if inputs else 1
        preds: dict[str, list[str]] = {}
        for a, b in edges:
            preds.setdefault(b, []).append(a)
        got, real, total = [], [], 0.0
        for nid, node in nodes.items():
            total += node.fwd_s + node.bwd_s if not node.is_input else 0.0
            in_elems = sum(nodes[p].activation_bytes for p in preds.get(nid, [])) / 4
            ops = module_ops(node.description, in_elems, node.activation_bytes / 4, batch)
            if not ops or node.fwd_s + node.bwd_s <= 0 or node.is_input:
                continue
            got.append(sum(layer_time_s(ops, rates, cal.params, ph, waves=cal.waves) for ph in ("fwd", "bwd")))
            real.append(node.fwd_s + node.bwd_s)
        if not got:
            rows.append(f"| {path.stem} | {batch} | 0 | - | - | - | not decomposed (LSTM cells) |")
            continue
        e = np.abs(np.array(got) / np.array(real) - 1)
        rows.append(f"| {path.stem} | {batch} | {len(got)} | {100 * np.median(e):.1f} | {100 * np.percentile(e, 90):.1f} | "
                    f"{100 * (sum(got) / sum(real) - 1):+.1f} | {100 * sum(real) / total:.0f} % |")
    return rows


def _shown(path: Path) -> str:
    """A data path relative to the checkout's parent (``shared/data/...``) when it is under it."""
    for base in (ROOT.parent, ROOT.parent.resolve()):
        try:
            return str(path.relative_to(base))
        except ValueError:
            continue
    return str(path)


def within(results: Sequence[LayerResult], cls: dict[str, float]) -> float:
    """Share of layers whose error is within twice the expected error of their op mix."""
    exp = np.array([sum(r.mix[k] * cls[k] for k in cls) for r in results])
    return float(np.mean(np.array([r.error for r in results]) <= 2 * exp))


def plot(panels: Sequence[tuple[str, Sequence[LayerResult]]], path: str) -> None:
    """Projected against measured per layer, one panel per (title, results), log axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 5.2))
    for ax, (title, sel) in zip(axes, panels, strict=True):
        for t in sorted({r.target for r in sel}):
            xs = [r.measured_s * 1e3 for r in sel if r.target == t]
            ys = [r.projected_s * 1e3 for r in sel if r.target == t]
            ax.scatter(xs, ys, s=5, label=t, alpha=0.55)
        lo = min(r.measured_s for r in sel) * 1e3 / 2
        hi = max(r.measured_s for r in sel) * 1e3 * 2
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        for f in (0.85, 1.15):
            ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.6)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured forward + backward per layer, ms")
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("projected, ms")
    axes[0].legend(fontsize=7, loc="upper left")
    fig.suptitle("OPT-350M per layer, each GPU type projected from the others with constants fitted without it "
                 "(Sailor's seven types); dotted: +-15 %", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sailor", default=str(SHARED / "sailor_opt350"))
    ap.add_argument("--network", default=str(SHARED / "sailor_validation" / "network" / "intra_node_bandwidths.json"))
    ap.add_argument("--pipedream", default=str(SHARED / "pipedream"))
    ap.add_argument("--math", default="fp32,tf32,fp16", help="math modes the fit may choose from")
    ap.add_argument("--recompute", default="both", choices=("both", "on", "off"))
    ap.add_argument("--no-waves", action="store_true", help="no GEMM tile/wave quantisation")
    ap.add_argument("--train-tp", default="1", help="tensor-parallel degrees the constants are fitted on")
    ap.add_argument("--out", default=None, help="also write the tables to this markdown file")
    ap.add_argument("--png", default=None, help="write the projected-against-measured plot here")
    args = ap.parse_args()
    t0 = time.perf_counter()
    sailor = Path(args.sailor)
    if not sailor.is_dir():
        sailor = ROOT / "tests" / "data" / "sailor_opt350"
    maths = tuple(args.math.split(","))
    recompute = {"both": (False, True), "on": (True,), "off": (False,)}[args.recompute]
    structs = structures(sailor, maths, recompute)
    configs = next(iter(structs.values()))
    net = Path(args.network)
    curves = json.loads(net.read_text()) if net.exists() else {}
    curves = curves.get("intra", curves)
    kw: dict[str, Any] = {"train_tp": tuple(int(x) for x in args.train_tp.split(",")), "maths": maths,
                          "waves": not args.no_waves}
    fits = loto_fits(structs, **kw)
    node = sailor_node_bytes_per_s(net) if net.exists() else {}
    points = collective_points(configs, node)
    colls = loto_collectives(points)
    res_new = evaluate(structs, fits, model_comm(colls, node))
    res = evaluate(structs, fits, nccl_comm(curves))
    res_own = evaluate(structs, fits, own_comm(configs))
    pairs = evaluate(structs, fits, nccl_comm(curves), by="pair")
    pairs_new = evaluate(structs, fits, model_comm(colls, node), by="pair")
    # one type alone cannot tell the math mode or recomputation (a V100 has no TF32 to tell FP32 from),
    # so the strict single-type fits take the structure the leave-one-type-out fits chose, as declared
    declared = declared_choice(fits)
    one = {k: v for k, v in structs.items() if k == declared[1]}
    singles = single_source_fits(one, **{**kw, "maths": (declared[0],)})
    single = evaluate(one, singles, nccl_comm(curves), by="source")
    old = old_method(configs, sailor)
    types = sorted({c.gpu_type for c in configs})
    lines = [f"# Projection error on Sailor's OPT-350M ({len(configs)} configurations of {len(types)} GPU types)", "",
             f"Machine: {machine_line()}. Data: {_shown(sailor)} (and {_shown(Path(args.pipedream))}, "
             f"{_shown(net)}).", "",
             "Sailor's names -> catalog types: " + ", ".join(f"{c.sailor_name} -> {c.gpu_type}"
                                                            for c in {c.gpu_type: c for c in configs}.values()), "",
             f"Constants fitted on tensor-parallel degrees {args.train_tp}. Chosen per held-out type "
             "(math mode, element type and recomputation; fitted constants):", ""]
    for t, (cal, key) in fits.items():
        p = cal.params
        lines.append(f"- {t}: {cal.math}, {key}: GEMM {p.gemm_tensor_fraction:.2f} of tensor-core peak / "
                     f"{p.gemm_cuda_fraction:.2f} of FP32 peak, batched x{p.bgemm_factor:.2f}, memory "
                     f"{p.memory_fraction:.2f} (soft-max x{p.softmax_factor:.2f}), launch {p.launch_s * 1e6:.1f} us, "
                     f"per pass {p.layer_fwd_s * 1e6:.0f}/{p.layer_bwd_s * 1e6:.0f} us")
    tp1 = [r for r in res if r.tensor_parallel == 1]
    lines += table("Leave-one-type-out, tensor parallel 1 (compute only)", tp1, "target")
    lines += collective_tables(colls, points, res_new, res, curves)
    lines += table("Leave-one-type-out, tensor parallel 2-8, target all-reduce read off its own embedding "
                   "(embedding left out)", [r for r in res_own if r.tensor_parallel > 1], "target", skip_embedding=True)
    known = tp1 + [r for r in res_own if r.tensor_parallel > 1 and r.layer > 0]
    lines += table("Leave-one-type-out, every configuration, target all-reduce read off its own embedding "
                   "(embedding left out at tensor parallel > 1)", known, "target")
    lines += table("From one measured type to every other, tensor parallel 1 (constants fitted without the target, "
                   "anchored on that one type)", [r for r in pairs if r.tensor_parallel == 1], "source")
    lines += table("From one measured type to every other, every configuration (as above; collective model)",
                   pairs_new, "source")
    lines += table("From one measured type to every other, every configuration (as above; NCCL fits)", pairs,
                   "source")
    lines += table(f"From one measured type (constants fitted on it alone, structure declared: {declared[0]}, "
                   f"{declared[1]}) to every other, tensor parallel 1",
                   [r for r in single if r.tensor_parallel == 1], "source")
    lines += table("From one measured type (constants fitted on it alone) to every other, every configuration "
                   "(NCCL fits)", single, "source")
    lines += old_rows(old, types)
    pairs1 = [r for r in pairs if r.tensor_parallel == 1]
    pd = Path(args.pipedream)
    if pd.is_dir():
        lines += pipedream_check(pd, fits["V100-SXM2-16GB"][0])
    cls = class_errors(pairs1)
    lines += ["", "Expected error per class of a layer's time (non-negative least squares of the single-source "
              "leave-one-type-out errors, tensor parallel 1, on each layer's op mix; what `profile project` "
              "reports): " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in cls.items())
              + f"; {100 * within(pairs1, cls):.0f} % of those layers are within twice their expected error, "
              f"{100 * within(pairs1, {k: v / 2 for k, v in cls.items()}):.0f} % within it.",
              "", f"({time.perf_counter() - t0:.1f} s)"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        atomic_write_text(args.out, text)
    if args.png:
        plot([("tensor parallel 1", tp1),
              ("tensor parallel 2-8, target all-reduce from the collective model",
               [r for r in res_new if r.tensor_parallel > 1]),
              ("tensor parallel 2-8, target all-reduce known", [r for r in known if r.tensor_parallel > 1])],
             args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
