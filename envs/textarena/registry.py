"""Which TextArena env ids run here, and why the others are refused (no textarena import: the
gateway checks a spec with these tables alone, before any worker imports the game).

Verified means: with textarena 0.7.4 on Python 3.11 and no network (checked under `unshare -n`),
the game resets and plays to its end with random bracketed moves, with no error from the game's
code; a two-player id also with the scripted opponent (opponents.py) on both seats and none of its
moves refused. tests/test_textarena.py re-checks every id (one-player: a reset and a move).
Everything else is refused with a one-line reason naming the id.
"""

from __future__ import annotations

import re
from functools import lru_cache

TEXTARENA_VERSION = "0.7.4"


def _ids(family: str, *suffixes: str) -> list[str]:
    return [f"{family}-v0{s}" for s in suffixes]


_ONE_PLAYER = [
    *_ids("2048", "-ultra-easy", "-mega-easy", "-super-easy", "-very-easy", "-easy", "", "-3x3"),
    *_ids("Bandit", "", "-hard"),
    *_ids("Blackjack", "", "-long"),
    *_ids("FifteenPuzzle", ""),
    *_ids("FrozenLake", "", "-random", "-hardcore"),
    *_ids("GuessTheNumber", "", "-hardcore"),
    *_ids("LightsOut", ""),
    *_ids("LogicPuzzle", "", "-hard"),
    *_ids("Mastermind", "", "-hard", "-extreme"),
    *_ids("Minesweeper", "", "-small", "-medium", "-hard"),
    *_ids("PegJump", ""),
    *_ids("Secretary", "", "-long"),
    *_ids("Sudoku", "-very-easy", "-easy", "", "-medium"),
    *_ids("ThreeCardMonte", ""),
    *_ids("TowerOfHanoi", "", "-medium", "-hard", "-hardcore", "-extreme"),
]
_TWO_PLAYERS = [
    *_ids("Breakthrough", "-tiny", "-small", "", "-large", "-long"),
    *_ids("ColonelBlotto", "-small", "", "-large", "-extreme"),
    *_ids("ConnectFour", "", "-blind", "-large"),
    *_ids("IteratedMatchingPennies", ""),
    *_ids("IteratedPrisonersDilemma", ""),
    *_ids("IteratedRockPaperScissors", ""),
    *_ids("KuhnPoker", "", "-short", "-medium", "-long", "-extreme"),
    *_ids("Nim", "", "-medium", "-large"),
    *_ids("Othello", "-tiny", "-small", "", "-big", "-hard"),
    *_ids("SimpleTak", "", "-medium", "-large"),
    *_ids("TicTacToe", ""),
    *_ids("UltimateTicTacToe", ""),
]
VERIFIED: dict[str, int] = {**{i: 1 for i in _ONE_PLAYER}, **{i: 2 for i in _TWO_PLAYERS}}
"""Env id -> number of players, for the ids verified to run offline here."""

_NLTK = "downloads NLTK data (the 'words' corpus and more) when it is imported or reset, which a worker without internet cannot fetch"
_ONLINE = "asks an online model (OpenRouter) to act as game master or jury, which needs the internet and an API key"
_PY312 = "its module does not compile on Python 3.11 (textarena 0.7.4 uses Python 3.12 f-string syntax)"
_MISSING = "files it reads are missing from the textarena 0.7.4 package"
_SWAPPED = ("textarena 0.7.4 passes its arguments to set_invalid_move in the wrong order, so an invalid move makes the "
            "reward the reason's text")
_MANY = "has more than two players; only one- and two-player games are adapted"
REFUSED: dict[str, str] = {
    **dict.fromkeys(["Codenames", "DontSayIt", "Hangman", "LetterAuction", "SpellingBee", "WordChains", "WordLadder",
                     "WordSearch", "Wordle"], _NLTK),
    "Crosswords": f"{_NLTK}, and {_ONLINE}",
    **dict.fromkeys(["Debate", "GuessWho", "ScenarioPlanning", "TwentyQuestions"], _ONLINE),
    **dict.fromkeys(["Checkers", "Chess", "IteratedStagHunt", "Klondike", "ReverseTicTacToe", "UltimateTexasHoldem"], _PY312),
    **dict.fromkeys(["Countdown", "Cryptarithm"], _SWAPPED),
    **dict.fromkeys(["ScorableGames", "UsedCar", "UsedCarNegotiation"], _MISSING),
    "BabyAiText": "needs the gym and BabyAI packages, which are not installed",
    **dict.fromkeys(["CharacterConclave", "MarketEntryGame", "PublicGoodsGame", "SecretMafia", "SettlersOfCatan", "Taboo",
                     "ThreePlayerGOPS", "ThreePlayerIPD", "ThreePlayerTicTacToe"], _MANY),
}
"""Env family (the id before '-v0') -> why none of its ids runs here."""


def family(env_id: str) -> str:
    """'Wordle-v0-hardcore' -> 'Wordle'."""
    found = re.match(r"^(.*?)-v\d", env_id)
    return found.group(1) if found else env_id


def refusal(env_id: object, players: int | None = None) -> str | None:
    """Why `env_id` cannot be played here with `players` players (None: either), as one line
    naming it; None when it can."""
    if not isinstance(env_id, str) or not env_id:
        return f"env_id: give a TextArena env id as text, e.g. 'TicTacToe-v0' (got {env_id!r})"
    reason = REFUSED.get(family(env_id))
    if reason:
        return f"TextArena env {env_id!r} is refused: {reason}"
    if env_id not in VERIFIED:
        return (f"TextArena env {env_id!r} is refused: it is not among the {len(VERIFIED)} env ids verified to run offline "
                "here (envs.textarena.registry.VERIFIED)")
    if players is not None and VERIFIED[env_id] != players:
        have = "a one-player game" if VERIFIED[env_id] == 1 else "a two-player game"
        use = ("envs.textarena:TextArenaGame" if VERIFIED[env_id] == 1
               else "envs.textarena:TextArenaMatch (or TextArenaGame against a scripted opponent)")
        return f"TextArena env {env_id!r} is {have}; use {use}"
    return None


@lru_cache(maxsize=1)
def installed_refusal() -> str | None:
    """Why textarena cannot be used on this machine (not installed, another version), or None."""
    from importlib import metadata

    try:
        version = metadata.version("textarena")
    except metadata.PackageNotFoundError:
        return f"the textarena package is not installed here (pip install textarena=={TEXTARENA_VERSION})"
    if version != TEXTARENA_VERSION:
        return f"textarena {version} is installed; the env ids here were verified with {TEXTARENA_VERSION}"
    return None


GAMES: dict[str, int | None] = {"envs.textarena:TextArenaGame": None, "envs.textarena:TextArenaMatch": 2}
"""The adapters' import paths -> the players their env ids must have (None: one or two)."""


def config_refusal(config: object, players: int | None) -> str | None:
    """Why a spec's `env.config` names no playable `env_id` (the tasks carry it), or None; also
    when textarena is missing or another version."""
    config = config if isinstance(config, dict) else {}
    return refusal(config.get("env_id"), players) or installed_refusal()


def check_spec_env(game: str, config: object) -> None:
    """The submission check for a spec whose `env.game` is one of GAMES: ValueError with the one-line
    reason (what a spec validator calls; it imports no textarena and runs no game)."""
    if game in GAMES and (reason := config_refusal(config, GAMES[game])):
        raise ValueError(reason)
