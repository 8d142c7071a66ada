{{/*
The inference and trainer containers, written once: their own pods (inference.yaml, trainer.yaml) and
the colocated pod (colocated.yaml, gpuSharing.mode pod) render the same container.
*/}}

{{- define "tether.checkpointClaim" -}}
{{- default (printf "%s-checkpoints" (include "tether.fullname" .)) .Values.checkpoints.existingClaim -}}
{{- end -}}

{{/* GPUs of a container: a device-plugin request, or the shared DRA claim. (dict "root" $ "gpus" n) */}}
{{- define "tether.gpuResources" -}}
{{- $root := .root -}}
{{- $res := deepCopy .resources -}}
{{- if and .gpu (gt (int .gpus) 0) -}}
{{- if or (eq (include "tether.sharedClaim" $root) "true") (eq (include "tether.colocatedPod" $root) "true") -}}
{{- $_ := set $res "claims" (list (dict "name" "gpu")) -}}
{{- else -}}
{{- $limits := deepCopy (default (dict) $res.limits) -}}
{{- $_ := set $limits $root.Values.gpuResourceName (int .gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- $requests := deepCopy (default (dict) $res.requests) -}}
{{- $_ := set $requests $root.Values.gpuResourceName (int .gpus) -}}
{{- $_ := set $res "requests" $requests -}}
{{- end -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* The pod's reference to its GPU claim (shared ResourceClaim, or the colocated pod's template). */}}
{{- define "tether.podResourceClaims" -}}
{{- if eq (include "tether.sharedClaim" .) "true" }}
resourceClaims:
  - name: gpu
    resourceClaimName: {{ include "tether.claimName" . }}
{{- else if eq (include "tether.colocatedPod" .) "true" }}
resourceClaims:
  - name: gpu
    resourceClaimTemplateName: {{ include "tether.claimName" . }}
{{- end }}
{{- end -}}

{{/*
With a ReadWriteOnce checkpoint volume and checkpoints.sameNode, the pods that mount it follow the
trainer onto its node. Called as (dict "root" $ "values" .Values.inference).
*/}}
{{- define "tether.affinity" -}}
{{- $aff := deepCopy (default (dict) .values.affinity) -}}
{{- $root := .root -}}
{{- $modes := $root.Values.checkpoints.accessModes -}}
{{- if and $root.Values.checkpoints.sameNode (not (or (has "ReadWriteMany" $modes) (has "ReadOnlyMany" $modes))) -}}
{{- $pa := deepCopy (default (dict) $aff.podAffinity) -}}
{{- $terms := default (list) $pa.requiredDuringSchedulingIgnoredDuringExecution -}}
{{- $trainer := ternary "colocated" "trainer" (eq (include "tether.colocatedPod" $root) "true") -}}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (dict "app.kubernetes.io/instance" $root.Release.Name "app.kubernetes.io/component" $trainer)) -}}
{{- $_ := set $pa "requiredDuringSchedulingIgnoredDuringExecution" (append $terms $term) -}}
{{- $_ := set $aff "podAffinity" $pa -}}
{{- end -}}
{{- with $aff }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
vLLM flags the chart adds to the user's: the drain the grace period was sized for (vLLM's default
shutdown timeout, 0, aborts every in-flight request on SIGTERM), and path-2 weight pushes need vLLM's
NCCL transfer engine.
*/}}
{{- define "tether.vllmExtraArgs" -}}
{{- $args := list (printf "--shutdown-timeout %d" (int .Values.shutdown.drainSeconds)) -}}
{{- with .Values.inference.extraArgs -}}{{- $args = append $args . -}}{{- end -}}
{{- if eq .Values.run.weightPush "nccl" -}}
{{- $args = append $args "--weight-transfer-config '{\"backend\": \"nccl\"}'" -}}
{{- end -}}
{{- join " " $args -}}
{{- end -}}

