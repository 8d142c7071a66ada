"""Fuzzing the gateway's HTTP API from its own OpenAPI document, in front of the vLLM look-alike.

Per documented operation (root and /rollouts/{rollout_id} forms alike): requests schemathesis generates
from the document (valid and invalid bodies, parameters, keys), checked by schemathesis against the
document (no 5xx, documented status and content type, responses and errors in the documented shape),
then requests hypothesis derives from those for what a schema cannot describe (invalid UTF-8, cut
JSON, NaN and Infinity literals, numbers past float range, nesting deep enough to exhaust a recursive
parser, duplicate keys, any value of any type at any depth, bytes): no 5xx, no hang (a timeout per
request), no dropped connection, every refusal in the API's own error shape. Each operation's count
covers both: schemathesis draws complex bodies slowly (tens of ms each on 2 cores), so for the
operations with a body the derived requests make up most of the count.

Most requests carry a working key and the rollout's real id (otherwise nearly all would stop at the
401/403 before the parsers); complete and fail get a fresh rollout each. Whatever is refused records no
sample: every ok trace recorded during an operation's run answers one 200 of a recorded call.

The look-alike answers a body it cannot read with vLLM's 400 (`_StrictHandler`), as vLLM's own request
validation does, so that a 502 here is the gateway's and not the look-alike's.

The fast suite runs a few dozen requests per operation; `slow` runs 1,000 per endpoint (each handler's
first path) and 200 on its other paths (the /rollouts/{rollout_id}/ and Gemini /v1/ aliases of the same
handler). Hand-made cases of issue 14 ("Bad input") follow at the end.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import jsonschema
import pytest
import redis
import requests
import schemathesis
from fakes.vllm_openai import MODEL, FakeVLLM, FakeVLLMHandler
from gateway_helpers import (
    ADMIN,
    InProcessGateway,
    bearer,
    gateway_settings,
    trace_count,
    trace_marks,
    traces_since,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from tether.gateway import openapi

DOC = openapi.document(MODEL)
SCHEMA = schemathesis.openapi.from_dict(DOC)
SCHEMA.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
# /metrics first: its answer grows with every route and code the others make it count.
OPS = sorted(
    ((m.upper(), path) for path, item in DOC["paths"].items() for m in item if m != "parameters"),
    key=lambda op: op[1] != "/metrics",
)
TIMEOUT_S = 15  # a request still unanswered then is a hang
DEPLOYMENT_KEY = "dk-fuzz"
SESSION = "fuzz"
# Operations that record a call (their 200s each add one ok trace).
_CALLS = {"chat_completions", "completions", "messages", "responses"} | {
    f"gemini_{m}{s}" for m in ("generateContent", "streamGenerateContent") for s in ("", "_v1")
}
RECORDED = _CALLS | {f"{op}_for_rollout" for op in _CALLS}
RUN_ROUTES = {"create_run", "list_runs", "get_run", "stop_run"}  # admin routes: the admin token
CHECKS = [
    schemathesis.checks.not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


class _StrictHandler(FakeVLLMHandler):
    """The look-alike, answering vLLM's 400 for a body its handler cannot read (vLLM's pydantic
    validation does the same), instead of dropping the connection."""

    def send_response(self, code: int, message: str | None = None) -> None:
        self._answered = True
        super().send_response(code, message)

    def do_POST(self) -> None:
        self._answered = False
        try:
            super().do_POST()
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            if not self._answered:
                self.server.unreadable += 1  # type: ignore[attr-defined]
                err = {
                    "message": f"invalid request: {exc!r}",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                }
                self._send(400, {"error": err})


def _session() -> requests.Session:
    session = requests.Session()
    session.trust_env = False  # no proxy lookups per request: the gateway is local
    return session


@dataclass
class Harness:
    """The gateway under test and what the fuzzing needs of it: keys, rollouts, a recorded call."""

    gw: InProcessGateway
    rdb: redis.Redis
    fake: FakeVLLM
    rollout: dict = field(default_factory=dict)  # running throughout: the call routes' rollout
    call_id: str = ""  # one recorded call of it (the reward routes)
    run_id: str = ""  # a registered run (the run routes)
    session: requests.Session = field(default_factory=lambda: _session())
    ok_calls: int = 0

    def fresh_rollout(self) -> dict:
        return self.gw.new_rollout()

    def ok_traces_since(self, marks: dict[str, str]) -> int:
        return sum(t["status"] == "ok" for t in traces_since(self.rdb, self.gw.keys, marks))

    def last_trace_id(self) -> dict[str, str]:
        return trace_marks(self.rdb, self.gw.keys)


@pytest.fixture(scope="module")
def harness(redis_port, rdb):
    fake = FakeVLLM()
    fake.RequestHandlerClass = _StrictHandler
    fake.unreadable = 0  # type: ignore[attr-defined]
    settings_ = gateway_settings(
        redis_port,
        fake.url,
        deployment_keys=f"{DEPLOYMENT_KEY}={SESSION}",
        max_body_bytes=256 * 1024,
        admission_wait_s=0.2,
    )
    with fake, InProcessGateway(settings_) as gw:
        gw.resume(1)
        h = Harness(gw, rdb, fake)
        h.rollout = gw.new_rollout()
        resp = gw.http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers=bearer(h.rollout["api_key"]),
        )
        assert resp.status_code == 200, resp.text
        h.call_id = resp.headers["x-tether-call-id"]
        resp = gw.http.post("/v1/runs", json={"run_id": "fuzz", "config": {}}, headers=bearer(ADMIN))
        assert resp.status_code == 201, resp.text
        h.run_id = resp.json()["run_id"]
        yield h
        h.session.close()


# --- what each request carries -------------------------------------------------------------------


def _key_headers(op_id: str, key: str, i: int) -> dict[str, str]:
    """The key in each header a client of that API may use, in turn."""
    if op_id.startswith("gemini") and i % 3 == 1:
        return {"x-goog-api-key": key}
    if i % 3 == 2:
        return {"x-api-key": key}
    return bearer(key)


def _setup(
    h: Harness, op_id: str, path_params: dict[str, Any], i: int
) -> tuple[dict[str, Any], dict[str, str]]:
    """Path parameters and headers for request `i`: three in four with the real rollout (or a fresh
    one for complete and fail), a working key, the recorded call's id; the rest as generated."""
    params = dict(path_params)
    if i % 4 == 3:
        return params, {}
    rollout = h.fresh_rollout() if op_id in ("complete_rollout", "fail_rollout") else h.rollout
    key = rollout["api_key"]
    if "rollout_id" in params:
        params["rollout_id"] = rollout["rollout_id"]
    if "call_id" in params and i % 2:
        params["call_id"] = h.call_id
    if "model" in params and i % 2:
        params["model"] = MODEL
    if "run_id" in params and i % 2:
        params["run_id"] = h.run_id
    if op_id == "create_rollout" or op_id in RUN_ROUTES:
        key = ADMIN
    if "name" in params:
        params["name"] = SESSION
        key = DEPLOYMENT_KEY if i % 2 else ADMIN
    return params, _key_headers(op_id, key, i)


