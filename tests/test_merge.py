"""Tests for tether.merger.merge: exact-prefix merging, forks, dedupe, drops, options."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tether.merger.merge import (
    MAX_MISMATCH_EXAMPLES,
    Call,
    MergeStats,
    Sequence,
    compact_mismatch,
    format_mismatch,
    generation_prompt_tail,
    merge_calls,
)


def C(cid, prompt, response, logprobs=None, **kw):
    if logprobs is None:
        logprobs = [-(i + 1) / 10 for i in range(len(response))]
    return Call(cid, list(prompt), list(response), list(logprobs), **kw)


def check_shapes(seqs: list[Sequence]) -> None:
    for s in seqs:
        assert len(s.token_ids) == len(s.loss_mask) == len(s.logprobs)
        assert len(s.call_ids) == len(s.call_weight_spans) == len(s.response_spans) >= 1
        assert set(s.loss_mask) <= {0, 1}
        assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m == 0)
        # The weight spans cover exactly the trainable positions, in order.
        covered = [i for _, a, b in s.version_spans() for i in range(a, b)]
        assert covered == [i for i, m in enumerate(s.loss_mask) if m == 1]


# ---------------------------------------------------------------- facts from the brief / Agent Lightning


def test_dedupe_keeps_last_retry_in_its_position():
    calls = [C("a", [1, 2], [10]), C("b", [3, 4], [20]), C("c", [1, 2], [30])]
    seqs, stats = merge_calls(calls, mode="per-call")
    assert [(s.token_ids, s.call_ids) for s in seqs] == [([3, 4, 20], ["b"]), ([1, 2, 30], ["c"])]
    assert stats.calls_deduped == 1
    # Same in merge mode: [3,4,20] and [1,2,...] do not prefix each other.
    seqs, stats = merge_calls(calls)
    assert [s.call_ids for s in seqs] == [["b"], ["c"]]
    assert [s.token_ids for s in seqs] == [[3, 4, 20], [1, 2, 30]]
    assert stats.calls_deduped == 1 and stats.sequences == 2 and stats.forks == 1


def test_unrelated_calls_fork_and_record_mismatch():
    seqs, stats = merge_calls([C("a", [1], [2]), C("b", [9], [10])])
    assert [s.token_ids for s in seqs] == [[1, 2], [9, 10]]
    assert [s.loss_mask for s in seqs] == [[0, 1], [0, 1]]
    assert stats.sequences == 2 and stats.forks == 1 and stats.merged_calls == 0
    assert stats.mismatches == [
        {"call_id": "b", "expected_prefix": [1, 2], "prompt": [9], "diverge_at": 0, "response_start": 1}
    ]
    assert stats.mismatched_calls == 1


def test_three_call_episode_merges_into_one_sequence_exactly():
    sys_user = [100, 101, 102]
    r1, l1 = [7, 8], [-0.5, -0.25]
    obs1 = [200, 201, 202]
    r2, l2 = [9], [-1.5]
    obs2 = [203]
    r3, l3 = [11, 12, 13], [-0.125, -2.0, -3.0]
    p1 = sys_user
    p2 = p1 + r1 + obs1
    p3 = p2 + r2 + obs2
    calls = [
        C("c1", p1, r1, l1, weight_version=3),
        C("c2", p2, r2, l2, weight_version=4),
        C("c3", p3, r3, l3, weight_version=4),
    ]
    seqs, stats = merge_calls(calls)
    assert len(seqs) == 1
    s = seqs[0]
    assert s.token_ids == [100, 101, 102, 7, 8, 200, 201, 202, 9, 203, 11, 12, 13]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 1, 1]
    assert s.logprobs == [0.0, 0.0, 0.0, -0.5, -0.25, 0.0, 0.0, 0.0, -1.5, 0.0, -0.125, -2.0, -3.0]
    assert s.call_ids == ["c1", "c2", "c3"]
    assert [spans[0][0] for spans in s.call_weight_spans] == [3, 4, 4]
    assert s.min_weight_version == 3
    assert stats == MergeStats(
        calls_in=3,
        calls_dropped_error=0,
        calls_dropped_empty=0,
        calls_deduped=0,
        sequences=1,
        merged_calls=2,
        forks=0,
        realigns=0,
        mismatches=[],
    )
    # The output does not alias the inputs.
    s.token_ids.append(0)
    assert calls[0].prompt_token_ids == sys_user and calls[0].response_token_ids == r1


def test_call_with_prompt_equal_to_view_merges_with_no_observation():
    seqs, _ = merge_calls([C("a", [1, 2], [3]), C("b", [1, 2, 3], [4])])
    assert [s.token_ids for s in seqs] == [[1, 2, 3, 4]]
    assert seqs[0].loss_mask == [0, 0, 1, 1]


def test_fork_mid_episode_when_history_is_rewritten():
    # Turn 2's prompt re-rendered turn 1's response differently (e.g. the template dropped <think>).
    calls = [
        C("c1", [1, 2], [50, 51, 52]),
        C("c2", [1, 2, 52, 60], [70]),
        C("c3", [1, 2, 52, 60, 70, 61], [71]),
    ]
    seqs, stats = merge_calls(calls)
    assert [s.call_ids for s in seqs] == [["c1"], ["c2", "c3"]]
    assert seqs[1].token_ids == [1, 2, 52, 60, 70, 61, 71]
    assert seqs[1].loss_mask == [0, 0, 0, 0, 1, 0, 1]
    assert stats.forks == 1 and stats.merged_calls == 1 and stats.sequences == 2
    (mm,) = stats.mismatches
    assert mm == {
        "call_id": "c2",
        "expected_prefix": [1, 2, 50, 51, 52],
        "prompt": [1, 2, 52, 60],
        "diverge_at": 2,
        "response_start": 2,
    }


def test_errored_and_empty_calls_are_dropped_and_counted():
    calls = [
        C("a", [1], [2]),
        C("err", [1, 2, 3], [4], status="error"),
        C("empty", [1, 2, 5], []),
        C("b", [1, 2, 3], [6]),
    ]
    seqs, stats = merge_calls(calls)
    assert [s.call_ids for s in seqs] == [["a", "b"]]
    assert seqs[0].token_ids == [1, 2, 3, 6]
    assert stats.calls_in == 4 and stats.calls_dropped_error == 1 and stats.calls_dropped_empty == 1
    assert stats.calls_deduped == 0  # dropping happens before dedupe: "err" is not a retry of "b"


def test_errored_retry_does_not_hide_the_good_call():
    seqs, stats = merge_calls([C("ok", [1], [2]), C("retry", [1], [3], status="error")])
    assert [s.call_ids for s in seqs] == [["ok"]]
    assert stats.calls_dropped_error == 1 and stats.calls_deduped == 0


def test_empty_input():
    seqs, stats = merge_calls([])
    assert seqs == [] and stats == MergeStats(0, 0, 0, 0, 0, 0, 0, 0, [])


def test_per_call_mode_gives_one_sequence_per_kept_call():
    calls = [
        C("a", [1], [2]),
        C("b", [1, 2, 3], [4]),
        C("bad", [5], [6], status="timeout"),
        C("c", [1, 2, 3, 4, 5], [6]),
    ]
    seqs, stats = merge_calls(calls, mode="per-call")
    assert [s.token_ids for s in seqs] == [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]]
    assert [s.loss_mask for s in seqs] == [[0, 1], [0, 0, 0, 1], [0, 0, 0, 0, 0, 1]]
    assert [s.call_ids for s in seqs] == [["a"], ["b"], ["c"]]
    assert (
        stats.sequences == 3
        and stats.forks == 0
        and stats.merged_calls == 0
        and stats.calls_dropped_error == 1
    )
    merged, _ = merge_calls(calls)
    assert len(merged) == 1


def test_interleaved_side_call_does_not_fork_the_main_conversation():
    main1 = C("m1", [1, 2], [3])
    side = C("s1", [90, 91], [92])  # e.g. a title-generation or sub-agent call
    main2 = C("m2", [1, 2, 3, 4], [5])
    side2 = C("s2", [90, 91, 92, 93], [94])
    seqs, stats = merge_calls([main1, side, main2, side2])
    assert [s.call_ids for s in seqs] == [["m1", "m2"], ["s1", "s2"]]
    assert [s.token_ids for s in seqs] == [[1, 2, 3, 4, 5], [90, 91, 92, 93, 94]]
    assert stats.sequences == 2 and stats.forks == 1 and stats.merged_calls == 2


def test_longer_context_wins_over_a_prefix_of_it():
    # Two sequences whose views are both prefixes of the next prompt: the most recent one is chosen.
    calls = [C("a", [1], [2]), C("b", [1, 2, 3], [4]), C("c", [1, 2, 3, 4, 5], [6])]
    seqs, _ = merge_calls(calls, max_seq_len=6)
    assert [s.call_ids for s in seqs] == [["a", "b", "c"]]
    seqs, stats = merge_calls(calls, max_seq_len=5)  # c forks, and alone it is still too long
    assert [s.call_ids for s in seqs] == [["a", "b"]]
    assert stats.forks == stats.forks_max_len == 1 and stats.calls_dropped_overlong == 1


# ---------------------------------------------------------------- options


THINK = [151667, 198, 151668, 198]  # stand-in ids for "<think>\n</think>\n"


def test_strip_tail_accepts_history_rendered_without_generation_tail():
    hdr = [10, 11]  # "<|im_start|>assistant\n"
    p1 = [1, 2] + hdr + THINK
    r1 = [5, 6, 99]  # ... "<|im_end|>"
    p2 = [1, 2] + hdr + r1 + [20, 21] + hdr + THINK  # history turn rendered without THINK
    r2 = [7, 99]
    p3 = [1, 2] + hdr + r1 + [20, 21] + hdr + r2 + [22] + hdr + THINK
    r3 = [8]
    calls = [C("c1", p1, r1), C("c2", p2, r2), C("c3", p3, r3)]

    seqs, stats = merge_calls(calls)
    assert len(seqs) == 3 and stats.forks == 2

    seqs, stats = merge_calls(calls, strip_tail=THINK)
    assert len(seqs) == 1 and stats.forks == 0 and stats.merged_calls == 2
    s = seqs[0]
    # The sequence keeps THINK where the model saw it before each response.
    assert s.token_ids == p1 + r1 + [20, 21] + hdr + THINK + r2 + [22] + hdr + THINK + r3
    mask1 = [t for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m]
    assert mask1 == r1 + r2 + r3
    check_shapes(seqs)


def test_strip_tail_is_only_removed_when_the_prompt_ends_with_it():
    # The previous prompt does not end with the tail, so the stripped view does not apply.
    calls = [C("a", [1, 2, 3], [4]), C("b", [1, 2, 4], [5])]
    seqs, _ = merge_calls(calls, strip_tail=[2])
    assert len(seqs) == 2
    seqs, _ = merge_calls(calls, strip_tail=[3])  # here it does end with it
    assert [s.token_ids for s in seqs] == [[1, 2, 3, 4, 5]]
    calls = [C("a", [1, 2, 3], [4]), C("b", [1, 2, 4, 6], [5])]
    seqs, _ = merge_calls(calls, strip_tail=[3])
    assert [s.token_ids for s in seqs] == [[1, 2, 3, 4, 6, 5]]


def test_realign_short_divergence_prompt_tokens_win():
    r1 = [5, 6, 7, 8]
    lp1 = [-0.1, -0.2, -0.3, -0.4]
    p2 = [1, 2] + [5, 6, 77, 88, 89] + [30]  # the last two response tokens were re-tokenised into three
    calls = [C("a", [1, 2], r1, lp1), C("b", p2, [9], [-0.9])]

    seqs, stats = merge_calls(calls)
    assert len(seqs) == 2 and stats.realigns == 0

    seqs, stats = merge_calls(calls, realign_max=1)
    assert len(seqs) == 2 and stats.realigns == 0  # divergence is 2 tokens from the end

    seqs, stats = merge_calls(calls, realign_max=2)
    assert len(seqs) == 1 and stats.realigns == 1 and stats.merged_calls == 1 and stats.forks == 0
    s = seqs[0]
    assert s.token_ids == [1, 2, 5, 6, 77, 88, 89, 30, 9]
    assert s.loss_mask == [0, 0, 1, 1, 0, 0, 0, 0, 1]
    assert s.logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, 0.0, 0.0, 0.0, -0.9]
    assert s.call_ids == ["a", "b"]
    check_shapes(seqs)


def test_realign_when_prompt_drops_the_stop_token():
    # The next prompt is a strict prefix of the view (stop token not kept) followed by nothing new.
    calls = [C("a", [1], [2, 3, 99]), C("b", [1, 2, 3], [4])]
    seqs, stats = merge_calls(calls, realign_max=1)
    assert [s.token_ids for s in seqs] == [[1, 2, 3, 4]]
    assert seqs[0].loss_mask == [0, 1, 1, 1]
    assert stats.realigns == 1


def test_realign_never_touches_the_prompt_part():
    calls = [C("a", [1, 2], [3]), C("b", [1, 9, 3, 4], [5])]
    seqs, stats = merge_calls(calls, realign_max=10)
    assert len(seqs) == 2 and stats.realigns == 0 and stats.forks == 1


def test_max_seq_len_forks_instead_of_growing():
    calls = [
        C("a", [1], [2]),
        C("b", [1, 2, 3], [4]),
        C("c", [1, 2, 3, 4, 5], [6]),
        C("d", [1, 2, 3, 4], [5, 6, 7]),  # a retry-like side branch off b
        C("e", [1, 2, 3, 4, 5, 6, 7], [8, 9, 10]),
    ]
    seqs, stats = merge_calls(calls, max_seq_len=7)
    # c joins a+b (6 tokens); d branches off b, which is no sequence's view any more: it forks.
    assert [s.call_ids for s in seqs] == [["a", "b", "c"], ["d"]]
    assert [s.token_ids for s in seqs] == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7]]
    # e continues d (10 tokens > 7): it forks, and alone it is still too long: dropped by default.
    assert stats.forks == 2 and stats.forks_max_len == 1 and stats.merged_calls == 2
    assert stats.mismatched_calls == 1 and [m["call_id"] for m in stats.mismatches] == ["d"]
    assert stats.calls_dropped_overlong == 1 and stats.truncated == 0 and stats.sequences == 2
    assert stats.dropped() == {"overlong": 1}
    seqs, stats = merge_calls(calls, max_seq_len=7, overlong="truncate")  # e cut to 7 keeps no sampled token
    assert len(seqs) == 2 and stats.calls_dropped_overlong == 1 and stats.truncated == 0
    seqs, stats = merge_calls(calls, max_seq_len=10)
    assert [s.call_ids for s in seqs] == [["a", "b", "c"], ["d", "e"]]


def test_overlong_truncate_cuts_trailing_tokens_and_flags():
    calls = [C("a", [1, 2], [3, 4, 5, 6], [-0.1, -0.2, -0.3, -0.4])]
    seqs, stats = merge_calls(calls, max_seq_len=4, overlong="truncate")
    (s,) = seqs
    assert (
        s.token_ids == [1, 2, 3, 4] and s.loss_mask == [0, 0, 1, 1] and s.logprobs == [0.0, 0.0, -0.1, -0.2]
    )
    assert s.truncated and s.response_spans == [(2, 4)]
    assert stats.truncated == 1 and stats.tokens_truncated == 2 and stats.calls_dropped_overlong == 0
    # A cut that leaves no sampled token drops the call instead.
    seqs, stats = merge_calls(calls, max_seq_len=2, overlong="truncate")
    assert seqs == [] and stats.calls_dropped_overlong == 1 and stats.truncated == 0
    seqs, stats = merge_calls(calls, max_seq_len=4)
    assert seqs == [] and stats.calls_dropped_overlong == 1
    seqs, stats = merge_calls(calls, mode="per-call", max_seq_len=4, overlong="truncate")
    assert [s.token_ids for s in seqs] == [[1, 2, 3, 4]] and stats.truncated == 1


def test_max_prompt_len_drops_calls_that_would_start_a_sequence():
    calls = [
        C("a", [1, 2], [3]),
        C("b", [1, 2, 3, 4, 5], [6]),  # joins a: its long prompt is fine
        C("c", [9, 9, 9, 9], [7]),  # would fork with a 4-token prompt: dropped
        C("d", [8], [7]),  # forks with a short prompt
    ]
    seqs, stats = merge_calls(calls, max_prompt_len=3)
    assert [s.call_ids for s in seqs] == [["a", "b"], ["d"]]
    assert stats.calls_dropped_prompt_len == 1 and stats.forks == 1 and stats.mismatched_calls == 2
    assert [m["call_id"] for m in stats.mismatches] == ["c", "d"]
    assert stats.dropped() == {"prompt_too_long": 1}
    seqs, stats = merge_calls([C("a", [1, 2, 3, 4], [5]), C("b", [1, 2, 3, 4, 5, 6], [7])], max_prompt_len=3)
    assert seqs == [] and stats.calls_dropped_prompt_len == 2 and stats.forks == 0
    seqs, stats = merge_calls(calls, mode="per-call", max_prompt_len=3)
    assert [s.call_ids for s in seqs] == [["a"], ["d"]] and stats.calls_dropped_prompt_len == 2


def test_realign_keeps_at_least_one_sampled_token():
    # The whole (short) response was re-rendered: realigning would train none of it, so fork instead.
    calls = [C("a", [1, 2], [5, 6]), C("b", [1, 2, 7, 8, 3], [9])]
    seqs, stats = merge_calls(calls, realign_max=8)
    assert len(seqs) == 2 and stats.realigns == 0 and stats.forks == 1


def test_response_spans_follow_merges_and_realigns():
    calls = [C("a", [1], [2, 3, 4]), C("b", [1, 2, 3, 40, 5], [6, 7]), C("c", [1, 2, 3, 40, 5, 6, 7], [8])]
    seqs, stats = merge_calls(calls, realign_max=2)
    (s,) = seqs
    assert stats.realigns == 1
    assert s.token_ids == [1, 2, 3, 40, 5, 6, 7, 8]
    assert s.response_spans == [(1, 3), (5, 7), (7, 8)]


def test_weight_spans_follow_calls_into_sequence_positions():
    # c1 was sampled across a push (v3 then v4), c2 says nothing (its version 4 for all), c3 spans v4->v5.
    calls = [
        C("c1", [1, 2, 3], [7, 8], weight_version=3, weight_spans=((3, 0, 1), (4, 1, 2))),
        C("c2", [1, 2, 3, 7, 8, 20, 21], [9], weight_version=4),
        C(
            "c3",
            [1, 2, 3, 7, 8, 20, 21, 9, 22],
            [10, 11, 12],
            weight_version=4,
            weight_spans=((4, 0, 1), (5, 1, 3)),
        ),
    ]
    (s,), _ = merge_calls(calls)
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1, 1]
    assert s.version_spans() == [(3, 3, 4), (4, 4, 5), (4, 7, 8), (4, 9, 10), (5, 10, 12)]
    assert s.min_weight_version == 3
    check_shapes([s])
    # A call admitted at version 2 whose tokens were all sampled by version 3 trains as version 3.
    (s,), _ = merge_calls([C("a", [1], [2, 3], weight_version=2, weight_spans=((3, 0, 2),))])
    assert s.min_weight_version == 3 and s.version_spans() == [(3, 1, 3)]


def test_weight_spans_lose_realigned_and_truncated_tokens():
    # The re-rendered last token of a (the only one sampled by v2) is dropped by the realign: a's
    # remaining tokens are all v5's, so the sequence's oldest version is 5.
    calls = [
        C("a", [1], [2, 3, 4], weight_version=2, weight_spans=((5, 0, 2), (2, 2, 3))),
        C("b", [1, 2, 3, 40, 5], [6], weight_version=5),
    ]
    (s,), stats = merge_calls(calls, realign_max=1)
    assert stats.realigns == 1
    assert s.version_spans() == [(5, 1, 3), (5, 5, 6)] and s.min_weight_version == 5
    check_shapes([s])
    (s,), _ = merge_calls(
        [C("a", [1, 2], [3, 4, 5, 6], weight_spans=((7, 0, 1), (8, 1, 4)))],
        max_seq_len=4,
        overlong="truncate",
    )
    assert s.version_spans() == [(7, 2, 3), (8, 3, 4)]


def test_validation():
    with pytest.raises(ValueError, match="logprobs"):
        merge_calls([Call("a", [1], [2, 3], [-1.0])])
    with pytest.raises(ValueError, match="mode"):
        merge_calls([], mode="exact")
    with pytest.raises(ValueError):
        merge_calls([], realign_max=-1)
    with pytest.raises(ValueError):
        merge_calls([], max_seq_len=0)
    with pytest.raises(ValueError):
        merge_calls([], max_prompt_len=0)
    with pytest.raises(ValueError, match="overlong"):
        merge_calls([], overlong="cut")


def test_tuples_are_accepted():
    calls = [Call("a", (1, 2), (3,), (-0.5,)), Call("b", (1, 2, 3, 4), (5,), (-0.25,))]
    seqs, _ = merge_calls(calls)
    assert [s.token_ids for s in seqs] == [[1, 2, 3, 4, 5]]
    assert all(type(x) is list for x in (seqs[0].token_ids, seqs[0].loss_mask, seqs[0].logprobs))


def test_mismatch_examples_are_capped():
    calls = [C(str(i), [1000 + i], [i]) for i in range(MAX_MISMATCH_EXAMPLES + 4)]
    seqs, stats = merge_calls(calls)
    assert stats.forks == len(calls) - 1 == len(seqs) - 1
    assert len(stats.mismatches) == MAX_MISMATCH_EXAMPLES


def test_long_episode_is_fast_enough():
    # 400 turns, ~20k-token final context: a quadratic copy per turn would still pass, but a quadratic
    # Python-level scan (400 * 20k * 400) would not finish in any reasonable time.
    calls, ctx = [], list(range(50))
    for i in range(400):
        resp = [i % 7 + 1] * 25
        calls.append(C(f"t{i}", ctx, resp))
        ctx = ctx + resp + [9] * 25
    seqs, stats = merge_calls(calls)
    assert len(seqs) == 1 and stats.merged_calls == 399
    assert sum(seqs[0].loss_mask) == 400 * 25


# ---------------------------------------------------------------- property tests


@st.composite
def call_lists(draw, constrained: bool = False):
    """Random rollouts: threads that grow (so merges happen), retries, rewrites, errors, empties; with
    `constrained`, some calls carry grammar-constrained response spans (forced tool calls)."""
    n = draw(st.integers(0, 14))
    tok = st.integers(0, 4)  # small alphabet: accidental prefix matches do happen
    contexts: list[list[int]] = []  # prompt + response of every call so far
    calls: list[Call] = []
    for i in range(n):
        kind = draw(st.sampled_from(["new", "continue", "continue", "continue", "retry", "rewrite"]))
        if kind == "retry" and calls:
            prompt = list(draw(st.sampled_from(calls)).prompt_token_ids)
        elif kind in ("continue", "rewrite") and contexts:
            lo = draw(st.sampled_from([0, max(0, len(contexts) - 2)]))  # favour the latest contexts
            prompt = contexts[draw(st.integers(lo, len(contexts) - 1))] + draw(st.lists(tok, max_size=3))
            if kind == "rewrite" and prompt:
                prompt[draw(st.integers(0, len(prompt) - 1))] = draw(tok)
        else:
            prompt = draw(st.lists(tok, max_size=4))
        resp = [] if draw(st.integers(0, 9)) == 0 else draw(st.lists(tok, min_size=1, max_size=4))
        status = "ok" if draw(st.integers(0, 7)) else "error"
        # Distinct logprobs per (call, position) so "equals a response logprob" is meaningful.
        lps = [-(i + 1) - (k + 1) / 100 for k in range(len(resp))]
        spans: tuple[tuple[int, int], ...] = ()
        if constrained and resp and draw(st.integers(0, 2)) == 0:
            cuts = sorted(set(draw(st.lists(st.integers(0, len(resp)), min_size=2, max_size=4))))
            spans = tuple((a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=False) if a < b)
        calls.append(
            Call(
                f"c{i}",
                prompt,
                resp,
                lps,
                weight_version=draw(st.integers(0, 3)),
                status=status,
                constrained=spans,
            )
        )
        contexts.append(prompt + resp)
    return calls


def constrained_reference(c: Call) -> tuple[list[int], list[float]]:
    """The response's mask and logprobs as a sequence must hold them, written independently of merge."""
    bad = {k for a, b in c.constrained for k in range(a, b)}
    mask = [0 if k in bad else 1 for k in range(len(c.response_token_ids))]
    return mask, [0.0 if k in bad else lp for k, lp in enumerate(c.response_logprobs)]


