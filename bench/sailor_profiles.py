"""This profiler on a real GPU against Sailor's measured OPT-350M profiles, and projection from it.

    python bench/sailor_profiles.py [--ours bench/results/h100] [--sailor DIR]

``--ours`` holds profiles of the OPT-350M shape (``gpt2-medium`` with 2,048 positions and a
vocabulary of 50,272) measured in fp16 by ``partitioner profile ... --device cuda`` at
micro-batch sizes 1, 2, 4 and 8 (``opt350_fp16_b{B}.json``; the committed ones were measured on
an NVIDIA H100 80GB HBM3, see docs/gpu.md). Two tables:

1. Per micro-batch size: the forward and backward of a transformer block (median over the 24),
   of the embedding and of the head, ours against Sailor's on GH200 (GH-96, the same Hopper GPU
   with faster memory), as times and ratios.
2. Projection: our measured profile projected (``partitioner.projection.roofline``) to every GPU type
   Sailor measured, against Sailor's measured forward time of a block there. Forward only:
   Sailor's backward includes what Megatron-DeepSpeed does in backward (see docs/gpu.md).

Reads files only; writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from partitioner.importers.sailor import import_sailor  # noqa: E402
from partitioner.profile import Profile  # noqa: E402
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ours", default=str(ROOT / "bench" / "results" / "h100"))
    ap.add_argument("--sailor", default=str(ROOT.parent / "shared" / "data" / "sailor_opt350"))
    args = ap.parse_args()
    ours = {b: Profile.load(Path(args.ours) / f"opt350_fp16_b{b}.json") for b in SIZES}
    measured_on = next(iter(ours[1].meta.get("measured_on", {}).values()), "?")
    source = ours[1].gpu_types[0]
    print(f"ours: {measured_on} ({source}), fp16, seq 2048; Sailor: OPT-350M, Megatron-DeepSpeed, fp16\n")
    print("1. per layer, ms (ours / Sailor GH-96)")
    print(f"{'mbs':>4} {'layer':>10} {'fwd ours':>9} {'fwd GH-96':>10} {'ratio':>6} "
          f"{'bwd ours':>9} {'bwd GH-96':>10} {'ratio':>6}")
    for b in SIZES:
        theirs = import_sailor(args.sailor, micro_batch_size=b, gpu_types=("GH-96",))
        gh = theirs.gpu_types[0]
        a, s = parts(ours[b], source), parts(theirs, gh)
        for name in ("embedding", "block", "head"):
            (fo, bo), (fs, bs) = a[name], s[name]
            print(f"{b:>4} {name:>10} {fo:9.2f} {fs:10.2f} {fo / fs:6.2f} {bo:9.2f} {bs:10.2f} {bo / bs:6.2f}")

    print("\n2. block forward, ms: our profile projected from "
          f"{source} against Sailor's measured (median over the 24 blocks)")
    print(f"{'mbs':>4} {'GPU type':>16} {'projected':>10} {'measured':>9} {'error':>7}")
    errors: list[float] = []
    for b in SIZES:
        theirs = import_sailor(args.sailor, micro_batch_size=b, gpu_types=measured_at(args.sailor, b))
        targets = [t for t in theirs.gpu_types if is_catalog_type(t) and t != source]
        projected = project_profile(ours[b], targets, source=source)
        for t in targets:
            fp, fm = parts(projected, t)["block"][0], parts(theirs, t)["block"][0]
            errors.append(abs(fp / fm - 1))
            print(f"{b:>4} {t:>16} {fp:10.2f} {fm:9.2f} {100 * (fp / fm - 1):+6.1f}%")
    print(f"\nprojection error of a block's forward: median {100 * statistics.median(errors):.1f}%, "
          f"worst {100 * max(errors):.1f}% over {len(errors)} (size, type) pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
