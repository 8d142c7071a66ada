"""Every gateway replica's GatewayControl as one stub: admission is per gateway process (its gate,
its calls in flight), so with several replicas the scheduler pauses, resumes and reads each of them.
A replica left open during a colocated push would admit calls while vLLM loads new weights and record
them under the old version.

Which replicas: the control address spec lists `host:port` entries (the launcher names each process)
and `dns:host:port` entries, every address `host` resolves to at the time of the call (a Kubernetes
headless Service lists every gateway pod; Docker's DNS every container of a scaled Compose service).
Names are resolved again on every call, so pods that come and go are followed.

The admission state also lives in Redis (`Keys.admission`): set before a pause reaches any replica,
cleared before a resume does. A replica that starts (or restarts) while the run is paused reads it and
starts paused, and one that the pause missed (a pod not yet in DNS) pauses itself on its next look
(gateway.main). So a replica cannot admit calls through a weight push just because it was late.

Who may call: scheduler.main (wiring); run.py sees only the stub methods.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from redis.asyncio import Redis

from tether.common.broker import Keys
from tether.common.grpc_server import channel
from tether.v1 import gateway_pb2

log = logging.getLogger(__name__)

DNS = "dns:"


def control_addresses(spec: str) -> list[str]:
    """ "host:port,dns:host:port" -> the entries, each once, in order."""
    return list(dict.fromkeys(a.strip() for a in spec.split(",") if a.strip()))


def split_host_port(address: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port); ValueError when it is neither."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


def check_spec(spec: str) -> None:
    """ValueError naming the first entry that is not `host:port` or `dns:host:port`."""
    entries = control_addresses(spec)
    if not entries:
        raise ValueError("name at least one host:port")
    for entry in entries:
        split_host_port(entry.removeprefix(DNS))


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_host(host: str, port: int) -> list[str]:
    """Every address `host` resolves to now, sorted; none when it does not resolve (a headless Service
    with no ready pod has no record)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return []
    return sorted({str(info[4][0]) for info in infos})


async def replicas_of(spec: str, resolve: Resolver = resolve_host) -> list[tuple[str, str]]:
    """(address, name) of every replica the spec names now; `name` is the DNS name an address came
    from (for TLS: the certificate names the Service, not the pod's IP), "" for a literal entry."""
    out: list[tuple[str, str]] = []
    for entry in control_addresses(spec):
        if not entry.startswith(DNS):
            out.append((entry, ""))
            continue
        host, port = split_host_port(entry.removeprefix(DNS))
        out += [(join_host_port(ip, port), host) for ip in sorted(await resolve(host, port))]
    return list(dict.fromkeys(out))


def combine(statuses: Sequence[gateway_pb2.AdmissionStatus], paused: bool) -> gateway_pb2.AdmissionStatus:
    """The replicas' admission as one: paused only when every replica is, their calls in flight added
    up (above 0 after a pause: some replica's drain timed out), the oldest weight version any serves.
    With no replica at all: `paused` (what the run asked for) and nothing in flight."""
    if not statuses:
        return gateway_pb2.AdmissionStatus(paused=paused, in_flight=0, weight_version=0)
    return gateway_pb2.AdmissionStatus(
        paused=all(s.paused for s in statuses),
        in_flight=sum(s.in_flight for s in statuses),
        weight_version=min(s.weight_version for s in statuses),
    )


class ControlChannels:
    """The replicas' gRPC channels, by (address, name): GatewayReplicas' `stub` opens, `close` closes."""

    def __init__(self) -> None:
        self._open: dict[tuple[str, str], grpc.aio.Channel] = {}

    def open(self, address: str, name: str) -> grpc.aio.Channel:
        made = self._open[(address, name)] = channel(address, server_name=name)
        return made

    async def close(self, address: str, name: str) -> None:
        made = self._open.pop((address, name), None)
        if made is not None:
            await made.close()


