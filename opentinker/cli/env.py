"""`opentinker env …`: serve a game over HTTP so that jobs use it by URL (`env.url`)."""

from __future__ import annotations

import os
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

env_app = typer.Typer(help="Environments")
console = Console(stderr=True)


@env_app.command()
def serve(
    game_path: str = typer.Argument(..., help="the game class, 'package.module:ClassName' (e.g. envs.math:MathGame); "
                                    "with --openenv an OpenEnv Environment class"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8300, help="TCP port"),
    token: Optional[list[str]] = typer.Option(None, help="a job token it answers (repeat for several jobs; also "
                                              "OPENTINKER_ENV_TOKENS, comma-separated): submit_job returns the job's token"),
    open_to_all: bool = typer.Option(False, "--open", help="answer anyone who reaches it (no token): for a private network only"),
    openenv: bool = typer.Option(False, "--openenv", help="GAME_PATH is an OpenEnv Environment class: serve it with OpenEnv's "
                                 "own app (its clients and jobs with env.protocol: openenv use it); needs openenv-core"),
    action: Optional[str] = typer.Option(None, help="--openenv: its Action class, when step's annotations do not say"),
    observation: Optional[str] = typer.Option(None, help="--openenv: its Observation class, when step's annotations do not say"),
    max_sessions: Optional[int] = typer.Option(None, min=1, help="--openenv: concurrent episodes (default 64 when the class "
                                               "supports concurrent sessions, else 1)"),
) -> None:
    """Serve one AbstractGame over HTTP; a job uses it with `env: {url: http://HOST:PORT}` (an OpenEnv
    environment with --openenv: `env: {url: http://HOST:PORT, protocol: openenv}`)."""
    tokens = list(token or []) + [t.strip() for t in os.environ.get("OPENTINKER_ENV_TOKENS", "").split(",") if t.strip()]
    try:
        if openenv:
            from opentinker.env.openenv_server import create_openenv_app, import_class, serve_openenv

            create_openenv_app(import_class(game_path, "environment"), action and import_class(action, "--action"),
                               observation and import_class(observation, "--observation"), max_sessions=max_sessions)
        else:
            from opentinker.env.environment import import_game

            import_game(game_path)  # the user's own code, on the user's machine: no allowlist
    except ImportError as err:  # openenv-core itself is missing
        console.print(f"[red]cannot serve {escape(game_path)}:[/] {escape(str(err))} (pip install 'opentinker[openenv]')",
                      highlight=False, emoji=False, soft_wrap=True)
        raise typer.Exit(2)
    except (ValueError, TypeError) as err:  # a bad import path, not a game, OpenEnv's concurrency refusal: one line, no traceback
        console.print(f"[red]cannot serve {escape(game_path)}:[/] {escape(str(err))}", highlight=False, emoji=False, soft_wrap=True)
        raise typer.Exit(2)
    if not tokens and not open_to_all:
        console.print("give the job token(s) this server answers (--token, or OPENTINKER_ENV_TOKENS), or --open to answer "
                      "anyone who reaches it", style="red", highlight=False)
        raise typer.Exit(2)
    if openenv:
        serve_openenv(game_path, host=host, port=port, tokens=tokens or None, action=action, observation=observation, max_sessions=max_sessions)
    else:
        from opentinker.env.server import serve as run_server

        run_server(game_path, host=host, port=port, tokens=tokens or None)
