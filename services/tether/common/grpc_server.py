"""gRPC server bootstrap: health, reflection, metrics port, graceful stop on SIGTERM/SIGINT, and the
service token that every call between Tether's services carries.

Service token: with TETHER_SERVICE_TOKEN (or TETHER_SERVICE_TOKEN_FILE, a mounted secret; it wins) set,
every server refuses a call whose metadata lacks `authorization: Bearer <token>` with UNAUTHENTICATED,
and every client channel made by `channel()` sends it. Health checks are exempt: kubelet's gRPC
probes and container HEALTHCHECKs cannot send metadata, and health reveals nothing. Compose and the
Helm chart always set it; the local launcher (`tether up`, `tether demo`, ...) writes a new one per
stack (`write_token_file`) unless the user gave one. Unset, calls are not checked (a service started
by hand, a test's in-process server).

TLS (optional; tether.common.tls reads the TETHER_TLS_* files): every server serves TLS, requiring a
client certificate from the CA when one is given (mutual TLS), and every channel made by `channel()`
presents the service's certificate; the token is checked on top. Health stays reachable for probes
that cannot do TLS on a plaintext port of its own that serves nothing else (TETHER_GRPC_HEALTH_PORT).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from tether.common import retry
from tether.common.tls import Tls, health_port_from_env, tls_from_env

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

_RUNNING_TO_END: set[asyncio.Task[object]] = set()

TOKEN_ENV = "TETHER_SERVICE_TOKEN"
TOKEN_FILE_ENV = "TETHER_SERVICE_TOKEN_FILE"
# Methods any caller may use without the token: health, for probes that cannot send metadata.
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def service_token(environ: dict[str, str] | None = None) -> str:
    """The deployment's service token: the file TETHER_SERVICE_TOKEN_FILE names (surrounding
    whitespace stripped), else TETHER_SERVICE_TOKEN, else "" (no token). A named file that cannot be
    read is an error (a missing secret must not turn authentication off)."""
    env = os.environ if environ is None else environ
    path = env.get(TOKEN_FILE_ENV, "")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise RuntimeError(f"{TOKEN_FILE_ENV}={path}: cannot read the service token: {exc}") from None
        if not token:
            raise RuntimeError(f"{TOKEN_FILE_ENV}={path}: the file is empty")
        return token
    return env.get(TOKEN_ENV, "").strip()


def token_given(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment names a service token (TETHER_SERVICE_TOKEN_FILE or TETHER_SERVICE_TOKEN,
    not empty): the user's own, which then wins over one the launcher would write."""
    env = os.environ if environ is None else environ
    return bool(env.get(TOKEN_FILE_ENV, "").strip() or env.get(TOKEN_ENV, "").strip())


def write_token_file(path: Path) -> str:
    """A new service token (256 random bits, URL-safe) written to `path`, readable and writable by its
    owner alone (mode 0600) from the moment the file exists, whatever the umask: made under a temporary
    name with that mode, then renamed over `path` (a process starting meanwhile reads the old token or
    the new, never half of one). Returns the token."""
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # left by a process of the same pid that died here
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # the umask can only take bits away; this makes the mode exact
        os.write(fd, f"{token}\n".encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return token


def _bearer(metadata: Any) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            scheme, _, credential = text.partition(" ")
            return credential.strip() if scheme.lower() == "bearer" else ""
    return ""


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuse, with UNAUTHENTICATED, every call but health's that does not carry the token."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        method = handler_call_details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(handler_call_details)
        given = _bearer(handler_call_details.invocation_metadata).encode()
        if hmac.compare_digest(given, self._token):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        return _refusal(handler, "missing service token" if not given else "wrong service token")


class StrictDecode(grpc.aio.ServerInterceptor):
    """A request that is not the method's message (bytes that do not parse) is refused with
    INVALID_ARGUMENT, the caller's mistake; gRPC's own decoding would answer INTERNAL, which reads as
    the server's fault (and which callers retry)."""

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        decode = handler.request_deserializer
        behaviour = handler.unary_stream if handler.response_streaming else handler.unary_unary
        method = handler_call_details.method

        async def parse(raw: bytes, context: Any) -> Any:
            try:
                return decode(raw)
            except Exception as exc:  # DecodeError, and whatever a bad wire type raises
                log.info("%s: a request that does not parse (%d bytes): %s", method, len(raw), exc)
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid message: {exc}"
                )

        if handler.response_streaming:

            async def unary_stream(raw: bytes, context: Any) -> AsyncIterator[Any]:
                request = await parse(raw, context)
                async for reply in behaviour(request, context):
                    yield reply

            return handler._replace(request_deserializer=None, unary_stream=unary_stream)

        async def unary_unary(raw: bytes, context: Any) -> Any:
            result = behaviour(await parse(raw, context), context)
            return await result if asyncio.iscoroutine(result) else result

        return handler._replace(request_deserializer=None, unary_unary=unary_unary)


