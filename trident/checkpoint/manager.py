"""The checkpointer: when a run saves, what goes in, and how a run resumes into any layout.

The tensor data is keyed by parameter name in global coordinates (``state.py``): model parameters as logical
tensors, AdamW state per parameter, each rank's RNG state under its layout coordinate. Each rank writes only the
boxes it holds, and loads exactly the boxes its placement covers, whatever the layout that saved them
(``dcp.py``). The directory and its atomic publish are ``files.py``'s. Nothing is ever unpickled with plain
``pickle``. A failure on any rank is raised on every rank and removes the temporary directory. With
``checkpoint.async`` the same save is staged in host memory and written in the background (``background.py``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch.distributed as dist
from torch import nn

from trident.checkpoint import integrity, room
from trident.checkpoint.background import BackgroundSave, WriterProcess
from trident.checkpoint.files import (
    checkpoint_name,
    find_resume_path,
    list_checkpoints,
    new_temporary,
    prune_checkpoints,
    publish,
    read_head,
    read_json,
    saved_model_config,
)
from trident.checkpoint.sharded import Sharded
from trident.checkpoint.state import (
    BUFFERS,
    MODEL,
    OPTIM,
    named_parameters,
    rng_destinations,
    rng_state,
)
from trident.checkpoint.zero_state import MasterState, MomentState
from trident.config import MOE_FIXED, SHAPE_KEYS
from trident.errors import CheckpointError, DiskFullError, TridentError
from trident.models.moe import balancing_state
from trident.parallel.agree import gathered, on_every_rank, on_one_rank
from trident.parallel.groups import ProcessGroups
from trident.parallel.zero.optimizer import ZeroOptimizer


class Trainable(Protocol):
    """What the checkpointer needs of the training loop."""

    step: int

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Checkpointer:
    """When to save, what goes in, and how a run resumes. Every rank calls ``save`` and ``maybe_resume``.

    ``modules`` are this rank's model chunks (several on a pipeline rank with virtual stages).
    """

    def __init__(
        self,
        root: Path,
        every: int,
        keep_last: int,
        resume: str,
        groups: ProcessGroups,
        modules: list[nn.Module],
        optimizer: ZeroOptimizer,
        config: dict,
        tokenizer: Path | None,
        background: bool = False,
        timeout_s: float = 600.0,
    ) -> None:
        """``background``: write each save in the background (``checkpoint.async``); ``timeout_s``: its
        collectives' timeout."""
        self.root, self.every, self.keep_last, self.resume = root, every, keep_last, resume
        self.groups, self.config, self.tokenizer = groups, config, tokenizer
        self.params = named_parameters(modules)
        # The weights saved are the optimizer's fp32 masters, with its AdamW state, as boxes of logical tensors.
        self.weights = MasterState(optimizer, self.params)
        self.optimizer = MomentState(optimizer, self.params)
        self.buffers = balancing_state(modules)  # every dp and tp rank holds the same: one copy is written
        topo = groups.topology
        self.layout = {"dp": topo.dp, "tp": topo.tp, "pp": topo.pp} | ({"cp": topo.cp} if topo.cp > 1 else {})
        # Made on every rank alike (a new process group): build_checkpointer runs at the same point on each.
        self.background = BackgroundSave(timeout_s) if background else None

    def due(self, step: int, total: int) -> bool:
        return step == total or (self.every > 0 and step % self.every == 0)

    # The rank that creates, finishes and renames the temporary directory.
    _WRITER = 0

    def prepare(self) -> None:
        """Before step 0: a checkpoint directory that cannot be written fails now, not after hours."""

        def probe() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            probe_file = self.root / f".write-test-{os.getpid()}"
            probe_file.write_text("ok")
            probe_file.unlink()

        on_one_rank(probe, self._WRITER, f"write to checkpoint.dir {self.root}")

    def save(self, trainer: Trainable) -> Path | None:
        """Save the trainer's step; return the newest checkpoint complete on return: this one, or when saving in
        the background (``checkpoint.async``), the one before it, if any (waited for first: one save at a time)."""
        done = self.wait()
        step = trainer.step
        name = checkpoint_name(step)
        made = [on_one_rank(lambda: self._start(step, name), self._WRITER, f"write {name} in {self.root}")]
        dist.broadcast_object_list(made, src=self._WRITER)
        tmp = Path(made[0])
        state = {
            **{MODEL + k: v for k, v in self.weights.sharded_state().items()},
            **{OPTIM + k: v for k, v in self.optimizer.sharded_state().items()},
            **{BUFFERS + k: Sharded.whole(v) for k, v in self.buffers.items()},
            **rng_state(self.groups.coord),
        }
        # Taken now: the trainer goes on to later steps while a background save is written.
        files = {"trainer.json": copy.deepcopy(trainer.state_dict()), "config.json": self.config}
        if self.background is None:
            return self._write(state, tmp, step, files, None)
        staged = self.background.stage.copy(state)  # the live tensors are free to change once this returns
        process = self.background.process
        self.background.start(lambda group: self._write(staged, tmp, step, files, group, process))
        return done

    def wait(self) -> Path | None:
        """Wait for the save in the background, if any (every rank, after the same step); return its checkpoint,
        or raise its failure, the same on every rank."""
        return self.background.wait() if self.background is not None else None

    def _write(
        self,
        state: dict,
        tmp: Path,
        step: int,
        files: dict[str, dict],
        group: dist.ProcessGroup | None,
        process: WriterProcess | None = None,
    ) -> Path:
        """Write the tensor data into ``tmp`` (every rank), then publish it (one rank); the collectives run on
        ``group`` (the background save's, or the world), the files are written by ``process`` (the background
        save's writer) or in this one."""
        name = checkpoint_name(step)
        from trident.checkpoint import dcp  # by the first save or load, not with this module (sharded.py says why)

        try:
            written = dcp.write_sharded(state, tmp, group, process)  # a failure on any rank is raised on every rank
            # Each rank hashes the files it wrote, while their pages are in memory (integrity.py).
            hashed = gathered(lambda: integrity.digests(tmp, written), f"hash the files of {name}", group)
            checksums = {file: digest for part in hashed for file, digest in part.items()}
        except TridentError as e:
            if dist.get_rank() == self._WRITER:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(e, DiskFullError):
                raise self._kept(e) from None
            raise

        def finish() -> None:
            try:
                publish(tmp, step, files, self.tokenizer, self.layout, checksums)
            except OSError as e:  # the small files found no room
                needed = sum(d["bytes"] for d in checksums.values())
                raise DiskFullError(room.full_line(self.root, needed)) if room.is_full(e) else e from None
            prune_checkpoints(self.root, self.keep_last, step)  # only once the new checkpoint is complete

        try:
            on_one_rank(finish, self._WRITER, f"write checkpoint {name} in {self.root}", group)
        except DiskFullError as e:
            raise self._kept(e) from None
        return self.root / name

    def _start(self, step: int, name: str) -> str:
        """The save's temporary directory, made only if the save fits beside the newest checkpoint (room.py)."""
        newest = list_checkpoints(self.root)[-1:]
        record = integrity.read_record(newest[0]) if newest else None
        try:
            if record:
                room.check(self.root, sum(d["bytes"] for d in record.values()))
        except DiskFullError as e:
            raise self._kept(DiskFullError(f"{e} (the size of {newest[0].name}); {name} was not started")) from None
        return str(new_temporary(self.root, step))

    def _kept(self, error: DiskFullError) -> DiskFullError:
        """``error`` with what is left and what to do; agreed (every rank raises the same)."""
        newest = list_checkpoints(self.root)[-1:]
        kept = f"the last complete checkpoint, {newest[0]}, is kept" if newest else "no checkpoint was written"
        full = DiskFullError(
            f"{error}; {kept}: free space, lower checkpoint.keep_last or point checkpoint.dir at a larger disk, then "
            "rerun to resume"
        )
        full.agreed = True
        return full

    def _find(self) -> list[str]:
        """checkpoint.resume's checkpoint; under ``auto`` every complete one in checkpoint.dir, newest first (the
        first intact one is resumed); none for ``none`` or a fresh directory."""
        if self.resume == "none" and list_checkpoints(self.root):
            raise CheckpointError(
                f"checkpoint.dir {self.root} already holds checkpoints (newest "
                f"{list_checkpoints(self.root)[-1].name}) and checkpoint.resume=none would mix a new run into "
                "them; use checkpoint.resume=auto to continue, or another checkpoint.dir"
            )
        if self.resume == "auto":
            return [str(p) for p in reversed(list_checkpoints(self.root))]
        path = find_resume_path(self.resume, self.root)
        return [str(path)] if path else []

    def _intact(self, candidates: list[str]) -> Path | None:
        """The first of ``candidates`` whose files match their checksums, every rank verifying its share of each
        (integrity.py); a damaged one is refused in one line, or under ``auto`` passed over with a line saying so."""
        for i, candidate in enumerate(candidates):
            path = Path(candidate)
            try:
                recorded = integrity.verify_everywhere(path)
            except CheckpointError as e:
                if self.resume != "auto":
                    raise
                if i == len(candidates) - 1:
                    raise CheckpointError(f"{e}; no older checkpoint in {self.root} is intact either") from None
                if self.groups.is_logging_rank:
                    print(f"warning: {e}; trying the checkpoint before it, {Path(candidates[i + 1]).name}", flush=True)
                continue
            if not recorded and self.groups.is_logging_rank:
                print(integrity.UNRECORDED.format(path=path), flush=True)
            return path
        return None

    def maybe_resume(self, trainer: Trainable) -> int | None:
        """Restore model, optimizer, RNG and trainer state from checkpoint.resume; return the step, or None."""
        # Rank 0 decides and every rank agrees, so an error can never leave the others waiting.
        found = [on_one_rank(self._find, 0, "look for checkpoints")]
        dist.broadcast_object_list(found, src=0)
        path = self._intact(found[0])
        if path is None:
            return None
        # Every rank reads the files itself (on several nodes checkpoint.dir must be a shared filesystem);
        # one that cannot makes them all stop with its reason instead of leaving the rest waiting.
        saved_config, load = on_every_rank(lambda: self._prepare_load(path, trainer), f"read checkpoint {path}")
        load()  # collective: a failure on any rank is raised on every rank
        if self.groups.is_logging_rank:
            print(f"resumed from {path} at step {trainer.step}", flush=True)
            changed = schedule_changes(saved_config, self.config)
            if changed:
                print(
                    f"note: resuming with {', '.join(changed)}: the steps from here differ from the interrupted run's",
                    flush=True,
                )
        return trainer.step

    def _prepare_load(self, path: Path, trainer: Trainable) -> tuple[dict, Callable[[], None]]:
        """Everything that can fail on one rank alone: read and check the small files and the index, restore
        the trainer state; return a function that loads the tensors (the collective part)."""
        meta, config = read_head(path)
        saved_model = dataclasses.asdict(saved_model_config(config, f"checkpoint {path}"))
        # model.moe's training knobs (the auxiliary losses, the bias's rate, a capacity) may change on resume, as the
        # learning rate may; its keys that fix the function may not.
        compared = [(f"moe.{k}", saved_model["moe"][k], self.config["model"]["moe"][k]) for k in MOE_FIXED]
        compared += [(key, saved_model[key], self.config["model"][key]) for key in SHAPE_KEYS if key != "moe"]
        for key, saved, mine in compared:
            if saved != mine:
                raise CheckpointError(
                    f"checkpoint {path} has model.{key}={saved} but this run has {mine}; "
                    "resume with the same model shape or set checkpoint.resume=none"
                )
        try:
            trainer.load_state_dict(read_json(path, "trainer.json"))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(
                f"cannot read checkpoint file {path / 'trainer.json'}: {type(e).__name__} {e}"
            ) from None
        from trident.checkpoint import dcp

        metadata = dcp.read_metadata(path)
        saved = {key: tuple(entry.size) for key, entry in metadata.state_dict_metadata.items()}

        saved_weights = {k[len(MODEL) :]: v for k, v in saved.items() if k.startswith(MODEL)}
        weights, install_weights = self.weights.load_destinations(saved_weights)
        state = {MODEL + k: v for k, v in weights.items()}
        for key, wanted in state.items():
            if saved.get(key) != wanted.shape:
                held = f"holds {key} with shape {list(saved[key])}" if key in saved else f"does not hold {key}"
                raise CheckpointError(f"checkpoint {path} {held}; this model's is {list(wanted.shape)}")
        saved_optim = {k[len(OPTIM) :]: v for k, v in saved.items() if k.startswith(OPTIM)}
        optim, install = {}, lambda: None  # noqa: E731  (checkpoint.fresh_optimizer: the state starts afresh)
        if not self.config["checkpoint"].get("fresh_optimizer", False):
            _same_optimizer(path, config, self.config)
            optim, install = self.optimizer.load_destinations(saved_optim)
        state.update({OPTIM + k: v for k, v in optim.items()})
        # The default generators' states (dropout derives its masks and draws from none of them; they are kept so
        # that anything else random resumes exactly) belong to a coordinate of the layout that saved them; under
        # another layout they mean something else, so the freshly seeded ones are kept.
        # A checkpoint from before a buffer existed keeps its fresh value (the bias at zero).
        state.update({BUFFERS + k: Sharded.whole(v) for k, v in self.buffers.items() if BUFFERS + k in saved})
        restore_rng = lambda: None  # noqa: E731
        if meta.get("layout") == self.layout:
            rng, restore_rng = rng_destinations(self.groups.coord, saved)
            state.update(rng)

        def load() -> None:
            dcp.read_sharded(state, path, metadata)
            install_weights()
            install()
            restore_rng()

        return config, load


