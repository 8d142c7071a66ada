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
