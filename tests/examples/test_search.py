"""The search example (tether.examples.search): its reward on crafted good, bad and cheating answers, its
corpus and BM25 index, and the words its harness and demonstrations use (fast); then a short
`tether demo --example search` whose samples must be exactly vLLM's tokens and the harness's rewards
(slow)."""

from __future__ import annotations

import pytest
from stack_helpers import (
    assert_samples_are_vllm_tokens,
    assert_sequences_are_vllm_calls,
    jsonl,
    runs_a_demo,
    small_demo,
    tether_jsonl,
)

from tether.examples.search import agent, corpus
from tether.examples.search.reward import exact_match, f1, normalize, score

CITY = {"question": "where does ada moss live ?", "answer": "rome"}
JOB = {"question": "what is the job of ada moss ?", "answer": "bread baker"}


def test_normalize_drops_case_punctuation_and_articles():
    assert normalize("The  Bread-Baker.") == ["bread", "baker"]
    assert normalize("") == [] and normalize(" . ") == []


@pytest.mark.parametrize(
    ("answer", "gold", "expected"),
    [
        ("rome", "rome", 1.0),
        ("Rome .", "rome", 1.0),
        ("the rome", "rome", 1.0),
        ("bread baker", "bread baker", 1.0),
        ("a Bread Baker", "bread baker", 1.0),
        ("oslo", "rome", 0.0),
        ("sea pilot", "bread baker", 0.0),
        # One word of two right: half of F1 (P=1/1, R=1/2, F1=2/3), below any exact match.
        ("baker", "bread baker", 1 / 3),
        ("sea baker", "bread baker", 0.25),
    ],
)
def test_good_bad_and_partial_answers(answer, gold, expected):
    assert score(answer, gold, "what is the job of ada moss ?") == pytest.approx(expected)


def test_no_answer_or_an_empty_one_scores_zero():
    assert score(None, "rome", CITY["question"]) == 0.0
    assert score("", "rome", CITY["question"]) == 0.0
    assert score(" . the ", "rome", CITY["question"]) == 0.0


def test_answering_every_candidate_at_once_does_not_pay():
    every_city = " ".join(corpus.CITIES)
    hedged = score(every_city, "rome", CITY["question"])
    assert 0.0 < hedged < 0.1
    # In expectation hedging over all candidates earns less than one random guess does.
    assert hedged < 1.0 / len(corpus.CITIES)
    every_job = " ".join(agent.CANDIDATES["job"])
    assert score(every_job, JOB["answer"], JOB["question"]) < 0.05


def test_padding_a_right_answer_does_not_pay():
    padded = "rome " + " ".join(["city"] * 20)
    assert score(padded, "rome", CITY["question"]) < 0.1
    assert score("rome rome rome rome", "rome", CITY["question"]) < 0.5
    assert not exact_match(padded, "rome")


def test_copying_the_question_earns_nothing():
    assert score(CITY["question"], CITY["answer"], CITY["question"]) == 0.0
    # The gold shares a word with the question: repeating the question still earns nothing, the exact
    # answer still earns everything.
    q, gold = "who works with ada moss ?", "ada lane"
    assert score(q, gold, q) == 0.0
    assert score("ada", gold, q) == 0.0
    assert score("lane", gold, q) == pytest.approx(0.5)
    assert score("ada lane", gold, q) == 1.0


def test_f1_is_symmetric_and_bounded():
    assert f1(["a", "b"], ["b", "c"]) == pytest.approx(0.5)
    assert f1([], ["b"]) == 0.0 == f1(["b"], [])
    assert f1(["x", "x"], ["x"]) == pytest.approx(2 / 3)


def test_corpus_is_seeded_and_names_are_distinct():
    assert corpus.notes() == corpus.notes()
    assert corpus.notes(seed=1) != corpus.notes()
    names = [p.name for p in corpus.people()]
    assert len(set(names)) == len(names) == corpus.N_PEOPLE


def test_a_good_query_ranks_the_answering_note_first_for_every_task():
    ix = corpus.index()
    for task in agent.tasks():
        notes = ix.search(agent.good_query(task))
        assert len(notes) == corpus.TOP_K
        assert notes[0] == f"the {task['kind']} of {task['name']} is {task['answer']} .", (task, notes)
        # The observation puts the best note last, its value right before the reply.
        assert agent.observation(notes).endswith(f"note : {notes[0]}")


def test_a_name_alone_misses_one_of_three_facts():
    """Two of the person's notes come back: the attribute's word in the query is what finds the third
    (room for a policy to learn better queries)."""
    ix = corpus.index()
    p = corpus.people()[0]
    found = ix.search(p.name)
    assert len(found) == 2 and all(f" of {p.name} is " in n for n in found)


