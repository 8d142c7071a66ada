"""The scheduler's decisions, as pure functions: what to dispatch, when a step may train and on which
groups, what a restarted scheduler resumes from, whether to hold dispatch for inference, how a step's
weights are pushed. No I/O, no clock, no Redis: the mode loops (tether.scheduler.sync_loop,
async_loop, serve) and the run's shell (run, steps, push, health) feed them what they read and carry
out what they answer (docs/architecture.md). Property-tested in tests/test_scheduler_plan.py and
tests/test_scheduler_decisions.py.

The async rule (colocated-async, disaggregated-async) is the product's staleness guarantee: no group
trains whose oldest token was sampled more than `max_staleness` (k) versions before the weights it
updates. Three decisions keep it without dropping groups:

- dispatch is throttled to a budget of (k + 1) x P groups running or ready (AReaL's rule: dispatched
  <= (version + k + 1) x P), so at most P groups ever come due in one step;
- a step trains the oldest ready groups first, and waits (for running groups to finish) when the
  groups it would leave behind, the running ones counted by the version they were dispatched at, could
  not all train in time in the steps after it, P per step, earliest deadline first; in particular it
  waits for a running group that would be too old after it, since this step is the last one that may
  train it (dropping the slow rollouts would bias training toward the fast ones).

A ready group that is too old all the same (a budget set above the default) is dropped, counted; that
is the only way a ready group leaves without training.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, Literal, Protocol, TypeVar

from tether.common.records import PendingStep, RunState

T = TypeVar("T")


class Result(Protocol):
    """What the decisions read of a group's result (tether.common.records.GroupResult)."""

    @property
    def group_id(self) -> str: ...
    @property
    def outcome(self) -> str: ...  # trained | filtered | too_few | eval | truncated
    @property
    def min_weight_version(self) -> int: ...  # the version that sampled its oldest token; -1: none


R = TypeVar("R", bound=Result)

# --- what to dispatch next (every mode) --------------------------------------------------------------


def task_draws(tasks: Sequence[T], seed: int) -> Iterator[T]:
    """The run's task draws, in order: a seeded sequence, so that a restarted scheduler that skips the
    draws its finished steps (or dispatched groups) used goes on with the very tasks an uninterrupted
    run would have drawn. colocated-sync takes P per step, the async modes one per group."""
    rng = random.Random(seed)
    while True:
        yield rng.choice(tasks)


def eval_groups(run_id: str, tasks: int, repeats: int) -> list[tuple[str, int]]:
    """The final evaluation's groups, (group id, task index): every task `repeats` times, one rollout
    each."""
    return [(f"{run_id}-eval-{i}-{k}", i) for i in range(tasks) for k in range(repeats)]


# --- colocated-sync ---------------------------------------------------------------------------------


def sync_group_ids(run_id: str, step: int, n: int) -> list[str]:
    """The step's groups, one per task drawn: every group of a synchronous step is dispatched at once
    (each with `max_attempts` attempts, retried by the agent worker and the merger, not here)."""
    return [f"{run_id}-s{step}-g{i}" for i in range(n)]


def sync_missing(group_ids: set[str], resolved: Mapping[str, object]) -> set[str]:
    """The step's groups with no result yet; the step is complete when none is left (results of other
    groups, e.g. session groups scored meanwhile, are no part of it)."""
    return group_ids - resolved.keys()


def sync_take(outcomes: Sequence[tuple[str, str]], limit: int = 0) -> list[str]:
    """The groups a synchronous step trains, from its (group id, outcome) results in the order they
    resolved: every trained one (the first `limit`, when > 0: dynamic sampling's batch); filtered or
    failed groups are reported, not trained."""
    take = [gid for gid, outcome in outcomes if outcome == "trained"]
    return take[:limit] if limit > 0 else take


def top_up(trainable: int, dispatched: int, wanted: int, bound: int) -> int:
    """Dynamic sampling (DAPO, arXiv:2503.14476): how many more groups a synchronous step dispatches
    when `trainable` of the `dispatched` so far carry signal and it wants `wanted`, at most `bound` in
    all. Enough for the deficit at the share of groups that passed so far (at least a quarter counted,
    so that a step whose groups all failed the filter does not ask for the whole bound at once); 0 when
    the step has enough or no room is left."""
    if trainable >= wanted or dispatched >= bound:
        return 0
    rate = max(trainable / dispatched if dispatched else 1.0, 0.25)
    return min(math.ceil((wanted - trainable) / rate), bound - dispatched)


