"""Inference replicas from the inference Service's EndpointSlices (discovery.k8s.io/v1; not the
deprecated Endpoints, which truncate at 1000 addresses and carry no terminating state).

Every changed list goes to `on_replicas`: the scheduler's inference fleet (which loads the current
weights into a new replica before publishing the ReplicaSet the gateway routes by), or, on its own,
`publisher`, which publishes at once. A replica that goes away is missing from the next list, so the
next publish drains it from routing.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from tether.common import replicas as replica_store
from tether.common.broker import Keys
from tether.common.records import InferenceReplica
from tether.scheduler.kube.client import KubeApi
from tether.scheduler.kube.metrics import REPLICAS
from tether.scheduler.kube.watch import Snapshot, follow

log = logging.getLogger(__name__)

OnReplicas = Callable[[list[InferenceReplica]], Awaitable[None]]

SERVICE_LABEL = "kubernetes.io/service-name"
HTTP_PORT, GRPC_PORT = "http", "grpc"  # the inference Service's port names (the chart's fixed interface)


def host(address: str) -> str:
    """An address as the host part of a URL: IPv6 in brackets."""
    try:
        return f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    except ValueError:  # an FQDN slice
        return address


def serving(endpoint: dict[str, Any]) -> bool:
    """Ready and not terminating. An unset `ready` counts as ready and an unset `terminating` as not,
    as the EndpointConditions API says consumers must read them."""
    cond = endpoint.get("conditions") or {}
    return cond.get("ready") is not False and not cond.get("terminating")


def replicas_from_slices(slices: Iterable[dict[str, Any]]) -> list[InferenceReplica]:
    """The serving replicas of a Service's EndpointSlices, one per pod, sorted by name. A pod listed
    in two slices (dual stack, or while the controller moves it) is taken once, IPv4 first; a slice
    without both named ports is skipped (it cannot be routed to and controlled)."""
    out: dict[str, InferenceReplica] = {}
    ordered = sorted(slices, key=lambda s: (s.get("addressType") != "IPv4", s["metadata"]["name"]))
    for sl in ordered:
        ports = {p.get("name"): p.get("port") for p in sl.get("ports") or []}
        http, grpc = ports.get(HTTP_PORT), ports.get(GRPC_PORT)
        if not http or not grpc:
            continue
        for ep in sl.get("endpoints") or []:
            if not ep.get("addresses") or not serving(ep):
                continue
            address = host(ep["addresses"][0])  # consumers use the first (the API's own rule)
            ref = ep.get("targetRef") or {}
            name = str(ref["name"]) if ref.get("kind", "Pod") == "Pod" and ref.get("name") else address
            out.setdefault(name, InferenceReplica(name, f"http://{address}:{http}", f"{address}:{grpc}"))
    return [out[n] for n in sorted(out)]


def publisher(r: Any, keys: Keys) -> OnReplicas:
    """The callback that publishes each list as the ReplicaSet (tether.common.replicas) at once."""

    async def publish(replicas: list[InferenceReplica]) -> None:
        new = await replica_store.publish(r, keys, replicas, "kubernetes")
        if new is not None:
            log.info("replica set v%d: %s", new.version, [x.name for x in new.replicas])

    return publish


async def discover(api: KubeApi, namespace: str, service: str, on_replicas: OnReplicas) -> None:
    """Follow the Service's EndpointSlices forever; hand each changed replica list to `on_replicas`."""
    last: list[InferenceReplica] | None = None

    async def changed(snapshot: Snapshot, _event: dict[str, Any] | None) -> None:
        nonlocal last
        now = replicas_from_slices(snapshot.values())
        REPLICAS.set(len(now))
        if now != last:
            await on_replicas(now)  # a failure lists again and hands the list over again
            last = now

    await follow(
        api,
        "endpointslices",
        api.discovery.list_namespaced_endpoint_slice,
        changed,
        namespace=namespace,
        label_selector=f"{SERVICE_LABEL}={service}",
    )
