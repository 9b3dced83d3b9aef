"""The units MCP server (FastMCP, streamable HTTP at /mcp): `convert` answers what the table knows.

    python -m envs.units.server --port 8400      # then env.tools: [{mcp: http://127.0.0.1:8400/mcp}]
"""

from __future__ import annotations

import argparse

from fastmcp import FastMCP

from envs.units.table import FACTORS, convert as convert_units


def app() -> FastMCP:
    server = FastMCP("units")

    @server.tool
    def convert(value: int, from_unit: str, to_unit: str) -> str:
        """Convert an amount from one unit to another (units: grain, zorb, flarn, quib, snark, blick, wump, trell)."""
        result = convert_units(value, from_unit, to_unit)
        return str(int(result)) if result == int(result) else f"{result:.4f}"

    @server.tool
    def list_units() -> str:
        """The units this server converts between."""
        return ", ".join(FACTORS)

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8400)
    args = parser.parse_args()
    app().run(transport="http", host=args.host, port=args.port, show_banner=False)


if __name__ == "__main__":
    main()