{{/* The inference container: the control adapter, which starts vLLM beside it. */}}
{{- define "tether.inferenceContainer" -}}
{{- $c := .Values.inference -}}
{{- $gpu := eq $c.backend "gpu" -}}
- name: inference
  image: {{ include "tether.inferenceImage" . }}
  imagePullPolicy: {{ .Values.pullPolicy }}
  command: ["python", "-m", "tether.inference"]
  ports:
    - {name: http, containerPort: 8001, protocol: TCP}
    - {name: grpc, containerPort: 50052, protocol: TCP}
    - {name: metrics, containerPort: 9102, protocol: TCP}
  env:
    {{- include "tether.env" . | nindent 4 }}
    {{- include "tether.cacheEnv" . | nindent 4 }}
    - name: TETHER_INFERENCE_GRPC_HOST
      value: 0.0.0.0
    - name: TETHER_INFERENCE_GRPC_PORT
      value: "50052"
    - name: TETHER_VLLM_HOST
      value: 0.0.0.0
    - name: TETHER_VLLM_PORT
      value: "8001"
    - name: TETHER_MODEL_DIR
      value: {{ .Values.model.dir | quote }}
    - name: TETHER_SERVED_MODEL
      value: {{ .Values.run.servedModel | quote }}
    - name: TETHER_VLLM_LOG
      value: /dev/stdout
    - name: TETHER_METRICS_PORT
      value: "9102"
    # A restarted pod starts vLLM on the run's newest complete checkpoint, not the base model.
    - name: TETHER_CHECKPOINT_DIR
      value: /checkpoints
    {{- include "tether.runEnv" (dict "root" . "section" "inference" "key" "dtype" "value" ($c.dtype)) | nindent 4 }}
    {{- if $gpu }}
    - name: TETHER_TENSOR_PARALLEL_SIZE
      value: {{ $c.gpus | quote }}
    {{- include "tether.runEnv" (dict "root" . "section" "inference" "key" "gpu_memory_utilization" "value" ($c.gpuMemoryUtilization)) | nindent 4 }}
    {{- else }}
    - name: VLLM_CPU_KVCACHE_SPACE
      value: {{ $c.cpuKvCacheSpaceGiB | quote }}
    {{- end }}
    {{- if gt (int $c.maxModelLen) 0 }}
    - name: TETHER_MAX_MODEL_LEN
      value: {{ $c.maxModelLen | quote }}
    {{- end }}
    {{- with include "tether.vllmExtraArgs" . }}
    - name: TETHER_VLLM_EXTRA_ARGS
      value: {{ . | quote }}
    {{- end }}
    {{- if .Values.runs.enabled }}
    # Runs side by side (runs.enabled): vLLM serves up to maxRuns LoRA adapters of rank loraRank.
    - name: TETHER_MAX_RUNS
      value: {{ .Values.runs.maxRuns | quote }}
    - name: TETHER_LORA_RANK
      value: {{ .Values.runs.loraRank | quote }}
    {{- end }}
    {{- with $c.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  # vLLM's /v1/models answers once the model is servable; /health stays 200 while vLLM sleeps, while
  # admission is paused and while weights are pushed (only a dead engine fails it). The adapter's gRPC
  # health is not probed: it says NOT_SERVING during a weight load, which must not restart the pod.
  startupProbe:
    httpGet: {path: /v1/models, port: http}
    periodSeconds: 10
    timeoutSeconds: 5
    failureThreshold: {{ div (add (int .Values.maxLoadSeconds) 9) 10 }}
  readinessProbe:
    httpGet: {path: /v1/models, port: http}
    periodSeconds: 10
    timeoutSeconds: 5
    failureThreshold: 3
  livenessProbe:
    httpGet: {path: /health, port: http}
    periodSeconds: 10
    timeoutSeconds: 10
    failureThreshold: 6
  {{- include "tether.lifecycle" . | nindent 2 }}
  securityContext:
    {{- include "tether.securityContext" (dict "root" . "writableRoot" (and $gpu $c.securityContext.allowWritableRootForGpuHooks)) | nindent 4 }}
  resources:
    {{- include "tether.gpuResources" (dict "root" . "resources" $c.resources "gpu" $gpu "gpus" $c.gpus) | nindent 4 }}
  volumeMounts:
    {{- include "tether.cacheMounts" . | nindent 4 }}
    - name: dshm
      mountPath: /dev/shm
    - name: checkpoints
      mountPath: /checkpoints
      readOnly: true
    {{- include "tether.modelMount" . | nindent 4 }}
{{- end -}}

{{/*
The trainer's command. One process: python -m tether.trainer. Several GPUs on one node: torchrun
--standalone. Several nodes: torchrun with c10d rendezvous at rank 0's stable name; is_host set from the
pod index (c10d's own test compares hostnames, which fails on Kubernetes). --local-addr is the pod's
stable name behind the headless Service, not $(POD_IP): c10d numbers the nodes in the sorted order of
these addresses, and rank 0 (which serves gRPC) must be pod 0, the address the scheduler and merger
use; IPs sort in any order (docs/kubernetes.md). Called as (dict "root" $ "colocated" bool).
*/}}
{{- define "tether.trainerCommand" -}}
{{- $root := .root -}}
{{- $t := $root.Values.trainer -}}
{{- $full := include "tether.fullname" $root -}}
{{- $procs := ternary (int $t.gpusPerNode) 1 (eq $t.backend "gpu") -}}
{{- if gt (int $t.nodes) 1 -}}
{{- $rank0 := include "tether.trainerHost" $root -}}
{{- $local := printf "$(TETHER_POD_HOST).%s-trainer" $full -}}
command:
  - /bin/sh
  - -c
  - >-
    if [ "$(TETHER_NODE_INDEX)" = "0" ]; then is_host=1; else is_host=0; fi;
    exec torchrun
    --nnodes={{ $t.nodes }}
    --nproc-per-node={{ $procs }}
    --rdzv-backend=c10d
    --rdzv-endpoint={{ $rank0 }}:{{ $t.rdzv.port }}
    --rdzv-id={{ $root.Values.run.id }}
    --rdzv-conf=is_host=${is_host},join_timeout={{ $t.rdzv.timeoutSeconds }}
    --local-addr={{ $local }}
    --max-restarts={{ $t.rdzv.maxRestarts }}
    -m tether.trainer
{{- else if gt (int $procs) 1 -}}
command: ["torchrun", "--standalone", "--nnodes=1", "--nproc-per-node={{ $procs }}", "--max-restarts={{ $t.rdzv.maxRestarts }}", "-m", "tether.trainer"]
{{- else -}}
command: ["python", "-m", "tether.trainer"]
{{- end -}}
{{- end -}}

{{/* The pod index that makes the rank: each workload labels its pods with it. */}}
{{- define "tether.nodeIndexField" -}}
{{- if eq .Values.trainer.workload "statefulset" -}}
metadata.labels['apps.kubernetes.io/pod-index']
{{- else -}}
metadata.labels['batch.kubernetes.io/job-completion-index']
{{- end -}}
{{- end -}}

{{/* The trainer container. Called as (dict "root" $ "colocated" bool). */}}
{{- define "tether.trainerContainer" -}}
{{- $root := .root -}}
{{- $t := $root.Values.trainer -}}
{{- $gpu := eq $t.backend "gpu" -}}
{{- $full := include "tether.fullname" $root -}}
- name: trainer
  image: {{ include "tether.trainerImage" $root }}
  imagePullPolicy: {{ $root.Values.pullPolicy }}
  {{- include "tether.trainerCommand" . | nindent 2 }}
  {{- /* In the colocated pod the inference container holds the names grpc and metrics. */}}
  {{- $p := ternary "trainer-" "" (default false .colocated) }}
  ports:
    - {name: {{ $p }}grpc, containerPort: 50053, protocol: TCP}
    {{- if $root.Values.tls.existingSecret }}
    {{- include "tether.healthContainerPort" (dict "root" $root "port" 50053 "prefix" $p) | nindent 4 }}
    {{- end }}
    - {name: {{ $p }}metrics, containerPort: 9103, protocol: TCP}
    - {name: rdzv, containerPort: {{ $t.rdzv.port }}, protocol: TCP}
  env:
    {{- include "tether.env" $root | nindent 4 }}
    {{- include "tether.cacheEnv" $root | nindent 4 }}
    {{- if $root.Values.tls.existingSecret }}
    {{- include "tether.healthPortEnv" (dict "root" $root "port" 50053) | nindent 4 }}
    {{- end }}
    {{- /* SIGTERM: the step in hand may run to its end for the trainer's grace less preStop and margin. */}}
    - name: TETHER_DRAIN_S
      value: {{ sub (int $t.terminationGracePeriodSeconds) (add (int $root.Values.shutdown.preStopSeconds) (int $root.Values.shutdown.marginSeconds)) | quote }}
    - name: POD_IP
      valueFrom: {fieldRef: {fieldPath: status.podIP}}
    - name: TETHER_NODE_INDEX
      valueFrom: {fieldRef: {fieldPath: {{ include "tether.nodeIndexField" $root | quote }}}}
    # The pod's hostname under the headless Service: the pod's name for a StatefulSet, <job>-<index>
    # for an Indexed Job, <jobset>-rank-0-<index> for a JobSet (their pod names carry a random suffix).
    - name: TETHER_POD_HOST
    {{- if eq $t.workload "statefulset" }}
      valueFrom: {fieldRef: {fieldPath: metadata.name}}
    {{- else if eq $t.workload "indexedJob" }}
      value: {{ printf "%s-trainer-$(TETHER_NODE_INDEX)" $full | quote }}
    {{- else }}
      value: {{ printf "%s-trainer-rank-0-$(TETHER_NODE_INDEX)" $full | quote }}
    {{- end }}
    - name: TETHER_TRAINER_GRPC_HOST
      value: 0.0.0.0
    - name: TETHER_TRAINER_GRPC_PORT
      value: "50053"
    - name: TETHER_MODEL_DIR
      value: {{ $root.Values.model.dir | quote }}
    - name: TETHER_CHECKPOINT_DIR
      value: /checkpoints
    {{- include "tether.runEnv" (dict "root" $root "section" "trainer" "key" "checkpoint_keep" "value" ($t.checkpointKeep)) | nindent 4 }}
    {{- include "tether.runEnv" (dict "root" $root "section" "trainer" "key" "lr" "value" ($t.lr | toString)) | nindent 4 }}
    {{- include "tether.runEnv" (dict "root" $root "section" "trainer" "key" "seed" "value" ($root.Values.run.seed)) | nindent 4 }}
    - name: TETHER_METRICS_PORT
      value: "9103"
    - name: TETHER_DEVICE
      value: {{ ternary "cuda" "cpu" $gpu }}
    {{- include "tether.runEnv" (dict "root" $root "section" "trainer" "key" "micro_batch_tokens" "value" ($t.microBatchTokens)) | nindent 4 }}
    - name: TETHER_FSDP
      value: {{ $t.fsdp | quote }}
    {{- include "tether.runEnv" (dict "root" $root "section" "trainer" "key" "bf16" "value" ($t.bf16)) | nindent 4 }}
    {{- include "tether.runEnv" (dict "root" $root "section" "trainer" "key" "gradient_checkpointing" "value" ($t.gradientCheckpointing)) | nindent 4 }}
    {{- if $root.Values.runs.enabled }}
    # Runs side by side: each run's adapter has the rank vLLM serves (the run config may not say otherwise).
    - name: TETHER_LORA_RANK
      value: {{ $root.Values.runs.loraRank | quote }}
    - name: TETHER_RUN_SHARING
      value: {{ $root.Values.runs.sharing | quote }}
    {{- else }}
    {{- include "tether.runEnv" (dict "root" $root "section" "trainer" "key" "lora_rank" "value" ($t.loraRank)) | nindent 4 }}
    {{- end }}
    {{- include "tether.runEnv" (dict "root" $root "section" "trainer" "key" "kl_coef" "value" ($t.klCoef | toString)) | nindent 4 }}
    - name: TETHER_WEIGHT_PUSH
      value: {{ $root.Values.run.weightPush | quote }}
    {{- if eq $root.Values.run.weightPush "nccl" }}
    - name: TETHER_VLLM_URL
      value: {{ printf "http://%s:8001" (include "tether.inferenceHost" $root) | quote }}
    - name: TETHER_WEIGHT_PUSH_MASTER_ADDRESS
      value: $(POD_IP)
    {{- end }}
    {{- if $gpu }}
    - name: NCCL_SOCKET_IFNAME
      value: {{ $t.nccl.socketIfname | quote }}
    - name: TORCH_NCCL_ASYNC_ERROR_HANDLING
      value: {{ $t.nccl.asyncErrorHandling | quote }}
    - name: TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC
      value: {{ $t.nccl.heartbeatTimeoutSeconds | quote }}
    {{- with $t.nccl.debug }}
    - name: NCCL_DEBUG
      value: {{ . | quote }}
    {{- end }}
    {{- if $t.nccl.ibDisable }}
    - name: NCCL_IB_DISABLE
      value: "1"
    {{- end }}
    {{- end }}
    - name: GLOO_SOCKET_IFNAME
      value: {{ $t.nccl.socketIfname | quote }}
    {{- with $t.nccl.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- with $t.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  # gRPC health: NOT_SERVING only when the trainer can no longer train. With several nodes only pod 0
  # (rank 0) serves gRPC; the other pods' probes pass while torchrun runs (it ends the container when
  # a rank fails, and the scheduler's gang restart restarts every rank).
  {{- $probe := dict "grpc" (dict "port" (int (include "tether.probePort" (dict "root" $root "port" 50053)))) }}
  {{- if gt (int $t.nodes) 1 }}
  {{- $probe = dict "exec" (dict "command" (list "/bin/sh" "-c" "[ \"$TETHER_NODE_INDEX\" != 0 ] || exec tether health --grpc 127.0.0.1:50053")) }}
  {{- end }}
  startupProbe:
    {{- toYaml $probe | nindent 4 }}
    periodSeconds: 10
    timeoutSeconds: 5
    failureThreshold: {{ div (add (int $root.Values.maxLoadSeconds) 9) 10 }}
  livenessProbe:
    {{- toYaml $probe | nindent 4 }}
    periodSeconds: 10
    timeoutSeconds: 5
    failureThreshold: 6
  readinessProbe:
    {{- toYaml $probe | nindent 4 }}
    periodSeconds: 10
    timeoutSeconds: 5
    failureThreshold: 3
  {{- include "tether.lifecycle" $root | nindent 2 }}
  securityContext:
    {{- include "tether.securityContext" (dict "root" $root) | nindent 4 }}
  resources:
    {{- include "tether.gpuResources" (dict "root" $root "resources" $t.resources "gpu" $gpu "gpus" $t.gpusPerNode) | nindent 4 }}
  volumeMounts:
    {{- include "tether.cacheMounts" $root | nindent 4 }}
    - name: dshm
      mountPath: /dev/shm
    - name: checkpoints
      mountPath: /checkpoints
    {{- include "tether.modelMount" $root | nindent 4 }}
{{- end -}}

{{/* The volumes of a pod running the trainer (and, colocated, inference). */}}
{{- define "tether.trainerVolumes" -}}
{{ include "tether.cacheVolumes" . }}
{{ include "tether.shmVolume" (dict "size" .Values.trainer.shmSizeLimit) }}
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ include "tether.checkpointClaim" . }}
{{- include "tether.modelVolume" . }}
{{- end -}}

{{/* The trainer's pod template. Called as (dict "root" $ "restartPolicy" "Always"). */}}
{{- define "tether.trainerPod" -}}
{{- $root := .root -}}
{{- $t := $root.Values.trainer -}}
metadata:
  labels:
    {{- include "tether.labels" (dict "root" $root "component" "trainer") | nindent 4 }}
  {{- include "tether.podAnnotations" (dict "root" $root "values" $t) | nindent 2 }}
spec:
  serviceAccountName: {{ include "tether.fullname" $root }}
  {{- include "tether.podCommon" $root | nindent 2 }}
  {{- if ne $t.workload "statefulset" }}
  subdomain: {{ include "tether.fullname" $root }}-trainer
  {{- end }}
  restartPolicy: {{ .restartPolicy }}
  terminationGracePeriodSeconds: {{ $t.terminationGracePeriodSeconds }}
  {{- include "tether.scheduling" $t | nindent 2 }}
  {{- include "tether.podResourceClaims" $root | nindent 2 }}
  {{- with include "tether.modelInit" $root }}
  initContainers:
    {{- . | nindent 4 }}
  {{- end }}
  containers:
    {{- include "tether.trainerContainer" (dict "root" $root) | nindent 4 }}
  volumes:
    {{- include "tether.trainerVolumes" $root | nindent 4 }}
{{- end -}}
