"""How wrong is the roofline projection? Compare projected against measured times.

Data: Sailor's OPT-350 profiles (one model measured on seven GPU types). For every
ordered pair (source, target) of measured types that the catalog knows, the source's
times are projected to the target and compared per layer with the target's measured
times. Prints, per target type, the median and worst absolute % error of a layer's
forward+backward time and of the whole model's sum, for the tensor-core roof (Sailor
trains in mixed precision) and, for comparison, the FP32 roof.

    python bench/projection_error.py [--sailor DIR] [--out bench/results/projection_error.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from partitioner._io import atomic_write_text
from partitioner.importers.sailor import import_sailor
from partitioner.profile import LayerProfile, Profile
from partitioner.projection import is_catalog_type, project_profile

ROOT = Path(__file__).resolve().parents[1]


def only(p: Profile, gpu: str) -> Profile:
    return Profile(p.model, p.micro_batch_size, tuple(
        LayerProfile(x.name, x.flops, x.param_bytes, x.saved_bytes, x.output_bytes, {gpu: x.times[gpu]})
        for x in p.layers), p.dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sailor", default=str(ROOT.parent / "shared" / "data" / "sailor_opt350"))
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "projection_error.md"))
    args = ap.parse_args()
    sailor = Path(args.sailor)
    if not sailor.is_dir():
        sailor = ROOT / "tests" / "data" / "sailor_opt350"
    full = import_sailor(sailor, micro_batch_size=args.micro_batch_size)
    types = [g for g in full.gpu_types if is_catalog_type(g, None)]
    lines = [f"# Projection error on Sailor OPT-350 (micro-batch {full.micro_batch_size}, {sailor})", "",
             f"Types in the catalog: {', '.join(types)} (GH-96 is not, so it is left out).", "",
             "Absolute % error of projected vs measured forward+backward time; each target is projected "
             f"from each of the other {len(types) - 1} types.", "",
             "| target | roof | layer median % | layer worst % | model-sum median % | model-sum worst % |",
             "|---|---|---|---|---|---|"]
    summary = {}
    for precision, label in (("tensor", "tensor-core*"), ("fp32", "FP32")):
        all_layer = []
        for tgt in types:
            real = np.array([x.times[tgt].total_s for x in full.layers])
            layer_err, model_err = [], []
            for src in types:
                if src == tgt:
                    continue
                proj = project_profile(only(full, src), [tgt], precision=precision)
                got = np.array([x.times[tgt].total_s for x in proj.layers])
                layer_err.extend(100 * np.abs(got / real - 1))
                model_err.append(100 * abs(got.sum() / real.sum() - 1))
            all_layer.extend(layer_err)
            lines.append(f"| {tgt} | {label} | {np.median(layer_err):.1f} | {np.max(layer_err):.1f} | "
                         f"{np.median(model_err):.1f} | {np.max(model_err):.1f} |")
        summary[label] = (np.median(all_layer), np.max(all_layer))
    lines += ["", "*tensor-core peaks where both types have one in the catalog, FP32 peaks otherwise "
              "(RTX-3090 has no tensor-core figure there).", ""]
    for label, (med, worst) in summary.items():
        lines.append(f"All targets, {label} roof: layer median {med:.1f} %, worst {worst:.1f} %")
    text = "\n".join(lines) + "\n"
    print(text)
    atomic_write_text(args.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
