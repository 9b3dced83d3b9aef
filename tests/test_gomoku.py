"""Gomoku: the rules engine, the move parser, invalid-move handling, the scripted opponents, the
two-player match and one episode through the real agent loop."""

import random

import numpy as np
import pytest

from envs.gomoku import (
    Board,
    GomokuGame,
    GomokuMatch,
    GomokuSelfPlay,
    greedy_opponent,
    parse_move,
    random_opponent,
)
from opentinker.env.environment import GameEnvironment

DIRECTIONS = {"horizontal": (0, 1), "vertical": (1, 0), "diagonal": (1, 1), "anti-diagonal": (1, -1)}


def scripted(moves):
    """An opponent that plays the given cells in order (tests only)."""
    it = iter(moves)
    return lambda board, player, rng: next(it)


# -- board ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [3, 4, 5])
@pytest.mark.parametrize("direction", DIRECTIONS)
def test_a_line_of_win_length_wins_in_every_direction(direction, k):
    dr, dc = DIRECTIONS[direction]
    board = Board(size=9, win_length=k)
    start = (2, 6) if dc < 0 else (2, 2)
    line = [(start[0] + i * dr, start[1] + i * dc) for i in range(k)]
    # the completing stone goes in the middle: detection must scan both ways from the last move
    order = line[: k // 2] + line[k // 2 + 1 :] + [line[k // 2]]
    for row, col in order[:-1]:
        board.play(row, col, 2)
        assert board.winner() == 0
    board.play(*order[-1], 2)
    assert board.winner() == 2 and not board.full()


def test_a_broken_line_does_not_win():
    board = Board(size=9, win_length=5)
    for col in (0, 1, 3, 4):
        board.play(0, col, 1)
    board.play(0, 2, 2)
    board.play(0, 5, 1)
    assert board.winner() == 0
    with pytest.raises(ValueError):
        board.play(0, 0, 2)  # occupied: the engine refuses, callers validate first
    with pytest.raises(ValueError):
        board.play(9, 0, 2)


def test_render_copy_and_to_list():
    board = Board(size=3, win_length=3)
    board.play(0, 1, 1)
    board.play(2, 2, 2)
    assert board.render() == "  0 1 2\n0 . X .\n1 . . .\n2 . . O"
    copy = board.copy()
    copy.play(1, 1, 1)
    assert board.to_list() == [[0, 1, 0], [0, 0, 0], [0, 0, 2]] and copy.to_list()[1][1] == 1


# -- parser --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, move",
    [
        ("4,4", (4, 4)),
        ("3 5", (3, 5)),
        ("(2, 7)", (2, 7)),
        ("Move: 1,0", (1, 0)),
        ("I considered 2,2 but Move: 6, 3.", (6, 3)),  # the last pair counts
        ("(1,1) or (8, 8)", (8, 8)),
        ("-1,2", (-1, 2)),  # kept, to be reported as off the board
        ("Move: 12,3", (12, 3)),
        ("", None),
        ("no idea", None),
        ("Move: 4", None),
        ("3.5, 2", None),
        ("123456,3", None),
    ],
)
def test_parse_move(text, move):
    assert parse_move(text) == move


# -- invalid moves -------------------------------------------------------------------------
def test_invalid_moves_are_retried_up_to_max_illegal_then_lose():
    game = GomokuGame(max_illegal=2)
    game.reset(seed=1, model_plays="X")
    first = game.step("I will win")
    assert not first.done and first.reward == 0.0 and "no move found" in first.observation
    assert "  0 1 2 3 4 5 6 7 8" in first.observation  # the board is shown again
    assert first.info == {"illegal_moves": 1, "moves": 0, "result": None, "correct": False, "game_length": 0,
                          "state": game.match.board.render()}  # the board it moves on: its state for step-level groups
    second = game.step("Move: -1,4")
    assert second.info["state"] == first.info["state"]  # an illegal move leaves the state as it was, whatever the message
    assert not second.done and "off the board" in second.observation and second.info["illegal_moves"] == 2
    legal = game.step("Move: 4,4")  # a legal move in between does not reset the count
    assert not legal.done and legal.info["moves"] == 1 and legal.info["game_length"] == 2
    occupied = game.step("Move: 4,4")
    assert occupied.done and occupied.reward == -1.0 and "already taken" in occupied.observation
    assert occupied.info == {"illegal_moves": 3, "moves": 1, "result": "loss", "correct": False, "game_length": 2,
                             "state": legal.info["state"]}


def test_match_forfeit_with_no_invalid_moves_allowed():
    match = GomokuMatch(size=5, win_length=4, max_illegal=0)
    legal, message = match.apply("X", "pass")
    assert not legal and match.finished and "You lose" in message
    assert match.result_for("X") == -1 and match.result_for("O") == 1 and match.illegal_moves == {1: 1, 2: 0}


