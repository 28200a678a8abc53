"""Dataset preparation, caching and windows, on a small corpus copied from the standard library."""

from __future__ import annotations

import json
import multiprocessing as mp
import runpy
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import REPO
from tests.helpers.processes import tool_process
from trident.config import DataConfig
from trident.data import prepare, verify
from trident.data.dataset import TokenDataset, eval_batch_count, open_dataset
from trident.data.meta import load_meta
from trident.data.prepare import prepare_dataset, resolve_dataset
from trident.data.sources import collect_text_files, default_corpus_files
from trident.data.tokenizer import load_tokenizer
from trident.errors import DataError

VOCAB = 512


def quiet(msg: str) -> None:
    pass


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for pkg in ("json", "email", "logging"):
        shutil.copytree(stdlib / pkg, root / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture(scope="session")
def dataset(corpus, tmp_path_factory) -> Path:
    files = collect_text_files([str(corpus)], [".py"])
    return prepare_dataset(files, tmp_path_factory.mktemp("ds") / "ds", VOCAB, log=quiet)


def test_roundtrip(dataset):
    meta = load_meta(dataset)
    sp = load_tokenizer(dataset)
    tokens = np.asarray(TokenDataset(dataset).tokens[:])
    docs = np.split(tokens, np.flatnonzero(tokens == meta["eos_id"]) + 1)[:-1]
    texts = [t for t in (Path(s["path"]).read_text() for s in meta["sources"]) if t]
    assert len(docs) == len(texts) == meta["n_documents"]
    for ids, text in zip(docs, texts, strict=True):
        assert ids[-1] == meta["eos_id"]
        assert sp.decode(ids[:-1].tolist()) == text
    # Indentation, tabs, blank lines and characters outside the tokenizer's pieces survive.
    tricky = "def f():\n\tif x:\n        return 'héllo ☃'\n\n\n  \r\n"
    assert sp.decode(sp.encode(tricky)) == tricky


def test_meta(dataset, corpus):
    meta = load_meta(dataset)
    files = collect_text_files([str(corpus)], [".py"])
    assert meta["format"] == 2
    assert meta["vocab_size"] == VOCAB
    assert meta["dtype"] == "uint16"
    assert meta["eos_id"] == 1
    assert [s["path"] for s in meta["sources"]] == [str(p) for p in files]
    assert [(s["bytes"], s["mtime_ns"]) for s in meta["sources"]] == [
        (p.stat().st_size, p.stat().st_mtime_ns) for p in files
    ]
    assert meta["source_bytes"] == sum(p.stat().st_size for p in files)
    assert meta["bad_records"] == 0 and meta["n_records"] == len(files) and meta["text_field"] == "text"
    shards = sorted((dataset / "shards").glob("*.bin"))
    assert [p.stem for p in shards] == [r["name"] for r in meta["shards"]]
    assert sum(p.stat().st_size for p in shards) == 2 * meta["n_tokens"]
    assert sorted(p.name for p in dataset.iterdir()) == ["meta.json", "shards", "tokenizer.model"]
    assert max(np.fromfile(p, dtype=np.uint16).max() for p in shards) < VOCAB


def test_prepare_is_deterministic(dataset, corpus, tmp_path):
    """Every node that prepares the same text must get the same tokenizer and tokens."""
    again = prepare_dataset(collect_text_files([str(corpus)], [".py"]), tmp_path / "again", VOCAB, log=quiet)
    names = ["meta.json", "tokenizer.model", *(f"shards/{p.name}" for p in (dataset / "shards").iterdir())]
    for name in names:
        assert (again / name).read_bytes() == (dataset / name).read_bytes()


def test_failed_prepare_leaves_nothing(corpus, tmp_path, monkeypatch):
    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "run_units", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(collect_text_files([str(corpus / "json")], [".py"]), tmp_path / "d", VOCAB, log=quiet)
    assert list(tmp_path.iterdir()) == []


def test_prepare_replaces_only_a_dataset(dataset, corpus, tmp_path):
    files = collect_text_files([str(corpus / "json")], [".py"])
    out = tmp_path / "out"
    shutil.copytree(dataset, out)
    prepare_dataset(files, out, VOCAB, log=quiet)
    assert [s["path"] for s in load_meta(out)["sources"]] == [str(p) for p in files]
    (out / "notes.txt").write_text("mine")
    with pytest.raises(DataError, match="not a trident dataset"):
        prepare_dataset(files, out, VOCAB, log=quiet)


def _cfg(corpus: Path, cache: Path, **kw) -> DataConfig:
    return DataConfig(text=[str(corpus / "json")], suffixes=[".py"], cache_dir=str(cache), **kw)


def test_cache_reuse(corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path / "cache")
    logs: list[str] = []
    first = resolve_dataset(cfg, VOCAB, log=logs.append)
    mtime = (first / "meta.json").stat().st_mtime_ns
    assert resolve_dataset(cfg, VOCAB, log=logs.append) == first
    assert (first / "meta.json").stat().st_mtime_ns == mtime
    assert sum("preparing dataset" in line for line in logs) == 1
    assert first.parent == tmp_path / "cache"
    # Another vocab size is another dataset.
    assert resolve_dataset(cfg, VOCAB + 64, log=quiet) != first


def test_leftover_tmp_dir_is_not_a_dataset(dataset, corpus, tmp_path):
    cfg = _cfg(corpus, tmp_path / "cache")
    files = collect_text_files(cfg.text, cfg.suffixes)
    key = prepare._cache_key(files, VOCAB, cfg.tokenizer_lines)[:16]
    # What a process killed before its final rename leaves behind.
    leftover = tmp_path / "cache" / f"{key}.tmp-999-dead"
    leftover.mkdir(parents=True)
    shutil.copy(dataset / "tokenizer.model", leftover)
    with pytest.raises(DataError, match="not a prepared dataset"):
        resolve_dataset(DataConfig(dataset_dir=str(leftover)), VOCAB)
    out = resolve_dataset(cfg, VOCAB, log=quiet)
    assert out == tmp_path / "cache" / key
    assert TokenDataset(out).n_tokens > 0
    assert not leftover.exists()


def test_default_corpus():
    files = default_corpus_files()
    assert len(files) > 500 and files == sorted(files)
    assert all(p.suffix == ".py" for p in files)
    assert not any({"test", "tests", "idle_test", "site-packages"} & set(p.parts) for p in files)
    assert 5e6 < sum(p.stat().st_size for p in files) < 5e7


def test_collect_text_files(corpus):
    json_files = collect_text_files([str(corpus / "json")], [".py"])
    names = ["__init__.py", "decoder.py", "encoder.py", "scanner.py", "tool.py"]
    assert [p.name for p in json_files] == names
    mixed = [str(corpus / "json" / "*.py"), str(corpus / "json"), str(corpus / "json" / "tool.py")]
    assert collect_text_files(mixed, [".py"]) == json_files
    with pytest.raises(DataError, match="has no files ending in .txt, .md"):
        collect_text_files([str(corpus / "json")], [".txt", ".md"])


@pytest.mark.parametrize(
    "entry, match",
    [
        ("missing", "'.*missing' does not exist"),
        ("empty", "has no files ending in .py"),
        ("*.nope", "matches no files"),
    ],
)
def test_collect_errors(tmp_path, entry, match):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("text")
    with pytest.raises(DataError, match=match) as e:
        collect_text_files([str(tmp_path / entry)], [".py"])
    assert "\n" not in str(e.value)


def test_prepare_errors(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hello world\n" * 20)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n\n")
    with pytest.raises(DataError, match="vocab_size 512 is too large for this text"):
        prepare_dataset([tiny], tmp_path / "a", VOCAB, log=quiet)
    with pytest.raises(DataError, match="too small"):
        prepare_dataset([tiny], tmp_path / "a", 200, log=quiet)
    for files in ([], [empty], [blank]):
        with pytest.raises(DataError, match="no text files|empty"):
            prepare_dataset(files, tmp_path / "a", VOCAB, log=quiet)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.txt", "empty.txt", "tiny.txt"]


def test_dataset_dir_errors(dataset, tmp_path):
    assert resolve_dataset(DataConfig(dataset_dir=str(dataset)), VOCAB) == dataset
    assert resolve_dataset(DataConfig(dataset_dir=str(dataset)), 1024) == dataset
    with pytest.raises(DataError, match=f"dataset vocab {VOCAB} > model.vocab_size 300"):
        resolve_dataset(DataConfig(dataset_dir=str(dataset)), 300)
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copytree(dataset / "shards", partial / "shards")
    with pytest.raises(DataError, match=r"missing meta.json, tokenizer.model\); run tools/prepare_data.py"):
        resolve_dataset(DataConfig(dataset_dir=str(partial)), VOCAB)


def _resolve_in_child(cfg: DataConfig, barrier, results) -> None:
    logs: list[str] = []
    barrier.wait()
    path = resolve_dataset(cfg, VOCAB, log=logs.append)
    results.put((str(path), sum("preparing dataset" in line for line in logs)))


def test_concurrent_resolve(corpus, tmp_path):
    """Ranks on one node resolve together: one prepares, the other waits on the lock and reuses it."""
    cfg = _cfg(corpus, tmp_path / "cache")
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_resolve_in_child, args=(cfg, barrier, results)) for _ in range(2)]
    for p in procs:
        p.start()
    out = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    (path_a, prepared_a), (path_b, prepared_b) = out
    assert path_a == path_b
    assert prepared_a + prepared_b == 1
    key = Path(path_a).name
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [key, f"{key}.lock"]
    assert TokenDataset(path_a).n_tokens > 0


