"""The chart under test, rendered offline by Helm v4 as a library (helm-python-sdk), and its value sets.

A value set is a values file under tests/deploy/values/ (bad/ holds the ones the chart must refuse).
Its leading comment lines may carry test metadata, invisible to Helm:

    # kube-versions: 1.29.0 1.34.0          the Kubernetes versions it renders and validates at
    # api-versions: monitoring.coreos.com/v1 the API groups present besides the built-in ones
    # expect-kinds: PodMonitor PrometheusRule   kinds the render must contain
    # expect-no-kinds: PodMonitor               kinds it must not
    # based-on: cpu-demo                       (bad sets) the good set the file patches
    # refused-at: inference.gpus                (bad sets) the path the refusal must name

A bad set is a patch over a good one, so each refusal is proven to come from the patch: the good set
renders, the same set with the patch is refused.

Renders are cached per (value set, Kubernetes version, API versions) for the session: every test
reads the same objects, and the chart is rendered once per combination.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import helm_python
import yaml
from helm_python import _native

from deploy.policy import pod_templates

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tether"
HERE = Path(__file__).parent
VALUES = HERE / "values"
GOLDEN = HERE / "golden"
CRDS = HERE / "crds"
# A release name without "tether" in it: the fullname helper must append it.
RELEASE = "rl"
NAMESPACE = "tether-ci"
FULLNAME = f"{RELEASE}-tether"
# The chart's floor (Chart.yaml kubeVersion) and a current release.
DEFAULT_KUBE_VERSIONS = ("1.29.0", "1.34.0")
# The one golden render that holds the dashboards in full (the others hold their digests).
FULL_DASHBOARDS = "monitoring-crds-present"
# libyaml's parser where PyYAML has it (ten times the pure-Python one on a 60 KB render).
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
META_LINE = re.compile(r"^#\s*([a-z][a-z-]*):\s*(.*?)\s*$")


@dataclass(frozen=True)
class ValueSet:
    name: str
    path: Path
    values: dict[str, Any]
    meta: dict[str, str]

    @property
    def kube_versions(self) -> tuple[str, ...]:
        return (
            tuple(self.meta["kube-versions"].split())
            if "kube-versions" in self.meta
            else DEFAULT_KUBE_VERSIONS
        )

    @property
    def api_versions(self) -> tuple[str, ...]:
        return tuple(self.meta.get("api-versions", "").split())

    def words(self, key: str) -> list[str]:
        return self.meta.get(key, "").split()


def _meta(text: str) -> dict[str, str]:
    """The `# key: value` lines of the file's leading comment block."""
    meta: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        m = META_LINE.match(line)
        if m:
            meta[m.group(1)] = (
                (meta[m.group(1)] + " " + m.group(2)).strip() if m.group(1) in meta else m.group(2)
            )
    return meta


def load_set(path: Path) -> ValueSet:
    text = path.read_text()
    return ValueSet(path.stem, path, yaml.safe_load(text) or {}, _meta(text))


def good_sets() -> list[ValueSet]:
    return [load_set(p) for p in sorted(VALUES.glob("*.yaml"))]


def bad_sets() -> list[ValueSet]:
    return [load_set(p) for p in sorted((VALUES / "bad").glob("*.yaml"))]


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`helm -f base -f patch`: mappings merge key by key, anything else is replaced."""
    out = dict(base)
    for k, v in patch.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def bad_values(vs: ValueSet) -> tuple[dict[str, Any], str]:
    """A bad set's full values (its base set patched) and the Kubernetes version it is tried at."""
    base = value_set(vs.meta["based-on"])
    version = vs.kube_versions[0] if "kube-versions" in vs.meta else base.kube_versions[0]
    return merge(base.values, vs.values), version


def value_set(name: str) -> ValueSet:
    path = VALUES / f"{name}.yaml"
    return load_set(path if path.exists() else VALUES / "bad" / f"{name}.yaml")


