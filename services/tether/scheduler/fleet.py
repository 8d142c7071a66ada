"""The inference replicas a run serves, as the one Inference stub the run calls (`Stubs.inference`).

Until `update` is first called (local, Compose, Kubernetes without discovery) the fleet hands every
call to the one adapter at `inference_address`, as that stub would answer it: nothing changes.

Once the scheduler's Kubernetes discovery calls `update` (from its EndpointSlice watch), the
fleet is the replicas discovered and *joined*, its members. A call goes to every member at once and
is answered from all of them: it succeeds only when every member succeeded (a failure names each
replica that failed, as one grpc.aio.AioRpcError with the first failure's code, so that the run's own
handling of codes is unchanged); GetWeightVersion answers the lowest version (and a checkpoint only
when all agree on it), so a push reaches only if it reached every replica. A member that fails a
LoadWeights is taken out (published out of routing, then joined again): it may serve the old weights.

Joining: a replica new in a discovered list is first brought to the weights the members serve (the
checkpoint of the last load, or the trainer's checkpoint of a version pushed by path 2; no load when
it already serves them), to the adapter version the members serve (a run's scheduler: the last
LoadAdapter of each adapter name; the replica's adapter loads nothing when it serves it already), and
into the state the run has put them in (asleep, paused), and only then published (tether.common.replicas.publish), so the gateway never routes to stale weights. Joins and
calls take one lock, so a push and a join never interleave: a replica joins before a load (and is
loaded with the others) or after it (and is loaded with its checkpoint). A join that fails is tried
again (backoff) while the replica is still listed. A replica no longer listed is published out at
once, without waiting for the lock, and its channel is closed, which ends its calls in flight (their
failure no longer counts: it is not a member any more).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import Gauge

from tether.common import replicas as published
from tether.common.broker import Keys
from tether.common.grpc_server import cancel_until_done, channel
from tether.common.records import InferenceReplica
from tether.common.retry import Retrying, backoff
from tether.v1 import inference_pb2, inference_pb2_grpc, types_pb2

log = logging.getLogger(__name__)

SOURCE = "kubernetes"

REPLICAS = Gauge(
    "tether_scheduler_inference_replicas",
    "Discovered inference replicas: serving (joined, published) or joining (not yet at the run's weights)",
    ["state"],
)

Key = tuple[str, str, str]  # name, vllm_url, control_address: a replica whose address changed is another


def key(replica: InferenceReplica) -> Key:
    return replica.name, replica.vllm_url, replica.control_address


@dataclass
class Member:
    replica: InferenceReplica
    stub: Any  # the Inference stub of its control adapter (Retrying; LoadWeights exempt)
    close: Callable[[], Any]  # closes its channel (ending its calls in flight)


def connect(replica: InferenceReplica) -> Member:
    """A replica's control adapter, reached as main.py reaches the one adapter."""
    ch = channel(replica.control_address)
    stub = Retrying(inference_pb2_grpc.InferenceStub(ch), exempt={"LoadWeights"})
    return Member(replica, stub, ch.close)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def combined_error(failures: list[tuple[InferenceReplica, BaseException]]) -> grpc.aio.AioRpcError:
    """One error for the replicas that failed a call, naming each; the first one's gRPC code."""
    first = failures[0][1]
    code = first.code() if isinstance(first, grpc.aio.AioRpcError) else grpc.StatusCode.UNKNOWN
    parts = [
        f"inference replica {r.name} ({r.control_address}): "
        + (f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError) else repr(exc))
        for r, exc in failures
    ]
    return rpc_error(code, "; ".join(parts))


