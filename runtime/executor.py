"""Execute one rank's action list from :func:`partitioner.schedule.build_schedule`.

The rank runs its actions in order, exactly as listed (the simulator times the same list):

``F(j, s)``
    forward of micro-batch ``j`` through stage ``s``, keeping the autograd graph. Stage 0
    reads the micro-batch from the data source; a later stage reads the activation its
    ``RECV_ACT`` received (or, when the previous stage is on this rank, that stage's output).
    The last stage computes the micro-batch's loss against its targets, divided by the
    micro-batch count (and, for a slice of a sliced first micro-batch, by the slice count: each
    loss is weighted by its share of the iteration's samples, ``MicroBatching.loss_divisor``).
``B(j, s)``
    backward of ``j`` through ``s``: from the loss on the last stage, otherwise with the
    gradient its ``RECV_GRAD`` received. Parameter gradients accumulate over the iteration.
``I(j, s)`` / ``W(j, s)``
    the backward of ``j`` through ``s`` in two (the zero-bubble schedules). A stage that is an
    ``nn.Sequential`` runs its forward layer by layer and keeps each layer with parameters' output;
    ``I`` computes, in one ``torch.autograd.grad`` keeping the graph, the gradient of the stage's
    input (which its ``SEND_GRAD`` sends on) and of those outputs; ``W`` later computes each such
    layer's weight gradients from its output's gradient (``torch.autograd.backward`` with
    ``inputs=`` the layer's parameters), through that layer only. Otherwise (another module, or a
    parameter shared by two of its layers) ``I`` computes the input's gradient alone and ``W``
    starts from the stage's output, computing the stage's inner input gradients again on its way
    to the weights. Either way the gradients accumulate as ``B``'s do: ``I`` then ``W`` leaves
    the same gradients as ``B``.
``SEND_ACT`` / ``SEND_GRAD``
    ``isend`` of the stage's output / input gradient to the peer (posted, not waited: the
    schedules' matching rule needs sends that do not wait for the receiver). A gradient's sends
    are waited at the ``STEP``. An output's sends are waited, and then its data freed (below), at
    the start of the rank's next compute action when every pipeline rank holds one stage of a
    flushing schedule (:attr:`PipelineExecutor.lean`), else when its gradient arrives (done by then:
    the receivers had the output).
``RECV_ACT`` / ``RECV_GRAD``
    ``irecv`` into a buffer of the known shape (posted earlier, see below), waited at once. Activation shapes come from a
    dry pass on the meta device (one for whole micro-batches, one for slices); a gradient has
    the shape of the stage's own output.
``STEP``
    wait for this iteration's sends, average gradients over the virtual workers (the
    ``sync`` callback), optimizer step, zero the gradients.

Freeing a sent output (as Megatron-LM does): once its sends are waited, the output's tensor is
given an empty storage (``.data`` replaced), so the executor holds nothing of it. What autograd
saved of it (an operation that saves its result, a ReLU, keeps it through its saved tensor, a
separate tensor object on the same storage) stays alive with the graph and is priced as saved
activations, so nothing is read after it is freed. Its backward is then started from the
output's gradient edge (``torch.autograd.graph.get_gradient_edge``, taken before freeing):
``torch.autograd.backward`` / ``grad`` accept an edge and check the gradient against the shape
the edge recorded, where a call on the freed tensor itself would refuse a gradient whose shape is
not its (now empty) one. The engine runs the same graph with the same gradient: the same bits.

Why the waits are where they are: when every pipeline rank holds one stage and the schedule
flushes, the receiver of output ``j`` posts its receive no later than its ``RECV_ACT`` of ``j``,
and reaches it needing from this rank only the outputs before ``j`` (sent); the last stage sends
no output, so by induction down the chain a wait at this rank's next compute never waits on this
rank. A rank with several stages (interleaved, ``zbv``) may need from this rank a message its
list sends later (a gradient, an output of its other chunk), and a schedule without flushes
(2bw, wsp) runs collectives between the sends: there the output's sends are waited when its
gradient arrives, which is certain to be done.

Messages carry the tag of :func:`partitioner.schedule.match_key` (gloo matches by it), and every
message between two ranks, send or receive, is posted in the one order both ends follow
(:mod:`partitioner.channels`, :meth:`PipelineExecutor.order_channels`), so a backend that matches
by order per pair of ranks and runs a pair's messages one at a time (NCCL) matches them too, for
every schedule, ``zbv``'s crossing chunks included.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.func import functional_call

from partitioner.channels import ChannelCursor, Key, Message, own_order
from partitioner.schedule import (
    PULL,
    PUSH,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    STEP,
    Action,
    B,
    F,
    I,
    MicroBatching,
    W,
    match_key,
)

from .emulation import Stretch
from .layout import Layout
from .memory import ActivationMeter, rng_restored, rng_state
from .recompute import keeping_core_gradients

__all__ = ["PipelineExecutor", "StashingExecutor", "message_tag"]

log = logging.getLogger(__name__)


def message_tag(direction: str, micro_batch: int, sending_stage: int, num_stages: int) -> int:
    """An integer form of ``match_key``: equal for a send and the receive that matches it."""
    return (micro_batch * num_stages + sending_stage) * 2 + (1 if direction == "grad" else 0)


class PipelineExecutor:
    """Runs the action lists of one rank of one pipeline.

    ``stages`` maps the global stage indices this rank holds to their modules; ``peers``
    maps a pipeline rank to its ``torch.distributed`` rank; ``input_shapes[s]`` is the
    shape and dtype of stage ``s``'s input; ``data(j)`` gives micro-batch ``j``'s input on
    the device; ``loss_fn(y, j)`` turns the last stage's output ``y`` for micro-batch ``j``
    into the micro-batch's scalar loss (against its targets), a mean over its samples.
    ``batching``: the iteration's micro-batches as the action lists number them (default:
    ``micro_batches`` whole ones); ``slice_shapes[s]``, the input of stage ``s`` for a slice of a
    sliced first micro-batch.
    """

    def __init__(self, stages: Mapping[int, nn.Module], num_stages: int, peers: Sequence[int],
                 input_shapes: Mapping[int, tuple[torch.Size, torch.dtype]], micro_batches: int,
                 data: Callable[[int], torch.Tensor], loss_fn: Callable[[torch.Tensor, int], torch.Tensor],
                 optimizer: torch.optim.Optimizer | None, device: torch.device,
                 sync: Callable[[], None] | None = None, *, batching: MicroBatching | None = None,
                 slice_shapes: Mapping[int, tuple[torch.Size, torch.dtype]] | None = None):
        self.stages = dict(stages)
        self.num_stages = num_stages
        self.peers = list(peers)
        self.input_shapes = dict(input_shapes)
        self.m = micro_batches
        self.batching = batching or MicroBatching(micro_batches, 1)
        if self.batching.micro_batches != micro_batches:
            raise ValueError(f"batching has {self.batching.micro_batches} micro-batches, not {micro_batches}")
        self.slice_shapes = dict(slice_shapes or {})
        if self.batching.first_slices > 1 and set(self.slice_shapes) != set(self.input_shapes):
            raise ValueError("a sliced first micro-batch needs the slice's input shape of every stage with an input")
        self.data = data
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.device = device
        self.sync = sync
        # pipeline rank -> the global ranks a send to it goes to, when not its peer alone (tensor
        # parallelism: runtime.layout.Layout.send_to)
        self.send_to: dict[int, tuple[int, ...]] = {}
        self.losses: list[float] = []  # last stage: the iteration's loss (sum of the scaled losses)
        # seconds spent per kind of work, summed over every run: compute (F, B), waiting in
        # receives, and the step (send completion, gradient averaging, optimizer)
        self.seconds = {"compute": 0.0, "recv": 0.0, "step": 0.0}
        self._posted: dict[int, tuple[Any, torch.Tensor]] = {}  # receives posted ahead, by tag
        # (micro-batch, stage) -> the sends of its output, until its gradient arrives (_release_sent_output)
        self._sent_outputs: dict[tuple[int, int], list[tuple[Any, torch.Tensor]]] = {}
        self.stretch: Stretch | None = None
        self._split_stages: set[int] = set()  # stages with I actions in the list being run
        self.step_ends: list[float] | None = None  # when set: perf_counter() at the end of every STEP
        self._cursors: dict[int, ChannelCursor] | None = None  # order_channels
        self._acts_ahead: dict[int, int] = {}  # peer -> activation receives posted and not yet taken
        self._grads_ahead: dict[int, int] = {}  # peer -> gradient receives posted and not yet taken
        # waits an output's sends at the next compute (one stage per pipeline rank, flushing schedule;
        # set by run) rather than when its gradient arrives (module docstring)
        self.lean = False
        # stages recomputed in full (Stage.recompute "full"): their forward keeps only its input,
        # their backward (I of a split one) runs it again first (:meth:`_recomputed`)
        self.recompute_full: set[int] = set()
        self.meter: ActivationMeter | None = None  # the activation memory held (runtime.memory)
        self._reset()

    def emulate(self, stretch: Stretch) -> None:
        """Stretch every forward and backward from now on (``train --emulate``, :mod:`runtime.emulation`);
        the seconds slept are counted as ``emulation``."""
        self.stretch = stretch
        self.seconds.setdefault("emulation", 0.0)

    def _reset(self) -> None:
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._out_grads: dict[tuple[int, int], torch.Tensor] = {}
        self._in_grads: dict[tuple[int, int], torch.Tensor | None] = {}
        # (micro-batch, stage) -> what an I left for its W: per layer with parameters, its output,
        # the output's gradient and its parameters (or the stage's output, gradient and parameters)
        self._weight_work: dict[tuple[int, int], list[tuple[torch.Tensor | GradientEdge, torch.Tensor | None,
                                                             list[Any]]]] = {}
        # (micro-batch, stage) -> per layer with parameters: its output, the output's version, its
        # parameters (a split backward's stage run layer by layer, see _forward)
        self._layer_outputs: dict[tuple[int, int], list[tuple[torch.Tensor, int, list[Any]]]] = {}
        # (micro-batch, stage) -> its output's shape and dtype, from its forward until its gradient's
        # receive is posted (the output itself may be freed by then)
        self._out_meta: dict[tuple[int, int], tuple[torch.Size, torch.dtype]] = {}
        # id of a freed output -> its gradient edge, where its backward starts (_free_output)
        self._edges: dict[int, GradientEdge] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._rng: dict[tuple[int, int], Any] = {}  # (micro-batch, stage) recomputed in full -> its forward's RNG state
        self._loss_sum: torch.Tensor | float = 0.0  # a device tensor: read back once per iteration

    # -- communication -------------------------------------------------------------------

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> list[tuple[Any, torch.Tensor]]:
        """Post the sends of ``tensor`` (not waited); returns them, with the buffer each holds."""
        buf = tensor.detach().contiguous()
        return [(dist.isend(buf, dst, tag=tag), buf) for dst in self.send_to.get(peer, (self.peers[peer],))]

    def _release_sent_output(self, j: int, s: int) -> None:
        """Wait for the sends of micro-batch ``j``'s output of stage ``s`` (done when its gradient has
        arrived: its receivers had it), drop their buffers and free the output (:meth:`_free_output`)."""
        for work, _ in self._sent_outputs.pop((j, s), ()):
            if work is not None:
                work.wait()
        self._free_output((j, s))

    def _release_sent_outputs(self) -> None:
        """Every output whose sends are pending: wait for them and free it (``lean``, before a compute)."""
        for j, s in list(self._sent_outputs):
            self._release_sent_output(j, s)

    def _free_output(self, key: tuple[int, int]) -> None:
        """Give the sent output ``key`` an empty storage, keeping its gradient edge for its backward
        (module docstring). A view (its base would stay), a tensor subclass or an output with no graph
        (a forward recomputed later) is only dropped at its backward, as before."""
        out = self._outputs.get(key)
        if out is None or type(out) is not torch.Tensor or out._base is not None:
            return
        if out.grad_fn is not None:
            self._edges[id(out)] = get_gradient_edge(out)
        elif out.requires_grad or key[1] not in self.recompute_full:
            return  # a leaf (the stage returned its input): not this output's to free
        out.data = torch.empty(0, dtype=out.dtype, device=out.device)

    def _root(self, t: torch.Tensor) -> torch.Tensor | GradientEdge:
        """Where a backward from ``t`` starts: its gradient edge if it was freed, else ``t``."""
        return self._edges.get(id(t), t)

    def _post(self, shape: torch.Size, dtype: torch.dtype, peer: int, tag: int) -> tuple[Any, torch.Tensor]:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return dist.irecv(buf, self.peers[peer], tag=tag), buf

    def _input_shape(self, j: int, s: int) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of stage ``s``'s input for micro-batch ``j`` (a slice's is smaller)."""
        return (self.slice_shapes if self.batching.is_slice(j) else self.input_shapes)[s]

    def _recv(self, peer: int, tag: int) -> torch.Tensor:
        """The message ``tag`` from pipeline rank ``peer``, whose receive was posted (see
        :meth:`run`): waits for it."""
        posted = self._posted.pop(tag, None)
        if posted is None:
            raise RuntimeError(f"message {tag} from pipeline rank {peer} was never posted")
        work, buf = posted
        if work is not None:
            work.wait()
        return buf

    def wait_sends(self) -> None:
        for work, _ in [*self._pending, *(w for sent in self._sent_outputs.values() for w in sent)]:
            if work is not None:
                work.wait()
        self._pending.clear()
        self._sent_outputs.clear()

    # -- actions -------------------------------------------------------------------------

    def _input(self, j: int, s: int) -> torch.Tensor:
        """Input of micro-batch ``j`` to stage ``s``: received, the data, or this rank's own
        previous stage (one device holding consecutive chunks)."""
        key = (j, s)
        if key in self._inputs:
            return self._inputs[key]
        if s == 0:
            return self.data(j)
        x = self._outputs[(j, s - 1)].detach().requires_grad_(True)
        self._inputs[key] = x
        return x

    def _forward(self, j: int, s: int) -> None:
        """Forward of micro-batch ``j`` through stage ``s`` (:meth:`_stage_forward`); a stage
        recomputed in full runs it without keeping anything for backward (:meth:`_recomputed`)."""
        x = self._input(j, s)
        if s in self.recompute_full:
            self._rng[(j, s)] = rng_state(self.device)
            with torch.no_grad():
                self._keep_output((j, s), self.stages[s](x))
            return
        self._keep_output((j, s), self._stage_forward(j, s, x))

    def _stage_forward(self, j: int, s: int, x: torch.Tensor) -> torch.Tensor:
        """Stage ``s``'s output on ``x`` (micro-batch ``j``). A stage whose backward is split (it
        has ``I`` actions) and is an ``nn.Sequential`` runs layer by layer, keeping each layer
        with parameters' output, so that its ``W`` can start from those outputs' gradients
        (:meth:`_backward_weight`); the same operations, the same result."""
        mod = self.stages[s]
        if s not in self._split_stages or not isinstance(mod, nn.Sequential):
            return mod(x)
        kept = []
        for layer in mod:
            x = layer(x)
            params = [p for p in layer.parameters() if p.requires_grad]
            if params and isinstance(x, torch.Tensor) and x.requires_grad:
                kept.append((x, x._version, params))
        self._layer_outputs[(j, s)] = kept
        return x

    def _recomputed(self, j: int, s: int, call: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Full recomputation: the output of micro-batch ``j`` on stage ``s`` computed again from
        its kept input, with its graph (``call``, default :meth:`_stage_forward`), under the
        random-number state its forward had; the last stage's loss share (not tallied again)."""
        x = self._input(j, s)
        with rng_restored(self._rng.pop((j, s)), self.device), torch.enable_grad():
            y = call(x) if call is not None else self._stage_forward(j, s, x)
            if s == self.num_stages - 1:
                y = self.loss_fn(y, j) / self.batching.loss_divisor(j)
        return y

    def _keep_output(self, key: tuple[int, int], y: torch.Tensor) -> None:
        """Keep stage output ``y`` of (micro-batch, stage) ``key`` for its backward; the last
        stage keeps the micro-batch's share of the loss instead (and adds it to the tally)."""
        if key[1] == self.num_stages - 1:
            loss = self.loss_fn(y, key[0]) / self.batching.loss_divisor(key[0])
            self._loss_sum = self._loss_sum + loss.detach()  # no host sync per micro-batch
            self._outputs[key] = loss
        else:
            self._outputs[key] = y
            self._out_meta[key] = (y.shape, y.dtype)

    def _output_grad(self, j: int, s: int, out: torch.Tensor) -> torch.Tensor | None:
        """The gradient of stage ``s``'s output for micro-batch ``j``: None for the loss (last
        stage), else received, or left by the next stage on this rank (zeros if it had none)."""
        if s == self.num_stages - 1:
            return None
        grad = self._out_grads.pop((j, s), None)
        if grad is None:  # next stage on this rank
            grad = self._in_grads.pop((j, s + 1))
            if grad is None:
                grad = torch.zeros_like(out)
        return grad

    def _backward(self, j: int, s: int) -> None:
        key = (j, s)
        out = self._outputs.pop(key)
        root = self._edges.pop(id(out), out)
        if s in self.recompute_full:
            out = root = self._recomputed(j, s)
        torch.autograd.backward(root, self._output_grad(j, s, out))
        x = self._inputs.pop(key, None)
        if s > 0:
            self._in_grads[key] = (x.grad if x is not None and x.grad is not None
                                   else None)

    def _backward_input(self, j: int, s: int) -> None:
        """``I``: the gradient of the stage's input only, the graph kept for the ``W``; with the
        stage's layer outputs kept (:meth:`_forward`), their gradients too, in the same pass."""
        key = (j, s)
        out = self._outputs.pop(key)
        root = self._root(out)
        if s in self.recompute_full:  # the recomputed forward belongs to I (W finds the graph I kept)
            out = root = self._recomputed(j, s)
        grad = self._output_grad(j, s, out)
        x = self._inputs.pop(key, None)
        want_x = s > 0 and x is not None and x.requires_grad
        kept = self._layer_outputs.pop(key, None)
        params = [p for p in self.stages[s].parameters() if p.requires_grad]
        shared = len({id(p) for _, _, ps in kept or () for p in ps}) < sum(len(ps) for _, _, ps in kept or ())
        if kept and not shared and {id(p) for _, _, ps in kept for p in ps} == {id(p) for p in params} \
                and all(y._version == v for y, v, _ in kept):
            roots = [self._root(y) for y, _, _ in kept]  # the stage's output among them: freed once sent
            wanted: list[Any] = ([x] if want_x and x is not None else []) + roots  # tensors and edges alike
            with keeping_core_gradients():  # a selective core recomputed here is not recomputed by the W
                grads = torch.autograd.grad(root, wanted, grad, retain_graph=True, allow_unused=True)
            if s > 0:
                self._in_grads[key] = grads[0] if want_x else None
            # a layer output the stage's output does not depend on (no gradient) has no W
            self._weight_work[key] = [(y, g, ps) for (_, _, ps), y, g in zip(kept, roots, grads[len(grads) - len(kept):],
                                                                           strict=True) if g is not None]
            self._edges.pop(id(out), None)
            return
        if s > 0:
            dx = None
            if want_x and x is not None:
                with keeping_core_gradients():
                    dx = torch.autograd.grad(root, x, grad, retain_graph=True, allow_unused=True)[0]
            self._in_grads[key] = dx
        self._edges.pop(id(out), None)
        self._weight_work[key] = [(root, grad, params)]

    def _backward_weight(self, j: int, s: int) -> None:
        """``W``: the weights' gradients of the micro-batch, accumulated into ``.grad`` as ``B``
        does: from each kept layer output's gradient through that layer only, or from the
        stage's output (which computes again the input gradients inside the stage on the way)."""
        for y, g, params in self._weight_work.pop((j, s)):
            if params:  # g is None only for the last stage's loss
                torch.autograd.backward(y, g, inputs=params)

    def order_channels(self, channels: Mapping[int, Sequence[Message]]) -> None:
        """Post the messages exchanged with each pipeline rank in this order
        (:func:`partitioner.channels.channel_order`: the order both ends post them, which a
        backend that matches by order, NCCL, needs); without it, each run's list's own order."""
        self._cursors = {peer: ChannelCursor(seq) for peer, seq in channels.items()}

    def _post_key(self, peer: int, key: Key) -> None:
        """Post the receive of message ``key`` (a match key) from pipeline rank ``peer``."""
        direction, j, sender = key
        if direction == "act":
            shape, dtype = self._input_shape(j, sender + 1)
            self._acts_ahead[peer] = self._acts_ahead.get(peer, 0) + 1
        else:  # the gradient of this rank's output of stage sender - 1
            meta = self._out_meta.pop((j, sender - 1), None)
            if meta is None:
                raise RuntimeError(f"gradient {key} from pipeline rank {peer} must be received before the "
                                   f"forward of micro-batch {j} on stage {sender - 1} ran: the channel order does "
                                   "not fit this rank's list")
            shape, dtype = meta
            self._grads_ahead[peer] = self._grads_ahead.get(peer, 0) + 1
        tag = message_tag(direction, j, sender, self.num_stages)
        self._posted[tag] = self._post(shape, dtype, peer, tag)

    def _post_ahead(self, cursors: Mapping[int, ChannelCursor]) -> None:
        """Post, per peer and in its channel order, the receives that can be posted now: an
        activation while no other from that peer is waiting to be taken, a gradient likewise and
        once the forward it belongs to has run (its shape is then known)."""
        for peer, cursor in cursors.items():
            while (key := cursor.next_receive()) is not None:
                if key[0] == "act" and self._acts_ahead.get(peer, 0) > 0:
                    break
                if key[0] == "grad" and (self._grads_ahead.get(peer, 0) > 0
                                         or (key[1], key[2] - 1) not in self._out_meta):
                    break
                self._post_key(peer, cursor.advance())

    def _communicate(self, a: Action, cursor: ChannelCursor) -> None:
        """A send or receive action: the receives its channel puts before it are posted first."""
        k, j, s, S = a.kind, a.micro_batch, a.stage, self.num_stages
        key = match_key(a)
        if k in (SEND_ACT, SEND_GRAD):
            for earlier in cursor.send(key):
                self._post_key(a.peer, earlier)
            if k == SEND_ACT:
                sent = self._send(self._outputs[(j, s)], a.peer, message_tag("act", j, s, S))
                self._sent_outputs.setdefault((j, s), []).extend(sent)
                return
            g = self._in_grads.pop((j, s))
            if g is None:
                shape, dtype = self._input_shape(j, s)
                g = torch.zeros(shape, dtype=dtype, device=self.device)
            self._pending.extend(self._send(g, a.peer, message_tag("grad", j, s, S)))
            return
        for needed in cursor.receive(key):
            self._post_key(a.peer, needed)
        buf = self._recv(a.peer, message_tag(*key, S))
        if k == RECV_ACT:
            self._acts_ahead[a.peer] -= 1
            self._inputs[(j, s)] = buf.requires_grad_(True)
        else:
            self._grads_ahead[a.peer] -= 1
            self._out_grads[(j, s)] = buf
            self._release_sent_output(j, s)

    def run(self, actions: Sequence[Action]) -> None:
        """Execute ``actions`` (one rank's list) in order.

        Every message is posted in its channel's order (:meth:`order_channels`), and receives are
        posted ahead, so that a message can be taken in while this rank computes rather than only
        when it asks for it (NCCL moves a message only once its receive is posted): the next
        activation from a peer as soon as the previous one is taken, and the next gradient likewise
        once the forward it belongs to has run, each as far as the channel's order allows. At most
        one activation buffer and one gradient buffer per peer more than the schedule holds.
        """
        clock, seconds = time.perf_counter, self.seconds
        self._split_stages = {a.stage for a in actions if a.kind == I}
        self.lean = len(self.peers) == self.num_stages and not any(a.kind in (PUSH, PULL) for a in actions) \
            and not isinstance(self, StashingExecutor)
        cursors = self._cursors
        if cursors is None:
            cursors = {peer: ChannelCursor(seq) for peer, seq in own_order(actions).items()}
        for cursor in cursors.values():
            cursor.restart()
        self._post_ahead(cursors)
        for a in actions:
            k = a.kind
            t0 = clock()
            if k in (F, B, I, W):
                self._compute(a, t0)
            elif k in (SEND_ACT, SEND_GRAD):
                self._communicate(a, cursors[a.peer])
            elif k in (RECV_ACT, RECV_GRAD):
                self._communicate(a, cursors[a.peer])
                seconds["recv"] += clock() - t0
            elif k == STEP:
                self.step(a.version)
                seconds["step"] += clock() - t0
            elif k == PUSH:
                self.push(a.version)
                seconds["step"] += clock() - t0
            elif k == PULL:
                self.pull(a.version)
                seconds["step"] += clock() - t0
            else:
                raise ValueError(f"action {k} is not executed by this runtime")
            if k in (F, RECV_ACT, RECV_GRAD, SEND_ACT, SEND_GRAD):
                self._post_ahead(cursors)

    def _compute(self, a: Action, t0: float) -> None:
        """F, B, I or W of ``a``; under emulation, held until its target (:mod:`runtime.emulation`)."""
        k, j, s = a.kind, a.micro_batch, a.stage
        if self.lean and self._sent_outputs:  # (counted as time waiting on messages)
            self._release_sent_outputs()
            now = time.perf_counter()
            self.seconds["recv"] += now - t0
            t0 = now
        meter = self.meter
        with (meter.tracking(self._held(), self._weights()) if meter is not None and meter.enabled
              else contextlib.nullcontext()):
            if k == F:
                self._forward(j, s)
            elif k == B:
                self._backward(j, s)
            elif k == I:
                self._backward_input(j, s)
            else:
                self._backward_weight(j, s)
        if self.stretch is None:
            self.seconds["compute"] += time.perf_counter() - t0
            return
        # heterogeneity emulation: the action takes its stage's factor times its compute
        share = 1.0 / self.batching.first_slices if self.batching.is_slice(j) else 1.0
        if k in (I, W):  # a part of the backward: its share of the backward's target
            share *= self.stretch.split_share(s, k == W)
        compute, slept = self.stretch.hold(s, k != F, t0, share)
        self.seconds["compute"] += compute
        self.seconds["emulation"] += slept

    def _held(self) -> Iterator[torch.Tensor]:
        """The activations and gradients this rank holds between its actions (for the meter)."""
        for store in (self._inputs, self._outputs, self._out_grads, self._in_grads):
            yield from (t for t in store.values() if isinstance(t, torch.Tensor))
        yield from (buf for _, buf in self._posted.values())
        for kept in self._layer_outputs.values():
            yield from (y for y, _, _ in kept)
        for work in self._weight_work.values():
            for y, g, _ in work:
                if isinstance(y, torch.Tensor):
                    yield y
                if g is not None:
                    yield g

    def _weights(self) -> Iterator[torch.Tensor]:
        """The weights this rank's forwards use (model state, not activations, for the meter)."""
        for mod in self.stages.values():
            yield from mod.parameters()

    def push(self, wave: int) -> None:
        raise ValueError("PUSH needs the WSP executor (runtime.wsp.WspExecutor)")

    def pull(self, wave: int) -> None:
        raise ValueError("PULL needs the WSP executor (runtime.wsp.WspExecutor)")

    def step(self, version: int = -1) -> None:
        self.wait_sends()
        if self.sync is not None:
            self.sync()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if any(s == self.num_stages - 1 for s in self.stages):
            self.losses.append(float(self._loss_sum))
        self._reset()
        if self.step_ends is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.step_ends.append(time.perf_counter())


class StashingExecutor(PipelineExecutor):
    """The base of the executors that keep the weights outside the stage modules and update them
    themselves, 2bw (:mod:`runtime.twobw`) and wsp (:mod:`runtime.wsp`): weight stashing (an
    update makes new tensors; a micro-batch in flight keeps the ones its forward used), plain SGD
    of learning rate ``lr``, no optimizer.

    ``groups``: this rank's parameters per holder set (:meth:`runtime.layout.Layout.holder_sets`)
    as ``(process group or None for a set of this rank alone, [(stage, name)])``, in the order every
    rank walks them, and ``group_ranks`` the ranks of each. Must be constructed on every rank (it
    creates process groups, a collective call); a subclass makes its own state in :meth:`_setup`."""

    def __init__(self, stages: Mapping[int, nn.Module], num_stages: int, peers: Sequence[int],
                 input_shapes: Mapping[int, tuple[torch.Size, torch.dtype]], micro_batches: int,
                 data: Callable[[int], torch.Tensor], loss_fn: Callable[[torch.Tensor, int], torch.Tensor],
                 device: torch.device, *, layout: Layout, rank: int, lr: float):
        super().__init__(stages, num_stages, peers, input_shapes, micro_batches, data, loss_fn, None, device)
        self.lr = lr
        self.workers = layout.workers
        self.push_times: dict[int, float] = {}  # iteration (wave) -> when its STEP (PUSH) ran
        # iteration (wave) -> (stage, parameter) -> the gradient summed over its micro-batches
        self._grads: dict[int, dict[tuple[int, str], torch.Tensor]] = {}
        layer_of = {(s, n): int(n.split("_", 1)[0]) for s, mod in self.stages.items()
                    for n, _ in mod.named_parameters()}
        self.groups: list[tuple[Any, list[tuple[int, str]]]] = []
        self.group_ranks: list[tuple[int, ...]] = []
        for ranks, layers in layout.holder_sets():  # (every rank makes the same groups: new_group is collective)
            group = dist.new_group(list(ranks)) if len(ranks) > 1 else None
            if rank in ranks:
                keys = [k for k, layer in layer_of.items() if layer in layers]
                if keys:
                    self.groups.append((group, keys))
                    self.group_ranks.append(tuple(ranks))
        self._setup(layout, rank)

    def _setup(self, layout: Layout, rank: int) -> None:
        """The subclass's own state, made last in construction (after the holder sets' groups)."""

    def _stashed(self, key: tuple[int, int], s: int) -> dict[str, torch.Tensor]:
        """The weights micro-batch ``key``'s forward on stage ``s`` used, given up by the stash."""
        raise NotImplementedError

    def _backward(self, j: int, s: int) -> None:
        """Micro-batch ``j``'s backward on stage ``s`` with the weights its forward used: their
        gradients accumulate into the micro-batch's iteration (wave), its input's is kept for the
        stage before."""
        key = (j, s)
        out = self._outputs.pop(key)
        root = self._edges.pop(id(out), out)  # (a sent output is freed once its gradient arrives)
        used = self._stashed(key, s)
        if s in self.recompute_full:
            out = root = self._recomputed(j, s, lambda x: functional_call(self.stages[s], used, (x,)))
        grad: torch.Tensor | None = None
        if s != self.num_stages - 1:
            grad = self._out_grads.pop(key, None)
            if grad is None:
                grad = self._in_grads.pop((j, s + 1), None)
                if grad is None:
                    grad = torch.zeros_like(out)
        x = self._inputs.pop(key, None)
        wants_x = s > 0 and x is not None and x.requires_grad
        inputs: list[torch.Tensor] = list(used.values())
        if wants_x and x is not None:
            inputs.append(x)
        grads = torch.autograd.grad(root, inputs, grad_outputs=grad, allow_unused=True)
        acc = self._grads.setdefault(j // self.m, {})
        for (name, leaf), g in zip(used.items(), grads, strict=False):
            k = (s, name)
            if g is None:
                acc.setdefault(k, torch.zeros_like(leaf))
            else:
                acc[k] = acc[k] + g if k in acc else g.detach().clone()
        if s > 0:
            self._in_grads[key] = grads[-1] if wants_x else None

    def _stashed_forward(self, j: int, s: int, weights: dict[str, torch.Tensor]) -> None:
        """Micro-batch ``j``'s forward on stage ``s`` with ``weights`` (a version kept for its
        backward); a stage recomputed in full keeps nothing for backward."""
        x = self._input(j, s)
        if s in self.recompute_full:
            self._rng[(j, s)] = rng_state(self.device)
            with torch.no_grad():
                self._keep_output((j, s), functional_call(self.stages[s], weights, (x,)))
            return
        self._keep_output((j, s), functional_call(self.stages[s], weights, (x,)))

    def _leaf_copies(self) -> dict[int, dict[str, torch.Tensor]]:
        """Stage -> parameter name -> a copy of the module's parameter as a leaf that takes gradients."""
        return {s: {n: p.detach().clone().requires_grad_(True) for n, p in mod.named_parameters()}
                for s, mod in self.stages.items()}
