"""vLLM endpoint plugin: per-token weight-version spans on the OpenAI chat and completions routes.

vLLM 0.32 tracks, for every request, which weight version sampled which output tokens (the engine tags
each step's outputs with the version `/update_weight_version` set; the output processor turns the tags
into `CompletionOutput.weight_versions`, contiguous `[start, end)` spans over output-token indexes). Only
`/inference/v1/generate` returns them. This plugin returns them on `/v1/chat/completions` and
`/v1/completions` too, for requests that ask with `"return_weight_versions": true`:

- whole responses: each choice gains `weight_versions: [{"version": "7", "start": 0, "end": 103}, ...]`;
- streams: one extra chunk just before `data: [DONE]`,
  `{"object": "tether.weight_versions", "choices": [{"index": 0, "weight_versions": [...]}]}`.

A request served by a LoRA adapter (its `model` named one) says which on every span:
`{"version": "7", "start": 0, "end": 103, "adapter": "run-a", "adapter_version": "3"}`, from the
LoRARequest vLLM carried the request with (RequestOutput.lora_request); the base model's spans carry no
adapter keys. The version is the last component of the adapter's path: Tether loads version V of an
adapter from `<dir>/<V>`. So that a (name, path) pair always names the same weights, the plugin makes
vLLM's in-place reload (`/v1/load_lora_adapter` with `load_inplace`) load a new path as a new adapter
id, swapped in under the same name: calls already running finish on the version they started with (the
record they carry stays true), later calls get the new one, and nobody pauses. An in-place reload from
the same path is refused (its old weights would hide under the same record and prefix cache).
docs/runs.md has the facts this rests on.

Requests that do not ask are untouched, byte for byte. The plugin wraps the two response builders of
each serving object and the models object's adapter loader when the app starts; it opens no new path
into the engine.

Loaded by vLLM from the `vllm.endpoint_plugins` entry point when `VLLM_PLUGINS` names `tether`
(services/tether/inference/launch.py sets it). `GET /tether/plugin` says it is there.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from pathlib import PurePosixPath
from typing import Any

log = logging.getLogger("tether_vllm")

NAME = "tether"
FLAG = "return_weight_versions"
STREAM_OBJECT = "tether.weight_versions"
_DONE = "data: [DONE]\n\n"


def wants_versions(request: Any) -> bool:
    extra = getattr(request, "model_extra", None) or {}
    return extra.get(FLAG) is True


def adapter_version(lora_path: str) -> str:
    """The version Tether loaded an adapter as: the last component of its path (`<dir>/<version>`)."""
    return PurePosixPath(str(lora_path).rstrip("/")).name


def adapter_keys(lora_request: Any) -> dict[str, str]:
    """What a span says about the adapter that served it: nothing for the base model."""
    if lora_request is None:
        return {}
    return {
        "adapter": str(lora_request.lora_name),
        "adapter_version": adapter_version(lora_request.lora_path),
    }


def span_dicts(spans: Any, lora_request: Any = None) -> list[dict[str, Any]] | None:
    """vLLM's WeightVersionSpan list as JSON objects, each naming the request's adapter (if any); None
    when vLLM gave none."""
    if not spans:
        return None
    adapter = adapter_keys(lora_request)
    return [{"version": str(s.version), "start": int(s.start), "end": int(s.end), **adapter} for s in spans]


class SpanTap:
    """Passes RequestOutputs through unchanged, keeping each choice's spans (set on its final output)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.spans: dict[int, list[dict[str, Any]]] = {}

    def see(self, res: Any, prompt_index: int = 0) -> None:
        for out in res.outputs:
            spans = span_dicts(getattr(out, "weight_versions", None), getattr(res, "lora_request", None))
            if spans is not None:
                self.spans[prompt_index * self.n + out.index] = spans

    async def chat(self, results: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for res in results:
            self.see(res)
            yield res

    async def completions(self, results: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[tuple[int, Any]]:
        async for prompt_index, res in results:
            self.see(res, prompt_index)
            yield prompt_index, res

    def chunk_payload(self) -> dict[str, Any]:
        """The extra stream chunk's JSON object."""
        choices = [{"index": i, "weight_versions": s} for i, s in sorted(self.spans.items())]
        return {"object": STREAM_OBJECT, "choices": choices}

    def stream_chunk(self) -> str:
        return f"data: {json.dumps(self.chunk_payload())}\n\n"

    def annotate(self, response: Any) -> Any:
        for choice in getattr(response, "choices", None) or []:
            spans = self.spans.get(choice.index)
            if spans is not None:
                choice.weight_versions = spans  # extra="allow": serialised with the choice
        return response


async def _stream_with_spans(tap: SpanTap, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    async for chunk in chunks:
        if chunk == _DONE and tap.spans:
            yield tap.stream_chunk()
        yield chunk


def _n(request: Any) -> int:
    return 1 if getattr(request, "n", None) is None else int(request.n)


def wrap_chat(serving: Any) -> None:
    full: Callable[..., Any] = serving.chat_completion_full_generator
    stream: Callable[..., Any] = serving.chat_completion_stream_generator

    async def full_generator(request: Any, result_generator: Any, *args: Any, **kwargs: Any) -> Any:
        if not wants_versions(request):
            return await full(request, result_generator, *args, **kwargs)
        tap = SpanTap(_n(request))
        return tap.annotate(await full(request, tap.chat(result_generator), *args, **kwargs))

    def stream_generator(request: Any, result_generator: Any, *args: Any, **kwargs: Any) -> Any:
        if not wants_versions(request):
            return stream(request, result_generator, *args, **kwargs)
        tap = SpanTap(_n(request))
        return _stream_with_spans(tap, stream(request, tap.chat(result_generator), *args, **kwargs))

    serving.chat_completion_full_generator = full_generator
    serving.chat_completion_stream_generator = stream_generator


def wrap_completions(serving: Any) -> None:
    to_response: Callable[..., Any] = serving.request_output_to_completion_response
    stream: Callable[..., Any] = serving.completion_stream_generator

    def response(final_res_batch: list[Any], request: Any, *args: Any, **kwargs: Any) -> Any:
        out = to_response(final_res_batch, request, *args, **kwargs)
        if wants_versions(request):
            tap = SpanTap(_n(request))
            for prompt_index, res in enumerate(final_res_batch):
                tap.see(res, prompt_index)
            tap.annotate(out)
        return out

    def stream_generator(
        request: Any, engine_inputs: Any, result_generator: Any, *args: Any, **kwargs: Any
    ) -> Any:
        if not wants_versions(request):
            return stream(request, engine_inputs, result_generator, *args, **kwargs)
        tap = SpanTap(_n(request))
        return _stream_with_spans(
            tap, stream(request, engine_inputs, tap.completions(result_generator), *args, **kwargs)
        )

    serving.request_output_to_completion_response = response
    serving.completion_stream_generator = stream_generator


def _error(message: str, err_type: str, status: HTTPStatus) -> Any:
    from vllm.entrypoints.serve import create_error_response

    return create_error_response(message=message, err_type=err_type, status_code=status)


async def _swap_in_version(models: Any, request: Any, base_model_name: str | None) -> Any:
    """Load `request.lora_path` under a fresh adapter id and point `request.lora_name` at it, without a
    moment where the name is missing. The previous id stays in vLLM's LRU cache for the calls that
    still carry it (vLLM reloads it from its path if it was evicted) and leaves when the cache needs
    room."""
    from vllm.lora.request import LoRARequest

    name = request.lora_name
    async with models.lora_resolver_lock[name]:
        previous = models.lora_requests.get(name)
        if previous is not None and previous.lora_path == request.lora_path:
            return _error(
                f"adapter {name!r} is already loaded from {request.lora_path!r}: load a new version "
                "from a new path (Tether's adapters keep one path per version)",
                "InvalidUserInput",
                HTTPStatus.BAD_REQUEST,
            )
        lora = LoRARequest(
            lora_name=name,
            lora_int_id=models.lora_id_counter.inc(1),
            lora_path=request.lora_path,
            is_3d_lora_weight=request.is_3d_lora_weight,
        )
        if base_model_name is not None and models.is_base_model(base_model_name):
            lora.base_model_name = base_model_name
        try:
            await models.engine_client.add_lora(lora)
        except Exception as exc:  # vLLM's own loader answers 500 with the message; so do we
            return _error(str(exc), "InternalServerError", HTTPStatus.INTERNAL_SERVER_ERROR)
        models.lora_requests[name] = lora
        log.info("tether plugin: adapter %r now %s (id %d)", name, request.lora_path, lora.lora_int_id)
        return f"Success: LoRA adapter '{name}' added successfully."


def wrap_models(models: Any) -> None:
    """Every (adapter name, path) names one set of weights: vLLM's in-place reload becomes a new id
    swapped in under the name, and a first load never keeps `load_inplace` (vLLM would reload the
    adapter from disk on every step of every call that carries the flag)."""
    load: Callable[..., Any] = models.load_lora_adapter

    async def load_lora_adapter(request: Any, base_model_name: str | None = None) -> Any:
        if not request.load_inplace:
            return await load(request, base_model_name)
        if request.lora_name not in models.lora_requests:
            return await load(request.model_copy(update={"load_inplace": False}), base_model_name)
        return await _swap_in_version(models, request, base_model_name)

    models.load_lora_adapter = load_lora_adapter


class WeightVersionsPlugin:
    """The `vllm.endpoint_plugins` entry point (vLLM calls the class with no arguments)."""

    name = NAME
    required_tasks = ("generate",)

    def __init__(self) -> None:
        self.wrapped: list[str] = []
        self.adapters = False  # whether it versions vLLM's adapter loads (a vLLM with LoRA on)

    def attach_router(self, app: Any) -> None:
        @app.get("/tether/plugin")
        async def plugin_info() -> dict[str, Any]:
            return {"plugin": NAME, "weight_versions": self.wrapped, "adapters": self.adapters}

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        # A vLLM whose serving objects look different keeps serving, without spans (the gateway then
        # records the versions it knows itself): never a reason for vLLM not to start.
        for route, attr, wrap in (
            ("chat.completions", "openai_serving_chat", wrap_chat),
            ("completions", "openai_serving_completion", wrap_completions),
        ):
            serving = getattr(state, attr, None)
            if serving is None:
                continue
            try:
                wrap(serving)
            except AttributeError as exc:
                log.warning("tether plugin: no weight-version spans on %s: %s", route, exc)
            else:
                self.wrapped.append(route)
        log.info("tether plugin: weight-version spans on %s", ", ".join(self.wrapped) or "no route")
        models = getattr(state, "openai_serving_models", None)
        if models is not None and getattr(getattr(state, "vllm_config", None), "lora_config", None):
            try:
                wrap_models(models)
            except AttributeError as exc:
                log.warning("tether plugin: adapter loads not versioned: %s", exc)
            else:
                self.adapters = True