# --- schemathesis: requests generated from the document ------------------------------------------


def _operation(method: str, path: str):
    return SCHEMA[path][method]


def _schemathesis_run(h: Harness, method: str, path: str, count: int) -> tuple[list[Any], int]:
    """`count` requests generated by schemathesis (half valid, half invalid where a body can be), each
    checked against the document. Returns what was sent (for deriving more) and the count."""
    op = _operation(method, path)
    op_id = op.definition.raw["operationId"]
    modes = [GenerationMode.POSITIVE]
    if "requestBody" in op.definition.raw:
        modes.append(GenerationMode.NEGATIVE)
    sent: list[Any] = []
    for mode in modes:

        @settings(
            max_examples=max(1, count // len(modes)),
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=mode), i=st.integers(0, 11))
        def run(case, i: int) -> None:
            case.path_parameters, headers = _setup(h, op_id, case.path_parameters or {}, i)
            resp = case.call(base_url=h.gw.url, headers=headers, timeout=TIMEOUT_S, session=h.session)
            case.validate_response(resp, checks=CHECKS, headers=headers)
            sent.append((case.path_parameters, case.query, case.body))
            if op_id in RECORDED and resp.status_code == 200:
                h.ok_calls += 1

        try:
            run()
        except Unsatisfiable:  # no invalid form of a string path parameter survives the URL
            assert mode is GenerationMode.NEGATIVE and "requestBody" not in op.definition.raw
    return sent, len(sent)


# --- hypothesis: requests derived for what the schema cannot describe ---------------------------

_RAW = "\x00raw{}\x00"  # stands in for a token JSON cannot encode, spliced in after dumps
RAW_TOKENS = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1" * 5000, "tru", "01", '"\\ud800"']


def _deep(depth: int, kind: str) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value] if kind == "list" else {"type": "object", "properties": {"a": value}}
    return value


