"""The run registry (docs/runs.md, "Design: a run is a namespace"): its pure rules (common/runs.py:
ids, namespaces, status transitions), the keys a run's namespace gives (kept apart from the base
namespace's, hash tags intact), and the Redis store (gateway/runs.py) against the embedded Redis."""

from __future__ import annotations

import asyncio
import hashlib
import uuid

import orjson
import pytest

from tether.common import broker
from tether.common import runs as rules
from tether.common.keys import Keys, slot_tag, trace_partition
from tether.common.records import RecordError, RunRecord
from tether.gateway.capture import ApiError
from tether.gateway.runs import RUN_KEY_PREFIX, Runs

# --- the rules ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("run_id", ["a", "calc", "calc-2", "0", "a" * 40, "run-1-b"])
def test_valid_run_ids(run_id):
    assert rules.valid_run_id(run_id)
    assert rules.run_namespace("tether", run_id) == f"tether.run.{run_id}"


@pytest.mark.parametrize(
    "run_id",
    ["", "a" * 41, "Calc", "-calc", "calc_1", "calc.1", "calc:1", "{p0}", "a b", "é", None, 3, ["a"]],
)
def test_invalid_run_ids(run_id):
    assert not rules.valid_run_id(run_id)
    with pytest.raises(ValueError, match="invalid run id"):
        rules.run_namespace("tether", run_id)


def test_transitions():
    assert rules.next_status("r", "created", "running") == "running"
    assert rules.next_status("r", "running", "stopping") == "stopping"
    assert rules.next_status("r", "stopping", "stopped") == "stopped"
    for live in ("created", "running", "stopping"):
        assert rules.next_status("r", live, "failed") == "failed"
    for current, wanted in [
        ("created", "stopped"),  # only through stopping
        ("running", "created"),
        ("stopping", "running"),
        ("stopped", "running"),
        ("stopped", "failed"),
        ("failed", "stopping"),
        ("running", "bogus"),
        ("bogus", "running"),
    ]:
        with pytest.raises(rules.TransitionRefused, match=f"is {current}: it cannot become {wanted}"):
            rules.next_status("r", current, wanted)
    assert set(rules.TRANSITIONS) == set(rules.STATUSES)
    assert all(not rules.TRANSITIONS[s] for s in rules.FINAL)


def test_stop_target():
    assert rules.stop_target("r", "created") == "stopping"
    assert rules.stop_target("r", "running") == "stopping"
    assert rules.stop_target("r", "stopping") is None
    assert rules.stop_target("r", "stopped") is None
    with pytest.raises(rules.TransitionRefused):
        rules.stop_target("r", "failed")
    assert rules.drains("running") and not rules.drains("created")


def test_which_statuses_take_rollouts_and_serve_their_calls():
    assert [s for s in rules.STATUSES if rules.takes_rollouts(s)] == ["created", "running"]
    # A stopping run drains (its running rollouts call on); a stopped or failed one serves nothing.
    assert [s for s in rules.STATUSES if rules.serves_calls(s)] == ["created", "running", "stopping"]


def test_a_namespace_names_its_run_for_the_trainer():
    for base in ("tether", "a.b", "x.run"):
        for run_id in ("calc", "r-2", "9"):
            ns = rules.run_namespace(base, run_id)
            assert rules.run_of_namespace(ns) == (base, run_id)
            assert rules.trainer_run_id(ns) == run_id
    # Not a run's: the trainer's single policy, exactly as before runs.
    for ns in ("tether", "tether.run.", ".run.calc", "tether.run.Calc", "tether.run.-x", "tether:run.a"):
        assert rules.run_of_namespace(ns) is None
        assert rules.trainer_run_id(ns) == ""


