"""What one generated response's length and shape say: DAPO's soft overlong punishment, and a check for
degenerate repetition.

Who calls this: the merger, for every response of a finished rollout (``tether.merger.responses``):
the penalty shapes the rollout's reward before advantages (``merger.truncated_responses=penalty``),
the repetition check feeds the step's ``repetition_rate``. Plain Python, no numpy: a response is a
list of token ids and a few integers.
"""

from __future__ import annotations

from collections.abc import Sequence

# Degenerate repetition (``repetitive``): the n-gram order, the shortest response judged, the window at
# the end of the response that is judged, and the share of distinct n-grams under which it repeats.
REPETITION_NGRAM = 4
REPETITION_MIN_TOKENS = 32
REPETITION_WINDOW = 512
REPETITION_DISTINCT_SHARE = 0.3


def overlong_penalty(
    length: int, max_tokens: int | None, buffer: int, factor: float = 1.0, cut: bool = False
) -> float:
    """DAPO's soft overlong punishment ``R_length`` of one response, times ``factor`` (Yu et al. 2025,
    "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476, eq. 13; verl's
    DAPO recipe calls the two settings ``overlong_buffer.len`` and ``overlong_buffer.penalty_factor``).

    With ``L_max = max_tokens`` (the output limit the response was generated under), ``L_cache =
    buffer`` and ``|y| = length``::

        R_length = 0                                  if |y| <= L_max - L_cache
                   ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                   -1                                 if |y| > L_max

    so the penalty falls linearly from 0 to -1 over the last ``L_cache`` tokens the limit allows. A
    response ``cut`` by the limit is at the limit and would have gone on: -1 (what the formula gives at
    ``|y| = L_max``), whether or not its limit is known; a response that stopped by itself under an
    unknown limit gets 0. A buffer wider than the limit is taken as the whole limit (the ramp then starts
    at 0 tokens). Returns ``factor * R_length``, in ``[-factor, 0]``.
    """
    if buffer < 1:
        raise ValueError(f"overlong buffer must be at least one token, got {buffer}")
    if cut:
        return -factor
    if max_tokens is None:
        return 0.0
    cache = min(buffer, max_tokens)
    expected = max_tokens - cache
    if length <= expected:
        return 0.0
    if length <= max_tokens:
        return factor * (expected - length) / cache
    return -factor


def repetitive(
    token_ids: Sequence[int],
    n: int = REPETITION_NGRAM,
    min_tokens: int = REPETITION_MIN_TOKENS,
    window: int = REPETITION_WINDOW,
    share: float = REPETITION_DISTINCT_SHARE,
) -> bool:
    """Whether a response is degenerate repetition: at least ``min_tokens`` long, and among the n-grams
    of its last ``window`` tokens (the whole response when shorter) fewer than ``share`` are distinct.

    The end is what is judged because a model that falls into a loop does so after a sound beginning
    and stays in it until the output limit cuts it; the window also bounds the cost per response. A loop
    of a block of k tokens has about k distinct n-grams, so with the defaults (4-grams, 512 tokens,
    0.3) any block of up to ~150 tokens repeated to the end of the response counts; prose, code and
    tables of varying values have mostly distinct 4-grams.
    """
    if len(token_ids) < max(min_tokens, n):
        return False
    tail = list(token_ids[-window:])
    grams = [tuple(tail[i : i + n]) for i in range(len(tail) - n + 1)]
    return len(set(grams)) < share * len(grams)
