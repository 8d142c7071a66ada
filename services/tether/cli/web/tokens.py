"""A sample's tokens as the rollout page shows them: what each is to the trainer (pure).

A token the loss trains on (loss mask 1) is "trained". Of the rest, a token before the first response
is "context" (the prompt), a token the grammar changed (Trace.constrained_spans, found by locating each
call's response in the sequence) is "grammar", and every other masked token is "masked" (tool output
and the turns between the responses)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

KINDS = ("trained", "context", "masked", "grammar")


def _find(seq: Sequence[int], sub: Sequence[int], start: int) -> int:
    """The first position >= start where `sub` occurs in `seq`; -1 when it does not (or is empty)."""
    if not sub:
        return -1
    first, n = sub[0], len(sub)
    for i in range(start, len(seq) - n + 1):
        if seq[i] == first and list(seq[i : i + n]) == list(sub):
            return i
    return -1


def grammar_positions(token_ids: Sequence[int], calls: Sequence[dict[str, Any]]) -> set[int]:
    """Positions of `token_ids` whose token a grammar changed: each call's (trace records, in the
    sample's call order) response located in the sequence after the previous one, its constrained
    spans shifted there. A call whose response is not found is skipped."""
    out: set[int] = set()
    at = 0
    for call in calls:
        response = call.get("response_token_ids") or []
        offset = _find(token_ids, response, at)
        if offset < 0:
            continue
        for start, end in call.get("constrained_spans") or []:
            out.update(range(offset + int(start), offset + int(end)))
        at = offset + len(response)
    return out


def token_kinds(
    token_ids: Sequence[int], loss_mask: Sequence[int], calls: Sequence[dict[str, Any]]
) -> list[str]:
    """One of KINDS per token of a sample (its ids and loss mask; `calls` its calls' trace records)."""
    grammar = grammar_positions(token_ids, calls)
    first = next((i for i, m in enumerate(loss_mask) if m), len(loss_mask))
    kinds = []
    for i, mask in enumerate(loss_mask):
        if mask:
            kinds.append("trained")
        elif i in grammar:
            kinds.append("grammar")
        elif i < first:
            kinds.append("context")
        else:
            kinds.append("masked")
    return kinds


def version_at(spans: Sequence[Sequence[int]], position: int, default: int) -> int:
    """The weight version that sampled the token at `position` ([[version, start, end), ...]);
    `default` (the sample's weight_version) outside every span."""
    for version, start, end in spans:
        if start <= position < end:
            return int(version)
    return default
