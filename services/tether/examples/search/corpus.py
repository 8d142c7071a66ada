"""The search agent's world: a seeded corpus of made-up people and a BM25 index over it (bm25s).

Every person has a two-word name, a city, a two-word job and an age, each stated in a note of its own
("the job of ada moss is bread baker .").
Names share first and last words, so a query that names one person also matches others' notes: the
retriever must rank the right note first and the agent must read the right one. A few notes that name no
one mention the same cities and jobs as distractors. Nothing is downloaded: the corpus is a pure function
of its seed and the index is built from it once per process.
"""

from __future__ import annotations

import functools
import random
import threading
from dataclasses import dataclass

import bm25s
import numpy as np

FIRST_NAMES: tuple[str, ...] = ("ada", "bo", "cy", "di", "ed", "flo", "gus", "hal", "ida", "jo")
LAST_NAMES: tuple[str, ...] = ("moss", "lane", "ray", "cole", "hart", "fox", "reed", "stone", "wood", "york")
CITIES: tuple[str, ...] = (
    "rome", "oslo", "paris", "lima", "cairo", "delhi", "tokyo", "quito", "dakar", "perth", "riga", "sofia",
)  # fmt: skip
# A job is a field word and a trade word ("bread baker"): two-word answers, where F1 gives partial credit.
JOB_FIELDS: tuple[str, ...] = ("bread", "sea", "tea", "glass", "wood", "road")
JOB_TRADES: tuple[str, ...] = ("baker", "pilot", "farmer", "maker", "trader", "guard")
AGES: tuple[str, ...] = tuple(str(a) for a in range(21, 33))
# The words of the notes themselves.
NOTE_WORDS: tuple[str, ...] = (
    "the", "city", "job", "age", "of", "is", "many", "people", "live", "in", "a", "works", "every", "day", "big",
    "small", "near", "sea",
)  # fmt: skip
# Query words a retriever ignores (they match almost every note).
STOPWORDS = frozenset({"a", "an", "the", "of", "in", "as", "is", "and", "or", "to", "for"})
ATTRIBUTES: tuple[str, ...] = ("city", "job", "age")
N_PEOPLE = 40
TOP_K = 2
SEED = 15


@dataclass(frozen=True)
class Person:
    name: str
    city: str
    job: str
    age: str


def people(n: int = N_PEOPLE, seed: int = SEED) -> list[Person]:
    """n people with distinct names; attributes drawn independently."""
    rng = random.Random(seed)
    names = [f"{f} {last}" for f in FIRST_NAMES for last in LAST_NAMES]
    return [
        Person(
            name, rng.choice(CITIES), f"{rng.choice(JOB_FIELDS)} {rng.choice(JOB_TRADES)}", rng.choice(AGES)
        )
        for name in rng.sample(names, n)
    ]


def person_notes(p: Person) -> list[str]:
    """One note per fact, the value last ("the city of ada moss is rome .")."""
    return [f"the {kind} of {p.name} is {getattr(p, kind)} ." for kind in ATTRIBUTES]


def distractors(seed: int = SEED) -> list[str]:
    """Notes that name no one but share the words of cities and jobs."""
    rng = random.Random(seed + 1)
    notes = [f"many people live in {c} ." for c in CITIES]
    notes += [f"a {f} {rng.choice(JOB_TRADES)} works every day ." for f in JOB_FIELDS]
    notes += [f"{c} is a {rng.choice(('big', 'small'))} city near the sea ." for c in rng.sample(CITIES, 4)]
    return notes


def notes(seed: int = SEED) -> list[str]:
    """The whole corpus: three notes per person, then the distractors."""
    return [n for p in people(seed=seed) for n in person_notes(p)] + distractors(seed)


def terms(text: str) -> list[str]:
    """What the index sees of a text: lower-cased words without punctuation or stopwords."""
    return [w for w in text.lower().replace("?", " ").replace(".", " ").split() if w not in STOPWORDS]


class Index:
    """BM25 (bm25s, Lucene's variant) over the notes; thread-safe searches (the agent worker runs many
    rollouts at once)."""

    def __init__(self, documents: list[str]) -> None:
        self.documents = documents
        self._bm25 = bm25s.BM25()
        self._bm25.index([terms(d) for d in documents], show_progress=False)
        self._lock = threading.Lock()

    def search(self, query: str, k: int = TOP_K) -> list[str]:
        """The k best notes for `query`, best first; none when no query word is in the corpus."""
        words = [w for w in terms(query) if w in self._bm25.vocab_dict]
        if not words:
            return []
        with self._lock:
            ids, scores = self._bm25.retrieve([words], k=min(k, len(self.documents)), show_progress=False)
        return [
            self.documents[int(i)] for i, s in zip(ids[0], scores[0], strict=True) if s > 0 and np.isfinite(s)
        ]


@functools.lru_cache(maxsize=4)
def index(seed: int = SEED) -> Index:
    """The corpus' index, built once per process (a few milliseconds for the ~140 notes)."""
    return Index(notes(seed))
