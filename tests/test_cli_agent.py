"""`tether agent FN`: the harness spec reaches the worker, and the worker runs the example shipped in the
package. (The positional once shared its name with the attribute the subcommand's handler is dispatched
through, so `tether agent` died with "'str' object is not callable".)"""

from __future__ import annotations

import signal
import subprocess

import redis
from stack_helpers import TETHER, wait_for

from tether.cli import build_parser, cmd_agent

EXAMPLE = "tether.examples.calculator.agent:rollout"


def test_agent_keeps_its_handler_and_its_harness():
    args = build_parser().parse_args(["agent", EXAMPLE, "--concurrency", "2"])
    assert args.fn is cmd_agent
    assert args.harness == EXAMPLE
    assert args.concurrency == 2


def test_agent_worker_starts_on_the_shipped_example(redis_url, tmp_path):
    """From a directory outside the repository: the worker loads the example, joins the dispatch
    stream's consumer group and stops cleanly on SIGTERM."""
    r = redis.Redis.from_url(redis_url, decode_responses=True)
    proc = subprocess.Popen(
        [*TETHER, "agent", EXAMPLE, "--redis-url", redis_url, "--gateway", "http://127.0.0.1:9"]
        + ["--namespace", "cli-agent", "--concurrency", "2"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )

    def joined() -> list[str]:
        if proc.poll() is not None:
            raise AssertionError(f"the worker exited with {proc.returncode}: {proc.stdout.read().decode()}")
        try:
            return [g["name"] for g in r.xinfo_groups("cli-agent:dispatch")]
        except redis.ResponseError:  # no stream yet
            return []

    try:
        assert wait_for(joined, 60, "the worker's consumer group on the dispatch stream") == ["agents"]
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        r.close()
    assert proc.returncode == 0, out.decode()
