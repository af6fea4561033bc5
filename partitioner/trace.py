"""Timelines you can look at: Chrome/Perfetto trace JSON, a PNG, and a short text summary.

The trace has one process per virtual worker and, per device, a compute track and a
communication track. Forward and backward are told apart by name (``F3`` / ``B3``) and
category (``forward`` / ``backward``); each micro-batch gets its colour. Open the JSON in
https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from ._io import atomic_write_bytes, write_json
from .schedule import ACTION_KINDS
from .timeline import Timeline

__all__ = ["chrome_trace", "render_png", "summary_text", "write_trace"]

# Colour names the Chrome trace viewer knows (Perfetto picks its own by name).
_CNAMES = ("thread_state_running", "rail_response", "rail_animation", "rail_idle", "rail_load",
           "thread_state_iowait", "thread_state_runnable", "good", "yellow", "olive", "generic_work",
           "startup", "heap_dump_stack_frame", "terrible", "cq_build_running", "cq_build_passed")
_CATEGORY = {"F": "forward", "B": "backward", "SEND_ACT": "send", "SEND_GRAD": "send",
             "RECV_ACT": "wait", "RECV_GRAD": "wait", "STEP": "step", "PUSH": "wsp", "PULL": "wsp"}


def chrome_trace(tl: Timeline, include_waits: bool = False) -> dict[str, Any]:
    """The timeline as a Chrome trace-event document (times in microseconds).

    Sends appear on the device's communication track for as long as the transfer takes;
    receives (time spent waiting for data) only with ``include_waits``.
    """
    events: list[dict[str, Any]] = []
    for w in sorted(set(tl.rank_worker)):
        events.append({"ph": "M", "name": "process_name", "pid": w, "args": {"name": f"virtual worker {w}"}})
    for r, dev in enumerate(tl.devices):
        pid = tl.rank_worker[r]
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 2 * r, "args": {"name": dev}})
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": 2 * r + 1,
                       "args": {"name": f"{dev} comm"}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": 2 * r, "args": {"sort_index": 2 * r}})
    kinds = [ACTION_KINDS[k] for k in tl.event_kind.tolist()]
    for rank, kind, mb, stage, start, end in zip(tl.event_rank.tolist(), kinds, tl.event_micro_batch.tolist(),
                                                 tl.event_stage.tolist(), tl.event_start_s.tolist(),
                                                 tl.event_end_s.tolist(), strict=True):
        dur = end - start
        if kind.startswith("RECV") and not include_waits:
            continue
        if kind.startswith(("SEND", "RECV")) and dur <= 0:
            continue
        comm = kind.startswith(("SEND", "RECV"))
        ev: dict[str, Any] = {
            "name": f"{kind}{mb}" if kind in ("F", "B") else kind if mb < 0 else f"{kind} {mb}",
            "cat": _CATEGORY[kind], "pid": tl.rank_worker[rank], "tid": 2 * rank + int(comm),
            "ts": start * 1e6, "args": {"micro_batch": mb, "stage": stage},
        }
        if dur > 0:
            ev.update(ph="X", dur=dur * 1e6)
        else:
            ev.update(ph="i", s="t")
        if mb >= 0:
            ev["cname"] = _CNAMES[mb % len(_CNAMES)]
        events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"schedule": tl.schedule, "iteration_s": tl.iteration_s,
                          "samples_per_s": tl.samples_per_s}}


def write_trace(tl: Timeline, path: str | os.PathLike[str], include_waits: bool = False) -> None:
    """Write :func:`chrome_trace` to ``path`` atomically."""
    write_json(path, chrome_trace(tl, include_waits))


def render_png(tl: Timeline, path: str | os.PathLike[str], width_in: float = 14.0, dpi: int = 110) -> None:
    """Draw one row per device (forward solid, backward hatched and darker; colour = micro-batch).

    The image is written atomically. Matplotlib is imported here, with the Agg backend.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(tl.devices)
    fig, ax = plt.subplots(figsize=(width_in, 0.9 + 0.45 * n))
    cmap = plt.get_cmap("tab20")
    for r in range(n):
        sel = (tl.event_rank == r) & (tl.event_kind <= 1)
        starts, ends = tl.event_start_s[sel], tl.event_end_s[sel]
        mbs, kinds = tl.event_micro_batch[sel], tl.event_kind[sel]
        for kind, alpha, hatch in ((0, 1.0, None), (1, 0.6, "//")):
            k = kinds == kind
            if not k.any():
                continue
            colours = [cmap(int(j) % 20) for j in mbs[k]]
            ax.broken_barh(list(zip(starts[k], ends[k] - starts[k], strict=True)), (r - 0.4, 0.8),
                           facecolors=colours, alpha=alpha, hatch=hatch, edgecolor="black", linewidth=0.2)
    ax.set_yticks(range(n), [f"{d} (vw {w})" for d, w in zip(tl.devices, tl.rank_worker, strict=True)])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(f"{tl.schedule}: {tl.micro_batches} micro-batches, iteration {tl.iteration_s:.4g} s, "
                 f"{tl.samples_per_s:.4g} samples/s")
    ax.legend(handles=[Patch(facecolor="grey", label="forward"),
                       Patch(facecolor="grey", alpha=0.6, hatch="//", label="backward")],
              loc="upper right", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def summary_text(tl: Timeline) -> str:
    """A few lines: iteration time, throughput, and per device bubble and peak memory."""
    lines = [
        f"schedule {tl.schedule}, {tl.micro_batches} micro-batches of {tl.micro_batch_size}, "
        f"{len(set(tl.rank_worker))} virtual worker(s), {tl.iterations} iteration(s) simulated",
        f"iteration {tl.iteration_s:.6g} s, {tl.samples_per_s:.6g} samples/s, {tl.num_events} actions",
        f"{'device':<14} {'vw':>3} {'bubble':>7} {'in flight':>9} {'versions':>8} {'peak memory':>12}",
    ]
    for r, dev in enumerate(tl.devices):
        lines.append(f"{dev:<14} {tl.rank_worker[r]:>3} {tl.bubble_fraction[dev]:>7.1%} "
                     f"{tl.peak_activations[dev]:>9} {tl.weight_versions[dev]:>8} "
                     f"{tl.peak_memory_bytes[dev] / 2**30:>8.2f} GiB")
    if tl.clock_gaps:
        lines.append(f"WSP clock gap at pulls: max {tl.max_clock_gap}, mean {np.mean(tl.clock_gaps):.2f}")
    lines += [f"note: {n}" for n in tl.notes]
    return "\n".join(lines)