def test_a_query_of_unknown_words_finds_nothing():
    ix = corpus.index()
    assert ix.search("") == [] and ix.search("zebra quantum") == [] and ix.search("the of a") == []
    assert agent.observation([]) == agent.NO_NOTES


def test_tasks_are_stable_and_sampled_without_replacement():
    every = agent.tasks()
    assert len(every) == 3 * corpus.N_PEOPLE == len({t["task_id"] for t in every})
    some = agent.tasks(10, seed=3)
    assert some == agent.tasks(10, seed=3) and len({t["task_id"] for t in some}) == 10
    with pytest.raises(ValueError):
        agent.tasks(len(every) + 1)


def test_every_word_the_tiny_model_reads_or_writes_is_in_vocab():
    vocab = set(agent.VOCAB)
    ix = corpus.index()
    texts = [agent.SYSTEM, agent.NO_NOTES, *corpus.notes()]
    for task in agent.tasks():
        texts += [task["question"], f"answer {task['answer']}", f"search {agent.good_query(task)}"]
        texts.append(agent.observation(ix.search(agent.good_query(task))))
    for conversation in agent.demonstrations(200, seed=1):
        texts += [m["content"] for m in conversation]
    missing = {w for t in texts for w in t.split()} - vocab
    assert not missing


def test_demonstrations_mix_searching_and_guessing():
    demos = agent.demonstrations(100, seed=0, search_fraction=0.3)
    searching = [d for d in demos if len(d) == 5]
    assert len(searching) == 30 and all(len(d) == 3 for d in demos if len(d) != 5)
    by_question = {t["question"]: t for t in agent.tasks()}
    for d in searching:
        # The searching demonstration answers right, from what its search returned.
        task = by_question[d[1]["content"]]
        assert d[2]["content"].startswith("search ") and task["answer"] in d[3]["content"]
        assert score(d[4]["content"].removeprefix("answer "), task["answer"], task["question"]) == 1.0
    with pytest.raises(ValueError):
        agent.demonstrations(10, search_fraction=1.5)


@pytest.mark.parametrize(
    ("reply", "parsed"),
    [
        ("search ada moss lives", ("search", "ada moss lives")),
        ("Answer: rome", ("answer", "rome")),
        ("answer", ("answer", "")),
        ("rome", None),
        ("", None),
        ("searching ada", None),
    ],
)
def test_parse(reply, parsed):
    assert agent.parse(reply) == parsed


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """Two steps of the search demo through the whole stack, with a few small groups."""
    work = tmp_path_factory.mktemp("search-demo")
    run_dir = small_demo(work, "search", tasks_per_step=3)
    return run_dir, tether_jsonl(work, "traces"), tether_jsonl(work, "samples")


@pytest.mark.slow
@runs_a_demo
def test_samples_are_the_tokens_vllm_returned(demo):
    run_dir, traces, samples = demo
    steps = [m for m in jsonl((run_dir / "metrics.jsonl").read_text()) if "step" in m]
    assert [m["step"] for m in steps] == [0, 1]
    assert traces and samples, "nothing trained: every group had equal rewards"
    assert_samples_are_vllm_tokens(traces, samples)
    # The harness's turns merge on the exact prefix: each sample is one whole episode, as vLLM saw it.
    assert_sequences_are_vllm_calls(traces, samples)
    assert len({s["rollout_id"] for s in samples}) == len(samples)


@pytest.mark.slow
@runs_a_demo
def test_sample_rewards_are_the_harness_rewards(demo):
    """The reward each sample carries is the one the harness computes from what vLLM answered last in
    that rollout (decoded from its token ids), and the observations were the index's own results."""
    from transformers import AutoTokenizer

    run_dir, traces, samples = demo
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "final-model")
    by_task = {t["task_id"]: t for t in agent.tasks()}
    ix = corpus.index()
    multi_turn = 0
    for s in samples:
        task = by_task[s["task_id"]]
        calls = sorted(
            (t for t in traces if t["rollout_id"] == s["rollout_id"] and t["status"] == "ok"),
            key=lambda t: len(t["prompt_token_ids"]),
        )
        messages = calls[-1]["request"]["messages"]
        assert messages[:2] == [
            {"role": "system", "content": agent.SYSTEM},
            {"role": "user", "content": task["question"]},
        ]
        # Every observation is what the index returns for the search before it.
        for said, observed in zip(messages[2::2], messages[3::2], strict=True):
            assert observed == {
                "role": "user",
                "content": agent.observation(ix.search(agent.parse(said["content"])[1])),
            }
        multi_turn += len(calls) > 1
        last = agent.parse(tokenizer.decode(calls[-1]["response_token_ids"], skip_special_tokens=True))
        expected = score(last[1], task["answer"], task["question"]) if last and last[0] == "answer" else 0.0
        assert s["reward"] == pytest.approx(expected, abs=1e-6), (s["task_id"], last)
    assert multi_turn, "no rollout searched"
