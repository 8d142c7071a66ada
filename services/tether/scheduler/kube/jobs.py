"""Agent harnesses as Kubernetes Jobs: one Job per rollout attempt, in place of an agent worker.

The dispatcher keeps the agent worker's contract (tether.agents.worker): it consumes the dispatch
stream in the consumer group "agents", creates each rollout through the gateway (admin token), and
acknowledges the entry once the slot is done: one attempt completed, or `max_attempts` failed (the
merger then leaves the slot out of its group). In between, a Job runs the harness (`tether agent-job`,
tether.agents.job): it reads its task, base URL and model from its environment and its rollout key from
a Secret of its own, and reports its reward to the gateway itself. A Job that fails (the harness
failed, its pod could not run, the deadline passed) is a failed attempt: the dispatcher fails the
rollout through the gateway and the next attempt runs. A Job that completed without its rollout having
been finished failed as well ("job finished without reporting").

Bodies are built by pure functions (validated against the API's schemas in tests/test_kube_bodies.py);
creation is rate-limited by a token bucket and bounded to `max_concurrent` Jobs alive. After a
scheduler restart, an entry still pending for this consumer waits for the Job it already has (found by
the entry annotation) instead of starting another.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tether.common import broker, retry
from tether.common.records import DispatchJob, RecordError
from tether.scheduler.kube.client import KubeApi
from tether.scheduler.kube.metrics import JOBS_ACTIVE, JOBS_CREATED, JOBS_FAILED
from tether.scheduler.kube.watch import Snapshot, follow

log = logging.getLogger(__name__)

GROUP = "agents"  # the agent workers' consumer group: one or the other runs a dispatched rollout
COMPONENT = "agent-job"
RUN_LABEL, ROLLOUT_LABEL = "tether.dev/run", "tether.dev/rollout"
ENTRY_ANNOTATION, ATTEMPT_ANNOTATION = "tether.dev/dispatch-entry", "tether.dev/attempt"
KEY_FIELD = "api-key"  # the Secret's one key
USER_ID = 2000  # the tether image's user (docker/Dockerfile: USER 2000:0)
HOME = "/cache"  # the tether image's HOME


# --- rate limit ----------------------------------------------------------------------------------


class TokenBucket:
    """`burst` creations at once, then `qps` per second: what client-go's rate limiter does for a
    controller, so a burst of dispatched rollouts does not hammer the API server."""

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.qps, self.burst, self.clock = qps, burst, clock
        self.tokens = float(burst)
        self.at = clock()

    def take(self) -> float:
        """Take a token: 0.0 when one was there, else the seconds until one is (nothing taken)."""
        now = self.clock()
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.qps)
        self.at = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.qps

    async def acquire(self) -> None:
        while (wait := self.take()) > 0:
            await asyncio.sleep(wait)


# --- bodies --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobTemplate:
    """What every agent Job of this deployment shares (the scheduler's settings)."""

    instance: str
    run_id: str
    image: str
    gateway_url: str
    command: list[str] = field(default_factory=list)
    args: list[str] = field(default_factory=list)
    resources: dict[str, Any] = field(default_factory=dict)
    ttl_s: int = 600
    deadline_s: int = 1800
    agent_fn: str = ""
    image_pull_secrets: list[str] = field(default_factory=list)


def dns_label(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")


def job_name(instance: str, rollout_id: str) -> str:
    """`<instance>-agent-<rollout id>`, at most 63 characters (the Job controller copies the name
    into a label of its pods)."""
    rid = dns_label(rollout_id)[:40]
    prefix = dns_label(instance)[: 63 - len(rid) - len("-agent-")].rstrip("-")
    return f"{prefix}-agent-{rid}" if prefix else f"agent-{rid}"


def labels(t: JobTemplate, rollout_id: str) -> dict[str, str]:
    """The labels of the Job, its pod and its Secret: the chart's selector labels for component
    agent-job (its NetworkPolicy selects them), the run and the rollout."""
    return {
        "app.kubernetes.io/name": "tether",
        "app.kubernetes.io/instance": t.instance,
        "app.kubernetes.io/component": COMPONENT,
        "app.kubernetes.io/part-of": "tether",
        "app.kubernetes.io/managed-by": "tether-scheduler",
        RUN_LABEL: dns_label(t.run_id)[:63].strip("-") or "run",
        ROLLOUT_LABEL: dns_label(rollout_id)[:63],
    }


def selector(instance: str) -> str:
    """The label selector of this deployment's agent Jobs."""
    return f"app.kubernetes.io/instance={instance},app.kubernetes.io/component={COMPONENT}"


def job_body(
    t: JobTemplate, rollout: dict[str, Any], task: dict[str, Any], entry_id: str, attempt: int
) -> dict:
    """The Job of one rollout attempt. A task may name its own image, command and args
    (`task["agent_job"]`); everything else is the deployment's. The key is not in it: the container
    reads it from the Secret `secret_body` makes (same name)."""
    rid = rollout["rollout_id"]
    name = job_name(t.instance, rid)
    raw = task.get("agent_job")
    own: dict[str, Any] = raw if isinstance(raw, dict) else {}
    command, args = own.get("command", t.command), own.get("args", t.args)
    env = [
        {"name": "TETHER_ROLLOUT_ID", "value": rid},
        {"name": "TETHER_GATEWAY_URL", "value": t.gateway_url},
        # The gateway in the cluster (what the Job's NetworkPolicy lets it reach), not the public URL
        # the gateway hands out (an ingress, maybe): the rollout's key is what names the rollout.
        {"name": "TETHER_BASE_URL", "value": f"{t.gateway_url.rstrip('/')}/v1"},
        {"name": "TETHER_MODEL", "value": rollout["model"]},
        {"name": "TETHER_TASK", "value": json.dumps(task)},
        {"name": "TETHER_API_KEY", "valueFrom": {"secretKeyRef": {"name": name, "key": KEY_FIELD}}},
        {"name": "HOME", "value": HOME},
        {"name": "TMPDIR", "value": "/tmp"},
    ]
    if t.agent_fn:
        env.append({"name": "TETHER_AGENT_FN", "value": t.agent_fn})
    container: dict[str, Any] = {
        "name": "agent",
        "image": own.get("image", t.image),
        "imagePullPolicy": "IfNotPresent",
        "env": env,
        "resources": t.resources,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": USER_ID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "home", "mountPath": HOME}],
    }
    if command:
        container["command"] = list(command)
    if args:
        container["args"] = list(args)
    meta_labels = labels(t, rid)
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": USER_ID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
            {"name": "home", "emptyDir": {"sizeLimit": "1Gi"}},
        ],
    }
    if t.image_pull_secrets:  # a private registry: the same pull secrets as the chart's own pods
        pod["imagePullSecrets"] = [{"name": n} for n in t.image_pull_secrets]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "labels": meta_labels,
            # The exact rollout id (the label holds it as a label value may), the dispatch entry and
            # the attempt: what a restarted scheduler needs to take the Job over.
            "annotations": {ROLLOUT_LABEL: rid, ENTRY_ANNOTATION: entry_id, ATTEMPT_ANNOTATION: str(attempt)},
        },
        "spec": {
            "backoffLimit": 0,  # one pod per attempt: the dispatcher's max_attempts is the retry rule
            "ttlSecondsAfterFinished": t.ttl_s,
            "activeDeadlineSeconds": t.deadline_s,
            "template": {"metadata": {"labels": meta_labels}, "spec": pod},
        },
    }


