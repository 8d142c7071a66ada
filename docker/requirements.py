"""Print the requirements of tether-rl's core plus the given extras, read from pyproject.toml, one a
line (extras that name tether-rl[...] are expanded). The images install these before copying the
source, so that a change of the code rebuilds only the last layers.

Usage: python3 docker/requirements.py pyproject.toml gateway,merger > requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib

SELF = re.compile(r"^tether-rl\[([^\]]*)\]\s*$")


def requirements(project: dict, extras: list[str]) -> list[str]:
    """Core dependencies and those of `extras`, in order, without duplicates; an unknown extra raises."""
    optional = project.get("optional-dependencies", {})
    out: list[str] = []
    seen: set[str] = set()

    def add(reqs: list[str]) -> None:
        for req in reqs:
            m = SELF.match(req)
            if m:
                expand([e.strip() for e in m.group(1).split(",") if e.strip()])
            elif req not in out:
                out.append(req)

    def expand(names: list[str]) -> None:
        for name in names:
            if name in seen:
                continue
            if name not in optional:
                raise SystemExit(f"requirements.py: no extra {name!r} in pyproject.toml")
            seen.add(name)
            add(optional[name])

    add(project.get("dependencies", []))
    expand(extras)
    return out


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    with open(sys.argv[1], "rb") as f:
        project = tomllib.load(f)["project"]
    extras = [e.strip() for e in sys.argv[2].split(",") if e.strip()]
    print("\n".join(requirements(project, extras)))


if __name__ == "__main__":
    main()
