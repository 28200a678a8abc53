"""The documentation against the code: README.md and docs/*.md say only what is true.

- every key of the config schema (``schema_keys``, what the unknown-key line suggests from) and every preset under
  conf/model/ is in docs/configuration.md, so a new key without its line there fails here;
- every relative link reaches a file and, where it names one, a heading of that file (GitHub's anchors);
- every command of a code block or inline code (``python tools/X.py ...``, ``python train.py ...``, ``torchrun ...``,
  ``sbatch ... tools/slurm/train.sbatch ...``) names a script that exists and flags its ``--help`` lists (each
  script's help read once, in this process; ``tools/<name>.py --help`` reads every tool's, ``bench.py <subcommand>
  --help`` every subcommand's); its overrides are config keys, ``model=`` presets or
  ``hydra.run.dir``, they compose, and a training command's layout passes train.py's validation at its world size;
- the cheap commands run as written: the README's gpt-tiny training command (``python train.py`` as a warm process, in a
  directory holding a copy of docs/), every ``estimate_memory`` command, and every ``plot_schedule --schedule``
  drawing, whose file in docs/ must be what the command draws.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import runpy
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from tests.helpers import REPO
from tests.helpers.processes import child_env
from tests.helpers.warm import run
from trident.config import compose_config, validate
from trident.config.compose import schema_keys

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PRESETS = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
# Tools whose positional arguments are train.py's overrides.
OVERRIDE_TOOLS = {"tools/estimate_memory.py", "tools/plan.py"}
# Hydra's own keys a command may set.
HYDRA_KEYS = {"hydra.run.dir"}


def leaf_keys() -> list[str]:
    keys = schema_keys()
    return [k for k in keys if not any(other.startswith(k + ".") for other in keys)]


FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


# --- config keys


def test_every_config_key_and_preset_is_in_the_configuration_page() -> None:
    page = (REPO / "docs" / "configuration.md").read_text()
    keys = leaf_keys()
    assert "checkpoint.keep_last" in keys and "checkpoint.async" in keys, keys  # the schema as users type it
    missing = [k for k in keys if f"| `{k}` |" not in page]
    assert not missing, f"docs/configuration.md has no table row for {missing}"
    assert not [p for p in PRESETS if f"| `{p}` |" not in page], PRESETS


# --- links


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_every_relative_link_reaches_a_file_and_its_heading() -> None:
    broken = []
    count = 0
    for page in PAGES:
        for target in LINK.findall(prose(page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            count += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.is_file():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading in {dest.name})")
    assert count > 30, count
    assert not broken, broken


# --- commands


@dataclass(frozen=True)
class Command:
    page: str
    text: str
    words: tuple[str, ...]
    block: bool  # from a code block (else inline code)

    @property
    def script(self) -> str | None:
        """The script run: tools/X.py, train.py, or the sbatch script (or None: a placeholder such as <name>)."""
        for word in self.words:
            if word.endswith((".py", ".sbatch")):
                return None if "<" in word else word
        return None

    @property
    def args(self) -> list[str]:
        """The words after the script, placeholders (``...``, ``[overrides]``) left out."""
        rest = list(self.words[self.words.index(self.script) + 1 :]) if self.script else []
        return [w for w in rest if w not in ("...", "&") and not re.fullmatch(r"\[[^=]*\]", w)]

    @property
    def trains(self) -> bool:
        return self.script in ("train.py", "tools/slurm/train.sbatch")

    @property
    def overrides(self) -> list[str]:
        if not (self.trains or self.script in OVERRIDE_TOOLS):
            return []
        return [w for w in self.args if "=" in w and not w.startswith("-")]

    @property
    def world(self) -> int | None:
        """Ranks the command launches, where it says: 1 for python train.py, torchrun's nodes x ranks per node."""
        if self.words[0] == "python":
            return 1
        if self.words[0] != "torchrun":
            return None
        opts = dict(zip(self.words, self.words[1:], strict=False))
        nodes, per_node = opts.get("--nnodes", "1"), opts.get("--nproc-per-node", "1")
        return int(nodes) * int(per_node) if nodes.isdigit() and per_node.isdigit() else None