def reference_kept(calls: list[Call]) -> list[Call]:
    ok = [c for c in calls if c.status == "ok" and c.response_token_ids]
    return [
        c for i, c in enumerate(ok) if not any(d.prompt_token_ids == c.prompt_token_ids for d in ok[i + 1 :])
    ]


def assert_invariants(calls, seqs, stats, *, exact: bool, max_seq_len=None):
    check_shapes(seqs)
    kept = reference_kept(calls)
    by_id = {c.call_id: c for c in kept}
    pos = {c.call_id: i for i, c in enumerate(kept)}
    assert stats.calls_in == len(calls)
    assert stats.calls_dropped_error == sum(c.status != "ok" for c in calls)
    assert stats.calls_dropped_empty == sum(c.status == "ok" and not c.response_token_ids for c in calls)
    assert stats.calls_deduped == len(calls) - stats.calls_dropped_error - stats.calls_dropped_empty - len(
        kept
    )
    assert stats.sequences == len(seqs)
    # Every kept call appears at most once (exactly once unless dropped as overlong); sequences
    # ordered by first call; calls in order inside.
    all_ids = [cid for s in seqs for cid in s.call_ids]
    assert len(set(all_ids)) == len(all_ids)
    assert len(all_ids) + stats.calls_dropped_overlong + stats.calls_dropped_prompt_len == len(kept)
    assert sorted(all_ids, key=pos.__getitem__) == [c.call_id for c in kept if c.call_id in set(all_ids)]
    firsts = [pos[s.call_ids[0]] for s in seqs]
    assert firsts == sorted(firsts)
    for s in seqs:
        idx = [pos[cid] for cid in s.call_ids]
        assert idx == sorted(idx)
        assert [spans[0][0] for spans in s.call_weight_spans] == [
            by_id[cid].weight_version for cid in s.call_ids
        ]
        if max_seq_len is not None:
            assert len(s.token_ids) <= max_seq_len
        assert not s.truncated or len(s.call_ids) == 1  # only single calls can be cut
        # Spans locate every trainable token: a prefix of that call's response, with its logprobs.
        assert len(s.response_spans) == len(s.call_ids)
        # Constrained tokens keep mask 0 and logprob 0.0 at their place, after realign and truncation.
        covered: list[int] = []
        prev_end = 0
        n_constrained = 0
        for cid, (a, b) in zip(s.call_ids, s.response_spans, strict=True):
            c = by_id[cid]
            assert prev_end <= a < b <= len(s.token_ids)
            prev_end = b
            mask, lps = constrained_reference(c)
            assert s.token_ids[a:b] == c.response_token_ids[: b - a]
            assert s.loss_mask[a:b] == mask[: b - a]
            assert s.logprobs[a:b] == lps[: b - a]
            covered.extend(i for i in range(a, b) if s.loss_mask[i])
            n_constrained += (b - a) - sum(mask[: b - a])
        assert covered == [i for i, m in enumerate(s.loss_mask) if m]
        assert s.constrained_tokens == n_constrained
    opened = len(kept) - stats.merged_calls - stats.calls_dropped_prompt_len  # sequences started
    assert opened >= 0 and stats.forks == max(opened - 1, 0)
    assert stats.truncated == sum(s.truncated for s in seqs)
    mask1 = sum(sum(s.loss_mask) for s in seqs)
    if exact:
        free = {cid: [k for k, m in enumerate(constrained_reference(by_id[cid])[0]) if m] for cid in all_ids}
        assert mask1 == sum(len(free[cid]) for cid in all_ids)
        for s in seqs:
            toks = [t for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m]
            lps = [lp for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if m]
            assert toks == [by_id[cid].response_token_ids[k] for cid in s.call_ids for k in free[cid]]
            assert lps == [by_id[cid].response_logprobs[k] for cid in s.call_ids for k in free[cid]]
            # Each call's exact sampling context is a prefix of the sequence, its response right after.
            for cid in s.call_ids:
                c = by_id[cid]
                n = len(c.prompt_token_ids)
                assert (
                    s.token_ids[: n + len(c.response_token_ids)] == c.prompt_token_ids + c.response_token_ids
                )
                assert s.loss_mask[n : n + len(c.response_token_ids)] == constrained_reference(c)[0]
    else:
        assert mask1 <= sum(len(by_id[cid].response_token_ids) for cid in all_ids)
        # Whatever is trained is a token vLLM sampled unconstrained, with its logprob, for a call of
        # that sequence.
        for s in seqs:
            sampled = {
                (t, lp)
                for cid in s.call_ids
                for t, lp, m in zip(
                    by_id[cid].response_token_ids,
                    by_id[cid].response_logprobs,
                    constrained_reference(by_id[cid])[0],
                    strict=True,
                )
                if m
            }
            for t, m, lp in zip(s.token_ids, s.loss_mask, s.logprobs, strict=True):
                if m:
                    assert (t, lp) in sampled


PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(call_lists())
def test_property_exact_merge(calls):
    seqs, stats = merge_calls(calls)
    assert_invariants(calls, seqs, stats, exact=True)
    assert stats.realigns == 0


@PROPS
@given(call_lists(), st.integers(1, 12))
def test_property_exact_merge_with_max_len(calls, max_len):
    seqs, stats = merge_calls(calls, max_seq_len=max_len)
    assert_invariants(calls, seqs, stats, exact=True, max_seq_len=max_len)


@PROPS
@given(
    call_lists(),
    st.integers(0, 3),
    st.lists(st.integers(0, 4), max_size=2),
    st.none() | st.integers(1, 12),
    st.none() | st.integers(1, 8),
    st.sampled_from(["drop", "truncate"]),
)
def test_property_with_strip_and_realign(calls, realign_max, tail, max_len, max_prompt, overlong):
    seqs, stats = merge_calls(
        calls,
        strip_tail=tail,
        realign_max=realign_max,
        max_seq_len=max_len,
        max_prompt_len=max_prompt,
        overlong=overlong,
    )
    assert_invariants(calls, seqs, stats, exact=False, max_seq_len=max_len)
    assert stats.realigns <= stats.merged_calls
    if max_prompt is not None:
        assert all(len(p) <= max_prompt for p in first_prompts(calls, seqs))


