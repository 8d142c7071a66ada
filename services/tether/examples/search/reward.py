"""The search agent's reward: pure functions over the answer text, the gold answer and the question.

Exact match (after normalising) earns 1.0. Otherwise an answer earns half its token F1 against the gold
answer as partial credit (a two-word job with one word right), so a miss never ties a hit. Two guards keep
F1 from being gamed: the partial-credit F1 ignores every word the question already holds (copying the
question earns nothing), and F1's precision punishes hedging (listing every candidate) and padding.
"""

from __future__ import annotations

import re
from collections import Counter

# Words that carry no answer (SQuAD's normalisation drops the articles; a trailing "." is punctuation).
ARTICLES = frozenset({"a", "an", "the"})
_PUNCT = re.compile(r"[^\w\s]")
PARTIAL_WEIGHT = 0.5


def normalize(text: str) -> list[str]:
    """Lower-cased words of `text` without punctuation and articles."""
    return [w for w in _PUNCT.sub(" ", text.lower()).split() if w not in ARTICLES]


def exact_match(prediction: str, gold: str) -> bool:
    return bool(normalize(gold)) and normalize(prediction) == normalize(gold)


def f1(prediction: list[str], gold: list[str]) -> float:
    """Token-level F1 of two word lists (multiset overlap); 0.0 when either is empty."""
    common = sum((Counter(prediction) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def score(prediction: str | None, gold: str, question: str = "") -> float:
    """The episode's reward: 1.0 for an exact match, else PARTIAL_WEIGHT x F1 over the words that are not
    in the question; 0.0 for no answer at all (None) or an empty one."""
    if prediction is None:
        return 0.0
    if exact_match(prediction, gold):
        return 1.0
    asked = set(normalize(question))
    pred = [w for w in normalize(prediction) if w not in asked]
    return PARTIAL_WEIGHT * f1(pred, [w for w in normalize(gold) if w not in asked])
