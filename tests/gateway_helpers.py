"""Test helpers for the gateway: a GatewayServer run in-process on its own event loop thread (as a
test would run a server on port 0), its settings for a test, and readers of what it recorded."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any

import grpc
import httpx
import openai
import redis

from tether.common.broker import Keys, merge_entries
from tether.gateway.main import GatewayServer, GatewaySettings
from tether.v1 import gateway_pb2, gateway_pb2_grpc

ADMIN = "admin-secret"


def gateway_settings(redis_port: int, vllm_url: str, **kw) -> GatewaySettings:
    defaults: dict[str, Any] = dict(
        redis_url=f"redis://127.0.0.1:{redis_port}",
        namespace=f"t{uuid.uuid4().hex[:8]}",
        vllm_url=vllm_url,
        gateway_port=0,
        gateway_grpc_port=0,
        admin_token=ADMIN,
        admission_wait_s=1.0,
        retry_after_s=2,
        max_body_bytes=64 * 1024,
        finish_wait_s=10,
        shutdown_grace_s=2,
    )
    return GatewaySettings(**{**defaults, **kw})


class InProcessGateway:
    """A GatewayServer on its own event loop thread, as a test would run a server on port 0."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server = GatewayServer(settings)

    def __enter__(self) -> InProcessGateway:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        self.url = f"http://127.0.0.1:{self.server.http_port}"
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.grpc_port}")
        self.control = gateway_pb2_grpc.GatewayControlStub(self.channel)
        self.http = httpx.Client(base_url=self.url, timeout=30)
        self.keys = self.settings.keys()
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.server.stop(0.5), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def new_rollout(self, **body) -> dict:
        body = {"task_id": "task-1", "group_id": f"g-{uuid.uuid4().hex[:8]}", **body}
        resp = self.http.post("/v1/rollouts", json=body, headers={"authorization": f"Bearer {ADMIN}"})
        assert resp.status_code == 201, resp.text
        return resp.json()

    def client(self, rollout: dict) -> openai.OpenAI:
        return openai.OpenAI(base_url=rollout["base_url"], api_key=rollout["api_key"], max_retries=0)

    def resume(self, version: int) -> gateway_pb2.AdmissionStatus:
        return self.control.ResumeAdmission(gateway_pb2.ResumeAdmissionRequest(weight_version=version))


def trace_marks(rdb: redis.Redis, keys: Keys) -> dict[str, str]:
    """The last entry id of every trace partition ("0-0" for an empty one): where `traces_since` starts."""
    out = {}
    for stream in keys.trace_streams:
        last = rdb.xrevrange(stream, count=1)
        out[stream] = last[0][0] if last else "0-0"
    return out


def traces_since(rdb: redis.Redis, keys: Keys, marks: dict[str, str] | None = None) -> list[dict]:
    """The traces of every partition recorded after `marks` (all of them without), oldest first."""
    parts = [
        rdb.xrange(stream, min=f"({(marks or {}).get(stream, '0-0')}", max="+")
        for stream in keys.trace_streams
    ]
    return [json.loads(f["data"]) for _, f in merge_entries(parts)]


def trace_count(rdb: redis.Redis, keys: Keys) -> int:
    """Entries on every trace partition together."""
    return sum(rdb.xlen(stream) for stream in keys.trace_streams)


def traces(rdb: redis.Redis, keys: Keys, rollout_id: str) -> list[tuple[str, dict]]:
    """The rollout's recorded calls, in order, as (stream entry id, trace)."""
    out = []
    for eid in rdb.lrange(keys.rollout_calls(rollout_id), 0, -1):
        for entry_id, fields in rdb.xrange(keys.traces(rollout_id), min=eid, max=eid):
            out.append((entry_id, json.loads(fields["data"])))
    return out


def wait_traces(
    rdb: redis.Redis, keys: Keys, rollout_id: str, n: int = 1, timeout_s: float = 5
) -> list[dict]:
    """Traces of a rollout once n are there (a stream's trace is written as the stream closes)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [t for _, t in traces(rdb, keys, rollout_id)]
        if len(found) >= n or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


ERROR_FIELDS = {"message", "type", "param", "code"}


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def assert_openai_error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    """An answer in OpenAI's error shape: {"error": {message, type, param, code}} and nothing else."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]
