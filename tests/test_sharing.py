"""The sharing policy's decision (common/sharing.py; docs/runs.md "Sharing the trainer"), pure: fairness
over a sequence, weights respected in the long run, no starvation, idle time not banked, ties by
arrival; with callers that always wait and with callers that ask again only after their step returned
(as a run's scheduler does). The real trainer serving waiting runs in this order: test_trainer_runs.py.
Also the step rate GetRunStatus reports."""

from __future__ import annotations

from collections import Counter

import pytest

from tether.common.sharing import TurnBook
from tether.trainer.steps import steps_per_minute


def always_waiting(book: TurnBook, runs: list[str], weights: dict[str, float], turns: int) -> list[str]:
    """Every run has a step waiting at every turn."""
    order = []
    for _ in range(turns):
        run = book.pick(runs)
        book.served(run, weights.get(run, 1.0))
        order.append(run)
    return order


def one_at_a_time(book: TurnBook, runs: list[str], weights: dict[str, float], turns: int) -> list[str]:
    """Each run asks for its next step only after its last returned (a run's scheduler): when a step
    ends its run is `returning`, and a pick of it is the turn held until it asks again."""
    waiting, order = list(runs), []
    returning = None
    for _ in range(turns):
        run = book.pick(waiting, returning)
        if returning is not None:
            waiting.append(returning)  # it asks again (within the hold)
        waiting.remove(run)
        book.served(run, weights.get(run, 1.0))
        order.append(run)
        returning = run
    return order


def test_round_robin_serves_the_run_that_trained_least_recently():
    book = TurnBook("round_robin")
    assert always_waiting(book, ["a", "b", "c"], {}, 9) == list("abcabcabc")
    # A run's second step waits behind the others', whatever the arrival order.
    assert book.pick(["c", "a", "b"]) == "a"  # a trained longest ago
    book.served("a", 1.0)
    assert book.pick(["a", "b"]) == "b"
    # Never held for the run whose step just ended.
    assert book.pick(["b"], returning="a") == "b"
    # A newcomer (never trained) goes first; ties by arrival.
    assert book.pick(["b", "new", "newer"]) == "new"


@pytest.mark.parametrize("caller", [always_waiting, one_at_a_time])
def test_weighted_shares_steps_in_proportion_to_the_weights(caller):
    weights = {"a": 3.0, "b": 1.0, "c": 0.5}
    order = caller(TurnBook("weighted"), ["a", "b", "c"], weights, 900)
    counts = Counter(order)
    total = sum(weights.values())
    for run, w in weights.items():
        assert abs(counts[run] - 900 * w / total) <= 2, counts
    # Fair at every prefix too, not only in the end: no run is ever more than 2 steps off its share.
    seen: Counter[str] = Counter()
    for n, run in enumerate(order, 1):
        seen[run] += 1
        assert all(abs(seen[r] - n * w / total) <= 2 for r, w in weights.items()), (n, seen)


def test_round_robin_with_callers_one_at_a_time_alternates():
    assert one_at_a_time(TurnBook("round_robin"), ["a", "b"], {"a": 3.0}, 6) == list("ababab")


@pytest.mark.parametrize("caller", [always_waiting, one_at_a_time])
def test_no_run_starves_under_any_weights(caller):
    order = caller(TurnBook("weighted"), ["heavy", "light"], {"heavy": 1000.0, "light": 1.0}, 3003)
    served = [i for i, r in enumerate(order) if r == "light"]
    assert len(served) == 3 and all(b - a <= 1002 for a, b in zip([-1, *served], served, strict=False))


def test_a_run_back_from_idling_does_not_bank_its_idle_time():
    book = TurnBook("weighted")
    always_waiting(book, ["a", "b"], {}, 100)  # c idles meanwhile
    order = always_waiting(book, ["a", "b", "c"], {}, 6)
    assert Counter(order) == {"a": 2, "b": 2, "c": 2}, order  # c catches up nothing: it shares


def test_weighted_ties_go_by_arrival_and_the_returning_run_wins_only_strictly():
    book = TurnBook("weighted")
    assert book.pick(["b", "a"]) == "b"
    book.served("b", 1.0)  # b: finish 1
    assert book.pick(["a"], returning="b") == "a"  # a: 0 < 1
    book.served("a", 1.0)  # a: finish 1; the virtual time 0
    assert book.pick(["a"], returning="b") == "a"  # equal: the waiting one goes
    book.served("a", 4.0)
    assert book.pick(["b"], returning="a") == "b"


def test_a_forgotten_run_starts_afresh():
    book = TurnBook("round_robin")
    always_waiting(book, ["a", "b"], {}, 4)
    book.forget("a")
    assert book.pick(["b", "a"]) == "a"  # as a newcomer


def test_bad_policy_and_weights_are_refused():
    with pytest.raises(ValueError, match="unknown sharing policy"):
        TurnBook("fifo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        TurnBook("weighted").served("a", 0.0)
    with pytest.raises(ValueError, match="no policy waits"):
        TurnBook("weighted").pick([])


def test_steps_per_minute_over_the_window_or_since_start():
    now = 10_000.0
    assert steps_per_minute([], now, since=now - 60) == 0.0
    assert steps_per_minute([now - 50, now - 30, now - 10], now, since=now - 60) == pytest.approx(3.0)
    # Over the last 10 minutes once the process is older: steps before it no longer count.
    old = [now - 900, now - 700]
    assert steps_per_minute([*old, now - 300], now, since=now - 3600) == pytest.approx(0.1)
    assert steps_per_minute([*old], now, since=now - 3600) == 0.0  # stopped: falls to 0
    assert steps_per_minute([now], now, since=now) == 0.0
