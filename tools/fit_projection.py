"""Fit the operator projection's calibration shipped with the package.

    python tools/fit_projection.py [--sailor DIR] [--network FILE] [-o partitioner/data/op_calibration.json]
        [--collectives-out partitioner/data/collectives.json]

Data: Sailor's OPT-350M per-layer profiles (eth-easl/sailor @ cf2c8e3, the seven GPU types in
``../shared/data/sailor_opt350``), tensor-parallel degree 1 (every micro-batch size). The
constants and the structure (math mode, element type, recomputation) are fitted on all seven
types; the expected error of each operator class comes from the leave-one-type-out residuals
(each type projected from each other type, with constants fitted on the six types other than
the target), anchored on the source's measurement, and from the model alone. The collective
model's constants (``partitioner/data/collectives.json``) are fitted on the all-reduces of all
seven types at tensor-parallel degrees 2-8, each read off the type's embedding layer, with the
link of each group from the GPUs' link facts and Sailor's node figures (``--network``, which tell
the bridged pairs). docs/profiling.md describes the method and the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from partitioner._io import atomic_write_text  # noqa: E402
from partitioner.projection.collective_fit import fit_collectives  # noqa: E402
from partitioner.projection.evaluation import (  # noqa: E402
    class_errors,
    collective_points,
    evaluate,
    loto_fits,
    own_allreduce,
    sailor_node_bytes_per_s,
    sailor_samples,
    structures,
)
from partitioner.projection.fit import fit_structure  # noqa: E402
from partitioner.projection.operator_model import Calibration  # noqa: E402

SHARED = ROOT.parent / "shared" / "data"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sailor", default=str(SHARED / "sailor_opt350"))
    ap.add_argument("--network", default=str(SHARED / "sailor_validation" / "network" / "intra_node_bandwidths.json"))
    ap.add_argument("-o", "--output", default=str(ROOT / "partitioner" / "data" / "op_calibration.json"))
    ap.add_argument("--collectives-out", default=str(ROOT / "partitioner" / "data" / "collectives.json"))
    args = ap.parse_args()
    structs = structures(args.sailor)
    fits = loto_fits(structs)
    # the command line projects from one measured type: the expected errors are those of single-source
    # projections, each target with constants fitted without it
    res = [r for r in evaluate(structs, fits, lambda c: None, by="pair") if r.tensor_parallel == 1]
    cands = {}
    for key, configs in structs.items():
        tp1 = [c for c in configs if c.tensor_parallel == 1]
        cands[key] = sailor_samples(tp1, own_allreduce(tp1))
    types = sorted({c.gpu_type for c in next(iter(structs.values()))})
    cal, key = fit_structure(cands, fitted_on="Sailor OPT-350M per-layer profiles (eth-easl/sailor @ cf2c8e3), "
                                             f"tensor-parallel degree 1, every micro-batch size, on {', '.join(types)}")
    cal = Calibration(cal.params, cal.math, class_errors(res), cal.waves, cal.fitted_on, cal.recompute,
                      class_errors(res, alone=True))
    text = json.dumps(cal.to_dict(), indent=1) + "\n"
    atomic_write_text(args.output, text)
    print(f"{key}, {cal.math}: {cal.params}\nclass errors {cal.class_error}, alone {cal.class_error_alone}\n"
          f"-> {args.output}")
    points = collective_points(next(iter(structs.values())), sailor_node_bytes_per_s(args.network))
    coll = fit_collectives(points, "Sailor OPT-350M all-reduces read off the embedding layer (eth-easl/sailor @ cf2c8e3), "
                                   f"tensor-parallel degrees 2-8, on {', '.join(types)}")
    atomic_write_text(args.collectives_out, json.dumps(coll.to_dict(), indent=1) + "\n")
    print(f"collectives: {coll.constants}\n-> {args.collectives_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
