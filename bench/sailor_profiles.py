"""This profiler on a real GPU against Sailor's measured OPT-350M profiles, and projection from it.

    python bench/sailor_profiles.py [--ours bench/results/h100-2026-11-27] [--sailor DIR]

``--ours`` holds profiles of the OPT-350M shape (``gpt2-medium`` with 2,048 positions and a
vocabulary of 50,272) measured in fp16 by ``partitioner profile ... --device cuda`` at
micro-batch sizes 1, 2, 4 and 8 (``opt350_fp16_b{B}.json``; the committed ones were measured on
an NVIDIA H100 80GB HBM3, see docs/gpu.md). Two tables:

1. Per micro-batch size: the forward and backward of a transformer block (median over the 24),
   of the embedding and of the head, ours against Sailor's on GH200 (GH-96, the same Hopper GPU
   with faster memory), as times and ratios.
2. Projection: our measured profile projected to every GPU type Sailor measured, per operator
   (``partitioner.projection.operator_model``, the default of ``partitioner profile project``) and
   by the per-layer roofline (``partitioner.projection.roofline``), against Sailor's measured
   forward time of a block there. Forward only: Sailor's backward includes what
   Megatron-DeepSpeed does in backward (see docs/gpu.md).
3. Tensor parallelism, where our profiles hold shards (``--tensor-parallel``): one GPU's shard of
   a block, forward, against Sailor's GH-96 block at the same degree. Ours is the shard's compute
   alone (the cost model adds the group's all-reduces); Sailor's includes them, so the difference
   is what the all-reduces and their synchronisation cost on a GH200 node.

A size whose file is missing is left out (said in one line).

Reads files only; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from partitioner.errors import FormatError  # noqa: E402
from partitioner.importers.sailor import import_sailor  # noqa: E402
from partitioner.profile import Profile  # noqa: E402
from partitioner.projection.operator_model import project_with_ops  # noqa: E402
from partitioner.projection.roofline import is_catalog_type, project_profile  # noqa: E402

SIZES = (1, 2, 4, 8)


def parts(p: Profile, gpu: str) -> dict[str, tuple[float, float]]:
    """Forward and backward ms of the embedding, the median block and the head."""
    t = [(la.times[gpu].fwd_s * 1e3, la.times[gpu].bwd_s * 1e3) for la in p.layers]
    blocks = t[1:-1]
    return {"embedding": t[0], "block": (statistics.median(f for f, _ in blocks),
                                         statistics.median(b for _, b in blocks)), "head": t[-1]}


def measured_at(sailor: str, b: int) -> tuple[str, ...]:
    """Sailor's GPU types with times at micro-batch size ``b`` (tensor-parallel degree 1)."""
    import json

    return tuple(f.stem for f in sorted(Path(sailor).glob("*.json"))
                 if f.stem[0].isupper() and "1" in json.loads(f.read_text()).get(str(b), {}))


def load_ours(directory: str) -> dict[int, Profile]:
    """Our profiles by micro-batch size; a missing size is said and left out."""
    ours = {}
    for b in SIZES:
        path = Path(directory) / f"opt350_fp16_b{b}.json"
        if path.exists():
            ours[b] = Profile.load(path)
        else:
            print(f"(no {path.name}: micro-batch {b} left out)")
    return ours


def per_layer(ours: dict[int, Profile], sailor: str, source: str) -> None:
    print("1. per layer, ms (ours / Sailor GH-96)")
    print(f"{'mbs':>4} {'layer':>10} {'fwd ours':>9} {'fwd GH-96':>10} {'ratio':>6} "
          f"{'bwd ours':>9} {'bwd GH-96':>10} {'ratio':>6}")
    for b, prof in ours.items():
        theirs = import_sailor(sailor, micro_batch_size=b, gpu_types=("GH-96",))
        a, s = parts(prof, source), parts(theirs, theirs.gpu_types[0])
        for name in ("embedding", "block", "head"):
            (fo, bo), (fs, bs) = a[name], s[name]
            print(f"{b:>4} {name:>10} {fo:9.2f} {fs:10.2f} {fo / fs:6.2f} {bo:9.2f} {bs:10.2f} {bo / bs:6.2f}")


