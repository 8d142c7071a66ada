"""The gateway's OpenAPI 3.1 document (`GET /openapi.json`), built from the body types in bodies.py.

FastAPI cannot generate it: the routes read their raw bodies themselves (a body is parsed once, by the
API's own parser, and recorded as sent), and the call routes are plain ASGI it never sees. So this
module lays out the routes (paths, keys, statuses, each family's error shape) and takes every body's
schema from the type its parser validates with (`bodies.schemas`): the document cannot drift from the
parsers. The served model, known only at run time, is written into each request's `model`.

tests/test_gateway_openapi.py holds this document and the app's routes to each other (both ways) and
validates it as OpenAPI 3.1; tests/test_gateway_fuzz.py fuzzes the gateway from it (schemathesis).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import orjson

from tether.gateway import bodies, gemini

Schema = dict[str, Any]

ROLLOUT_PREFIX = "/rollouts/{rollout_id}"
# The API families: how each answers an error, and the keys it takes.
OPENAI, ANTHROPIC, GOOGLE = "openai", "anthropic", "google"
_ERROR_TYPE = {OPENAI: bodies.OpenAIError, ANTHROPIC: bodies.AnthropicError, GOOGLE: bodies.GoogleError}
# Every key header a call route reads (app._call_headers); Google's clients may also use ?key=.
_CALL_SECURITY: list[dict[str, list[str]]] = [{"rolloutKey": []}, {"xApiKey": []}, {"azureApiKey": []}]
_GOOGLE_SECURITY: list[dict[str, list[str]]] = [{"googApiKey": []}, {"googKeyQuery": []}, *_CALL_SECURITY]
_ADMIN_SECURITY: list[dict[str, list[str]]] = [
    {"adminToken": []},
    {},
]  # {}: a loopback gateway without an admin token
_OWN: list[dict[str, list[str]]] = [{"rolloutKey": []}, {"adminToken": []}, {"runKey": []}]
# What a call route may answer besides 200: the request's fault, the key's, the rollout's state,
# admission paused (429), the upstream's (5xx: never expected from a healthy upstream).
_CALL_ERRORS = (400, 401, 403, 404, 405, 409, 413, 422, 429, 502, 503, 504)
_ROUTE_ERRORS = (400, 401, 403, 404, 405, 409, 413, 422, 503)
_MODEL_ERRORS = (401, 403, 404, 503)
_OBJECT: Schema = {"type": "object"}
_SSE = "text/event-stream"
_SECURITY_SCHEMES: Schema = {
    "rolloutKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "a rollout's key (tr-...), or a deployment key",
    },
    "adminToken": {"type": "http", "scheme": "bearer", "description": "TETHER_ADMIN_TOKEN"},
    "runKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "a run's API key (trk-...): its own run's rollouts only (docs/runs.md)",
    },
    "deploymentKey": {
        "type": "http",
        "scheme": "bearer",
        "description": "a record-only session's deployment key",
    },
    "xApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    "azureApiKey": {"type": "apiKey", "in": "header", "name": "api-key"},
    "googApiKey": {"type": "apiKey", "in": "header", "name": "x-goog-api-key"},
    "googKeyQuery": {"type": "apiKey", "in": "query", "name": "key"},
}


@dataclass(frozen=True)
class Op:
    """One operation: what it answers (a body type, or a schema where the answer is not JSON of a
    type), its family's errors, and the body type its parser validates with."""

    op_id: str
    summary: str
    family: str
    ok: Any
    errors: tuple[int, ...]
    body: Any = None
    security: list[dict[str, list[str]]] | None = None
    stream: bool = False
    ok_status: int = 200
    body_required: bool = True


def _param(name: str, description: str = "", slashes: bool = False) -> Schema:
    """A path parameter: one path segment, or (`slashes`) several, for model names ("org/name")."""
    schema: Schema = {"type": "string", "minLength": 1}
    if not slashes:
        schema["pattern"] = "^[^/]+$"
    out: Schema = {"name": name, "in": "path", "required": True, "schema": schema}
    if description:
        out["description"] = description
    return out