ODD_VALUES = st.one_of(
    st.sampled_from(
        [
            None,
            True,
            False,
            0,
            -1,
            1,
            10**9,
            2**63,
            -(2**63) - 1,
            1.5,
            -0.0,
            "",
            "x",
            [],
            {},
            [None],
            {"": {}},
        ]
    ),
    st.sampled_from([_RAW.format(i) for i in range(len(RAW_TOKENS))]),
    st.sampled_from([_deep(200, "dict"), _deep(600, "dict"), _deep(1100, "list"), _deep(900, "list")]),
    st.text(max_size=20),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
        max_leaves=8,
    ),
)


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every place in a JSON value (the root included) a mutation may land."""
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


def _replace(value: Any, where: tuple, new: Any) -> Any:
    if not where:
        return new
    head, rest = where[0], where[1:]
    if isinstance(value, dict):
        return {**value, head: _replace(value[head], rest, new)}
    out = list(value)
    out[head] = _replace(value[head], rest, new)
    return out


def _dumps(value: Any) -> bytes:
    text = json.dumps(value)
    for i, token in enumerate(RAW_TOKENS):
        text = text.replace(json.dumps(_RAW.format(i)), token)
    return text.encode()


@st.composite
def derived_bodies(draw, body: Any) -> bytes:
    """One request body derived from a generated one."""
    base = body if isinstance(body, (dict, list)) else {}
    kind = draw(st.sampled_from(["value", "value", "value", "key", "utf8", "cut", "dup", "bytes", "top"]))
    if kind == "value":  # any value, of any type, anywhere
        where = draw(st.sampled_from(_paths(base)))
        return _dumps(_replace(base, where, draw(ODD_VALUES)))
    if kind == "key":  # an unknown field
        name = draw(st.text(min_size=1, max_size=12))
        return _dumps({**base, name: draw(ODD_VALUES)} if isinstance(base, dict) else base)
    raw = _dumps(base)
    if kind == "utf8":
        at = draw(st.integers(0, len(raw)))
        return (
            raw[:at]
            + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80", b"\xf8"]))
            + raw[at:]
        )
    if kind == "cut":
        return raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    if kind == "dup" and isinstance(base, dict) and base:
        k = draw(st.sampled_from(sorted(base, key=str)))
        return (
            raw[:-1]
            + (b", " if len(raw) > 2 else b"")
            + json.dumps(k).encode()
            + b": "
            + _dumps(draw(ODD_VALUES))
            + b"}"
        )
    if kind == "top":
        return _dumps(draw(st.sampled_from([[base], "x", 1, None, [], True])))
    return draw(st.binary(max_size=64))


def _family_error(op: dict, status: int) -> dict:
    response = op["responses"].get(str(status))
    assert response is not None, f"status {status} is not documented"
    schema = response["content"]["application/json"]["schema"]
    return {**schema, "components": DOC["components"]}


BATCH = 10  # derived requests per hypothesis example: its engine costs more than a request


def _derived_run(h: Harness, method: str, path: str, sent: list, count: int) -> int:
    """`count` requests derived from what schemathesis sent (or from nothing, for operations without a
    body): no 5xx, no hang, no dropped connection, each refusal in the documented error shape."""
    op_def = DOC["paths"][path][method.lower()]
    op_id = op_def["operationId"]
    has_body = "requestBody" in op_def
    pool = sent or [({}, {}, None)]
    names = [
        p["name"]
        for p in [*DOC["paths"][path].get("parameters", []), *op_def.get("parameters", [])]
        if p["in"] == "path"
    ]
    n = [0]

    def one(data: st.DataObject) -> None:
        n[0] += 1
        i = data.draw(st.integers(0, 11))  # drawn, so that a failing example replays the same
        path_params, query, body = data.draw(st.sampled_from(pool))
        generated = {k: v if "/" not in (v := str(path_params.get(k, "x"))) else "x" for k in names}
        junk: dict[str, str] = {}
        if not has_body:  # parameters, query and key are what varies: any text
            generated = {k: data.draw(st.one_of(st.just(v), SEGMENTS)) for k, v in generated.items()}
            query = data.draw(
                st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=2)
            )
            junk = data.draw(st.sampled_from(JUNK_KEYS))
        params, headers = _setup(h, op_id, generated, i)
        url = path.format(**{k: requests.utils.quote(str(v), safe="") for k, v in params.items()})
        content = data.draw(derived_bodies(body)) if has_body else None
        resp = h.session.request(
            method,
            h.gw.url + url,
            data=content,
            params=query or None,
            headers={**headers, **junk},
            timeout=TIMEOUT_S,
        )
        what = (method, url, content[:300] if content else None, resp.status_code, resp.text[:300])
        assert resp.status_code < 500, what
        if resp.status_code >= 400 and method != "HEAD":
            try:
                jsonschema.validate(resp.json(), _family_error(op_def, resp.status_code))
            except (ValueError, jsonschema.ValidationError) as exc:
                raise AssertionError(what) from exc
        elif op_id in RECORDED:
            h.ok_calls += 1

    @settings(
        max_examples=-(-count // BATCH),
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        for _ in range(BATCH):
            one(data)

    run()
    return n[0]


# A path parameter: one segment of any text (a "/" would make it another path, fuzzed as that one).
SEGMENTS = st.text(min_size=1, max_size=30).filter(lambda v: "/" not in v and v not in (".", ".."))
JUNK_KEYS = [{}, {}, {"authorization": "Bearer "}, {"x-api-key": "tr-x"}, {"authorization": "Basic x"}]


def _fuzz(h: Harness, method: str, path: str, total: int, generated_with_body: int) -> None:
    has_body = "requestBody" in DOC["paths"][path][method.lower()]
    before, h.ok_calls = h.last_trace_id(), 0
    sent, n = _schemathesis_run(h, method, path, generated_with_body if has_body else total // 2)
    n += _derived_run(h, method, path, sent, total - n)
    assert n >= total
    _recorded_only_what_succeeded(h, before)


def _recorded_only_what_succeeded(h: Harness, before: str) -> None:
    """Every ok trace recorded during the run answers a 200 of a recorded call (a stream's trace is
    written as it closes: waited for)."""
    for _ in range(300):  # up to 30 s: a loaded machine can lag a stream's trace behind its answer
        if h.ok_traces_since(before) >= h.ok_calls:
            break
        time.sleep(0.1)
    assert h.ok_traces_since(before) == h.ok_calls


def _op_id(op: tuple[str, str]) -> str:
    return f"{op[0]} {op[1]}"


@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_fuzz_each_operation(harness, op):
    _fuzz(harness, *op, total=24, generated_with_body=6)


def _alias_of(op: tuple[str, str]) -> tuple[str, str] | None:
    """The operation whose handler `op` shares, when `op` is only another path to it: the
    /rollouts/{rollout_id}/ form of a root route, or Gemini's /v1/ form of a /v1beta/ one."""
    method, path = op
    for prefix, root in (("/rollouts/{rollout_id}", ""), ("/v1/models/", "/v1beta/models/")):
        if path.startswith(prefix):
            other = (
                (method, root + path[len(prefix) :])
                if root == ""
                else (method, path.replace(prefix, root, 1))
            )
            if other in OPS and other != op:
                return other
    return None


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("op", OPS, ids=_op_id)
def test_fuzz_each_operation_1000(harness, op):
    # 1,000 per endpoint (handler); its second path (a rollout-scoped or /v1 alias, the same handler
    # behind another prefix) gets 200 more, which is what tells the two paths apart.
    _fuzz(harness, *op, total=200 if _alias_of(op) else 1000, generated_with_body=24)


