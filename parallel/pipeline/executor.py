"""The pipeline executor: one loop that walks this rank's action list (parallel/pipeline/schedules.py).

    F  receive the input activation (stage > 0; tokens on stage 0), run the chunk, send its output on (or, on
       the last stage, compute the loss)
    B  receive the output gradient (or start from the loss), backward, send the input gradient back
    I  as B, but for the input gradient only: the weights' part is kept for W (torch's stage_backward_input)
    W  the weight gradients from what I kept, without redoing the backward

Point-to-point messages go through ``dist.batch_isend_irecv`` on global ranks of this pipeline. The sends an
action produces are posted in one batch with the receives the next action needs (Megatron's pattern: NCCL sees
each pair's sends and receives together, so two ranks sending to each other cannot block on one another), and
a send is waited for only once its buffer could be reused (at the latest at the end of the step). Every rank can
compute every rank's action list, so this rank posts its receives from each peer in exactly the order that peer
sends them: NCCL matches same-shaped messages by order alone and would otherwise swap them silently.

Shapes are known in advance: [micro_batch, seq (/ tp under sequence parallelism), d_model] in the residual
stream's dtype (the parameters'). Tokens are read on the first stage only, labels on the last; the last stage
returns the summed loss of its micro-batches (unscaled), other stages zero. A micro-batch's activations are
dropped as soon as its backward (B, or W) is done. Gradient sync is off during the schedule and the reducer
reduces every bucket after the last backward.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import stage_backward_input

from trident.parallel.pipeline.schedules import Action, B, F, I, Schedule, W, build_schedule, forward_only, stage_of
from trident.parallel.reducer import GradReducer
from trident.precision import autocast

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# A message is named by what it carries: ("act", micro, stage) is the input activation of ``stage``, ("grad",
# micro, stage) the gradient of ``stage``'s output. Each has one sender and one receiver.
Message = tuple[str, int, int]


def sends_of(action: Action, rank: int, pp: int, stages: int) -> list[tuple[Message, int]]:
    """What ``action`` on ``rank`` sends, to which pipeline rank."""
    s = stage_of(action.chunk, rank, pp)
    if action.kind == F and s < stages - 1:
        return [(("act", action.micro, s + 1), (s + 1) % pp)]
    if action.kind in (B, I) and s > 0:
        return [(("grad", action.micro, s - 1), (s - 1) % pp)]
    return []


def needs_of(action: Action, rank: int, pp: int, stages: int) -> Message | None:
    """The message ``action`` on ``rank`` must have received before it runs."""
    s = stage_of(action.chunk, rank, pp)
    if action.kind == F and s > 0:
        return ("act", action.micro, s)
    if action.kind in (B, I) and s < stages - 1:
        return ("grad", action.micro, s)
    return None


def receive_order(schedule: Schedule, rank: int, stages: int) -> dict[int, deque[Message]]:
    """For each peer pipeline rank, the messages it sends to ``rank``, in the order it sends them."""
    pp = len(schedule)
    order: dict[int, deque[Message]] = {}
    for peer, ops in enumerate(schedule):
        for action in ops:
            for message, dst in sends_of(action, peer, pp, stages):
                if dst == rank:
                    order.setdefault(peer, deque()).append(message)
    return order


def backward_weight(param_groups: list[dict]) -> None:
    """The weight gradients of a chunk from what ``stage_backward_input`` kept: backward from the saved
    gradients of the intermediates to the weights only. Unlike torch's ``stage_backward_weight`` (which writes
    ``.grad`` itself) this accumulates through autograd, so the reducer's post-accumulate hooks see every one."""
    for group in param_groups:
        edges, grads = [], []
        for saved, node in zip(group["grads"], group["intermediates"], strict=True):
            for i, g in enumerate(saved):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        handles = []
        if len(group["intermediates"]) > 1:
            # An intermediate reached again through another one must take its saved gradient, not a second sum.
            handles = [
                node.register_prehook(lambda _, sg=saved: sg)
                for saved, node in zip(group["grads"], group["intermediates"], strict=True)
            ]
        try:
            if edges:
                torch.autograd.backward(edges, grad_tensors=grads, inputs=[acc.variable for acc in group["params"]])
        finally:
            for h in handles:
                h.remove()