def _refusal(handler: grpc.RpcMethodHandler | None, why: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that aborts with UNAUTHENTICATED (the shape must
    match: a streaming method answered by a unary handler breaks the call instead of refusing it)."""

    async def abort(request_or_iterator: Any, context: Any) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, f"{why}: this service needs Tether's service token"
        )

    async def abort_stream(request_or_iterator: Any, context: Any) -> AsyncIterator[Any]:
        await abort(request_or_iterator, context)
        yield  # pragma: no cover - abort raises

    streaming_in = bool(handler and handler.request_streaming)
    streaming_out = bool(handler and handler.response_streaming)
    if streaming_in and streaming_out:
        return grpc.stream_stream_rpc_method_handler(abort_stream)
    if streaming_in:
        return grpc.stream_unary_rpc_method_handler(abort)
    if streaming_out:
        return grpc.unary_stream_rpc_method_handler(abort_stream)
    return grpc.unary_unary_rpc_method_handler(abort)


class _SendToken:
    """Add `authorization: Bearer <token>` to a call's metadata."""

    def __init__(self, token: str) -> None:
        self._pair = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = [*(details.metadata or ()), self._pair]
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# grpc.aio files each interceptor under the first call kind it is an instance of: one class per kind.
class _SendTokenUnaryUnary(_SendToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _SendTokenUnaryStream(_SendToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _SendTokenStreamUnary(_SendToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


class _SendTokenStreamStream(_SendToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return await continuation(self._details(details), request_iterator)


def _token_senders(token: str) -> list[Any]:
    kinds = (_SendTokenUnaryUnary, _SendTokenUnaryStream, _SendTokenStreamUnary, _SendTokenStreamStream)
    return [kind(token) for kind in kinds]


async def run_to_end(coro: Awaitable[Any]) -> Any:
    """Await `coro` in its own task that a cancelled caller (a client that went away mid-RPC) does not
    cancel: it runs to its end, held here until then (the loop keeps only weak references to tasks)."""
    task = asyncio.ensure_future(coro)
    _RUNNING_TO_END.add(task)
    task.add_done_callback(_RUNNING_TO_END.discard)
    return await asyncio.shield(task)


async def cancel_until_done(*tasks: asyncio.Future[Any], poll_s: float = 1.0) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again each `poll_s` seconds. On
    Python 3.11 a cancel that lands as a redis-py socket timeout (asyncio.timeout) fires can be
    swallowed: the task loops on, and one cancel plus a plain wait then hangs for good (seen once in CI:
    a merger's loop kept reading its stream for 15 minutes after its test cancelled it)."""
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=poll_s)
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: no "exception was never retrieved" at exit


class Health:
    """Health the service sets from its real state (all names at once). `probe_server`: the
    plaintext health-only server (TETHER_GRPC_HEALTH_PORT), sharing this servicer, if there is one."""

    def __init__(self, names: Iterable[str]) -> None:
        self.servicer = health.aio.HealthServicer()
        self.names = ["", *names]
        self.probe_server: grpc.aio.Server | None = None
        self.probe_port = 0

    async def set(self, serving: bool) -> None:
        for name in self.names:
            await self.servicer.set(name, SERVING if serving else NOT_SERVING)

    async def close(self, grace: float | None = None) -> None:
        """Stop the health-only server (after the service's own: probes see NOT_SERVING until then)."""
        if self.probe_server is not None:
            await self.probe_server.stop(grace)
            self.probe_server = None


class _FromEnv:
    """Default of `tls` arguments: read TETHER_TLS_* (None is "no TLS")."""


FROM_ENV = _FromEnv()
_SIZE_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]


async def follow_health(
    health_handle: Health, probe: Callable[[], Awaitable[bool]], interval_s: float = 1.0, what: str = ""
) -> None:
    """Set health from `probe()` every `interval_s`, for good (a background task of
    `run_until_signal`): SERVING while it answers True, NOT_SERVING while it answers False or fails."""
    serving: bool | None = None
    while True:
        try:
            ok = bool(await probe())
        except Exception as exc:  # a probe that fails says "not serving", it does not end the watch
            log.debug("health probe failed: %r", exc)
            ok = False
        if ok != serving:
            if serving is not None:
                log.warning("%s: %s", what or "health", "serving again" if ok else "not serving")
            serving = ok
            await health_handle.set(ok)
        await asyncio.sleep(interval_s)


async def start_server(
    port: int,
    register: Callable[[grpc.aio.Server], Iterable[str]],
    host: str = "127.0.0.1",
    metrics_port: int = 0,
    token: str | None = None,
    tls: Tls | None | _FromEnv = FROM_ENV,
    health_port: int | None = None,
) -> tuple[grpc.aio.Server, Health, int]:
    """Start a grpc.aio server on host:port (0 = any free port). `register` adds servicers and
    returns their full service names. Returns the server, its health handle and the bound port.
    `token`: the service token calls must carry (None: `service_token()`; "": none). `tls`: the
    server's TLS (default: `tls_from_env()`; None: plaintext). `health_port`: a plaintext port that
    serves health only (None: TETHER_GRPC_HEALTH_PORT; 0: none); its server is `Health.probe_server`."""
    token = service_token() if token is None else token
    tls = tls_from_env() if isinstance(tls, _FromEnv) else tls
    health_port = health_port_from_env() if health_port is None else health_port
    # so_reuseport off: a second process on the same fixed port must fail loudly, not share it.
    server = grpc.aio.server(
        interceptors=[*([TokenCheck(token)] if token else []), StrictDecode()],
        options=[*_SIZE_OPTIONS, ("grpc.so_reuseport", 0)],
    )
    names = list(register(server))
    health_handle = Health(names)
    health_pb2_grpc.add_HealthServicer_to_server(health_handle.servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{host}:{port}"
    bound = (
        server.add_secure_port(address, tls.server_credentials())
        if tls is not None
        else server.add_insecure_port(address)
    )
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC port {address}")
    if health_port:
        # Health only, on its own server: nothing but grpc.health.v1 can be reached without TLS.
        probe = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(health_handle.servicer, probe)
        if probe.add_insecure_port(f"{host}:{health_port}") == 0:
            raise RuntimeError(f"cannot bind the gRPC health port {host}:{health_port}")
        await probe.start()
        health_handle.probe_server, health_handle.probe_port = probe, health_port
    await server.start()
    if metrics_port:
        start_http_server(metrics_port, addr=host)
    return server, health_handle, bound


async def finish_running(timeout_s: float) -> None:
    """Wait (up to `timeout_s`) for the work started with `run_to_end` -- a training step, a weight
    load, the merger's group in hand -- so that a SIGTERM never cuts it short; a supervisor's own
    grace period (the launcher's, Kubernetes') bounds it as well."""
    running = set(_RUNNING_TO_END)
    if running:
        log.info("stopping: finishing %d operation(s) in hand first", len(running))
        await asyncio.wait(running, timeout=timeout_s)


async def run_until_signal(
    server: grpc.aio.Server,
    health_handle: Health,
    background: Iterable[Awaitable[Any]] = (),
    on_stop: Callable[[], Awaitable[None]] | None = None,
    grace: float = 5.0,
    drain_s: float = 60.0,
) -> None:
    """Serve until SIGTERM/SIGINT or until a background task ends; then finish the operations in hand
    (`finish_running`, at most `drain_s`), drain and stop. A background
    task that failed is raised again once the server stopped, so the process exits non-zero and its
    supervisor (the launcher, Compose, Kubernetes) sees it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.ensure_future(b) for b in background]
    waiter = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    failure: BaseException | None = None
    for task in done:
        if task is not waiter and task.exception() is not None:
            failure = failure or task.exception()
            log.error("background task failed", exc_info=task.exception())
    await health_handle.set(False)
    await cancel_until_done(*tasks)
    await finish_running(drain_s)
    if on_stop is not None:
        await on_stop()
    await server.stop(grace)
    await health_handle.close(0)
    if failure is not None:
        raise failure


def channel(
    address: str,
    wait_for_ready: bool = True,
    token: str | None = None,
    tls: Tls | None | _FromEnv = FROM_ENV,
    server_name: str = "",
) -> grpc.aio.Channel:
    """A client channel to another service. With `wait_for_ready`, calls wait for a callee that is
    (re)starting instead of failing at once (a restart of the trainer, inference or the gateway is part
    of a run); a call's deadline still bounds the wait. Reconnect attempts back off to at most 5 s
    (gRPC's default grows to 2 min), so a restarted callee is found again soon. Retrying a failed call
    is the caller's (`tether.common.retry`). `token`: the service token every call carries (None:
    `service_token()`; "": none). `tls`: the client's TLS (default: `tls_from_env()`; None:
    plaintext): it presents its certificate and checks the server's against the CA. `server_name`: the
    name the server's certificate must carry when `address` is an IP a DNS name resolved to (unless
    TETHER_TLS_SERVER_NAME names one for every service)."""
    token = service_token() if token is None else token
    tls = tls_from_env() if isinstance(tls, _FromEnv) else tls
    interceptors = _token_senders(token) if token else None
    options: list[tuple[str, Any]] = [
        *_SIZE_OPTIONS,
        ("grpc.service_config", retry.service_config(wait_for_ready)),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 5000),
    ]
    if tls is None:
        return grpc.aio.insecure_channel(address, interceptors=interceptors, options=options)
    names = tls.channel_options()
    if not names and server_name:
        names = [("grpc.ssl_target_name_override", server_name)]
    return grpc.aio.secure_channel(
        address, tls.channel_credentials(), interceptors=interceptors, options=[*options, *names]
    )
