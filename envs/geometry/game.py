"""Geometry3k-style "find x" problems: a diagram, a short question, four lettered choices.

Generated problems come in families (triangle angle sum, right triangle, parallel lines and a
transversal, circle radius/diameter, central angles, isosceles base angles); a number the answer
needs is drawn only in the diagram, the text is "Find x." and the choices. The three wrong
choices are answers of other problems of the same family, so the choices alone do not single
out the right one: the picture has to be read. Real Geometry3k problems (see `envs.geometry.data`)
go through the same game with their diagram in the task (`image`: PNG in base64) instead of
generated parameters; a task never names a file (tasks are data tenants write).

Reward 1 for the correct letter in the strict format `Answer: <letter>` (as in Geometry3k's
multiple-choice setting), 0 otherwise; `info` has `correct`, `format_ok` and the `family`.
"""

from __future__ import annotations

from typing import Any

from envs.geometry.render import FAMILIES, parallel_measure, render
from envs.shapes.game import LETTERS, LetterChoiceGame, choices_text, parse_letter, place_answer
from opentinker.env import Observation, StepResult
from opentinker.env.observation import decode_image

SYSTEM_PROMPT = ("Solve the geometry problem using the diagram. Give the letter of the correct choice "
                 "in the form 'Answer: <letter>'.")
EXAMPLE = ("The two acute angles of a right triangle are 35° and y°. Find y.\nA. 45\nB. 65\nC. 55\nD. 145",
           "The angles of a triangle add up to 180°, so y = 180 - 90 - 35 = 55.\nAnswer: C")
TRIPLES = ((3, 4, 5), (5, 12, 13), (8, 15, 17), (7, 24, 25), (20, 21, 29))
NAMES = ("ABC", "DEF", "JKL", "PQR", "RST", "XYZ", "LMN", "FGH")
MAX_IMAGE_SIZE = 1024


def _int(rng: Any, low: int, high: int) -> int:
    """An integer in [low, high] inclusive."""
    return int(rng.integers(low, high + 1))


def _names(rng: Any) -> str:
    names = NAMES[int(rng.integers(len(NAMES)))]
    return "".join(names[int(i)] for i in rng.permutation(3))


def _triangle_angle_sum(rng: Any) -> tuple[dict[str, Any], int]:
    a = _int(rng, 30, 110)
    b = _int(rng, 30, 150 - a)
    angles, unknown = [a, b, 180 - a - b], _int(rng, 0, 2)
    return {"angles": angles, "unknown": unknown, "rotation": _int(rng, 0, 359), "names": _names(rng)}, angles[unknown]


def _right_triangle(rng: Any) -> tuple[dict[str, Any], int]:
    a, b, c = TRIPLES[int(rng.integers(len(TRIPLES)))]
    k = _int(rng, 1, 3)
    a, b = (b, a) if rng.integers(2) else (a, b)
    unknown = "hypotenuse" if rng.integers(2) else "leg"
    params = {"sides": [k * a, k * b, k * c], "unknown": unknown, "rotation": _int(rng, 0, 359), "names": _names(rng)}
    return params, k * c if unknown == "hypotenuse" else k * b


def _parallel_lines(rng: Any) -> tuple[dict[str, Any], int]:
    theta = _int(rng, 45, 80) if rng.integers(2) else _int(rng, 100, 135)
    given_line = _int(rng, 0, 1)
    given, asked = [given_line, _int(rng, 0, 3)], [1 - given_line, _int(rng, 0, 3)]
    return {"theta": theta, "given": given, "asked": asked}, parallel_measure(theta, asked[1])


def _circle(rng: Any) -> tuple[dict[str, Any], int]:
    r, unknown, at = _int(rng, 3, 19), ("diameter" if rng.integers(2) else "radius"), _int(rng, 0, 179)
    params = {"radius": r, "unknown": unknown, "diameter_at": at, "radius_at": at + _int(rng, 50, 130)}
    return params, 2 * r if unknown == "diameter" else r


