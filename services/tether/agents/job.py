"""One rollout's harness inside its Kubernetes Job (`tether agent-job`; the scheduler creates the Job,
tether.scheduler.kube.jobs). The agent worker's attempt without the worker: the rollout already exists,
its task, base URL and model are in the environment and its key comes from the Job's Secret; the
harness function is called as the worker calls it and its reward (or its failure) is reported with the
rollout's own key. The exit status tells the Job controller: 0 reported a reward, 1 did not.
"""

from __future__ import annotations

import json
import logging
import math
import time
import traceback
from collections.abc import Mapping

import httpx

from tether.agents.worker import HarnessFn, load_function
from tether.common import retry

log = logging.getLogger(__name__)

NEEDED = ("TETHER_TASK", "TETHER_BASE_URL", "TETHER_API_KEY", "TETHER_MODEL", "TETHER_AGENT_FN")


# The gateway could not take the report yet (a restarting Redis behind it): tried again, bounded.
RETRYABLE_STATUS = frozenset({502, 503, 504})
REPORT_TRIES = 6


def report(http: httpx.Client, gateway_url: str, rollout_id: str, outcome: str, body: dict) -> None:
    url = f"{gateway_url.rstrip('/')}/v1/rollouts/{rollout_id}/{outcome}"
    for attempt in range(REPORT_TRIES):
        try:
            resp = http.post(url, json=body)
            if resp.status_code not in RETRYABLE_STATUS or attempt == REPORT_TRIES - 1:
                resp.raise_for_status()
                return
        except httpx.ConnectError:
            if attempt == REPORT_TRIES - 1:
                raise
        time.sleep(retry.backoff(attempt, 0.5, 5.0))


def run(env: Mapping[str, str], fn: HarnessFn | None = None, http: httpx.Client | None = None) -> int:
    """Run the harness named by TETHER_AGENT_FN (or `fn`) once and report; the exit status."""
    missing = [n for n in NEEDED if not env.get(n) and not (n == "TETHER_AGENT_FN" and fn)]
    missing += [n for n in ("TETHER_GATEWAY_URL", "TETHER_ROLLOUT_ID") if not env.get(n)]
    if missing:
        log.error("agent-job: missing %s", ", ".join(missing))
        return 1
    key, rollout_id, gateway = env["TETHER_API_KEY"], env["TETHER_ROLLOUT_ID"], env["TETHER_GATEWAY_URL"]
    client = http or httpx.Client(timeout=60.0)
    client.headers["Authorization"] = f"Bearer {key}"
    try:
        try:
            harness = fn or load_function(env["TETHER_AGENT_FN"])
            reward = float(
                harness(json.loads(env["TETHER_TASK"]), env["TETHER_BASE_URL"], key, env["TETHER_MODEL"])
            )
            if not math.isfinite(reward):
                raise ValueError(f"harness returned a non-finite reward {reward}")
        except Exception as exc:
            reason = "".join(traceback.format_exception_only(exc)).strip()
            log.warning("rollout %s failed: %s", rollout_id, reason)
            report(client, gateway, rollout_id, "fail", {"reason": reason[:2000]})
            return 1
        report(client, gateway, rollout_id, "complete", {"reward": reward})
        return 0
    except httpx.HTTPError as exc:
        log.error("rollout %s: could not report to the gateway: %r", rollout_id, exc)
        return 1
    finally:
        if http is None:
            client.close()
