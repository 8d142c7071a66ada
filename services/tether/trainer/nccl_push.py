"""Path 2 of the weight push: stream the trainer's weights straight into vLLM's workers.

The trainer is rank 0 of a small process group it shares with the vLLM workers (ranks 1..N). Per
bucket of at most `bucket_bytes`, the metadata (names, dtype names, shapes) goes over HTTP
(`/update_weights`) while the bucket's tensors, packed into one flat uint8 buffer, go out in one
broadcast; vLLM's workers cut the same buffer back into tensors from the metadata and load them. On
GPUs the group is NCCL (vLLM's StatelessProcessGroup + PyNcclCommunicator); on CPU, for tests, the same
code runs over a gloo group.

Wire format (must match vLLM's packed NCCL consumer, vllm/distributed/weight_transfer/packed_tensor.py):
each tensor, made contiguous and viewed as bytes, follows the previous one with no padding; its size is
prod(shape) * itemsize. The workers receive with `packed=True` and `packed_buffer_size_bytes` =
`bucket_bytes` (set at init): they close a chunk once it exceeds that size, so a bucket that stays
within it (or holds one tensor) is exactly one broadcast. vLLM views each slice in place, which needs
the slice's offset to be a multiple of the dtype's size: the planner starts a new bucket rather than
misalign a tensor.

`push_weights` takes any client with the four methods of `WeightSyncClient`
(tether.trainer.weight_transfer.WeightTransferClient, vLLM's HTTP routes, is one). The trainer service
(`PushWeights`) drives it; the scheduler decides when (docs/weight-push.md).

Collectives run on daemon threads. A collective blocked in C++ (GIL released) that wakes up while the
interpreter finalizes is ended by CPython 3.11 with pthread_exit, whose unwinding aborts the process
inside pybind11 ("terminate called without an active exception", exit 134). So at exit this module
waits for the collectives that will give up by themselves (gloo timeouts, rendezvous); NCCL
broadcasts that never return stay blocked, harmlessly, until the process is gone.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 << 20


# -- bucketing (pure) ---------------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    """The name vLLM resolves with getattr(torch, name): torch.bfloat16 -> "bfloat16"."""
    name = str(dtype).split(".")[-1]
    if getattr(torch, name, None) != dtype:
        raise ValueError(f"dtype {dtype} has no torch.<name> alias vLLM could resolve")
    return name


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, cast_floats_to: torch.dtype | None = None) -> TensorSpec:
        dtype = cast_floats_to if cast_floats_to is not None and tensor.is_floating_point() else tensor.dtype
        return cls(name, dtype, tuple(int(d) for d in tensor.shape))


@dataclass(frozen=True)
class Bucket:
    index: int
    specs: tuple[TensorSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def update_info(self) -> dict[str, Any]:
        """vLLM's NCCLWeightTransferUpdateInfo for this bucket, JSON-ready."""
        return {
            "names": self.names,
            "dtype_names": [dtype_name(s.dtype) for s in self.specs],
            "shapes": [list(s.shape) for s in self.specs],
        }


