"""The chat format of a vision-language policy: the processor's chat template and image tokens.

Messages carry images as content parts (`{"type": "image", "image": <PIL image>}` before the
text). The template renders each as the processor's `<image>` placeholder; the processor then
expands every placeholder into the model's image tokens (for Idefics3: the image wrapped in its
fake tokens, `image_seq_len` image tokens a tile) and makes the tiles' pixel values, once. The
record keeps both (opentinker.core.trajectory.VisualInput), so sampling and the trainer's
recompute see the same tokens and the same pixels. Observation deltas are measured as in
ChatFormat, with the image parts in place. Outside text is text here too (ChatFormat.as_text): the
processor makes each image's expansion and pixels, the expansions replace the template's own
`<image>` placeholders only (transformers' `get_text_with_replacements` skips marked ones), and
the whole is encoded as ChatFormat encodes a render, so an `<image>` a game writes is words.
"""

from __future__ import annotations

from typing import Any

from opentinker.agent.chat import PLACEHOLDER, ChatFormat, Chunk
from opentinker.core.trajectory import VisualInput
from opentinker.env.observation import Observation


def _parts(content: Any) -> list[dict[str, Any]]:
    """A message's content as template parts (images reduced to their type: the template only places them)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [{"type": "image"} if part.get("type") == "image" else {"type": "text", "text": part.get("text", "")} for part in content]


def _images(messages: list[dict[str, Any]]) -> list[Any]:
    return [part["image"] for m in messages if not isinstance(m["content"], str) for part in m["content"] if part.get("type") == "image"]


class VisionChatFormat(ChatFormat):
    def __init__(self, tokenizer):
        self.processor = tokenizer.processor
        super().__init__(tokenizer)

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        parts = [{"role": m["role"], "content": _parts(m["content"])} for m in messages]
        return self.processor.apply_chat_template(parts, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str, images: list[Any], what: str) -> Chunk:
        """`text`: a render whose outside text went through `as_text`, with one `<image>` of the
        template's for each of `images`."""
        if not images:
            return Chunk(self.encode_rendered(text, what))
        placeholders = [self.processor.image_token * len(images)]
        out = self.processor(text=placeholders, images=[images], add_special_tokens=False, return_tensors="pt",
                             return_text_replacement_offsets=True)
        replacements = [r["replacement"] for r in out["text_replacement_offsets"][0]]
        (expanded,), _ = self.processor.get_text_with_replacements([text], images_replacements=replacements)
        visual = VisualInput(images=list(images), pixel_values=out["pixel_values"][0], pixel_mask=out["pixel_attention_mask"][0])
        return Chunk(self.encode_rendered(expanded, what), visual)

    def encode_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> Chunk:
        if tools:
            raise ValueError("declared tools are not taken by a vision-language policy yet: play its tools as observations")
        return self._encode(self._render(self.as_text(messages), add_generation_prompt=True), _images(messages), "the prompt")

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode_prompt(messages).ids

    def encode_observation(self, observation: str | Observation, policy_stopped: bool) -> Chunk:
        if isinstance(observation, str) or not observation.images:
            return super().encode_observation(observation, policy_stopped)
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": PLACEHOLDER}]
        closed = self._render(base)
        content = [{"type": "image"}] * len(observation.images) + [{"type": "text", "text": PLACEHOLDER}]
        opened = self._render(base + [{"role": "user", "content": content}], add_generation_prompt=True)
        prefix, suffix = opened[len(closed):].split(PLACEHOLDER)
        text = self._closing(policy_stopped) + prefix + self.as_text(observation.text) + suffix
        return self._encode(text, observation.images, "the observation")


def chat_format(tokenizer: Any) -> ChatFormat:
    """The chat format of a model: a VLM's tokenizer carries its processor (see opentinker.model.vision)."""
    if getattr(tokenizer, "processor", None) is not None:
        return VisionChatFormat(tokenizer)
    return ChatFormat(tokenizer)
