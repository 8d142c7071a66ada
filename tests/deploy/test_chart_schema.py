"""values.schema.json against values.yaml: strict at every level Tether owns, no drift between the two
(production-stack's schema admits unknown keys and drifted from its values), and an unknown key at any
Tether-owned level refused with its path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python
import pytest

from deploy import chart

# Schema keys values.yaml need not spell out.
UNLISTED = {"global"}
# Levels whose keys are all optional by design: runConfig's sections (a run config names only those it sets).
OPTIONAL_KEYS = {("runConfig",)}


def _owned(
    schema: dict[str, Any], path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], dict[str, Any]]]:
    """Every Tether-owned object schema (inline, with properties), by its values path. Kubernetes
    pass-through objects are `$ref`s into the vendored definitions and are not Tether's."""
    if schema.get("type") == "object" and "properties" in schema and "$ref" not in schema:
        yield path, schema
        for key, sub in schema["properties"].items():
            yield from _owned(sub, (*path, key))


OWNED = list(_owned(chart.schema() or {}))


def test_the_schema_has_tether_levels():
    assert len(OWNED) > 30, [".".join(p) for p, _ in OWNED]


def test_every_tether_level_refuses_unknown_keys():
    loose = [".".join(p) or "(root)" for p, s in OWNED if s.get("additionalProperties") is not False]
    assert loose == []


def _at(values: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        values = values[key]
    return values


def test_values_yaml_and_the_schema_name_the_same_keys():
    """Each Tether level of values.yaml lists exactly the keys its schema knows: a key the schema does
    not know fails every install; an option the schema has but values.yaml omits is undocumented."""
    defaults = chart.default_values()
    problems = []
    for path, schema in OWNED:
        try:
            node = _at(defaults, path)
        except (KeyError, TypeError):
            if not set(path) & UNLISTED:
                problems.append(f"{'.'.join(path)}: in the schema, not in values.yaml")
            continue
        if not isinstance(node, dict):
            problems.append(f"{'.'.join(path)}: values.yaml has {type(node).__name__}")
            continue
        declared, present = set(schema["properties"]) - UNLISTED, set(node)
        if declared - present and path not in OPTIONAL_KEYS:
            problems.append(f"{'.'.join(path) or '(root)'}: not in values.yaml: {sorted(declared - present)}")
        if present - declared:
            problems.append(f"{'.'.join(path) or '(root)'}: not in the schema: {sorted(present - declared)}")
    assert problems == []


def _with(values: dict[str, Any], path: tuple[str, ...], leaf: dict[str, Any]) -> dict[str, Any]:
    patch: dict[str, Any] = leaf
    for key in reversed(path):
        patch = {key: patch}
    return chart.merge(values, patch)


@pytest.mark.parametrize(
    "path", [p for p, _ in OWNED if not set(p) & UNLISTED], ids=lambda p: ".".join(p) or "root"
)
def test_an_unknown_key_is_refused_at_every_level(path):
    """A typo anywhere a Tether key lives (`tether.bogusKey` under each level) is refused, and the
    message points at that level."""
    base = chart.value_set("cpu-demo").values
    values = _with(base, path, {"bogusKey": 1})
    with pytest.raises(helm_python.HelmValuesError) as refused:
        chart.validate_schema(values)
    message = str(refused.value)
    assert "bogusKey" in message
    assert f"'/{'/'.join(path)}'" in message or not path, message