def secret_body(job: dict[str, Any], api_key: str) -> dict:
    """The rollout key, owned by its (created) Job so that Kubernetes deletes it with the Job. No
    blockOwnerDeletion: setting it needs the right to update the Job's finalizers, which the
    scheduler does not hold."""
    meta = job["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": meta["name"],
            "labels": meta.get("labels") or {},
            "ownerReferences": [
                {"apiVersion": "batch/v1", "kind": "Job", "name": meta["name"], "uid": meta["uid"]}
            ],
        },
        "type": "Opaque",
        "immutable": True,
        "stringData": {KEY_FIELD: api_key},
    }


def delete_job_options() -> dict:
    """Delete a Job with its pods (the Secret goes by its owner reference)."""
    return {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}


def job_outcome(job: dict[str, Any]) -> tuple[str, str] | None:
    """("complete", "") or ("failed", reason) once the Job finished (its terminal condition, or the
    condition the controller sets first on Kubernetes >= 1.31); None while it runs."""
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("status") != "True":
            continue
        if cond.get("type") in ("Failed", "FailureTarget"):
            return "failed", cond.get("reason") or "Failed"
        if cond.get("type") in ("Complete", "SuccessCriteriaMet"):
            return "complete", ""
    return None


def failure_message(job: dict[str, Any]) -> str:
    for cond in (job.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Failed", "FailureTarget") and cond.get("status") == "True":
            return f"{cond.get('reason', 'Failed')}: {cond.get('message', '')}".strip(": ")
    return ""


# --- the gateway ---------------------------------------------------------------------------------

RETRYABLE_STATUS = frozenset({502, 503, 504})
GATEWAY_RETRIES = 6


class Gateway:
    """The gateway's rollout API as the dispatcher uses it, with the admin token (creating, reading
    and failing any rollout; the dispatcher never holds a rollout key beyond handing it over)."""

    def __init__(self, url: str, admin_token: str, http: httpx.AsyncClient | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.http = http or httpx.AsyncClient(timeout=60.0, headers=headers)

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Tried again while the gateway cannot take it yet (502/503/504, connection refused)."""
        for attempt in range(GATEWAY_RETRIES):
            try:
                resp = await self.http.request(method, self.url + path, **kwargs)
                if resp.status_code not in RETRYABLE_STATUS:
                    return resp
            except httpx.ConnectError:
                pass
            await asyncio.sleep(retry.backoff(attempt, 0.5, 5.0))
        return await self.http.request(method, self.url + path, **kwargs)

    async def create(self, job: DispatchJob, attempt: int) -> dict[str, Any]:
        meta = {**job.metadata, "attempt": attempt, "max_attempts": job.max_attempts}
        body = {
            "task_id": job.task_id,
            "group_id": job.group_id,
            "group_size": job.group_size,
            "metadata": meta,
        }
        resp = await self.request("POST", "/v1/rollouts", json=body)
        resp.raise_for_status()
        return resp.json()

    async def fail(self, rollout_id: str, reason: str) -> bool:
        """Fail a running rollout; False when it had finished already (409)."""
        resp = await self.request("POST", f"/v1/rollouts/{rollout_id}/fail", json={"reason": reason[:2000]})
        if resp.status_code == 409:
            return False
        resp.raise_for_status()
        return True

    async def status(self, rollout_id: str) -> str:
        resp = await self.request("GET", f"/v1/rollouts/{rollout_id}")
        resp.raise_for_status()
        return str(resp.json()["status"])

    async def aclose(self) -> None:
        await self.http.aclose()


# --- the dispatcher ------------------------------------------------------------------------------

Outcome = tuple[str, str]


class JobDispatcher:
    def __init__(
        self,
        r: Any,
        keys: broker.Keys,
        api: KubeApi,
        namespace: str,
        template: JobTemplate,
        gateway: Gateway,
        bucket: TokenBucket,
        max_concurrent: int,
        consumer: str = "scheduler-jobs",
    ) -> None:
        self.r, self.keys, self.api, self.namespace = r, keys, api, namespace
        self.t, self.gateway, self.bucket = template, gateway, bucket
        self.max_concurrent, self.consumer = max_concurrent, consumer
        # Entries idle this long are another consumer's that died: longer than any Job may run.
        self.claim_idle_ms = (template.deadline_s + 300) * 1000
        self.jobs: Snapshot = {}  # this deployment's Jobs, as last listed/watched
        self.synced = asyncio.Event()
        self.waiters: dict[str, asyncio.Future[Outcome]] = {}
        self.seen: set[str] = set()  # Jobs waited for that a snapshot has shown
        self.in_flight: set[str] = set()

    # -- the Jobs, as the watch sees them

    async def on_jobs(self, snapshot: Snapshot, event: dict[str, Any] | None) -> None:
        self.jobs = snapshot
        self.synced.set()
        names = [event["object"]["metadata"]["name"]] if event else list(self.waiters)
        for name in names:
            fut = self.waiters.get(name)
            if fut is None or fut.done():
                continue
            job = snapshot.get(name)
            if job is None:
                # Deleted: by its event, or, after a gap in the watch, missing from a new list once seen.
                if (event and event["type"] == "DELETED") or (event is None and name in self.seen):
                    fut.set_result(("failed", "Deleted"))
                continue
            self.seen.add(name)
            outcome = job_outcome(job)
            if outcome is not None:
                fut.set_result(outcome)

    def alive(self) -> int:
        return sum(1 for j in self.jobs.values() if job_outcome(j) is None)

    def job_of_entry(self, entry_id: str) -> dict[str, Any] | None:
        """The newest Job this deployment made for a dispatch entry (after a restart)."""
        mine = [
            j
            for j in self.jobs.values()
            if (j["metadata"].get("annotations") or {}).get(ENTRY_ANNOTATION) == entry_id
        ]
        return max(
            mine, key=lambda j: int(j["metadata"]["annotations"].get(ATTEMPT_ANNOTATION, "0")), default=None
        )

    async def wait(self, name: str) -> Outcome:
        fut = self.waiters.get(name)
        if fut is None:
            fut = self.waiters[name] = asyncio.get_running_loop().create_future()
        job = self.jobs.get(name)
        if job is not None and (outcome := job_outcome(job)) is not None and not fut.done():
            fut.set_result(outcome)
        JOBS_ACTIVE.inc()
        try:
            return await fut
        finally:
            JOBS_ACTIVE.dec()
            self.waiters.pop(name, None)
            self.seen.discard(name)

    # -- one attempt

    async def launch(
        self, rollout: dict[str, Any], job: DispatchJob, entry_id: str, attempt: int
    ) -> str | None:
        """Create the attempt's Job and its Secret; the Job's name, or None when that failed (the
        rollout is failed then, and the Job, if one was made, deleted)."""
        body = job_body(self.t, rollout, job.task, entry_id, attempt)
        name = body["metadata"]["name"]
        self.waiters[name] = asyncio.get_running_loop().create_future()  # before the watch can see it
        created: dict[str, Any] | None = None
        try:
            created = await self.api.create(
                "jobs", self.api.batch.create_namespaced_job, self.namespace, body
            )
            JOBS_CREATED.inc()
            await self.api.create(
                "secrets",
                self.api.core.create_namespaced_secret,
                self.namespace,
                secret_body(created, rollout["api_key"]),
            )
            return name
        except Exception as exc:
            self.waiters.pop(name, None)
            JOBS_FAILED.labels("CreateFailed").inc()
            log.error("could not create agent Job %s: %r", name, exc)
            if created is not None:
                try:
                    await self.api.delete(
                        "jobs",
                        self.api.batch.delete_namespaced_job,
                        name,
                        self.namespace,
                        delete_job_options(),
                    )
                except Exception as cleanup:  # its deadline ends it; its pod cannot start without the key
                    log.warning("could not delete agent Job %s: %r", name, cleanup)
            await self.gateway.fail(rollout["rollout_id"], f"could not create the agent Job: {exc!r}")
            return None

    async def settle(self, rollout_id: str, name: str, outcome: Outcome) -> bool:
        """What a finished Job means for its rollout attempt: whether the attempt completed."""
        kind, reason = outcome
        if kind == "failed":
            why = failure_message(self.jobs.get(name, {})) or reason
            if await self.gateway.fail(rollout_id, f"agent Job {name} failed: {why}"):
                JOBS_FAILED.labels(reason).inc()
                log.warning("agent Job %s failed: %s", name, why)
                return False
            return await self.gateway.status(rollout_id) == "completed"  # it reported, then failed
        status = await self.gateway.status(rollout_id)
        if status == "running":
            if await self.gateway.fail(rollout_id, "job finished without reporting"):
                JOBS_FAILED.labels("NotReported").inc()
                log.warning("agent Job %s finished without reporting its rollout", name)
                return False
            status = await self.gateway.status(rollout_id)  # it reported meanwhile
        return status == "completed"

    async def run_slot(self, entry_id: str, job: DispatchJob) -> None:
        """Attempts until one completes or `max_attempts` failed; then acknowledge the entry. A
        gateway or Redis error leaves the entry pending (claimed again later)."""
        try:
            first = 0
            await self.synced.wait()
            existing = self.job_of_entry(entry_id)
            done = False
            if existing is not None:  # a previous scheduler's attempt: wait for it, don't start another
                meta = existing["metadata"]
                first = int(meta["annotations"].get(ATTEMPT_ANNOTATION, "0")) + 1
                rid = meta["annotations"].get(ROLLOUT_LABEL) or meta["labels"][ROLLOUT_LABEL]
                done = await self.settle(rid, meta["name"], await self.wait(meta["name"]))
            for attempt in range(first, job.max_attempts):
                if done:
                    break
                await self.bucket.acquire()
                rollout = await self.gateway.create(job, attempt)
                name = await self.launch(rollout, job, entry_id, attempt)
                if name is not None:
                    done = await self.settle(rollout["rollout_id"], name, await self.wait(name))
            await self.r.xack(self.keys.dispatch, GROUP, entry_id)
        except (httpx.HTTPError, *broker.TRANSIENT) as exc:
            log.error("dispatch %s left pending: %r", entry_id, exc)
        except Exception:  # left pending as well: claimed again later, by this scheduler or the next
            log.exception("dispatch %s failed unexpectedly; left pending", entry_id)
        finally:
            self.in_flight.discard(entry_id)

    # -- the loop

    async def dead_letter(self, entry_id: str, record: object, exc: RecordError) -> None:
        stream = self.keys.dispatch
        await broker.dead_letter(self.r, self.keys, stream, entry_id, repr(exc), record, "DispatchJob")
        await self.r.xack(stream, GROUP, entry_id)

    async def own_pending(self) -> list[tuple[str, dict[str, Any]]]:
        """The entries a previous process of this consumer took and did not acknowledge."""
        resp: Any = await self.r.xreadgroup(GROUP, self.consumer, {self.keys.dispatch: "0"}, count=10_000)
        return [(eid, broker.decode(f)) for _, items in resp or [] for eid, f in items if f]

    def start_slot(self, tasks: set[asyncio.Task], entry_id: str, record: dict[str, Any]) -> None:
        if entry_id in self.in_flight:
            return
        try:
            job = DispatchJob.from_dict(record)
        except RecordError as exc:
            tasks.add(asyncio.create_task(self.dead_letter(entry_id, record, exc)))
            return
        self.in_flight.add(entry_id)
        task = asyncio.create_task(self.run_slot(entry_id, job))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def dispatch(self) -> None:
        await broker.ensure_group(self.r, self.keys.dispatch, GROUP)
        await self.synced.wait()
        tasks: set[asyncio.Task] = set()
        try:
            for entry_id, record in await self.own_pending():
                self.start_slot(tasks, entry_id, record)
            while True:
                free = self.max_concurrent - max(len(self.in_flight), self.alive())
                if free <= 0:
                    await asyncio.sleep(0.5)
                    continue
                try:
                    entries = await broker.read_group(
                        self.r,
                        self.keys.dispatch,
                        GROUP,
                        self.consumer,
                        count=free,
                        block_ms=1000,
                        claim_idle_ms=self.claim_idle_ms,
                    )
                except broker.TRANSIENT as exc:
                    log.warning("Redis read failed (%s); retrying", exc)
                    await asyncio.sleep(1.0)
                    continue
                for entry_id, record in entries:
                    self.start_slot(tasks, entry_id, record)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def watch_jobs(self) -> None:
        await follow(
            self.api,
            "jobs",
            self.api.batch.list_namespaced_job,
            self.on_jobs,
            namespace=self.namespace,
            label_selector=selector(self.t.instance),
        )

    async def run(self) -> None:
        """The Job watch and the dispatch loop together; neither ends unless cancelled."""
        try:
            await asyncio.gather(self.watch_jobs(), self.dispatch())
        finally:
            await self.gateway.aclose()
