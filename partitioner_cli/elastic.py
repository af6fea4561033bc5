"""``partitioner train ... --local --elastic``: a rank that dies is answered by re-planning over
the devices left and resuming on the new plan, instead of ending the run.

    partitioner train plan.json --profile p.json --cluster c.yaml --model gpt2-tiny --local \\
        --checkpoint-dir ckpt --checkpoint-every 2 --elastic [--max-restarts 3]

When a process of the run dies (a signal or an exit code: the device is taken to be lost), the
steps ``partitioner train`` would otherwise print are taken here: the plan is re-planned without
the rank's GPU (the other GPUs of a tensor-parallel group are planned over again), as
``partitioner replan PLAN --without GPU`` does (:func:`partitioner_cli.replan.new_devices`,
:func:`solvers.analysis.replan.replan`: the global batch kept), the new plan is written beside the old one (``PLAN-without-DEVICE.json``), and the
run resumes on it from the last complete checkpoint (a fresh start when none was written yet),
to the step count asked for. At most ``--max-restarts`` restarts; one line says each, and the
metrics record them (``restarts``, :class:`Restart`). A rank that raised an exception is not
restarted (it would raise again on any plan), nor a run whose re-planning finds no plan: both
end with the one-line error and the commands that continue the run by hand.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar

from partitioner._io import check_outputs
from partitioner.cluster import Cluster
from partitioner.errors import PartitionerError
from partitioner.plan import Plan
from partitioner.profile import Profile
from partitioner_cli._args import as_flags

__all__ = ["DEFAULT_MAX_RESTARTS", "Restart", "plan_without", "train_elastic"]

DEFAULT_MAX_RESTARTS = 3


class Ready(Protocol):
    """A plan made ready to train (``partitioner_cli.train.Prepared``)."""

    @property
    def plan(self) -> Plan: ...
    @property
    def plan_file(self) -> str: ...
    @property
    def config(self) -> Any: ...
    @property
    def run(self) -> Any: ...


R = TypeVar("R", bound=Ready)


def plan_without(plan_file: str, device: str) -> str:
    """The file of the plan made from ``plan_file``'s without ``device``: ``plan-without-n0_1.json``."""
    root, ext = os.path.splitext(plan_file)
    return f"{root}-without-{device.replace(':', '_')}{ext or '.json'}"


@dataclass(frozen=True)
class Restart:
    """One restart of an elastic run: which attempt it began (1 = the first restart), the rank
    that died and its device, the failure's line, the seconds the failed attempt ran, the re-plan
    (its seconds, ``how``: kept / warm / full), the new plan's file and device count, and the step
    it resumed at (the last complete checkpoint's; 0: none was written)."""

    attempt: int
    rank: int
    device: str
    failure: str
    failed_after_s: float
    replan_s: float
    how: str
    plan_file: str
    devices: int
    resumed_at_step: int

    def __post_init__(self) -> None:
        if self.attempt < 1 or self.rank < 0 or self.devices < 1 or self.resumed_at_step < 0:
            raise ValueError(f"Restart: attempt {self.attempt}, rank {self.rank}, devices {self.devices}, "
                             f"resumed_at_step {self.resumed_at_step}: must be >= 1, >= 0, >= 1, >= 0")
        if not (self.failed_after_s >= 0 and self.replan_s >= 0):
            raise ValueError(f"Restart: failed_after_s {self.failed_after_s}, replan_s {self.replan_s}: must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Restart:
        return cls(**d)

    def line(self, most: int) -> str:
        """The one line that says this restart."""
        where = f"at step {self.resumed_at_step}" if self.resumed_at_step else "at step 0 (no checkpoint yet)"
        return (f"elastic restart {self.attempt} of at most {most}: {self.failure}; re-planned without "
                f"{self.device} in {self.replan_s:.3f} s ({self.how}, {self.devices} devices), wrote "
                f"{self.plan_file}; resuming {where}")


def train_elastic(args: argparse.Namespace, ready: R, profile: Profile, cluster: Cluster,
                  prepare: Callable[[Plan, str, int], R], give_up: Callable[[str, str], list[str]]
                  ) -> tuple[dict[str, Any], R]:
    """Train ``ready`` with local processes, restarting on a new plan when a rank dies (the module
    docstring); returns the last attempt's metrics, with ``restarts``, and the plan it ran.
    ``prepare(plan, plan_file, attempt)`` makes a new plan ready to resume; ``give_up(device,
    plan_file)``: the lines that continue the run by hand when it is not restarted."""
    from runtime.launch import RankFailed, train_local

    most = DEFAULT_MAX_RESTARTS if args.max_restarts is None else args.max_restarts
    restarts: list[Restart] = []
    while True:
        t0 = time.perf_counter()
        try:
            metrics = train_local(ready.plan, ready.config, run=ready.run)
        except RankFailed as err:
            device = ready.run.layout.ranks[err.rank].gpu
            if len(restarts) >= most:
                why = f"not restarted: --max-restarts {most} reached"
            elif not err.died:
                why = "not restarted: it raised, and would on any plan"
            else:
                try:
                    restart, ready = _restart(args, ready, profile, cluster, prepare, err, len(restarts) + 1,
                                              time.perf_counter() - t0)
                except PartitionerError as failed:
                    why = f"not restarted: {failed}"
                else:
                    restarts.append(restart)
                    print(restart.line(most), flush=True)
                    continue
            print("\n".join(give_up(device, ready.plan_file)), flush=True)
            raise PartitionerError(f"{err} ({why})") from None
        metrics["restarts"] = [r.to_dict() for r in restarts]
        return metrics, ready


def _restart(args: argparse.Namespace, ready: R, profile: Profile, cluster: Cluster,
             prepare: Callable[[Plan, str, int], R], err: Any, attempt: int, failed_after_s: float
             ) -> tuple[Restart, R]:
    """Re-plan ``ready``'s plan without the device of the rank that died, write the new plan,
    and prepare it to resume (refused in one line when no plan is found)."""
    from partitioner_cli.replan import new_devices
    from runtime.checkpoint import latest_complete
    from solvers.analysis.replan import replan

    device = ready.run.layout.ranks[err.rank].gpu
    devices = new_devices(ready.plan, cluster, [device], None)
    done = replan(ready.plan, profile, cluster, devices)
    if not done.result.ok:
        raise PartitionerError(f"re-planning without {device}: {done.result.status}: "
                               f"{as_flags(done.result.reason or '')}")
    new_file = plan_without(ready.plan_file, device)
    check_outputs({"--elastic": new_file}, (args.plan, args.profile, args.cluster))
    done.plan.save(new_file)
    manifest = latest_complete(args.checkpoint_dir)
    restart = Restart(attempt, err.rank, device, str(err), failed_after_s, done.time_s, done.how, new_file,
                      len(done.plan.devices), manifest.step if manifest is not None else 0)
    return restart, prepare(done.plan, new_file, attempt)
