{{/*
Names, labels and the pieces every pod template shares. The fixed interface (BRIEF): tether.fullname,
tether.labels and tether.selectorLabels, the latter two called as (dict "root" $ "component" "gateway").
*/}}

{{/* The release name if it already says "tether", else <release>-tether; 63 characters at most. */}}
{{- define "tether.fullname" -}}
{{- if contains "tether" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-tether" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* <fullname>-<component>, the name of a component's objects. Called as (dict "root" $ "component" "x"). */}}
{{- define "tether.componentName" -}}
{{- printf "%s-%s" (include "tether.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tether.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Exactly these three: selectors are immutable on upgrade, so nothing else may enter them. */}}
{{- define "tether.selectorLabels" -}}
app.kubernetes.io/name: tether
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tether.labels" -}}
{{ include "tether.selectorLabels" . }}
app.kubernetes.io/part-of: tether
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ include "tether.chart" .root }}
tether.dev/run: {{ .root.Values.run.id | quote }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels of the objects that belong to the release rather than to one component. */}}
{{- define "tether.releaseLabels" -}}
app.kubernetes.io/name: tether
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: tether
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ include "tether.chart" . }}
tether.dev/run: {{ .Values.run.id | quote }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
An image reference: repository@digest when a digest is given, else repository:tag, the tag defaulting
to the chart's appVersion (plus tagSuffix). Called as (dict "root" $ "image" .Values.images.tether).
*/}}
{{- define "tether.image" -}}
{{- $img := .image -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s%s" $img.repository (default .root.Chart.AppVersion $img.tag) (default "" $img.tagSuffix) -}}
{{- end -}}
{{- end -}}

{{/* The image of the inference pods and of the trainer pods, by backend. */}}
{{- define "tether.inferenceImage" -}}
{{- include "tether.image" (dict "root" . "image" (ternary .Values.images.inference .Values.images.inferenceCpu (eq .Values.inference.backend "gpu"))) -}}
{{- end -}}
{{- define "tether.trainerImage" -}}
{{- include "tether.image" (dict "root" . "image" (ternary .Values.images.trainerGpu .Values.images.trainer (eq .Values.trainer.backend "gpu"))) -}}
{{- end -}}

{{/* Service addresses every component uses (BRIEF: fixed names and ports). */}}
{{- define "tether.gatewayUrl" -}}
{{- printf "http://%s-gateway:8000" (include "tether.fullname" .) -}}
{{- end -}}
{{- define "tether.publicUrl" -}}
{{- default (printf "http://%s-gateway.%s:8000" (include "tether.fullname" .) .Release.Namespace) .Values.gateway.publicUrl -}}
{{- end -}}
{{- define "tether.inferenceHost" -}}
{{- printf "%s-inference" (include "tether.fullname" .) -}}
{{- end -}}
{{/* Rank 0 of the trainer (or the colocated pod) through the headless Service. */}}
{{- define "tether.trainerHost" -}}
{{- $full := include "tether.fullname" . -}}
{{- if eq (include "tether.colocatedPod" .) "true" -}}
{{- printf "%s-colocated-0.%s-trainer" $full $full -}}
{{- else if eq .Values.trainer.workload "statefulset" -}}
{{- printf "%s-trainer-0.%s-trainer" $full $full -}}
{{- else if eq .Values.trainer.workload "indexedJob" -}}
{{- printf "%s-trainer-0.%s-trainer" $full $full -}}
{{- else -}}
{{/* JobSet pods: <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain> */}}
{{- printf "%s-trainer-rank-0-0.%s-trainer" $full $full -}}
{{- end -}}
{{- end -}}

{{/* "true" when inference and trainer run as one pod (gpuSharing.mode pod on a GPU backend). */}}
{{- define "tether.colocatedPod" -}}
{{- and (eq .Values.gpuSharing.mode "pod") (eq .Values.inference.backend "gpu") | toString -}}
{{- end -}}
{{/* "true" when both pods reference one shared DRA ResourceClaim. */}}
{{- define "tether.sharedClaim" -}}
{{- and (eq .Values.gpuSharing.mode "dra") (eq .Values.inference.backend "gpu") | toString -}}
{{- end -}}
{{- define "tether.claimName" -}}
{{- printf "%s-gpu" (include "tether.fullname" .) -}}
{{- end -}}

{{/* The Secret holding the admin token and the in-chart Redis password. */}}
{{- define "tether.secretName" -}}
{{- default (printf "%s-secrets" (include "tether.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{/* Pod-level fields every Tether pod shares. Called with the root context. */}}
{{- define "tether.podCommon" -}}
{{- include "tether.podCommonToken" (dict "root" . "token" false) -}}
{{- end -}}

{{- /* The same, with the service account's token mounted when `token` (a pod that calls the API). */ -}}
{{- define "tether.podCommonToken" -}}
automountServiceAccountToken: {{ .token }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- end -}}

{{/* A component's scheduling fields. Called with the component's values. */}}
{{- define "tether.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- end -}}

{{/* Pod annotations: the chart's, the component's. Called as (dict "root" $ "values" .Values.gateway). */}}
{{- define "tether.podAnnotations" -}}
{{- $ann := merge (deepCopy (default (dict) .values.podAnnotations)) (deepCopy .root.Values.podAnnotations) -}}
{{- if .root.Values.runConfig -}}
{{- /* A changed run config rolls the pods (a mounted ConfigMap changes under a running process). */ -}}
{{- $_ := set $ann "checksum/run-config" (toYaml .root.Values.runConfig | sha256sum) -}}
{{- end -}}
{{- with $ann }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The container securityContext. Called as (dict "root" $ "writableRoot" false). */}}
{{- define "tether.securityContext" -}}
{{- $sc := deepCopy .root.Values.securityContext -}}
{{- if .writableRoot -}}
{{- $_ := set $sc "readOnlyRootFilesystem" false -}}
{{- end -}}
{{- toYaml $sc -}}
{{- end -}}

{{/* Environment every Tether container gets (compose's x-env): tether.baseEnv, the service token
and the mTLS files. */}}
{{- define "tether.env" -}}
{{ include "tether.baseEnv" . }}
{{- /* Every gRPC call between the services carries it (tether.common.grpc_server); health is exempt. */}}
- name: TETHER_SERVICE_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tether.secretName" . }}
      key: {{ .Values.secrets.serviceTokenKey }}
{{- if .Values.tls.existingSecret }}
{{- /* Mutual TLS between the services (tether.common.tls): the Secret mounted by tether.cacheMounts. */}}
- name: TETHER_TLS_CERT_FILE
  value: /etc/tether/tls/tls.crt
- name: TETHER_TLS_KEY_FILE
  value: /etc/tether/tls/tls.key
- name: TETHER_TLS_CA_FILE
  value: /etc/tether/tls/ca.crt
- name: TETHER_TLS_SERVER_NAME
  value: {{ .Values.tls.serverName | quote }}
{{- end }}
{{- end -}}

{{/* What a container that talks no gRPC gets too (compose's x-base-env: the ui). */}}
{{- define "tether.baseEnv" -}}
- name: TETHER_LOG_LEVEL
  value: {{ .Values.run.logLevel | quote }}
- name: PYTHONUNBUFFERED
  value: "1"
- name: OMP_NUM_THREADS
  value: "1"
- name: TOKENIZERS_PARALLELISM
  value: "false"
- name: HF_HUB_OFFLINE
  value: "1"
{{- if .Values.runConfig }}
{{- /* The run config (runConfig, a ConfigMap mounted at /config): each service reads its section. */}}
- name: TETHER_CONFIG
  value: /config/run.yaml
{{- end }}
{{- end -}}

{{/* With mTLS, the plaintext health-only port of a gRPC service on .port (its port + 100), which
kubelet's gRPC probes read (they cannot present a client certificate). (dict "root" $ "port" 50054) */}}
{{- define "tether.probePort" -}}
{{- if .root.Values.tls.existingSecret -}}{{ add (int .port) 100 }}{{- else -}}{{ .port }}{{- end -}}
{{- end -}}
{{- define "tether.healthContainerPort" -}}
- {name: {{ .prefix | default "" }}health, containerPort: {{ include "tether.probePort" . }}, protocol: TCP}
{{- end -}}
{{- define "tether.healthPortEnv" -}}
- name: TETHER_GRPC_HEALTH_PORT
  value: {{ include "tether.probePort" . | quote }}
{{- end -}}

{{/* The run's Redis (compose's x-redis-env): the URL from a Secret, never a literal. */}}
{{- define "tether.redisEnv" -}}
{{- if eq .Values.redis.mode "external" }}
- name: TETHER_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.urlKey }}
{{- else }}
- name: TETHER_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "tether.secretName" . }}
      key: {{ .Values.secrets.redisPasswordKey }}
- name: TETHER_REDIS_URL
  value: {{ printf "redis://:$(TETHER_REDIS_PASSWORD)@%s-redis:6379/0" (include "tether.fullname" .) | quote }}
{{- end }}
- name: TETHER_NAMESPACE
  value: {{ .Values.run.redisNamespace | quote }}
{{- end -}}

{{- define "tether.adminTokenEnv" -}}
- name: TETHER_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "tether.secretName" . }}
      key: {{ .Values.secrets.adminTokenKey }}
{{- end -}}