# -- two-player match ----------------------------------------------------------------------
def test_scripted_match_gives_the_winner_plus_one_and_the_loser_minus_one():
    match = GomokuMatch(size=9, win_length=5)
    assert "Your move (X)" in match.observation_for("X") and "Waiting for X" in match.observation_for(2)
    with pytest.raises(ValueError):
        match.apply("O", "0,0")  # out of turn: a caller's bug, not the model's
    for col in range(4):
        assert match.apply("X", f"Move: 0,{col}")[0]
        assert match.apply("O", f"({1}, {col})")[0]
        assert not match.finished and match.result_for("X") == 0
    legal, message = match.apply(1, "Move: 0,4")
    assert legal and match.finished and "You win" in message
    assert match.result_for("X") == 1 and match.result_for("O") == -1 and match.winner == 1
    assert "You lose: X has 5 in a row." in match.observation_for("O")
    with pytest.raises(ValueError):
        match.apply("O", "5,5")


def test_full_board_without_a_line_is_a_draw():
    # final position:  X O X / X O O / O X X  (no three in a row)
    x_moves, o_moves = [(0, 0), (0, 2), (1, 0), (2, 1), (2, 2)], [(0, 1), (1, 1), (1, 2), (2, 0)]
    match = GomokuMatch(size=3, win_length=3)
    for i, (row, col) in enumerate(x_moves):
        assert match.apply("X", f"{row},{col}")[0]
        if i < len(o_moves):
            assert match.apply("O", f"{o_moves[i][0]} {o_moves[i][1]}")[0]
    assert match.finished and match.board.full() and match.board.winner() == 0
    assert match.result_for("X") == match.result_for("O") == 0
    assert "Draw" in match.observation_for("O")


# -- opponents -----------------------------------------------------------------------------
def test_greedy_takes_a_win_before_blocking_and_blocks_a_threat():
    board = Board(size=9, win_length=5)
    for col in range(4):
        board.play(0, col, 1)  # X threatens 0,4
        board.play(8, col + 1, 2)  # O can win at 8,0 or 8,5
    for seed in range(5):
        assert greedy_opponent(board, 2, np.random.default_rng(seed)) in {(8, 0), (8, 5)}
    board = Board(size=9, win_length=5)
    for row in range(1, 5):
        board.play(row, 4, 1)  # X threatens 0,4 and 5,4
    board.play(5, 4, 2)
    for seed in range(5):
        assert greedy_opponent(board, 2, np.random.default_rng(seed)) == (0, 4)
    assert greedy_opponent(board, 2, random.Random(0)) == (0, 4)  # either rng API


def test_opponents_play_legal_moves_deterministically():
    board = Board(size=5, win_length=4)
    board.play(2, 2, 1)
    for opponent in (random_opponent, greedy_opponent):
        moves = {opponent(board, 2, np.random.default_rng(3)) for _ in range(3)}
        assert len(moves) == 1 and board.legal(*moves.pop())
    assert len(board.moves) == 1  # opponents never touch the board


# -- the game against an opponent ----------------------------------------------------------
def test_model_as_o_lets_the_opponent_open():
    game = GomokuGame(opponent="greedy")
    observation = game.reset(seed=5, model_plays="O")
    assert observation.startswith("You play O; the opponent (X) opened at")
    assert sum(line.count("X") for line in observation.splitlines()[2:11]) == 1
    assert len(game.match.board.moves) == 1 and game.match.turn == 2
    result = game.step("Move: 0,0")
    assert not result.done and "The opponent (X) played" in result.observation and result.info["game_length"] == 3


def test_win_and_loss_rewards():
    win = GomokuGame()
    win.reset(seed=0, model_plays="X")
    win.opponent = scripted([(8, c) for c in range(9)])
    steps = [win.step(f"Move: 0,{c}") for c in range(5)]
    assert [s.reward for s in steps] == [0, 0, 0, 0, 1.0] and steps[-1].done and not steps[-2].done
    assert steps[-1].info == {"illegal_moves": 0, "moves": 5, "result": "win", "correct": True, "game_length": 9,
                              "state": win.match.board.render()}

    loss = GomokuGame(model_plays="O")  # the constructor's side overrides the task's
    loss.opponent = scripted([(4, c) for c in range(9)])
    assert loss.reset(seed=0, model_plays="X").startswith("You play O")
    steps = [loss.step(f"{r},0") for r in range(4)]
    assert steps[-1].done and steps[-1].reward == -1.0 and steps[-1].info["result"] == "loss"
    assert "You lose: X has 5 in a row." in steps[-1].observation


def test_tasks_and_play_are_deterministic_for_a_seed():
    tasks = [GomokuGame.generate_task(np.random.default_rng(7), model_plays="random") for _ in range(2)]
    assert tasks[0] == tasks[1] and set(tasks[0]) == {"seed", "model_plays"}
    sides = {GomokuGame.generate_task(np.random.default_rng(s), model_plays="random")["model_plays"] for s in range(20)}
    assert sides == {"X", "O"}

    def play(task):
        game = GomokuGame(opponent="random")
        out = [game.reset(**task)]
        for r in range(9):
            result = game.step(f"Move: {r},{r}")
            out.append(result.observation)
            if result.done:
                break
        return out

    task = {"seed": 11, "model_plays": "O"}
    assert play(task) == play(task) and play(task) != play({"seed": 12, "model_plays": "O"})


