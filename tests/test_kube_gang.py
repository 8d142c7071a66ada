"""Gang restart of the trainer ranks: the pure decision on crafted snapshots, then the controller
against the recording fake (one restart per event, nothing while ranks come up, the uid precondition
on every delete)."""

from __future__ import annotations

import asyncio

from kube_fake import FakeKube

from tether.scheduler.kube import gang
from tether.scheduler.kube.gang import Rank, pods_to_restart

UP = dict(running=True, deleting=False)


def snap(**ranks: tuple[str, int]) -> dict[str, Rank]:
    return {name: Rank(uid, restarts, **UP) for name, (uid, restarts) in ranks.items()}


BASE = snap(t0=("a", 0), t1=("b", 0), t2=("c", 0))


def test_nothing_changed_nothing_restarts():
    assert pods_to_restart(BASE, BASE) == []


def test_a_container_restart_restarts_the_other_ranks():
    now = {**BASE, "t1": Rank("b", 1, running=False, deleting=False)}
    assert pods_to_restart(BASE, now) == ["t0", "t2"]


def test_a_replaced_pod_restarts_the_other_ranks():
    now = {**BASE, "t2": Rank("c2", 0, running=False, deleting=False)}
    assert pods_to_restart(BASE, now) == ["t0", "t1"]


def test_ranks_already_restarting_are_left_alone():
    now = {
        "t0": Rank("a", 1, running=False, deleting=False),  # the event
        "t1": Rank("b", 0, running=True, deleting=True),  # being deleted
        # t2 gone: its controller is replacing it
    }
    assert pods_to_restart(BASE, now) == []
    now["t2"] = Rank("c", 0, **UP)
    assert pods_to_restart(BASE, now) == ["t2"]


def test_all_ranks_restarting_together_needs_nothing():
    now = snap(t0=("a", 1), t1=("b2", 0), t2=("c", 3))
    assert pods_to_restart(BASE, now) == []


def test_a_new_rank_is_no_event():
    assert pods_to_restart(BASE, {**BASE, "t3": Rank("d", 5, **UP)}) == []


def test_settled_needs_every_rank_up():
    assert gang.settled(BASE)
    assert not gang.settled({})
    assert not gang.settled({**BASE, "t1": Rank("b", 0, running=False, deleting=False)})
    assert not gang.settled({**BASE, "t1": Rank("b", 0, running=True, deleting=True)})


def pod(name: str, uid: str, restarts: int = 0, ready: bool = True, phase: str = "Running") -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "uid": uid,
            "labels": {"app.kubernetes.io/instance": "demo", "app.kubernetes.io/component": "trainer"},
        },
        "status": {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "containerStatuses": [{"name": "trainer", "restartCount": restarts, "ready": ready}],
        },
    }


def test_rank_of_reads_a_pod():
    assert gang.rank_of(pod("t0", "u", restarts=2)) == Rank("u", 2, running=True, deleting=False, pod="t0")
    assert not gang.rank_of(pod("t0", "u", ready=False)).running
    assert not gang.rank_of(pod("t0", "u", phase="Pending")).running


