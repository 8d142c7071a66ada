"""Every body tether.scheduler.kube sends -- the agent Job, its Secret, the delete options of a Job and
of a trainer pod -- validated strictly against the API's schemas at the chart's oldest and the newest
Kubernetes version, and the Job's pod held to Pod Security Standards "restricted" and to what the
harness needs (its key only through the Secret, a writable /tmp and HOME on a read-only root)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from deploy.policy import pod_spec_violations
from kube_bodies import VERSIONS, validate

from tether.scheduler.kube import gang, jobs

TEMPLATE = jobs.JobTemplate(
    instance="demo",
    run_id="run-1",
    image="tether/tether:0.1.0",
    gateway_url="http://demo-tether-gateway:8000",
    command=["tether", "agent-job"],
    resources={"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
    ttl_s=600,
    deadline_s=1800,
    agent_fn="tether.examples.calculator.agent:rollout",
)
ROLLOUT = {
    "rollout_id": "0123456789abcdef0123456789abcdef",
    "api_key": "tr-secret-key",
    "base_url": "http://demo-tether-gateway:8000/v1",
    "model": "tether-policy",
}
TASK = {"id": "t1", "question": "2+2", "answer": 4}


def job() -> dict:
    return jobs.job_body(TEMPLATE, ROLLOUT, TASK, "1700000000000-0", 1)


def created(body: dict) -> dict:
    return {**body, "metadata": {**body["metadata"], "uid": "7d7a1b9e-0000-4000-8000-000000000001"}}


BODIES = {
    "job": job,
    "job-own-image": lambda: jobs.job_body(
        TEMPLATE,
        ROLLOUT,
        {**TASK, "agent_job": {"image": "me/agent:1", "command": ["python", "a.py"]}},
        "1-0",
        0,
    ),
    "job-no-command": lambda: jobs.job_body(
        jobs.JobTemplate("demo", "r", "img:1", "http://gw:8000"), ROLLOUT, TASK, "1-0", 0
    ),
    "secret": lambda: jobs.secret_body(created(job()), ROLLOUT["api_key"]),
    "delete-job": jobs.delete_job_options,
    "delete-pod": lambda: gang.delete_options("7d7a1b9e-0000-4000-8000-000000000002"),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(BODIES))
def test_every_body_passes_the_strict_schema(name, version):
    validate(BODIES[name](), version)


def test_the_validation_can_fail():
    bad = job()
    bad["spec"]["template"]["spec"]["containers"][0]["securityContex"] = {}
    with pytest.raises(jsonschema.ValidationError, match="securityContex"):
        validate(bad, VERSIONS[0])
    with pytest.raises(jsonschema.ValidationError, match="propagation"):
        validate({**jobs.delete_job_options(), "propagation": "Background"}, VERSIONS[0])


@pytest.mark.parametrize("name", ["job", "job-own-image", "job-no-command"])
def test_the_job_pod_is_restricted_and_cannot_reach_the_api(name):
    body = BODIES[name]()
    pod = body["spec"]["template"]["spec"]
    assert pod_spec_violations(pod) == []  # the chart's own check (tests/deploy/policy.py)
    assert pod["automountServiceAccountToken"] is False
    assert pod["enableServiceLinks"] is False
    assert pod["restartPolicy"] == "Never"
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["runAsUser"] == 2000
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    home = next(e["value"] for e in c["env"] if e["name"] == "HOME")
    assert {"/tmp", home} <= set(mounts)
    assert all("emptyDir" in v for v in pod["volumes"] if v["name"] in mounts.values())


def test_the_checker_catches_a_violation():
    pod = job()["spec"]["template"]["spec"]
    pod["containers"][0]["securityContext"]["capabilities"] = {"drop": ["NET_RAW"]}
    pod["volumes"].append({"name": "h", "hostPath": {"path": "/"}})
    found = pod_spec_violations(pod)
    assert any("capabilities" in v for v in found) and any("hostPath" in v for v in found), found


def test_the_job_holds_the_key_only_by_reference():
    body = job()
    text = json.dumps(body)
    assert ROLLOUT["api_key"] not in text
    env = {e["name"]: e for e in body["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TETHER_API_KEY"] == {
        "name": "TETHER_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": body["metadata"]["name"], "key": jobs.KEY_FIELD}},
    }
    assert json.loads(env["TETHER_TASK"]["value"]) == TASK
    assert env["TETHER_BASE_URL"]["value"] == ROLLOUT["base_url"]
    # A gateway that hands out its public (ingress) URL: the Job still talks to it inside the cluster.
    public = jobs.job_body(TEMPLATE, {**ROLLOUT, "base_url": "https://tether.example.com/v1"}, TASK, "1-0", 0)
    env_public = {
        e["name"]: e.get("value") for e in public["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env_public["TETHER_BASE_URL"] == "http://demo-tether-gateway:8000/v1"
    assert env["TETHER_MODEL"]["value"] == "tether-policy"
    assert env["TETHER_AGENT_FN"]["value"] == TEMPLATE.agent_fn
    secret = BODIES["secret"]()
    assert secret["stringData"] == {jobs.KEY_FIELD: ROLLOUT["api_key"]}
    (owner,) = secret["metadata"]["ownerReferences"]
    assert owner == {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": body["metadata"]["name"],
        "uid": created(body)["metadata"]["uid"],
    }


def test_the_job_spec_follows_the_settings_and_labels():
    body = job()
    spec = body["spec"]
    assert (spec["backoffLimit"], spec["ttlSecondsAfterFinished"], spec["activeDeadlineSeconds"]) == (
        0,
        600,
        1800,
    )
    want = {
        "app.kubernetes.io/name": "tether",
        "app.kubernetes.io/instance": "demo",
        "app.kubernetes.io/component": "agent-job",
        "tether.dev/run": "run-1",
        "tether.dev/rollout": ROLLOUT["rollout_id"],
    }
    for labels in (body["metadata"]["labels"], spec["template"]["metadata"]["labels"]):
        assert want.items() <= labels.items()
    assert jobs.selector("demo") == "app.kubernetes.io/instance=demo,app.kubernetes.io/component=agent-job"
    c = spec["template"]["spec"]["containers"][0]
    assert (c["image"], c["command"], c["resources"]) == (
        TEMPLATE.image,
        TEMPLATE.command,
        TEMPLATE.resources,
    )
    own = BODIES["job-own-image"]()["spec"]["template"]["spec"]["containers"][0]
    assert (own["image"], own["command"]) == ("me/agent:1", ["python", "a.py"])
    assert "command" not in BODIES["job-no-command"]()["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(
    "instance,rollout",
    [("demo", "0123456789abcdef0123456789abcdef"), ("a" * 53, "f" * 32), ("My_Release", "ID.With.Dots")],
)
def test_job_names_are_dns_labels_of_at_most_63(instance, rollout):
    import re

    name = jobs.job_name(instance, rollout)
    assert len(name) <= 63 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name), name
    assert name.endswith(jobs.dns_label(rollout))
