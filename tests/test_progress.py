"""Progress on stderr: plain lines on a non-terminal at the configured interval (the clock is
injected, nothing is timed), the solvers' status line, ``--quiet``, and the profiler's estimate."""

from __future__ import annotations

import functools
import io

import pytest

from partitioner import progress
from partitioner.progress import INTERVAL_S, Progress, note, silenced


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_come_at_the_interval_on_a_stream_that_is_not_a_terminal():
    clock, out = FakeClock(), io.StringIO()
    line = Progress("profile toy", 40, unit="layer", file=out, clock=clock)
    assert line.active and not line.terminal and line._bar is None
    for step in range(41):  # a layer a second, 40 s in all
        line.update(step, "timing")
        clock.now += 1.0
    line.close()
    lines = out.getvalue().splitlines()
    # none before INTERVAL_S, then one every INTERVAL_S, however many updates came in between
    assert len(lines) == int(40 // INTERVAL_S)
    assert lines[0] == f"profile toy: layer {int(INTERVAL_S)}/40 (timing), {int(INTERVAL_S)} s elapsed, about 35 s left"
    assert lines[-1].startswith("profile toy: layer 40/40 (timing), 40 s elapsed")


def test_the_interval_is_configurable_and_ticks_write_between_updates():
    clock, out = FakeClock(), io.StringIO()
    line = Progress("solve", file=out, clock=clock, interval_s=2.0, after_s=0.0, expected_s=10.0)
    line.update(text="searching")
    for _ in range(6):  # no update for 6 s: the ticks alone keep the line moving
        clock.now += 1.0
        line.tick()
    assert out.getvalue().splitlines() == [
        "solve: searching, 0 s elapsed, about 10 s left",
        "solve: searching, 2 s elapsed, about 8 s left",
        "solve: searching, 4 s elapsed, about 6 s left",
        "solve: searching, 6 s elapsed, about 4 s left",
    ]


def test_silenced_writes_no_progress_and_no_notes(capsys):
    clock, out = FakeClock(), io.StringIO()
    with silenced():
        line = Progress("profile toy", 10, unit="layer", file=out, clock=clock, show=True)
        for step in range(11):
            line.update(step)
            clock.now += 10.0
            line.tick()
        line.close()
        note("profile toy: estimate")
    assert not line.active and out.getvalue() == ""
    assert capsys.readouterr().err == ""
    with silenced(False):
        note("shown")
    assert capsys.readouterr().err == "shown\n"


def test_duration():
    assert [progress.duration(s) for s in (0, 0.2, 41, 150, 5400, 7200)] == ["0 s", "1 s", "41 s", "2 min", "1.5 h", "2.0 h"]


def test_a_solve_status_is_a_plain_line_off_a_terminal():
    from solvers import progress as solver_progress

    clock, out = FakeClock(), io.StringIO()
    with solver_progress.shown():
        status = solver_progress.Status("cpsat", file=out, clock=clock)
        clock.now += INTERVAL_S
        status.update(0.029688, 0.028989)
        status.update(0.029, 0.028989)  # within the interval: no second line
        status.close()
    assert out.getvalue().splitlines() == [f"cpsat: best 29.69 ms  bound 28.99 ms  gap 2.4%, {int(INTERVAL_S)} s elapsed"]
    with silenced(), solver_progress.shown():  # --quiet wins over shown()
        assert not solver_progress.status("cpsat").active


@pytest.mark.parametrize("argv", [
    ["-q", "plan", "p.json", "--cluster", "c.yaml"],
    ["plan", "p.json", "--cluster", "c.yaml", "--quiet"],
    ["--quiet", "profile", "gpt2-tiny", "--micro-batch-size", "1", "-o", "x.json"],
    ["profile", "gpt2-tiny", "--micro-batch-size", "1", "-o", "x.json", "-q"],
])
def test_quiet_parses_before_and_after_the_subcommand(argv):
    from partitioner_cli.main import build_parser, quiet

    assert quiet(build_parser().parse_args(argv))
    assert not quiet(build_parser().parse_args([a for a in argv if a not in ("-q", "--quiet")]))


@pytest.fixture
def profiled(monkeypatch, tmp_path):
    """Run ``partitioner profile gpt2-tiny`` on the CPU with extra options; returns the order in
    which the estimate note and the layer timings came."""
    import partitioner.profiler as profiler
    import partitioner_cli.main as cli

    monkeypatch.setattr(cli, "COMMAND_MODULES", ("partitioner_cli.profile",))
    events: list[str] = []
    real_note, real_time = profiler.note, profiler._time_layer

    def recorded_note(text, *a, **kw):
        events.append("note")
        real_note(text, *a, **kw)

    def recorded_time(layer, x, name, *a, **kw):
        events.append(f"time {name}")
        return real_time(layer, x, name, *a, **kw)

    monkeypatch.setattr(profiler, "note", recorded_note)
    monkeypatch.setattr(profiler, "_time_layer", recorded_time)

    def run(*extra: str) -> list[str]:
        events.clear()
        argv = ["profile", "gpt2-tiny", "--micro-batch-size", "1", "--seq-len", "8", "--device", "cpu",
                "--warmup", "0", "--repeats", "1", "-o", str(tmp_path / "p.json"), *extra]
        assert cli.main(argv) == 0
        return list(events)

    return run


def test_the_estimate_comes_before_the_first_layer_is_timed(profiled, capsys):
    events = profiled()
    assert events[0] == "note" and events[1].startswith("time ")
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert first.startswith("profile gpt2-tiny: 4 layers on cpu, micro-batch 1; estimate: about ")
    assert "of memory (parameters " in first


def test_quiet_profile_writes_no_estimate_and_no_progress(profiled, capsys, monkeypatch):
    import partitioner.profiler as profiler

    clock = FakeClock()

    def fast_clock() -> float:  # every look at the clock is 10 s later: a line per layer if shown
        clock.now += 10.0
        return clock.now

    monkeypatch.setattr(profiler, "Progress", functools.partial(Progress, clock=fast_clock, terminal=False))
    events = profiled("--quiet")
    assert "note" not in events
    captured = capsys.readouterr()
    assert "estimate" not in captured.err and "profile gpt2-tiny:" not in captured.err
    assert captured.out.startswith("profiled gpt2-tiny: 4 layers")
    profiled()  # the same run without --quiet writes the estimate and layer lines
    err = capsys.readouterr().err
    assert "estimate: about" in err and "profile gpt2-tiny: layer 4/4 (done)" in err


def test_a_terminal_gets_a_bar_not_plain_lines():
    out = io.StringIO()
    with Progress("profile toy", 3, unit="layer", file=out, terminal=True, after_s=0.0) as line:
        for step in range(4):
            line.update(step, "timing")
    text = out.getvalue()
    assert "3/3" in text and "layer/s" in text and "elapsed" not in text
