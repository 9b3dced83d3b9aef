"""The `opentinker` command line (typer + rich)."""
