"""Gateway process: the OpenAI-compatible HTTP server (uvicorn, on uvloop) and the GatewayControl gRPC
server in one asyncio loop, sharing the admission gate, plus the replica health checks. SIGTERM stops
accepting calls, lets in-flight calls finish and record, then stops.

Run: python -m tether.gateway (settings from TETHER_* environment variables, see GatewaySettings).
Tests start `GatewayServer` in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import socket
from collections.abc import Coroutine, Iterator
from typing import Any, ClassVar

import grpc
import redis.asyncio as aioredis
import uvicorn
from pydantic import Field, field_validator, model_validator
from redis.exceptions import RedisError
from starlette.types import ASGIApp

from tether.common import broker, replicas
from tether.common.grpc_server import Health, cancel_until_done, run_until_signal, start_server
from tether.common.keys import Keys
from tether.common.logs import setup_logging
from tether.common.malloc import tune_malloc
from tether.common.net import is_loopback
from tether.common.records import RunRecord
from tether.common.settings import RedisSettings, refused_settings_exit
from tether.common.sharing import SharingPolicy
from tether.common.usage import exit_if_help
from tether.gateway.admission import Admission
from tether.gateway.app import create_app
from tether.gateway.callpaths import (
    CallPaths,
    follow_admission,
    open_admission,
    read_redis,
    run_trace_partitions,
)
from tether.gateway.guided import GuidedCheck, GuidedMode
from tether.gateway.proxy import Proxy
from tether.gateway.quotas import Limits, Quotas
from tether.gateway.recorder import Recorder
from tether.gateway.rollouts import RolloutRegistry
from tether.gateway.routing import Replica, ReplicaPool
from tether.gateway.runs import Runs, rollout_key_prefix
from tether.gateway.served import RunReplicas
from tether.gateway.servicer import SERVICE_NAME, GatewayControlServicer
from tether.gateway.sessions import Sessions, parse_deployment_keys
from tether.gateway.share import CallShare, RunShare, run_weight_of
from tether.gateway.upstream import UpstreamClient
from tether.v1 import gateway_pb2_grpc

log = logging.getLogger("tether.gateway")

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class GatewaySettings(RedisSettings):
    config_section: ClassVar[str | None] = "gateway"

    # vLLM's OpenAI server, e.g. http://127.0.0.1:8000: one replica (vllm_url) or several
    # (vllm_urls, comma-separated); at least one is required, both may be given.
    vllm_url: str | None = None
    vllm_urls: str | None = None
    vllm_api_key: str | None = None
    # Replicas: GET /health every health_check_s puts a replica back (or takes it out).
    health_check_s: float = Field(5.0, gt=0)
    # How often a replica checks that the run is not paused without it (scheduler/gateways.py).
    admission_check_s: float = Field(2.0, gt=0)
    # Follow the replicas the scheduler discovers (Kubernetes) and publishes at Keys.replicas, read
    # every health_check_s; vllm_url(s) serve until the first set arrives (tether.gateway.routing).
    replica_discovery: bool = False
    health_timeout_s: float = Field(2.0, gt=0)
    # Upstream 502/503/504, timeouts and broken connections are sent again (while nothing reached the
    # client) up to upstream_retries times, after retry_backoff_s, doubling. A 500 is not (proxy.py).
    upstream_retries: int = Field(2, ge=0)
    retry_backoff_s: float = Field(0.25, ge=0)
    upstream_connect_timeout_s: float = Field(10.0, gt=0)
    # Output limit of a call whose client names none (chat max_tokens/max_completion_tokens,
    # completions max_tokens, Responses max_output_tokens), bounded by the served context; 0 = none
    # (vLLM's own: the whole room left for chat, 16 tokens for completions). A client's limit above
    # the context is always lowered to fit (limits.py).
    default_max_tokens: int = Field(4096, ge=0)
    # Record-only sessions: "key=session,key2=other" (or one bare key: session "default").
    deployment_keys: str | None = None
    # The model name agents send; calls naming another model get 404.
    served_model: str = "tether-policy"
    # The name vLLM serves the policy under, when it differs from served_model.
    upstream_model: str | None = None
    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(8080, ge=0, le=65535)  # 0 = any free port (logged)
    gateway_grpc_port: int = Field(50061, ge=0, le=65535)
    # Bind the HTTP port with SO_REUSEPORT, so that several gateway processes (replicas) share it and
    # the kernel spreads connections over them (`tether up --gateway-replicas N`). Everything a call
    # needs across replicas lives in Redis; each replica keeps its own gRPC and metrics port.
    gateway_reuse_port: bool = False
    # Base URL agents reach this gateway at; rollouts hand out <public_url>/v1. Default http://host:port.
    public_url: str | None = None
    # When set, POST /v1/rollouts (and admin reads/finishes) need "Authorization: Bearer <admin_token>".
    admin_token: str | None = None
    # Without an admin token anyone may create rollouts (and so have the model trained on what they
    # send): a gateway listening beyond loopback refuses to start without one, unless this says an
    # open gateway is meant (a private network that is guarded otherwise).
    allow_open_admin: bool = False
    # How long a call waits while admission is paused before 429 + Retry-After.
    admission_wait_s: float = Field(60.0, ge=0)
    retry_after_s: int = Field(5, ge=0)
    default_group_size: int = Field(1, ge=1)
    upstream_timeout_s: float = Field(600.0, gt=0)
    upstream_max_connections: int = Field(1024, ge=1)
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0)
    # Grammar-guided calls (tool_choice required/named, response_format, ...): "mask" rescores each one
    # unconstrained and records the tokens the grammar changed (beyond guided_tolerance nats) so that they
    # are not trained on; "off" records only that the call was guided (docs/merging.md).
    guided: GuidedMode = "mask"
    guided_tolerance: float = Field(1e-3, gt=0)
    guided_timeout_s: float = Field(30.0, gt=0)
    # Completing a rollout waits this long for its in-flight calls to be recorded.
    finish_wait_s: float = Field(10.0, ge=0)
    # SIGTERM: how long in-flight HTTP requests may take to finish.
    shutdown_grace_s: float = Field(30.0, ge=0)
    redis_check_s: float = Field(2.0, gt=0)
    # One log line per request (method, route template, status, latency, rollout; never a key) on the
    # logger tether.gateway.access. Off by default: at full load it is most of a call's logging cost.
    access_log: bool = False
    # Origins browser-hosted harnesses call from ("https://a.example,https://b.example", or "*"); CORS
    # stays off (no headers, preflights unanswered) while unset.
    cors_origins: str | None = None
    # Key expiry (rollouts.py): a rollout and its key live rollout_ttl_s from creation unless finished
    # first; a finished rollout's key makes no model call, and is kept finished_key_grace_s for its
    # harness to read the state and retry its complete (0: gone at once); a finished rollout's records
    # are kept finished_rollout_ttl_s.
    rollout_ttl_s: int = Field(24 * 3600, gt=0)
    finished_key_grace_s: int = Field(300, ge=0)
    finished_rollout_ttl_s: int = Field(7 * 24 * 3600, gt=0)
    # Per-key limits (quotas.py), shared by every replica through Redis; 0 = none. A rollout key's
    # defaults leave a real agent room (parallel subagents, 100k-token prompts) and stop a runaway loop;
    # a deployment key carries production traffic, so only its calls in flight are bounded by default.
    rollout_max_request_bytes: int = Field(8 * 1024 * 1024, ge=0)
    rollout_max_concurrent: int = Field(16, ge=0)
    rollout_tokens_per_minute: int = Field(2_000_000, ge=0)
    deployment_max_request_bytes: int = Field(0, ge=0)
    deployment_max_concurrent: int = Field(256, ge=0)
    deployment_tokens_per_minute: int = Field(0, ge=0)
    # A call's concurrency slot lapses after this long even if never given back (a replica that died).
    quota_slot_ttl_s: int = Field(1800, gt=0)
    # Sharing vLLM among runs (share.py, docs/runs.md "Sharing vLLM"): at most run_max_concurrent calls
    # of runs in flight from this process (0 = no bound: they go as they come); past it a run's call
    # waits for its run's turn by run_sharing (round_robin, or weighted by each run's
    # trainer.run_weight; the trainer reads the same setting), at most run_share_wait_s (then 429).
    run_max_concurrent: int = Field(0, ge=0)
    run_sharing: SharingPolicy = "round_robin"
    run_share_wait_s: float = Field(300.0, gt=0)

    @field_validator("vllm_url", "public_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(("http://", "https://")):
            raise ValueError("must be an http(s):// URL")
        return v.rstrip("/") if v else v

    @field_validator("vllm_urls")
    @classmethod
    def _http_urls(cls, v: str | None) -> str | None:
        for url in (v or "").split(","):
            if url.strip() and not url.strip().startswith(("http://", "https://")):
                raise ValueError(f"{url.strip()!r} is not an http(s):// URL")
        return v

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, v: str | None) -> str | None:
        for origin in (v or "").split(","):
            origin = origin.strip()
            if origin and origin != "*" and not origin.startswith(("http://", "https://")):
                raise ValueError(f"{origin!r} is not an origin (scheme://host[:port]) or *")
        return v

    @property
    def cors_origin_list(self) -> list[str]:
        return [o.strip().rstrip("/") for o in (self.cors_origins or "").split(",") if o.strip()]

    @field_validator("deployment_keys")
    @classmethod
    def _deployment_keys(cls, v: str | None) -> str | None:
        parse_deployment_keys(v)
        return v

    @model_validator(mode="after")
    def _admin_guard(self) -> GatewaySettings:
        if not self.admin_token and not self.allow_open_admin and not is_loopback(self.gateway_host):
            raise ValueError(
                f"gateway_host {self.gateway_host!r} listens beyond loopback without an admin token: set "
                "TETHER_ADMIN_TOKEN (or TETHER_ALLOW_OPEN_ADMIN=true to serve an open gateway on purpose)"
            )
        return self

    @model_validator(mode="after")
    def _some_replica(self) -> GatewaySettings:
        if not self.replica_urls:
            raise ValueError("set vllm_url or vllm_urls (TETHER_VLLM_URL / TETHER_VLLM_URLS)")
        return self

    @property
    def replica_urls(self) -> list[str]:
        """vllm_url then vllm_urls, each once, without a trailing slash."""
        urls = [self.vllm_url or "", *(self.vllm_urls or "").split(",")]
        return list(dict.fromkeys(u.strip().rstrip("/") for u in urls if u.strip()))


class _Uvicorn(uvicorn.Server):
    # Signals belong to the process (run_until_signal), not to uvicorn.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only then (else Nagle plus
    # delayed ACKs add ~40 ms to every response).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


async def agree_partitions(r: aioredis.Redis, keys: broker.Keys, timeout_s: float = 5.0) -> bool:
    """broker.agree_trace_partitions: PartitionMismatch raised, False when Redis did not answer (the
    Redis watch checks again)."""

    async def agree() -> bool:
        await broker.agree_trace_partitions(r, keys)
        return True

    return await read_redis("the run's trace partitions", agree(), False, timeout_s)


class GatewayServer:
    """Everything one gateway process runs, with an explicit, idempotent lifecycle."""

    def __init__(self, s: GatewaySettings) -> None:
        self.s = s
        self.http_port = 0
        self.grpc_port = 0
        self.public_url = ""
        self.grpc_server: grpc.aio.Server | None = None
        self.health: Health | None = None
        self._http_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None
        self._followers: list[asyncio.Task] = []  # each namespace's admission follower
        self._partitions_agreed = False
        self._stopped = False

    async def start(self) -> None:
        """Bind, connect to Redis, build the call path, then serve gRPC and HTTP; health turns
        SERVING only once calls are accepted."""
        s = self.s
        keys = s.keys()
        sock = self._bind_http()
        await self._open_redis(keys)
        self._build_call_path(keys)
        app = self._app()
        self._health_task = asyncio.create_task(self._watch_replicas(keys))
        await self._start_grpc()
        await self._serve_http(app, sock)
        assert self.health is not None
        # SERVING only once calls are accepted: a supervisor waits on it for each replica.
        await self.health.set(await self._redis_ok())
        log.info(
            "gateway HTTP on %s:%d (agents use %s/v1), gRPC GatewayControl on %s:%d, vLLM at %s",
            s.gateway_host,
            self.http_port,
            self.public_url,
            s.gateway_host,
            self.grpc_port,
            ", ".join(s.replica_urls),
        )

    def _bind_http(self) -> socket.socket:
        s = self.s
        sock = _bind(s.gateway_host, s.gateway_port, s.gateway_reuse_port)
        self.http_port = sock.getsockname()[1]
        url_host = "127.0.0.1" if s.gateway_host in ("0.0.0.0", "::", "") else s.gateway_host
        self.public_url = s.public_url or f"http://{url_host}:{self.http_port}"
        if s.gateway_host not in _LOOPBACK and not s.admin_token:
            log.warning(
                "gateway listens on %s without TETHER_ADMIN_TOKEN: anyone can create rollouts", s.gateway_host
            )
        return sock

    async def _open_redis(self, keys: broker.Keys) -> None:
        """Redis, the admission gate as the run state has it, and the call path's recorder."""
        s = self.s
        # Blocking pool: past its size a command waits for a connection instead of failing (redis-py's
        # default pool raises at 100). The call path pipelines (recorder.Batcher) and needs few.
        self.redis = broker.connect(s.redis_url, max_connections=64, pool_timeout_s=30)
        # A count of trace partitions other than the run's is refused (PartitionMismatch: main exits
        # with SETTINGS_REFUSED): this replica would write calls to partitions the merger never reads.
        self._partitions_agreed = await agree_partitions(self.redis, keys)
        self.admission = await self._admission(keys, resumes=False)
        self.recorder = Recorder(self.redis, s.redis_url, keys)
        with contextlib.suppress(RedisError, OSError):  # loaded on first use when Redis is not up yet
            await self.recorder.start()

    async def _admission(self, keys: broker.Keys, resumes: bool) -> Admission:
        """A namespace's admission gate (callpaths.open_admission), followed in Redis from now on."""
        admission = await open_admission(self.redis, keys)
        self._followers.append(
            asyncio.create_task(
                follow_admission(admission, self.redis, keys, self.s.admission_check_s, resumes)
            )
        )
        return admission

    def _build_call_path(self, keys: broker.Keys) -> None:
        """The replicas, the base namespace's rollout registry, sessions and proxy, and the runs'
        call paths (opened on first use)."""
        s = self.s
        self.pool = ReplicaPool([Replica(url, self._upstream(url)) for url in s.replica_urls])
        self.rollouts = RolloutRegistry(
            self.redis,
            keys,
            self.admission,
            s.admin_token,
            s.finish_wait_s,
            batch=self.recorder.batch,
            max_lifetime_s=s.rollout_ttl_s,
            finished_key_grace_s=s.finished_key_grace_s,
            finished_ttl_s=s.finished_rollout_ttl_s,
        )
        self.runs = Runs(self.redis, keys)
        self.share = CallShare(s.run_max_concurrent, s.run_sharing)  # the runs' calls (share.py)
        self.sessions = Sessions(
            parse_deployment_keys(s.deployment_keys), self.redis, keys, self.recorder, s.admin_token
        )
        self.proxy = self._proxy(
            self.rollouts, self.recorder, self.sessions, s.upstream_model or s.served_model
        )
        self.call_paths = CallPaths(self.proxy, self.runs, self._open_run)

    async def _open_run(self, run: RunRecord) -> Proxy:
        """A run's call path: the base one's parts over the run's namespace (with the trace partitions
        its merger reads: callpaths.run_trace_partitions), its own admission gate
        (resumed from Redis: the scheduler's GatewayControl holds the base one), vLLM asked for its
        adapter, no deployment keys."""
        keys = Keys(run.namespace, await run_trace_partitions(self.redis, run, self.s.trace_partitions))
        admission = await self._admission(keys, resumes=True)
        recorder = self.recorder.in_namespace(keys)
        rollouts = self.rollouts.in_namespace(keys, admission, recorder.batch, rollout_key_prefix(run.run_id))
        sessions = Sessions({}, self.redis, keys, recorder, self.s.admin_token)
        share = RunShare(self.share, run.run_id, run_weight_of(run.config), self.s.run_share_wait_s)
        served = (  # where its adapter is loaded, as its scheduler publishes it (served.py)
            RunReplicas(self.redis, keys, run.run_id, self.s.health_check_s)
            if self.s.replica_discovery
            else None
        )
        return self._proxy(rollouts, recorder, sessions, run.adapter, share, served)

    def _proxy(
        self,
        rollouts: RolloutRegistry,
        recorder: Recorder,
        sessions: Sessions,
        upstream: str,
        share: RunShare | None = None,
        served: RunReplicas | None = None,
    ) -> Proxy:
        """The proxy of one namespace's call path (the registry's keys and admission gate)."""
        s = self.s
        return Proxy(
            pool=self.pool,
            rollouts=rollouts,
            sessions=sessions,
            admission=rollouts.admission,
            recorder=recorder,
            keys=rollouts.keys,
            served_model=s.served_model,
            upstream_model=upstream,
            admission_wait_s=s.admission_wait_s,
            retry_after_s=s.retry_after_s,
            max_retries=s.upstream_retries,
            retry_backoff_s=s.retry_backoff_s,
            default_max_tokens=s.default_max_tokens or None,
            guided=GuidedCheck(upstream, s.guided, s.guided_tolerance, s.guided_timeout_s),
            quotas=self._quotas(rollouts.keys, recorder),
            share=share,
            served=served,
        )

    def _quotas(self, keys: broker.Keys, recorder: Recorder) -> Quotas:
        s = self.s
        return Quotas(
            recorder.batch,
            keys,
            Limits(s.rollout_max_request_bytes, s.rollout_max_concurrent, s.rollout_tokens_per_minute),
            Limits(
                s.deployment_max_request_bytes, s.deployment_max_concurrent, s.deployment_tokens_per_minute
            ),
            s.retry_after_s,
            s.quota_slot_ttl_s,
            self.redis.script_load,
        )

    def _app(self) -> ASGIApp:
        s = self.s
        return create_app(
            call_paths=self.call_paths,
            sessions=self.sessions,
            admission=self.admission,
            pool=self.pool,
            redis_ping=self.redis.ping,
            served_model=s.served_model,
            public_url=self.public_url,
            default_group_size=s.default_group_size,
            max_body_bytes=s.max_body_bytes,
            retry_after_s=s.retry_after_s,
            access=s.access_log,
            cors_origins=s.cors_origin_list,
        )

    async def _watch_replicas(self, keys: broker.Keys) -> None:
        """Replica health, and with replica discovery the replica set the scheduler publishes."""
        s = self.s
        if s.replica_discovery:
            await self.pool.follow(
                lambda: replicas.current(self.redis, keys),
                self._upstream,
                s.health_check_s,
                s.health_timeout_s,
            )
        else:
            await self.pool.watch(s.health_check_s, s.health_timeout_s)

    async def _start_grpc(self) -> None:
        def register(server: grpc.aio.Server) -> list[str]:
            gateway_pb2_grpc.add_GatewayControlServicer_to_server(
                GatewayControlServicer(self.admission), server
            )
            return [SERVICE_NAME]

        s = self.s
        self.grpc_server, self.health, self.grpc_port = await start_server(
            s.gateway_grpc_port, register, s.gateway_host, s.metrics_port
        )

    async def _serve_http(self, app: ASGIApp, sock: socket.socket) -> None:
        """uvicorn on the bound socket, in its own task; returns once it accepts connections."""
        s = self.s
        # uvicorn formats an access-log line per request whenever its logger has a handler anywhere up
        # the tree (ours: the root's), even with access_log off: cut it loose.
        logging.getLogger("uvicorn.access").propagate = False
        config = uvicorn.Config(
            app,
            lifespan="off",
            access_log=False,
            log_config=None,
            http="httptools",
            proxy_headers=False,
            log_level=s.log_level.lower(),
            timeout_graceful_shutdown=math.ceil(s.shutdown_grace_s),  # uvicorn waits whole seconds
            timeout_keep_alive=30,
        )
        self._uvicorn = _Uvicorn(config)
        self._http_task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._http_task.done():
                self._http_task.result()
                raise RuntimeError("HTTP server stopped during startup")
            await asyncio.sleep(0.01)

    def _upstream(self, url: str) -> UpstreamClient:
        s = self.s
        return UpstreamClient(
            url,
            s.upstream_timeout_s,
            s.upstream_max_connections,
            s.vllm_api_key,
            s.upstream_connect_timeout_s,
        )

    async def _redis_ok(self) -> bool:
        try:
            await asyncio.wait_for(self.redis.ping(), 2.0)
            return True
        except Exception as exc:
            log.debug("redis ping failed: %r", exc)
            return False

    async def watch_redis(self) -> None:
        """gRPC health follows Redis only: a paused gateway is healthy (pausing is routine). When Redis
        was down at start, the trace partitions are checked once it answers: a mismatch ends this task,
        which stops the process (drained) and refuses it, saying why."""
        serving = None
        while True:
            ok = await self._redis_ok()
            if ok and not self._partitions_agreed:
                self._partitions_agreed = await agree_partitions(self.redis, self.s.keys())
            if ok != serving and self.health is not None:
                await self.health.set(ok)
                if serving is not None or not ok:
                    log.log(
                        logging.INFO if ok else logging.WARNING,
                        "redis %s",
                        "answers again: SERVING" if ok else "not answering: NOT_SERVING",
                    )
                serving = ok
            await asyncio.sleep(self.s.redis_check_s)

    async def http_stopped(self) -> None:
        if self._http_task is not None:
            await asyncio.shield(self._http_task)

    async def stop_http(self) -> None:
        """Stop accepting calls, let in-flight ones finish and record, close clients. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._http_task is not None:
            self._uvicorn.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._http_task), self.s.shutdown_grace_s + 5)
        await self.call_paths.aclose()
        # Cancelled until they end: a cancel can be lost inside a Redis read (cancel_until_done).
        tasks = (self._health_task, *self._followers)
        await cancel_until_done(*(t for t in tasks if t is not None))
        await self.pool.aclose()
        self.recorder.close()
        await self.redis.aclose()

    async def stop(self, grace: float = 5.0) -> None:
        await self.stop_http()
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace)
        if self.health is not None:
            await self.health.close(0)


async def amain(s: GatewaySettings) -> None:
    tune_malloc()
    gw = GatewayServer(s)
    await gw.start()
    tune_gc()
    # One line the launcher (or a human) can read the bound ports from.
    print(
        f"tether-gateway ready http_port={gw.http_port} grpc_port={gw.grpc_port} base_url={gw.public_url}/v1",
        flush=True,
    )
    assert gw.grpc_server is not None and gw.health is not None
    await run_until_signal(
        gw.grpc_server, gw.health, [gw.watch_redis(), gw.http_stopped()], on_stop=gw.stop_http
    )


def tune_gc() -> None:
    """A call allocates thousands of small objects (token id lists, logprob dicts), which triggers the
    cyclic GC often; each full collection walked every object the process had imported. Freeze what
    start-up made (never collected again) and collect the young generation less often: the call path
    makes few cycles."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def run(coro: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop when installed (uvicorn[standard] brings it): the loop is much of a call's cost."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main() -> None:
    exit_if_help(GatewaySettings, __doc__)
    with refused_settings_exit("gateway"):
        s = GatewaySettings()
    setup_logging("gateway", s.log_level)
    with refused_settings_exit("gateway"):
        run(amain(s))


if __name__ == "__main__":
    main()
