{{/* vim: set filetype=mustache: */}}

{{/* Chart name, overridable with nameOverride. */}}
{{- define "mossrt.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name (63 characters at most: some Kubernetes name fields are limited to that).
A release name that already contains the chart name is used as is.
*/}}
{{- define "mossrt.fullname" -}}
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

{{/* chart label value: name-version */}}
{{- define "mossrt.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Common labels. */}}
{{- define "mossrt.labels" -}}
helm.sh/chart: {{ include "mossrt.chart" . }}
{{ include "mossrt.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/component: tts-server
app.kubernetes.io/part-of: mossrt
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels (immutable on a Deployment: keep them minimal). */}}
{{- define "mossrt.selectorLabels" -}}
app.kubernetes.io/name: {{ include "mossrt.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* ServiceAccount name. */}}
{{- define "mossrt.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "mossrt.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Server image reference: the GPU image when gpu.enabled. */}}
{{- define "mossrt.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion | toString }}
{{- if .Values.gpu.enabled }}
{{- $repo := .Values.gpu.image.repository | default .Values.image.repository }}
{{- $gtag := .Values.gpu.image.tag | default (printf "%s-cuda" $tag) | toString }}
{{- printf "%s:%s" $repo $gtag }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* Pull policy matching mossrt.image. */}}
{{- define "mossrt.imagePullPolicy" -}}
{{- if .Values.gpu.enabled }}
{{- .Values.gpu.image.pullPolicy | default .Values.image.pullPolicy }}
{{- else }}
{{- .Values.image.pullPolicy }}
{{- end }}
{{- end }}

{{/* onnxruntime provider: explicit server.device, else cuda with a GPU, cpu without. */}}
{{- define "mossrt.device" -}}
{{- if .Values.server.device }}
{{- .Values.server.device }}
{{- else if .Values.gpu.enabled }}
{{- "cuda" }}
{{- else }}
{{- "cpu" }}
{{- end }}
{{- end }}

{{/* Name of the claim mounted at dataPath. */}}
{{- define "mossrt.claimName" -}}
{{- .Values.persistence.existingClaim | default (printf "%s-data" (include "mossrt.fullname" .)) }}
{{- end }}

{{/* Name of the Secret holding MOSSRT_API_KEYS; empty when there is none. */}}
{{- define "mossrt.apiKeysSecretName" -}}
{{- if .Values.existingSecret }}
{{- .Values.existingSecret }}
{{- else if .Values.apiKeys }}
{{- printf "%s-api-keys" (include "mossrt.fullname" .) }}
{{- end }}
{{- end }}

{{/* nginx variable for the session header: X-Session-Id -> $http_x_session_id */}}
{{- define "mossrt.sessionHeaderVar" -}}
{{- printf "$http_%s" (.Values.ingress.sessionHeader | lower | replace "-" "_") }}
{{- end }}

{{/* Label matcher of this release's metric series (ServiceMonitor labels: namespace, service). */}}
{{- define "mossrt.metricSelector" -}}
{{- if .Values.autoscaling.keda.metricSelector }}
{{- tpl .Values.autoscaling.keda.metricSelector . }}
{{- else }}
{{- printf "namespace=%q,service=%q" .Release.Namespace (include "mossrt.fullname" .) }}
{{- end }}
{{- end }}

{{/*
Validation of mutually exclusive or mandatory values; included from the Deployment so that
`helm lint` / `helm template` / `helm install` fail early with a clear message.
*/}}
{{- define "mossrt.validate" -}}
{{- if and .Values.export.enabled .Values.bundleImage.enabled }}
{{- fail "export.enabled and bundleImage.enabled are exclusive: pick one way to provide the bundle" }}
{{- end }}
{{- if and .Values.export.enabled (or (not .Values.export.model) (not .Values.export.codec)) }}
{{- fail "export.enabled needs export.model and export.codec (Hugging Face Hub ids or paths)" }}
{{- end }}
{{- if and .Values.bundleImage.enabled (not .Values.bundleImage.repository) }}
{{- fail "bundleImage.enabled needs bundleImage.repository" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (not (has .Values.autoscaling.kind (list "keda" "hpa"))) }}
{{- fail (printf "autoscaling.kind must be keda or hpa, not %q" .Values.autoscaling.kind) }}
{{- end }}
{{- if and .Values.ingress.enabled (not (has .Values.ingress.affinity (list "header" "cookie" "none"))) }}
{{- fail (printf "ingress.affinity must be header, cookie or none, not %q" .Values.ingress.affinity) }}
{{- end }}
{{- if and .Values.httpRoute.enabled (not .Values.httpRoute.parentRefs) }}
{{- fail "httpRoute.enabled needs httpRoute.parentRefs (the Gateway to attach to)" }}
{{- end }}
{{- if and .Values.podDisruptionBudget.enabled (not (kindIs "invalid" .Values.podDisruptionBudget.minAvailable)) (not (kindIs "invalid" .Values.podDisruptionBudget.maxUnavailable)) }}
{{- fail "podDisruptionBudget: set only one of minAvailable and maxUnavailable (null the other)" }}
{{- end }}
{{- if and .Values.podDisruptionBudget.enabled (kindIs "invalid" .Values.podDisruptionBudget.minAvailable) (kindIs "invalid" .Values.podDisruptionBudget.maxUnavailable) }}
{{- fail "podDisruptionBudget.enabled needs minAvailable or maxUnavailable" }}
{{- end }}
{{- if and .Values.export.enabled (not (hasPrefix (trimSuffix "/" .Values.dataPath | printf "%s/") (printf "%s/" .Values.bundlePath))) }}
{{- fail "with export.enabled, bundlePath must lie under dataPath (the export writes to the data volume)" }}
{{- end }}
{{- $drain := addf (float64 .Values.preStopSleepSeconds) (maxf (float64 .Values.server.drainTimeout) (float64 .Values.server.shutdownDelay)) 3 }}
{{- if lt (float64 .Values.terminationGracePeriodSeconds) $drain }}
{{- fail (printf "terminationGracePeriodSeconds (%v) is shorter than preStopSleepSeconds + max(server.drainTimeout, server.shutdownDelay) + 3 s of flush (%v): the pod would be killed while draining" .Values.terminationGracePeriodSeconds $drain) }}
{{- end }}
{{- if and .Values.wyoming.enabled (or .Values.apiKeys .Values.existingSecret) (not .Values.wyoming.allowKeylessRemote) (not (has .Values.server.host (list "127.0.0.1" "localhost" "::1"))) }}
{{- fail (printf "wyoming.enabled with API keys serves Wyoming, which has no authentication, on %s: set wyoming.allowKeylessRemote: true to say so (a keyless peer then reaches the built-in voices, free slots and wyoming.maxSessions connections; docs/wyoming.md)" .Values.server.host) }}
{{- end }}
{{- if not (hasPrefix (trimSuffix "/" .Values.dataPath | printf "%s/") (printf "%s/" .Values.voicesPath)) }}
{{- fail "voicesPath must lie under dataPath (the voices persist on the data volume)" }}
{{- end }}
{{- end }}
