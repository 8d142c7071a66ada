"""The agent worker tries a gateway request again when the gateway could not take it yet (502/503/504,
as while its Redis restarts) or refused the connection, and never on a refusal of the request itself;
it keeps to the bound. Against a small real HTTP server that answers like the gateway's rollout API."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tether.agents import worker as worker_mod
from tether.agents.worker import Worker, backoff_s
from tether.common.broker import Keys
from tether.common.records import DispatchJob


class Gateway(ThreadingHTTPServer):
    """Answers `fail_first` POSTs with `status` (Retry-After 0), then like the rollout API."""

    def __init__(self, status: int, fail_first: int) -> None:
        self.status, self.fail_first, self.posts = status, fail_first, []
        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    server: Gateway

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.server.posts.append(self.path)
        if len(self.server.posts) <= self.server.fail_first:
            body, code, extra = b'{"error": "not now"}', self.server.status, {"Retry-After": "0"}
        elif self.path == "/v1/rollouts":
            ro = {"rollout_id": "r1", "api_key": "k", "base_url": "http://x/v1", "model": "m"}
            body, code, extra = json.dumps(ro).encode(), 200, {}
        else:
            body, code, extra = b"{}", 200, {}
        self.send_response(code)
        for k, v in {"content-type": "application/json", **extra}.items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def gateway(request):
    server = Gateway(*request.param)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


JOB = DispatchJob.from_dict(
    {
        "task": {"task_id": "t"},
        "task_id": "t",
        "group_id": "g",
        "group_size": 1,
        "max_attempts": 1,
        "metadata": {},
    }
)


def worker(url: str) -> Worker:
    return Worker(None, Keys("t"), url, lambda task, base_url, api_key, model: 1.0, concurrency=1)


@pytest.mark.parametrize("gateway", [(503, 2), (502, 1), (504, 1)], indirect=True)
async def test_a_gateway_that_cannot_take_it_yet_is_tried_again(gateway):
    w = worker(gateway.url)
    try:
        assert await w.attempt(JOB, 0) is True
    finally:
        await w.http.aclose()
    retried = gateway.fail_first
    assert gateway.posts == ["/v1/rollouts"] * (retried + 1) + ["/v1/rollouts/r1/complete"]


@pytest.mark.parametrize("gateway", [(400, 1), (401, 1), (409, 1)], indirect=True)
async def test_a_refused_request_is_not_tried_again(gateway):
    w = worker(gateway.url)
    try:
        with pytest.raises(httpx.HTTPStatusError):
            await w.attempt(JOB, 0)
    finally:
        await w.http.aclose()
    assert gateway.posts == ["/v1/rollouts"]


@pytest.mark.parametrize("gateway", [(503, 100)], indirect=True)
async def test_retries_are_bounded(gateway, monkeypatch):
    monkeypatch.setattr(worker_mod, "GATEWAY_RETRIES", 3)
    w = worker(gateway.url)
    try:
        with pytest.raises(httpx.HTTPStatusError):
            await w.attempt(JOB, 0)
    finally:
        await w.http.aclose()
    assert gateway.posts == ["/v1/rollouts"] * 4


async def test_a_refused_connection_is_tried_again_then_raised(monkeypatch):
    monkeypatch.setattr(worker_mod, "GATEWAY_RETRIES", 2)
    monkeypatch.setattr(worker_mod, "FIRST_BACKOFF_S", 0.01)
    from tether.common.net import free_port

    w = worker(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    try:
        with pytest.raises(httpx.ConnectError):
            await w.post(f"{w.gateway_url}/v1/rollouts", json={})
    finally:
        await w.http.aclose()


def test_backoff_follows_retry_after_and_is_capped():
    resp = httpx.Response(503, headers={"Retry-After": "2"})
    assert backoff_s(resp, 0) == 2.0
    assert backoff_s(httpx.Response(503, headers={"Retry-After": "60"}), 0) == worker_mod.MAX_BACKOFF_S
    # No Retry-After: full jitter under a doubling ceiling, capped at MAX_BACKOFF_S.
    for attempt, ceiling in ((0, 0.5), (1, 1.0), (2, 2.0), (9, worker_mod.MAX_BACKOFF_S)):
        waits = [backoff_s(httpx.Response(503), attempt) for _ in range(200)]
        assert all(0.0 <= w <= ceiling for w in waits), (attempt, max(waits))
        assert max(waits) > ceiling / 2, (attempt, max(waits))  # drawn up to the ceiling, not pinned low
    assert all(0.0 <= backoff_s(None, 4) <= worker_mod.MAX_BACKOFF_S for _ in range(50))
