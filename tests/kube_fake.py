"""A recording fake of the `kubernetes` client, the one fake the tests of tether.scheduler.kube use (no
API server can run here): stand-ins for DiscoveryV1Api, BatchV1Api, CoreV1Api and `watch.Watch` over
a small in-memory store that behaves like the API server where the code depends on it: resource
versions, list then watch from a version (events replayed after it; 410 once the version was
compacted away), label selectors, uid preconditions on delete, owner-reference garbage collection.

It records every call as (API group, resource, verb) -- what tests/test_kube_rbac.py compares with the
Role -- and every body sent. To stay honest about the real client, each call is bound to the real
method's signature (a parameter the client does not take fails here as it would there) and each body
goes through the client's own model (its pydantic models refuse unknown fields), as the real client
does before it sends anything.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import itertools
import json
import threading
import uuid
from typing import Any

import kubernetes.client as k8s
from kubernetes.client.exceptions import ApiException

from tether.agents import job as agent_job
from tether.scheduler.kube import jobs
from tether.scheduler.kube.client import KubeApi

GROUPS = {"endpointslices": "discovery.k8s.io", "jobs": "batch", "secrets": "", "pods": ""}
MODELS = {
    "jobs": k8s.V1Job,
    "secrets": k8s.V1Secret,
    "pods": k8s.V1Pod,
    "endpointslices": k8s.V1EndpointSlice,
}


class Response:
    """What the client returns with `_preload_content=False` (a urllib3 response), as far as used."""

    def __init__(self, obj: Any, status: int = 200) -> None:
        self.data = json.dumps(obj).encode()
        self.status = status


def matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors ("a=b,c=d"), the only kind the code uses."""
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class FakeKube:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.bodies: list[tuple[str, str, dict]] = []
        self.store: dict[str, dict[str, dict]] = {r: {} for r in GROUPS}
        self.log: list[tuple[int, str, str, dict]] = []  # (resourceVersion, resource, type, object)
        self.version = itertools.count(100)
        self.rv = 99
        self.compacted = 0  # watches from a version at or below this get 410 Gone
        self.failures: dict[tuple[str, str], list[int]] = {}
        self.cond = threading.Condition()
        self.discovery = DiscoveryV1Api(self)
        self.batch = BatchV1Api(self)
        self.core = CoreV1Api(self)

    def api(self) -> KubeApi:
        return KubeApi(self.discovery, self.batch, self.core, lambda: Watch(self), threads=8)

    # --- what tests do to the "cluster"

    def fail_next(self, resource: str, verb: str, status: int = 500, times: int = 1) -> None:
        self.failures.setdefault((resource, verb), []).extend([status] * times)

    def put(self, resource: str, obj: dict) -> dict:
        """Create or replace an object (as a controller or the kubelet would), with a new version."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        with self.cond:
            old = self.store[resource].get(meta["name"])
            meta.setdefault("uid", old["metadata"]["uid"] if old else str(uuid.uuid4()))
            meta.setdefault("namespace", "ns")
            self._bump(resource, "MODIFIED" if old else "ADDED", obj)
            self.store[resource][meta["name"]] = obj
        return obj

    def remove(self, resource: str, name: str) -> None:
        with self.cond:
            obj = self.store[resource].pop(name)
            self._bump(resource, "DELETED", obj)
            # Garbage collection: what this object owned goes with it.
            for res, objs in self.store.items():
                for other in list(objs.values()):
                    owners = other["metadata"].get("ownerReferences") or []
                    if any(o.get("uid") == obj["metadata"]["uid"] for o in owners):
                        objs.pop(other["metadata"]["name"])
                        self._bump(res, "DELETED", other)

    def compact(self) -> None:
        """Forget the event history: every watch from an older version gets 410 Gone."""
        with self.cond:
            self.compacted = self.rv
            self.log.clear()
            self.cond.notify_all()

    def _bump(self, resource: str, kind: str, obj: dict) -> None:
        self.rv = next(self.version)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.log.append((self.rv, resource, kind, copy.deepcopy(obj)))
        self.cond.notify_all()

    # --- what the API classes do

    def record(self, resource: str, verb: str, body: dict | None = None) -> None:
        self.calls.append((GROUPS[resource], resource, verb))
        if body is not None:
            self.bodies.append((resource, verb, copy.deepcopy(body)))
        pending = self.failures.get((resource, verb))
        if pending:
            raise ApiException(status=pending.pop(0), reason="injected")

    def list(self, resource: str, namespace: str, kwargs: dict) -> Any:
        if kwargs.get("watch"):
            self.record(resource, "watch")
            return Subscription(
                self, resource, kwargs.get("label_selector", ""), int(kwargs.get("resource_version") or 0)
            )
        self.record(resource, "list")
        with self.cond:
            items = [
                copy.deepcopy(o)
                for o in self.store[resource].values()
                if matches(o["metadata"].get("labels") or {}, kwargs.get("label_selector", ""))
            ]
            return Response({"metadata": {"resourceVersion": str(self.rv)}, "items": items})

    def create(self, resource: str, namespace: str, body: dict) -> Response:
        self.record(resource, "create", body)
        sent = k8s.ApiClient().sanitize_for_serialization(MODELS[resource].model_validate(body))
        with self.cond:
            if body["metadata"]["name"] in self.store[resource]:
                raise ApiException(status=409, reason="AlreadyExists")
        return Response(self.put(resource, sent), 201)

    def delete(self, resource: str, name: str, namespace: str, body: dict | None) -> Response:
        self.record(resource, "delete", body or {})
        if body is not None:
            k8s.V1DeleteOptions.model_validate(body)
        with self.cond:
            obj = self.store[resource].get(name)
            if obj is None:
                raise ApiException(status=404, reason="NotFound")
            want = ((body or {}).get("preconditions") or {}).get("uid")
            if want and want != obj["metadata"]["uid"]:
                raise ApiException(status=409, reason="Conflict")
            self.remove(resource, name)
        return Response({"kind": "Status", "status": "Success"})


class Subscription:
    """One watch request: the events after its version, then whatever comes, until stopped."""

    def __init__(self, fake: FakeKube, resource: str, selector: str, since: int) -> None:
        self.fake, self.resource, self.selector, self.cursor = fake, resource, selector, since
        self.stopped = False

    def events(self):
        fake = self.fake
        while not self.stopped:
            with fake.cond:
                if self.cursor < fake.compacted:
                    raise ApiException(status=410, reason="Expired: too old resource version")
                new = [e for e in fake.log if e[0] > self.cursor and e[1] == self.resource]
                if not new:
                    fake.cond.wait(0.05)
                    continue
            for rv, _, kind, obj in new:
                self.cursor = rv
                if matches(obj["metadata"].get("labels") or {}, self.selector):
                    yield {"type": kind, "object": obj, "raw_object": obj}


class Watch:
    """kubernetes.watch.Watch: stream(func, **kwargs) calls func with watch=True."""

    def __init__(self, fake: FakeKube) -> None:
        self.fake = fake
        self.sub: Subscription | None = None

    def stream(self, func, *args, **kwargs):
        self.sub = func(*args, watch=True, _preload_content=False, **kwargs)
        yield from self.sub.events()

    def stop(self) -> None:
        if self.sub is not None:
            self.sub.stopped = True


# --- the kubelet, for the agent Jobs -----------------------------------------------------------------


def finished(job: dict, kind: str, reason: str = "") -> dict:
    cond = {"type": kind, "status": "True"} | (
        {"reason": reason, "message": f"{reason} (test)"} if reason else {}
    )
    return {**job, "status": {"conditions": [cond]}}


class Cluster:
    """The fake API server plus what the kubelet would do: a Job's pod starts once its Secret
    exists, runs `tether agent-job` (tether.agents.job.run) with the Job's environment and the key
    from the Secret, and the Job ends Complete (exit 0) or Failed (exit 1); `plan` may end a Job
    otherwise (a deadline, a pod that exits 0 without reporting) or hold it."""

    def __init__(self, gateway_url: str, plan, fake: FakeKube | None = None) -> None:
        self.fake = fake or FakeKube()
        self.gateway_url = gateway_url
        self.plan = plan  # (job body, attempt) -> "run" | "deadline" | "silent" | "hold"
        self.started: list[str] = []
        self.held: list[str] = []
        self.max_alive = 0

    def alive(self) -> int:
        return sum(1 for j in self.fake.store["jobs"].values() if jobs.job_outcome(j) is None)

    async def run_pod(self, job: dict, action: str) -> None:
        name = job["metadata"]["name"]
        if action == "hold":
            self.held.append(name)
            return
        if action == "deadline":
            self.fake.put("jobs", finished(job, "Failed", "DeadlineExceeded"))
            return
        if action == "silent":
            self.fake.put("jobs", finished(job, "Complete"))
            return
        env = {e["name"]: e.get("value", "") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
        env["TETHER_API_KEY"] = self.fake.store["secrets"][name]["stringData"][jobs.KEY_FIELD]

        def harness(task, base_url, api_key, model):
            assert base_url.endswith("/v1") and model and api_key.startswith("tr-")
            if task.get("raise_on_attempt") == int(job["metadata"]["annotations"][jobs.ATTEMPT_ANNOTATION]):
                raise RuntimeError("the agent crashed")
            return float(task["reward"])

        code = await asyncio.to_thread(agent_job.run, env, harness)
        self.fake.put(
            "jobs",
            finished(job, "Complete") if code == 0 else finished(job, "Failed", "BackoffLimitExceeded"),
        )

    async def kubelet(self) -> None:
        while True:
            self.max_alive = max(self.max_alive, self.alive())
            for name, job in list(self.fake.store["jobs"].items()):
                if name in self.started or name not in self.fake.store["secrets"]:
                    continue
                self.started.append(name)
                attempt = int(job["metadata"]["annotations"][jobs.ATTEMPT_ANNOTATION])
                asyncio.create_task(self.run_pod(job, self.plan(job, attempt)))
            await asyncio.sleep(0.01)


METHODS: set[str] = set()  # every client method called, in any test of this process


def _bind(real_cls: type, method: str, args: tuple, kwargs: dict) -> None:
    """Fail as the real client would on a parameter its method does not take."""
    METHODS.add(method)
    inspect.signature(getattr(real_cls, method)).bind(None, *args, **kwargs)


class DiscoveryV1Api:
    def __init__(self, fake: FakeKube) -> None:
        self.fake = fake

    def list_namespaced_endpoint_slice(self, namespace, **kwargs):
        _bind(k8s.DiscoveryV1Api, "list_namespaced_endpoint_slice", (namespace,), kwargs)
        return self.fake.list("endpointslices", namespace, kwargs)


class BatchV1Api:
    def __init__(self, fake: FakeKube) -> None:
        self.fake = fake

    def list_namespaced_job(self, namespace, **kwargs):
        _bind(k8s.BatchV1Api, "list_namespaced_job", (namespace,), kwargs)
        return self.fake.list("jobs", namespace, kwargs)

    def create_namespaced_job(self, namespace, body, **kwargs):
        _bind(k8s.BatchV1Api, "create_namespaced_job", (namespace, body), kwargs)
        return self.fake.create("jobs", namespace, body)

    def delete_namespaced_job(self, name, namespace, **kwargs):
        _bind(k8s.BatchV1Api, "delete_namespaced_job", (name, namespace), kwargs)
        return self.fake.delete("jobs", name, namespace, kwargs.get("body"))


class CoreV1Api:
    def __init__(self, fake: FakeKube) -> None:
        self.fake = fake

    def create_namespaced_secret(self, namespace, body, **kwargs):
        _bind(k8s.CoreV1Api, "create_namespaced_secret", (namespace, body), kwargs)
        return self.fake.create("secrets", namespace, body)

    def list_namespaced_pod(self, namespace, **kwargs):
        _bind(k8s.CoreV1Api, "list_namespaced_pod", (namespace,), kwargs)
        return self.fake.list("pods", namespace, kwargs)

    def delete_namespaced_pod(self, name, namespace, **kwargs):
        _bind(k8s.CoreV1Api, "delete_namespaced_pod", (name, namespace), kwargs)
        return self.fake.delete("pods", name, namespace, kwargs.get("body"))