def plan_buckets(
    state: Mapping[str, torch.Tensor] | Iterable[TensorSpec],
    bucket_bytes: int,
    *,
    cast_floats_to: torch.dtype | None = None,
) -> list[Bucket]:
    """Split a state dict into buckets, in its own order, each tensor in exactly one bucket.

    A bucket holds at most `bucket_bytes`, except that a tensor larger than that travels alone. A new
    bucket also starts where the next tensor's byte offset would not be a multiple of its element size
    (vLLM views each slice of the received buffer in place). `cast_floats_to` (e.g. the serving dtype,
    torch.bfloat16, for fp32 master weights) sends floating-point tensors in that dtype, cast bucket by
    bucket when packed."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    specs = (
        [TensorSpec.of(k, v, cast_floats_to) for k, v in state.items()]
        if isinstance(state, Mapping)
        else list(state)
    )
    seen: set[str] = set()
    buckets: list[Bucket] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"tensor {spec.name!r} appears twice")
        seen.add(spec.name)
        dtype_name(spec.dtype)  # fail early on a dtype vLLM cannot name
        if current and (size + spec.nbytes > bucket_bytes or size % spec.dtype.itemsize):
            buckets.append(Bucket(len(buckets), tuple(current)))
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        buckets.append(Bucket(len(buckets), tuple(current)))
    return buckets


def _local_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if hasattr(tensor, "full_tensor"):
        # Gathering a DTensor is a collective of every trainer rank; only rank 0 pushes.
        raise TypeError(f"{name} is a sharded DTensor: gather the full state dict on all ranks first")
    return tensor.detach()


def pack_bucket(
    bucket: Bucket, state: Mapping[str, torch.Tensor], device: torch.device | str | None = None
) -> torch.Tensor:
    """The bucket's tensors as one flat uint8 buffer (on `device`, default where the tensors are), each
    floating-point tensor cast to its planned dtype. A one-tensor bucket may share the tensor's storage."""
    parts = []
    for spec in bucket.specs:
        tensor = _local_tensor(spec.name, state[spec.name])
        if device is not None:
            tensor = tensor.to(device)
        if tensor.dtype != spec.dtype and tensor.is_floating_point() and spec.dtype.is_floating_point:
            tensor = tensor.to(spec.dtype)
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise ValueError(
                f"{spec.name}: planned {spec.dtype} {spec.shape}, the state now holds "
                f"{tensor.dtype} {tuple(tensor.shape)}"
            )
        parts.append(tensor.contiguous().reshape(-1).view(torch.uint8))
    if not parts:
        return torch.empty(0, dtype=torch.uint8, device=device)
    # One tensor: its own bytes (no copy; a broadcast only reads the root's buffer).
    flat = torch.cat(parts) if len(parts) > 1 else parts[0]
    assert flat.numel() == bucket.nbytes
    return flat


def unpack_bucket(flat: torch.Tensor, update_info: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Inverse of `pack_bucket`, from the metadata alone (what a worker knows). Returns copies."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, dname, shape in zip(
        update_info["names"], update_info["dtype_names"], update_info["shapes"], strict=True
    ):
        dtype = getattr(torch, dname)
        n = math.prod(shape) * dtype.itemsize
        raw = flat[offset : offset + n].clone()  # a fresh, aligned storage for the dtype view
        out[name] = raw.view(dtype).reshape(shape)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"buffer holds {flat.numel()} bytes, the metadata describes {offset}")
    return out


# -- the transfer group ------------------------------------------------------------------------------


class TransferGroup(Protocol):
    rank: int
    world_size: int
    device: torch.device
    gives_up_after_s: float | None  # how long a broadcast waits for missing peers (None: forever)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Blocking: returns once `tensor` went out (src) or arrived (others)."""
        ...

    def close(self) -> None: ...


class GlooTransferGroup:
    """CPU stand-in for the NCCL group (tests; vLLM's CPU build has no transfer engine)."""

    def __init__(self, pg: Any, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        self.pg, self.store, self.rank, self.world_size = pg, store, rank, world_size
        self.device = torch.device("cpu")
        self.gives_up_after_s: float | None = timeout_s  # a broadcast whose peer is gone fails then

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.pg is None:
            raise RuntimeError("transfer group closed")
        self.pg.broadcast(tensor, src).wait()

    def close(self) -> None:
        # Only drop it: ProcessGroupGloo.abort() waits out a broadcast whose peer is gone (the full
        # timeout); that broadcast fails on its own thread when the timeout expires.
        self.pg, self.store = None, None


class NcclTransferGroup:
    """The trainer's end of vLLM's NCCL transfer group (a vLLM PyNcclCommunicator)."""

    gives_up_after_s: float | None = None  # an NCCL broadcast without its peers blocks for good

    def __init__(self, comm: Any, rank: int, world_size: int, device: torch.device) -> None:
        self.comm, self.rank, self.world_size, self.device = comm, rank, world_size, device

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        if self.comm is None:
            raise RuntimeError("transfer group closed")
        # Runs on a helper thread: name the device, or CUDA would use device 0 there.
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream(self.device)
            self.comm.broadcast(tensor, src=src, stream=stream)
            stream.synchronize()  # the caller frees or reuses the buffer next

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            try:
                comm.destroy()  # vLLM's destroy: ncclCommAbort, waited for at most 5 s
            except Exception:  # noqa: BLE001
                log.warning("destroying the NCCL transfer communicator failed", exc_info=True)


def _cuda_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"the NCCL transfer group needs a CUDA device, not {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def _vllm_nccl_communicator(
    master_address: str, master_port: int, rank: int, world_size: int, device: torch.device, timeout_s: float
) -> Any:
    """vLLM's own rendezvous: StatelessProcessGroup (rank 0 hosts the TCPStore) + PyNcclCommunicator,
    through vLLM's helper where it has one (it also unpins vLLM's NCCL environment settings)."""
    try:
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
    except ImportError:
        stateless_init_process_group = None
    if stateless_init_process_group is not None:
        return stateless_init_process_group(master_address, master_port, rank, world_size, device)
    try:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
    except ImportError as exc:
        raise RuntimeError(
            "the NCCL weight push joins vLLM's own rendezvous: install the vLLM version "
            "the inference server runs in the trainer's environment"
        ) from exc
    pg = StatelessProcessGroup.create(
        host=master_address, port=master_port, rank=rank, world_size=world_size, store_timeout=int(timeout_s)
    )
    return PyNcclCommunicator(pg, device=device)