def projection(ours: dict[int, Profile], sailor: str, source: str) -> None:
    print(f"\n2. block forward, ms: our profile projected from {source} against Sailor's measured "
          "(median over the 24 blocks)")
    print(f"{'mbs':>4} {'GPU type':>16} {'measured':>9} {'per-op':>8} {'error':>7} {'roofline':>9} {'error':>7}")
    errors: dict[str, list[float]] = {"per-op": [], "roofline": []}
    for b, prof in ours.items():
        theirs = import_sailor(sailor, micro_batch_size=b, gpu_types=measured_at(sailor, b))
        targets = [t for t in theirs.gpu_types if is_catalog_type(t) and t != source]
        ops = project_with_ops(prof, targets, source=source)
        roof = project_profile(prof, targets, source=source)
        for t in targets:
            fm = parts(theirs, t)["block"][0]
            fo, fr = parts(ops, t)["block"][0], parts(roof, t)["block"][0]
            errors["per-op"].append(abs(fo / fm - 1))
            errors["roofline"].append(abs(fr / fm - 1))
            print(f"{b:>4} {t:>16} {fm:9.2f} {fo:8.2f} {100 * (fo / fm - 1):+6.1f}% {fr:9.2f} {100 * (fr / fm - 1):+6.1f}%")
    for method, e in errors.items():
        print(f"{method}: median error of a block's forward {100 * statistics.median(e):.1f}%, "
              f"worst {100 * max(e):.1f}% over {len(e)} (size, type) pairs")


def shards(ours: dict[int, Profile], sailor: str, source: str) -> None:
    rows = [(b, t) for b, p in ours.items() for t in p.tensor_parallel_degrees if t > 1]
    if not rows:
        return
    print("\n3. tensor parallelism: a block's forward, ms, one GPU's shard (ours: compute alone) against "
          "Sailor's GH-96 (with its all-reduces)")
    print(f"{'mbs':>4} {'tp':>3} {'ours':>7} {'GH-96':>7} {'GH-96 - ours':>13} {'ours tp1/tp':>12} {'GH-96 tp1/tp':>13}")
    for b, t in rows:
        mine = statistics.median(la.shards[t].times[source].fwd_s * 1e3 for la in ours[b].layers[1:-1])
        mine1 = parts(ours[b], source)["block"][0]
        try:
            theirs = import_sailor(sailor, micro_batch_size=b, tensor_parallel=t, gpu_types=("GH-96",))
            base = import_sailor(sailor, micro_batch_size=b, gpu_types=("GH-96",))
        except FormatError as e:  # a degree Sailor did not measure
            print(f"{b:>4} {t:>3} {mine:7.2f}   (Sailor: {e.expected.split(';')[0]})")
            continue
        gh, gh1 = parts(theirs, theirs.gpu_types[0])["block"][0], parts(base, base.gpu_types[0])["block"][0]
        print(f"{b:>4} {t:>3} {mine:7.2f} {gh:7.2f} {gh - mine:13.2f} {mine1 / mine:12.2f} {gh1 / gh:13.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ours", default=str(ROOT / "bench" / "results" / "h100-2026-11-27"))
    ap.add_argument("--sailor", default=str(ROOT.parent / "shared" / "data" / "sailor_opt350"))
    args = ap.parse_args()
    ours = load_ours(args.ours)
    if not ours:
        print(f"{args.ours}: no opt350_fp16_b*.json profile")
        return 1
    first = next(iter(ours.values()))
    measured_on = next(iter(first.meta.get("measured_on", {}).values()), "?")
    source = first.gpu_types[0]
    print(f"ours: {measured_on} ({source}), fp16, seq 2048; Sailor: OPT-350M, Megatron-DeepSpeed, fp16\n")
    per_layer(ours, args.sailor, source)
    projection(ours, args.sailor, source)
    shards(ours, args.sailor, source)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
