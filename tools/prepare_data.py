"""Tokenize a corpus into a dataset directory that training reads with data.dataset_dir=DIR.

    python tools/prepare_data.py --text docs/ notes.md --out data/mydata --vocab-size 8192
    python tools/prepare_data.py --text 'corpus/*.jsonl.zst' --out data/web --tokenizer llama/tokenizer.json \\
        --workers 8

--text takes text files (one document each), directories, globs, and JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst) or
Parquet files of many documents each, the text under --text-field. --vocab-size trains a sentencepiece BPE tokenizer
of that many pieces on a sample of the text; --tokenizer uses an existing one instead (a sentencepiece .model, a
Hugging Face tokenizer.json, or a directory holding one), which must have an end-of-text token. Without --text the
embedded corpus (the Python standard library's source) is used.

--workers processes tokenize, each taking whole work units of --shard-mb MiB of input (32 by default; a unit becomes
one shard), so a corpus of fewer units than --workers uses fewer, and the first line says so; the dataset's bytes
are the same for any number of workers. Bad records (malformed JSON, no text
field, not UTF-8) are skipped and counted, up to --max-bad-fraction of all records. A preparation that is stopped
leaves DIR.partial, never DIR: the same command again reuses the shards it finished.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

# The package is imported inside main(): worker processes import this script again, and need none of it up here.
DEFAULTS = {"suffixes": [".txt", ".md", ".py", ".rst"], "tokenizer_lines": 200_000, "text_field": "text"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", nargs="+", metavar="PATH", help="files, directories or globs (default: stdlib)")
    p.add_argument("--suffixes", nargs="+", default=DEFAULTS["suffixes"], help="text suffixes searched in dirs")
    p.add_argument("--out", required=True, type=Path, help="dataset directory to write")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--vocab-size", type=int, help="train a tokenizer of this many pieces on the text")
    how.add_argument("--tokenizer", metavar="PATH", help="use this tokenizer (.model, tokenizer.json or its dir)")
    p.add_argument("--text-field", default=DEFAULTS["text_field"], help="JSON Lines / Parquet field of the text")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes, at most one per work unit (default 1)")
    p.add_argument("--max-bad-fraction", type=float, default=0.01, help="bad records tolerated (default 0.01)")
    p.add_argument("--shard-mb", type=float, default=32, help="input MiB per work unit, and so per shard (default 32)")
    p.add_argument("--tokenizer-lines", type=int, default=DEFAULTS["tokenizer_lines"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers {args.workers} must be >= 1")
    if args.shard_mb <= 0:
        p.error(f"--shard-mb {args.shard_mb} must be > 0")
    if not 0 <= args.max_bad_fraction < 1:
        p.error(f"--max-bad-fraction {args.max_bad_fraction} must be in [0, 1)")

    from trident.data.meta import load_meta
    from trident.data.prepare import counted, prepare_dataset
    from trident.data.sources import collect_text_files, default_corpus_files
    from trident.data.tokenizer import load_tokenizer
    from trident.errors import DataError

    t0 = time.perf_counter()
    how = {"text_field": args.text_field, "workers": args.workers, "max_bad_fraction": args.max_bad_fraction}
    how.update(unit_bytes=int(args.shard_mb * (1 << 20)), progress=sys.stderr)
    try:
        files = collect_text_files(args.text, args.suffixes) if args.text else default_corpus_files()
        if args.tokenizer is not None:
            out = prepare_dataset(files, args.out, tokenizer=load_tokenizer(args.tokenizer), log=_log, **how)
        else:
            out = prepare_dataset(files, args.out, args.vocab_size, args.tokenizer_lines, args.seed, log=_log, **how)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {args.out}: {e.strerror}; point --out at a writable place", file=sys.stderr)
        return 2
    meta = load_meta(out)
    n_bytes, n_tokens = meta["source_bytes"], meta["n_tokens"]
    bad = f", {meta['bad_records']:,} bad records skipped" if meta["bad_records"] else ""
    print(
        f"wrote {out}: {counted(len(files), 'file')}, {n_bytes / 1e6:.1f} MB, "
        f"{counted(meta['n_documents'], 'document')}, {n_tokens:,} tokens in {counted(len(meta['shards']), 'shard')} "
        f"({n_bytes / max(1, n_tokens):.2f} bytes/token, "
        f"vocab {meta['vocab_size']}, {meta['tokenizer_file']}){bad} in {time.perf_counter() - t0:.1f}s"
    )
    return 0


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
