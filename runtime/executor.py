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
    the backward of ``j`` through ``s`` in two (the zero-bubble schedules): ``I`` computes only the
    gradient of the stage's input (``torch.autograd.grad`` w.r.t. it, keeping the graph), which its
    ``SEND_GRAD`` sends on; ``W`` later computes the weights' gradients from the same graph and
    output gradient (``torch.autograd.backward`` with ``inputs=`` the stage's parameters, which
    accumulates them as ``B`` does). ``I`` then ``W`` leaves the same gradients as ``B``.
``SEND_ACT`` / ``SEND_GRAD``
    ``isend`` of the stage's output / input gradient to the peer (posted, not waited: the
    schedules' matching rule needs sends that do not wait for the receiver).
``RECV_ACT`` / ``RECV_GRAD``
    ``irecv`` into a buffer of the known shape, waited at once. Activation shapes come from a
    dry pass on the meta device (one for whole micro-batches, one for slices); a gradient has
    the shape of the stage's own output.
``STEP``
    wait for this iteration's sends, average gradients over the virtual workers (the
    ``sync`` callback), optimizer step, zero the gradients.

Messages carry the tag of :func:`partitioner.schedule.match_key`; FIFO order per pair of
ranks matches them as well (NCCL ignores tags).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

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
)

from .emulation import Stretch
from .layout import Layout

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
        self.stretch: Stretch | None = None
        # stage -> the weight-gradient share of its backward, for stretching a split backward's I
        # and W under emulation (default: half each, the profile's estimate rule)
        self.weight_share: dict[int, float] = {}
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
        # (micro-batch, stage) -> the output and its gradient an I left for its W
        self._weight_work: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._loss_sum: torch.Tensor | float = 0.0  # a device tensor: read back once per iteration

    # -- communication -------------------------------------------------------------------

    def _send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        buf = tensor.detach().contiguous()
        for dst in self.send_to.get(peer, (self.peers[peer],)):
            self._pending.append((dist.isend(buf, dst, tag=tag), buf))

    def _post(self, shape: torch.Size, dtype: torch.dtype, peer: int, tag: int) -> tuple[Any, torch.Tensor]:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        return dist.irecv(buf, self.peers[peer], tag=tag), buf

    def _input_shape(self, j: int, s: int) -> tuple[torch.Size, torch.dtype]:
        """Shape and dtype of stage ``s``'s input for micro-batch ``j`` (a slice's is smaller)."""
        return (self.slice_shapes if self.batching.is_slice(j) else self.input_shapes)[s]

    def _recv(self, shape: torch.Size, dtype: torch.dtype, peer: int, tag: int) -> torch.Tensor:
        """The message ``tag`` from pipeline rank ``peer``: its receive was posted ahead (see
        :meth:`run`) or is posted now; waits for it."""
        posted = self._posted.pop(tag) if tag in self._posted else self._post(shape, dtype, peer, tag)
        work, buf = posted
        if work is not None:
            work.wait()
        return buf

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            if work is not None:
                work.wait()
        self._pending.clear()

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
        self._keep_output((j, s), self.stages[s](self._input(j, s)))

    def _keep_output(self, key: tuple[int, int], y: torch.Tensor) -> None:
        """Keep stage output ``y`` of (micro-batch, stage) ``key`` for its backward; the last
        stage keeps the micro-batch's share of the loss instead (and adds it to the tally)."""
        if key[1] == self.num_stages - 1:
            loss = self.loss_fn(y, key[0]) / self.batching.loss_divisor(key[0])
            self._loss_sum = self._loss_sum + loss.detach()  # no host sync per micro-batch
            self._outputs[key] = loss
        else:
            self._outputs[key] = y

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
        torch.autograd.backward(out, self._output_grad(j, s, out))
        x = self._inputs.pop(key, None)
        if s > 0:
            self._in_grads[key] = (x.grad if x is not None and x.grad is not None
                                   else None)

    def _backward_input(self, j: int, s: int) -> None:
        """``I``: the gradient of the stage's input only, the graph kept for the ``W``."""
        key = (j, s)
        out = self._outputs.pop(key)
        grad = self._output_grad(j, s, out)
        x = self._inputs.pop(key, None)
        if s > 0:
            dx = None
            if x is not None and x.requires_grad:
                dx = torch.autograd.grad(out, x, grad, retain_graph=True, allow_unused=True)[0]
            self._in_grads[key] = dx
        self._weight_work[key] = (out, grad)

    def _backward_weight(self, j: int, s: int) -> None:
        """``W``: the weights' gradients of the micro-batch, accumulated into ``.grad`` as ``B`` does."""
        out, grad = self._weight_work.pop((j, s))
        params = [p for p in self.stages[s].parameters() if p.requires_grad]
        if params:
            torch.autograd.backward(out, grad, inputs=params)

    def run(self, actions: Sequence[Action]) -> None:
        """Execute ``actions`` (one rank's list) in order.

        Receives are posted ahead, so that a message can be taken in while this rank computes
        rather than only when it asks for it (NCCL moves a message only once its receive is
        posted): the next activation as soon as the previous one is taken, and a gradient as soon
        as the forward it belongs to has run (its shape is then known). At most one activation
        buffer more than the schedule holds.
        """
        S = self.num_stages
        clock, seconds = time.perf_counter, self.seconds
        act_recvs = [a for a in actions if a.kind == RECV_ACT]
        grad_recv = {(a.micro_batch, a.stage): a for a in actions if a.kind == RECV_GRAD}
        next_act = 0

        def post_next_activation() -> None:
            nonlocal next_act
            if next_act < len(act_recvs):
                r = act_recvs[next_act]
                next_act += 1
                shape, dtype = self._input_shape(r.micro_batch, r.stage)
                tag = message_tag("act", r.micro_batch, r.stage - 1, S)
                self._posted[tag] = self._post(shape, dtype, r.peer, tag)

        post_next_activation()
        for a in actions:
            k, j, s = a.kind, a.micro_batch, a.stage
            t0 = clock()
            if k in (F, B, I, W):
                if k == F:
                    self._forward(j, s)
                    later = grad_recv.get((j, s))
                    if later is not None:  # post the receive of this output's gradient now
                        y = self._outputs[(j, s)]
                        tag = message_tag("grad", j, s + 1, S)
                        self._posted[tag] = self._post(y.shape, y.dtype, later.peer, tag)
                elif k == B:
                    self._backward(j, s)
                elif k == I:
                    self._backward_input(j, s)
                else:
                    self._backward_weight(j, s)
                if self.stretch is None:
                    seconds["compute"] += clock() - t0
                else:  # heterogeneity emulation: the action takes its stage's factor times its compute
                    share = 1.0 / self.batching.first_slices if self.batching.is_slice(j) else 1.0
                    if k in (I, W):  # a part of the backward: its share of the backward's target
                        w = self.weight_share.get(s, 0.5)
                        share *= w if k == W else 1.0 - w
                    compute, slept = self.stretch.hold(s, k != F, t0, share)
                    seconds["compute"] += compute
                    seconds["emulation"] += slept
            elif k == SEND_ACT:
                self._send(self._outputs[(j, s)], a.peer, message_tag("act", j, s, S))
            elif k == RECV_ACT:
                shape, dtype = self._input_shape(j, s)
                self._inputs[(j, s)] = self._recv(shape, dtype, a.peer,
                                                  message_tag("act", j, s - 1, S)).requires_grad_(True)
                post_next_activation()
                seconds["recv"] += clock() - t0
            elif k == SEND_GRAD:
                g = self._in_grads.pop((j, s))
                if g is None:
                    shape, dtype = self._input_shape(j, s)
                    g = torch.zeros(shape, dtype=dtype, device=self.device)
                self._send(g, a.peer, message_tag("grad", j, s, S))
            elif k == RECV_GRAD:
                out = self._outputs[(j, s)]
                self._out_grads[(j, s)] = self._recv(out.shape, out.dtype, a.peer, message_tag("grad", j, s + 1, S))
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
        grad: torch.Tensor | None = None
        if s != self.num_stages - 1:
            grad = self._out_grads.pop(key, None)
            if grad is None:
                grad = self._in_grads.pop((j, s + 1), None)
                if grad is None:
                    grad = torch.zeros_like(out)
        used = self._stashed(key, s)
        x = self._inputs.pop(key, None)
        wants_x = s > 0 and x is not None and x.requires_grad
        inputs: list[torch.Tensor] = list(used.values())
        if wants_x and x is not None:
            inputs.append(x)
        grads = torch.autograd.grad(out, inputs, grad_outputs=grad, allow_unused=True)
        acc = self._grads.setdefault(j // self.m, {})
        for (name, leaf), g in zip(used.items(), grads, strict=False):
            k = (s, name)
            if g is None:
                acc.setdefault(k, torch.zeros_like(leaf))
            else:
                acc[k] = acc[k] + g if k in acc else g.detach().clone()
        if s > 0:
            self._in_grads[key] = grads[-1] if wants_x else None

    def _leaf_copies(self) -> dict[int, dict[str, torch.Tensor]]:
        """Stage -> parameter name -> a copy of the module's parameter as a leaf that takes gradients."""
        return {s: {n: p.detach().clone().requires_grad_(True) for n, p in mod.named_parameters()}
                for s, mod in self.stages.items()}
