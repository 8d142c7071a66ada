"""Async client for vLLM's dev-mode control endpoints (VLLM_SERVER_DEV_MODE=1): the inference adapter's,
and the trainer's around a path-2 push."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx


class VLLMError(RuntimeError):
    pass


class VLLMControl:
    def __init__(
        self, base_url: str, timeout_s: float = 300.0, http: httpx.AsyncClient | None = None
    ) -> None:
        self.http = http or httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=timeout_s)

    async def close(self) -> None:
        await self.http.aclose()

    async def _send(self, path: str, **kw: Any) -> httpx.Response:
        resp = await self.http.post(path, **kw)
        if resp.status_code >= 400:
            raise VLLMError(f"POST {path} -> {resp.status_code}: {resp.text[:300]}")
        return resp

    async def _post(self, path: str, **kw: Any) -> dict[str, Any]:
        resp = await self._send(path, **kw)
        body: dict[str, Any] = resp.json() if resp.content else {}
        return body

    async def healthy(self) -> bool:
        try:
            return (await self.http.get("/health", timeout=2.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def weight_version(self) -> str | None:
        resp = await self.http.get("/weight_info")
        if resp.status_code >= 400:
            raise VLLMError(f"GET /weight_info -> {resp.status_code}")
        version: str | None = resp.json().get("weight_version")
        return version

    async def pause(self, mode: str = "keep") -> None:
        await self._post("/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self._post("/resume")

    async def is_paused(self) -> bool:
        return bool((await self.http.get("/is_paused")).json().get("is_paused"))

    async def sleep(self, level: int = 1) -> None:
        # mode=wait: vLLM's default ("abort") would kill requests still in flight.
        await self._post("/sleep", params={"level": level, "mode": "wait"})

    async def wake_up(self) -> None:
        await self._post("/wake_up")

    async def served_adapters(self) -> dict[str, str]:
        """Name -> directory of every LoRA adapter vLLM serves (`/v1/models`: an adapter's `root` is
        the path it was loaded from, its `parent` the base model)."""
        resp = await self.http.get("/v1/models")
        if resp.status_code >= 400:
            raise VLLMError(f"GET /v1/models -> {resp.status_code}: {resp.text[:300]}")
        return {m["id"]: m["root"] for m in resp.json().get("data", []) if m.get("parent")}

    async def load_adapter(self, name: str, path: str) -> None:
        """vLLM's documented runtime load, in place (a new version of a loaded name; the first load of
        a name ignores the flag). Tether's plugin loads the new path beside the old one. It answers
        plain text, not JSON."""
        await self._send(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, "load_inplace": True}
        )

    async def reload_weights(self, checkpoint_dir: str) -> None:
        await self._post(
            "/collective_rpc", json={"method": "reload_weights", "kwargs": {"weights_path": checkpoint_dir}}
        )

    async def set_weight_version(self, version: int) -> None:
        await self._post("/update_weight_version", json={"new_version": str(version)})

    async def reset_prefix_cache(self, attempts: int = 50, delay_s: float = 0.1) -> None:
        # reload_weights keeps the prefix cache; stale KV would make later logprobs disagree with
        # the trainer. The reset answers success=false while requests still hold blocks: retry.
        for _ in range(attempts):
            if (await self._post("/reset_prefix_cache")).get("success"):
                return
            await asyncio.sleep(delay_s)
        raise VLLMError("reset_prefix_cache kept failing (requests still hold KV blocks)")
