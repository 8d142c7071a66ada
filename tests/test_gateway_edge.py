"""What the gateway's routes share (gateway/edge.py) and the pure parts of its routers: the key a
request carries, read the same way by the plain-ASGI call routes (from raw headers) and by the FastAPI
routes (from a Request); which family's error shape a path gets; the doubled-/v1 hint; the Gemini
call-route match; a call's body read under the limit; a new rollout's client URLs."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.requests import Request

from tether.gateway.call import ClientGone
from tether.gateway.capture import ApiError
from tether.gateway.edge import api_key, call_headers, doubled_v1, error_payload, is_gemini, is_messages
from tether.gateway.rollouts import NewRollout
from tether.gateway.routers.calls import receive_body
from tether.gateway.routers.gemini import match_call
from tether.gateway.routers.rollouts import client_urls


def request(path: str, headers: list[tuple[bytes, bytes]], query: bytes = b"") -> Request:
    return Request(
        {"type": "http", "method": "POST", "path": path, "headers": headers, "query_string": query}
    )


# --- keys ----------------------------------------------------------------------------------------------

token = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12)
header_value = st.one_of(
    token, st.just(""), st.just("   "), token.map(lambda t: f" {t} "), token.map(lambda t: f"Basic {t}")
)


@st.composite
def key_headers(draw: st.DrawFn) -> list[tuple[bytes, bytes]]:
    """Each key header at most once, in any order, with values that hold a key or not. Only one of
    x-api-key and x-goog-api-key: with both, or with a header sent twice, the two readers differ (the
    call routes take the last, Request.headers the first) — a difference no client has been seen to
    rely on, left as it is."""
    x_name = draw(st.sampled_from([b"x-api-key", b"x-goog-api-key"]))
    names = draw(st.lists(st.sampled_from([b"authorization", x_name, b"api-key"]), unique=True))
    out = []
    for name in names:
        value = draw(header_value)
        if name == b"authorization" and draw(st.booleans()):
            value = f"{draw(st.sampled_from(['Bearer', 'bearer', 'BEARER']))} {value}"
        out.append((name, value.encode()))
    out += draw(st.lists(st.sampled_from([(b"content-type", b"application/json"), (b"x-other", b"v")])))
    return draw(st.permutations(out))


@given(key_headers())
def test_the_call_routes_and_the_fastapi_routes_read_the_same_key(headers):
    raw_key, length = call_headers(headers)
    assert raw_key == api_key(request("/v1/chat/completions", headers))
    assert length is None


def test_keys_in_order_of_precedence_and_each_once():
    both = [(b"api-key", b"az"), (b"x-api-key", b"anth"), (b"authorization", b"Bearer oai")]
    assert call_headers(both) == (("oai", "anth", "az"), None)
    same = [(b"authorization", b"Bearer k"), (b"x-api-key", b"k")]
    assert call_headers(same) == ("k", None)
    assert call_headers([(b"x-goog-api-key", b" g "), (b"content-length", b"12")]) == ("g", 12)
    assert call_headers([(b"authorization", b"Basic abc")]) == (None, None)


def test_the_query_key_counts_on_gemini_routes_only():
    q = b"alt=sse&key=gk"
    assert api_key(request("/v1beta/models/m:countTokens", [], q)) == "gk"
    assert api_key(request("/rollouts/r/v1/models/m:countTokens", [], q)) == "gk"
    assert api_key(request("/v1/messages/count_tokens", [], q)) is None
    assert api_key(request("/v1beta/models/m:countTokens", [(b"x-api-key", b"h")], q)) == "h"


# --- paths ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, family",
    [
        ("/v1/messages", "anthropic"),
        ("/v1/messages/count_tokens", "anthropic"),
        ("/rollouts/r1/v1/messages", "anthropic"),
        ("/v1/v1/messages", "anthropic"),
        ("/v1/messagesx", "openai"),
        ("/v1beta/models/m:generateContent", "google"),
        ("/v1/v1beta/models", "google"),
        ("/v1/models/m:streamGenerateContent", "google"),
        ("/v1/models/m:countTokens", "google"),
        ("/v1/models/llama3:8b", "openai"),  # OpenAI's model ids may hold a colon
        ("/rollouts/r1/v1/models/llama3:8b", "openai"),
        ("/v1/chat/completions", "openai"),
        ("/health", "openai"),
    ],
)
def test_errors_answer_in_the_shape_of_the_paths_family(path, family):
    body = orjson.loads(error_payload(path, 404, "no", "invalid_request_error", "not_found", "p"))
    shapes = {
        "anthropic": {"type": "error", "error": {"type": "not_found_error", "message": "no"}},
        "google": {"error": {"code": 404, "message": "no", "status": "NOT_FOUND"}},
        "openai": {
            "error": {"message": "no", "type": "invalid_request_error", "param": "p", "code": "not_found"}
        },
    }
    assert body == shapes[family]
    assert is_messages(path) == (family == "anthropic") and is_gemini(path) == (family == "google")


@pytest.mark.parametrize(
    "path, base",
    [
        ("/v1/v1/messages", ""),
        ("/v1/v1beta/models/m:generateContent", ""),
        ("/rollouts/r-1/v1/v1/chat/completions", "/rollouts/r-1"),
        ("/v1/messages", None),
        ("/v1/v1", None),
        ("/rollouts/r-1", None),
        ("/rollouts/r-1/v1/messages", None),
    ],
)
def test_a_doubled_v1_names_the_base_url_to_use_instead(path, base):
    assert doubled_v1(path) == base


@pytest.mark.parametrize(
    "path, hit",
    [
        (
            "/v1beta/models/m:generateContent",
            ("m", "generateContent", "/v1beta/models/{model}:generateContent", None),
        ),
        (
            "/v1/models/org/name:streamGenerateContent",
            ("org/name", "streamGenerateContent", "/v1/models/{model}:streamGenerateContent", None),
        ),
        (
            "/rollouts/r-1/v1beta/models/a:b:generateContent",
            ("a:b", "generateContent", "/rollouts/{rollout_id}/v1beta/models/{model}:generateContent", "r-1"),
        ),
        ("/v1beta/models/m:countTokens", None),  # not a call: FastAPI's route answers it
        ("/v1beta/models/:generateContent", None),
        ("/v1beta/models/m", None),
        ("/rollouts//v1beta/models/m:generateContent", None),
        ("/rollouts/r-1", None),
        ("/v1/chat/completions", None),
    ],
)
def test_gemini_calls_are_matched_by_model_and_method(path, hit):
    assert match_call(path) == hit


# --- a call's body -------------------------------------------------------------------------------------


def receiver(*messages: dict):
    queue = list(messages)

    async def receive() -> dict:
        return queue.pop(0)

    return receive


def body_of(*messages: dict, length: int | None = None, limit: int = 10) -> bytes:
    return asyncio.run(receive_body(receiver(*messages), length, limit))


def piece(body: bytes, more: bool = False) -> dict:
    return {"type": "http.request", "body": body, "more_body": more}


def test_a_body_is_read_whole_in_one_piece_or_several():
    assert body_of(piece(b"0123456789")) == b"0123456789"
    assert body_of(piece(b"012", True), piece(b"", True), piece(b"345", True), piece(b"6")) == b"0123456"
    assert body_of({"type": "http.request"}) == b""


@pytest.mark.parametrize(
    "messages, length",
    [
        ((piece(b"x"),), 11),  # said too long: refused before reading
        ((piece(b"01234567890"),), None),
        ((piece(b"0123456", True), piece(b"7890")), None),
        ((piece(b"0123456", True), piece(b"7890", True), piece(b"")), 3),  # a length that lied
    ],
)
def test_a_body_over_the_limit_is_413(messages, length):
    with pytest.raises(ApiError) as err:
        body_of(*messages, length=length)
    assert (err.value.status, err.value.code) == (413, "request_too_large")


def test_a_client_that_leaves_before_its_body_is_gone():
    with pytest.raises(ClientGone):
        body_of({"type": "http.disconnect"})
    with pytest.raises(ClientGone):
        body_of(piece(b"01", True), {"type": "http.disconnect"})


# --- a new rollout -------------------------------------------------------------------------------------


def test_a_new_rollout_gets_one_base_url_per_kind_of_client():
    urls = client_urls("https://gw.example", "policy", NewRollout("r-1", "tr-key"))
    assert urls == {
        "rollout_id": "r-1",
        "api_key": "tr-key",
        "base_url": "https://gw.example/v1",
        "rollout_base_url": "https://gw.example/rollouts/r-1/v1",
        "anthropic_base_url": "https://gw.example",
        "rollout_anthropic_base_url": "https://gw.example/rollouts/r-1",
        "gemini_base_url": "https://gw.example",
        "model": "policy",
    }
