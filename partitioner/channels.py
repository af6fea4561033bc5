"""The order in which two ranks post the messages they exchange, for channels that match by order.

gloo matches a receive to its send by tag (:func:`partitioner.schedule.match_key`); NCCL matches
them by order: between two ranks, the k-th receive one posts takes the k-th message the other
sends, and every send and receive of the pair, both directions, runs in posting order on one
stream (a send waits there until its receive is posted). Under ``zbv`` both chunks' messages cross
a pair of ranks in both directions, and a rank's list receives them in another order than its
peer sends them, so posting receives as the list asks for them would mismatch messages (or wait
forever).

:func:`channel_order` derives, from the action lists (which every rank has), one sequence of the
messages of each pair of ranks, and both ends post exactly that sequence: each rank its own sends
when its list reaches them, and the peer's messages as receives, in the peer's send order, each
one posted before the rank's next send of the sequence and no later than the receive that waits
for it (:class:`ChannelCursor` keeps a rank's place). The sequence is the order of the sends in
one execution of the lists (each rank runs until a receive whose send has not run, rank after
rank). It is deadlock-free whenever the lists are under tag matching: a rank waits for a message
only after posting everything before it in its pair's sequence; the other end posts its part of
that prefix by the time it sends the message, and the execution shows it gets there. The same
holds for every schedule, so the runtime posts in this order on gloo and NCCL alike.

Torch-free: the runtime (:class:`runtime.executor.PipelineExecutor`) posts by it, the tests check
it on every schedule.
"""

from __future__ import annotations

from collections.abc import Sequence

from .schedule import RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD, Action, match_key

__all__ = ["ChannelCursor", "Key", "Message", "channel_order", "own_order"]

Key = tuple[str, int, int]  # match_key: (direction, micro_batch, sending stage)
Message = tuple[bool, Key]  # (this rank sends it, its key)

_SENDS = (SEND_ACT, SEND_GRAD)
_RECVS = (RECV_ACT, RECV_GRAD)


def channel_order(lists: Sequence[Sequence[Action]]) -> list[dict[int, list[Message]]]:
    """For every rank of one pipeline (``lists[r]``, peers numbered as the lists number them),
    for every peer it exchanges messages with: the messages of the pair, in the order both post
    them (module docstring). A ``ValueError`` if the lists deadlock under tag matching."""
    n = len(lists)
    pos = [0] * n
    sent: set[tuple[int, int, Key]] = set()
    pairs: dict[tuple[int, int], list[tuple[int, Key]]] = {}
    while any(pos[r] < len(lists[r]) for r in range(n)):
        moved = False
        for r in range(n):
            actions, i = lists[r], pos[r]
            while i < len(actions):
                a = actions[i]
                if a.kind in _RECVS and (a.peer, r, match_key(a)) not in sent:
                    break
                if a.kind in _SENDS:
                    key = match_key(a)
                    sent.add((r, a.peer, key))
                    pairs.setdefault((min(r, a.peer), max(r, a.peer)), []).append((r, key))
                i += 1
            moved |= i != pos[r]
            pos[r] = i
        if not moved:
            stuck = [f"rank {r} at {lists[r][pos[r]]!r}" for r in range(n) if pos[r] < len(lists[r])]
            raise ValueError(f"the action lists deadlock: {', '.join(stuck)} wait for messages never sent")
    out: list[dict[int, list[Message]]] = [{} for _ in range(n)]
    for (lo, hi), seq in pairs.items():
        out[lo][hi] = [(sender == lo, key) for sender, key in seq]
        out[hi][lo] = [(sender == hi, key) for sender, key in seq]
    return out


def own_order(actions: Sequence[Action]) -> dict[int, list[Message]]:
    """Per peer, the sends and receives of one rank's list in its own order: the order to post in
    when the other ends' lists are not known (enough for tag matching, and for order matching
    when the lists' receives come in their peers' send order, the loop schedules)."""
    out: dict[int, list[Message]] = {}
    for a in actions:
        if a.kind in _SENDS or a.kind in _RECVS:
            out.setdefault(a.peer, []).append((a.kind in _SENDS, match_key(a)))
    return out


class ChannelCursor:
    """One rank's place in the message sequence of one peer (from :func:`channel_order`): every
    message is posted once, in the sequence's order. A receive may be posted ahead
    (:meth:`next_receive`, :meth:`advance`); :meth:`send` and :meth:`receive` say which receives
    must be posted first. A sequence that is done starts again at :meth:`restart` (the lists of
    a flushing schedule are one iteration, run once per step: :meth:`restart`)."""

    def __init__(self, messages: Sequence[Message]):
        self.messages = list(messages)
        self.index = {m: i for i, m in enumerate(self.messages)}
        if len(self.index) != len(self.messages):
            raise ValueError("a message appears twice in the sequence")
        self.pos = 0

    def restart(self) -> None:
        """Start the sequence again if it is done (at the start of a rank's list)."""
        if self.pos == len(self.messages):
            self.pos = 0

    def next_receive(self) -> Key | None:
        """The next message if it is a receive (which may be posted now), else None."""
        if self.pos < len(self.messages) and not self.messages[self.pos][0]:
            return self.messages[self.pos][1]
        return None

    def advance(self) -> Key:
        """Mark the next message, a receive, as posted; returns its key."""
        key = self.next_receive()
        if key is None:
            raise ValueError("the next message is not a receive")
        self.pos += 1
        return key

    def _position(self, message: Message) -> int:
        i = self.index.get(message)
        if i is None:
            raise ValueError(f"{'send' if message[0] else 'receive'} {message[1]} is not in this pair's sequence")
        return i

    def _receives_before(self, i: int) -> list[Key]:
        """Post every message before position ``i``: receives only (a send not yet run before it
        means the list does not follow the sequence)."""
        keys = []
        while self.pos < i:
            is_send, key = self.messages[self.pos]
            if is_send:
                raise ValueError(f"message {self.messages[i][1]} comes after this rank's send {key}, which has "
                                 "not run")
            keys.append(key)
            self.pos += 1
        return keys

    def send(self, key: Key) -> list[Key]:
        """This rank sends ``key`` now: the receives to post before it (in order)."""
        i = self._position((True, key))
        if i < self.pos:
            raise ValueError(f"send {key} was already posted")
        keys = self._receives_before(i)
        self.pos += 1
        return keys

    def receive(self, key: Key) -> list[Key]:
        """This rank waits for ``key`` now: the receives to post first, ``key`` last; empty when
        ``key`` was posted ahead."""
        i = self._position((False, key))
        if i < self.pos:
            return []
        keys = self._receives_before(i)
        self.pos += 1
        return [*keys, key]
