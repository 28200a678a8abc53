"""Hydra's side of the config: the schema registered with the ConfigStore, Hydra's tree converted to the typed
``Config`` once (unknown keys refused), composing the YAML under a checkout's ``conf/`` for tools and tests, and the
default run directory's name.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.nodes import BooleanNode

from trident.config.schema import RENAMED, Config
from trident.errors import ConfigError
from trident.launcher import launcher


def launch_id() -> str:
    """The default run directory's name, ``YYYY-MM-DD/HH-MM-SS-<launcher pid>``.

    Every local rank of one torchrun job computes the same name (the same launcher), and train.py hands rank 0's
    to the other nodes. Two jobs started in the same second have different launchers, so different names.
    """
    pid, stamp = launcher()
    return datetime.datetime.fromtimestamp(stamp).strftime(f"%Y-%m-%d/%H-%M-%S-{pid}")


def register_configs() -> None:
    """Register the schema (so conf/config.yaml can name it) and the resolvers the YAML uses."""
    cs = ConfigStore.instance()
    schema = OmegaConf.structured(Config)
    for section, key, name in RENAMED:
        # The key users type, as a typed node beside the field (a bad value is refused like any other key's).
        with open_dict(schema[section]):
            schema[section][key] = BooleanNode(getattr(getattr(Config(), section), name))
    cs.store(name="trident_schema", node=schema)
    if not OmegaConf.has_resolver("launch_id"):
        OmegaConf.register_new_resolver("launch_id", launch_id)


def to_config(node: DictConfig) -> Config:
    """Convert Hydra's tree to the typed ``Config``, refusing keys the schema does not have.

    Plain overrides of unknown keys are already refused by Hydra; ``+key=value`` appends would slip
    through and be silently ignored, so they are caught here.
    """

    def check(sub: DictConfig, schema: object, prefix: str) -> None:
        for key in sub.keys():
            if not hasattr(schema, str(key)):
                raise ConfigError(f"unknown config key {prefix}{key}; the valid keys are in trident/config/schema.py")
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
    checkout's conf/), for the tests and tools that start runs as a user would."""
    from hydra import compose, initialize_config_dir  # here: only the tools and tests compose outside train.py

    register_configs()
    with initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base="1.3"):
        return to_config(compose("config", overrides=list(overrides)))
