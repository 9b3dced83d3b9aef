"""The conversation a game opens with, as chat messages (no tokens).

One definition for training, evaluation and inference: the agent loop tokenizes these messages
once, and `run_inference` sends the same messages to an OpenAI-compatible server, so a served
model sees the prompt its training evaluation saw.
"""

from __future__ import annotations

from typing import Any

from opentinker.env.base import AbstractGame
from opentinker.env.observation import Observation


def user_content(text: str, images: list[Any]) -> str | list[dict[str, Any]]:
    """A user message's content: the text, or image parts (PIL images) before a text part."""
    if not images:
        return text
    return [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": text}]


def initial_messages(game: AbstractGame, observation: str | Observation) -> list[dict[str, Any]]:
    """System prompt, few-shot turns, then the initial user message joined with the first
    observation (its images, if any, shown first)."""
    messages: list[dict[str, Any]] = []
    system = game.get_system_prompt()
    if system:
        messages.append({"role": "system", "content": system})
    messages.extend(game.get_example_turns())
    text, images = (observation, []) if isinstance(observation, str) else (observation.text, observation.images)
    first = "\n\n".join(x for x in (game.get_initial_user_message(), text) if x)
    messages.append({"role": "user", "content": user_content(first, images)})
    return messages
