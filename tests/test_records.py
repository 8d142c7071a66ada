"""The Redis half of the contract: every record that travels between services decodes strictly (an
unknown field, a missing required field or a value of the wrong kind is a RecordError, never a
default), round-trips through JSON, and a bad one on a stream is dead-lettered and counted by the
real consumer (merger, agent worker, scheduler) which then goes on."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from dataclasses import MISSING, fields
from pathlib import Path

import orjson
import pytest
from prometheus_client import REGISTRY

from tether.common import broker
from tether.common.grpc_server import cancel_until_done
from tether.common.records import (
    RECORDS,
    AdapterSpan,
    DispatchJob,
    GroupResult,
    InferenceReplica,
    MergedRollout,
    MergedSequence,
    RecordError,
    ReplicaSet,
    RolloutEvent,
    RunRecord,
    SampleRecord,
    SessionReward,
    StepMetrics,
    Trace,
    TrainingOutcome,
)
from tether.v1 import types_pb2

SEQ = {
    "token_ids": [1, 2, 3],
    "loss_mask": [0, 1, 1],
    "logprobs": [0.0, -0.5, -0.25],
    "weight_version": 2,
    "weight_spans": [[2, 1, 3]],
    "truncated": False,
    "constrained_tokens": 0,
}

# One valid record of each type, as its producer writes it: every required field, no optional one.
EXAMPLES = {
    Trace: {"call_id": "c", "rollout_id": "r", "api": "chat.completions", "request": {}, "status": "ok"},
    AdapterSpan: {"adapter": "run-a", "version": "3", "start": 0, "end": 4},
    RolloutEvent: {
        "rollout_id": "r",
        "task_id": "t",
        "group_id": "g",
        "group_size": 2,
        "status": "completed",
    },
    DispatchJob: {
        "group_id": "g",
        "task_id": "t",
        "group_size": 2,
        "task": {"task_id": "t"},
        "metadata": {},
        "max_attempts": 3,
    },
    SessionReward: {
        "session": "prod",
        "call_id": "call-1",
        "rollout_id": "session:prod:call-1",
        "reward": 0.5,
        "trace_entry_id": "1-0",
        "rewarded_at": 1.0,
    },
    MergedSequence: SEQ,
    MergedRollout: {
        "rollout_id": "r",
        "group_id": "g",
        "task_id": "t",
        "status": "completed",
        "reward": 1.0,
        "eval": False,
        "sequences": [SEQ],
        "group_size": 2,
    },
    GroupResult: {
        "group_id": "g",
        "rollouts": 2,
        "completed": 2,
        "rewards": [1.0, 0.0],
        "eval": False,
        "sequences": 2,
        "forks": 0,
        "single_sequence_rollouts": 2,
        "realigns": 0,
        "truncated": 0,
        "generated_tokens": 4,
        "mismatched_calls": 0,
        "side_sequences_excluded": 0,
        "dropped_calls": {},
        "mismatches": [],
        "timed_out": False,
        "finished_at": 1.0,
        "estimator": "grpo",
        "outcome": "trained",
        "samples": 2,
        "tokens": 6,
        "min_weight_version": 3,
    },
    StepMetrics: {
        "step": 0,
        "weight_version": 1,
        "reward_mean": 0.5,
        "rollouts": 2.0,
        "groups_trained": 1.0,
        "groups_filtered": 0.0,
        "samples": 2.0,
        "tokens": 6.0,
        "generated_tokens": 4.0,
        "forks": 0.0,
        "sequences_per_rollout": 1.0,
        "logprob_abs_diff": None,  # NaN on the stream's JSON
        "constrained_tokens_masked": 0.0,
        "push_seconds": 0.1,
        "paused_seconds": 0.0,
        "step_seconds": 1.0,
        "time": 1.0,
    },
    SampleRecord: {
        "rollout_id": "r",
        "group_id": "g",
        "task_id": "t",
        "sequence_index": 0,
        "token_ids": [1, 2, 3],
        "loss_mask": [0, 1, 1],
        "rollout_logprobs": [0.0, -0.5, -0.25],
        "advantages": [0.0, 1.0, 1.0],
        "reward": 1.0,
        "weight_version": 2,
    },
    TrainingOutcome: {"rollout_id": "r", "group_id": "g", "status": "trained"},
    InferenceReplica: {
        "name": "tether-inference-0",
        "vllm_url": "http://10.1.2.3:8001",
        "control_address": "10.1.2.3:50052",
    },
    RunRecord: {
        "run_id": "calc-1",
        "adapter": "calc-1",
        "namespace": "tether.run.calc-1",
        "config": {"trainer": {"lr": 0.001}},
        "status": "created",
        "created_at": 1.0,
        "updated_at": 1.0,
        "key_sha256": "ab" * 32,
    },
    ReplicaSet: {
        "version": 3,
        "source": "kubernetes",
        "replicas": [
            {
                "name": "tether-inference-0",
                "vllm_url": "http://10.1.2.3:8001",
                "control_address": "10.1.2.3:50052",
            }
        ],
        "updated_at": 1.0,
    },
}


def _wire(cls, f) -> str:
    return cls._wire.get(f.name, f.name)


def _required(cls) -> list[str]:
    return [_wire(cls, f) for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]


def test_every_record_has_an_example():
    assert set(EXAMPLES) == set(RECORDS)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_round_trip_through_json(cls):
    record = cls.from_dict(EXAMPLES[cls])
    again = cls.from_json(orjson.dumps(record.to_dict()))
    assert again == record
    assert again.to_dict() == record.to_dict()
    for key, value in EXAMPLES[cls].items():  # what the producer wrote comes back as written
        nested = {"sequences": MergedSequence, "replicas": InferenceReplica}.get(key)
        assert record[key] == value or (nested and record[key][0] == nested.from_dict(value[0]))


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_unknown_field_is_refused(cls):
    with pytest.raises(RecordError, match="unknown field"):
        cls.from_dict({**EXAMPLES[cls], "surprise": 1})


@pytest.mark.parametrize(("cls", "name"), [(c, n) for c in RECORDS for n in _required(c)])
def test_missing_required_field_is_refused(cls, name):
    data = {k: v for k, v in EXAMPLES[cls].items() if k != name}
    with pytest.raises(RecordError, match=f"missing required field.*{name}"):
        cls.from_dict(data)


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_wrong_types_are_refused(cls):
    ex = EXAMPLES[cls]
    for f in fields(cls):
        key = _wire(cls, f)
        if key not in ex or ex[key] is None:
            continue
        value = ex[key]
        # A value of another JSON kind: an object for a scalar or a list, a string for an object.
        wrong = "x" if isinstance(value, dict) else {"x": 1}
        with pytest.raises(RecordError, match=f"field '{key}'"):
            cls.from_dict({**ex, key: wrong})
    with pytest.raises(RecordError, match="expected a JSON object"):
        cls.from_dict([ex])
    with pytest.raises(RecordError, match="not JSON"):
        cls.from_json(b"{nope")


def test_cheap_type_checks():
    ev = EXAMPLES[RolloutEvent]
    with pytest.raises(RecordError, match="group_size"):
        RolloutEvent.from_dict({**ev, "group_size": True})  # a bool is not an int
    with pytest.raises(RecordError, match="group_size"):
        RolloutEvent.from_dict({**ev, "group_size": 2.0})
    with pytest.raises(RecordError, match="reward"):
        RolloutEvent.from_dict({**ev, "reward": "1.0"})
    assert RolloutEvent.from_dict({**ev, "reward": 1}).reward == 1.0  # JSON ints are numbers
    assert RolloutEvent.from_dict({**ev, "reward": None}).reward is None  # optional
    with pytest.raises(RecordError, match="status"):
        RolloutEvent.from_dict({**ev, "status": None})  # required, not optional
    # Nested records decode strictly too.
    bad_seq = {**SEQ, "extra": 1}
    with pytest.raises(RecordError, match="sequences.*unknown field"):
        MergedRollout.from_dict({**EXAMPLES[MergedRollout], "sequences": [bad_seq]})


def test_indexing_a_record_is_strict():
    g = GroupResult.from_dict(EXAMPLES[GroupResult])
    assert g["min_weight_version"] == g.min_weight_version == 3
    with pytest.raises(KeyError):
        g["min_weight_versions"]
    assert not hasattr(g, "get")  # no read with a default that would hide a rename


def test_a_renamed_group_result_field_fails_decoding():
    """The staleness bound reads min_weight_version: a producer that renames or drops it must be
    refused, not decoded into a group that looks fresh (the old ``g.get(..., version)``)."""
    ex = dict(EXAMPLES[GroupResult])
    renamed = {**{k: v for k, v in ex.items() if k != "min_weight_version"}, "oldest_weight_version": 0}
    with pytest.raises(RecordError, match="unknown field.*oldest_weight_version"):
        GroupResult.from_dict(renamed)
    del ex["min_weight_version"]
    with pytest.raises(RecordError, match="missing required field.*min_weight_version"):
        GroupResult.from_dict(ex)


def test_merged_sequence_return_is_its_wire_name_and_optional_fields_stay_absent():
    seq = MergedSequence.from_dict({**SEQ, "spans": [[1, 3]], "returns": [0.5], "return": 0.5})
    assert seq.return_ == 0.5 and seq.to_dict()["return"] == 0.5 and "return_" not in seq.to_dict()
    plain = MergedSequence.from_dict(SEQ).to_dict()
    assert "spans" not in plain and "return" not in plain  # readers test for their absence
    m = MergedRollout.from_dict(EXAMPLES[MergedRollout]).to_dict()
    assert "estimator" not in m and "return" not in m and m["sequences"] == [SEQ]


def test_trace_carries_the_gateways_own_keys():
    data = {
        **EXAMPLES[Trace],
        "weight_version_end": 4,
        "replica": "http://127.0.0.1:1",
        "retries": 1,
        "failovers": 2,
        "session": "prod",
    }
    t = Trace.from_dict(data)
    assert (t.weight_version_end, t.replica, t.retries, t.failovers, t.session) == (
        4,
        "http://127.0.0.1:1",
        1,
        2,
        "prod",
    )
    assert Trace.from_json(orjson.dumps(t.to_dict())) == t


def test_trace_names_the_adapter_of_each_span_and_older_traces_decode():
    spans = [
        {"adapter": "run-a", "version": "3", "start": 0, "end": 2},
        {"adapter": "", "version": "", "start": 2, "end": 5},
    ]
    t = Trace.from_dict({**EXAMPLES[Trace], "adapter_spans": spans})
    assert t.adapter_spans == [AdapterSpan("run-a", "3", 0, 2), AdapterSpan("", "", 2, 5)]
    assert Trace.from_json(orjson.dumps(t.to_dict())) == t
    assert orjson.loads(orjson.dumps(t.to_dict()))["adapter_spans"] == spans
    assert Trace.from_dict(EXAMPLES[Trace]).adapter_spans == []  # a trace written before adapters
    with pytest.raises(RecordError, match="version"):
        Trace.from_dict({**EXAMPLES[Trace], "adapter_spans": [{**spans[0], "version": 3}]})


def test_rollout_event_says_whether_a_failure_is_retried():
    ev = EXAMPLES[RolloutEvent]
    assert RolloutEvent.from_dict({**ev, "status": "failed", "attempt": 0, "max_attempts": 2}).retried
    assert not RolloutEvent.from_dict({**ev, "status": "failed", "attempt": 1, "max_attempts": 2}).retried
    assert not RolloutEvent.from_dict({**ev, "attempt": 0, "max_attempts": 2}).retried  # completed
    assert RolloutEvent.from_dict({**ev, "eval": True}).eval


def test_gateway_reads_attempts_from_metadata():
    from tether.gateway.rollouts import attempts_of

    assert attempts_of({"attempt": 1, "max_attempts": 3}) == (1, 3)
    assert attempts_of({}) == (0, 1)
    assert attempts_of({"attempt": "x", "max_attempts": 3}) == (0, 1)


def test_gateway_reads_the_expected_adapter_from_metadata():
    from tether.gateway.rollouts import adapter_of

    assert adapter_of({"adapter": "run-a"}) == "run-a"
    assert adapter_of({}) == adapter_of({"adapter": None}) == ""
    assert adapter_of({"adapter": 7}) == "7"  # checked against, never silently dropped
    ev = EXAMPLES[RolloutEvent]
    assert RolloutEvent.from_dict(ev).adapter == ""  # an event written before adapters: no check
    assert RolloutEvent.from_dict({**ev, "adapter": "run-a"}).adapter == "run-a"
    with pytest.raises(RecordError, match="adapter"):
        RolloutEvent.from_dict({**ev, "adapter": 7})


# ---------------------------------------------------------------- SampleRecord <-> tether.v1.Sample


def _sample(**kw) -> SampleRecord:
    return SampleRecord.from_dict({**EXAMPLES[SampleRecord], **kw})


def test_sample_proto_round_trip():
    s = _sample(weight_spans=[[2, 1, 2], [3, 2, 3]], constrained_tokens=1, rollout_sequences=2)
    p = s.to_proto()
    assert isinstance(p, types_pb2.Sample)
    wire = types_pb2.Sample.FromString(p.SerializeToString())
    back = SampleRecord.from_proto(wire)
    assert back == s  # these floats are exact in float32
    assert back.weight_spans == [[2, 1, 2], [3, 2, 3]] and back.weight_version == 2
    assert (back.token_ids, back.loss_mask, back.constrained_tokens) == ([1, 2, 3], [0, 1, 1], 1)
    assert back.rollout_logprobs == pytest.approx(s.rollout_logprobs)


def test_sample_weight_version_cannot_disagree_with_its_spans():
    """The spans are authoritative; weight_version is their oldest version (kept on the proto for
    wire compatibility), and a record or a proto that says otherwise is refused."""
    assert _sample(weight_spans=[[5, 1, 2], [4, 2, 3]], weight_version=4).weight_version == 4
    with pytest.raises(RecordError, match="oldest version 4"):
        _sample(weight_spans=[[5, 1, 2], [4, 2, 3]], weight_version=5)
    p = _sample(weight_spans=[[4, 1, 3]], weight_version=4).to_proto()
    p.weight_version = 7
    with pytest.raises(RecordError):
        SampleRecord.from_proto(p)
    assert _sample(weight_spans=[], weight_version=9).weight_version == 9  # no spans: the field says
    assert SampleRecord.version_of([[5, 0, 1], [3, 1, 2]], 0) == 3 and SampleRecord.version_of([], 6) == 6


async def test_trainer_refuses_a_sample_whose_version_disagrees():
    """Over real gRPC: SubmitGroup answers INVALID_ARGUMENT, before anything is buffered."""
    import grpc

    from tether.common.grpc_server import start_server
    from tether.trainer.servicer import TrainerServicer
    from tether.v1 import trainer_pb2, trainer_pb2_grpc

    # No trainer core: the sample is refused at the edge, before anything would reach it.
    servicer = TrainerServicer(trainer=None)

    def register(server):
        trainer_pb2_grpc.add_TrainerServicer_to_server(servicer, server)
        return [trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name]

    server, _, port = await start_server(0, register)
    try:
        p = _sample(weight_spans=[[4, 1, 3]], weight_version=4).to_proto()
        p.weight_version = 7
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = trainer_pb2_grpc.TrainerStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SubmitGroup(trainer_pb2.SubmitGroupRequest(group_id="g", samples=[p], rollouts=1))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "oldest version 4" in err.value.details()
    finally:
        await server.stop(None)


# ---------------------------------------------------------------- keys


def test_every_redis_key_is_built_by_keys():
    """No service builds a key from the namespace itself (grep for it): Keys (common/keys.py, re-exported
    by broker) is the one place."""
    root = Path(__file__).resolve().parents[1] / "services" / "tether"
    pattern = re.compile(r"""f["'][^"']*\{[^}]*(\.ns|namespace|keys\.\w+)\}:""")
    offenders = [
        f"{p.relative_to(root)}:{i}"
        for p in root.rglob("*.py")
        if p.relative_to(root).as_posix() != "common/keys.py" and "v1" not in p.parts
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert offenders == []
    keys = broker.Keys("n")
    assert (keys.mismatches, keys.merger_pending_groups, keys.run_inflight) == (
        "n:mismatches",
        "n:merger:pending-groups",
        "n:run:inflight:{n:run}",  # in the run hash's slot (tests/test_redis_cluster.py)
    )


# ---------------------------------------------------------------- bad records on the real consumers


def _dead(stream: str, record: str) -> float:
    return REGISTRY.get_sample_value("tether_dead_letters_total", {"stream": stream, "record": record}) or 0.0


async def _until(cond, timeout=10.0, task=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if task is not None and task.done():
            task.result()
            raise AssertionError("consumer stopped")
        if await cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


async def _stop(task):
    await cancel_until_done(task)


async def test_merger_dead_letters_a_renamed_event_field_and_goes_on(redis_url):
    from tether.merger.consumer import Merger, MergerConfig

    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    before = _dead("rollout-events", "RolloutEvent")
    bad = {**EXAMPLES[RolloutEvent], "rollout_id": "bad", "attempts": 1}  # renamed: attempt -> attempts
    await broker.publish(r, keys.rollout_events, bad)
    await broker.publish(r, keys.rollout_events, {"data": "not even the right shape"})
    await r.xadd(keys.rollout_events, {"data": b"{not json"})
    good = RolloutEvent("ok", "t", "g1", 1, "failed", finished_at=1.0)
    await broker.publish(r, keys.rollout_events, good.to_dict())
    merger = Merger(r, keys, MergerConfig(), None)
    task = asyncio.create_task(merger.run())
    try:

        async def done():
            return (
                await r.exists(keys.group_done("g1")) and len(await broker.read_all(r, keys.dead_letter)) == 3
            )

        await _until(done, task=task)
        assert (await r.xpending(keys.rollout_events, "merger"))["pending"] == 0
    finally:
        await _stop(task)
    letters = [rec for _, rec in await broker.read_all(r, keys.dead_letter)]
    assert [x["record_type"] for x in letters] == ["RolloutEvent"] * 3
    assert "attempts" in letters[0]["reason"] and letters[0]["record"] == bad
    assert _dead("rollout-events", "RolloutEvent") == before + 3
    await r.aclose()


async def test_merger_dead_letters_a_bad_trace_and_merges_the_rest(redis_url):
    from tether.merger.consumer import Merger, MergerConfig

    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    before = _dead(keys.short(keys.traces("a")), "Trace")
    good = Trace("c0", "a", "chat.completions", {}, "ok", [1, 2], [3], [-0.5], weight_version=1)
    bad = {**good.to_dict(), "call_id": "c1", "prompt_tokens": [1]}  # a field no Trace has
    for rec in (good.to_dict(), bad):
        await broker.publish_once(
            r, keys, keys.traces("a"), rec["call_id"], rec, index_list=keys.rollout_calls("a")
        )
    submitted = []

    async def submit(group_id, samples, rollouts):
        submitted.append([s.token_ids for s in samples])

    cfg = MergerConfig(estimator="running_baseline")
    merger = Merger(r, keys, cfg, submit)
    ev = RolloutEvent("a", "t", "g", 1, "completed", reward=1.0)
    await broker.publish(r, keys.rollout_events, ev.to_dict())
    task = asyncio.create_task(merger.run())
    try:
        await _until(lambda: _true(len(submitted) == 1), task=task)
    finally:
        await _stop(task)
    assert submitted == [[[1, 2, 3]]]  # the good call trained; the bad one left out
    ((_, letter),) = await broker.read_all(r, keys.dead_letter)
    assert letter["stream"] == keys.traces("a") and letter["record"]["call_id"] == "c1"
    assert _dead(keys.short(keys.traces("a")), "Trace") == before + 1
    ((_, result),) = await broker.read_all(r, keys.group_results)
    assert GroupResult.from_dict(result).outcome == "trained"  # what the merger publishes decodes
    await r.aclose()


async def _true(value):
    return value


async def test_agent_worker_dead_letters_a_bad_dispatch_job_and_acknowledges_it(redis_url):
    from tether.agents.worker import Worker

    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    before = _dead("dispatch", "DispatchJob")
    bad = {k: v for k, v in EXAMPLES[DispatchJob].items() if k != "max_attempts"}
    await broker.publish(r, keys.dispatch, bad)
    worker = Worker(r, keys, "http://127.0.0.1:9", lambda *a: 0.0, concurrency=1)
    task = asyncio.create_task(worker.run())
    try:

        async def dead():
            return len(await broker.read_all(r, keys.dead_letter)) == 1

        await _until(dead, task=task)
        await _until(lambda: _pending_zero(r, keys.dispatch, "agents"), task=task)
    finally:
        await _stop(task)
    ((_, letter),) = await broker.read_all(r, keys.dead_letter)
    assert letter["record_type"] == "DispatchJob" and "max_attempts" in letter["reason"]
    assert _dead("dispatch", "DispatchJob") == before + 1
    assert worker.done == worker.failed == 0  # nothing was run
    await r.aclose()


async def _pending_zero(r, stream, group):
    return (await r.xpending(stream, group))["pending"] == 0


async def test_scheduler_dead_letters_a_group_result_without_its_version(redis_url, tmp_path):
    """The scheduler never sees a group result that lacks min_weight_version (it is dead-lettered);
    the ones it sees are typed, and the step's staleness is read from that field."""
    from tether.scheduler.run import Run, RunConfig, Stubs

    r = broker.connect(redis_url)
    keys = broker.Keys("t")
    before = _dead("group-results", "GroupResult")
    cfg = RunConfig(run_id="r", steps=1, tasks_per_step=1, group_size=1, seed=0, run_dir=tmp_path)
    run = Run(r, keys, cfg, Stubs(None, None, None), [{"task_id": "t"}])
    try:
        cursor = await run.results_cursor()
        old = {**EXAMPLES[GroupResult], "group_id": "old"}
        del old["min_weight_version"]
        await broker.publish(r, keys.group_results, old)
        await broker.publish(
            r, keys.group_results, {**EXAMPLES[GroupResult], "group_id": "g", "min_weight_version": 2}
        )
        _, results = await run.read_results(cursor, 100)
        assert [(type(g), g.group_id) for g in results] == [(GroupResult, "g")]
        assert _dead("group-results", "GroupResult") == before + 1
        ((_, letter),) = await broker.read_all(r, keys.dead_letter)
        assert letter["record"]["group_id"] == "old" and "min_weight_version" in letter["reason"]
        run.state = dataclasses.replace(run.state, weight_version=5)
        record = run.step_record(0, results, {}, time.perf_counter(), 1.0, 0.0, 0.0, version_before=5)
        assert record["staleness_max"] == 3.0  # 5 - min_weight_version 2
        StepMetrics.from_dict(orjson.loads(orjson.dumps(record)))  # what goes on the metrics stream
    finally:
        await r.aclose()