def test_aliases_are_paths_to_the_same_handler():
    aliases = {op: _alias_of(op) for op in OPS if _alias_of(op)}
    assert aliases, "no alias found: the slow fuzz would skip none"
    for op in aliases:  # each alias leads, in a step or two, to a path that gets the full 1,000
        seen = [op]
        while (nxt := _alias_of(seen[-1])) is not None:
            assert nxt not in seen, seen
            seen.append(nxt)
        assert len(seen) > 1 and _alias_of(seen[-1]) is None


# --- hand-made cases -------------------------------------------------------------------------------

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
GEMINI = {"contents": [{"parts": [{"text": "hi"}]}]}
# (path, a valid body, the error shape's checker)
APIS = [
    ("/v1/chat/completions", CHAT, "openai"),
    ("/v1/completions", {"prompt": "hi"}, "openai"),
    ("/v1/messages", MESSAGES, "anthropic"),
    ("/v1/responses", {"input": "hi"}, "openai"),
    (f"/v1beta/models/{MODEL}:generateContent", GEMINI, "google"),
]
SHAPES = {
    k: DOC["components"]["schemas"][v]
    for k, v in (("openai", "OpenAIError"), ("anthropic", "AnthropicError"), ("google", "GoogleError"))
}


def _refused(resp: httpx.Response, status: int, shape: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    jsonschema.validate(body, SHAPES[shape])
    return body


class NoSample:
    """Around a block: no trace recorded in it is ok (a refusal of a known rollout's call is recorded
    as an error trace, which never becomes a sample; without a known key nothing is recorded)."""

    def __init__(self, h: Harness, recorded: int | None = None) -> None:
        self.h, self.recorded = h, recorded

    def __enter__(self) -> NoSample:
        self.before = self.h.last_trace_id()
        self.length = trace_count(self.h.rdb, self.h.gw.keys)
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:
            return
        assert self.h.ok_traces_since(self.before) == 0
        if self.recorded is not None:
            assert trace_count(self.h.rdb, self.h.gw.keys) - self.length == self.recorded


@pytest.mark.parametrize(("path", "body", "shape"), APIS)
def test_invalid_utf8_and_cut_bodies(harness, path, body, shape):
    key = bearer(harness.rollout["api_key"])
    raw = json.dumps(body).encode()
    with NoSample(harness):
        for bad in (raw[:-1] + b"\xff}", b"\xc3\x28", raw[: len(raw) // 2], b"", b"[]", b"\x00"):
            _refused(harness.gw.http.post(path, content=bad, headers=key), 400, shape)


@pytest.mark.parametrize(("path", "body", "shape"), APIS)
def test_a_10mb_body_is_413(harness, path, body, shape):
    """Over TETHER_MAX_BODY_BYTES (256 KiB here), in the API's shape, whether or not it says its
    length up front."""
    key = bearer(harness.rollout["api_key"])
    big = json.dumps({**body, "pad": "x" * (10 * 1024 * 1024)}).encode()
    with NoSample(harness):
        _refused(harness.gw.http.post(path, content=big, headers=key), 413, shape)
        chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))  # chunked: no length
        _refused(harness.gw.http.post(path, content=chunks, headers=key), 413, shape)
    with NoSample(harness, recorded=0):  # without a known key nothing at all is recorded
        _refused(harness.gw.http.post(path, content=big), 413, shape)


LIMITS = [
    ("/v1/chat/completions", CHAT, "max_tokens", "openai"),
    ("/v1/chat/completions", CHAT, "max_completion_tokens", "openai"),
    ("/v1/completions", {"prompt": "hi"}, "max_tokens", "openai"),
    ("/v1/messages", MESSAGES, "max_tokens", "anthropic"),
    ("/v1/responses", {"input": "hi"}, "max_output_tokens", "openai"),
]


@pytest.mark.parametrize(("path", "body", "name", "shape"), LIMITS)
def test_output_limits_out_of_range(harness, path, body, name, shape):
    key = bearer(harness.rollout["api_key"])
    with NoSample(harness):
        for bad in (-1, 0, 10**9, "16", 1.5, True):
            _refused(harness.gw.http.post(path, json={**body, name: bad}, headers=key), 400, shape)
        gemini = f"/v1beta/models/{MODEL}:generateContent"
        for bad in (-1, 10**9):
            resp = harness.gw.http.post(
                gemini, json={**GEMINI, "generationConfig": {"maxOutputTokens": bad}}, headers=key
            )
            _refused(resp, 400, "google")


def test_ten_thousand_choices(harness):
    key = bearer(harness.rollout["api_key"])
    sent_upstream = len(harness.fake.requests)
    with NoSample(harness):
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi"})):
            for name in ("n", "best_of") if path == "/v1/completions" else ("n",):
                _refused(harness.gw.http.post(path, json={**body, name: 10_000}, headers=key), 400, "openai")
        resp = harness.gw.http.post(
            f"/v1beta/models/{MODEL}:generateContent",
            json={**GEMINI, "generationConfig": {"candidateCount": 10_000}},
            headers=key,
        )
        _refused(resp, 400, "google")
    assert len(harness.fake.requests) == sent_upstream  # refused before vLLM


WRONG_TYPES = [
    # (path, body, field family)
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, "flags"),
    ("/v1/chat/completions", {**CHAT, "model": 7}, "model"),
    ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "logprobs": "5"}, "numbers"),
    ("/v1/messages", {**MESSAGES, "messages": [{"role": "user", "content": 5}]}, "content"),
    ("/v1/messages", {**MESSAGES, "system": {"text": "x"}}, "system"),
    ("/v1/messages", {**MESSAGES, "tools": {"name": "f"}}, "tools"),
    ("/v1/messages", {**MESSAGES, "tool_choice": "auto"}, "tool_choice"),
    ("/v1/messages", {**MESSAGES, "temperature": "hot"}, "numbers"),
    ("/v1/messages", {**MESSAGES, "stop_sequences": "END"}, "stops"),
    ("/v1/responses", {"input": 5}, "input"),
    ("/v1/responses", {"input": [{"type": ["message"], "role": "user", "content": "hi"}]}, "item-type"),
    ("/v1/responses", {"input": "hi", "tools": [5]}, "tools"),
    ("/v1/responses", {"input": "hi", "parallel_tool_calls": "no"}, "flags"),
    ("/v1/responses", {"input": "hi", "text": {"format": "json"}}, "format"),
    (f"/v1beta/models/{MODEL}:generateContent", {"contents": {"parts": []}}, "contents"),
    (f"/v1beta/models/{MODEL}:generateContent", {**GEMINI, "generationConfig": []}, "config"),
    (f"/v1beta/models/{MODEL}:generateContent", {**GEMINI, "generationConfig": {"topK": 1.5}}, "numbers"),
    (
        f"/v1beta/models/{MODEL}:generateContent",
        {**GEMINI, "tools": [{"functionDeclarations": [{"name": 3}]}]},
        "tools",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "family"), WRONG_TYPES, ids=[f"{p.rsplit('/', 1)[1]}-{f}" for p, _, f in WRONG_TYPES]
)
def test_wrong_types(harness, path, body, family):
    shape = "google" if "v1beta" in path else "anthropic" if path.endswith("/messages") else "openai"
    with NoSample(harness):
        resp = harness.gw.http.post(path, json=body, headers=bearer(harness.rollout["api_key"]))
        assert 400 <= resp.status_code < 500
        _refused(resp, resp.status_code, shape)


