"""Per-key limits and expiring keys (issue 14): request size, calls in flight and tokens per minute for
rollout keys and deployment keys, refused in each API family's own shape before anything is recorded;
a finished or expired rollout's key refused on every API. The decisions are pure (quotas.py); the
gateway runs against the vLLM look-alike and a real Redis."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from fakes.vllm_openai import MODEL
from gateway_helpers import ADMIN, InProcessGateway, bearer, gateway_settings, wait_traces
from stack_helpers import wait_for

from tether.common.broker import key_digest
from tether.gateway.quotas import (
    WINDOW_S,
    tokens_estimate,
    tokens_retry_after,
    too_large,
    window_of,
)

# --- the decisions (pure) --------------------------------------------------------------------------


def test_window_and_estimate():
    assert window_of(125.0) == (2, 5.0)
    assert tokens_estimate(100, 0, 30.0) == 100
    assert tokens_estimate(0, 100, 0.0) == 100  # the whole last minute is still inside the window
    assert tokens_estimate(10, 100, 45.0) == 35  # a quarter of it is


@pytest.mark.parametrize(
    ("current", "previous", "elapsed", "limit", "expected"),
    [
        (9, 0, 10.0, 10, None),  # under the limit
        (0, 0, 0.0, 0, None),  # no limit
        (10, 0, 10.0, 10, 51),  # this minute's tokens leave with the window (and none past it)
        (20, 0, 10.0, 10, 81),  # ... and half of them must also slide out of the next one
        (0, 20, 0.0, 10, 31),  # last minute's: until half of it slid out
        (5, 20, 30.0, 10, 16),  # 5 + 20*(1 - t/60) < 10 once t > 45
        (100, 0, 59.9, 10, 55),
        (11, 0, 59.99, 10, 6),
    ],
)
def test_tokens_retry_after(current, previous, elapsed, limit, expected):
    got = tokens_retry_after(current, previous, elapsed, limit)
    assert got == expected
    if got is not None:  # after the wait (nothing more sent), the estimate is under the limit
        t = elapsed + got
        later = (
            tokens_estimate(0, current, t - WINDOW_S)
            if t >= WINDOW_S
            else tokens_estimate(current, previous, t)
        )
        assert later < limit
        assert got >= 1


def test_too_large():
    assert too_large("rollout", 100, 0) is None
    assert too_large("rollout", 100, 100) is None
    err = too_large("deployment", 101, 100)
    assert err is not None and err.status == 413 and err.code == "request_too_large"
    assert "deployment key" in err.message


# --- on the gateway --------------------------------------------------------------------------------

SIZE, TPM = 4096, 5
DEPLOYMENT = {"dk-size-0123": "prod", "dk-conc-4567": "prod", "dk-tpm-89ab": "prod"}


@pytest.fixture(scope="module")
def qgw(redis_port, vllm):
    kw = dict(
        rollout_max_request_bytes=SIZE,
        rollout_max_concurrent=1,
        rollout_tokens_per_minute=TPM,
        deployment_max_request_bytes=SIZE,
        deployment_max_concurrent=1,
        deployment_tokens_per_minute=TPM,
        deployment_keys=",".join(f"{k}={v}" for k, v in DEPLOYMENT.items()),
    )
    with InProcessGateway(gateway_settings(redis_port, vllm.url, **kw)) as g:
        yield g


FAMILIES = ("openai", "anthropic", "google")


def call(
    g: InProcessGateway, family: str, key: str, text: str = "hi", stream: bool = False, **kw
) -> httpx.Response:
    """One model call in the family's dialect, with the key where that family's clients put it."""
    if family == "openai":
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": stream}
        return g.http.post("/v1/chat/completions", json=body, headers=bearer(key), **kw)
    if family == "anthropic":
        body = {
            "model": MODEL,
            "max_tokens": 16,
            "messages": [{"role": "user", "content": text}],
            "stream": stream,
        }
        return g.http.post("/v1/messages", json=body, headers={"x-api-key": key}, **kw)
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    body = {"contents": [{"role": "user", "parts": [{"text": text}]}]}
    return g.http.post(f"/v1beta/models/{MODEL}:{method}", json=body, headers={"x-goog-api-key": key}, **kw)


def hold_call(g: InProcessGateway, key: str) -> socket.socket:
    """Start an OpenAI call the fake vLLM holds for a minute; closing the socket hangs up."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hold:60"}]}).encode()
    host, port = g.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def assert_refused(resp: httpx.Response, family: str, status: int, retry_after: bool = True) -> str:
    """The refusal in the family's own error shape; returns its message."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    if family == "openai":
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == ("rate_limit_error" if status == 429 else "invalid_request_error")
        assert err["code"] == ("rate_limit_exceeded" if status == 429 else "request_too_large")
    elif family == "anthropic":
        assert body["type"] == "error"
        err = body["error"]
        assert err["type"] == {429: "rate_limit_error", 413: "request_too_large"}[status]
    else:
        err = body["error"]
        assert err["code"] == status
        assert err["status"] == {429: "RESOURCE_EXHAUSTED", 413: "INVALID_ARGUMENT"}.get(
            status, err["status"]
        )
    if retry_after:
        assert int(resp.headers["retry-after"]) >= 1
    return err["message"]


def refusals(g: InProcessGateway, limit: str, kind: str) -> float:
    for line in g.http.get("/metrics").text.splitlines():
        if line.startswith(f'tether_gateway_quota_refusals_total{{key_kind="{kind}",limit="{limit}"}}'):
            return float(line.split()[-1])
    return 0.0


def calls(rdb, g: InProcessGateway, rollout_id: str) -> int:
    return rdb.llen(g.keys.rollout_calls(rollout_id))


@pytest.mark.parametrize("kind", ["rollout", "deployment"])
def test_request_size(qgw, rdb, kind):
    r = qgw.new_rollout() if kind == "rollout" else None
    key = r["api_key"] if r else "dk-size-0123"
    before = refusals(qgw, "request_bytes", kind)
    assert call(qgw, "openai", key, "y" * (SIZE // 2)).status_code == 200
    for family in FAMILIES:
        message = assert_refused(call(qgw, family, key, "x" * SIZE), family, 413, retry_after=False)
        assert f"limit of {SIZE} bytes" in message and key not in message
    assert refusals(qgw, "request_bytes", kind) == before + 3
    if r is not None:  # the refused calls were not recorded
        assert len(wait_traces(rdb, qgw.keys, r["rollout_id"], 1)) == 1
        assert calls(rdb, qgw, r["rollout_id"]) == 1


@pytest.mark.parametrize("kind", ["rollout", "deployment"])
def test_calls_in_flight(qgw, rdb, vllm, kind):
    r = qgw.new_rollout() if kind == "rollout" else None
    key = r["api_key"] if r else "dk-conc-4567"
    ident = r["rollout_id"] if r else key_digest(key)
    slots = qgw.keys.quota_slots(kind, ident)
    before = refusals(qgw, "concurrency", kind)
    # One call held by vLLM until its client hangs up: sent on a raw socket that the test closes itself
    # once the refusals are checked (a client timeout could lapse first on a loaded machine).
    held = hold_call(qgw, key)
    try:
        wait_for(lambda: rdb.zcard(slots) == 1, 10, "the held call's slot", every_s=0.01)
        for family in FAMILIES:
            for stream in (False, True):  # a stream is refused before it starts: a JSON answer
                message = assert_refused(call(qgw, family, key, stream=stream), family, 429)
                assert "1 calls in flight" in message and key not in message
    finally:
        held.close()
    assert refusals(qgw, "concurrency", kind) == before + 6
    # The held call's slot comes back once its client left.
    wait_for(lambda: rdb.zcard(slots) == 0, 10, "the held call's slot back", every_s=0.01)
    if r is not None:
        assert [t["error"] for t in wait_traces(rdb, qgw.keys, r["rollout_id"], 1)] == ["client went away"]
    # A slot a dead replica never gave back lapses on its own; a live one holds.
    rdb.zadd(slots, {"live": time.time() + 600})
    assert_refused(call(qgw, "openai", key), "openai", 429)
    rdb.zadd(slots, {"live": time.time() - 1})
    assert call(qgw, "openai", key).status_code == 200  # the lapsed slot went with that admission
    assert rdb.zscore(slots, "live") is None
    # and the call's own slot goes once it is recorded (a write sent after the answer: wait for it)
    wait_for(lambda: rdb.zcard(slots) == 0, 10, "the call's slot back", every_s=0.01)


@pytest.mark.parametrize("kind", ["rollout", "deployment"])
def test_tokens_per_minute(qgw, rdb, kind):
    r = qgw.new_rollout() if kind == "rollout" else None
    key = r["api_key"] if r else "dk-tpm-89ab"
    before = refusals(qgw, "tokens_per_minute", kind)
    ok = call(qgw, "openai", key)  # under the limit when it started: through, and its tokens counted
    assert ok.status_code == 200
    used = ok.json()["usage"]["total_tokens"]
    assert used > 2 * TPM  # refused for half a minute at least, whatever window the call landed in
    for family in FAMILIES:
        for stream in (False, True):
            message = assert_refused(call(qgw, family, key, stream=stream), family, 429)
            assert f"{TPM} tokens per minute" in message and key not in message
    assert refusals(qgw, "tokens_per_minute", kind) == before + 6
    if r is not None:
        assert calls(rdb, qgw, r["rollout_id"]) == 1


def test_limits_are_shared_through_redis(qgw, rdb, redis_port, vllm):
    """A second gateway on the same Redis (a replica behind one address) sees the first one's counts."""
    settings = qgw.settings.model_copy()
    with InProcessGateway(settings) as other:
        r = qgw.new_rollout()
        assert call(qgw, "openai", r["api_key"]).status_code == 200
        assert_refused(call(other, "openai", r["api_key"]), "openai", 429)


