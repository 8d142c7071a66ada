"""Side-call rules on crafted merged sequences (pure: tether.merger.sidecalls)."""

from __future__ import annotations

import re

import pytest

from tether.merger.sidecalls import compile_patterns, side_call_exclusions, system_text

# opencode's title generator and Claude Code's small/fast-model title call, as their system prompts begin.
TITLE = "You are a title generator. You output ONLY a thread title. Nothing else."
SUMMARY = "Summarize this coding conversation in under 50 characters."
AGENT = "You are opencode, an interactive CLI tool that helps users with software engineering tasks."


def test_system_text_of_every_api_shape():
    assert (
        system_text({"messages": [{"role": "system", "content": TITLE}, {"role": "user", "content": "x"}]})
        == TITLE
    )
    assert (
        system_text({"messages": [{"role": "developer", "content": [{"type": "text", "text": "dev"}]}]})
        == "dev"
    )
    assert (
        system_text(
            {
                "system": [
                    {"type": "text", "text": "You are Claude Code."},
                    {"type": "text", "text": SUMMARY},
                ],
                "messages": [{"role": "user", "content": "x"}],
            }
        )
        == f"You are Claude Code.\n{SUMMARY}"
    )
    assert system_text({"system": SUMMARY}) == SUMMARY
    assert (
        system_text({"instructions": "resp", "input": [{"role": "system", "content": "more"}]})
        == "resp\nmore"
    )
    assert (
        system_text({"messages": [{"role": "user", "content": TITLE}]}) == ""
    )  # user text is not a system prompt
    assert system_text({}) == ""


# Three chains of one rollout: the agent's (c0, c2, c4), a title call (c1), a second side call (c3).
CHAINS = [["c0", "c2", "c4"], ["c1"], ["c3"]]
ORDER = ["c0", "c1", "c2", "c3", "c4"]
SYSTEMS = {"c0": AGENT, "c1": TITLE, "c2": AGENT, "c3": SUMMARY, "c4": AGENT}


def test_keep_without_patterns_keeps_everything():
    assert side_call_exclusions(CHAINS, ORDER, SYSTEMS) == [None, None, None]


def test_last_chain_keeps_only_the_chain_of_the_last_call():
    assert side_call_exclusions(CHAINS, ORDER, SYSTEMS, "last_chain") == [
        None,
        "not_last_chain",
        "not_last_chain",
    ]
    # The last call is what counts, not the longest chain: a side call made last wins (hence patterns).
    side_last = ["c0", "c1", "c2", "c4", "c3"]
    assert side_call_exclusions(CHAINS, side_last, SYSTEMS, "last_chain") == [
        "not_last_chain",
        "not_last_chain",
        None,
    ]


def test_patterns_match_the_first_calls_system_prompt():
    pats = compile_patterns([r"^You are a title generator", r"Summarize this coding conversation"])
    assert side_call_exclusions(CHAINS, ORDER, SYSTEMS, "keep", pats) == [None, "pattern", "pattern"]
    assert side_call_exclusions(CHAINS, ORDER, SYSTEMS, "keep", compile_patterns(["^nothing"])) == [
        None,
        None,
        None,
    ]
    assert side_call_exclusions(CHAINS, ORDER, {}, "keep", pats) == [
        None,
        None,
        None,
    ]  # no system prompt known


def test_patterns_first_then_last_chain_of_what_is_left():
    """A side call after the agent's last turn (Qwen Code's memory extraction runs after a completed
    turn) is matched by a pattern, and last_chain then keeps the agent's chain, not the side call's."""
    systems = {**SYSTEMS, "m0": "You are now acting as the managed memory extraction subagent"}
    chains, order = [*CHAINS, ["m0"]], [*ORDER, "m0"]
    assert side_call_exclusions(chains, order, systems, "last_chain") == [
        "not_last_chain",
        "not_last_chain",
        "not_last_chain",
        None,
    ]
    pats = compile_patterns(["managed memory extraction subagent"])
    assert side_call_exclusions(chains, order, systems, "last_chain", pats) == [
        None,
        "not_last_chain",
        "not_last_chain",
        "pattern",
    ]


def test_bad_rule_and_pattern_fail_fast():
    with pytest.raises(ValueError, match="side-call rule"):
        side_call_exclusions(CHAINS, ORDER, SYSTEMS, "first_chain")
    with pytest.raises(re.error):
        compile_patterns(["(unclosed"])