def test_a_runs_keys_are_apart_from_the_base_namespace_and_keep_their_hash_tags():
    base, run = Keys("tether"), Keys(rules.run_namespace("tether", "calc"))
    for k in range(base.trace_partitions):
        assert slot_tag(run.trace_stream(k)) == slot_tag(base.trace_stream(k)) == f"p{k}"
    rid = uuid.uuid4().hex
    assert slot_tag(run.rollout(rid)) == f"p{trace_partition(rid, run.trace_partitions)}"
    assert slot_tag(run.published("x", run.rollout_events)) == slot_tag(run.rollout_events)
    assert slot_tag(run.run_inflight) == slot_tag(run.run)
    # No key of the run's equals or starts with a key of the base namespace's, nor the reverse: a
    # SCAN of `tether:*` sees nothing of a run, and the scheduler's `tether:run` hash is not a run's.
    run_keys = [*run.streams().values(), run.run, run.run_inflight, run.rollout(rid), run.api_key("k")]
    base_keys = [*base.streams().values(), base.run, base.run_inflight, base.rollout(rid), base.runs]
    for a in run_keys:
        assert not a.startswith(f"{base.ns}:")
        for b in base_keys:
            assert a != b and not a.startswith(b + ":") and not b.startswith(a + ":")
    assert run.short(run.samples) == base.short(base.samples) == "samples"
    # The registry's key index shares the registry's slot (one script writes both).
    assert slot_tag(base.run_key("ab")) == slot_tag(base.runs)


def test_the_record_checks_id_and_status():
    ok = dict(
        run_id="calc",
        adapter="calc",
        namespace="tether.run.calc",
        config={},
        status="created",
        created_at=1.0,
        updated_at=1.0,
        key_sha256="0" * 64,
    )
    assert RunRecord.from_dict(ok).run_id == "calc"
    with pytest.raises(RecordError, match="run_id"):
        RunRecord.from_dict({**ok, "run_id": "Calc"})
    with pytest.raises(RecordError, match="status"):
        RunRecord.from_dict({**ok, "status": "paused"})


# --- the store --------------------------------------------------------------------------------------


def _run(coro):
    return asyncio.run(coro)


async def _with_runs(redis_port, body, clock=None):
    r = broker.connect(f"redis://127.0.0.1:{redis_port}/0")
    try:
        runs = Runs(r, Keys(f"t{uuid.uuid4().hex[:8]}"), **({"clock": clock} if clock else {}))
        return await body(runs)
    finally:
        await r.aclose()


CONFIG = {"trainer": {"lr": 0.001}, "example": "calculator"}


def test_create_get_list_and_the_key(redis_port, rdb):
    async def body(runs: Runs):
        record, key = await runs.create("calc", CONFIG)
        assert key.startswith(RUN_KEY_PREFIX) and len(key) > 30
        assert record.status == "created" and record.adapter == "calc" and record.config == CONFIG
        assert record.namespace == f"{runs.keys.ns}.run.calc"
        assert record.key_sha256 == hashlib.sha256(key.encode()).hexdigest()
        assert await runs.get("calc") == record
        other, other_key = await runs.create("instr", {}, adapter="instruction-lora")
        assert other.adapter == "instruction-lora"
        assert [r.run_id for r in await runs.list()] == ["calc", "instr"]
        assert await runs.by_key(key) == record and await runs.by_key(other_key) == other
        for stranger in (None, "", "trk-unknown", key[4:], "tr-" + key[4:], key + "x"):
            assert await runs.by_key(stranger) is None
        # The key itself is nowhere in Redis: only its digest names it.
        dump = orjson.dumps({k: rdb.dump(k).hex() for k in rdb.keys(f"{runs.keys.ns}*")})
        assert key.encode().hex().encode() not in dump and key.encode() not in dump
        assert rdb.get(runs.keys.run_key(record.key_sha256)) == "calc"
        return record

    _run(_with_runs(redis_port, body))


