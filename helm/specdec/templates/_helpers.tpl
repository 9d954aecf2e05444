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

{{/* The coordinator's --redis-url: redis://[:$(REDIS_PASSWORD)@]host:port/db, or with Sentinel
redis+sentinel://[:$(REDIS_PASSWORD)@]host:port,host:port,.../master-name/db (rediss for TLS).
$(REDIS_PASSWORD) is expanded by the kubelet from the env var defined just before REDIS_URL. */}}
{{- define "specdec.redisUrl" -}}
{{- $r := .Values.redis }}
{{- $auth := ternary ":$(REDIS_PASSWORD)@" "" (ne $r.auth.existingSecret "") }}
{{- $scheme := ternary "rediss" "redis" (and (eq $r.mode "external") $r.external.tls) }}
{{- if eq $r.mode "sentinel" }}
{{- $hosts := list }}
{{- range (include "specdec.redisPodAddresses" . | splitList " ") }}
{{- $hosts = append $hosts (printf "%s:%d" . (int $r.sentinel.port)) }}
{{- end }}
{{- printf "%s+sentinel://%s%s/%s/0" $scheme $auth (join "," $hosts) $r.sentinel.masterName }}
{{- else if and (eq $r.mode "external") $r.external.sentinel.hosts }}
{{- printf "%s+sentinel://%s%s/%s/%d" $scheme $auth (join "," $r.external.sentinel.hosts) $r.external.sentinel.masterName (int $r.external.db) }}
{{- else if eq $r.mode "external" }}
{{- printf "%s://%s%s:%d/%d" $scheme $auth $r.external.host (int $r.external.port) (int $r.external.db) }}
{{- else }}
{{- printf "redis://%s%s:%d/0" $auth (include "specdec.componentName" (dict "ctx" . "component" "redis")) (int $r.bundled.port) }}
{{- end }}
{{- end }}

{{/* "true" when the coordinator talks to Redis through Sentinels, else empty. */}}
{{- define "specdec.redisSentinel" -}}
{{- $r := .Values.redis }}
{{- if or (eq $r.mode "sentinel") (and (eq $r.mode "external") $r.external.sentinel.hosts) }}true{{ end }}
{{- end }}

{{/* The Redis pods of mode sentinel, space-separated, the first pod first: <pod>.<headless
Service>.<namespace>.svc, names that outlive the pods' IPs. */}}
{{- define "specdec.redisPodAddresses" -}}
{{- $name := include "specdec.componentName" (dict "ctx" . "component" "redis") }}
{{- $addresses := list }}
{{- range $i := until (int .Values.redis.sentinel.replicas) }}
{{- $addresses = append $addresses (printf "%s-%d.%s.%s.svc" $name $i $name $.Release.Namespace) }}
{{- end }}
{{- join " " $addresses }}
{{- end }}

{{/* --redis-wait-replicas: coordinator.redisWaitReplicas, or when null 1 with Sentinel, else 0. */}}
{{- define "specdec.redisWaitReplicas" -}}
{{- $n := .Values.coordinator.redisWaitReplicas }}
{{- if kindIs "invalid" $n }}{{ ternary 1 0 (eq (include "specdec.redisSentinel" .) "true") }}{{ else }}{{ int $n }}{{ end }}
{{- end }}

{{/* --redis-retry: coordinator.redisRetrySeconds, or when null 30 with Sentinel (a failover), else 5. */}}
{{- define "specdec.redisRetrySeconds" -}}
{{- $s := .Values.coordinator.redisRetrySeconds }}
{{- if kindIs "invalid" $s }}{{ ternary 30 5 (eq (include "specdec.redisSentinel" .) "true") }}{{ else }}{{ $s }}{{ end }}
{{- end }}