# --- expiring keys ---------------------------------------------------------------------------------


def assert_unauthorized(resp: httpx.Response, family: str) -> None:
    assert resp.status_code == 401, resp.text
    body = resp.json()
    if family == "openai":
        assert body["error"]["code"] == "invalid_api_key"
    elif family == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    else:
        assert body["error"]["status"] == "UNAUTHENTICATED"


def test_key_lives_with_its_rollout(gw, rdb):
    """Created with the rollout's lifetime; refused for model calls from the finish on, on every API,
    while its record is kept the grace for state reads and a retried complete (409)."""
    r = gw.new_rollout()
    rid, key = r["rollout_id"], r["api_key"]
    record = gw.keys.api_key(key)
    lifetime = gw.settings.rollout_ttl_s
    assert 0 < rdb.ttl(record) <= lifetime and 0 < rdb.ttl(gw.keys.rollout(rid)) <= lifetime
    assert key not in str(rdb.hgetall(gw.keys.rollout(rid)))
    assert call(gw, "openai", key).status_code == 200
    wait_traces(rdb, gw.keys, rid, 1)
    assert 0 < rdb.ttl(gw.keys.rollout_calls(rid)) <= lifetime
    assert (
        gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 1.0}, headers=bearer(key)).status_code
        == 200
    )
    for family in FAMILIES:
        for stream in (False, True):
            assert_unauthorized(call(gw, family, key, stream=stream), family)
    assert 0 < rdb.ttl(record) <= gw.settings.finished_key_grace_s
    for kept in (gw.keys.rollout(rid), gw.keys.rollout_calls(rid)):  # kept for the merger and state reads
        assert gw.settings.rollout_ttl_s < rdb.ttl(kept) <= gw.settings.finished_rollout_ttl_s
    assert gw.http.get(f"/v1/rollouts/{rid}", headers=bearer(key)).json()["status"] == "completed"
    again = gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 1.0}, headers=bearer(key))
    assert again.status_code == 409
    assert len(wait_traces(rdb, gw.keys, rid, 1)) == 1  # the refused calls were not recorded


