"""docs/metrics.md against the code: its table of Tether's metrics lists exactly the `tether_*` metrics each
service process registers (name, type, labels, which processes), so that adding a metric without
documenting it fails. Each process is imported as it starts (`tether.<service>.main`) in its own
interpreter: what that interpreter's prometheus_client registry holds is what its /metrics serves.

The vLLM table: it holds the current names (no removed `vllm:gpu_*`), and (slow, needs the vLLM-CPU
virtualenv) it lists exactly the families a real vllm-cpu server exports after the operations the
page names.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from vllm_cpu import VLLM_VENV

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
PROCESSES = {
    "gateway": "tether.gateway.main",
    "inference": "tether.inference.main",
    "trainer": "tether.trainer.main",
    "merger": "tether.merger.main",
    "scheduler": "tether.scheduler.main",
    "agents": "tether.agents.main",
    "runhost": "tether.runhost.main",
}

# Printed by a fresh interpreter that imported one service's main module: its tether_* metrics. The
# collectors themselves, not REGISTRY.collect(): a labelled metric with no child yet yields no samples,
# and its label names are known only to the collector (prometheus_client's `_name`, `_type`,
# `_labelnames`; a counter's `_name` is without `_total`).
_DUMP = """
import importlib, json, sys
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase
importlib.import_module(sys.argv[1])
out = []
for c in list(REGISTRY._collector_to_names):
    if isinstance(c, MetricWrapperBase) and c._name.startswith("tether_"):
        name = c._name + ("_total" if c._type == "counter" else "")
        out.append([name, c._type, list(c._labelnames)])
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Row:
    name: str
    type: str
    labels: tuple[str, ...]
    processes: frozenset[str]
    meaning: str


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _table(header: str) -> list[list[str]]:
    """The rows of the markdown table whose header row starts with `header`."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    return rows


def _names(cell: str) -> tuple[str, ...]:
    return tuple(re.findall(r"`([^`]+)`", cell))


def documented() -> list[Row]:
    """The table of Tether's metrics in docs/metrics.md."""
    out = []
    for name, type_, labels, processes, meaning in _table("| metric | type | labels | process | meaning |"):
        (metric,) = _names(name)
        out.append(
            Row(
                metric,
                type_,
                () if labels == "—" else _names(labels),
                frozenset(p.strip() for p in processes.split(",")),
                meaning,
            )
        )
    return out


def registered() -> dict[str, tuple[str, tuple[str, ...], frozenset[str]]]:
    """name -> (type, labels, processes registering it), from every service's process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = {
        process: subprocess.Popen(
            [sys.executable, "-c", _DUMP, module], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for process, module in PROCESSES.items()
    }
    found: dict[str, tuple[str, tuple[str, ...], set[str]]] = {}
    for process, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()[-2000:]
        for name, type_, labels in json.loads(out):
            previous = found.setdefault(name, (type_, tuple(labels), set()))
            assert previous[:2] == (type_, tuple(labels)), f"{name} differs between processes"
            previous[2].add(process)
    return {name: (t, labels, frozenset(p)) for name, (t, labels, p) in found.items()}


def test_the_table_lists_exactly_the_metrics_every_process_registers():
    rows = documented()
    names = [row.name for row in rows]
    assert len(names) == len(set(names)), "a metric is listed twice"
    assert all(row.meaning for row in rows)
    assert all(row.processes <= set(PROCESSES) for row in rows), [r.processes for r in rows]
    table = {row.name: (row.type, row.labels, row.processes) for row in rows}
    code = registered()
    missing = {n: v for n, v in code.items() if n not in table}
    stale = sorted(set(table) - set(code))
    assert not missing, f"registered but not in docs/metrics.md: {missing}"
    assert not stale, f"in docs/metrics.md but registered by no process: {stale}"
    assert table == code


def test_the_issue_names_are_there():
    """The names the dashboards and alerts are written against."""
    names = {row.name for row in documented()}
    wanted = {
        "tether_broker_stream_length",
        "tether_broker_group_lag",
        "tether_broker_group_pending",
        "tether_broker_dead_letter_entries",
        *(
            f"tether_run_{n}"
            for n in (
                "reward_mean step_seconds push_seconds paused_seconds staleness_max staleness_mean "
                "token_staleness_max token_staleness_mean logprob_abs_diff logprob_k3_kl "
                "sequences_per_rollout forks groups_in_flight tokens_per_second eval_reward max_staleness phase"
            ).split()
        ),
        *(f"tether_{c}_weight_version" for c in ("gateway", "inference", "trainer", "scheduler")),
    }
    assert wanted <= names, sorted(wanted - names)


# --- vLLM --------------------------------------------------------------------------------------

CURRENT_VLLM = {
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:engine_sleep_state",
    "vllm:rl_weight_update_operation_duration_seconds",
}


def documented_vllm() -> dict[str, tuple[str, str]]:
    """vLLM metric -> (type, labels cell) from docs/metrics.md."""
    return {
        _names(n)[0]: (t, labels) for n, t, labels, _ in _table("| vLLM metric | type | labels | meaning |")
    }


def test_the_vllm_table_has_the_current_names_and_no_removed_ones():
    table = documented_vllm()
    assert CURRENT_VLLM <= set(table), sorted(CURRENT_VLLM - set(table))
    assert not [n for n in table if n.startswith("vllm:gpu_")]


def _vllm_families(text: str) -> dict[str, tuple[str, set[str]]]:
    """family (as PromQL names it: counters with _total) -> (type, label names), `_created` left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, tuple[str, set[str]]] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith("vllm:") or fam.name.endswith("_created"):
            continue
        name = fam.name + ("_total" if fam.type == "counter" else "")
        labels = {k for s in fam.samples for k in s.labels} - {"le", "quantile"}
        out[name] = (fam.type, labels)
    return out


