"""Every schedule's action lists are valid: order, matching, no deadlock, bounded versions."""

from __future__ import annotations

import ast
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.errors import FormatError
from partitioner.schedule import (
    ACTION_KINDS,
    ALLREDUCE,
    PULL,
    PUSH,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    STEP,
    Action,
    ActionKind,
    build_schedule,
    check_schedule,
    match_key,
)
from partitioner.simulate import DeadlockError, simulate_programs


def _check_valid(lists: list[list[Action]], p: int, m: int, v: int, iterations: int) -> None:
    n_stages = p * v
    total = m * iterations
    # every (micro-batch, stage) has exactly one F and one B, on the right rank, F first
    for r, prog in enumerate(lists):
        pos_f, pos_b = {}, {}
        for i, a in enumerate(prog):
            if a.kind == "F":
                assert a.stage % p == r
                pos_f[(a.micro_batch, a.stage)] = i
            elif a.kind == "B":
                pos_b[(a.micro_batch, a.stage)] = i
        expect = {(j, c * p + r) for j in range(total) for c in range(v)}
        assert set(pos_f) == expect and set(pos_b) == expect
        assert all(pos_f[k] < pos_b[k] for k in expect)
    # sends match receives, per ordered rank pair, in the same order
    sends, recvs = defaultdict(list), defaultdict(list)
    for r, prog in enumerate(lists):
        for a in prog:
            if a.kind in (SEND_ACT, SEND_GRAD):
                sends[(r, a.peer)].append(match_key(a))
            elif a.kind in (RECV_ACT, RECV_GRAD):
                recvs[(a.peer, r)].append(match_key(a))
    assert sends == recvs
    n_msgs = sum(len(x) for x in sends.values())
    assert n_msgs == (2 * total * (n_stages - 1) if p > 1 else 0)
    simulate_programs(lists)  # raises DeadlockError on a wait cycle


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 9), it=st.integers(1, 2),
       sched=st.sampled_from(["gpipe", "1f1b"]))
def test_flush_schedules_valid(p: int, m: int, it: int, sched: str) -> None:
    _check_valid(build_schedule(sched, p, m, iterations=it), p, m, 1, it)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 5), g=st.integers(1, 3), v=st.integers(1, 4), it=st.integers(1, 2))
def test_interleaved_valid(p: int, g: int, v: int, it: int) -> None:
    m = g * p
    _check_valid(build_schedule("interleaved", p, m, v, iterations=it), p, m, v, it)


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 8), v=st.integers(1, 4))
def test_bfs_valid(p: int, m: int, v: int) -> None:
    _check_valid(build_schedule("bfs", p, m, v), p, m, v, 1)


def _max_live_versions(prog: list[Action]) -> int:
    current, used, live_peak = 0, {}, 1
    refs = Counter({0: 1})
    for a in prog:
        if a.kind == "F":
            used[a.micro_batch] = current
            refs[current] += 1
        elif a.kind == "B":
            refs[used.pop(a.micro_batch)] -= 1
        elif a.kind == "STEP":
            refs[current] -= 1
            current = a.version
            refs[current] += 1
        live_peak = max(live_peak, sum(1 for c in refs.values() if c > 0))
    return live_peak


@settings(max_examples=40, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 10), it=st.integers(2, 4))
def test_2bw_valid_and_two_versions(p: int, m: int, it: int) -> None:
    lists = build_schedule("2bw", p, m, iterations=it)
    _check_valid(lists, p, m, 1, it)
    assert max(_max_live_versions(prog) for prog in lists) <= 2
    # no flush: the first forward of iteration 1 comes before the last backward of iteration 0
    if p > 1 and m > 1:
        kinds = [(a.kind, a.micro_batch) for a in lists[0]]
        assert kinds.index(("F", m)) < kinds.index(("B", m - 1))


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 6), d=st.integers(0, 2), it=st.integers(1, 4))
def test_wsp_valid(p: int, m: int, d: int, it: int) -> None:
    lists = build_schedule("wsp", p, m, iterations=it, staleness=d)
    _check_valid(lists, p, m, 1, it)
    for prog in lists:
        pushes = [a.version for a in prog if a.kind == PUSH]
        pulls = [a.version for a in prog if a.kind == PULL]
        assert pushes == list(range(it))
        assert pulls == [c - d for c in range(it) if c - d >= 0]


def test_1f1b_in_flight_matches_closed_form() -> None:
    p, m = 5, 3
    for r, prog in enumerate(build_schedule("1f1b", p, m)):
        held = peak = 0
        for a in prog:
            held += (a.kind == "F") - (a.kind == "B")
            peak = max(peak, held)
        assert peak == min(p - r, m)


