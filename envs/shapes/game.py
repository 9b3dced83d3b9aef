"""Coloured shapes on a white picture, one multiple-choice question whose answer is only in the picture.

It exists to show that a vision-language policy learns through the image: the text names the
question kind and four choices, the correct one uniform and independent of their order, so from
the text alone chance is 25%. `blank=True` (a generate_task
config key, so it travels inside the task) shows a plain white picture of the same size instead:
the ablation, whose accuracy should stay near 25% whatever the policy learns.

Two reply formats (game kwarg `reply`): "letter" (default), lettered choices answered in the
strict format `Answer: <letter>` (the last occurrence counts; the letter is case-insensitive), as
the geometry game does; "word", the choices named inline and the reply exactly one of them as
written ("green", a full stop allowed), so the answer is the reply's first token. Reward 1 for the
correct choice, 0 otherwise: no format bonus, which would invite answering one choice in the
right format. Why "word" exists: for a small untrained policy the first token of an `Answer: X`
reply is a near tie between "Answer" and "A", and RL updates that move the letter tip it, so the
format breaks before the picture is learned (README, learning through the picture).
"""

from __future__ import annotations

import math
import re
from typing import Any

from opentinker.env import AbstractGame, Observation, StepResult

LETTERS = "ABCD"
ANSWER_RE = re.compile(r"Answer:\s*([A-Da-d])\b")
COLOURS = {"red": (220, 30, 30), "green": (20, 150, 40), "blue": (30, 60, 220), "yellow": (235, 190, 0)}
SHAPES = ("circle", "square", "triangle", "star")
QUESTIONS = {"colour": "What colour is the shape?", "shape": "Which shape is in the picture?",
             "count": "How many shapes are in the picture?"}
SYSTEM_PROMPT = ("Look at the picture and answer the multiple-choice question. "
                 "Reply with the letter of the correct choice in the form 'Answer: <letter>'.")
EXAMPLE = ("Which of these is a fruit?\nA. hammer\nB. cloud\nC. apple\nD. chair", "Answer: C")
WORD_SYSTEM_PROMPT = "Look at the picture and answer the question with one word."
WORD_EXAMPLE = ("Which of these is a fruit: hammer, cloud, apple or chair?", "apple")
REPLIES = ("letter", "word")
WORD_RE = re.compile(r"\s*(\S+?)\.?\s*")
MAX_IMAGE_SIZE = 1024


def parse_letter(text: str) -> str | None:
    """The letter (upper case) of the last `Answer: X` in the text, or None when the format is missing."""
    found = ANSWER_RE.findall(text)
    return found[-1].upper() if found else None


def place_answer(rng: Any, correct: str, distractors: list[str]) -> tuple[list[str], str]:
    """Four choices with the correct one at a uniform letter and the three distractors in random
    order elsewhere: the letter is then independent of what the choices say."""
    if len(distractors) != 3 or len({correct, *distractors}) != 4:
        raise ValueError(f"need 3 distinct distractors besides {correct!r}, got {distractors!r}")
    index = int(rng.integers(4))
    rest = [distractors[int(i)] for i in rng.permutation(3)]
    return rest[:index] + [correct] + rest[index:], LETTERS[index]


def parse_choice(text: str, choices: list[str]) -> str | None:
    """The choice the whole reply is, exactly as written (a full stop and spaces around allowed), or None."""
    found = WORD_RE.fullmatch(text)
    return found.group(1) if found and found.group(1) in choices else None


def choices_text(question: str, choices: list[str]) -> str:
    return "\n".join([question, *(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))])


def choices_inline(question: str, choices: list[str]) -> str:
    """`What colour is the shape: red, green, blue or yellow?`"""
    return f"{question.rstrip('?')}: {', '.join(choices[:-1])} or {choices[-1]}?"


def _others(rng: Any, names: list[str] | tuple[str, ...], correct: str) -> list[str]:
    rest = [n for n in names if n != correct]
    return [rest[int(i)] for i in rng.permutation(len(rest))[:3]]


def _shape(rng: Any, x: float, y: float, r: float) -> dict[str, Any]:
    """One shape; positions and sizes are fractions of the picture's side, so any size renders it."""
    return {"shape": SHAPES[int(rng.integers(len(SHAPES)))], "colour": list(COLOURS)[int(rng.integers(len(COLOURS)))],
            "x": round(x, 3), "y": round(y, 3), "r": round(r, 3)}