def _central_angle(rng: Any) -> tuple[dict[str, Any], int]:
    a = 5 * _int(rng, 10, 40)
    b = 5 * _int(rng, 10, (310 - a) // 5)
    angles, unknown = [a, b, 360 - a - b], _int(rng, 0, 2)
    return {"angles": angles, "unknown": unknown, "start": _int(rng, 0, 359)}, angles[unknown]


def _isosceles(rng: Any) -> tuple[dict[str, Any], int]:
    apex, unknown = 2 * _int(rng, 15, 60), ("apex" if rng.integers(2) else "base")
    params = {"apex": apex, "unknown": unknown, "base_vertex": _int(rng, 0, 1), "rotation": _int(rng, 0, 359), "names": _names(rng)}
    return params, apex if unknown == "apex" else (180 - apex) // 2


SAMPLERS = {"triangle_angle_sum": _triangle_angle_sum, "right_triangle": _right_triangle, "parallel_lines": _parallel_lines,
            "circle": _circle, "central_angle": _central_angle, "isosceles": _isosceles}
PROBLEMS = {"parallel_lines": "Lines m and n are parallel. Find x."}
assert set(SAMPLERS) == set(FAMILIES)


def generate_problem(rng: Any, family: str, image_size: int = 256) -> dict[str, Any]:
    """One generated problem of `family` as a task dict; distractors are other draws' answers."""
    if family not in SAMPLERS:
        raise ValueError(f"unknown geometry family {family!r}; use some of {sorted(SAMPLERS)}")
    params, answer = SAMPLERS[family](rng)
    wrong: list[str] = []
    for _ in range(1000):
        other = str(SAMPLERS[family](rng)[1])
        if other != str(answer) and other not in wrong:
            wrong.append(other)
            if len(wrong) == 3:
                break
    choices, letter = place_answer(rng, str(answer), wrong)
    return {"family": family, "params": params, "problem": PROBLEMS.get(family, "Find x."), "choices": choices,
            "answer": letter, "image_size": int(image_size)}


class GeometryGame(LetterChoiceGame):
    """One geometry problem per episode (single turn).

    Config keys (generate_task): `families` (default all of FAMILIES) and `image_size` (default
    256). Generated task: {"family", "params", "problem", "choices": [4 strings], "answer":
    "A".."D", "image_size"}; a dataset task has "image" (the diagram, PNG in base64) and no
    "params" instead. Game kwargs: `few_shot` (0 or 1).
    """

    SYSTEM_PROMPT = SYSTEM_PROMPT
    EXAMPLE = EXAMPLE  # a worked example whose numbers are in its text: it has no picture

    def __init__(self, few_shot: int = 1, system_prompt: str | None = None):
        super().__init__(few_shot, system_prompt)
        self.family = ""

    @classmethod
    def generate_task(cls, rng: Any, families: list[str] | tuple[str, ...] | None = None, image_size: int = 256) -> dict[str, Any]:
        families = list(families or FAMILIES)
        return generate_problem(rng, str(families[int(rng.integers(len(families)))]), image_size)

    def reset(self, problem: str, choices: list[str], answer: str, family: str = "geometry3k", params: dict[str, Any] | None = None,
              image: dict[str, str] | None = None, image_size: int = 256, **_: Any) -> Observation:
        if len(choices) != 4 or answer not in LETTERS:
            raise ValueError(f"malformed task: {len(choices)} choices, answer={answer!r}")
        if image is not None:
            image = decode_image(image, "the task's image")  # size-capped before the pixels are decoded
        elif params is not None:
            if not 32 <= int(image_size) <= MAX_IMAGE_SIZE:
                raise ValueError(f"image_size {image_size} is outside 32..{MAX_IMAGE_SIZE}")
            image = render(family, params, int(image_size))
        else:
            raise ValueError("a geometry task needs `params` (generated) or `image` (a dataset's diagram)")
        self.family, self.answer = family, answer
        return Observation(choices_text(problem, [str(c) for c in choices]), [image])

    def step(self, action: str) -> StepResult:
        given = parse_letter(action)
        correct = given == self.answer
        info = {"correct": correct, "format_ok": given is not None, "answer": given, "expected": self.answer, "family": self.family}
        return StepResult(observation="Correct." if correct else f"Incorrect: {self.answer}.", reward=1.0 if correct else 0.0,
                          done=True, info=info)
