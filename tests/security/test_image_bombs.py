"""Images whose header promises far more than their bytes: refused from the header, before a pixel
is decoded, so the episode fails with the reason and the worker's memory does not move; what is
accepted is stored as 8-bit RGB, 16-bit samples scaled (not clipped)."""

from __future__ import annotations

import base64
import io
import subprocess
import sys
import textwrap

import pytest
from PIL import Image

from opentinker.env.observation import MAX_OBSERVATION_BYTES, Observation, as_observation, from_wire


def png(image: Image.Image) -> dict[str, str]:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return {"mime": "image/png", "data": base64.b64encode(buffer.getvalue()).decode()}


@pytest.fixture(scope="module")
def bomb() -> dict[str, str]:
    """A 4096 x 4096 16-bit PNG of one grey: a few tens of KB that would decode to 32 MB (and more as RGB)."""
    return png(Image.new("I;16", (4096, 4096), 1234))


def test_a_small_png_claiming_a_huge_16bit_image_is_refused_from_its_header(bomb):
    assert len(bomb["data"]) < 200_000
    with pytest.raises(ValueError, match=r"observation.images\[0\] is 4096x4096 pixels \(at most 4,194,304 pixels\)"):
        from_wire({"text": "look", "images": [bomb]})


def test_refusing_bombs_leaves_the_process_memory_where_it_was(bomb):
    """Four bombs in a fresh process: its peak resident memory grows by less than 20 MB."""
    script = textwrap.dedent("""
        import json, resource, sys
        from opentinker.env.observation import from_wire
        payload = json.loads(sys.stdin.read())
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(4):
            try:
                from_wire({"text": "", "images": [payload]})
            except ValueError:
                pass
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """)
    import json

    out = subprocess.run([sys.executable, "-c", script], input=json.dumps(bomb), capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) < 20_000, f"peak RSS grew by {out.stdout.strip()} KB"


def test_sixteen_bit_images_are_scaled_to_eight_bit_rgb_not_clipped():
    decoded = from_wire({"text": "", "images": [png(Image.new("I;16", (8, 8), 60000))]})
    assert decoded.images[0].mode == "RGB" and decoded.images[0].getpixel((0, 0)) == (233, 233, 233)  # 60000 / 257
    local = as_observation(Observation("", [Image.new("I;16", (8, 8), 257 * 10), Image.new("RGBA", (4, 4), (1, 2, 3, 4))]))
    assert [im.mode for im in local.images] == ["RGB", "RGB"] and local.images[0].getpixel((0, 0)) == (10, 10, 10)


def test_an_observations_images_together_are_bounded():
    """Eight images each within the caps, together over the observation's budget: refused before
    the image that would cross it is decoded."""
    image = png(Image.new("RGB", (2048, 1024), (9, 9, 9)))
    assert 8 * 2048 * 1024 * 3 > MAX_OBSERVATION_BYTES
    with pytest.raises(ValueError, match=r"observation.images\[5\]: the observation's images would hold over"):
        from_wire({"text": "", "images": [image] * 8})
    with pytest.raises(ValueError, match=r"its images hold 50,331,648 bytes as RGB"):
        as_observation(Observation("", [Image.new("RGB", (2048, 1024))] * 8))
