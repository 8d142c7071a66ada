"""Async client for vLLM's native weight-transfer routes (path 2 of the weight push, GPUs only).

It lives with the trainer because the trainer drives path 2: it broadcasts the tensors while these
routes tell vLLM's workers what to receive (tether.trainer.nccl_push), so both halves must be issued
by the same process. The inference adapter keeps path 1 (checkpoint reloads) and pause/resume.

vLLM serves these routes when started with `VLLM_SERVER_DEV_MODE=1` and
`--weight-transfer-config '{"backend": "nccl"}'` (read from vllm/entrypoints/rl/online/api_router.py
and vllm/distributed/weight_transfer/ of vLLM 0.32):

    POST /init_weight_transfer_engine      {"init_info": {...}}      once: the workers join the trainer's
                                                                     process group (blocks until they have)
    POST /start_weight_update              (no body)                 opens a session (layerwise reload)
    POST /update_weights                   {"update_info": {...}}    per bucket: the workers receive the
                                                                     bucket's broadcast and load it
    POST /finish_weight_update             {"weight_version": "7"}   closes the session, sets the version
    POST /shutdown_weight_transfer_engine  (no body)                 drops the group (refused mid-session)

For the NCCL backend `init_info` is `NCCLWeightTransferInitInfo` (master_address, master_port,
rank_offset, world_size, packed, packed_buffer_size_bytes, packed_num_buffers; unknown keys are
rejected) and `update_info` is `NCCLWeightTransferUpdateInfo` (names, dtype_names, shapes).

Failure semantics (vLLM 0.32 has no abort route): if a worker fails inside `update_weights`, vLLM closes
the session itself (`finish_weight_update` then answers an error) and the weight version stays the old
one, but layers whose tensors had all arrived were already copied into the live model. So keep
generation paused, and run the whole push again from `start_weight_update` (after re-initialising the
transfer group, see tether.trainer.nccl_push) before resuming. This client mirrors that state machine
locally: it refuses calls out of order without sending them, and after a failed update it is back to
"ready", so `finish_weight_update` is refused until a new `start_weight_update`.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

import httpx

from tether.common.vllm_client import VLLMControl, VLLMError

log = logging.getLogger(__name__)

# vLLM's own default for the packed transfer buffer (packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES).
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
DEFAULT_PACKED_NUM_BUFFERS = 2


class TransferState(enum.Enum):
    IDLE = "idle"  # no transfer group (never initialised, shut down, or init failed)
    READY = "ready"  # group up, no session open
    UPDATING = "updating"  # between start_weight_update and finish_weight_update


class WeightTransferError(RuntimeError):
    """A weight-transfer call failed: `step` is the route's step ("init", "start", "update", "finish",
    "shutdown"), `status` the HTTP status (None when no answer came back), `detail` vLLM's error
    message, `sent` False when the client refused the call before sending it (called out of order)."""

    def __init__(
        self, step: str, message: str, *, status: int | None = None, detail: str = "", sent: bool = True
    ) -> None:
        super().__init__(f"weight transfer {step}: {message}")
        self.step = step
        self.status = status
        self.detail = detail
        self.sent = sent


def _error_detail(resp: httpx.Response) -> str:
    """vLLM answers {"error": {"message": ...}} (its exception handlers) or {"detail": ...} (FastAPI
    validation, HTTPException); fall back to the raw text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if isinstance(err, str):
            return err[:500]
        if "detail" in body:
            return str(body["detail"])[:500]
    return resp.text[:500]