def test_wrong_types_on_the_rollout_api(harness):
    h = harness
    admin = bearer(ADMIN)
    with NoSample(h, recorded=0):
        for body in (
            {"task_id": 1, "group_id": "g"},
            {"task_id": "t", "group_id": "g", "group_size": "2"},
            {"task_id": "t", "group_id": "g", "metadata": []},
        ):
            _refused(h.gw.http.post("/v1/rollouts", json=body, headers=admin), 422, "openai")
        r = h.fresh_rollout()
        for body in ({"reward": "1"}, {"reward": True}, {"reward": None}, {}, {"reward": [1]}):
            resp = h.gw.http.post(
                f"/v1/rollouts/{r['rollout_id']}/complete", json=body, headers=bearer(r["api_key"])
            )
            _refused(resp, 422, "openai")
        _refused(
            h.gw.http.post(f"/v1/rollouts/{r['rollout_id']}/fail", json={"reason": 5}, headers=admin),
            422,
            "openai",
        )
        _refused(
            h.gw.http.post(
                f"/v1/sessions/{SESSION}/rewards", json={"call_id": 5, "reward": 1}, headers=admin
            ),
            422,
            "openai",
        )
        assert h.gw.http.get(f"/v1/rollouts/{r['rollout_id']}", headers=admin).json()["status"] == "running"