def create_transfer_group(
    master_address: str,
    master_port: int,
    world_size: int,
    *,
    rank: int = 0,
    backend: str = "nccl",
    device: torch.device | str | int | None = None,
    timeout_s: float = 600.0,
) -> TransferGroup:
    """Join (rank 0: host) the transfer group. Blocks until every rank has joined, so the trainer runs
    it while vLLM answers /init_weight_transfer_engine.

    "nccl" needs CUDA and vLLM importable in the trainer: vLLM's workers rendezvous through vLLM's
    StatelessProcessGroup and talk through its PyNcclCommunicator, so the trainer must speak the same.
    "gloo" is a CPU group over a torch TCPStore (rank 0 hosts it), for tests and non-vLLM peers; its
    collectives time out after `timeout_s` (NCCL's never do)."""
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("the NCCL weight push needs a CUDA device; on CPU push checkpoints (path 1)")
        dev = _cuda_device(device)
        with torch.cuda.device(dev):
            comm = _vllm_nccl_communicator(master_address, master_port, rank, world_size, dev, timeout_s)
        return NcclTransferGroup(comm, rank, world_size, dev)
    if backend == "gloo":
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, rank == 0, timeout)
        pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        return GlooTransferGroup(pg, store, rank, world_size, timeout_s)
    raise ValueError(f"unknown transfer backend {backend!r} (nccl, gloo)")


# -- the push -------------------------------------------------------------------------------------------


class WeightSyncClient(Protocol):
    async def start_weight_update(self) -> None: ...

    async def update_weights(self, update_info: dict[str, Any]) -> None: ...

    async def finish_weight_update(self, weight_version: str | int | None = None) -> None: ...


class PushError(RuntimeError):
    """A push failed at `step` ("init", "start", "update", "finish"; `bucket` for updates). vLLM's
    weight version is unchanged (only a finished push sets it), but see `retry_from`:

    - "start": the group is in step and no session is open (start or finish failed, or a bucket could not
      be packed and the session was closed); push again on the same group.
    - "init": a bucket's transfer went wrong. The workers may have loaded earlier buckets already (vLLM applies
      complete layers as they arrive), and the group's byte stream cannot be trusted (an NCCL root can
      complete a small broadcast no worker consumed): drop the group, shut the workers' side down,
      re-initialise, then push everything again. Keep generation paused meanwhile."""

    def __init__(self, step: str, message: str, *, retry_from: str, bucket: int | None = None) -> None:
        super().__init__(f"weight push {step}{'' if bucket is None else f' (bucket {bucket})'}: {message}")
        self.step, self.retry_from, self.bucket = step, retry_from, bucket


@dataclass(frozen=True)
class PushReport:
    version: str
    buckets: int
    tensors: int
    bytes: int
    seconds: float


# Collective threads still running -> when they give up by themselves (time.monotonic(); inf: never).
_running: dict[threading.Thread, float] = {}
EXIT_WAIT_CAP_S = 60.0
# How long past its deadline a collective may still take to return: gloo's rendezvous gives up about
# 1 s after its timeout on an idle machine, later on a loaded one (a grace of 1 s aborted test runs).
EXIT_GRACE_S = 15.0