class WeightTransferClient:
    """One inference server's weight-transfer control plane. Not safe for concurrent pushes: one
    session at a time, driven by one trainer (rank 0 of the transfer group)."""

    def __init__(
        self, base_url: str, *, timeout_s: float = 600.0, http: httpx.AsyncClient | None = None
    ) -> None:
        # update_weights returns only once the workers have received (and loaded) the bucket, and init
        # only once the NCCL group is up: the timeout must cover a whole bucket transfer.
        self._own_http = http is None
        self.http = http or httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s)
        self.control = VLLMControl(base_url, http=self.http)  # the dev-mode routes, on the same connection
        self.state = TransferState.IDLE
        self.updates_sent = 0  # update_weights calls that succeeded in the open session

    async def close(self) -> None:
        if self._own_http:
            await self.http.aclose()

    async def __aenter__(self) -> WeightTransferClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- plumbing ---------------------------------------------------------------------------------

    def _require(self, step: str, *allowed: TransferState) -> None:
        if self.state not in allowed:
            want = " or ".join(s.value for s in allowed)
            raise WeightTransferError(
                step, f"called in state {self.state.value!r}, needs {want} (not sent)", sent=False
            )

    async def _post(self, step: str, path: str, json: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            resp = await self.http.post(path, json=json)
        except httpx.HTTPError as exc:
            raise WeightTransferError(step, f"POST {path} got no answer: {exc!r}") from exc
        if resp.status_code >= 400:
            detail = _error_detail(resp)
            raise WeightTransferError(
                step, f"POST {path} -> {resp.status_code}: {detail}", status=resp.status_code, detail=detail
            )
        try:
            return resp.json() if resp.content else {}
        except ValueError:
            return {}

    # -- the four-phase protocol ------------------------------------------------------------------

    async def init_engine(
        self,
        *,
        master_address: str,
        master_port: int,
        world_size: int,
        rank_offset: int = 1,
        backend: str = "nccl",
        packed: bool = True,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    ) -> None:
        """Ask the workers to join the transfer group at `master_address:master_port` (the trainer,
        rank 0, hosts the TCP store). Worker i takes rank `rank_offset + i`; `world_size` counts the
        trainer and every worker (TP x PP x DP). vLLM blocks until the group is up, so the trainer
        must create its side of the group concurrently with this call.

        `backend` is fixed when vLLM starts (`--weight-transfer-config`); only "nccl" is spoken here.
        With `packed`, the workers cut their receive stream into chunks of at most
        `packed_buffer_size_bytes` (a chunk closes once it exceeds that size): a trainer that sends one
        broadcast per update must keep every multi-tensor bucket within it."""
        if backend != "nccl":
            raise ValueError(f"backend {backend!r}: this client speaks the NCCL init info only")
        if world_size < rank_offset + 1:
            raise ValueError(
                f"world_size {world_size} leaves no rank for the workers (rank_offset {rank_offset})"
            )
        self._require("init", TransferState.IDLE, TransferState.READY)
        init_info = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
            "packed": bool(packed),
            "packed_buffer_size_bytes": int(packed_buffer_size_bytes),
            "packed_num_buffers": int(packed_num_buffers),
        }
        self.state = TransferState.IDLE
        await self._post("init", "/init_weight_transfer_engine", {"init_info": init_info})
        self.state = TransferState.READY

    async def start_weight_update(self) -> None:
        self._require("start", TransferState.READY)
        await self._post("start", "/start_weight_update")
        self.state = TransferState.UPDATING
        self.updates_sent = 0

    async def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """One bucket: `{"names": [...], "dtype_names": [...], "shapes": [[...], ...]}` (or a list of
        such dicts, one per worker rank). Returns once the workers have received and loaded it; the
        trainer's broadcast of the bucket must run concurrently."""
        self._require("update", TransferState.UPDATING)
        infos = update_info if isinstance(update_info, list) else [update_info]
        for info in infos:
            n = len(info.get("names", ()))
            if len(info.get("dtype_names", ())) != n or len(info.get("shapes", ())) != n:
                raise ValueError("update_info: names, dtype_names and shapes must have the same length")
        try:
            await self._post("update", "/update_weights", {"update_info": update_info})
        except WeightTransferError:
            # vLLM's worker ends the session when an update raises; a retry starts over.
            self.state = TransferState.READY
            raise
        self.updates_sent += 1

    async def finish_weight_update(self, weight_version: str | int | None = None) -> None:
        """Close the session; vLLM then reports `weight_version` (when given) as the served version."""
        self._require("finish", TransferState.UPDATING)
        body = None if weight_version is None else {"weight_version": str(weight_version)}
        try:
            await self._post("finish", "/finish_weight_update", body)
        finally:
            # Success closes the session; a failure leaves vLLM's state unknown (see the module doc):
            # either way this client does not send further updates into it.
            self.state = TransferState.READY

    async def shutdown_engine(self) -> None:
        """Drop the workers' side of the transfer group (vLLM refuses while a session is open)."""
        await self._post("shutdown", "/shutdown_weight_transfer_engine")
        self.state = TransferState.IDLE

    async def reset_prefix_cache(self) -> None:
        """Drop KV computed by the old weights (a weight update does not)."""
        try:
            await self.control.reset_prefix_cache()
        except VLLMError as exc:
            raise WeightTransferError("reset_prefix_cache", str(exc)) from exc

    # -- read-only helpers ------------------------------------------------------------------------

    async def weight_version(self) -> str | None:
        try:
            return await self.control.weight_version()
        except VLLMError as exc:
            raise WeightTransferError("weight_info", str(exc)) from exc

    async def inference_world_size(self) -> int:
        """Number of inference workers (TP x PP x DP): the transfer group's world size is this + 1."""
        resp = await self.http.get("/get_world_size", params={"include_dp": "true"})
        if resp.status_code >= 400:
            raise WeightTransferError(
                "world_size",
                f"GET /get_world_size -> {resp.status_code}",
                status=resp.status_code,
                detail=_error_detail(resp),
            )
        return int(resp.json()["world_size"])
