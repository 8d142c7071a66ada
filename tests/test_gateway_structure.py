"""The gateway's structure (issue 26): no function over 100 lines and no class over 350 anywhere in
`tether.gateway`, and one thin router module per API family that `create_app` only assembles. Static,
over the AST of every module."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from fastapi import APIRouter

from tether.gateway.app import ROUTERS

GATEWAY = Path(__file__).resolve().parent.parent / "services" / "tether" / "gateway"
MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 350
# Files excused from the limits: none since the typed bodies (gateway/bodies.py) replaced the hand-written
# JSON Schema, whose builders were over them.
PENDING: set[str] = set()


def oversized(source: str, name: str) -> list[str]:
    """'name:line kind qualname (N lines)' for every function over MAX_FUNCTION_LINES and class over
    MAX_CLASS_LINES, nested ones included (a method counts on its own as well as in its class)."""
    out = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                assert child.end_lineno is not None
                lines = child.end_lineno - child.lineno + 1
                is_class = isinstance(child, ast.ClassDef)
                limit = MAX_CLASS_LINES if is_class else MAX_FUNCTION_LINES
                if lines > limit:
                    kind = "class" if is_class else "function"
                    out.append(f"{name}:{child.lineno} {kind} {prefix}{child.name} ({lines} lines)")
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(ast.parse(source), "")
    return out


def test_the_size_check_finds_long_functions_and_classes_nested_or_not() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    src = f"def ok():\n{body}\n"  # the def line and 99 more: exactly at the limit
    src += f"def long():\n{body}    y = 0\n"
    src += f"class C:\n    def inner(self):\n    {body.replace(chr(10), chr(10) + '    ')}    return 1\n"
    assert oversized(src, "m.py") == [
        f"m.py:{MAX_FUNCTION_LINES + 2} function long ({MAX_FUNCTION_LINES + 1} lines)",
        f"m.py:{2 * MAX_FUNCTION_LINES + 4} function C.inner ({MAX_FUNCTION_LINES + 1} lines)",
    ]
    methods = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(MAX_CLASS_LINES // 2))
    assert oversized(f"class Big:\n{methods}", "b.py") == [f"b.py:1 class Big ({MAX_CLASS_LINES + 1} lines)"]


def test_no_function_over_100_lines_nor_class_over_350_in_the_gateway() -> None:
    paths = sorted(GATEWAY.rglob("*.py"))
    assert GATEWAY / "routers" / "calls.py" in paths
    bad = [
        line
        for path in paths
        if path.relative_to(GATEWAY).as_posix() not in PENDING
        for line in oversized(path.read_text(), path.relative_to(GATEWAY).as_posix())
    ]
    assert not bad, "\n".join(bad)


FAMILIES = ("chat", "messages", "responses", "gemini", "rollouts", "sessions", "ops")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_has_a_router_module_that_create_app_includes(family: str) -> None:
    module = importlib.import_module(f"tether.gateway.routers.{family}")
    assert isinstance(module.router, APIRouter) and module.router.routes
    assert module.router in ROUTERS


def test_create_app_only_assembles() -> None:
    """No route is declared in app.py: every one lives in a router module."""
    tree = ast.parse((GATEWAY / "app.py").read_text())
    decorated = [
        f"{n.name}:{n.lineno}"
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.decorator_list
    ]
    assert decorated == []
