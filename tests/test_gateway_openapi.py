"""The gateway's OpenAPI document (GET /openapi.json): valid OpenAPI 3.1, naming every route the app
serves and nothing else, and its request schemas agreeing with the parsers on bodies they accept and
refuse. The fuzzing from it is in test_gateway_fuzz.py."""

from __future__ import annotations

import jsonschema
import pytest
import schemathesis
from fakes.vllm_openai import MODEL
from gateway_helpers import bearer
from openapi_spec_validator import validate

from tether.gateway import openapi
from tether.gateway.app import create_app
from tether.gateway.capture import MAX_CHOICES, MAX_OUTPUT_TOKENS

DOC = openapi.document(MODEL)


def _body_schema(path: str, method: str = "post") -> dict:
    """A request body's schema, its $refs resolvable (the document's components beside it)."""
    schema = DOC["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
    return {**schema, "components": DOC["components"]}


def _valid(path: str, body: object) -> bool:
    return jsonschema.Draft202012Validator(_body_schema(path)).is_valid(body)


def test_document_is_valid_openapi_3_1():
    validate(DOC)  # openapi-spec-validator, 3.1 by the document's own `openapi`
    assert DOC["openapi"].startswith("3.1")
    loaded = schemathesis.openapi.from_dict(DOC)
    results = list(loaded.get_all_operations())
    assert [r.err() for r in results if not hasattr(r, "ok")] == []
    assert len(results) == len(openapi.documented_routes(DOC))
    schemes = DOC["components"]["securitySchemes"]
    assert {s.get("name") for s in schemes.values()} >= {"x-api-key", "x-goog-api-key", "api-key", "key"}
    assert {k for k, s in schemes.items() if s.get("scheme") == "bearer"} >= {"rolloutKey", "adminToken"}


def test_every_served_route_is_documented_and_every_documented_one_served(gw):
    s = gw.server
    app = create_app(
        call_paths=s.call_paths,
        sessions=s.sessions,
        admission=s.admission,
        pool=s.pool,
        redis_ping=s.redis.ping,
        served_model=MODEL,
        public_url="http://gw",
        default_group_size=1,
        max_body_bytes=1024,
        retry_after_s=1,
        cors_origins=["http://x"],  # the middleware around the routes is seen through
    )
    served, documented = openapi.served_routes(app), openapi.documented_routes(DOC)
    assert served - documented == set(), "served but not documented"
    assert documented - served == set(), "documented but not served"
    # The agent-facing routes are there in both forms.
    for path in ("/v1/chat/completions", "/v1/messages", "/v1beta/models/{model}:streamGenerateContent"):
        assert ("POST", path) in served and ("POST", openapi.ROLLOUT_PREFIX + path) in served


def test_the_gateway_serves_the_document_and_no_ui(gw):
    resp = gw.http.get("/openapi.json")
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/json"
    assert resp.json() == DOC
    for ui in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert gw.http.get(ui).status_code == 404


def test_each_documented_path_answers_in_its_familys_error_shape(gw):
    """Without a key, every documented call route refuses in the error shape the document gives it."""
    for path, item in DOC["paths"].items():
        for method, op in item.items():
            if method != "post" or "401" not in op["responses"]:
                continue
            url = path.format(rollout_id="r-none", model=MODEL, call_id="call-x", name="none", run_id="none")
            resp = gw.http.post(url, content=b"{}")
            assert resp.status_code in {int(s) for s in op["responses"]}, (path, resp.status_code)
            ref = op["responses"][str(resp.status_code)]["content"]["application/json"]["schema"]["$ref"]
            schema = {**DOC["components"]["schemas"][ref.rsplit("/", 1)[1]], "components": DOC["components"]}
            jsonschema.validate(resp.json(), schema)


@pytest.mark.parametrize(
    ("path", "body", "ok"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, True),
        ("/v1/chat/completions", {"messages": []}, False),
        ("/v1/chat/completions", {"messages": [{}], "max_tokens": -1}, False),
        ("/v1/chat/completions", {"messages": [{}], "max_tokens": MAX_OUTPUT_TOKENS + 1}, False),
        ("/v1/chat/completions", {"messages": [{}], "n": MAX_CHOICES + 1}, False),
        ("/v1/chat/completions", {"messages": [{}], "model": "other"}, False),
        ("/v1/chat/completions", {"messages": [{}], "vllm_only_knob": 3}, True),  # forwarded
        ("/v1/completions", {"prompt": [1, 2, 3]}, True),
        ("/v1/completions", {"prompt": ["a", "b"]}, False),
        ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}, True),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}, False),  # max_tokens required
        ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "x": 1}, False),
        ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}, True),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 3, "store": False}, True),
        ("/v1/responses", {"input": "hi", "unknown": None}, True),  # null counts as absent
        ("/v1/responses", {"input": "hi", "unknown": 1}, False),
        ("/v1beta/models/{model}:generateContent", {"contents": [{"parts": [{"text": "hi"}]}]}, True),
        (
            "/v1beta/models/{model}:generateContent",
            {"contents": [{"parts": [{"text": "hi"}]}], "generationConfig": {"candidateCount": 0}},
            False,
        ),
        ("/v1/rollouts", {"task_id": "t", "group_id": "g", "group_size": 0}, False),
        ("/v1/rollouts/{rollout_id}/complete", {"reward": 1e39}, False),  # beyond float32
        ("/v1/rollouts/{rollout_id}/complete", {"reward": -0.5}, True),
        ("/v1/runs", {"run_id": "calc-1", "config": {"trainer": {"lr": 1e-3}}, "adapter": "calc"}, True),
        ("/v1/runs", {"run_id": "Calc", "config": {}}, False),
        ("/v1/runs", {"run_id": "-calc", "config": {}}, False),
        ("/v1/runs", {"run_id": "calc", "config": {"trainr": {}}}, False),
        ("/v1/runs", {"run_id": "calc", "config": {"trainer": 1}}, False),
        ("/v1/runs", {"run_id": "calc", "config": {}, "adapter": " x"}, False),
    ],
)
def test_the_schemas_agree_with_the_parsers(path, body, ok):
    assert _valid(path, body) is ok


def test_documented_bodies_are_answered_as_documented(gw):
    """A body the document calls valid gets past the gateway's own checks; one it calls invalid is
    refused: the same examples, sent."""
    rollout = gw.new_rollout()
    gw.resume(1)
    key = bearer(rollout["api_key"])
    cases = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2}, 200),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "n": MAX_CHOICES + 1},
            400,
        ),
        ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}, 200),
        (
            "/v1/messages",
            {"max_tokens": MAX_OUTPUT_TOKENS + 1, "messages": [{"role": "user", "content": "x"}]},
            400,
        ),
        ("/v1/responses", {"input": "hi", "unknown": None}, 200),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 10**9}, 400),
    ]
    for path, body, status in cases:
        assert _valid(path, body) is (status == 200)
        resp = gw.http.post(path, json=body, headers=key)
        assert resp.status_code == status, (path, body, resp.text)
