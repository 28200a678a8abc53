"""``checkpoint.init_from=PATH``: start a run from the weights of a trident checkpoint (any layout) or of a local
Hugging Face directory (GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE, OLMoE), under any layout, with a fresh optimizer at
step 0.

The model's shape comes from that source. ``adopt_init_from`` (train.py's ``main``, and tests) gives every
``model.*`` key the user did not set on the command line the source's value; a key the user did set (directly,
``model.n_layers=4``, or through a preset, ``model=gpt-small``) that contradicts the source stops the run with one
line naming the keys, on every rank before any collective. ``check_init_from`` makes ``train.run`` refuse a config
that still contradicts its source.

Each rank reads only its own shard (``load_init_weights``, called by trident/build.py right after the model is
initialised, before the ZeRO optimizer copies its fp32 masters): from a trident checkpoint through DCP, which reads
only the boxes a rank asks for; from a Hugging Face directory through safetensors slices of the rows and columns of
its placement (trident/checkpoint/hf.py's ``read_box``).

When ``checkpoint.resume`` finds a checkpoint of this run, resuming wins: a restarted run continues from its own
checkpoint and the source is neither read for weights nor needed (the shape is taken from that checkpoint).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import nn

from trident.checkpoint import integrity
from trident.checkpoint.files import find_resume_path, read_head, saved_model_config
from trident.checkpoint.hf import check_parts, read_box, sources
from trident.checkpoint.hf_dir import HFDir, is_hf_dir
from trident.checkpoint.sharded import Sharded
from trident.checkpoint.state import BUFFERS, MODEL, named_parameters
from trident.config import MOE_FIXED, SHAPE_KEYS, Config, ModelConfig, MoEConfig
from trident.errors import CheckpointError, ConfigError
from trident.models.gpt import GPT
from trident.models.moe import balancing_state
from trident.parallel.agree import on_every_rank
from trident.parallel.placement import placement_of

T = TypeVar("T")

# The model.* keys a source fixes: every parameter shape, and the functions of the block.
_SCALING = ("rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_seq_len")
ADOPTED = (*SHAPE_KEYS, "norm_eps", "rope_theta", "rope_scaling", *_SCALING)
# The model.* keys a source carries without fixing any function: its context (kept when the run trains on shorter
# windows) and its token ids, which its export gives back. Taken from it unless the command line sets them.
CARRIED = ("max_seq_len", "bos_id", "eos_ids")


@dataclass
class InitSource:
    """Where a run's first weights come from: a trident checkpoint directory or a Hugging Face directory."""

    path: Path
    kind: str  # "trident" | "hf"
    model: dict  # the model.* values it fixes (a subset of ADOPTED), those it carries (CARRIED) and its name

    @property
    def what(self) -> str:
        return "Hugging Face model" if self.kind == "hf" else "trident checkpoint"


def open_source(path: str, what: str = "checkpoint.init_from") -> InitSource:
    """The source ``path`` names: a Hugging Face directory (a config.json, no meta.json), else a trident checkpoint
    or a directory of them (the newest). Reads only the small files."""
    where = Path(path).expanduser()
    if not where.exists():
        raise CheckpointError(f"{what}={path}: no such file or directory")
    if is_hf_dir(where):
        hf = HFDir(where)
        return InitSource(where, "hf", {"name": where.name, **hf.model})
    found = find_resume_path(str(where), where, what=what)
    _, config = read_head(found)
    model = saved_model_config(config, f"checkpoint {found}")
    saved = {**dataclasses.asdict(model), "max_seq_len": model.context_len, "moe": model.moe}
    return InitSource(found, "trident", {key: saved[key] for key in ("name", *ADOPTED, *CARRIED)})


def _effective(cfg: ModelConfig, key: str) -> object:
    """The value that matters: d_ff None is 4 * d_model, n_kv_heads None is n_heads, d_expert None is d_ff, and
    RoPE's scaling factors none without RoPE scaling. ``moe.KEY``: a key of model.moe."""
    if key.startswith("moe."):
        return cfg.expert_dim if key == "moe.d_expert" else getattr(cfg.moe, key[len("moe.") :])
    if key in _SCALING and cfg.rope_scaling is None:
        return None
    return {"d_ff": cfg.ffn_dim, "n_kv_heads": cfg.kv_heads}.get(key, getattr(cfg, key))