{{/* The writable paths of a read-only root: /tmp and /cache (HOME and every ML cache, docker/Dockerfile). */}}
{{- define "tether.cacheVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
- name: cache
  emptyDir:
    sizeLimit: {{ .Values.cacheSizeLimit }}
{{- if .Values.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ .Values.tls.existingSecret }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- if .Values.runConfig }}
- name: run-config
  configMap:
    name: {{ include "tether.fullname" . }}-run-config
{{- end }}
{{- end -}}
{{- define "tether.cacheMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- if .Values.tls.existingSecret }}
- name: tls
  mountPath: /etc/tether/tls
  readOnly: true
{{- end }}
{{- if .Values.runConfig }}
- name: run-config
  mountPath: /config
  readOnly: true
{{- end }}
{{- end -}}

{{/*
A run setting the chart sets from its values, unless the run config's section sets that key itself: the
run config wins over the chart's values, as over compose's defaults (docs/recipes.md, "Precedence").
Called as (dict "root" $ "section" "trainer" "key" "lr" "value" $t.lr).
*/}}
{{- define "tether.runEnv" -}}
{{- $section := index (default (dict) .root.Values.runConfig) .section | default (dict) -}}
{{- if not (hasKey $section .key) -}}
- name: {{ printf "TETHER_%s" (upper .key) }}
  value: {{ .value | toString | quote }}
{{- end -}}
{{- end -}}
{{/* The cache variables, set explicitly so an image without them still writes under /cache. */}}
{{- define "tether.cacheEnv" -}}
- name: HOME
  value: /cache
- name: XDG_CACHE_HOME
  value: /cache/xdg
- name: HF_HOME
  value: /cache/huggingface
- name: VLLM_CACHE_ROOT
  value: /cache/vllm
- name: TRITON_CACHE_DIR
  value: /cache/triton
- name: TORCHINDUCTOR_CACHE_DIR
  value: /cache/inductor
{{- end -}}

{{/* /dev/shm as a memory emptyDir (every GPU pod; vLLM's engine on CPU too). Called as (dict "size" x). */}}
{{- define "tether.shmVolume" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .size }}
{{- end -}}

{{/* The model volume (none when the model is baked into the image). */}}
{{- define "tether.modelVolume" -}}
{{- if eq .Values.model.source "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .Values.model.source "download" }}
- name: models
  emptyDir:
    sizeLimit: {{ .Values.model.download.sizeLimit }}
{{- end }}
{{- with .Values.model.download.tokenSecret.name }}
{{- if eq $.Values.model.source "download" }}
- name: hf-token
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:
      - key: {{ $.Values.model.download.tokenSecret.key }}
        path: token
{{- end }}
{{- end }}
{{- end -}}
{{- define "tether.modelMount" -}}
{{- if eq .Values.model.source "pvc" }}
- name: models
  mountPath: /models
  readOnly: true
  {{- with .Values.model.pvc.subPath }}
  subPath: {{ . }}
  {{- end }}
{{- else if eq .Values.model.source "download" }}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}
{{- end -}}

{{/* The init container that downloads (or prepares) the model into the pod's /models emptyDir. */}}
{{- define "tether.modelInit" -}}
{{- if eq .Values.model.source "download" }}
{{- $d := .Values.model.download }}
- name: model-download
  image: {{ include "tether.image" (dict "root" . "image" (index .Values.images $d.image)) }}
  imagePullPolicy: {{ .Values.pullPolicy }}
  {{- if $d.command }}
  command:
    {{- toYaml $d.command | nindent 4 }}
  {{- else }}
  command: ["tether", "prepare-demo", "--out", "/models/calculator", "--seed", {{ .Values.run.seed | quote }}]
  {{- end }}
  env:
    {{- include "tether.cacheEnv" . | nindent 4 }}
    - name: HF_HUB_OFFLINE
      value: "0"
    {{- if $d.tokenSecret.name }}
    - name: HF_TOKEN_PATH
      value: /var/run/secrets/tether/hf/token
    {{- end }}
  securityContext:
    {{- include "tether.securityContext" (dict "root" .) | nindent 4 }}
  resources:
    {{- toYaml $d.resources | nindent 4 }}
  volumeMounts:
    - name: models
      mountPath: /models
    {{- include "tether.cacheMounts" . | nindent 4 }}
    {{- if $d.tokenSecret.name }}
    - name: hf-token
      mountPath: /var/run/secrets/tether/hf
      readOnly: true
    {{- end }}
{{- end }}
{{- end -}}

{{/* A preStop that keeps serving while the endpoint removal reaches every client (exec sleep: the
sleep action is alpha on 1.29). */}}
{{- define "tether.lifecycle" -}}
lifecycle:
  preStop:
    exec:
      command: ["sleep", {{ .Values.shutdown.preStopSeconds | quote }}]
{{- end -}}

{{/* gRPC-native probes on a service's health (grpc.health.v1); with mTLS on its health-only port.
Called as (dict "root" $ "port" 50054). */}}
{{- define "tether.grpcProbes" -}}
{{- $port := include "tether.probePort" . -}}
startupProbe:
  grpc: {port: {{ $port }}}
  periodSeconds: 2
  timeoutSeconds: 5
  failureThreshold: 90
readinessProbe:
  grpc: {port: {{ $port }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
livenessProbe:
  grpc: {port: {{ $port }}}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
{{- end -}}

{{/* A NetworkPolicy peer: the release's pods of one component. (dict "root" $ "component" "x") */}}
{{- define "tether.peer" -}}
- podSelector:
    matchLabels:
      app.kubernetes.io/instance: {{ .root.Release.Name }}
      app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Prometheus scraping the given ports. (dict "root" $ "ports" (list 9102)) */}}
{{- define "tether.prometheusIngress" -}}
{{- $p := .root.Values.networkPolicy.prometheus -}}
- from:
    - namespaceSelector:
        {{- toYaml $p.namespaceSelector | nindent 8 }}
      podSelector:
        {{- toYaml $p.podSelector | nindent 8 }}
  ports:
    {{- range .ports }}
    - {protocol: TCP, port: {{ . }}}
    {{- end }}
{{- end -}}

{{/* The run's Redis: the in-chart StatefulSet, or the external one (networkPolicy.externalRedisEgress). */}}
{{- /* Egress to the Kubernetes API (the scheduler's controller; the run host's runs' replica discovery). */ -}}
{{- define "tether.kubeApiEgress" -}}
{{- $np := .Values.networkPolicy -}}
- ports:
    {{- range $np.kubeApi.ports }}
    - {protocol: TCP, port: {{ . }}}
    {{- end }}
  {{- with $np.kubeApi.cidrs }}
  to:
    {{- range . }}
    - ipBlock: {cidr: {{ . }}}
    {{- end }}
  {{- end }}
{{- end }}

{{- /* Whether the runs' schedulers (in the run host) discover the inference replicas: whenever the
gateway routes by discovered sets (it then routes a run's calls by the set its scheduler publishes). */ -}}
{{- define "tether.runsDiscover" -}}
{{- and .Values.runs.enabled .Values.scheduler.kubernetes.enabled .Values.scheduler.kubernetes.discovery -}}
{{- end }}

{{- define "tether.redisEgress" -}}
{{- if eq .Values.redis.mode "internal" -}}
- to:
    {{- include "tether.peer" (dict "root" . "component" "redis") | nindent 4 }}
  ports:
    - {protocol: TCP, port: 6379}
{{- else -}}
{{- with .Values.networkPolicy.externalRedisEgress }}
{{- toYaml . }}
{{- else -}}
- ports:
    - {protocol: TCP, port: 6379}
{{- end }}
{{- end -}}
{{- end -}}

{{/* The model download's egress (model.source download: the init container fetches the model). */}}
{{- define "tether.downloadEgress" -}}
{{- if eq .Values.model.source "download" -}}
{{- with .Values.networkPolicy.modelDownloadEgress }}
{{- toYaml . }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* The names in imagePullSecrets, as a JSON list (the scheduler gives its agent Jobs the same ones). */}}
{{- define "tether.pullSecretNames" -}}
{{- $names := list -}}
{{- range .Values.imagePullSecrets -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- toJson $names -}}
{{- end -}}
