"""What the gateway refuses is visible, and the rollout response fits every client: refused calls
give one log line, a counter by route and code, and (for a known rollout) an error trace the merger
skips; the access log; the base URLs handed out work with the official SDKs; /v1/v1 says what to
change; models by id; key precedence and Azure's api-key header; CORS on the call routes.

Against real components: an embedded Redis, the gateway in-process, the vLLM look-alike
(tests/fakes/vllm_openai.py), driven by the `openai` and `anthropic` SDKs and httpx.
"""

from __future__ import annotations

import logging
import time

import anthropic
import openai
import pytest
from fakes.vllm_openai import MODEL, PROMPT_IDS, TOKEN_IDS
from gateway_helpers import (
    ADMIN,
    InProcessGateway,
    assert_openai_error,
    bearer,
    gateway_settings,
    traces,
    wait_traces,
)
from prometheus_client.parser import text_string_to_metric_families

from tether.common.records import RolloutEvent, Trace

ORIGIN = "https://harness.example"


@pytest.fixture(scope="module")
def gw(redis_port, vllm):
    settings = gateway_settings(
        redis_port, vllm.url, access_log=True, cors_origins=f"{ORIGIN}, https://b.example"
    )
    with InProcessGateway(settings) as g:
        yield g


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


def errors_counted(gw: InProcessGateway, route: str, status: int, code: str) -> float:
    for family in text_string_to_metric_families(gw.http.get("/metrics").text):
        if family.name == "tether_gateway_errors":
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels == {
                    "route": route,
                    "status": str(status),
                    "code": code,
                }:
                    return sample.value
    return 0.0


def refused_lines(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "tether.gateway.refused"]


# --- refused calls: log line, counter, error trace -------------------------------------------------


def test_refused_call_of_a_rollout_is_logged_counted_and_recorded(gw, rdb, caplog):
    caplog.set_level(logging.INFO, logger="tether.gateway.refused")
    rollout = gw.new_rollout()
    rid, key = rollout["rollout_id"], rollout["api_key"]
    route = "/v1/chat/completions"
    before = errors_counted(gw, route, 400, "unsupported_parameter")
    body = chat_body(use_beam_search=True)
    resp = gw.http.post(route, json=body, headers=bearer(key))
    err = assert_openai_error(resp, 400, "unsupported_parameter")
    assert err["param"] == "use_beam_search"
    assert errors_counted(gw, route, 400, "unsupported_parameter") == before + 1

    [line] = [r for r in refused_lines(caplog) if r.rollout_id == rid]
    assert (line.route, line.status, line.code, line.param) == (
        route,
        400,
        "unsupported_parameter",
        "use_beam_search",
    )
    assert "use_beam_search" in line.getMessage() and rid in line.getMessage()

    # The trace says why, with the request as sent; its call id came back with the error.
    [(_, trace)] = traces(rdb, gw.keys, rid)
    assert trace["call_id"] == resp.headers["x-tether-call-id"]
    assert trace["status"] == "error" and trace["http_status"] == 400
    assert "unsupported_parameter" in trace["error"] and "use_beam_search" in trace["error"]
    assert trace["request"] == body and trace["prompt_token_ids"] == [] and trace["response_token_ids"] == []

    # model_not_found through the SDK, a body that is not JSON, one over the limit: all recorded.
    with pytest.raises(openai.NotFoundError):
        gw.client(rollout).chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
        )
    assert_openai_error(gw.http.post(route, content=b'{"model": ', headers=bearer(key)), 400, "invalid_json")
    resp = gw.http.post(route, json=chat_body(pad="x" * 70_000), headers=bearer(key))
    assert_openai_error(resp, 413, "request_too_large")
    assert "x-tether-call-id" in resp.headers
    recorded = [t for _, t in traces(rdb, gw.keys, rid)]
    assert [t["http_status"] for t in recorded] == [400, 404, 400, 413]
    assert (
        "model_not_found (param 'model')" in recorded[1]["error"]
        and recorded[1]["request"]["model"] == "gpt-4o"
    )
    assert recorded[2]["request"] == {"unparsed": "10 bytes, not a JSON object: '{\"model\": '"}
    assert recorded[3]["request"]["unparsed"].startswith("body not read")
    assert [r.status for r in refused_lines(caplog) if r.rollout_id == rid] == [400, 404, 400, 413]
    assert not any(key in r.getMessage() for r in caplog.records)
    # Refused calls count among the rollout's recorded calls (every one of them is on its list).
    assert gw.http.get(f"/v1/rollouts/{rid}", headers=bearer(ADMIN)).json()["calls"] == 4


