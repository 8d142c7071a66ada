"""The inference replicas a deployment serves, as discovered, shared through Redis.

On Kubernetes the scheduler discovers them (tether.scheduler.kube) and publishes a ReplicaSet at
``Keys.replicas``; the gateway routes to the replicas of the newest set it read, and the scheduler
loads weights into every one of them. Locally and under Compose nothing publishes: the gateway keeps
its configured URLs and the scheduler its one inference address.

A set is published only when the replicas changed (their names, URLs and addresses, in any order), with
a version one above the stored one; readers keep the highest version they applied and ignore older
ones, so a reader never goes back to a stale list.
"""

from __future__ import annotations

import time

import orjson
import redis.asyncio as aioredis

from tether.common.broker import Keys
from tether.common.records import InferenceReplica, RecordError, ReplicaSet


def same_replicas(a: list[InferenceReplica], b: list[InferenceReplica]) -> bool:
    """Whether two lists name the same replicas, order aside."""
    return sorted(r.to_dict().items() for r in a) == sorted(r.to_dict().items() for r in b)


async def current(r: aioredis.Redis, keys: Keys) -> ReplicaSet | None:
    """The stored set, None when none was published (or what is stored does not decode)."""
    raw = await r.get(keys.replicas)
    if raw is None:
        return None
    try:
        replicas: ReplicaSet = ReplicaSet.from_json(raw)
        return replicas
    except RecordError:
        return None


async def publish(
    r: aioredis.Redis, keys: Keys, replicas: list[InferenceReplica], source: str
) -> ReplicaSet | None:
    """Store `replicas` as the new set when they differ from the stored one; returns the new set, or
    None when nothing changed. One writer (the scheduler) at a time."""
    stored = await current(r, keys)
    if stored is not None and same_replicas(stored.replicas, replicas):
        return None
    new = ReplicaSet(
        version=(stored.version if stored else 0) + 1,
        source=source,
        replicas=sorted(replicas, key=lambda x: x.name),
        updated_at=time.time(),
    )
    await r.set(keys.replicas, orjson.dumps(new.to_dict()))  # orjson writes the nested records
    return new
