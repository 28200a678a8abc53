"""``checkpoint.async``: a checkpoint written in the background while training goes on.

A save here has three parts:

stage    on the training thread: every box is copied to host memory (pinned on CUDA, so the copy is one DMA,
         reused from save to save), so the next step may change the live parameters and moments at once. This
         copy is the memory a background save costs: the rank's saved state (fp32 masters, AdamW moments) once
         more, in host memory, for as long as the run lives.
write    on a thread of its own, through DCP, whose collectives (the save plan, the agreement that every rank's
         data is written, the index) run on a gloo group made for this thread alone: collectives on the training
         groups from a second thread could interleave with the step's own and hang or corrupt both. The files
         themselves are serialised and written by a process of the rank's own (``WriterProcess``), which reads the
         staged boxes from shared memory: torch.save holds the GIL for much of its work, and a writer thread in the
         training process slowed its steps by half here (a training loop beside a thread writing 1.4 GB with
         torch.save: 1.64 s a step alone, 2.42-2.59 s with the thread, 1.68 s with the same writes in a process).
publish  once DCP returns (every rank's data and the index are on disk), rank 0 adds the small files and renames
         the temporary directory into place (files.publish: complete or absent), then prunes (keep_last); the
         outcome is shared over the same group, so a failure is known to every rank.

At most one save is in flight. ``wait`` joins it and raises its failure, the same one-line error on every rank;
the checkpointer calls it before the next save, and the loop at the end of the run, on a stop and on divergence,
all points every rank reaches after the same step. torch.distributed.checkpoint.async_save does stage and write
the same way, but stages only tensors (our boxes are ``Sharded`` objects) and would leave the publish and its
agreement to a second mechanism; this is one thread doing the three in order.
"""

from __future__ import annotations

import datetime
import importlib
import pickle
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.futures import Future

from trident.checkpoint.sharded import Sharded

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem
    from torch.distributed.checkpoint.storage import WriteResult


class HostStage:
    """Host copies of a rank's checkpoint boxes, allocated on the first save and reused by every later one."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def copy(self, state: dict[str, Sharded]) -> dict[str, Sharded]:
        """``state`` with every box replaced by a host copy of it, complete when this returns."""
        staged: dict[str, Sharded] = {}
        cuda = False
        for key, value in state.items():
            boxes = []
            for i, (offsets, t) in enumerate(value.boxes):
                buffer = self._buffer((key, i), t)
                cuda = cuda or t.is_cuda
                buffer.copy_(t.detach(), non_blocking=t.is_cuda)
                boxes.append((offsets, buffer))
            staged[key] = Sharded(value.shape, boxes)
        if cuda:
            torch.cuda.current_stream().synchronize()  # the pinned copies are whole before the step goes on
        return staged

    def _buffer(self, key: tuple[str, int], t: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != t.shape or buffer.dtype != t.dtype:
            buffer = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            if not t.is_cuda:  # shared with the writer process once, not copied to it at every save
                buffer.share_memory_()
            self._buffers[key] = buffer
        return buffer

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class _Resolved:
    """What the writer process's FileSystemWriter asks a planner for: the data of each write item, sent along."""

    def __init__(self, data: dict[MetadataIndex, object]) -> None:
        self.data = data

    def resolve_data(self, item: WriteItem) -> object:
        return self.data[item.index]


def _serve(conn: Connection) -> None:
    """The writer process: write each plan it is sent, answer with DCP's results or the exception; end when the
    rank's end of the pipe closes (the rank is gone, however it ended)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    torch.set_num_threads(1)
    while True:
        try:
            path, plan, data = conn.recv()
        except EOFError:
            return
        try:
            answer: object = FileSystemWriter(path).write_data(plan, _Resolved(data)).wait()
        except BaseException as e:  # raised again on the rank's thread
            answer = e if _picklable(e) else RuntimeError(f"{type(e).__name__}: {e}")
        del data
        try:
            conn.send(answer)
        except OSError:  # the rank is gone (killed mid-write): what was written stays hidden under its tmp name
            return


def _picklable(e: BaseException) -> bool:
    try:
        pickle.dumps(e)
        return True
    except Exception:
        return False


class WriterProcess:
    """A process of this rank's that serialises and writes a save's files (DCP's ``write_data``), started at the
    first write. The tensors reach it as shared memory: on a CPU the host stage's buffers are allocated there, so
    nothing is copied; on CUDA they are pinned (for the device-to-host DMA), and sending copies them into shared
    memory, on the background thread."""

    def __init__(self) -> None:
        self._proc: mp.Process | None = None
        self._conn: Connection | None = None

    def write(self, path: Path, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self._proc is None:
            # Forked from a fork server, which imported torch and DCP's writer once: the first writer of a rank
            # process starts that server (a fresh interpreter, as a spawned writer would be), and a process that
            # lives through many runs (the tests' and the layout fuzzer's rank pools) forks the later ones instead
            # of starting an interpreter each (about 2 s of a core). Where a fork server already runs (the pools'
            # own), the writer is forked from it. Never a plain fork: the rank has threads, and CUDA.
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload([__name__, "torch.distributed.checkpoint.filesystem"])
            self._conn, child = ctx.Pipe()
            # A daemon: it must not outlive the rank's normal exit; on any other end the pipe's EOF ends it.
            self._proc = ctx.Process(target=_serve, args=(child,), name="trident-checkpoint-writer", daemon=True)
            self._proc.start()
            child.close()
        data = {item.index: planner.resolve_data(item) for item in plan.items}
        try:
            self._conn.send((path, plan, data))
            del data
            answer = self._conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"the checkpoint writer process ended while writing {path}: {e}") from None
        if isinstance(answer, BaseException):
            raise answer
        future: Future[list[WriteResult]] = Future()
        future.set_result(answer)
        return future


class BackgroundSave:
    """One save at a time on a thread of its own, with its own gloo group over every rank.

    Created by every rank at the same point (``new_group`` is collective).
    """

    def __init__(self, timeout_s: float) -> None:
        # The writes go through DCP (dcp.py), which importing the checkpointer leaves out: imported now, on the
        # training thread, rather than by the first write's thread while training runs.
        importlib.import_module("trident.checkpoint.dcp")
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.stage = HostStage()
        self.process = WriterProcess()
        self._thread: threading.Thread | None = None
        self._path: Path | None = None
        self._error: BaseException | None = None

    def start(self, write: Callable[[dist.ProcessGroup], Path]) -> None:
        """Run ``write(group)`` in the background (the previous save must have been waited for)."""
        assert self._thread is None, "one save in flight at a time: wait() first"

        def run() -> None:
            try:
                self._path = write(self.group)
            except BaseException as e:  # kept for wait(), which raises it on the training thread
                self._error = e

        # A daemon: a process ending on an error must not hang on a write whose peers are gone (the temporary
        # directory it leaves is hidden, and cleared by the next run in the directory).
        self._thread = threading.Thread(target=run, name="trident-checkpoint", daemon=True)
        self._thread.start()

    @property
    def writing(self) -> bool:
        """Whether the save in flight is still being written (``wait`` would block)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> Path | None:
        """Wait for the save in flight; return its checkpoint (None when none was in flight) or raise its error."""
        if self._thread is None:
            return None
        self._thread.join()
        path, error = self._path, self._error
        self._thread, self._path, self._error = None, None, None
        if error is not None:
            raise error
        return path
