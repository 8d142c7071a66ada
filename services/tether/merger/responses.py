"""The responses of one rollout's recorded calls, as the merger counts and shapes them (pure).

A response is one choice of a call whose token ids the gateway recorded (an n > 1 call has several),
trained or not: its length in tokens, whether the output limit cut it (vLLM's ``finish_reason``
``"length"``, on the trace and on each of its ``extra_choices``), the limit it ran under (``output_limit``)
and whether it is degenerate repetition. ``score.merge_rollout`` puts their figures on the merged
rollout (``response_lengths``, ``cut_responses``, ``repetitive_responses``) and, with
``merger.truncated_responses=penalty``, DAPO's soft overlong punishment of the rollout
(``length_penalty``); docs/merging.md, "Responses cut by the output limit".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tether.algorithms.responses import overlong_penalty, repetitive
from tether.common.records import Trace

CUT = "length"  # vLLM's finish_reason for a response the output limit (or the context) stopped

# Where each API's request carries the client's output limit (Trace.api -> paths into Trace.request, the
# body as the client sent it), first found wins; chat completions: vLLM's order. The gateway's own
# decision, when it made one, is Trace.adjustments["max_tokens"]["applied"] and comes first.
_LIMIT_FIELDS: dict[str, tuple[tuple[str, ...], ...]] = {
    "chat.completions": (("max_completion_tokens",), ("max_tokens",)),
    "completions": (("max_tokens",),),
    "anthropic.messages": (("max_tokens",),),
    "responses": (("max_output_tokens",),),
    "gemini.generate_content": (
        ("generationConfig", "maxOutputTokens"),
        ("generation_config", "max_output_tokens"),
    ),
}


@dataclass(frozen=True)
class Response:
    """One generated response: its tokens, the output limit it ran under (None: not known), cut by it."""

    token_ids: Sequence[int]
    limit: int | None
    cut: bool


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def output_limit(trace: Trace) -> int | None:
    """The output limit a call ran under: what the gateway applied (``adjustments["max_tokens"]``:
    its default, or the client's limit lowered to the room the context left), else the client's own
    limit in its API's request field, else None (the server's default applied, not recorded)."""
    note = trace.adjustments.get("max_tokens")
    if isinstance(note, Mapping) and (applied := _positive(note.get("applied"))) is not None:
        return applied
    for path in _LIMIT_FIELDS.get(trace.api, ()):
        value: Any = trace.request
        for key in path:
            value = value.get(key) if isinstance(value, Mapping) else None
        if (limit := _positive(value)) is not None:
            return limit
    return None


def rollout_responses(traces: Sequence[Trace]) -> Iterator[Response]:
    """Every response of the calls that succeeded and whose prompt ids were recorded (without them the
    gateway captured no token ids, so the length is not known), in call order, choice by choice."""
    for t in traces:
        if t.status != "ok" or not t.prompt_token_ids:
            continue
        limit = output_limit(t)
        yield Response(t.response_token_ids, limit, t.finish_reason == CUT)
        for choice in t.extra_choices:
            yield Response(list(choice.get("token_ids") or ()), limit, choice.get("finish_reason") == CUT)


@dataclass(frozen=True)
class ResponseFigures:
    lengths: list[int]
    cut: int
    repetitive: int


def figures(found: Sequence[Response]) -> ResponseFigures:
    """The lengths of the responses, and how many were cut and how many are degenerate repetition."""
    return ResponseFigures(
        [len(r.token_ids) for r in found],
        sum(r.cut for r in found),
        sum(repetitive(r.token_ids) for r in found),
    )


def length_penalty(found: Sequence[Response], buffer: int, factor: float) -> float:
    """A rollout's soft overlong punishment: the most negative ``overlong_penalty`` of its responses
    (one response at its limit is enough to mark the rollout as overlong), 0 without any."""
    return min(
        (overlong_penalty(len(r.token_ids), r.limit, buffer, factor, r.cut) for r in found), default=0.0
    )
