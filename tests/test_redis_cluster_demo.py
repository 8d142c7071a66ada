"""A whole `tether demo --config FILE` whose Redis is a 3-master Redis Cluster (REDIS_URL=
redis+cluster://...): every service (gateway, merger, scheduler, agent worker, the CLI) talks to the
cluster, the traces land in partitions on more than one master, the samples trained are vLLM's tokens,
and the run's shape is the run config's (read by every service, no flag given)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import redis
from redis_cluster import LocalRedisCluster
from stack_helpers import TETHER, assert_samples_are_vllm_tokens, jsonl, tether_jsonl

from tether.common.broker import Keys

pytestmark = pytest.mark.slow


def test_a_demo_runs_from_a_run_config_on_a_redis_cluster(tmp_path):
    with LocalRedisCluster(tmp_path / "cluster") as cluster:
        run_dir = tmp_path / "run"
        config = tmp_path / "run.yaml"
        config.write_text(
            "example: calculator\n"
            "scheduler: {steps: 2, tasks_per_step: 2, group_size: 4, eval_repeats: 0}\n"
            "gateway: {default_group_size: 4}\n"
            "agent: {agent_concurrency: 8}\n"
        )
        args = ["--config", str(config)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("TETHER_")}
        proc = subprocess.run(
            [*TETHER, "demo", *args, "--run-dir", str(run_dir), "--quiet"],
            cwd=tmp_path,
            env={**env, "REDIS_URL": cluster.url},
            capture_output=True,
            text=True,
            timeout=1500,
        )
        if proc.returncode != 0:
            logs = "\n".join(
                f"--- {p.name}\n{p.read_text()[-2000:]}" for p in (run_dir / "logs").glob("*.log")
            )
            pytest.fail(
                f"demo failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}\n{logs}"
            )
        metrics = jsonl((run_dir / "metrics.jsonl").read_text())
        steps = [m for m in metrics if "step" in m]
        assert [m["step"] for m in steps] == [0, 1]
        assert [m["rollouts"] for m in steps] == [8.0, 8.0]  # the config's 2 tasks x 4, not the demo's 8 x 8
        assert [m["weight_version"] for m in metrics if m.get("samples")] == [1, 2]

        # Read back through the cluster (the stack state names it), not through an embedded Redis.
        traces, samples = tether_jsonl(tmp_path, "traces"), tether_jsonl(tmp_path, "samples")
        assert_samples_are_vllm_tokens(traces, samples)
        assert {s["rollout_id"] for s in samples} <= {t["rollout_id"] for t in traces}
        state = json.loads((tmp_path / ".tether" / "stack.json").read_text())
        assert state["redis_url"] == cluster.url
        keys = Keys(state.get("namespace", "tether"))
        holders = set()
        for stream in keys.trace_streams:
            node = redis.Redis(port=cluster.port_of_key(stream), decode_responses=True)
            try:
                if node.xlen(stream):
                    holders.add(cluster.port_of_key(stream))
            finally:
                node.close()
        assert len(holders) >= 2, "the traces should spread over the cluster's masters"
