"""What the tests share, in one place: no test module imports another's helpers.

- ``layouts``: train in-process under any layout, the one-process references (each trained once per session),
  and the curve comparison;
- ``processes``: the command line as a user starts it (``train.py``, ``torchrun``), its environment, its output,
  its metrics file and its worker processes;
- ``tools``: a ``tools/*.py`` script run in the test process;
- ``corpus``: a generated corpus of every input kind; ``plan_profiles``: a hand-built planner profile;
  ``plan_space``: the planner's whole space and the full grid of its keys.

The package is importable by the pooled ranks too (trident_dev/ranks.py), which import the functions they run by
their module names."""

from __future__ import annotations

import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
# The text of the test dataset (tests/conftest.py's ``tiny_dataset``): a few standard-library packages.
SMALL_CORPUS = [str(Path(sysconfig.get_paths()["stdlib"]) / name) for name in ("json", "email", "logging")]
