"""Gang restart of the trainer ranks, as JobSet's failure policy does it but without JobSet: NCCL
cannot take a restarted rank back into a running group, so when one rank restarts (its container
restarted, or its pod was replaced) while the others keep running, the others' pods are deleted; their
controller (the trainer StatefulSet) creates them again, all ranks meet at the rendezvous, and the
trainer resumes from its checkpoint.

A rank is its pod's index label (an Indexed Job replaces a failed pod under a new name; a StatefulSet
under the same one), else its pod's name. The decision is a pure function over two snapshots; `GangRestart` keeps the baseline: the last
snapshot in which the gang was settled (every rank running and ready). Nothing is decided while no
baseline exists (ranks still coming up, or coming back after a restart), so one event restarts the
gang once, and the restarts of pods we deleted ourselves never count as new events.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tether.scheduler.kube.client import KubeApi, status_of
from tether.scheduler.kube.metrics import GANG_RESTARTS
from tether.scheduler.kube.watch import Snapshot, follow

log = logging.getLogger(__name__)


# The rank of a trainer pod: its index under an Indexed Job (whose replacement pods get new names),
# or under a StatefulSet (whose replacements keep the name; the label exists since Kubernetes 1.28).
INDEX_LABELS = ("batch.kubernetes.io/job-completion-index", "apps.kubernetes.io/pod-index")


@dataclass(frozen=True)
class Rank:
    """What the decision needs of the pod that runs one trainer rank."""

    uid: str
    restarts: int  # sum of its containers' restartCount
    running: bool  # phase Running and the Ready condition true
    deleting: bool  # deletionTimestamp set
    pod: str = ""  # its name, to delete it (the rank's own name where empty)


def rank_of(pod: dict[str, Any]) -> Rank:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    return Rank(
        uid=meta.get("uid", ""),
        restarts=sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or []),
        running=status.get("phase") == "Running" and ready,
        deleting=bool(meta.get("deletionTimestamp")),
        pod=meta.get("name", ""),
    )


def rank_key(pod: dict[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    index = next((labels[k] for k in INDEX_LABELS if k in labels), None)
    return f"rank-{index}" if index is not None else str(meta.get("name", ""))


def ranks(snapshot: Snapshot) -> dict[str, Rank]:
    """Rank -> its pod. Where two pods hold one rank (a replacement created while the old pod
    terminates), the one not being deleted, else the newer."""
    out: dict[str, tuple[tuple[bool, str], Rank]] = {}
    for pod in snapshot.values():
        rank = rank_of(pod)
        order = (not rank.deleting, str((pod.get("metadata") or {}).get("creationTimestamp", "")))
        key = rank_key(pod)
        if key not in out or order > out[key][0]:
            out[key] = (order, rank)
    return {key: rank for key, (_, rank) in out.items()}


def settled(current: Mapping[str, Rank]) -> bool:
    """Every rank up: the gang a restart is measured against."""
    return bool(current) and all(r.running and not r.deleting for r in current.values())


def restarted_ranks(previous: Mapping[str, Rank], current: Mapping[str, Rank]) -> set[str]:
    """The ranks of `previous` that restarted in `current`: more container restarts, or a new pod
    under the same name."""
    return {
        name
        for name, now in current.items()
        if name in previous and (now.uid != previous[name].uid or now.restarts > previous[name].restarts)
    }


def pods_to_restart(previous: Mapping[str, Rank], current: Mapping[str, Rank]) -> list[str]:
    """The pods to delete so that all ranks restart together: when a rank of the settled gang
    `previous` restarted in `current`, the pod of every other rank still running the pod it ran in
    `previous` (pod names, sorted). Empty when nothing restarted, and for the ranks already restarting
    (deleted, replaced, or being deleted)."""
    restarted = restarted_ranks(previous, current)
    if not restarted:
        return []
    return sorted(
        now.pod or name
        for name, now in current.items()
        if name not in restarted and name in previous and now.uid == previous[name].uid and not now.deleting
    )


def delete_options(uid: str) -> dict[str, Any]:
    """Delete exactly the pod we saw (a precondition on its uid), never its replacement."""
    return {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid}}


class GangRestart:
    def __init__(self, api: KubeApi, namespace: str, selector: str) -> None:
        self.api, self.namespace, self.selector = api, namespace, selector
        self.baseline: dict[str, Rank] | None = None

    async def changed(self, snapshot: Snapshot, _event: dict[str, Any] | None) -> None:
        current = ranks(snapshot)
        if self.baseline is None:
            if settled(current):
                self.baseline = current
            return
        baseline = self.baseline
        victims = pods_to_restart(baseline, current)
        if victims:
            restarted = sorted(restarted_ranks(baseline, current))
            log.warning(
                "trainer rank restarted (%s): restarting %s so that all ranks rendezvous", restarted, victims
            )
            GANG_RESTARTS.inc()
            self.baseline = None  # until the gang settles again: one event, one restart
            uids = {r.pod or key: r.uid for key, r in current.items()}
            try:
                for name in victims:
                    await self.delete(name, uids[name])
            except Exception:
                # Listed again after the failure, the ranks deleted so far count as restarted against
                # the old baseline and the rest are deleted then.
                self.baseline = baseline
                raise
        elif settled(current) and set(current) >= set(self.baseline):
            self.baseline = current  # scaled up, or restart counts of a settled gang moved on

    async def delete(self, name: str, uid: str) -> None:
        try:
            await self.api.delete(
                "pods", self.api.core.delete_namespaced_pod, name, self.namespace, delete_options(uid)
            )
        except Exception as exc:
            # Gone already (404) or replaced (409, the uid precondition): restarting anyway.
            if status_of(exc) not in (404, 409):
                raise

    async def run(self) -> None:
        await follow(
            self.api,
            "pods",
            self.api.core.list_namespaced_pod,
            self.changed,
            namespace=self.namespace,
            label_selector=self.selector,
        )
