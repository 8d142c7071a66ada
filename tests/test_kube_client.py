"""tether.scheduler.kube.client with the real `kubernetes` client, against a small HTTP server that
answers the few API paths like an API server would: raw lists, creates answered with the stored
object, a watch stream that ends in a 410 ERROR event (-> Gone), deletes with their options as the
body. What the recording fake cannot show: that the real client's calls, its Watch and its exceptions
are what the code expects of them."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import kubernetes.client as k8s
import pytest
from kubernetes import watch

from tether.scheduler.kube.client import Gone, KubeApi
from tether.scheduler.kube.watch import follow

JOB = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j1", "resourceVersion": "7"}}


class ApiServer(ThreadingHTTPServer):
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict, object]] = []
        self.watches = 0
        super().__init__(("127.0.0.1", 0), Handler)


class Handler(BaseHTTPRequestHandler):
    server: ApiServer

    def _body(self):
        n = int(self.headers.get("content-length") or 0)
        return json.loads(self.rfile.read(n)) if n else None

    def _send(self, code: int, obj) -> None:
        out = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urlparse(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        self.server.requests.append(("GET", url.path, query, None))
        if query.get("watch") == "true":
            self.server.watches += 1
            events = [
                {"type": "ADDED", "object": {**JOB, "metadata": {"name": "j2", "resourceVersion": "8"}}},
                {
                    "type": "BOOKMARK",
                    "object": {"kind": "Job", "apiVersion": "batch/v1", "metadata": {"resourceVersion": "9"}},
                },
                {
                    "type": "ERROR",
                    "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"},
                },
            ]
            out = b"".join(json.dumps(e).encode() + b"\n" for e in events)
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)
            return
        self._send(
            200,
            {
                "apiVersion": "batch/v1",
                "kind": "JobList",
                "metadata": {"resourceVersion": "7"},
                "items": [JOB],
            },
        )

    def do_POST(self) -> None:  # noqa: N802
        body = self._body()
        self.server.requests.append(("POST", self.path, {}, body))
        if body["metadata"]["name"] == "exists":
            self._send(409, {"kind": "Status", "code": 409, "reason": "AlreadyExists"})
            return
        self._send(201, {**body, "metadata": {**body["metadata"], "uid": "u-1", "resourceVersion": "10"}})

    def do_DELETE(self) -> None:  # noqa: N802
        self.server.requests.append(("DELETE", self.path, {}, self._body()))
        if self.path.endswith("/missing"):
            self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})
            return
        self._send(200, {"kind": "Status", "status": "Success"})

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server():
    srv = ApiServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()


@pytest.fixture
def api(server):
    cfg = k8s.Configuration()
    cfg.host = f"http://127.0.0.1:{server.server_address[1]}"
    client = k8s.ApiClient(cfg)
    return KubeApi(k8s.DiscoveryV1Api(client), k8s.BatchV1Api(client), k8s.CoreV1Api(client), watch.Watch)


async def test_list_create_delete_through_the_real_client(api, server):
    body = await api.list("jobs", api.batch.list_namespaced_job, namespace="ns", label_selector="a=b,c=d")
    assert body["metadata"]["resourceVersion"] == "7" and body["items"] == [JOB]
    assert server.requests[-1][:3] == (
        "GET",
        "/apis/batch/v1/namespaces/ns/jobs",
        {"labelSelector": "a=b,c=d"},
    )

    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "x", "labels": {"a": "b"}},
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]}},
        },
    }
    created = await api.create("jobs", api.batch.create_namespaced_job, "ns", job)
    assert created["metadata"]["uid"] == "u-1"
    assert server.requests[-1][3] == job  # sent as built: nothing dropped or renamed by the client
    with pytest.raises(k8s.ApiException) as err:
        await api.create(
            "secrets",
            api.core.create_namespaced_secret,
            "ns",
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "exists"}},
        )
    assert err.value.status == 409

    options = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": "u-1"}}
    await api.delete("pods", api.core.delete_namespaced_pod, "p", "ns", options)  # answered with a Status
    assert server.requests[-1][1:] == ("/api/v1/namespaces/ns/pods/p", {}, options)
    with pytest.raises(k8s.ApiException) as err:
        await api.delete("jobs", api.batch.delete_namespaced_job, "missing", "ns", options)
    assert err.value.status == 404  # what the gang restart and the Job cleanup tell apart


async def test_the_watch_yields_raw_objects_and_a_410_is_gone(api, server):
    events = []
    with pytest.raises(Gone):
        async for e in api.stream(
            "jobs",
            api.batch.list_namespaced_job,
            namespace="ns",
            label_selector="a=b",
            resource_version="7",
            timeout_seconds=5,
            allow_watch_bookmarks=True,
        ):
            events.append(e)
    assert [e["type"] for e in events] == ["ADDED", "BOOKMARK"]
    assert events[0]["object"]["metadata"] == {"name": "j2", "resourceVersion": "8"}  # the raw JSON
    query = server.requests[-1][2]
    assert query == {
        "watch": "true",
        "labelSelector": "a=b",
        "resourceVersion": "7",
        "timeoutSeconds": "5",
        "allowWatchBookmarks": "true",
    }


async def test_follow_lists_again_after_a_410(api, server):
    seen = []

    async def on_change(snapshot, event):
        seen.append((sorted(snapshot), event["type"] if event else None))

    task = asyncio.create_task(
        follow(api, "jobs", api.batch.list_namespaced_job, on_change, namespace="ns", label_selector="")
    )
    try:
        for _ in range(500):
            if server.watches >= 2:
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert seen[:3] == [(["j1"], None), (["j1", "j2"], "ADDED"), (["j1"], None)]