async def until(predicate, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


SELECTOR = "app.kubernetes.io/instance=demo,app.kubernetes.io/component=trainer"


def deletes(fake: FakeKube) -> list[dict]:
    return [b for res, verb, b in fake.bodies if verb == "delete"]


async def test_one_rank_restarting_restarts_the_others_once():
    fake = FakeKube()
    # Ranks coming up: a restart while not all are ready is no event.
    fake.put("pods", pod("t0", "a", ready=False))
    fake.put("pods", pod("t1", "b", ready=False))
    controller = gang.GangRestart(fake.api(), "ns", SELECTOR)
    task = asyncio.create_task(controller.run())
    try:
        await until(lambda: ("", "pods", "watch") in fake.calls)
        fake.put("pods", pod("t1", "b", restarts=1, ready=False))
        fake.put("pods", pod("t0", "a"))
        fake.put("pods", pod("t1", "b", restarts=1))
        await until(lambda: controller.baseline is not None)
        assert deletes(fake) == []
        # Rank 1's container restarts: rank 0 is deleted, with a precondition on its uid.
        fake.put("pods", pod("t1", "b", restarts=2, ready=False))
        await until(lambda: deletes(fake))
        assert deletes(fake) == [gang.delete_options("a")]
        assert "t0" not in fake.store["pods"]
        # The StatefulSet brings rank 0 back; rank 1 restarts once more while coming up: no second round.
        fake.put("pods", pod("t0", "a2", ready=False))
        fake.put("pods", pod("t1", "b", restarts=3, ready=False))
        fake.put("pods", pod("t0", "a2"))
        fake.put("pods", pod("t1", "b", restarts=3))
        await until(lambda: controller.baseline is not None)
        await asyncio.sleep(0.2)
        assert len(deletes(fake)) == 1
        # Settled again, rank 0's pod is replaced (a new uid): rank 1 is restarted.
        fake.remove("pods", "t0")
        fake.put("pods", pod("t0", "a3", ready=False))
        await until(lambda: len(deletes(fake)) == 2)
        assert deletes(fake)[1] == gang.delete_options("b")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert {c for c in fake.calls} == {("", "pods", "list"), ("", "pods", "watch"), ("", "pods", "delete")}


async def test_a_pod_replaced_before_the_delete_is_not_deleted():
    fake = FakeKube()
    fake.put("pods", pod("t0", "a"))
    fake.put("pods", pod("t1", "b"))
    controller = gang.GangRestart(fake.api(), "ns", SELECTOR)
    await controller.changed({n: fake.store["pods"][n] for n in fake.store["pods"]}, None)
    # t0 already replaced by the time the delete arrives: the uid precondition refuses (409), ignored.
    fake.put("pods", pod("t0", "a-new"))
    await controller.changed({"t0": pod("t0", "a"), "t1": pod("t1", "b2", ready=False)}, None)
    assert deletes(fake) == [gang.delete_options("a")]
    assert fake.store["pods"]["t0"]["metadata"]["uid"] == "a-new"


def indexed_pod(
    name: str, uid: str, index: int, deleting: bool = False, created: str = "2026-01-01T00:00:00Z"
) -> dict:
    p = pod(name, uid)
    p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] = str(index)
    p["metadata"]["creationTimestamp"] = created
    if deleting:
        p["metadata"]["deletionTimestamp"] = "2026-01-01T00:05:00Z"
    return p


def test_ranks_of_an_indexed_job_follow_the_index_not_the_pod_name():
    before = gang.ranks(
        {
            p["metadata"]["name"]: p
            for p in (indexed_pod("tr-0-aaaaa", "a", 0), indexed_pod("tr-1-bbbbb", "b", 1))
        }
    )
    assert set(before) == {"rank-0", "rank-1"} and gang.settled(before)
    # Rank 1 failed; the Job controller made a replacement under a new name while the old one terminates.
    now = gang.ranks(
        {
            p["metadata"]["name"]: p
            for p in (
                indexed_pod("tr-0-aaaaa", "a", 0),
                indexed_pod("tr-1-bbbbb", "b", 1, deleting=True),
                indexed_pod("tr-1-ccccc", "c", 1, created="2026-01-01T00:05:01Z"),
            )
        }
    )
    assert now["rank-1"].pod == "tr-1-ccccc"
    assert pods_to_restart(before, now) == ["tr-0-aaaaa"]


def test_statefulset_pods_are_ranked_by_their_pod_index_label():
    p = pod("demo-tether-trainer-1", "u")
    p["metadata"]["labels"]["apps.kubernetes.io/pod-index"] = "1"
    assert gang.rank_key(p) == "rank-1"
    assert gang.rank_key(pod("plain", "u")) == "plain"