def _query(name: str, description: str) -> Schema:
    """An optional query parameter (a string)."""
    return {
        "name": name,
        "in": "query",
        "required": False,
        "schema": {"type": "string"},
        "description": description,
    }


_ROLLOUT_PARAM = _param("rollout_id", "the rollout the key must belong to (403 otherwise)")
_ROLLOUT_ID = _param("rollout_id")
_RUN_QUERY = _query("run", "the run whose rollout it is (the admin token; without it, the base namespace's)")
_CALL_ID = _param("call_id", "a recorded call's id (x-tether-call-id)")
_GEMINI_MODEL = _param("model", "the served model, optionally as models/<name>", slashes=True)
_ALT = _query("alt", "sse: a stream as SSE; anything else: one JSON array")


class _Builder:
    """Collects the paths and the body types they name; `schema` turns a type into its $ref."""

    def __init__(self, model: Schema) -> None:
        self.model = model  # the schema of a request's `model`
        self.paths: Schema = {}
        self.types: list[Any] = []

    def schema(self, kind: Any) -> Schema:
        if isinstance(kind, dict):
            return kind
        self.types.append(kind)
        return {"$ref": f"#/components/schemas/{kind.__name__}"}

    def op(self, op: Op) -> Schema:
        content: Schema = {"application/json": {"schema": self.schema(op.ok)}}
        if op.stream:  # the schema of one event
            content[_SSE] = {"schema": {"type": "object", "properties": {"data": {"type": "string"}}}}
        error = {"application/json": {"schema": self.schema(_ERROR_TYPE[op.family])}}
        out: Schema = {
            "operationId": op.op_id,
            "summary": op.summary,
            "responses": {
                str(op.ok_status): {"description": "ok", "content": content},
                **{
                    str(s): {"description": f"error, in {op.family}'s shape", "content": error}
                    for s in op.errors
                },
            },
        }
        if op.body is not None:
            out["requestBody"] = {
                "required": op.body_required,
                "content": {"application/json": {"schema": self.schema(op.body)}},
            }
        if op.security is not None:
            out["security"] = op.security
        return out

    def add(self, path: str, method: str, op: Op, params: list[Schema] | None = None) -> None:
        self.paths.setdefault(path, {})[method] = self.op(op)
        if params:
            self.paths[path][method]["parameters"] = params

    def both(self, path: str, method: str, op: Op, params: list[Schema] | None = None) -> None:
        """`path` and its /rollouts/{rollout_id} form (an operationId of its own)."""
        self.add(path, method, op, params)
        scoped = Op(**{**op.__dict__, "op_id": op.op_id + "_for_rollout"})
        self.add(ROLLOUT_PREFIX + path, method, scoped, [_ROLLOUT_PARAM, *(params or [])])


def _agent_routes(b: _Builder) -> None:
    """The routes agents call: OpenAI's, Anthropic's, the models lists."""
    calls = [
        (
            "/v1/chat/completions",
            "chat_completions",
            "OpenAI chat completions",
            bodies.ChatCompletionRequest,
            bodies.Completion,
            OPENAI,
        ),
        (
            "/v1/completions",
            "completions",
            "OpenAI completions, one prompt",
            bodies.CompletionRequest,
            bodies.Completion,
            OPENAI,
        ),
        (
            "/v1/messages",
            "messages",
            "Anthropic Messages, translated to chat",
            bodies.MessagesBody,
            bodies.AnthropicMessage,
            ANTHROPIC,
        ),
        (
            "/v1/responses",
            "responses",
            "OpenAI Responses, translated to chat",
            bodies.ResponsesBody,
            bodies.Response,
            OPENAI,
        ),
    ]
    for path, op_id, summary, body, ok, family in calls:
        b.both(
            path,
            "post",
            Op(op_id, f"{summary} (recorded)", family, ok, _CALL_ERRORS, body, _CALL_SECURITY, stream=True),
        )
    count = Op(
        "messages_count_tokens",
        "Anthropic token count (vLLM's /tokenize; not recorded)",
        ANTHROPIC,
        bodies.InputTokens,
        _CALL_ERRORS,
        bodies.MessagesCountTokensBody,
        _CALL_SECURITY,
    )
    b.both("/v1/messages/count_tokens", "post", count)
    stored = Op("get_response", "No response is stored here: always 404", OPENAI, _OBJECT, (404,))
    b.add("/v1/responses/{response_id}", "get", stored)
    b.add("/v1/responses/{response_id}", "delete", Op(**{**stored.__dict__, "op_id": "delete_response"}))
    b.paths["/v1/responses/{response_id}"]["parameters"] = [_param("response_id")]
    b.both(
        "/v1/models",
        "get",
        Op("list_models", "The served model (OpenAI's list)", OPENAI, bodies.ModelList, _MODEL_ERRORS),
    )
    get_model = Op(
        "get_model", "The served model (404 for any other id)", OPENAI, bodies.Model, _MODEL_ERRORS
    )
    b.both("/v1/models/{model_id}", "get", get_model, [_param("model_id", slashes=True)])