class GatewayReplicas:
    """Calls each replica's stub concurrently; a failure on any replica fails the call, as with one
    gateway. `stub(address, name)` makes a replica's stub (retried by its own `Retrying`) and
    `close(address, name)` lets its channel go once the address is gone from DNS. With `r`, the admission state is
    written to Redis for replicas the call does not reach."""

    def __init__(
        self,
        spec: str,
        stub: Callable[[str, str], Any],
        *,
        close: Callable[[str, str], Awaitable[None]] | None = None,
        r: Redis | None = None,
        keys: Keys | None = None,
        resolve: Resolver = resolve_host,
    ) -> None:
        check_spec(spec)
        self.spec = spec
        self._stub = stub
        self._close = close
        self._resolve = resolve
        self._stubs: dict[tuple[str, str], Any] = {}
        self._state = (r, keys) if r is not None and keys is not None else None
        self._paused = False
        self._warned_empty = False

    async def current(self) -> list[Any]:
        """The stubs of the replicas the spec names now (made for new addresses, dropped for gone ones)."""
        now = await replicas_of(self.spec, self._resolve)
        for gone in [a for a in self._stubs if a not in now]:
            log.info("gateway replica %s is gone", gone[0])
            del self._stubs[gone]
            if self._close is not None:
                await self._close(*gone)
        for address in now:
            if address not in self._stubs:
                if self._stubs or len(now) > 1:
                    log.info("gateway replica %s", address[0])
                self._stubs[address] = self._stub(*address)
        if not now and not self._warned_empty:
            log.warning(
                "no gateway replica resolved from %s: none is paused or resumed now; one that starts reads "
                "the admission state from Redis",
                self.spec,
            )
        self._warned_empty = not now
        return [self._stubs[a] for a in now]

    async def _each(self, method: str, request: Any) -> gateway_pb2.AdmissionStatus:
        stubs = await self.current()
        statuses = await asyncio.gather(*(getattr(s, method)(request) for s in stubs))
        return combine(statuses, self._paused)

    async def _record(self, paused: bool) -> None:
        self._paused = paused
        if self._state is not None:
            r, keys = self._state
            if paused:
                await r.set(keys.admission, "paused")
            else:
                await r.delete(keys.admission)

    async def PauseAdmission(self, request: gateway_pb2.PauseAdmissionRequest) -> gateway_pb2.AdmissionStatus:
        await self._record(True)  # first: a replica that starts from now on starts paused
        return await self._each("PauseAdmission", request)

    async def ResumeAdmission(
        self, request: gateway_pb2.ResumeAdmissionRequest
    ) -> gateway_pb2.AdmissionStatus:
        # First: a replica starting between the two steps starts open (at the run state's version)
        # rather than stays paused with no resume to come.
        await self._record(False)
        return await self._each("ResumeAdmission", request)

    async def GetAdmission(self, request: Any) -> gateway_pb2.AdmissionStatus:
        return await self._each("GetAdmission", request)

    async def aclose(self) -> None:
        for address in list(self._stubs):
            del self._stubs[address]
            if self._close is not None:
                await self._close(*address)


class RunGate:
    """A run's admission (docs/runs.md): its gateways' run gates follow the run namespace's `admission`
    key, each looking every TETHER_ADMISSION_CHECK_S, and GatewayControl does not reach them (it holds
    the base namespace's gates). So a pause sets the key and holds `hold_s` (twice that interval) before
    the caller goes on, long enough for every gate to have seen it; a resume deletes it, and each gate
    opens again at the weight version the run state has then (saved before the resume). Calls already
    admitted are not waited for: an adapter load lets them finish on the version they started with.
    Nothing outside the run's namespace is touched. GatewayControl's surface, for tether.scheduler.push."""

    def __init__(self, r: Redis, keys: Keys, hold_s: float) -> None:
        self.r = r
        self.keys = keys
        self.hold_s = hold_s

    async def PauseAdmission(self, request: gateway_pb2.PauseAdmissionRequest) -> gateway_pb2.AdmissionStatus:
        await self.r.set(self.keys.admission, "paused")
        await asyncio.sleep(self.hold_s)
        return await self.GetAdmission(request)

    async def ResumeAdmission(
        self, request: gateway_pb2.ResumeAdmissionRequest
    ) -> gateway_pb2.AdmissionStatus:
        await self.r.delete(self.keys.admission)
        return await self.GetAdmission(request)

    async def GetAdmission(self, request: Any) -> gateway_pb2.AdmissionStatus:
        """What the key asks of the run's gates (their calls in flight are theirs: 0 here)."""
        paused = await self.r.get(self.keys.admission) in ("paused", b"paused")
        return gateway_pb2.AdmissionStatus(paused=paused, in_flight=0, weight_version=0)
