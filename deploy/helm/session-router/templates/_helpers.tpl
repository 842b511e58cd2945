{{/* The chart's name, within Kubernetes' 63 characters. */}}
{{- define "session-router.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's resources' name. */}}
{{- define "session-router.fullname" -}}
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

{{- define "session-router.selectorLabels" -}}
app.kubernetes.io/name: {{ include "session-router.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "session-router.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "session-router.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: router
{{- end }}

{{- define "session-router.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "session-router.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The namespace of the worker pods discovery watches. */}}
{{- define "session-router.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.discovery.namespace }}
{{- end }}

{{/* Exactly one source of the Redis URL, or a clear failure. */}}
{{- define "session-router.redisSource" -}}
{{- $sources := 0 }}
{{- if .Values.redis.url }}{{ $sources = add1 $sources }}{{ end }}
{{- if .Values.redis.urlSecret.name }}{{ $sources = add1 $sources }}{{ end }}
{{- if .Values.redis.enabled }}{{ $sources = add1 $sources }}{{ end }}
{{- if ne $sources 1 }}
{{- fail "session-router: give exactly one of redis.url, redis.urlSecret.name or redis.enabled=true (the routers' replicas share state in one Redis)" }}
{{- end }}
{{- end }}

{{/* The router's TOML configuration: the user's keys, then those the chart owns. */}}
{{- define "session-router.config" -}}
{{- $config := deepCopy .Values.config }}
{{- $_ := set $config "host" "0.0.0.0" }}
{{- $_ := set $config "port" (int .Values.containerPort) }}
{{- if not $config.workers }}
{{- $_ := unset $config "workers" }}
{{- end }}
{{- if ne .Values.discovery.mode "static" }}
{{- if not .Values.discovery.selector }}
{{- fail "session-router: discovery.mode kubernetes needs discovery.selector (the worker pods' labels)" }}
{{- end }}
{{- $_ := set $config "discovery" .Values.discovery.mode }}
{{- $_ := set $config "discovery_namespace" (include "session-router.discoveryNamespace" .) }}
{{- $_ := set $config "discovery_selector" .Values.discovery.selector }}
{{- $_ := set $config "discovery_port" (int .Values.discovery.port) }}
{{- $_ := set $config "discovery_role" .Values.discovery.role }}
{{- $_ := set $config "discovery_engine" .Values.discovery.engine }}
{{- else if not .Values.config.workers }}
{{- fail "session-router: discovery.mode static needs config.workers (a list of {url, role, engine})" }}
{{- end }}
{{- if .Values.otel.enabled }}
{{- $_ := set $config "otel" true }}
{{- end }}
{{- toToml $config }}
{{- end }}
