"""The tools a job's spec gives every episode (`env.tools`, core/tool_spec.py), made once when the
job starts: an MCP server's tools listed then (a server that cannot be listed fails the job's
start in one line), the sandbox's `python` checked then (bubblewrap missing: one line naming the
package). `close()` ends the MCP sessions."""

from __future__ import annotations

from typing import Any

from opentinker.tools.declared import Tool
from opentinker.tools.sources import merge_tools
from opentinker.tools.toolbox import checked_tools


class JobTools:
    def __init__(self, sources: list[Any], hosts: Any, max_response_bytes: int | None = None):
        self.tools: list[Tool] = []
        self._open: list[Any] = []
        try:
            made = [self._made(source, hosts, max_response_bytes) for source in sources]
            labels = [source.mcp if getattr(source, "mcp", None) else "the python tool" for source in sources]
            self.tools = checked_tools(merge_tools(made, labels))  # two servers' tools of one name: refused here, naming both
        except BaseException:
            self.close()
            raise

    def _made(self, source: Any, hosts: Any, max_response_bytes: int | None) -> list[Tool]:
        if getattr(source, "mcp", None):
            from opentinker.tools.mcp import McpTools

            kwargs = {"max_response_bytes": max_response_bytes} if max_response_bytes else {}
            server = McpTools(source.mcp, hosts, timeout_s=source.timeout_s, **kwargs)
            self._open.append(server)
            return server.tools()
        from opentinker.tools.sandbox import Sandbox, SandboxLimits, python_tool

        return [python_tool(Sandbox(SandboxLimits(**source.python.model_dump())))]

    def close(self) -> None:
        for server in self._open:
            try:
                server.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
        self._open = []