class PipelineRunner:
    """Runs a pipeline schedule over this rank's model chunks (``Runner`` of trident/runner.py).

    ``chunks[c]`` is virtual stage ``c * pp + pp_rank``; ``pp_ranks`` the global ranks of this pipeline in stage
    order; ``seq_divisor`` tp under sequence parallelism (activations are sequence shards), else 1.
    ``timings``: a JSON-lines file to which each step's actions are appended with their start and end times.
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        schedule: str,
        pp_rank: int,
        pp_ranks: Sequence[int],
        pp_group: dist.ProcessGroup,
        reducer: GradReducer,
        precision: str,
        d_model: int,
        seq_divisor: int = 1,
        timings: Path | None = None,
    ) -> None:
        self.chunks, self.schedule = list(chunks), schedule
        self.pp_rank, self.pp_ranks, self.pp_group = pp_rank, tuple(pp_ranks), pp_group
        self.pp, self.vpp = len(self.pp_ranks), len(self.chunks)
        self.stages = self.pp * self.vpp
        self.reducer, self.precision = reducer, precision
        self.d_model, self.seq_divisor = d_model, seq_divisor
        self.timings, self.calls = timings, 0
        first = next(p for c in self.chunks for p in c.parameters())
        self.device, self.dtype = first.device, first.dtype
        # NCCL creates a communicator on a group's first collective, which every member must join; p2p batches
        # involve only neighbours, so join here.
        dist.barrier(group=pp_group)

    def forward_backward(self, micro_batches: list[Batch], loss_fn: LossFn, loss_multiplier: float) -> torch.Tensor:
        for chunk in self.chunks:
            chunk.train()
        schedule = build_schedule(self.schedule, self.pp, self.vpp, len(micro_batches))
        self.reducer.set_sync(False)  # every bucket is reduced once, after the last backward
        total = _Step(self, schedule, micro_batches, loss_fn, loss_multiplier, train=True).run()
        self.reducer.finish()
        return total

    @torch.no_grad()
    def forward_only(self, micro_batches: list[Batch], loss_fn: LossFn) -> torch.Tensor:
        for chunk in self.chunks:
            chunk.eval()
        schedule = forward_only(build_schedule(self.schedule, self.pp, self.vpp, len(micro_batches)))
        return _Step(self, schedule, micro_batches, loss_fn, 1.0, train=False).run()

    def activation_shape(self, micro_batches: list[Batch]) -> tuple[int, int, int]:
        b, t = micro_batches[0][0].shape
        return (b, t // self.seq_divisor, self.d_model)


class _Step:
    """One walk of this rank's action list: its messages, saved activations and loss."""

    def __init__(
        self,
        runner: PipelineRunner,
        schedule: Schedule,
        micro_batches: list[Batch],
        loss_fn: LossFn,
        loss_multiplier: float,
        train: bool,
    ) -> None:
        self.r, self.schedule, self.batches = runner, schedule, micro_batches
        self.loss_fn, self.loss_multiplier, self.train = loss_fn, loss_multiplier, train
        self.shape = runner.activation_shape(micro_batches)
        self.expected = receive_order(schedule, runner.pp_rank, runner.stages)
        self.received: dict[Message, tuple[torch.Tensor, dist.Work | None]] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (micro, chunk) -> (in, out)
        self.kept: dict[tuple[int, int], list[dict]] = {}  # what I left for W
        self.total = torch.zeros((), device=runner.device)
        self.spans: list[tuple[str, int, int, float, float]] = []

    def run(self) -> torch.Tensor:
        r = self.r
        ops: list[tuple[dist.P2POp, Message | None]] = []  # the next batch; a receive names its message
        for action in self.schedule[r.pp_rank]:
            need = needs_of(action, r.pp_rank, r.pp, r.stages)
            if need is not None:
                self._post_receives(need, ops)
            self._launch(ops)
            ops = []
            received = None if need is None else self._take(need)
            start = time.time()  # after the wait: a span is compute, the gaps between spans are the bubble
            for tensor, dst in self._do(action, received):
                ops.append((dist.P2POp(dist.isend, tensor, r.pp_ranks[dst], r.pp_group), None))
            if r.timings is not None:
                if r.device.type == "cuda":
                    torch.cuda.synchronize(r.device)
                self.spans.append((action.kind, action.micro, action.chunk, start, time.time()))
        self._launch(ops)
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        assert not self.saved and not self.kept and not self.received, "the schedule left work undone"
        if r.timings is not None:
            self._record()
        return self.total

    # -- messages ---------------------------------------------------------------------------------------------

    def _post_receives(self, need: Message, ops: list) -> None:
        """Post receives from ``need``'s sender up to and including ``need``, in the sender's order."""
        if need in self.received:
            return
        r = self.r
        peer = next(p for p, queue in self.expected.items() if need in queue)
        queue = self.expected[peer]
        while True:
            message = queue.popleft()
            buffer = torch.empty(self.shape, dtype=r.dtype, device=r.device)
            self.received[message] = (buffer, None)
            ops.append((dist.P2POp(dist.irecv, buffer, r.pp_ranks[peer], r.pp_group), message))
            if message == need:
                return

    def _launch(self, ops: list[tuple[dist.P2POp, Message | None]]) -> None:
        """Post one batch; remember each receive's handle and each send's (its buffer must live until done)."""
        if not ops:
            return
        works = dist.batch_isend_irecv([op for op, _ in ops])
        # gloo gives a handle per op; NCCL one for the coalesced batch.
        handles = works if len(works) == len(ops) else [works[-1]] * len(ops)
        for (op, message), work in zip(ops, handles, strict=True):
            if message is not None:
                self.received[message] = (self.received[message][0], work)
            else:
                self.sends.append((work, op.tensor))
        # Finished sends let go of their buffers (on this thread: see GradReducer.finish).
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]

    def _take(self, message: Message) -> torch.Tensor:
        buffer, work = self.received.pop(message)
        assert work is not None
        work.wait()
        return buffer

    # -- compute ----------------------------------------------------------------------------------------------

    def _do(self, action: Action, received: torch.Tensor | None) -> list[tuple[torch.Tensor, int]]:
        """Run ``action`` (``received``: the message it needed); return what it sends and to which rank."""
        r = self.r
        key = (action.micro, action.chunk)
        sends = sends_of(action, r.pp_rank, r.pp, r.stages)
        stage = stage_of(action.chunk, r.pp_rank, r.pp)
        if action.kind == F:
            x = self.batches[action.micro][0] if received is None else received.requires_grad_(self.train)
            with autocast(r.precision, r.device):
                out = r.chunks[action.chunk](x)
            if stage == r.stages - 1:
                loss = self.loss_fn(out, self.batches[action.micro][1])
                self.total += loss.detach()
                out = loss * self.loss_multiplier
            elif out.shape != self.shape or out.dtype != r.dtype:
                raise RuntimeError(
                    f"stage {stage} sends {tuple(out.shape)} {out.dtype}; expected {self.shape} {r.dtype}"
                )
            if self.train:
                self.saved[key] = (x, out)
            return [(out.detach(), dst) for _, dst in sends]
        if action.kind == W:
            backward_weight(self.kept.pop(key))
            return []
        x, out = self.saved.pop(key)
        if action.kind == B or stage == 0:
            # On stage 0 (token ids in, no input gradient) I is the whole backward and W has nothing left.
            torch.autograd.backward(out, grad_tensors=received)
            if action.kind == I:
                self.kept[key] = []
            dx = x.grad
        else:
            grads = None if received is None else [received]
            (dx,), self.kept[key] = stage_backward_input([out], grads, [x], r.chunks[action.chunk].parameters())
        return [(dx, dst) for _, dst in sends]

    def _record(self) -> None:
        r = self.r
        row = {
            "call": r.calls,
            "rank": r.pp_rank,
            "global_rank": dist.get_rank(),
            "schedule": r.schedule,
            "pp": r.pp,
            "vpp": r.vpp,
            "micro_batches": len(self.batches),
            "train": self.train,
            "spans": self.spans,
        }
        r.calls += 1
        r.timings.parent.mkdir(parents=True, exist_ok=True)
        with open(r.timings, "a") as f:
            f.write(json.dumps(row) + "\n")
