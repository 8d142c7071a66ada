"""The one door to the Kubernetes API: the client's API objects (DiscoveryV1Api, BatchV1Api,
CoreV1Api) and its `watch.Watch`, called from asyncio in a thread pool of our own (the client is
synchronous; a watch holds its thread for a whole watch window), every failure counted.

Lists are read raw (`_preload_content=False`) and watch events by their `raw_object`: the code works
on the API's own JSON (camelCase dicts), which is also what the tests write by hand and validate.
`load()` builds it from the pod's service account; tests hand `KubeApi` a recording fake instead
(tests/kube_fake.py), so everything the code calls goes through here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tether.scheduler.kube.metrics import API_ERRORS

log = logging.getLogger(__name__)

_END = object()
REQUEST_TIMEOUT_S = 30


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of a client ApiException (None for anything else)."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


@dataclass
class KubeApi:
    discovery: Any  # kubernetes.client.DiscoveryV1Api
    batch: Any  # kubernetes.client.BatchV1Api
    core: Any  # kubernetes.client.CoreV1Api
    watch: Callable[[], Any]  # kubernetes.watch.Watch
    threads: int = 8
    pool: ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="kube")

    async def call(self, resource: str, verb: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` in the pool; a failure is counted (resource, verb) and raised. The
        client waits forever by default: every call gets a timeout (a stalled API server then fails
        the call, and the watch loops list again)."""
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT_S)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.pool, lambda: fn(*args, **kwargs))
        except Exception:
            API_ERRORS.labels(resource, verb).inc()
            raise

    async def list(self, resource: str, fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
        """A list call's JSON body ({"metadata": {"resourceVersion"}, "items": [...]})."""
        resp = await self.call(resource, "list", fn, _preload_content=False, **kwargs)
        return json.loads(resp.data)

    async def create(
        self, resource: str, fn: Callable[..., Any], namespace: str, body: dict
    ) -> dict[str, Any]:
        """A create call; the created object's JSON (with its uid)."""
        resp = await self.call(resource, "create", fn, namespace, body, _preload_content=False)
        return json.loads(resp.data)

    async def delete(
        self, resource: str, fn: Callable[..., Any], name: str, namespace: str, body: dict
    ) -> None:
        """A delete call. Its answer is not read: the API server answers with the object or with a
        Status, and the client, which types the answer as the object, fails on a Status."""
        await self.call(resource, "delete", fn, name, namespace, body=body, _preload_content=False)

    async def stream(
        self, resource: str, fn: Callable[..., Any], **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """The events of one watch window ({"type", "object"}; object as raw JSON) until the server
        ends it; a 410 raises Gone, any other failure is counted and raised."""
        # A read timeout past the server's own end of the window: a connection that went silent
        # (a dead API server, a dropped NAT entry) ends instead of hanging the watch forever.
        kwargs.setdefault("_request_timeout", kwargs.get("timeout_seconds", 300) + REQUEST_TIMEOUT_S)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        w = self.watch()

        def put(item: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the loop closed while the thread was still reading
                pass

        def pump() -> None:
            try:
                for event in w.stream(fn, **kwargs):
                    put(event)
                put(_END)
            except BaseException as exc:  # noqa: BLE001 - handed to the event loop, raised there
                put(exc)

        loop.run_in_executor(self.pool, pump)
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    if status_of(item) == 410:
                        raise Gone() from item
                    API_ERRORS.labels(resource, "watch").inc()
                    raise item
                yield {"type": item["type"], "object": item.get("raw_object", item.get("object"))}
        finally:
            w.stop()


def load(threads: int = 8) -> KubeApi:
    """The API as the pod's service account sees it (a kubeconfig outside a cluster, for development)."""
    from kubernetes import client, config, watch

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return KubeApi(client.DiscoveryV1Api(), client.BatchV1Api(), client.CoreV1Api(), watch.Watch, threads)
