"""`opentinker env …`: serve a game over HTTP so that jobs use it by URL (`env.url`)."""

from __future__ import annotations

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
) -> None:
    """Serve one AbstractGame over HTTP; a job uses it with `env: {url: http://HOST:PORT}`."""
    from opentinker.env.server import serve as run_server

    try:
        run_server(game_path, host=host, port=port)
    except (ValueError, TypeError) as err:  # a bad import path or not a game: one line, no traceback
        console.print(f"[red]cannot serve {escape(game_path)}:[/] {escape(str(err))}", highlight=False, emoji=False, soft_wrap=True)
        raise typer.Exit(2)
