"""Merge one rollout's recorded LLM calls into training sequences (pure: no I/O, no torch).

DESIGN.md pitfalls 1 and 2.  We never see text here, only the token ids vLLM consumed and sampled and
the logprobs it reported, so nothing is ever re-tokenised.

Mode ``"merge"`` (default), in four steps:

1. **Drop** calls whose ``status != "ok"`` (``calls_dropped_error``), then calls that sampled no
   token (``calls_dropped_empty``).
2. **Dedupe** retries: calls with identical ``prompt_token_ids`` keep only the LAST one, which stays
   at its own position (``[1,2]->[10], [3,4]->[20], [1,2]->[30]`` leaves ``[3,4]->[20], [1,2]->[30]``).
   Note this also collapses deliberate repeats of one prompt (two identical sub-agent requests).
3. **Walk** the kept calls in order.  Every sequence remembers the last call merged into it; its
   *view* is that call's ``prompt + response``, i.e. exactly the context the next turn of the same
   conversation should start with.  A call **joins** a sequence when its prompt starts with that view:
   the prompt tokens beyond the view (tool results, the next user turn, the template's generation
   prompt) are appended with mask 0 / logprob 0.0, then its response with mask 1 and vLLM's logprobs.
   For plain exact-prefix merging the view IS the sequence's full ``token_ids``.
   Candidates are tried most-recently-extended first, so the current sequence wins; older sequences
   are tried too, so a side call (a sub-agent, a title/safety classifier call) interleaved with the
   main conversation does not fork the main conversation when it resumes.
   Otherwise the call **forks**: it starts a new sequence (prompt mask 0, response mask 1) and a
   mismatch example against the current sequence is recorded (at most ``MAX_MISMATCH_EXAMPLES``).
4. Sequences come out ordered by their first call; inside a sequence calls keep call order.

Options:

* ``strip_tail``: token ids of the part of the generation prompt that the chat template does NOT
  re-render when it renders that assistant turn as history (e.g. Qwen3's empty
  ``<think>\\n\\n</think>\\n\\n`` with thinking off, which is emitted after ``<|im_start|>assistant\\n``
  for the new turn but absent from history turns).  When the last merged prompt ends with
  ``strip_tail``, the view ``prompt[:-len(strip_tail)] + response`` is accepted as well (what Polar
  does).  The merged sequence keeps the tail where the model really saw it, so later turns are
  trained on a context that differs from their sampling context by those few tokens.
* ``realign_max > 0``: the prompt contains the view's prompt part exactly, and agrees with the last
  response except for its final ``<= realign_max`` tokens (the template or a tool-call parser
  re-rendered the end of the response: ``h+aving`` vs ``hav+ing``, a dropped stop token).  The
  prompt's tokens win: the response tokens from the first divergence on are removed from the
  sequence, and the prompt's tokens there are appended with mask 0.  Counted in ``realigns`` (such a
  call also counts in ``merged_calls``).  Only tried when no exact/strip match exists.
* ``max_seq_len``: a call that would grow a sequence beyond it forks instead (counted in ``forks``,
  no mismatch example).  A single call longer than ``max_seq_len`` still becomes its own sequence;
  truncating or dropping it is the caller's decision.

Mode ``"per-call"``: steps 1 and 2, then every kept call becomes its own sequence (``forks`` and
``merged_calls`` stay 0).

Cost: every slice comparison is bounded by the length of the prompt being matched; other candidate
sequences are screened with O(1) token probes and at most ``_MAX_FULL_COMPARES`` full comparisons
per call, so the walk is O(total tokens + calls * open sequences).
"""

from __future__ import annotations

import collections.abc as cabc
from dataclasses import dataclass, field

MAX_MISMATCH_EXAMPLES = 5
_MAX_FULL_COMPARES = 8
MODES = ("merge", "per-call")


@dataclass(frozen=True)
class Call:
    """One recorded LLM call: the exact ids vLLM consumed and sampled."""

    call_id: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]  # same length as response_token_ids
    weight_version: int = 0
    status: str = "ok"  # calls with status != "ok" are dropped
    reward: float | None = None  # optional per-call reward


