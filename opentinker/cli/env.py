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
    game_path: str = typer.Argument(..., help="the game class, 'package.module:ClassName' (e.g. envs.math:MathGame)"),
    host: str = typer.Option("127.0.0.1", help="interface to listen on (0.0.0.0: every interface)"),
    port: int = typer.Option(8300, help="TCP port"),
    token: Optional[list[str]] = typer.Option(None, help="a job token it answers (repeat for several jobs; also "
                                              "OPENTINKER_ENV_TOKENS, comma-separated): submit_job returns the job's token"),
    open_to_all: bool = typer.Option(False, "--open", help="answer anyone who reaches it (no token): for a private network only"),
) -> None:
    """Serve one AbstractGame over HTTP; a job uses it with `env: {url: http://HOST:PORT}`."""
    from opentinker.env.environment import import_game
    from opentinker.env.server import serve as run_server

    try:
        import_game(game_path)  # the user's own code, on the user's machine: no allowlist
    except (ValueError, TypeError) as err:  # a bad import path or not a game: one line, no traceback
        console.print(f"[red]cannot serve {escape(game_path)}:[/] {escape(str(err))}", highlight=False, emoji=False, soft_wrap=True)
        raise typer.Exit(2)
    tokens = list(token or []) + [t.strip() for t in os.environ.get("OPENTINKER_ENV_TOKENS", "").split(",") if t.strip()]
    if not tokens and not open_to_all:
        console.print("give the job token(s) this server answers (--token, or OPENTINKER_ENV_TOKENS), or --open to answer "
                      "anyone who reaches it", style="red", highlight=False)
        raise typer.Exit(2)
    run_server(game_path, host=host, port=port, tokens=tokens or None)
