"""The run registry's decisions, pure (docs/runs.md, "Design: a run is a namespace"): which run ids are
valid, the namespace a run's keys live under, and which status a run may move to. No Redis: the
gateway's store (`tether.gateway.runs.Runs`) reads a record, asks here, and writes; `RunRecord`
(common/records.py) checks its id and status with the same rules.
"""

from __future__ import annotations

import re
from typing import Literal

RunStatus = Literal["created", "running", "stopping", "stopped", "failed"]
CREATED, RUNNING, STOPPING, STOPPED, FAILED = "created", "running", "stopping", "stopped", "failed"
STATUSES: tuple[str, ...] = (CREATED, RUNNING, STOPPING, STOPPED, FAILED)
FINAL = frozenset({STOPPED, FAILED})

# Where a status may go. `failed` from any live status (a run's service gave up); `stopped` only through
# `stopping` (its services drain first). Final statuses go nowhere.
TRANSITIONS: dict[str, frozenset[str]] = {
    CREATED: frozenset({RUNNING, STOPPING, FAILED}),
    RUNNING: frozenset({STOPPING, FAILED}),
    STOPPING: frozenset({STOPPED, FAILED}),
    STOPPED: frozenset(),
    FAILED: frozenset(),
}

MAX_RUN_ID = 40
# A slug: no ':' (the key separator), no '{' or '}' (Redis Cluster hash tags), no '.' (the namespace's
# own separator), no upper case (ids that differ only in case would be one run to a human).
_RUN_ID = re.compile(r"[a-z0-9][a-z0-9-]*")
RUN_ID_RULE = f"lowercase letters, digits and '-', 1 to {MAX_RUN_ID} characters, not starting with '-'"
# Between the base namespace and the run id: no key of the base namespace (`<base>:<name>`) begins so.
RUN_SEPARATOR = ".run."


class TransitionRefused(ValueError):
    """A status change the run's current status does not allow."""

    def __init__(self, run_id: str, current: str, wanted: str) -> None:
        super().__init__(f"run {run_id} is {current}: it cannot become {wanted}")
        self.run_id = run_id
        self.current = current
        self.wanted = wanted


def valid_run_id(run_id: object) -> bool:
    return isinstance(run_id, str) and len(run_id) <= MAX_RUN_ID and _RUN_ID.fullmatch(run_id) is not None


def run_namespace(base: str, run_id: str) -> str:
    """The namespace of a run's keys: `<base>.run.<run id>` (ValueError for an invalid id)."""
    if not valid_run_id(run_id):
        raise ValueError(f"invalid run id {run_id!r}: {RUN_ID_RULE}")
    return f"{base}{RUN_SEPARATOR}{run_id}"


def run_of_namespace(namespace: str) -> tuple[str, str] | None:
    """(base namespace, run id) when `namespace` is a run's (`run_namespace`'s inverse), None for any
    other: a run's services know their run by the namespace they are given, with nothing beside it that
    could name another run. A base namespace must not end in `.run.<slug>` itself."""
    base, sep, run_id = namespace.rpartition(RUN_SEPARATOR)
    if not sep or not base or not valid_run_id(run_id):
        return None
    return base, run_id


def trainer_run_id(namespace: str) -> str:
    """The `run_id` a namespace's services send the trainer: the run's id for a run's namespace, ""
    (the trainer's single policy, as before runs) for any other."""
    found = run_of_namespace(namespace)
    return found[1] if found else ""


def next_status(run_id: str, current: str, wanted: str) -> str:
    """`wanted`, when `current` may move to it; TransitionRefused otherwise."""
    if wanted not in TRANSITIONS.get(current, frozenset()):
        raise TransitionRefused(run_id, current, wanted)
    return wanted


def stop_target(run_id: str, current: str) -> str | None:
    """What stopping a run in `current` does: the status to write (`stopping`), or None when it is
    stopping or stopped already (stopping again changes nothing); TransitionRefused for a failed run."""
    if current in (STOPPING, STOPPED):
        return None
    return next_status(run_id, current, STOPPING)


def takes_rollouts(status: str) -> bool:
    """Whether a run in `status` may start rollouts: not once it is asked to stop, nor after."""
    return status in (CREATED, RUNNING)


def serves_calls(status: str) -> bool:
    """Whether the calls of a run's rollouts are served in `status`: while it runs, and while it is
    `stopping` (the rollouts already running finish: its services drain); never once it is `stopped`
    or `failed` (nothing of it trains any more: a call would be served and recorded for nothing)."""
    return status not in FINAL


def drains(status_before_stop: str) -> bool:
    """Whether a run stopped from this status has services to drain before it is `stopped`: only a
    running one (a `created` run never had any, so it is stopped at once)."""
    return status_before_stop == RUNNING
