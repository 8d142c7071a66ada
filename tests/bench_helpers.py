"""The benchmarks under bench/ are scripts without a .py suffix; their pure figures are tested by
loading the script as a module."""

from __future__ import annotations

import importlib.machinery
import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench(name: str) -> ModuleType:
    """bench/<name> as a module (its `main` is not run)."""
    loader = importlib.machinery.SourceFileLoader(f"bench_{name}", str(BENCH / name))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
