"""``tools/bench.py prepare``: the preparation rate of tools/prepare_data.py (JSON Lines to a sharded token store) at
1 and more workers, against the tokenizer's own batch API on one process (docs/benchmarks.md#prepare).

    python tools/bench.py prepare                        # ~200 MB of JSON Lines, workers 1 and 2, 3 rounds
    python tools/bench.py prepare --mb 50 --workers 1 2 4 --rounds 5 --tokenizer llama/tokenizer.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from trident.data.bpe import sample_lines, train_bpe
from trident.data.meta import load_meta
from trident.data.prepare import prepare_dataset
from trident.data.tokenizer import SentencePieceTokenizer, Tokenizer, load_tokenizer
from trident_dev.bench.compare import Column, Comparison, Rank, Setting, Steps, run_settings, tabulate
from trident_dev.bench.harness import Table, number, ratio, spread

_FILE_MB = 50
_BATCH_CHARS = 32 << 20
API = "batch API, 1 process"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mb", type=float, default=200, help="corpus size in MB (default 200)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts (default 1 2)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of every variant (default 3)")
    p.add_argument("--vocab-size", type=int, default=8192, help="the trained tokenizer's pieces (default 8192)")
    p.add_argument("--tokenizer", metavar="PATH", help="use this tokenizer (.model, tokenizer.json) instead")
    p.add_argument("--dir", type=Path, help="where the corpus is generated (default: under the temporary dir)")
    p.add_argument("--seed", type=int, default=0)


def generate_corpus(root: Path, mb: float, seed: int = 0) -> list[Path]:
    """JSON Lines files of about ``mb`` MB in all, made of standard-library source cut into documents; the same
    bytes for the same arguments (a finished corpus is reused: ``done`` is written last)."""
    if (root / "done").is_file():
        return sorted(root.glob("*.jsonl"))
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(
        p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts
    )
    rng = random.Random(seed)
    target, written, k, index = int(mb * 1e6), 0, 0, 0
    out = None
    while written < target:
        for path in sources:
            text = path.read_text(encoding="utf-8", errors="replace")
            pos = rng.randrange(0, 200) if k else 0  # each pass over the library cuts it elsewhere
            while pos < len(text) and written < target:
                size = rng.randint(200, 8000)
                if out is None or out.tell() >= _FILE_MB * 1_000_000:
                    if out is not None:
                        out.close()
                    out = open(root / f"corpus-{len(list(root.glob('*.jsonl'))):03d}.jsonl", "w", encoding="utf-8")
                line = json.dumps({"text": text[pos : pos + size], "id": index}, ensure_ascii=False) + "\n"
                out.write(line)
                written += len(line.encode())
                index += 1
                pos += size
            if written >= target:
                break
        k += 1
    out.close()
    (root / "done").write_text(f"{index} documents, {written} bytes\n")
    return sorted(root.glob("*.jsonl"))


def _texts(files: list[Path]) -> list[str]:
    return [json.loads(line)["text"] for f in files for line in f.open(encoding="utf-8")]


def batch_api_tokens(tokenizer: Tokenizer, texts: list[str]) -> int:
    """Tokens (ids plus one eos a document) of ``texts`` encoded by the tokenizer's own batch call, ids dropped."""
    n, i = 0, 0
    while i < len(texts):
        j, chars = i, 0
        while j < len(texts) and chars < _BATCH_CHARS:
            chars += len(texts[j])
            j += 1
        n += sum(len(ids) + 1 for ids in tokenizer.encode_batch(texts[i:j]))
        i = j
    return n