def _fake_dataset(root: Path, n_tokens: int) -> Path:
    """A dataset whose token at position i is i, so windows show exactly which tokens they read."""
    root.mkdir()
    np.arange(n_tokens, dtype=np.uint16).tofile(root / "tokens.bin")
    (root / "tokenizer.model").write_bytes(b"")
    meta = {"format": 1, "vocab_size": 65536, "dtype": "uint16", "n_tokens": n_tokens, "eos_id": 1}
    (root / "meta.json").write_text(json.dumps(meta))
    return root


def test_windows(tmp_path):
    ds = TokenDataset(_fake_dataset(tmp_path / "ds", 1001))
    train, val = ds.split(seq_len=10, val_fraction=0.1)
    assert (len(train), len(val)) == (89, 10)  # 100 windows: 10 validation, 1 gap
    x, y = train.batch(torch.tensor([0, 5, 88]))
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (3, 10)
    assert x[1].tolist() == list(range(50, 60))
    assert torch.equal(y, x + 1)
    vx, vy = val.batch(torch.tensor([9]))
    assert vy[0, -1].item() == 1000  # the last window ends on the last token
    train_read = set(torch.cat(train.batch(torch.arange(len(train)))).flatten().tolist())
    val_read = set(torch.cat(val.batch(torch.arange(len(val)))).flatten().tolist())
    assert not train_read & val_read
    with pytest.raises(IndexError):
        train.batch(torch.tensor([89]))


