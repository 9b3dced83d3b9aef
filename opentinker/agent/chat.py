"""Chat-template arithmetic: the prompt once, then each observation as a token delta.

Earlier turns are never re-rendered from text: a new observation is rendered by the model's own
chat template as the difference between "conversation + user message" and "conversation",
measured once on a placeholder conversation, and appended after the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from opentinker.core.trajectory import VisualInput
from opentinker.env.observation import Observation
from opentinker.tools.declared import ToolResult
from opentinker.tools.formats import ToolFormat

PLACEHOLDER = "\u2063OPENTINKERPLACEHOLDER\u2063"


@dataclass
class Chunk:
    """Tokens to append to a record, and the images they show (None: text only)."""

    ids: list[int]
    visual: VisualInput | None = None


def no_images(what: str) -> ValueError:
    return ValueError(f"{what} has images, and the policy's model is a language model: it takes no images")


class ChatFormat:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token or ""
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": PLACEHOLDER}]
        closed = self._render(base)
        self._after_assistant = closed[closed.index(PLACEHOLDER) + len(PLACEHOLDER) :]
        # What the template writes after the end-of-turn token (e.g. "\n"): appended when the
        # policy itself stopped with that token.
        self._after_eos = self._after_assistant[len(eos) :] if eos and self._after_assistant.startswith(eos) else None
        opened = self._render(base + [{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=True)
        user_part = opened[len(closed) :]
        self._user_prefix, self._user_suffix = user_part.split(PLACEHOLDER)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    @cached_property
    def tools(self) -> ToolFormat:
        """How this policy reads tools and writes calls (its template's format, or the hermes default)."""
        return ToolFormat(self.tokenizer)

    @cached_property
    def max_token_chars(self) -> int | None:
        """The most characters one token of the vocabulary stands for (its longest entry; byte-level
        entries count a character per byte): a text of n characters is at least n / this many tokens."""
        vocab = getattr(self.tokenizer, "get_vocab", None)
        longest = max((len(entry) for entry in vocab()), default=0) if vocab is not None else 0
        return longest or None

    def min_tokens(self, chars: int) -> int:
        """A lower bound on the tokens of a text of `chars` characters, without encoding it (0 when
        the vocabulary is not known): a text too long for an episode is refused before it is tokenized."""
        return -(-chars // self.max_token_chars) if self.max_token_chars else 0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation so far, rendered once, ending with the assistant's generation prompt."""
        return self.encode(self._render(messages, add_generation_prompt=True))

    def observation_ids(self, observation: str, policy_stopped: bool) -> list[int]:
        """Tokens that close the assistant turn (if the policy did not), add a user message
        with the observation, and open the next assistant turn."""
        if policy_stopped and self._after_eos is not None:
            closing = self._after_eos
        else:
            closing = self._after_assistant
        return self.encode(closing + self._user_prefix + observation + self._user_suffix)

    def tool_results_ids(self, results: list[ToolResult], policy_stopped: bool) -> list[int]:
        """Tokens that close the assistant turn (if the policy did not), add the turn's tool results
        as the template renders `tool` messages, and open the next assistant turn: the difference the
        results make to a placeholder conversation, so earlier tokens are never re-rendered."""
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": PLACEHOLDER}]
        closed = self.tools.render(base, None, add_generation_prompt=False)
        opened = self.tools.render(base + tool_messages(results), None, add_generation_prompt=True)
        if not opened.startswith(closed):
            raise ValueError("the chat template re-renders earlier turns when tool results follow; it cannot be trained turn by turn")
        closing = self._after_eos if policy_stopped and self._after_eos is not None else closed[closed.index(PLACEHOLDER) + len(PLACEHOLDER):]
        return self.encode(closing + opened[len(closed):])

    # --- chunks: what the agent loop appends (a VLM's format adds images, see vision_chat.py) ---
    def encode_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Chunk:
        if any(not isinstance(m.get("content"), str) for m in messages):
            raise no_images("the first observation")
        if tools:
            return Chunk(self.encode(self.tools.render(messages, tools, add_generation_prompt=True)))
        return Chunk(self.prompt_ids(messages))

    def encode_observation(self, observation: str | Observation, policy_stopped: bool) -> Chunk:
        if isinstance(observation, Observation):
            if observation.images:
                raise no_images("the observation")
            observation = observation.text
        return Chunk(self.observation_ids(observation, policy_stopped))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def tool_messages(results: list[ToolResult]) -> list[dict[str, Any]]:
    """The `tool` messages of a turn's results, as chat templates and the OpenAI API take them."""
    return [{"role": "tool", "content": r.content, "name": r.name, "tool_call_id": r.call_id} for r in results]