class InferenceFleet:
    def __init__(
        self,
        single: Any,
        r: Any,
        keys: Keys,
        trainer: Any = None,
        connect: Callable[[InferenceReplica], Member] = connect,
        load_timeout_s: float = 1800.0,
        call_timeout_s: float = 60.0,
        join_backoff_s: float = 1.0,
    ) -> None:
        self.single: Any = single  # the inference_address stub; None once discovery took over
        self.r = r
        self.keys = keys
        self.trainer = trainer  # for the checkpoint of a version pushed by path 2 (GetStatus)
        self._connect = connect
        self.load_timeout_s = load_timeout_s
        self.call_timeout_s = call_timeout_s
        self.join_backoff_s = join_backoff_s  # a failed join is tried again after backoff (full jitter)
        self.members: dict[Key, Member] = {}
        self.pending: dict[Key, InferenceReplica] = {}  # discovered, not joined yet
        self.failures: dict[Key, str] = {}  # why a pending replica's last join failed
        # What every member serves, (checkpoint_dir, version); None until a call tells (a load, or
        # versions all members agree on). checkpoint_dir "" with a version > 0: pushed by path 2.
        self.weights: tuple[str, int] | None = None
        self.paused: str | None = None  # the Pause mode the run left the members in
        self.adapters: dict[str, str] = {}  # adapter name -> the directory every member serves it from
        self.asleep: int | None = None  # the Sleep level
        self._lock = asyncio.Lock()  # calls and joins, one at a time
        self._publish_lock = asyncio.Lock()  # one publish at a time (each reads, then writes the set)
        self._joiner: asyncio.Task | None = None
        self._joins: dict[Key, asyncio.Future] = {}  # joins under way (cancelled when one goes away)
        self._tried = asyncio.Condition()  # notified after every round of joins
        self._unpublished = False  # the last publish failed (Redis): publish again
        REPLICAS.labels("serving").set_function(lambda: len(self.members))
        REPLICAS.labels("joining").set_function(lambda: len(self.pending))

    # --- the Inference surface the run calls ---------------------------------------------------------

    async def GetWeightVersion(self, req: types_pb2.Empty, **kw: Any) -> inference_pb2.WeightVersion:
        async with self._lock:
            if self.single is not None:
                answer = await self.single.GetWeightVersion(req, **kw)
                self._agreed([answer])
                return answer
            answers = await self._all("GetWeightVersion", req, kw)
            if not answers:  # no replica: what the fleet last served (none known: the base model)
                checkpoint_dir, version = self.weights or ("", 0)
                return inference_pb2.WeightVersion(version=version, checkpoint_dir=checkpoint_dir)
            self._agreed(answers)
            dirs = {a.checkpoint_dir for a in answers}
            alike = len({a.version for a in answers}) == 1 and len(dirs) == 1
            return inference_pb2.WeightVersion(
                version=min(a.version for a in answers), checkpoint_dir=dirs.pop() if alike else ""
            )

    async def LoadWeights(
        self, req: inference_pb2.LoadWeightsRequest, **kw: Any
    ) -> inference_pb2.WeightVersion:
        async with self._lock:
            if self.single is not None:
                answer = await self.single.LoadWeights(req, **kw)
                self._loaded(req, answer)
                return answer
            await self._adopt()
            members = list(self.members.values())
            results = await self._gather(members, "LoadWeights", req, kw)
            still = [(m, res) for m, res in zip(members, results, strict=True) if self._member(m)]
            failed = [(m, res) for m, res in still if isinstance(res, BaseException)]
            odd = [res.version for _, res in still if not isinstance(res, BaseException)]
            odd = [v for v in odd if v != req.version]
            answer = inference_pb2.WeightVersion(
                version=odd[0] if odd else req.version, checkpoint_dir=req.checkpoint_dir
            )
            if len(failed) < len(still) or not still:
                self._loaded(req, answer)  # what the members left serve
            if failed:
                # It may serve the old weights (restored) or none (paused): out of routing, join again.
                for m, _ in failed:
                    del self.members[key(m.replica)]
                    self.pending[key(m.replica)] = m.replica
                    await _closed(m)
                self._join_later()
                with contextlib.suppress(Exception):  # Redis away: published by the next round
                    await self._publish()
                raise combined_error([(m.replica, exc) for m, exc in failed])
            return answer

    async def Pause(self, req: inference_pb2.PauseRequest, **kw: Any) -> types_pb2.Empty:
        return await self._each("Pause", req, kw, paused=req.mode or "keep")

    async def Resume(self, req: types_pb2.Empty, **kw: Any) -> types_pb2.Empty:
        return await self._each("Resume", req, kw, paused=None)

    async def Sleep(self, req: inference_pb2.SleepRequest, **kw: Any) -> types_pb2.Empty:
        return await self._each("Sleep", req, kw, asleep=req.level or 1)

    async def WakeUp(self, req: types_pb2.Empty, **kw: Any) -> types_pb2.Empty:
        return await self._each("WakeUp", req, kw, asleep=None)

    async def LoadAdapter(self, req: inference_pb2.LoadAdapterRequest, **kw: Any) -> types_pb2.Empty:
        # Every member; a replica that joins later is brought to the newest directory loaded.
        return await self._each(
            "LoadAdapter", req, kw, adapters={**self.adapters, req.adapter: req.adapter_dir}
        )

    # --- fan-out --------------------------------------------------------------------------------------

    async def _each(self, method: str, req: Any, kw: dict, **state: Any) -> types_pb2.Empty:
        """A call without an answer; once it succeeded, the state it put the replicas in (`paused`,
        `asleep`) is what a joining replica is put in too."""
        async with self._lock:
            if self.single is not None:
                result: types_pb2.Empty = await getattr(self.single, method)(req, **kw)
            else:
                await self._all(method, req, kw)
                result = types_pb2.Empty()
            for name, value in state.items():
                setattr(self, name, value)
            return result

    async def _all(self, method: str, req: Any, kw: dict) -> list[Any]:
        """Every member's answer (the lock held), or one error naming those that failed; a replica that
        went away during the call does not count."""
        await self._adopt()
        members = list(self.members.values())
        results = await self._gather(members, method, req, kw)
        still = [(m, res) for m, res in zip(members, results, strict=True) if self._member(m)]
        failures = [(m.replica, res) for m, res in still if isinstance(res, BaseException)]
        if failures:
            raise combined_error(failures)
        return [res for _, res in still]

    @staticmethod
    async def _gather(members: list[Member], method: str, req: Any, kw: dict) -> list[Any]:
        calls = (getattr(m.stub, method)(req, **kw) for m in members)
        return await asyncio.gather(*calls, return_exceptions=True)

    def _member(self, m: Member) -> bool:
        return self.members.get(key(m.replica)) is m

    # --- what the members serve ----------------------------------------------------------------------

    def _loaded(self, req: inference_pb2.LoadWeightsRequest, answer: inference_pb2.WeightVersion) -> None:
        if answer.version == req.version:
            self.weights = (req.checkpoint_dir, req.version)
        self.paused = None  # a load resumes generation (tether.inference.weights)

    def _agreed(self, answers: list[inference_pb2.WeightVersion]) -> None:
        """Weights every member reports alike are what the fleet serves (a path-2 push reports no
        checkpoint: the one known for that version is kept)."""
        if len({(a.version, a.checkpoint_dir) for a in answers}) != 1:
            return
        version, checkpoint_dir = answers[0].version, answers[0].checkpoint_dir
        if not checkpoint_dir and self.weights is not None and self.weights[1] == version:
            checkpoint_dir = self.weights[0]
        self.weights = (checkpoint_dir, version)

    # --- discovered replicas -------------------------------------------------------------------------

    async def update(self, discovered: list[InferenceReplica]) -> None:
        """The replicas discovered now (all of them). Those gone are published out at once (never
        waiting for a push) and their channels closed; those new join in the background (`settled`
        waits for their first try). The first call hands the run from the configured adapter to the
        discovered replicas. Never raises for Redis: a set not published is published again later."""
        if self.single is not None:
            log.info("inference replicas discovered: weights go to each of them from now on")
            self.single = None
        want = {key(x): x for x in discovered}
        gone = [m for k, m in self.members.items() if k not in want]
        for m in gone:
            del self.members[key(m.replica)]
            log.info("inference replica %s (%s) went away", m.replica.name, m.replica.control_address)
        for k in [k for k in self.pending if k not in want]:
            del self.pending[k]
            self.failures.pop(k, None)
            join = self._joins.pop(k, None)
            if join is not None:
                join.cancel()
        for k, x in want.items():
            if k not in self.members and k not in self.pending:
                self.pending[k] = x
        for m in gone:
            await _closed(m)  # ends its calls in flight
        if gone or not want or self._unpublished:
            try:
                await self._publish()  # an empty list is news too: the gateway stops its configured URLs
            except Exception as exc:
                log.warning("inference replicas not published (%r): trying again", exc)
        self._join_later()
        await self._notify()  # one that went away is no longer waited for

    async def settled(self) -> None:
        """Wait until every replica discovered has joined or failed its latest try."""
        async with self._tried:
            await self._tried.wait_for(lambda: all(k in self.failures for k in self.pending))

    def status(self) -> dict[str, Any]:
        return {
            "serving": sorted(m.replica.name for m in self.members.values()),
            "joining": {x.name: self.failures.get(k, "") for k, x in sorted(self.pending.items())},
            "weights": self.weights,
            "adapters": dict(self.adapters),
        }

    async def aclose(self) -> None:
        if self._joiner is not None:
            await cancel_until_done(self._joiner)  # a cancel can be lost inside a Redis read
        for m in list(self.members.values()):
            await _closed(m)
        self.members.clear()

    def _join_later(self) -> None:
        if (self.pending or self._unpublished) and (self._joiner is None or self._joiner.done()):
            self._joiner = asyncio.create_task(self._join_pending())

    async def _join_pending(self) -> None:
        attempt = 0
        while self.pending or self._unpublished:
            try:
                async with self._lock:
                    await self._join_round()
                    if self._unpublished:
                        await self._publish()
            except Exception as exc:  # Redis not answering: the joined stay joined, published later
                log.warning("inference replicas: %r; trying again", exc)
            if self.pending or self._unpublished:
                await asyncio.sleep(backoff(attempt, self.join_backoff_s, 30.0))
                attempt += 1

    async def _adopt(self) -> None:
        """Before a call while the weights are not known yet (a scheduler that just started): the
        pending replicas join as they are, so that the call (the run's reconcile) reaches them."""
        if self.weights is None and self.pending:
            await self._join_round()

    async def _join_round(self) -> None:
        """Join every pending replica at once (the lock held); publish those that joined."""
        batch = list(self.pending.items())
        self._joins = {k: asyncio.ensure_future(self._join(x)) for k, x in batch}
        results = await asyncio.gather(*self._joins.values(), return_exceptions=True)
        self._joins = {}
        joined = False
        for (k, x), res in zip(batch, results, strict=True):
            if isinstance(res, Member):
                if self.pending.pop(k, None) is None:  # went away while it joined
                    await _closed(res)
                    continue
                self.failures.pop(k, None)
                self.members[k] = res
                joined = True
                log.info("inference replica %s joined (version %d)", x.name, (self.weights or ("", 0))[1])
            elif k in self.pending:
                self.failures[k] = str(res) or repr(res)
                log.warning("inference replica %s did not join (tried again later): %s", x.name, res)
        if joined:
            try:
                await self._publish()
            except Exception as exc:  # joined all the same: the joiner publishes them once Redis answers
                log.warning("inference replicas not published (%r): trying again", exc)
                self._join_later()
        await self._notify()

    async def _notify(self) -> None:
        async with self._tried:
            self._tried.notify_all()

    async def _join(self, replica: InferenceReplica) -> Member:
        member = self._connect(replica)
        try:
            if self.weights is None:  # adopted as it is: the run's first call brings it along
                await member.stub.GetWeightVersion(types_pb2.Empty(), timeout=self.call_timeout_s)
                await self._bring_adapters(member)
            else:
                await self._bring(member, *self.weights)
        except BaseException:
            await _closed(member)
            raise
        return member

    async def _bring(self, member: Member, checkpoint_dir: str, version: int) -> None:
        """Bring a replica to the weights the members serve, in the state they are in."""
        stub, name = member.stub, member.replica.name
        served = await stub.GetWeightVersion(types_pb2.Empty(), timeout=self.call_timeout_s)
        # No checkpoint on either side (a path-2 push) with the same version: the same weights.
        current = served.version == version and (
            not served.checkpoint_dir or not checkpoint_dir or served.checkpoint_dir == checkpoint_dir
        )
        if not current:
            if not checkpoint_dir:  # pushed by path 2 (or the base model): the trainer's checkpoint
                status = await self.trainer.GetStatus(types_pb2.Empty()) if self.trainer is not None else None
                if status is None or status.weight_version != version or not status.checkpoint_dir:
                    # Tried again after the run's next load, which names one.
                    raise RuntimeError(
                        f"it serves version {served.version}; no checkpoint known for version {version}"
                    )
                checkpoint_dir = status.checkpoint_dir
            log.info(
                "inference replica %s serves version %d: loading %s", name, served.version, checkpoint_dir
            )
            loaded = await stub.LoadWeights(
                inference_pb2.LoadWeightsRequest(checkpoint_dir=checkpoint_dir, version=version),
                timeout=self.load_timeout_s,
            )
            if loaded.version != version:
                raise RuntimeError(f"it reports version {loaded.version} after loading version {version}")
        await self._bring_adapters(member)
        if self.paused is not None:
            await stub.Pause(inference_pb2.PauseRequest(mode=self.paused), timeout=self.call_timeout_s)
        elif current:  # (a load resumes) a push cut short may have left it paused
            await stub.Resume(types_pb2.Empty(), timeout=self.call_timeout_s)
        if self.asleep is not None:
            await stub.Sleep(inference_pb2.SleepRequest(level=self.asleep), timeout=self.call_timeout_s)

    async def _bring_adapters(self, member: Member) -> None:
        """Serve every adapter at the version the members serve it (a run's: its newest version)."""
        for adapter, adapter_dir in self.adapters.items():
            log.info("inference replica %s: serving %s from %s", member.replica.name, adapter, adapter_dir)
            await member.stub.LoadAdapter(
                inference_pb2.LoadAdapterRequest(adapter=adapter, adapter_dir=adapter_dir),
                timeout=self.call_timeout_s,
            )

    async def _publish(self) -> None:
        """Publish the members as the set the gateway routes to (a no-op when it did not change). Until
        that succeeds, `_unpublished` says so: the next update or round of joins publishes again."""
        async with self._publish_lock:
            self._unpublished = True
            routed = [m.replica for m in self.members.values()]
            new = await published.publish(self.r, self.keys, routed, SOURCE)
            self._unpublished = False
            if new is not None:
                log.info(
                    "replica set %d published: %s", new.version, ", ".join(x.name for x in routed) or "none"
                )


async def _closed(member: Member) -> None:
    with contextlib.suppress(Exception):
        result = member.close()
        if asyncio.iscoroutine(result):
            await result