def test_windows_fraction_rounds_to_at_least_one(tmp_path):
    ds = TokenDataset(_fake_dataset(tmp_path / "ds", 101))
    train, val = ds.split(seq_len=10, val_fraction=0.01)
    assert (len(train), len(val)) == (8, 1)


def test_too_small(tmp_path):
    ds = TokenDataset(_fake_dataset(tmp_path / "ds", 1001))
    ds.split(seq_len=10, val_fraction=0.1, global_batch_size=89)
    with pytest.raises(DataError, match="only 89 training windows of seq_len 10, fewer than one global"):
        ds.split(seq_len=10, val_fraction=0.1, global_batch_size=90)
    with pytest.raises(DataError, match="only 0 training windows"):
        ds.split(seq_len=1000, val_fraction=0.1)


def test_eval_batches_are_bounded_by_the_validation_windows(tmp_path):
    """An evaluation may read each validation window once: 10 windows hold 2 global batches of 4."""
    ds = TokenDataset(_fake_dataset(tmp_path / "ds", 1001))
    _, val = ds.split(seq_len=10, val_fraction=0.1, global_batch_size=4, eval_batches=2)
    assert len(val) == 10
    with pytest.raises(DataError) as e:
        ds.split(seq_len=10, val_fraction=0.1, global_batch_size=4, eval_batches=100_000_000)
    assert "train.eval_batches=100000000 needs 400,000,000 validation windows" in str(e.value)
    assert "holds 10 of seq_len 10" in str(e.value) and "at most 2" in str(e.value)
    # A validation set smaller than one global batch still gives one (windows repeat), never zero.
    ds.split(seq_len=10, val_fraction=0.1, global_batch_size=16, eval_batches=1)
    with pytest.raises(DataError, match="at most 1 "):
        ds.split(seq_len=10, val_fraction=0.1, global_batch_size=16, eval_batches=2)
    # Left out: up to 4 batches, as many as the windows hold.
    assert [eval_batch_count(None, n, 4) for n in (3, 10, 100)] == [1, 2, 4]
    assert eval_batch_count(3, 100, 4) == 3


