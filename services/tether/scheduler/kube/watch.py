"""List, then watch from the list's resourceVersion, for one kind of object: the informer pattern
without a cache library. A 410 (the version fell out of the server's window) lists again; any other
failure waits (jittered backoff) and lists again, so the caller always sees a full, current snapshot
after a gap, never a stale one patched by events it may have missed."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tether.common import retry
from tether.scheduler.kube.client import Gone, KubeApi

log = logging.getLogger(__name__)

Snapshot = dict[str, dict[str, Any]]  # object name -> the object (raw JSON)
OnChange = Callable[[Snapshot, dict[str, Any] | None], Awaitable[None]]  # (snapshot, event or None: a list)

WINDOW_S = 300  # one watch request; the server ends it, we watch again from the last version
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


def apply_event(state: Snapshot, event: dict[str, Any]) -> bool:
    """Fold one watch event into `state`; whether the snapshot changed (bookmarks never change it)."""
    kind, obj = event.get("type"), event.get("object") or {}
    name = (obj.get("metadata") or {}).get("name")
    if not name or kind not in ("ADDED", "MODIFIED", "DELETED"):
        return False
    if kind == "DELETED":
        return state.pop(name, None) is not None
    state[name] = obj
    return True


async def follow(
    api: KubeApi,
    resource: str,
    list_fn: Callable[..., Any],
    on_change: OnChange,
    *,
    namespace: str,
    label_selector: str,
    window_s: int = WINDOW_S,
) -> None:
    """Run forever: `on_change(snapshot, None)` after every (re-)list, `on_change(snapshot, event)`
    after every event that changed it."""
    attempt = 0
    while True:
        try:
            body = await api.list(resource, list_fn, namespace=namespace, label_selector=label_selector)
            state: Snapshot = {o["metadata"]["name"]: o for o in body.get("items") or []}
            version = (body.get("metadata") or {}).get("resourceVersion", "")
            await on_change(dict(state), None)
            attempt = 0
            while True:
                async for event in api.stream(
                    resource,
                    list_fn,
                    namespace=namespace,
                    label_selector=label_selector,
                    resource_version=version,
                    timeout_seconds=window_s,
                    allow_watch_bookmarks=True,
                ):
                    version = ((event.get("object") or {}).get("metadata") or {}).get(
                        "resourceVersion"
                    ) or version
                    if apply_event(state, event):
                        await on_change(dict(state), event)
        except Gone:
            log.info("%s: watch version expired; listing again", resource)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            wait = retry.backoff(attempt, FIRST_BACKOFF_S, MAX_BACKOFF_S)
            log.warning("%s: list/watch failed (%r); listing again in %.1fs", resource, exc, wait)
            attempt += 1
            await asyncio.sleep(wait)
