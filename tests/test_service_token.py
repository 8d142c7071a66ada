"""The service token between Tether's services (tether.common.grpc_server): a server with a token
refuses every call without it (unary and streaming alike) with UNAUTHENTICATED, answers health to
anyone, and `channel()` sends the token so Tether's own clients pass."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tether.common import grpc_server
from tether.common.grpc_server import channel, service_token, start_server

SERVICE = "tether.test.Echo"


def _echo(server: grpc.aio.Server) -> list[str]:
    async def unary(request: bytes, context) -> bytes:
        return request

    async def stream(request: bytes, context):
        for _ in range(3):
            yield request

    handlers = {
        "Say": grpc.unary_unary_rpc_method_handler(unary),
        "Repeat": grpc.unary_stream_rpc_method_handler(stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    return [SERVICE]


async def _calls(ch: grpc.aio.Channel) -> dict[str, object]:
    """Each kind of call, with its answer or its status code."""
    say = ch.unary_unary(f"/{SERVICE}/Say")
    repeat = ch.unary_stream(f"/{SERVICE}/Repeat")
    out: dict[str, object] = {}
    try:
        out["unary"] = await say(b"hi", timeout=5)
    except grpc.aio.AioRpcError as exc:
        out["unary"] = exc.code()
    try:
        out["stream"] = [m async for m in repeat(b"x", timeout=5)]
    except grpc.aio.AioRpcError as exc:
        out["stream"] = exc.code()
    try:  # reflection: a stream-stream method, and no schema for strangers
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        out["reflection"] = [r async for r in refl.ServerReflectionInfo(iter([req]), timeout=5)][
            0
        ].WhichOneof("message_response")
    except grpc.aio.AioRpcError as exc:
        out["reflection"] = exc.code()
    reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    out["health"] = reply.status
    return out


def _run(token: str, client_token: str) -> dict[str, object]:
    async def main() -> dict[str, object]:
        server, health, port = await start_server(0, _echo, token=token)
        await health.set(True)
        try:
            async with channel(f"127.0.0.1:{port}", wait_for_ready=False, token=client_token) as ch:
                return await _calls(ch)
        finally:
            await server.stop(0)

    return asyncio.run(main())


UNAUTH = grpc.StatusCode.UNAUTHENTICATED
SERVING = health_pb2.HealthCheckResponse.SERVING


def test_without_the_token_every_call_but_health_is_refused():
    out = _run("s3cret-token", "")
    assert out == {"unary": UNAUTH, "stream": UNAUTH, "reflection": UNAUTH, "health": SERVING}


def test_a_wrong_token_is_refused():
    out = _run("s3cret-token", "s3cret-tokem")
    assert out["unary"] == UNAUTH and out["stream"] == UNAUTH


def test_the_right_token_passes():
    out = _run("s3cret-token", "s3cret-token")
    assert out == {
        "unary": b"hi",
        "stream": [b"x"] * 3,
        "reflection": "list_services_response",
        "health": SERVING,
    }


def test_no_token_configured_checks_nothing():
    assert _run("", "")["unary"] == b"hi"


def test_refusal_names_no_token():
    async def main() -> str:
        server, _, port = await start_server(0, _echo, token="s3cret-token")
        try:
            async with channel(f"127.0.0.1:{port}", wait_for_ready=False, token="guess-123") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await ch.unary_unary(f"/{SERVICE}/Say")(b"hi", timeout=5)
                return err.value.details() or ""
        finally:
            await server.stop(0)

    details = asyncio.run(main())
    assert "wrong service token" in details
    assert "s3cret" not in details and "guess" not in details


def test_token_from_the_environment_reaches_server_and_channel(monkeypatch, tmp_path):
    secret = tmp_path / "token"
    secret.write_text("file-token\n")
    monkeypatch.setenv(grpc_server.TOKEN_ENV, "env-token")
    monkeypatch.setenv(grpc_server.TOKEN_FILE_ENV, str(secret))
    assert service_token() == "file-token"  # the mounted secret wins

    async def main() -> tuple[object, object]:
        server, _, port = await start_server(0, _echo)  # token from the environment
        try:
            async with channel(f"127.0.0.1:{port}", wait_for_ready=False) as ch:  # token too
                ours = await ch.unary_unary(f"/{SERVICE}/Say")(b"ok", timeout=5)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as bare:
                try:
                    await bare.unary_unary(f"/{SERVICE}/Say")(b"ok", timeout=5)
                    theirs: object = "answered"
                except grpc.aio.AioRpcError as exc:
                    theirs = exc.code()
            return ours, theirs
        finally:
            await server.stop(0)

    assert asyncio.run(main()) == (b"ok", UNAUTH)


@pytest.mark.parametrize("content", ["", "  \n"])
def test_an_empty_or_missing_token_file_is_an_error_not_no_auth(tmp_path, content):
    path = tmp_path / "token"
    if content:
        path.write_text(content)
        with pytest.raises(RuntimeError, match="empty"):
            service_token({grpc_server.TOKEN_FILE_ENV: str(path)})
    else:
        with pytest.raises(RuntimeError, match="cannot read"):
            service_token({grpc_server.TOKEN_FILE_ENV: str(path)})