@PROPS
@given(call_lists(constrained=True), st.none() | st.integers(1, 12))
def test_property_exact_merge_with_constrained_tokens(calls, max_len):
    seqs, stats = merge_calls(calls, max_seq_len=max_len, overlong="truncate")
    assert_invariants(calls, seqs, stats, exact=max_len is None, max_seq_len=max_len)


@PROPS
@given(
    call_lists(constrained=True),
    st.integers(0, 3),
    st.lists(st.integers(0, 4), max_size=2),
    st.none() | st.integers(1, 12),
    st.sampled_from(["drop", "truncate"]),
)
def test_property_constrained_tokens_survive_realign_and_truncation(
    calls, realign_max, tail, max_len, overlong
):
    seqs, stats = merge_calls(
        calls, strip_tail=tail, realign_max=realign_max, max_seq_len=max_len, overlong=overlong
    )
    assert_invariants(calls, seqs, stats, exact=False, max_seq_len=max_len)


@PROPS
@given(call_lists(constrained=True))
def test_property_per_call_constrained(calls):
    seqs, _ = merge_calls(calls, mode="per-call")
    check_shapes(seqs)
    for s, c in zip(seqs, reference_kept(calls), strict=True):
        mask, lps = constrained_reference(c)
        n = len(c.prompt_token_ids)
        assert s.loss_mask == [0] * n + mask and s.logprobs == [0.0] * n + lps
        assert s.constrained_tokens == len(mask) - sum(mask)


