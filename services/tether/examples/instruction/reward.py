"""Verifiable constraints and the instruction agent's reward: pure functions, no I/O.

A task carries a list of constraints, each a JSON-serialisable dict with a ``kind``:

| kind | fields | met when |
|---|---|---|
| ``length_exact`` | ``n`` | the answer has exactly n words |
| ``length_at_most`` | ``n`` | the answer has 1..n words |
| ``include`` | ``word`` | the answer *uses* the word: outside quotes in text, as (part of) a value in JSON |
| ``exclude`` | ``word`` | the word appears nowhere: not quoted, not as a JSON key or value |
| ``starts_with`` / ``ends_with`` | ``word`` | the first / last word (outside quotes) is that word |
| ``lower_case`` | | the answer has letters and no capital |
| ``bullets`` | ``n`` | n or more lines, each ``- item`` or ``* item`` |
| ``json_keys`` | ``keys`` | the answer is a JSON object with exactly those keys, each a non-empty string |

Words are runs of letters and digits, compared case-insensitively; a ``"."`` is not a word. The reward
is the share of constraints met, except that an empty answer and an answer that repeats the prompt's
own instructions (to smuggle a required word in) score 0: neither follows the instruction.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

_WORD = re.compile(r"[A-Za-z0-9]+")
_QUOTED = re.compile(r'"[^"]*"')
_BULLET = re.compile(r"^\s*[-*]\s+\S")
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
# Four consecutive words of an instruction in the answer: it repeats the prompt rather than answering.
ECHO_WINDOW = 4
# The check tool: a reply ``check <draft>`` asks the harness which constraints the draft fails.
CHECK = "check"


def words(text: str) -> list[str]:
    """Every word of `text`, lower-cased, wherever it stands (quotes, JSON keys and values included)."""
    return [w.lower() for w in _WORD.findall(text)]


def unquoted_words(text: str) -> list[str]:
    """The words the answer says itself: quoted spans are mentions, not uses."""
    return words(_QUOTED.sub(" ", text))


def parse_json_object(text: str) -> dict | None:
    """The answer as a JSON object (a single ```json fence around it is allowed), else None."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1)
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def used_words(answer: str) -> list[str]:
    """The words that count as used: a JSON object's string values, else the unquoted words."""
    obj = parse_json_object(answer)
    if obj is not None:
        return [w for v in obj.values() if isinstance(v, str) for w in words(v)]
    return unquoted_words(answer)


def _length_exact(answer: str, c: dict) -> bool:
    return len(words(answer)) == c["n"]


def _length_at_most(answer: str, c: dict) -> bool:
    return 1 <= len(words(answer)) <= c["n"]


def _include(answer: str, c: dict) -> bool:
    return c["word"].lower() in used_words(answer)


def _exclude(answer: str, c: dict) -> bool:
    return c["word"].lower() not in words(answer)


def _starts_with(answer: str, c: dict) -> bool:
    said = unquoted_words(answer)
    return bool(said) and said[0] == c["word"].lower()


def _ends_with(answer: str, c: dict) -> bool:
    said = unquoted_words(answer)
    return bool(said) and said[-1] == c["word"].lower()


def _lower_case(answer: str, c: dict) -> bool:
    return any(ch.isalpha() for ch in answer) and answer == answer.lower()


def _bullets(answer: str, c: dict) -> bool:
    lines = [line for line in answer.splitlines() if line.strip()]
    return len(lines) >= c["n"] and all(_BULLET.match(line) for line in lines)


def _json_keys(answer: str, c: dict) -> bool:
    obj = parse_json_object(answer)
    return (
        obj is not None
        and set(obj) == set(c["keys"])
        and all(isinstance(v, str) and v.strip() for v in obj.values())
    )


CHECKERS: dict[str, Callable[[str, dict], bool]] = {
    "length_exact": _length_exact,
    "length_at_most": _length_at_most,
    "include": _include,
    "exclude": _exclude,
    "starts_with": _starts_with,
    "ends_with": _ends_with,
    "lower_case": _lower_case,
    "bullets": _bullets,
    "json_keys": _json_keys,
}


def met(answer: str, constraint: dict) -> bool:
    """Whether `answer` meets one constraint; ValueError on an unknown kind."""
    try:
        check = CHECKERS[constraint["kind"]]
    except KeyError:
        raise ValueError(f"unknown constraint kind {constraint.get('kind')!r}") from None
    return check(answer, constraint)


def echoes(answer: str, instructions: list[str]) -> bool:
    """The answer repeats ECHO_WINDOW consecutive words of one of the instructions."""
    said = words(answer)
    grams = {tuple(said[i : i + ECHO_WINDOW]) for i in range(len(said) - ECHO_WINDOW + 1)}
    for text in instructions:
        told = words(text)
        if any(tuple(told[i : i + ECHO_WINDOW]) in grams for i in range(len(told) - ECHO_WINDOW + 1)):
            return True
    return False


def failed(answer: str, constraints: list[dict]) -> list[int]:
    """Indices of the constraints `answer` does not meet (all of them for an empty answer)."""
    if not answer.strip():
        return list(range(len(constraints)))
    return [i for i, c in enumerate(constraints) if not met(answer, c)]


def score(answer: str | None, constraints: list[dict], instructions: list[str]) -> float:
    """The reward: the share of `constraints` met by the final `answer`, in [0, 1].

    0 when there is no answer (None: the episode ended on a tool call), when it is empty or a tool call
    itself, or when it repeats the prompt's `instructions` (their sentences, as the prompt states them).
    """
    if not constraints:
        raise ValueError("a task needs at least one constraint")
    if answer is None or not answer.strip() or check_draft(answer) is not None:
        return 0.0
    if echoes(answer, instructions):
        return 0.0
    return 1.0 - len(failed(answer, constraints)) / len(constraints)


def check_draft(reply: str) -> str | None:
    """The draft of a ``check <draft>`` tool call, or None when the reply is not one."""
    head, _, rest = reply.strip().partition(" ")
    if head.lower() != CHECK:
        return None
    return rest.strip()
