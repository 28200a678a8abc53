"""Typed configuration, in three parts:

    schema.py    one dataclass per concern (model, parallel, train, optim, data, checkpoint, logging, wandb)
    compose.py   Hydra: the schema registered, Hydra's tree converted to ``Config`` once, conf/ composed for tools
    validate.py  every rule, checked before any collective, and the resolved layout a valid config launches

``train.py`` converts the Hydra tree to ``Config`` once and passes the sections (and the layout ``validate``
returns) down. The names below are the package's public API, re-exported so callers import ``trident.config``.
"""

from trident.config.compose import compose_config, launch_id, register_configs, to_config
from trident.config.schema import (
    MOE_FIXED,
    SHAPE_KEYS,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    OffloadConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    WandbConfig,
    model_config_from_dict,
)
from trident.config.validate import grad_accum_steps, mix_entry, resolve_dp, validate

__all__ = [
    "MOE_FIXED",
    "SHAPE_KEYS",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "LoggingConfig",
    "ModelConfig",
    "MoEConfig",
    "OffloadConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "WandbConfig",
    "compose_config",
    "grad_accum_steps",
    "launch_id",
    "mix_entry",
    "model_config_from_dict",
    "register_configs",
    "resolve_dp",
    "to_config",
    "validate",
]
