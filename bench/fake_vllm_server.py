#!/usr/bin/env python3
"""A canned vLLM look-alike for bench/gateway_overhead: far cheaper than any proxy in front of it.

Every POST to /v1/chat/completions gets the same pre-built answer, shaped like vLLM 0.32's with
`return_token_ids` and `logprobs`: a 1,024-token prompt (`prompt_token_ids`) and a 128-token
completion (token ids and per-token logprobs). A body holding `"stream":true` gets the same answer as
SSE: a first chunk with the prompt ids, one chunk per token (content, logprobs, token ids), a final
usage chunk, then [DONE]. GET /health and GET /v1/models answer 200.

It is a raw asyncio protocol writing pre-built bytes: no HTTP library, no JSON encoding per request.
Stream events go out as separate writes, yielding to the loop between them, so that a proxy reads a
stream in several pieces as it would from a real engine; `--tick-ms` paces tokens instead, like an
engine step (every active stream gets its next token each tick).

Usage: bench/fake_vllm_server.py --port 8000 [--tick-ms 0]; prints "ready <port>" once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket

PROMPT_TOKENS = 1024
COMPLETION_TOKENS = 128
MODEL = "tether-policy"


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
                "message": {
                    "role": "assistant",
                    "content": "".join(toks),
                    "tool_calls": [],
                    "reasoning_content": None,
                },
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
                        "stop_reason": None,
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


class FakeProtocol(asyncio.Protocol):
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


async def serve(port: int, tick_ms: float, host: str = "127.0.0.1") -> None:
    canned_ = Canned(tick_ms)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FakeProtocol(canned_), host, port, backlog=4096)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
        run(serve(args.port, args.tick_ms))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
