"""Geometry3k (Lu et al., Inter-GPS, ACL 2021) as GeometryGame tasks, for users who have the data.

The public layout: `<root>/{train,val,test}/<number>/data.json` (keys "problem_text", "choices"
(4 strings), "answer" (a letter A-D), "id", ...) beside `img_diagram.png`. Tasks carry the
diagram itself (PNG in base64, as images travel between hosts), never a path: a task is data a
tenant may write, and a path in it would have the worker read any image file it names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from opentinker.env.observation import decode_image, encode_image

LETTERS = "ABCD"
SPLITS = ("train", "val", "test")


def _problem(folder: Path) -> dict[str, Any]:
    data_path, image_path = folder / "data.json", folder / "img_diagram.png"
    if not data_path.is_file() or not image_path.is_file():
        raise ValueError(f"{folder}: a Geometry3k problem folder needs data.json and img_diagram.png")
    try:
        data = json.loads(data_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{data_path}: not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{data_path}: expected a JSON object")
    text, choices, answer = data.get("problem_text"), data.get("choices"), data.get("answer")
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{data_path}: missing problem_text")
    if not isinstance(choices, list) or len(choices) != 4 or not all(isinstance(c, (str, int, float)) for c in choices):
        raise ValueError(f"{data_path}: choices must be a list of 4 strings, got {choices!r}")
    if not isinstance(answer, str) or answer.strip().upper() not in LETTERS or not answer.strip():
        raise ValueError(f"{data_path}: answer must be a letter A-D, got {answer!r}")
    try:
        from PIL import Image

        with Image.open(image_path) as opened:
            diagram = encode_image(decode_image(encode_image(opened.convert("RGB")), str(image_path)))
    except (OSError, ValueError) as err:
        raise ValueError(f"{image_path}: not a usable diagram ({err})") from None
    return {"problem": text.strip(), "choices": [str(c) for c in choices], "answer": answer.strip().upper(),
            "image": diagram, "family": "geometry3k", "id": str(data.get("id", folder.name))}


def load_geometry3k(root: str | Path, split: str = "train") -> list[dict[str, Any]]:
    """The split's problems in numeric folder order, as tasks `GeometryGame.reset(**task)` takes
    (JSON-able: save them with `save_dataset` and pass `data_path`). ValueError naming the path
    for a missing split or a malformed problem folder: a silently skipped problem would change
    the benchmark."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    folder = Path(root).expanduser() / split
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such Geometry3k split folder")
    problems = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")]
    strays = [p.name for p in problems if not p.name.isdigit()]
    if strays:
        raise ValueError(f"{folder}: problem folders are numbered, found {sorted(strays)}")
    if not problems:
        raise ValueError(f"{folder}: no problem folders")
    return [_problem(p) for p in sorted(problems, key=lambda p: int(p.name))]