def _polygon(kind: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if kind == "square":
        h = r * 0.85
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if kind == "triangle":
        return [(cx + r * math.cos(math.radians(a)), cy - r * math.sin(math.radians(a))) for a in (90, 210, 330)]
    if kind == "star":
        return [(cx + (r if i % 2 == 0 else r * 0.45) * math.cos(math.radians(90 + 36 * i)),
                 cy - (r if i % 2 == 0 else r * 0.45) * math.sin(math.radians(90 + 36 * i))) for i in range(10)]
    raise ValueError(f"unknown shape {kind!r}; use one of {SHAPES}")


def render(shapes: list[dict[str, Any]], size: int, blank: bool = False) -> Any:
    """The picture (RGB, white background); the same shapes give the same pixels."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    if blank:
        return image
    draw = ImageDraw.Draw(image)
    for s in shapes:
        if s["colour"] not in COLOURS:
            raise ValueError(f"unknown colour {s['colour']!r}; use one of {list(COLOURS)}")
        fill, (cx, cy, r) = COLOURS[s["colour"]], (float(s["x"]) * size, float(s["y"]) * size, float(s["r"]) * size)
        if s["shape"] == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
        else:
            draw.polygon(_polygon(s["shape"], cx, cy, r), fill=fill)
    return image


class LetterChoiceGame(AbstractGame):
    """A single-turn multiple-choice game answered `Answer: <letter>`: its system prompt and, with
    `few_shot=1`, one text-only example turn (`EXAMPLE`: user text, assistant reply) of the format."""

    SYSTEM_PROMPT = SYSTEM_PROMPT
    EXAMPLE = EXAMPLE

    def __init__(self, few_shot: int = 1, system_prompt: str | None = None):
        if few_shot not in (0, 1):
            raise ValueError("few_shot must be 0 or 1")
        self.few_shot = few_shot
        self.system_prompt = system_prompt if system_prompt is not None else self.SYSTEM_PROMPT
        self.answer = ""

    def get_system_prompt(self) -> str:
        return self.system_prompt

    def get_example_turns(self) -> list[dict[str, str]]:
        """The example has no picture, so it shows the format and nothing about the pictures."""
        if not self.few_shot:
            return []
        return [{"role": "user", "content": self.EXAMPLE[0]}, {"role": "assistant", "content": self.EXAMPLE[1]}]


class ShapesGame(LetterChoiceGame):
    """One question about one picture per episode (single turn).

    Config keys (generate_task): `kinds` (default ("colour",): one big shape, the easiest),
    among "colour", "shape", "count" (1-4 shapes); `image_size` (default 128); `blank` (default
    False: True shows a white picture, the ablation); `fixed_choices` (default False: True lists the
    choices in one fixed order, the same text for every task). Task: {"kind", "shapes": [{"shape",
    "colour", "x", "y", "r"}], "choices": [4 strings], "answer": "A".."D", "image_size", "blank"}.
    Game kwargs: `few_shot` (0 or 1), `reply` ("letter" or "word", see the module's docstring).
    """

    def __init__(self, few_shot: int = 1, system_prompt: str | None = None, reply: str = "letter"):
        if reply not in REPLIES:
            raise ValueError(f"reply must be one of {REPLIES}, got {reply!r}")
        word = reply == "word"
        super().__init__(few_shot, system_prompt if system_prompt is not None else WORD_SYSTEM_PROMPT if word else SYSTEM_PROMPT)
        self.reply, self.kind, self.choices = reply, "", []
        if word:
            self.EXAMPLE = WORD_EXAMPLE

    @classmethod
    def generate_task(cls, rng: Any, kinds: list[str] | tuple[str, ...] = ("colour",), image_size: int = 128,
                      blank: bool = False, fixed_choices: bool = False) -> dict[str, Any]:
        """The same draws whether or not `blank` is set, so the ablation sees the same tasks.
        `fixed_choices`: the four choices always in one order (red, green, blue, yellow; ...), so the
        text is the same for every task and the letter depends on the picture alone (still uniform)."""
        unknown = [k for k in kinds if k not in QUESTIONS]
        if unknown or not kinds:
            raise ValueError(f"unknown kinds {unknown!r}; use some of {list(QUESTIONS)}")
        kind = str(kinds[int(rng.integers(len(kinds)))])
        if kind == "count":
            n = int(rng.integers(1, 5))
            cells = [int(c) for c in rng.permutation(4)[:n]]  # a 2x2 grid: shapes never overlap
            shapes = [_shape(rng, 0.25 + 0.5 * (c % 2) + rng.uniform(-0.05, 0.05), 0.25 + 0.5 * (c // 2) + rng.uniform(-0.05, 0.05),
                             rng.uniform(0.12, 0.17)) for c in cells]
            correct, names = str(n), ["1", "2", "3", "4"]
        else:
            shapes = [_shape(rng, 0.5 + rng.uniform(-0.08, 0.08), 0.5 + rng.uniform(-0.08, 0.08), rng.uniform(0.28, 0.36))]
            correct = shapes[0]["colour"] if kind == "colour" else shapes[0]["shape"]
            names = list(COLOURS) if kind == "colour" else list(SHAPES)
        if fixed_choices:
            choices, answer = list(names), LETTERS[list(names).index(correct)]
        else:
            choices, answer = place_answer(rng, correct, _others(rng, names, correct))
        return {"kind": kind, "shapes": shapes, "choices": choices, "answer": answer, "image_size": int(image_size), "blank": bool(blank)}

    def reset(self, kind: str, shapes: list[dict[str, Any]], choices: list[str], answer: str, image_size: int = 128,
              blank: bool = False, **_: Any) -> Observation:
        if kind not in QUESTIONS or len(choices) != 4 or answer not in LETTERS:
            raise ValueError(f"malformed task: kind={kind!r}, {len(choices)} choices, answer={answer!r}")
        if not 8 <= int(image_size) <= MAX_IMAGE_SIZE:
            raise ValueError(f"image_size {image_size} is outside 8..{MAX_IMAGE_SIZE}")
        self.kind, self.choices = kind, [str(c) for c in choices]
        self.answer = self.choices[LETTERS.index(answer)] if self.reply == "word" else answer
        text = (choices_inline if self.reply == "word" else choices_text)(QUESTIONS[kind], self.choices)
        return Observation(text, [render(shapes, int(image_size), bool(blank))])

    def step(self, action: str) -> StepResult:
        given = parse_choice(action, self.choices) if self.reply == "word" else parse_letter(action)
        correct = given == self.answer
        info = {"correct": correct, "format_ok": given is not None, "answer": given, "expected": self.answer, "kind": self.kind}
        return StepResult(observation="Correct." if correct else f"Incorrect: {self.answer}.", reward=1.0 if correct else 0.0,
                          done=True, info=info)
