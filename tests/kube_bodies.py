"""Strict schema validation of the bodies tether.scheduler.kube sends, with kubernetes-validate's
bundled schemas (DeleteOptions is filed under its meta group there, so it is checked against that
schema file directly, with the same definitions)."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
from kubernetes_validate.utils import schema_contents
from referencing import Registry, Resource

# The chart's floor and the newest the validator bundles.
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())


def validate(body: dict, version: str) -> None:
    """Raise on anything the API's schema for `version` (strict: no unknown fields) refuses."""
    if body.get("kind") != "DeleteOptions":
        kubernetes_validate.validate(body, version, strict=True)
        return
    schema_dir = f"kubernetes-json-schema/v{version}-local-strict"
    schema = schema_contents(f"{schema_dir}/deleteoptions-meta-v1.json", version)
    definitions = schema_contents(f"{schema_dir}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    jsonschema.validators.Draft202012Validator(schema, registry=registry).validate(body)
