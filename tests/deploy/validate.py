"""Manifest validation offline: built-in kinds against kubernetes-validate's strict schemas of a given
Kubernetes version, custom resources against their CRDs' vendored openAPIV3Schema (crds/README.md)."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate

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


def kube_violations(obj: dict[str, Any], version: str) -> list[str]:
    """kubernetes-validate --strict at one version; a kind it has no schema for is a violation too
    (an API that version does not serve), unless it is one of the vendored custom resources."""
    if is_custom(obj):
        return crd_violations(obj)
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{_where(e)}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [e.message]
    return []
