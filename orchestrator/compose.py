"""A config composed from conf/ as `python -m orchestrator ...` composes it, without the CLI.

For code that runs jobs in process (the tests, the benchmarks): the same config tree, schema and
overrides as `@hydra.main` in `__main__`, and Hydra's global state cleared before and after, so
one composition never sees another's (or the CLI's) initialization.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from .schema import Config, register_configs, to_config

CONF = Path(__file__).resolve().parents[1] / "conf"  # what `@hydra.main(config_path="../conf")` reads


def compose_dict(overrides: Sequence[str]) -> DictConfig:
    """conf/config.yaml with `overrides` (Hydra's syntax), not validated: `to_config` does that."""
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("config", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def compose_config(overrides: Sequence[str]) -> Config:
    """The validated config of `overrides`; raises ConfigError naming the bad field."""
    return to_config(compose_dict(overrides))
