"""What a run recorded, read from its Redis (or, once the stack stopped, from its append-only file):
`tether traces`, `samples`, `metrics`, `dead-letters`, each as JSON lines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from tether.common.keys import Keys

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tether.cli.args import Subparsers
from tether.cli.stack import stack_state


async def trace_keys(r: Any, namespace: str, given: int | None) -> Keys:
    """The run's keys with its trace partitions: --trace-partitions, else the count the run's services
    recorded in Redis, else TETHER_TRACE_PARTITIONS (or its default)."""
    from tether.common.broker import DEFAULT_TRACE_PARTITIONS, Keys, recorded_trace_partitions

    partitions = given or await recorded_trace_partitions(r, Keys(namespace))
    return Keys(
        namespace, partitions or int(os.environ.get("TETHER_TRACE_PARTITIONS") or DEFAULT_TRACE_PARTITIONS)
    )


async def stream_records(
    stream_attr: str, redis_url: str, namespace: str, keep: Callable[[dict], bool] = lambda rec: True
) -> list[dict]:
    """The records of one stream (a Keys attribute: "samples", "metrics", "group_results") that `keep`
    keeps, oldest first, as the JSON objects they were written as (what `tether samples` and `tether
    metrics` print, and `tether ui` shows)."""
    from tether.common import broker

    r = broker.connect(redis_url)
    try:
        rows = await broker.read_all(r, getattr(broker.Keys(namespace), stream_attr))
        return [record for _, record in rows if keep(record)]
    finally:
        await r.aclose()


async def _dump(stream_attr: str, redis_url: str, namespace: str, keys_filter: Callable[[dict], bool]) -> int:
    records = await stream_records(stream_attr, redis_url, namespace, keys_filter)
    for record in records:
        sys.stdout.write(json.dumps(record) + "\n")
    return len(records)


def _without_password(url: str | None) -> str | None:
    """`url` with its password masked: it goes to logs (a container's, for compose's and the chart's ui)."""
    from urllib.parse import urlsplit

    if not url or "@" not in url:
        return url
    parts = urlsplit(url)
    return parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]).geturl()


@contextmanager
def stack_redis(redis_url: str | None, state: dict) -> Iterator[str]:
    """The URL of the run's Redis: `redis_url`, else the stack's (`state`, stack.json's); when that is
    down (or neither is given), a temporary embedded Redis on its append-only file (the trace store
    outlives the run), stopped on leaving."""
    import redis

    from tether.common.broker import connect_sync
    from tether.common.net import free_port
    from tether.common.redis_server import start_embedded_redis

    url = redis_url or state.get("redis_url")
    up = False
    if url:
        try:
            up = bool(connect_sync(url).ping())
        except (redis.ConnectionError, redis.exceptions.RedisClusterException):
            pass
    if url and up:
        yield url
        return
    if not state.get("redis_data"):
        raise SystemExit(f"Redis at {_without_password(url)} is not reachable")
    proc = start_embedded_redis(Path(state["redis_data"]), free_port())
    try:
        argv = [str(a) for a in cast("list[str]", proc.args)]
        yield f"redis://127.0.0.1:{argv[argv.index('--port') + 1]}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def _with_redis(args: argparse.Namespace, fn: Callable[[str, str], int]) -> int:
    """Run fn(redis_url, namespace) against the stack's Redis (stack_redis)."""
    state = {} if args.redis_url else stack_state()
    namespace = args.namespace or state.get("namespace", "tether")
    with stack_redis(args.redis_url, state) as url:
        return fn(url, namespace)


async def trace_records(
    redis_url: str, namespace: str, partitions: int | None, rollout_id: str | None
) -> list[dict]:
    """Every partition of the trace stream, oldest first; with `rollout_id`, that rollout's calls alone
    (what `tether traces` prints and `tether ui` shows)."""
    from tether.common import broker

    r = broker.connect(redis_url)
    try:
        keys = await trace_keys(r, namespace, partitions)
        if rollout_id:
            rows = await broker.read_all(r, keys.traces(rollout_id))
        else:
            rows = await broker.read_traces(r, keys)
        return [
            record
            for _, record in rows
            if not rollout_id or (isinstance(record, dict) and record.get("rollout_id") == rollout_id)
        ]
    finally:
        await r.aclose()


async def dump_traces(redis_url: str, namespace: str, partitions: int | None, rollout_id: str | None) -> int:
    """Every partition of the trace stream, oldest first; with `rollout_id`, its partition alone."""
    records = await trace_records(redis_url, namespace, partitions, rollout_id)
    for record in records:
        sys.stdout.write(json.dumps(record) + "\n")
    return len(records)


def cmd_traces(args: argparse.Namespace) -> int:
    given = getattr(args, "trace_partitions", None)
    _with_redis(args, lambda url, ns: asyncio.run(dump_traces(url, ns, given, args.rollout)))
    return 0


