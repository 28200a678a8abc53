"""Hydra's side of the config: the schema registered with the ConfigStore, Hydra's tree converted to the typed
``Config`` once (unknown keys refused), and composing the YAML under a checkout's ``conf/`` for tools and tests.
The default run directory's name is trident/launcher.py's ``launch_id``, which the YAML reads as ``${launch_id:}``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import re
from collections.abc import Iterable
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException
from omegaconf.nodes import BooleanNode

from trident.config.schema import RENAMED, Config
from trident.errors import ConfigError, one_line
from trident.launcher import launch_id


@functools.cache
def register_configs() -> None:
    """Register the schema (so conf/config.yaml can name it) and the resolvers the YAML uses: once a process (the
    schema is this module's ``Config``; building its node costs a quarter of a composition)."""
    cs = ConfigStore.instance()
    schema = OmegaConf.structured(Config)
    for section, key, name in RENAMED:
        # The key users type, as a typed node beside the field (a bad value is refused like any other key's).
        with open_dict(schema[section]):
            schema[section][key] = BooleanNode(getattr(getattr(Config(), section), name))
    cs.store(name="trident_schema", node=schema)
    if not OmegaConf.has_resolver("launch_id"):
        OmegaConf.register_new_resolver("launch_id", launch_id)


def schema_keys() -> list[str]:
    """Every key a user can set, dotted (``parallel.tp``), sections too (``parallel.offload``), as typed: a
    renamed field by the name users type (``checkpoint.async``)."""
    typed = {(section, name): key for section, key, name in RENAMED}

    def walk(schema: object, prefix: str) -> list[str]:
        out = []
        for f in dataclasses.fields(schema):  # type: ignore[arg-type]
            name = typed.get((prefix.rstrip("."), f.name), f.name)
            out.append(prefix + name)
            if dataclasses.is_dataclass(value := getattr(schema, f.name)):
                out += walk(value, f"{prefix}{name}.")
        return out

    return walk(Config(), "")


def unknown_key_line(key: str) -> str:
    """One line for a key the schema does not have, naming the nearest that it has (difflib): a typo is told
    its fix, whether typed as ``parallel.tpp=2`` or ``+parallel.tpp=2``."""
    keys = schema_keys()
    scored = sorted(((difflib.SequenceMatcher(None, key, k).ratio(), k) for k in keys), key=lambda t: -t[0])
    best = [k for score, k in scored if score >= max(0.6, scored[0][0] - 1e-9)][:3]
    where = "the valid keys are in trident/config/schema.py"
    return f"unknown config key {key}; " + (f"did you mean {' or '.join(best)}? ({where})" if best else where)


def hydra_error_line(error: Exception) -> str:
    """One line for an error Hydra or OmegaConf raised while composing the config: an override of a key the
    schema does not have gets ``unknown_key_line`` (Hydra's own advice, to append ``+key``, would only be refused
    in turn), anything else Hydra's message folded into one line, with the first line of its cause."""
    cause = error.__cause__
    override = re.match(r"Could not override '([^']+)'", str(error))
    if override and isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and " not in " in str(cause):
        return unknown_key_line(override.group(1))
    detail = f"\n{str(cause).splitlines()[0]}" if isinstance(cause, OmegaConfBaseException) else ""
    # Hydra appends its search path to a missing-preset message: noise for the user.
    return one_line(str(error).split("Config search path:")[0] + detail)


def to_config(node: DictConfig) -> Config:
    """Convert Hydra's tree to the typed ``Config``, refusing keys the schema does not have.

    Plain overrides of unknown keys are already refused by Hydra; ``+key=value`` appends would slip
    through and be silently ignored, so they are caught here.
    """

    def check(sub: DictConfig, schema: object, prefix: str) -> None:
        for key in sub.keys():
            if not hasattr(schema, str(key)):
                value = sub[key]
                while isinstance(value, DictConfig) and len(value) == 1:  # +paralel.tp=2: the key as typed
                    (inner,) = value.keys()
                    key, value = f"{key}.{inner}", value[inner]
                raise ConfigError(unknown_key_line(f"{prefix}{key}"))
            default = getattr(schema, str(key))
            if dataclasses.is_dataclass(default):
                check(sub[key], default, f"{prefix}{key}.")

    for section, key, name in RENAMED:
        if section in node and key in node[section]:
            if node[section][name] != getattr(getattr(Config(), section), name):
                raise ConfigError(f"unknown config key {section}.{name}; the key is {section}.{key}")
            with open_dict(node[section]):
                node[section][name] = node[section].pop(key)
    check(node, Config(), "")
    return OmegaConf.to_object(node)


def compose_config(conf_dir: Path | str, overrides: Iterable[str] = ()) -> Config:
    """The typed config ``train.py`` builds from ``overrides``, composed from the YAML under ``conf_dir`` (a
    checkout's conf/), for the tests and tools that start runs as a user would.

    A composition costs about a third of a second of Python (Hydra's defaults tree and OmegaConf's merges), and
    tools and tests compose the same overrides again (the fuzzer checks a layout, then trains it): the last
    ``_COMPOSED_MAX`` results are kept, keyed by the overrides and every YAML file's path, size and mtime, so an
    edited conf/ composes afresh. Each caller gets its own copy."""
    conf = Path(conf_dir).resolve()
    overrides = list(overrides)
    key = (str(conf), tuple(overrides), _conf_stamp(conf))
    if key not in _COMPOSED:
        _COMPOSED[key] = _compose(conf, overrides)
        while len(_COMPOSED) > _COMPOSED_MAX:
            _COMPOSED.pop(next(iter(_COMPOSED)))
    return copy.deepcopy(_COMPOSED[key])


_COMPOSED: dict[tuple, Config] = {}
_COMPOSED_MAX = 256


def _conf_stamp(conf: Path) -> tuple:
    return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(conf.rglob("*.yaml")))


def _compose(conf: Path, overrides: list[str]) -> Config:
    from hydra import compose, initialize_config_dir  # here: only the tools and tests compose outside train.py

    register_configs()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        return to_config(compose("config", overrides=overrides))
