"""Tools an agent may call: declared (OpenAI function schemas), rendered with the policy's chat
template, parsed from what the model wrote, and called (a game's own, MCP servers', the sandbox's
`python`). The agent loop asks this layer once per turn (opentinker/agent/tool_turns.py)."""