async def mismatch_records(redis_url: str, namespace: str) -> list[dict]:
    """The merger's prefix-mismatch examples (the calls that forked a sequence), oldest first: what
    `tether samples --mismatches` prints and `tether ui` shows with their rollouts."""
    from tether.common import broker
    from tether.merger.consumer import mismatch_stream

    r = broker.connect(redis_url)
    try:
        return [rec for _, rec in await broker.read_all(r, mismatch_stream(broker.Keys(namespace)))]
    finally:
        await r.aclose()


async def _dump_mismatches(redis_url: str, namespace: str, model_dir: str | None) -> int:
    from tether.merger.merge import format_mismatch

    decode = None
    if model_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)

        def decode(ids: list[int]) -> str:
            return str(tokenizer.decode(ids, skip_special_tokens=False))

    records = await mismatch_records(redis_url, namespace)
    for rec in records:
        if decode is None:
            sys.stdout.write(json.dumps(rec) + "\n")
        else:
            sys.stdout.write(format_mismatch(rec, decode) + "\n\n")
    return len(records)


def sample_filter(rollout: str | None, group: str | None) -> Callable[[dict], bool]:
    """The samples `tether samples --rollout/--group` keeps (and `tether ui` shows)."""

    def keep(rec: dict) -> bool:
        return (not rollout or rec.get("rollout_id") == rollout) and (
            not group or rec.get("group_id") == group
        )

    return keep


def cmd_samples(args: argparse.Namespace) -> int:
    if args.mismatches:
        model_dir = args.model
        if model_dir is None and not args.redis_url:
            model_dir = stack_state().get("model_dir")
        _with_redis(args, lambda url, ns: asyncio.run(_dump_mismatches(url, ns, model_dir)))
        return 0

    keep = sample_filter(args.rollout, args.group)
    _with_redis(args, lambda url, ns: asyncio.run(_dump("samples", url, ns, keep)))
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    _with_redis(args, lambda url, ns: asyncio.run(_dump("metrics", url, ns, lambda rec: True)))
    return 0


async def _dead_letters(redis_url: str, namespace: str, as_json: bool) -> int:
    """The dead-letter stream: one line per entry (stream, reason, record type, time), then the count
    per stream it came from; with `as_json`, JSON lines (each entry, then one {"counts": ...})."""
    from collections import Counter

    from tether.common import broker

    keys = broker.Keys(namespace)
    r = broker.connect(redis_url)
    try:
        rows = await broker.read_all(r, keys.dead_letter)
    finally:
        await r.aclose()
    counts: Counter = Counter()
    for entry_id, rec in rows:
        if not isinstance(rec, dict):
            rec = {"record": rec}
        source = keys.short(str(rec.get("stream", "")))
        counts[source] += 1
        at = float(rec.get("dead_lettered_at") or int(entry_id.split("-")[0]) / 1000)
        if as_json:
            sys.stdout.write(json.dumps({"id": entry_id, **rec, "stream": source, "at": at}) + "\n")
        else:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))
            what = rec.get("record_type") or "unknown"
            sys.stdout.write(f"{when}Z  {source}  {what}  {entry_id}  {rec.get('reason', '')}\n")
    if as_json:
        sys.stdout.write(json.dumps({"counts": dict(counts)}) + "\n")
    else:
        total = ", ".join(f"{name}: {n}" for name, n in sorted(counts.items())) or "none"
        sys.stdout.write(f"{len(rows)} dead-lettered ({total})\n")
    return len(rows)


def cmd_dead_letters(args: argparse.Namespace) -> int:
    _with_redis(args, lambda url, ns: asyncio.run(_dead_letters(url, ns, args.json)))
    return 0


def add_inspection(sub: Subparsers) -> None:
    for name, fn, help_ in (
        ("traces", cmd_traces, "print recorded LLM calls as JSON lines"),
        ("samples", cmd_samples, "print what the trainer consumed as JSON lines"),
        (
            "metrics",
            cmd_metrics,
            "print the run's training steps (reward, weight version, ...) as JSON lines",
        ),
    ):
        c = sub.add_parser(name, help=help_)
        if name != "metrics":
            c.add_argument("--rollout")
        if name == "samples":
            c.add_argument("--group")
            c.add_argument(
                "--mismatches",
                action="store_true",
                help="show prefix mismatches (forks) as decoded token diffs instead",
            )
            c.add_argument(
                "--model", help="tokenizer directory for --mismatches (default: the stack's model)"
            )
        if name == "traces":
            c.add_argument(
                "--trace-partitions",
                type=int,
                help="partitions of the trace stream (default: the run's, as its services recorded it in Redis)",
            )
        c.add_argument("--redis-url")
        c.add_argument("--namespace")
        c.set_defaults(fn=fn)

    dead = sub.add_parser(
        "dead-letters", help="list the records consumers gave up on (stream, reason, record type, time)"
    )
    dead.add_argument("--json", action="store_true", help="JSON lines, then the counts per stream")
    dead.add_argument("--redis-url")
    dead.add_argument("--namespace")
    dead.set_defaults(fn=cmd_dead_letters)