def top_up_group_ids(run_id: str, step: int, round_: int, n: int) -> list[str]:
    """The groups of a step's `round_`-th top-up (dynamic sampling), apart from its first P."""
    return [f"{run_id}-s{step}-r{round_}-g{i}" for i in range(n)]


def top_up_draws(tasks: Sequence[T], seed: int, step: int) -> Iterator[T]:
    """A step's top-up tasks: a seeded sequence of its own, so the run's main draws (and a restarted
    scheduler's replay of them) do not depend on how many groups a step topped up."""
    rng = random.Random(f"{seed}:top-up:{step}")
    while True:
        yield rng.choice(tasks)


# --- colocated-async and disaggregated-async -------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """A scored group waiting to train: its id and the version that sampled its oldest token."""

    group_id: str
    min_weight_version: int


@dataclass(frozen=True)
class Take:
    """Train now on `take` (P groups, the oldest first); `ready` carries over to later steps, `stale`
    leaves untrained (too old, counted)."""

    take: tuple[Ready, ...]
    ready: tuple[Ready, ...]
    stale: tuple[Ready, ...]


@dataclass(frozen=True)
class Wait:
    """Do not train yet: fewer than P groups are ready ("too_few"), or a running group must be waited
    for ("due": this step is the last that may train it). `ready` stays, `stale` leaves (counted)."""

    reason: Literal["too_few", "due"]
    ready: tuple[Ready, ...]
    stale: tuple[Ready, ...]


def async_group_id(run_id: str, step: int, n: int) -> str:
    """The n-th group an async run dispatches (n counts across steps, so ids never repeat), dispatched
    while the run is on `step`."""
    return f"{run_id}-a{step}-{n}"


def async_budget(max_inflight_groups: int, max_staleness: int, groups_per_step: int) -> int:
    """Groups running or ready at once: `max_inflight_groups`, or (k + 1) x P when that is 0."""
    return max_inflight_groups or (max_staleness + 1) * groups_per_step


def async_dispatch_count(outstanding: int, ready: int, budget: int) -> int:
    """How many groups to dispatch now. Ready groups not yet trained count against the budget too, so
    at most P groups are ever due in one step: the wait in plan_async_step fits."""
    return max(0, budget - outstanding - ready)


def plan_async_step(
    ready: Sequence[Ready],
    outstanding: Mapping[str, int],
    version: int,
    groups_per_step: int,
    max_staleness: int,
) -> Take | Wait:
    """Whether a step trains now on the weights `version`, and on which groups.

    `ready`: the scored groups not yet trained, in the order they arrived; `outstanding`: the groups
    still running, by the version they were dispatched at (their oldest token cannot be older).
    Groups older than `max_staleness` versions leave as `stale` whatever the answer."""
    k = max_staleness
    stale = tuple(g for g in ready if version - g.min_weight_version > k)
    fresh = tuple(g for g in ready if version - g.min_weight_version <= k)
    if len(fresh) < groups_per_step:
        return Wait("too_few", fresh, stale)
    oldest_first = sorted(fresh, key=lambda g: g.min_weight_version)  # stable: arrival order in a tie
    take, rest = oldest_first[:groups_per_step], oldest_first[groups_per_step:]
    # A group still running that would be too old after this step can only be trained in it.
    if any(version - v >= k for v in outstanding.values()):
        return Wait("due", fresh, stale)
    # Each group's deadline is the last version that may train it; a running group's is bounded by the
    # version it was dispatched at. Wait when training now would leave groups that cannot all train in
    # time, P per step, while all of them still could if this step waited for the running ones (when
    # they could not anyway, waiting would only stall the run: the late ones go stale, counted).
    left = [g.min_weight_version + k for g in rest]
    running = [v + k for v in outstanding.values()]
    every = [g.min_weight_version + k for g in fresh] + running
    if fits_in_time(every, version - 1, groups_per_step) and not fits_in_time(
        [*left, *running], version, groups_per_step
    ):
        return Wait("due", fresh, stale)
    return Take(tuple(take), tuple(rest), stale)


