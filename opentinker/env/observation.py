"""Observations with images, for vision-language policies.

A game's `reset` and `step` return text as before, or an `Observation`: text with images (PIL
images) shown before it. Text-only games are unchanged, and a text-only observation still
travels as a plain string.

Between hosts (an environment server, the client link) images travel as PNG in base64,
`{"text": ..., "images": [{"mime": "image/png", "data": ...}]}`, each capped in encoded bytes, in
pixels and in decoded bytes (from the header, before any pixel is decoded: a small PNG can claim a
huge 16-bit image), at most `MAX_IMAGES` and `MAX_OBSERVATION_BYTES` of pixels per observation.
Every image is stored as 8-bit RGB (16-bit samples scaled, not clipped), whatever it came as.
Anything else in `images`, an image over a cap or a payload that does not decode is a
ValueError/TypeError naming it: the episode that got it fails with that reason, the job goes on.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass, field
from typing import Any

MAX_IMAGES = 8
MAX_PIXELS = 2048 * 2048
MAX_IMAGE_BYTES = 8 * 1024 * 1024  # encoded PNG
MAX_DECODED_BYTES = 16 * 1024 * 1024  # one image's pixels in the mode it decodes to (2048² RGBA)
MAX_OBSERVATION_BYTES = 32 * 1024 * 1024  # all images of one observation, as stored (8-bit RGB)


@dataclass
class Observation:
    """What a game shows the policy: `images` (PIL images, in order) before `text`."""

    text: str = ""
    images: list[Any] = field(default_factory=list)


def _bytes_per_pixel(mode: str) -> int:
    """From PIL's own mode table (bands x the array type's size, `|u1`, `<u2`, `<i4`); 8 for a mode it does not know."""
    from PIL import ImageMode

    try:
        described = ImageMode.getmode(mode)
    except KeyError:
        return 8
    return int(described.typestr[2:]) * len(described.bands)


def _check_image(image: Any, where: str) -> Any:
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise TypeError(f"{where} is {type(image).__name__}, expected a PIL image")
    width, height = image.size
    if width < 1 or height < 1 or width * height > MAX_PIXELS:
        raise ValueError(f"{where} is {width}x{height} pixels (at most {MAX_PIXELS:,} pixels)")
    decoded = width * height * _bytes_per_pixel(image.mode)
    if decoded > MAX_DECODED_BYTES:
        raise ValueError(f"{where} is {width}x{height} {image.mode}: {decoded:,} bytes decoded (at most {MAX_DECODED_BYTES:,})")
    return image


def _rgb(image: Any) -> Any:
    """8-bit RGB: 16-bit grey scaled to 8 bits (PIL's own conversion would clip it), alpha dropped."""
    if image.mode == "RGB":
        return image
    if image.mode.startswith("I;16"):
        image = image.convert("I").point(lambda v: v / 257).convert("L")
    return image.convert("RGB")


def _checked_total(images: list[Any], what: str) -> list[Any]:
    total = sum(img.size[0] * img.size[1] * 3 for img in images)
    if total > MAX_OBSERVATION_BYTES:
        raise ValueError(f"{what}: its images hold {total:,} bytes as RGB (at most {MAX_OBSERVATION_BYTES:,} an observation)")
    return images


def as_observation(value: Any, what: str = "observation") -> Observation:
    """An Observation from what a game returned (text, or an Observation whose images are
    checked); TypeError/ValueError naming what is wrong."""
    if isinstance(value, str):
        return Observation(value)
    if not isinstance(value, Observation):
        raise TypeError(f"{what} is {type(value).__name__}, expected str or Observation")
    if not isinstance(value.text, str):
        raise TypeError(f"{what}.text is {type(value.text).__name__}, expected str")
    images = list(value.images or [])
    if len(images) > MAX_IMAGES:
        raise ValueError(f"{what} has {len(images)} images (at most {MAX_IMAGES})")
    checked = _checked_total([_check_image(img, f"{what}.images[{i}]") for i, img in enumerate(images)], what)
    return Observation(value.text, [_rgb(img) for img in checked])


def observation_text(value: str | Observation) -> str:
    return value if isinstance(value, str) else value.text


def encode_image(image: Any) -> dict[str, str]:
    """An image as PNG in base64 (ValueError over MAX_IMAGE_BYTES)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"an image of {len(data):,} bytes as PNG is over the limit of {MAX_IMAGE_BYTES:,}")
    return {"mime": "image/png", "data": base64.b64encode(data).decode("ascii")}


def decode_image(payload: Any, where: str = "image", budget: int = MAX_OBSERVATION_BYTES) -> Any:
    """A PIL image (8-bit RGB) from `encode_image`'s payload, or from raw base64 image bytes; checks
    the encoded size before decoding, and the pixel count, the decoded bytes and the RGB bytes
    against `budget` (what the observation has left) before loading the pixels."""
    from PIL import Image, UnidentifiedImageError

    data = payload.get("data") if isinstance(payload, dict) else payload
    if not isinstance(data, str):
        raise TypeError(f"{where}: expected base64 image data, got {type(data).__name__}")
    if len(data) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"{where}: {len(data):,} bytes of base64 is over the limit of {MAX_IMAGE_BYTES:,} encoded bytes")
    try:
        raw = base64.b64decode(data, validate=True)
        image = Image.open(io.BytesIO(raw))
        _check_image(image, where)  # the header gives size and mode: nothing large is decoded before this
        if image.size[0] * image.size[1] * 3 > budget:
            raise ValueError(f"{where}: the observation's images would hold over {MAX_OBSERVATION_BYTES:,} bytes as RGB")
        image.load()
    except (binascii.Error, UnidentifiedImageError, OSError, Image.DecompressionBombError) as err:
        raise ValueError(f"{where}: not a readable image ({type(err).__name__}: {err})") from None
    return _rgb(image)


def to_wire(value: str | Observation) -> Any:
    """JSON form: a string for text, else {"text", "images": [PNG payloads]}."""
    observation = as_observation(value)
    if not observation.images:
        return observation.text
    return {"text": observation.text, "images": [encode_image(img) for img in observation.images]}


def from_wire(value: Any, what: str = "observation") -> str | Observation:
    """Back from `to_wire` (what a host answered), every cap checked again."""
    if isinstance(value, str):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("text", ""), str) or not isinstance(value.get("images", []), list):
        raise TypeError(f"{what}: expected text or {{text, images}}, got {type(value).__name__}")
    images = value.get("images", [])
    if len(images) > MAX_IMAGES:
        raise ValueError(f"{what} has {len(images)} images (at most {MAX_IMAGES})")
    decoded, budget = [], MAX_OBSERVATION_BYTES
    for i, img in enumerate(images):
        decoded.append(decode_image(img, f"{what}.images[{i}]", budget))
        budget -= decoded[-1].size[0] * decoded[-1].size[1] * 3
    return Observation(value.get("text", ""), decoded)


def data_url(image: Any) -> str:
    """An image as a `data:image/png;base64,…` URL (OpenAI's image_url content parts)."""
    return f"data:image/png;base64,{encode_image(image)['data']}"


def from_data_url(url: str, where: str = "image_url") -> Any:
    """A PIL image from a `data:image/…;base64,` URL (ValueError for any other URL: nothing is fetched)."""
    head, _, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64")):
        raise ValueError(f"{where}: only data:image/…;base64 URLs are accepted (nothing is fetched)")
    return decode_image(data, where)
