"""What users hand the clients as a job config (a spec, a dict, a YAML path, argparse or omegaconf
args), turned into the plain dict the gateway validates."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def config_to_dict(config: Any) -> dict[str, Any]:
    from pydantic import BaseModel

    if isinstance(config, BaseModel):  # JobSpec, SFTSpec
        return config.model_dump(mode="json", exclude_none=True)
    if isinstance(config, (str, Path)):  # read as `opentinker validate` reads it: bounded, one line if refused
        from opentinker.core.spec_limits import SpecError, read_spec_file

        data = read_spec_file(config)
        if not isinstance(data, dict):
            raise SpecError(f"{config}: expected a mapping of spec sections, got {type(data).__name__}")
        return dict(data)
    if isinstance(config, dict):
        return dict(config)
    try:  # omegaconf DictConfig, as in the reference design's scripts
        from omegaconf import OmegaConf

        if OmegaConf.is_config(config):
            return dict(OmegaConf.to_container(config, resolve=True))
    except ImportError:
        pass
    if hasattr(config, "__dict__"):
        return {k: v for k, v in vars(config).items() if not k.startswith("_")}
    raise TypeError(f"config must be a JobSpec, a dict, a YAML path or an args object, not {type(config).__name__}")


def env_config_of(config: Any) -> dict[str, Any]:
    """The environment's data-source config inside a job config: `env.config` or `env_config`."""
    if config is None:
        return {}
    data = config_to_dict(config)
    env = data.get("env") or {}
    return dict(env.get("config") or data.get("env_config") or {})
