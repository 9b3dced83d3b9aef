"""TextArena through envs.textarena, against the real textarena package (no mocks): a one-player
game and a two-player match played to the end by scripted moves, invalid moves as TextArena rules
them, a game whose code raises, refused env ids, reproducibility by seed, and every verified id
played to its end by the scripted opponent."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from envs.textarena import REFUSED, VERIFIED, TextArenaGame, TextArenaMatch, check_spec_env, refusal
from envs.textarena.opponents import random_opponent
from envs.textarena.session import Session
from opentinker.env.environment import GameEnvironment
from opentinker.env.hosting import start_episode

ta = pytest.importorskip("textarena")
from textarena.envs.TicTacToe.env import TicTacToeEnv  # noqa: E402 - after the skip


def guess_by_halving(game: TextArenaGame, observation: str, low: int = 1, high: int = 20):
    """Play GuessTheNumber to the end from its hints; the last StepResult."""
    while True:
        guess = (low + high) // 2
        result = game.step(f"My guess is [{guess}]")
        if result.done:
            return result
        hint = re.findall(r"target number is (higher|lower)", result.observation)[-1]
        low, high = (guess + 1, high) if hint == "higher" else (low, guess - 1)


# -- one player --------------------------------------------------------------------------------
def test_a_one_player_game_played_to_the_end_by_scripted_moves_pays_textarenas_reward():
    env = GameEnvironment(TextArenaGame, {"env": {"config": {"env_id": "GuessTheNumber-v0", "val_size": 4}}, "seed": 3})
    task = env.validation_tasks()[0]
    assert set(task) == {"env_id", "seed"}
    game = env.make_game()
    first = start_episode(game, task)
    assert "Guess The Number" in first and "[5]" in first  # the game's own instructions and format
    assert "competitive game player" in game.get_system_prompt()  # TextArena's own system prompt
    result = guess_by_halving(game, first)
    assert result.done and result.reward == 1.0
    assert result.info["correct"] and result.info["result"] == "win" and result.info["illegal_moves"] == 0
    assert "Congratulations" in result.observation


def test_a_malformed_action_costs_the_turn_as_textarena_rules_it():
    game = TextArenaGame()
    game.reset(env_id="GuessTheNumber-v0", seed=11)
    first = game.step("I think it is twelve")  # no [number]: TextArena's invalid move, one retry allowed
    assert not first.done and first.reward == 0.0 and first.info["illegal_moves"] == 1
    assert "attempted an invalid move" in first.observation and "resubmit" in first.observation
    second = game.step("[99]")  # out of range: past the allowance the game ends with TextArena's reward
    assert second.done and second.info["illegal_moves"] == 2 and not second.info["correct"]
    assert second.reward == 0.0 and "Invalid move" in second.observation


def test_a_two_player_env_against_the_scripted_opponent_ends_with_the_models_result():
    env = GameEnvironment(TextArenaGame, {"env": {"config": {"env_id": "TicTacToe-v0", "model_plays": 1, "val_size": 3}}})
    game = env.make_game()
    observation = start_episode(game, env.validation_tasks()[0])
    assert "[Player 0]" in observation  # the opponent (player 0) opened
    rng, result = random.Random(0), None
    for _ in range(9):
        move = random_opponent(game.session, observation, rng)  # the model's side played by the same script
        result = game.step(move)
        observation = result.observation
        if result.done:
            break
    assert result.done and result.reward in (-1.0, 0.0, 1.0)
    assert result.reward == game.session.result(1) and result.info["illegal_moves"] == 0


# -- two players -------------------------------------------------------------------------------
def play(match: TextArenaMatch, moves: list[str]) -> None:
    for move in moves:
        player = match.current_player
        match.observation_for(player)
        legal, message = match.apply(player, move)
        assert legal, message


def test_a_two_player_match_played_to_the_end_gives_zero_sum_results():
    env = GameEnvironment(TextArenaMatch, {"env": {"config": {"env_id": "TicTacToe-v0", "val_size": 2}}})
    match = env.make_game()
    start_episode(match, env.validation_tasks()[0])
    assert match.players == ("P0", "P1") and match.current_player == "P0"
    first = match.observation_for("P0")
    assert "Tic Tac Toe" in first and "Available Moves" in first
    play(match, ["[4]", "[0]", "[2]", "[1]", "[6]"])  # P0 takes the diagonal 2-4-6
    assert match.finished
    assert (match.result_for("P0"), match.result_for("P1")) == (1, -1)
    assert match.info_for("P0")["result"] == "win" and match.info_for("P1")["result"] == "loss"
    assert "has won" in match.observation_for("P1")

    draw = TextArenaMatch()
    draw.reset(env_id="TicTacToe-v0", seed=1)
    play(draw, ["[4]", "[0]", "[2]", "[6]", "[3]", "[5]", "[7]", "[1]", "[8]"])
    assert draw.finished and (draw.result_for("P0"), draw.result_for("P1")) == (0, 0)
    assert draw.info_for("P0")["result"] == "draw" and draw.info_for("P0")["game_length"] == 9


def test_each_player_sees_only_what_is_new_to_it_and_not_its_own_move():
    match = TextArenaMatch()
    match.reset(env_id="TicTacToe-v0", seed=0)
    assert match.observation_for("P0").count("You are Player 0") == 1
    match.apply("P0", "[4]")
    to_p1 = match.observation_for("P1")
    assert "You are Player 1" in to_p1 and "[Player 0] [4]" in to_p1
    match.apply("P1", "[0]")
    to_p0 = match.observation_for("P0")
    assert "You are Player" not in to_p0 and "[Player 1] [0]" in to_p0 and "[Player 0] [4]" not in to_p0


def test_a_malformed_move_in_a_match_is_refused_then_loses_as_textarena_rules():
    match = TextArenaMatch()
    match.reset(env_id="TicTacToe-v0", seed=0)
    match.observation_for("P0")
    legal, message = match.apply("P0", "center please")
    assert not legal and "attempted an invalid move" in message and match.current_player == "P0"
    legal, message = match.apply("P0", "[42]")  # TicTacToe allows one retry: the second invalid move loses
    assert not legal and match.finished
    assert (match.result_for("P0"), match.result_for("P1")) == (-1, 1)
    assert match.info_for("P0")["illegal_moves"] == 2 and match.info_for("P1")["illegal_moves"] == 0
    with pytest.raises(ValueError, match="over"):
        match.apply("P1", "[0]")


def test_a_move_out_of_turn_is_the_callers_bug():
    match = TextArenaMatch("TicTacToe-v0")
    match.reset(seed=0)
    with pytest.raises(ValueError, match="P0's turn"):
        match.apply("P1", "[0]")


def test_the_match_names_its_single_agent_evaluation():
    env = TextArenaMatch.evaluation_env("P1", {"env_id": "Nim-v0", "val_size": 8})
    assert env["game"] == "envs.textarena:TextArenaGame"
    assert env["config"] == {"env_id": "Nim-v0", "model_plays": 1, "val_size": 8, "game_kwargs": {"opponent": "random"}}
    GameEnvironment(TextArenaGame, {"env": {"config": env["config"]}})  # a spec that runs


# -- a game that raises ------------------------------------------------------------------------
class RaisingTicTacToe(TicTacToeEnv):
    """A real TextArena env whose step raises on one text, as a game's bug would."""

    def step(self, action):
        if "boom" in action:
            raise ZeroDivisionError("division by zero")
        return super().step(action)