def _gemini_routes(b: _Builder) -> None:
    """Google's generateContent, streamGenerateContent and countTokens, under /v1beta and /v1."""
    for prefix, suffix in (("/v1beta", ""), ("/v1", "_v1")):
        for method, what, ok in (
            (gemini.GENERATE, "Gemini generateContent", bodies.GenerateContentResponse),
            (
                gemini.STREAM_GENERATE,
                "Gemini streamGenerateContent: SSE with ?alt=sse, else one JSON array",
                {"type": "array", "items": b.schema(bodies.GenerateContentResponse)},
            ),
        ):
            op = Op(
                f"gemini_{method}{suffix}",
                f"{what} (recorded)",
                GOOGLE,
                ok,
                _CALL_ERRORS,
                bodies.GenerateContentBody,
                _GOOGLE_SECURITY,
                stream=method == gemini.STREAM_GENERATE,
            )
            b.both(f"{prefix}/models/{{model}}:{method}", "post", op, [_GEMINI_MODEL, _ALT])
        count = Op(
            f"gemini_countTokens{suffix}",
            "Gemini countTokens (vLLM's /tokenize; not recorded)",
            GOOGLE,
            bodies.TotalTokens,
            _CALL_ERRORS,
            bodies.GeminiCountTokensBody,
            _GOOGLE_SECURITY,
        )
        b.both(f"{prefix}/models/{{model}}:countTokens", "post", count, [_GEMINI_MODEL])
    listed = Op(
        "gemini_list_models",
        "The served model (Google's list)",
        GOOGLE,
        bodies.GoogleModelList,
        _MODEL_ERRORS,
    )
    b.both("/v1beta/models", "get", listed)
    one = Op(
        "gemini_get_model", "The served model (Google's resource)", GOOGLE, bodies.GoogleModel, _MODEL_ERRORS
    )
    b.both("/v1beta/models/{model}", "get", one, [_GEMINI_MODEL])


def _rollout_routes(b: _Builder) -> None:
    """The rollout API: create, look at, complete, fail."""
    create = Op(
        "create_rollout",
        "Create a rollout and its key (admin; or a run's key: in its run)",
        OPENAI,
        bodies.NewRollout,
        _ROUTE_ERRORS,
        bodies.CreateRolloutRequest,
        [*_ADMIN_SECURITY, {"runKey": []}],
        ok_status=201,
    )
    b.add("/v1/rollouts", "post", create)
    state = "A rollout's state (its key, the admin token; anyone on a loopback gateway without one)"
    ops = [
        ("", "get", Op("get_rollout", state, OPENAI, bodies.Rollout, _ROUTE_ERRORS, security=[*_OWN, {}])),
        (
            "/complete",
            "post",
            Op(
                "complete_rollout",
                "Complete once, with the rollout's reward (409 after)",
                OPENAI,
                bodies.Rollout,
                _ROUTE_ERRORS,
                bodies.RewardRequest,
                _OWN,
            ),
        ),
        (
            "/fail",
            "post",
            Op(
                "fail_rollout",
                "Fail once (409 after)",
                OPENAI,
                bodies.Rollout,
                _ROUTE_ERRORS,
                bodies.FailRolloutRequest,
                _OWN,
                body_required=False,
            ),
        ),
    ]
    for suffix, method, op in ops:
        b.add(f"/v1/rollouts/{{rollout_id}}{suffix}", method, op)
        b.paths[f"/v1/rollouts/{{rollout_id}}{suffix}"]["parameters"] = [_ROLLOUT_ID, _RUN_QUERY]


