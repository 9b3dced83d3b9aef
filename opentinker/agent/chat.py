"""Chat-template arithmetic: the prompt once, then each observation as a token delta.

Earlier turns are never re-rendered from text: a new observation is rendered by the model's own
chat template as the difference between "conversation + user message" and "conversation",
measured once on a placeholder conversation, and appended after the sampled tokens.

Text from outside (a game's prompt, observations and examples, a tool's answer, a tool's schema)
is text: a `<|im_end|>` in it becomes ordinary tokens, never the control token, so it cannot close
a turn or forge one. Its control tokens (every added token of the tokenizer, special or not) are
marked before the template renders it and encoded as plain text after (transformers'
`mark_control_tokens` / `encode_marked_chat`, what `apply_chat_template(sanitize_control_tokens=True)`
does in one piece); the template's own control tokens are encoded as they always were.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from transformers.utils.chat_template_utils import encode_marked_chat, mark_control_tokens

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

    @cached_property
    def _control_tokens(self) -> re.Pattern:
        """Every added token of the tokenizer but the whitespace ones (templates and text share those), longest first."""
        tokens = sorted((t for t in self.tokenizer.added_tokens_encoder if t.strip()), key=len, reverse=True)
        return re.compile("|".join(map(re.escape, tokens)) or "(?!)")

    def as_text(self, value: Any) -> Any:
        """Outside text (a string, or the strings in messages, tools): its control tokens marked to be encoded as text."""
        return mark_control_tokens(value, self._control_tokens)

    def encode_rendered(self, rendered: str, what: str) -> list[int]:
        """A render whose outside text went through `as_text`: the template's control tokens as
        tokens, the outside text's as text. ValueError for text the tokenizer cannot take."""
        try:
            rendered.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"{what} is not text: a lone surrogate ({rendered[err.start]!r}) in it") from None
        return encode_marked_chat(self.tokenizer, rendered)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The conversation so far, rendered once, ending with the assistant's generation prompt."""
        return self.encode_rendered(self._render(self.as_text(messages), add_generation_prompt=True), "the prompt")

    def _closing(self, policy_stopped: bool) -> str:
        """What closes the assistant turn: the template's tail after the end-of-turn token the policy
        stopped with, else the whole tail."""
        return self._after_eos if policy_stopped and self._after_eos is not None else self._after_assistant

    def observation_ids(self, observation: str, policy_stopped: bool) -> list[int]:
        """Tokens that close the assistant turn (if the policy did not), add a user message
        with the observation, and open the next assistant turn."""
        text = self._closing(policy_stopped) + self._user_prefix + self.as_text(observation) + self._user_suffix
        return self.encode_rendered(text, "the observation")

    def tool_results_ids(self, results: list[ToolResult], policy_stopped: bool) -> list[int]:
        """Tokens that close the assistant turn (if the policy did not), add the turn's tool results
        as the template renders `tool` messages, and open the next assistant turn: the difference the
        results make to a placeholder conversation, so earlier tokens are never re-rendered."""
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": PLACEHOLDER}]
        closed = self.tools.render(base, None, add_generation_prompt=False)
        opened = self.tools.render(base + self.as_text(tool_messages(results)), None, add_generation_prompt=True)
        if not opened.startswith(closed):
            raise ValueError("the chat template re-renders earlier turns when tool results follow; it cannot be trained turn by turn")
        closing = self._after_eos if policy_stopped and self._after_eos is not None else closed[closed.index(PLACEHOLDER) + len(PLACEHOLDER):]
        return self.encode_rendered(closing + opened[len(closed):], "a tool's answer")

    # --- chunks: what the agent loop appends (a VLM's format adds images, see vision_chat.py) ---
    def encode_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Chunk:
        if any(not isinstance(m.get("content"), str) for m in messages):
            raise no_images("the first observation")
        if tools:
            rendered = self.tools.render(self.as_text(messages), self.as_text(tools), add_generation_prompt=True)
            return Chunk(self.encode_rendered(rendered, "the prompt"))
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