def test_constrained_tokens_are_masked_where_they_sit():
    # A forced tool call: tokens 1..3 of the second response were written by the grammar.
    calls = [C("a", [1, 2], [3, 4]), C("b", [1, 2, 3, 4, 5], [6, 7, 8, 9, 10], constrained=((1, 4),))]
    [s], _ = merge_calls(calls)
    assert s.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert s.loss_mask == [0, 0, 1, 1, 0, 1, 0, 0, 0, 1]
    assert s.logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, -0.1, 0.0, 0.0, 0.0, -0.5]
    assert s.constrained_tokens == 3
    assert s.version_spans() == [(0, 2, 4), (0, 5, 6), (0, 9, 10)]
    # Truncation cuts constrained tokens with the rest; a cut leaving only constrained tokens drops it.
    [t], _ = merge_calls([calls[1]], max_seq_len=7, overlong="truncate")
    assert t.loss_mask == [0] * 5 + [1, 0] and t.constrained_tokens == 1
    none, stats = merge_calls(
        [C("c", [1], [2, 3], constrained=((0, 2),))], max_seq_len=2, overlong="truncate"
    )
    assert none == [] and stats.calls_dropped_overlong == 1


def first_prompts(calls, seqs):
    by_id = {c.call_id: c for c in calls}
    return [by_id[s.call_ids[0]].prompt_token_ids for s in seqs]


