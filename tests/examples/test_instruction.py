"""The instruction-following example: its constraint checkers on crafted good, bad and cheating answers,
the harness's check-tool loop with a scripted model, the tiny model's vocabulary, and (slow) a short
`tether demo --example instruction` whose samples are exactly what vLLM returned, with the rewards the
harness computes from those very responses."""

from __future__ import annotations

import json

import pytest
from stack_helpers import assert_samples_are_vllm_tokens, runs_a_demo, small_demo, tether_jsonl

from tether.demo import tiny
from tether.examples.instruction import agent
from tether.examples.instruction.reward import check_draft, echoes, failed, met, parse_json_object, score

EXACT4 = {"kind": "length_exact", "n": 4}
AT_MOST3 = {"kind": "length_at_most", "n": 3}
SEA = {"kind": "include", "word": "sea"}
NO_RED = {"kind": "exclude", "word": "red"}
KEYS = {"kind": "json_keys", "keys": ["name", "color"]}


@pytest.mark.parametrize(
    ("constraint", "good", "bad"),
    [
        (EXACT4, "the calm blue sea", "the sea"),
        (EXACT4, "sea , so very calm .", "sea so very calm day"),
        (AT_MOST3, "blue sea", "a very calm blue sea"),
        (SEA, "the Sea is calm", "the sky is calm"),
        (SEA, '{"name": "the sea"}', '{"sea": "calm"}'),  # in JSON a word is used as a value, not a key
        (NO_RED, "a blue sky", "a Red sky"),
        ({"kind": "starts_with", "word": "sun"}, "Sun over the sea", "the sun"),
        ({"kind": "ends_with", "word": "cat"}, "a calm cat .", "cat so calm"),
        ({"kind": "lower_case"}, "all calm here", "All calm here"),
        ({"kind": "bullets", "n": 2}, "- sea\n- sky\n", "- sea\nsky"),
        ({"kind": "bullets", "n": 3}, "* a\n* b\n* c", "- a\n- b"),
        (KEYS, '{"name": "cat", "color": "red"}', '{"name": "cat"}'),
        (
            KEYS,
            '```json\n{"color": "red", "name": "cat"}\n```',
            '{"name": "cat", "color": "red", "size": "big"}',
        ),
        (KEYS, '{ "name" : "cat" , "color" : "calm" }', '{"name": "cat", "color": 3}'),
    ],
)
def test_each_checker_tells_good_from_bad(constraint, good, bad):
    assert met(good, constraint)
    assert not met(bad, constraint)


def test_cheating_answers_do_not_pay():
    # A forbidden word hidden inside JSON, as a value or as a key, is still used.
    assert not met('{"name": "cat", "color": "red"}', NO_RED)
    assert not met('{"red": "cat"}', NO_RED)
    assert not met('{"note": ["bright", "RED"]}', NO_RED)
    # A required word only quoted (a mention, e.g. inside a quoted forbidden phrase) is not used.
    assert not met('i will not say "the sea"', SEA)
    assert not met('"sea" was forbidden', {"kind": "starts_with", "word": "sea"})
    # Quoting does not hide a forbidden word either.
    assert not met('never "red"', NO_RED)
    # Repeating the prompt to carry the required word scores 0, although it "includes" the word.
    task = {"task_id": "x", "constraints": [SEA, NO_RED]}
    echo = agent.prompt(task)
    assert met(echo, SEA)
    assert score(echo, task["constraints"], agent.instructions(task)) == 0.0
    assert echoes("so include the word sea now", agent.instructions(task))
    assert not echoes("the word sea", agent.instructions(task))  # three words in a row are no echo
    # Empty output meets nothing, not even "do not use" or "at most".
    assert score("", [NO_RED, AT_MOST3], []) == 0.0
    assert score("   \n", [NO_RED], []) == 0.0
    assert failed("", [NO_RED, AT_MOST3]) == [0, 1]
    # A final reply that is itself a tool call is no answer.
    assert score("check sea", [SEA], []) == 0.0
    assert score(None, [SEA], []) == 0.0


def test_reward_is_the_share_of_constraints_met():
    constraints = [EXACT4, SEA, NO_RED]
    assert score("the calm blue sea", constraints, []) == 1.0
    assert score("the calm red sea", constraints, []) == pytest.approx(2 / 3)
    assert score("red sea", constraints, []) == pytest.approx(1 / 3)
    assert score("red", constraints, []) == 0.0
    with pytest.raises(ValueError):
        score("sea", [], [])
    with pytest.raises(ValueError):
        met("sea", {"kind": "rhymes"})


