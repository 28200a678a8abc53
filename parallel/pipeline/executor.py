"""The pipeline executor: one loop that walks this rank's action list (parallel/pipeline/schedules.py).

    F  receive the input activation (stage > 0; tokens on stage 0), run the chunk, send its output on (or, on
       the last stage, compute the loss)
    B  receive the output gradient (or start from the loss), backward, send the input gradient back
    I  as B, but the linear layers' weight gradients wait for W (parallel/wgrad.py); a compiled chunk's I is
       torch's stage_backward_input, all of its weights' part kept for W (``backward_weight``)
    W  the weight gradients from what I kept, without redoing the backward

Point-to-point messages go through ``dist.batch_isend_irecv`` on global ranks of this pipeline, planned from
the schedule alone (parallel/pipeline/messages.py): the ranks walk a common clock, and after each tick a rank
posts one batch holding the sends of its action and the receives of what its neighbours sent at that tick, so
both ends of every message are in batches of the same tick (NCCL sees each pair's sends and receives together,
and posted in the same order: it matches same-shaped messages by order alone). On gloo each receive is posted a
tick earlier, so it is usually there before its message (``receive_lead``: a receive posted after its message had
arrived cost the posting rank 0.7 ms). A receive is waited for just before the action that needs it, a send only
once its buffer could be reused (at the latest at the step's end).

Shapes are known in advance: [micro_batch, seq (/ tp under sequence parallelism), d_model] in the residual
stream's dtype (the parameters'). Tokens are read on the first stage only, labels on the last; the last stage
returns the summed loss of its micro-batches (unscaled), other stages zero. A training forward runs inside its
micro-batch's context on the chunk's RNG tracker (dropout's masks are derived from it). A micro-batch's activations are
dropped as soon as its backward (B, or W) is done.

Where two consecutive stages are chunks of this rank (zb-v's turn of the V) the activation and its gradient are
handed over in place, in no batch (``_Step.local``).

Gradient sync is off during the schedule except for each chunk's last action that produces its weight gradients
(its last B; under zb-h1 and zb-v its last W, or on stage 0, where I is the whole backward, its last I): during that
action the chunk's buckets start their dp reduction as they fill, and right after it the rest of them
(``GradReducer.launch_chunk``), so the reduction runs behind the rest of the schedule and ``finish`` at the end only
waits. Every dp rank of a pipeline rank walks the same actions, so they start the buckets in the same order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.graph import GradientEdge

from trident.parallel.batch import Batch
from trident.parallel.pipeline.messages import Message, Step, needs_of, p2p_plan, receive_lead, sends_of
from trident.parallel.pipeline.schedules import (
    Action,
    B,
    F,
    I,
    W,
    build_schedule,
    forward_only,
    makes_weight_grads,
    stage_of,
    stage_placement,
)
from trident.parallel.precision import autocast
from trident.parallel.random import dropout_context
from trident.parallel.reducer import GradReducer
from trident.parallel.wgrad import WeightGradStore, weight_pass

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def backward_weight(param_groups: list[dict], together: bool = False) -> None:
    """A compiled chunk's W: backward from the gradients ``stage_backward_input`` kept for the intermediates to the
    weights, through autograd (the reducer's hooks see every weight), one backward per group as torch's
    ``stage_backward_weight`` (one over all groups would redo the input-gradient path between them,
    tests/test_zb_weight_pass.py). ``together``: one for all groups, for recomputed chunks (each backward would
    recompute the block again)."""
    groups, nodes, seen = [], [], set()
    for group in param_groups:
        edges, grads = [], []
        for saved, node in zip(group["grads"], group["intermediates"], strict=True):
            nodes.append((node, saved))
            for i, g in enumerate(saved):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        weights = [acc.variable for acc in group["params"]]
        # A weight in two groups would get two accumulations, which the reducer counts as two gradients.
        together |= any(id(w) in seen for w in weights)
        seen.update(id(w) for w in weights)
        if edges:
            groups.append((edges, grads, weights))
    if together and groups:
        edges, grads, weights = (sum((g[k] for g in groups), []) for k in range(3))
        weights = list({id(w): w for w in weights}.values())
        groups = [(edges, grads, weights)]
    handles = []
    if len(nodes) > 1:
        # An intermediate reached again through another one must take its saved gradient, not a second sum.
        handles = [node.register_prehook(lambda _, sg=saved: sg) for node, saved in nodes]
    try:
        for k, (edges, grads, weights) in enumerate(groups):
            torch.autograd.backward(edges, grad_tensors=grads, inputs=weights, retain_graph=k < len(groups) - 1)
    finally:
        for h in handles:
            h.remove()


class PipelineRunner:
    """Runs a pipeline schedule over this rank's model chunks (``Runner`` of trident/runner.py).

    ``chunks[c]`` is virtual stage ``stage_of(c, pp_rank, pp, stage_placement(schedule))`` (``c * pp + pp_rank``, or
    under zb-v's V ``pp_rank`` and ``2 * pp - 1 - pp_rank``); ``pp_ranks`` the global ranks of this pipeline in
    pp-rank order; ``seq_divisor`` tp under sequence parallelism (activations are sequence shards), else 1.
    ``timings``: a JSON-lines file to which each step's actions are appended with their start and end times, and
    the span of the reducer's ``finish`` (the dp reduction left exposed after the schedule).
    ``recomputed``: the chunks recompute activations in backward
    (``backward_weight``'s ``together``). The attribute ``lead``: how many ticks before its send a receive is posted
    (parallel/pipeline/messages.py), ``receive_lead`` of the group's backend; a test sets it to run NCCL's plan on
    gloo.
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
        recomputed: bool = False,
        wgrad: WeightGradStore | None = None,
    ) -> None:
        self.chunks, self.schedule = list(chunks), schedule
        self.recomputed, self.wgrad = recomputed, wgrad
        self.pp_rank, self.pp_ranks, self.pp_group = pp_rank, tuple(pp_ranks), pp_group
        self.pp, self.vpp = len(self.pp_ranks), len(self.chunks)
        self.stages, self.placement = self.pp * self.vpp, stage_placement(schedule)
        self.reducer, self.precision = reducer, precision
        self.d_model, self.seq_divisor = d_model, seq_divisor
        self.timings, self.calls = timings, 0
        # The most activation sets (micro-batch x chunk) a training step has held for backward at once: counted from
        # what the step really keeps (memory.json writes it beside the estimator's walk of the same actions).
        self.peak_activation_sets = 0
        self.lead = receive_lead(dist.get_backend(pp_group))
        self._plans: dict[tuple[int, bool, int], list[Step]] = {}
        first = next(p for c in self.chunks for p in c.parameters())
        self.device, self.dtype = first.device, first.dtype
        # NCCL creates a communicator on a group's first collective, which every member must join; p2p batches
        # involve only neighbours, so join here.
        dist.barrier(group=pp_group)

    def forward_backward(self, micro_batches: list[Batch], loss_fn: LossFn, loss_multiplier: float) -> torch.Tensor:
        for chunk in self.chunks:
            chunk.train()
            if hasattr(chunk, "set_loss_multiplier"):  # its auxiliary losses' gradient, the token loss's
                chunk.set_loss_multiplier(loss_multiplier)
        self.reducer.set_sync(False)  # on for each chunk's last backward only (module docstring)
        step = _Step(self, self._plan(len(micro_batches), True), micro_batches, loss_fn, loss_multiplier, True)
        total = step.run()
        start = time.time()
        self.reducer.finish()
        if self.timings is not None:
            step.record(reduce=(start, time.time()))
        return total

    @torch.no_grad()
    def forward_only(self, micro_batches: list[Batch], loss_fn: LossFn) -> torch.Tensor:
        for chunk in self.chunks:
            chunk.eval()
        step = _Step(self, self._plan(len(micro_batches), False), micro_batches, loss_fn, 1.0, train=False)
        total = step.run()
        if self.timings is not None:
            step.record()
        return total

    def _plan(self, micro: int, train: bool) -> list[Step]:
        """This rank's ticks for ``micro`` micro-batches (training, or forwards only), computed once."""
        key = (micro, train, self.lead)
        if key not in self._plans:
            schedule = build_schedule(self.schedule, self.pp, self.vpp, micro)
            planned = schedule if train else forward_only(schedule)
            self._plans[key] = p2p_plan(planned, self.pp_rank, self.stages, self.lead, self.placement)
        return self._plans[key]

    def last_weight_ticks(self, plan: list[Step]) -> dict[int, int]:
        """{tick: chunk} for each chunk's last action of ``plan`` that produces its weight gradients: B, or W
        (zb-h1), or I on stage 0, where I is the whole backward and W has nothing left."""
        last = {}
        for t, tick in enumerate(plan):
            if tick.action is not None and makes_weight_grads(tick.action, self.pp_rank, self.pp, self.placement):
                last[tick.action.chunk] = t
        return {t: c for c, t in last.items()}

    def activation_shape(self, micro_batches: list[Batch]) -> tuple[int, int, int]:
        b, t = micro_batches[0].tokens.shape
        return (b, t // self.seq_divisor, self.d_model)


class _Step:
    """One walk of this rank's ticks (parallel/pipeline/messages.py): its messages, saved activations and loss."""

    def __init__(
        self,
        runner: PipelineRunner,
        plan: list[Step],
        micro_batches: list[Batch],
        loss_fn: LossFn,
        loss_multiplier: float,
        train: bool,
    ) -> None:
        self.r, self.plan, self.batches = runner, plan, micro_batches
        self.loss_fn, self.loss_multiplier, self.train = loss_fn, loss_multiplier, train
        self.shape = runner.activation_shape(micro_batches)
        self.received: dict[Message, tuple[torch.Tensor, dist.Work]] = {}
        self.local: dict[Message, torch.Tensor] = {}  # messages between two chunks of this rank (the V's turn)
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (micro, chunk) -> (in, out)
        self.kept: dict[tuple[int, int], list[dict]] = {}  # what I left for W
        self.total = torch.zeros((), device=runner.device)
        self.spans: list[tuple[str, int, int, float, float]] = []

    def run(self) -> torch.Tensor:
        r = self.r
        last = r.last_weight_ticks(self.plan) if self.train else {}
        for t, tick in enumerate(self.plan):
            outgoing: list[tuple[torch.Tensor, int]] = []
            if tick.action is not None:
                need = needs_of(tick.action, r.pp_rank, r.pp, r.stages, r.placement)
                received = None if need is None else self._take(need)
                start = time.time()  # after the wait: a span is compute, the gaps between spans are the bubble
                chunk = last.get(t)
                if chunk is not None:  # the chunk's last weight gradients: its buckets reduce as they fill
                    r.reducer.set_sync(True, chunk)
                outgoing = self._do(tick.action, received)
                r.peak_activation_sets = max(r.peak_activation_sets, self.held_sets())
                if chunk is not None:
                    r.reducer.set_sync(False, chunk)
                    r.reducer.launch_chunk(chunk)
                if r.timings is not None:
                    if r.device.type == "cuda":
                        torch.cuda.synchronize(r.device)
                    self.spans.append((tick.action.kind, tick.action.micro, tick.action.chunk, start, time.time()))
            self._post(tick, outgoing)
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        assert not (self.saved or self.kept or self.received or self.local), "the schedule left work undone"
        return self.total

    def held_sets(self) -> int:
        """Activation sets this step holds for backward: a forward's (input, output) until its backward, then
        under zb-h1 what I kept for W until W (on stage 0 I keeps nothing: it was the whole backward)."""
        return len(self.saved) + sum(1 for kept in self.kept.values() if kept)

    # -- messages ---------------------------------------------------------------------------------------------

    def _post(self, tick: Step, outgoing: list[tuple[torch.Tensor, int]]) -> None:
        """Post this tick's batch: the action's sends and the receives of what the neighbours sent at this tick.
        Receives are waited for when needed; a send's buffer is kept until it is done."""
        r = self.r
        if not tick.sends and not tick.recvs:
            return
        ops = [dist.P2POp(dist.isend, tensor, r.pp_ranks[dst], r.pp_group) for tensor, dst in outgoing]
        buffers = []
        for message, src in tick.recvs:
            buffers.append((message, torch.empty(self.shape, dtype=r.dtype, device=r.device)))
            ops.append(dist.P2POp(dist.irecv, buffers[-1][1], r.pp_ranks[src], r.pp_group))
        works = dist.batch_isend_irecv(ops)
        # gloo gives a handle per op; NCCL one for the coalesced batch.
        handles = works if len(works) == len(ops) else [works[-1]] * len(ops)
        for (tensor, _), work in zip(outgoing, handles, strict=False):
            self.sends.append((work, tensor))
        for (message, buffer), work in zip(buffers, handles[len(outgoing) :], strict=True):
            self.received[message] = (buffer, work)
        # Finished sends let go of their buffers (on this thread: see GradReducer.finish).
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]

    def _take(self, message: Message) -> torch.Tensor:
        if message in self.local:
            return self.local.pop(message)
        buffer, work = self.received.pop(message)
        work.wait()
        return buffer

    # -- compute ----------------------------------------------------------------------------------------------

    def _do(self, action: Action, received: torch.Tensor | None) -> list[tuple[torch.Tensor, int]]:
        """Run ``action`` (``received``: the message it needed); return what it sends and to which rank. A message
        to a chunk of this rank is kept for it instead."""
        outgoing = []
        for (message, dst), tensor in zip(*self._compute(action, received), strict=True):
            if dst == self.r.pp_rank:
                self.local[message] = tensor
            else:
                outgoing.append((tensor, dst))
        return outgoing

    def _compute(
        self, action: Action, received: torch.Tensor | None
    ) -> tuple[list[tuple[Message, int]], list[torch.Tensor]]:
        """Run ``action``; return its messages (``sends_of``) and the tensor of each."""
        r = self.r
        key = (action.micro, action.chunk)
        sends = sends_of(action, r.pp_rank, r.pp, r.stages, r.placement)
        stage = stage_of(action.chunk, r.pp_rank, r.pp, r.placement)
        if action.kind == F:
            batch, chunk = self.batches[action.micro], r.chunks[action.chunk]
            x = batch.tokens if received is None else received.requires_grad_(self.train)
            with autocast(r.precision, r.device), dropout_context(chunk, batch.step, batch.sample_ids):
                last = stage == r.stages - 1  # given the targets, the last stage returns its loss (GPT.head)
                kwargs = dict(documents=batch.documents, positions=batch.positions, index=batch.index, keys=batch.keys)
                out = chunk(x, **kwargs, targets=batch.targets if last else None)
            if last:
                loss = self.loss_fn(out, batch.targets)
                self.total += loss.detach()
                out = loss * self.loss_multiplier
            elif out.shape != self.shape or out.dtype != r.dtype:
                raise RuntimeError(
                    f"stage {stage} sends {tuple(out.shape)} {out.dtype}; expected {self.shape} {r.dtype}"
                )
            if self.train:
                self.saved[key] = (x, out)
            return sends, [out.detach() for _ in sends]
        if action.kind == W:
            kept = self.kept.pop(key)
            weight_pass(kept) if r.wgrad is not None else backward_weight(kept, together=r.recomputed)
            return sends, []
        x, out = self.saved.pop(key)
        if action.kind == I and stage > 0 and r.wgrad is not None:
            r.wgrad.deferring = True
            try:
                torch.autograd.backward(out, grad_tensors=received)
            finally:  # a failed pass leaves nothing behind for a later W
                r.wgrad.deferring = False
                kept = r.wgrad.take()
            self.kept[key], dx = kept, x.grad
        elif action.kind == B or stage == 0:
            # On stage 0 (token ids in, no input gradient) I is the whole backward and W has nothing left.
            torch.autograd.backward(out, grad_tensors=received)
            if action.kind == I:
                self.kept[key] = []
            dx = x.grad
        else:
            # Imported by the first I (zero-bubble schedules): torch.distributed.pipelining brings torch.export and
            # dynamo, which no other run needs (after the first, a lookup in sys.modules).
            from torch.distributed.pipelining._backward import stage_backward_input

            grads = None if received is None else [received]
            (dx,), self.kept[key] = stage_backward_input([out], grads, [x], r.chunks[action.chunk].parameters())
        return sends, [dx for _ in sends]

    def record(self, reduce: tuple[float, float] | None = None) -> None:
        """Append the step's action spans (and ``reduce``: the span of the reducer's finish) to the timings file."""
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
        if reduce is not None:
            row["reduce"] = reduce
        r.calls += 1
        r.timings.parent.mkdir(parents=True, exist_ok=True)
        with open(r.timings, "a") as f:
            f.write(json.dumps(row) + "\n")