def test_unknown_rollout_ids(harness):
    h = harness
    admin, key = bearer(ADMIN), bearer(h.rollout["api_key"])
    ghost = uuid.uuid4().hex
    with NoSample(h, recorded=0):
        for verb, path, body in (
            ("GET", f"/v1/rollouts/{ghost}", None),
            ("POST", f"/v1/rollouts/{ghost}/complete", {"reward": 1.0}),
            ("POST", f"/v1/rollouts/{ghost}/fail", {}),
            ("POST", f"/v1/rollouts/{ghost}/calls/{h.call_id}/reward", {"reward": 1.0}),
        ):
            _refused(h.gw.http.request(verb, path, json=body, headers=admin), 404, "openai")
        # The key's own rollout is not the path's: 403, not a lookup of the ghost.
        _refused(
            h.gw.http.post(f"/rollouts/{ghost}/v1/chat/completions", json=CHAT, headers=key), 403, "openai"
        )
        _refused(
            h.gw.http.post(f"/rollouts/{ghost}/v1/messages", json=MESSAGES, headers=key), 403, "anthropic"
        )
        resp = h.gw.http.post(
            f"/rollouts/{ghost}/v1beta/models/{MODEL}:generateContent", json=GEMINI, headers=key
        )
        _refused(resp, 403, "google")
        _refused(
            h.gw.http.post("/v1/chat/completions", json=CHAT, headers=bearer("tr-" + ghost)), 401, "openai"
        )


