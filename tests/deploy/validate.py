"""Manifest validation offline: built-in kinds against kubernetes-validate's strict schemas of a given
Kubernetes version, custom resources against their CRDs' vendored openAPIV3Schema (crds/README.md)."""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
from kubernetes_validate import utils
from packaging.version import Version
from referencing import Registry, Resource

from deploy import policy

CRDS = Path(__file__).parent / "crds"
# The schemas do not carry their kind: the vendored files' plurals.
KINDS = {"podmonitors": "PodMonitor", "prometheusrules": "PrometheusRule", "jobsets": "JobSet"}


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever the API server would prune them: an object with
    `properties` and neither `additionalProperties` nor `x-kubernetes-preserve-unknown-fields`."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: _strict(v) if k not in ("enum", "default", "example", "required") else v for k, v in schema.items()
    }
    if (
        "properties" in schema
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> strict schema of every vendored CRD version."""
    out = {}
    for path in sorted(CRDS.glob("*.json")):
        group, plural, version = path.stem.rsplit("_", 2)
        out[(f"{group}/{version}", KINDS[plural])] = _strict(json.loads(path.read_text()))
    return out


def is_custom(obj: dict[str, Any]) -> bool:
    return (obj.get("apiVersion"), obj.get("kind")) in crd_schemas()


def _where(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(root)"


def crd_violations(obj: dict[str, Any]) -> list[str]:
    """Every schema error of a custom resource (its metadata checked as ObjectMeta by the built-in
    schema of a Secret, which carries nothing else)."""
    schema = crd_schemas()[(obj["apiVersion"], obj["kind"])]
    body = copy.deepcopy(obj)
    meta = body.pop("metadata", {})
    validator = jsonschema.Draft7Validator(schema)
    out = [f"{_where(e)}: {e.message}" for e in validator.iter_errors(body)]
    out += [
        f"metadata: {m}"
        for m in kube_violations({"apiVersion": "v1", "kind": "Secret", "metadata": meta}, "1.34.0")
    ]
    return out


@functools.cache
def _kube_validator(version: str, api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    """kubernetes-validate's strict schema of one kind at one version, compiled once (its `validate`
    reloads the 1.5 MB definitions on every call); None when that version serves no such kind."""
    wanted = utils.major_minor(version)
    bundled = [v for v in utils.all_versions() if Version(utils.major_minor(v)) <= Version(wanted)][-1]
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"kubernetes-json-schema/v{bundled}-local-strict"
    try:
        schema = utils.schema_contents(f"{folder}/{kind.lower()}-{group}.json", version)
    except FileNotFoundError:
        return None
    definitions = Resource.from_contents(utils.schema_contents(f"{folder}/_definitions.json", version))
    registry = definitions @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def kube_violations(obj: dict[str, Any], version: str) -> list[str]:
    """kubernetes-validate --strict at one version (every error, not only the first); a kind it has no
    schema for is a violation too (an API that version does not serve), unless it is one of the vendored
    custom resources."""
    if is_custom(obj):
        return crd_violations(obj)
    validator = _kube_validator(version, obj["apiVersion"], obj["kind"])
    if validator is None:
        return [f"Kubernetes {version} serves no {obj['kind']} in {obj['apiVersion']}"]
    return [f"{_where(e)}: {e.message}" for e in validator.iter_errors(obj)]


# --- what the API server refuses and the OpenAPI schemas cannot say -----------------------------------

DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # RFC 1035: Services, port-less hostnames
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
LABEL_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
QUANTITY = re.compile(r"([0-9.]+)([a-zA-Z]*)")
SUFFIX = {
    "": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
}  # fmt: skip
NATIVE_RESOURCES = ("cpu", "memory", "ephemeral-storage")
# Names the controllers derive and put into a label (<= 63 characters): a StatefulSet's
# controller-revision-hash is <name>-<10 characters>, a CronJob's Jobs are <name>-<11 digits>.
MAX_NAME = {"StatefulSet": 52, "CronJob": 52, "Job": 63, "Service": 63}


def quantity(q: Any) -> float:
    m = QUANTITY.fullmatch(str(q))
    assert m and m.group(2) in SUFFIX, f"not a quantity: {q!r}"
    return float(m.group(1)) * SUFFIX[m.group(2)]


def _labels_violations(where: str, labels: dict[str, Any]) -> list[str]:
    out = []
    for k, v in (labels or {}).items():
        prefix, _, name = k.rpartition("/")
        if (
            (prefix and not DNS_SUBDOMAIN.fullmatch(prefix))
            or len(name) > 63
            or not LABEL_NAME.fullmatch(name)
        ):
            out.append(f"{where}: label key {k!r}")
        if not isinstance(v, str) or len(v) > 63 or not LABEL_VALUE.fullmatch(v):
            out.append(f"{where}: label {k}={v!r} is not a label value")
    return out


def _container_violations(where: str, c: dict[str, Any], volumes: set[str]) -> list[str]:
    out = []
    names = [p.get("name") for p in c.get("ports") or [] if p.get("name")]
    for n in names:
        if len(n) > 15 or not PORT_NAME.fullmatch(n) or not re.search("[a-z]", n):
            out.append(f"{where}: port name {n!r} (IANA_SVC_NAME: <= 15, lowercase, a letter)")
    if len(names) != len(set(names)):
        out.append(f"{where}: duplicate port names {names}")
    env = [e["name"] for e in c.get("env") or []]
    dupes = sorted({n for n in env if env.count(n) > 1})
    if dupes:
        out.append(f"{where}: env set twice (the last wins silently): {dupes}")
    for m in c.get("volumeMounts") or []:
        if m["name"] not in volumes:
            out.append(f"{where}: mounts {m['name']}, no such volume")
    paths = [m["mountPath"] for m in c.get("volumeMounts") or []]
    if len(paths) != len(set(paths)):
        out.append(f"{where}: a mountPath twice: {paths}")
    res = c.get("resources") or {}
    requests, limits = res.get("requests") or {}, res.get("limits") or {}
    for r, lim in limits.items():
        if r in requests and quantity(requests[r]) > quantity(lim):
            out.append(f"{where}: requests.{r} {requests[r]} > limits.{r} {lim}")
        if (
            r not in NATIVE_RESOURCES
            and not r.startswith("hugepages-")
            and r in requests
            and requests[r] != lim
        ):
            out.append(
                f"{where}: {r} requests {requests[r]} != limits {lim} (extended resources cannot overcommit)"
            )
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c.get(kind)
        if probe:
            handlers = [h for h in ("exec", "httpGet", "tcpSocket", "grpc") if h in probe]
            if len(handlers) != 1:
                out.append(f"{where}.{kind}: {len(handlers)} handlers")
            if kind in ("livenessProbe", "startupProbe") and probe.get("successThreshold", 1) != 1:
                out.append(f"{where}.{kind}: successThreshold must be 1")
    return out


def api_server_violations(obj: dict[str, Any]) -> list[str]:
    """The checks of the API server's validation that the OpenAPI schemas leave out: name and label
    syntax, a workload's selector matching its template, names the controllers derive labels from,
    quantities (requests <= limits), port and env names, mounts of declared volumes."""
    from deploy.policy import label_selector_matches, pod_templates

    kind, meta = obj["kind"], obj.get("metadata") or {}
    name = str(meta.get("name", ""))
    where = f"{kind}/{name}"
    out = []
    pattern = DNS_LABEL if kind == "Service" else DNS_SUBDOMAIN
    if len(name) > MAX_NAME.get(kind, 253) or not pattern.fullmatch(name):
        out.append(f"{where}: name is not valid for a {kind} (<= {MAX_NAME.get(kind, 253)})")
    out += _labels_violations(where, meta.get("labels") or {})
    spec = obj.get("spec") or {}
    selector = spec.get("selector")
    for twhere, template in pod_templates(obj):
        tlabels = (template.get("metadata") or {}).get("labels") or {}
        out += _labels_violations(f"{where} {twhere}", tlabels)
        if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet") and not label_selector_matches(
            selector, tlabels
        ):
            out.append(f"{where}: selector does not match the template's labels")
        pod = template.get("spec") or {}
        volumes = [v["name"] for v in pod.get("volumes") or []]
        if len(volumes) != len(set(volumes)):
            out.append(f"{where}: duplicate volumes {volumes}")
        cnames = [c["name"] for c in [*(pod.get("initContainers") or []), *(pod.get("containers") or [])]]
        if len(cnames) != len(set(cnames)):
            out.append(f"{where}: duplicate container names {cnames}")
        claims = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates") or []}
        for field in ("initContainers", "containers"):
            for c in pod.get(field) or []:
                out += _container_violations(f"{where} {field}[{c['name']}]", c, set(volumes) | claims)
    last_host = {
        "StatefulSet": lambda: f"{name}-{int(spec.get('replicas', 1)) - 1}",
        "Job": lambda: f"{name}-{int(spec.get('completions', 1)) - 1}",
        "JobSet": lambda: max(
            (
                f"{name}-{rj['name']}-{int(rj.get('replicas', 1)) - 1}-{int(rj['template']['spec'].get('completions', 1)) - 1}"
                for rj in spec.get("replicatedJobs") or []
            ),
            key=len,
            default="",
        ),
    }.get(kind)
    if last_host and len(last_host()) > 63:
        out.append(f"{where}: pod hostname {last_host()} is longer than 63 (DNS label)")
    return out


def render_problems(render: Any, version: str) -> list[str]:
    """What the core checks find in a chart render (deploy.chart.Render) at Kubernetes `version`: objects
    the version's schemas refuse, what the API server itself would refuse, and every pod template held to
    the chart's pod policies (policy.POD_CHECKS)."""
    problems = [
        f"{o['kind']}/{o['metadata']['name']}: {p}"
        for o in render.objects
        for p in kube_violations(o, version)
    ]
    problems += [p for o in render.objects for p in api_server_violations(o)]
    for where, t in render.pod_templates():
        for check in policy.POD_CHECKS:
            problems += [f"{where}: {v}" for v in check(t["spec"])]
    return problems
