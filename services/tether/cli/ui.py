"""`tether ui`: a web view of the run started here (`.tether/stack.json`), or of a run directory when
the stack is down (`--run-dir`): its curves and steps, a step's groups and rollouts, a rollout's calls
and samples token by token (tether.cli.web, imported when the command runs). docs/ui.md."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from contextlib import ExitStack
from pathlib import Path

from tether.cli.args import Subparsers


def _sources(
    args: argparse.Namespace, stack: ExitStack
) -> tuple[Path | None, str | None, str, str | None, str]:
    """(run dir, Redis URL or None, namespace, model dir, what the runs page says it read)."""
    from tether.cli.inspection import stack_redis
    from tether.cli.stack import stack_state

    if args.run_dir:
        given = Path(args.run_dir).resolve()
        data = given / "redis"
        url = None
        if args.redis_url or data.is_dir():
            url = stack.enter_context(stack_redis(args.redis_url, {"redis_data": str(data)}))
        namespace = args.namespace or f"tether-{given.name}"
        return given, url, namespace, args.model, f"run directory {given}"
    # A Redis named here (compose's and the chart's ui: TETHER_REDIS_URL, as every service reads it)
    # needs no stack.json; the view then reads the metrics stream.
    state = {} if args.redis_url else stack_state()
    run_dir = Path(state["run_dir"]) if state.get("run_dir") else None
    url = stack.enter_context(stack_redis(args.redis_url, state))
    namespace = args.namespace or state.get("namespace", "tether")
    return run_dir, url, namespace, args.model or state.get("model_dir"), f"stack run {run_dir} ({namespace})"


def open_refusal(host: str, token: str | None) -> str | None:
    """Why `tether ui` will not serve on `host` without an admin token, as the gateway will not: every
    recorded call and sample would be readable beyond this machine. None where it may."""
    from tether.common.net import is_loopback

    if token or is_loopback(host) or os.environ.get("TETHER_ALLOW_OPEN_ADMIN", "").lower() in ("1", "true"):
        return None
    return (
        f"--host {host} listens beyond loopback without an admin token: set TETHER_ADMIN_TOKEN (or "
        "TETHER_ALLOW_OPEN_ADMIN=true to serve an open view on purpose)"
    )


def cmd_ui(args: argparse.Namespace) -> int:
    token = os.environ.get("TETHER_ADMIN_TOKEN") or None
    refusal = open_refusal(args.host, token)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 2
    import uvicorn

    from tether.cli.web.app import build_app
    from tether.cli.web.store import UiStore, tokenizer_decode

    # uvicorn shuts down on SIGTERM, then raises it again: with the default action the process would die
    # there, before the ExitStack stops the embedded Redis a stopped run's data was opened with (it runs
    # in a session of its own and would outlive the view). As SystemExit it unwinds the stack.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        with ExitStack() as stack:
            run_dir, url, namespace, model_dir, source = _sources(args, stack)
            store = UiStore(run_dir, url, namespace, tokenizer_decode(model_dir))
            app = build_app(store, source, token)
            print(f"tether ui: http://{args.host}:{args.port}/", flush=True)
            uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(0)


def add_ui(sub: Subparsers) -> None:
    ui = sub.add_parser("ui", help="serve a web view of the run: curves, steps, rollouts token by token")
    ui.add_argument(
        "--run-dir",
        help="a run directory to show when the stack is down (its metrics.jsonl; its Redis data when kept)",
    )
    ui.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ui.add_argument("--port", type=int, default=8900, help="default 8900")
    # Defaults from the environment every service reads (compose's x-redis-env, the chart's redisEnv):
    # the URL holds the Redis password, which a command line would show to `ps` and `docker inspect`.
    ui.add_argument(
        "--redis-url",
        default=os.environ.get("TETHER_REDIS_URL") or None,
        help="the run's Redis (default: $TETHER_REDIS_URL, else the stack's)",
    )
    ui.add_argument(
        "--namespace",
        default=os.environ.get("TETHER_NAMESPACE") or None,
        help="its key prefix (default: $TETHER_NAMESPACE, else the stack's)",
    )
    ui.add_argument(
        "--model",
        default=os.environ.get("TETHER_MODEL_DIR") or None,
        help="tokenizer directory for token texts (default: $TETHER_MODEL_DIR, else the stack's model)",
    )
    ui.set_defaults(fn=cmd_ui)