{{/* Bytes in a Redis memory size (800mb, 1gb, 1000000) or a Kubernetes quantity (1Gi, 800M);
empty when it is neither. (dict "value" "1Gi") */}}
{{- define "specdec.bytes" -}}
{{- $units := dict "" 1 "b" 1 "k" 1000 "kb" 1024 "m" 1000000 "mb" 1048576 "g" 1000000000 "gb" 1073741824 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "K" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 }}
{{- $value := toString .value }}
{{- $number := regexFind "^[0-9]+" $value }}
{{- $unit := trimPrefix $number $value }}
{{- if and $number (hasKey $units $unit) }}{{ mul (int64 $number) (get $units $unit) }}{{ end }}
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
- name: SPECDEC_LOG_FORMAT
  value: {{ .Values.logFormat | quote }}
{{- if .Values.models.hfToken.existingSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.models.hfToken.existingSecret }}
      key: {{ .Values.models.hfToken.key }}
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
    # "liveness" is SERVING while the process serves at all; "" (readiness) turns NOT_SERVING
    # when a dependency is gone, which should take the pod out of rotation, not restart it.
    service: liveness
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
{{- $tls := .Values.tls }}
{{- if and $tls.enabled (not $tls.public.existingSecret) (not $tls.internal.existingSecret) }}
{{- fail "tls.enabled needs tls.public.existingSecret (the coordinator's API) and/or tls.internal.existingSecret (mutual TLS to the workers)" }}
{{- end }}
{{- if and .Values.monitoring.serviceMonitor.enabled (not .Values.metrics.enabled) }}
{{- fail "monitoring.serviceMonitor.enabled needs metrics.enabled" }}
{{- end }}
{{- $lt := .Values.loadtest }}
{{- if $lt.enabled }}
{{- if include "specdec.publicTls" . }}
{{- fail "loadtest.enabled: the locust user speaks plaintext gRPC, the coordinator TLS (tls.public); turn one off" }}
{{- end }}
{{- if .Values.auth.existingSecret }}
{{- fail "loadtest.enabled: the locust user sends no bearer token, the coordinator requires one (auth.existingSecret); turn one off" }}
{{- end }}
{{- end }}
{{- include "specdec.validateRedis" . }}
{{- range $component := list "coordinator" "draft" "target" }}
{{- $v := index $.Values $component }}
{{- $ports := list (int $v.port) }}
{{- if $.Values.metrics.enabled }}{{ $ports = append $ports (int $.Values.metrics.port) }}{{ end }}
{{- $ports = append $ports (int $.Values.health.port) }}
{{- if ne (len $ports) (len (uniq $ports)) }}
{{- fail (printf "%s: its gRPC, metrics and health ports must differ, got %v" $component $ports) }}
{{- end }}
{{- end }}
{{- range $component := list "coordinator" "draft" "target" }}
{{- $v := index $.Values $component }}
{{- if not (kindIs "invalid" $v.terminationGracePeriodSeconds) }}
{{- $floor := addf $.Values.shutdown.preStopSleepSeconds $v.drainSeconds }}
{{- if le (float64 $v.terminationGracePeriodSeconds) $floor }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must exceed shutdown.preStopSleepSeconds + %s.drainSeconds (%v), or in-flight calls are killed; leave it null to derive it" $component $v.terminationGracePeriodSeconds $component $floor) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* Redis settings the schema cannot check. */}}
{{- define "specdec.validateRedis" -}}
{{- $r := .Values.redis }}
{{- $wait := int (include "specdec.redisWaitReplicas" .) }}
{{- if ne $r.mode "external" }}
{{- $b := $r.bundled }}
{{- $limit := dig "limits" "memory" "" ($b.resources | default dict) }}
{{- if $limit }}
{{- $max := include "specdec.bytes" (dict "value" $b.maxmemory) }}
{{- $limitBytes := include "specdec.bytes" (dict "value" $limit) }}
{{- if and $max $limitBytes (ge (int64 $max) (int64 $limitBytes)) }}
{{- fail (printf "redis.bundled.maxmemory (%s) must be below redis.bundled.resources.limits.memory (%s), or the kernel kills Redis before it refuses writes; about 80%% of it leaves room for rewrites and buffers" $b.maxmemory (toString $limit)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if eq $r.mode "bundled" }}
{{- if gt $wait 0 }}
{{- fail (printf "coordinator.redisWaitReplicas (%d) needs Redis replicas: the bundled Redis (redis.mode bundled) has none; use redis.mode sentinel" $wait) }}
{{- end }}
{{- else if eq $r.mode "sentinel" }}
{{- $s := $r.sentinel }}
{{- if not $r.bundled.appendonly }}
{{- fail "redis.mode sentinel needs redis.bundled.appendonly: a master that restarted empty before the Sentinels noticed would empty its replicas too" }}
{{- end }}
{{- if gt (int $s.quorum) (int $s.replicas) }}
{{- fail (printf "redis.sentinel.quorum (%d) must not exceed redis.sentinel.replicas (%d)" (int $s.quorum) (int $s.replicas)) }}
{{- end }}
{{- if ge $wait (int $s.replicas) }}
{{- fail (printf "coordinator.redisWaitReplicas (%d) must be below redis.sentinel.replicas (%d): the master is one of them" $wait (int $s.replicas)) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Where Secrets are mounted (read-only) in the specdec containers. */}}
{{- define "specdec.tlsPublicDir" -}}/etc/specdec/tls/public{{- end }}
{{- define "specdec.tlsInternalDir" -}}/etc/specdec/tls/internal{{- end }}
{{- define "specdec.authDir" -}}/etc/specdec/auth{{- end }}
{{- define "specdec.redisCaDir" -}}/etc/specdec/redis-tls{{- end }}

{{/* "true" when the coordinator's public port speaks TLS, else empty. */}}
{{- define "specdec.publicTls" -}}
{{- if and .Values.tls.enabled .Values.tls.public.existingSecret }}true{{ end }}
{{- end }}

{{/* "true" when coordinator and workers talk mutual TLS, else empty. */}}
{{- define "specdec.internalTls" -}}
{{- if and .Values.tls.enabled .Values.tls.internal.existingSecret }}true{{ end }}
{{- end }}

{{/* "true" when the component's gRPC port speaks TLS: (dict "ctx" $ "component" "draft") */}}
{{- define "specdec.serverTls" -}}
{{- if eq .component "coordinator" }}{{ include "specdec.publicTls" .ctx }}{{ else }}{{ include "specdec.internalTls" .ctx }}{{ end }}
{{- end }}

{{/* The port the probes use: always the plaintext health port, served by its own threads, so
that no load on (or slow client of) the gRPC port can starve a probe; Kubernetes' gRPC probes
cannot speak TLS anyway. (dict "ctx" $ "component" "draft" "port" 50051) */}}
{{- define "specdec.probePort" -}}
{{ .ctx.Values.health.port }}
{{- end }}

{{/* Flags every specdec server gets: drain, metrics and its own TLS.
(dict "ctx" $ "component" "draft" "values" .Values.draft) */}}
{{- define "specdec.serverArgs" -}}
{{- $ctx := .ctx }}
- --drain-seconds={{ .values.drainSeconds }}
{{- if $ctx.Values.metrics.enabled }}
- --metrics-port={{ $ctx.Values.metrics.port }}
{{- end }}
{{- if include "specdec.serverTls" . }}
{{- $dir := ternary (include "specdec.tlsPublicDir" $ctx) (include "specdec.tlsInternalDir" $ctx) (eq .component "coordinator") }}
- --tls-cert={{ $dir }}/tls.crt
- --tls-key={{ $dir }}/tls.key
{{- if ne .component "coordinator" }}
- --tls-client-ca={{ $dir }}/ca.crt
{{- end }}
{{- end }}
- --health-port={{ $ctx.Values.health.port }}
{{- end }}

{{/* Container ports besides grpc: metrics and health. (dict "ctx" $ "component" "draft") */}}
{{- define "specdec.extraPorts" -}}
{{- if .ctx.Values.metrics.enabled }}
- name: metrics
  containerPort: {{ .ctx.Values.metrics.port }}
  protocol: TCP
{{- end }}
- name: health
  containerPort: {{ .ctx.Values.health.port }}
  protocol: TCP
{{- end }}

{{/* The metrics Service port. */}}
{{- define "specdec.metricsServicePort" -}}
{{- if .Values.metrics.enabled }}
- name: metrics
  port: {{ .Values.metrics.port }}
  targetPort: metrics
  protocol: TCP
{{- end }}
{{- end }}

{{/* Secret mounts of a specdec container: (dict "ctx" $ "component" "coordinator") */}}
{{- define "specdec.secretVolumeMounts" -}}
{{- $ctx := .ctx }}
{{- if and (eq .component "coordinator") (include "specdec.publicTls" $ctx) }}
- name: tls-public
  mountPath: {{ include "specdec.tlsPublicDir" $ctx }}
  readOnly: true
{{- end }}
{{- if include "specdec.internalTls" $ctx }}
- name: tls-internal
  mountPath: {{ include "specdec.tlsInternalDir" $ctx }}
  readOnly: true
{{- end }}
{{- if eq .component "coordinator" }}
{{- if $ctx.Values.auth.existingSecret }}
- name: auth-tokens
  mountPath: {{ include "specdec.authDir" $ctx }}
  readOnly: true
{{- end }}
{{- if include "specdec.redisTlsCa" $ctx }}
- name: redis-tls-ca
  mountPath: {{ include "specdec.redisCaDir" $ctx }}
  readOnly: true
{{- end }}
{{- end }}
{{- end }}

{{/* The Secret volumes behind specdec.secretVolumeMounts; each key is projected to a fixed file
name, so a missing key stops the pod from starting with a clear event. */}}
{{- define "specdec.secretVolumes" -}}
{{- $ctx := .ctx }}
{{- if and (eq .component "coordinator") (include "specdec.publicTls" $ctx) }}
- name: tls-public
  secret:
    secretName: {{ $ctx.Values.tls.public.existingSecret }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- if include "specdec.internalTls" $ctx }}
- name: tls-internal
  secret:
    secretName: {{ $ctx.Values.tls.internal.existingSecret }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- if eq .component "coordinator" }}
{{- with $ctx.Values.auth.existingSecret }}
- name: auth-tokens
  secret:
    secretName: {{ . }}
    defaultMode: 0440
    items:
      - {key: {{ $ctx.Values.auth.key | quote }}, path: tokens}
{{- end }}
{{- if include "specdec.redisTlsCa" $ctx }}
- name: redis-tls-ca
  secret:
    secretName: {{ $ctx.Values.redis.external.tlsCA.existingSecret }}
    defaultMode: 0440
    items:
      - {key: {{ $ctx.Values.redis.external.tlsCA.key | quote }}, path: ca.crt}
{{- end }}
{{- end }}
{{- end }}