_RUN_ID = _param("run_id", "a run's id (a slug; 400 for an id no run can have)")


def _run_routes(b: _Builder) -> None:
    """The run registry (admin): create, list, read, stop."""
    create = Op(
        "create_run",
        "Create a run and its API key, shown once (admin)",
        OPENAI,
        bodies.NewRun,
        _ROUTE_ERRORS,
        bodies.CreateRunRequest,
        _ADMIN_SECURITY,
        ok_status=201,
    )
    b.add("/v1/runs", "post", create)
    b.add(
        "/v1/runs",
        "get",
        Op("list_runs", "Every run (admin)", OPENAI, bodies.RunList, _ROUTE_ERRORS, security=_ADMIN_SECURITY),
    )
    get = Op("get_run", "One run (admin)", OPENAI, bodies.Run, _ROUTE_ERRORS, security=_ADMIN_SECURITY)
    b.add("/v1/runs/{run_id}", "get", get, [_RUN_ID])
    stop = Op(
        "stop_run",
        "Stop a run: created or running -> stopping -> stopped; as it is when stopping or stopped (admin)",
        OPENAI,
        bodies.Run,
        _ROUTE_ERRORS,
        security=_ADMIN_SECURITY,
    )
    b.add("/v1/runs/{run_id}/stop", "post", stop, [_RUN_ID])


def _reward_routes(b: _Builder) -> None:
    """Rewards of single calls: of a running rollout, of the key's own, of a record-only session."""
    call = Op(
        "reward_call",
        "Reward one call of a running rollout",
        OPENAI,
        bodies.CallReward,
        _ROUTE_ERRORS,
        bodies.RewardRequest,
        [*_OWN, {"xApiKey": []}, {"azureApiKey": []}],
    )
    b.add("/v1/rollouts/{rollout_id}/calls/{call_id}/reward", "post", call)
    b.paths["/v1/rollouts/{rollout_id}/calls/{call_id}/reward"]["parameters"] = [
        _ROLLOUT_ID,
        _CALL_ID,
        _RUN_QUERY,
    ]
    own = Op(
        "reward_own_call",
        "Reward one call of the key's rollout",
        OPENAI,
        bodies.CallReward,
        _ROUTE_ERRORS,
        bodies.RewardRequest,
        _CALL_SECURITY,
    )
    b.both("/v1/calls/{call_id}/reward", "post", own, [_CALL_ID])
    session = Op(
        "reward_session_call",
        "Reward one call of a record-only session, once",
        OPENAI,
        _OBJECT,
        _ROUTE_ERRORS,
        bodies.SessionRewardRequest,
        [{"adminToken": []}, {"deploymentKey": []}, {}],
        ok_status=201,
    )
    b.add("/v1/sessions/{name}/rewards", "post", session)
    b.paths["/v1/sessions/{name}/rewards"]["parameters"] = [
        _param("name", "a record-only session (docs/gateway.md)")
    ]


