"""The search agent: a multi-turn harness that answers questions about made-up people by searching a
local BM25 index, against any OpenAI-compatible endpoint (Search-R1's shape).

Each turn the model replies either ``search WORDS`` (the harness sends back the top-2 notes the index
ranks for WORDS, the best last) or ``answer TEXT`` (the episode ends and TEXT is scored, reward.py); at
most 4 turns. The facts are in the corpus only, so answering without searching is a guess.
Demonstrations mostly answer directly with a random candidate of the right kind, the rest search with
the person's name and the attribute's word and copy the answer from the best note, so that RL can raise
the reward by moving probability mass onto searching first (README, "Measured").
"""

from __future__ import annotations

import random

from openai.types.chat import ChatCompletionMessageParam

from tether.examples import harness
from tether.examples.search import corpus
from tether.examples.search.reward import score

MAX_TURNS = 4
MAX_TOKENS = 8  # "search ada moss city" and "answer bread baker" fit with room to spare
SYSTEM = (
    "answer the question about a person . you may search the notes : reply search and a few words , "
    "and you get the best notes back . when you know the answer , reply answer and the answer ."
)
NO_NOTES = "no notes found ."
# Question templates by the attribute asked, with the word a good query adds to the person's name.
QUESTIONS: dict[str, tuple[str, str]] = {
    "city": ("where does {name} live ?", "city"),
    "job": ("what is the job of {name} ?", "job"),
    "age": ("how old is {name} ?", "age"),
}
CANDIDATES: dict[str, tuple[str, ...]] = {
    "city": corpus.CITIES,
    "job": tuple(f"{f} {t}" for f in corpus.JOB_FIELDS for t in corpus.JOB_TRADES),
    "age": corpus.AGES,
}

PROTOCOL_WORDS: tuple[str, ...] = ("search", "answer", "note", ":", ".", ",", "?", "no", "found")
PROMPT_WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        w for text in (SYSTEM, *(q for q, _ in QUESTIONS.values())) for w in text.split() if "{" not in w
    )
)
VOCAB: list[str] = list(
    dict.fromkeys(
        [
            *PROTOCOL_WORDS,
            *PROMPT_WORDS,
            *corpus.NOTE_WORDS,
            *corpus.FIRST_NAMES,
            *corpus.LAST_NAMES,
            *corpus.CITIES,
            *corpus.JOB_FIELDS,
            *corpus.JOB_TRADES,
            *corpus.AGES,
        ]
    )
)

# Warm start: 30% searching demonstrations, 1,000 steps: enough to teach the copy from the note (offline,
# greedy, 60 tasks: the exact answer after a search 97% of the time; 23% after 300 steps: README).
DEMONSTRATIONS = 2000
WARM_START: dict[str, float] = {"steps": 1000, "lr": 3e-3}
SEARCH_FRACTION = 0.3
DEMO: dict[str, int | float] = {"steps": 40, "tasks_per_step": 8, "group_size": 8}


def tasks(n: int | None = None, seed: int = 0) -> list[dict]:
    """One question per person and attribute (120 tasks), or n of them sampled without replacement."""
    every = [
        {
            "task_id": f"{p.name.replace(' ', '-')}-{kind}",
            "name": p.name,
            "question": template.format(name=p.name),
            "kind": kind,
            "answer": getattr(p, kind),
        }
        for p in corpus.people()
        for kind, (template, _) in QUESTIONS.items()
    ]
    return harness.pick(every, n, seed)


def observation(notes: list[str]) -> str:
    """What the harness sends back for a search: the notes, each after ``note :``, the best one last
    (closest to the reply that uses it)."""
    return " ".join(f"note : {n}" for n in reversed(notes)) if notes else NO_NOTES


def good_query(task: dict) -> str:
    """The demonstrations' query: the person's name and the attribute's word."""
    return f"{task['name']} {QUESTIONS[task['kind']][1]}"


def demonstrations(
    n: int = DEMONSTRATIONS, seed: int = 0, search_fraction: float = SEARCH_FRACTION
) -> list[list[dict]]:
    """n conversations shaped like the agent's calls, round(n * search_fraction) of them searching.

    Direct demonstrations answer with a random candidate of the asked kind (rarely the right one), so
    the warm-started policy learns that only the searching path is reliable.
    """
    rng = random.Random(seed)
    pool = tasks()
    kinds = harness.mix(n, search_fraction, rng, "search_fraction")
    ix = corpus.index()
    out: list[list[dict]] = []
    for searches in kinds:
        task = rng.choice(pool)
        opening = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
        if searches:
            query = good_query(task)
            out.append(
                [
                    *opening,
                    {"role": "assistant", "content": f"search {query}"},
                    {"role": "user", "content": observation(ix.search(query))},
                    {"role": "assistant", "content": f"answer {task['answer']}"},
                ]
            )
        else:
            guess = rng.choice(CANDIDATES[task["kind"]])
            out.append([*opening, {"role": "assistant", "content": f"answer {guess}"}])
    return out


def parse(reply: str) -> tuple[str, str] | None:
    """(``search`` | ``answer``, the rest) for a well-formed reply, else None. A real model may wrap
    its reply in punctuation or capitals; the first word decides."""
    words = reply.strip().split(maxsplit=1)
    if not words:
        return None
    action = words[0].lower().strip(":.,")
    if action not in ("search", "answer"):
        return None
    return action, words[1].strip() if len(words) > 1 else ""


def rollout(task: dict, base_url: str, api_key: str, model: str) -> float:
    """Run one episode and return its reward (reward.score): up to MAX_TURNS replies, each a search or
    the answer; a reply that is neither, or no answer by the last turn, scores 0."""
    client = harness.client(base_url, api_key)
    ix = corpus.index()
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task["question"]},
    ]
    for _ in range(MAX_TURNS):
        completion = client.chat.completions.create(
            model=model, messages=messages, temperature=1.0, max_tokens=MAX_TOKENS
        )
        reply = completion.choices[0].message.content or ""
        parsed = parse(reply)
        if parsed is None:
            return 0.0
        action, text = parsed
        if action == "answer":
            return score(text, task["answer"], task["question"])
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": observation(ix.search(text))})
    return 0.0
