"""The scheduler's decisions beyond the staleness rule (tether.scheduler.plan; that rule itself is
tests/test_scheduler_plan.py's), property-tested: the task draws a restarted run replays, group ids,
the async run's bookkeeping of in-flight, ready and reported groups (every result reported exactly
once, or dropped as too old, counted), what a restart resumes from, holding dispatch on inference
health, how a step pushes, and a step's staleness figures."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from tether.common.records import PendingStep, RunState
from tether.scheduler.plan import (
    AsyncStep,
    InFlight,
    arrive,
    async_budget,
    async_dispatch_count,
    async_group_id,
    async_step,
    eval_groups,
    on_health,
    pending_for,
    push_plan,
    restore_inflight,
    resume_from,
    saved_cursor,
    serve_scored,
    staleness,
    stream_position,
    sync_group_ids,
    task_draws,
)
from tether.scheduler.store import InflightGroup

OUTCOMES = st.sampled_from(["trained", "filtered", "too_few", "eval", "truncated"])


@dataclass(frozen=True)
class G:
    """A group result as the decisions read it."""

    group_id: str
    outcome: str
    min_weight_version: int


# --- what to dispatch next -------------------------------------------------------------------------


@given(st.lists(st.integers(), min_size=1, max_size=6), st.integers(0, 2**32), st.integers(0, 40))
def test_task_draws_are_the_seeded_sequence_and_resume_where_a_run_stopped(tasks, seed, n):
    draws = list(itertools.islice(task_draws(tasks, seed), n + 10))
    # The draws an earlier scheduler made (random.Random(seed).choice, one at a time): a run resumed
    # across this change replays the very tasks it drew before.
    rng = random.Random(seed)
    assert draws == [rng.choice(tasks) for _ in range(n + 10)]
    # Skipping the draws of the groups (or steps) done continues with the same tasks.
    assert list(itertools.islice(task_draws(tasks, seed), n, n + 10)) == draws[n:]
    assert set(draws) <= set(tasks)


@given(st.integers(1, 5), st.integers(0, 6), st.integers(0, 2**16))
def test_sync_steps_draw_p_tasks_each_in_sequence(P, steps, seed):
    tasks = list(range(7))
    draws = task_draws(tasks, seed)
    per_step = [list(itertools.islice(draws, P)) for _ in range(steps)]
    assert [t for step in per_step for t in step] == list(
        itertools.islice(task_draws(tasks, seed), P * steps)
    )


@given(st.integers(0, 8), st.integers(0, 5), st.integers(1, 4), st.integers(0, 20))
def test_group_ids_never_repeat_within_a_run(tasks, repeats, P, steps):
    evals = eval_groups("r", tasks, repeats)
    assert Counter(i for _, i in evals) == Counter({i: repeats for i in range(tasks)} if repeats else {})
    sync = [g for s in range(steps) for g in sync_group_ids("r", s, P)]
    # n counts every async group of the run; the step it went out in only labels it.
    asyncs = [async_group_id("r", n // P, n) for n in range(steps * P)]
    ids = [gid for gid, _ in evals] + sync + asyncs
    assert len(ids) == len(set(ids))


# --- the async modes' bookkeeping ------------------------------------------------------------------


@st.composite
def books(draw):
    version = draw(st.integers(0, 10))
    running = draw(st.lists(st.integers(0, version), max_size=8))
    outstanding = {f"o{i}": v for i, v in enumerate(running)}
    ready = tuple(
        G(f"r{i}", "trained", draw(st.integers(-1, version))) for i in range(draw(st.integers(0, 8)))
    )
    others = tuple(
        G(f"w{i}", draw(OUTCOMES.filter(lambda o: o != "trained")), -1)
        for i in range(draw(st.integers(0, 3)))
    )
    window = ready + others
    dropped = tuple(f"d{i}" for i in range(draw(st.integers(0, 2))))
    total = len(dropped) + draw(st.integers(0, 5))
    return InFlight(outstanding, ready, window, dropped, total), version


@given(books(), st.data())
def test_arrive_takes_each_running_group_once_and_nothing_else(start, data):
    book, version = start
    ids = sorted(book.outstanding) + ["elsewhere", "session:x"]
    batch = data.draw(
        st.lists(st.builds(G, st.sampled_from(ids), OUTCOMES, st.integers(-1, version)), max_size=12)
    )
    after = arrive(book, batch)
    first: dict[str, G] = {}
    for g in batch:
        if g.group_id in book.outstanding:
            first.setdefault(g.group_id, g)
    arrived = list(first.values())  # in arrival order: dict keeps insertion order
    assert after.window == book.window + tuple(arrived)
    assert after.ready == book.ready + tuple(g for g in arrived if g.outcome == "trained")
    assert dict(after.outstanding) == {k: v for k, v in book.outstanding.items() if k not in first}
    assert (after.dropped, after.dropped_total) == (book.dropped, book.dropped_total)


@given(books(), st.integers(1, 4), st.integers(0, 3))
def test_async_step_reports_every_result_once_and_keeps_the_rest(start, P, k):
    book, version = start
    after, step = async_step(book, version, P, k)
    stale = [g.group_id for g in book.ready if version - g.min_weight_version > k]
    assert after.dropped_total == book.dropped_total + len(stale)
    assert after.outstanding == book.outstanding
    if step is None:
        # Nothing trains: the window waits for the next step, the dropped ones are told with it.
        assert after.window == book.window and after.dropped == (*book.dropped, *stale)
        return
    assert isinstance(step, AsyncStep) and len(step.take) == P
    assert step.drop == [*book.dropped, *stale] and after.dropped == ()
    kept = {g.group_id for g in after.ready}
    # Each result of the window: reported now, carried to a later step (trainable, kept), or dropped.
    for g in book.window:
        where = [g in step.results, g in after.window, g.group_id in stale]
        assert where.count(True) == 1, g
        if g.outcome != "trained":
            assert g in step.results
    assert {g.group_id for g in after.window} == kept
    assert set(step.take) <= {g.group_id for g in step.results}


@settings(max_examples=150, deadline=None)
@given(k=st.integers(0, 3), P=st.integers(1, 4), steps=st.integers(1, 6), data=st.data())
def test_a_simulated_async_run_reports_each_result_exactly_once(k, P, steps, data):
    """The async loop's bookkeeping end to end (arrive, async_step, InFlight.dispatched), with results
    that arrive in any order, some untrainable and some twice: every group that went out is reported
    by exactly one step (trained or untrainable) or is still in the book at the end, and every step's
    report holds the groups it trained."""
    budget = async_budget(0, k, P)
    book: InFlight[G] = InFlight({})
    version = 0
    sent: list[str] = []
    reported: list[str] = []
    trained: list[str] = []
    for _ in range(500):
        if len(trained) >= steps * P:
            break
        for _ in range(async_dispatch_count(len(book.outstanding), len(book.ready), budget)):
            sent.append(async_group_id("r", version, len(sent)))
            book = book.dispatched(sent[-1], version)
        running = sorted(book.outstanding)
        done = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True)) if running else []
        batch = [
            G(gid, data.draw(st.sampled_from(["trained", "trained", "filtered"])), book.outstanding[gid])
            for gid in done
        ]
        book, step = async_step(arrive(book, batch + batch[:1]), version, P, k)  # one arrives twice
        if step is None:
            continue
        assert set(step.take) <= {g.group_id for g in step.results}
        assert step.drop == []  # (k + 1) x P in flight: no group ever comes due too late
        reported.extend(g.group_id for g in step.results)
        trained.extend(step.take)
        version += 1
    assert len(trained) == steps * P, "the run did not finish"
    left = [*book.outstanding, *(g.group_id for g in book.window)]
    assert sorted([*reported, *left]) == sorted(sent)  # each once: none lost, none reported twice
    assert book.dropped_total == 0 and book.dropped == ()


@given(
    st.dictionaries(
        st.text("abcdefg", min_size=1, max_size=3),
        st.tuples(st.integers(0, 9), st.tuples(st.integers(0, 10**13), st.integers(0, 99))),
        max_size=8,
    ),
    st.data(),
)
def test_restore_inflight_keeps_the_unused_groups_and_reads_from_the_earliest(saved, data):
    groups = {gid: (v, f"{ms}-{seq}") for gid, (v, (ms, seq)) in saved.items()}
    used = data.draw(st.lists(st.sampled_from(sorted(groups)), unique=True) if groups else st.just([]))
    split = len(used) // 2
    pending = (
        PendingStep(
            step=3,
            take=used[:split],
            drop=[],
            results=[{"group_id": g} for g in used[split:]],
            version_before=1,
            rollout_s=0.0,
        )
        if used
        else None
    )
    outstanding, cursor = restore_inflight(groups, pending)
    assert outstanding == {gid: v for gid, (v, _) in groups.items() if gid not in used}
    if not groups:
        assert cursor is None
    else:
        # Numerically earliest, not by string ("9-0" comes before "10-0").
        assert stream_position(cursor) == min(pos for _, pos in saved.values())


def test_stream_positions_order_numerically():
    assert stream_position("9-5") < stream_position("10-0") and stream_position("12") == (12, 0)


def test_an_inflight_group_keeps_its_saved_form():
    """The in-flight hash's values are JSON a scheduler of before this module wrote too."""
    old = '{"version": 2, "cursor": "5-1", "task": {"task_id": "t"}, "step": 4}'
    group = InflightGroup.from_json(old)
    assert group == InflightGroup(2, "5-1", {"task_id": "t"}, 4) and group.to_json() == old


