"""A transport fault costs a retry, not a job (opentinker/core/own_servers.py): a server that closes
an idle connection just as the client reuses it (the race that failed `make demo` twice), a request
that cannot be repeated, a server that is gone, and a server whose engine died. The same against a
real vLLM server is in tests/test_vllm_rollouts.py."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from opentinker.core.own_servers import CLIENT_KEEP_ALIVE_S, SERVER_KEEP_ALIVE_S, OwnServer, RequestLost, ServerGone, own_client


class ClosingAtReuse:
    """An HTTP/1.1 server that answers the first request of each connection (keep-alive) and meets
    the next one on it as a server whose keep-alive just ran out does: it closes the connection,
    either cleanly before any reply (httpx: RemoteProtocolError) or with a reset (ReadError).
    `/health` answers `health` (200 while alive)."""

    def __init__(self, health: int = 200):
        self.health, self.reuses, self.fresh = health, 0, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    @staticmethod
    def _read_request(conn: socket.socket) -> tuple[str, bytes] | None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return None
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        length = next((int(line.split(":")[1]) for line in lines if line.lower().startswith("content-length")), 0)
        while len(body) < length:
            body += conn.recv(65536)
        return lines[0].split()[1], body

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            first = self._read_request(conn)
            if first is None:
                return
            path, body = first
            self.fresh += 1
            status, payload = (self.health, b"") if path == "/health" else (200, json.dumps({"echo": json.loads(body or b"null")}).encode())
            conn.sendall(f"HTTP/1.1 {status} X\r\nContent-Length: {len(payload)}\r\nContent-Type: application/json\r\n\r\n".encode() + payload)
            if self._read_request(conn) is None:
                return
            self.reuses += 1
            if self.reuses % 2:  # a reset: the client reads ECONNRESET
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def test_keep_alive_cannot_race():
    """Every server started here keeps an idle connection longer than its clients do."""
    assert CLIENT_KEEP_ALIVE_S < SERVER_KEEP_ALIVE_S / 2
    with own_client("http://127.0.0.1:1") as client:
        assert client._transport._pool._keepalive_expiry == CLIENT_KEEP_ALIVE_S


def test_a_connection_closed_at_its_reuse_costs_a_retry_in_500_reuses():
    """500 requests, each on a connection the server closes as it is reused (a clean close or a
    reset, alternating): every one answered, each retried once on a fresh connection."""
    server = ClosingAtReuse()
    client = own_client(server.url, max_connections=1)
    calls = OwnServer(client, "the test server")
    try:
        for i in range(1001):
            reply = calls.call("POST", "/echo", repeatable=True, json={"i": i})
            assert reply.json() == {"echo": {"i": i}}  # the retry's connection is not pooled: every other call reuses one
    finally:
        client.close()
        server.close()
    assert server.reuses >= 500 and calls.retried == server.reuses


def test_a_request_that_cannot_be_repeated_is_not():
    server = ClosingAtReuse()
    client = own_client(server.url, max_connections=1)
    calls = OwnServer(client, "the test server")
    try:
        calls.call("POST", "/step", repeatable=False, json={})
        with pytest.raises(RequestLost, match=r"^POST /step to the test server failed in transport \(\w+\) though the server is "
                                              r"alive, and cannot be repeated safely$"):
            calls.call("POST", "/step", repeatable=False, json={})
    finally:
        client.close()
        server.close()
    assert server.fresh == 2 and calls.retried == 0  # the second connection was the health check's


def test_a_server_gone_is_server_gone_with_how_it_ended():
    """A server whose process ended: its own words; one whose engine died (health 503): that, and the cause."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    client = own_client(f"http://127.0.0.1:{port}")
    with pytest.raises(ServerGone, match=r"^the test server is gone: it was killed by signal SIGKILL; run the job id again"):
        OwnServer(client, "the test server", ended=lambda: "it was killed by signal SIGKILL").call("GET", "/v1/models", repeatable=True)
    with pytest.raises(ServerGone, match=r"^the test server is gone: it does not answer its health check \(ConnectError\); "):
        OwnServer(client, "the test server").call("GET", "/v1/models", repeatable=True)
    client.close()
    dead = ClosingAtReuse(health=503)
    client = own_client(dead.url, max_connections=1)
    calls = OwnServer(client, "the test server", cause=lambda: "RuntimeError: EngineCore died")
    try:
        calls.call("GET", "/v1/models", repeatable=True)
        with pytest.raises(ServerGone, match=r"^the test server is gone: its health check answers 503 \(its engine died\): "
                                             r"RuntimeError: EngineCore died; run the job id again to resume from its last checkpoint$"):
            calls.call("GET", "/v1/models", repeatable=True)
    finally:
        client.close()
        dead.close()


def test_without_the_retry_the_same_server_fails():
    """The server above does fail a plain pooled client at every reuse (the test above is not empty)."""
    server = ClosingAtReuse()
    try:
        with httpx.Client(base_url=server.url, trust_env=False, limits=httpx.Limits(max_connections=1)) as client:
            client.post("/echo", json={})
            with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
                client.post("/echo", json={})
    finally:
        server.close()
