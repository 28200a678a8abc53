"""A generated corpus of every input kind, with bad records among the documents: real text (standard-library source
cut into documents of random lengths, a seeded generator), written as JSON Lines, gzip'd and zstd'd JSON Lines,
Parquet and a text file. ``Corpus`` knows what a preparation must find in it: the documents in order and every bad
record's place."""

from __future__ import annotations

import gzip
import json
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

STDLIB = Path(sysconfig.get_paths()["stdlib"])


@dataclass
class Corpus:
    root: Path
    documents: list[str] = field(default_factory=list)  # the non-empty documents, in the order prepared
    bad: list[str] = field(default_factory=list)  # "PATH line N" / "PATH row N" of each bad record, in order
    records: int = 0  # every record: documents, empty ones and bad ones

    @property
    def files(self) -> list[Path]:
        return sorted(p for p in self.root.iterdir() if p.is_file())


def texts(n: int, seed: int = 0, packages: tuple[str, ...] = ("json", "email", "logging")) -> list[str]:
    """``n`` documents of 50 to 3000 characters cut from standard-library source, and one of non-ASCII text."""
    rng = random.Random(seed)
    source = "".join(p.read_text() for pkg in packages for p in sorted((STDLIB / pkg).glob("*.py")))
    docs, pos = [], 0
    while len(docs) < n - 1:
        size = rng.randint(50, 3000)
        if pos + size > len(source):
            pos = 0
        docs.append(source[pos : pos + size])
        pos += size
    return [*docs, "héllo ☃ — naïve façade\n\tindented\r\n"]


def make_corpus(root: Path, n: int = 400, seed: int = 0) -> Corpus:
    root.mkdir(parents=True, exist_ok=True)
    docs = texts(n, seed)
    corpus = Corpus(root)
    a, b, c = int(n * 0.4), int(n * 0.55), int(n * 0.7)

    # a.jsonl: plain, large enough to be cut into byte ranges; bad records early and late, a blank line, an empty doc.
    path = root / "a.jsonl"
    lines: list[bytes] = [json.dumps({"text": t, "id": i}, ensure_ascii=False).encode() for i, t in enumerate(docs[:a])]
    inserts = {
        3: (b'{"text": "unterminated', "bad"),
        10: (b"", "blank"),
        11: (b'{"text": ""}', "empty"),
        40: (b'{"text": "\xff\xfe caf\xe9"}', "bad"),
        a // 2: (b'{"text": 42}', "bad"),
        a - 20: (b"[1, 2, 3]", "bad"),
        a - 5: (b'{"body": "the text is under another field"}', "bad"),
    }
    out: list[bytes] = []
    for i, line in enumerate(lines):
        if i in inserts:
            extra, kind = inserts[i]
            out.append(extra)
            if kind == "bad":
                corpus.bad.append(f"{path} line {len(out)}")
            corpus.records += kind != "blank"
        out.append(line)
        corpus.records += 1
    path.write_bytes(b"\n".join(out) + b"\n")
    corpus.documents += docs[:a]

    # b.jsonl.gz and c.jsonl.zst: one bad record each.
    for name, part, bad_line in (("b.jsonl.gz", docs[a:b], b'{"text": null}'), ("c.jsonl.zst", docs[b:c], b'{"t')):
        path = root / name
        rows = [json.dumps({"text": t}).encode() for t in part]
        rows.insert(7, bad_line)
        corpus.bad.append(f"{path} line 8")
        data = b"\n".join(rows) + b"\n"
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else zstandard.ZstdCompressor().compress(data))
        corpus.documents += part
        corpus.records += len(rows)

    # d.parquet: row groups of 25, one null text.
    path = root / "d.parquet"
    values: list[str | None] = list(docs[c:-1])
    values.insert(30, None)
    corpus.bad.append(f"{path} row 31")
    pq.write_table(pa.table({"text": values, "n": list(range(len(values)))}), path, row_group_size=25)
    corpus.documents += docs[c:-1]
    corpus.records += len(values)

    # notes.txt: one document.
    (root / "notes.txt").write_text(docs[-1])
    corpus.documents.append((root / "notes.txt").read_text())  # as text files are read: universal newlines
    corpus.records += 1
    return corpus
