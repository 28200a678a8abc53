"""train.py's config as the tools take it: a command line's overrides composed from conf/ and checked the way
train.py checks them, and the world size a launch of it has when the tool is not told one.

The tools (tools/estimate_memory.py, plot_schedule.py, plan.py) and the benchmark and planner trials read their
configs here, so a key or value train.py refuses is refused by each of them with the same one line.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from trident.config import Config, compose_config
from trident.config.compose import hydra_error_line
from trident.data.vocab import adopt_data_vocab
from trident.errors import ConfigError


def load_config(conf_dir: Path | str, overrides: Iterable[str] = ()) -> Config:
    """train.py's config of ``overrides``; raises ConfigError with one line for a value train.py refuses and for
    a key or value Hydra refuses (an unknown key, a value of the wrong type, an unknown config group option)."""
    overrides = list(overrides)
    try:
        cfg = compose_config(conf_dir, overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(hydra_error_line(e)) from None
    return adopt_data_vocab(cfg, overrides)[0]  # model.vocab_size left out: the data's tokenizer's, as train.py


def default_world(cfg: Config) -> int:
    """The world size ``cfg`` asks for: parallel.dp x cp x tp x pp, dp 1 when left out (to the world)."""
    return (cfg.parallel.dp or 1) * cfg.parallel.cp * cfg.parallel.tp * cfg.parallel.pp