def _same_optimizer(path: Path, saved: dict, current: dict) -> None:
    """Refuse, in one line, to load one optimizer's state into the other (AdamW's moments are not Muon's momentum)."""
    was, now = (c.get("optim", {}).get("name", "adamw") for c in (saved, current))
    if was != now:
        raise CheckpointError(
            f"checkpoint {path} holds the state of optim.name={was}, this run steps with optim.name={now}: resume "
            f"with optim.name={was}, or set checkpoint.fresh_optimizer=true to keep the weights and start the "
            "optimizer state afresh"
        )


# Settings that shape every later step without changing parameter shapes: changing them on resume is
# allowed (extending a run is common), but the user is told the curve will not match the original.
_SCHEDULE_KEYS = {"train": ("steps",), "optim": ("lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip")}


def schedule_changes(saved: dict, current: dict) -> list[str]:
    """``key old -> new`` for each schedule setting (and model.moe training knob) that differs between two run
    configs."""
    changes = []
    for section, keys in _SCHEDULE_KEYS.items():
        for key in keys:
            old, new = _setting(saved, section, key), _setting(current, section, key)
            if old is not None and old != new:
                changes.append(f"{section}.{key} {old} -> {new}")
    saved_moe, moe = (_setting(c, "model", "moe") or {} for c in (saved, current))
    for key in sorted(set(saved_moe) - set(MOE_FIXED)):  # the training knobs of model.moe, which a resume may change
        if key in moe and saved_moe[key] != moe[key]:
            changes.append(f"model.moe.{key} {saved_moe[key]} -> {moe[key]}")
    return changes


def _setting(config: dict, section: str, key: str) -> object:
    values = config.get(section)
    return values.get(key) if isinstance(values, dict) else None
