"""The scheduler's Kubernetes settings (TETHER_KUBE_* and TETHER_AGENT_JOB*), as the chart renders them
(the scheduler Deployment of helm/tether; docs/scheduler-kubernetes.md lists them). Parsed and
checked once at start-up, so a bad value refuses the scheduler before it talks to the API server."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from tether.common.settings import CommonSettings

# What a container's `resources` may hold (core/v1 ResourceRequirements).
RESOURCE_KEYS = frozenset({"requests", "limits", "claims"})


class KubeSettings(CommonSettings):
    """Off unless TETHER_KUBE_ENABLED=true; each feature is on when its own setting names a target."""

    config_section: ClassVar[str | None] = "kube"

    kube_enabled: bool = False
    kube_namespace: str = ""  # the chart sets it from the downward API (metadata.namespace)
    kube_instance: str = ""  # the Helm release: app.kubernetes.io/instance of every object
    kube_inference_service: str = ""  # <fullname>-inference; empty: no discovery
    kube_trainer_selector: str = ""  # label selector of the trainer pods; empty: no gang restart

    agent_jobs: bool = False
    agent_job_image: str = ""
    agent_job_command: list[str] = Field(default_factory=list)  # JSON list; empty: the image's entrypoint
    agent_job_args: list[str] = Field(default_factory=list)
    agent_job_qps: float = Field(5.0, gt=0)
    agent_job_burst: int = Field(10, ge=1)
    agent_job_max_concurrent: int = Field(64, ge=1)
    agent_job_ttl_s: int = Field(600, ge=0)
    agent_job_deadline_s: int = Field(1800, ge=1)
    agent_job_resources: dict[str, Any] = Field(default_factory=dict)  # JSON ResourceRequirements
    agent_job_gateway_url: str = ""  # http://<fullname>-gateway:8000: rollouts are created there
    # Names of the Secrets the Jobs' pods pull their image with (JSON list; the chart's imagePullSecrets).
    agent_job_image_pull_secrets: list[str] = Field(default_factory=list)
    # The harness the Job's `tether agent-job` runs (MODULE:FN); empty: the image's own TETHER_AGENT_FN.
    agent_fn: str = ""
    admin_token: str = ""  # the gateway's admin token: creating, reading and failing rollouts

    @field_validator("agent_job_resources")
    @classmethod
    def _resources(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = set(v) - RESOURCE_KEYS
        if unknown:
            raise ValueError(
                f"unknown keys {sorted(unknown)}; a container's resources hold {sorted(RESOURCE_KEYS)}"
            )
        return v

    @model_validator(mode="after")
    def _consistent(self) -> KubeSettings:
        if not self.kube_enabled:
            if self.agent_jobs:
                raise ValueError("TETHER_AGENT_JOBS=true needs TETHER_KUBE_ENABLED=true")
            return self
        missing = [n for n in ("kube_namespace", "kube_instance") if not getattr(self, n)]
        if self.agent_jobs:
            missing += [n for n in ("agent_job_image", "agent_job_gateway_url") if not getattr(self, n)]
        if missing:
            raise ValueError(
                "needed with TETHER_KUBE_ENABLED=true: " + ", ".join(f"TETHER_{n.upper()}" for n in missing)
            )
        return self
