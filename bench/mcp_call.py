"""What one MCP tool call costs a job, measured: the round trip of `McpTools.call` (the official `mcp`
SDK over streamable HTTP, one session, its own event-loop thread, the confined client) beside a plain
HTTP POST to a trivial endpoint of the same server (the confined sync httpx client an environment
step uses), in the same run, interleaved call by call.

The server is one uvicorn process of its own (this file, `--serve`): a FastMCP server whose tool
`echo(text)` returns its text, and `POST /echo` answering the same text as JSON. Both clients keep
their connections; the first --warmup calls of each are left out; the median and p90 of --calls are
reported, and the ratio of the medians.

    python bench/mcp_call.py --calls 200
writes bench/results/mcp_call.{json,md}
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TEXT = "the quick brown fox"


def serve(port: int) -> None:
    import uvicorn
    from fastmcp import FastMCP
    from starlette.responses import JSONResponse

    server = FastMCP("bench")

    @server.tool
    def echo(text: str) -> str:
        """Return the text."""
        return text

    @server.custom_route("/echo", methods=["POST"])
    async def plain(request):
        return JSONResponse({"text": (await request.json())["text"]})

    uvicorn.run(server.http_app(path="/mcp"), host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def in_loop(tools, hosts, base: str, n: int) -> tuple[list[float], list[float]]:
    """On the session's own loop: the SDK's call alone, and a POST through the confined async
    transport McpTools uses (where the time goes: the hop between threads, the SDK, the transport)."""
    from opentinker.env.confined_net import confined_async_client

    client, sdk, post = tools._client, [], []
    async with confined_async_client(hosts, flavour="httpx2", base_url=base, timeout=10) as http:
        for _ in range(n):
            start = time.perf_counter()
            await client.call_tool("echo", {"text": TEXT})
            middle = time.perf_counter()
            (await http.post("/echo", json={"text": TEXT})).raise_for_status()
            sdk.append(middle - start)
            post.append(time.perf_counter() - middle)
    return sdk, post


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="measured calls of each kind")
    parser.add_argument("--warmup", type=int, default=20, help="calls of each kind left out first")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.serve:
        return serve(a.serve)

    from opentinker.core.env_hosts import EnvHosts
    from opentinker.env.confined_net import confined_client
    from opentinker.inference.launch import free_port
    from opentinker.tools.mcp import McpTools

    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port)], cwd=ROOT)
    hosts = EnvHosts.parse("127.0.0.0/8")
    base = f"http://127.0.0.1:{port}"
    try:
        plain = confined_client(hosts, base_url=base, timeout=10, headers={"Accept-Encoding": "identity"})
        deadline = time.monotonic() + 60
        while True:
            try:
                plain.post("/echo", json={"text": TEXT}).raise_for_status()
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the bench server did not start") from None
                time.sleep(0.2)
        tools = McpTools(f"{base}/mcp", hosts, timeout_s=10)
        (echo,) = tools.tools()
        mcp_s, post_s = [], []
        for i in range(a.warmup + a.calls):
            start = time.perf_counter()
            assert echo.run({"text": TEXT}) == TEXT
            middle = time.perf_counter()
            assert plain.post("/echo", json={"text": TEXT}).json()["text"] == TEXT
            end = time.perf_counter()
            if i >= a.warmup:
                mcp_s.append(middle - start)
                post_s.append(end - middle)
        protocol = tools._client.protocol_version
        sdk_s, async_post_s = tools._run(in_loop(tools, hosts, base, a.warmup + a.calls), 600)
        sdk_s, async_post_s = sdk_s[a.warmup:], async_post_s[a.warmup:]
        tools.close()
        plain.close()
    finally:
        proc.terminate()
        proc.wait(10)
    rows = [{"way": way, "median_ms": 1e3 * statistics.median(v), "p90_ms": 1e3 * percentile(v, 0.9), "min_ms": 1e3 * min(v)}
            for way, v in (("MCP tools/call (McpTools.call)", mcp_s), ("plain HTTP POST (confined httpx)", post_s),
                           ("  the SDK's call_tool on the session's loop (no thread hop)", sdk_s),
                           ("  async POST through the confined httpx2 transport", async_post_s))]
    ratio = rows[0]["median_ms"] / rows[1]["median_ms"]
    for r in rows:
        print(f"{r['way']}: median {r['median_ms']:.2f} ms, p90 {r['p90_ms']:.2f} ms, min {r['min_ms']:.2f} ms")
    print(f"MCP call median over plain POST median: {ratio:.2f}x (MCP protocol {protocol})")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": f"python bench/mcp_call.py --calls {a.calls}", "machine": platform.processor() or platform.machine(),
            "python": platform.python_version(), "mcp_protocol": protocol, "calls": a.calls, "warmup": a.warmup,
            "ratio_mcp_over_post": ratio, "rows": rows}
    (out / "mcp_call.json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = ["# One MCP tool call's round trip, beside a plain HTTP POST", "",
             f"`{meta['command']}` (one run, loopback, server in its own process; MCP protocol {protocol}; "
             f"{a.calls} calls of each, interleaved, after {a.warmup} left out)", "",
             "| way | median (ms) | p90 (ms) | min (ms) |", "|---|---:|---:|---:|"]
    lines += [f"| {r['way']} | {r['median_ms']:.2f} | {r['p90_ms']:.2f} | {r['min_ms']:.2f} |" for r in rows]
    lines += ["", f"MCP call median over plain POST median: {ratio:.2f}x", ""]
    (out / "mcp_call.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
