"""`python -m tether.<service> --help`: the service's settings (environment variables, types,
defaults), printed without reading the environment, so it works where nothing is configured yet (a
fresh image, a new machine). Every service's `main()` calls `exit_if_help` before building its
settings; a service takes no other command-line argument (anything else is refused, exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import AliasChoices, AliasPath
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings


def exit_if_help(
    settings: type[BaseSettings], doc: str | None = None, argv: Sequence[str] | None = None
) -> None:
    """Print the usage and the settings table and exit 0 on -h/--help; exit 2 on any other argument;
    return (having read nothing) when there are none. `doc`: the service's module docstring."""
    module = settings.__module__.removesuffix(".main")
    parser = argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=(doc or "").strip() or None,
        epilog=settings_table(settings),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_args(sys.argv[1:] if argv is None else list(argv))


def settings_table(settings: type[BaseSettings]) -> str:
    """One line per field: the environment variable, its type (with constraints), its default."""
    prefix = settings.model_config.get("env_prefix", "") or ""
    rows = [
        (env_name(prefix, name, field), type_text(field), default_text(field))
        for name, field in settings.model_fields.items()
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"  {a.ljust(w0)}  {b.ljust(w1)}  {c}".rstrip() for a, b, c in rows]
    return (
        f"settings ({settings.__name__}: environment variables, read when the service starts; "
        "required ones say so):\n" + "\n".join(lines)
    )


def env_name(prefix: str, name: str, field: FieldInfo) -> str:
    alias = field.validation_alias or field.alias
    if isinstance(alias, str):
        return alias.upper()
    if isinstance(alias, AliasChoices):
        return " | ".join(c.upper() for c in alias.choices if isinstance(c, str)) or (prefix + name).upper()
    if isinstance(alias, AliasPath):
        return (prefix + name).upper()
    return (prefix + name).upper()


def type_text(field: FieldInfo) -> str:
    text = _type(field.annotation)
    limits = [_constraint(m) for m in field.metadata]
    limits = [x for x in limits if x]
    return f"{text} ({', '.join(limits)})" if limits else text


def default_text(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "(required)"
    value = field.default if field.default_factory is None else field.default_factory()  # type: ignore[call-arg]
    if value is None:
        return "(unset)"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list | tuple | dict):
        return json.dumps(value)
    return str(value)


def _type(t: Any) -> str:
    origin = typing.get_origin(t)
    args = typing.get_args(t)
    if origin is typing.Literal:
        return "|".join(str(a) if a != "" else '""' for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(a) for a in args)
    if origin is typing.Annotated:
        return _type(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type(a) for a in args)}]" if args else name
    if t is type(None):
        return "None"
    if isinstance(t, type) and issubclass(t, enum.Enum):
        return "|".join(str(m.value) for m in t)
    return getattr(t, "__name__", str(t).replace("typing.", ""))


def _constraint(meta: Any) -> str:
    if dataclasses.is_dataclass(meta) and not isinstance(meta, type):
        items = dataclasses.asdict(meta).items()
    else:
        items = getattr(meta, "__dict__", {}).items()
    return ", ".join(f"{k}={v}" for k, v in items if v is not None)
