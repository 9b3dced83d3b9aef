"""Shipped environments: math (strict answer format), math_tool (a declared calculator tool the agent
loop answers, several turns), gomoku (self-play), shapes and geometry (pictures, for
vision-language policies), toy (pipeline smoke test)."""
