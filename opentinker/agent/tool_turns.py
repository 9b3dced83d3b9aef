"""Tool turns of the agent loop: when a turn calls tools, the tools answer it, not the game.

An episode's tools are the job's (its spec's `env.tools`: MCP servers, the sandbox's `python`)
and its game's own (`get_tools()`, asked after reset). A turn with a call (or a malformed one) is
answered with `tool` messages rendered by the policy's template and appended as a token delta
(mask 0), and the model goes on; a turn without one goes to the game's `step` as before. Games
without tools never get here.
"""

from __future__ import annotations

from typing import Any

from opentinker.agent.chat import ChatFormat, tool_messages
from opentinker.agent.guard import call_with_timeout
from opentinker.core.trajectory import Trajectory
from opentinker.env.base import AbstractGame
from opentinker.tools.declared import Tool
from opentinker.tools.sources import as_tools, merge_tools
from opentinker.tools.toolbox import ToolBox


def episode_tools(game: AbstractGame, job_tools: list[Tool], max_calls_per_turn: int) -> ToolBox | None:
    """The episode's tools (the job's, then the game's); None when there are none. Asked inside
    the episode's bounded reset, so a game whose get_tools raises costs its episode."""
    own = getattr(game, "get_tools", None)
    game_tools = as_tools(own() if own is not None else [])  # a served game's GameTools become Tools
    tools = merge_tools([job_tools, game_tools], ["the job's env.tools", "the game"])
    return ToolBox(tools, max_calls_per_turn=max_calls_per_turn) if tools else None


def answer_tool_turn(box: ToolBox, chat: ChatFormat, traj: Trajectory, policy_stopped: bool) -> tuple[list[int], str, list[dict]] | None:
    """The tokens, text and `tool` messages that answer the last turn's tool calls; None when it called none."""
    last = traj.turns[-1]
    # a response parser reads the turn after what the template opened it with (e.g. `<think>`): give it the prompt
    prefix = chat.tokenizer.decode(traj.token_ids[: last.sampled_start]) if chat.tools.response_template is not None else ""
    turn = chat.tools.parse(last.action, prefix=prefix)
    if not turn.attempted:
        return None
    results = box.answer(turn, call_with_timeout)
    traj.info.update(box.counts)
    text = "\n".join(f"[{r.name or 'tool'}] {r.content}" for r in results)
    return chat.tool_results_ids(results, policy_stopped), text, tool_messages(results)


def final_counts(box: ToolBox | None, traj: Any) -> None:
    """The episode's tool counts in its info, whoever ended it (a game's own counts are kept beside them)."""
    if box is not None and traj is not None:
        traj.info.update(box.counts)
