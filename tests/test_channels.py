"""The order two ranks post their messages in (partitioner/channels.py): receives in the peer's
send order and the same sequence at both ends for every schedule (zbv's crossing chunks
included), no deadlock when every pair's messages run one at a time in that order (NCCL), and
the runtime posting exactly that."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.channels import ChannelCursor, Key, channel_order, own_order
from partitioner.schedule import (
    FIFO_MATCHED,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    STEP,
    Action,
    B,
    F,
    I,
    build_schedule,
    match_key,
)

FLUSHING = ("gpipe", "1f1b", "interleaved", "bfs", "zb-h1", "zb-h2", "zbv")


def _lists(schedule: str, p: int, m: int, iterations: int) -> list[list[Action]]:
    v = 2 if schedule in ("interleaved", "bfs", "zbv") else 1
    if schedule in ("interleaved", "bfs"):
        m = max(p, m - m % p)  # a multiple of p
    return build_schedule(schedule, p, m, v, iterations)


def _run_in_order(lists: list[list[Action]]) -> dict[tuple[int, int], list[tuple[int, Key]]]:
    """Every rank runs its list, posting through its cursors as the executor does (what a send
    and a receive need first, then ahead: an activation while none from that peer waits to be
    taken, a gradient once its forward ran). Each pair's messages complete one at a time, in
    the order both ends posted them, a message once both ends posted it (NCCL's rendezvous
    stream per pair); a receive waits for its message, a step for the rank's sends. Returns
    every rank's posts per peer, ``(rank, peer) -> [(sender, key)]``; fails on a deadlock."""
    n = len(lists)
    order = channel_order(lists)
    cursors = [{q: ChannelCursor(seq) for q, seq in order[r].items()} for r in range(n)]
    posts: dict[tuple[int, int], list[tuple[int, Key]]] = defaultdict(list)
    outputs: list[set[tuple[int, int]]] = [set() for _ in range(n)]
    acts_ahead: list[dict[int, int]] = [defaultdict(int) for _ in range(n)]
    pos = [0] * n

    def post(r: int, q: int, key: Key, sender: int) -> None:
        if sender != r and key[0] == "act":
            acts_ahead[r][q] += 1
        if sender != r and key[0] == "grad":
            assert (key[1], key[2] - 1) in outputs[r], f"rank {r} posts {key} before its forward"
        posts[(r, q)].append((sender, key))

    def complete(r: int, q: int, sender: int, key: Key) -> bool:
        """Both ends posted it, and everything before it at both ends (same sequence)."""
        mine, theirs = posts[(r, q)], posts[(q, r)]
        k = mine.index((sender, key))
        return len(theirs) > k and theirs[: k + 1] == mine[: k + 1]

    def ahead(r: int) -> None:
        for q, c in cursors[r].items():
            while (key := c.next_receive()) is not None:
                if (key[0] == "act" and acts_ahead[r][q]) or (key[0] == "grad" and (key[1], key[2] - 1) not in outputs[r]):
                    break
                post(r, q, c.advance(), q)

    for r in range(n):
        ahead(r)
    while any(pos[r] < len(lists[r]) for r in range(n)):
        moved = False
        for r in range(n):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                if a.kind in (SEND_ACT, SEND_GRAD):
                    for key in cursors[r][a.peer].send(match_key(a)):
                        post(r, a.peer, key, a.peer)
                    post(r, a.peer, match_key(a), r)
                elif a.kind in (RECV_ACT, RECV_GRAD):
                    for key in cursors[r][a.peer].receive(match_key(a)):
                        post(r, a.peer, key, a.peer)
                    if not complete(r, a.peer, a.peer, match_key(a)):
                        break
                    if a.kind == RECV_ACT:
                        acts_ahead[r][a.peer] -= 1
                elif a.kind == STEP:
                    if not all(complete(r, q, r, key) for (x, q), seq in list(posts.items()) if x == r
                               for sender, key in seq if sender == r):
                        break
                elif a.kind == F:
                    outputs[r].add((a.micro_batch, a.stage))
                elif a.kind in (I, B):
                    outputs[r].discard((a.micro_batch, a.stage))
                pos[r] += 1
                moved = True
                ahead(r)
        assert moved, f"deadlock: {[(r, lists[r][pos[r]]) for r in range(n) if pos[r] < len(lists[r])]}"
    return posts


