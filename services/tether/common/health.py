"""`tether health`: one health check of one service, for container HEALTHCHECKs and probes.

    tether health --grpc HOST:PORT [--service NAME] [--plaintext] [--timeout S]
                                                                    gRPC health: SERVING = healthy
    tether health --http URL [--timeout S]                          HTTP GET: 200 = healthy
    tether health                                                   the target in TETHER_HEALTH

Exit 0 when healthy; 1 otherwise, with a one-line reason on stderr (Docker reserves exit 2, so bad
arguments exit 1 too). TETHER_HEALTH holds `grpc://HOST:PORT[/SERVICE]` or an `http(s)://` URL: an
image's HEALTHCHECK line is one command for every service, and each container sets its own target.

It runs every few seconds in every container, so it imports only grpc's health stubs or urllib (no
pydantic, no settings), and works in any image that has the core installed
(`python -m tether.common.health` is the same command). With the TETHER_TLS_* files set (the
container's own, tether.common.tls) the gRPC check dials with TLS and presents the certificate, as
every client of the service's port must; `--plaintext` dials without it (the health-only port,
TETHER_GRPC_HEALTH_PORT).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

ENV = "TETHER_HEALTH"
DEFAULT_TIMEOUT_S = 3.0


class Refused(ValueError):
    """A target or option that cannot be checked (bad arguments)."""


@dataclass(frozen=True)
class Target:
    kind: str  # "grpc" or "http"
    address: str  # host:port for gRPC, the URL for HTTP
    service: str = ""  # the gRPC health service name ("" = the server as a whole)
    plaintext: bool = False  # gRPC without TLS even where TETHER_TLS_* are set


def grpc_address(value: str) -> str:
    """`HOST:PORT` (a bracketed IPv6 host too) with a port in 1..65535; raises Refused otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise Refused(f"--grpc wants HOST:PORT with a port in 1..65535, got {value!r}")
    return value


def http_url(value: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Refused(f"--http wants an http:// or https:// URL, got {value!r}")
    try:
        parts.port  # noqa: B018 - a port out of range raises here
    except ValueError as exc:
        raise Refused(f"--http: {exc} in {value!r}") from None
    return value


def target_from_env(value: str) -> Target:
    """TETHER_HEALTH: `grpc://HOST:PORT[/SERVICE]` or an http(s) URL."""
    if value.startswith("grpc://"):
        address, _, service = value.removeprefix("grpc://").partition("/")
        return Target("grpc", grpc_address(address), service)
    if value.startswith(("http://", "https://")):
        return Target("http", http_url(value))
    raise Refused(f"{ENV} wants grpc://HOST:PORT[/SERVICE] or an http(s):// URL, got {value!r}")


def check_grpc(address: str, service: str, timeout_s: float, plaintext: bool = False) -> str | None:
    """None when the server reports `service` SERVING, else why not. TLS as TETHER_TLS_* say, unless
    `plaintext`."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tether.common.tls import TlsSettingsError, sync_channel, tls_from_env

    try:
        tls = None if plaintext else tls_from_env()
    except TlsSettingsError as exc:
        return str(exc)
    with sync_channel(address, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            name = code.name if code is not None else "error"
            if code == grpc.StatusCode.NOT_FOUND:
                return f"gRPC {address}: no health status for service {service!r}"
            return f"gRPC {address}: {name}: {exc.details() if hasattr(exc, 'details') else exc}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"gRPC {address}{' ' + service if service else ''}: {status}"
    return None


def check_http(url: str, timeout_s: float) -> str | None:
    """None when GET `url` answers 200, else why not."""
    import urllib.error
    import urllib.request

    try:
        # The scheme is checked (http_url) before this is called: no file:// or other handlers.
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310
            status = resp.status
            body = resp.read(200)
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read(200)
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"GET {url}: {reason}"
    if status != 200:
        text = body.decode("utf-8", "replace").replace("\n", " ").strip()
        return f"GET {url}: {status}{': ' + text if text else ''}"
    return None


def check(target: Target, timeout_s: float) -> str | None:
    if target.kind == "grpc":
        return check_grpc(target.address, target.service, timeout_s, target.plaintext)
    return check_http(target.address, timeout_s)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise Refused(message)


def add_arguments(p: argparse.ArgumentParser) -> None:
    how = p.add_mutually_exclusive_group()
    how.add_argument("--grpc", metavar="HOST:PORT", help="gRPC health check (SERVING = healthy)")
    how.add_argument(
        "--http", metavar="URL", help="HTTP GET (200 = healthy), e.g. http://127.0.0.1:8000/health"
    )
    p.add_argument("--service", default="", help="gRPC health service name (default: the whole server)")
    p.add_argument(
        "--plaintext",
        action="store_true",
        help="gRPC without TLS even where TETHER_TLS_* are set (the health-only port)",
    )
    p.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S", help="seconds (default 3)"
    )


def parse(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> tuple[Target, float]:
    """The target and timeout `argv` asks for; raises Refused on bad arguments."""
    p = _Parser(prog="tether health", add_help=True)
    add_arguments(p)
    args = p.parse_args(list(argv))
    if not (args.timeout > 0 and args.timeout < 3600):  # NaN fails too
        raise Refused(f"--timeout wants seconds in (0, 3600), got {args.timeout}")
    if args.grpc is not None:
        return Target("grpc", grpc_address(args.grpc), args.service, args.plaintext), args.timeout
    if args.service or args.plaintext:
        raise Refused(f"{'--service' if args.service else '--plaintext'} goes with --grpc")
    if args.http is not None:
        return Target("http", http_url(args.http)), args.timeout
    value = environ.get(ENV, "")
    if not value:
        raise Refused(f"give --grpc HOST:PORT or --http URL (or set {ENV})")
    return target_from_env(value), args.timeout


def main(argv: Sequence[str] | None = None) -> int:
    """Exit status: 0 healthy, 1 not (or bad arguments)."""
    try:
        target, timeout_s = parse(sys.argv[1:] if argv is None else argv)
    except Refused as exc:
        print(f"tether health: {exc}", file=sys.stderr)
        return 1
    reason = check(target, timeout_s)
    if reason is not None:
        print(f"unhealthy: {reason}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