def test_game_code_that_raises_is_charged_as_textarenas_invalid_move():
    from textarena.envs.registration import ENV_REGISTRY

    if "RaisingTicTacToe-v0-test" not in ENV_REGISTRY:
        ta.register(id="RaisingTicTacToe-v0-test", entry_point=RaisingTicTacToe)
    session = Session("RaisingTicTacToe-v0-test", 2, seed=0)
    assert session.step("[boom]") is False  # not raised: the turn is refused, the game goes on
    assert session.errors == 1 and session.refused[0] == 1 and not session.done and session.current == 0
    assert "could not process this move (ZeroDivisionError" in session.render(0)
    assert session.step("[4]") and session.current == 1


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("env_id, words", [
    ("Wordle-v0", "downloads NLTK data"),
    ("Hangman-v0-hardcore", "downloads NLTK data"),
    ("TwentyQuestions-v0", "online model (OpenRouter)"),
    ("Chess-v0", "Python 3.12"),
    ("Countdown-v0", "wrong order"),
    ("SecretMafia-v0", "more than two players"),
    ("NoSuchGame-v0", "not among the"),
])
def test_a_refused_env_id_gets_a_one_line_reason_naming_it(env_id, words):
    reason = refusal(env_id)
    assert reason and words in reason and repr(env_id) in reason and "\n" not in reason
    with pytest.raises(ValueError, match=re.escape(reason)):
        TextArenaGame.generate_task(np.random.default_rng(0), env_id=env_id)
    with pytest.raises(ValueError, match=re.escape(reason)):
        TextArenaGame.check_config({"env_id": env_id})
    with pytest.raises(ValueError, match=re.escape(reason)):
        GameEnvironment(TextArenaGame, {"env": {"config": {"env_id": env_id}}})  # the job stops before its first episode


