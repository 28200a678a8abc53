"""Shared fixtures: a small real dataset (a few standard-library packages, 512-piece BPE tokenizer)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from trident.data.prepare import collect_text_files, prepare_dataset

REPO = Path(__file__).resolve().parent.parent
SMALL_CORPUS = [str(Path(sysconfig.get_paths()["stdlib"]) / name) for name in ("json", "email", "logging")]


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared dataset directory for gpt-tiny (vocab 512): ~300k tokens of real Python source."""
    files = collect_text_files(SMALL_CORPUS, [".py"])
    return prepare_dataset(files, tmp_path_factory.mktemp("data") / "tiny", vocab_size=512, log=lambda _: None)
