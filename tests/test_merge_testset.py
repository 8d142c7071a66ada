"""The merger on the multi-turn tool-use test set (tether.demo.testset).

Exact-prefix merging keeps few rollouts in one sequence there (like Agent Lightning's reported 36% /
2.41 sequences per rollout on coding rollouts); stripping the generation-prompt tail and realigning
re-rendered response ends does clearly better, and whatever is trained is still a token vLLM sampled,
at its place, with its logprob.
"""

from __future__ import annotations

import json

import pytest

from tether.demo import testset as ts
from tether.merger.merge import generation_prompt_tail, merge_calls

FIXABLE = {
    "thinking",
    "non_thinking",
    "trailing_newline",
    "wrong_eos",
    "no_eos",
    "retry_error",
    "retry_discarded",
}


@pytest.fixture(scope="module")
def tok():
    return ts.build_tokenizer()


@pytest.fixture(scope="module")
def rollouts():
    return ts.generate(ts.TestSetConfig(n_rollouts=200, seed=0))


@pytest.fixture(scope="module")
def tail():
    return ts.strip_tail()


def test_generation_is_deterministic_and_the_incremental_encoding_exact():
    cfg = ts.TestSetConfig(n_rollouts=6, seed=3)
    a = ts.generate(cfg, verify=True)  # verify: every prompt equals a full encode of its text
    b = ts.generate(cfg)
    assert [
        [
            (c.call_id, c.prompt_token_ids, c.response_token_ids, c.response_logprobs, c.status)
            for c in r.calls
        ]
        for r in a
    ] == [
        [
            (c.call_id, c.prompt_token_ids, c.response_token_ids, c.response_logprobs, c.status)
            for c in r.calls
        ]
        for r in b
    ]
    c = ts.generate(ts.TestSetConfig(n_rollouts=6, seed=4))
    assert [r.calls[0].prompt_token_ids for r in c] != [r.calls[0].prompt_token_ids for r in a]


def test_strip_tail_is_the_empty_think_block(tok, tail):
    assert tok.convert_ids_to_tokens(tail) == ["<think>", "\n\n", "</think>", "\n\n"]
    # With thinking on, the whole generation prompt is re-rendered in history: nothing to strip.
    assert generation_prompt_tail(tok) == []


def test_template_drops_think_before_the_last_user_turn_and_rerenders_tool_calls(tok):
    call = {"type": "function", "function": {"name": "read_file", "arguments": json.dumps({"path": "x"})}}
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "reasoning_content": "early", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "r"},
        {"role": "assistant", "reasoning_content": "late", "content": "done"},
    ]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert "<think>\nearly\n</think>" in text and "<think>\nlate\n</think>" in text
    assert '<tool_call>\n{"name": "read_file", "arguments": {"path": "x"}}\n</tool_call><|im_end|>' in text
    text = tok.apply_chat_template(
        msgs + [{"role": "user", "content": "q2"}], add_generation_prompt=True, tokenize=False
    )
    assert "early" not in text and "late" not in text  # both turns now precede the last user turn
    assert text.endswith("<|im_start|>assistant\n")
    text = tok.apply_chat_template(
        msgs[:2], add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_decode_then_encode_is_not_the_identity(tok):
    word = next(iter(ts.SPLITS))
    a, b = ts.SPLITS[word]
    sampled = tok.convert_tokens_to_ids([a, b])
    assert tok.decode(sampled) == word
    assert tok.encode(word, add_special_tokens=False) == tok.convert_tokens_to_ids([word]) != sampled


def test_exact_prefix_share_is_low_and_strip_realign_does_clearly_better(rollouts, tail):
    exact = ts.evaluate(rollouts)
    better = ts.evaluate(rollouts, strip_tail=tail, realign_max=8)
    # Exact prefix matching: around a third of the rollouts stay one sequence (cf. 36% / 2.41).
    assert 0.2 <= exact["single_sequence_share"] <= 0.5
    assert exact["sequences_per_rollout"] >= 2.0
    # Strip + realign: clearly better, and realigning gives up almost no sampled token.
    assert better["single_sequence_share"] >= exact["single_sequence_share"] + 0.25
    assert better["single_sequence_share"] >= 0.6
    assert better["sequences_per_rollout"] <= 1.6
    assert better["trainable_token_share"] >= 0.99
    assert exact["trainable_token_share"] == 1.0
    # Each option alone helps too.
    assert ts.evaluate(rollouts, strip_tail=tail)["single_sequence_share"] > exact["single_sequence_share"]
    assert ts.evaluate(rollouts, realign_max=8)["single_sequence_share"] > exact["single_sequence_share"]


def test_rollouts_with_only_fixable_breakage_become_one_sequence(rollouts, tail):
    checked = 0
    for ro in rollouts:
        ev = set(ro.events)
        if not ev <= FIXABLE | ({"followup_user_turns"} if not ro.thinking else set()):
            continue
        seqs, stats = merge_calls(ro.calls, strip_tail=tail, realign_max=8)
        assert len(seqs) == 1, (ro.rollout_id, ro.events, stats.mismatches[:1])
        checked += 1
        broken = ev & {"non_thinking", "trailing_newline", "wrong_eos"}
        if broken:
            exact, _ = merge_calls(ro.calls)
            assert len(exact) > 1, (ro.rollout_id, ro.events)
    assert checked >= 60


def test_unfixable_breakage_still_forks(rollouts, tail):
    # Tool-call JSON rewritten by the parser and history rewritten by the template fork under every
    # option: the merged sequence would otherwise train on a context the model never saw.
    seen = 0
    for ro in rollouts:
        if not ro.thinking or "followup_user_turns" not in ro.events:
            continue
        seqs, _ = merge_calls(ro.calls, strip_tail=tail, realign_max=8)
        assert len(seqs) >= 2
        seen += 1
    assert seen >= 5


def test_property_every_trainable_token_is_sampled_with_its_logprob(rollouts, tail):
    for ro in rollouts:
        by_id = {c.call_id: c for c in ro.calls}
        for kwargs in (
            {},
            {"strip_tail": tail, "realign_max": 8},
            {"strip_tail": tail, "realign_max": 8, "max_seq_len": 1500},
        ):
            seqs, stats = merge_calls(ro.calls, **kwargs)
            for s in seqs:
                covered: list[int] = []
                for cid, (a, b) in zip(s.call_ids, s.response_spans, strict=True):
                    c = by_id[cid]
                    assert b > a
                    # The tokens at the span are the start of what vLLM sampled, with its logprobs ...
                    assert s.token_ids[a:b] == c.response_token_ids[: b - a]
                    assert s.logprobs[a:b] == c.response_logprobs[: b - a]
                    # ... right after the generation prompt the model saw.
                    assert s.token_ids[a - 3 : a] == c.prompt_token_ids[-3:]
                    covered.extend(range(a, b))
                assert covered == [i for i, m in enumerate(s.loss_mask) if m]
                assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True) if not m)
                if "max_seq_len" in kwargs:
                    assert len(s.token_ids) <= kwargs["max_seq_len"]
            if not kwargs:  # exact merging trains every sampled token of every kept call
                kept = {cid for s in seqs for cid in s.call_ids}
                assert sum(sum(s.loss_mask) for s in seqs) == sum(
                    len(by_id[cid].response_token_ids) for cid in kept
                )