def test_the_spec_check_knows_which_adapter_takes_which_games():
    check_spec_env("envs.textarena:TextArenaGame", {"env_id": "TicTacToe-v0"})  # two players against the script
    check_spec_env("envs.textarena:TextArenaMatch", {"env_id": "TicTacToe-v0"})
    with pytest.raises(ValueError, match="one-player game; use envs.textarena:TextArenaGame"):
        check_spec_env("envs.textarena:TextArenaMatch", {"env_id": "GuessTheNumber-v0"})
    with pytest.raises(ValueError, match="give a TextArena env id"):
        check_spec_env("envs.textarena:TextArenaMatch", {})
    check_spec_env("envs.gomoku:GomokuGame", {})  # not ours: nothing to say


def test_the_spec_check_needs_no_textarena_import():
    import subprocess
    import sys

    code = ("import sys, envs.textarena as t; t.check_spec_env('envs.textarena:TextArenaGame', {'env_id': 'Nim-v0'}); "
            "assert 'textarena' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_every_refused_family_exists_in_textarena_and_no_verified_id_is_refused():
    from textarena.envs.registration import ENV_REGISTRY

    families = {k.split("-v0")[0] for k in ENV_REGISTRY}
    assert set(REFUSED) <= families
    assert set(VERIFIED) <= set(ENV_REGISTRY)
    assert not [i for i in VERIFIED if refusal(i)]


# -- reproducibility ---------------------------------------------------------------------------
def transcript(env_id: str, seed: int, players: int) -> list[str]:
    session, rng, seen, out = Session(env_id, players, seed), random.Random(seed), {}, []
    while not session.done and len(out) < 60:
        p = session.current
        seen[p] = session.render(p)
        move = random_opponent(session, seen[p], rng)
        session.step(move)
        out.append(move)
        random.random()  # other code drawing from the global generator between moves changes nothing
    return [*out, repr(session.rewards)]


def test_the_same_seed_gives_the_same_game_and_tasks():
    assert transcript("Minesweeper-v0-small", 5, 1) == transcript("Minesweeper-v0-small", 5, 1)
    assert transcript("KuhnPoker-v0", 5, 2) == transcript("KuhnPoker-v0", 5, 2)
    assert transcript("KuhnPoker-v0", 5, 2) != transcript("KuhnPoker-v0", 6, 2)
    cfg = {"env": {"config": {"env_id": "Mastermind-v0", "val_size": 4}}, "seed": 7}
    a, b = GameEnvironment(TextArenaGame, cfg), GameEnvironment(TextArenaGame, cfg)
    assert a.validation_tasks() == b.validation_tasks() and a.train_tasks(3) == b.train_tasks(3)
    first = [start_episode(TextArenaGame(), t) for t in a.validation_tasks()]
    assert first == [start_episode(TextArenaGame(), t) for t in b.validation_tasks()]


# -- every verified id -------------------------------------------------------------------------
@pytest.mark.parametrize("env_id", sorted(i for i, n in VERIFIED.items() if n == 2))
def test_every_verified_two_player_id_is_played_to_its_end_by_the_scripted_opponent(env_id):
    session, rng, seen = Session(env_id, 2, seed=1), random.Random(1), {0: [], 1: []}
    for _ in range(300):
        if session.done:
            break
        p = session.current
        seen[p] = seen[p][:1] + [session.render(p)]
        assert session.step(random_opponent(session, "\n".join(seen[p]), rng)), f"{env_id}: the script's move was refused"
    assert session.done and session.errors == 0
    assert sorted((session.result(0), session.result(1))) in ([-1, 1], [0, 0])


@pytest.mark.parametrize("env_id", sorted(i for i, n in VERIFIED.items() if n == 1))
def test_every_verified_one_player_id_resets_and_takes_a_move(env_id):
    game = TextArenaGame()
    assert game.reset(env_id=env_id, seed=2)
    result = game.step("[0]")
    assert result.info["game_errors"] == 0 and isinstance(result.reward, float)


def test_the_gateway_refuses_a_game_that_downloads_data_at_submission():
    """confine_env (the gateway's check of a spec's env before submission) asks the game class's
    check_config: a refused env id is one line naming the field; a verified one passes."""
    from opentinker.control.gateway.confine import confine_env
    from opentinker.core.settings import Settings
    from opentinker.core.spec_limits import SpecError

    settings = Settings()
    with pytest.raises(SpecError, match=r"^env\.config: .*Wordle-v0.*NLTK"):
        confine_env(settings, "alice", {"game": "envs.textarena:TextArenaGame", "config": {"env_id": "Wordle-v0"}})
    with pytest.raises(SpecError, match=r"^env\.config: .*one-player game; use envs.textarena:TextArenaGame"):
        confine_env(settings, "alice", {"game": "envs.textarena:TextArenaMatch", "config": {"env_id": "GuessTheNumber-v0"}})
    kept = confine_env(settings, "alice", {"game": "envs.textarena:TextArenaMatch", "config": {"env_id": "TicTacToe-v0"}})
    assert kept["config"] == {"env_id": "TicTacToe-v0"}


def test_self_play_players_that_are_not_the_matchs_are_refused_before_submission_and_on_the_worker():
    """The seats are the match's players: `multiagent.players` left at its default [X, O] for a
    TextArena match (players P0, P1) would leave every match unplayable. The gateway refuses it in
    one line, and so does the self-play job where a spec comes without the gateway."""
    from opentinker.control.gateway.confine import confine_env
    from opentinker.core.settings import Settings
    from opentinker.core.spec import parse_spec
    from opentinker.core.spec_limits import SpecError
    from opentinker.rl.selfplay import SelfPlayJob

    env = {"game": "envs.textarena:TextArenaMatch", "config": {"env_id": "TicTacToe-v0"}}
    with pytest.raises(SpecError, match=r"^multiagent\.players: \['X', 'O'\] are not the players of TextArenaMatch \(P0, P1\)$"):
        confine_env(Settings(), "alice", env, ["X", "O"])
    assert confine_env(Settings(), "alice", env, ["P1", "P0"])["game"] == env["game"]  # either seat first
    spec = parse_spec({"model": {"name": "tiny-random"}, "env": env, "multiagent": {"opponent": "self"}})  # players: the default [X, O]
    with pytest.raises(ValueError, match=r"^multiagent\.players: \['X', 'O'\] are not the players of TextArenaMatch"):
        SelfPlayJob(spec, job_id="players-check")
