"""Checkpoint integrity (trident/checkpoint/integrity.py): every file a save writes is in meta.json's record with
its size and CRC-32; a byte changed after the save is refused in one line naming the file, by a resume, by
``checkpoint.init_from`` and by the tools, and ``checkpoint.resume=auto`` passes over a damaged checkpoint to the
newest intact one, saying so. A checkpoint from before the record still loads, said once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.layouts import assert_same_curve, four_layers, train_in_process
from tests.test_checkpoint import FakeTrainer, build, checkpointer
from trident.checkpoint import integrity
from trident.checkpoint.files import checkpoint_name
from trident.checkpoint.init_from import load_init_weights, open_source
from trident.errors import CheckpointError
from trident_dev.consolidated import load_weights


def _flip(file: Path, at: float = 0.5) -> None:
    """Change one byte of ``file`` in place, ``at`` its length: the damage a bad disk or a bad copy leaves."""
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    file.write_bytes(bytes(data))


def _record(path: Path) -> dict:
    return json.loads((path / "meta.json").read_text())[integrity.RECORD]


def test_the_shares_of_the_ranks_cover_every_file_once_and_each_finds_its_own_damage(tmp_path: Path) -> None:
    names = [f"f{i}" for i in range(7)]
    for i, name in enumerate(names):
        (tmp_path / name).write_bytes(bytes([i]) * (1000 + i))
    record = integrity.digests(tmp_path, names)
    assert record["f3"] == {"bytes": 1003, "crc32": f"{__import__('zlib').crc32(bytes([3]) * 1003):08x}"}
    for world in (1, 2, 3):
        assert all(integrity.damage(tmp_path, record, r, world) is None for r in range(world))
    _flip(tmp_path / "f4")
    for world in (1, 2, 3):
        found = [integrity.damage(tmp_path, record, r, world) for r in range(world)]
        owner = sorted(names).index("f4") % world
        assert [r for r, p in enumerate(found) if p] == [owner], world
        assert found[owner] == (
            f"checkpoint {tmp_path} is damaged: f4 has CRC-32 {integrity.file_digest(tmp_path / 'f4')['crc32']}, its "
            f"record says {record['f4']['crc32']} (its bytes changed after it was saved)"
        )
    (tmp_path / "f5").write_bytes(b"short")
    assert integrity.damage(tmp_path, {"f5": record["f5"]}) == (
        f"checkpoint {tmp_path} is damaged: f5 is 5 bytes, its record says 1005"
    )
    (tmp_path / "f6").unlink()
    assert integrity.damage(tmp_path, {"f6": record["f6"]}) == f"checkpoint {tmp_path} is damaged: f6 is missing"


def test_a_flipped_byte_is_refused_by_name_and_auto_resumes_the_newest_intact_checkpoint(
    one_process,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"a tokenizer's bytes")
    run = build(one_process, 1)
    saver = checkpointer(tmp_path / "ck", run, tokenizer=tokenizer)
    saver.save(FakeTrainer(1))
    saver.save(FakeTrainer(2))
    first, second = (tmp_path / "ck" / checkpoint_name(s) for s in (1, 2))
    # Every file of the save is recorded (meta.json, written last, aside), and matches.
    for path in (first, second):
        assert set(_record(path)) == {p.name for p in path.iterdir()} - {"meta.json"}
        assert {".metadata", "__0_0.distcp", "trainer.json", "config.json", "tokenizer.model"} <= set(_record(path))
        assert integrity.damage(path, _record(path)) is None
    _flip(second / "__0_0.distcp")
    capsys.readouterr()

    trainer = FakeTrainer()
    assert checkpointer(tmp_path / "ck", build(one_process, 2)).maybe_resume(trainer) == 1
    out = capsys.readouterr().out
    assert f"warning: checkpoint {second} is damaged: __0_0.distcp has CRC-32 " in out.splitlines()[
        0
    ] and out.splitlines()[0].endswith(
        "its record says " + _record(second)["__0_0.distcp"]["crc32"] + " (its bytes changed after it was saved); "
        f"trying the checkpoint before it, {first.name}"
    ), out
    assert f"resumed from {first} at step 1" in out

    with pytest.raises(CheckpointError, match=rf"^checkpoint {second} is damaged: __0_0\.distcp has CRC-32 \w+, its"):
        checkpointer(tmp_path / "ck", build(one_process, 2), resume=str(second)).maybe_resume(FakeTrainer())
    _flip(first / "trainer.json", 0.2)
    with pytest.raises(CheckpointError, match=r"trainer\.json has CRC-32 .*; no older checkpoint in .* is intact"):
        checkpointer(tmp_path / "ck", build(one_process, 2)).maybe_resume(FakeTrainer())

    # The tools (convert, consolidate, generate, export read through load_weights) and init_from refuse it too.
    with pytest.raises(CheckpointError, match=rf"^checkpoint {second} is damaged: __0_0\.distcp"):
        load_weights(second)
    with pytest.raises(CheckpointError, match=rf"^checkpoint {second} is damaged: __0_0\.distcp"):
        load_init_weights(run.parts.chunks, open_source(str(second)))


def test_a_checkpoint_from_before_the_record_loads_unverified_and_says_so(
    one_process,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    run = build(one_process, 1)
    checkpointer(tmp_path, run).save(FakeTrainer(3))
    path = tmp_path / checkpoint_name(3)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != integrity.RECORD}))
    capsys.readouterr()
    assert checkpointer(tmp_path, build(one_process, 2)).maybe_resume(FakeTrainer()) == 3
    out = capsys.readouterr().out
    assert out.count("has no checksums") == 1 and integrity.UNRECORDED.format(path=path) in out
    assert load_weights(path).step == 3
    assert capsys.readouterr().err.count("has no checksums") == 1


@pytest.mark.multiprocess
def test_two_ranks_share_the_verification_and_resume_before_the_damage_with_the_unbroken_losses(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    """dp=2 saves at steps 2 and 4; a byte of a file that the second rank verifies is flipped in step 4; resumed
    with train.steps=6 and checkpoint.resume=auto, both ranks pass over step 4 and go on from step 2 with the losses
    of the run that was never damaged."""
    base = four_layers(tiny_dataset, 6, "train.eval_every=0", "checkpoint.every=2", "parallel.dp=2")
    (unbroken, _) = train_in_process(tmp_path / "unbroken", base, world=2)
    first = [*base, "train.steps=4"]
    train_in_process(tmp_path / "run", first, world=2)
    step4 = tmp_path / "run" / "checkpoints" / checkpoint_name(4)
    second_share = [n for n in sorted(_record(step4))[1::2] if n.endswith(".distcp")] or sorted(_record(step4))[1::2]
    _flip(step4 / second_share[0])
    (resumed, _) = train_in_process(tmp_path / "run", [*base, "checkpoint.resume=auto"], world=2)
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]
    assert_same_curve(unbroken[2:], resumed, rel=1e-12)
