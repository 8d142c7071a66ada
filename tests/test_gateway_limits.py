"""Output limits: the gateway's default when a client names none, and the clamp that keeps a limit
inside the served context (Claude Code sends max_tokens 32000 whatever the model) instead of letting
vLLM answer 400; what applied is recorded in the trace (adjustments.max_tokens). The decision is a
pure function (limits.py); the gateway runs against the vLLM look-alike, which checks the context as
vLLM 0.32 does (or as older vLLM did, for the resend path)."""

from __future__ import annotations

import json
import time

import pytest
from fakes.vllm_openai import MODEL, PROMPT_IDS, FakeVLLM
from gateway_helpers import InProcessGateway, assert_openai_error, bearer, gateway_settings, wait_traces

from tether.gateway.capture import MAX_OUTPUT_TOKENS
from tether.gateway.limits import (
    CLAMPED,
    DEFAULT,
    MaxTokens,
    applied_max_tokens,
    budget_error,
    client_limit,
    decide_max_tokens,
)
from tether.gateway.routing import served_context_len

P = len(PROMPT_IDS)  # the look-alike's prompt length

# --- the decision (pure) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requested", "default", "context", "prompt", "expected"),
    [
        (None, 4096, 512, None, MaxTokens(None, 512, DEFAULT)),  # default bounded by the context
        (None, 100, 512, None, MaxTokens(None, 100, DEFAULT)),
        (None, 4096, 512, 500, MaxTokens(None, 12, DEFAULT)),  # ... and by the room the prompt leaves
        (None, 100, None, None, MaxTokens(None, 100, DEFAULT)),  # context unknown: the default as it is
        (None, None, 512, None, MaxTokens(None, None, None)),  # no default: the server's own
        # Fits the context: vLLM fits it to the prompt itself.
        (32000, 4096, 32768, None, MaxTokens(32000, 32000, None)),
        (32000, 4096, 8192, None, MaxTokens(32000, 8192, CLAMPED)),
        (32000, 4096, 8192, 1000, MaxTokens(32000, 7192, CLAMPED)),
        (8, 4096, 8192, 1000, MaxTokens(8, 8, None)),
        (32000, 4096, None, None, MaxTokens(32000, 32000, None)),  # nothing known: untouched
        (32000, 4096, 512, 512, MaxTokens(32000, 32000, None)),  # no room at all: vLLM's own 400 says why
    ],
)
def test_decide_max_tokens(requested, default, context, prompt, expected):
    assert decide_max_tokens(requested, default, context, prompt) == expected


def test_applied_is_what_vllm_generated_under():
    # Sent 512 into a 512 context, the prompt took 9: vLLM generated under 503.
    assert applied_max_tokens(MaxTokens(32000, 512, CLAMPED), 512, 9) == {
        "requested": 32000,
        "applied": 503,
        "reason": CLAMPED,
    }
    assert applied_max_tokens(MaxTokens(None, 100, DEFAULT), 512, 9) == {
        "requested": None,
        "applied": 100,
        "reason": DEFAULT,
    }
    # The client's limit fit the context but not next to its prompt: vLLM lowered it.
    assert applied_max_tokens(MaxTokens(510, 510, None), 512, 9) == {
        "requested": 510,
        "applied": 503,
        "reason": CLAMPED,
    }
    assert applied_max_tokens(MaxTokens(8, 8, None), 512, 9) is None
    # The call failed (no prompt ids): what was sent.
    assert applied_max_tokens(MaxTokens(32000, 512, CLAMPED), 512, None) == {
        "requested": 32000,
        "applied": 512,
        "reason": CLAMPED,
    }


def test_client_limit():
    assert client_limit(None) == (True, None) and client_limit(7) == (True, 7)
    for bad in (0, -1, True, "7", 7.0):  # vLLM rejects these in its own words
        assert client_limit(bad) == (False, None)