# --- a restart -------------------------------------------------------------------------------------


@st.composite
def run_states(draw):
    pending = draw(
        st.none()
        | st.builds(
            PendingStep, st.integers(0, 5), st.just(["g"]), st.just([]), st.just([]), st.just(0), st.just(0.0)
        )
    )
    return RunState(
        run_id=draw(st.sampled_from(["r", "other"])),
        total_steps=8,
        run_dir="/runs/r",
        mode="colocated-sync",
        next_step=draw(st.integers(0, 8)),
        weight_version=0,
        step=draw(st.integers(0, 5)),
        results_cursor=draw(st.sampled_from(["", "1-0", "7-3"])),
        pending=pending,
    )


@given(st.none() | run_states())
def test_a_run_resumes_only_its_own_state(previous):
    start = resume_from(previous, "r")
    if previous is None or previous.run_id != "r":
        assert start is None
    else:
        assert start == previous.next_step


@given(run_states(), st.integers(0, 5))
def test_a_pending_step_and_a_saved_cursor_belong_to_their_step_only(state, step):
    pending = pending_for(state, step)
    assert pending is (state.pending if state.pending is not None and state.pending.step == step else None)
    cursor = saved_cursor(state, step)
    assert cursor == (state.results_cursor if state.step == step and state.results_cursor else None)


