"""Timelines you can look at: Chrome/Perfetto trace JSON, a PNG, and a short text summary.

The trace has one process per virtual worker and, per device, up to four tracks (threads):
compute (``F`` / ``B``), point-to-point communication (sends; receives with ``include_waits``),
collectives (gradient ``ALLREDUCE``, WSP's ``PUSH`` / ``PULL``) and the optimizer (``STEP``).
Forward and backward are told apart by name (``F3`` / ``B3``) and category (``forward`` /
``backward``); each micro-batch gets its colour. Every event's category is its kind's
:attr:`~partitioner.schedule.ActionKind.category`. Open the JSON in https://ui.perfetto.dev or
chrome://tracing. The PNG draws compute as bars and, under them, the all-reduces and optimizer
steps.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np

from ._io import atomic_write_bytes, write_json
from .schedule import ACTION_KINDS, COMPUTE_KINDS, ActionKind
from .timeline import Timeline

__all__ = ["TRACKS", "chrome_trace", "render_png", "summary_text", "write_trace"]

# Colour names the Chrome trace viewer knows (Perfetto picks its own by name).
_CNAMES = ("thread_state_running", "rail_response", "rail_animation", "rail_idle", "rail_load",
           "thread_state_iowait", "thread_state_runnable", "good", "yellow", "olive", "generic_work",
           "startup", "heap_dump_stack_frame", "terrible", "cq_build_running", "cq_build_passed")
TRACKS = ("compute", "comm", "collective", "optimizer")
"""A device's tracks in the trace, in order (thread id ``len(TRACKS) * rank + index``)."""
_TRACK_OF_CATEGORY = {"forward": 0, "backward": 0, "send": 1, "wait": 1, "allreduce": 2, "wsp": 2, "step": 3}
_TRACK = np.array([_TRACK_OF_CATEGORY[k.category] for k in ACTION_KINDS])  # by kind code


def _tid(rank: int, track: int) -> int:
    return len(TRACKS) * rank + track


def _track_names(tl: Timeline) -> list[dict[str, Any]]:
    """Metadata: a process per virtual worker; per device its compute and comm tracks, and its
    collective and optimizer tracks where it has such events."""
    events: list[dict[str, Any]] = []
    for w in sorted(set(tl.rank_worker)):
        events.append({"ph": "M", "name": "process_name", "pid": w, "args": {"name": f"virtual worker {w}"}})
    present = {(int(r), int(t)) for r, t in zip(tl.event_rank.tolist(), _TRACK[tl.event_kind].tolist(), strict=True)}
    for r, dev in enumerate(tl.devices):
        pid = tl.rank_worker[r]
        for track, suffix in enumerate(("", " comm", " all-reduce", " optimizer")):
            if track >= 2 and (r, track) not in present:
                continue
            tid = _tid(r, track)
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": dev + suffix}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return events