def run(args: argparse.Namespace) -> list[Table]:
    key = hashlib.sha256(f"{args.mb}\0{args.seed}".encode()).hexdigest()[:12]
    root = args.dir or Path(tempfile.gettempdir()) / f"trident-bench-prepare-{key}"
    t0 = time.perf_counter()
    files = generate_corpus(root / "corpus", args.mb, args.seed)
    corpus_bytes = sum(p.stat().st_size for p in files)
    print(f"corpus: {len(files)} files, {corpus_bytes / 1e6:.1f} MB in {root} ({time.perf_counter() - t0:.0f}s)")
    texts = _texts(files)
    if args.tokenizer:
        tokenizer = load_tokenizer(args.tokenizer)
    else:
        t0 = time.perf_counter()
        lines = sample_lines(texts, 200_000, args.seed)
        tokenizer = SentencePieceTokenizer(train_bpe(lines, args.vocab_size, len(lines), args.seed))
        print(f"trained a {args.vocab_size}-piece BPE on {len(lines):,} lines ({time.perf_counter() - t0:.0f}s)")
    work = root / "out"
    shutil.rmtree(work, ignore_errors=True)
    job = Job(files, texts, tokenizer, args.workers, work)
    # The title and the columns read the tokens the variants counted: the table is made once they agree.
    c = Comparison("", [], [Setting(_variants, job, world=None, device="cpu")], warmup=0, steps=1, rounds=args.rounds)
    runs = run_settings(c)
    shutil.rmtree(work, ignore_errors=True)

    counts = {name: out.figures["tokens"] for name, out in runs[0].outcomes.items()}
    tokens = counts[API]
    assert all(n == tokens for n in counts.values()), f"the variants counted different tokens: {counts}"
    title = (
        f"prepare: {corpus_bytes / 1e6:.0f} MB of JSON Lines ({len(texts):,} documents, {tokens:,} tokens), "
        f"{tokenizer.file_name} of {tokenizer.vocab_size} ids, {os.cpu_count()} CPUs, {args.rounds} rounds"
    )
    columns = [
        Column("variant"),
        Column("tokens/s", lambda r: number(r.out.rate(tokens).median)),
        Column("MB/s", lambda r: number(corpus_bytes / 1e6 / r.out.time.median, ".1f")),
        Column("spread", lambda r: spread(r.out.wall)),
        Column("seconds", lambda r: f"{r.out.time.median:.1f} ({r.out.time.low:.1f}-{r.out.time.high:.1f})"),
        Column("x batch API", lambda r: ratio(r.of(API).time.median, r.out.time.median)),
    ]
    threads = "all cores" if tokenizer.file_name.endswith(".model") else "its own thread pool"
    notes = [
        f"batch API: {tokenizer.file_name} encode of the documents already in memory ({threads}), ids dropped; "
        "prepare: read, parse, tokenize and write the shards. x batch API above 1.00x: faster than the batch API."
    ]
    return [tabulate(dataclasses.replace(c, title=title, columns=columns, notes=notes), runs)]


@dataclasses.dataclass
class Job:
    files: list[Path]
    texts: list[str]
    tokenizer: Tokenizer
    workers: list[int]
    work: Path


def _variants(rank: Rank, job: Job) -> dict[str, Callable[[], Steps]]:
    """prepare_dataset at each worker count, each step into a fresh directory, and the batch API; each counts the
    tokens it made (its figure)."""

    def counting(count: Callable[[int], int]) -> Steps:
        counted: dict[str, int] = {}
        return Steps(lambda i: counted.update(tokens=count(i)), figures=lambda: counted)

    def prepare(workers: int, i: int) -> int:
        out = job.work / f"w{workers}-{i}"
        out = prepare_dataset(job.files, out, tokenizer=job.tokenizer, log=lambda _: None, workers=workers)
        tokens = load_meta(out)["n_tokens"]
        shutil.rmtree(out)
        return tokens

    variants = {
        f"prepare, {w} worker{'s' if w > 1 else ''}": (lambda w=w: counting(lambda i: prepare(w, i)))
        for w in job.workers
    }
    return {**variants, API: lambda: counting(lambda i: batch_api_tokens(job.tokenizer, job.texts))}