@pytest.fixture(scope="module")
def short_gw(redis_port, vllm):
    settings = gateway_settings(redis_port, vllm.url, rollout_ttl_s=2, finished_key_grace_s=0)
    with InProcessGateway(settings) as g:
        yield g


def test_key_gone_at_finish_without_grace(short_gw, rdb):
    g = short_gw
    r = g.new_rollout()
    assert call(g, "anthropic", r["api_key"]).status_code == 200
    resp = g.http.post(f"/v1/rollouts/{r['rollout_id']}/fail", json={}, headers=bearer(ADMIN))
    assert resp.status_code == 200
    assert not rdb.exists(g.keys.api_key(r["api_key"]))
    for family in FAMILIES:
        assert_unauthorized(call(g, family, r["api_key"]), family)


def test_key_expires_with_a_rollout_nobody_finishes(short_gw, rdb):
    g = short_gw
    r = g.new_rollout()
    assert call(g, "google", r["api_key"]).status_code == 200  # seen: cached by the replica
    deadline = time.monotonic() + 20
    while rdb.exists(g.keys.api_key(r["api_key"])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not rdb.exists(g.keys.api_key(r["api_key"]))
    assert not rdb.exists(g.keys.rollout(r["rollout_id"]))
    for family in FAMILIES:
        assert_unauthorized(call(g, family, r["api_key"]), family)
