"""Side calls: LLM calls a harness makes that are not the agent's turn (pure: no I/O).

opencode's title generation, Qwen Code's memory-extraction subagent, Claude Code's small/fast-model
calls (title, new-topic check) are recorded in the rollout like any call. Their prompts do not
continue the agent's conversation, so merging puts them in sequences of their own, and scoring would
give them the task's reward: the policy would learn to write titles from whether the bug got fixed.
These rules leave such sequences out (docs/merging.md, "Side calls", says which fits which harness):

* ``patterns``: a sequence whose first call's system prompt matches one of the regular expressions
  (``re.search``) is left out (reason ``pattern``).
* ``rule="last_chain"``: of the sequences left, only the one holding the rollout's last call is kept
  (reason ``not_last_chain``): the agent's turn ends the rollout, side calls hang off it.  Applied
  after the patterns, so a side call that runs after the agent's last turn (Qwen Code's memory
  extraction) can be matched by a pattern and the chain before it is still the one kept.
* ``rule="keep"`` and no patterns (the default): every sequence is kept.

Who calls this: ``score.merge_rollout``, after ``merge.merge_calls``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal, get_args

SideCallRule = Literal["keep", "last_chain"]
SIDE_CALL_RULES: tuple[SideCallRule, ...] = get_args(SideCallRule)


def system_text(request: Mapping[str, Any]) -> str:
    """The system prompt of a recorded request body, whatever its API: Chat Completions ``messages``
    of role ``system``/``developer``, Anthropic Messages ``system`` (a string or text blocks), OpenAI
    Responses ``instructions`` (and ``input`` items of role ``system``/``developer``). Parts are joined
    with newlines; "" when there is none."""
    parts: list[str] = []

    def add(content: Any) -> None:
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for block in content:
                if isinstance(block, str):
                    parts.append(block)
                elif isinstance(block, Mapping) and isinstance(block.get("text"), str):
                    parts.append(block["text"])

    add(request.get("system"))
    add(request.get("instructions"))
    for key in ("messages", "input"):
        items = request.get(key)
        if isinstance(items, list):
            for m in items:
                if isinstance(m, Mapping) and m.get("role") in ("system", "developer"):
                    add(m.get("content"))
    return "\n".join(parts)


def compile_patterns(patterns: Sequence[str]) -> tuple[re.Pattern[str], ...]:
    """The configured patterns, compiled once (an invalid one raises ``re.error`` at startup)."""
    return tuple(re.compile(p) for p in patterns)


def side_call_exclusions(
    chains: Sequence[Sequence[str]],
    order: Sequence[str],
    systems: Mapping[str, str],
    rule: SideCallRule = "keep",
    patterns: Sequence[re.Pattern[str]] = (),
) -> list[str | None]:
    """Which merged sequences are side calls.

    Args:
        chains: the call ids of each merged sequence (``Sequence.call_ids``), in sequence order.
        order: every call id of the rollout in call order (its last one that is in a kept chain is
            "the rollout's last call").
        systems: call id -> its request's system prompt (``system_text``); missing = "".
        rule: one of ``SIDE_CALL_RULES``.
        patterns: compiled regular expressions matched against each chain's first call's system prompt.

    Returns:
        One entry per chain: ``None`` to keep it, else why it is left out (``"pattern"`` or
        ``"not_last_chain"``).
    """
    if rule not in SIDE_CALL_RULES:
        raise ValueError(f"unknown side-call rule {rule!r}; choose one of {', '.join(SIDE_CALL_RULES)}")
    out: list[str | None] = []
    for calls in chains:
        text = systems.get(calls[0], "") if calls else ""
        out.append("pattern" if any(p.search(text) for p in patterns) else None)
    if rule == "last_chain":
        owner = {cid: i for i, calls in enumerate(chains) if out[i] is None for cid in calls}
        last = next((owner[cid] for cid in reversed(order) if cid in owner), None)
        out = [why if why is not None or i == last else "not_last_chain" for i, why in enumerate(out)]
    return out