def _in_daemon_thread(fn: Callable[..., Any], *args: Any, gives_up_after_s: float | None) -> asyncio.Future:
    """Run a blocking collective on a daemon thread. Not an executor: a collective whose peer never
    comes can block for good (NCCL has no timeout), and an executor thread would then hold up exit.
    `gives_up_after_s`: how long the call can block before it fails by itself (None: never)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            outcome = (False, exc)
        else:
            outcome = (True, result)
        finally:
            _running.pop(threading.current_thread(), None)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is gone: nobody is waiting any more
            pass

    thread = threading.Thread(target=target, daemon=True, name="tether-weight-transfer")
    _running[thread] = math.inf if gives_up_after_s is None else time.monotonic() + gives_up_after_s
    thread.start()
    # A future abandoned after a failure must not log "exception was never retrieved".
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return fut


@atexit.register
def _wait_for_collectives_at_exit() -> None:
    """Runs before the interpreter finalizes: let abandoned collectives that will time out do so now,
    while their threads can still take the GIL (see the module docstring)."""
    waits = {t: d for t, d in list(_running.items()) if t.is_alive() and d != math.inf}
    if not waits:
        return
    until = min(max(waits.values()) + EXIT_GRACE_S, time.monotonic() + EXIT_WAIT_CAP_S)
    log.info(
        "waiting up to %.0fs for %d abandoned weight-transfer call(s) to time out",
        until - time.monotonic(),
        len(waits),
    )
    for thread in waits:
        thread.join(max(0.0, until - time.monotonic()))


async def _together(http: asyncio.Future, collective: asyncio.Future) -> None:
    """Await an HTTP call and the matching collective; the first failure wins, without waiting for the
    other side (which may never finish when its peer gave up)."""
    pending = {http, collective}
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for f in done:
                f.result()
    finally:
        if not http.done():
            http.cancel()


async def push_weights(
    model_state: Mapping[str, torch.Tensor],
    client: WeightSyncClient,
    group: TransferGroup,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    version: str | int | None = None,
    *,
    cast_floats_to: torch.dtype | None = None,
    buckets: list[Bucket] | None = None,
) -> PushReport:
    """One push: start_weight_update, then per bucket /update_weights (metadata) concurrently with one
    broadcast of the packed bucket, then finish_weight_update(version). Rank 0 only; `bucket_bytes` must
    not exceed the `packed_buffer_size_bytes` the workers were initialised with. `model_state` must be
    the full (gathered) state under the HF names vLLM's load_weights expects; `cast_floats_to` sends
    floating-point tensors in that dtype (vLLM would cast on load anyway: this halves fp32 traffic).
    Raises PushError."""
    if group.rank != 0:
        raise ValueError("only the transfer group's rank 0 (the trainer) pushes")
    t0 = time.perf_counter()
    plan = (
        buckets
        if buckets is not None
        else plan_buckets(model_state, bucket_bytes, cast_floats_to=cast_floats_to)
    )
    try:
        await client.start_weight_update()
    except Exception as exc:
        raise PushError("start", str(exc), retry_from="start") from exc
    total = 0
    for bucket in plan:
        try:
            flat = pack_bucket(bucket, model_state, device=group.device)
        except Exception as exc:
            # Nothing of this bucket is on the wire and the group is in step, but vLLM's session is
            # open: close it (without a version, so the served version stays) before anyone retries.
            try:
                await client.finish_weight_update(None)
            except Exception:  # noqa: BLE001
                log.warning("closing the weight-update session after a packing failure failed", exc_info=True)
            raise PushError(
                "update", f"cannot pack: {exc!r}", retry_from="start", bucket=bucket.index
            ) from exc
        if flat.is_cuda:
            # Packed on this thread's stream; the broadcast thread uses the device's default stream.
            torch.cuda.current_stream(flat.device).synchronize()
        http = asyncio.ensure_future(client.update_weights(bucket.update_info()))
        sent = _in_daemon_thread(group.broadcast, flat, 0, gives_up_after_s=group.gives_up_after_s)
        try:
            await _together(http, sent)
        except Exception as exc:
            raise PushError("update", str(exc), retry_from="init", bucket=bucket.index) from exc
        total += bucket.nbytes
        del flat
    label = None if version is None else str(version)
    try:
        await client.finish_weight_update(label)
    except Exception as exc:
        raise PushError("finish", str(exc), retry_from="start") from exc
    report = PushReport(
        version=label or "",
        buckets=len(plan),
        tensors=sum(len(b.specs) for b in plan),
        bytes=total,
        seconds=time.perf_counter() - t0,
    )
    log.info(
        "pushed weight version %s: %d tensors, %.1f MiB in %d buckets, %.2fs",
        report.version,
        report.tensors,
        report.bytes / 2**20,
        report.buckets,
        report.seconds,
    )
    return report


class WeightPusher:
    """Owns the transfer group and retries failed pushes the way PushError says: from start on the same
    group, or after dropping the group and initialising a new one (on a fresh port).

    `client` also needs `init_engine(...)` and `shutdown_engine()` (WeightTransferClient has them).
    `master_address` must be reachable from the vLLM workers; `master_port` 0 picks a free port each
    time the group is (re)created. `world_size` None asks vLLM (`1 + inference_world_size()`)."""

    def __init__(
        self,
        client: Any,
        *,
        master_address: str,
        master_port: int = 0,
        world_size: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        backend: str = "nccl",
        device: torch.device | str | int | None = None,
        timeout_s: float = 600.0,
        attempts: int = 3,
        cast_floats_to: torch.dtype | None = None,
    ) -> None:
        self.client, self.master_address, self.master_port = client, master_address, master_port
        self.world_size, self.bucket_bytes, self.backend = world_size, bucket_bytes, backend
        self.device, self.timeout_s, self.attempts = device, timeout_s, max(1, attempts)
        self.cast_floats_to = cast_floats_to
        self.group: TransferGroup | None = None
        self.port: int | None = None

    async def connect(self) -> None:
        from tether.common.net import free_port

        if self.backend == "nccl" and not torch.cuda.is_available():
            # Checked before vLLM is asked to join: its workers would wait out their store timeout.
            raise RuntimeError("the NCCL weight push needs a CUDA device; on CPU push checkpoints (path 1)")
        if self.world_size is None:
            try:
                self.world_size = 1 + await self.client.inference_world_size()
            except Exception as exc:
                raise PushError("init", f"cannot read vLLM's world size: {exc}", retry_from="init") from exc
        port = self.master_port or free_port()
        init = asyncio.ensure_future(
            self.client.init_engine(
                master_address=self.master_address,
                master_port=port,
                world_size=self.world_size,
                rank_offset=1,
                backend="nccl",
                packed=True,
                packed_buffer_size_bytes=self.bucket_bytes,
            )
        )
        joined = _in_daemon_thread(
            functools.partial(
                create_transfer_group,
                self.master_address,
                port,
                self.world_size,
                rank=0,
                backend=self.backend,
                device=self.device,
                timeout_s=self.timeout_s,
            ),
            gives_up_after_s=self.timeout_s,
        )
        try:
            await _together(init, joined)
        except Exception as exc:
            # A group that comes up after all is closed at once; one that never does times out.
            joined.add_done_callback(lambda f: f.cancelled() or f.exception() or f.result().close())
            raise PushError("init", str(exc), retry_from="init") from exc
        self.group, self.port = joined.result(), port

    async def reset(self) -> None:
        """Drop the group on both sides (best effort: a failed update may have left vLLM refusing)."""
        group, self.group = self.group, None
        try:
            await self.client.shutdown_engine()
        except Exception as exc:  # noqa: BLE001
            log.warning("shutdown_weight_transfer_engine failed (%s); re-initialising anyway", exc)
        if group is not None:
            await asyncio.to_thread(group.close)  # NCCL: ncclCommAbort, which ends a stuck broadcast

    async def push(self, model_state: Mapping[str, torch.Tensor], version: str | int) -> PushReport:
        last: PushError | None = None
        for attempt in range(1, self.attempts + 1):
            try:
                if self.group is None:
                    await self.connect()
                assert self.group is not None
                return await push_weights(
                    model_state,
                    self.client,
                    self.group,
                    self.bucket_bytes,
                    version,
                    cast_floats_to=self.cast_floats_to,
                )
            except PushError as exc:
                last = exc
                log.warning("weight push attempt %d/%d failed: %s", attempt, self.attempts, exc)
                if exc.retry_from == "init":
                    await self.reset()
        assert last is not None
        raise last

    async def close(self) -> None:
        if self.group is not None:
            await self.reset()