def test_replayed_and_concurrent_completions_one_wins(harness):
    h = harness
    r = h.fresh_rollout()
    url, key = f"/v1/rollouts/{r['rollout_id']}/complete", bearer(r["api_key"])
    events_before = h.rdb.xlen(h.gw.keys.rollout_events)

    def complete(reward: float) -> httpx.Response:
        with httpx.Client(base_url=h.gw.url, timeout=TIMEOUT_S) as c:
            return c.post(url, json={"reward": reward}, headers=key)

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(complete, [float(i) for i in range(16)]))
    won = [a for a in answers if a.status_code == 200]
    assert len(won) == 1
    for a in answers:
        if a.status_code != 200:
            assert _refused(a, 409, "openai")["error"]["code"] == "rollout_finished"
    _refused(h.gw.http.post(url, json={"reward": 5.0}, headers=key), 409, "openai")  # replayed
    _refused(h.gw.http.post(f"/v1/rollouts/{r['rollout_id']}/fail", json={}, headers=key), 409, "openai")
    state = h.gw.http.get(f"/v1/rollouts/{r['rollout_id']}", headers=key).json()
    assert state["status"] == "completed" and state["reward"] == won[0].json()["reward"]
    events = h.rdb.xrange(h.gw.keys.rollout_events, min="-", max="+")[events_before:]
    assert sum(json.loads(f["data"])["rollout_id"] == r["rollout_id"] for _, f in events) == 1


NON_FINITE = [
    b'{"reward": NaN}',
    b'{"reward": Infinity}',
    b'{"reward": -Infinity}',
    b'{"reward": 1e400}',
    b'{"reward": 1e39}',
]


def test_non_finite_rewards(harness):
    h = harness
    r = h.fresh_rollout()
    key = bearer(r["api_key"])
    targets = [
        f"/v1/rollouts/{r['rollout_id']}/complete",
        f"/v1/rollouts/{h.rollout['rollout_id']}/calls/{h.call_id}/reward",
        f"/v1/calls/{h.call_id}/reward",
        f"/v1/sessions/{SESSION}/rewards",
    ]
    for raw in NON_FINITE:
        for url in targets:
            headers = key if "complete" in url else bearer(h.rollout["api_key"])
            if "sessions" in url:
                raw_body = raw.replace(b"{", b'{"call_id": "call-x", ', 1)
                headers = bearer(ADMIN)
            else:
                raw_body = raw
            resp = h.gw.http.post(url, content=raw_body, headers=headers)
            assert _refused(resp, 422, "openai")["error"]["param"] == "reward", (url, raw)
    assert h.gw.http.get(f"/v1/rollouts/{r['rollout_id']}", headers=key).json()["status"] == "running"
    assert math.isfinite(
        h.gw.http.post(targets[1], json={"reward": 0.5}, headers=bearer(h.rollout["api_key"])).json()[
            "reward"
        ]
    )


def test_a_key_of_another_rollout_is_403(harness):
    h = harness
    a, b = h.fresh_rollout(), h.fresh_rollout()
    other = bearer(b["api_key"])
    with NoSample(h, recorded=0):
        for verb, path, body, shape in (
            ("GET", f"/v1/rollouts/{a['rollout_id']}", None, "openai"),
            ("POST", f"/v1/rollouts/{a['rollout_id']}/complete", {"reward": 1.0}, "openai"),
            ("POST", f"/v1/rollouts/{a['rollout_id']}/fail", {}, "openai"),
            ("POST", f"/v1/rollouts/{a['rollout_id']}/calls/{h.call_id}/reward", {"reward": 1.0}, "openai"),
            ("POST", f"/rollouts/{a['rollout_id']}/v1/calls/{h.call_id}/reward", {"reward": 1.0}, "openai"),
            ("POST", f"/rollouts/{a['rollout_id']}/v1/chat/completions", CHAT, "openai"),
            ("POST", f"/rollouts/{a['rollout_id']}/v1/messages", MESSAGES, "anthropic"),
            ("POST", f"/rollouts/{a['rollout_id']}/v1/messages/count_tokens", MESSAGES, "anthropic"),
            ("POST", f"/rollouts/{a['rollout_id']}/v1beta/models/{MODEL}:generateContent", GEMINI, "google"),
            ("GET", f"/rollouts/{a['rollout_id']}/v1/models", None, "openai"),
            ("POST", "/v1/rollouts", {"task_id": "t", "group_id": "g"}, "openai"),
        ):
            _refused(h.gw.http.request(verb, path, json=body, headers=other), 403, shape)
    assert (
        h.gw.http.get(f"/v1/rollouts/{a['rollout_id']}", headers=bearer(a["api_key"])).json()["status"]
        == "running"
    )


# --- what the fuzzing found (each was a 500) --------------------------------------------------------