def test_refused_anthropic_call_is_recorded_in_its_api(gw, rdb, caplog):
    caplog.set_level(logging.INFO, logger="tether.gateway.refused")
    rollout = gw.new_rollout()
    client = anthropic.Anthropic(
        base_url=rollout["anthropic_base_url"], api_key=rollout["api_key"], max_retries=0
    )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="not-the-policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["api"] == "anthropic.messages" and trace["http_status"] == 404
    assert trace["request"]["model"] == "not-the-policy"
    [line] = [r for r in refused_lines(caplog) if r.rollout_id == rollout["rollout_id"]]
    assert (line.route, line.code) == ("/v1/messages", "model_not_found")


def test_refused_without_a_rollout_is_logged_and_counted_not_recorded(gw, rdb, caplog):
    caplog.set_level(logging.INFO, logger="tether.gateway.refused")
    rollout = gw.new_rollout()
    rid = rollout["rollout_id"]
    before = errors_counted(gw, "/v1/chat/completions", 401, "invalid_api_key")
    assert_openai_error(
        gw.http.post("/v1/chat/completions", json=chat_body(), headers=bearer("tr-guess")), 401
    )
    assert errors_counted(gw, "/v1/chat/completions", 401, "invalid_api_key") == before + 1
    assert [r.rollout_id for r in refused_lines(caplog)] == [None]
    assert "tr-guess" not in caplog.text

    # A FastAPI route: counted by its template, logged with the rollout of its path.
    other = gw.new_rollout()
    route = "/v1/rollouts/{rollout_id}"
    before = errors_counted(gw, route, 403, "forbidden")
    assert_openai_error(gw.http.get(f"/v1/rollouts/{rid}", headers=bearer(other["api_key"])), 403)
    assert errors_counted(gw, route, 403, "forbidden") == before + 1
    assert refused_lines(caplog)[-1].route == route and refused_lines(caplog)[-1].rollout_id == rid
    before = errors_counted(gw, "unmatched", 404, "not_found")
    assert_openai_error(gw.http.get("/v1/nothing"), 404)
    assert errors_counted(gw, "unmatched", 404, "not_found") == before + 1
    assert refused_lines(caplog)[-1].route == "unmatched"

    # A call refused for a finished rollout is not added to it after its event went out.
    assert (
        gw.http.post(f"/v1/rollouts/{rid}/complete", json={"reward": 1.0}, headers=bearer(ADMIN)).status_code
        == 200
    )
    assert_openai_error(
        gw.http.post(
            "/v1/chat/completions", json=chat_body(use_beam_search=True), headers=bearer(rollout["api_key"])
        ),
        400,
    )
    assert traces(rdb, gw.keys, rid) == []


def test_merger_skips_refused_calls(gw, rdb):
    from tether.merger.consumer import Merger, MergerConfig
    from tether.merger.score import trace_to_call

    rollout = gw.new_rollout()
    client = gw.client(rollout)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body={"use_beam_search": True}
        )
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    records = wait_traces(rdb, gw.keys, rollout["rollout_id"], 2)
    assert [t["status"] for t in records] == ["error", "ok"]
    assert trace_to_call(Trace.from_dict(records[0])) == (None, "error")
    event = RolloutEvent(
        rollout_id=rollout["rollout_id"],
        task_id="task-1",
        group_id="g",
        group_size=1,
        status="completed",
        reward=1.0,
    )
    merged = Merger(None, gw.keys, MergerConfig(), None).merge_records(event, records)
    assert merged["dropped_calls"] == {"error": 1}
    [seq] = merged["sequences"]
    assert seq["token_ids"] == PROMPT_IDS + TOKEN_IDS


def test_paused_call_is_recorded_as_refused(gw, rdb):
    from tether.v1 import gateway_pb2

    rollout = gw.new_rollout()
    gw.control.PauseAdmission(gateway_pb2.PauseAdmissionRequest(drain_timeout_s=0))
    try:
        resp = gw.http.post("/v1/chat/completions", json=chat_body(), headers=bearer(rollout["api_key"]))
    finally:
        gw.resume(3)
    assert_openai_error(resp, 429, "admission_paused")
    [trace] = wait_traces(rdb, gw.keys, rollout["rollout_id"])
    assert trace["call_id"] == resp.headers["x-tether-call-id"] and trace["http_status"] == 429
    assert trace["request"] == chat_body()