def commands_of(page: Path) -> list[Command]:
    text = page.read_text()
    lines = []
    for block in FENCE.findall(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        lines += [(line, True) for line in joined.splitlines()]
    lines += [(" ".join(span.split()), False) for span in re.findall(r"`([^`]+)`", prose(text))]
    out = []
    for line, block in lines:
        line = re.sub(r"^\$ |^time ", "", line.strip())
        if not re.match(r"(python (tools/|train\.py)|torchrun |sbatch )", line):
            continue
        words = tuple(shlex.split(line, comments=True))
        out.append(Command(page.relative_to(REPO).as_posix(), line, words, block))
    return out


COMMANDS = [c for page in PAGES for c in commands_of(page)]


def test_the_docs_have_the_commands_this_file_checks() -> None:
    readme = [c for c in COMMANDS if c.page == "README.md"]
    assert any(c.words[:3] == ("torchrun", "--nproc-per-node", "8") for c in readme)  # the quick start's main job
    assert len(COMMANDS) > 60 and {c.script for c in COMMANDS} >= {
        "train.py",
        "tools/slurm/train.sbatch",
        *(f"tools/{p.name}" for p in (REPO / "tools").glob("*.py")),
    }, sorted({str(c.script) for c in COMMANDS})


@functools.cache
def help_text(script: str, subcommand: str | None = None) -> str:
    """``python script [subcommand] --help``, run once in this process (torch is imported already)."""
    argv = sys.argv
    sys.argv = [str(REPO / script), *([subcommand] if subcommand else []), "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            runpy.run_path(str(REPO / script), run_name="__main__")
    finally:
        sys.argv = argv
    assert exit_.value.code in (0, None), (script, subcommand, out.getvalue())
    return out.getvalue()


def flags_of(help_: str) -> set[str]:
    return set(re.findall(r"--[\w-]+", help_))


TORCHRUN_FLAGS = {o for a in get_args_parser()._actions for o in a.option_strings}


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: f"{c.page}:{c.text[:60]}")
def test_a_command_names_real_scripts_flags_and_keys(cmd: Command) -> None:
    script = cmd.script
    if cmd.words[0] == "torchrun":
        launcher = cmd.words[1 : cmd.words.index(script)] if script else cmd.words[1:]
        wrong = [w for w in launcher if w.startswith("--") and w.split("=")[0] not in TORCHRUN_FLAGS]
        assert not wrong, f"{cmd.page}: torchrun has no {wrong}: {cmd.text}"
    if script is None:  # torchrun's own flags, or python tools/<name>.py --help: every tool's help then
        assert cmd.words[0] == "torchrun" or "tools/<name>.py" in cmd.words, cmd.text
        for tool in sorted((REPO / "tools").glob("*.py")):
            assert "usage:" in help_text(f"tools/{tool.name}"), tool
        return
    assert (REPO / script).is_file(), f"{cmd.page}: {script} does not exist: {cmd.text}"
    if script.startswith("tools/") and script.endswith(".py"):
        positional = [w for w in cmd.args if not w.startswith("-")]
        sub = positional[0] if script == "tools/bench.py" and positional else None
        if sub == "<subcommand>":  # python tools/bench.py <subcommand> --help: each subcommand's
            subs = re.search(r"\{([\w,]+)\}", help_text(script)).group(1).split(",")
            assert len(subs) >= 8 and all("usage:" in help_text(script, s) for s in subs), subs
            sub = None
        flags = flags_of(help_text(script, sub))
        wrong = [w for w in cmd.args if w.startswith("--") and w.split("=")[0] not in flags]
        assert not wrong, f"{cmd.page}: {script}{' ' + sub if sub else ''} --help lists no {wrong}: {cmd.text}"
    keys = set(schema_keys())
    overrides = []
    for word in cmd.overrides:
        key, value = word.lstrip("+").split("=", 1)
        if key == "model":
            assert value in PRESETS, f"{cmd.page}: no preset conf/model/{value}.yaml: {cmd.text}"
        elif key not in HYDRA_KEYS:
            assert key in keys, f"{cmd.page}: {key} is not a config key: {cmd.text}"
        if key not in HYDRA_KEYS:
            overrides.append(word)
    if not overrides and not cmd.trains:
        return
    cfg = compose_config(REPO / "conf", overrides)
    world = cmd.world
    if cmd.trains and world is not None and not cfg.parallel.auto and cfg.checkpoint.init_from is None:
        validate(cfg, world)  # the layout a training command launches is one train.py accepts


# --- commands run as written


@pytest.mark.multiprocess
def test_the_readme_trains_gpt_tiny_as_written(tmp_path: Path) -> None:
    """The README's quick training command, as a user types it in a checkout (here: a directory with docs/ in it,
    a home of its own for the dataset cache): it prepares the docs as a dataset, trains, and saves."""
    (cmd,) = [c for c in COMMANDS if c.page == "README.md" and c.trains and "model=gpt-tiny" in c.words]
    assert cmd.words[:2] == ("python", "train.py"), cmd.text
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    (tmp_path / "home").mkdir()
    env = child_env(HOME=str(tmp_path / "home"))
    done = run(REPO / "train.py", cmd.args, env, tmp_path, timeout=300)  # python train.py ..., forked warm
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    steps = int(next(w for w in cmd.words if w.startswith("train.steps=")).split("=")[1])
    run_dir = tmp_path / next(w for w in cmd.words if w.startswith("hydra.run.dir=")).split("=")[1]
    assert f"done: {steps} steps" in done.stdout, done.stdout[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert (run_dir / "checkpoints" / f"step_{steps:08d}" / "meta.json").is_file()


def run_in(cwd: Path, script: str, args: list[str]) -> tuple[int, str]:
    """``python script args`` in this process, in ``cwd``: exit code and stdout."""
    argv, here = sys.argv, os.getcwd()
    sys.argv = [str(REPO / script), *args]
    out = io.StringIO()
    code: object = 0
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(REPO / script), run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
        os.chdir(here)
    return (0 if code is None else code), out.getvalue()  # type: ignore[return-value]


def distinct(commands: list[Command]) -> list[Command]:
    """One of each command however many pages show it."""
    return list({c.words: c for c in reversed(commands)}.values())[::-1]


ESTIMATES = distinct([c for c in COMMANDS if c.script == "tools/estimate_memory.py" and c.block])
DRAWINGS = distinct([c for c in COMMANDS if c.script == "tools/plot_schedule.py" and "--schedule" in c.words])


def test_there_are_cheap_commands_to_run() -> None:
    assert len(ESTIMATES) >= 3 and len(DRAWINGS) >= 2, (ESTIMATES, DRAWINGS)


@pytest.mark.parametrize("cmd", ESTIMATES, ids=lambda c: c.text[:80])
def test_an_estimate_memory_command_runs_as_written(cmd: Command, tmp_path: Path) -> None:
    code, out = run_in(tmp_path, cmd.script, cmd.args)
    assert code == 0, out
    assert out.startswith("Estimated memory per rank for "), out
    if "checkpoint.async=true" in cmd.words:
        assert "checkpoint staging" in out, out


@pytest.mark.parametrize("cmd", DRAWINGS, ids=lambda c: c.text[:80])
def test_a_schedule_drawing_runs_as_written_and_the_docs_picture_is_its_output(cmd: Command, tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    code, out = run_in(tmp_path, cmd.script, cmd.args)
    assert code == 0, out
    target = cmd.args[cmd.args.index("--out") + 1]
    drawn = (tmp_path / target).read_text()
    assert drawn.startswith("<?xml") or drawn.startswith("<svg"), drawn[:200]
    if shown := re.search(r"docs/[\w.-]+\.svg", cmd.text):  # the picture docs/ shows (its --out, or its comment)
        assert drawn == (REPO / shown.group()).read_text(), f"{shown.group()} is stale: redraw it with {cmd.text}"


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    """The quick start's second command, and the Tests section's, is exactly what .ci/run runs."""
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == 'pip install torch==2.13.0 -e ".[dev]" && python -m pytest -q -n 2 --dist loadfile', ci
    blocks = [b.strip() for b in FENCE.findall((REPO / "README.md").read_text())]
    assert blocks.count(ci) == 2, blocks  # in the quick start and under Tests
    assert (
        "pip install torch==2.13.0 -e . && torchrun --nproc-per-node 8 train.py parallel.tp=2 parallel.pp=4" in blocks
    )
