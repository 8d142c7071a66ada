"""Poison entries: a record that every consumer taking it dies on (or never acknowledges) is moved to
the dead-letter stream once it was delivered more than broker.MAX_DELIVERIES times, counted in
tether_dead_letters_total and shown by `tether dead-letters`; the good entries around it are all
handled, and a consumer started again under its name takes up its own pending entries at once."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

from prometheus_client import REGISTRY
from stack_helpers import TETHER, wait_for

from tether import launcher
from tether.common import broker
from tether.launcher import Proc, Stack

# The crash test's limit: each life past the first waits out the launcher's restart backoff.
MAX = 2

# A consumer as the services write one (read_own_pending first, then read_group with poison
# checks): it dies on the poison record, as a consumer crashing on a record would, before acking.
CONSUMER = textwrap.dedent(
    """
    import asyncio, os, sys
    from tether.common import broker

    MAX = int(os.environ["MAX_DELIVERIES"])

    async def main(url, ns):
        r = broker.connect(url)
        keys = broker.Keys(ns)
        await broker.ensure_group(r, keys.dispatch, "g")
        after = "0"
        while True:
            if after is not None:
                entries, after = await broker.read_own_pending(
                    r, keys, keys.dispatch, "g", "c0", after, record_type="Job", max_deliveries=MAX
                )
            else:
                entries = await broker.read_group(
                    r, keys.dispatch, "g", "c0", block_ms=200, keys=keys, record_type="Job",
                    max_deliveries=MAX,
                )
            for eid, rec in entries:
                if rec.get("poison"):
                    os._exit(3)
                await r.rpush(ns + ":handled", rec["i"])
                await r.xack(keys.dispatch, "g", eid)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def _dead_letters_total(stream: str, record: str) -> float:
    labels = {"stream": stream, "record": record}
    return REGISTRY.get_sample_value("tether_dead_letters_total", labels) or 0.0


async def test_an_entry_never_acknowledged_is_dead_lettered_after_max_deliveries(redis_url):
    r = broker.connect(redis_url)
    keys = broker.Keys("poison")
    try:
        await broker.ensure_group(r, keys.trace_stream(0), "merger")
        await broker.publish(r, keys.trace_stream(0), {"bad": True})
        before = _dead_letters_total("traces:{p0}", "Trace")
        deliveries = 0
        for _ in range(broker.MAX_DELIVERIES + 3):
            got = await broker.read_group(
                r,
                keys.trace_stream(0),
                "merger",
                "c1",
                block_ms=None,
                claim_idle_ms=0,
                keys=keys,
                record_type="Trace",
            )
            deliveries += len(got)  # handed out, never acknowledged (the consumer "crashed")
        assert deliveries == broker.MAX_DELIVERIES
        assert _dead_letters_total("traces:{p0}", "Trace") == before + 1
        (_, dead), *rest = await broker.read_all(r, keys.dead_letter)
        assert not rest
        assert dead["stream"] == keys.trace_stream(0) and dead["record_type"] == "Trace"
        assert dead["record"] == {"bad": True} and dead["deliveries"] == broker.MAX_DELIVERIES + 1
        assert await r.xpending(keys.trace_stream(0), "merger") == {
            "pending": 0,
            "min": None,
            "max": None,
            "consumers": [],
        }
    finally:
        await r.aclose()


