"""Writes the openAPIV3Schema of each version of a CRD as JSON data (README.md says from which files).

Only the schema travels: descriptions are dropped (prose, not validation) and nothing else of the CRD
is kept. Usage: python tests/deploy/crds/extract.py CRD.yaml [...]   (writes <group>_<plural>_<version>.json
next to this file).
"""

import json
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent


def without_descriptions(node: Any) -> Any:
    """The schema minus its prose: a `description` whose value is a string (a property named
    `description` is a mapping and stays)."""
    if isinstance(node, dict):
        return {
            k: without_descriptions(v)
            for k, v in node.items()
            if not (k == "description" and isinstance(v, str))
        }
    if isinstance(node, list):
        return [without_descriptions(v) for v in node]
    return node


def main(paths: list[str]) -> None:
    for path in paths:
        for crd in yaml.safe_load_all(Path(path).read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                schema = without_descriptions(version["schema"]["openAPIV3Schema"])
                out = HERE / f"{spec['group']}_{spec['names']['plural']}_{version['name']}.json"
                out.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
                print(out)


if __name__ == "__main__":
    main(sys.argv[1:])