def test_create_refuses_an_existing_id_and_bad_input(redis_port):
    async def body(runs: Runs):
        first, first_key = await runs.create("calc", CONFIG)
        with pytest.raises(ApiError) as exc:
            await runs.create("calc", {}, adapter="other")
        assert exc.value.status == 409 and exc.value.code == "run_exists"
        assert await runs.get("calc") == first and await runs.by_key(first_key) == first  # untouched
        for run_id, config, adapter, param in [
            ("Calc", {}, None, "run_id"),
            ("a" * 41, {}, None, "run_id"),
            ("calc2", {"trainr": {}}, None, "config"),
            ("calc2", {"trainer": 3}, None, "config"),
            ("calc2", [], None, "config"),
            ("calc2", {}, "", "adapter"),
            ("calc2", {}, " x", "adapter"),
            ("calc2", {}, "x" * 201, "adapter"),
        ]:
            with pytest.raises(ApiError) as exc:
                await runs.create(run_id, config, adapter)
            assert (exc.value.status, exc.value.param) == (400, param), (run_id, config, adapter)
        assert [r.run_id for r in await runs.list()] == ["calc"]

    _run(_with_runs(redis_port, body))


def test_concurrent_creates_of_one_id_make_one_run(redis_port):
    async def body(runs: Runs):
        results = await asyncio.gather(
            *(runs.create("race", {"description": str(i)}) for i in range(8)), return_exceptions=True
        )
        made = [r for r in results if not isinstance(r, Exception)]
        assert len(made) == 1
        assert all(isinstance(r, ApiError) and r.status == 409 for r in results if r not in made)
        record, key = made[0]
        assert await runs.get("race") == record and await runs.by_key(key) == record

    _run(_with_runs(redis_port, body))


def test_get_and_stop_of_unknown_or_invalid_ids(redis_port):
    async def body(runs: Runs):
        for call in (runs.get, runs.stop):
            with pytest.raises(ApiError) as exc:
                await call("nope")
            assert (exc.value.status, exc.value.code) == (404, "run_not_found")
            with pytest.raises(ApiError) as exc:
                await call("No:pe")
            assert (exc.value.status, exc.value.param) == (400, "run_id")
        with pytest.raises(ApiError) as exc:
            await runs.set_status("nope", "running")
        assert exc.value.status == 404

    _run(_with_runs(redis_port, body))


def test_stop(redis_port):
    now = [100.0]

    async def body(runs: Runs):
        await runs.create("idle", {})
        now[0] = 200.0
        stopped = await runs.stop("idle")  # nothing runs for a created run: stopped at once
        assert (stopped.status, stopped.created_at, stopped.updated_at) == ("stopped", 100.0, 200.0)
        assert await runs.get("idle") == stopped
        assert await runs.stop("idle") == stopped  # again: as it is

        await runs.create("busy", {})
        assert (await runs.set_status("busy", "running")).status == "running"
        stopping = await runs.stop("busy")  # its services drain first
        assert stopping.status == "stopping" and await runs.stop("busy") == stopping
        assert (await runs.set_status("busy", "stopped")).status == "stopped"

        await runs.create("broken", {})
        await runs.set_status("broken", "failed")
        with pytest.raises(ApiError) as exc:
            await runs.stop("broken")
        assert (exc.value.status, exc.value.code) == (409, "run_status")
        with pytest.raises(ApiError) as exc:
            await runs.set_status("idle", "running")  # stopped is final
        assert exc.value.status == 409
        assert {r.run_id: r.status for r in await runs.list()} == {
            "idle": "stopped",
            "busy": "stopped",
            "broken": "failed",
        }

    _run(_with_runs(redis_port, body, clock=lambda: now[0]))


@pytest.mark.parametrize("end", ["stopped", "failed"])
def test_a_runs_final_status_revokes_the_keys_issued_to_its_services(redis_port, rdb, end):
    """Keys issued to a run's services (issue_key) stop naming the run once it is stopped or failed, in
    the write that ends it; the key given at creation keeps reading it; an ended run gets no new key; the
    other run's keys are untouched."""

    async def body(runs: Runs):
        record, creator = await runs.create("calc", {})
        _, other_creator = await runs.create("other", {})
        issued = [await runs.issue_key("calc") for _ in range(3)]
        other_issued = await runs.issue_key("other")
        for key in issued:
            assert await runs.by_key(key) == record
        await runs.set_status("calc", "running")
        assert {r.run_id: r.status for r in await runs.list()}["calc"] == "running"
        for key in issued:  # not while it runs, nor while it drains
            assert (await runs.by_key(key)).run_id == "calc"
        await runs.stop("calc")
        assert (await runs.by_key(issued[0])).run_id == "calc"
        await runs.set_status("calc", end)
        for key in issued:
            assert await runs.by_key(key) is None
            assert not rdb.exists(runs.keys.run_key(broker.key_digest(key)))
        assert not rdb.exists(runs.keys.run_issued("calc"))
        assert (await runs.by_key(creator)).status == end  # the creator's key reads what the run left
        assert (await runs.by_key(other_issued)).run_id == "other"
        assert (await runs.by_key(other_creator)).run_id == "other"
        with pytest.raises(ApiError) as exc:
            await runs.issue_key("calc")
        assert (exc.value.status, exc.value.code) == (409, "run_status")
        assert not rdb.exists(runs.keys.run_issued("calc"))

        await runs.create("idle", {})  # a created run stopped at once (through stopping) revokes too
        idle_key = await runs.issue_key("idle")
        await runs.stop("idle")
        assert await runs.by_key(idle_key) is None

    _run(_with_runs(redis_port, body))