def test_access_log_has_one_line_per_request_and_no_key(gw, caplog):
    caplog.set_level(logging.INFO, logger="tether.gateway.access")
    rollout = gw.new_rollout()
    gw.client(rollout).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    gw.http.get(f"/v1/rollouts/{rollout['rollout_id']}", headers=bearer(rollout["api_key"]))
    # A line is written once the answer has gone out, so the client may read it a moment earlier.
    deadline = time.monotonic() + 10
    while len(lines := [r for r in caplog.records if r.name == "tether.gateway.access"]) < 3:
        assert time.monotonic() < deadline, lines
        time.sleep(0.01)
    assert [(r.method, r.route, r.status, r.rollout_id) for r in lines] == [
        ("POST", "/v1/rollouts", 201, None),
        ("POST", "/v1/chat/completions", 200, rollout["rollout_id"]),
        ("GET", "/v1/rollouts/{rollout_id}", 200, rollout["rollout_id"]),
    ]
    assert all(r.latency_ms >= 0 for r in lines)
    assert rollout["api_key"] not in caplog.text and ADMIN not in caplog.text


# --- the rollout response and the URLs clients build from it ----------------------------------------


def test_rollout_base_urls_work_with_each_sdk(gw, rdb):
    rollout = gw.new_rollout()
    rid = rollout["rollout_id"]
    assert rollout["base_url"] == f"{gw.url}/v1"
    assert rollout["rollout_base_url"] == f"{gw.url}/rollouts/{rid}/v1"
    assert rollout["anthropic_base_url"] == rollout["gemini_base_url"] == gw.url
    assert rollout["rollout_anthropic_base_url"] == f"{gw.url}/rollouts/{rid}"
    for name in ("base_url", "rollout_base_url"):
        client = openai.OpenAI(base_url=rollout[name], api_key=rollout["api_key"], max_retries=0)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    for name in ("anthropic_base_url", "rollout_anthropic_base_url"):
        client = anthropic.Anthropic(base_url=rollout[name], api_key=rollout["api_key"], max_retries=0)
        msg = client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert msg.content[0].text
    recorded = wait_traces(rdb, gw.keys, rid, 4)
    assert [t["status"] for t in recorded] == ["ok"] * 4


def test_doubled_v1_says_which_base_url_to_use(gw):
    rollout = gw.new_rollout()
    rid = rollout["rollout_id"]
    # The Anthropic SDK given the OpenAI base URL: /v1/v1/messages.
    for given, right in (
        (rollout["base_url"], gw.url),
        (rollout["rollout_base_url"], f"{gw.url}/rollouts/{rid}"),
    ):
        client = anthropic.Anthropic(base_url=given, api_key=rollout["api_key"], max_retries=0)
        with pytest.raises(anthropic.NotFoundError) as exc:
            client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert f"Set its base URL to '{right}' (no /v1)" in exc.value.message
        assert exc.value.body["type"] == "error"  # Anthropic's shape on /v1/messages
    err = assert_openai_error(gw.http.get("/v1/v1/models"), 404, "doubled_v1")
    assert f"'{gw.url}'" in err["message"]
    # A Gemini client's doubled path answers in Google's error shape.
    resp = gw.http.post(f"/v1/v1beta/models/{MODEL}:generateContent", json={})
    assert resp.status_code == 404
    err = resp.json()["error"]
    assert err["status"] == "NOT_FOUND" and "/v1beta" in err["message"] and f"'{gw.url}'" in err["message"]
    assert_openai_error(gw.http.get("/v1/sessions/v1x"), 404, "not_found")  # not a doubled /v1


def test_model_by_id(gw):
    rollout = gw.new_rollout()
    for name in ("base_url", "rollout_base_url"):
        client = openai.OpenAI(base_url=rollout[name], api_key=rollout["api_key"], max_retries=0)
        model = client.models.retrieve(MODEL)
        assert (model.id, model.object, model.owned_by) == (MODEL, "model", "tether")
        with pytest.raises(openai.NotFoundError) as exc:
            client.models.retrieve("gpt-4o")
        assert exc.value.code == "model_not_found" and exc.value.body["param"] == "model"
    assert_openai_error(gw.http.get(f"/rollouts/{rollout['rollout_id']}/v1/models/{MODEL}"), 401)