def test_budget_errors_are_read_from_vllms_messages():
    # vLLM 0.32, renderers/params.py
    assert budget_error(
        "max_tokens=32000 cannot be greater than max_model_len=512. Please request fewer output tokens."
    ) == (512, None)
    assert budget_error("max_completion_tokens=9000 cannot be greater than max_model_len=8192.") == (
        8192,
        None,
    )
    # vLLM before 0.32 (chat, completions)
    assert budget_error(
        "This model's maximum context length is 4096 tokens. However, you requested 4196 "
        "tokens (100 in the messages, 4096 in the completion). Please reduce the length of "
        "the messages or completion."
    ) == (4096, 100)
    assert budget_error(
        "This model's maximum context length is 2048 tokens, however you requested 2100 "
        "tokens (52 in your prompt; 2048 for the completion)."
    ) == (2048, 52)
    # A prompt too long on its own, and other 400s, are not the limit's fault.
    assert (
        budget_error(
            "This model's maximum context length is 512 tokens. However, your prompt contains "
            "600 input tokens, which exceeds this limit even without any output tokens."
        )
        is None
    )
    assert budget_error("maximum context length is 8 tokens") is None
    assert budget_error("'messages' must be a non-empty array") is None


def test_served_context_len():
    assert (
        served_context_len(
            json.dumps(
                {"data": [{"id": "a", "max_model_len": 4096}, {"id": "lora", "max_model_len": 2048}]}
            ).encode()
        )
        == 2048
    )
    assert served_context_len(b'{"data": [{"id": "a"}]}') is None
    assert served_context_len(b"not json") is None
    assert served_context_len(b"[]") is None


# --- through the gateway ------------------------------------------------------------------------


@pytest.fixture
def fake():
    with FakeVLLM() as f:
        yield f


def _gateway(redis_port, fake, **kw) -> InProcessGateway:
    return InProcessGateway(gateway_settings(redis_port, fake.url, health_check_s=0.2, **kw))


def _knows_context(g: InProcessGateway, length: int | None) -> None:
    """Wait for the health check to read the replica's context length."""
    deadline = time.monotonic() + 10
    while g.server.pool.context_len != length:
        assert time.monotonic() < deadline, g.http.get("/health").json()
        time.sleep(0.02)


def _call(g: InProcessGateway, path: str, body: dict, stream: bool = False):
    rollout = g.new_rollout()
    resp = g.http.post(
        path, json={"model": MODEL, "stream": stream, **body}, headers=bearer(rollout["api_key"])
    )
    return rollout, resp