def _damaged_copy(dataset: Path, root: Path) -> Path:
    copy = root / "ds"
    shutil.copytree(dataset, copy)
    return copy


def _truncate_tokens(d: Path) -> None:
    with open(d / "shards" / "00000.bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 2)


DAMAGE = [
    ("meta.json", lambda d: (d / "meta.json").write_text('{"format": 1, "vocab_'), "not JSON"),
    ("meta.json", lambda d: (d / "meta.json").write_text("[1, 2]"), "not a JSON object"),
    ("meta.json", lambda d: (d / "meta.json").write_text('{"format": 1, "vocab_size": 512}'), "no int eos_id"),
    ("tokenizer.model", lambda d: (d / "tokenizer.model").write_bytes(b"\x00garbage" * 10), "sentencepiece cannot"),
    ("shards/00000.bin", _truncate_tokens, "bytes, but meta.json says"),
]


@pytest.mark.parametrize("name,damage,what", DAMAGE, ids=[f"{n}-{w}" for n, _, w in DAMAGE])
def test_a_damaged_dataset_file_is_one_line_naming_it_and_the_rebuild_command(dataset, tmp_path, name, damage, what):
    d = _damaged_copy(dataset, tmp_path)
    damage(d)
    with pytest.raises(DataError) as e:
        open_dataset(DataConfig(dataset_dir=str(d)), VOCAB)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"dataset file {d / name} is damaged (") and what in message, message
    assert message.endswith(f"rebuild it: python tools/prepare_data.py --text YOUR_TEXT --out {d} --vocab-size 512")


def test_a_damaged_cached_dataset_says_to_remove_it(corpus, tmp_path):
    """A dataset prepared into the cache from data.text is rebuilt by deleting it: the next run prepares it."""
    cfg = _cfg(corpus, tmp_path / "cache")
    d = open_dataset(cfg, VOCAB).dir
    (d / "meta.json").write_text("not json")
    with pytest.raises(DataError, match=rf"dataset file {d / 'meta.json'} is damaged .*rebuild it: rm -r {d} and run"):
        open_dataset(cfg, VOCAB)
    shutil.rmtree(d)
    assert open_dataset(cfg, VOCAB).dir == d


def test_real_dataset_windows(dataset):
    ds = TokenDataset(dataset)
    assert ds.vocab_size == VOCAB and ds.eos_id == 1 and ds.tokenizer_path.is_file()
    train, val = ds.split(seq_len=64, val_fraction=0.05, global_batch_size=32)
    x, y = train.batch(torch.arange(4))
    assert int(x.max()) < VOCAB and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.multiprocess
