"""The scheduler's decisions, as pure functions: what to dispatch, when a step may train and on which
groups. No I/O, no clock, no Redis: the mode loops in tether.scheduler.run feed them what they read
and carry out what they answer (docs/architecture.md). Property-tested in tests/test_scheduler_plan.py.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

# --- colocated-sync ---------------------------------------------------------------------------------


def sync_group_ids(run_id: str, step: int, n: int) -> list[str]:
    """The step's groups, one per task drawn: every group of a synchronous step is dispatched at once
    (each with `max_attempts` attempts, retried by the agent worker and the merger, not here)."""
    return [f"{run_id}-s{step}-g{i}" for i in range(n)]


def sync_missing(group_ids: set[str], resolved: Mapping[str, object]) -> set[str]:
    """The step's groups with no result yet; the step is complete when none is left (results of other
    groups, e.g. session groups scored meanwhile, are no part of it)."""
    return group_ids - resolved.keys()


def sync_take(outcomes: Sequence[tuple[str, str]]) -> list[str]:
    """The groups a synchronous step trains, from its (group id, outcome) results in the order they
    resolved: every trained one; filtered or failed groups are reported, not trained."""
    return [gid for gid, outcome in outcomes if outcome == "trained"]


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


# --- serve (`tether up`) ----------------------------------------------------------------------------


def serve_should_train(trained: int, arriving: bool, groups_per_step: int) -> bool:
    """Serve mode trains once `groups_per_step` groups are trainable, and keeps collecting (up to 4x
    that) while groups are still arriving."""
    return not (trained < groups_per_step or (arriving and trained < 4 * groups_per_step))