def _operations(b: _Builder) -> None:
    """The probes, health, metrics and this document."""
    probe = {"responses": {"200": {"description": "reachable (Claude Code probes its base URL)"}}}
    b.paths["/"] = {"head": {**probe, "operationId": "probe"}}
    b.paths[ROLLOUT_PREFIX] = {
        "parameters": [_param("rollout_id")],
        "head": {**probe, "operationId": "probe_for_rollout"},
    }

    def answer(description: str, kind: Any) -> Schema:
        return {"description": description, "content": {"application/json": {"schema": b.schema(kind)}}}

    health = {"200": answer("ok", bodies.Health), "503": answer("Redis unreachable", bodies.Unhealthy)}
    b.paths["/health"] = {
        "get": {
            "operationId": "health",
            "summary": "Redis reachable, admission, weight version, replicas",
            "responses": health,
        }
    }
    text = {"200": {"description": "ok", "content": {"text/plain": {"schema": {"type": "string"}}}}}
    b.paths["/metrics"] = {
        "get": {"operationId": "metrics", "summary": "Prometheus exposition", "responses": text}
    }
    doc = {"200": answer("ok", _OBJECT)}
    b.paths["/openapi.json"] = {
        "get": {"operationId": "openapi", "summary": "This document", "responses": doc}
    }


def document(served_model: str, version: str = "1") -> Schema:
    """The whole OpenAPI 3.1 document for a gateway serving `served_model`."""
    b = _Builder({"enum": [served_model], "description": bodies.MODEL_DESCRIPTION})
    _agent_routes(b)
    _gemini_routes(b)
    _rollout_routes(b)
    _run_routes(b)
    _reward_routes(b)
    _operations(b)
    _, components = bodies.schemas(b.types)
    for kind in _ERROR_TYPE.values():  # self-contained: a client checks an error with its schema alone
        components[kind.__name__] = _inlined(components[kind.__name__], components)
    for name in [n for n in components if n.endswith("ErrorDetail")]:
        if f'"#/components/schemas/{name}"' not in orjson.dumps(components).decode():
            del components[name]
    for schema in components.values():  # each request's bodies.Model field
        if schema.get("properties", {}).get("model", {}).get("description") == bodies.MODEL_DESCRIPTION:
            schema["properties"]["model"] = b.model
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Tether gateway",
            "version": version,
            "description": "OpenAI, Anthropic and Gemini APIs in front of vLLM, every call recorded; the rollout API. Errors come in each API's own shape.",
        },
        "paths": b.paths,
        "components": {"schemas": components, "securitySchemes": copy.deepcopy(_SECURITY_SCHEMES)},
    }


def _inlined(schema: Any, components: Schema) -> Any:
    """`schema` with every $ref into `components` replaced by (a copy of) what it names."""
    if isinstance(schema, list):
        return [_inlined(x, components) for x in schema]
    if not isinstance(schema, dict):
        return schema
    if set(schema) == {"$ref"}:
        return _inlined(components[schema["$ref"].rsplit("/", 1)[1]], components)
    return {k: _inlined(v, components) for k, v in schema.items()}


def served_routes(app: Any) -> set[tuple[str, str]]:
    """(METHOD, path) of every route a `create_app` app serves, written as this document writes them:
    the call routes (app.CallRoutes, plain ASGI, POST only; Gemini's matched by `{model}:{method}`) and
    the FastAPI routes behind them (`:path` converters dropped, `{path_rollout}` as `{rollout_id}`,
    countTokens as the only `models/{target}` POST they serve). HEAD beside GET is Starlette's own."""
    while not hasattr(app, "fallback"):  # CORS and other middleware around the call routes
        app = app.app
    out = {("POST", path) for path in app._plain}
    out |= {("POST", route) for _, route in app._for_rollout.values()}
    for prefix in ("", ROLLOUT_PREFIX):
        for base in ("/v1beta/models/", "/v1/models/"):
            out |= {("POST", f"{prefix}{base}{{model}}:{method}") for method in gemini.METHODS}
    for route in app.fallback.routes:
        path = route.path.replace(":path}", "}").replace("{path_rollout}", "{rollout_id}")
        methods = set(route.methods) - ({"HEAD"} if "GET" in route.methods else set())
        if path.endswith("/models/{target}"):
            path = path.replace("{target}", f"{{model}}:{gemini.COUNT_TOKENS}")
        out |= {(m, path) for m in methods}
    return out


def documented_routes(doc: Schema) -> set[tuple[str, str]]:
    methods = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
    return {(m.upper(), path) for path, item in doc["paths"].items() for m in item if m in methods}
