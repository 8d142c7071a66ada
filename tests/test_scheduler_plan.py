"""The scheduler's decisions (tether.scheduler.plan), property-tested: in the async modes nothing trains
more than k versions stale, no ready group is lost (each is taken, kept, or dropped as too old and
counted), the oldest ready groups go first; a simulated async run keeps all of it step after step, and
with the default budget never has to drop a group. The synchronous step and serve mode's trigger too."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tether.scheduler.plan import (
    Ready,
    Take,
    Wait,
    async_budget,
    async_dispatch_count,
    plan_async_step,
    serve_should_train,
    sync_group_ids,
    sync_missing,
    sync_take,
)

VERSION = st.integers(0, 12)


@st.composite
def async_inputs(draw):
    version = draw(VERSION)
    k = draw(st.integers(0, 3))
    P = draw(st.integers(1, 5))
    mwvs = draw(st.lists(st.integers(-1, version), max_size=14))
    ready = [Ready(f"g{i}", v) for i, v in enumerate(mwvs)]
    outstanding = {f"o{i}": v for i, v in enumerate(draw(st.lists(st.integers(0, version), max_size=8)))}
    return ready, outstanding, version, P, k


@given(async_inputs())
def test_plan_async_step_loses_nothing_and_trains_nothing_too_old(args):
    ready, outstanding, version, P, k = args
    plan = plan_async_step(ready, outstanding, version, P, k)
    taken = plan.take if isinstance(plan, Take) else ()
    # Every ready group is accounted for exactly once: taken, kept for later, or dropped as too old.
    assert Counter([*taken, *plan.ready, *plan.stale]) == Counter(ready)
    # Dropped are exactly the groups older than k versions; nothing taken or kept is.
    assert set(plan.stale) == {g for g in ready if version - g.min_weight_version > k}
    assert all(version - g.min_weight_version <= k for g in (*taken, *plan.ready))


def _all_train_in_time(groups, first: int, P: int, k: int) -> bool:
    """Oracle: step by step from version `first`, train the P groups with the earliest deadline
    (a Ready's oldest token + k, a running group's dispatch version + k); True when none is late."""
    deadlines = sorted(g.min_weight_version + k if isinstance(g, Ready) else g + k for g in groups)
    step = first
    while deadlines:
        if deadlines[0] < step:
            return False
        deadlines, step = deadlines[P:], step + 1
    return True


@given(async_inputs())
def test_plan_async_step_takes_the_oldest_when_it_may_and_only_then(args):
    ready, outstanding, version, P, k = args
    plan = plan_async_step(ready, outstanding, version, P, k)
    fresh = [g for g in ready if version - g.min_weight_version <= k]
    due = [gid for gid, v in outstanding.items() if version - v >= k]
    if len(fresh) < P:
        assert plan == Wait("too_few", tuple(fresh), plan.stale)  # kept in arrival order
    elif due:
        # One of them would be too old after this step: wait for it rather than drop it later.
        assert plan == Wait("due", tuple(fresh), plan.stale)
    elif _all_train_in_time([*fresh, *outstanding.values()], version, P, k) and not _all_train_in_time(
        [*sorted(fresh, key=lambda g: g.min_weight_version)[P:], *outstanding.values()], version + 1, P, k
    ):
        # Training now would leave more groups due by some version than the steps until then can train,
        # though waiting for the running ones could train them all: wait.
        assert plan == Wait("due", tuple(fresh), plan.stale)
    else:
        assert isinstance(plan, Take) and len(plan.take) == P
        # The oldest first, the rest carried over; ties in arrival order (a stable sort).
        assert list(plan.take) + list(plan.ready) == sorted(fresh, key=lambda g: g.min_weight_version)
        assert max(g.min_weight_version for g in plan.take) <= min(
            (g.min_weight_version for g in plan.ready), default=version
        )


def test_plan_async_step_examples():
    a, b, c = Ready("a", 3), Ready("b", 2), Ready("c", 1)
    # k = 1 at version 3: c (sampled at 1) is too old; b goes before a.
    assert plan_async_step([a, b, c], {}, 3, 1, 1) == Take((b,), (a,), (c,))
    # A group dispatched at version 2 is still running: after this step it would be 2 > k old.
    assert plan_async_step([a, b], {"x": 2}, 3, 1, 1) == Wait("due", (a, b), ())
    assert plan_async_step([a, b], {"x": 3}, 3, 2, 1) == Take((b, a), (), ())
    assert plan_async_step([a], {}, 3, 2, 1) == Wait("too_few", (a,), ())
    # k = 0: fully on-policy, so any running group holds the step back.
    assert plan_async_step([a], {"x": 3}, 3, 1, 0) == Wait("due", (a,), ())


@given(st.integers(0, 20), st.integers(0, 20), st.integers(0, 3), st.integers(1, 6), st.integers(0, 30))
def test_dispatch_fills_exactly_to_the_budget(outstanding, ready, k, P, inflight):
    budget = async_budget(inflight, k, P)
    assert budget == (inflight if inflight else (k + 1) * P)
    n = async_dispatch_count(outstanding, ready, budget)
    assert n >= 0 and outstanding + ready + n == max(budget, outstanding + ready)


@settings(max_examples=150, deadline=None)
@given(
    k=st.integers(0, 3),
    P=st.integers(1, 4),
    steps=st.integers(1, 8),
    extra_budget=st.sampled_from([0, 0, 1, 3, 8]),
    data=st.data(),
)
def test_a_simulated_async_run_keeps_the_staleness_bound(k, P, steps, extra_budget, data):
    """The async loop of tether.scheduler.run, decisions only: dispatch to the budget, groups complete
    in any order (some not trainable), each sampled by weights no older than the version it was
    dispatched at; plan, train, bump the version. Every step trains P groups at most k versions stale,
    every dispatched group ends accounted for, and with the default budget none is ever dropped."""
    budget = async_budget((k + 1) * P + extra_budget if extra_budget else 0, k, P)
    version, n = 0, 0
    outstanding: dict[str, int] = {}
    ready: list[Ready] = []
    trained: list[str] = []
    dropped: list[str] = []
    untrainable: list[str] = []
    failures_left = data.draw(st.integers(0, 2 * P), label="untrainable groups")
    for _ in range(1000):
        if len(trained) == steps * P:
            break
        for _ in range(async_dispatch_count(len(outstanding), len(ready), budget)):
            outstanding[f"g{n}"] = version
            n += 1
        # Some of the running groups finish (at least one, so the run moves), in any order.
        done = (
            data.draw(st.lists(st.sampled_from(sorted(outstanding)), min_size=1, unique=True), label="done")
            if outstanding
            else []
        )
        for gid in done:
            dispatched_at = outstanding.pop(gid)
            if failures_left and data.draw(st.booleans(), label="untrainable"):
                failures_left -= 1
                untrainable.append(gid)
                continue
            mwv = data.draw(st.integers(dispatched_at, version), label="oldest token's version")
            ready.append(Ready(gid, mwv))
        plan = plan_async_step(ready, outstanding, version, P, k)
        ready = list(plan.ready)
        dropped.extend(g.group_id for g in plan.stale)
        if isinstance(plan, Wait):
            continue
        assert len(plan.take) == P
        assert all(version - g.min_weight_version <= k for g in plan.take)
        trained.extend(g.group_id for g in plan.take)
        version += 1
    assert len(trained) == steps * P, "the run did not finish"
    accounted = [*trained, *dropped, *untrainable, *(g.group_id for g in ready), *outstanding]
    assert sorted(accounted) == sorted(f"g{i}" for i in range(n))  # each dispatched group once
    if extra_budget == 0:
        assert dropped == []  # (k + 1) x P in flight: the wait always fits, no group comes due too late


def test_sync_step_dispatches_one_group_per_task_and_is_complete_when_all_resolved():
    ids = sync_group_ids("run", 3, 4)
    assert ids == ["run-s3-g0", "run-s3-g1", "run-s3-g2", "run-s3-g3"]
    assert not set(ids) & set(sync_group_ids("run", 4, 4))  # no step answers for another's groups
    want = set(ids)
    resolved: dict[str, dict] = {}
    assert sync_missing(want, resolved) == want
    resolved.update({ids[0]: {}, ids[2]: {}})
    assert sync_missing(want, resolved) == {ids[1], ids[3]}
    resolved.update({ids[1]: {}, ids[3]: {}})
    assert sync_missing(want, resolved) == set()


@given(st.lists(st.tuples(st.text(min_size=1), st.sampled_from(["trained", "filtered", "too_few", "eval"]))))
def test_sync_step_trains_every_trained_group_in_order(outcomes):
    assert sync_take(outcomes) == [g for g, o in outcomes if o == "trained"]


@given(st.integers(0, 50), st.booleans(), st.integers(1, 10))
def test_serve_trains_once_enough_groups_and_collects_while_they_arrive(trained, arriving, per_step):
    want = trained >= per_step and (not arriving or trained >= 4 * per_step)
    assert serve_should_train(trained, arriving, per_step) == want