def _limit(trace: dict) -> dict | None:
    return trace["adjustments"].get("max_tokens")


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("stream", [False, True])
def test_claude_code_sized_max_tokens_is_clamped_not_rejected(redis_port, rdb, fake, stream):
    with _gateway(redis_port, fake) as g:
        _knows_context(g, 512)
        rollout, resp = _call(g, "/v1/messages", {"max_tokens": 32000, **CHAT}, stream)
        assert resp.status_code == 200, resp.text
        assert len(fake.requests) == 1  # clamped before sending: no 400, no resend
        assert fake.requests[0]["max_tokens"] == 512 and fake.applied == [512 - P]
        [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"])
        assert trace["status"] == "ok" and trace["request"]["max_tokens"] == 32000  # recorded as sent
        assert _limit(trace) == {"requested": 32000, "applied": 512 - P, "reason": "clamped_to_context"}


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/chat/completions", CHAT, "max_tokens"),
        ("/v1/completions", {"prompt": "what is 3 + 4 ?"}, "max_tokens"),
        ("/v1/responses", {"input": "what is 3 + 4 ?"}, "max_tokens"),  # translated to chat
    ],
)
def test_default_max_tokens_when_the_client_names_none(redis_port, rdb, fake, path, body, field):
    with _gateway(redis_port, fake, default_max_tokens=100) as g:
        _knows_context(g, 512)
        rollout, resp = _call(g, path, body)
        assert resp.status_code == 200, resp.text
        assert fake.requests[-1][field] == 100 and fake.applied == [100]
        [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"])
        assert _limit(trace) == {"requested": None, "applied": 100, "reason": "default"}


def test_default_is_bounded_by_the_context(redis_port, rdb, fake):
    fake.max_model_len = 64
    with _gateway(redis_port, fake) as g:  # the default default, 4096
        _knows_context(g, 64)
        rollout, resp = _call(g, "/v1/chat/completions", CHAT, stream=True)
        assert resp.status_code == 200, resp.text
        assert fake.requests[-1]["max_tokens"] == 64 and fake.applied == [64 - P]
        [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"])
        assert _limit(trace) == {"requested": None, "applied": 64 - P, "reason": "default"}


def test_no_default_and_limits_that_fit_are_left_alone(redis_port, rdb, fake):
    with _gateway(redis_port, fake, default_max_tokens=0) as g:
        _knows_context(g, 512)
        rollout, resp = _call(g, "/v1/chat/completions", CHAT)
        assert resp.status_code == 200 and "max_tokens" not in fake.requests[-1]
        _, resp = _call(g, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 8})
        assert resp.status_code == 200 and fake.requests[-1]["max_completion_tokens"] == 8
        assert "max_tokens" not in fake.requests[-1]
        [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"])
        assert _limit(trace) is None


def test_max_completion_tokens_is_clamped_where_the_client_put_it(redis_port, rdb, fake):
    with _gateway(redis_port, fake) as g:
        _knows_context(g, 512)
        rollout, resp = _call(g, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 32000})
        assert resp.status_code == 200, resp.text
        assert fake.requests[-1]["max_completion_tokens"] == 512 and "max_tokens" not in fake.requests[-1]
        [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"])
        assert _limit(trace) == {"requested": 32000, "applied": 512 - P, "reason": "clamped_to_context"}


def test_unknown_context_is_learned_from_vllms_400(redis_port, rdb, fake):
    """A /v1/models without max_model_len: vLLM's own 400 names the context; sent once more."""
    fake.report_context = False
    with _gateway(redis_port, fake) as g:
        deadline = time.monotonic() + 10
        while "/v1/models" not in fake.get_paths:  # the health check asked, and learned nothing
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert g.server.pool.context_len is None
        rollout, resp = _call(g, "/v1/messages", {"max_tokens": 32000, **CHAT})
        assert resp.status_code == 200, resp.text
        assert [r["max_tokens"] for r in fake.requests] == [32000, 512] and fake.applied == [512 - P]
        [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"])
        assert trace["status"] == "ok" and trace["retries"] == 0
        assert _limit(trace) == {"requested": 32000, "applied": 512 - P, "reason": "clamped_to_context"}


@pytest.mark.parametrize("stream", [False, True])
def test_legacy_context_400_is_resent_once_with_the_room_left(redis_port, rdb, fake, stream):
    fake.context_errors = "legacy"  # 400 whenever prompt + limit > context, naming the prompt length
    with _gateway(redis_port, fake) as g:
        _knows_context(g, 512)
        rollout, resp = _call(g, "/v1/chat/completions", {**CHAT, "max_tokens": 32000}, stream)
        assert resp.status_code == 200, resp.text
        assert [r["max_tokens"] for r in fake.requests] == [512, 512 - P] and fake.applied == [512 - P]
        [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"])
        assert trace["status"] == "ok"
        assert _limit(trace) == {"requested": 32000, "applied": 512 - P, "reason": "clamped_to_context"}


def test_a_prompt_that_fills_the_context_gets_vllms_400_once(redis_port, rdb, fake):
    fake.max_model_len = P
    with _gateway(redis_port, fake) as g:
        _knows_context(g, P)
        rollout, resp = _call(g, "/v1/chat/completions", {**CHAT, "max_tokens": 32000})
        assert resp.status_code == 400 and "prompt contains" in resp.json()["error"]["message"]
        assert len(fake.requests) == 1
        [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"])
        assert trace["status"] == "error" and trace["http_status"] == 400
        assert _limit(trace) == {"requested": 32000, "applied": P, "reason": "clamped_to_context"}


def test_a_malformed_limit_is_refused_before_vllm(redis_port, rdb, fake):
    """Out of 1..MAX_OUTPUT_TOKENS (or not an integer): the gateway's own 400, nothing sent upstream;
    the rollout's trace says why (an error trace, never a sample)."""
    fake.max_model_len = None
    with _gateway(redis_port, fake) as g:
        for bad in (0, -1, "7", 7.5, True, MAX_OUTPUT_TOKENS + 1):
            for name in ("max_tokens", "max_completion_tokens"):
                rollout, resp = _call(g, "/v1/chat/completions", {**CHAT, name: bad})
                assert assert_openai_error(resp, 400, "invalid_value")["param"] == name
                [trace] = wait_traces(rdb, g.keys, rollout["rollout_id"])
                assert trace["status"] == "error" and trace["http_status"] == 400
        assert fake.requests == []
