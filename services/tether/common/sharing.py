"""Whose turn comes next when several policies wait for one shared thing (issue 28's sharing policy;
docs/runs.md, "Sharing the trainer" and "Sharing vLLM"). Two users, one decision:

- the trainer, which trains one step at a time: when the step in hand ends and steps of several
  policies wait, `TurnBook.pick` chooses whose goes next (tether.trainer.steps.Turns);
- the gateway, which lets at most `run_max_concurrent` calls of runs reach vLLM at once: when a call
  ends and calls of several runs wait, the same choice says whose call goes next
  (tether.gateway.share.CallShare; a turn is one call there).

The policies:

- `round_robin`: the policy served least recently (one never served first); ties, in arrival order.
  Each waiting policy is served within as many turns as there are policies.
- `weighted`: start-time fair queuing by weight (stride scheduling's virtual time): each turn costs
  its policy 1 / weight, the policy that has spent least goes, so over a long run the turns of
  policies that keep asking are shared in proportion to their weights, and every waiting policy is
  served within a bounded number of turns (no starvation). A policy back from idling starts level
  with the others: time it spent idle is not banked as a burst that would shut them out.

On the trainer, a run's scheduler asks for its next step only after its last one returned (and its
adapter was loaded), so when a step ends its policy is not waiting yet: `pick` is told which policy
that is (`returning`), and when the policy says it goes next, the trainer holds the turn for it a
moment (`TETHER_RUN_SHARING_HOLD_S`) rather than hand it to a policy that should wait; otherwise a
policy whose every step follows its last would merely alternate with the others, whatever the
weights. The gateway has no such moment: a run's agents keep many calls waiting.

Pure: no asyncio, no clock (a turn counter orders the services).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

SharingPolicy = Literal["round_robin", "weighted"]
SHARING_POLICIES: tuple[str, ...] = get_args(SharingPolicy)


class TurnBook:
    """What the policy remembers between turns: when each policy was last served (round-robin), and
    each policy's finish tag and the virtual time (weighted: start-time fair queuing, Goyal et al.
    1996: a step's start tag is max(virtual time, its policy's finish tag), the smallest start tag
    goes, the virtual time becomes its start tag and the policy's finish tag start + 1 / weight). A
    policy back from idling starts at the virtual time: time it spent idle is not banked."""

    def __init__(self, policy: SharingPolicy) -> None:
        if policy not in SHARING_POLICIES:
            raise ValueError(f"unknown sharing policy {policy!r}: one of {SHARING_POLICIES}")
        self.policy = policy
        self.turn = 0  # turns served so far
        self.last_served: dict[str, int] = {}  # policy -> the turn it was last served
        self.finish: dict[str, float] = {}  # policy -> finish tag of its newest step
        self.virtual_time = 0.0  # start tag of the newest step served

    def key(self, run: str) -> float:
        """What `pick` orders by: smaller goes first."""
        if self.policy == "round_robin":
            return float(self.last_served.get(run, -1))
        return max(self.virtual_time, self.finish.get(run, 0.0))

    def pick(self, waiting: Sequence[str], returning: str | None = None) -> str:
        """The policy whose step goes next, among `waiting` (distinct, in the arrival order of each one's
        oldest waiting step) and `returning`: the policy whose step just ended, not waiting yet (its
        scheduler calls again after its push). When `returning` comes back, the caller holds the turn
        for it a moment; it wins only strictly (round-robin: never), and ties go by arrival."""
        candidates = [*waiting, *([returning] if returning and returning not in waiting else [])]
        if not candidates:
            raise ValueError("no policy waits")
        return min(candidates, key=self.key)  # min keeps the first of equals

    def served(self, run: str, weight: float) -> None:
        """`run`'s step was chosen; `weight` > 0 is its share under `weighted`."""
        if weight <= 0:
            raise ValueError(f"a weight must be positive, not {weight}")
        start = self.key(run) if self.policy == "weighted" else self.virtual_time
        self.last_served[run] = self.turn
        self.turn += 1
        self.virtual_time = start
        self.finish[run] = start + 1.0 / weight

    def forget(self, run: str) -> None:
        """`run` left (a closed run): it starts afresh if it comes back."""
        self.last_served.pop(run, None)
        self.finish.pop(run, None)