def test_json_parsing_and_the_check_protocol():
    assert parse_json_object('{ "name" : "cat" }') == {"name": "cat"}
    assert parse_json_object("[1, 2]") is None
    assert parse_json_object("name: cat") is None
    assert check_draft("check the calm sea") == "the calm sea"
    assert check_draft("  Check  sea ") == "sea"
    assert check_draft("checked sea") is None
    assert check_draft("the sea , check") is None


def _scripted(replies: list[str], seen: list[list[dict]]):
    def reply(messages):
        seen.append([dict(m) for m in messages])
        return replies[len(seen) - 1]

    return reply


def test_the_harness_loop_checks_drafts_and_scores_the_answer():
    task = {"task_id": "x", "constraints": [EXACT4, SEA, {"kind": "ends_with", "word": "cat"}]}
    seen: list[list[dict]] = []
    reward = agent.episode(task, _scripted(["check Sea cat", "sea so calm cat"], seen))
    assert reward == 1.0
    # The tool's report names the failing constraints in the prompt's own sentences.
    assert seen[1][-1] == {"role": "user", "content": "not met : use exactly 4 words ."}
    assert seen[1][-2] == {"role": "assistant", "content": "check Sea cat"}
    assert agent.report("sea so calm cat", task) == agent.ALL_MET

    # Direct answers are scored at once; a model that only ever checks never answers: reward 0.
    assert agent.episode(task, _scripted(["sea cat"], [])) == pytest.approx(2 / 3)
    seen = []
    assert agent.episode(task, _scripted(["check sea"] * 10, seen)) == 0.0
    assert len(seen) == agent.MAX_CHECKS + 1


def test_tasks_references_and_the_tiny_vocabulary():
    every = agent.tasks()
    assert len(every) == agent.TASKS == len({t["task_id"] for t in every})
    assert json.loads(json.dumps(every)) == every
    assert agent.tasks(5, seed=1) == agent.tasks(5, seed=1) and len(agent.tasks(5)) == 5
    kinds = {c["kind"] for t in every for c in t["constraints"]}
    assert kinds == {"length_exact", "length_at_most", "include", "exclude", "starts_with", "ends_with",
                     "lower_case", "json_keys"}  # fmt: skip
    for t in every:
        assert score(agent.reference(t), t["constraints"], agent.instructions(t)) == 1.0
    # Every word the tiny model reads or writes is in its vocabulary: prompts, reports, demonstrations.
    tokenizer = tiny.build_tokenizer(agent.VOCAB)
    unk = tokenizer.convert_tokens_to_ids(tiny.UNK)
    conversations = agent.demonstrations(300, seed=0)
    texts = [m["content"] for c in conversations for m in c]
    texts += [agent.report("", t) for t in every[:50]]
    for text in texts:
        assert unk not in tokenizer(text, add_special_tokens=False)["input_ids"], text
    checked = sum(len(c) == 4 for c in conversations)
    assert checked == round(300 * 0.3)
    # Checked demonstrations end on the reference answer; direct ones are sloppy on average.
    for c in conversations:
        if len(c) == 4:
            assert check_draft(c[1]["content"]) is not None


@pytest.mark.slow
@runs_a_demo
def test_demo_samples_carry_vllms_tokens_and_the_harness_rewards(tmp_path):
    small_demo(tmp_path, "instruction")
    assert_run_flowed_exactly(tmp_path)


def assert_run_flowed_exactly(cwd, seed: int = 0) -> None:
    """The checks on a finished `tether demo --example instruction` run from `cwd`."""
    traces = tether_jsonl(cwd, "traces")
    samples = tether_jsonl(cwd, "samples")
    assert_samples_are_vllm_tokens(traces, samples)
    # Replaying each rollout's responses (decoded from vLLM's token ids) through the harness gives the
    # reward its samples carry: the reward flowed unchanged from the harness to the trainer.
    from transformers import AutoTokenizer

    from tether.cli import prepare_example_model

    tokenizer = AutoTokenizer.from_pretrained(prepare_example_model("instruction", seed))
    by_id = {t["task_id"]: t for t in agent.tasks()}
    calls: dict[str, list[dict]] = {}
    for t in traces:
        if t["status"] == "ok":
            calls.setdefault(t["rollout_id"], []).append(t)
    for s in samples:
        replies = [
            tokenizer.decode(t["response_token_ids"], skip_special_tokens=True)
            for t in sorted(calls[s["rollout_id"]], key=lambda t: t["started_at"])
        ]
        replayed = agent.episode(by_id[s["task_id"]], _scripted(replies, []))
        assert s["reward"] == pytest.approx(replayed, abs=1e-6), (replies, s["reward"])
