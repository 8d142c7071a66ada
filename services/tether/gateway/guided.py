"""Grammar-guided calls: which calls vLLM sampled under a constraint, and which of their response
tokens the constraint changed, so that the merger keeps those tokens out of the loss.

Why: vLLM applies the grammar bitmask to the logits *before* its sampler (v1 `gpu_model_runner`:
`apply_grammar_bitmask(...)`, then `_sample`), so the logprobs it returns under a grammar -- raw and
processed alike -- are those of the masked, renormalised distribution q = p * 1[allowed] / Z (a forced
token comes back as 0.0), while the trainer computes the unconstrained policy's p. Trained as they are,
such tokens give |log p - log q| = -log Z of several nats per token and a PPO ratio clipped from the
start. The same holds for other per-request logits processing (`allowed_token_ids`, `bad_words`,
`logit_bias`, `min_tokens`).

How: `guidance(body)` names what guides a call, from the chat/completions body sent upstream (the
translated APIs -- Anthropic Messages, Responses, Gemini -- are chat bodies by then, so one check covers
them all). After a guided call the response is scored again, unconstrained: a `/v1/completions` request
to the same replica with `prompt` = prompt + response ids, `max_tokens: 1` and `prompt_logprobs: 0`.
vLLM computes prompt logprobs as a plain log_softmax of the model's logits (no grammar, no temperature,
no top-p: `_get_prompt_logprobs_dict`) -- exactly what the trainer computes. A token is *constrained*
where vLLM's sampled logprob differs from that score by more than `tolerance`; such tokens are recorded
as spans and masked from the loss. Tokens the grammar left alone (Z = 1: free text inside a JSON string,
the argument digits the model would have written anyway) keep mask 1: there q = p, the token was sampled
from the policy itself and its logprob agrees with the trainer's.

The rescore must have run on the weights that sampled the call: both carry vLLM's per-token weight
versions (Tether's plugin); anything else -- no versions, versions that differ, a rescore that failed,
timed out or answered something unexpected -- masks the whole response of that call. A rescore never
makes a call fail.

Pure functions plus `GuidedCheck`, which proxy.py calls once per guided call before recording it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any, Literal, get_args

import orjson
from prometheus_client import Counter

from tether.common.records import Trace, spans_cover
from tether.gateway.capture import WEIGHT_VERSIONS_FLAG, Captured, weight_spans

log = logging.getLogger(__name__)

# "mask": rescore guided calls and mask the constrained tokens; "off": record only that a call was guided.
GuidedMode = Literal["mask", "off"]
GUIDED_MODES: tuple[GuidedMode, ...] = get_args(GuidedMode)
RESCORE_PATH = "/v1/completions"
# Whole-response masking, and why (Trace.guidance["method"]).
RESCORED, WHOLE, OFF = "rescore", "whole", "off"

GUIDED_CALLS = Counter(
    "tether_gateway_guided_calls_total",
    "Grammar-guided calls, by how their constrained tokens were found",
    ["method"],
)
CONSTRAINED_TOKENS = Counter(
    "tether_gateway_constrained_tokens_total",
    "Response tokens of guided calls recorded as constrained (not trained on)",
)

# Keys whose presence can make a body guided; orjson writes `"key":` with no space, and inside a JSON
# string the same text would read `\"key\":`, so a substring test is a cheap, exact pre-filter.
# Codex and others send `"strict":false` on every tool: only a true one makes a body worth parsing.
_KEYS = tuple(
    f'"{k}":'.encode()
    for k in (
        "tool_choice",
        "response_format",
        "structured_outputs",
        "allowed_token_ids",
        "bad_words",
        "logit_bias",
        "min_tokens",
    )
) + (b'"guided_', b'"strict":true')
# vLLM < 0.32's request fields; 0.32 ignores them (with a warning): the rescore then finds nothing.
_LEGACY = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guidance(body: bytes) -> list[str]:
    """What constrains the sampling of the chat or completions body `body` (as sent to vLLM): e.g.
    ``["tool_choice=required"]``, ``["response_format=json_schema"]``; [] for a free call."""
    if not any(k in body for k in _KEYS):
        return []
    try:
        d = orjson.loads(body)
    except orjson.JSONDecodeError:
        return []
    return guidance_of(d) if isinstance(d, dict) else []


def guidance_of(d: dict[str, Any]) -> list[str]:
    """`guidance` of a parsed body."""
    out: list[str] = []
    tools = d.get("tools") if isinstance(d.get("tools"), list) else []
    choice = d.get("tool_choice")
    if tools and choice == "required":
        out.append("tool_choice=required")
    elif tools and isinstance(choice, dict):
        fn = f if isinstance(f := choice.get("function"), dict) else choice
        out.append(f"tool_choice={fn.get('name', '?')}")
    elif (
        tools
        and choice != "none"
        and any(
            isinstance(t, dict)
            and isinstance(t.get("function"), dict)
            and t["function"].get("strict") is True
            for t in tools
        )
    ):
        # vLLM's structural tag pins a strict tool's arguments once the model opens a call, even under "auto".
        out.append("tools.strict")
    rf = d.get("response_format")
    if isinstance(rf, dict) and rf.get("type") not in (None, "text"):
        out.append(f"response_format={rf.get('type')}")
    if d.get("structured_outputs") is not None:
        out.append("structured_outputs")
    out.extend(k for k in _LEGACY if d.get(k) is not None)
    for k in ("allowed_token_ids", "bad_words", "logit_bias"):
        if d.get(k):
            out.append(k)
    if isinstance(d.get("min_tokens"), int) and d["min_tokens"] > 0:
        out.append("min_tokens")
    return out


def constrained_spans(
    rollout_logprobs: list[float], free_logprobs: list[float], tolerance: float
) -> list[list[int]]:
    """[start, end) spans of the response tokens whose sampled logprob is not the unconstrained one.

    Args:
        rollout_logprobs: (n,) vLLM's logprob of each sampled token, under the grammar.
        free_logprobs: (n,) the same tokens scored without the grammar (prompt logprobs).
        tolerance: largest |difference| still read as "not constrained" (numerical noise between a
            decode step and a prefill).

    A token is constrained where the difference exceeds the tolerance or either value is not finite.
    """
    if len(rollout_logprobs) != len(free_logprobs):
        raise ValueError(f"{len(rollout_logprobs)} rollout logprobs for {len(free_logprobs)} scores")
    spans: list[list[int]] = []
    for i, (a, b) in enumerate(zip(rollout_logprobs, free_logprobs, strict=True)):
        if math.isfinite(a) and math.isfinite(b) and abs(a - b) <= tolerance:
            continue
        if spans and spans[-1][1] == i:
            spans[-1][1] = i + 1
        else:
            spans.append([i, i + 1])
    return spans


def max_kept_diff(rollout_logprobs: list[float], free_logprobs: list[float], spans: list[list[int]]) -> float:
    """The largest |difference| among the tokens left trainable (for the trace: how close the call was)."""
    masked = {i for a, b in spans for i in range(a, b)}
    return max(
        (
            abs(x - y)
            for i, (x, y) in enumerate(zip(rollout_logprobs, free_logprobs, strict=True))
            if i not in masked
        ),
        default=0.0,
    )


def rescore_body(model: str, prompt: list[int], responses: list[list[int]]) -> bytes:
    """The completions request that scores each response after `prompt` without any constraint.
    `max_tokens: 1` because vLLM must sample something; the token is thrown away."""
    prompts = [prompt + r for r in responses]
    return orjson.dumps(
        {
            "model": model,
            "prompt": prompts[0] if len(prompts) == 1 else prompts,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
            WEIGHT_VERSIONS_FLAG: True,
        }
    )


def parse_rescore(
    resp: Any, prompt_len: int, responses: list[list[int]]
) -> list[tuple[list[float], set[int]]]:
    """Per response (in order): the unconstrained logprob of each of its tokens, and the weight versions
    that ran the rescore. Raises ValueError on anything unexpected (the caller then masks the call)."""
    choices = resp.get("choices") if isinstance(resp, dict) else None
    if not isinstance(choices, list) or len(choices) != len(responses):
        raise ValueError("rescore answered another number of choices")
    by_index = {}
    for pos, c in enumerate(choices):
        if not isinstance(c, dict):
            raise ValueError("rescore choice is not an object")
        by_index[int(c.get("index", pos))] = c
    out = []
    for k, ids in enumerate(responses):
        c = by_index.get(k)
        plp = c.get("prompt_logprobs") if c else None
        if not c or not isinstance(plp, list) or len(plp) != prompt_len + len(ids):
            raise ValueError("rescore carried no prompt logprobs of the right length")
        values = []
        for tok, entry in zip(ids, plp[prompt_len:], strict=True):
            item = entry.get(str(tok)) if isinstance(entry, dict) else None
            lp = item.get("logprob") if isinstance(item, dict) else None
            if not isinstance(lp, (int, float)):
                raise ValueError(f"rescore has no logprob for token {tok}")
            values.append(float(lp))
        spans = weight_spans(c.get("weight_versions"))
        out.append((values, {v for v, _, _ in spans}))
    return out


def call_versions(captured: Captured) -> set[int] | None:
    """The weight versions that sampled every choice of a call; None when vLLM did not say for all."""
    versions: set[int] = set()
    for c in captured.choices.values():
        if not c.weight_spans or not spans_cover(c.weight_spans, len(c.token_ids)):
            return None
        versions.update(v for v, _, _ in c.weight_spans)
    return versions


def whole(captured: Captured, why: str) -> dict[str, Any]:
    """Every response token of every choice counts as constrained."""
    return {
        "method": WHOLE,
        "why": why,
        "spans": {i: [[0, len(c.token_ids)]] if c.token_ids else [] for i, c in captured.choices.items()},
    }


class GuidedCheck:
    """Finds the constrained tokens of guided calls (see the module docstring)."""

    def __init__(
        self, upstream_model: str, mode: GuidedMode = "mask", tolerance: float = 1e-3, timeout_s: float = 30.0
    ) -> None:
        if mode not in GUIDED_MODES:
            raise ValueError(f"guided mode must be one of {GUIDED_MODES}, got {mode!r}")
        self.upstream_model = upstream_model
        self.mode = mode
        self.tolerance = tolerance
        self.timeout_s = timeout_s

    async def inspect(self, replica: Any, captured: Captured) -> dict[str, Any]:
        """The call's guidance record: {"method", "spans": {choice index: [[start, end), ...]], ...}.
        Never raises: whatever goes wrong masks the whole response."""
        if self.mode == OFF:
            out: dict[str, Any] = {"method": OFF, "spans": {}}
        elif captured.missing_ids():
            out = {"method": WHOLE, "why": "no token ids", "spans": {}}
        else:
            try:
                out = await asyncio.wait_for(self._rescore(replica, captured), self.timeout_s)
            except Exception as exc:  # a rescore must never fail the call
                log.warning("rescoring a guided call failed (%r): its whole response is masked", exc)
                out = whole(captured, f"rescore failed: {exc!r}"[:300])
        GUIDED_CALLS.labels(out["method"]).inc()
        CONSTRAINED_TOKENS.inc(sum(b - a for spans in out["spans"].values() for a, b in spans))
        return out

    async def _rescore(self, replica: Any, captured: Captured) -> dict[str, Any]:
        versions = call_versions(captured)
        if versions is None:
            return whole(captured, "vLLM reported no weight versions for the call")
        if len(versions) != 1:
            return whole(captured, f"the call was sampled by several weight versions {sorted(versions)}")
        if replica is None:
            return whole(captured, "no replica")
        indices = sorted(captured.choices)
        responses = [captured.choices[i].token_ids for i in indices]
        prompt = captured.prompt_token_ids
        ex = await replica.client.request(
            "POST", RESCORE_PATH, rescore_body(self.upstream_model, prompt, responses)
        )
        status = await ex.head()
        content = await ex.body()
        if status != 200:
            return whole(captured, f"rescore answered HTTP {status}: {content[:200]!r}")
        scored = parse_rescore(orjson.loads(content), len(prompt), responses)
        spans: dict[int, list[list[int]]] = {}
        kept = 0.0
        for i, (free, rescore_versions) in zip(indices, scored, strict=True):
            if rescore_versions != versions:
                return whole(
                    captured,
                    f"rescored by weight version {sorted(rescore_versions)}, sampled by {sorted(versions)}",
                )
            lps = captured.choices[i].logprobs
            spans[i] = constrained_spans(lps, free, self.tolerance)
            kept = max(kept, max_kept_diff(lps, free, spans[i]))
        return {"method": RESCORED, "tolerance": self.tolerance, "max_kept_diff": kept, "spans": spans}


def annotate(trace: Trace, guided_by: list[str], result: dict[str, Any] | None) -> None:
    """Write a guided call's record into its trace (and into its further choices)."""
    trace.guided_by = list(guided_by)
    if result is None:
        return
    spans = result["spans"]
    trace.guidance = {k: v for k, v in result.items() if k != "spans"}
    if not trace.response_token_ids and result["method"] != OFF:
        return
    indices = sorted(spans) or [0]
    trace.constrained_spans = spans.get(indices[0], [])
    for extra in trace.extra_choices:
        extra["constrained_spans"] = spans.get(extra.get("index"), [])