{{/* "true" when the coordinator checks an external Redis' certificate against a CA from a Secret. */}}
{{- define "specdec.redisTlsCa" -}}
{{- $r := .Values.redis }}
{{- if and (eq $r.mode "external") $r.external.tls $r.external.tlsCA.existingSecret }}true{{ end }}
{{- end }}

{{/* Graceful shutdown of a specdec pod: (dict "ctx" $ "values" .Values.draft)
terminationGracePeriodSeconds (derived unless set) and the container's preStop sleep. */}}
{{- define "specdec.terminationGracePeriod" -}}
{{- $v := .values }}
{{- $s := .ctx.Values.shutdown }}
{{- if kindIs "invalid" $v.terminationGracePeriodSeconds }}
{{- add (int $s.preStopSleepSeconds) (int (ceil $v.drainSeconds)) (int $s.marginSeconds) }}
{{- else }}
{{- int $v.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{- define "specdec.lifecycle" -}}
{{- with int .Values.shutdown.preStopSleepSeconds }}
lifecycle:
  preStop:
    exec:
      command: [sleep, {{ . | quote }}]
{{- end }}
{{- end }}

{{/* The workers' KV-tier flags (none when kvStore is off). */}}
{{- define "specdec.kvStoreArgs" -}}
{{- $k := .Values.kvStore }}
{{- if $k.enabled }}
{{- $url := $k.url | default (printf "redis://%s:%v/0" (include "specdec.componentName" (dict "ctx" . "component" "kvstore")) $k.bundled.port) }}
- --kv-store-url={{ $url }}
- --kv-chunk-tokens={{ $k.chunkTokens }}
- --kv-compression={{ $k.compression }}
- --kv-max-pending-mb={{ $k.maxPendingMb }}
{{- end }}
{{- end }}