def test_environment_serves_gomoku_tasks():
    env = GameEnvironment(GomokuGame, {"model_plays": "random", "val_size": 8, "seed": 1, "game_kwargs": {"opponent": "greedy"}})
    val = env.validation_tasks()
    assert len(val) == 8 and {t["model_plays"] for t in val} <= {"X", "O"}
    game = env.make_game()
    assert game.opponent is greedy_opponent and "Move: 4,4" in game.get_system_prompt()
    with pytest.raises(ValueError):
        GomokuGame(opponent="minimax")


# -- through the agent loop ----------------------------------------------------------------
def test_an_episode_through_the_agent_loop_with_a_random_model(tiny):
    import torch

    from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
    from opentinker.backend import HFRolloutEngine, SamplingParams

    model, tok = tiny
    torch.manual_seed(0)
    games = [GomokuGame(opponent="greedy", max_illegal=2) for _ in range(2)]
    tasks = [{"seed": 0, "model_plays": "X"}, {"seed": 1, "model_plays": "O"}]
    trajs = run_episodes(
        HFRolloutEngine(model, tok), ChatFormat(tok), games, tasks,
        SamplingParams(max_new_tokens=6, temperature=1.0), EpisodeLimits(max_turns=4, max_total_tokens=2048),
    )
    for traj in trajs:
        assert not traj.failed, traj.failure
        assert traj.stop_reason in ("done", "max_turns") and 1 <= len(traj.turns) <= 4
        assert set(traj.info) == {"illegal_moves", "moves", "result", "correct", "game_length"}
        if traj.info["illegal_moves"] > 2:  # the usual fate of random text: a loss by invalid moves
            assert traj.stop_reason == "done" and traj.info["result"] == "loss" and traj.reward == -1.0
    assert any(t.info["result"] == "loss" and t.reward == -1.0 for t in trajs)


# -- example exchanges (few_shot) --------------------------------------------------------------
def test_few_shot_example_is_a_real_opening_played_by_the_rules():
    from envs.gomoku.examples import game_example

    assert GomokuGame(size=6, win_length=4).get_example_turns() == []
    turns = GomokuGame(size=6, win_length=4, few_shot=1).get_example_turns()
    assert [m["role"] for m in turns] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in turns[1::2]] == ["Move: 2,2", "Move: 2,3"]
    # replaying the example's moves against the same environment gives the same observations
    game = GomokuGame(size=6, win_length=4, opponent="random")
    for seed in range(100):
        if game.reset(seed=seed) == turns[0]["content"] and game.step("Move: 2,2").observation == turns[2]["content"]:
            break
    else:
        pytest.fail("no opponent seed reproduces the example's observations")
    assert game_example(6, 4, 2) == turns
    with pytest.raises(ValueError, match="few_shot"):
        GomokuGame(few_shot=3)


def test_selfplay_examples_show_each_player_its_own_moves():
    match = GomokuSelfPlay(size=6, win_length=4, few_shot=1)
    for player in ("X", "O"):
        turns = match.example_turns(player)
        assert [m["role"] for m in turns] == ["user", "assistant", "user", "assistant"]
        assert all(m["content"].startswith(f"You play {player}.") for m in turns[::2])
        assert f"Your move ({player})." in turns[0]["content"]
        assert [m["content"] for m in turns[1::2]] == ["Move: 2,2", "Move: 2,3"]
    assert GomokuSelfPlay(size=6, win_length=4).example_turns("X") == []
    assert match.board.moves == []  # building examples never touches the live board


def test_selfplay_prompt_carries_the_example_and_the_record_stays_exact(tiny):
    import torch

    from opentinker.agent import ChatFormat, EpisodeLimits
    from opentinker.agent.selfplay import Seat, play_matches
    from opentinker.backend import HFRolloutEngine, SamplingParams

    model, tok = tiny
    torch.manual_seed(0)
    chat = ChatFormat(tok)
    seat = Seat(HFRolloutEngine(model, tok), chat)
    matches = [GomokuSelfPlay(size=5, win_length=4, few_shot=1) for _ in range(2)]
    records = play_matches({"X": seat, "O": seat}, matches, SamplingParams(max_new_tokens=6, temperature=1.0),
                           EpisodeLimits(max_turns=4, max_total_tokens=4096))
    for player in ("X", "O"):
        for match, traj in zip(matches, records[player]):
            if traj is None:
                continue
            examples = match.example_turns(player)
            first = [{"role": "system", "content": match.system_prompt(player)}, *examples, traj.messages[len(examples) + 1]]
            assert traj.messages[: len(first)] == first
            assert traj.prompt_ids == chat.prompt_ids(first)
            sampled = {k for t in traj.turns for k in range(t.sampled_start, t.sampled_end)}
            assert traj.loss_mask == [1 if k in sampled else 0 for k in range(len(traj))]
