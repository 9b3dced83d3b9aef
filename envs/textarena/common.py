"""What the TextArena game and match share: the config check, the task draw, the system prompt."""

from __future__ import annotations

from typing import Any

from envs.textarena.registry import config_refusal, installed_refusal, refusal


def check_env(env_id: Any, players: int | None) -> None:
    """ValueError with the one-line reason when `env_id` cannot be played here."""
    reason = refusal(env_id, players) or installed_refusal()
    if reason:
        raise ValueError(reason)


def check_env_config(config: dict[str, Any] | None, players: int | None) -> None:
    """The spec's `env.config` checked before anything runs (its `env_id`)."""
    reason = config_refusal(config, players)
    if reason:
        raise ValueError(reason)


def draw_seed(rng: Any) -> int:
    return int(rng.integers(2**31 - 1))


def system_prompt() -> str:
    """TextArena's own system prompt for its agents; the game's rules come as its first message."""
    from textarena.agents.basic_agents import STANDARD_GAME_PROMPT

    return STANDARD_GAME_PROMPT


def outcome(result: int) -> str:
    return {1: "win", -1: "loss", 0: "draw"}[result]
