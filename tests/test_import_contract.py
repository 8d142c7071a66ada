"""The import contract the per-service images rely on (pyproject.toml: one extra per service).

- Each service room imports only the shared hallway (`tether.common`, `tether.algorithms`,
  `tether.v1`) and its own room; the shared packages import no room. Static, over the AST of every
  module, lazy imports inside functions included. (tether.cli, launcher.py, tether.demo and
  tether.examples sit above the services and may import any of them.)
- The torch-free services (gateway, merger, scheduler, inference adapter, agent worker) never import
  torch, transformers or matplotlib: statically (no such import anywhere in their rooms or in the
  shared modules), and at run time (a fresh interpreter that imports every module of the room and
  runs `python -m tether.<svc> --help` has none of them in sys.modules, although this venv has them).
- `python -m tether.<svc> --help` exits 0 for every service and lists its settings without any
  environment variable set.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SERVICES = Path(__file__).resolve().parent.parent / "services"
PACKAGE = SERVICES / "tether"
SHARED = ("common", "algorithms", "v1")
ROOMS = ("gateway", "merger", "trainer", "scheduler", "inference", "agents")
TORCH_FREE = ("gateway", "merger", "scheduler", "inference", "agents")
HEAVY = ("torch", "transformers", "matplotlib")
# The one heavy import a torch-free room may hold, only on the path that needs it: the merger renders
# TETHER_MODEL_DIR's chat template with transformers (the optional `chat-template` extra) when no
# TETHER_STRIP_TAIL is given; never imported otherwise (the run-time check below starts without it).
OPTIONAL_HEAVY = {("merger/main.py", "transformers")}


def modules(package: str) -> list[Path]:
    return sorted((PACKAGE / package).rglob("*.py"))


def imported(path: Path, text: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the module at `path` (its text, or `text`),
    relative ones resolved; ``from . import x`` counts as importing the submodule ``x``."""
    package = list(path.relative_to(SERVICES).parts[:-1])  # the same for __init__.py and a module
    out = []
    for node in ast.walk(ast.parse(path.read_text() if text is None else text, str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            if node.module:
                out.append((node.lineno, ".".join([*base, node.module])))
            else:
                out += [(node.lineno, ".".join([*base, a.name])) for a in node.names]
    return sorted(out)


def room_of(module: str) -> str | None:
    """'tether.gateway.proxy' -> 'gateway'; None for a module outside the tether package."""
    parts = module.split(".")
    if parts[0] != "tether":
        return None
    return parts[1] if len(parts) > 1 else ""


def test_the_static_walk_sees_every_kind_of_import() -> None:
    """The checker itself: absolute, from-, relative and function-local imports are all found."""
    src = "import torch.nn\nfrom tether.trainer import x\nfrom ..merger.merge import y\nfrom . import app\n"
    src += "def f():\n    import matplotlib.pyplot\n"
    names = [m for _, m in imported(PACKAGE / "gateway" / "proxy.py", src)]
    assert names == [
        "torch.nn",
        "tether.trainer",
        "tether.merger.merge",
        "tether.gateway.app",
        "matplotlib.pyplot",
    ]
    assert room_of("tether.merger.merge") == "merger" and room_of("torch.nn") is None


@pytest.mark.parametrize("room", ROOMS)
def test_a_service_imports_only_the_shared_packages_and_its_own_room(room: str) -> None:
    allowed = {*SHARED, room}
    bad = [
        f"{path.relative_to(PACKAGE)}:{line}: {mod}"
        for path in modules(room)
        for line, mod in imported(path)
        if room_of(mod) is not None and room_of(mod) not in allowed
    ]
    assert not bad, f"tether.{room} may import only tether.{{{', '.join(sorted(allowed))}}}:\n" + "\n".join(
        bad
    )


@pytest.mark.parametrize("package", SHARED)
def test_the_shared_packages_import_no_service_room(package: str) -> None:
    bad = [
        f"{path.relative_to(PACKAGE)}:{line}: {mod}"
        for path in modules(package)
        for line, mod in imported(path)
        if room_of(mod) is not None and room_of(mod) not in SHARED
    ]
    assert not bad, "\n".join(bad)


def module_graph() -> dict[str, set[str]]:
    """Each module of the tether package (the generated tether.v1 aside) -> the tether modules it
    imports, statically, lazy and TYPE_CHECKING imports included; `from tether.common import retry`
    counts as importing the submodule tether.common.retry."""
    paths = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(SERVICES).with_suffix("").parts)
        if parts[1:2] != ["v1"]:
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, node.module] if node.module else base)
                found |= {
                    f"{module}.{a.name}" if f"{module}.{a.name}" in paths else module for a in node.names
                }
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another, directly or around a loop (the strongly
    connected components of more than one module, Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                cycles.append(sorted([v, *group]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_the_cycle_check_finds_loops_and_only_loops() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"], ["d", "e"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []
    # The walk resolves `from tether.common import x` to the submodule and sees lazy imports.
    assert "tether.common.retry" in module_graph()["tether.common.grpc_server"]


def test_no_module_imports_itself_back() -> None:
    """Imports only run downward: no two modules of the package import each other, directly or
    around a loop, lazily or not (tether.common.broker and tether.common.settings did until both
    built on tether.common.keys)."""
    assert import_cycles(module_graph()) == []


@pytest.mark.parametrize("package", [*TORCH_FREE, "common", "v1"])
def test_no_heavy_import_in_the_torch_free_rooms_and_the_hallway(package: str) -> None:
    bad = []
    for path in modules(package):
        for line, mod in imported(path):
            top = mod.split(".")[0]
            if top in HEAVY and (str(path.relative_to(PACKAGE)), top) not in OPTIONAL_HEAVY:
                bad.append(f"{path.relative_to(PACKAGE)}:{line}: {mod}")
    assert not bad, "torch-free code imports a heavy package:\n" + "\n".join(bad)


def test_the_advantages_the_merger_uses_are_torch_free() -> None:
    # algorithms/ holds the trainer's torch losses too; what the merger imports must not need torch.
    mods = {m.split(".")[0] for _, m in imported(PACKAGE / "algorithms" / "advantages.py")}
    mods |= {m.split(".")[0] for _, m in imported(PACKAGE / "algorithms" / "__init__.py")}
    assert not mods & set(HEAVY), mods


# A fresh interpreter: import every module of the room, then run `python -m tether.<svc> --help` in
# the same process; report the exit code, what it printed and which heavy packages got imported.
PROBE = r"""
import contextlib, io, json, pkgutil, runpy, sys, importlib
svc, heavy = sys.argv[1], sys.argv[2].split(",")
pkg = importlib.import_module(f"tether.{svc}")
for m in pkgutil.walk_packages(pkg.__path__, f"tether.{svc}."):
    if not m.name.endswith(".__main__"):
        importlib.import_module(m.name)
sys.argv = [f"tether.{svc}", "--help"]
out = io.StringIO()
code = None
with contextlib.redirect_stdout(out):
    try:
        runpy.run_module(f"tether.{svc}", run_name="__main__")
    except SystemExit as exc:
        code = exc.code
from pydantic_settings import BaseSettings
main = sys.modules[f"tether.{svc}.main"]
settings = [c for c in vars(main).values() if isinstance(c, type) and issubclass(c, BaseSettings)
            and c.__module__ == main.__name__]
prefix = settings[0].model_config.get("env_prefix", "") if len(settings) == 1 else ""
names = [(prefix + n).upper() for n in settings[0].model_fields] if len(settings) == 1 else []
print(json.dumps({"code": code, "help": out.getvalue(), "settings": names,
                  "heavy": sorted({m.split(".")[0] for m in sys.modules} & set(heavy))}))
"""


@functools.cache
def probe(svc: str) -> dict:
    # No TETHER_* variable at all: --help must not need any.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(SERVICES), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, svc, ",".join(HEAVY)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("svc", TORCH_FREE)
def test_a_torch_free_service_loads_no_torch_in_a_fresh_interpreter(svc: str) -> None:
    assert all(importlib_finds(m) for m in HEAVY), "this venv lacks a heavy package: the check proves nothing"
    got = probe(svc)
    assert got["heavy"] == [], f"tether.{svc} imported {got['heavy']}"
    assert got["code"] in (0, None)


@pytest.mark.parametrize("svc", ROOMS)
def test_help_lists_every_setting_without_any_environment(svc: str) -> None:
    got = probe(svc)
    assert got["code"] == 0, got
    text = got["help"]
    assert text.startswith(f"usage: python -m tether.{svc}"), text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.startswith("  TETHER_")}
    # One row per field of the service's settings class, each with a type and a default (or "(required)").
    assert got["settings"] and sorted(rows) == sorted(got["settings"]), text
    assert all(len(r) >= 2 for r in rows.values()), text
    assert rows["TETHER_LOG_LEVEL"][-1] == "INFO", text


def importlib_finds(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_the_merger_says_what_to_install_for_a_strip_tail_from_model_dir(monkeypatch, tmp_path) -> None:
    """Without transformers (the [merger] extra alone) a model_dir strip tail fails at start, naming the
    extra and the alternative; an explicit strip tail needs nothing."""
    from tether.merger.main import MergerSettings, strip_tail_for

    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when absent
    base = {"redis_url": "redis://127.0.0.1:1/0", "merger_grpc_port": 1, "trainer_address": "127.0.0.1:2"}
    with pytest.raises(SystemExit, match=r"tether-rl\[merger,chat-template\].*TETHER_STRIP_TAIL"):
        strip_tail_for(MergerSettings(**base, model_dir=str(tmp_path)))
    assert strip_tail_for(MergerSettings(**base, model_dir=str(tmp_path), strip_tail=[7])) == (7,)
    assert strip_tail_for(MergerSettings(**base)) == ()
