"""Vision-language models (the Idefics3 / SmolVLM family): loading, and the VLMs that run here.

No pretrained vision weights can be downloaded on this machine, so two VLMs are assembled from a
config: `smolvlm-135m-tiny-vision` is SmolLM2-135M-Instruct's real language weights and tokenizer
(with Idefics3's image tokens added) under a small randomly initialised SigLIP-style vision
encoder and connector; `tiny-vlm-random` is the same around the tiny random language model, for
tests. A real VLM folder (e.g. SmolVLM on a GPU cluster) loads through the same `load_vision`.

The processor is the model's own (image processor, image-token expansion, chat template); the
tokenizer the runtime passes around carries it as `tokenizer.processor`, so text-only code paths
keep working and vision-aware ones (opentinker.agent.vision_chat) find it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VISION_MODEL_TYPES = ("idefics3", "smolvlm")
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>"]

# ChatML (SmolLM2's format) that renders image parts as the processor's `<image>` placeholder.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The small vision side: 128-pixel images in 16-pixel patches, 2x2 pixel shuffle: 16 tokens an image.
VISION = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4, image_size=128, patch_size=16)
SCALE_FACTOR = 2


def is_vision_folder(path: Path) -> bool:
    """Does the model folder hold a vision-language model (by its config's model_type)?"""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("model_type") in VISION_MODEL_TYPES or "vision_config" in config


def is_vision_model(model: Any) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in VISION_MODEL_TYPES


def assemble(target: Path, text_folder: Path, seed: int = 0) -> None:
    """Write a VLM into `target`: the language model of `text_folder` (weights and tokenizer, the
    image tokens added, their embeddings drawn around the old ones' mean), a random vision
    encoder and connector, and an Idefics3 processor (no image splitting: one 128-pixel tile an
    image) with a ChatML template that takes image parts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(text_folder)
    tokenizer.add_tokens(IMAGE_TOKENS, special_tokens=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        text = AutoModelForCausalLM.from_pretrained(text_folder, dtype=torch.float32)
        text.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        text_config = text.config.to_dict() | {"vocab_size": len(tokenizer)}
        config = Idefics3Config(text_config=text_config, vision_config=dict(VISION), scale_factor=SCALE_FACTOR,
                                image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                                tie_word_embeddings=text.config.tie_word_embeddings, pad_token_id=tokenizer.pad_token_id)
        model = Idefics3ForConditionalGeneration(config)
    model.model.text_model.load_state_dict(text.model.state_dict(), strict=True)
    if text.config.tie_word_embeddings:
        model.tie_weights()
    else:
        model.lm_head.load_state_dict(text.lm_head.state_dict())
    model.generation_config.eos_token_id = text.generation_config.eos_token_id
    size = VISION["image_size"]
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": size}, max_image_size={"longest_edge": size})
    seq_len = (size // VISION["patch_size"]) ** 2 // SCALE_FACTOR**2
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=seq_len, chat_template=CHAT_TEMPLATE)
    model.save_pretrained(target)
    processor.save_pretrained(target)


def load_vision(path: Path, dtype: Any):
    """(model, tokenizer) of a VLM folder; the tokenizer carries the processor (`.processor`)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    processor = AutoProcessor.from_pretrained(path)
    tokenizer = processor.tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.processor = processor
    model.eval()
    return model, tokenizer


def language_modules(model: Any, names: list[str] | tuple[str, ...]) -> str | list[str]:
    """LoRA targets: `names` as they are for a language model; for a VLM, a pattern that keeps
    them to its language model (the vision encoder has q_proj/k_proj/v_proj too)."""
    if not is_vision_model(model):
        return list(names)
    return rf"^(.*\.)?text_model\..*\.({'|'.join(names)})$"


def encoder_parameters(model: Any) -> list[Any]:
    """The vision encoder's parameters (empty for a language model)."""
    return list(model.model.vision_model.parameters()) if is_vision_model(model) else []


def connector_parameters(model: Any) -> list[Any]:
    """The connector's parameters (the projection of image features into the language model)."""
    return list(model.model.connector.parameters()) if is_vision_model(model) else []


def hidden_states(lm: Any, input_ids: Any, attention_mask: Any, pixel_values: Any = None, pixel_attention_mask: Any = None) -> Any:
    """Last hidden states of a causal LM or a VLM (images merged at their tokens)."""
    if is_vision_model(lm):
        out = lm.model(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixel_values,
                       pixel_attention_mask=pixel_attention_mask, use_cache=False)
        return out.last_hidden_state
    return lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def pixel_batch(rows: list[list[Any]], device: Any) -> dict[str, Any]:
    """A batch's pixel inputs from each row's VisualInputs (opentinker.core.trajectory): tiles in
    record order, rows padded with all-zero tiles (which Idefics3 drops) and pixel masks of 0."""
    import torch

    tiles = [[v.pixel_values for v in row] for row in rows]
    masks = [[v.pixel_mask for v in row] for row in rows]
    stacked = [torch.cat(t) if t else None for t in tiles]
    stacked_masks = [torch.cat(m) if m else None for m in masks]
    present = [t for t in stacked if t is not None]
    n = max(t.shape[0] for t in present)
    channels = present[0].shape[1]
    height, width = max(t.shape[2] for t in present), max(t.shape[3] for t in present)
    values = torch.zeros((len(rows), n, channels, height, width), dtype=present[0].dtype)
    mask = torch.zeros((len(rows), n, height, width), dtype=torch.long)
    for i, (t, m) in enumerate(zip(stacked, stacked_masks)):
        if t is not None:
            values[i, : t.shape[0], :, : t.shape[2], : t.shape[3]] = t
            mask[i, : m.shape[0], : m.shape[1], : m.shape[2]] = m
    return {"pixel_values": values.to(device), "pixel_attention_mask": mask.to(device)}
