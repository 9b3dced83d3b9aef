"""The vision environments: ShapesGame (the answer only in the picture) and GeometryGame
(generated Geometry3k-style diagrams, and Geometry3k itself through its loader)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from envs.geometry import FAMILIES, GeometryGame, load_geometry3k
from envs.geometry.game import generate_problem
from envs.shapes import ShapesGame, parse_letter
from envs.shapes.game import COLOURS
from opentinker.env import GameEnvironment, Observation
from opentinker.env.hosting import reset_reply, step_reply
from opentinker.env.observation import from_wire

KINDS = ("colour", "shape", "count")


def _tasks(game_class, n, seed=0, **config):
    rng = np.random.default_rng(seed)
    return [game_class.generate_task(rng, **config) for _ in range(n)]


def _pixels(observation: Observation) -> list[bytes]:
    return [image.tobytes() for image in observation.images]


# -- shapes ------------------------------------------------------------------------------------
def test_shapes_tasks_are_json_and_render_the_same_picture_every_time():
    for task in _tasks(ShapesGame, 30, kinds=KINDS):
        task = json.loads(json.dumps(task))  # tasks travel over HTTP
        first, second = ShapesGame().reset(**task), ShapesGame().reset(**task)
        assert isinstance(first, Observation) and len(first.images) == 1
        assert first.images[0].size == (128, 128) and first.images[0].mode == "RGB"
        assert _pixels(first) == _pixels(second) and first.text == second.text


def test_shapes_default_is_one_big_shape_whose_colour_is_the_answer():
    for task in _tasks(ShapesGame, 20):
        assert task["kind"] == "colour" and len(task["shapes"]) == 1
        observation = ShapesGame().reset(**task)
        centre = observation.images[0].getpixel((int(task["shapes"][0]["x"] * 128), int(task["shapes"][0]["y"] * 128)))
        answer = task["choices"]["ABCD".index(task["answer"])]
        assert centre == COLOURS[answer]
        assert observation.text.splitlines()[0] == "What colour is the shape?"


def test_shapes_count_and_shape_kinds_match_their_pictures():
    for task in _tasks(ShapesGame, 40, kinds=("count", "shape")):
        answer = task["choices"]["ABCD".index(task["answer"])]
        if task["kind"] == "count":
            assert int(answer) == len(task["shapes"]) and 1 <= len(task["shapes"]) <= 4
        else:
            assert answer == task["shapes"][0]["shape"]
        assert sorted(task["choices"]) == sorted(set(task["choices"]))


def test_shapes_letters_are_uniform():
    for config in ({}, {"kinds": KINDS}):
        counts = Counter(t["answer"] for t in _tasks(ShapesGame, 200, seed=3, **config))
        assert set(counts) == set("ABCD") and all(30 <= c <= 70 for c in counts.values()), counts


def test_shapes_blank_changes_only_the_picture():
    plain, blank = _tasks(ShapesGame, 20, kinds=KINDS), _tasks(ShapesGame, 20, kinds=KINDS, blank=True)
    assert [{**t, "blank": True} for t in plain] == blank  # the same tasks: a fair ablation
    white = Image.new("RGB", (128, 128), "white").tobytes()
    for task, twin in zip(plain, blank):
        seen, hidden = ShapesGame().reset(**task), ShapesGame().reset(**twin)
        assert hidden.text == seen.text and _pixels(hidden) == [white] and _pixels(seen) != [white]


def test_shapes_text_alone_does_not_know_the_answer():
    """With blank pictures a model has only the text: the best lookup from text to letter, fit on
    1500 tasks, stays at chance on 500 others."""
    tasks = _tasks(ShapesGame, 2000, seed=5, kinds=KINDS, blank=True)
    observations = [ShapesGame().reset(**t) for t in tasks]
    assert len({o.images[0].tobytes() for o in observations}) == 1
    table: dict[str, Counter] = {}
    for o, t in zip(observations[:1500], tasks[:1500]):
        table.setdefault(o.text, Counter())[t["answer"]] += 1
    overall = Counter(t["answer"] for t in tasks[:1500]).most_common(1)[0][0]
    guesses = [table[o.text].most_common(1)[0][0] if o.text in table else overall for o in observations[1500:]]
    accuracy = np.mean([g == t["answer"] for g, t in zip(guesses, tasks[1500:])])
    assert accuracy < 0.32, accuracy
    for o, t in zip(observations, tasks):  # the question line never names the answer
        assert t["choices"]["ABCD".index(t["answer"])] not in o.text.splitlines()[0]


@pytest.mark.parametrize("reply, reward, format_ok", [
    ("Answer: {a}", 1.0, True), ("The shape is red.\nAnswer: {a}.", 1.0, True), ("Answer: {a_lower}", 1.0, True),
    ("Answer: {w}\nOn second thought, Answer: {a}", 1.0, True), ("Answer: {a}\nAnswer: {w}", 0.0, True),
    ("Answer: {w}", 0.0, True), ("{a}", 0.0, False), ("Answer: E", 0.0, False), ("Answer: {a}pple", 0.0, False), ("", 0.0, False),
])
def test_shapes_rewards(reply, reward, format_ok):
    task = _tasks(ShapesGame, 1, seed=11)[0]
    wrong = next(letter for letter in "ABCD" if letter != task["answer"])
    game = ShapesGame()
    game.reset(**task)
    result = game.step(reply.format(a=task["answer"], a_lower=task["answer"].lower(), w=wrong))
    assert result.done and result.reward == reward
    assert result.info["correct"] is (reward == 1.0) and result.info["format_ok"] is format_ok
    assert result.observation == ("Correct." if reward else f"Incorrect: {task['answer']}.")


def test_parse_letter():
    assert parse_letter("Answer: c") == "C" and parse_letter("answer: C") is None and parse_letter("Answer:D") == "D"


def test_shapes_config_reaches_the_generator():
    env = GameEnvironment(ShapesGame, config={"kinds": ["count"], "image_size": 64, "blank": True, "val_size": 8})
    task = env.train_tasks(1)[0]
    assert task["kind"] == "count" and task["blank"] is True
    assert env.make_game().reset(**task).images[0].size == (64, 64)
    with pytest.raises(ValueError, match="unknown kinds"):
        ShapesGame.generate_task(np.random.default_rng(0), kinds=["size"])


@pytest.mark.parametrize("reply, reward, format_ok", [
    ("{w}", 1.0, True), ("{w}.", 1.0, True), ("  {w}\n", 1.0, True), ("{o}", 0.0, True),
    ("{W}", 0.0, False), ("{w} {o}", 0.0, False), ("The shape is {w}.", 0.0, False), ("{w}!", 0.0, False),
    ("Answer: {a}", 0.0, False), ("{a}", 0.0, False), ("", 0.0, False),
])
def test_shapes_word_reply_rewards_exactly_the_right_choice_as_written(reply, reward, format_ok):
    task = _tasks(ShapesGame, 1, seed=11, fixed_choices=True)[0]
    right = task["choices"]["ABCD".index(task["answer"])]
    other = next(c for c in task["choices"] if c != right)
    game = ShapesGame(reply="word")
    game.reset(**task)
    result = game.step(reply.format(w=right, W=right.capitalize(), o=other, a=task["answer"]))
    assert result.done and result.reward == reward
    assert result.info["correct"] is (reward == 1.0) and result.info["format_ok"] is format_ok
    assert result.info["expected"] == right and result.info["answer"] == (reply.format(w=right, o=other).strip(" .\n") if format_ok else None)


def test_shapes_word_reply_names_the_choices_inline_with_its_own_prompt_and_example():
    task = _tasks(ShapesGame, 1, fixed_choices=True)[0]
    word, letter = ShapesGame(reply="word"), ShapesGame()
    assert word.reset(**task).text == "What colour is the shape: red, green, blue or yellow?"
    assert letter.reset(**task).text.splitlines()[1] == "A. red"
    assert "one word" in word.get_system_prompt() and "Answer: <letter>" in letter.get_system_prompt()
    assert word.get_example_turns()[1] == {"role": "assistant", "content": "apple"}
    assert letter.get_example_turns()[1]["content"] == "Answer: C"
    count = _tasks(ShapesGame, 1, kinds=("count",), fixed_choices=True)[0]
    assert ShapesGame(reply="word").reset(**count).text == "How many shapes are in the picture: 1, 2, 3 or 4?"
    with pytest.raises(ValueError, match="reply must be one of"):
        ShapesGame(reply="sentence")

# -- geometry ----------------------------------------------------------------------------------
def _expected(task) -> int:
    """The answer worked out again from the parameters, independently of the generator."""
    p, family = task["params"], task["family"]
    if family in ("triangle_angle_sum", "central_angle"):
        total = 180 if family == "triangle_angle_sum" else 360
        return total - sum(a for i, a in enumerate(p["angles"]) if i != p["unknown"])
    if family == "right_triangle":
        a, b, c = p["sides"]
        return round((a * a + b * b) ** 0.5) if p["unknown"] == "hypotenuse" else round((c * c - a * a) ** 0.5)
    if family == "parallel_lines":  # corresponding angles are equal, neighbours supplementary
        same = (p["given"][1] - p["asked"][1]) % 2 == 0
        given = p["theta"] if p["given"][1] in (0, 2) else 180 - p["theta"]
        return given if same else 180 - given
    if family == "circle":
        return 2 * p["radius"] if p["unknown"] == "diameter" else p["radius"]
    return p["apex"] if p["unknown"] == "apex" else (180 - p["apex"]) // 2


def test_geometry_families_render_and_their_answers_are_right():
    rng = np.random.default_rng(0)
    for family in FAMILIES:
        for _ in range(15):
            task = json.loads(json.dumps(generate_problem(rng, family)))
            observation = GeometryGame().reset(**task)
            assert len(observation.images) == 1 and observation.images[0].size == (256, 256)
            assert observation.images[0].mode == "RGB"
            first, *choices = observation.text.splitlines()
            assert "Find x" in first and not any(ch.isdigit() for ch in first)  # numbers only in the picture
            assert [c.split(". ", 1)[1] for c in choices] == task["choices"] and len(set(task["choices"])) == 4
            assert task["choices"]["ABCD".index(task["answer"])] == str(_expected(task)), task
            again = GeometryGame().reset(**task)
            assert _pixels(again) == _pixels(observation)
            assert observation.images[0].convert("L").getextrema()[0] < 255  # something was drawn


def test_geometry_letters_are_uniform_and_families_mixed():
    tasks = _tasks(GeometryGame, 200, seed=2)
    counts = Counter(t["answer"] for t in tasks)
    assert set(counts) == set("ABCD") and all(30 <= c <= 70 for c in counts.values()), counts
    assert set(t["family"] for t in tasks) == set(FAMILIES)
    only = _tasks(GeometryGame, 10, families=["circle"], image_size=128)
    assert {t["family"] for t in only} == {"circle"} and GeometryGame().reset(**only[0]).images[0].size == (128, 128)


def test_geometry_rewards_and_info():
    task = _tasks(GeometryGame, 1, seed=4)[0]
    wrong = next(letter for letter in "ABCD" if letter != task["answer"])
    for reply, reward, format_ok in ((f"x = ... so\nAnswer: {task['answer']}", 1.0, True), (f"Answer: {wrong}", 0.0, True),
                                     (task["choices"]["ABCD".index(task["answer"])], 0.0, False)):
        game = GeometryGame()
        game.reset(**task)
        result = game.step(reply)
        assert result.reward == reward and result.done
        assert result.info["correct"] is (reward == 1.0) and result.info["format_ok"] is format_ok
        assert result.info["family"] == task["family"]
    assert GeometryGame().get_example_turns()[1]["content"].endswith("Answer: C")
    assert GeometryGame(few_shot=0).get_example_turns() == []


# -- Geometry3k loader -------------------------------------------------------------------------
def _problem_folder(folder, number, answer="B", choices=("3", "4", "5", "6"), image=True):
    path = folder / str(number)
    path.mkdir(parents=True)
    data = {"id": number, "problem_text": f"Find x in problem {number}.", "choices": list(choices), "answer": answer,
            "problem_type_graph": ["Triangle"], "problem_type_goal": ["Length"]}
    (path / "data.json").write_text(json.dumps(data))
    if image:
        Image.new("RGB", (40 + number, 30), (number * 20, 0, 0)).save(path / "img_diagram.png")
    return path


def test_geometry3k_loader_on_a_fake_folder(tmp_path):
    for number in (10, 2):  # numeric order, not text order
        _problem_folder(tmp_path / "train", number, choices=(3, 4.5, "5", "6"))
    tasks = load_geometry3k(tmp_path, "train")
    assert [t["id"] for t in tasks] == ["2", "10"] and json.loads(json.dumps(tasks)) == tasks
    assert tasks[0]["choices"] == ["3", "4.5", "5", "6"] and tasks[0]["answer"] == "B"
    assert all("image_path" not in t and t["image"]["mime"] == "image/png" for t in tasks)  # the pixels, never a path
    game = GeometryGame()
    observation = game.reset(**tasks[1])
    assert observation.images[0].size == (50, 30) and observation.images[0].getpixel((0, 0)) == (200, 0, 0)
    assert observation.text.splitlines() == ["Find x in problem 10.", "A. 3", "B. 4.5", "C. 5", "D. 6"]
    assert game.step("Answer: B").reward == 1.0 and game.step("Answer: B").info["family"] == "geometry3k"
    env = GameEnvironment(GeometryGame, config={"dataset": tasks, "val_fraction": 0.5})
    assert env.make_game().reset(**env.train_tasks(1)[0]).images
    with pytest.raises(ValueError, match="needs `params`"):  # a task naming a file on the worker reads nothing
        GeometryGame().reset(problem="p", choices=["1", "2", "3", "4"], answer="A", image_path="/etc/hostname")


@pytest.mark.parametrize("damage, message", [
    (lambda root: _problem_folder(root, 3, image=False), "img_diagram.png"),
    (lambda root: _problem_folder(root, 3, answer="E"), "answer must be a letter"),
    (lambda root: _problem_folder(root, 3, choices=("1", "2", "3")), "choices must be"),
    (lambda root: (root / "notes").mkdir(), "numbered"),
    (lambda root: (_problem_folder(root, 3) / "data.json").write_text("{oops"), "not readable JSON"),
])
def test_geometry3k_loader_refuses_malformed_folders(tmp_path, damage, message):
    _problem_folder(tmp_path / "test", 0)
    damage(tmp_path / "test")
    with pytest.raises(ValueError, match=message) as err:
        load_geometry3k(tmp_path, "test")
    assert str(tmp_path) in str(err.value)
    with pytest.raises(ValueError, match="no such Geometry3k split"):
        load_geometry3k(tmp_path, "val")


# -- hosting ----------------------------------------------------------------------------------
@pytest.mark.parametrize("game_class, config", [(ShapesGame, {"kinds": KINDS}), (GeometryGame, {})])
def test_hosting_round_trip_carries_the_picture(game_class, config):
    task = _tasks(game_class, 1, seed=9, **config)[0]
    reply = json.loads(json.dumps(reset_reply(game_class(), task)))
    observation = from_wire(reply["observation"])
    local = game_class().reset(**task)
    assert isinstance(observation, Observation) and observation.text == local.text
    assert _pixels(observation) == _pixels(local)
    assert reply["system_prompt"] and len(reply["example_turns"]) == 2
    game = game_class()
    game.reset(**task)
    stepped = json.loads(json.dumps(step_reply(game, f"Answer: {task['answer']}")))
    assert stepped["observation"] == "Correct." and stepped["reward"] == 1.0 and stepped["info"]["correct"] is True


def test_shapes_fixed_choices_make_the_text_identical_and_the_letter_the_pictures():
    tasks = _tasks(ShapesGame, 200, fixed_choices=True)
    assert {tuple(t["choices"]) for t in tasks} == {("red", "green", "blue", "yellow")}
    assert all(t["choices"]["ABCD".index(t["answer"])] == t["shapes"][0]["colour"] for t in tasks)
    counts = Counter(t["answer"] for t in tasks)
    assert set(counts) == set("ABCD") and min(counts.values()) > 30
