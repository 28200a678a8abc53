"""Tokenizing work units into shards, in this process (one worker) or spread over worker processes.

``encode_unit`` streams a unit's records, encodes its documents in batches of a few megabytes of text (memory stays
bounded whatever the unit's size) and writes shard k of unit k: what a unit holds, not which worker took it,
decides the bytes. ``run_units`` hands units to ``workers`` processes (spawned: no inherited threads or locks) and
yields each finished shard's record as it comes; a worker that dies (killed, out of memory) stops the preparation
with one line, and the shards finished so far stay for the rerun.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trident.data.sources import BadRecord, Reader
from trident.data.store import ShardWriter
from trident.data.tokenizer import Tokenizer, tokenizer_from_bytes
from trident.data.units import Unit
from trident.errors import DataError

# Documents are encoded in batches of about this many characters.
CHUNK_CHARS = 4 << 20
# Bad records named in a shard's record (all are counted).
MAX_EXAMPLES = 20

Report = Callable[[int, int, int], None]  # documents, tokens, input bytes just done


@dataclass(frozen=True)
class EncodeJob:
    """One unit of the corpus to encode into its shard: what a worker process is handed."""

    unit: Unit
    key: str
    shard_dir: str
    text_field: str
    dtype: str


def encode_unit(job: EncodeJob, tokenizer: Tokenizer, report: Report = lambda d, t, b: None) -> dict:
    """Write the shard of ``job.unit``; return its record."""
    writer = ShardWriter(Path(job.shard_dir), job.unit.index, np.dtype(job.dtype))
    eos, vocab = tokenizer.eos_id, tokenizer.vocab_size
    n_records = n_bad = 0
    examples: list[str] = []
    texts: list[str] = []
    chars = bytes_reported = bytes_before = 0

    def flush(done_bytes: int) -> None:
        nonlocal texts, chars, bytes_reported
        if texts:
            encoded = tokenizer.encode_batch(texts)
            # Each document ends with one eos: its encoding's own when the tokenizer ends every text with it (a
            # tokenizer.json post-processor ``<s> $A </s>``), else one added here.
            ends = [not ids or ids[-1] != eos for ids in encoded]
            lengths = np.fromiter(
                (len(ids) + end for ids, end in zip(encoded, ends, strict=True)), np.int64, len(encoded)
            )
            tokens = np.empty(int(lengths.sum()), dtype=np.int64)
            pos = 0
            for ids, n in zip(encoded, lengths.tolist(), strict=True):
                tokens[pos : pos + len(ids)] = ids
                tokens[pos + n - 1] = eos
                pos += n
            if len(tokens) and (tokens.min() < 0 or tokens.max() >= vocab):  # a tokenizer.json may give a stray id
                bad = int(tokens.max() if tokens.max() >= vocab else tokens.min())
                raise DataError(
                    f"tokenizer {tokenizer.file_name} gave id {bad}, outside its vocabulary of {vocab}; "
                    "the tokenizer file is inconsistent: use another"
                )
            writer.add(tokens, lengths)
            report(len(encoded), len(tokens), done_bytes - bytes_reported)
        else:
            report(0, 0, done_bytes - bytes_reported)
        bytes_reported = done_bytes
        texts, chars = [], 0

    try:
        for piece in job.unit.pieces:
            reader = Reader(piece, job.text_field)
            for record in reader.records():
                n_records += 1
                if isinstance(record, BadRecord):
                    n_bad += 1
                    if len(examples) < MAX_EXAMPLES:
                        examples.append(str(record))
                elif record:
                    texts.append(record)
                    chars += len(record)
                    if chars >= CHUNK_CHARS:
                        flush(bytes_before + reader.done)
            bytes_before += piece.size
        flush(bytes_before)
        record = {
            "key": job.key,
            "unit": job.unit.index,
            "source_bytes": job.unit.size,
            "n_records": n_records,
            "n_bad": n_bad,
            "bad_examples": examples,
        }
        return writer.finish(record)
    except BaseException:
        writer.abort()
        raise


def run_units(jobs: list[EncodeJob], tokenizer: Tokenizer, workers: int, report: Report) -> Iterator[dict]:
    """Each job's shard record, in the order they finish. One worker (or one job): in this process."""
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield encode_unit(job, tokenizer, report)
        return
    ctx = mp.get_context("spawn")
    counters = ctx.Array("q", 3)
    reported = [0, 0, 0]
    executor = cf.ProcessPoolExecutor(
        min(workers, len(jobs)),
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(tokenizer.file_name, tokenizer.data, counters),
    )
    clean = False
    try:
        pending = {executor.submit(_run_job, job) for job in jobs}
        while pending:
            done, pending = cf.wait(pending, timeout=0.2, return_when=cf.FIRST_COMPLETED)
            now = list(counters)
            report(*(a - b for a, b in zip(now, reported, strict=True)))
            reported = now
            for future in done:
                try:
                    yield future.result()
                except BrokenProcessPool:
                    raise DataError(
                        "a tokenizing worker process died (killed, or out of memory); run the same command again: "
                        "the shards finished so far are kept, or lower the workers"
                    ) from None
        clean = True
    finally:
        if not clean:  # stop the other workers now rather than after their current unit
            for process in list(getattr(executor, "_processes", {}).values()):
                process.kill()
        executor.shutdown(wait=True, cancel_futures=True)


_worker: dict = {}


def _init_worker(file_name: str, data: bytes, counters) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread each: the processes are the parallelism
    tokenizer = tokenizer_from_bytes(file_name, data)
    tokenizer.threads = 1
    _worker.update(tokenizer=tokenizer, counters=counters)


def _run_job(job: EncodeJob) -> dict:
    counters = _worker["counters"]

    def report(documents: int, tokens: int, done_bytes: int) -> None:
        with counters.get_lock():
            counters[0] += documents
            counters[1] += tokens
            counters[2] += done_bytes

    return encode_unit(job, _worker["tokenizer"], report)
