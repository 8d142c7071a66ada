"""The gateway's Prometheus metrics, in one place (served on GET /metrics).

Label children are cached: `labels()` takes a lock and hashes its arguments on every call, and the
call path touches several metrics per call.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter("tether_gateway_requests_total", "HTTP requests", ["route", "status", "replica"])
LATENCY = Histogram(
    "tether_gateway_request_latency_seconds",
    "HTTP request latency (to the last byte sent)",
    ["route"],
    buckets=_LATENCY_BUCKETS,
)
# route: the template (the call routes', FastAPI's, or "unmatched"), never a raw path: bounded labels.
ERRORS = Counter("tether_gateway_errors_total", "Error answers", ["route", "status", "code"])
UPSTREAM_LATENCY = Histogram(
    "tether_gateway_upstream_latency_seconds",
    "Time vLLM took to answer a call",
    ["replica"],
    buckets=_LATENCY_BUCKETS,
)
# run: the run whose rollout made the call ("" for the base namespace's: Prometheus stores it unlabelled).
PROMPT_TOKENS = Counter(
    "tether_gateway_prompt_tokens_total", "Prompt tokens of recorded calls", ["replica", "run"]
)
COMPLETION_TOKENS = Counter(
    "tether_gateway_completion_tokens_total", "Generated tokens of recorded calls", ["replica", "run"]
)
TRACES = Counter("tether_gateway_traces_total", "Calls recorded", ["status", "kind", "run"])
UPSTREAM_ERRORS = Counter(
    "tether_gateway_upstream_errors_total", "Failed exchanges with vLLM", ["replica", "kind"]
)
RETRIES = Counter(
    "tether_gateway_retries_total", "Calls sent again after an upstream 5xx or timeout", ["replica", "reason"]
)
FAILOVERS = Counter(
    "tether_gateway_failovers_total", "Calls moved to another replica after a connect failure", ["replica"]
)
# limit: request_bytes | concurrency | tokens_per_minute; key_kind: rollout | deployment (never the key).
QUOTA_REFUSALS = Counter(
    "tether_gateway_quota_refusals_total", "Calls refused by a per-key limit", ["limit", "key_kind"]
)
IN_FLIGHT = Gauge("tether_gateway_in_flight", "Calls admitted and not yet recorded")
REPLICA_IN_FLIGHT = Gauge("tether_gateway_replica_in_flight", "Calls in flight per vLLM replica", ["replica"])
REPLICA_HEALTHY = Gauge("tether_gateway_replica_healthy", "1 while a vLLM replica takes calls", ["replica"])
REPLICAS = Gauge(
    "tether_gateway_replicas",
    "vLLM replicas by state: up, down (routed), joining (discovered, not checked yet), draining",
    ["state"],
)
# Sharing vLLM among runs (share.py): a run's calls in flight and waiting for its turn.
RUN_CALLS_IN_FLIGHT = Gauge(
    "tether_gateway_run_calls_in_flight", "A run's model calls past the run share, not yet ended", ["run"]
)
RUN_REPLICAS = Gauge(
    "tether_gateway_run_replicas",
    "Inference replicas serving a run's adapter, as its scheduler published them (replica discovery only)",
    ["run"],
)
RUN_CALLS_WAITING = Gauge(
    "tether_gateway_run_calls_waiting", "A run's model calls waiting for the run's turn at vLLM", ["run"]
)
RUN_SHARE_WAIT = Histogram(
    "tether_gateway_run_share_wait_seconds",
    "How long a run's call waited for its turn at vLLM",
    ["run"],
    buckets=_LATENCY_BUCKETS,
)
RUN_SHARE_REFUSED = Counter(
    "tether_gateway_run_share_refused_total",
    "A run's calls refused after waiting too long for a turn",
    ["run"],
)
PAUSED = Gauge("tether_gateway_admission_paused", "1 while admission is paused")
WEIGHT_VERSION = Gauge("tether_gateway_weight_version", "Weight version new calls are recorded with")

_children: dict[tuple[int, tuple[str, ...]], Any] = {}


def child(metric: Any, *labels: str) -> Any:
    key = (id(metric), labels)
    c = _children.get(key)
    if c is None:
        c = _children[key] = metric.labels(*labels)
    return c