def chrome_trace(tl: Timeline, include_waits: bool = False) -> dict[str, Any]:
    """The timeline as a Chrome trace-event document (times in microseconds).

    Sends appear on the device's communication track for as long as the transfer takes;
    receives (time spent waiting for data) only with ``include_waits``. All-reduces, WSP's
    pushes and pulls and optimizer steps appear on their own tracks; one that takes no time is
    an instant event. ``args`` has every event's kind, micro-batch and stage.
    """
    events = _track_names(tl)
    for rank, code, mb, stage, start, end in zip(tl.event_rank.tolist(), tl.event_kind.tolist(),
                                                 tl.event_micro_batch.tolist(), tl.event_stage.tolist(),
                                                 tl.event_start_s.tolist(), tl.event_end_s.tolist(), strict=True):
        kind = ActionKind.from_code(code)
        dur = end - start
        if kind.category == "wait" and not include_waits:
            continue
        if kind.category in ("send", "wait") and dur <= 0:
            continue
        ev: dict[str, Any] = {
            "name": f"{kind}{mb}" if kind in COMPUTE_KINDS else kind.value if mb < 0 else f"{kind} {mb}",
            "cat": kind.category, "pid": tl.rank_worker[rank], "tid": _tid(rank, int(_TRACK[code])),
            "ts": start * 1e6, "args": {"kind": kind.value, "micro_batch": mb, "stage": stage},
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


_SYNC_COLOUR = {2: "black", 3: "red"}  # collective track, optimizer track


def render_png(tl: Timeline, path: str | os.PathLike[str], width_in: float = 14.0, dpi: int = 110) -> None:
    """Draw one row per device (forward solid, backward hatched and darker; colour = micro-batch)
    and, in a band under the bars, its all-reduces and WSP pushes / pulls (black) and optimizer
    steps (red), each as a tick where it is too short to see; the legend names the kinds drawn.

    The image is written atomically. Matplotlib is imported here, with the Agg backend.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(tl.devices)
    fig, ax = plt.subplots(figsize=(width_in, 0.9 + 0.45 * n))
    track = _TRACK[tl.event_kind]
    sync_tracks = sorted({int(t) for t in track.tolist()} & set(_SYNC_COLOUR))
    height = 0.55 if sync_tracks else 0.8  # compute bars leave room for the band under them
    cmap = plt.get_cmap("tab20")
    for r in range(n):
        on = tl.event_rank == r
        for kind, alpha, hatch in ((ActionKind.F, 1.0, None), (ActionKind.B, 0.6, "//")):
            k = on & (tl.event_kind == kind.code)
            if not k.any():
                continue
            starts, ends = tl.event_start_s[k], tl.event_end_s[k]
            colours = [cmap(int(j) % 20) for j in tl.event_micro_batch[k]]
            ax.broken_barh(list(zip(starts, ends - starts, strict=True)), (r - 0.4, height),
                           facecolors=colours, alpha=alpha, hatch=hatch, edgecolor="black", linewidth=0.2)
        band = (0.8 - height - 0.05) / max(len(sync_tracks), 1)
        for i, t in enumerate(sync_tracks):
            _draw_band(ax, tl, on & (track == t), r - 0.35 + height + i * band, band, _SYNC_COLOUR[t],
                       tl.makespan_s / 500)
    ax.set_yticks(range(n), [f"{d} (vw {w})" for d, w in zip(tl.devices, tl.rank_worker, strict=True)])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(f"{tl.schedule}: {tl.micro_batches} micro-batches, iteration {tl.iteration_s:.4g} s, "
                 f"{tl.samples_per_s:.4g} samples/s")
    handles = [Patch(facecolor="grey", label="forward"),
               Patch(facecolor="grey", alpha=0.6, hatch="//", label="backward")]
    present = [ActionKind.from_code(c) for c in np.unique(tl.event_kind).tolist()]
    handles += [Patch(facecolor=_SYNC_COLOUR[t], label=", ".join(k.label for k in present if _TRACK[k.code] == t))
                for t in sync_tracks]
    ax.legend(handles=handles, loc="upper right", fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


def _draw_band(ax: Any, tl: Timeline, sel: np.ndarray, y: float, h: float, colour: str, visible: float) -> None:
    """The selected events as bars from ``y`` to ``y + h``; those shorter than ``visible``
    seconds as ticks."""
    starts, ends = tl.event_start_s[sel], tl.event_end_s[sel]
    timed = ends - starts >= visible
    if timed.any():
        ax.broken_barh(list(zip(starts[timed], (ends - starts)[timed], strict=True)), (y, h),
                       facecolors=colour, edgecolor=colour, linewidth=0.2)
    if (~timed).any():
        ax.vlines(starts[~timed], y, y + h, colors=colour, linewidth=1.0)


def summary_text(tl: Timeline) -> str:
    """A few lines: iteration time, throughput, and per device bubble and peak memory."""
    lines = [
        f"schedule {tl.schedule}, {tl.micro_batches} micro-batches of {tl.micro_batch_size}, "
        f"{len(set(tl.rank_worker))} virtual worker(s), {tl.iterations} iteration(s) simulated",
        f"iteration {tl.iteration_s:.6g} s, {tl.samples_per_s:.6g} samples/s, {tl.num_events} actions"
        + (f" (iterations overlap: steady-state period; the first iteration ends at {tl.first_iteration_s:.6g} s, "
           f"{tl.first_iteration_s - tl.iteration_s:.6g} s of fill more)" if tl.first_iteration_s else ""),
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