def test_concurrent_status_changes_never_both_win(redis_port):
    """stop and fail at once on a running run: whichever writes first, the other reads its result
    (WATCH), so the run ends in a state some order of the two gives, never a lost update."""

    async def body(runs: Runs):
        for i in range(10):
            run_id = f"race-{i}"
            await runs.create(run_id, {})
            await runs.set_status(run_id, "running")
            results = await asyncio.gather(
                runs.stop(run_id), runs.set_status(run_id, "failed"), return_exceptions=True
            )
            final = (await runs.get(run_id)).status
            stop, fail = results
            if isinstance(stop, ApiError):  # failed first: stopping a failed run is refused
                assert final == "failed" and stop.status == 409
            else:  # stopped first (to stopping): failing a stopping run is allowed
                assert not isinstance(fail, Exception) and final == "failed"

    _run(_with_runs(redis_port, body))


def test_a_record_that_does_not_decode_is_dead_lettered_and_left_out(redis_port, rdb):
    async def body(runs: Runs):
        await runs.create("good", {})
        rdb.hset(runs.keys.runs, "bad", '{"run_id": "bad"}')
        assert [r.run_id for r in await runs.list()] == ["good"]
        with pytest.raises(ApiError) as exc:
            await runs.get("bad")
        assert exc.value.status == 404
        letters = rdb.xrange(runs.keys.dead_letter)
        assert len(letters) == 2 and "RunRecord" in letters[0][1]["data"]

    _run(_with_runs(redis_port, body))


async def check_the_registry(url: str) -> None:
    """The store's Redis paths in one go (test_redis_cluster.py runs it on a cluster too): the create
    script (record and key), a concurrent create of one id, the key lookup, a stop and a concurrent
    status change under WATCH."""
    r = broker.connect(url)
    try:
        runs = Runs(r, Keys(f"t{uuid.uuid4().hex[:8]}"))
        results = await asyncio.gather(
            *(runs.create("one", CONFIG) for _ in range(4)), return_exceptions=True
        )
        made = [x for x in results if not isinstance(x, Exception)]
        assert len(made) == 1 and sum(isinstance(x, ApiError) and x.status == 409 for x in results) == 3
        record, key = made[0]
        assert await runs.by_key(key) == record == await runs.get("one")
        issued = await runs.issue_key("one")  # the issue script and the revoking transaction
        assert (await runs.by_key(issued)).run_id == "one"
        await runs.set_status("one", "running")
        stop, fail = await asyncio.gather(
            runs.stop("one"), runs.set_status("one", "failed"), return_exceptions=True
        )
        assert (await runs.get("one")).status == "failed"
        assert isinstance(stop, ApiError) or not isinstance(fail, Exception)
        assert await runs.by_key(issued) is None and (await runs.by_key(key)).run_id == "one"
        await runs.create("two", {})
        assert (await runs.stop("two")).status == "stopped"
        assert [x.run_id for x in await runs.list()] == ["one", "two"]
    finally:
        await r.aclose()


async def test_the_registry_in_one_go(redis_port):
    await check_the_registry(f"redis://127.0.0.1:{redis_port}/0")
