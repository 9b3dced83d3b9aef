"""TextArena games, unmodified: one-player games (and two-player ones against a scripted
opponent) as `TextArenaGame`, two-player games as the self-play match `TextArenaMatch`. Only env
ids verified to run offline are played; the rest are refused with the reason (see registry).
textarena itself is imported when a game starts, not here: a spec is checked without it."""

from envs.textarena.game import TextArenaGame
from envs.textarena.match import TextArenaMatch
from envs.textarena.opponents import random_opponent
from envs.textarena.registry import REFUSED, VERIFIED, check_spec_env, refusal

__all__ = ["REFUSED", "VERIFIED", "TextArenaGame", "TextArenaMatch", "check_spec_env", "random_opponent", "refusal"]
