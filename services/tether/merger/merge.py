"""Merge one rollout's recorded LLM calls into training sequences (pure: no I/O, no torch).

docs/architecture.md, pitfalls 1 and 2.  We never see text here, only the token ids vLLM consumed and
sampled and the logprobs it reported, so nothing is ever re-tokenised.

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
  for the new turn but absent from history turns; ``generation_prompt_tail`` computes it from a
  tokenizer).  When the last merged prompt ends with ``strip_tail``, the view
  ``prompt[:-len(strip_tail)] + response`` is accepted as well (what Polar does).  The merged
  sequence keeps the tail where the model really saw it, so later turns are trained on a context that
  differs from their sampling context by those few tokens.
* ``realign_max > 0``: the prompt contains the view's prompt part exactly, and agrees with the last
  response except for its final ``<= realign_max`` tokens (the template or a tool-call parser
  re-rendered the end of the response: ``h+aving`` vs ``hav+ing``, a trailing newline the template
  strips, a different stop token).  At least one response token must agree.  The prompt's tokens
  win: the response tokens from the first divergence on are removed from the sequence, and the
  prompt's tokens there are appended with mask 0.  Counted in ``realigns`` (such a call also counts
  in ``merged_calls``).  Only tried when no exact/strip match exists.
* ``max_seq_len``: a call that would grow a sequence beyond it forks instead (counted in ``forks``
  and ``forks_max_len``, no mismatch example).  A single call longer than ``max_seq_len`` is then
  handled by ``overlong``: ``"drop"`` removes it (``calls_dropped_overlong``); ``"truncate"`` cuts
  its trailing tokens to ``max_seq_len``, sets ``Sequence.truncated`` and counts it in ``truncated``
  / ``tokens_truncated`` (a cut that leaves no sampled token drops it instead).
* ``max_prompt_len``: a call that would START a sequence (the first call, a fork) with a prompt
  longer than this is dropped (``calls_dropped_prompt_len``) under either policy: no cut of trailing
  tokens can save it.  Calls that join a sequence are bounded by ``max_seq_len`` only.

Mode ``"per-call"``: steps 1 and 2, then every kept call becomes its own sequence (``forks`` and
``merged_calls`` stay 0); ``max_prompt_len`` / ``max_seq_len`` / ``overlong`` apply per call.

A call's ``constrained`` spans (response tokens a grammar constrained, docs/merging.md
"Constrained decoding") enter the sequence with mask 0 and logprob 0.0; ``Sequence.constrained_tokens``
counts those still in it after realign and truncation.

Every sequence records ``response_spans``: one ``[start, end)`` per call (aligned with ``call_ids``)
locating the tokens of that call's response that are still trainable in ``token_ids``.

Cost: every slice comparison is bounded by the length of the prompt being matched; other candidate
sequences are screened with O(1) token probes and at most ``_MAX_FULL_COMPARES`` full comparisons
per call, so the walk is O(total tokens + calls * open sequences).
"""

from __future__ import annotations

import collections.abc as cabc
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

MAX_MISMATCH_EXAMPLES = 5
_MAX_FULL_COMPARES = 8
MergeMode = Literal["merge", "per-call"]
# An overlong sequence is dropped, or truncated (trailing tokens only; flagged and counted).
OverlongPolicy = Literal["drop", "truncate"]
MODES: tuple[MergeMode, ...] = get_args(MergeMode)
OVERLONG_POLICIES: tuple[OverlongPolicy, ...] = get_args(OverlongPolicy)


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
    # (version, start, end) over response token indexes, contiguous from 0 (vLLM's per-token record of
    # the weights that sampled them); empty = every token sampled by `weight_version`.
    weight_spans: tuple[tuple[int, int, int], ...] = ()
    # [start, end) over response token indexes that a grammar constrained (Trace.constrained_spans): they
    # enter the sequence with mask 0 and logprob 0.0, like context -- vLLM's logprob there is the masked
    # distribution's, not the policy's.
    constrained: tuple[tuple[int, int], ...] = ()

    def response_mask(self) -> tuple[list[int], list[float]]:
        """Loss mask and logprobs of the response as it enters a sequence: 1 and vLLM's logprob, except
        0 and 0.0 on constrained tokens."""
        n = len(self.response_token_ids)
        mask, lps = [1] * n, list(self.response_logprobs)
        for a, b in self.constrained:
            a, b = max(a, 0), min(b, n)
            mask[a:b] = [0] * max(b - a, 0)
            lps[a:b] = [0.0] * max(b - a, 0)
        return mask, lps

    def spans(self) -> tuple[tuple[int, int, int], ...]:
        return self.weight_spans or ((self.weight_version, 0, len(self.response_token_ids)),)


