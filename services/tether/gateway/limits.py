"""How many tokens a call may generate, as pure functions: the gateway's default when the client names
no limit, and the cap that keeps prompt + output inside the served context (Claude Code sends
`max_tokens: 32000` whatever its prompt and the model; vLLM answers 400 to a limit above its
max_model_len). forwarding.py applies them to every API; a route that translates another API (Gemini's
`generationConfig.maxOutputTokens`) calls `decide_max_tokens` the same way.

Knowing the prompt length without paying for it. The served context length comes from vLLM's
/v1/models (`max_model_len`, read by routing.py with the health check). The prompt length is not
known before vLLM renders the prompt, and it does not have to be: vLLM 0.32 lowers any max_tokens up
to max_model_len to the room the prompt leaves (`get_max_tokens`), and only rejects a limit above
max_model_len. So the gateway sends at most max_model_len, vLLM fits it to the prompt, and the trace
records what vLLM applied, min(sent, max_model_len - prompt tokens), from the prompt ids it answered
with: no extra request and no tokenizing. A server that instead rejects prompt + limit > context
(vLLM before the renderer rewrite: "... (P in the messages, N in the completion)") names the prompt
length in its 400, and `budget_error` reads it so the call is sent once more with the room left.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Trace.adjustments["max_tokens"]["reason"]
DEFAULT = "default"  # the client named no limit: the gateway's default (bounded by the context)
CLAMPED = "clamped_to_context"  # the client's limit did not fit the context


@dataclass(frozen=True, slots=True)
class MaxTokens:
    """One decision: what the client asked for (None: nothing), what goes upstream (None: leave it
    to the server's own default) and why they differ (None: they do not)."""

    requested: int | None
    send: int | None
    reason: str | None


def decide_max_tokens(
    requested: int | None, default: int | None, context_len: int | None, prompt_len: int | None = None
) -> MaxTokens:
    """The output limit to send. `default` applies when `requested` is None (None: no default);
    both are bounded by the room `context_len - prompt_len`. Unknown lengths are None: without
    `prompt_len` the bound is the whole context (vLLM fits what is sent to the prompt itself),
    without `context_len` nothing is bounded. A prompt that leaves no room bounds nothing either:
    vLLM's own 400 (the prompt is too long) is the right answer then."""
    room = None
    if context_len is not None:
        room = context_len - (prompt_len or 0)
        if room < 1:
            room = None
    if requested is None:
        if default is None:
            return MaxTokens(None, None, None)
        return MaxTokens(None, default if room is None else min(default, room), DEFAULT)
    if room is not None and requested > room:
        return MaxTokens(requested, room, CLAMPED)
    return MaxTokens(requested, requested, None)


def applied_max_tokens(decision: MaxTokens, context_len: int | None, prompt_len: int | None) -> dict | None:
    """Trace.adjustments["max_tokens"] once the prompt length is known (from the prompt ids vLLM
    answered with): {"requested", "applied", "reason"}, or None when the client's limit stood.
    `applied` is what vLLM generated under: what was sent, lowered to the room the prompt left."""
    applied = decision.send
    if context_len is not None and prompt_len is not None and context_len - prompt_len >= 1:
        room = context_len - prompt_len
        if applied is not None and applied > room:
            applied = room
    reason = decision.reason
    if (
        reason is None
        and decision.requested is not None
        and applied is not None
        and applied < decision.requested
    ):
        reason = CLAMPED
    if reason is None:
        return None
    return {"requested": decision.requested, "applied": applied, "reason": reason}


def client_limit(value: Any) -> tuple[bool, int | None]:
    """(the gateway may decide, the client's limit) for a request's raw limit field. The parsers
    refuse a value that is not a positive integer (the body types in bodies.py); one that gets here anyway
    is left untouched."""
    if value is None:
        return True, None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return True, value
    return False, None


# vLLM 0.32 (renderers/params.py), a limit above the context: "max_tokens=32000 cannot be greater
# than max_model_len=512. Please request fewer output tokens."
_ABOVE_CONTEXT = re.compile(r"max_(?:completion_)?tokens=\d+ cannot be greater than max_model_len=(\d+)")
# Older vLLM (serving_engine._validate_input), prompt + limit above the context: "This model's maximum
# context length is 512 tokens. However, you requested 32100 tokens (100 in the messages, 32000 in
# the completion)." (completions: "100 in the prompt" or "in your prompt").
_LEGACY_CONTEXT = re.compile(r"maximum context length is (\d+) tokens")
_LEGACY_PROMPT = re.compile(
    r"\((\d+) in (?:the messages|the prompt|your prompt)[,;]\s*\d+ (?:in|for) the completion"
)


def budget_error(message: str) -> tuple[int, int | None] | None:
    """(context length, prompt length or None) when a 400's message says the output limit did not fit
    the context; None for any other 400 (a prompt too long on its own included)."""
    if m := _ABOVE_CONTEXT.search(message):
        return int(m.group(1)), None
    context, prompt = _LEGACY_CONTEXT.search(message), _LEGACY_PROMPT.search(message)
    if context and prompt:
        return int(context.group(1)), int(prompt.group(1))
    return None