def _compared(keys: Iterable[str]) -> list[str]:
    """``keys`` with ``moe`` as the model.moe keys a source fixes (``MOE_FIXED``), each its own ``moe.KEY``."""
    return [k for key in keys for k in ([f"moe.{m}" for m in MOE_FIXED] if key == "moe" else [key])]


def conflicts(mine: ModelConfig, source: InitSource, keys: Iterable[str]) -> list[str]:
    """Those of ``keys`` (a model.moe key as ``moe.KEY``) whose value in ``mine`` contradicts the source. With RoPE,
    ``seq_len`` fixes no parameter: training on windows up to the source's is no contradiction."""
    theirs = dataclasses.replace(mine, **{k: v for k, v in source.model.items() if k != "name"})
    out = []
    for key in keys:
        if key.split(".")[0] not in source.model or key == "name":
            continue
        if key == "seq_len" and theirs.position == "rope" and mine.seq_len <= theirs.seq_len:
            continue
        if _effective(mine, key) != _effective(theirs, key):
            out.append(key)
    return out


def _refuse(cfg: ModelConfig, source: InitSource, keys: list[str], verb: str) -> None:
    source_cfg = dataclasses.replace(cfg, **{k: v for k, v in source.model.items() if k != "name"})
    theirs = ", ".join(f"model.{k}={_effective(source_cfg, k)}" for k in keys)
    mine = ", ".join(f"model.{k}={_effective(cfg, k)}" for k in keys)
    raise ConfigError(
        f"checkpoint.init_from={source.path} is a {source.what} with {theirs}; {verb} {mine}: leave "
        f"{'it' if len(keys) == 1 else 'them'} out to take its shape, or start from another model"
    )


def given_model_keys(overrides: Iterable[str], conf_dir: Path) -> set[str]:
    """The model.* keys a command line sets: ``model.KEY=...`` and every key of a preset ``model=NAME``; a key of
    model.moe as ``moe.KEY``."""
    given: set[str] = set()
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key == "model" and value:
            preset = conf_dir / "model" / f"{value}.yaml"
            if preset.is_file():
                loaded = OmegaConf.load(preset)
                given |= {str(k) for k in loaded.keys() if k != "moe"}
                given |= {f"moe.{k}" for k in (loaded.get("moe") or {}).keys()}
        elif key.startswith("model.moe."):
            given.add("moe." + key.split(".")[2])
        elif key.startswith("model."):
            given.add(key.split(".")[1])
    return given


def resume_checkpoint(cfg: Config, run_dir: Path) -> Path | None:
    """The checkpoint of this run that ``checkpoint.resume`` would continue from, if any (it wins over init_from)."""
    ck = cfg.checkpoint
    root = Path(ck.dir).expanduser() if ck.dir else run_dir / "checkpoints"
    if ck.resume == "none":
        return None
    try:
        return find_resume_path(ck.resume, root)
    except CheckpointError:
        return None  # the checkpointer says what is wrong with checkpoint.resume, in its place


def adopt_init_from(cfg: Config, overrides: Iterable[str], conf_dir: Path, run_dir: Path) -> Config:
    """``cfg`` with the model of checkpoint.init_from (or, when resuming, of this run's checkpoint): keys not in
    ``overrides`` (the command line) take the source's values; a given key that contradicts it raises
    ConfigError naming the keys."""
    if cfg.checkpoint.init_from is None:
        return cfg
    resumed = resume_checkpoint(cfg, run_dir)
    source = open_source(str(resumed) if resumed else cfg.checkpoint.init_from)
    given = given_model_keys(overrides, conf_dir)
    bad = conflicts(cfg.model, source, [k for k in _compared(ADOPTED) if k in given])
    if bad:
        _refuse(cfg.model, source, bad, "the command line sets")
    # Kept: a shorter RoPE window the user asked for (no contradiction, see ``conflicts``), a preset's name, what
    # the command line sets of the keys the source only carries, and the model.moe training knobs it sets.
    values = {k: v for k, v in source.model.items() if k not in given or k not in ("seq_len", "name", *CARRIED)}
    if "moe" in values:
        knobs = [f.name for f in dataclasses.fields(MoEConfig) if f"moe.{f.name}" in given and f.name not in MOE_FIXED]
        values["moe"] = dataclasses.replace(values["moe"], **{k: getattr(cfg.model.moe, k) for k in knobs})
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **values))


