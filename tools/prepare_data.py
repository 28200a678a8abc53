"""Tokenize text into a dataset directory that training reads with data.dataset_dir=DIR.

    python tools/prepare_data.py --text docs/ notes.md --out data/mydata --vocab-size 8192
    python tools/prepare_data.py --text docs/ --out data/mydata --tokenizer llama/tokenizer.json

--vocab-size trains a sentencepiece BPE tokenizer of that many pieces on the text; --tokenizer uses an existing one
instead (a sentencepiece .model, a Hugging Face tokenizer.json, or a directory holding one), which must have an
end-of-text token. Without --text the embedded corpus (the Python standard library's source) is used.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from trident.config import DataConfig
from trident.data.prepare import (
    collect_text_files,
    default_corpus_files,
    load_meta,
    prepare_dataset,
)
from trident.data.tokenizer import load_tokenizer
from trident.errors import DataError


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--text", nargs="+", metavar="PATH", help="files, directories or globs (default: stdlib)")
    p.add_argument("--suffixes", nargs="+", default=DataConfig().suffixes, help="suffixes searched in dirs")
    p.add_argument("--out", required=True, type=Path, help="dataset directory to write")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--vocab-size", type=int, help="train a tokenizer of this many pieces on the text")
    how.add_argument("--tokenizer", metavar="PATH", help="use this tokenizer (.model, tokenizer.json or its dir)")
    p.add_argument("--tokenizer-lines", type=int, default=DataConfig().tokenizer_lines)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    try:
        files = collect_text_files(args.text, args.suffixes) if args.text else default_corpus_files()
        if args.tokenizer is not None:
            out = prepare_dataset(files, args.out, tokenizer=load_tokenizer(args.tokenizer))
        else:
            out = prepare_dataset(files, args.out, args.vocab_size, args.tokenizer_lines, args.seed)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {args.out}: {e.strerror}; point --out at a writable place", file=sys.stderr)
        return 2
    meta = load_meta(out)
    n_bytes, n_tokens = meta["source_bytes"], meta["n_tokens"]
    print(
        f"wrote {out}: {len(files)} files, {n_bytes / 1e6:.1f} MB, {n_tokens:,} tokens "
        f"({n_bytes / n_tokens:.2f} bytes/token, vocab {meta['vocab_size']}, {meta['tokenizer_file']}) "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