# --- keys ------------------------------------------------------------------------------------------


def test_a_known_key_wins_over_an_unknown_one(gw, rdb):
    a, b = gw.new_rollout(), gw.new_rollout()
    stale = "sk-from-the-environment"
    cases = [
        {"authorization": f"Bearer {stale}", "x-api-key": a["api_key"]},
        {"authorization": f"Bearer {a['api_key']}", "x-api-key": stale},
        {"api-key": a["api_key"]},
        {"authorization": f"Bearer {stale}", "api-key": a["api_key"]},
        {"authorization": f"Bearer {a['api_key']}", "x-api-key": b["api_key"]},  # both known: Bearer first
    ]
    for headers in cases:
        resp = gw.http.post("/v1/chat/completions", json=chat_body(), headers=headers)
        assert resp.status_code == 200, (headers, resp.text)
    assert len(wait_traces(rdb, gw.keys, a["rollout_id"], len(cases))) == len(cases)
    assert traces(rdb, gw.keys, b["rollout_id"]) == []
    assert_openai_error(
        gw.http.post(
            "/v1/chat/completions",
            json=chat_body(),
            headers={"authorization": f"Bearer {stale}", "x-api-key": "tr-nope"},
        ),
        401,
    )
    # The openai SDK with a stale api_key and the rollout's key in Azure's header.
    client = openai.OpenAI(
        base_url=a["base_url"], api_key=stale, default_headers={"api-key": a["api_key"]}, max_retries=0
    )
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert client.models.retrieve(MODEL).id == MODEL
    # Messages under the rollout's path, as a harness with a stale Bearer beside its x-api-key sends it.
    resp = gw.http.post(
        f"/rollouts/{a['rollout_id']}/v1/messages",
        json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {stale}", "x-api-key": a["api_key"]},
    )
    assert resp.status_code == 200, resp.text
    # FastAPI routes resolve the same way.
    resp = gw.http.get(
        f"/rollouts/{a['rollout_id']}/v1/models",
        headers={"authorization": f"Bearer {stale}", "x-api-key": a["api_key"]},
    )
    assert resp.status_code == 200, resp.text
    assert len(wait_traces(rdb, gw.keys, a["rollout_id"], len(cases) + 2)) == len(cases) + 2


# --- CORS ------------------------------------------------------------------------------------------


def test_cors_preflight_and_headers_on_call_routes(gw):
    rollout = gw.new_rollout()
    preflight = gw.http.options(
        "/v1/chat/completions",
        headers={
            "origin": ORIGIN,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert "POST" in preflight.headers["access-control-allow-methods"]
    for stream in (False, True):
        resp = gw.http.post(
            "/v1/chat/completions",
            json=chat_body(stream=stream),
            headers={**bearer(rollout["api_key"]), "origin": ORIGIN},
        )
        assert resp.status_code == 200
        assert resp.headers["access-control-allow-origin"] == ORIGIN
        assert "x-tether-call-id" in resp.headers["access-control-expose-headers"]
    resp = gw.http.get("/v1/models", headers={"origin": "https://b.example"})
    assert resp.headers["access-control-allow-origin"] == "https://b.example"
    # An origin not listed gets no CORS headers, and its preflight is refused.
    resp = gw.http.post(
        "/v1/chat/completions",
        json=chat_body(),
        headers={**bearer(rollout["api_key"]), "origin": "https://evil.example"},
    )
    assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers
    assert (
        gw.http.options(
            "/v1/chat/completions",
            headers={"origin": "https://evil.example", "access-control-request-method": "POST"},
        ).status_code
        == 400
    )


def test_cors_is_off_by_default(redis_port, vllm):
    with InProcessGateway(gateway_settings(redis_port, vllm.url)) as plain:
        rollout = plain.new_rollout()
        resp = plain.http.post(
            "/v1/chat/completions", json=chat_body(), headers={**bearer(rollout["api_key"]), "origin": ORIGIN}
        )
        assert resp.status_code == 200 and "access-control-allow-origin" not in resp.headers
        preflight = plain.http.options(
            "/v1/chat/completions", headers={"origin": ORIGIN, "access-control-request-method": "POST"}
        )
        assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers


def test_cors_setting_rejects_a_non_origin(redis_port, vllm):
    with pytest.raises(ValueError, match="not an origin"):
        gateway_settings(redis_port, vllm.url, cors_origins="harness.example")
