"""The scheduler as a Kubernetes controller (the official `kubernetes` client, least privilege).

Three features, each on when its setting names a target (tether.scheduler.kube.settings):
- discovery (TETHER_KUBE_INFERENCE_SERVICE): inference replicas from the Service's EndpointSlices,
  handed to `on_replicas` (tether.scheduler.kube.discovery);
- agent Jobs (TETHER_AGENT_JOBS): each dispatched rollout's harness as a Job (tether.scheduler.kube.jobs);
- gang restart (TETHER_KUBE_TRAINER_SELECTOR): one trainer rank restarted, all restart
  (tether.scheduler.kube.gang).

The scheduler's main calls `start` and runs the coroutines it returns beside its own work. The Role in
helm/tether/templates/scheduler-rbac.yaml grants exactly the calls these make
(tests/test_kube_rbac.py holds the two to each other).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from tether.common.broker import Keys
from tether.scheduler.kube import metrics as metrics  # registered with the scheduler's process
from tether.scheduler.kube.client import KubeApi
from tether.scheduler.kube.discovery import OnReplicas, discover, publisher
from tether.scheduler.kube.settings import KubeSettings

__all__ = ["KubeSettings", "job_template", "start"]


def start(
    s: KubeSettings,
    r: Any,
    keys: Keys,
    run_id: str,
    on_replicas: OnReplicas | None = None,
    api: KubeApi | None = None,
) -> list[Coroutine[Any, Any, None]]:
    """The background coroutines of the features `s` turns on (none when Kubernetes is off).
    `on_replicas`: the scheduler passes its inference fleet's `update` (new replicas are brought to the
    run's weights before they are published to the gateway); without it each discovered list is
    published as is. `api` defaults to the pod's service account."""
    if not s.kube_enabled:
        return []
    from tether.scheduler.kube import client, gang, jobs

    api = api or client.load()
    out: list[Coroutine[Any, Any, None]] = []
    if s.kube_inference_service:
        out.append(
            discover(api, s.kube_namespace, s.kube_inference_service, on_replicas or publisher(r, keys))
        )
    if s.agent_jobs:
        template = job_template(s, run_id)
        dispatcher = jobs.JobDispatcher(
            r,
            keys,
            api,
            s.kube_namespace,
            template,
            jobs.Gateway(s.agent_job_gateway_url, s.admin_token),
            jobs.TokenBucket(s.agent_job_qps, s.agent_job_burst),
            s.agent_job_max_concurrent,
        )
        out.append(dispatcher.run())
    if s.kube_trainer_selector:
        out.append(gang.GangRestart(api, s.kube_namespace, s.kube_trainer_selector).run())
    return out


def job_template(s: KubeSettings, run_id: str) -> Any:
    """What every agent Job of this deployment shares, from the scheduler's settings (a
    tether.scheduler.kube.jobs.JobTemplate)."""
    from tether.scheduler.kube import jobs

    return jobs.JobTemplate(
        instance=s.kube_instance,
        run_id=run_id,
        image=s.agent_job_image,
        gateway_url=s.agent_job_gateway_url,
        command=s.agent_job_command,
        args=s.agent_job_args,
        resources=s.agent_job_resources,
        ttl_s=s.agent_job_ttl_s,
        deadline_s=s.agent_job_deadline_s,
        agent_fn=s.agent_fn,
        image_pull_secrets=s.agent_job_image_pull_secrets,
    )
