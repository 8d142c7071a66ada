"""The chart refuses each bad value set under tests/deploy/values/bad/, and says where: the message
names the offending path. Each bad set patches a good one, and the good one renders, so the refusal
comes from the patch and nothing else."""

from __future__ import annotations

import pytest

from deploy import chart

BAD = chart.bad_sets()


def names_path(message: str, path: str) -> bool:
    """The message names the dotted path: as written (a template's fail), or as the schema's JSON
    pointer (`/trainer/nccl` ... `socketIfName` for an unknown key, `/run/mode` for a bad value)."""
    parts = path.split(".")
    pointer = "/" + "/".join(parts)
    parent = "/" + "/".join(parts[:-1])
    if path in message or pointer in message:
        return True
    if len(parts) == 1:
        return f"'{parts[0]}'" in message or f'"{parts[0]}"' in message
    return parent in message and parts[-1] in message


def test_there_is_a_bad_set_for_each_rule():
    assert len(BAD) >= 8
    for vs in BAD:
        assert {"based-on", "refused-at"} <= set(vs.meta), f"{vs.path.name}: needs based-on and refused-at"


@pytest.mark.parametrize("name", [vs.name for vs in BAD])
def test_a_bad_set_is_refused_with_its_path(name):
    vs = chart.value_set(name)
    base = chart.value_set(vs.meta["based-on"])
    values, version = chart.bad_values(vs)
    assert chart.refusal(base.values, base.kube_versions[0], base.api_versions) is None, (
        "the base set is refused"
    )
    message = chart.refusal(values, version, base.api_versions)
    assert message is not None, f"{name}: rendered, want a refusal at {vs.meta['refused-at']}"
    assert names_path(message, vs.meta["refused-at"]), (
        f"the refusal does not name {vs.meta['refused-at']}: {message}"
    )


@pytest.mark.parametrize(
    "message,path,expected",
    [
        (
            "at '/trainer/nccl': additional properties 'socketIfName' not allowed",
            "trainer.nccl.socketIfName",
            True,
        ),
        ("at '': additional properties 'inferense' not allowed", "inferense", True),
        ("at '/run/mode': value must be one of ...", "run.mode", True),
        ("tether: inference.gpus must be >= 1 on the gpu backend", "inference.gpus", True),
        ("at '/trainer': additional properties 'nodes2' not allowed", "trainer.nccl.socketIfName", False),
        ("inference.gpus must be >= 1", "trainer.gpusPerNode", False),
    ],
)
def test_names_path(message, path, expected):
    assert names_path(message, path) is expected


RUNS_BAD = [vs.name for vs in BAD if vs.name.startswith("runs-")]


@pytest.mark.parametrize("name", RUNS_BAD)
def test_a_runs_rule_refuses_only_with_runs_on(name):
    """What a run's adapter cannot share (vLLM's sleep, the NCCL push, a trainer on several ranks or
    with FSDP, another LoRA rank, several inference replicas, no room for an adapter) is refused only
    with runs.enabled, and the message says it is the runs that refuse it: the same values with
    runs.enabled false render. (The schema's refusals of a runs key, runs-replicas and a rank vLLM cannot
    serve, hold whatever runs.enabled says.)"""
    assert len(RUNS_BAD) >= 10
    values, version = chart.bad_values(chart.value_set(name))
    message = chart.refusal(values, version)
    assert message is not None
    if "execution error" not in message:  # the schema's
        assert chart.refusal(chart.merge(values, {"runs": {"enabled": False}}), version) is not None
        return
    assert "runs." in message, message  # runs.enabled, runs.loraRank, runs.terminationGracePeriodSeconds
    assert chart.refusal(chart.merge(values, {"runs": {"enabled": False}}), version) is None, name