@pytest.mark.slow
def test_the_vllm_table_is_what_vllm_cpu_exports(tmp_path):
    """A real vllm-cpu server started as the inference service starts it (plus the weight-transfer flag)
    and put through the page's operations exports exactly the documented families."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no vLLM-CPU virtualenv at {VLLM_VENV}")
    import httpx

    from tether.cli import load_example
    from tether.common.net import free_port
    from tether.demo import tiny
    from tether.inference.launch import start_vllm, vllm_command, vllm_env

    example = load_example()
    tokenizer = tiny.build_tokenizer(example["VOCAB"])
    models = [tiny.save(tiny.build_model(tokenizer, seed=s), tokenizer, tmp_path / f"m{s}") for s in (0, 1)]
    port = free_port()
    cmd = vllm_command(
        str(python), str(models[0]), "tiny", "127.0.0.1", port, 256,
        extra=["--weight-transfer-config", '{"backend": "nccl"}'],
    )  # fmt: skip
    proc = start_vllm(cmd, vllm_env(), tmp_path / "vllm.log")
    try:
        c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM did not come up"
            try:
                if c.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "what is 2 + 3"}], "max_tokens": 8}
        assert c.post("/v1/chat/completions", json=chat).status_code == 200
        with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as resp:
            assert resp.status_code == 200
            for _ in resp.iter_lines():
                pass
        before = _vllm_families(c.get("/metrics").text)
        steps = [
            ("/sleep", {"params": {"level": 1, "mode": "wait"}}),
            ("/wake_up", {}),
            ("/pause", {"params": {"mode": "keep"}}),
            ("/collective_rpc", {"json": {"method": "reload_weights", "kwargs": {"weights_path": str(models[1])}}}),
            ("/update_weight_version", {"json": {"new_version": "1"}}),
            ("/resume", {}),
            ("/start_weight_update", {}),
            ("/finish_weight_update", {"json": {"weight_version": "2"}}),
        ]  # fmt: skip
        for path, kw in steps:
            resp = c.post(path, **kw)
            assert resp.status_code == 200, (path, resp.text)
        assert c.get("/weight_info").json()["weight_version"] == "2"
        text = c.get("/metrics").text
        after = _vllm_families(text)
    finally:
        proc.terminate()
        proc.wait(60)

    table = documented_vllm()
    assert set(after) == set(table), (sorted(set(after) - set(table)), sorted(set(table) - set(after)))
    for name, (type_, labels) in table.items():
        assert after[name][0] == type_, name
        has, _, lacks = labels.partition("(no ")
        assert set(_names(has)) <= after[name][1], (name, after[name][1])
        assert not set(_names(lacks)) & after[name][1], (name, after[name][1])
        if not lacks and name != "vllm:cache_config_info":
            assert {"model_name", "engine"} <= after[name][1], name
    # Only after their operation: the sleep and weight-transfer families.
    late = {n for n in after if n.startswith(("vllm:sleep_mode_", "vllm:rl_weight_update_"))}
    assert late and not late & set(before)
    assert 'sleep_state="awake"} 1.0' in text
