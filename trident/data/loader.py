"""The batches a training step reads: this rank's micro-batches of a step, taken from the windows by the sampler's
indices and put on the device, the next step's read ahead in the background (trident/loop.py's ``Trainer`` reads
through a ``BatchLoader``)."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from trident.data.dataset import TokenWindows
from trident.data.mixture import MixedWindows
from trident.data.sampler import Batches
from trident.parallel.batch import Batch, document_ids
from trident.parallel.context.batch import context_part

Windows = TokenWindows | MixedWindows


class BatchLoader:
    """This rank's micro-batches of each step, read from the windows and put on the device, off the critical path.

    Reading is vectorised (memmap slicing, no Python loop per token). ``get(step)`` hands over the step's batches and
    starts reading the next step's in a background thread, so a step waits only for what is not ready yet (0 in the
    steady state): ``get`` returns that wait beside the batches. On a GPU the thread also pins the host tensors and
    copies them on a CUDA stream of its own; the step's stream waits for that copy's event before using them, and the
    tensors are recorded on it so the allocator does not reuse their memory while the step reads them. With
    ``eos_id`` (``data.document_mask``) each batch carries its document ids, computed from the tokens on the device.
    """

    def __init__(
        self,
        windows: Windows,
        sampler: Batches,
        dp_rank: int,
        dp_size: int,
        micro_batch_size: int,
        device: torch.device,
        eos_id: int | None = None,
        prefetch: bool = True,
        cp_rank: int = 0,
        cp_size: int = 1,
    ) -> None:
        self.windows, self.sampler, self.device, self.eos_id = windows, sampler, device, eos_id
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.dp_rank, self.dp_size, self.micro_batch_size = dp_rank, dp_size, micro_batch_size
        self.prefetch = prefetch
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda and prefetch else None
        self._pool: ThreadPoolExecutor | None = None
        self._next: tuple[int, Future] | None = None
        self.last_read_s = 0.0  # how long reading the batches ``get`` returned took (in the background or not)

    def build(self, x: torch.Tensor, y: torch.Tensor, sample_ids: torch.Tensor, step: int) -> Batch:
        """One micro-batch on the device, with its document ids when ``eos_id`` is set (the hook of
        ``data.document_mask``); under context parallelism this cp rank's part of it (parallel/context/batch.py)."""
        if self.cuda:
            x, y = x.pin_memory(), y.pin_memory()
        batch = Batch(x, y, sample_ids, step).to(self.device)
        if self.eos_id is not None:
            batch = batch._replace(documents=document_ids(batch.tokens, self.eos_id))
        if self.cp_size > 1:
            batch = context_part(batch, self.cp_size, self.cp_rank)
        return batch

    def read(self, step: int, windows: Windows | None = None, sampler: Batches | None = None) -> list[Batch]:
        """The micro-batches of ``step``, read now on this thread (``windows`` and ``sampler``: another set's)."""
        windows = self.windows if windows is None else windows
        sampler = self.sampler if sampler is None else sampler
        args = (step, self.dp_rank, self.dp_size, self.micro_batch_size)
        indices, samples = sampler.micro_batches(*args), sampler.sample_ids(*args)
        return [self.build(*windows.batch(w), s, step) for w, s in zip(indices, samples, strict=True)]

    def _read_ahead(self, step: int) -> tuple[list[Batch], float, torch.cuda.Event | None]:
        start = time.perf_counter()
        if self._stream is None:
            return self.read(step), time.perf_counter() - start, None
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            batches = self.read(step)
            event = torch.cuda.Event()
            event.record(self._stream)
        return batches, time.perf_counter() - start, event

    def get(self, step: int, last: int | None = None) -> tuple[list[Batch], float]:
        """The micro-batches of ``step`` and the seconds this call waited for them; starts reading ``step + 1``
        (when it is below ``last``) in the background."""
        if self._next is not None and self._next[0] == step:
            start = time.perf_counter()
            batches, self.last_read_s, event = self._next[1].result()
            self._next = None
            if event is not None:
                main = torch.cuda.current_stream(self.device)
                main.wait_event(event)
                for b in batches:
                    for t in (b.tokens, b.targets, b.documents, b.positions, b.index):
                        if t is not None:
                            t.record_stream(main)
            waited = time.perf_counter() - start
        else:
            self._drop()
            start = time.perf_counter()
            batches = self.read(step)
            self.last_read_s = waited = time.perf_counter() - start
        if self.prefetch and (last is None or step + 1 < last):
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trident-loader")
            self._next = (step + 1, self._pool.submit(self._read_ahead, step + 1))
        return batches, waited

    def _drop(self) -> None:
        if self._next is not None:
            self._next[1].cancel()
            self._next = None

    def close(self) -> None:
        """Stop reading ahead (a read in flight finishes first)."""
        self._drop()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