@dataclass
class Render:
    """One render: the manifests by template path, and the objects they hold."""

    manifests: dict[str, str]
    objects: list[dict[str, Any]] = field(default_factory=list)

    def of_kind(self, *kinds: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o.get("kind") in kinds]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.objects if o.get("kind") == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} in the render"
        return found[0]

    def pod_templates(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(`Kind/name` + where, template) for every pod template in the render."""
        for obj in self.objects:
            for where, template in pod_templates(obj):
                yield f"{obj['kind']}/{obj['metadata']['name']}{' ' + where if where else ''}", template

    def text(self) -> str:
        """The render as `helm template` prints it: each YAML manifest under its `# Source:` line, in
        template order (what checkov scans)."""
        parts = []
        for path in sorted(self.manifests):
            body = self.manifests[path].strip("\n")
            if body.strip() and path.endswith((".yaml", ".yml")):
                parts.append(f"---\n# Source: {path}\n{body}\n")
        return "".join(parts)

    def golden(self, *, full_dashboards: bool) -> str:
        """The golden file: text() with NOTES.txt appended as comments, and each Grafana dashboard
        ConfigMap (the same in every set, thousands of lines) cut to its digest unless full_dashboards."""
        out = self.text()
        if not full_dashboards:
            out = DASHBOARD.sub(_dashboard_digest, out)
        notes = next((v for k, v in self.manifests.items() if k.endswith("NOTES.txt")), "")
        if notes.strip():
            out += "---\n# Source: NOTES.txt (as comments)\n" + "".join(
                f"#{' ' if line else ''}{line}\n" for line in notes.strip("\n").splitlines()
            )
        return out


# One rendered document that is a ConfigMap labelled grafana_dashboard (up to the next document).
DASHBOARD = re.compile(
    r"(?ms)^(apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: (\S+)\n(?:(?!^---$).)*?grafana_dashboard(?:(?!^---$).)*?)(?=^---$|\Z)"
)


def _dashboard_digest(m: re.Match[str]) -> str:
    digest = hashlib.sha256(m.group(1).encode()).hexdigest()[:16]
    return f"# ConfigMap/{m.group(2)}: a Grafana dashboard, sha256 {digest} (in full: golden/{FULL_DASHBOARDS}.yaml)\n"


def _objects(manifests: dict[str, str]) -> list[dict[str, Any]]:
    objects = []
    for path in sorted(manifests):
        if not path.endswith((".yaml", ".yml")):
            continue
        for doc in yaml.load_all(manifests[path], Loader=LOADER):
            if doc:
                assert isinstance(doc, dict) and "kind" in doc, f"{path}: not a Kubernetes object: {doc!r}"
                objects.append(doc)
    return objects


@functools.cache
def _chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def render_values(
    values: dict[str, Any],
    kube_version: str = DEFAULT_KUBE_VERSIONS[0],
    api_versions: tuple[str, ...] = (),
    release: str = RELEASE,
) -> Render:
    """Renders as `helm install` would (schema first, then the templates), offline. Raises
    helm_python.HelmError (HelmValuesError, HelmRenderError) when the chart refuses the values."""
    manifests = _manifests(values, kube_version, api_versions, release)
    return Render(manifests, _objects(manifests))


def _manifests(
    values: dict[str, Any], kube_version: str, api_versions: tuple[str, ...], release: str = RELEASE
) -> dict[str, str]:
    """The render through the SDK's native call: `Chart.render` takes no Kubernetes or API versions."""
    opts = {
        "name": release,
        "namespace": NAMESPACE,
        "is_install": True,
        "kube_version": f"v{kube_version}",
        "api_versions": list(api_versions),
    }
    raw = _native.call_string("helm_render", _chart()._raw(), json.dumps(values), json.dumps(opts))
    manifests: dict[str, str] = json.loads(raw)
    return manifests


@functools.cache
def render(name: str, kube_version: str | None = None, api_versions: tuple[str, ...] | None = None) -> Render:
    """The named value set's render (cached); by default at its first Kubernetes version with its own
    API versions."""
    vs = value_set(name)
    return render_values(
        vs.values,
        kube_version or vs.kube_versions[0],
        vs.api_versions if api_versions is None else api_versions,
    )


def refusal(
    values: dict[str, Any], kube_version: str = DEFAULT_KUBE_VERSIONS[0], api_versions: tuple[str, ...] = ()
) -> str | None:
    """Why the chart refuses these values (schema or template), or None when it renders them."""
    try:
        _chart().validate_schema(values)
        _manifests(values, kube_version, api_versions)
    except helm_python.HelmError as e:
        return str(e)
    return None


@functools.cache
def lint(name: str, kube_version: str) -> dict[str, Any]:
    """`helm lint --strict` of the chart with the named value set."""
    report: dict[str, Any] = helm_python.lint(
        CHART, value_set(name).values, strict=True, namespace=NAMESPACE, kube_version=f"v{kube_version}"
    )
    return report


def chart_metadata() -> dict[str, Any]:
    return _chart().metadata


def default_values() -> dict[str, Any]:
    return _chart().values


@functools.cache
def _merged(name: str) -> str:
    return json.dumps(_chart().merge_values(value_set(name).values))


def effective_values(name: str) -> dict[str, Any]:
    """The values a release of the named set runs with (the chart's defaults coalesced with the set)."""
    merged: dict[str, Any] = json.loads(_merged(name))
    return merged


def schema() -> dict[str, Any] | None:
    return _chart().schema


def validate_schema(values: dict[str, Any]) -> None:
    """values.schema.json over the values (raises helm_python.HelmValuesError naming the key)."""
    _chart().validate_schema(values)
