"""The conversation a game opens with, as chat messages (text only, no tokens).

One definition for training, evaluation and inference: the agent loop tokenizes these messages
once, and `run_inference` sends the same messages to an OpenAI-compatible server, so a served
model sees the prompt its training evaluation saw.
"""

from __future__ import annotations

from opentinker.env.base import AbstractGame


def initial_messages(game: AbstractGame, observation: str) -> list[dict[str, str]]:
    """System prompt, few-shot turns, then the initial user message joined with the first observation."""
    messages = []
    system = game.get_system_prompt()
    if system:
        messages.append({"role": "system", "content": system})
    messages.extend(game.get_example_turns())
    first = "\n\n".join(x for x in (game.get_initial_user_message(), observation) if x)
    messages.append({"role": "user", "content": first})
    return messages
