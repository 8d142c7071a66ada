"""The Kubernetes definitions the chart's values.schema.json validates pass-through objects against
(resources, affinity, tolerations, env, securityContext, NetworkPolicy peers, ...), vendored from the
OpenAPI-derived JSON schemas that the `kubernetes-validate` package bundles: no network, no drift.

Run: python scripts/k8s_schema.py [--check] [--version 1.29.0]
It reads helm/tether/values.schema.json, collects every "#/$defs/io.k8s..." reference in it, and
rewrites the file's "$defs" so that it holds exactly those definitions and everything they reference
(descriptions and x-kubernetes-* annotations dropped: they are documentation, not constraints; the
Tether definitions, whose names do not start with "io.k8s.", are kept as they are). --check exits 1
when the committed file differs from what this would write.

Why the oldest supported version: a field only newer Kubernetes knows would be accepted by the
schema and then refused by an older API server (Chart.yaml: kubeVersion >=1.29).
The definitions are data derived from the Kubernetes OpenAPI (Apache-2.0, the Kubernetes Authors),
as packaged by kubernetes-validate (Apache-2.0).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_FILE = ROOT / "helm" / "tether" / "values.schema.json"
DEFAULT_VERSION = "1.29.0"
K8S_PREFIX = "#/$defs/io.k8s."
DROPPED_KEYS = ("description",)


def bundled_definitions(version: str) -> dict[str, Any]:
    """The `$defs` of kubernetes-validate's strict standalone schemas for `version`."""
    spec = importlib.util.find_spec("kubernetes_validate")  # its data directory, not its API
    if spec is None or spec.origin is None:
        raise SystemExit("kubernetes-validate is not installed (pip install kubernetes-validate)")
    base = Path(spec.origin).parent / "kubernetes-json-schema"
    path = base / f"v{version}-local-strict" / "_definitions.json"
    if not path.is_file():
        raise SystemExit(f"kubernetes-validate bundles no schemas for {version} ({path})")
    defs: dict[str, Any] = json.loads(path.read_text())["$defs"]
    return defs


def refs(node: Any) -> set[str]:
    """Every Kubernetes definition name a schema fragment references."""
    found: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(K8S_PREFIX):
            found.add(ref.removeprefix("#/$defs/"))
        for value in node.values():
            found |= refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= refs(value)
    return found


def strip(node: Any) -> Any:
    """A definition without its prose and its x-kubernetes-* annotations."""
    if isinstance(node, dict):
        return {
            key: strip(value)
            for key, value in node.items()
            if key not in DROPPED_KEYS and not key.startswith("x-kubernetes-")
        }
    if isinstance(node, list):
        return [strip(value) for value in node]
    return node


def closure(roots: set[str], defs: dict[str, Any]) -> dict[str, Any]:
    """The definitions named in `roots` and all they reference, transitively, sorted by name."""
    out: dict[str, Any] = {}
    todo = sorted(roots)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        if name not in defs:
            raise SystemExit(f"values.schema.json references {name}, which Kubernetes does not define")
        out[name] = strip(defs[name])
        todo.extend(sorted(refs(out[name]) - out.keys()))
    return dict(sorted(out.items()))


def with_kubernetes_defs(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """`schema` with its Kubernetes $defs replaced by the closure of what the Tether part references."""
    own = {name: body for name, body in schema.get("$defs", {}).items() if not name.startswith("io.k8s.")}
    tether_part = {key: value for key, value in schema.items() if key != "$defs"}
    roots = refs(tether_part) | refs(own)
    return {**tether_part, "$defs": {**dict(sorted(own.items())), **closure(roots, defs)}}


def dump(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed schema would change")
    parser.add_argument("--version", default=DEFAULT_VERSION, help="Kubernetes version of the definitions")
    args = parser.parse_args(argv)
    current = SCHEMA_FILE.read_text()
    written = dump(with_kubernetes_defs(json.loads(current), bundled_definitions(args.version)))
    if args.check:
        if written != current:
            print(
                f"{SCHEMA_FILE.relative_to(ROOT)} is stale: run python scripts/k8s_schema.py", file=sys.stderr
            )
            return 1
        return 0
    SCHEMA_FILE.write_text(written)
    return 0


if __name__ == "__main__":
    sys.exit(main())