@PROPS
@given(call_lists())
def test_property_per_call(calls):
    seqs, stats = merge_calls(calls, mode="per-call")
    check_shapes(seqs)
    kept = reference_kept(calls)
    assert [s.call_ids for s in seqs] == [[c.call_id] for c in kept]
    for s, c in zip(seqs, kept, strict=True):
        assert s.token_ids == c.prompt_token_ids + c.response_token_ids
        assert s.logprobs == [0.0] * len(c.prompt_token_ids) + c.response_logprobs
    assert stats.sequences == len(kept) and stats.forks == stats.merged_calls == 0


def test_prompt_differing_only_in_the_middle_forks():
    # Ends and response match; one token in the middle of the earlier prompt was rewritten.
    calls = [C("a", [1, 2, 3, 4, 5, 6, 7], [8]), C("b", [1, 2, 3, 0, 5, 6, 7, 8, 9], [10])]
    seqs, stats = merge_calls(calls, realign_max=3, strip_tail=[7])
    assert [s.call_ids for s in seqs] == [["a"], ["b"]]
    assert stats.mismatches[0]["diverge_at"] == 3


# ---------------------------------------------------------------- mismatch rendering, strip tail


WORDS = {1: "<s>", 2: "user", 3: ":", 4: "hav", 5: "ing", 6: "having", 7: "\n", 8: "fun", 9: "</s>"}


