"""A small JSON file of measurements keyed per machine (trident/peak.py's CPU peaks, the planner's calibrations):
read whole, and added to one entry at a time, atomically."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


def read_entries(path: Path) -> dict:
    """The file's entries; none when it is missing, unreadable or not a JSON object."""
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def add_entry(path: Path, key: str, value: object) -> None:
    """Set ``key`` in the file, keeping the other entries. Re-read just before writing: the ranks of a node measure
    together and each adds its own entry. The write is atomic (a reader sees the old file or the new one), and a
    file that cannot be written costs a measurement next time, nothing more."""
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = {**read_entries(path), key: value}
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