def fits_in_time(deadlines: Sequence[int], version: int, groups_per_step: int) -> bool:
    """Whether groups with these deadlines (the last version that may train each) can all train in the
    steps after the one on `version`, `groups_per_step` (P) per step, earliest deadline first: the j-th
    earliest needs j <= (deadline - version) x P."""
    return all(j <= (d - version) * groups_per_step for j, d in enumerate(sorted(deadlines), start=1))


@dataclass(frozen=True)
class InFlight(Generic[R]):
    """An async run's groups between steps: `outstanding` still running (by the version they were
    dispatched at), `ready` scored and trainable, not yet trained (in arrival order), `window` every
    result since the last step (reported with the next one), `dropped` the groups dropped as too old
    since the last step (the trainer drops them from its buffer) and `dropped_total` in all."""

    outstanding: Mapping[str, int]
    ready: tuple[R, ...] = ()
    window: tuple[R, ...] = ()
    dropped: tuple[str, ...] = ()
    dropped_total: int = 0

    def dispatched(self, group_id: str, version: int) -> InFlight[R]:
        """The group went out while inference serves `version`."""
        return replace(self, outstanding={**self.outstanding, group_id: version})


@dataclass(frozen=True)
class AsyncStep(Generic[R]):
    """A step to train now: `take` (its groups), `drop` (the groups dropped as too old since the last
    step) and `results` (what the step reports: every result of its window except the trainable groups
    it leaves for later)."""

    take: list[str]
    drop: list[str]
    results: list[R]


def arrive(book: InFlight[R], results: Iterable[R]) -> InFlight[R]:
    """Results read from the stream: those of groups this run has running join the window (and the
    ready ones if trainable); anything else (another run's, a session group's, a second result of a
    group already in) is no part of the run."""
    outstanding = dict(book.outstanding)
    window, ready = list(book.window), list(book.ready)
    for rec in results:
        if outstanding.pop(rec.group_id, None) is None:
            continue
        window.append(rec)
        if rec.outcome == "trained":
            ready.append(rec)
    return replace(book, outstanding=outstanding, window=tuple(window), ready=tuple(ready))


def async_step(
    book: InFlight[R], version: int, groups_per_step: int, max_staleness: int
) -> tuple[InFlight[R], AsyncStep[R] | None]:
    """plan_async_step on the run's groups: the groups after it, and the step to train now (None:
    wait). Groups too old leave the ready ones and are counted, whether or not a step trains."""
    by_id = {g.group_id: g for g in book.ready}
    plan = plan_async_step(
        [Ready(g.group_id, g.min_weight_version) for g in book.ready],
        book.outstanding,
        version,
        groups_per_step,
        max_staleness,
    )
    book = replace(
        book,
        ready=tuple(by_id[g.group_id] for g in plan.ready),
        dropped=(*book.dropped, *(g.group_id for g in plan.stale)),
        dropped_total=book.dropped_total + len(plan.stale),
    )
    if isinstance(plan, Wait):
        return book, None
    taken = {g.group_id for g in plan.take}
    kept = {g.group_id for g in plan.ready}
    step = AsyncStep(
        take=[g.group_id for g in plan.take],
        drop=list(book.dropped),
        results=[g for g in book.window if g.outcome != "trained" or g.group_id in taken],
    )
    window = tuple(g for g in book.window if g.outcome == "trained" and g.group_id in kept)
    return replace(book, window=window, dropped=()), step


def stream_position(entry: str) -> tuple[int, int]:
    """A Redis stream entry id ("ms-seq") as a sortable pair."""
    ms, _, seq = entry.partition("-")
    return int(ms), int(seq or 0)


def restore_inflight(
    saved: Mapping[str, tuple[int, str]], pending: PendingStep | None
) -> tuple[dict[str, int], str | None]:
    """An async run after a restart, from its saved in-flight groups (id -> (dispatch version, stream
    position when dispatched)): the groups still running (not used up by the pending step, which is
    finished with its own), and the earliest position their results can be at (None: none saved)."""
    taken = {*pending.take, *pending.drop, *(g["group_id"] for g in pending.results)} if pending else set()
    cursor = min((c for _, c in saved.values()), key=stream_position, default=None)
    return {gid: v for gid, (v, _) in saved.items() if gid not in taken}, cursor