# --- inference health ------------------------------------------------------------------------------


@settings(max_examples=200)
@given(
    st.lists(st.tuples(st.booleans(), st.floats(0, 5, allow_nan=False)), max_size=30),
    st.floats(0, 20, allow_nan=False),
)
def test_dispatch_holds_while_not_serving_and_gives_up_only_after_the_timeout(checks, timeout):
    """A sequence of health checks, time going forward: go exactly when serving; hold otherwise, from
    the first check of an outage on; give up at the first check more than `timeout` after it."""
    now, since = 0.0, None
    outage_start: float | None = None
    for serving, dt in checks:
        now += dt
        decision = on_health(serving, since, now, timeout)
        if serving:
            assert decision.action == "go" and decision.since is None
            outage_start = None
        else:
            outage_start = now if outage_start is None else outage_start
            assert decision.since == outage_start
            late = now - outage_start > timeout
            assert decision.action == ("give_up" if late else "hold")
            if late:
                return
        since = decision.since


@given(st.integers(0, 100), st.integers(0, 100), st.integers(0, 50))
def test_a_wait_started_earlier_counts_from_its_start(start, elapsed, timeout):
    """wait() passes the time it started waiting as `since`: the first check may already give up.
    (Whole seconds: the comparison is exact.)"""
    decision = on_health(False, float(start), float(start + elapsed), float(timeout))
    assert decision.action == ("give_up" if elapsed > timeout else "hold") and decision.since == start