def _nested(body: dict, depth: int) -> bytes:
    """`body` with a field nested `depth` levels deep (the body's own level counted)."""
    value = "[" * (depth - 1) + "1" + "]" * (depth - 1)
    return (json.dumps(body)[:-1] + f', "metadata": {value}}}').encode()


@pytest.mark.parametrize(("path", "body", "shape"), APIS)
def test_bodies_nested_too_deep_for_the_trace(harness, path, body, shape):
    """orjson reads 1024 levels but writes 254: a body nested deeper parsed, then failed to be sent
    upstream or recorded (500). Now 400 past MAX_DEPTH, the refusal recorded as an error trace."""
    key = bearer(harness.rollout["api_key"])
    with NoSample(harness):
        for depth in (129, 300, 1000):
            _refused(harness.gw.http.post(path, content=_nested(body, depth), headers=key), 400, shape)
    fine = json.dumps({**body, "x": _deep(100, "list")}).encode()
    assert harness.gw.http.post(path, content=fine, headers=key).status_code in (200, 400)
    resp = harness.gw.http.post(
        "/v1/rollouts",
        json={"task_id": "t", "group_id": "g", "metadata": _deep(300, "dict")},
        headers=bearer(ADMIN),
    )
    _refused(resp, 400, "openai")


def test_count_tokens_with_messages_of_the_wrong_type(harness):
    key = bearer(harness.rollout["api_key"])
    for messages in (-1, 7, True):
        for path in ("/v1/messages/count_tokens", "/v1/messages"):
            resp = harness.gw.http.post(path, json={"max_tokens": 5, "messages": messages}, headers=key)
            _refused(resp, 400, "anthropic")


def test_openai_model_ids_with_a_colon_get_openais_error_shape(harness):
    """`/v1/models/llama3:8b` is OpenAI's model lookup, not a Gemini method: OpenAI's shape."""
    key = bearer(harness.rollout["api_key"])
    for path in ("/v1/models/llama3:8b", "/v1/models/a/v1/messages/b", "/v1/models/x/v1beta/y"):
        _refused(harness.gw.http.get(path, headers=key), 404, "openai")
    _refused(
        harness.gw.http.post("/v1/models/other:generateContent", json=GEMINI, headers=key), 404, "google"
    )
    _refused(harness.gw.http.get("/v1/models/x:generateContent", headers=key), 405, "google")


def test_an_unhashable_thinking_type_is_ignored_not_a_500(harness):
    key = bearer(harness.rollout["api_key"])
    for kind in ([], {}, [1]):
        resp = harness.gw.http.post(
            "/v1/messages", json={**MESSAGES, "thinking": {"type": kind}}, headers=key
        )
        assert resp.status_code == 200, resp.text


def test_a_thought_part_of_the_user_is_a_text_part(harness):
    """A user turn's thought part is skipped, but its text must still be text (as in a model turn)."""
    key = bearer(harness.rollout["api_key"])
    contents = [{"parts": [{"text": 5, "thought": True}, {"text": "hi"}]}]
    resp = harness.gw.http.post(
        f"/v1beta/models/{MODEL}:generateContent", json={"contents": contents}, headers=key
    )
    _refused(resp, 400, "google")


def test_unpaired_surrogates_on_the_rollout_routes(harness):
    """The rollout routes read NaN literals (to refuse them as values) with json, which also reads
    unpaired surrogates, escaped or as raw bytes, into strings Redis cannot encode: the fail route
    stored its reason and answered 500. Now 400, as on the call routes (orjson refuses them)."""
    h = harness
    r = h.fresh_rollout()
    key = bearer(r["api_key"])
    for raw in (b'{"reason": "\\ud800"}', b'{"reason": "\xed\xa0\x80"}', b'{"reason": "\xff"}'):
        _refused(
            h.gw.http.post(f"/v1/rollouts/{r['rollout_id']}/fail", content=raw, headers=key), 400, "openai"
        )
    raw = b'{"call_id": "call-\\udfff", "reward": 1}'
    _refused(
        h.gw.http.post(f"/v1/sessions/{SESSION}/rewards", content=raw, headers=bearer(ADMIN)), 400, "openai"
    )
    assert h.gw.http.get(f"/v1/rollouts/{r['rollout_id']}", headers=key).json()["status"] == "running"
    resp = h.gw.http.post(
        f"/v1/rollouts/{r['rollout_id']}/fail", json={"reason": "\U0001f600 ok"}, headers=key
    )
    assert resp.status_code == 200 and resp.json()["reason"] == "\U0001f600 ok"
