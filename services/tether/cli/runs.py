"""`tether run create|list|status|stop`: the runs of a deployment (docs/runs.md), through the gateway's
admin routes (`/v1/runs...`), each answer printed as one JSON line, as the inspection commands print
records.

The gateway is --gateway-url, else TETHER_GATEWAY_URL, else the local stack's (`.tether/stack.json`);
the admin token is TETHER_ADMIN_TOKEN, the variable the stack's gateway reads its own from (never a
flag: a command line is visible to every user of the machine). `create` checks the run config against
every service's settings first (as `tether config check`), and sends it only when it passes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tether.cli.args import Subparsers


class GatewayRefused(Exception):
    """The gateway answered an error: its message, as it said it."""


def gateway_url(given: str | None) -> str:
    """--gateway-url, else TETHER_GATEWAY_URL, else the local stack's gateway."""
    url = given or os.environ.get("TETHER_GATEWAY_URL")
    if url:
        return url.rstrip("/")
    from tether.cli.stack import stack_state

    url = stack_state().get("addresses", {}).get("gateway_url")
    if not url:
        raise SystemExit("the stack here names no gateway (.tether/stack.json): pass --gateway-url")
    return str(url).rstrip("/")


def _request(url: str, method: str, path: str, body: Any = None) -> Any:
    import httpx

    token = os.environ.get("TETHER_ADMIN_TOKEN")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    content = None
    if body is not None:
        headers["content-type"] = "application/json"
        content = json.dumps(body, default=str).encode()  # YAML's dates become their text
    try:
        with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
            resp = client.request(method, path, content=content, headers=headers)
    except httpx.HTTPError as exc:
        raise GatewayRefused(f"the gateway at {url} did not answer: {exc}") from None
    try:
        data = resp.json()
    except ValueError:
        data = None
    if resp.status_code >= 400:
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else resp.text[:200]
        raise GatewayRefused(f"{resp.status_code}: {message}")
    return data


def default_run_id(config_path: str) -> str | None:
    """The run id a config file's name gives (`recipes/calculator_lora.yaml` -> calculator-lora), None
    when it gives no valid one."""
    from tether.common.runs import valid_run_id

    slug = re.sub(r"[^a-z0-9-]+", "-", Path(config_path).stem.lower()).strip("-")
    return slug if valid_run_id(slug) else None


def cmd_run_create(args: argparse.Namespace) -> Any:
    from tether.common.settings import read_run_config
    from tether.runconfig import check

    problems = check(args.config)
    if problems:
        raise GatewayRefused("the run config is refused:\n" + "\n".join(problems))
    run_id = args.id or default_run_id(args.config)
    if run_id is None:
        raise GatewayRefused(f"{args.config}: its name makes no run id: pass --id")
    body: dict[str, Any] = {"run_id": run_id, "config": read_run_config(args.config)}
    if args.adapter:
        body["adapter"] = args.adapter
    return _request(gateway_url(args.gateway_url), "POST", "/v1/runs", body)


def cmd_run_list(args: argparse.Namespace) -> Any:
    return _request(gateway_url(args.gateway_url), "GET", "/v1/runs")["runs"]


def cmd_run_status(args: argparse.Namespace) -> Any:
    return _request(gateway_url(args.gateway_url), "GET", f"/v1/runs/{quote(args.run_id, safe='')}")


def cmd_run_stop(args: argparse.Namespace) -> Any:
    return _request(gateway_url(args.gateway_url), "POST", f"/v1/runs/{quote(args.run_id, safe='')}/stop")


def _printing(fn: Any) -> Any:
    """The command's answer as JSON lines (a list: one line each); exit 1 with the gateway's own words
    when it refuses."""

    def run(args: argparse.Namespace) -> int:
        try:
            out = fn(args)
        except GatewayRefused as exc:
            print(f"tether run {args.run_command}: {exc}", file=sys.stderr)
            return 1
        for record in out if isinstance(out, list) else [out]:
            sys.stdout.write(json.dumps(record) + "\n")
        return 0

    return run


def add_runs(sub: Subparsers) -> None:
    run = sub.add_parser("run", help="the runs of a deployment: create, list, status, stop (docs/runs.md)")
    run_sub = run.add_subparsers(dest="run_command", required=True)

    def command(name: str, fn: Any, help: str) -> argparse.ArgumentParser:
        p = run_sub.add_parser(name, help=help)
        p.add_argument(
            "--gateway-url",
            help="the gateway (default: TETHER_GATEWAY_URL, else the stack's in .tether/stack.json)",
        )
        p.set_defaults(fn=_printing(fn))
        return p

    create = command(
        "create", cmd_run_create, "register a run: prints its record and its API key (shown this once)"
    )
    create.add_argument("--config", required=True, metavar="FILE", help="the run config (docs/recipes.md)")
    create.add_argument("--id", help="the run id, a slug (default: from the config file's name)")
    create.add_argument("--adapter", help="the model name the run's agents call (default: the run id)")
    command("list", cmd_run_list, "every run, oldest first, one JSON line each")
    for name, fn, help in (
        ("status", cmd_run_status, "one run's record"),
        ("stop", cmd_run_stop, "stop a run (created -> stopped; running -> stopping)"),
    ):
        command(name, fn, help).add_argument("run_id", metavar="ID")
