"""``partitioner calibrate RUN...``: fit the link and overhead parameters to measured runs and
write a calibrated cluster file; report the fit's error and its leave-one-run-out error.

    partitioner calibrate runs/a runs/b runs/c --cluster my.yaml -o my_calibrated.json
    partitioner calibrate ../shared/data/sailor_validation/clariden_opt350/*.json \\
        --profiles ../shared/data/sailor_opt350 --network .../network_coeffs_all_homo.json -o clariden.json
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path

__all__ = ["register"]


def _errors(label: str, errs: Sequence[float]) -> str:
    if not errs:
        return f"{label}: no runs"
    med = statistics.median(abs(e) for e in errs)
    worst = max(errs, key=abs)
    return f"{label}: median |error| {100 * med:.1f}%, worst {100 * worst:+.1f}%"


def _run(args: argparse.Namespace) -> int:
    from partitioner._io import check_outputs, write_json
    from partitioner.calibrate import apply_params, fit, leave_one_out
    from partitioner.cluster import Cluster
    from partitioner.errors import OptionError
    from partitioner.measured import load_run

    inputs: list[str] = []
    for r in args.runs:
        p = Path(r)
        inputs += [str(p / n) for n in ("plan.json", "profile.json", "cluster.json", "metrics.json")] if p.is_dir() \
            else [r]
    inputs += [x for x in (args.cluster, args.network) if x]
    check_outputs({"-o": args.output, "--report": args.report}, inputs,
                  input_dirs=[args.profiles] if args.profiles else ())
    parameters = [x.strip() for x in args.fit.split(",") if x.strip()]
    runs = [load_run(r, args.profiles, args.network, args.shared_nics) for r in args.runs]
    base = Cluster.load(args.cluster) if args.cluster else runs[0].cluster
    calibration = fit(runs, parameters)
    print(f"fitted {', '.join(parameters)} on {len(runs)} run(s): " +
          ", ".join(f"{k} {v:.4g}" for k, v in calibration.params.to_dict().items()))
    print("  " + _errors("iteration time, in-sample", calibration.time_errors))
    if calibration.memory_errors:
        print("  " + _errors("peak memory, in-sample", calibration.memory_errors))
    report = {"parameters": calibration.params.to_dict(), "fitted": parameters,
              "runs": [{"run": n, "measured_s": m, "fit_s": p} for n, m, p in
                       zip(calibration.runs, calibration.measured_s, calibration.predicted_s, strict=True)]}
    if len(runs) >= 2 and not args.no_loo:
        loo, folds = leave_one_out(runs, parameters)
        print("  " + _errors("iteration time, leave-one-run-out", loo.time_errors))
        if loo.memory_errors:
            print("  " + _errors("peak memory, leave-one-run-out", loo.memory_errors))
        for row, pred, params in zip(report["runs"], loo.predicted_s, folds, strict=True):
            row.update({"leave_one_out_s": pred, "fold_parameters": params.to_dict()})
    elif len(runs) < 2 and not args.no_loo:
        raise OptionError("runs", len(runs), "leave-one-run-out needs two or more runs (or say --no-loo)")
    calibrated = apply_params(base, calibration.params)
    calibrated.save(args.output)
    print(f"wrote {args.output}" + (f"; reserve {calibration.params.reserved_bytes / 2**30:.2f} GiB per GPU "
                                    f"(--reserved-gb) when pricing" if calibration.params.reserved_bytes is not None
                                    else ""))
    if args.report:
        write_json(args.report, report)
        print(f"wrote {args.report}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit link and overhead parameters to measured runs",
                       description="Fit link and overhead parameters (per-send overhead, point-to-point and "
                                   "inter-node bandwidth scales) and the framework's memory to measured runs (folders as `import sailor-run -o` or `train -o` leave "
                                   "them, or Sailor run files), print the fit's error and each run's error when "
                                   "fitted without it, and write the calibrated cluster file.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run folder (plan.json, profile.json, cluster.json, "
                   "measured in the plan's meta.measured or a metrics.json) or a Sailor plan_config file")
    p.add_argument("--cluster", metavar="CLUSTER", help="the cluster file to calibrate (default: the first run's)")
    p.add_argument("--profiles", metavar="DIR", help="Sailor's profile folder (for Sailor run files)")
    p.add_argument("--network", metavar="FILE", help="Sailor's network file (for Sailor run files)")
    p.add_argument("--shared-nics", action=argparse.BooleanOptionalAction, default=True,
                   help="Sailor run files: the network with each node's GPUs sharing one NIC of the capacity measured "
                        "with them all sending, one flow at the curve measured with one GPU sending (the default); "
                        "--no-shared-nics: every flow at the curve of the node's GPU count, as Sailor prices plans")
    p.add_argument("--fit", default="p2p_bandwidth,reserved",
                   help="parameters to fit, comma separated: send_overhead (per pipeline send), p2p_bandwidth "
                        "(pipeline sends' rate over the inter-node link's), inter_bandwidth (the inter-node links), "
                        "reserved (the framework's memory per GPU); default p2p_bandwidth,reserved")
    p.add_argument("--no-loo", action="store_true", help="skip the leave-one-run-out check")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="write the calibrated cluster file here")
    p.add_argument("--report", metavar="REPORT.json", help="write the parameters and every run's errors here")
    p.set_defaults(func=_run)