def check_init_from(cfg: Config, run_dir: Path) -> InitSource | None:
    """The source ``train.run`` loads its first weights from: None without checkpoint.init_from, or when
    checkpoint.resume finds a checkpoint of this run. Refuses a model config that contradicts it (one line, the
    keys named): ``adopt_init_from`` first makes the config agree. Reads only small files; no collective."""
    if cfg.checkpoint.init_from is None or resume_checkpoint(cfg, run_dir) is not None:
        return None
    source = open_source(cfg.checkpoint.init_from)
    bad = conflicts(cfg.model, source, _compared(ADOPTED))
    if bad:
        _refuse(cfg.model, source, bad, "this run's config has")
    return source


# --- loading ------------------------------------------------------------------------------------------------


def load_init_weights(chunks: list[GPT], source: InitSource) -> None:
    """Fill this rank's parameters (its blocks of the logical tensors, padding left zero) from ``source``. Every
    rank calls it (a trident source is read collectively); a failure on any rank is raised on every rank."""
    params = named_parameters(chunks)
    if source.kind == "hf":  # Hugging Face models have no balancing bias: it stays zero
        _agreed(lambda: _load_hf(params, chunks[0].cfg, source.path), f"read {source.path}")
    else:
        from trident.checkpoint.dcp import read_sharded  # DCP is imported by a load only (sharded.py says why)

        buffers = balancing_state(chunks)
        # Every rank verifies its share of the files (integrity.py); a damaged one stops them all, before any read.
        if not integrity.verify_everywhere(source.path) and (not dist.is_initialized() or dist.get_rank() == 0):
            print(integrity.UNRECORDED.format(path=source.path), flush=True)
        state, metadata = _agreed(
            lambda: _trident_boxes(params, buffers, source.path), f"read checkpoint {source.path}"
        )
        read_sharded(state, source.path, metadata)


def _agreed(fn: Callable[[], T], what: str) -> T:
    return on_every_rank(fn, what) if dist.is_initialized() else fn()


def _trident_boxes(
    params: dict[str, nn.Parameter], buffers: dict[str, torch.Tensor], path: Path
) -> tuple[dict[str, Sharded], object]:
    """This rank's boxes of each model tensor (a tied copy reads the tensor it copies), checked against the
    checkpoint's index, and the buffers it saved (the loss-free balancing biases: every rank reads them whole; a
    checkpoint without one leaves it zero)."""
    from trident.checkpoint.dcp import read_metadata

    metadata = read_metadata(path)
    state: dict[str, Sharded] = {}
    for name, buffer in buffers.items():
        entry = metadata.state_dict_metadata.get(BUFFERS + name)
        if entry is None:
            continue
        if tuple(entry.size) != tuple(buffer.shape):
            raise CheckpointError(
                f"checkpoint {path} holds {name} with shape {list(entry.size)}; this model's is {list(buffer.shape)}"
            )
        state[BUFFERS + name] = Sharded.whole(buffer)
    for name, param in params.items():
        placement = placement_of(param)
        tensor = placement.tied_to or name
        key = MODEL + tensor
        entry = metadata.state_dict_metadata.get(key)
        if entry is None or tuple(entry.size) != placement.shape:
            held = f"holds {tensor} with shape {list(entry.size)}" if entry else f"holds no {tensor}"
            raise CheckpointError(f"checkpoint {path} {held}; this model's is {list(placement.shape)}")
        boxes = Sharded.of(param.data, placement)
        if key in state:
            state[key].boxes.extend(boxes.boxes)
        else:
            state[key] = boxes
    return state, metadata


@torch.no_grad()
def _load_hf(params: dict[str, nn.Parameter], cfg: ModelConfig, path: Path) -> None:
    hf = HFDir(path)
    table = sources(cfg)
    with hf.slices() as slicer:
        for name, param in params.items():
            placement = placement_of(param)
            key = placement.tied_to or name
            source = table[key]
            check_parts(source, slicer, placement.shape, str(path))
            target = placement.real_part(param.data)
            if target.numel():
                target.copy_(read_box(source, slicer, placement.offsets, placement.chunk_sizes))