@dataclass
class Sequence:
    """One training sequence made of one or more calls."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 = sampled by the policy, 0 = prompt/observation
    logprobs: list[float]  # vLLM's logprob where mask 1, 0.0 where mask 0
    call_ids: list[str]
    weight_versions: list[int]  # one per call merged in, in call order

    @property
    def min_weight_version(self) -> int:
        """The oldest policy version that sampled any token of this sequence (0 when empty)."""
        return min(self.weight_versions, default=0)


@dataclass
class MergeStats:
    calls_in: int = 0
    calls_dropped_error: int = 0
    calls_dropped_empty: int = 0
    calls_deduped: int = 0
    sequences: int = 0
    merged_calls: int = 0  # calls that joined an existing sequence (realigned ones included)
    forks: int = 0  # calls after the first that started a new sequence (mismatch or max_seq_len)
    realigns: int = 0
    # A few examples: {"call_id", "expected_prefix", "prompt", "diverge_at"} (token ids / index).
    mismatches: list[dict] = field(default_factory=list)


class _Open:
    """A sequence under construction plus the last call merged into it (its view)."""

    __slots__ = ("seq", "prompt", "response")

    def __init__(self, seq: Sequence, prompt: list[int], response: list[int]):
        self.seq = seq
        self.prompt = prompt
        self.response = response


def _filter(calls: list[Call], stats: MergeStats) -> list[tuple[Call, list[int], list[int], list[float]]]:
    """Steps 1 and 2: drop errored and empty calls, then keep the last of each identical prompt."""
    kept: list[tuple[Call, list[int], list[int], list[float]]] = []
    for c in calls:
        if c.status != "ok":
            stats.calls_dropped_error += 1
            continue
        if len(c.response_token_ids) == 0:
            stats.calls_dropped_empty += 1
            continue
        if len(c.response_logprobs) != len(c.response_token_ids):
            raise ValueError(
                f"call {c.call_id!r}: {len(c.response_logprobs)} logprobs for "
                f"{len(c.response_token_ids)} response tokens"
            )
        # Copy to plain lists: callers may hand tuples, and list == tuple is always False.
        kept.append((c, list(c.prompt_token_ids), list(c.response_token_ids), list(c.response_logprobs)))
    last: dict[tuple[int, ...], int] = {}
    for i, (_, p, _, _) in enumerate(kept):
        last[tuple(p)] = i
    out = [k for i, k in enumerate(kept) if last[tuple(k[1])] == i]
    stats.calls_deduped = len(kept) - len(out)
    return out


def _new_sequence(c: Call, p: list[int], r: list[int], lp: list[float]) -> _Open:
    seq = Sequence(
        token_ids=p + r,
        loss_mask=[0] * len(p) + [1] * len(r),
        logprobs=[0.0] * len(p) + lp,
        call_ids=[c.call_id],
        weight_versions=[c.weight_version],
    )
    return _Open(seq, p, r)


def _cuts(o: _Open, tail: list[int]) -> list[int]:
    """Lengths of the last prompt to match against: all of it, then (optionally) minus the tail."""
    n = len(o.prompt)
    cuts = [n]
    t = len(tail)
    if t and n >= t and o.prompt[n - t :] == tail:
        cuts.append(n - t)
    return cuts


def _prompt_part_matches(p: list[int], prompt: list[int], cut: int) -> bool:
    """p[:cut] == prompt[:cut], with cheap probes first.  Requires len(p) >= cut."""
    if cut == 0:
        return True
    for i in (cut - 1, cut // 2, cut // 4, (3 * cut) // 4, 0):
        if p[i] != prompt[i]:
            return False
    return p[:cut] == (prompt if cut == len(prompt) else prompt[:cut])


def _diverge_at(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def merge_calls(
    calls: list[Call],
    mode: str = "merge",
    strip_tail: cabc.Sequence[int] = (),
    realign_max: int = 0,
    max_seq_len: int | None = None,
) -> tuple[list[Sequence], MergeStats]:
    """Turn one rollout's calls (in call order) into training sequences.  See the module docstring."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if realign_max < 0:
        raise ValueError(f"realign_max must be >= 0, got {realign_max}")
    if max_seq_len is not None and max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    tail = list(strip_tail)

    stats = MergeStats(calls_in=len(calls))
    kept = _filter(calls, stats)

    if mode == "per-call":
        seqs = [_new_sequence(c, p, r, lp).seq for c, p, r, lp in kept]
        stats.sequences = len(seqs)
        return seqs, stats

    opened: list[_Open] = []  # in creation order (= output order)
    recent: list[_Open] = []  # most recently extended last
    for c, p, r, lp in kept:
        target: _Open | None = None
        keep = 0  # tokens of p already present in the sequence (the matched view)
        drop = 0  # trailing response tokens of the sequence to remove (realign)
        budget = _MAX_FULL_COMPARES

        # Exact (or tail-stripped) prefix match, most recently extended sequence first.
        for o in reversed(recent):
            if budget <= 0:
                break
            R = o.response
            for cut in _cuts(o, tail):
                end = cut + len(R)
                if len(p) < end or p[cut] != R[0] or p[end - 1] != R[-1]:
                    continue
                budget -= 1
                if p[cut:end] == R and _prompt_part_matches(p, o.prompt, cut):
                    target, keep = o, end
                    break
            if target is not None:
                break

        # Realign: prompt part matches, the response diverges only in its last realign_max tokens.
        if target is None and realign_max > 0:
            budget = _MAX_FULL_COMPARES
            for o in reversed(recent):
                if budget <= 0:
                    break
                R = o.response
                safe = max(len(R) - realign_max, 0)  # response tokens that must match exactly
                for cut in _cuts(o, tail):
                    if len(p) < cut + safe:
                        continue
                    budget -= 1
                    if p[cut : cut + safe] != R[:safe] or not _prompt_part_matches(p, o.prompt, cut):
                        continue
                    j = safe
                    stop = min(len(R), len(p) - cut)
                    while j < stop and p[cut + j] == R[j]:
                        j += 1
                    if j < len(R):  # j == len(R) would have been an exact match
                        target, keep, drop = o, cut + j, len(R) - j
                        break
                if target is not None:
                    break

        if target is not None and max_seq_len is not None:
            new_len = len(target.seq.token_ids) - drop + (len(p) - keep) + len(r)
            if new_len > max_seq_len:
                target = None
                stats.forks += 1
        elif target is None and opened:
            stats.forks += 1
            if len(stats.mismatches) < MAX_MISMATCH_EXAMPLES:
                cur = recent[-1]
                expected = cur.prompt + cur.response
                stats.mismatches.append(
                    {
                        "call_id": c.call_id,
                        "expected_prefix": expected,
                        "prompt": list(p),
                        "diverge_at": _diverge_at(expected, p),
                    }
                )

        if target is None:
            o = _new_sequence(c, p, r, lp)
            opened.append(o)
            recent.append(o)
            continue

        s = target.seq
        if drop:
            del s.token_ids[-drop:]
            del s.loss_mask[-drop:]
            del s.logprobs[-drop:]
            stats.realigns += 1
        extra = len(p) - keep
        s.token_ids.extend(p[keep:])
        s.loss_mask.extend([0] * extra)
        s.logprobs.extend([0.0] * extra)
        s.token_ids.extend(r)
        s.loss_mask.extend([1] * len(r))
        s.logprobs.extend(lp)
        s.call_ids.append(c.call_id)
        s.weight_versions.append(c.weight_version)
        target.prompt, target.response = p, r
        stats.merged_calls += 1
        if recent[-1] is not target:
            recent.remove(target)
            recent.append(target)

    seqs = [o.seq for o in opened]
    stats.sequences = len(seqs)
    return seqs, stats
