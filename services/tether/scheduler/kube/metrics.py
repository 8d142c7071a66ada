"""The scheduler's Kubernetes metrics (tether_kube_*); docs/metrics.md lists them."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

JOBS_CREATED = Counter(
    "tether_kube_jobs_created", "Agent Jobs the scheduler created (one per rollout attempt)"
)
JOBS_FAILED = Counter(
    "tether_kube_jobs_failed",
    "Agent Jobs whose rollout attempt failed, by reason (the Job condition's reason, NotReported, ...)",
    ["reason"],
)
JOBS_ACTIVE = Gauge("tether_kube_jobs_active", "Agent Jobs created and not yet finished")
REPLICAS = Gauge("tether_kube_replicas_discovered", "Ready inference replicas in the EndpointSlices")
GANG_RESTARTS = Counter(
    "tether_kube_gang_restarts", "Trainer gang restarts (one rank restarted, the others deleted)"
)
API_ERRORS = Counter(
    "tether_kube_api_errors", "Kubernetes API calls that failed, by resource and verb", ["resource", "verb"]
)