def _check(lists: list[list[Action]]) -> None:
    posts = _run_in_order(lists)
    sends: dict[tuple[int, int], list[Key]] = defaultdict(list)
    for r, actions in enumerate(lists):
        for a in actions:
            if a.kind in (SEND_ACT, SEND_GRAD):
                sends[(r, a.peer)].append(match_key(a))
    for (r, q), seq in posts.items():
        assert seq == posts[(q, r)], (r, q)  # the same sequence at both ends
        assert [k for s, k in seq if s == q] == sends[(q, r)]  # receives in the peer's send order
    assert {(r, q) for (r, q) in posts} == {(r, q) for (r, q) in sends} | {(q, r) for (r, q) in sends}


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 6), m=st.integers(1, 12), it=st.integers(1, 2))
def test_zbv_receives_in_send_order_for_every_pair(p: int, m: int, it: int) -> None:
    _check(_lists("zbv", p, m, it))


@settings(max_examples=60, deadline=None)
@given(p=st.integers(1, 5), m=st.integers(1, 10), schedule=st.sampled_from((*FLUSHING, "2bw", "wsp")))
def test_every_schedule_posts_one_sequence_per_pair(p: int, m: int, schedule: str) -> None:
    _check(_lists(schedule, p, m, 1 if schedule in FLUSHING else 3))


def test_zbv_lists_alone_receive_out_of_send_order() -> None:
    """What the channel order is for: under zbv a rank's own list takes some pair's messages in
    another order than the peer sends them (the loop schedules' lists never do)."""
    def out_of_order(lists: list[list[Action]]) -> bool:
        for r, actions in enumerate(lists):
            for q, seq in own_order(actions).items():
                sent = [k for s, k in own_order(lists[q])[r] if s]
                if [k for s, k in seq if not s] != sent:
                    return True
        return False

    assert out_of_order(_lists("zbv", 3, 6, 1))
    assert not any(out_of_order(_lists(s, 3, 6, 1)) for s in FIFO_MATCHED)


def test_cursor_refuses_a_list_that_does_not_follow_its_sequence() -> None:
    c = ChannelCursor([(True, ("act", 0, 0)), (False, ("grad", 0, 1))])
    with pytest.raises(ValueError, match=r"comes after this rank's send \('act', 0, 0\)"):
        c.receive(("grad", 0, 1))
    assert c.send(("act", 0, 0)) == [] and c.receive(("grad", 0, 1)) == [("grad", 0, 1)]
    with pytest.raises(ValueError, match="not in this pair's sequence"):
        c.send(("act", 5, 0))
    c.restart()
    assert c.pos == 0
    with pytest.raises(ValueError, match="deadlock"):
        channel_order([[Action(RECV_GRAD, 0, 0, 1)], [Action(RECV_ACT, 0, 1, 0)]])


def test_the_runtime_posts_every_pair_in_one_sequence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A zbv run on gloo, every isend and irecv recorded as it is posted: per pair of ranks both
    ends post the same sequence, which NCCL needs."""
    from partitioner.plan import Plan, Stage, VirtualWorker
    from runtime.launch import TrainConfig, train_local

    real_send, real_recv = dist.isend, dist.irecv

    def log(what: str, peer: int, tag: int) -> None:
        with open(tmp_path / f"{os.getpid()}.jsonl", "a") as fh:
            fh.write(json.dumps([dist.get_rank(), what, peer, tag]) + "\n")

    def isend(tensor: torch.Tensor, dst: int, *args: object, tag: int = 0, **kw: object) -> object:
        log("send", dst, tag)
        return real_send(tensor, dst, *args, tag=tag, **kw)  # type: ignore[arg-type]

    def irecv(tensor: torch.Tensor, src: int, *args: object, tag: int = 0, **kw: object) -> object:
        log("recv", src, tag)
        return real_recv(tensor, src, *args, tag=tag, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(dist, "irecv", irecv)
    vw = VirtualWorker((Stage((0, 1), "n0:0"), Stage((1, 2), "n0:1"), Stage((2, 3), "n0:1"), Stage((3, 4), "n0:0")))
    plan = Plan("gpt2-tiny", (vw,), schedule="zbv", micro_batch_size=2, micro_batches=4, chunks=2)
    train_local(plan, TrainConfig("gpt2-tiny", steps=2, warmup=1, threads=1, timeout_s=60, progress=False),
                start_method="fork")  # the ranks inherit the patched calls
    seqs: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for path in tmp_path.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            me, what, peer, tag = json.loads(line)
            seqs[(me, peer)].append((me if what == "send" else peer, tag))
    assert set(seqs) == {(0, 1), (1, 0)}
    assert seqs[(0, 1)] == seqs[(1, 0)] and len(seqs[(0, 1)]) == 2 * 2 * 4 * 2  # 2 steps, 4 micro-batches
    # and this order is not the one the lists alone would post: rank 0 sends and takes both chunks
    assert any(s == 1 for s, _ in seqs[(0, 1)]) and any(s == 0 for s, _ in seqs[(0, 1)])