# --- a step's push and figures ---------------------------------------------------------------------


@given(st.booleans(), st.integers(0, 2))
def test_only_colocated_steps_drain_admission_and_sleep(colocated, level):
    plan = push_plan(colocated, level)
    assert plan.drain == colocated
    assert plan.sleep_level == (level if colocated else 0)
    assert not plan.gate_load


@given(st.booleans(), st.integers(0, 2))
def test_a_runs_step_never_sleeps_the_shared_vllm_and_always_pauses_its_gate_for_the_load(colocated, level):
    plan = push_plan(colocated, level, run=True)
    assert plan.sleep_level == 0
    # Its admission is paused around the load either way: for the whole update when colocated, for
    # the load alone otherwise (its gateways take the new version only when a pause ends).
    assert plan.drain == colocated and plan.gate_load == (not colocated)


@given(st.lists(st.builds(G, st.text(max_size=3), OUTCOMES, st.integers(-1, 9))), st.integers(0, 12))
def test_staleness_counts_the_trained_groups_with_tokens(results, version):
    results = [g for g in results if g.min_weight_version <= version]
    ages = [
        version - g.min_weight_version
        for g in results
        if g.outcome == "trained" and g.min_weight_version >= 0
    ]
    top, mean = staleness(results, version)
    if not ages:
        assert (top, mean) == (0.0, 0.0)
    else:
        assert top == max(ages) and min(ages) <= mean <= top
        assert abs(mean * len(ages) - sum(ages)) < 1e-9


@given(st.lists(st.builds(G, st.text(max_size=3), OUTCOMES, st.just(0))))
def test_serve_reports_the_scored_groups_in_order(results):
    assert serve_scored(results) == [g for g in results if g.outcome in ("trained", "filtered", "truncated")]


@given(
    wanted=st.integers(1, 16),
    bound_extra=st.integers(0, 48),
    dispatched=st.integers(0, 64),
    trainable_share=st.floats(0.0, 1.0),
)
def test_dynamic_sampling_tops_up_within_its_bound_and_only_when_short(
    wanted, bound_extra, dispatched, trainable_share
):
    from tether.scheduler.plan import top_up

    bound = wanted + bound_extra
    dispatched = min(dispatched, bound)
    trainable = int(dispatched * trainable_share)
    n = top_up(trainable, dispatched, wanted, bound)
    assert 0 <= n <= bound - dispatched
    assert (n == 0) == (trainable >= wanted or dispatched >= bound)
    if n and n < bound - dispatched:  # not cut by the bound: enough at the share seen so far (>= 1/4)
        rate = max(trainable / dispatched if dispatched else 1.0, 0.25)
        assert trainable + n * rate >= wanted - 1e-9


def test_top_up_draws_and_ids_are_the_steps_own():
    from tether.scheduler.plan import sync_group_ids, task_draws, top_up_draws, top_up_group_ids

    tasks = [{"task_id": f"t{i}"} for i in range(10)]
    a = [t["task_id"] for t in itertools.islice(top_up_draws(tasks, 1, 3), 20)]
    assert a == [t["task_id"] for t in itertools.islice(top_up_draws(tasks, 1, 3), 20)]  # replayable
    assert a != [t["task_id"] for t in itertools.islice(top_up_draws(tasks, 1, 4), 20)]
    assert a != [t["task_id"] for t in itertools.islice(task_draws(tasks, 1), 20)]  # not the main draws
    ids = top_up_group_ids("r", 3, 1, 4) + top_up_group_ids("r", 3, 2, 4) + sync_group_ids("r", 3, 4)
    assert len(set(ids)) == len(ids)