def test_cli(corpus, tmp_path):
    # Run from elsewhere: the script must find the package without it being installed.
    out = tmp_path / "ds"
    args = ["--text", str(corpus / "json"), "--out", str(out), "--vocab-size", "512"]
    r = tool_process("prepare_data", *args, cwd=tmp_path, fresh=True)
    assert r.returncode == 0, r.stderr
    assert "5 files" in r.stdout and "bytes/token" in r.stdout
    assert TokenDataset(out).vocab_size == 512


@pytest.mark.multiprocess
def test_cli_error(tmp_path):
    r = tool_process(
        "prepare_data", "--text", str(tmp_path / "nope"), "--out", str(tmp_path / "ds"), "--vocab-size", "512", cwd=REPO
    )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: data.text:")
    assert not (tmp_path / "ds").exists()


@pytest.mark.multiprocess
def test_cli_unwritable_out(corpus, tmp_path):
    r = tool_process(
        "prepare_data", "--text", str(corpus / "json"), "--out", "/proc/trident-ds", "--vocab-size", "512", cwd=tmp_path
    )
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: cannot write /proc/trident-ds: ")


def _flip_a_byte_in_the_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_shard_of_a_large_corpus_stops_the_reads_once_the_background_check_finds_it(
    tiny_dataset, tmp_path, monkeypatch
):
    # Past SYNC_BYTES the shards are hashed while training runs: opening does not wait, and the first read after
    # the check found the damage raises the line naming the shard.
    monkeypatch.setattr(verify, "SYNC_BYTES", 0)
    copy = shutil.copytree(tiny_dataset, tmp_path / "tiny")
    shard = copy / "shards" / "00000.bin"
    _flip_a_byte_in_the_middle(shard)
    ds = open_dataset(DataConfig(dataset_dir=str(copy)), 512)
    train, _ = ds.split(seq_len=64, val_fraction=0.05, global_batch_size=16)
    checker = ds.tokens.check.__self__
    checker.wait(60)
    with pytest.raises(DataError, match=rf"^dataset file {shard} is damaged \(sha256 [0-9a-f]{{12}}, but its record"):
        train.batch(torch.arange(4))
    intact = open_dataset(DataConfig(dataset_dir=str(tiny_dataset)), 512).split(64, 0.05, 16)[0]
    intact.tokens.check.__self__.wait(60)
    assert intact.batch(torch.arange(4))[0].shape == (4, 64)


def test_fewer_workers_than_asked_are_said_first_and_why_and_counts_read_as_english(tmp_path, capsys):
    """A small corpus is one 32 MiB work unit, and a worker takes whole units: --workers 2 uses one, and the first
    line says so and why; the counts of one are singular ("1 unit", "1 file"), and --help says it too."""
    text = tmp_path / "one.txt"
    text.write_text("".join(f"line {i} of a small corpus, the quick brown fox\n" for i in range(3000)))
    tool = runpy.run_path(str(REPO / "tools" / "prepare_data.py"))
    assert (
        tool["main"](["--text", str(text), "--out", str(tmp_path / "ds"), "--vocab-size", "300", "--workers", "2"]) == 0
    )
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0] == (
        "using 1 worker, not the 2 asked for: a worker takes whole work units of up to 32 MiB of input, and this "
        "input is 1 unit"
    )
    assert any(line.startswith("tokenizing 1 unit (") and line.endswith(" on 1 worker") for line in lines), lines
    assert out.startswith(f"wrote {tmp_path / 'ds'}: 1 file, ") and ", 1 document, " in out and " in 1 shard (" in out
    with pytest.raises(SystemExit):
        tool["main"](["--help"])
    assert "tokenizing processes, at most one per work unit" in capsys.readouterr().out


def test_the_workers_asked_for_are_used_without_a_word(tmp_path):
    text = tmp_path / "one.txt"
    text.write_text("".join(f"line {i} of a small corpus, the quick brown fox\n" for i in range(3000)))
    logs: list[str] = []
    prepare_dataset([text], tmp_path / "ds", 300, log=logs.append, workers=1)
    assert logs[0].startswith("training a 300-piece BPE tokenizer") and logs[1].endswith(" on 1 worker"), logs