def test_deadlock_is_detected_and_names_ranks() -> None:
    # both ranks receive before they send: a two-rank wait cycle
    r0 = [Action(RECV_GRAD, 0, 0, 1), Action(SEND_ACT, 0, 0, 1)]
    r1 = [Action(RECV_ACT, 0, 1, 0), Action(SEND_GRAD, 0, 1, 0)]
    with pytest.raises(DeadlockError, match=r"rank 0 .*rank 1|rank 1 .*rank 0"):
        simulate_programs([r0, r1])


def test_unmatched_send_is_refused() -> None:
    with pytest.raises(DeadlockError, match="never received"):
        simulate_programs([[Action(SEND_ACT, 0, 0, 1)], []])


@pytest.mark.parametrize(("args", "needle"), [
    (("interleaved", 4, 6, 2), "multiple of the 4 devices; nearest valid: 4 or 8"),
    (("interleaved", 4, 3, 2), "nearest valid: 4"),
    (("bfs", 4, 8, 0), "chunks = 0: must be an integer >= 1"),
    (("1f1b", 4, 8, 2), "use chunks=1"),
    (("pipedream", 4, 8, 1), "must be one of"),
])
def test_impossible_schedules_are_refused(args: tuple, needle: str) -> None:
    with pytest.raises(FormatError, match=needle):
        check_schedule(*args)


def test_1f1b_with_fewer_micro_batches_than_stages_is_supported() -> None:
    _check_valid(build_schedule("1f1b", 6, 2), 6, 2, 1, 1)


# -- the action kinds: one definition --------------------------------------------------------


def test_action_kinds_are_defined_once_with_a_code_label_and_category() -> None:
    assert [k.code for k in ACTION_KINDS] == list(range(len(ActionKind)))  # the kind column's codes
    assert set(ACTION_KINDS) == set(ActionKind)
    for k in ActionKind:
        assert k == k.value == k.name and str(k) == f"{k}" == k.name  # a kind equals its name
        assert ActionKind.from_code(k.code) is k and ActionKind(k.name) is k
        assert k.label and k.category in {"forward", "backward", "send", "wait", "step", "allreduce", "wsp"}
    assert (ActionKind.F.code, ActionKind.B.code) == (0, 1)  # saved timelines keep their codes
    assert ALLREDUCE.category == "allreduce" and STEP.category == "step"


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 3, 4, 1), ("1f1b", 4, 3, 1), ("interleaved", 2, 4, 2),
                                            ("bfs", 2, 3, 3), ("2bw", 3, 4, 1), ("wsp", 3, 4, 1)])
def test_actions_have_a_compact_form_read_back_by_from_str(schedule: str, p: int, m: int, v: int) -> None:
    lists = build_schedule(schedule, p, m, v, iterations=2, staleness=1)
    for actions in [*lists, [Action(ALLREDUCE, peer=3, version=2)]]:
        for a in actions:
            assert Action.from_str(repr(a)) == a and str(a) == repr(a)
    assert repr(lists[-1][0]) == f"{p - 1}RECV_ACT0@{p - 2}"  # the last rank waits for micro-batch 0 first
    assert repr(Action(ActionKind.F, 0, 2)) == "2F0"
    assert repr(Action(STEP, version=1)) == "STEP(1)" and repr(Action(SEND_ACT, 5, 1, 2)) == "1SEND_ACT5@2"
    assert Action.from_str("2B7") == Action(ActionKind.B, 7, 2)


@pytest.mark.parametrize("text", ["", "2X0", "F-1", "2F0@", "STEP(x)", "f0"])
def test_a_malformed_compact_action_is_one_line_naming_the_field(text: str) -> None:
    with pytest.raises(FormatError, match=r"^action = .*must read \[stage\]KIND"):
        Action.from_str(text)


def test_no_module_but_the_schedule_spells_action_kinds_or_their_codes() -> None:
    """The kinds' names and codes are said in partitioner/schedule.py only: elsewhere in the core
    and the runtime a kind is ``ActionKind.X`` (or its alias) and a code ``X.code``."""
    root = Path(__file__).resolve().parents[1]
    names = set(ActionKind.__members__)
    found = []
    for pkg in ("partitioner", "runtime"):
        for path in sorted((root / pkg).rglob("*.py")):
            if path == root / "partitioner" / "schedule.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and node.value in names:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
                elif (isinstance(node, ast.Compare) and "kind" in ast.unparse(node.left)
                      and any(isinstance(c, ast.Constant) and type(c.value) is int for c in node.comparators)):
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
    assert not found