def decode(ids):
    return "".join(WORDS.get(i, f"<{i}>") for i in ids)


def test_compact_and_format_mismatch_show_a_token_diff():
    # The previous response sampled "hav"+"ing"; the harness re-tokenised it as "having".
    seqs, stats = merge_calls([C("a", [1, 2, 3], [4, 5, 8, 9]), C("b", [1, 2, 3, 6, 8, 9, 7], [8])])
    (full,) = stats.mismatches
    ex = compact_mismatch(full, window=2)
    assert ex == {
        "call_id": "b",
        "diverge_at": 3,
        "expected_len": 7,
        "prompt_len": 7,
        "in_response": True,
        "common_tail": [2, 3],
        "expected": [4, 5],
        "got": [6, 8],
    }
    text = format_mismatch(ex, decode)
    assert text.splitlines() == [
        "call b: prompt diverges at token 3 inside the previous response (expected context 7 tokens, prompt 7)",
        "  ...user:",
        "- expected: having    [4, 5]",
        "+ got:      havingfun    [6, 8]",
    ]
    # The full form renders the same way (it is compacted first); newlines are shown escaped.
    assert format_mismatch(full, decode).splitlines()[0].startswith("call b: prompt diverges at token 3")
    assert "\\n" in format_mismatch(full, decode)
    # A prompt that simply ends early, and a divergence in earlier context.
    short = {
        "call_id": "c",
        "expected_prefix": [1, 2, 3],
        "prompt": [1, 2],
        "diverge_at": 2,
        "response_start": 1,
    }
    lines = format_mismatch(short, decode).splitlines()
    assert lines[-1].startswith("+ got:      (end)") and "inside the previous response" in lines[0]
    early = dict(short, diverge_at=0, prompt=[9], response_start=2)
    assert "in earlier context" in format_mismatch(early, decode)


class FakeTemplate:
    """apply_chat_template of a Qwen3-like template with thinking off, over one id per piece."""

    def __init__(self, history_keeps_think: bool = False):
        self.keep = history_keeps_think

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict, **kw):
        assert tokenize and not return_dict
        ids = []
        for m in messages:
            ids += [100, {"user": 101, "assistant": 102}[m["role"]], 10]
            if m["role"] == "assistant" and self.keep:
                ids += [200, 10, 201, 10]
            ids += [ord(m["content"]), 103, 10]
        if add_generation_prompt:
            ids += [100, 102, 10]
            if kw.get("enable_thinking") is False:
                ids += [200, 10, 201, 10]
        return ids


def test_generation_prompt_tail_is_what_history_does_not_rerender():
    assert generation_prompt_tail(FakeTemplate(), enable_thinking=False) == [200, 10, 201, 10]
    assert generation_prompt_tail(FakeTemplate()) == []
    assert generation_prompt_tail(FakeTemplate(history_keeps_think=True), enable_thinking=False) == []