async def test_a_dead_consumers_entries_go_to_another_consumer_once_idle(redis_url):
    """A consumer that took entries and died (another name: a replaced pod) leaves them pending; a live
    consumer's read claims them (XAUTOCLAIM) once they were idle `claim_idle_ms`, not before, each once,
    ahead of new entries."""
    r = broker.connect(redis_url)
    keys = broker.Keys("reclaim")
    stream = keys.dispatch
    try:
        await broker.ensure_group(r, stream, "g")
        for i in range(3):
            await broker.publish(r, stream, {"i": i})
        taken = await broker.read_group(r, stream, "g", "dead", block_ms=None)
        assert [rec["i"] for _, rec in taken] == [0, 1, 2]  # and never acknowledged: it died
        await broker.publish(r, stream, {"i": 3})
        # Not idle long enough: the live consumer gets only the new entry.
        fresh = await broker.read_group(r, stream, "g", "live", block_ms=None, claim_idle_ms=10_000)
        assert [rec["i"] for _, rec in fresh] == [3]
        await r.xack(stream, "g", *(eid for eid, _ in fresh))
        await asyncio.sleep(0.3)
        claimed = await broker.read_group(r, stream, "g", "live", block_ms=None, claim_idle_ms=200)
        assert [(eid, rec["i"]) for eid, rec in claimed] == [(eid, rec["i"]) for eid, rec in taken]
        pending = await r.xpending(stream, "g")
        assert pending["pending"] == 3 and [c["name"] for c in pending["consumers"]] == ["live"]
        await r.xack(stream, "g", *(eid for eid, _ in claimed))
        # Claimed once: nothing is left to claim or read.
        assert await broker.read_group(r, stream, "g", "live", block_ms=None, claim_idle_ms=0) == []
    finally:
        await r.aclose()


def test_a_consumer_crashing_on_a_poison_entry_under_the_launcher(tmp_path, monkeypatch, redis_url):
    """The launcher restarts a consumer that dies on a record each time it takes it; after
    `max_deliveries` lives (here MAX) the record is dead-lettered, the consumer lives on, and every
    good record is handled exactly once. `tether dead-letters` lists it (text and --json, with the
    counts)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launcher, "BACKOFF_BASE_S", 0.05)  # restarts as the launcher does, waits short
    script = tmp_path / "consumer.py"
    script.write_text(CONSUMER)
    ns = "poison-run"
    import redis

    r = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = broker.Keys(ns)
    for i in range(3):
        r.xadd(keys.dispatch, {"data": json.dumps({"i": i})})
    r.xadd(keys.dispatch, {"data": json.dumps({"i": 99, "poison": True})})
    for i in range(3, 6):
        r.xadd(keys.dispatch, {"data": json.dumps({"i": i})})
    stack = Stack(run_dir=tmp_path / "run", namespace=ns)
    stack.redis_url = redis_url
    stack.log_dir.mkdir(parents=True)
    log = stack.log_dir / "consumer.log"

    def spawn():
        with open(log, "ab") as out:
            return subprocess.Popen(
                [sys.executable, str(script), redis_url, ns],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "MAX_DELIVERIES": str(MAX)},
            )

    proc = Proc("consumer", spawn, log)
    stack.procs.append(proc)
    try:

        def settled():
            stack.check_alive()
            return r.xlen(keys.dead_letter) == 1 and r.llen(f"{ns}:handled") == 6

        wait_for(settled, 60, "the poison entry dead-lettered and the rest handled", every_s=0.1)
        # Each life took the poison entry once (its own pending, first thing) and died on it.
        assert proc.restarts == MAX
        assert proc.popen.poll() is None
        assert sorted(map(int, r.lrange(f"{ns}:handled", 0, -1))) == list(range(6))
        assert r.xpending(keys.dispatch, "g")["pending"] == 0
        assert log.read_text().count("--- launcher: exited with code 3; restart") == MAX
    finally:
        stack.stop(grace_s=5)

    def cli(*args: str) -> str:
        out = subprocess.run(
            [*TETHER, "dead-letters", "--redis-url", redis_url, "--namespace", ns, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    rows = [json.loads(x) for x in cli("--json").splitlines()]
    assert rows[-1] == {"counts": {"dispatch": 1}}
    (entry,) = rows[:-1]
    assert entry["stream"] == "dispatch" and entry["record_type"] == "Job"
    assert entry["record"] == {"i": 99, "poison": True} and entry["deliveries"] == MAX + 1
    assert "delivered" in entry["reason"] and entry["at"] > 0
    text = cli()
    assert "dispatch  Job" in text and "1 dead-lettered (dispatch: 1)" in text
    r.close()
