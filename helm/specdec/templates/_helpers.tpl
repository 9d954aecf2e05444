{{/* Names. Component names keep the full name under 40 characters so that StatefulSet pod names
and their controller-revision-hash labels stay within 63. */}}
{{- define "specdec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specdec.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* (dict "ctx" $ "component" "target") */}}
{{- define "specdec.componentName" -}}
{{- printf "%s-%s" (include "specdec.fullname" .ctx | trunc 40 | trimSuffix "-") .component }}
{{- end }}

{{- define "specdec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels: (dict "ctx" $ "component" "target") */}}
{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specdec.labels" -}}
helm.sh/chart: {{ include "specdec.chart" .ctx }}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/part-of: specdec
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end }}

{{- define "specdec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specdec.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The specdec image: (dict "ctx" $ "image" .Values.target.image "gpu" true). A component's own
tag is used as is; otherwise the global tag (default: appVersion), plus the CUDA suffix on GPU. */}}
{{- define "specdec.image" -}}
{{- $global := .ctx.Values.image }}
{{- $repository := .image.repository | default $global.repository }}
{{- $tag := .image.tag }}
{{- if not $tag }}
{{- $tag = printf "%s%s" ($global.tag | default .ctx.Chart.AppVersion) (ternary $global.cudaTagSuffix "" .gpu) }}
{{- end }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}

{{/* Service addresses the coordinator dials. */}}
{{- /* dns:/// on a headless Service: the coordinator resolves every replica and routes sessions. */ -}}
{{- define "specdec.targetAddress" -}}
{{- printf "dns:///%s:%d" (include "specdec.componentName" (dict "ctx" . "component" "target")) (int .Values.target.port) }}
{{- end }}

{{- define "specdec.draftAddress" -}}
{{- if .Values.draft.enabled }}
{{- printf "dns:///%s:%d" (include "specdec.componentName" (dict "ctx" . "component" "draft")) (int .Values.draft.port) }}
{{- end }}
{{- end }}

{{- define "specdec.coordinatorAddress" -}}
{{- printf "%s:%d" (include "specdec.componentName" (dict "ctx" . "component" "coordinator")) (int .Values.coordinator.port) }}
{{- end }}

{{/* redis://[:$(REDIS_PASSWORD)@]host:port/db; $(REDIS_PASSWORD) is expanded by the kubelet from
the env var defined just before REDIS_URL. */}}
{{- define "specdec.redisUrl" -}}
{{- $r := .Values.redis }}
{{- $auth := ternary ":$(REDIS_PASSWORD)@" "" (ne $r.auth.existingSecret "") }}
{{- if eq $r.mode "external" }}
{{- printf "%s://%s%s:%d/%d" (ternary "rediss" "redis" $r.external.tls) $auth $r.external.host (int $r.external.port) (int $r.external.db) }}
{{- else }}
{{- printf "redis://%s%s:%d/0" $auth (include "specdec.componentName" (dict "ctx" . "component" "redis")) (int $r.bundled.port) }}
{{- end }}
{{- end }}

{{/* Env every specdec container gets: caches, log level, HF token. */}}
{{- define "specdec.commonEnv" -}}
- name: HOME
  value: /cache/home
- name: XDG_CACHE_HOME
  value: /cache
- name: HF_HOME
  value: /cache/huggingface
- name: SPECDEC_CACHE_DIR
  value: /cache/specdec
- name: SPECDEC_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
{{- if .Values.models.hfToken.existingSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.models.hfToken.existingSecret }}
      key: {{ .Values.models.hfToken.key }}
{{- end }}
{{- if .Values.monitoring.serviceMonitor.enabled }}
- name: SPECDEC_METRICS_PORT
  value: {{ .Values.metrics.port | quote }}
{{- end }}
{{- end }}

{{- define "specdec.modelVolumeMounts" -}}
- name: cache
  mountPath: /cache
- name: tmp
  mountPath: /tmp
{{- if ne .Values.models.volume.type "none" }}
- name: models
  mountPath: {{ .Values.models.volume.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "specdec.modelVolumes" -}}
{{- $m := .Values.models -}}
- name: cache
{{- if eq $m.cache.type "persistentVolumeClaim" }}
  persistentVolumeClaim:
    claimName: {{ $m.cache.claimName }}
{{- else }}
  emptyDir:
    sizeLimit: {{ $m.cache.sizeLimit }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- if eq $m.volume.type "persistentVolumeClaim" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ $m.volume.claimName }}
    readOnly: true
{{- else if eq $m.volume.type "hostPath" }}
- name: models
  hostPath:
    path: {{ $m.volume.hostPath }}
    type: Directory
{{- end }}
{{- end }}

{{/* Native gRPC probes on the service port: (dict "port" 50051 "probes" .Values.draft.probes) */}}
{{- define "specdec.grpcProbes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
  {{- toYaml .probes.startup | nindent 2 }}
readinessProbe:
  grpc:
    port: {{ .port }}
  {{- toYaml .probes.readiness | nindent 2 }}
livenessProbe:
  grpc:
    port: {{ .port }}
  {{- toYaml .probes.liveness | nindent 2 }}
{{- end }}

{{/* Pod-level settings shared by the specdec components:
(dict "ctx" $ "values" .Values.target "component" "target" "tolerations" list) */}}
{{- define "specdec.podCommon" -}}
{{- $ctx := .ctx -}}
serviceAccountName: {{ include "specdec.serviceAccountName" $ctx }}
automountServiceAccountToken: false
{{- /* Service links would put e.g. SPECDEC_COORDINATOR_PORT=tcp://... into the environment, where
the services read SPECDEC_* settings. */}}
enableServiceLinks: false
{{- with $ctx.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml $ctx.Values.podSecurityContext | nindent 2 }}
{{- include "specdec.scheduling" . }}
{{- end }}

{{/* nodeSelector, tolerations, affinity, topologySpreadConstraints, priorityClassName. */}}
{{- define "specdec.scheduling" -}}
{{- $v := .values }}
{{- with $v.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $tolerations := concat ($v.tolerations | default list) (.tolerations | default list) }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if $v.topologySpreadConstraints }}
{{- $selector := fromYaml (include "specdec.selectorLabels" (dict "ctx" .ctx "component" .component)) }}
topologySpreadConstraints:
{{- range $v.topologySpreadConstraints }}
{{- $c := deepCopy . }}
{{- if not $c.labelSelector }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" $selector) }}
{{- end }}
  - {{- toYaml $c | nindent 4 }}
{{- end }}
{{- end }}
{{- end }}

{{/* Resources with the GPU count forced into limits: (dict "resources" ... "gpu" ... "count" N) */}}
{{- define "specdec.resources" -}}
{{- $res := deepCopy (.resources | default dict) }}
{{- if .gpu.enabled }}
{{- $limits := deepCopy ($res.limits | default dict) }}
{{- $_ := set $limits .gpu.resourceName (int .count) }}
{{- $_ := set $res "limits" $limits }}
{{- if $res.requests }}
{{- $requests := deepCopy $res.requests }}
{{- $_ := set $requests .gpu.resourceName (int .count) }}
{{- $_ := set $res "requests" $requests }}
{{- end }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{- define "specdec.gpuTolerations" -}}
- key: {{ .resourceName }}
  operator: Exists
  effect: NoSchedule
{{- end }}

{{/* Checks the schema cannot express. */}}
{{- define "specdec.validate" -}}
{{- $a := .Values.coordinator.autoscaling }}
{{- if and $a.enabled (lt (int $a.maxReplicas) (int $a.minReplicas)) }}
{{- fail (printf "coordinator.autoscaling.maxReplicas (%d) must be >= minReplicas (%d)" (int $a.maxReplicas) (int $a.minReplicas)) }}
{{- end }}
{{- end }}