# --- a run's restart ---------------------------------------------------------------------------------


def resume_from(previous: RunState | None, run_id: str) -> int | None:
    """The step a run starts at when Redis holds `previous`: its first unfinished step if it is this
    run, None when the run starts afresh (nothing saved, or another run id's state)."""
    if previous is None or previous.run_id != run_id:
        return None
    return previous.next_step


def pending_for(state: RunState, step: int) -> PendingStep | None:
    """The groups `step` was to train with, written down before a restart (None: choose afresh)."""
    pending = state.pending
    return pending if pending is not None and pending.step == step else None


def saved_cursor(state: RunState, step: int) -> str | None:
    """Where `step`'s results start, if a scheduler before a restart saved it (None: from now on)."""
    return state.results_cursor if state.step == step and state.results_cursor else None


# --- inference health --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Health:
    """What to do on a health check's answer: "go" (serving: dispatch), "hold" (not serving: dispatch
    nothing, check again), "give_up" (not serving for longer than the timeout: the run fails, its
    supervisor starts the scheduler again). `since`: not serving since (None while serving)."""

    action: Literal["go", "hold", "give_up"]
    since: float | None


def on_health(serving: bool, since: float | None, now: float, timeout_s: float) -> Health:
    """Hold dispatch while inference is not serving (a vLLM restarting would only burn the attempts of
    the rollouts dispatched meanwhile), from the first check that said so (`since`: None before it)
    until `timeout_s` later."""
    if serving:
        return Health("go", None)
    if since is None:
        return Health("hold", now)
    if now - since > timeout_s:
        return Health("give_up", since)
    return Health("hold", since)


# --- a step's weight push ----------------------------------------------------------------------------


@dataclass(frozen=True)
class PushPlan:
    """How a step trains and pushes: `drain` gateway admission around it (colocated: the GPUs are
    shared, nothing may generate), put vLLM to sleep at `sleep_level` while the trainer trains
    (0: awake), and `gate_load`: pause admission around the weight load alone."""

    drain: bool
    sleep_level: int
    gate_load: bool = False


def push_plan(colocated: bool, sleep_level: int, run: bool = False) -> PushPlan:
    """Colocated modes drain admission and sleep vLLM (when configured); disaggregated-async neither:
    rollouts go on while the trainer trains, and vLLM holds requests in flight only while it loads.
    A run's step (`run`: its adapter on a vLLM other runs share) never puts vLLM to sleep, and in
    disaggregated-async pauses its own admission around the adapter load: the run's gateway gates
    follow its `admission` key and take the new version only when a pause of it ends."""
    if run:
        return PushPlan(drain=colocated, sleep_level=0, gate_load=not colocated)
    return PushPlan(drain=colocated, sleep_level=sleep_level if colocated else 0)


def staleness(results: Iterable[Result], version_before: int) -> tuple[float, float]:
    """(max, mean) versions between the weights a step updates and the oldest token of each group it
    trains; groups with no sampled token (min_weight_version -1) do not count."""
    ages = [
        version_before - g.min_weight_version
        for g in results
        if g.outcome == "trained" and g.min_weight_version >= 0
    ]
    return float(max(ages, default=0)), (sum(ages) / len(ages) if ages else 0.0)


# --- serve (`tether up`) ----------------------------------------------------------------------------


def serve_should_train(trained: int, arriving: bool, groups_per_step: int) -> bool:
    """Serve mode trains once `groups_per_step` groups are trainable, and keeps collecting (up to 4x
    that) while groups are still arriving."""
    return not (trained < groups_per_step or (arriving and trained < 4 * groups_per_step))


def serve_scored(results: Iterable[R]) -> list[R]:
    """The results serve mode reports with its next step: the groups scored, trained, filtered or left
    with nothing to train because the output limit cut every rollout's response (``truncated``: its
    cuts belong in the step's figures); a group with too few rollouts, or an evaluation, is no part of
    a step."""
    return [g for g in results if g.outcome in ("trained", "filtered", "truncated")]