@dataclass
class Sequence:
    """One training sequence made of one or more calls."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 = sampled by the policy, 0 = prompt/observation or grammar-constrained
    logprobs: list[float]  # vLLM's logprob where mask 1, 0.0 where mask 0
    call_ids: list[str]
    # [start, end) of each call's still-trainable response tokens, aligned with call_ids.
    response_spans: list[tuple[int, int]] = field(default_factory=list)
    truncated: bool = False  # trailing tokens were cut (overlong="truncate")
    # Each call's Call.spans(), aligned with call_ids.
    call_weight_spans: list[tuple[tuple[int, int, int], ...]] = field(default_factory=list)

    @property
    def constrained_tokens(self) -> int:
        """Response tokens still in the sequence that are masked because a grammar constrained them:
        inside a call's response span every token is mask 1 unless constrained, and realign/truncation
        cut the spans together with the tokens, so this stays right after both."""
        return sum((b - a) - sum(self.loss_mask[a:b]) for a, b in self.response_spans)

    def version_spans(self) -> list[tuple[int, int, int]]:
        """(version, start, end) over this sequence's positions, for every trainable token: each
        call's spans moved to where its response sits, cut to what is still trainable (realigned or
        truncated tails are gone), neighbours of one version joined."""
        out: list[tuple[int, int, int]] = []
        mask = self.loss_mask
        for (a, b), spans in zip(self.response_spans, self.call_weight_spans, strict=True):
            for version, start, end in spans:
                lo, hi = a + start, min(a + end, b)
                if lo >= hi:
                    continue
                # Constrained tokens inside a response are not trainable: the spans skip them.
                pieces = [(lo, hi)] if 0 not in mask[lo:hi] else _runs_of_ones(mask, lo, hi)
                for lo, hi in pieces:
                    if out and out[-1][0] == version and out[-1][2] == lo:
                        out[-1] = (version, out[-1][1], hi)
                    else:
                        out.append((version, lo, hi))
        return out

    @property
    def min_weight_version(self) -> int:
        """The oldest policy version that sampled a trainable token of this sequence (the oldest
        call's version when none is left, 0 when empty)."""
        return min(
            (v for v, _, _ in self.version_spans()),
            default=min((v for spans in self.call_weight_spans for v, _, _ in spans), default=0),
        )


def _runs_of_ones(mask: list[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """[start, end) runs of mask 1 inside [lo, hi)."""
    runs: list[tuple[int, int]] = []
    i = lo
    while i < hi:
        if mask[i]:
            j = i
            while j < hi and mask[j]:
                j += 1
            runs.append((i, j))
            i = j
        else:
            i += 1
    return runs


@dataclass
class MergeStats:
    calls_in: int = 0
    calls_dropped_error: int = 0
    calls_dropped_empty: int = 0
    calls_deduped: int = 0
    sequences: int = 0
    merged_calls: int = 0  # calls that joined an existing sequence (realigned ones included)
    forks: int = 0  # sequences started after the first one (prefix mismatch or max_seq_len)
    realigns: int = 0
    # A few examples: {"call_id", "expected_prefix", "prompt", "diverge_at", "response_start"}
    # (token ids / indices; "response_start" is where the previous call's response began in
    # "expected_prefix").  ``compact_mismatch`` makes the bounded form that is published.
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    mismatched_calls: int = 0  # calls whose prompt continued no open sequence (all, not just examples)
    forks_max_len: int = 0  # forks because joining would exceed max_seq_len
    calls_dropped_prompt_len: int = 0
    calls_dropped_overlong: int = 0
    truncated: int = 0  # sequences whose trailing tokens were cut
    tokens_truncated: int = 0

    def dropped(self) -> dict[str, int]:
        """Calls not trained on, by reason (only non-zero reasons)."""
        out = {
            "error": self.calls_dropped_error,
            "empty": self.calls_dropped_empty,
            "retried": self.calls_deduped,
            "prompt_too_long": self.calls_dropped_prompt_len,
            "overlong": self.calls_dropped_overlong,
        }
        return {k: v for k, v in out.items() if v}


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
    mask, lp = c.response_mask() if c.constrained else ([1] * len(r), lp)
    seq = Sequence(
        token_ids=p + r,
        loss_mask=[0] * len(p) + mask,
        logprobs=[0.0] * len(p) + lp,
        call_ids=[c.call_id],
        response_spans=[(len(p), len(p) + len(r))],
        call_weight_spans=[c.spans()],
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


def _limit_lengths(
    seqs: list[Sequence], max_seq_len: int | None, overlong: str, stats: MergeStats
) -> list[Sequence]:
    """Drop or truncate sequences longer than max_seq_len (only single calls can be: merging forks)."""
    if max_seq_len is None:
        return seqs
    out: list[Sequence] = []
    for s in seqs:
        n = len(s.token_ids)
        if n <= max_seq_len:
            out.append(s)
            continue
        if overlong == "truncate" and any(s.loss_mask[:max_seq_len]):
            del s.token_ids[max_seq_len:]
            del s.loss_mask[max_seq_len:]
            del s.logprobs[max_seq_len:]
            s.response_spans = [(min(a, max_seq_len), min(b, max_seq_len)) for a, b in s.response_spans]
            s.truncated = True
            stats.truncated += 1
            stats.tokens_truncated += n - max_seq_len
            out.append(s)
        else:
            stats.calls_dropped_overlong += len(s.call_ids)
    return out


def _check_options(
    mode: str, realign_max: int, max_seq_len: int | None, max_prompt_len: int | None, overlong: str
) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if realign_max < 0:
        raise ValueError(f"realign_max must be >= 0, got {realign_max}")
    if max_seq_len is not None and max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive, got {max_seq_len}")
    if max_prompt_len is not None and max_prompt_len <= 0:
        raise ValueError(f"max_prompt_len must be positive, got {max_prompt_len}")
    if overlong not in OVERLONG_POLICIES:
        raise ValueError(f"overlong must be one of {OVERLONG_POLICIES}, got {overlong!r}")


def _exact_match(recent: list[_Open], p: list[int], tail: list[int]) -> tuple[_Open | None, int]:
    """The open sequence whose view (optionally tail-stripped) the prompt starts with, most recently
    extended first, and how many prompt tokens that view covers."""
    budget = _MAX_FULL_COMPARES
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
                return o, end
    return None, 0


def _realign_match(
    recent: list[_Open], p: list[int], tail: list[int], realign_max: int
) -> tuple[_Open | None, int, int]:
    """The open sequence whose view the prompt reproduces except the response's last ``realign_max``
    tokens; how many prompt tokens it covers, and how many response tokens to remove."""
    budget = _MAX_FULL_COMPARES
    for o in reversed(recent):
        if budget <= 0:
            break
        R = o.response
        safe = max(len(R) - realign_max, 1)  # response tokens that must match exactly
        for cut in _cuts(o, tail):
            if len(p) < cut + safe or p[cut] != R[0]:
                continue
            budget -= 1
            if p[cut : cut + safe] != R[:safe] or not _prompt_part_matches(p, o.prompt, cut):
                continue
            j = safe
            stop = min(len(R), len(p) - cut)
            while j < stop and p[cut + j] == R[j]:
                j += 1
            if j < len(R):  # j == len(R) would have been an exact match
                return o, cut + j, len(R) - j
    return None, 0, 0


def _note_mismatch(stats: MergeStats, c: Call, p: list[int], cur: _Open) -> None:
    """Count a call whose prompt continued no open sequence; keep a few examples against the current
    sequence."""
    stats.mismatched_calls += 1
    if len(stats.mismatches) < MAX_MISMATCH_EXAMPLES:
        expected = cur.prompt + cur.response
        stats.mismatches.append(
            {
                "call_id": c.call_id,
                "expected_prefix": expected,
                "prompt": list(p),
                "diverge_at": _diverge_at(expected, p),
                "response_start": len(cur.prompt),
            }
        )


def _join(target: _Open, c: Call, p: list[int], r: list[int], lp: list[float], keep: int, drop: int) -> None:
    """Append the call to the sequence: its response's last ``drop`` tokens removed (realign), the
    prompt beyond the first ``keep`` tokens as context, then the response."""
    s = target.seq
    if drop:
        del s.token_ids[-drop:]
        del s.loss_mask[-drop:]
        del s.logprobs[-drop:]
        a, b = s.response_spans[-1]
        s.response_spans[-1] = (a, b - drop)
    extra = len(p) - keep
    s.token_ids.extend(p[keep:])
    s.loss_mask.extend([0] * extra)
    s.logprobs.extend([0.0] * extra)
    start = len(s.token_ids)
    mask, lp = c.response_mask() if c.constrained else ([1] * len(r), lp)
    s.token_ids.extend(r)
    s.loss_mask.extend(mask)
    s.logprobs.extend(lp)
    s.call_ids.append(c.call_id)
    s.response_spans.append((start, start + len(r)))
    s.call_weight_spans.append(c.spans())
    target.prompt, target.response = p, r


def _per_call(
    kept: list[tuple[Call, list[int], list[int], list[float]]], max_prompt_len: int | None, stats: MergeStats
) -> list[Sequence]:
    seqs = []
    for c, p, r, lp in kept:
        if max_prompt_len is not None and len(p) > max_prompt_len:
            stats.calls_dropped_prompt_len += 1
            continue
        seqs.append(_new_sequence(c, p, r, lp).seq)
    return seqs


def _walk(
    kept: list[tuple[Call, list[int], list[int], list[float]]],
    tail: list[int],
    realign_max: int,
    max_seq_len: int | None,
    max_prompt_len: int | None,
    stats: MergeStats,
) -> list[Sequence]:
    """Step 3: each kept call joins an open sequence (exact, tail-stripped or realigned match) or
    forks a new one. The sequences in creation order, before length limits."""
    opened: list[_Open] = []  # in creation order (= output order)
    recent: list[_Open] = []  # most recently extended last
    for c, p, r, lp in kept:
        target, keep = _exact_match(recent, p, tail)
        drop = 0  # trailing response tokens of the sequence to remove (realign)
        if target is None and realign_max > 0:
            target, keep, drop = _realign_match(recent, p, tail, realign_max)

        fork_reason = None
        if target is not None and max_seq_len is not None:
            new_len = len(target.seq.token_ids) - drop + (len(p) - keep) + len(r)
            if new_len > max_seq_len:
                target, fork_reason = None, "max_len"
        elif target is None and opened:
            fork_reason = "mismatch"
            _note_mismatch(stats, c, p, recent[-1])

        if target is None:
            if max_prompt_len is not None and len(p) > max_prompt_len:
                stats.calls_dropped_prompt_len += 1
                continue
            if opened:
                stats.forks += 1
                if fork_reason == "max_len":
                    stats.forks_max_len += 1
            o = _new_sequence(c, p, r, lp)
            opened.append(o)
            recent.append(o)
            continue

        if drop:
            stats.realigns += 1
        _join(target, c, p, r, lp, keep, drop)
        stats.merged_calls += 1
        if recent[-1] is not target:
            recent.remove(target)
            recent.append(target)
    return [o.seq for o in opened]


def merge_calls(
    calls: list[Call],
    mode: MergeMode = "merge",
    strip_tail: cabc.Sequence[int] = (),
    realign_max: int = 0,
    max_seq_len: int | None = None,
    max_prompt_len: int | None = None,
    overlong: OverlongPolicy = "drop",
) -> tuple[list[Sequence], MergeStats]:
    """Turn one rollout's calls (in call order) into training sequences.  See the module docstring."""
    _check_options(mode, realign_max, max_seq_len, max_prompt_len, overlong)
    stats = MergeStats(calls_in=len(calls))
    kept = _filter(calls, stats)
    if mode == "per-call":
        seqs = _per_call(kept, max_prompt_len, stats)
    else:
        seqs = _walk(kept, list(strip_tail), realign_max, max_seq_len, max_prompt_len, stats)
    seqs = _limit_lengths(seqs, max_seq_len, overlong, stats)
    stats.sequences = len(seqs)
    return seqs, stats


# ---------------------------------------------------------------- mismatch examples


def compact_mismatch(example: dict[str, Any], window: int = 24) -> dict[str, Any]:
    """The bounded form of a mismatch example that is stored and published.

    ``common_tail``: the last ``window`` tokens both sides agree on; ``expected``: the next ``window``
    tokens of the previous call's prompt + response; ``got``: the next ``window`` tokens of the new
    prompt.  ``in_response``: the divergence falls inside the previous call's response (re-rendered
    or re-tokenised by the harness) rather than in earlier context (history rewritten).
    """
    e, p, d = example["expected_prefix"], example["prompt"], int(example["diverge_at"])
    rs = example.get("response_start")
    return {
        "call_id": example.get("call_id", ""),
        "diverge_at": d,
        "expected_len": len(e),
        "prompt_len": len(p),
        "in_response": None if rs is None else d >= rs,
        "common_tail": list(e[max(0, d - window) : d]),
        "expected": list(e[d : d + window]),
        "got": list(p[d : d + window]),
    }


def _show(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")


def format_mismatch(example: dict[str, Any], decode: cabc.Callable[[list[int]], str]) -> str:
    """Render a mismatch example (full or ``compact_mismatch`` form) as a readable token diff.

    The decoded tail of the common prefix, then ``- expected`` (what continuing the previous call's
    context needed) and ``+ got`` (what the new prompt has there), each decoded and with its token
    ids: decoding can hide the difference (``h+aving`` and ``hav+ing`` read the same).
    """
    ex = compact_mismatch(example) if "expected_prefix" in example else example
    d = ex["diverge_at"]
    where = {True: "inside the previous response", False: "in earlier context", None: "?"}[
        ex.get("in_response")
    ]
    head = f"call {ex.get('call_id') or '?'}"
    if ex.get("rollout_id"):
        head += f" (rollout {ex['rollout_id']})"
    lines = [
        f"{head}: prompt diverges at token {d} {where} "
        f"(expected context {ex.get('expected_len', '?')} tokens, prompt {ex.get('prompt_len', '?')})",
    ]
    tail = ex.get("common_tail") or []
    more = "..." if d > len(tail) else ""
    lines.append(f"  {more}{_show(decode(list(tail)))}")
    for sign, label, key in (("-", "expected", "expected"), ("+", "got", "got")):
        ids = list(ex.get(key) or [])
        text = _show(decode(ids)) if ids else "(end)"
        lines.append(f"{sign} {label + ':':<9} {text}    {ids}")
    return "\n".join(lines)


# ---------------------------------------------------------------- strip tail from a tokenizer


def _template_ids(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any
) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, **kwargs
    )
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):  # batched answer
        out = out[0]
    return [int(x) for x in out]


def generation_prompt_tail(tokenizer: Any, **template_kwargs: Any) -> list[int]:
    """Token ids the chat template appends as generation prompt but does not re-render in history.

    The generation prompt is ``render([user], add_generation_prompt=True)`` minus
    ``render([user])``; the part of it a history turn starts with as well (``<|im_start|>assistant\\n``)
    is kept, the rest is the tail to strip (Qwen3 with ``enable_thinking=False``:
    ``<think>\\n\\n</think>\\n\\n``; a plain ChatML template: nothing).  ``template_kwargs`` go to
    ``apply_chat_template`` (e.g. ``enable_thinking=False``).  Duck-typed: any object with a
    Hugging Face ``apply_chat_template`` works.
    """
    user = [{"role": "user", "content": "x"}]
    base = _template_ids(tokenizer, user, False, **template_kwargs)
    with_gp = _template_ids(tokenizer, user, True, **template_kwargs)
    if with_gp[: len(base)] != base:
        return []
    gp = with_gp[len(base) :]
    try:
        hist = _template_ids(
            tokenizer,
            user + [{"role": "assistant", "content": "y"}, {"role": "user", "content": "z"}],
            False,
            **template_kwargs,
        )
    except Exception:  # a template that cannot render this probe: strip the whole generation prompt
        return gp
    if hist[: len(base)] != base:
        return gp
    k = _diverge_at(gp, hist[len(base) :])
    return gp[k:]
